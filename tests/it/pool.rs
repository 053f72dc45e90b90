//! A pool member (`sandbox::member`), made and assigned directly: the real bwrap,
//! init, seccomp filter, Python and mount helper (`scriptgated
//! --sandbox-mounter`), as the daemon's pool will use them. The workspace comes
//! into a sandbox that already runs, as a mount; these tests hold what the cold
//! path's bind gives: private, nosuid and nodev, read-only when asked, `.agent`
//! read-only on top, and beyond the script's reach to unmount or remount.
use crate::common::*;
use scriptgate::pool_parts::{
    runtime_dir, Identity, Member, SandboxBase, SandboxSpec, Via, Waiting,
};
use serde_json::{json, Value};
use std::io::Read;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

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
    make_placed(pool, None).expect("a pool member")
}

/// A member as nobody, placed by `place` where given.
fn make_placed(
    pool: &Pool,
    place: Option<&dyn Fn(u32) -> std::io::Result<Waiting>>,
) -> std::io::Result<Member> {
    // Spawned from the test's own thread, which outlives the member.
    let spawn = |mut c: std::process::Command| c.spawn();
    Member::make(
        &pool.spec,
        Path::new("bwrap"),
        &Via::Exec(BIN.into()),
        Some(NOBODY_ID),
        vec![],
        &spawn,
        place,
    )
}

/// The pool's workspace and its `.agent`, as the daemon opens them.
fn dirs(pool: &Pool) -> (OwnedFd, OwnedFd) {
    (
        open_dir(&pool.workspace),
        open_dir(&pool.workspace.join(".agent")),
    )
}

/// A member with the pool's workspace mounted in (read-only when asked).
fn mounted(pool: &Pool, read_only: bool) -> Member {
    let mut m = make(pool);
    let (ws, agent) = dirs(pool);
    m.mount(&pool.workspace, ws.as_fd(), agent.as_fd(), read_only)
        .unwrap();
    m
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
    let m = mounted(&pool, false);
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
    let m = mounted(&pool, true);
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
    let mut m = mounted(&pool, false);
    let (ws, agent) = dirs(&pool);
    let again = m
        .mount(&pool.workspace, ws.as_fd(), agent.as_fd(), false)
        .unwrap_err();
    assert!(again.to_string().contains("assigned already"), "{again}");
    let (status, out, err) = finish(m, &pool.workspace, "print('once')\n");
    assert_eq!((status, out.as_str()), (0, "once\n"), "{err}");
}

/// On a backend with units a member waits behind the gate until it is placed:
/// when `place` runs, the process is still the gate's shell (bwrap has not
/// started, so nothing of the sandbox ran outside a unit), and a member whose
/// placing fails is not made and leaves no process. (Placing in a real scope or
/// leaf, and the move into the run's unit, run in the VM suite.)
#[test]
#[ignore = "needs root (cargo test -- --include-ignored, as root)"]
fn a_member_is_placed_before_bwrap_runs_and_one_that_cannot_be_is_not_made() {
    let pool = pool();
    let seen = std::sync::Mutex::new(None);
    let place = |pid: u32| {
        // What it executes, once its exec is through (spawn may return a
        // moment before /proc shows it): the shell, never bwrap.
        let exe = format!("/proc/{pid}/exe");
        let own = std::fs::read_link("/proc/self/exe").unwrap();
        let t0 = std::time::Instant::now();
        let mut now = std::fs::read_link(&exe).unwrap();
        while now == own && t0.elapsed() < Duration::from_secs(10) {
            std::thread::yield_now();
            now = std::fs::read_link(&exe).unwrap();
        }
        let name = now.file_name().unwrap().to_string_lossy().into_owned();
        *seen.lock().unwrap() = Some((pid, name));
        Err::<Waiting, _>(std::io::Error::other("no unit here"))
    };
    let e = make_placed(&pool, Some(&place))
        .err()
        .expect("a member that cannot be placed is not made");
    assert!(
        e.to_string()
            .contains("cannot place a pre-made sandbox in its unit: no unit here"),
        "{e}"
    );
    let (pid, exe) = seen.lock().unwrap().clone().expect("place was called");
    assert!(
        ["sh", "dash", "bash"].contains(&exe.as_str()),
        "placed while still the gate, not {exe}"
    );
    assert!(
        !Path::new(&format!("/proc/{pid}")).exists(),
        "the gate's shell was reaped"
    );
}

