//! The bubblewrap sandbox. `bwrap_args` is pure: it turns a spec into bwrap's argv
//! (unit-tested below); the spawn itself lives in `sys`, the privileged seam.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// Where the embedded `agent_tools.py` is mounted inside the sandbox.
pub const RUNTIME_MOUNT: &str = "/run/scriptgate";

/// The fixed descriptors the sandbox child gets. 3 and 4 are the tool channel
/// (protocol §8) and reach the script; 5, 7, 8 and 9 are read by bwrap itself
/// (8 and 9 are the workspace and its `.agent`, opened once by the daemon and
/// bound by descriptor, never by path; bwrap closes them); 6 is the placement
/// gate, closed before bwrap runs.
pub const FD_REQUESTS: i32 = 3;
pub const FD_REPLIES: i32 = 4;
pub const FD_INFO: i32 = 5;
pub const FD_GATE: i32 = 6;
pub const FD_SECCOMP: i32 = 7;
pub const FD_WORKSPACE: i32 = 8;
pub const FD_AGENT: i32 = 9;

/// Host directories mounted read-only when they exist (symlinks are recreated as
/// symlinks, so merged-/usr systems get `/lib -> usr/lib`).
const SYSTEM_DIRS: &[&str] = &[
    "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
];

/// The few files of `/etc` a Python needs; the rest of `/etc` stays out.
const ETC_FILES: &[&str] = &[
    "/etc/ld.so.cache",
    "/etc/localtime",
    "/etc/nsswitch.conf",
    "/etc/passwd",
    "/etc/group",
    "/etc/mime.types",
    "/etc/ssl/certs/ca-certificates.crt",
];

#[derive(Debug, Clone)]
pub struct SandboxSpec {
    /// The workspace's path: where the directory open at `FD_WORKSPACE` is mounted,
    /// and the working directory.
    pub workspace: PathBuf,
    pub read_only: bool,
    /// Host directory holding `agent_tools.py` (mounted read-only at RUNTIME_MOUNT).
    pub runtime_dir: PathBuf,
    /// The interpreter (`scripts.python`).
    pub python: PathBuf,
    /// The script to run, inside the workspace's `.agent` tree.
    pub script: PathBuf,
    /// Size of the private `/tmp`.
    pub tmp_size_bytes: u64,
}

/// What a host path is, as far as the sandbox layout cares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry {
    Missing,
    Plain,
    Symlink(PathBuf),
}

/// What exists on the host, so that `bwrap_args` stays pure.
pub trait HostView {
    fn entry(&self, path: &Path) -> Entry;
}

pub struct RealHost;

impl HostView for RealHost {
    fn entry(&self, path: &Path) -> Entry {
        match std::fs::symlink_metadata(path) {
            Err(_) => Entry::Missing,
            Ok(m) if m.file_type().is_symlink() => match std::fs::read_link(path) {
                Ok(t) => Entry::Symlink(t),
                Err(_) => Entry::Missing,
            },
            Ok(_) => Entry::Plain,
        }
    }
}

fn push(args: &mut Vec<OsString>, items: &[&dyn AsRef<std::ffi::OsStr>]) {
    args.extend(items.iter().map(|s| s.as_ref().to_os_string()));
}

