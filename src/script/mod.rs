//! Spawning and supervising one script: the sandbox child, its output, its end.

pub mod broker;
pub(crate) mod engine;
pub(crate) mod pipe;

use crate::limits::{Backend, Placement, UnitEnd};
use crate::policy::Limits;
use crate::protocol::script::ToolErrorCode;
use crate::protocol::Status;
use crate::sandbox::abi::{
    FD_AGENT, FD_GATE, FD_INFO, FD_REPLIES, FD_REQUESTS, FD_SCRIPT, FD_SECCOMP, FD_USAGE,
    FD_WORKSPACE,
};
use crate::sandbox::member::Member;
use crate::sandbox::pool::{Bounds, Cold, Pool, Profile};
use crate::sandbox::{bwrap_args, parse_usage_report, RealHost, Report, SandboxBase, SandboxSpec};
use crate::script::broker::Broker;
use crate::script::engine::Abandoned;
use crate::sys::{
    channel_pipe, dup_high, give_pipe, install_cloexec_above_fixed, install_ignore_sigxfsz,
    install_pre_exec, wait_child, ChildSetup, Exit, Identity, PidFd, Spawner,
};
use std::io::Write;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::AsyncReadExt;
use tokio::sync::watch;

/// Why the supervisor should stop a script early.
#[derive(Debug, Clone, PartialEq)]
pub enum Stop {
    /// `script.cancel`, an administrator's cancel, or a revocation: the words
    /// say which.
    Cancel(String),
    /// The connection that started it closed: no engine serves its calls.
    EngineLost,
    /// The daemon stops.
    Interrupt,
}

impl Stop {
    /// Why a cancelled script was cancelled, as its result's `error` says.
    fn why(&self) -> Option<String> {
        match self {
            Stop::Cancel(why) => Some(why.clone()),
            Stop::EngineLost => Some("engine disconnected".into()),
            Stop::Interrupt => None,
        }
    }
}

/// Why a script's sandbox could not be started. Cloned: the daemon's answer to
/// `script.start` and the script's result each say it.
#[derive(Debug, Clone, thiserror::Error)]
pub enum SpawnError {
    /// Its descriptors or pipes could not be made, or its streams not served.
    #[error("{0}")]
    Setup(Arc<std::io::Error>),
    /// bwrap (behind its gate) could not be spawned.
    #[error("{}: {source}", program.display())]
    Spawn {
        program: PathBuf,
        source: Arc<std::io::Error>,
    },
}

impl SpawnError {
    /// The system's error, without the program's name (a result's `error`).
    pub fn cause(&self) -> &std::io::Error {
        match self {
            SpawnError::Setup(e) | SpawnError::Spawn { source: e, .. } => e,
        }
    }
}

impl From<std::io::Error> for SpawnError {
    fn from(e: std::io::Error) -> SpawnError {
        SpawnError::Setup(Arc::new(e))
    }
}

/// What every script's launch takes from the daemon: its settings and what it
/// found at start. Made once, by `Daemon::new`; each script adds its [`Run`].
#[derive(Clone)]
pub struct Settings {
    bwrap: PathBuf,
    /// Where `agent_tools.py` is, the interpreter, and what else every
    /// sandbox shares.
    sandbox: SandboxBase,
    backend: Backend,
    output_max_bytes: u64,
    return_max_chars: usize,
    require_enforced_limits: bool,
    file_max_bytes: u64,
    /// Pre-made sandboxes (`sandbox.pool_size`), where the backend allows.
    pool: Option<Arc<Pool>>,
}

impl Settings {
    /// `runtime_dir` holds `agent_tools.py` (mounted read-only in every
    /// sandbox); `disable_userns` is the preflight's answer, whether bwrap's
    /// `--disable-userns` works here.
    pub fn new(
        cfg: &crate::config::Config,
        runtime_dir: PathBuf,
        disable_userns: bool,
        backend: Backend,
        spawner: &Spawner,
    ) -> Settings {
        let mut s = Settings {
            bwrap: cfg.sandbox.bwrap.clone(),
            sandbox: SandboxBase::new(
                runtime_dir,
                cfg.scripts.python.clone(),
                cfg.sandbox.tmp_size_bytes,
                disable_userns,
                cfg.scripts.nofile_max,
            ),
            backend,
            output_max_bytes: cfg.scripts.output_max_bytes,
            return_max_chars: cfg.scripts.return_max_chars,
            require_enforced_limits: cfg.sandbox.require_enforced_limits,
            file_max_bytes: cfg.scripts.file_max_bytes,
            pool: None,
        };
        s.pool = s.start_pool(cfg, spawner);
        s
    }

    /// The pool of pre-made sandboxes, made with what a cold sandbox of a run
    /// with the configured limits would get. None when `sandbox.pool_size` is
    /// 0, the daemon has no mount server (not root, or without the
    /// capabilities: `mounter::start_server`), or (on a backend with units) no
    /// runtime runs to place members in theirs.
    fn start_pool(&self, cfg: &crate::config::Config, spawner: &Spawner) -> Option<Arc<Pool>> {
        let sb = &cfg.sandbox;
        if sb.pool_size == 0 {
            return None;
        }
        // The default is silent where it cannot apply; a size of one's own is
        // said.
        let not_used = |why: &str| {
            if sb.pool_size == crate::config::POOL_SIZE_DEFAULT {
                tracing::debug!("no pre-made sandboxes: {why}");
            } else {
                tracing::warn!(
                    "sandbox.pool_size = {} is not used: {why}; every script starts cold",
                    sb.pool_size
                );
            }
        };
        if let Some(why) = crate::sandbox::mounter::server_missing() {
            not_used(&why);
            return None;
        }
        let spec = SandboxSpec::new(&self.sandbox, PathBuf::new(), false, PathBuf::new());
        let limits = Limits::effective(&cfg.scripts, &Default::default());
        // On a backend with units, each member waits in one of its own.
        let units = match (
            self.backend.needs_gate(),
            tokio::runtime::Handle::try_current(),
        ) {
            (false, _) => None,
            (true, Ok(runtime)) => Some(crate::sandbox::pool::Units {
                backend: self.backend.clone(),
                runtime,
                idle: crate::limits::member::idle_limits(&limits),
            }),
            (true, Err(_)) => {
                tracing::warn!("sandbox.pool_size is not used: no runtime to place pre-made sandboxes in their units; every script starts cold");
                return None;
            }
        };
        let profile = Profile {
            units,
            rlimits: spawn_rlimits(&self.backend, &limits, &spec, self.file_max_bytes),
            spec,
            bwrap: self.bwrap.clone(),
            mounter: crate::sandbox::mounter::Via::Server,
        };
        let bounds = Bounds::new(
            sb.pool_size as usize,
            sb.pool_memory_max_bytes,
            sb.pool_idle_s,
        );
        // Root peers' scripts run as `run_as`, when the daemon is root (else as
        // the daemon's own uid: no identity to switch to).
        let warm = if nix::unistd::geteuid().is_root() {
            crate::sys::resolve_run_as(0, 0, &sb.run_as).ok().map(Some)
        } else {
            Some(None)
        };
        let warm: Vec<_> = warm.into_iter().collect();
        Some(Arc::new(Pool::start(
            profile,
            bounds,
            spawner.clone(),
            &warm,
        )))
    }

    /// `daemon.info`'s `pool`: None when the daemon keeps none.
    pub fn pool_info(&self) -> Option<crate::protocol::PoolInfo> {
        self.pool.as_ref().map(|p| crate::protocol::PoolInfo {
            size: p.bounds().size as u64,
            waiting: p.waiting(),
            max_members: p.bounds().max_members,
        })
    }
}

/// The workspace a script runs in, as the daemon opened it.
pub struct RunWorkspace {
    path: PathBuf,
    dir: OwnedFd,
    read_only: bool,
}

