//! Spawning and supervising one script: the sandbox child, its output, its end.

use crate::broker::Broker;
use crate::limits::{Backend, Placement};
use crate::policy::Limits;
use crate::protocol::Status;
use crate::sandbox::{
    bwrap_args, parse_usage_report, RealHost, SandboxSpec, FD_AGENT, FD_GATE, FD_INFO, FD_REPLIES,
    FD_REQUESTS, FD_SECCOMP, FD_USAGE, FD_WORKSPACE,
};
use crate::sys::{
    channel_pipe, dup_high, give_pipe, install_cloexec_above_fixed, install_pre_exec, wait_child,
    ChildSetup, Exit, Identity, PidFd, Spawner,
};
use std::io::Write;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::AsyncReadExt;
use tokio::sync::watch;

/// Why the supervisor should stop a script early.
#[derive(Debug, Clone, PartialEq)]
pub enum Stop {
    Cancel(String),
    Interrupt,
}

pub struct Launch {
    pub bwrap: PathBuf,
    pub sandbox: SandboxSpec,
    /// The workspace and its `.agent`, opened by the daemon; bwrap binds these.
    pub workspace_dir: std::os::fd::OwnedFd,
    pub agent_dir: std::os::fd::OwnedFd,
    pub identity: Option<Identity>,
    pub limits: Limits,
    pub backend: Backend,
    pub stdout_file: std::fs::File,
    pub stderr_file: std::fs::File,
    pub output_max_bytes: u64,
    pub return_max_chars: usize,
}

/// What the supervisor observed; the daemon turns it into the result object.
#[derive(Debug)]
pub struct Ended {
    pub status: Status,
    pub exit_code: Option<i32>,
    pub duration_ms: u64,
    pub output: String,
    pub output_truncated: bool,
    pub error: Option<String>,
    /// The unit's peak; else (rlimit backend) the largest resident set of any
    /// process of the script's tree, as the sandbox init reports it. None when the
    /// script was killed (timeout, cancel) before the init could report: the
    /// outer bwrap's rusage is no substitute, as it counts the daemon's own
    /// resident set at the fork.
    pub memory_peak_bytes: Option<u64>,
    pub cpu_usec: Option<u64>,
}

/// How much of stderr is kept for the result's `error`.
const STDERR_TAIL_BYTES: usize = 4000;

struct Captured {
    head: Vec<u8>,
    tail: Vec<u8>,
    total: u64,
}

/// Copy a child stream to its artifact file (up to `max_file` bytes, then a note of
/// how much was dropped), keeping the first `head_max` and last `tail_max` bytes.
async fn capture<R: tokio::io::AsyncRead + Unpin>(
    mut r: R,
    mut file: std::fs::File,
    max_file: u64,
    head_max: usize,
    tail_max: usize,
) -> Captured {
    let mut c = Captured {
        head: Vec::new(),
        tail: Vec::new(),
        total: 0,
    };
    let mut buf = vec![0u8; 64 * 1024];
    let mut written = 0u64;
    loop {
        let n = match r.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let chunk = &buf[..n];
        c.total += n as u64;
        if written < max_file {
            let k = ((max_file - written) as usize).min(n);
            if file.write_all(&chunk[..k]).is_ok() {
                written += k as u64;
            }
        }
        if c.head.len() < head_max {
            let k = (head_max - c.head.len()).min(n);
            c.head.extend_from_slice(&chunk[..k]);
        }
        if tail_max > 0 {
            c.tail.extend_from_slice(chunk);
            if c.tail.len() > tail_max * 2 {
                c.tail.drain(..c.tail.len() - tail_max);
            }
        }
    }
    if c.total > written {
        let _ = writeln!(file, "\n[scriptgate: {} more bytes were printed and dropped; the limit is output_max_bytes = {max_file}]", c.total - written);
    }
    if c.tail.len() > tail_max {
        c.tail.drain(..c.tail.len() - tail_max);
    }
    c
}

/// Read bwrap's `--info-fd` JSON (`{"child-pid": N, …}`). The sandbox inherits the
/// pipe's write end, so parse as soon as the object is complete rather than at EOF.
async fn read_child_pid(fd: std::os::fd::OwnedFd) -> Option<i32> {
    let mut r = tokio::net::unix::pipe::Receiver::from_owned_fd(fd).ok()?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 512];
    while buf.len() < 4096 {
        match r.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
        if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&buf) {
            return v.get("child-pid")?.as_i64().map(|p| p as i32);
        }
    }
    None
}

/// First `max` characters of `bytes` (lossy UTF-8), and whether anything was cut.
fn head_chars(bytes: &[u8], total_bytes: u64, max: usize) -> (String, bool) {
    let s = String::from_utf8_lossy(bytes);
    match s.char_indices().nth(max) {
        Some((i, _)) => (s[..i].to_string(), true),
        None => (s.into_owned(), total_bytes > bytes.len() as u64),
    }
}