// --- Through the daemon: `sandbox.pool_size` ---

/// What a script sees of its sandbox: its environment, its /tmp, the processes
/// it can see, its working directory; and a tool call through the broker.
const LOOK: &str = r#"
import json, os, sys
import agent_tools
mark = "/tmp/mark-" + os.urandom(8).hex()
open(mark, "w").write("mine")
seen = {
    "env": sorted(os.environ.items()),
    "tmp": sorted(os.listdir("/tmp")),
    "procs": sorted(p for p in os.listdir("/proc") if p.isdigit()),
    "cwd": os.getcwd(),
    "argv": sys.argv,
    "file": __file__,
    "main": __name__,
    "call": agent_tools.call("fleet__get_device_status", {"sn": "SN1"}),
}
print(json.dumps(seen))
"#;

fn pool_info(e: &Engine) -> Value {
    e.request("daemon.info", json!({})).unwrap()["pool"].clone()
}

/// A rig with `config` and its engine, once `n` members wait.
fn pooled(config: &str, n: u64) -> (Rig, Engine) {
    let rig = Rig::with_config(config);
    let e = rig.engine();
    eventually("members waiting", Duration::from_secs(30), || {
        pool_info(&e)["waiting"] == n || rig.log_text().contains("cannot make a pre-made")
    });
    assert_eq!(pool_info(&e)["waiting"], n, "{}", rig.log_text());
    (rig, e)
}

fn seen(r: &Value) -> Value {
    assert_eq!(r["status"], "ok", "{r}");
    serde_json::from_str(r["output"].as_str().unwrap().trim()).unwrap()
}

#[test]
#[ignore = "needs root (cargo test -- --include-ignored, as root)"]
fn scripts_run_in_pre_made_sandboxes_and_see_what_a_cold_one_sees() {
    require_root("makes sandboxes as another uid and mounts into them");
    let rig = Rig::with_config("[sandbox]\npool_size = 2\n");
    let e = rig.engine();
    // The scripts' uid of root peers (`run_as`) has its members from the start.
    eventually("two members waiting", Duration::from_secs(30), || {
        pool_info(&e) == json!({"size": 2, "waiting": 2, "max_members": 21})
    });
    let token = rig.token(&rig.snapshot("auto"));
    // A run whose limits differ from the pool's starts cold: the baseline.
    let mut snap = rig.snapshot("auto");
    snap["limits"] = json!({"memory_max_bytes": 200_000_000u64});
    let cold = e.run(&rig.token(&snap), LOOK, &[]);
    assert_eq!(cold["pre_made"], false, "{cold}");
    let mut pooled = vec![];
    for _ in 0..4 {
        eventually("a member waiting", Duration::from_secs(30), || {
            pool_info(&e)["waiting"].as_u64() > Some(0)
        });
        let r = e.run(&token, LOOK, &[]);
        assert_eq!(r["pre_made"], true, "{r}");
        pooled.push(seen(&r));
    }
    let cold = seen(&cold);
    for s in &pooled {
        // The same environment, directory, names and broker as the cold path.
        for key in ["env", "cwd", "argv", "file", "main", "call"] {
            assert_eq!(s[key], cold[key], "{key}: {s} vs {cold}");
        }
        // Its own /tmp and processes only: its mark alone, PID 1 and itself.
        let marks: Vec<_> = s["tmp"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|t| t.as_str().unwrap().starts_with("mark-"))
            .collect();
        assert_eq!(marks.len(), 1, "{s}");
        assert_eq!(s["procs"].as_array().unwrap().len(), 2, "{s}");
    }
    assert_eq!(cold["procs"].as_array().unwrap().len(), 2, "{cold}");
    // No two scripts shared a sandbox: every mark differs.
    let mut marks: Vec<String> = pooled.iter().map(|s| s["tmp"].to_string()).collect();
    marks.sort();
    marks.dedup();
    assert_eq!(marks.len(), pooled.len());
}

