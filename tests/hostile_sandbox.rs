//! An outside red team's breaks of the sandbox, each replayed through the real
//! daemon, bwrap and Python: the daemon's environment and descriptors seen through
//! `/proc`, socket families outside the network namespace (AF_VSOCK), the x32
//! syscall ABI, an unbounded writable `/dev` and the pty pool, threads under the
//! rlimit backend's address-space cap, a wrong `memory_peak_bytes`, and sandbox
//! processes left as zombies.
mod common;
use common::*;
use serde_json::{json, Value};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The last line of a successful script's output, as JSON.
fn last_json(r: &Value) -> Value {
    assert_eq!(r["status"], "ok", "{r}");
    let out = r["output"].as_str().unwrap();
    serde_json::from_str(out.lines().last().unwrap_or("null"))
        .unwrap_or_else(|e| panic!("{e}: {out}"))
}

fn run(rig: &Rig, code: &str) -> Value {
    rig.engine()
        .run(&rig.token(&rig.snapshot("auto")), code, &[])
}

/// Restart the rig's daemon the way a careless parent would leave it: a marker in
/// its environment and an inheritable descriptor (at 42) on a marker file.
fn restart_with_secrets(rig: &mut Rig, env_marker: &str, secret_file: &Path) {
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;
    rig.stop(nix::sys::signal::Signal::SIGKILL);
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&rig.log)
        .unwrap();
    let secret = std::fs::File::open(secret_file).unwrap();
    let raw = secret.as_raw_fd();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_scriptgated"));
    cmd.arg("--listen")
        .arg(&rig.socket)
        .arg("--config")
        .arg(&rig.config)
        .env("SG_HOSTILE_MARKER", env_marker)
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log);
    // SAFETY: dup2 is async-signal-safe; `raw` stays open in the parent until
    // spawn returns (`secret` lives to the end of this function).
    unsafe {
        cmd.pre_exec(move || {
            if libc::dup2(raw, 42) == -1 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    rig.daemon = Some(cmd.spawn().unwrap());
    let t0 = Instant::now();
    while std::os::unix::net::UnixStream::connect(&rig.socket).is_err() {
        if let Some(st) = rig.daemon.as_mut().unwrap().try_wait().unwrap() {
            panic!("daemon exited {st}: {}", rig.log_text());
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "daemon did not listen"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(secret);
}

#[test]
fn nothing_of_the_daemon_is_reachable_through_proc() {
    let mut rig = Rig::new();
    let marker = format!("sg-env-marker-{}", std::process::id());
    let secret = rig.dir.path().join("daemon-secret.txt");
    std::fs::write(&secret, "daemon only").unwrap();
    restart_with_secrets(&mut rig, &marker, &secret);
    let code = format!(
        r#"
import json, os
marker = {marker:?}.encode()
secret = {secret:?}
me = os.getpid()
parent = {{}}
for p in os.listdir("/proc"):
    if p.isdigit():
        try:
            parent[int(p)] = int(open("/proc/%s/stat" % p).read().rsplit(")", 1)[1].split()[1])
        except OSError:
            pass
def mine(p):
    while p in parent and p != me:
        p = parent[p]
    return p == me
out = {{"pids": sorted(parent), "me": me, "environ": [], "mem_rw": [], "fd_links": [], "environ_denied": []}}
for p in parent:
    try:
        if marker in open("/proc/%d/environ" % p, "rb").read():
            out["environ"].append(p)
    except OSError:
        out["environ_denied"].append(p)
    if not mine(p):
        try:
            os.close(os.open("/proc/%d/mem" % p, os.O_RDWR))
            out["mem_rw"].append(p)
        except OSError:
            pass
    try:
        for f in os.listdir("/proc/%d/fd" % p):
            try:
                if os.readlink("/proc/%d/fd/%s" % (p, f)) == secret:
                    out["fd_links"].append([p, int(f)])
            except OSError:
                pass
    except OSError:
        pass
def is_open(fd):
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False
out["extra_fds"] = [f for f in sorted(int(f) for f in os.listdir("/proc/self/fd")) if f > 4 and is_open(f)]
print(json.dumps(out))
"#,
        secret = secret.to_str().unwrap()
    );
    let out = last_json(&run(&rig, &code));
    assert_eq!(
        out["environ"],
        json!([]),
        "daemon environment visible: {out}"
    );
    assert_eq!(
        out["mem_rw"],
        json!([]),
        "memory of a process that is not the script's own descendant opens for writing: {out}"
    );
    assert_eq!(out["fd_links"], json!([]), "a daemon descriptor: {out}");
    assert_eq!(
        out["extra_fds"],
        json!([]),
        "only fds 0-4 reach the script: {out}"
    );
    // The sandbox's PID 1 is scriptgate's init, not the script, and it is closed.
    assert_ne!(out["me"], 1, "{out}");
    assert!(
        out["environ_denied"]
            .as_array()
            .unwrap()
            .contains(&json!(1)),
        "PID 1 is not dumpable: {out}"
    );
}

/// The workspace is a host directory: no set-user-ID or set-group-ID file may be
/// left in it (systemd's RestrictSUIDSGID=, which the unit cannot use with
/// bubblewrap 0.12, done by the sandbox's own filter).
#[test]
fn no_setuid_or_setgid_file_is_made() {
    let rig = Rig::new();
    let code = r#"
import errno, json, os
out = {}
def try_(name, f):
    try:
        f()
        out[name] = "done"
    except OSError as e:
        out[name] = errno.errorcode.get(e.errno, e.errno)
open("plain", "w").close()
try_("chmod_suid", lambda: os.chmod("plain", 0o4755))
try_("chmod_sgid", lambda: os.chmod("plain", 0o2755))
fd = os.open("plain", os.O_RDONLY)
try_("fchmod_suid", lambda: os.fchmod(fd, 0o4700))
try_("create_suid", lambda: os.close(os.open("made", os.O_CREAT | os.O_WRONLY, 0o4755)))
try_("mknod_sgid", lambda: os.mknod("fifo", 0o2644 | 0o010000))
try_("chmod_plain", lambda: os.chmod("plain", 0o750))
try_("create_plain", lambda: os.close(os.open("made2", os.O_CREAT | os.O_WRONLY, 0o640)))
out["modes"] = oct(os.stat("plain").st_mode & 0o7777)
print(json.dumps(out))
"#;
    let out = last_json(&run(&rig, code));
    for k in [
        "chmod_suid",
        "chmod_sgid",
        "fchmod_suid",
        "create_suid",
        "mknod_sgid",
    ] {
        assert_eq!(out[k], "EPERM", "{k}: {out}");
    }
    for k in ["chmod_plain", "create_plain"] {
        assert_eq!(out[k], "done", "{k}: {out}");
    }
    assert_eq!(out["modes"], "0o750", "{out}");
    let ws = &rig.workspace;
    for f in ["plain", "made2"] {
        let mode = std::fs::metadata(ws.join(f)).unwrap().permissions();
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&mode) & 0o6000,
            0,
            "{f} on the host"
        );
    }
    assert!(!ws.join("made").exists(), "a refused create leaves no file");
}

#[test]
fn only_unix_and_inet_sockets_can_be_created() {
    // Never bind or connect anything here: AF_VSOCK is not namespaced, and this
    // host's control plane may listen on vsock.
    let rig = Rig::new();
    let code = format!(
        r#"
import ctypes, errno, json, socket
out = {{}}
def mk(name, fam, typ):
    try:
        socket.socket(fam, typ).close()
        out[name] = "created"
    except OSError as e:
        out[name] = errno.errorcode.get(e.errno, e.errno)
mk("unix", socket.AF_UNIX, socket.SOCK_STREAM)
mk("inet", socket.AF_INET, socket.SOCK_DGRAM)
mk("inet6", socket.AF_INET6, socket.SOCK_STREAM)
mk("vsock", 40, socket.SOCK_STREAM)
mk("netlink", 16, socket.SOCK_RAW)
mk("packet", 17, socket.SOCK_DGRAM)
mk("alg", 38, socket.SOCK_SEQPACKET)
mk("unspec", 0, socket.SOCK_STREAM)
try:
    socket.socketpair(socket.AF_UNIX).__class__
    out["pair_unix"] = "created"
except OSError as e:
    out["pair_unix"] = errno.errorcode.get(e.errno, e.errno)
libc = ctypes.CDLL(None, use_errno=True)
def raw(nr, fam):
    r = libc.syscall(ctypes.c_long(nr), ctypes.c_long(fam), ctypes.c_long(1), ctypes.c_long(0))
    return "created" if r >= 0 else errno.errorcode.get(ctypes.get_errno())
fds = (ctypes.c_int * 2)()
r = libc.syscall(ctypes.c_long({socketpair}), ctypes.c_long(40), ctypes.c_long(1), ctypes.c_long(0), fds)
out["pair_vsock"] = "created" if r >= 0 else errno.errorcode.get(ctypes.get_errno())
# The kernel reads the family as a 32-bit int: high bits must not matter.
out["vsock_high_bits"] = raw({socket}, (1 << 32) | 40)
out["unix_high_bits"] = raw({socket}, (1 << 32) | 1)
print(json.dumps(out))
"#,
        socket = libc::SYS_socket,
        socketpair = libc::SYS_socketpair,
    );
    let out = last_json(&run(&rig, &code));
    for k in ["unix", "inet", "inet6", "pair_unix", "unix_high_bits"] {
        assert_eq!(out[k], "created", "{k}: {out}");
    }
    for k in [
        "vsock",
        "netlink",
        "packet",
        "alg",
        "unspec",
        "pair_vsock",
        "vsock_high_bits",
    ] {
        assert_eq!(out[k], "EAFNOSUPPORT", "{k}: {out}");
    }
}

#[cfg(target_arch = "x86_64")]
#[test]
fn x32_system_calls_kill_the_script() {
    let rig = Rig::new();
    let code = format!(
        r#"
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
print("before", flush=True)
r = libc.syscall(ctypes.c_long({getpid} | 0x40000000))
print("after", r, ctypes.get_errno(), flush=True)
"#,
        getpid = libc::SYS_getpid
    );
    let r = run(&rig, &code);
    assert_eq!(r["status"], "error", "{r}");
    assert_eq!(r["output"], "before\n", "{r}");
    assert_eq!(r["exit_code"], 128 + libc::SIGSYS, "{r}");
}

#[test]
fn dev_is_read_only_shm_is_bounded_and_there_are_no_ptys() {
    let rig = Rig::with_config("[sandbox]\ntmp_size_bytes = 8388608\n");
    let code = r#"
import errno, json, multiprocessing, os
out = {}
def attempt(name, f):
    try:
        out[name] = f()
    except OSError as e:
        out[name] = errno.errorcode.get(e.errno, e.errno)
def fill(path, mib):
    with open(path, "wb") as f:
        for _ in range(mib):
            f.write(b"x" * (1 << 20))
    return "wrote %d MiB" % mib
# Python's multiprocessing needs a writable /dev/shm for its semaphores.
attempt("mp_lock", lambda: multiprocessing.Lock().acquire() and "ok")
def queue():
    q = multiprocessing.Queue()
    q.put(41)
    return q.get(timeout=10) + 1
attempt("mp_queue", queue)
attempt("dev_file", lambda: fill("/dev/big", 16))
attempt("dev_mkdir", lambda: os.mkdir("/dev/sub") or "made")
attempt("dev_chmod_null", lambda: os.chmod("/dev/null", 0o600) or "changed")
attempt("shm", lambda: fill("/dev/shm/big", 16))
attempt("shm_rm", lambda: os.unlink("/dev/shm/big") or "removed")
attempt("ptmx", lambda: os.open("/dev/ptmx", os.O_RDWR | os.O_NOCTTY) and "opened")
attempt("openpty", lambda: os.openpty() and "opened")
attempt("pts", lambda: os.listdir("/dev/pts"))
attempt("null_w", lambda: open("/dev/null", "w").write("xyz"))
attempt("null_r", lambda: len(open("/dev/null", "rb").read()))
attempt("zero", lambda: open("/dev/zero", "rb").read(8).hex())
attempt("urandom", lambda: len(open("/dev/urandom", "rb").read(8)))
attempt("random", lambda: len(open("/dev/random", "rb").read(8)))
attempt("full", lambda: open("/dev/full", "wb", buffering=0).write(b"x"))
attempt("fd", lambda: sorted(int(f) for f in os.listdir("/dev/fd"))[:3])
attempt("stdin", lambda: len(open("/dev/stdin", "rb").read()))
attempt("stdout", lambda: open("/dev/stdout", "w").write("via /dev/stdout\n"))
attempt("stderr", lambda: open("/dev/stderr", "w").write("via /dev/stderr\n"))
print(json.dumps(out))
"#;
    let r = run(&rig, code);
    let out = last_json(&r);
    assert_eq!(out["mp_lock"], "ok", "{out}");
    assert_eq!(out["mp_queue"], 42, "{out}");
    for k in ["dev_file", "dev_mkdir"] {
        assert_eq!(out[k], "EROFS", "{k}: {out}");
    }
    assert_ne!(out["dev_chmod_null"], "changed", "{out}");
    assert_eq!(out["shm"], "ENOSPC", "/dev/shm shares /tmp's bound: {out}");
    assert_eq!(out["shm_rm"], "removed", "{out}");
    for k in ["ptmx", "openpty", "pts"] {
        assert_eq!(out[k], "ENOENT", "{k}: {out}");
    }
    assert_eq!(out["null_w"], 3, "{out}");
    assert_eq!(out["null_r"], 0, "{out}");
    assert_eq!(out["zero"], "0000000000000000", "{out}");
    assert_eq!(out["urandom"], 8, "{out}");
    assert_eq!(out["random"], 8, "{out}");
    assert_eq!(out["full"], "ENOSPC", "{out}");
    assert_eq!(out["fd"], json!([0, 1, 2]), "{out}");
    assert_eq!(out["stdin"], 0, "{out}");
    assert_eq!(out["stdout"], 16, "{out}");
    assert_eq!(out["stderr"], 16, "{out}");
    assert!(
        r["output"].as_str().unwrap().contains("via /dev/stdout\n"),
        "{r}"
    );
}

#[test]
fn sixty_four_threads_call_tools_under_the_default_limits() {
    let rig = Rig::new();
    let e = rig.engine();
    let code = r#"
import json, threading, agent_tools
N = 64
barrier = threading.Barrier(N)
results = [None] * N
def work(i):
    try:
        barrier.wait()  # all N threads exist at once
        results[i] = agent_tools.call("fleet__get_device_status", {"sn": "SN1"})
    except Exception as e:
        results[i] = repr(e)
threads = []
start_error = None
try:
    for i in range(N):
        t = threading.Thread(target=work, args=(i,))
        t.start()
        threads.append(t)
except Exception as e:
    barrier.abort()  # release the started ones
    start_error = "thread %d: %r" % (len(threads), e)
for t in threads:
    t.join()
print(json.dumps({"start_error": start_error,
                  "online": sum(1 for r in results if isinstance(r, dict) and r.get("online") is True),
                  "errors": [r for r in results if r is not None and not isinstance(r, dict)][:3]}))
"#;
    let r = e.run(&rig.token(&rig.snapshot("auto")), code, &[]);
    let out = last_json(&r);
    assert_eq!(
        out,
        json!({"start_error": null, "online": 64, "errors": []}),
        "{r}"
    );
    assert_eq!(r["calls"], 64, "{r}");
    assert_eq!(e.calls_seen().len(), 64);
}

const MIB: u64 = 1 << 20;

#[test]
fn memory_peak_and_cpu_are_the_scripts_own() {
    let rig = Rig::new();
    // The main process allocates 200 MiB and burns 300 ms of CPU.
    let r = run(
        &rig,
        r#"
import time
x = bytearray(200 << 20)
x[::4096] = b"\1" * len(range(0, len(x), 4096))
t = time.process_time()
while time.process_time() - t < 0.3:
    pass
print("done")
"#,
    );
    assert_eq!(r["status"], "ok", "{r}");
    let peak = r["memory_peak_bytes"].as_u64().unwrap();
    assert!(
        (200 * MIB..350 * MIB).contains(&peak),
        "memory_peak_bytes = {peak}: {r}"
    );
    let cpu = r["cpu_usec"].as_u64().unwrap();
    assert!(cpu >= 300_000, "cpu_usec = {cpu}: {r}");

    // A descendant that is still running (and never waited for) when the script
    // ends counts too.
    let r = run(
        &rig,
        r#"
import os, subprocess, sys
r, w = os.pipe()
child = """
import os, sys, time
x = bytearray(150 << 20)
x[::4096] = b"\\1" * len(range(0, len(x), 4096))
os.write(int(sys.argv[1]), b"k")
time.sleep(600)
"""
subprocess.Popen([sys.executable, "-c", child, str(w)], pass_fds=[w], start_new_session=True)
os.read(r, 1)
print("child allocated")
"#,
    );
    assert_eq!(r["status"], "ok", "{r}");
    let peak = r["memory_peak_bytes"].as_u64().unwrap();
    assert!(
        (150 * MIB..300 * MIB).contains(&peak),
        "memory_peak_bytes = {peak}: {r}"
    );

    // A small script reports a small peak, not the daemon's size.
    let r = run(&rig, "print('small')\n");
    let peak = r["memory_peak_bytes"].as_u64().unwrap();
    assert!(peak < 40 * MIB, "memory_peak_bytes = {peak}: {r}");

    // Killed before it could be measured: unknown, not a guess.
    let e = rig.engine();
    let mut snap = rig.snapshot("auto");
    snap["limits"] = json!({"timeout_s": 1});
    let r = e.run(&rig.token(&snap), "import time\ntime.sleep(60)\n", &[]);
    assert_eq!(r["status"], "timeout", "{r}");
    assert_eq!(r["memory_peak_bytes"], Value::Null, "{r}");
}

#[test]
fn the_sandbox_init_reaps_orphans_and_the_script_is_not_pid_1() {
    let rig = Rig::new();
    let code = r#"
import json, os, signal, subprocess, sys, time
# Twenty shells that leave a background child behind: the children are orphaned
# inside the sandbox and must be reaped there, or they pile up against tasks_max.
for _ in range(20):
    subprocess.run(["/bin/sh", "-c", "/bin/true &"])
def zombies():
    z = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                if open("/proc/%s/stat" % p).read().rsplit(")", 1)[1].split()[0] == "Z":
                    z.append(int(p))
            except OSError:
                pass
    return z
deadline = time.monotonic() + 10
while zombies() and time.monotonic() < deadline:
    time.sleep(0.05)
print(json.dumps({"pid": os.getpid(), "zombies": zombies()}), flush=True)
# An ordinary process can end itself with a signal (PID 1 could not).
os.kill(os.getpid(), signal.SIGTERM)
print("still alive", flush=True)
"#;
    let r = run(&rig, code);
    assert_eq!(r["status"], "error", "{r}");
    assert_eq!(r["exit_code"], 128 + libc::SIGTERM, "{r}");
    let out: Value = serde_json::from_str(r["output"].as_str().unwrap().lines().next().unwrap())
        .unwrap_or_else(|e| panic!("{e}: {r}"));
    assert_ne!(out["pid"], 1, "{out}");
    assert_eq!(out["zombies"], json!([]), "{out}");
}

/// Processes whose parent is this test process and that are not a daemon it
/// started: with this process a child subreaper, any sandbox process that outlives
/// the daemon's own child (the outer bwrap) lands here.
fn stray_children() -> Vec<String> {
    let me = std::process::id().to_string();
    let mut out = vec![];
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
            continue;
        };
        let Some((head, rest)) = stat.rsplit_once(") ") else {
            continue;
        };
        let comm = head.split_once(" (").map(|x| x.1).unwrap_or("");
        let f: Vec<&str> = rest.split(' ').collect();
        if f.get(1) == Some(&me.as_str()) && comm != "scriptgated" {
            out.push(format!(
                "{} {comm} {}",
                e.file_name().to_string_lossy(),
                f[0]
            ));
        }
    }
    out
}

#[test]
fn no_sandbox_process_outlives_the_outer_bwrap() {
    // SAFETY: prctl with integer arguments only.
    let rc = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    assert_eq!(rc, 0);
    let rig = Rig::new();
    let e = rig.engine();
    let token = rig.token(&rig.snapshot("auto"));
    for code in [
        "print('plain')\n",
        "import os\nos._exit(3)\n",
        "import subprocess\nsubprocess.Popen(['/bin/sleep', '600'], start_new_session=True)\n",
        "raise SystemExit('failing')\n",
    ] {
        let r = e.run(&token, code, &[]);
        assert_ne!(r["status"], "running", "{r}");
        assert_eq!(stray_children(), Vec::<String>::new(), "after {code:?}");
    }
    let id = e
        .start(&token, "import time\ntime.sleep(600)\n", &[])
        .unwrap();
    e.request("script.cancel", json!({"script_id": id}))
        .unwrap();
    assert_eq!(e.wait(&id)["status"], "cancelled");
    assert_eq!(stray_children(), Vec::<String>::new(), "after a cancel");
}