impl RunWorkspace {
    /// `dir` is the directory the daemon opened at `path` (bwrap binds it).
    pub fn new(path: PathBuf, dir: OwnedFd, read_only: bool) -> RunWorkspace {
        RunWorkspace {
            path,
            dir,
            read_only,
        }
    }
}

/// A script's record, as the sandbox needs it.
pub struct RunRecord {
    /// The record's `script.py` (its name only reaches the argv; see `SandboxSpec`).
    script: PathBuf,
    /// The workspace's `.agent`, opened by the daemon.
    agent_dir: OwnedFd,
    stdout_file: std::fs::File,
    stderr_file: std::fs::File,
    /// The code, in a sealed memfd (`sys::sealed_copy`).
    script_code: OwnedFd,
}

impl RunRecord {
    pub fn new(
        script: PathBuf,
        agent_dir: OwnedFd,
        stdout_file: std::fs::File,
        stderr_file: std::fs::File,
        script_code: OwnedFd,
    ) -> RunRecord {
        RunRecord {
            script,
            agent_dir,
            stdout_file,
            stderr_file,
            script_code,
        }
    }
}

/// What one script brings to its launch: its workspace, record and limits.
pub struct Run {
    workspace: RunWorkspace,
    record: RunRecord,
    /// The identity to switch to; `None` when it is the daemon's own.
    identity: Option<Identity>,
    limits: Limits,
    /// What the daemon knows before the start of this script's limits not in
    /// force (the disk bound); they join the result's `backend_notes`.
    notes: Vec<String>,
}

impl Run {
    pub fn new(
        workspace: RunWorkspace,
        record: RunRecord,
        identity: Option<Identity>,
        limits: Limits,
        notes: Vec<String>,
    ) -> Run {
        Run {
            workspace,
            record,
            identity,
            limits,
            notes,
        }
    }
}

impl Launch {
    /// The launch of `run` with the daemon's `settings`.
    pub fn new(settings: &Settings, run: Run) -> Launch {
        let Run {
            workspace,
            record,
            identity,
            limits,
            notes,
        } = run;
        Launch {
            bwrap: settings.bwrap.clone(),
            // The runner makes the execute-only copies (see `with_exec_only`).
            sandbox: SandboxSpec::new(
                &settings.sandbox,
                workspace.path,
                workspace.read_only,
                record.script,
            ),
            workspace_dir: workspace.dir,
            agent_dir: record.agent_dir,
            identity,
            limits,
            backend: settings.backend.clone(),
            stdout_file: record.stdout_file,
            stderr_file: record.stderr_file,
            output_max_bytes: settings.output_max_bytes,
            return_max_chars: settings.return_max_chars,
            require_enforced_limits: settings.require_enforced_limits,
            file_max_bytes: settings.file_max_bytes,
            script_code: record.script_code,
            notes,
            pool: settings.pool.clone(),
        }
    }
}

/// Everything the runner needs to start one script's sandbox: [`Launch::new`].
pub struct Launch {
    bwrap: PathBuf,
    sandbox: SandboxSpec,
    /// The workspace and its `.agent`, opened by the daemon; bwrap binds these.
    workspace_dir: std::os::fd::OwnedFd,
    agent_dir: std::os::fd::OwnedFd,
    identity: Option<Identity>,
    limits: Limits,
    backend: Backend,
    stdout_file: std::fs::File,
    stderr_file: std::fs::File,
    output_max_bytes: u64,
    return_max_chars: usize,
    /// `sandbox.require_enforced_limits`: no "go" through the gate for a script
    /// whose limits read back as not in force.
    require_enforced_limits: bool,
    /// `scripts.file_max_bytes`: RLIMIT_FSIZE of the script's processes.
    file_max_bytes: u64,
    /// The script's code, in a sealed memfd (`sys::sealed_copy`): bwrap copies
    /// it to `SCRIPT_MOUNT`, so the sandbox runs the code the audit row holds,
    /// and nothing in the workspace is opened again (the engine owns that tree).
    script_code: OwnedFd,
    /// Limits known not to be in force before the start (`Run::new`'s `notes`).
    notes: Vec<String>,
    pool: Option<Arc<Pool>>,
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
    /// The unit's peak (`memory.peak`, which counts page cache, tmpfs and
    /// kernel memory too). None where there is no unit to read it from (the
    /// rlimit backend): a resident-set figure is no peak of what the script
    /// held (an unmapped memfd, SysV segments, /tmp's tmpfs and pipe buffers are
    /// in no process's resident set; a 512 MiB memfd was reported as 9 MiB).
    pub memory_peak_bytes: Option<u64>,
    pub cpu_usec: Option<u64>,
    /// Limits of this script that were not in force (read back from its cgroups).
    pub backend_notes: Vec<String>,
    /// The script never ran as configured: its unit or limits could not be set up
    /// (the journal entry says so at `err`, not as the script's own failure).
    pub setup_failed: bool,
    /// The record files (output.txt, stderr.txt) the daemon could not write in
    /// full, each with why.
    pub record_incomplete: Vec<String>,
    /// Ran in a pre-made sandbox (true) or started cold; None: no pool.
    pub pre_made: Option<bool>,
    /// What is left of the sandbox once the script ended (bwrap's exit, the
    /// namespaces', the unit's), for the daemon to run after the result;
    /// None: nothing (it never started).
    pub teardown: Option<Teardown>,
}

impl Ended {
    /// A script whose sandbox could not be started: an error not of its doing.
    pub fn not_started(e: &SpawnError) -> Ended {
        Ended {
            status: Status::Error,
            exit_code: None,
            duration_ms: 0,
            output: String::new(),
            output_truncated: false,
            error: Some(format!("the sandbox could not start: {}", e.cause())),
            memory_peak_bytes: None,
            cpu_usec: None,
            backend_notes: vec![],
            setup_failed: true,
            record_incomplete: vec![],
            pre_made: None,
            teardown: None,
        }
    }
}

/// How much of stderr is kept for the result's `error`.
const STDERR_TAIL_BYTES: usize = 4000;

struct Captured {
    head: Vec<u8>,
    tail: Vec<u8>,
    total: u64,
    /// Why the artifact file stopped short of what was to be kept in it (a full
    /// filesystem): from then on nothing more is written to it.
    write_error: Option<String>,
}

