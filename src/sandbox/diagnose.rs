//! What a sandbox failure means, in words: bwrap's own lines turned into one
//! line that names the cause and the fix ([`diagnose`]), from what this host
//! and this process have ([`HostFacts`]). Pure but for [`HostFacts::read`]; the
//! start-up preflight and a script whose sandbox was never made both say it
//! so, and neither enters the other.

use std::path::Path;

/// Every line this module says starts so, for those who grep for it.
pub const UNAVAILABLE: &str = "sandbox unavailable:";

/// What a diagnosis depends on, as this host and this process have it (None:
/// absent or unreadable). Read once by [`HostFacts::read`]; the rules in
/// [`diagnose`] only look at it, so tests give any host they like.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostFacts {
    pub max_user_namespaces: Option<u64>,
    pub unprivileged_userns_clone: Option<u64>,
    /// Ubuntu's `kernel.apparmor_restrict_unprivileged_userns` (Debian's kernels
    /// have no such sysctl).
    pub apparmor_restrict_userns: Option<u64>,
    /// AppArmor is enabled in the kernel.
    pub apparmor_enabled: bool,
    /// This process's AppArmor label, e.g. `scriptgated (enforce)`, `unconfined`.
    pub apparmor_label: Option<String>,
    /// Whether the profile `scriptgated` is loaded (None: the list is unreadable).
    pub scriptgated_profile: Option<bool>,
    /// A loaded, enforcing profile that confines bwrap's user namespaces: one
    /// named for bwrap (Ubuntu's `bwrap-userns-restrict`, a `/usr/bin/bwrap`
    /// profile) or an enforcing `unprivileged_userns` (Debian ships it in
    /// complain mode), other than scriptgate's own.
    pub bwrap_profile: Option<String>,
    /// The systemd unit this process runs in, when it was started as one.
    pub unit: Option<String>,
    /// The container manager's name (`/run/systemd/container`, `$container`).
    pub container: Option<String>,
    /// Mount points below /proc (not /proc itself, nor the permanently empty
    /// binfmt_misc directory), as `/proc/self/mountinfo` lists them.
    pub proc_overmounts: Vec<String>,
}

impl HostFacts {
    /// This host's and this process's facts.
    pub fn read() -> HostFacts {
        let text = |p: &str| std::fs::read_to_string(p).ok();
        let num = |p: &str| text(p)?.trim().parse().ok();
        let apparmor_enabled =
            text("/sys/module/apparmor/parameters/enabled").is_some_and(|v| v.trim() == "Y");
        // AppArmor's own attribute only (attr/current is the major LSM's: an
        // SELinux context on Fedora).
        let label = text("/proc/self/attr/apparmor/current")
            .filter(|_| apparmor_enabled)
            .map(|l| l.trim_end_matches(['\n', '\0']).to_string())
            .filter(|l| !l.is_empty());
        let profiles = text("/sys/kernel/security/apparmor/profiles");
        // A unit's main process: systemd 248 and later set SYSTEMD_EXEC_PID to it
        // (INVOCATION_ID alone is inherited by everything below a service). Its
        // unit is the last part of its cgroup path (`0::/system.slice/x.service`).
        let unit = std::env::var("SYSTEMD_EXEC_PID")
            .ok()
            .filter(|p| p.trim() == std::process::id().to_string())
            .and_then(|_| {
                let c = text("/proc/self/cgroup")?;
                unit_of_cgroup(&c).map(str::to_string)
            });
        let exists = |p: &str| Path::new(p).exists();
        let container = text("/run/systemd/container")
            .or_else(|| std::env::var("container").ok())
            .map(|c| c.trim().to_string())
            .filter(|c| !c.is_empty())
            .or_else(|| exists("/.dockerenv").then(|| "docker".to_string()))
            .or_else(|| exists("/run/.containerenv").then(|| "podman".to_string()))
            .or_else(|| {
                label
                    .as_deref()
                    .and_then(container_label)
                    .map(str::to_string)
            });
        HostFacts {
            max_user_namespaces: num("/proc/sys/user/max_user_namespaces"),
            unprivileged_userns_clone: num("/proc/sys/kernel/unprivileged_userns_clone"),
            apparmor_restrict_userns: num("/proc/sys/kernel/apparmor_restrict_unprivileged_userns"),
            apparmor_enabled,
            apparmor_label: label,
            scriptgated_profile: profiles
                .as_deref()
                .map(|p| loaded_profiles(p).any(|(name, _)| name == "scriptgated")),
            bwrap_profile: profiles.as_deref().and_then(bwrap_profile),
            unit,
            container,
            proc_overmounts: text("/proc/self/mountinfo")
                .map(|m| proc_overmounts(&m))
                .unwrap_or_default(),
        }
    }

