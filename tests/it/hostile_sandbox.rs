//! An outside red team's breaks of the sandbox, each replayed through the real
//! daemon, bwrap and Python: the daemon's environment and descriptors seen through
//! `/proc`, socket families outside the network namespace (AF_VSOCK), the x32
//! syscall ABI, an unbounded writable `/dev` and the pty pool, threads under the
//! rlimit backend's address-space cap, a wrong `memory_peak_bytes`, and sandbox
//! processes left as zombies; memory outside RLIMIT_AS (memfd, SysV), the
//! daemon's descriptor bound, a refused thread that killed its script, script ids
//! in command lines, and a running script read by its uid from outside.
// The test rig forks and execs children (pre_exec, prctl, rusage): each block
// says why it is sound.
#![allow(unsafe_code)]
use crate::common::*;
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

#[test]
fn cpu_is_the_scripts_own_and_no_memory_peak_is_guessed() {
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
    let cpu = r["cpu_usec"].as_u64().unwrap();
    assert!(cpu >= 300_000, "cpu_usec = {cpu}: {r}");
    // The rlimit backend has no unit to read a peak from, and a resident-set
    // figure would under-report (tmpfs, pipe buffers and the like are in no
    // resident set): no figure at all.
    assert_eq!(r["memory_peak_bytes"], Value::Null, "{r}");

    // 48 MiB in /tmp's tmpfs and 1 MiB resident: the init's report would say
    // ~10 MiB.
    let r = run(
        &rig,
        r#"
with open("/tmp/fill", "wb") as f:
    for _ in range(48):
        f.write(b"x" * (1 << 20))
print("filled")
"#,
    );
    assert_eq!(r["status"], "ok", "{r}");
    assert_eq!(r["memory_peak_bytes"], Value::Null, "{r}");

    // Killed: unknown too.
    let e = rig.engine();
    let mut snap = rig.snapshot("auto");
    snap["limits"] = json!({"timeout_s": 1});
    let r = e.run(&rig.token(&snap), "import time\ntime.sleep(60)\n", &[]);
    assert_eq!(r["status"], "timeout", "{r}");
    assert_eq!(r["memory_peak_bytes"], Value::Null, "{r}");
}

/// Item 6: memory the rlimit backend's RLIMIT_AS cannot see. A memfd filled with
/// write(2) and never mapped, and SysV segments attached one at a time, held 6x a
/// 256 MiB memory_max_bytes. Refused by the seccomp filter; POSIX shared memory
/// (multiprocessing.shared_memory, in /dev/shm, which is /tmp) and ctypes
/// callbacks (libffi closures, which may try memfd_create first) still work.
#[test]
fn memory_outside_the_address_space_cap_is_refused() {
    let rig = Rig::new();
    let code = format!(
        r#"
import ctypes, errno, json, os
from multiprocessing import shared_memory
out = {{}}
libc = ctypes.CDLL(None, use_errno=True)
def sc(name, nr, *args):
    r = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
    out[name] = "allowed" if r >= 0 else errno.errorcode.get(ctypes.get_errno())
try:
    fd = os.memfd_create("held")
    for _ in range(64):
        os.write(fd, b"x" * (1 << 20))
    out["memfd"] = "wrote 64 MiB"
except OSError as e:
    out["memfd"] = errno.errorcode.get(e.errno)
name = ctypes.c_char_p(b"raw")
r = libc.syscall(ctypes.c_long({memfd}), name, ctypes.c_long(0))
out["memfd_raw"] = "allowed" if r >= 0 else errno.errorcode.get(ctypes.get_errno())
IPC_CREAT, IPC_RMID = 0o1000, 0
sc("shmget", {shmget}, 0, 1 << 20, IPC_CREAT | 0o600)
sc("shmat", {shmat}, 0, 0, 0)
sc("shmdt", {shmdt}, 0)
sc("shmctl", {shmctl}, 0, IPC_RMID, 0)
sc("msgget", {msgget}, 0, IPC_CREAT | 0o600)
sc("msgsnd", {msgsnd}, 0, 0, 0, 0)
sc("msgrcv", {msgrcv}, 0, 0, 0, 0, 0o4000)  # IPC_NOWAIT
sc("msgctl", {msgctl}, 0, IPC_RMID, 0)
sc("semget", {semget}, 0, 1, IPC_CREAT | 0o600)
sc("semop", {semop}, 0, 0, 0)
sc("semctl", {semctl}, 0, 0, IPC_RMID)
shm = shared_memory.SharedMemory(create=True, size=1 << 20)
shm.buf[:5] = b"hello"
other = shared_memory.SharedMemory(shm.name)
out["posix_shm"] = bytes(other.buf[:5]).decode()
other.close()
shm.close()
shm.unlink()
CB = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int)
out["callback"] = CB(lambda x: x + 1)(41)
print(json.dumps(out))
"#,
        memfd = libc::SYS_memfd_create,
        shmget = libc::SYS_shmget,
        shmat = libc::SYS_shmat,
        shmdt = libc::SYS_shmdt,
        shmctl = libc::SYS_shmctl,
        msgget = libc::SYS_msgget,
        msgsnd = libc::SYS_msgsnd,
        msgrcv = libc::SYS_msgrcv,
        msgctl = libc::SYS_msgctl,
        semget = libc::SYS_semget,
        semop = libc::SYS_semop,
        semctl = libc::SYS_semctl,
    );
    let r = run(&rig, &code);
    let out = last_json(&r);
    for k in [
        "memfd",
        "memfd_raw",
        "shmget",
        "shmat",
        "shmdt",
        "shmctl",
        "msgget",
        "msgsnd",
        "msgrcv",
        "msgctl",
        "semget",
        "semop",
        "semctl",
    ] {
        assert_eq!(out[k], "EPERM", "{k}: {out}");
    }
    assert_eq!(out["posix_shm"], "hello", "{out}");
    assert_eq!(out["callback"], 42, "{out}");
}

