//! A pool member (`sandbox::member`), made and assigned directly: the real bwrap,
//! init, seccomp filter, Python and mount helper (`scriptgated
//! --sandbox-mounter`), as the daemon's pool will use them. The workspace comes
//! into a sandbox that already runs, as a mount; these tests hold what the cold
//! path's bind gives: private, nosuid and nodev, read-only when asked, `.agent`
//! read-only on top, and beyond the script's reach to unmount or remount.
use crate::common::*;
use scriptgate::pool_parts::{runtime_dir, Identity, Member, SandboxBase, SandboxSpec};
use std::io::Read;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

const BIN: &str = env!("CARGO_BIN_EXE_scriptgated");
const NOBODY_ID: Identity = Identity {
    uid: NOBODY,
    gid: NOBODY,
};

struct Pool {
    _dir: tempfile::TempDir,
    spec: SandboxSpec,
    workspace: PathBuf,
}

/// A runtime directory and a workspace (writable by the scripts' uid, with an
/// `.agent/note.txt`), under a fresh temporary directory.
fn pool() -> Pool {
    require_root("makes sandboxes as another uid and mounts into them");
    shared();
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let runtime = runtime_dir(&dir.path().join("state"));
    let workspace = dir.path().join("a workspace");
    std::fs::create_dir_all(workspace.join(".agent")).unwrap();
    std::fs::write(workspace.join(".agent/note.txt"), "from the agent").unwrap();
    std::fs::set_permissions(&workspace, std::fs::Permissions::from_mode(0o777)).unwrap();
    let base = SandboxBase::new(runtime, "/usr/bin/python3".into(), 16 << 20, true, 1024)
        .with_init(BIN.into());
    let spec = SandboxSpec::new(&base, PathBuf::new(), false, "script.py".into());
    Pool {
        _dir: dir,
        spec,
        workspace,
    }
}

fn open_dir(p: &Path) -> OwnedFd {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW)
        .open(p)
        .unwrap()
        .into()
}

fn make(pool: &Pool) -> Member {
    Member::make(
        &pool.spec,
        Path::new("bwrap"),
        Path::new(BIN),
        Some(NOBODY_ID),
    )
    .expect("a pool member")
}

/// Send `code`, then read the script's stdout and stderr to their end and
/// wait for the sandbox: (exit status, stdout, stderr).
fn finish(mut m: Member, workspace: &Path, code: &str) -> (i32, String, String) {
    m.go(workspace, "script.py", code.as_bytes()).unwrap();
    let Member {
        mut child,
        stdout,
        stderr,
        ..
    } = m;
    let err = std::thread::spawn(move || {
        let mut s = String::new();
        std::fs::File::from(stderr).read_to_string(&mut s).unwrap();
        s
    });
    let mut out = String::new();
    std::fs::File::from(stdout)
        .read_to_string(&mut out)
        .unwrap();
    let status = child.wait().unwrap().code().unwrap_or(-1);
    (status, out, err.join().unwrap())
}

/// Inside: where it runs, what it may write, and what it cannot undo.
const PROBE: &str = r#"
import ctypes, os
import agent_tools
libc = ctypes.CDLL(None, use_errno=True)
here = os.getcwd()
print("cwd", here)
print("uid", os.getuid())
def attempt(what, f):
    try:
        f()
        print(what, "ok")
    except OSError as e:
        print(what, "errno", e.errno)
attempt("write", lambda: open("written.txt", "w").write("from the script"))
print("agent", open(".agent/note.txt").read())
attempt("agent-write", lambda: open(".agent/x", "w"))
for line in open("/proc/self/mountinfo"):
    f = line.split()
    if f[4].replace("\\040", " ") == here:
        print("mount", " ".join(f[5:f.index("-")]))
print("umount", libc.umount2(here.encode(), 2), ctypes.get_errno())
MS_REMOUNT, MS_BIND = 32, 4096
print("remount", libc.mount(None, here.encode(), None, MS_REMOUNT | MS_BIND, None), ctypes.get_errno())
print("caps", [l.split()[1] for l in open("/proc/self/status") if l.startswith("Cap")])
"#;