    /// The daemon runs under scriptgate's own profile (or a stack with it).
    fn in_our_profile(&self) -> bool {
        self.apparmor_label
            .as_deref()
            .is_some_and(|l| l.starts_with("scriptgated"))
    }
}

/// A container runtime's AppArmor label (Docker's, Podman's, LXC's).
fn container_label(label: &str) -> Option<&str> {
    let name = label.split(' ').next()?;
    ["docker-default", "containers-default", "lxc-"]
        .iter()
        .any(|p| name.starts_with(p))
        .then_some(name)
}

/// The (name, mode) pairs of AppArmor's `profiles` list (`NAME (MODE)` lines).
fn loaded_profiles(profiles: &str) -> impl Iterator<Item = (&str, &str)> {
    profiles.lines().filter_map(|l| l.rsplit_once(' '))
}

/// The first enforcing profile of a `profiles` list that confines bwrap's user
/// namespaces, scriptgate's own aside.
fn bwrap_profile(profiles: &str) -> Option<String> {
    loaded_profiles(profiles).find_map(|(name, mode)| {
        let confines = name.contains("bwrap") || name == "unprivileged_userns";
        (mode == "(enforce)" && confines && !name.starts_with("scriptgated"))
            .then(|| name.to_string())
    })
}

/// The unit of a `/proc/self/cgroup` text: the last `.service` or `.scope` part
/// of its cgroup v2 (or systemd v1) path.
fn unit_of_cgroup(cgroup: &str) -> Option<&str> {
    cgroup
        .lines()
        .filter_map(|l| l.splitn(3, ':').nth(2))
        .flat_map(|path| path.rsplit('/'))
        .find(|part| part.ends_with(".service") || part.ends_with(".scope"))
}

/// Mount points below /proc in a mountinfo text (field 5), but the permanently
/// empty `/proc/sys/fs/binfmt_misc`, which the kernel does not count.
pub fn proc_overmounts(mountinfo: &str) -> Vec<String> {
    let mut v: Vec<String> = mountinfo
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .filter(|m| m.starts_with("/proc/") && *m != "/proc/sys/fs/binfmt_misc")
        .map(str::to_string)
        .collect();
    v.sort();
    v.dedup();
    v
}

/// The unit options that mount over parts of /proc, by the path they cover.
const UNIT_PROC_MOUNTS: [(&str, &str); 5] = [
    ("/proc/kmsg", "ProtectKernelLogs=yes"),
    ("/proc/sys", "ProtectKernelTunables=yes"),
    ("/proc/sysrq-trigger", "ProtectKernelTunables=yes"),
    ("/proc/sys/kernel/hostname", "ProtectHostname=yes"),
    ("/proc/sys/kernel/domainname", "ProtectHostname=yes"),
];

/// Why bwrap could not make a sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    /// Ubuntu ≥ 23.10: the user namespace is made, but AppArmor's
    /// `unprivileged_userns` profile takes every capability in it, so bwrap cannot
    /// set up loopback (`--unshare-net`) or write its uid map.
    AppArmor,
    /// `clone(CLONE_NEWUSER)` gave ENOSPC with `user.max_user_namespaces = 0`.
    UsernsOff,
    /// ENOSPC otherwise: the count or the nesting depth (32) is used up.
    UsernsExhausted,
    /// EPERM with Debian's `kernel.unprivileged_userns_clone = 0`.
    UnprivilegedCloneOff,
    /// EPERM otherwise: a seccomp profile (a container's), a chroot, or another policy.
    UsernsRefused,
    /// EINVAL: a kernel without CONFIG_USER_NS.
    NoUserns,
    /// The kernel refused a new /proc: the host's /proc has hidden or read-only
    /// parts (a container's masked paths), so no proc is "fully visible".
    ProcRefused,
    /// The same, because the daemon's own unit mounts over parts of /proc
    /// (`ProtectKernelLogs=yes`, `ProtectHostname=yes`).
    UnitProcMounts,
    /// A seccomp filter answers a system call bwrap needs with ENOSYS: a unit's
    /// `RestrictSUIDSGID=yes` (openat2), or an old container seccomp profile.
    SyscallFiltered,
    /// `--disable-userns` could not write `/proc/sys/user/max_user_namespaces`.
    ProcSysReadOnly,
    /// This bwrap does not know `--disable-userns` (before 0.8.0).
    NoDisableUserns,
    /// Any other failure of bwrap before the script ran.
    Other,
}

impl Cause {
    /// Failures of `--disable-userns` alone: the sandbox works without it.
    pub fn only_disable_userns(self) -> bool {
        matches!(self, Cause::ProcSysReadOnly | Cause::NoDisableUserns)
    }
}

/// A sandbox failure explained: its cause and the one line that says it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Diagnosis {
    pub cause: Cause,
    pub line: String,
}

