//! The start-up preflight, owned by the daemon (`Daemon::new` runs it once;
//! `daemon.info`, the start-up line and `script.start` read its result).
//!
//! - The sandbox: bwrap is run once, as the uid scripts run as, with the
//!   namespaces, flags and seccomp program of a real sandbox (`sandbox::probe_args`).
//!   Where it cannot make its namespaces (Ubuntu's AppArmor restriction, a sysctl,
//!   a container), [`diagnose`](crate::sandbox::diagnose::diagnose) turns bwrap's
//!   words into one line that names the cause and the fix. Where only `--disable-userns` fails (a read-only
//!   `/proc/sys`, as containers mount it; a bwrap older than 0.8), the sandbox runs
//!   without it and the seccomp filter alone refuses new namespaces.
//! - The limits: one process is placed in a unit of the chosen backend with the
//!   configured limits, and the limits are read back from the cgroups it is in.
//!
//! The probes run the real launcher; the words are `sandbox::diagnose`'s.

use crate::limits::{Backend, Enforcement};
use crate::policy::Limits;
use crate::protocol::SandboxInfo;
use crate::sandbox::abi::FD_SECCOMP;
use crate::sandbox::diagnose::{
    bwrap_lines, diagnose, limits_refusal, Cause, HostFacts, UNAVAILABLE,
};
use crate::sandbox::{probe_args, RealHost};
use crate::sys::{
    channel_pipe, dup_high, install_cloexec_above_fixed, install_pre_exec, wait_child, ChildSetup,
    Identity, PidFd, Spawner,
};
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;
use tokio::io::AsyncReadExt;

/// How long a probe may take before start-up goes on without its answer.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(10);

/// What the sandbox preflight found; `daemon.info`'s `sandbox`.
#[derive(Debug, Clone, PartialEq)]
pub struct SandboxCheck {
    pub info: SandboxInfo,
    /// Whether scripts' sandboxes get `--disable-userns`.
    pub disable_userns: bool,
}

impl SandboxCheck {
    fn new(
        state: &str,
        disable_userns: bool,
        problem: Option<String>,
        detail: Option<String>,
    ) -> Self {
        SandboxCheck {
            info: SandboxInfo {
                state: state.into(),
                nested_userns: if disable_userns {
                    "disable-userns"
                } else {
                    "seccomp"
                }
                .into(),
                problem,
                detail,
            },
            disable_userns,
        }
    }

    /// The start-up line's part: `sandbox ok (...)` or the diagnosis.
    pub fn summary(&self) -> String {
        let i = &self.info;
        let how = if self.disable_userns {
            "nested user namespaces: bwrap --disable-userns and the seccomp filter"
        } else {
            "nested user namespaces: the seccomp filter alone, as --disable-userns cannot be used here"
        };
        match (i.state.as_str(), &i.problem) {
            ("ok", _) => format!("sandbox ok ({how})"),
            ("unchecked", Some(p)) => format!("sandbox not checked: {p}"),
            (_, Some(p)) => match &i.detail {
                Some(d) => format!("{p} (bwrap said: {})", d.replace('\n', " / ")),
                None => p.clone(),
            },
            _ => format!("sandbox not checked ({how})"),
        }
    }
}

/// How one probe ended.
struct ProbeRun {
    ok: bool,
    stderr: String,
    /// Why it could not be run or waited for.
    failed: Option<String>,
}