/// Item 8: scripts inherited the daemon's RLIMIT_NOFILE (the unit's 65536). They
/// get `scripts.nofile_max` (1024 by default): EMFILE past it, and the script
/// goes on.
#[test]
fn scripts_have_a_descriptor_bound_of_their_own() {
    let rig = Rig::new();
    let code = r#"
import errno, json, os, resource, subprocess, sys
fds, err = [], None
try:
    for _ in range(2000):
        fds.append(os.open("/dev/null", os.O_RDONLY))
except OSError as e:
    err = errno.errorcode.get(e.errno)
n = len(fds)
for f in fds:
    os.close(f)
child = subprocess.run([sys.executable, "-c",
    "import resource; print(resource.getrlimit(resource.RLIMIT_NOFILE)[1])"],
    capture_output=True, text=True).stdout.strip()
print(json.dumps({"opened": n, "error": err, "limit": resource.getrlimit(resource.RLIMIT_NOFILE),
                  "child_hard": int(child)}))
"#;
    let out = last_json(&run(&rig, code));
    assert_eq!(out["error"], "EMFILE", "{out}");
    assert_eq!(out["limit"], json!([1024, 1024]), "{out}");
    assert_eq!(out["child_hard"], 1024, "{out}");
    let n = out["opened"].as_u64().unwrap();
    assert!((1000..1024).contains(&n), "{out}");

    let rig = Rig::with_config("[scripts]\nnofile_max = 300\n");
    let out = last_json(&run(&rig, code));
    assert_eq!(out["error"], "EMFILE", "{out}");
    assert_eq!(out["limit"], json!([300, 300]), "{out}");
}

/// Item 8: a thread bomb under the rlimit backend's RLIMIT_AS. Thread stacks used
/// up the address space, the next thread was refused, and the script then died
/// ("libgcc_s.so.1 must be installed for pthread_exit to work", status `error`)
/// after catching the RuntimeError: at the interpreter's exit, its daemon threads
/// end in pthread_exit, whose unwinder glibc `dlopen`s, and there was no address
/// space left to map it. The script takes what is left (as a busy script would)
/// so that the exit finds none. 512 MiB keeps this script's share of nobody's
/// RLIMIT_NPROC (which other tests' scripts share) small.
#[test]
fn a_script_survives_its_own_refused_thread() {
    // Alone: its threads count against nobody's RLIMIT_NPROC, which the other
    // tests' scripts share.
    alone();
    let rig = Rig::new();
    let e = rig.engine();
    let mut snap = rig.snapshot("auto");
    snap["limits"] = json!({"memory_max_bytes": 512u64 << 20});
    let code = r#"
import json, mmap, threading, time
def busy():
    while True:
        time.sleep(0.001)
threads, refused = [], None
try:
    while len(threads) < 1000:
        t = threading.Thread(target=busy, daemon=True)
        t.start()
        threads.append(t)
except RuntimeError as e:
    refused = str(e)
hold, n = [None] * 100000, 0
for size in (1 << 24, 1 << 20, 1 << 16, 1 << 12):
    while n < len(hold):
        try:
            hold[n] = mmap.mmap(-1, size)
            n += 1
        except (OSError, MemoryError):
            break
print(json.dumps({"started": len(threads), "refused": refused}), flush=True)
"#;
    let r = e.run(&rig.token(&snap), code, &[]);
    let out = last_json(&r);
    assert!(
        out["refused"]
            .as_str()
            .is_some_and(|m| m.contains("can't start new thread")),
        "{r}"
    );
    assert!(out["started"].as_u64().unwrap() >= 10, "{out}");
    assert_eq!(r["exit_code"], 0, "{r}");
}