/// Copy a child stream to its artifact file (up to `max_file` bytes, then a note of
/// how much was dropped), keeping the first `head_max` and last `tail_max` bytes.
/// A write that fails (ENOSPC, EDQUOT) stops the copy to the file, not the
/// draining: the script is never blocked on its pipe, and the failure is kept.
async fn capture<R: tokio::io::AsyncRead + Unpin>(
    mut r: R,
    mut file: std::fs::File,
    name: &str,
    max_file: u64,
    head_max: usize,
    tail_max: usize,
) -> Captured {
    let mut c = Captured {
        head: Vec::new(),
        tail: Vec::new(),
        total: 0,
        write_error: None,
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
        if written < max_file && c.write_error.is_none() {
            let k = ((max_file - written) as usize).min(n);
            let (w, e) = write_counted(&mut file, &chunk[..k]);
            written += w;
            c.write_error = e;
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
    if let Some(e) = c.write_error.take() {
        let kept = c.total.min(max_file);
        c.write_error = Some(format!("{name}: {e}; {written} of {kept} bytes written"));
    } else if c.total > written {
        let _ = writeln!(file, "\n[scriptgate: {} more bytes were printed and dropped; the limit is output_max_bytes = {max_file}]", c.total - written);
    }
    if c.tail.len() > tail_max {
        c.tail.drain(..c.tail.len() - tail_max);
    }
    c
}

/// Write all of `bytes`, counting what reached the file: `(written, error)`.
fn write_counted(file: &mut std::fs::File, mut bytes: &[u8]) -> (u64, Option<String>) {
    let mut n = 0u64;
    while !bytes.is_empty() {
        match file.write(bytes) {
            Ok(0) => return (n, Some("the write wrote nothing".into())),
            Ok(k) => {
                n += k as u64;
                bytes = &bytes[k..];
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return (n, Some(broker::describe_write_error(&e))),
        }
    }
    (n, None)
}

/// The disk bound of a script's processes, the same on every backend: no file
/// larger than `file_max_bytes` (RLIMIT_FSIZE), with SIGXFSZ ignored (see
/// `command`), so that a write past it fails with EFBIG (Python sees an OSError)
/// instead of killing the writer. It bounds each file, not their number or
/// total: only a filesystem quota, or workspace roots on a filesystem apart from
/// `state.dir`, bound that. The daemon's own writes are not under it. 0: no bound.
pub fn file_size_rlimit(file_max_bytes: u64) -> (libc::__rlimit_resource_t, u64) {
    let limit = match file_max_bytes {
        0 => libc::RLIM_INFINITY,
        n => n,
    };
    (libc::RLIMIT_FSIZE, limit)
}

/// Read bwrap's `--info-fd` JSON (`{"child-pid": N, …}`). The sandbox inherits the
/// pipe's write end, so parse as soon as the object is complete rather than at EOF.
async fn read_child_pid(fd: std::os::fd::OwnedFd) -> Option<i32> {
    let mut r = tokio::net::unix::pipe::Receiver::from_owned_fd(fd).ok()?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 512];
    while buf.len() < crate::sandbox::INFO_MAX {
        match r.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
        if let Some(pid) = crate::sandbox::parse_child_pid(&buf) {
            return pid;
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

/// Read the sandbox init's report (see `sandbox::init`): one line, written once
/// every process of the script is reaped. Only the init holds the write end;
/// it writes nothing when it is killed (then: None at end of file).
async fn read_report(fd: std::os::fd::OwnedFd) -> Option<Report> {
    let mut r = tokio::net::unix::pipe::Receiver::from_owned_fd(fd).ok()?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 256];
    while buf.len() < 1024 && !buf.ends_with(b"\n") {
        match r.read(&mut chunk).await {
            Ok(0) | Err(_) => break,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
    parse_usage_report(&buf)
}

/// The init's report, read on a task of its own from the start (`read_report`):
/// None until it is read, then what it said.
type ReportRx = watch::Receiver<Option<Option<Report>>>;

fn watch_report(fd: OwnedFd) -> ReportRx {
    let (tx, rx) = watch::channel(None);
    tokio::spawn(async move {
        let _ = tx.send(Some(read_report(fd).await));
    });
    rx
}

/// The script's end as the init reported it, once every process of it was
/// reaped; never, when the init said nothing (killed) or no status.
async fn reported_end(mut rx: ReportRx) -> Exit {
    match rx
        .wait_for(Option::is_some)
        .await
        .ok()
        .and_then(|r| *r)
        .flatten()
    {
        Some(Report {
            status: Some(code),
            max_rss_bytes,
            cpu_usec,
        }) => Exit {
            code: Some(code),
            signal: None,
            max_rss_bytes,
            cpu_usec: cpu_usec.unwrap_or(0),
        },
        _ => std::future::pending().await,
    }
}

/// Start the sandbox and supervise it to its end. `started` is answered once the
/// child exists (the script is then `running`) or could not be spawned.
///
/// The steps run in this order, and the order matters (see each step's comment).
// Longer than most functions here, on purpose: eight named steps, each a call or
// two, kept together so that their order reads top to bottom (firecracker's
// `Env::run` is the model).
pub async fn run(
    spawner: &Spawner,
    mut launch: Launch,
    broker: Arc<Broker>,
    mut stop: watch::Receiver<Option<Stop>>,
    started: tokio::sync::oneshot::Sender<Result<(), SpawnError>>,
) -> Result<Ended, SpawnError> {
    let t0 = Instant::now();
    let script_id = broker.script_id.clone();

    // 0. The execute-only interpreter and init, when the script runs as another
    //    uid than a root daemon (`with_exec_only`).
    exec_only_or_warn(&mut launch, &script_id).await;
    // 1.–3. A pre-made sandbox with the workspace mounted in (`take_member`);
    //    or the descriptors, the command, the spawn (`spawn_sandbox`).
    let (mut sandbox, ours, pooled) = match take_member(&launch, &script_id).await {
        Ok((sandbox, ours, pooled)) => {
            let _ = started.send(Ok(()));
            (sandbox, ours, Some(pooled))
        }
        Err(cold) => {
            tracing::debug!(script_id = %script_id, "starts cold: {}", cold.as_str());
            let (sandbox, ours) = spawn_sandbox(spawner, &launch, started).await?;
            (sandbox, ours, None)
        }
    };
    let pre_made = pooled.is_some();
    broker.live.set_sandbox_pid(sandbox.pid);
    // Our copies of the workspace's descriptors go: bwrap has its own.
    drop((launch.workspace_dir, launch.agent_dir));

    // 4. Serve fd 3/4 and drain stdout/stderr, before step 5: its "go" lets the
    //    script run, and from its first instruction on its calls must be
    //    answered and a full pipe would block it. Nothing comes through before
    //    (bwrap waits behind the gate), so serving early costs nothing, and a
    //    script whose placement fails ends with EOF on every stream.
    let end = pipe::End::new();
    let streams = Streams::start(
        broker.clone(),
        ours.streams,
        &end,
        launch.stdout_file,
        launch.stderr_file,
        launch.output_max_bytes,
        launch.return_max_chars,
    )?;
    let report = watch_report(ours.usage);

    // 5. Into the unit, then through the gate (a pre-made sandbox moves from
    //    the unit it waited in). A keeper holds a systemd scope open.
    let mut pooled = pooled;
    let entry = match (ours.gate, pooled.as_mut().and_then(|p| p.unit.take())) {
        (Some(gate), _) => Entry::Gate(gate),
        (None, Some(waiting)) => Entry::Member(waiting),
        (None, None) => Entry::None,
    };
    let placed = place_behind_gate(
        spawner,
        &launch.backend,
        &launch.limits,
        launch.identity,
        &script_id,
        sandbox.pid,
        entry,
        launch.require_enforced_limits,
    )
    .await;
    let mut backend_notes = launch.notes.clone();
    backend_notes.extend(placed.notes.iter().cloned());
    // 5b. A pre-made sandbox starts when its script arrives; one that could
    //    not be placed gets none, and its Python refuses to wait on.
    if let Some(pooled) = pooled.filter(|_| placed.error.is_none()) {
        if let Err(e) = pooled.go().await {
            tracing::warn!(script_id = %script_id, "cannot send the script to its pre-made sandbox: {e}");
        }
    }

    // 6. Wait for the end, or make it: the timeout counts from here, once the
    //    script can run.
    let init = match ours.init {
        Init::Info(info) => sandbox_init(info, launch.identity).await,
        Init::Held(init) => Some(init),
    };
    // The init's report is the end (every process of the script is reaped):
    // the sandbox's teardown (bwrap's exit, the namespaces', the unit's) goes
    // on after the result (`pipe`, `release_unit`).
    let (cut, exit, early_end) = wait_or_stop(
        &mut sandbox,
        init.as_ref(),
        &placed.placement,
        Duration::from_secs(launch.limits.timeout_s),
        &mut stop,
        report.clone(),
        &script_id,
    )
    .await;
    // The script's end: the teardown's time counts from here.
    let ended_at = Instant::now();
    if early_end {
        end.now();
    }
    // Exited (or being reaped): its pid is no longer the script's to read.
    broker.live.set_sandbox_pid(0);

    // 7. Collect what the ending left: the init's report and the unit's counters
    //    (read while the keeper still holds the scope); then the output and the
    //    broker, told first how the script was made to end (`forced`): the
    //    calls still at the engine are abandoned with that reason.
    let unit = launch.backend.unit_for(&script_id).unwrap_or_default();
    let (usage, mut outcome) = unit_facts(report, &placed.placement).await;
    // The teardown is the daemon's to run, after the result (`Ended::teardown`).
    let release = release_unit(
        placed.placement,
        placed.keeper,
        early_end.then_some(sandbox),
    );
    let teardown = Teardown(Box::pin(async move {
        release.await;
        ended_at.elapsed()
    }));
    let carried = placed.carried_bytes;
    outcome.stats.memory_peak_bytes = outcome.stats.memory_peak_bytes.map(|p| p + carried);
    let mut ending = Ending {
        cut,
        setup_error: placed.error,
        oom_killed: outcome.stats.oom_killed,
        stopped_externally: outcome.stopped_externally,
        unit_timeout: outcome.unit_timeout,
        exit,
        ..Default::default()
    };
    broker.end(Abandoned::after(forced(&ending, &launch.limits, &unit)));
    let (out, err) = streams.finish(&script_id).await;
    let collected = Collected {
        usage,
        outcome,
        out,
        err,
    };
    ending.uncaught = broker.live.uncaught.lock().unwrap().clone();
    ending.stderr_tail = collected.stderr_tail();

    // The init reports at its end, even after a failed script; no report and no
    // kill means bwrap failed before it ran (its `child-pid` may have come: on
    // Ubuntu the namespace is made, and its setup then fails).
    let never_ran = collected.usage.is_none();
    // 8. Decide the status and error, from facts only.
    let (status, error, setup_failed) = decide(&ending, never_ran, &launch.limits, &unit);
    let mut ended = collected.ended(status, error, exit, t0, launch.return_max_chars);
    ended.backend_notes = backend_notes;
    ended.pre_made = launch.pool.as_ref().map(|_| pre_made);
    ended.setup_failed = setup_failed;
    ended.teardown = Some(teardown);
    Ok(ended)
}

/// Step 8: the status and error (`judge`), and whether the sandbox itself could
/// not be set up. A bwrap that failed before the sandbox existed (no usage
/// report, no cut) gets its one-line diagnosis, bwrap's words after it.
fn decide(
    ending: &Ending,
    never_ran: bool,
    limits: &Limits,
    unit: &str,
) -> (Status, Option<String>, bool) {
    let (status, mut error) = judge(ending, limits, unit);
    let mut setup_failed = ending.setup_error.is_some();
    if never_ran && ending.cut.is_none() && ending.setup_error.is_none() && status == Status::Error
    {
        let facts = crate::sandbox::diagnose::HostFacts::read();
        if let Some(why) = crate::sandbox::diagnose::explain(&ending.stderr_tail, &facts) {
            error = Some(why);
            setup_failed = true;
        }
    }
    (status, error, setup_failed)
}

/// Step 0: the execute-only copies of the interpreter and the init
/// (`sandbox::ExecOnly`), copied once per version. They are a second layer
/// (other processes of the script's uid cannot read it through /proc); a state
/// directory with no room for them costs that layer, said at warning priority,
/// not the script.
async fn exec_only_or_warn(launch: &mut Launch, script_id: &str) {
    if let Err(e) = with_exec_only(launch).await {
        tracing::warn!(
            script_id = %script_id,
            "no execute-only copies of the interpreter and the init in {}: {e}; this script runs \
             without them, so other processes of its uid may read it through /proc/PID",
            launch.sandbox.runtime_dir().with_file_name("exec").display()
        );
    }
}

/// Steps 1–3. Every descriptor is opened before the spawn: the child's ends
/// are dup2'ed to fixed numbers in `pre_exec`, where nothing may be allocated.
/// The command is bwrap, behind the gate when the backend places the sandbox
/// in a unit (its first instruction must already run there). It is spawned from
/// the spawner's long-lived thread (`--die-with-parent` fires when the spawning
/// thread exits) and reaped on a thread of its own. `started` hears either way.
async fn spawn_sandbox(
    spawner: &Spawner,
    launch: &Launch,
    started: tokio::sync::oneshot::Sender<Result<(), SpawnError>>,
) -> Result<(Sandbox, OurEnds), SpawnError> {
    let (child_ends, ours) = open_fds(launch)?;
    let ChildEnds {
        fixed,
        stdout,
        stderr,
    } = child_ends;
    let cmd = command(launch, &fixed, stdout, stderr);
    let sandbox = match spawn_supervised(spawner, cmd, launch.identity).await {
        Ok(s) => s,
        Err(e) => {
            let e = SpawnError::Spawn {
                program: launch.bwrap.clone(),
                source: Arc::new(e),
            };
            let _ = started.send(Err(e.clone()));
            return Err(e);
        }
    };
    let _ = started.send(Ok(()));
    // Our copies of the child's ends must go, or fd 3 would never reach EOF
    // (`cmd`, holding stdout/stderr's write ends, was consumed by the spawn).
    drop(fixed);
    Ok((sandbox, ours))
}

/// A pre-made sandbox with the run's workspace in it, waiting for its script.
struct Pooled {
    go: crate::sandbox::member::Go,
    workspace: PathBuf,
    name: String,
    code: Vec<u8>,
    /// The unit it waited in, on a backend with units: its processes move to
    /// the run's own at step 5.
    unit: Option<crate::limits::member::Waiting>,
}

impl Pooled {
    /// Send the script: the member starts it at once.
    async fn go(self) -> std::io::Result<()> {
        tokio::task::spawn_blocking(move || self.go.go(&self.workspace, &self.name, &self.code))
            .await
            .map_err(std::io::Error::other)?
    }
}

/// Steps 1–3 on the pooled path: a member for this run's identity from the pool
/// (`sandbox::pool`), with the run's workspace and `.agent` mounted into it.
/// `Err`: why the run starts cold instead (nothing of it ran).
async fn take_member(launch: &Launch, script_id: &str) -> Result<(Sandbox, OurEnds, Pooled), Cold> {
    let pool = launch.pool.as_ref().ok_or(Cold::Empty)?;
    let rlimits = spawn_rlimits(
        &launch.backend,
        &launch.limits,
        &launch.sandbox,
        launch.file_max_bytes,
    );
    let workspace = launch.sandbox.workspace().to_path_buf();
    if rlimits != pool.profile().rlimits {
        return Err(Cold::Limits);
    }
    if workspace.to_str().is_none() {
        return Err(Cold::Path);
    }
    let code = read_code(&launch.script_code).map_err(|_| Cold::Mount)?;
    let mut member = pool.take(launch.identity)?;
    let (ws, agent) = match (
        launch.workspace_dir.try_clone(),
        launch.agent_dir.try_clone(),
    ) {
        (Ok(w), Ok(a)) => (w, a),
        _ => return Err(Cold::Mount),
    };
    let read_only = launch.sandbox.read_only();
    let path = workspace.clone();
    let mounted = tokio::task::spawn_blocking(move || {
        let r = member.mount(&path, ws.as_fd(), agent.as_fd(), read_only);
        match r {
            Ok(()) => Ok(member),
            Err(e) => {
                member.discard();
                Err(e)
            }
        }
    })
    .await
    .map_err(std::io::Error::other)
    .and_then(|r| r);
    let mut member = match mounted {
        Ok(m) => m,
        Err(e) => {
            tracing::warn!(script_id = %script_id, "a pre-made sandbox could not take the workspace, so this script starts cold: {e}");
            return Err(Cold::Mount);
        }
    };
    let go = member.take_go().ok_or(Cold::Mount)?;
    let Member {
        child,
        init,
        requests,
        replies,
        usage,
        stdout,
        stderr,
        unit,
        ..
    } = member;
    let pid = child.id() as i32;
    let sandbox = Sandbox {
        pid,
        bwrap: PidFd::open_as(pid, launch.identity),
        exited: Some(wait_child(pid)),
    };
    let ours = OurEnds {
        streams: StreamEnds {
            requests,
            replies,
            stdout,
            stderr,
        },
        init: Init::Held(init),
        usage,
        gate: None,
    };
    let name = launch.sandbox.script_name().to_string_lossy().into_owned();
    Ok((
        sandbox,
        ours,
        Pooled {
            go,
            workspace,
            name,
            code,
            unit,
        },
    ))
}

/// The script's code from its sealed memfd (`sys::sealed_copy`).
fn read_code(fd: &OwnedFd) -> std::io::Result<Vec<u8>> {
    use std::os::unix::fs::FileExt;
    let file = std::fs::File::from(fd.try_clone()?);
    let mut code = vec![0u8; file.metadata()?.len() as usize];
    file.read_exact_at(&mut code, 0)?;
    Ok(code)
}

/// The child's ends of its descriptors.
struct ChildEnds {
    /// Each dup2'ed to its fixed number in `pre_exec`; everything else stays
    /// close-on-exec.
    fixed: Vec<(OwnedFd, RawFd)>,
    /// Pipes the script's uid owns, so that /dev/stdout works inside.
    stdout: OwnedFd,
    stderr: OwnedFd,
}

/// Our ends of the child's descriptors.
struct OurEnds {
    streams: StreamEnds,
    /// The sandbox init: by bwrap's `--info-fd` (which says its pid), or
    /// already held (a pool member's).
    init: Init,
    /// The sandbox init's usage report.
    usage: OwnedFd,
    /// The gate's write end, when the backend gates.
    gate: Option<OwnedFd>,
}

/// How the runner comes to hold the sandbox's PID 1.
enum Init {
    Info(OwnedFd),
    Held(PidFd),
}

/// Our ends of the streams that are served while the script runs.
struct StreamEnds {
    /// fd 3: the script's requests.
    requests: OwnedFd,
    /// fd 4: our replies.
    replies: OwnedFd,
    stdout: OwnedFd,
    stderr: OwnedFd,
}

/// Step 0: fill `launch.sandbox.exec_only` where it helps: the daemon is root
/// (the copies are root's, unreadable by the script's uid) and the script runs
/// as another uid. The copies live in `<state>/exec`, beside the runtime dir.
async fn with_exec_only(launch: &mut Launch) -> std::io::Result<()> {
    let spec = &launch.sandbox;
    let wanted = launch.identity.is_some_and(|id| id.uid != 0)
        && nix::unistd::geteuid().is_root()
        && spec.exec_only().is_none();
    if !wanted {
        return Ok(());
    }
    let dir = spec.runtime_dir().with_file_name("exec");
    let (python, init) = (spec.python().to_path_buf(), spec.init().to_path_buf());
    let x = tokio::task::spawn_blocking(move || crate::sandbox::exec_only(&python, &init, &dir))
        .await
        .map_err(std::io::Error::other)??;
    launch.sandbox.set_exec_only(x);
    Ok(())
}

/// Step 1: every pipe and descriptor of one sandbox.
fn open_fds(launch: &Launch) -> std::io::Result<(ChildEnds, OurEnds)> {
    let (req_r, req_w) = channel_pipe()?; // script writes fd 3, we read
    let (rep_r, rep_w) = channel_pipe()?; // we write, script reads fd 4
    let (info_r, info_w) = channel_pipe()?; // bwrap writes the sandbox init's pid
    let (usage_r, usage_w) = channel_pipe()?; // the sandbox init reports its usage
    let seccomp_r = crate::sandbox::seccomp::in_a_pipe()?; // bwrap reads the program
    let mut fixed = vec![
        (req_w, FD_REQUESTS),
        (rep_r, FD_REPLIES),
        (info_w, FD_INFO),
        (usage_w, FD_USAGE),
        (seccomp_r, FD_SECCOMP),
        (dup_high(&launch.workspace_dir)?, FD_WORKSPACE),
        (dup_high(&launch.script_code)?, FD_SCRIPT),
        (dup_high(&launch.agent_dir)?, FD_AGENT),
    ];
    let gate = if launch.backend.needs_gate() {
        let (gate_r, gate_w) = channel_pipe()?;
        fixed.push((gate_r, FD_GATE));
        Some(gate_w)
    } else {
        None
    };
    let (out_r, out_w) = channel_pipe()?;
    let (err_r, err_w) = channel_pipe()?;
    if let Some(id) = launch.identity {
        give_pipe(&out_w, id)?;
        give_pipe(&err_w, id)?;
    }
    Ok((
        ChildEnds {
            fixed,
            stdout: out_w,
            stderr: err_w,
        },
        OurEnds {
            streams: StreamEnds {
                requests: req_r,
                replies: rep_w,
                stdout: out_r,
                stderr: err_r,
            },
            init: Init::Info(info_r),
            usage: usage_r,
            gate,
        },
    ))
}

/// Step 2: the command that starts the sandbox, with its `pre_exec` setup.
fn command(
    launch: &Launch,
    fixed: &[(OwnedFd, RawFd)],
    stdout: OwnedFd,
    stderr: OwnedFd,
) -> std::process::Command {
    let mut cmd = if launch.backend.needs_gate() {
        crate::sandbox::gated(&launch.bwrap)
    } else {
        std::process::Command::new(&launch.bwrap)
    };
    // No environment: bwrap (and the gate shell) would otherwise carry the
    // daemon's, and bwrap's --clearenv clears only the sandboxed child's.
    cmd.env_clear()
        .args(bwrap_args(&launch.sandbox, &RealHost))
        .stdin(Stdio::null())
        .stdout(Stdio::from(stdout))
        .stderr(Stdio::from(stderr));
    install_pre_exec(
        &mut cmd,
        ChildSetup {
            identity: launch.identity,
            rlimits: spawn_rlimits(
                &launch.backend,
                &launch.limits,
                &launch.sandbox,
                launch.file_max_bytes,
            ),
            dups: fixed.iter().map(|(fd, to)| (fd.as_raw_fd(), *to)).collect(),
            parent_pid: std::process::id() as libc::pid_t,
        },
    );
    install_ignore_sigxfsz(&mut cmd);
    install_cloexec_above_fixed(&mut cmd);
    cmd
}

/// The resource limits every process of a sandbox gets at its spawn, cold or
/// pre-made: the backend's, RLIMIT_NOFILE and RLIMIT_FSIZE.
fn spawn_rlimits(
    backend: &Backend,
    limits: &Limits,
    spec: &SandboxSpec,
    file_max_bytes: u64,
) -> Vec<(libc::__rlimit_resource_t, u64)> {
    let mut r = backend.rlimits(limits, nofile_max(spec));
    r.push(file_size_rlimit(file_max_bytes));
    r
}

/// `scripts.nofile_max`, but never above the daemon's own hard limit: the daemon
/// keeps no CAP_SYS_RESOURCE, and raising it would fail the spawn (EPERM).
fn nofile_max(spec: &SandboxSpec) -> u64 {
    let hard = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .map_or(u64::MAX, |(_, hard)| hard);
    spec.nofile_max().min(hard)
}

/// The spawned sandbox (bwrap, or the gate shell that becomes bwrap).
struct Sandbox {
    pid: i32,
    /// Until the reaper reaps it, this pid cannot be reused: the pidfd is exact.
    bwrap: std::io::Result<PidFd>,
    /// Resolves once the reaper has reaped it; taken when it has resolved.
    exited: Option<tokio::sync::oneshot::Receiver<std::io::Result<Exit>>>,
}

impl Sandbox {
    /// Wait for the reaper (at most `grace`, if given). `None` when it has no exit
    /// status to give, or the grace ran out (then it can still be waited for).
    async fn exit(&mut self, grace: Option<Duration>) -> Option<Exit> {
        let rx = self.exited.as_mut()?;
        let r = match grace {
            Some(g) => tokio::time::timeout(g, rx).await.ok()?,
            None => rx.await,
        };
        self.exited = None;
        r.ok().and_then(Result::ok)
    }
}

/// Step 3: spawn, then hold the child by pidfd and reap it on a thread of its own.
async fn spawn_supervised(
    spawner: &Spawner,
    cmd: std::process::Command,
    identity: Option<Identity>,
) -> std::io::Result<Sandbox> {
    let child = spawner.spawn(cmd).await?;
    let pid = child.id() as i32;
    Ok(Sandbox {
        pid,
        bwrap: PidFd::open_as(pid, identity),
        exited: Some(wait_child(pid)),
    })
}

/// The tasks that serve a running script: the broker on fd 3/4, and the copies
/// of stdout and stderr.
struct Streams {
    broker: tokio::task::JoinHandle<()>,
    out: tokio::task::JoinHandle<Captured>,
    err: tokio::task::JoinHandle<Captured>,
}

impl Streams {
    /// Step 4: the broker on fd 3/4; stdout and stderr copied to their files,
    /// keeping the head of the output (for the result) and the tail of stderr
    /// (for its error).
    fn start(
        broker: Arc<Broker>,
        ends: StreamEnds,
        end: &Arc<pipe::End>,
        stdout_file: std::fs::File,
        stderr_file: std::fs::File,
        output_max_bytes: u64,
        return_max_chars: usize,
    ) -> std::io::Result<Streams> {
        use tokio::net::unix::pipe::Sender;
        let head_max = return_max_chars.saturating_mul(4).saturating_add(4);
        Ok(Streams {
            broker: tokio::spawn(broker.serve(
                pipe::Pipe::new(ends.requests, end)?,
                Sender::from_owned_fd(ends.replies)?,
            )),
            out: tokio::spawn(capture(
                pipe::Pipe::new(ends.stdout, end)?,
                stdout_file,
                "output.txt",
                output_max_bytes,
                head_max,
                0,
            )),
            err: tokio::spawn(capture(
                pipe::Pipe::new(ends.stderr, end)?,
                stderr_file,
                "stderr.txt",
                output_max_bytes,
                0,
                STDERR_TAIL_BYTES,
            )),
        })
    }

    /// The captured output and stderr, and the broker ended. The namespace is gone,
    /// so the pipes reach EOF promptly; every wait is bounded anyway.
    async fn finish(self, script_id: &str) -> (Option<Captured>, Option<Captured>) {
        let grace = Duration::from_secs(5);
        let out = tokio::time::timeout(grace, self.out)
            .await
            .ok()
            .and_then(Result::ok);
        let err = tokio::time::timeout(grace, self.err)
            .await
            .ok()
            .and_then(Result::ok);
        // The broker ends by itself once fd 3 is closed (after a short grace for
        // calls still at the engine); if it does not, abort it: its cancelled calls
        // are still logged and counted.
        let mut broker = self.broker;
        if tokio::time::timeout(grace * 2, &mut broker).await.is_err() {
            tracing::warn!(script_id = %script_id, "broker did not stop after the script ended");
            broker.abort();
            let _ = broker.await;
        }
        (out, err)
    }
}

/// A process that holds a systemd scope until its counters are read.
struct Keeper {
    pidfd: std::io::Result<PidFd>,
    exited: tokio::sync::oneshot::Receiver<std::io::Result<Exit>>,
    /// Its stdin's write end: the keeper lives while this is open.
    lifeline: OwnedFd,
}

impl Keeper {
    async fn end(self) {
        if let Ok(k) = self.pidfd {
            let _ = k.kill();
        }
        drop(self.lifeline);
        let _ = self.exited.await;
    }
}

/// Where step 5 left the script.
struct Placed {
    placement: Placement,
    keeper: Option<Keeper>,
    /// Why the script could not be placed; it then never passed the gate.
    error: Option<String>,
    /// Its limits that read back as not in force.
    notes: Vec<String>,
    /// What a pre-made sandbox's processes held when they moved in, charged
    /// to the unit they waited in (`limits::member`): added to the peak.
    carried_bytes: u64,
}

/// How a sandbox enters its unit at step 5.
enum Entry {
    /// No unit (the rlimit backend).
    None,
    /// A cold sandbox waits behind its gate: placed, then "go". Without "go"
    /// (the gate's write end dropped) the gate shell exits 125 and bwrap never
    /// runs.
    Gate(OwnedFd),
    /// A pre-made sandbox waits in a unit of its own: every process of it
    /// moves to the run's unit (`limits::member`), and its own goes.
    Member(crate::limits::member::Waiting),
}

/// Step 5: put the sandbox (and a keeper, for a scope) in its unit, then let it
/// run (`Entry`).
// One argument over clippy's seven: `launch` is partly moved by now, so its
// parts come one by one.
#[allow(clippy::too_many_arguments)]
async fn place_behind_gate(
    spawner: &Spawner,
    backend: &Backend,
    limits: &Limits,
    identity: Option<Identity>,
    script_id: &str,
    pid: i32,
    entry: Entry,
    require_enforced_limits: bool,
) -> Placed {
    let mut placed = Placed {
        placement: Placement::None,
        keeper: None,
        error: None,
        notes: vec![],
        carried_bytes: 0,
    };
    let (mut pids, gate, waiting) = match entry {
        Entry::None => return placed,
        Entry::Gate(gate) => (vec![pid as u32], Some(gate), None),
        Entry::Member(waiting) => match waiting.pids() {
            Ok(pids) => {
                placed.carried_bytes = waiting.memory_current();
                (pids, None, Some(waiting))
            }
            Err(e) => {
                placed.error = Some(format!(
                    "cannot move the pre-made sandbox into its unit: {e}"
                ));
                release(waiting).await;
                return placed;
            }
        },
    };
    // The member's unit goes once its processes left it (or, placing failed,
    // with them): it holds nothing of the run. (`return` in the block below
    // ends the placing, not the step.)
    let placed = async {
        if backend.needs_keeper() {
            // The keeper holds the scope (and its counters) until they are read; it
            // ends when the daemon kills it, closes its lifeline, or dies.
            let started = match crate::sys::placeholder(identity) {
                Ok((cmd, lifeline)) => spawner.spawn(cmd).await.map(|k| (k, lifeline)),
                Err(e) => Err(e),
            };
            match started {
                Ok((k, lifeline)) => {
                    let kpid = k.id() as i32;
                    pids.push(kpid as u32);
                    placed.keeper = Some(Keeper {
                        pidfd: PidFd::open_as(kpid, identity),
                        exited: wait_child(kpid),
                        lifeline,
                    });
                }
                Err(e) => {
                    placed.error = Some(format!("cannot start the scope keeper: {e}"));
                    return placed;
                }
            }
        }
        match backend.place(script_id, limits, &pids).await {
            Ok(p) => {
                placed.placement = p;
                // Read back what the unit's cgroups actually have.
                let e = backend.verify(script_id, pid as u32, limits);
                placed.notes = e.lines();
                if require_enforced_limits && !e.enforced() {
                    placed.error = Some(crate::sandbox::diagnose::limits_refusal(&e.problems));
                    return placed;
                }
                if let Some(gate) = gate {
                    let mut w = std::fs::File::from(gate);
                    let _ = std::io::Write::write_all(&mut w, b"go\n");
                }
            }
            Err(e) => {
                placed.error = Some(format!(
                    "cannot place the script in its {} unit: {e}",
                    backend.kind().as_str()
                ))
            }
        }
        placed
    }
    .await;
    if let Some(w) = waiting {
        release(w).await;
    }
    placed
}

/// Let a pre-made sandbox's own unit go, off the async threads.
async fn release(w: crate::limits::member::Waiting) {
    let _ = tokio::task::spawn_blocking(move || w.release()).await;
}

/// bwrap reports the sandbox's PID 1 once it exists; hold it by pidfd. If bwrap
/// fails before that, the pipe closes and its stderr says why.
async fn sandbox_init(info: OwnedFd, identity: Option<Identity>) -> Option<PidFd> {
    tokio::time::timeout(Duration::from_secs(10), read_child_pid(info))
        .await
        .ok()
        .flatten()
        .and_then(|pid| PidFd::open_as(pid, identity).ok())
}

/// Step 6: the sandbox's end (the init's report, `true` with it, or bwrap's
/// exit), or (timeout, a stop) why it was cut short and the exit after the kill.
async fn wait_or_stop(
    sandbox: &mut Sandbox,
    init: Option<&PidFd>,
    placement: &Placement,
    timeout: Duration,
    stop: &mut watch::Receiver<Option<Stop>>,
    reported: ReportRx,
    script_id: &str,
) -> (Option<Cut>, Option<Exit>, bool) {
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
    let reported = reported_end(reported);
    let (cut, exit, early_end) = tokio::select! {
        // An exit that is already there is the fact, whatever else is due: a
        // daemon that was stalled (frozen, swapped out) past the timeout finds
        // the sandbox gone and asks the unit why (its RuntimeMaxSec= backstop).
        biased;
        e = sandbox.exit(None) => (None, e, false),
        e = reported => (None, Some(e), true),
        _ = tokio::time::sleep(timeout) => (Some(Cut::Timeout), None, false),
        s = stopped => (Some(Cut::Stopped(s)), None, false),
    };
    if exit.is_some() {
        return (cut, exit, early_end);
    }
    (
        cut,
        kill_sandbox(sandbox, init, placement, script_id).await,
        false,
    )
}

/// Killing the sandbox's PID 1 makes the kernel kill every process in its
/// namespace, setsid'd ones included; the outer bwrap then reaps it and exits.
/// Killing bwrap as well would orphan the dying init (a zombie of whoever
/// inherits it), so bwrap is killed only when the init is unknown or bwrap
/// outlasts it; then the unit.
async fn kill_sandbox(
    sandbox: &mut Sandbox,
    init: Option<&PidFd>,
    placement: &Placement,
    script_id: &str,
) -> Option<Exit> {
    let init_killed = match init {
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
    let mut exit = sandbox.exit(Some(grace)).await;
    if exit.is_none() && sandbox.exited.is_some() {
        if let Ok(b) = &sandbox.bwrap {
            let _ = b.kill();
        }
        placement.kill();
        exit = sandbox.exit(None).await;
    }
    placement.kill();
    exit
}

/// What step 7 gathered once the sandbox had ended.
struct Collected {
    /// The sandbox init's report of its largest resident set.
    usage: Option<u64>,
    /// The unit's counters and state.
    outcome: UnitEnd,
    out: Option<Captured>,
    err: Option<Captured>,
}

/// Step 7, first part. Every process of the script is reaped (the init
/// reported, or bwrap waited for it), so its report is complete; the unit's
/// word on how it ended is read while the keeper still holds it.
async fn unit_facts(mut report: ReportRx, placement: &Placement) -> (Option<u64>, UnitEnd) {
    let usage = tokio::time::timeout(Duration::from_secs(5), report.wait_for(Option::is_some))
        .await
        .ok()
        .and_then(|r| r.ok().and_then(|r| *r))
        .flatten()
        .map(|r| r.max_rss_bytes);
    (usage, placement.read_end().await)
}

/// The sandbox's teardown after its script's end: it resolves to how long
/// that took from the end (the audit row's `teardown_ms`). Not started until
/// polled; the daemon spawns it once the result is recorded.
pub struct Teardown(std::pin::Pin<Box<dyn std::future::Future<Output = Duration> + Send>>);

impl Teardown {
    pub async fn run(self) -> Duration {
        self.0.await
    }
}

impl std::fmt::Debug for Teardown {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Teardown")
    }
}

/// Step 7, second part: the unit goes (`Placement::release`), then the
/// keeper. After an early end (`sandbox` given) the sandbox's bwrap is waited
/// for first, up to 10 s (it exits once the init has), so that a leaf's kill
/// does not orphan the dying init.
async fn release_unit(placement: Placement, keeper: Option<Keeper>, sandbox: Option<Sandbox>) {
    if let Some(mut s) = sandbox {
        let _ = s.exit(Some(Duration::from_secs(10))).await;
    }
    placement.release().await;
    if let Some(k) = keeper {
        k.end().await;
    }
}

impl Collected {
    fn stderr_tail(&self) -> String {
        self.err
            .as_ref()
            .map(|c| String::from_utf8_lossy(&c.tail).trim_end().to_string())
            .unwrap_or_default()
    }

    /// What the daemon turns into the result object.
    fn ended(
        self,
        status: Status,
        error: Option<String>,
        exit: Option<Exit>,
        t0: Instant,
        return_max_chars: usize,
    ) -> Ended {
        let (output, output_truncated) = match &self.out {
            Some(c) => head_chars(&c.head, c.total, return_max_chars),
            None => (String::new(), false),
        };
        let stats = self.outcome.stats;
        let record_incomplete = [&self.out, &self.err]
            .into_iter()
            .flatten()
            .filter_map(|c| c.write_error.clone())
            .collect();
        Ended {
            status,
            exit_code: exit.and_then(|e| e.code),
            duration_ms: t0.elapsed().as_millis() as u64,
            output,
            output_truncated,
            error,
            // The unit's counters, or nothing: the init's report (the tree's
            // largest resident set) would under-report (see `Ended`), and the
            // outer bwrap's ru_maxrss is the daemon's size at the fork.
            memory_peak_bytes: stats.memory_peak_bytes,
            // bwrap reaps the init, which reaps the whole namespace: its rusage
            // covers every process of the sandbox.
            cpu_usec: stats.cpu_usec.or(exit.map(|e| e.cpu_usec)),
            backend_notes: vec![],
            setup_failed: false,
            record_incomplete,
            pre_made: None,
            teardown: None,
        }
    }
}

/// Why the supervisor ended a script before it exited by itself.
#[derive(Debug, Clone, PartialEq)]
pub enum Cut {
    /// It ran longer than `timeout_s`.
    Timeout,
    /// `script.cancel`, a revocation, a lost engine, or the daemon's shutdown.
    Stopped(Stop),
}

/// What the supervisor knows once a script has ended: the facts [`judge`] decides on.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Ending {
    pub cut: Option<Cut>,
    /// The script could not be placed in its unit (it never passed the gate).
    pub setup_error: Option<String>,
    /// The unit's memory events say the OOM killer ended it.
    pub oom_killed: bool,
    /// The unit was stopped from outside scriptgate (`systemctl stop`).
    pub stopped_externally: bool,
    /// systemd ended the unit at its `RuntimeMaxSec=`.
    pub unit_timeout: bool,
    pub exit: Option<Exit>,
    /// The code of the `ToolError` the script died of, if it did.
    pub uncaught: Option<String>,
    /// The end of stderr, trimmed.
    pub stderr_tail: String,
}

/// The endings the script did not choose, in `judge`'s order: the supervisor's
/// cut, a failed setup, the unit's counters; `None` when the script's own exit
/// decides. Known before the output is drained (the broker is told from it).
pub fn forced(e: &Ending, limits: &Limits, unit: &str) -> Option<(Status, String)> {
    match &e.cut {
        // systemd's backstop ended the unit before the daemon's own timer came
        // round (a stalled daemon): the unit's word says so.
        Some(Cut::Timeout) if e.unit_timeout => {}
        Some(Cut::Timeout) => {
            return Some((
                Status::Timeout,
                format!(
                    "the script ran longer than timeout_s = {} and was killed",
                    limits.timeout_s
                ),
            ))
        }
        Some(Cut::Stopped(stop @ (Stop::Cancel(_) | Stop::EngineLost))) => {
            return Some((Status::Cancelled, stop.why().unwrap_or_default()))
        }
        Some(Cut::Stopped(Stop::Interrupt)) => {
            return Some((
                Status::Interrupted,
                "the daemon stopped while the script ran".into(),
            ))
        }
        None => {}
    }
    if let Some(why) = &e.setup_error {
        return Some((Status::Error, why.clone()));
    }
    if e.oom_killed {
        return Some((
            Status::Oom,
            format!(
                "the script ran out of memory (memory_max_bytes = {}) and was killed",
                limits.memory_max_bytes
            ),
        ));
    }
    if e.unit_timeout {
        return Some((
            Status::Timeout,
            format!("the script's unit {unit} reached its RuntimeMaxSec= and systemd stopped it"),
        ));
    }
    if e.stopped_externally {
        return Some((
            Status::Cancelled,
            format!("stopped from outside scriptgate (systemctl stop {unit})"),
        ));
    }
    None
}

/// Which status and error an ending gets. The arms are in order of precedence:
/// the supervisor's own cut first, then a failed setup, then the unit's counters
/// (not the exit signal: a SIGKILL alone does not mean `oom`), then the exit.
pub fn judge(e: &Ending, limits: &Limits, unit: &str) -> (Status, Option<String>) {
    if let Some((status, why)) = forced(e, limits, unit) {
        return (status, Some(why));
    }
    if e.exit.and_then(|x| x.code) == Some(0) {
        return (Status::Ok, None);
    }
    let status =
        if e.uncaught.as_deref().and_then(ToolErrorCode::from_wire) == Some(ToolErrorCode::Limit) {
            Status::Limit
        } else {
            Status::Error
        };
    let error = if !e.stderr_tail.is_empty() {
        e.stderr_tail.clone()
    } else {
        match e.exit {
            Some(Exit { code: Some(c), .. }) => format!("exit code {c}"),
            Some(Exit {
                signal: Some(s), ..
            }) => format!("killed by signal {s}"),
            _ => "the sandbox ended without an exit status".into(),
        }
    };
    (status, Some(error))
}

#[cfg(test)]
mod tests {
    use super::{head_chars, judge, Cut, Ending, Stop};
    use crate::policy::Limits;
    use crate::protocol::Status;
    use crate::sys::Exit;

    fn limits() -> Limits {
        Limits {
            max_calls: 500,
            max_concurrency: 4,
            timeout_s: 600,
            memory_max_bytes: 1 << 30,
            tasks_max: 64,
        }
    }

    fn exited(code: Option<i32>, signal: Option<i32>) -> Option<Exit> {
        Some(Exit {
            code,
            signal,
            max_rss_bytes: 0,
            cpu_usec: 0,
        })
    }

    /// Every ending the supervisor can see, and the status and error it gets: a
    /// table, one row per ending, hence its length.
    #[test]
    fn each_ending_gets_its_status_and_error() {
        let ok = exited(Some(0), None);
        let failed = exited(Some(1), None);
        let killed = exited(None, Some(9));
        let unit = "scriptgate-ab.scope";
        let cancel = Some(Cut::Stopped(Stop::EngineLost));
        let table: Vec<(&str, Ending, Status, Option<&str>)> = vec![
            (
                "exit 0",
                Ending {
                    exit: ok,
                    ..Default::default()
                },
                Status::Ok,
                None,
            ),
            (
                "exit 0 with stderr is still ok",
                Ending {
                    exit: ok,
                    stderr_tail: "warning".into(),
                    ..Default::default()
                },
                Status::Ok,
                None,
            ),
            (
                "non-zero exit: the stderr tail",
                Ending {
                    exit: failed,
                    stderr_tail: "Traceback: boom".into(),
                    ..Default::default()
                },
                Status::Error,
                Some("Traceback: boom"),
            ),
            (
                "non-zero exit, nothing on stderr",
                Ending {
                    exit: failed,
                    ..Default::default()
                },
                Status::Error,
                Some("exit code 1"),
            ),
            (
                "a signal, nothing on stderr",
                Ending {
                    exit: killed,
                    ..Default::default()
                },
                Status::Error,
                Some("killed by signal 9"),
            ),
            (
                "no exit status",
                Ending::default(),
                Status::Error,
                Some("the sandbox ended without an exit status"),
            ),
            (
                "an uncaught limit ToolError",
                Ending {
                    exit: failed,
                    uncaught: Some("limit".into()),
                    stderr_tail: "ToolError: limit".into(),
                    ..Default::default()
                },
                Status::Limit,
                Some("ToolError: limit"),
            ),
            (
                "another uncaught ToolError is an error",
                Ending {
                    exit: failed,
                    uncaught: Some("denied".into()),
                    ..Default::default()
                },
                Status::Error,
                Some("exit code 1"),
            ),
            (
                "timeout beats everything after it",
                Ending {
                    cut: Some(Cut::Timeout),
                    oom_killed: true,
                    exit: killed,
                    ..Default::default()
                },
                Status::Timeout,
                Some("the script ran longer than timeout_s = 600 and was killed"),
            ),
            (
                "cancel keeps its reason",
                Ending {
                    cut: cancel.clone(),
                    setup_error: Some("x".into()),
                    exit: ok,
                    ..Default::default()
                },
                Status::Cancelled,
                Some("engine disconnected"),
            ),
            (
                "interrupt",
                Ending {
                    cut: Some(Cut::Stopped(Stop::Interrupt)),
                    ..Default::default()
                },
                Status::Interrupted,
                Some("the daemon stopped while the script ran"),
            ),
            (
                "a failed setup beats the counters",
                Ending {
                    setup_error: Some("cannot start the scope keeper: x".into()),
                    oom_killed: true,
                    exit: exited(Some(125), None),
                    ..Default::default()
                },
                Status::Error,
                Some("cannot start the scope keeper: x"),
            ),
            (
                "oom from the unit's counters, not the signal",
                Ending {
                    oom_killed: true,
                    stopped_externally: true,
                    exit: killed,
                    stderr_tail: "Killed".into(),
                    ..Default::default()
                },
                Status::Oom,
                Some("the script ran out of memory (memory_max_bytes = 1073741824) and was killed"),
            ),
            (
                "oom even with exit 0",
                Ending {
                    oom_killed: true,
                    exit: ok,
                    ..Default::default()
                },
                Status::Oom,
                Some("the script ran out of memory (memory_max_bytes = 1073741824) and was killed"),
            ),
            (
                "the scope's RuntimeMaxSec=",
                Ending {
                    unit_timeout: true,
                    exit: killed,
                    ..Default::default()
                },
                Status::Timeout,
                Some("the script's unit scriptgate-ab.scope reached its RuntimeMaxSec= and systemd stopped it"),
            ),
            (
                "the scope's RuntimeMaxSec= came first, the daemon's timer after it",
                Ending {
                    cut: Some(Cut::Timeout),
                    unit_timeout: true,
                    exit: killed,
                    ..Default::default()
                },
                Status::Timeout,
                Some("the script's unit scriptgate-ab.scope reached its RuntimeMaxSec= and systemd stopped it"),
            ),
            (
                "systemctl stop",
                Ending {
                    stopped_externally: true,
                    exit: killed,
                    ..Default::default()
                },
                Status::Cancelled,
                Some("stopped from outside scriptgate (systemctl stop scriptgate-ab.scope)"),
            ),
        ];
        for (what, ending, status, error) in table {
            assert_eq!(
                judge(&ending, &limits(), unit),
                (status, error.map(str::to_string)),
                "{what}"
            );
        }
    }

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
