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
//!   writes to REPORT_FD (close-on-exec, never the script's) the tree's largest
//!   resident set and CPU time (`getrusage(RUSAGE_CHILDREN)`) and the script's
//!   status (128 + signal when killed by one) as one line, `{"max_rss_kib": N,
//!   "status": S, "cpu_usec": C}` (the daemon may take it as the script's end,
//!   `script::pipe`); then exits with that status;
//! - ends the sandbox when the daemon is gone: REPORT_FD is the write end of a
//!   pipe whose only reader is the daemon, so the pipe reports an error (no
//!   reader left) the moment the daemon dies, however it died. The init then
//!   kills the namespace and exits, and bwrap with it. (bwrap's
//!   `--die-with-parent` is not enough: the kernel sends a parent-death signal
//!   with the dying parent's credentials, and a root daemon without CAP_KILL
//!   may not signal a process of the script's uid, so bwrap would outlive a
//!   daemon killed with SIGKILL.)

use crate::sandbox::abi::{FD_REPLIES, FD_USAGE};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::signal::{kill, SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use std::ffi::OsString;
use std::os::fd::{AsFd, BorrowedFd};
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

/// A line on stderr, whose reader is the daemon: if it is gone the line is
/// lost, never a panic.
fn say(what: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "scriptgate init: {what}");
}

fn fail(what: &str, code: i32) -> i32 {
    say(what);
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
            say(&format!(
                "cannot start {}: {e}",
                Path::new(&argv[0]).display()
            ));
            None
        }
    };
    // Keep stderr for our own messages; stdin, stdout and the tool channel are
    // the script's alone.
    crate::sys::close_fds(0, 1);
    crate::sys::close_fds(FD_REPLIES - 1, FD_USAGE - 1);
    let status = match reap(main, report.as_fd()) {
        Reaped::Ended(status) => status,
        Reaped::DaemonGone => {
            say("the daemon is gone; the sandbox ends");
            return 137;
        }
    };
    let code = match status {
        _ if main.is_none() => 127,
        Some(WaitStatus::Exited(_, code)) => code,
        Some(WaitStatus::Signaled(_, sig, _)) => 128 + sig as i32,
        _ => 255,
    };
    let usage = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_CHILDREN);
    let (peak, cpu_usec) = usage.map_or((0, 0), |u| {
        let us = |t: nix::sys::time::TimeVal| t.tv_sec() * 1_000_000 + t.tv_usec();
        (u.max_rss(), us(u.user_time()) + us(u.system_time()))
    });
    // The script's end, as the daemon takes it: nothing of the script is left
    // (every process reaped), so the result need not wait for this process's
    // own exit and the namespaces' teardown.
    let line =
        format!("{{\"max_rss_kib\": {peak}, \"status\": {code}, \"cpu_usec\": {cpu_usec}}}\n");
    let _ = nix::unistd::write(&report, line.as_bytes());
    code
}

/// How the namespace ended.
enum Reaped {
    /// Every process reaped after the script (`main`) exited: its status.
    Ended(Option<WaitStatus>),
    /// The daemon died first: everything was killed, nobody is left to tell.
    DaemonGone,
}

/// Reap every process of the namespace until none is left; once the script
/// (`main`) has exited, kill the rest. Until then, also watch `lifeline` (the
/// report pipe's write end): the error the pipe reports once the daemon, its
/// only reader, is gone ends everything at once.
fn reap(main: Option<Pid>, lifeline: BorrowedFd) -> Reaped {
    let mut status = None;
    let mut main_done = main.is_none();
    // SIGCHLD as a descriptor, so one poll waits for a child or the lifeline.
    // Blocked only here, after the script started (and std resets the mask
    // in children anyway). A child that ended before the block is reaped by
    // the first non-blocking wait below.
    let mut chld = SigSet::empty();
    chld.add(Signal::SIGCHLD);
    let sigfd = chld.thread_block().ok().and_then(|()| {
        SignalFd::with_flags(&chld, SfdFlags::SFD_NONBLOCK | SfdFlags::SFD_CLOEXEC).ok()
    });
    while !main_done {
        // Every child that has ended, without blocking.
        loop {
            match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::StillAlive) => break,
                Ok(st) => {
                    if st.pid().is_some() && st.pid() == main {
                        status = Some(st);
                        main_done = true;
                    }
                }
                Err(nix::errno::Errno::EINTR) => continue,
                Err(_) => {
                    // ECHILD: nothing left to wait for.
                    main_done = true;
                    break;
                }
            }
        }
        if main_done {
            break;
        }
        let Some(sigfd) = sigfd.as_ref() else {
            // No signalfd: wait for the script alone. bwrap's --die-with-parent
            // still ends the sandbox with a daemon of the script's uid.
            say("cannot watch the daemon (no signalfd): the sandbox may outlive a daemon killed outright");
            return Reaped::Ended(reap_blocking(main, None));
        };
        // No events asked of the lifeline: POLLERR and POLLHUP always count.
        let mut fds = [
            PollFd::new(sigfd.as_fd(), PollFlags::POLLIN),
            PollFd::new(lifeline, PollFlags::empty()),
        ];
        match poll(&mut fds, PollTimeout::NONE) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(_) => return Reaped::Ended(reap_blocking(main, None)),
        }
        let gone = fds[1]
            .revents()
            .is_some_and(|r| r.intersects(PollFlags::POLLERR | PollFlags::POLLHUP));
        if gone {
            let _ = kill(Pid::from_raw(-1), Signal::SIGKILL);
            return Reaped::DaemonGone;
        }
        // Drain the queued SIGCHLDs; the loop's top reaps their children.
        while let Ok(Some(_)) = sigfd.read_signal() {}
    }
    Reaped::Ended(reap_blocking(None, status))
}

/// Kill and reap everything left once the script has ended (or wait for
/// `main` first, when it has not): its status.
fn reap_blocking(main: Option<Pid>, mut status: Option<WaitStatus>) -> Option<WaitStatus> {
    let mut main_done = main.is_none();
    loop {
        if main_done {
            let _ = kill(Pid::from_raw(-1), Signal::SIGKILL);
        }
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
    }
    status
}