/// Start `code` (which writes `running` in the workspace and then waits for
/// `release`), wait until it runs, hand over, then release it: its result.
fn while_running(rig: &Rig, code: &str, during: impl FnOnce(&str)) -> Value {
    let e = rig.engine();
    let id = e
        .start(&rig.token(&rig.snapshot("auto")), code, &[])
        .unwrap();
    let mut ended = None;
    eventually("the script to run", Duration::from_secs(20), || {
        if rig.workspace.join("running").exists() {
            return true;
        }
        let st = e
            .request("script.status", json!({"script_id": id}))
            .unwrap();
        if st["state"] != "running" {
            ended = Some(st);
        }
        ended.is_some()
    });
    if ended.is_some() {
        panic!("the script ended before it was running: {}", e.wait(&id));
    }
    during(&id);
    std::fs::write(rig.workspace.join("release"), "").unwrap();
    e.wait(&id)
}

const WAIT_FOR_RELEASE: &str = r#"
while not os.path.exists("release"):
    time.sleep(0.02)
"#;

/// Item 3: `ps` shows every user every command line, and a script id is what
/// names its record. No id in any command line (bwrap's, the init's, Python's)
/// or environment while the script runs.
#[test]
fn no_script_id_is_in_a_command_line_or_environment() {
    let rig = Rig::new();
    let code = format!(
        "import os, subprocess, sys, time\n\
         child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n\
         open('running', 'w').write(__file__)\n{WAIT_FOR_RELEASE}child.kill()\nprint(__file__)\n"
    );
    let r = while_running(&rig, &code, |id| {
        let mut seen = vec![];
        for e in std::fs::read_dir("/proc").unwrap().flatten() {
            if !e
                .file_name()
                .to_string_lossy()
                .bytes()
                .all(|b| b.is_ascii_digit())
            {
                continue;
            }
            for f in ["cmdline", "environ", "mountinfo"] {
                if let Ok(b) = std::fs::read(e.path().join(f)) {
                    if String::from_utf8_lossy(&b).contains(id) {
                        seen.push(format!(
                            "{}/{f}: {:?}",
                            e.path().display(),
                            String::from_utf8_lossy(&b)
                        ));
                    }
                }
            }
        }
        assert_eq!(seen, Vec::<String>::new(), "script id {id}");
        // The sandbox is there all the same: bwrap, the init, Python and its child.
        let daemon = rig.daemon.as_ref().unwrap().id();
        assert!(descendants(daemon).len() >= 4, "{:?}", descendants(daemon));
    });
    assert_eq!(r["status"], "ok", "{r}");
    assert_eq!(r["output"], "/run/scriptgate-script/script.py\n", "{r}");
}