/// A process's effective capabilities (`CapEff` of /proc/PID/status).
fn cap_eff(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let hex = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .unwrap()
        .trim();
    u64::from_str_radix(hex, 16).unwrap()
}

/// Privilege separation: a daemon with pre-made sandboxes keeps none of the
/// three capabilities that entering one takes (CAP_SYS_ADMIN 21, CAP_SYS_CHROOT
/// 18, CAP_SYS_PTRACE 19): its mount server holds them (and the daemon's own
/// five, no more), and scripts still run pre-made through it.
#[test]
#[ignore = "needs root (cargo test -- --include-ignored, as root)"]
fn only_the_mount_server_holds_what_entering_a_sandbox_takes() {
    require_root("makes sandboxes as another uid and mounts into them");
    let (rig, e) = pooled("[sandbox]\npool_size = 1\n", 1);
    let pool_caps: u64 = (1 << 21) | (1 << 18) | (1 << 19);
    let daemon = rig.daemon.as_ref().unwrap().id();
    assert_eq!(
        cap_eff(daemon) & pool_caps,
        0,
        "the daemon keeps none of them"
    );
    let servers: Vec<u32> = descendants(daemon)
        .into_iter()
        .filter(|p| {
            std::fs::read(format!("/proc/{p}/cmdline"))
                .is_ok_and(|c| c.ends_with(b"--sandbox-mount-server\0"))
        })
        .collect();
    assert_eq!(servers.len(), 1, "one mount server");
    let server = cap_eff(servers[0]);
    assert_eq!(server & pool_caps, pool_caps, "the server holds them");
    assert_eq!(
        server & !pool_caps,
        cap_eff(daemon),
        "and beyond them only the daemon's own"
    );
    let r = e.run(
        &rig.token(&rig.snapshot("auto")),
        "print('pre-made')\n",
        &[],
    );
    assert_eq!(
        (r["status"].as_str(), r["pre_made"].as_bool()),
        (Some("ok"), Some(true)),
        "{r}\n{}",
        rig.log_text()
    );
}

#[test]
#[ignore = "needs root (cargo test -- --include-ignored, as root)"]
fn a_burst_larger_than_the_pool_starts_the_rest_cold() {
    require_root("makes sandboxes as another uid and mounts into them");
    let (rig, e) = pooled(
        "[sandbox]\npool_size = 2\n[scripts]\nmax_concurrency = 8\n",
        2,
    );
    let token = rig.token(&rig.snapshot("auto"));
    // All five sent before any answer: the keeper, making one member at a
    // time, cannot refill the shelf between them.
    let answers: Vec<_> = (0..5)
        .map(|i| {
            e.send_request(
                "script.start",
                json!({"token": token, "code": format!("print({i})\n"), "tools": [], "description": "burst"}),
            )
        })
        .collect();
    let ids: Vec<String> = answers
        .into_iter()
        .map(|rx| {
            let m = rx.recv_timeout(Duration::from_secs(120)).unwrap();
            m["result"]["script_id"]
                .as_str()
                .unwrap_or_else(|| panic!("{m}"))
                .to_string()
        })
        .collect();
    let results: Vec<Value> = ids.iter().map(|id| e.wait(id)).collect();
    for (i, r) in results.iter().enumerate() {
        assert_eq!(r["status"], "ok", "{r}");
        assert_eq!(r["output"], format!("{i}\n"), "{r}");
    }
    // The two waiting (perhaps one made meanwhile); the rest cold.
    let pre_made = results.iter().filter(|r| r["pre_made"] == true).count();
    assert!(
        (2..=3).contains(&pre_made),
        "{pre_made} pre-made: {results:?}"
    );
    // The metrics count both ways, from the audit store.
    let o = rig.cli(["metrics"]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.contains(&format!(
            "scriptgate_sandbox_starts_total{{start=\"pre_made\"}} {pre_made}\n"
        )) && text.contains(&format!(
            "scriptgate_sandbox_starts_total{{start=\"cold\"}} {}\n",
            5 - pre_made
        )),
        "{text}"
    );
}

