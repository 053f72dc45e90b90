//! The sandbox from the inside: a real bwrap, a real Python, the real daemon.
use crate::common::*;
use serde_json::{json, Value};
use std::os::unix::fs::MetadataExt;
use std::time::Duration;

fn run_json(rig: &Rig, snap: &Value, code: &str) -> (Value, Value) {
    let e = rig.engine();
    let r = e.run(&rig.token(snap), code, &[]);
    assert_eq!(r["status"], "ok", "{r}");
    let out = serde_json::from_str(r["output"].as_str().unwrap().lines().last().unwrap()).unwrap();
    (r, out)
}

#[test]
fn no_network_not_even_the_hosts_loopback() {
    let rig = Rig::new();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let code = format!(
        r#"
import socket, json
out = {{}}
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=2)
    out["loopback"] = "connected"
except OSError as e:
    out["loopback"] = type(e).__name__
# /proc/net/dev lists the namespace's interfaces (if_nameindex needs AF_NETLINK,
# which the seccomp filter refuses).
out["interfaces"] = [l.split(":")[0].strip() for l in open("/proc/net/dev").readlines()[2:]]
try:
    socket.getaddrinfo("example.com", 443)
    out["dns"] = "resolved"
except OSError as e:
    out["dns"] = "failed"
try:
    s = socket.socket(socket.AF_UNIX); s.connect({sock:?}); out["daemon_socket"] = "connected"
except OSError as e:
    out["daemon_socket"] = type(e).__name__
print(json.dumps(out))
"#,
        sock = rig.socket.to_str().unwrap()
    );
    let (_, out) = run_json(&rig, &rig.snapshot("auto"), &code);
    assert_eq!(out["loopback"], "ConnectionRefusedError", "{out}");
    assert_eq!(out["interfaces"], json!(["lo"]), "{out}");
    assert_eq!(out["dns"], "failed");
    assert_eq!(
        out["daemon_socket"], "FileNotFoundError",
        "the daemon's socket is not in the sandbox: {out}"
    );
    listener.set_nonblocking(true).unwrap();
    assert!(
        listener.accept().is_err(),
        "nothing reached the host listener"
    );
}

#[test]
fn writes_only_in_the_workspace_and_agent_is_read_only() {
    let rig = Rig::new();
    let host_tmp_marker = format!("/tmp/sg-sandbox-probe-{}", std::process::id());
    let code = format!(
        r#"
import os, json, glob
out = {{}}
def attempt(name, path):
    try:
        with open(path, "w") as f: f.write("x")
        out[name] = "written"
    except OSError as e:
        out[name] = type(e).__name__
attempt("workspace", "result.csv")
attempt("tmp", {host_tmp_marker:?})
attempt("usr", "/usr/pwned")
attempt("etc", "/etc/pwned")
attempt("root", "/pwned")
attempt("agent", ".agent/forged.txt")
own = glob.glob(".agent/scripts/*/calls.jsonl")
attempt("own_record", own[0])
try:
    os.rename(".agent", "agent-moved"); out["rename_agent"] = "renamed"
except OSError as e:
    out["rename_agent"] = type(e).__name__
out["uid"] = os.getuid()
out["gid"] = os.getgid()
out["caps"] = [l.split()[1] for l in open("/proc/self/status") if l.startswith("CapEff")][0]
out["cwd"] = os.getcwd()
out["etc_files"] = sorted(os.listdir("/etc"))
out["pid1"] = open("/proc/1/cmdline").read().split("\0")[0]
print(json.dumps(out))
"#
    );
    let (r, out) = run_json(&rig, &rig.snapshot("auto"), &code);
    assert_eq!(out["workspace"], "written", "{out}");
    assert_eq!(out["tmp"], "written", "the private /tmp is writable");
    assert!(
        !std::path::Path::new(&host_tmp_marker).exists(),
        "the sandbox's /tmp is not the host's"
    );
    for k in ["usr", "etc", "root", "agent", "own_record"] {
        assert!(
            out[k] == "OSError" || out[k] == "PermissionError" || out[k] == "FileNotFoundError",
            "{k}: {out}"
        );
    }
    assert_ne!(out["rename_agent"], "renamed", "{out}");
    assert_eq!(out["uid"].as_u64().unwrap() as u32, script_uid(), "{out}");
    assert_ne!(out["uid"], 0);
    assert_eq!(out["caps"], "0000000000000000");
    assert_eq!(out["cwd"], rig.workspace.to_str().unwrap());
    assert!(
        !out["etc_files"]
            .as_array()
            .unwrap()
            .iter()
            .any(|f| f == "shadow"),
        "{out}"
    );
    assert_ne!(out["pid1"], "/sbin/init");
    // The file the script wrote is on the host, owned by the script's uid; so is its record.
    let meta = std::fs::metadata(rig.workspace.join("result.csv")).unwrap();
    assert_eq!(meta.uid(), script_uid());
    let dir = rig.details(r["script_id"].as_str().unwrap());
    for f in ["script.py", "calls.jsonl", "output.txt"] {
        assert_eq!(
            std::fs::metadata(dir.join(f)).unwrap().uid(),
            script_uid(),
            "{f}"
        );
    }
    assert!(!rig.workspace.join(".agent/forged.txt").exists());
}