/// Item 3, "a uid per script": a process of the script's uid outside the
/// sandbox, with no key and no connection, read a running script's private /tmp
/// and listed its workspace through /proc/PID/root. The init and Python run from
/// execute-only copies: non-dumpable from their first instruction, with their
/// mm's user namespace the host's, where that process has no CAP_SYS_PTRACE.
#[test]
#[ignore = "needs root (the daemon must be root for execute-only copies, the script another uid)"]
fn a_running_script_is_closed_to_its_uid_outside_the_sandbox() {
    require_root("the daemon runs scripts as nobody from root-owned copies");
    let rig = Rig::new();
    let code = format!(
        r#"
import ctypes, json, os, sqlite3, ssl, subprocess, sys, threading, time
open("/tmp/private", "w").write("secret")
out = {{"prefix": sys.prefix, "executable": sys.executable}}
out["child"] = subprocess.run([sys.executable, "-c", "import sys; print(sys.prefix)"],
                              capture_output=True, text=True).stdout.strip()
out["sh"] = subprocess.run(["/bin/sh", "-c", "echo hi"], capture_output=True, text=True).stdout.strip()
got = []
t = threading.Thread(target=lambda: got.append(sqlite3.connect(":memory:").execute("select 6*7").fetchone()[0]))
t.start()
t.join()
out["thread"] = got
out["environ"] = os.environ["PATH"]
out["own_fds"] = sorted(int(f) for f in os.listdir("/proc/self/fd"))[:3]
# Non-dumpable: its own /proc/self files of mode 0400 are root's now.
try:
    open("/proc/self/environ", "rb").read()
    out["proc_self_environ"] = "read"
except PermissionError:
    out["proc_self_environ"] = "EACCES"
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open("running", "w").write("x")
{WAIT_FOR_RELEASE}
child.kill()
print(json.dumps(out))
"#
    );
    let probe = r#"
import json, os, sys
got = {}
for p in sys.argv[1:]:
    for what, f in [("tmp", lambda: os.listdir("/proc/%s/root/tmp" % p)),
                    ("private", lambda: open("/proc/%s/root/tmp/private" % p).read()),
                    ("environ", lambda: open("/proc/%s/environ" % p, "rb").read()[:40].decode()),
                    ("cwd", lambda: os.listdir("/proc/%s/cwd" % p)),
                    ("fd", lambda: os.listdir("/proc/%s/fd" % p))]:
        try:
            got["%s %s" % (p, what)] = f()
        except OSError as e:
            pass
print(json.dumps(got))
"#;
    let r = while_running(&rig, &code, |_| {
        let daemon = rig.daemon.as_ref().unwrap().id();
        let own_mnt = std::fs::read_link(format!("/proc/{daemon}/ns/mnt")).unwrap();
        // The sandbox's processes: the init, Python and its Python child (the
        // outer bwrap is in the host's mount namespace).
        let mnt = |p: &u32| std::fs::read_link(format!("/proc/{p}/ns/mnt")).ok();
        let inside: Vec<u32> = descendants(daemon)
            .into_iter()
            .filter(|p| mnt(p).is_some_and(|m| m != own_mnt))
            .collect();
        // The script's sandbox is the namespace whose processes work in the
        // workspace; with a pool (SCRIPTGATE_TEST_POOL), the waiting members'
        // are probed too.
        let script_ns = inside
            .iter()
            .find(|p| {
                std::fs::read_link(format!("/proc/{p}/cwd")).is_ok_and(|c| c == rig.workspace)
            })
            .and_then(mnt);
        let script_procs = inside.iter().filter(|p| mnt(p) == script_ns).count();
        assert_eq!(script_procs, 3, "init, script, child: {inside:?}");
        let inside: Vec<String> = inside.iter().map(|p| p.to_string()).collect();
        let out = {
            use std::os::unix::process::CommandExt;
            Command::new("/usr/bin/python3")
                .arg("-c")
                .arg(probe)
                .args(&inside)
                .uid(NOBODY)
                .gid(NOBODY)
                .output()
                .unwrap()
        };
        let seen: Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
        assert_eq!(seen, json!({}), "what uid {NOBODY} read of pids {inside:?}");
    });
    let out = last_json(&r);
    assert_eq!(out["prefix"], "/usr", "{out}");
    assert_eq!(out["executable"], "/usr/bin/python3", "{out}");
    assert_eq!(out["child"], "/usr", "{out}");
    assert_eq!(out["sh"], "hi", "{out}");
    assert_eq!(out["thread"], json!([42]), "{out}");
    assert_eq!(out["environ"], "/usr/local/bin:/usr/bin:/bin", "{out}");
    assert_eq!(out["own_fds"], json!([0, 1, 2]), "{out}");
    assert_eq!(out["proc_self_environ"], "EACCES", "documented: {out}");
    // daemon.info says plainly what sharing the uid still means.
    let info = rig.engine().request("daemon.info", json!({})).unwrap();
    let said = info["same_uid"].as_array().expect("daemon.info same_uid");
    let has = |needle: &str| said.iter().any(|s| s.as_str().unwrap().contains(needle));
    assert!(has("execute-only copies"), "{info}");
    assert!(has("may send signals"), "{info}");
    assert!(has("inotify instances"), "{info}");
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
    // Alone: the subreaper flag is the whole test process's, and every other
    // test's children would be this process's children too.
    alone();
    /// Clears the flag when the test ends, passed or not.
    struct Subreaper;
    impl Drop for Subreaper {
        fn drop(&mut self) {
            // SAFETY: prctl with integer arguments only.
            unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0) };
        }
    }
    // SAFETY: prctl with integer arguments only.
    let rc = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    assert_eq!(rc, 0);
    let _subreaper = Subreaper;
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