/// bwrap's own lines (`bwrap: …`, or `<3>bwrap: …` with --level-prefix) in `stderr`.
pub fn bwrap_lines(stderr: &str) -> Vec<&str> {
    stderr
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with("bwrap: ") || l.starts_with("<3>bwrap: "))
        .collect()
}

/// What a rule looks at: bwrap's words and this host's facts.
struct Seen<'a> {
    stderr: &'a str,
    facts: &'a HostFacts,
}

impl Seen<'_> {
    fn has(&self, s: &str) -> bool {
        self.stderr.contains(s)
    }

    /// bwrap had its user namespace, but no capability in it.
    fn caps_taken(&self) -> bool {
        self.has("loopback: Failed RTM_NEWADDR: Operation not permitted")
            || self.has("setting up uid map: Permission denied")
            || self.has("setting up gid map: Permission denied")
            || self.has("loopback: Failed RTM_NEWLINK: Operation not permitted")
    }

    fn no_perm(&self) -> bool {
        self.has("No permissions to create")
    }

    /// AppArmor refuses user namespaces to programs it does not let have them:
    /// Ubuntu's sysctl, or an enforcing profile that confines bwrap. Where one
    /// of them is there, the daemon is not in our profile, no container is in
    /// the way and Debian's own sysctl does not say no, a refusal is AppArmor's.
    fn apparmor_refuses(&self) -> bool {
        let f = self.facts;
        f.apparmor_enabled
            && f.container.is_none()
            && !f.in_our_profile()
            && f.unprivileged_userns_clone != Some(0)
            && (f.apparmor_restrict_userns == Some(1) || f.bwrap_profile.is_some())
    }

    fn enosys(&self) -> bool {
        self.has(": Function not implemented")
    }

    fn userns_enospc(&self) -> bool {
        self.has("Creating new namespace failed")
            && (self.has("ENOSPC") || self.has("No space left on device"))
    }

    fn proc_refused(&self) -> bool {
        self.has("Can't mount proc on")
    }

    /// The unit the daemon runs in, outside a container.
    fn in_unit(&self) -> Option<&str> {
        let f = self.facts;
        f.container.is_none().then_some(f.unit.as_deref()).flatten()
    }

    /// That unit, or the packaged one's name.
    fn unit(&self) -> &str {
        self.in_unit().unwrap_or("scriptgate.service")
    }

    /// The options of the daemon's unit that mount over the parts of /proc
    /// that are covered, each once.
    fn proc_by_unit(&self) -> Vec<&'static str> {
        UNIT_PROC_MOUNTS
            .iter()
            .filter(|(path, _)| self.facts.proc_overmounts.iter().any(|m| m == path))
            .map(|(_, option)| *option)
            .fold(vec![], |mut v, o| {
                if !v.contains(&o) {
                    v.push(o)
                }
                v
            })
    }

    /// The parts of /proc that are mounted over.
    fn covered(&self) -> String {
        self.facts.proc_overmounts.join(", ")
    }
}

/// One rule of [`RULES`]: where `pattern` holds, the failure is `cause`, said
/// by `what`, and `fix` says what to do.
struct Rule {
    pattern: fn(&Seen) -> bool,
    cause: Cause,
    what: fn(&Seen) -> String,
    fix: fn(&Seen) -> String,
}