#[test]
fn read_only_runs_cannot_write_the_workspace() {
    let rig = Rig::new();
    let mut snap = rig.snapshot("auto");
    snap["read_only"] = json!(true);
    let code = "import json\ntry:\n    open('x','w')\n    r='written'\nexcept OSError as e:\n    r=type(e).__name__\nprint(json.dumps({'w': r}))\n";
    let (_, out) = run_json(&rig, &snap, code);
    assert_eq!(out["w"], "OSError", "{out}");
    assert!(!rig.workspace.join("x").exists());
}

#[test]
fn a_planted_agent_symlink_is_refused() {
    let rig = Rig::new();
    let e = rig.engine();
    let target = rig.dir.path().join("elsewhere");
    std::fs::create_dir(&target).unwrap();
    std::os::unix::fs::symlink(&target, rig.workspace.join(".agent")).unwrap();
    let err = e
        .start(&rig.token(&rig.snapshot("auto")), "print(1)", &[])
        .unwrap_err();
    assert_eq!(err["code"], -32603);
    assert!(err["message"].as_str().unwrap().contains(".agent"), "{err}");
    assert_eq!(
        std::fs::read_dir(&target).unwrap().count(),
        0,
        "nothing was written through the link"
    );
}

fn setsid_children(marker: &str) -> String {
    format!(
        r#"
import subprocess, sys, time
for i in range(3):
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "{marker}"], start_new_session=True)
print("spawned", flush=True)
time.sleep(600)
"#
    )
}

#[test]
fn timeout_ends_the_whole_process_tree() {
    let rig = Rig::new();
    let e = rig.engine();
    let marker = format!("sg-timeout-marker-{}", std::process::id());
    let mut snap = rig.snapshot("auto");
    snap["limits"] = json!({"timeout_s": 2});
    let id = e
        .start(&rig.token(&snap), &setsid_children(&marker), &[])
        .unwrap();
    eventually("children to start", Duration::from_secs(10), || {
        processes_with(&marker).len() == 3
    });
    let r = e.wait(&id);
    assert_eq!(r["status"], "timeout", "{r}");
    assert_eq!(r["output"], "spawned\n");
    assert!(r["error"].as_str().unwrap().contains("timeout_s = 2"));
    assert!(r["text"]
        .as_str()
        .unwrap()
        .starts_with("run_script timeout: 0 calls"));
    eventually("no process left", Duration::from_secs(5), || {
        processes_with(&marker).is_empty()
    });
}

