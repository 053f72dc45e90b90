//! Where the sandbox cannot be made as usual: Ubuntu's AppArmor restriction, user
//! namespaces switched off, a container's read-only /proc/sys, cgroups the daemon
//! cannot write. The real daemon, the real bwrap where the failure can be made
//! safely (a user namespace or mount namespace of the test's own), and a stand-in
//! bwrap with the real one's words and exit code where it cannot (AppArmor).
use crate::common::*;
use serde_json::{json, Value};
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// `scriptgate status` against the rig, which must exit `code` (14: degraded,
/// 15: unavailable).
fn status(rig: &Rig, code: i32) -> String {
    let o: Output = rig.cli(["status"]);
    assert_eq!(
        o.status.code(),
        Some(code),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn info(rig: &Rig) -> Value {
    rig.engine().request("daemon.info", json!({})).unwrap()
}

/// The rig's daemon with its config text edited by `edit`, not yet started.
fn rig_with(edit: impl FnOnce(String) -> String) -> Rig {
    let mut rig = Rig::new();
    rig.stop(nix::sys::signal::Signal::SIGTERM);
    // The first daemon's lines go: `ready_line` reads the next daemon's only.
    std::fs::write(&rig.log, "").unwrap();
    let text = std::fs::read_to_string(&rig.config).unwrap();
    std::fs::write(&rig.config, edit(text)).unwrap();
    rig
}

/// Start the rig's daemon as the last arguments of `wrapper` (which must exec
/// it, so that the rig's pid is the daemon's). `between` runs once the wrapper
/// exists and before the test waits for the socket.
fn start_under(
    rig: &mut Rig,
    mut wrapper: Command,
    between: impl FnOnce(&mut std::process::Child),
) {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&rig.log)
        .unwrap();
    wrapper
        .arg(env!("CARGO_BIN_EXE_scriptgated"))
        .arg("--listen")
        .arg(&rig.socket)
        .arg("--config")
        .arg(&rig.config)
        .stdout(log.try_clone().unwrap())
        .stderr(log);
    let mut child = wrapper.spawn().unwrap();
    between(&mut child);
    rig.daemon = Some(child);
    let t0 = Instant::now();
    while UnixStream::connect(&rig.socket).is_err() {
        if let Some(st) = rig.daemon.as_mut().unwrap().try_wait().unwrap() {
            panic!("daemon exited {st}: {}", rig.log_text());
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "no socket: {}",
            rig.log_text()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The start-up line. The daemon listens before it logs it, so a connectable
/// socket does not mean the line is written yet: wait for it.
fn ready_line(rig: &Rig) -> String {
    let t0 = Instant::now();
    loop {
        let log = rig.log_text();
        if let Some(l) = log.lines().rev().find(|l| l.contains("scriptgated ready")) {
            return l.to_string();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "no ready line: {log}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Everything said about one bwrap failure: the start-up line, daemon.info,
/// `scriptgate status`, and the result of a script that hits it. Each has the
/// one-line diagnosis; the raw words come after it, never alone.
fn assert_diagnosed(rig: &Rig, diagnosis: &str, raw: &str) {
    let line = ready_line(rig);
    assert!(
        line.contains(" ERROR ") && line.contains("); no script can run until this is fixed"),
        "a sandbox that cannot be made is an error: {line}"
    );
    assert!(
        line.contains(&format!("{diagnosis} (bwrap said: {raw})")),
        "{line}"
    );
    let i = info(rig);
    assert_eq!(i["sandbox"]["state"], "unavailable", "{i}");
    assert_eq!(i["sandbox"]["problem"], diagnosis, "{i}");
    assert_eq!(i["sandbox"]["detail"], raw, "{i}");
    let st = status(rig, 15);
    assert!(
        st.contains(&format!("{diagnosis} (bwrap said: {raw})")),
        "{st}"
    );
    assert_eq!(st.matches(diagnosis).count(), 1, "said once: {st}");
    assert!(
        st.lines().any(|l| l.starts_with("state")
            && l.ends_with(
                "unavailable: no script can run: the sandbox cannot be made (see sandbox)"
            )),
        "{st}"
    );
    let r = rig
        .engine()
        .run(&rig.token(&rig.snapshot("auto")), "print('never')", &[]);
    assert_eq!(r["status"], "error", "{r}");
    assert_eq!(r["error"], format!("{diagnosis}\n{raw}"), "{r}");
    assert!(
        r["text"]
            .as_str()
            .unwrap()
            .contains(&format!("error: {diagnosis}\n{raw}")),
        "{r}"
    );
}

/// Ubuntu ≥ 23.10 cannot be had here: a stand-in `sandbox.bwrap` fails as bwrap
/// 0.9 does there with `--unshare-net` (issue reports from Ubuntu 24.04; see
/// `preflight`): the parent reports the child's pid on --info-fd, the child's
/// loopback setup fails with EPERM, and bwrap exits 1.
#[test]
fn ubuntu_apparmor_restriction_is_diagnosed_everywhere() {
    let mut rig = rig_with(|t| t);
    let fake = rig.dir.path().join("bwrap-ubuntu");
    std::fs::write(
        &fake,
        "#!/bin/sh\n\
         # bwrap 0.9 on Ubuntu 24.04, kernel.apparmor_restrict_unprivileged_userns=1\n\
         { printf '{\\n    \"child-pid\": %d\\n}\\n' $$ >&5; } 2>/dev/null\n\
         echo 'bwrap: loopback: Failed RTM_NEWADDR: Operation not permitted' >&2\n\
         exit 1\n",
    )
    .unwrap();
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
    let text = std::fs::read_to_string(&rig.config).unwrap();
    let text = text.replace("[sandbox]\n", &format!("[sandbox]\nbwrap = {fake:?}\n"));
    std::fs::write(&rig.config, text).unwrap();
    rig.start();
    assert_diagnosed(
        &rig,
        "sandbox unavailable: AppArmor denies the sandbox its user namespace \
         (kernel.apparmor_restrict_unprivileged_userns=1, the default since Ubuntu 23.10, or a profile confining bwrap); \
         fix: load the profile scriptgate ships, `apparmor_parser -r /etc/apparmor.d/scriptgated`, \
         then restart scriptgated",
        "bwrap: loopback: Failed RTM_NEWADDR: Operation not permitted",
    );
}

/// The real failure: the daemon runs as root of a user namespace of its own, in
/// which user.max_user_namespaces is 0 (the host's stays as it is), so the real
/// bwrap, as nobody, gets ENOSPC for its namespace.
#[test]
#[ignore = "needs root: maps uids 0-65535 into a user namespace"]
fn max_user_namespaces_zero_is_diagnosed_with_the_real_bwrap() {
    require_root("writes a user namespace's uid_map");
    let host_max = std::fs::read_to_string("/proc/sys/user/max_user_namespaces").unwrap();
    let mut rig = rig_with(|t| t);
    let mut wrapper = Command::new("unshare");
    wrapper.args([
        "--user",
        "--",
        "sh",
        "-c",
        // sh lost its capabilities at its exec (its uid was not mapped yet); the
        // second exec, as uid 0 of the namespace, has them all there.
        "read go && exec sh -c 'echo 0 > /proc/sys/user/max_user_namespaces && exec \"$@\"' sh \"$@\"",
        "sh",
    ]);
    wrapper.stdin(Stdio::piped());
    start_under(&mut rig, wrapper, |child| {
        let pid = child.id();
        // Written from outside, by root of the parent namespace: the whole range.
        let map = |f: &str| {
            let p = format!("/proc/{pid}/{f}");
            let t0 = Instant::now();
            // unshare writes nothing itself; wait until it has made the namespace.
            while std::fs::read_link(format!("/proc/{pid}/ns/user")).unwrap()
                == std::fs::read_link("/proc/self/ns/user").unwrap()
            {
                assert!(t0.elapsed() < Duration::from_secs(10));
                std::thread::sleep(Duration::from_millis(5));
            }
            std::fs::write(p, "0 0 65536\n").unwrap();
        };
        map("uid_map");
        map("gid_map");
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(b"go\n").unwrap();
    });
    assert_diagnosed(
        &rig,
        "sandbox unavailable: user namespaces are switched off (user.max_user_namespaces=0); \
         fix: `sysctl -w user.max_user_namespaces=15000`, and keep it in a file in /etc/sysctl.d/",
        "bwrap: Creating new namespace failed: nesting depth or /proc/sys/user/max_*_namespaces exceeded (ENOSPC)",
    );
    assert_eq!(
        std::fs::read_to_string("/proc/sys/user/max_user_namespaces").unwrap(),
        host_max,
        "the host's sysctl is untouched"
    );
}

/// The real failure: in a chroot the kernel refuses CLONE_NEWUSER with EPERM (as
/// a container's seccomp profile does), and bwrap says "No permissions".
#[test]
#[ignore = "needs root: a private mount namespace and a chroot"]
fn a_refused_user_namespace_is_diagnosed_with_the_real_bwrap() {
    require_root("mounts and chroots in a private mount namespace");
    let mut rig = rig_with(|t| t);
    let root = rig.dir.path().join("chroot");
    std::fs::create_dir(&root).unwrap();
    let mut wrapper = Command::new("unshare");
    wrapper.args(["--mount", "--propagation", "private", "--", "sh", "-c"]);
    wrapper.arg(format!(
        "mount --rbind / {r} && exec chroot {r} \"$@\"",
        r = root.display()
    ));
    wrapper.arg("sh");
    start_under(&mut rig, wrapper, |_| {});
    let line = ready_line(&rig);
    let bwrap_says = "bwrap: No permissions to create";
    assert!(
        line.contains(
            "sandbox unavailable: a security policy refuses the sandbox its user namespace"
        ),
        "{line}"
    );
    assert!(
        line.contains("or run scriptgated outside the chroot"),
        "{line}"
    );
    assert!(
        line.contains(&format!("(bwrap said: {bwrap_says}")),
        "{line}"
    );
    let r = rig
        .engine()
        .run(&rig.token(&rig.snapshot("auto")), "print('never')", &[]);
    let err = r["error"].as_str().unwrap();
    let (first, raw) = err.split_once('\n').unwrap();
    assert_eq!(first, info(&rig)["sandbox"]["problem"], "{r}");
    assert!(raw.starts_with(bwrap_says), "{r}");
}

/// A container's read-only /proc/sys: bwrap --disable-userns cannot set
/// user.max_user_namespaces there ("cannot open ...: Read-only file system"), so
/// the preflight drops the flag, scripts run, and the seccomp filter alone keeps
/// them from making a user namespace (clone and unshare: EPERM; clone3: ENOSYS).
///
/// The daemon runs in a private mount namespace where /proc/sys is bound
/// read-only over itself. A second, whole proc instance is mounted aside, as a
/// container runtime leaves one visible: without any fully visible proc the
/// kernel refuses bwrap its `--proc` (that failure has its own diagnosis).
#[test]
#[ignore = "needs root: mounts in a private mount namespace"]
fn read_only_proc_sys_runs_scripts_that_still_cannot_make_a_user_namespace() {
    require_root("mounts in a private mount namespace");
    let mut rig = rig_with(|t| t);
    let aside = rig.dir.path().join("proc-aside");
    std::fs::create_dir(&aside).unwrap();
    let mut wrapper = Command::new("unshare");
    wrapper.args(["--mount", "--propagation", "private", "--", "sh", "-c"]);
    wrapper.arg(format!(
        "mount -t proc proc {a} && mount --bind /proc/sys /proc/sys && \
         mount -o remount,bind,ro /proc/sys && exec \"$@\"",
        a = aside.display()
    ));
    wrapper.arg("sh");
    start_under(&mut rig, wrapper, |_| {});
    let line = ready_line(&rig);
    assert!(
        line.contains("sandbox ok (nested user namespaces: the seccomp filter alone, as --disable-userns cannot be used here)"),
        "{line}"
    );
    let i = info(&rig);
    assert_eq!(i["sandbox"]["state"], "ok", "{i}");
    assert_eq!(i["sandbox"]["nested_userns"], "seccomp", "{i}");
    let code = r#"
import ctypes, json, os, subprocess, threading
libc = ctypes.CDLL(None, use_errno=True)
out = {}
def attempt(name, f):
    r = f()
    out[name] = "made" if r >= 0 else os.strerror(ctypes.get_errno())
NEWUSER, NEWNS, SIGCHLD = 0x10000000, 0x00020000, 17
attempt("unshare_user", lambda: libc.unshare(NEWUSER))
attempt("unshare_mount", lambda: libc.unshare(NEWNS))
# clone(2) raw: x86_64's number is 56, aarch64's and riscv64's 220.
nr = {"x86_64": 56, "aarch64": 220, "riscv64": 220}[os.uname().machine]
def clone_user():
    r = libc.syscall(nr, NEWUSER | SIGCHLD, 0, 0, 0, 0)
    if r == 0:
        os._exit(0)
    return r
attempt("clone_user", clone_user)
nr3 = 435
attempt("clone3", lambda: libc.syscall(nr3, 0, 0))
# The sysctl bwrap would have set: not set here (the filter does the work).
out["max_user_namespaces"] = open("/proc/sys/user/max_user_namespaces").read().strip()
t = threading.Thread(target=lambda: out.__setitem__("thread", "ran")); t.start(); t.join()
out["subprocess"] = subprocess.run(["/bin/echo", "hi"], capture_output=True, text=True).stdout.strip()
print(json.dumps(out))
"#;
    let r = rig
        .engine()
        .run(&rig.token(&rig.snapshot("auto")), code, &[]);
    assert_eq!(r["status"], "ok", "{r}");
    let out: Value = serde_json::from_str(r["output"].as_str().unwrap().trim()).unwrap();
    assert_eq!(out["unshare_user"], "Operation not permitted", "{out}");
    assert_eq!(out["unshare_mount"], "Operation not permitted", "{out}");
    assert_eq!(out["clone_user"], "Operation not permitted", "{out}");
    assert_eq!(out["clone3"], "Function not implemented", "{out}");
    assert_ne!(
        out["max_user_namespaces"], "1",
        "--disable-userns was not used: {out}"
    );
    assert_eq!(out["thread"], "ran", "{out}");
    assert_eq!(out["subprocess"], "hi", "{out}");
}

/// The cgroup backend over a cgroupfs that takes every write and enforces
/// nothing (a tmpfs over /sys/fs/cgroup, in a private mount namespace): the
/// read-back finds each script in its real cgroups, not in its leaf. Loud at
/// start, in daemon.info, in status and in each result; refused when required.
#[test]
#[ignore = "needs root: mounts in a private mount namespace"]
fn limits_not_in_force_are_loud_and_refused_when_required() {
    require_root("mounts in a private mount namespace");
    let start = |rig: &mut Rig| {
        let mut wrapper = Command::new("unshare");
        wrapper.args(["--mount", "--propagation", "private", "--", "sh", "-c"]);
        wrapper.arg(
            "mount -t tmpfs fake /sys/fs/cgroup && cd /sys/fs/cgroup && \
             echo 'cpu memory pids' > cgroup.controllers && : > cgroup.subtree_control && \
             : > cgroup.procs && exec \"$@\"",
        );
        wrapper.arg("sh");
        start_under(rig, wrapper, |_| {});
    };
    let mut rig = rig_with(|t| t.replace("backend = \"rlimit\"", "backend = \"cgroup\""));
    start(&mut rig);
    let line = ready_line(&rig);
    assert!(line.contains(" WARN "), "{line}");
    assert!(
        line.contains("(backend cgroup; as configured; LIMITS NOT ENFORCED: memory_max_bytes = "),
        "{line}"
    );
    assert!(line.contains("not in its own script-preflight-"), "{line}");
    let i = info(&rig);
    assert_eq!(i["limits_enforced"], false, "{i}");
    let notes: Vec<String> = serde_json::from_value(i["backend_notes"].clone()).unwrap();
    assert!(
        notes.iter().any(|n| n.starts_with(
            "memory_max_bytes = 1073741824 is not in force: the script is in memory cgroup "
        )),
        "{notes:?}"
    );
    assert!(
        notes.iter().any(|n| n.starts_with("tasks_max = ")),
        "{notes:?}"
    );
    let st = status(&rig, 14);
    assert!(st.contains("LIMITS NOT ENFORCED"), "{st}");
    assert!(
        st.lines().any(|l| l.starts_with("state")
            && l.ends_with("degraded: limits are not in force (see backend); the bound on all scripts together is not in force (see total)")),
        "{st}"
    );
    // The total's files on the fake tree take the writes, but no controller
    // is enabled there: not in force either, and said why.
    assert!(
        st.lines().any(|l| l.starts_with("total ")
            && l.contains(": NOT in force, total_memory_max_bytes = ")
            && l.contains("the memory controller is not enabled for /sys/fs/cgroup/scripts")),
        "{st}"
    );
    // Not required: the script runs, and its result says what was not in force.
    let r = rig
        .engine()
        .run(&rig.token(&rig.snapshot("auto")), "print('ran')", &[]);
    assert_eq!(r["status"], "ok", "{r}");
    let notes = r["backend_notes"].as_array().unwrap();
    assert!(
        notes[0]
            .as_str()
            .unwrap()
            .starts_with("memory_max_bytes = "),
        "{r}"
    );
    assert!(
        notes[0]
            .as_str()
            .unwrap()
            .contains(", not in its own script-"),
        "{r}"
    );

    // Required: refused before anything runs, with the reason.
    rig.stop(nix::sys::signal::Signal::SIGTERM);
    // The first daemon's lines go: `ready_line` reads the next daemon's only.
    std::fs::write(&rig.log, "").unwrap();
    let text = std::fs::read_to_string(&rig.config).unwrap();
    let text = text.replace(
        "backend = \"cgroup\"",
        "backend = \"cgroup\"\nrequire_enforced_limits = true",
    );
    std::fs::write(&rig.config, text).unwrap();
    start(&mut rig);
    let line = ready_line(&rig);
    assert!(
        line.contains(" ERROR "),
        "no script can run: an error: {line}"
    );
    let st = status(&rig, 15);
    assert!(
        st.lines().any(|l| l.starts_with("state")
            && l.contains("unavailable: no script can run: the limits sandbox.require_enforced_limits requires")),
        "{st}"
    );
    let e = rig
        .engine()
        .start(&rig.token(&rig.snapshot("auto")), "print('never')", &[])
        .unwrap_err();
    assert_eq!(
        code_reason(&e),
        (-32603, "limits_not_enforced".to_string()),
        "{e}"
    );
    let msg = e["message"].as_str().unwrap();
    assert!(
        msg.starts_with("limits not enforced: memory_max_bytes = "),
        "{msg}"
    );
    assert!(
        msg.contains("sandbox.require_enforced_limits = true"),
        "{msg}"
    );
    let recorded = std::fs::read_dir(rig.workspace.join(".agent/scripts"))
        .unwrap()
        .count();
    assert_eq!(recorded, 1, "only the first script left a record");
}