#[test]
#[ignore = "needs root (cargo test -- --include-ignored, as root)"]
fn a_run_with_tighter_limits_starts_cold() {
    require_root("makes sandboxes as another uid and mounts into them");
    let (rig, e) = pooled("[sandbox]\npool_size = 1\n", 1);
    let mut snap = rig.snapshot("auto");
    snap["limits"] = json!({"memory_max_bytes": 200_000_000u64});
    let r = e.run(&rig.token(&snap), "print(1)\n", &[]);
    assert_eq!(
        (r["status"].as_str(), r["pre_made"].as_bool()),
        (Some("ok"), Some(false)),
        "{r}"
    );
    assert_eq!(pool_info(&e)["waiting"], 1, "the member still waits");
}

/// The waiting members' processes (bwrap, init and Python: `member.py` in
/// their command line) among the daemon's descendants.
fn member_processes(daemon: u32) -> Vec<u32> {
    descendants_running(daemon, b"member.py")
}

/// No member outlives the interpreter it was made with: once `scripts.python`
/// is replaced (as an upgrade does, a new file renamed over the old), the next
/// run starts cold with the new one, the waiting member goes, and the next
/// member is made with the new interpreter.
#[test]
#[ignore = "needs root (cargo test -- --include-ignored, as root)"]
fn members_made_with_a_replaced_interpreter_go() {
    require_root("makes sandboxes as another uid and mounts into them");
    // An interpreter of its own, outside the system directories (its prefix,
    // like a venv's, is bound into the sandbox), that the scripts' uid reaches.
    let dir = tempfile::Builder::new().tempdir_in("/var/tmp").unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let bin = dir.path().join("py/bin");
    std::fs::create_dir_all(&bin).unwrap();
    let real = std::fs::canonicalize("/usr/bin/python3").unwrap();
    let python = bin.join("python3");
    std::fs::copy(&real, &python).unwrap();
    let (rig, e) = pooled(
        &format!(
            "[sandbox]\npool_size = 1\n[scripts]\npython = \"{}\"\n",
            python.display()
        ),
        1,
    );
    let daemon = rig.daemon.as_ref().unwrap().id();
    let token = rig.token(&rig.snapshot("auto"));
    let r = e.run(&token, "print('before')\n", &[]);
    assert_eq!(
        (r["status"].as_str(), r["pre_made"].as_bool()),
        (Some("ok"), Some(true)),
        "{r}"
    );
    eventually("a member waiting", Duration::from_secs(30), || {
        pool_info(&e)["waiting"] == 1
    });
    let old = member_processes(daemon);
    assert!(!old.is_empty());
    // The upgrade: a new file in the interpreter's place.
    let new = bin.join("python3.new");
    std::fs::copy(&real, &new).unwrap();
    std::fs::rename(&new, &python).unwrap();
    let r = e.run(&token, "print('after')\n", &[]);
    assert_eq!(
        (
            r["status"].as_str(),
            r["pre_made"].as_bool(),
            r["output"].as_str()
        ),
        (Some("ok"), Some(false), Some("after\n")),
        "{r}"
    );
    eventually("the old member gone", Duration::from_secs(30), || {
        member_processes(daemon).iter().all(|p| !old.contains(p))
    });
    assert!(
        rig.log_text().contains("was replaced"),
        "{}",
        rig.log_text()
    );
    // The next member is made with the new interpreter, and takes runs again.
    eventually("a new member waiting", Duration::from_secs(30), || {
        pool_info(&e)["waiting"] == 1
    });
    let r = e.run(&token, "print('again')\n", &[]);
    assert_eq!(
        (r["status"].as_str(), r["pre_made"].as_bool()),
        (Some("ok"), Some(true)),
        "{r}"
    );
}