#[test]
fn cancel_ends_the_whole_process_tree() {
    let rig = Rig::new();
    let e = rig.engine();
    let marker = format!("sg-cancel-marker-{}", std::process::id());
    let id = e
        .start(
            &rig.token(&rig.snapshot("auto")),
            &setsid_children(&marker),
            &[],
        )
        .unwrap();
    eventually("children to start", Duration::from_secs(10), || {
        processes_with(&marker).len() == 3
    });
    e.request("script.cancel", json!({"script_id": id}))
        .unwrap();
    assert_eq!(e.wait(&id)["status"], "cancelled");
    eventually("no process left", Duration::from_secs(5), || {
        processes_with(&marker).is_empty()
    });
}

#[test]
fn engine_disconnect_cancels_its_scripts() {
    let rig = Rig::new();
    let e = rig.engine();
    let marker = format!("sg-disconnect-marker-{}", std::process::id());
    let token = rig.token(&rig.snapshot("auto"));
    let id = e.start(&token, &setsid_children(&marker), &[]).unwrap();
    eventually("children to start", Duration::from_secs(10), || {
        processes_with(&marker).len() == 3
    });
    e.close();
    eventually("no process left", Duration::from_secs(10), || {
        processes_with(&marker).is_empty()
    });
    // Another connection holding the run's token can read the result.
    let other = rig.engine();
    let r = other
        .request(
            "script.wait",
            json!({"script_id": id, "token": token, "timeout_s": 10}),
        )
        .unwrap();
    assert_eq!(r["status"], "cancelled");
    assert_eq!(r["error"], "engine disconnected");
}

#[test]
fn memory_and_task_limits_hold_in_the_rlimit_backend() {
    // Alone: it takes ~128 of nobody's tasks, which every other test's scripts
    // share under RLIMIT_NPROC (in one test binary, they run beside it).
    alone();
    let rig = Rig::new();
    let mut snap = rig.snapshot("auto");
    // RLIMIT_NPROC counts every task of the uid, and the other tests of this file
    // run scripts as the same uid (nobody) in parallel. 128 leaves room for them:
    // this script's bwrap starts while another test's tasks (a few dozen at most:
    // bwrap, init, python, its threads and children) count against it, and while
    // this script holds ~128 of nobody's tasks, the rig's default tasks_max (256)
    // leaves the others 128. At 64, a concurrent test's tasks made this bwrap's own
    // clone fail ("bwrap: Resource temporarily unavailable", 1 run in 6).
    let tasks_max = 128;
    snap["limits"] = json!({"memory_max_bytes": 256u64 << 20, "tasks_max": tasks_max});
    let code = r#"
import json, os
out = {}
try:
    x = bytearray(512 << 20)
    out["mem"] = "allocated"
except MemoryError:
    out["mem"] = "MemoryError"
pids = []
try:
    for i in range(400):
        pid = os.fork()
        if pid == 0:
            import time; time.sleep(30); os._exit(0)
        pids.append(pid)
    out["fork"] = "unbounded"
except OSError as e:
    out["fork"] = "refused after %d" % len(pids)
print(json.dumps(out))
"#;
    let (_, out) = run_json(&rig, &snap, code);
    assert_eq!(out["mem"], "MemoryError", "{out}");
    // Refused, and by the limit: before the script alone reached it.
    let forked: u64 = out["fork"]
        .as_str()
        .and_then(|f| f.strip_prefix("refused after "))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{out}"));
    assert!(forked < tasks_max, "{out}");
}

#[test]
#[ignore = "needs root (cargo test -- --include-ignored, as root)"]
fn script_is_never_root_and_runs_as_run_as_for_root_peers() {
    require_root("connects as root");
    let rig = Rig::new();
    let (_, out) = run_json(
        &rig,
        &rig.snapshot("auto"),
        "import os, json\nprint(json.dumps([os.getuid(), os.getgid(), os.getgroups()]))\n",
    );
    assert_eq!(out, json!([NOBODY, NOBODY, []]));
}