/// The gate: a shell that waits for "go" on `FD_GATE` before it execs bwrap, so
/// that the sandbox's first instruction already runs inside its unit. (A gate in
/// `pre_exec` would deadlock: spawning waits for the exec.) Closed without "go", it
/// exits 125.
fn gate_script() -> String {
    format!(
        r#"IFS= read -r go <&{FD_GATE} && [ "$go" = go ] || exit 125; exec {FD_GATE}<&-; exec "$0" "$@""#
    )
}

/// A process that holds a systemd scope (and its counters) until they are read.
fn keeper(identity: Option<Identity>) -> std::process::Command {
    let sleep = ["/usr/bin/sleep", "/bin/sleep"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
        .unwrap_or("sleep");
    let mut k = std::process::Command::new(sleep);
    k.arg("infinity")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    install_pre_exec(
        &mut k,
        ChildSetup {
            identity,
            rlimits: vec![],
            dups: vec![],
            parent_pid: std::process::id() as libc::pid_t,
        },
    );
    k
}

/// Read the sandbox init's usage report (see `sandbox::INIT`). Only the init holds
/// the write end, so EOF comes when it exits; it writes nothing when it is killed.
async fn read_usage(fd: std::os::fd::OwnedFd) -> Option<u64> {
    let mut r = tokio::net::unix::pipe::Receiver::from_owned_fd(fd).ok()?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 256];
    while buf.len() < 1024 {
        match r.read(&mut chunk).await {
            Ok(0) | Err(_) => break,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
    parse_usage_report(&buf)
}

/// Start the sandbox and supervise it to its end. `started` is answered once the
/// child exists (the script is then `running`) or could not be spawned.
pub async fn run(
    spawner: &Spawner,
    launch: Launch,
    broker: Arc<Broker>,
    mut stop: watch::Receiver<Option<Stop>>,
    started: tokio::sync::oneshot::Sender<Result<(), String>>,
) -> Result<Ended, std::io::Error> {
    use std::os::fd::AsRawFd;
    let t0 = Instant::now();
    let script_id = broker.script_id.clone();
    let (req_r, req_w) = channel_pipe()?; // script writes fd 3, we read
    let (rep_r, rep_w) = channel_pipe()?; // we write, script reads fd 4
    let (info_r, info_w) = channel_pipe()?; // bwrap writes the sandbox init's pid on fd 5
                                            // fd 7: the seccomp program, already in the pipe (a few KiB) for bwrap to read.
    let (seccomp_r, seccomp_w) = channel_pipe()?;
    let program = crate::seccomp::cached().map_err(std::io::Error::other)?;
    std::io::Write::write_all(&mut std::fs::File::from(seccomp_w), program)?;
    let (ws_fd, agent_fd) = (
        dup_high(&launch.workspace_dir)?,
        dup_high(&launch.agent_dir)?,
    );
    let (usage_r, usage_w) = channel_pipe()?; // the sandbox init reports on fd 7
    let mut dups = vec![
        (req_w.as_raw_fd(), FD_REQUESTS),
        (rep_r.as_raw_fd(), FD_REPLIES),
        (info_w.as_raw_fd(), FD_INFO),
        (usage_w.as_raw_fd(), FD_USAGE),
        (seccomp_r.as_raw_fd(), FD_SECCOMP),
        (ws_fd.as_raw_fd(), FD_WORKSPACE),
        (agent_fd.as_raw_fd(), FD_AGENT),
    ];
    let gate = if launch.backend.needs_gate() {
        Some(channel_pipe()?)
    } else {
        None
    };
    let mut cmd = match &gate {
        Some((gate_r, _)) => {
            dups.push((gate_r.as_raw_fd(), FD_GATE));
            let mut c = std::process::Command::new("/bin/sh");
            c.arg("-c").arg(gate_script()).arg(&launch.bwrap);
            c
        }
        None => std::process::Command::new(&launch.bwrap),
    };
    // stdout/stderr: pipes the script's uid owns, so /dev/stdout works inside.
    let (out_r, out_w) = channel_pipe()?;
    let (err_r, err_w) = channel_pipe()?;
    if let Some(id) = launch.identity {
        give_pipe(&out_w, id)?;
        give_pipe(&err_w, id)?;
    }
    // No environment: bwrap (and the gate shell) would otherwise carry the
    // daemon's, and bwrap's --clearenv clears only the sandboxed child's.
    cmd.env_clear()
        .args(bwrap_args(&launch.sandbox, &RealHost))
        .stdin(Stdio::null())
        .stdout(Stdio::from(out_w))
        .stderr(Stdio::from(err_w));
    let parent_pid = std::process::id() as libc::pid_t;
    install_pre_exec(
        &mut cmd,
        ChildSetup {
            identity: launch.identity,
            rlimits: launch.backend.rlimits(&launch.limits),
            dups,
            parent_pid,
        },
    );
    install_cloexec_above_fixed(&mut cmd);
    let child = match spawner.spawn(cmd).await {
        Ok(c) => c,
        Err(e) => {
            let _ = started.send(Err(format!("{}: {e}", launch.bwrap.display())));
            return Err(e);
        }
    };
    // Until the reaper below reaps it, this pid cannot be reused: the pidfd is exact.
    let pid = child.id() as i32;
    let bwrap = PidFd::open(pid);
    let mut exited = wait_child(pid);
    let _ = started.send(Ok(()));
    // Our copies of the child's ends must go, or fd 3 would never reach EOF.
    // (`cmd`, holding stdout/stderr's write ends, was consumed by the spawn.)
    drop((req_w, rep_r, info_w, seccomp_r, usage_w, ws_fd, agent_fd));
    drop((launch.workspace_dir, launch.agent_dir));
    drop(child);
    let input = tokio::net::unix::pipe::Receiver::from_owned_fd(req_r)?;
    let output = tokio::net::unix::pipe::Sender::from_owned_fd(rep_w)?;
    let mut broker_task = tokio::spawn(broker.clone().serve(input, output));
    let head_max = launch.return_max_chars.saturating_mul(4).saturating_add(4);
    let pipe = tokio::net::unix::pipe::Receiver::from_owned_fd;
    let out_task = tokio::spawn(capture(
        pipe(out_r)?,
        launch.stdout_file,
        launch.output_max_bytes,
        head_max,
        0,
    ));
    let err_task = tokio::spawn(capture(
        pipe(err_r)?,
        launch.stderr_file,
        launch.output_max_bytes,
        0,
        STDERR_TAIL_BYTES,
    ));

    // Into the unit, then through the gate. A keeper holds a systemd scope open.
    let mut keeper_proc = None;
    let mut setup_error = None;
    let mut placement = Placement::None;
    if let Some((gate_r, gate_w)) = gate {
        drop(gate_r);
        let mut pids = vec![pid as u32];
        if launch.backend.needs_keeper() {
            match spawner.spawn(keeper(launch.identity)).await {
                Ok(k) => {
                    let kpid = k.id() as i32;
                    pids.push(kpid as u32);
                    keeper_proc = Some((PidFd::open(kpid), wait_child(kpid)));
                }
                Err(e) => setup_error = Some(format!("cannot start the scope keeper: {e}")),
            }
        }
        if setup_error.is_none() {
            match launch
                .backend
                .place(&script_id, &launch.limits, &pids)
                .await
            {
                Ok(p) => {
                    placement = p;
                    let mut w = std::fs::File::from(gate_w);
                    let _ = std::io::Write::write_all(&mut w, b"go\n");
                }
                Err(e) => {
                    setup_error = Some(format!(
                        "cannot place the script in its {} unit: {e}",
                        launch.backend.kind.as_str()
                    ))
                }
            }
        }
        // gate_w is dropped here: without "go" the gate exits 125.
    }

    // bwrap reports the sandbox's PID 1 once it exists; hold it by pidfd. If bwrap
    // fails before that, the pipe closes and its stderr says why.
    let sandbox_init = tokio::time::timeout(Duration::from_secs(10), read_child_pid(info_r))
        .await
        .ok()
        .flatten()
        .and_then(|pid| PidFd::open(pid).ok());
    let timeout = Duration::from_secs(launch.limits.timeout_s);
    let stopped = async {
        loop {
            if let Some(s) = stop.borrow_and_update().clone() {
                return s;
            }
            if stop.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    };
    let (early, exit) = tokio::select! {
        st = &mut exited => (None, st.ok().and_then(Result::ok)),
        _ = tokio::time::sleep(timeout) => (Some(None), None),
        s = stopped => (Some(Some(s)), None),
    };
    let exit = match exit {
        Some(e) => Some(e),
        None => {
            // Killing the sandbox's PID 1 makes the kernel kill every process in its
            // namespace, setsid'd ones included; the outer bwrap then reaps it and
            // exits. Killing bwrap as well would orphan the dying init (a zombie of
            // whoever inherits it), so bwrap is killed only when the init is
            // unknown or bwrap outlasts it; then the unit.
            let init_killed = match &sandbox_init {
                Some(init) => match init.kill() {
                    Ok(()) => true,
                    Err(e) => {
                        tracing::warn!(script_id = %script_id, "cannot kill the sandbox init: {e}");
                        false
                    }
                },
                None => false,
            };
            let grace = Duration::from_secs(if init_killed { 5 } else { 0 });
            let exit = match tokio::time::timeout(grace, &mut exited).await {
                Ok(r) => r.ok().and_then(Result::ok),
                Err(_) => {
                    if let Ok(b) = &bwrap {
                        let _ = b.kill();
                    }
                    placement.kill();
                    exited.await.ok().and_then(Result::ok)
                }
            };
            placement.kill();
            exit
        }
    };
    // The init has exited (bwrap waited for it), so its report is complete.
    let usage = tokio::time::timeout(Duration::from_secs(5), read_usage(usage_r))
        .await
        .ok()
        .flatten();
    // The unit's word on how it ended, read while the keeper still holds it.
    let outcome = placement.finish().await;
    if let Some((kfd, kexit)) = keeper_proc {
        if let Ok(k) = kfd {
            let _ = k.kill();
        }
        let _ = kexit.await;
    }
    // The namespace is gone, so the pipes reach EOF promptly; bound the wait anyway.
    let grace = Duration::from_secs(5);
    let out = tokio::time::timeout(grace, out_task)
        .await
        .ok()
        .and_then(Result::ok);
    let err = tokio::time::timeout(grace, err_task)
        .await
        .ok()
        .and_then(Result::ok);
    // The broker ends by itself once fd 3 is closed (after a short grace for
    // calls still at the engine); if it does not, abort it: its cancelled calls are
    // still logged and counted.
    if tokio::time::timeout(grace * 2, &mut broker_task)
        .await
        .is_err()
    {
        tracing::warn!(script_id = %script_id, "broker did not stop after the script ended");
        broker_task.abort();
        let _ = broker_task.await;
    }
    let exit_code = exit.and_then(|e| e.code);
    let stderr_tail = err
        .map(|c| String::from_utf8_lossy(&c.tail).trim_end().to_string())
        .unwrap_or_default();
    let (output, output_truncated) = match &out {
        Some(c) => head_chars(&c.head, c.total, launch.return_max_chars),
        None => (String::new(), false),
    };
    let uncaught = broker.live.uncaught.lock().unwrap().clone();
    let unit = launch.backend.unit_for(&script_id).unwrap_or_default();
    let (status, error) = match early {
        Some(None) => (
            Status::Timeout,
            Some(format!(
                "the script ran longer than timeout_s = {} and was killed",
                launch.limits.timeout_s
            )),
        ),
        Some(Some(Stop::Cancel(why))) => (Status::Cancelled, Some(why)),
        Some(Some(Stop::Interrupt)) => (
            Status::Interrupted,
            Some("the daemon stopped while the script ran".into()),
        ),
        None if setup_error.is_some() => (Status::Error, setup_error),
        // The unit's counters decide, not the exit signal.
        None if outcome.stats.oom_killed => (
            Status::Oom,
            Some(format!(
                "the script ran out of memory (memory_max_bytes = {}) and was killed",
                launch.limits.memory_max_bytes
            )),
        ),
        None if outcome.stopped_externally => (
            Status::Cancelled,
            Some(format!(
                "stopped from outside scriptgate (systemctl stop {unit})"
            )),
        ),
        None if exit_code == Some(0) => (Status::Ok, None),
        None => {
            let status = if uncaught.as_deref() == Some("limit") {
                Status::Limit
            } else {
                Status::Error
            };
            let error = if stderr_tail.is_empty() {
                match exit {
                    Some(Exit { code: Some(c), .. }) => format!("exit code {c}"),
                    Some(Exit {
                        signal: Some(s), ..
                    }) => format!("killed by signal {s}"),
                    _ => "the sandbox ended without an exit status".into(),
                }
            } else {
                stderr_tail
            };
            (status, Some(error))
        }
    };
    Ok(Ended {
        status,
        exit_code,
        duration_ms: t0.elapsed().as_millis() as u64,
        output,
        output_truncated,
        error,
        // The unit's counters when it has them, else the init's report (never the
        // outer bwrap's ru_maxrss: that is the daemon's size at the fork).
        memory_peak_bytes: outcome.stats.memory_peak_bytes.or(usage),
        // bwrap reaps the init, which reaps the whole namespace: its rusage covers
        // every process of the sandbox.
        cpu_usec: outcome.stats.cpu_usec.or(exit.map(|e| e.cpu_usec)),
    })
}

#[cfg(test)]
mod tests {
    use super::head_chars;

    #[test]
    fn head_is_cut_at_a_char_boundary() {
        assert_eq!(
            head_chars("héllo".as_bytes(), 6, 3),
            ("hél".to_string(), true)
        );
        assert_eq!(head_chars(b"abc", 3, 3), ("abc".to_string(), false));
        assert_eq!(
            head_chars(b"abc", 10, 5),
            ("abc".to_string(), true),
            "bytes beyond the kept head mean truncation"
        );
    }
}