/// The rules in their order: the first whose pattern holds decides. Texts
/// from bubblewrap's source (bubblewrap.c, network.c; 0.8 to 0.12): `die()`
/// and `die_with_error()` print "bwrap: MESSAGE" and "bwrap: MESSAGE:
/// strerror", then exit 1.
static RULES: [Rule; 16] = [
    Rule {
        pattern: |s| s.caps_taken() || (s.no_perm() && s.apparmor_refuses()),
        cause: Cause::AppArmor,
        what: apparmor_what,
        fix: apparmor_fix,
    },
    Rule {
        pattern: |s| s.enosys() && s.facts.container.is_some(),
        cause: Cause::SyscallFiltered,
        what: |s| {
            format!("the container's seccomp profile answers a system call bwrap needs with ENOSYS (bubblewrap 0.12, built without its fallback as Debian 13 does, opens files with openat2, which older profiles do not know; container: {})", s.facts.container.as_deref().unwrap_or("?"))
        },
        fix: |_| {
            "fix: a container runtime or seccomp profile that knows openat2 (Docker 20.10.0 and later, Podman 3 and later)".into()
        },
    },
    Rule {
        pattern: |s| s.enosys() && s.in_unit().is_some(),
        cause: Cause::SyscallFiltered,
        what: |s| {
            format!("a seccomp filter of {} answers a system call bwrap needs with ENOSYS: most likely RestrictSUIDSGID=yes, whose filter cannot inspect openat2() and refuses it, and bubblewrap 0.12 as Debian 13 builds it opens files with openat2 only", s.unit())
        },
        fix: |s| {
            format!("fix: `systemctl edit {unit}`, add `[Service]` and `RestrictSUIDSGID=no` (the packaged unit leaves it off), then `systemctl restart {unit}`", unit = s.unit())
        },
    },
    Rule {
        pattern: |s| s.enosys(),
        cause: Cause::SyscallFiltered,
        what: |_| {
            "a seccomp filter scriptgated inherited answers a system call bwrap needs with ENOSYS (bubblewrap 0.12 opens files with openat2 only; a filter that cannot inspect it refuses it)".into()
        },
        fix: |_| {
            "fix: start scriptgated without that filter (a service manager's or a sandbox's), or with a bubblewrap built with its fallback".into()
        },
    },
    Rule {
        pattern: |s| {
            s.has("cannot open /proc/sys/user/max_user_namespaces")
                || s.has("sysctl user.max_user_namespaces = 1")
        },
        cause: Cause::ProcSysReadOnly,
        what: |_| {
            "/proc/sys is read-only here (a container), so bwrap --disable-userns cannot set user.max_user_namespaces".into()
        },
        fix: |_| {
            "fix: restart scriptgated; its preflight then runs the sandbox without --disable-userns, and the seccomp filter refuses new namespaces".into()
        },
    },
    Rule {
        pattern: |s| s.has("Unknown option --disable-userns"),
        cause: Cause::NoDisableUserns,
        what: |_| "this bwrap does not know --disable-userns (bubblewrap before 0.8.0)".into(),
        fix: |_| {
            "fix: install bubblewrap 0.8.0 or later, or restart scriptgated; its preflight then does without the flag".into()
        },
    },
    Rule {
        pattern: |s| s.userns_enospc() && s.facts.max_user_namespaces == Some(0),
        cause: Cause::UsernsOff,
        what: |_| "user namespaces are switched off (user.max_user_namespaces=0)".into(),
        fix: |_| sysctl_fix("user.max_user_namespaces", "15000"),
    },
    Rule {
        pattern: |s| s.userns_enospc(),
        cause: Cause::UsernsExhausted,
        what: |s| {
            format!(
            "no more user namespaces may be made here (user.max_user_namespaces{} is used up, or 32 levels of nesting are reached)",
            s.facts.max_user_namespaces.map(|n| format!("={n}")).unwrap_or_default()
        )
        },
        fix: |_| {
            "fix: raise user.max_user_namespaces with `sysctl -w` (and in /etc/sysctl.d/), or run scriptgated in a less deeply nested container".into()
        },
    },
    Rule {
        pattern: |s| s.no_perm() && s.facts.unprivileged_userns_clone == Some(0),
        cause: Cause::UnprivilegedCloneOff,
        what: |_| {
            "unprivileged user namespaces are switched off (kernel.unprivileged_userns_clone=0)"
                .into()
        },
        fix: |_| sysctl_fix("kernel.unprivileged_userns_clone", "1"),
    },
    Rule {
        pattern: |s| s.no_perm(),
        cause: Cause::UsernsRefused,
        what: |_| {
            "a security policy refuses the sandbox its user namespace (in a container: its seccomp profile, as Docker's default one does; or scriptgated runs in a chroot)".into()
        },
        fix: |_| {
            "fix: let the container make user namespaces (Docker, Podman: a seccomp profile that allows clone and unshare of user namespaces; LXC, Incus: security.nesting=true), or run scriptgated outside the chroot".into()
        },
    },
    Rule {
        pattern: |s| s.has("kernel does not support user namespaces"),
        cause: Cause::NoUserns,
        what: |_| "this kernel has no user namespaces (CONFIG_USER_NS)".into(),
        fix: |_| "fix: boot a kernel built with user namespaces".into(),
    },
    Rule {
        pattern: |s| s.proc_refused() && !s.proc_by_unit().is_empty() && s.in_unit().is_some(),
        cause: Cause::UnitProcMounts,
        what: |s| {
            format!("the kernel refuses the sandbox a /proc of its own, because {} mounts over parts of this /proc ({}: {})", s.unit(), s.covered(), s.proc_by_unit().join(", "))
        },
        fix: |s| {
            format!("fix: `systemctl edit {unit}`, add `[Service]` and {} (the packaged unit leaves them off), then `systemctl restart {unit}`", s.proc_by_unit().iter().map(|o| format!("`{}no`", o.trim_end_matches("yes"))).collect::<Vec<_>>().join(" and "), unit = s.unit())
        },
    },
    Rule {
        pattern: |s| s.proc_refused() && s.in_unit().is_some() && !s.covered().is_empty(),
        cause: Cause::UnitProcMounts,
        what: |s| {
            format!("the kernel refuses the sandbox a /proc of its own, because something mounts over parts of this /proc ({}): {} or a drop-in of it", s.covered(), s.unit())
        },
        fix: |s| {
            format!("fix: see `systemctl cat {unit}` for the options that mount over /proc (ProtectKernelTunables=, ProtectKernelLogs=, ProtectHostname=, ProtectProc=), turn them off in a drop-in, then `systemctl restart {unit}`", unit = s.unit())
        },
    },
    Rule {
        pattern: |s| s.proc_refused() && (s.facts.container.is_some() || !s.covered().is_empty()),
        cause: Cause::ProcRefused,
        what: |s| {
            format!("the kernel refuses the sandbox a /proc of its own, because parts of this /proc are hidden or read-only ({}a container's masked /proc paths)", if s.covered().is_empty() { String::new() } else { format!("mounts over {}; ", s.covered()) })
        },
        fix: |_| {
            "fix: give the container an unmasked /proc (Docker, Podman: --security-opt systempaths=unconfined; LXC: lxc.mount.auto = proc:rw)".into()
        },
    },
    Rule {
        pattern: |s| s.proc_refused(),
        cause: Cause::ProcRefused,
        what: |_| {
            "the kernel refuses the sandbox a /proc of its own: this /proc hides processes or parts of itself (mounted with hidepid= or subset=pid, as a unit's ProtectProc= or ProcSubset= does)".into()
        },
        fix: |s| {
            format!("fix: mount /proc without hidepid= and subset= for scriptgated, and leave ProtectProc= and ProcSubset= off in {}", s.unit())
        },
    },
    Rule {
        pattern: |_| true,
        cause: Cause::Other,
        what: |_| "bwrap failed before the script ran".into(),
        fix: |_| "fix: see bwrap's own words, which follow".into(),
    },
];

