//! The sandbox's PID 1, in Rust: both binaries (`scriptgated`, and `scriptgate`,
//! whose `run` embeds a daemon) become it when started as `BIN --sandbox-init
//! REPORT_FD PROGRAM ARGS...`, checked first thing in `main`. bwrap runs it with
//! `--as-pid-1`, from the daemon's own binary bound read-only at `MOUNT` (no
//! second program to ship). It stands in for bwrap's own init, which was dumpable
//! by the script's uid (so `/proc/1/environ` showed bwrap's environment and
//! `/proc/1/mem` opened for writing) and did not always carry the seccomp filter;
//! and it replaced a Python init with the same duties that cost a second
//! interpreter start (+40–70 ms and ~8 MB per script). It:
//!
//! - carries the seccomp filter (bwrap loads it before the exec) and makes
//!   itself non-dumpable before the script exists, which closes
//!   `/proc/1/{mem,environ,fd}` and ptrace to the script inside (it has no
//!   capability in the namespace). Not to a process of the script's uid
//!   outside: that uid owns the sandbox's user namespace, and so has every
//!   capability in it. For that, a root daemon runs the init (and Python) from
//!   an execute-only copy (`sandbox::ExecOnly`), which puts the process's mm in
//!   the host's user namespace at the exec;
//! - starts the script as an ordinary process (PID 1 drops signals it has no
//!   handler for: a script could not even SIGTERM itself), with SIGPIPE back at
//!   its default and only fds 0-4, and reaps orphans, which would otherwise pile
//!   up as zombies against tasks_max;
//! - holds none of the script's descriptors (stdio, fds 3/4), so the daemon sees
//!   them close when the script's tree does;
//! - when the script exits, kills what is left in the namespace, reaps it, and
//!   writes the tree's largest resident set, `getrusage(RUSAGE_CHILDREN)`, to
//!   REPORT_FD (close-on-exec, never the script's) as `{"max_rss_kib": N}`; then
//!   exits with the script's status (128 + signal when killed by one).

use crate::sandbox::abi::{FD_REPLIES, FD_USAGE};
use nix::sys::signal::{kill, Signal};
use nix::sys::wait::{waitpid, WaitStatus};
use nix::unistd::Pid;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The hidden argument that selects the init mode.
pub const ARG: &str = "--sandbox-init";
/// Where the daemon's binary is bound (read-only) inside the sandbox.
pub const MOUNT: &str = "/run/scriptgate-init";

/// The running binary, bound into each sandbox as its init. Resolved once: a
/// package upgrade that replaces the file leaves the path valid (and the new
/// binary has the same init mode).
pub fn exe() -> PathBuf {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    EXE.get_or_init(|| std::env::current_exe().unwrap_or_else(|_| PathBuf::from("/proc/self/exe")))
        .clone()
}

/// For the binaries' `main`: `Some(status)` when started as the sandbox init
/// (the process has then done its work), `None` otherwise.
pub fn dispatch() -> Option<i32> {
    let mut args = std::env::args_os();
    args.next();
    if args.next().as_deref() != Some(std::ffi::OsStr::new(ARG)) {
        return None;
    }
    Some(run(args.collect()))
}

fn fail(what: &str, code: i32) -> i32 {
    eprintln!("scriptgate init: {what}");
    code
}

fn run(args: Vec<OsString>) -> i32 {
    // It kills every other process it can see once the script ends: only ever
    // as PID 1 of a namespace of its own, never in the host's.
    if std::process::id() != 1 {
        return fail(
            "not PID 1 of a sandbox's PID namespace; refusing to run (this mode is for bwrap --as-pid-1 only)",
            125,
        );
    }
    let Some((report, argv)) = args
        .split_first()
        .and_then(|(r, rest)| Some((r.to_str()?.parse::<i32>().ok()?, rest)))
        .filter(|(_, rest)| !rest.is_empty())
    else {
        return fail("usage: --sandbox-init REPORT_FD PROGRAM [ARGS...]", 125);
    };
    let report = match crate::sys::inherited_fd(report) {
        Ok(fd) => fd,
        Err(e) => return fail(&format!("report descriptor {report}: {e}"), 125),
    };
    // Nothing above the tool channel reaches the script: the report (7) and
    // anything else bwrap left open are close-on-exec.
    if let Err(e) = crate::sys::cloexec_from(FD_REPLIES + 1) {
        return fail(&format!("cannot mark descriptors close-on-exec: {e}"), 125);
    }
    // Not dumpable before the script exists (see the module's doc).
    if nix::sys::prctl::set_dumpable(false).is_err() || nix::sys::prctl::get_dumpable() != Ok(false)
    {
        return fail("cannot make the sandbox init non-dumpable", 125);
    }
    let main = match std::process::Command::new(&argv[0])
        .args(&argv[1..])
        .spawn()
    {
        Ok(child) => Some(Pid::from_raw(child.id() as i32)),
        Err(e) => {
            eprintln!(
                "scriptgate init: cannot start {}: {e}",
                Path::new(&argv[0]).display()
            );
            None
        }
    };
    // Keep stderr for our own messages; stdin, stdout and the tool channel are
    // the script's alone.
    crate::sys::close_fds(0, 1);
    crate::sys::close_fds(FD_REPLIES - 1, FD_USAGE - 1);
    let status = reap(main);
    let peak = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_CHILDREN)
        .map(|u| u.max_rss())
        .unwrap_or(0);
    let _ = nix::unistd::write(&report, format!("{{\"max_rss_kib\": {peak}}}\n").as_bytes());
    match status {
        _ if main.is_none() => 127,
        Some(WaitStatus::Exited(_, code)) => code,
        Some(WaitStatus::Signaled(_, sig, _)) => 128 + sig as i32,
        _ => 255,
    }
}

/// Reap every process of the namespace until none is left; once the script
/// (`main`) has exited, kill the rest. The script's status.
fn reap(main: Option<Pid>) -> Option<WaitStatus> {
    let mut status = None;
    let mut main_done = main.is_none();
    loop {
        match waitpid(Pid::from_raw(-1), None) {
            Ok(st) => {
                if st.pid().is_some() && st.pid() == main {
                    status = Some(st);
                    main_done = true;
                }
            }
            Err(nix::errno::Errno::EINTR) => continue,
            Err(_) => break, // ECHILD: nothing left
        }
        if main_done {
            let _ = kill(Pid::from_raw(-1), Signal::SIGKILL);
        }
    }
    status
}