/// Run bwrap once as `identity` with the probe's argv.
async fn probe_once(
    spawner: &Spawner,
    bwrap: &Path,
    python: &Path,
    identity: Option<Identity>,
    disable_userns: bool,
) -> ProbeRun {
    let failed = |why: String| ProbeRun {
        ok: false,
        stderr: String::new(),
        failed: Some(why),
    };
    let setup = || -> std::io::Result<_> {
        let seccomp_r = crate::sandbox::seccomp::in_a_pipe()?;
        let (err_r, err_w) = channel_pipe()?;
        Ok((dup_high(&seccomp_r)?, err_r, err_w))
    };
    let (seccomp_fd, err_r, err_w) = match setup() {
        Ok(x) => x,
        Err(e) => return failed(format!("cannot set up the probe: {e}")),
    };
    let mut cmd = std::process::Command::new(bwrap);
    cmd.env_clear()
        .args(probe_args(python, disable_userns, &RealHost))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::from(err_w));
    install_pre_exec(
        &mut cmd,
        ChildSetup {
            identity,
            rlimits: vec![(libc::RLIMIT_CORE, 0)],
            dups: vec![(std::os::fd::AsRawFd::as_raw_fd(&seccomp_fd), FD_SECCOMP)],
            parent_pid: std::process::id() as libc::pid_t,
        },
    );
    install_cloexec_above_fixed(&mut cmd);
    let child = match spawner.spawn(cmd).await {
        Ok(c) => c,
        Err(e) => {
            return ProbeRun {
                ok: false,
                stderr: String::new(),
                failed: Some(format!(
                    "{UNAVAILABLE} sandbox.bwrap = {} cannot be run ({e}); fix: install bubblewrap, or set sandbox.bwrap to its path",
                    bwrap.display()
                )),
            }
        }
    };
    drop(seccomp_fd);
    let pid = child.id() as i32;
    let pidfd = PidFd::open_as(pid, identity);
    let exited = wait_child(pid);
    let read_err = async {
        let mut buf = Vec::new();
        if let Ok(mut r) = tokio::net::unix::pipe::Receiver::from_owned_fd(err_r) {
            let mut chunk = [0u8; 1024];
            while buf.len() < 8192 {
                match r.read(&mut chunk).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => buf.extend_from_slice(&chunk[..n]),
                }
            }
        }
        String::from_utf8_lossy(&buf).into_owned()
    };
    match tokio::time::timeout(PROBE_TIMEOUT, async { tokio::join!(exited, read_err) }).await {
        Ok((Ok(Ok(exit)), stderr)) => ProbeRun {
            ok: exit.code == Some(0),
            stderr,
            failed: None,
        },
        Ok((_, stderr)) => ProbeRun {
            ok: false,
            stderr,
            failed: Some("the probe's exit status was lost".into()),
        },
        Err(_) => {
            if let Ok(p) = pidfd {
                let _ = p.kill();
            }
            failed(format!(
                "the sandbox probe did not end within {} s",
                PROBE_TIMEOUT.as_secs()
            ))
        }
    }
}

/// The sandbox preflight: with `--disable-userns`, and without it when only that
/// flag fails.
pub async fn check_sandbox(
    spawner: &Spawner,
    bwrap: &Path,
    python: &Path,
    identity: Option<Identity>,
) -> SandboxCheck {
    let facts = HostFacts::read();
    let first = probe_once(spawner, bwrap, python, identity, true).await;
    if first.ok {
        return SandboxCheck::new("ok", true, None, None);
    }
    let judged = |run: &ProbeRun, disable_userns: bool| -> SandboxCheck {
        if let Some(why) = &run.failed {
            let state = if why.starts_with(UNAVAILABLE) {
                "unavailable"
            } else {
                "unchecked"
            };
            let detail = (!run.stderr.trim().is_empty()).then(|| run.stderr.trim().to_string());
            return SandboxCheck::new(state, disable_userns, Some(why.clone()), detail);
        }
        let lines = bwrap_lines(&run.stderr);
        let raw = if lines.is_empty() {
            run.stderr.trim().to_string()
        } else {
            lines.join("\n")
        };
        let d = diagnose(&raw, &facts);
        let detail = (!raw.is_empty()).then_some(raw);
        SandboxCheck::new("unavailable", disable_userns, Some(d.line), detail)
    };
    let verdict = judged(&first, true);
    let cause = first
        .failed
        .is_none()
        .then(|| diagnose(&first.stderr, &facts).cause);
    if !cause.is_some_and(Cause::only_disable_userns) {
        return verdict;
    }
    let second = probe_once(spawner, bwrap, python, identity, false).await;
    if second.ok {
        SandboxCheck::new("ok", false, None, None)
    } else {
        judged(&second, false)
    }
}

/// The limits preflight: a placeholder process (as the script uid) placed in a
/// unit of `backend` with `limits`, the limits read back, the unit let go.
pub async fn check_limits(
    spawner: &Spawner,
    backend: &Backend,
    limits: &Limits,
    identity: Option<Identity>,
) -> Enforcement {
    if matches!(backend, Backend::Rlimit) {
        return Enforcement::default();
    }
    let cannot = |why: String| Enforcement {
        problems: vec![format!("limits cannot be checked: {why}")],
        notes: vec![],
    };
    // A placeholder that ends with the daemon, however it ends (a `sleep`
    // would outlive a daemon killed with SIGKILL, in its unit).
    let (child, lifeline) = match crate::sys::placeholder(identity) {
        Ok((cmd, lifeline)) => match spawner.spawn(cmd).await {
            Ok(c) => (c, lifeline),
            Err(e) => return cannot(format!("the placeholder process: {e}")),
        },
        Err(e) => return cannot(format!("the placeholder's pipe: {e}")),
    };
    let pid = child.id();
    let pidfd = PidFd::open_as(pid as i32, identity);
    let exited = wait_child(pid as i32);
    let id = format!("preflight-{}", std::process::id());
    let placed = backend.place(&id, limits, &[pid]).await;
    let verdict = match &placed {
        Ok(_) => backend.verify(&id, pid, limits),
        Err(e) => cannot(format!(
            "cannot place a process in a {} unit: {e}",
            backend.kind().as_str()
        )),
    };
    if let Ok(p) = &pidfd {
        let _ = p.kill();
    }
    drop(lifeline);
    let _ = exited.await;
    if let Ok(placement) = placed {
        placement.finish().await;
    }
    verdict
}