fn sysctl_fix(key: &str, value: &str) -> String {
    format!("fix: `sysctl -w {key}={value}`, and keep it in a file in /etc/sysctl.d/")
}

fn apparmor_what(s: &Seen) -> String {
    let f = s.facts;
    let label = match (&f.apparmor_label, &f.bwrap_profile) {
        (Some(l), _) if !f.in_our_profile() => {
            format!("; scriptgated runs as `{l}`, not under its profile scriptgated")
        }
        (_, Some(p)) => format!("; the profile `{p}` confines bwrap"),
        _ => String::new(),
    };
    format!("AppArmor denies the sandbox its user namespace (kernel.apparmor_restrict_unprivileged_userns=1, the default since Ubuntu 23.10, or a profile confining bwrap){label}")
}

fn apparmor_fix(s: &Seen) -> String {
    if s.facts.in_our_profile() {
        "fix: reload scriptgate's profile (`apparmor_parser -r /etc/apparmor.d/scriptgated`), check `aa-status`, and see the apparmor=\"DENIED\" lines of `journalctl -k`".into()
    } else if s.facts.scriptgated_profile == Some(true) {
        "fix: start scriptgated through scriptgate.service, which enters the profile (AppArmorProfile=-scriptgated); a daemon started by hand stays unconfined".into()
    } else {
        "fix: load the profile scriptgate ships, `apparmor_parser -r /etc/apparmor.d/scriptgated`, then restart scriptgated".into()
    }
}

/// The index in [`RULES`] of the rule that decides a failure.
fn rule_for(seen: &Seen) -> usize {
    RULES
        .iter()
        .position(|r| (r.pattern)(seen))
        .unwrap_or(RULES.len() - 1)
}

/// The one line for a bwrap failure: the first rule of [`RULES`] whose
/// pattern holds for `stderr` (what bwrap printed) on a host with `facts`.
pub fn diagnose(stderr: &str, facts: &HostFacts) -> Diagnosis {
    let seen = Seen { stderr, facts };
    let rule = &RULES[rule_for(&seen)];
    Diagnosis {
        cause: rule.cause,
        line: format!(
            "{UNAVAILABLE} {}; {}",
            (rule.what)(&seen),
            (rule.fix)(&seen)
        ),
    }
}

/// The error of a script whose sandbox was never made: the diagnosis, then
/// bwrap's own words. None when bwrap said nothing (the failure was elsewhere).
pub fn explain(stderr_tail: &str, facts: &HostFacts) -> Option<String> {
    let lines = bwrap_lines(stderr_tail);
    if lines.is_empty() {
        return None;
    }
    let raw = lines.join("\n");
    Some(format!("{}\n{raw}", diagnose(&raw, facts).line))
}