/// bwrap's argv (without the program name). The order matters: later mounts cover
/// earlier ones, so the workspace comes after the system dirs and `.agent` is
/// remounted read-only over the workspace last.
pub fn bwrap_args(spec: &SandboxSpec, host: &dyn HostView) -> Vec<OsString> {
    let mut a: Vec<OsString> = Vec::new();
    // Namespaces: all of them (no network, not even loopback to the host), and an
    // explicit user namespace so that --disable-userns can forbid nested ones.
    push(
        &mut a,
        &[&"--unshare-all", &"--unshare-user", &"--disable-userns"],
    );
    // The sandbox dies with its supervisor, has no controlling terminal (no TIOCSTI)
    // and no capabilities, and sees only the environment set below.
    push(
        &mut a,
        &[
            &"--die-with-parent",
            &"--new-session",
            &"--cap-drop",
            &"ALL",
            &"--clearenv",
        ],
    );
    // bwrap writes {"child-pid": N}, the sandbox's PID 1, so the supervisor can
    // kill the whole namespace even before --die-with-parent is armed.
    push(&mut a, &[&"--info-fd", &FD_INFO.to_string()]);
    for dir in SYSTEM_DIRS {
        match host.entry(Path::new(dir)) {
            Entry::Symlink(target) => push(&mut a, &[&"--symlink", &target, dir]),
            Entry::Plain => push(&mut a, &[&"--ro-bind", dir, dir]),
            Entry::Missing => {}
        }
    }
    for f in ETC_FILES {
        // A symlinked file (e.g. /etc/localtime) is bound as its target's content.
        if host.entry(Path::new(f)) != Entry::Missing {
            push(&mut a, &[&"--ro-bind", f, f]);
        }
    }
    // An interpreter outside the system dirs (a venv, /opt/python) brings its prefix.
    if !SYSTEM_DIRS.iter().any(|d| spec.python.starts_with(d)) {
        if let Some(prefix) = spec.python.parent().and_then(Path::parent) {
            push(&mut a, &[&"--ro-bind", &prefix, &prefix]);
        }
    }
    push(&mut a, &[&"--proc", &"/proc", &"--dev", &"/dev"]);
    push(
        &mut a,
        &[
            &"--size",
            &spec.tmp_size_bytes.to_string(),
            &"--tmpfs",
            &"/tmp",
        ],
    );
    push(&mut a, &[&"--ro-bind", &spec.runtime_dir, &RUNTIME_MOUNT]);
    // The workspace and its `.agent` come as descriptors the daemon opened without
    // following symlinks: what is mounted is what was checked.
    let ws = &spec.workspace;
    let agent = ws.join(".agent");
    let bind = if spec.read_only {
        "--ro-bind-fd"
    } else {
        "--bind-fd"
    };
    push(&mut a, &[&bind, &FD_WORKSPACE.to_string(), ws]);
    push(&mut a, &[&"--ro-bind-fd", &FD_AGENT.to_string(), &agent]);
    // The root tmpfs bwrap builds the tree on goes read-only: writable are only the
    // workspace (unless read-only) and the private /tmp.
    push(&mut a, &[&"--remount-ro", &"/"]);
    push(&mut a, &[&"--chdir", ws]);
    for (k, v) in [
        ("PATH", "/usr/local/bin:/usr/bin:/bin"),
        ("HOME", "/tmp"),
        ("TMPDIR", "/tmp"),
        ("LANG", "C.UTF-8"),
        ("PYTHONPATH", RUNTIME_MOUNT),
        ("PYTHONDONTWRITEBYTECODE", "1"),
        ("PYTHONIOENCODING", "utf-8"),
        ("PYTHONUNBUFFERED", "1"),
    ] {
        push(&mut a, &[&"--setenv", &k, &v]);
    }
    // The seccomp program (see `seccomp`), loaded just before the script's exec.
    push(&mut a, &[&"--seccomp", &FD_SECCOMP.to_string()]);
    // -s: no user site-packages; -B: no .pyc writes. PYTHONPATH is ours alone
    // because the environment was cleared.
    push(&mut a, &[&"--", &spec.python, &"-s", &"-B", &spec.script]);
    a
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    struct FakeHost(HashMap<&'static str, Option<&'static str>>);
    impl HostView for FakeHost {
        fn entry(&self, path: &Path) -> Entry {
            match self.0.get(path.to_str().unwrap()) {
                None => Entry::Missing,
                Some(None) => Entry::Plain,
                Some(Some(t)) => Entry::Symlink(t.into()),
            }
        }
    }

    fn spec(read_only: bool) -> SandboxSpec {
        SandboxSpec {
            workspace: "/srv/ws/run-42".into(),
            read_only,
            runtime_dir: "/var/lib/scriptgate/runtime".into(),
            python: "/usr/bin/python3".into(),
            script: "/srv/ws/run-42/.agent/scripts/abc/script.py".into(),
            tmp_size_bytes: 1 << 20,
        }
    }

    fn argv(read_only: bool) -> Vec<String> {
        let host = FakeHost(HashMap::from([
            ("/usr", None),
            ("/lib", Some("usr/lib")),
            ("/bin", Some("usr/bin")),
            ("/etc/passwd", None),
        ]));
        bwrap_args(&spec(read_only), &host)
            .into_iter()
            .map(|s| s.into_string().unwrap())
            .collect()
    }

    fn has(a: &[String], seq: &[&str]) -> bool {
        a.windows(seq.len()).any(|w| w == seq)
    }

    #[test]
    fn isolation_flags_are_present() {
        let a = argv(false);
        for f in [
            "--unshare-all",
            "--unshare-user",
            "--disable-userns",
            "--die-with-parent",
            "--new-session",
            "--clearenv",
        ] {
            assert!(a.contains(&f.to_string()), "{f} missing");
        }
        assert!(has(&a, &["--cap-drop", "ALL"]));
        assert!(has(&a, &["--ro-bind", "/usr", "/usr"]));
        assert!(has(&a, &["--symlink", "usr/lib", "/lib"]));
        assert!(!a.iter().any(|s| s == "/lib64"), "absent dirs are skipped");
        assert!(has(&a, &["--ro-bind", "/etc/passwd", "/etc/passwd"]));
        assert!(!a.iter().any(|s| s == "/etc/ld.so.cache"));
        assert!(has(&a, &["--size", "1048576", "--tmpfs", "/tmp"]));
        assert!(has(&a, &["--chdir", "/srv/ws/run-42"]));
        assert!(has(&a, &["--remount-ro", "/"]));
        assert!(has(&a, &["--info-fd", "5"]));
        assert!(has(&a, &["--seccomp", "7"]));
        assert_eq!(
            &a[a.len() - 5..],
            [
                "--",
                "/usr/bin/python3",
                "-s",
                "-B",
                "/srv/ws/run-42/.agent/scripts/abc/script.py"
            ]
        );
    }

    #[test]
    fn workspace_rw_with_agent_read_only_on_top() {
        let a = argv(false);
        let ws = a
            .windows(3)
            .position(|w| w == ["--bind-fd", "8", "/srv/ws/run-42"])
            .expect("the workspace is bound from its descriptor");
        let agent = a
            .windows(3)
            .position(|w| w == ["--ro-bind-fd", "9", "/srv/ws/run-42/.agent"])
            .expect(".agent is bound read-only from its descriptor");
        assert!(
            agent > ws,
            ".agent must be mounted after (over) the workspace"
        );
        assert!(
            !a.iter().any(|s| s == "--bind"),
            "nothing is bound writable by path"
        );
    }

    #[test]
    fn read_only_run_mounts_the_workspace_read_only() {
        let a = argv(true);
        assert!(!a.iter().any(|s| s == "--bind-fd" || s == "--bind"));
        assert!(has(&a, &["--ro-bind-fd", "8", "/srv/ws/run-42"]));
    }

    #[test]
    fn python_outside_system_dirs_brings_its_prefix() {
        let mut s = spec(false);
        s.python = "/opt/py/bin/python3".into();
        let a: Vec<String> = bwrap_args(&s, &FakeHost(HashMap::new()))
            .into_iter()
            .map(|s| s.into_string().unwrap())
            .collect();
        assert!(has(&a, &["--ro-bind", "/opt/py", "/opt/py"]));
    }
}