/// What the start-up preflight found.
#[derive(Debug, Clone)]
pub struct Preflight {
    pub sandbox: SandboxCheck,
    pub limits: Enforcement,
}

/// The identity the probes run as: `sandbox.run_as` as the daemon resolves it
/// for root's scripts (None: this process's own), or why it cannot be taken.
fn script_identity(cfg: &crate::config::Config) -> Result<Option<Identity>, String> {
    let (uid, gid) = (
        nix::unistd::Uid::effective().as_raw(),
        nix::unistd::Gid::effective().as_raw(),
    );
    crate::sys::resolve_run_as(uid, gid, &cfg.sandbox.run_as)
        .map(|id| (id.uid != uid).then_some(id))
        .map_err(|e| format!("the preflight cannot take the script uid: {e}"))
}

impl Preflight {
    /// Probe the sandbox and the limits as the uid a root engine's scripts run as
    /// (`sandbox.run_as`), or as the daemon's own uid when it is not root.
    /// The sandbox alone, probed as the daemon would at start (as the
    /// `sandbox.run_as` uid): `scriptgated --check`.
    pub async fn sandbox_only(spawner: &Spawner, cfg: &crate::config::Config) -> SandboxCheck {
        match script_identity(cfg) {
            Ok(identity) => {
                check_sandbox(spawner, &cfg.sandbox.bwrap, &cfg.scripts.python, identity).await
            }
            Err(why) => SandboxCheck::new("unchecked", true, Some(why), None),
        }
    }

    pub async fn run(
        spawner: &Spawner,
        cfg: &crate::config::Config,
        backend: &Backend,
    ) -> Preflight {
        let identity = match script_identity(cfg) {
            Ok(identity) => identity,
            Err(why) => {
                return Preflight {
                    sandbox: SandboxCheck::new("unchecked", true, Some(why.clone()), None),
                    limits: Enforcement {
                        problems: vec![format!("limits cannot be checked: {why}")],
                        notes: vec![],
                    },
                };
            }
        };
        let limits = Limits::effective(&cfg.scripts, &Default::default());
        Preflight {
            sandbox: check_sandbox(spawner, &cfg.sandbox.bwrap, &cfg.scripts.python, identity)
                .await,
            limits: check_limits(spawner, backend, &limits, identity).await,
        }
    }

    /// `script.start` is refused when `sandbox.require_enforced_limits` is on and
    /// the preflight found the limits not in force.
    pub fn refuse_unenforced(
        &self,
        cfg: &crate::config::Config,
    ) -> Result<(), crate::protocol::refusal::Refused> {
        use crate::protocol::refusal::{Reason, Refused};
        if cfg.sandbox.require_enforced_limits && !self.limits.enforced() {
            return Err(Refused::new(
                Reason::LimitsNotEnforced,
                limits_refusal(&self.limits.problems),
            ));
        }
        Ok(())
    }

    /// The start-up line's words after the backend: the limits, then the sandbox.
    pub fn summary(&self) -> String {
        let limits = if self.limits.enforced() {
            "limits in force".to_string()
        } else {
            format!("LIMITS NOT ENFORCED: {}", self.limits.problems.join("; "))
        };
        format!("{limits}; {}", self.sandbox.summary())
    }

    /// No script can run: the sandbox cannot be made, or the limits that
    /// `sandbox.require_enforced_limits` requires are not in force.
    pub fn blocks_scripts(&self, require_enforced_limits: bool) -> bool {
        self.sandbox.info.state == "unavailable"
            || (require_enforced_limits && !self.limits.enforced())
    }

    /// Whether the start-up line must be a warning.
    pub fn loud(&self) -> bool {
        !self.limits.enforced() || self.sandbox.info.state != "ok" || !self.limits.notes.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summaries() {
        assert!(SandboxCheck::new("ok", true, None, None)
            .summary()
            .starts_with("sandbox ok (nested user namespaces: bwrap --disable-userns"));
        assert!(SandboxCheck::new("ok", false, None, None)
            .summary()
            .contains("the seccomp filter alone"));
        let bad = SandboxCheck::new(
            "unavailable",
            true,
            Some("sandbox unavailable: x; fix: y".into()),
            Some("bwrap: a\nbwrap: b".into()),
        );
        assert_eq!(
            bad.summary(),
            "sandbox unavailable: x; fix: y (bwrap said: bwrap: a / bwrap: b)"
        );
        assert_eq!(bad.info.nested_userns, "disable-userns");
    }
}