/// The refusal when `sandbox.require_enforced_limits` is on and they are not.
pub fn limits_refusal(problems: &[String]) -> String {
    format!(
        "limits not enforced: {}; scripts are refused because sandbox.require_enforced_limits = true \
         (fix: give scriptgated a backend whose cgroups it can write, see scriptgated(8), or set it to false)",
        problems.join("; ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each row of the table, in order, with a failure it decides: the row
    /// that decides is that row (no earlier one takes it), and its cause.
    #[test]
    fn the_rules_are_walked_row_by_row() {
        let base = facts();
        let ubuntu = HostFacts {
            apparmor_enabled: true,
            apparmor_restrict_userns: Some(1),
            ..facts()
        };
        let docker = HostFacts {
            container: Some("docker".into()),
            ..facts()
        };
        let unit = HostFacts {
            unit: Some("scriptgate.service".into()),
            ..facts()
        };
        let unit_kmsg = HostFacts {
            proc_overmounts: vec!["/proc/kmsg".into()],
            ..unit.clone()
        };
        let unit_other = HostFacts {
            proc_overmounts: vec!["/proc/acpi".into()],
            ..unit.clone()
        };
        let off = HostFacts {
            max_user_namespaces: Some(0),
            ..facts()
        };
        let clone_off = HostFacts {
            unprivileged_userns_clone: Some(0),
            ..facts()
        };
        let enosys = "bwrap: Failed to make / slave: Function not implemented";
        let no_perm = "bwrap: No permissions to create new namespace";
        let enospc = "bwrap: Creating new namespace failed: No space left on device";
        let proc = "bwrap: Can't mount proc on /newroot/proc: Operation not permitted";
        let rows: [(&str, &HostFacts); 16] = [
            (no_perm, &ubuntu),
            (enosys, &docker),
            (enosys, &unit),
            (enosys, &base),
            ("bwrap: cannot open /proc/sys/user/max_user_namespaces: Read-only file system", &base),
            ("bwrap: Unknown option --disable-userns", &base),
            (enospc, &off),
            (enospc, &base),
            (no_perm, &clone_off),
            (no_perm, &base),
            ("bwrap: Creating new namespace failed, likely because the kernel does not support user namespaces.", &base),
            (proc, &unit_kmsg),
            (proc, &unit_other),
            (proc, &docker),
            (proc, &base),
            ("bwrap: execvp python3: No such file or directory", &base),
        ];
        assert_eq!(rows.len(), RULES.len());
        for (i, (stderr, facts)) in rows.into_iter().enumerate() {
            let seen = Seen { stderr, facts };
            assert_eq!(rule_for(&seen), i, "row {i}: {stderr}");
            let d = diagnose(stderr, facts);
            assert_eq!(d.cause, RULES[i].cause, "row {i}");
            assert!(d.line.starts_with(UNAVAILABLE), "row {i}: {}", d.line);
            assert!(d.line.contains("; fix: "), "row {i}: {}", d.line);
        }
    }

    fn facts() -> HostFacts {
        HostFacts {
            max_user_namespaces: Some(15000),
            ..HostFacts::default()
        }
    }

    /// bwrap's real texts (bubblewrap.c, network.c; 0.8 to 0.11), and the cause
    /// each one gets.
    #[test]
    fn each_bwrap_failure_gets_its_cause_and_fix() {
        let off = HostFacts {
            max_user_namespaces: Some(0),
            ..facts()
        };
        let clone_off = HostFacts {
            unprivileged_userns_clone: Some(0),
            ..facts()
        };
        let plain = facts();
        // Debian 13's packaged unit before the fix: systemd 257, bubblewrap 0.12.
        let unit = HostFacts {
            unit: Some("scriptgate.service".into()),
            apparmor_enabled: true,
            apparmor_label: Some("scriptgated (enforce)".into()),
            scriptgated_profile: Some(true),
            proc_overmounts: vec![
                "/proc/kmsg".into(),
                "/proc/sys/kernel/domainname".into(),
                "/proc/sys/kernel/hostname".into(),
            ],
            ..facts()
        };
        let docker = HostFacts {
            container: Some("docker".into()),
            apparmor_enabled: true,
            apparmor_label: Some("docker-default (enforce)".into()),
            proc_overmounts: vec!["/proc/kcore".into(), "/proc/keys".into()],
            ..facts()
        };
        // Debian 13 with bwrap confined by a restricting profile and scriptgated's
        // own profile not loaded (the daemon unconfined): Ubuntu's case.
        let unconfined = HostFacts {
            apparmor_enabled: true,
            apparmor_label: Some("unconfined".into()),
            scriptgated_profile: Some(false),
            bwrap_profile: Some("bwrap-sim".into()),
            ..facts()
        };
        // Debian 12: AppArmor on, no scriptgated profile (AppArmor 3), nothing
        // confining bwrap: a refusal there is not AppArmor's.
        let bookworm = HostFacts {
            apparmor_enabled: true,
            apparmor_label: Some("unconfined".into()),
            scriptgated_profile: Some(false),
            ..facts()
        };
        let bookworm_clone_off = HostFacts {
            unprivileged_userns_clone: Some(0),
            ..bookworm.clone()
        };
        // systemd-nspawn: the packaged unit inside, a FIFO over /proc/kmsg and a
        // read-only /proc/sys from the container.
        let nspawn = HostFacts {
            container: Some("systemd-nspawn".into()),
            proc_overmounts: vec!["/proc/kmsg".into(), "/proc/sys".into()],
            ..unit.clone()
        };
        let tunables = HostFacts {
            proc_overmounts: vec!["/proc/sys".into(), "/proc/sysrq-trigger".into()],
            ..unit.clone()
        };
        let odd_mount = HostFacts {
            proc_overmounts: vec!["/proc/acpi".into()],
            ..unit.clone()
        };
        // Docker on Ubuntu 24.04: the sysctl is visible, the label Docker's.
        let docker_on_ubuntu = HostFacts {
            apparmor_restrict_userns: Some(1),
            ..docker.clone()
        };
        let ubuntu_by_hand = HostFacts {
            apparmor_restrict_userns: Some(1),
            scriptgated_profile: Some(true),
            ..unconfined.clone()
        };
        let no_perm = "bwrap: No permissions to create a new namespace, likely because the kernel does not allow non-privileged user namespaces. On e.g. debian this can be enabled with 'sysctl kernel.unprivileged_userns_clone=1'.";
        let table: Vec<(&str, &HostFacts, Cause, &str)> = vec![
            ("bwrap: Can't open source /usr: Function not implemented", &unit, Cause::SyscallFiltered, "`RestrictSUIDSGID=no`"),
            ("bwrap: Can't open source /usr: Function not implemented", &docker, Cause::SyscallFiltered, "knows openat2"),
            ("bwrap: Can't mount proc on /newroot/proc: Operation not permitted", &unit, Cause::UnitProcMounts, "`ProtectKernelLogs=no` and `ProtectHostname=no`"),
            ("bwrap: Can't mount proc on /newroot/proc: Operation not permitted", &docker, Cause::ProcRefused, "systempaths=unconfined"),
            (no_perm, &unconfined, Cause::AppArmor, "apparmor_parser -r /etc/apparmor.d/scriptgated"),
            (no_perm, &ubuntu_by_hand, Cause::AppArmor, "through scriptgate.service"),
            (no_perm, &docker, Cause::UsernsRefused, "seccomp profile"),
            (no_perm, &docker_on_ubuntu, Cause::UsernsRefused, "seccomp profile"),
            (no_perm, &bookworm, Cause::UsernsRefused, "seccomp profile"),
            (no_perm, &bookworm_clone_off, Cause::UnprivilegedCloneOff, "kernel.unprivileged_userns_clone=1"),
            ("bwrap: Can't mount proc on /newroot/proc: Operation not permitted", &nspawn, Cause::ProcRefused, "systempaths=unconfined"),
            ("bwrap: Can't open source /usr: Function not implemented", &nspawn, Cause::SyscallFiltered, "container"),
            ("bwrap: Can't mount proc on /newroot/proc: Operation not permitted", &tunables, Cause::UnitProcMounts, "`ProtectKernelTunables=no`"),
            ("bwrap: Can't mount proc on /newroot/proc: Operation not permitted", &odd_mount, Cause::UnitProcMounts, "systemctl cat scriptgate.service"),
            ("bwrap: Can't open source /usr: Function not implemented", &plain, Cause::SyscallFiltered, "a seccomp filter scriptgated inherited"),
            ("bwrap: loopback: Failed RTM_NEWADDR: Operation not permitted", &plain, Cause::AppArmor, "apparmor_parser -r /etc/apparmor.d/scriptgated"),
            ("bwrap: setting up uid map: Permission denied", &plain, Cause::AppArmor, "kernel.apparmor_restrict_unprivileged_userns=1"),
            ("bwrap: Creating new namespace failed: nesting depth or /proc/sys/user/max_*_namespaces exceeded (ENOSPC)", &off, Cause::UsernsOff, "sysctl -w user.max_user_namespaces=15000"),
            ("bwrap: Creating new namespace failed: No space left on device", &off, Cause::UsernsOff, "user.max_user_namespaces=0"),
            ("bwrap: Creating new namespace failed: nesting depth or /proc/sys/user/max_*_namespaces exceeded (ENOSPC)", &plain, Cause::UsernsExhausted, "32 levels"),
            ("bwrap: No permissions to create a new namespace, likely because the kernel does not allow non-privileged user namespaces. On e.g. debian this can be enabled with 'sysctl kernel.unprivileged_userns_clone=1'.", &clone_off, Cause::UnprivilegedCloneOff, "sysctl -w kernel.unprivileged_userns_clone=1"),
            ("bwrap: No permissions to create new namespace, likely because the kernel does not allow non-privileged user namespaces. On e.g. debian this can be enabled with 'sysctl kernel.unprivileged_userns_clone=1'.", &plain, Cause::UsernsRefused, "seccomp profile"),
            ("bwrap: Creating new namespace failed, likely because the kernel does not support user namespaces.  bwrap must be installed setuid on such systems.", &plain, Cause::NoUserns, "CONFIG_USER_NS"),
            ("bwrap: Can't mount proc on /newroot/proc: Operation not permitted", &plain, Cause::ProcRefused, "hidepid="),
            ("bwrap: cannot open /proc/sys/user/max_user_namespaces: Read-only file system", &plain, Cause::ProcSysReadOnly, "without --disable-userns"),
            ("bwrap: Unknown option --disable-userns", &plain, Cause::NoDisableUserns, "0.8.0"),
            ("bwrap: execvp /nope/python3: No such file or directory", &plain, Cause::Other, "bwrap's own words"),
        ];
        for (stderr, f, cause, needle) in table {
            let d = diagnose(stderr, f);
            assert_eq!(d.cause, cause, "{stderr}");
            assert!(d.line.starts_with(UNAVAILABLE), "{}", d.line);
            assert!(d.line.contains("; fix: "), "names a fix: {}", d.line);
            assert!(d.line.contains(needle), "{stderr}: {}", d.line);
            assert!(!d.line.contains('\n'), "one line: {}", d.line);
        }
    }

    #[test]
    fn the_unit_and_its_proc_mounts_are_read_from_the_process() {
        assert_eq!(
            unit_of_cgroup("0::/system.slice/scriptgate.service\n"),
            Some("scriptgate.service")
        );
        assert_eq!(
            unit_of_cgroup("12:pids:/x\n1:name=systemd:/system.slice/a.service/sub\n0::/\n"),
            Some("a.service")
        );
        assert_eq!(unit_of_cgroup("0::/\n"), None);
        let mountinfo = "22 1 0:5 / /proc rw,nosuid - proc proc rw
30 22 0:6 / /proc/sys/fs/binfmt_misc rw - autofs systemd-1 rw
41 22 0:40 / /proc/kmsg ro - tmpfs tmpfs ro
42 22 0:5 /sys/kernel/hostname /proc/sys/kernel/hostname ro - proc proc rw
43 1 0:41 / /tmp rw - tmpfs tmpfs rw
";
        assert_eq!(
            proc_overmounts(mountinfo),
            ["/proc/kmsg", "/proc/sys/kernel/hostname"]
        );
        // The AppArmor label is "ours" for the profile and a stack on it.
        let ours = HostFacts {
            apparmor_label: Some("scriptgated//&scriptgated_bwrap (enforce)".into()),
            ..HostFacts::default()
        };
        assert!(ours.in_our_profile());
        assert!(!HostFacts::default().in_our_profile());
        assert_eq!(
            container_label("docker-default (enforce)"),
            Some("docker-default")
        );
        assert_eq!(container_label("unconfined"), None);
        let profiles =
            "scriptgated_bwrap (enforce)\nunprivileged_userns (complain)\nbwrap-sim (enforce)\n";
        assert_eq!(bwrap_profile(profiles).as_deref(), Some("bwrap-sim"));
        assert_eq!(
            bwrap_profile("unprivileged_userns (complain)\nscriptgated (enforce)\n"),
            None
        );
        assert_eq!(
            bwrap_profile("unprivileged_userns (enforce)\n").as_deref(),
            Some("unprivileged_userns")
        );
    }

    #[test]
    fn a_script_error_puts_the_diagnosis_before_bwraps_words() {
        let e = explain(
            "bwrap: loopback: Failed RTM_NEWADDR: Operation not permitted\n",
            &facts(),
        )
        .unwrap();
        let (first, rest) = e.split_once('\n').unwrap();
        assert!(
            first.starts_with("sandbox unavailable: AppArmor"),
            "{first}"
        );
        assert_eq!(
            rest,
            "bwrap: loopback: Failed RTM_NEWADDR: Operation not permitted"
        );
        assert_eq!(
            explain("Traceback (most recent call last):\nValueError", &facts()),
            None
        );
    }

    #[test]
    fn only_disable_userns_failures_fall_back() {
        let fallback: Vec<Cause> = [
            "bwrap: cannot open /proc/sys/user/max_user_namespaces: Read-only file system",
            "bwrap: Unknown option --disable-userns",
            "bwrap: setting up uid map: Permission denied",
            "bwrap: Can't mount proc on /newroot/proc: Operation not permitted",
        ]
        .iter()
        .map(|s| diagnose(s, &facts()).cause)
        .filter(|c| c.only_disable_userns())
        .collect();
        assert_eq!(fallback, [Cause::ProcSysReadOnly, Cause::NoDisableUserns]);
    }
}