#[test]
#[ignore = "needs root (cargo test -- --include-ignored, as root)"]
fn a_workspace_mounted_into_a_waiting_member_is_the_scripts_and_beyond_its_reach() {
    let pool = pool();
    let mut m = make(&pool);
    let ws = open_dir(&pool.workspace);
    let agent = open_dir(&pool.workspace.join(".agent"));
    m.mount(&pool.workspace, ws.as_fd(), agent.as_fd(), false)
        .unwrap();
    let (status, out, err) = finish(m, &pool.workspace, PROBE);
    assert_eq!(status, 0, "{out}\n{err}");
    let want = |line: &str| {
        assert!(
            out.lines().any(|l| l == line),
            "no {line:?} in:\n{out}\n{err}"
        )
    };
    want(&format!("cwd {}", pool.workspace.display()));
    want(&format!("uid {NOBODY}"));
    want("write ok");
    want("agent from the agent");
    want("agent-write errno 30");
    // Private (no shared: or master: tag), nosuid and nodev, writable.
    let mount = out.lines().find(|l| l.starts_with("mount ")).unwrap();
    assert!(
        mount.contains("nosuid") && mount.contains("nodev"),
        "{mount}"
    );
    assert!(mount.starts_with("mount rw,"), "{mount}");
    assert!(
        !mount.contains("shared:") && !mount.contains("master:"),
        "{mount}"
    );
    // EPERM: the seccomp filter, and no capability in any namespace.
    want("umount -1 1");
    want("remount -1 1");
    want("caps ['0000000000000000', '0000000000000000', '0000000000000000', '0000000000000000', '0000000000000000']");
    assert_eq!(
        std::fs::read_to_string(pool.workspace.join("written.txt")).unwrap(),
        "from the script"
    );
}

#[test]
#[ignore = "needs root (cargo test -- --include-ignored, as root)"]
fn a_read_only_run_gets_its_workspace_read_only() {
    let pool = pool();
    let mut m = make(&pool);
    let ws = open_dir(&pool.workspace);
    let agent = open_dir(&pool.workspace.join(".agent"));
    m.mount(&pool.workspace, ws.as_fd(), agent.as_fd(), true)
        .unwrap();
    let (status, out, err) = finish(m, &pool.workspace, PROBE);
    assert_eq!(status, 0, "{out}\n{err}");
    assert!(out.contains("\nwrite errno 30\n"), "{out}");
    assert!(out.contains("\nmount ro,"), "{out}");
    assert!(out.contains("\nremount -1 1\n"), "{out}");
    assert!(!pool.workspace.join("written.txt").exists());
}

#[test]
#[ignore = "needs root (cargo test -- --include-ignored, as root)"]
fn a_member_refuses_a_script_when_no_workspace_was_mounted() {
    let pool = pool();
    let m = make(&pool);
    let (status, out, err) = finish(m, &pool.workspace, "print('ran')\n");
    assert_eq!(status, 125, "{out}\n{err}");
    assert_eq!(out, "");
    assert!(
        err.contains(&format!(
            "no workspace is mounted at {}; the script was not run",
            pool.workspace.display()
        )),
        "{err}"
    );
}

#[test]
#[ignore = "needs root (cargo test -- --include-ignored, as root)"]
fn a_member_is_assigned_once() {
    let pool = pool();
    let mut m = make(&pool);
    let ws = open_dir(&pool.workspace);
    let agent = open_dir(&pool.workspace.join(".agent"));
    m.mount(&pool.workspace, ws.as_fd(), agent.as_fd(), false)
        .unwrap();
    let again = m
        .mount(&pool.workspace, ws.as_fd(), agent.as_fd(), false)
        .unwrap_err();
    assert!(again.to_string().contains("assigned already"), "{again}");
    let (status, out, err) = finish(m, &pool.workspace, "print('once')\n");
    assert_eq!((status, out.as_str()), (0, "once\n"), "{err}");
}