#[test]
fn cancel_right_after_start_leaves_no_process() {
    // Regression: a stop that lands before bwrap's child has armed PDEATHSIG must
    // still end the sandbox (it is killed through its PID-namespace init).
    let rig = Rig::new();
    let e = rig.engine();
    let token = rig.token(&rig.snapshot("auto"));
    for _ in 0..5 {
        let id = e
            .start(&token, "import time\ntime.sleep(600)\n", &[])
            .unwrap();
        e.request("script.cancel", json!({"script_id": id}))
            .unwrap();
        let r = e.wait(&id);
        assert_eq!(r["status"], "cancelled");
        // No id is in any command line (the record dir is bound by fd): the
        // sandbox's processes are those that work in the rig's workspace, and
        // the bwrap whose argv names it.
        eventually("no process of the script", Duration::from_secs(5), || {
            processes_in(&rig.workspace).is_empty()
        });
    }
}

#[test]
fn the_seccomp_filter_refuses_kernel_attack_surface() {
    // Each of these succeeds for an unprivileged process outside the sandbox.
    let rig = Rig::new();
    let code = format!(
        r#"
import ctypes, json, os, threading, subprocess, sqlite3
libc = ctypes.CDLL(None, use_errno=True)
def sc(nr, *a):
    r = libc.syscall(nr, *[ctypes.c_long(x) for x in a])
    return r if r >= 0 else -ctypes.get_errno()
buf = ctypes.create_string_buffer(120)
out = {{
    "keyctl": sc({keyctl}, 0, -3, 1),
    "io_uring_setup": sc({io_uring}, 1, ctypes.addressof(buf)),
    "personality": sc({personality}, 0xffffffff),
    "unshare": sc({unshare}, 0x00020000),
}}
# Ordinary work is untouched: threads, a subprocess, sqlite in /tmp.
t = threading.Thread(target=lambda: None); t.start(); t.join()
out["subprocess"] = subprocess.run(["/bin/echo", "fine"], capture_output=True, text=True).stdout.strip()
db = sqlite3.connect("/tmp/x.db"); db.execute("create table t(x)"); out["sqlite"] = "ok"
print(json.dumps(out))
"#,
        keyctl = libc::SYS_keyctl,
        io_uring = libc::SYS_io_uring_setup,
        personality = libc::SYS_personality,
        unshare = libc::SYS_unshare,
    );
    let (_, out) = run_json(&rig, &rig.snapshot("auto"), &code);
    let eperm = -libc::EPERM as i64;
    for k in ["keyctl", "io_uring_setup", "personality", "unshare"] {
        assert_eq!(out[k].as_i64(), Some(eperm), "{k}: {out}");
    }
    assert_eq!(
        (out["subprocess"].as_str(), out["sqlite"].as_str()),
        (Some("fine"), Some("ok"))
    );
}

/// Processes whose working directory is `dir` (the sandbox's, which binds the
/// workspace at its own path) or whose command line names it (bwrap's).
fn processes_in(dir: &std::path::Path) -> Vec<i32> {
    let mut out = vec![];
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let cwd = std::fs::read_link(e.path().join("cwd")).is_ok_and(|c| c == dir);
        let named = std::fs::read(e.path().join("cmdline"))
            .is_ok_and(|c| String::from_utf8_lossy(&c).contains(dir.to_str().unwrap()));
        if cwd || named {
            out.push(pid);
        }
    }
    out
}

/// agent_tools.py reaches scripts compiled (a checked-hash .pyc the daemon made
/// at start in its runtime directory), not compiled again by every script.
#[test]
fn agent_tools_is_compiled_once_by_the_daemon() {
    let rig = Rig::new();
    let code = r#"
import agent_tools, importlib.util, json, os
head = open(agent_tools.__cached__, "rb").read(16)
source = open(agent_tools.__file__, "rb").read()
print(json.dumps({
    "flags": int.from_bytes(head[4:8], "little"),
    "matches": head[8:16] == importlib.util.source_hash(source),
    "mode": oct(os.stat(agent_tools.__cached__).st_mode & 0o777),
}))
"#;
    let (_, out) = run_json(&rig, &rig.snapshot("auto"), code);
    // 0b11: hash-based, checked against the source at each import.
    assert_eq!(out, json!({"flags": 3, "matches": true, "mode": "0o644"}));
}
