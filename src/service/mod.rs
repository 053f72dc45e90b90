//! `scriptgated` as a process: arguments, logging, the listening socket (socket
//! activation or `--listen`), sd_notify, signals. The order in `main` matters:
//! environment variables are read before the runtime starts threads, and the config
//! and key are checked before any socket exists.

pub(crate) mod checkconfig;
pub(crate) mod server;
pub(crate) mod startfail;

use crate::config::{Config, DEFAULT_PATH};
use crate::daemon::Daemon;
use clap::Parser;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

#[derive(Parser, Debug)]
#[command(
    name = "scriptgated",
    version,
    about = "Run model-written scripts in a sandbox and broker their tool calls (engine protocol v1)"
)]
pub struct Args {
    /// Bind this Unix socket instead of taking one from systemd (LISTEN_FDS).
    #[arg(long, value_name = "PATH")]
    pub listen: Option<PathBuf>,
    /// Configuration file.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Check the configuration and the token key, print what the daemon would run
    /// with (backend included), and exit 0 (ok) or 1; nothing is started.
    #[arg(long, conflicts_with = "listen")]
    pub check_config: bool,
    /// As --check-config, and the host too: the sandbox is made with the real
    /// bwrap as the sandbox.run_as uid, as the daemon does at start; exit 1 when
    /// no script could run.
    #[arg(long, conflicts_with_all = ["listen", "check_config"])]
    pub check: bool,
}

pub fn init_logging() {
    use tracing_subscriber::prelude::*;
    let filter = tracing_subscriber::EnvFilter::try_from_env("SCRIPTGATE_LOG")
        .unwrap_or_else(|_| "info".into());
    let journald = Path::new("/run/systemd/journal/socket")
        .exists()
        .then(|| {
            tracing_journald::layer()
                .ok()
                .map(|l| l.with_field_prefix(None))
        })
        .flatten();
    let registry = tracing_subscriber::registry().with(filter);
    match journald {
        Some(l) => registry.with(l).init(),
        None => {
            use std::io::IsTerminal;
            let ansi = std::io::stderr().is_terminal();
            registry
                .with(
                    tracing_subscriber::fmt::layer()
                        .with_writer(std::io::stderr)
                        .with_target(false)
                        .with_ansi(ansi),
                )
                .init()
        }
    }
}

pub fn main() -> ExitCode {
    // 0. Descriptors inherited above stdio (a shell's, a test harness's) must not
    //    reach the sandboxes: close-on-exec, before anything is spawned.
    let cloexec = crate::sys::cloexec_inherited_fds();
    let args = Args::parse();
    if args.check_config || args.check {
        return crate::service::checkconfig::main(args.config, args.check);
    }
    // 1. Before any thread exists: take (and unset) LISTEN_FDS / WATCHDOG_USEC.
    let activated = match crate::sys::activated_sockets() {
        Ok(fds) => fds,
        Err(e) => return fail(&format!("socket activation: {e}")),
    };
    let watchdog = crate::sys::take_watchdog();
    // 2. Config and key: any error stops us here, before a socket is created.
    let (path, explicit) = match &args.config {
        Some(p) => (p.clone(), true),
        None => (PathBuf::from(DEFAULT_PATH), false),
    };
    let (cfg, source) = match Config::load_with_source(&path, explicit) {
        Ok(c) => c,
        Err(e) => return cannot_start(&activated, &e),
    };
    let key = match cfg.read_key() {
        Ok(k) => k,
        Err(e) => return cannot_start(&activated, &e),
    };
    if activated.is_empty() && args.listen.is_none() {
        return fail(
            &"no socket: not started by scriptgate.socket (LISTEN_FDS) and no --listen PATH given",
        );
    }
    init_logging();
    match crate::sys::raise_nofile() {
        Ok(n) => tracing::debug!("open descriptors: up to {n}"),
        Err(e) => tracing::warn!("cannot raise the open-descriptor limit: {e}"),
    }
    if let Err(e) = cloexec {
        tracing::warn!("cannot mark inherited descriptors close-on-exec: {e}");
    }
    // 3. Only the capabilities scripts need (scriptgated(8), Privileges), while
    //    this is the only thread: capabilities are per thread, and every thread
    //    the runtime and the daemon start from here on inherits this one's. (A
    //    drop on one thread of many left the others all of root's.) The state,
    //    the engines' directories, the audit store and the socket's group below
    //    take only kept ones.
    //    Pre-made sandboxes' capabilities stay with the mount server only,
    //    started before the drop (`sandbox::mounter`).
    if cfg.sandbox.pool_size > 0 {
        crate::sandbox::mounter::start_server(&crate::sandbox::init::exe());
    }
    let quotas = cfg.scripts.disk_max_bytes > 0;
    if let Err(e) = crate::sys::drop_daemon_capabilities(quotas, false) {
        tracing::warn!("could not drop capabilities: {e}");
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => return fail(&e),
    };
    let code = rt.block_on(run(
        cfg,
        source,
        key,
        activated,
        args.listen,
        watchdog.map(|d| d.as_micros() as u64),
    ));
    // Scripts were interrupted and recorded; do not wait for stray blocking tasks.
    // A pool's keeper asks the runtime nothing more from here on.
    crate::sandbox::pool::stopping();
    rt.shutdown_timeout(Duration::from_secs(1));
    code
}

/// Exit 1 (the unit does not restart on it), telling the engines queued on an
/// activated socket why first (crate::service::startfail).
fn cannot_start(activated: &[OwnedFd], e: &dyn std::fmt::Display) -> ExitCode {
    crate::service::startfail::answer_pending(activated, e);
    fail(e)
}

/// Why the daemon cannot start or cannot go on, on standard error: under systemd
/// that is the journal, and each line is marked priority err (`<3>`), so that
/// `journalctl -u scriptgate -p err` shows it beside systemd's "Failed to start".
fn fail(e: &dyn std::fmt::Display) -> ExitCode {
    let prefix = if crate::sys::stderr_is_journal() {
        "<3>"
    } else {
        ""
    };
    eprint!("{}", err_lines(prefix, &format!("scriptgated: {e}")));
    ExitCode::from(1)
}

/// `text`, each of its lines with `prefix`.
fn err_lines(prefix: &str, text: &str) -> String {
    text.lines().map(|l| format!("{prefix}{l}\n")).collect()
}

/// The daemon's life, in order: state (which completes what a killed daemon left
/// running), the socket, ready, the housekeeping tasks,
/// serving until a signal or idle exit, then interrupting what still runs.
async fn run(
    cfg: Config,
    source: crate::config::Source,
    key: Vec<u8>,
    activated: Vec<OwnedFd>,
    listen: Option<PathBuf>,
    watchdog_usec: Option<u64>,
) -> ExitCode {
    let activated = activated.into_iter().next();
    let idle_exit = (activated.is_some() && cfg.server.idle_exit_s > 0)
        .then(|| Duration::from_secs(cfg.server.idle_exit_s));
    // 1. State first: a bad state dir or config stops us before any socket exists.
    let (daemon, interrupted) = match Daemon::new(cfg, key, crate::daemon::Hosting::Service).await {
        Ok(d) => d,
        Err(e) => return cannot_start(activated.as_slice(), &e),
    };
    daemon.loaded_from(source);
    // Scripts a killed daemon left running: their record is completed now, and so is
    // their journal entry.
    for r in &interrupted {
        crate::audit::journal::script_finished(&crate::audit::journal::Finished {
            result: &r.result,
            runner: r.runner.as_deref(),
            uid: r.run_uid,
            unit: None,
            workspace: &r.workspace,
            infrastructure: true,
            trace_id: None,
        });
    }
    // 2. The socket (systemd's, or our own --listen; its group takes CAP_CHOWN).
    let bound = activated.is_none();
    let listener = match listener(
        activated,
        listen.as_deref(),
        &daemon.live().cfg.auth.allowed_groups,
    ) {
        Ok(l) => l,
        Err(e) => return fail(&format!("listening socket: {e}")),
    };
    // 3. Ready: `systemctl start` returns now, and the status line begins.
    announce_ready(&daemon);
    let housekeeping = Housekeeping::start(&daemon, watchdog_usec);
    // 4. Serve until a signal, idle exit or an accept error.
    let code = serve_until_stopped(&daemon, listener, idle_exit).await;
    // 5. Stop: running scripts are interrupted and recorded before we exit,
    //    then their sandboxes torn down, within one 10 s (the unit's
    //    TimeoutStopSec= is drain_s + 15 s).
    let _ = sd_notify::notify(&[sd_notify::NotifyState::Stopping]);
    let stop_by = tokio::time::Instant::now() + Duration::from_secs(10);
    daemon.interrupt_all(Duration::from_secs(10)).await;
    daemon
        .settled(stop_by.saturating_duration_since(tokio::time::Instant::now()))
        .await;
    daemon.flush_refusals().await;
    drop(housekeeping);
    // Last: the log folded into scriptgate.db, so that a copy of the file alone
    // is a backup (a start refused on a connection still open writes after it,
    // and stays in the log; scriptgated(8) BACKUP).
    daemon.checkpoint_store().await;
    if let Some(p) = listen.filter(|_| bound) {
        let _ = std::fs::remove_file(p);
    }
    code
}

/// The listening socket: the one systemd passed, or `--listen PATH` bound now.
fn listener(
    activated: Option<OwnedFd>,
    listen: Option<&Path>,
    groups: &[String],
) -> std::io::Result<tokio::net::UnixListener> {
    match activated {
        Some(fd) => {
            let std = std::os::unix::net::UnixListener::from(fd);
            std.set_nonblocking(true)?;
            tokio::net::UnixListener::from_std(std)
        }
        None => bind(listen.expect("main checked: a socket or --listen"), groups),
    }
}

/// Log readiness with the backend (a warning when scripts of one uid share their
/// limits), and tell systemd.
fn announce_ready(daemon: &Daemon) {
    let notes = if daemon.backend.notes.is_empty() {
        "as configured".to_string()
    } else {
        daemon.backend.notes.join("; ")
    };
    let backend = daemon.backend.kind.as_str();
    // The preflight: limits read back from a unit, and the sandbox probed.
    let preflight = daemon.preflight.summary();
    if daemon
        .preflight
        .blocks_scripts(daemon.live().cfg.sandbox.require_enforced_limits)
    {
        // No script can run: at err, where `journalctl -p err` looks.
        tracing::error!(
            version = crate::daemon::VERSION,
            backend,
            "scriptgated ready (backend {backend}; {notes}; {preflight}); no script can run until this is fixed"
        );
    } else if daemon.backend.limits_per_script() && !daemon.preflight.loud() {
        tracing::info!(
            version = crate::daemon::VERSION,
            backend,
            "scriptgated ready (backend {backend}; {notes}; {preflight})"
        );
    } else {
        // Loud: scripts of one uid share their limits on this backend, or the
        // limits are not in force, or the sandbox cannot be made.
        tracing::warn!(
            version = crate::daemon::VERSION,
            backend,
            "scriptgated ready (backend {backend}; {notes}; {preflight})"
        );
    }
    if let Err(e) =
        crate::audit::metrics::write_daemon_file(&daemon.live().cfg.state.dir, &daemon.info())
    {
        tracing::warn!("cannot write daemon.json for scriptgate metrics: {e}");
    }
    let _ = sd_notify::notify(&[
        sd_notify::NotifyState::Ready,
        sd_notify::NotifyState::Status("0 scripts running"),
    ]);
}

/// The tasks that run beside the server: audit retention (at start, then hourly),
/// the status line systemd shows, and the watchdog ping. Dropping it stops them.
struct Housekeeping(Vec<tokio::task::JoinHandle<()>>);

impl Housekeeping {
    fn start(daemon: &Arc<Daemon>, watchdog_usec: Option<u64>) -> Housekeeping {
        let mut tasks = Vec::new();
        tasks.push(tokio::spawn(audit_retention(daemon.clone())));
        let d = daemon.clone();
        tasks.push(tokio::spawn(workspace_retention(d)));
        tasks.push(tokio::spawn(reload_on_hangup(daemon.clone())));
        let d = daemon.clone();
        tasks.push(tokio::spawn(async move {
            loop {
                d.changed().await;
                let n = d.running_count();
                let s = format!("{n} script{} running", if n == 1 { "" } else { "s" });
                let _ = sd_notify::notify(&[sd_notify::NotifyState::Status(&s)]);
            }
        }));
        if let Some(usec) = watchdog_usec {
            tasks.push(tokio::spawn(async move {
                let mut t = tokio::time::interval(Duration::from_micros(usec / 2));
                loop {
                    t.tick().await;
                    let _ = sd_notify::notify(&[sd_notify::NotifyState::Watchdog]);
                }
            }));
        }
        Housekeeping(tasks)
    }
}

/// `[audit] retain_days`: at start, then hourly, audit rows older than that
/// many days are removed (0 keeps everything). Read at every pass: a reload
/// changes the next one.
async fn audit_retention(d: Arc<Daemon>) {
    let mut t = tokio::time::interval(Duration::from_secs(3600));
    loop {
        t.tick().await;
        let days = d.live().cfg.audit.retain_days;
        if days == 0 {
            continue; // retain_days = 0 keeps everything
        }
        match d.store.prune(days).await {
            Ok((0, 0)) => {}
            Ok((s, r)) => {
                tracing::info!("audit retention ({days} days): pruned {s} scripts and {r} refusals")
            }
            Err(e) => tracing::warn!("audit retention: {e}"),
        }
    }
}

/// SIGHUP (`systemctl reload scriptgate`, the unit's `ExecReload=`): the
/// configuration file is read again (`Daemon::reload`). systemd is told
/// `RELOADING=1` with the monotonic time first and `READY=1` when done, so that
/// the unit is "reloading" meanwhile and active again after. What changed is
/// logged at info, the keys that need a restart at warning ("pending restart:
/// KEY, ..."), and a file that does not check at err, the running
/// configuration kept.
async fn reload_on_hangup(d: Arc<Daemon>) {
    use tokio::signal::unix::{signal, SignalKind};
    let Ok(mut hup) = signal(SignalKind::hangup()) else {
        return;
    };
    while hup.recv().await.is_some() {
        let mut reloading = vec![sd_notify::NotifyState::Reloading];
        reloading.extend(sd_notify::NotifyState::monotonic_usec_now().ok());
        let _ = sd_notify::notify(&reloading);
        match d.reload() {
            Ok(r) => {
                d.bound_all_scripts().await;
                let applied = match r.applied.as_slice() {
                    [] => "no setting that applies live changed".to_string(),
                    a => format!("in force for new scripts: {}", a.join(", ")),
                };
                tracing::info!("SIGHUP: configuration reloaded ({applied})");
                if !r.pending.is_empty() {
                    tracing::warn!(
                        "SIGHUP: pending restart: {} (changed in the file; the running values are kept until \"systemctl restart scriptgate\")",
                        r.pending.join(", ")
                    );
                }
            }
            Err(e) => {
                tracing::error!("SIGHUP: configuration not reloaded, the running one is kept: {e}")
            }
        }
        let n = d.running_count();
        let status = format!("{n} script{} running", if n == 1 { "" } else { "s" });
        let _ = sd_notify::notify(&[
            sd_notify::NotifyState::Ready,
            sd_notify::NotifyState::Status(&status),
        ]);
    }
}

/// `[workspace] retain_days`: at start, then hourly, remove the workspaces
/// scriptgate created that nothing used for that long (crate::daemon::prune; bounded per
/// pass, never an engine's own workspace, never one a running script uses).
async fn workspace_retention(d: Arc<Daemon>) {
    let mut t = tokio::time::interval(Duration::from_secs(3600));
    loop {
        t.tick().await;
        let days = d.live().cfg.workspace.retain_days;
        if days == 0 {
            continue;
        }
        // The pass `admin.prune` runs too (one at a time).
        let pass = match d.prune_workspaces(false, None).await {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!("workspace retention: {}", e.message);
                continue;
            }
        };
        for c in &pass.expired {
            match &c.error {
                None => tracing::info!(
                    "workspace retention ({days} days): removed {} (last used {})",
                    c.path.display(),
                    crate::time::rfc3339(c.last_used_ms)
                ),
                Some(e) => {
                    tracing::warn!(
                        "workspace retention: cannot remove {}: {e}",
                        c.path.display()
                    )
                }
            }
        }
        // Not forgotten: looked at again at the next pass.
        for u in &pass.unknown {
            tracing::warn!(
                "workspace retention: cannot look at {} now ({}); kept, and looked at again next pass",
                u.path.display(),
                u.error
            );
        }
    }
}

impl Drop for Housekeeping {
    fn drop(&mut self) {
        for t in &self.0 {
            t.abort();
        }
    }
}

/// Serve connections until SIGTERM, SIGINT, idle exit or an accept error. On a
/// signal, drain: refuse new starts, keep serving the running scripts (their tool
/// calls, script.wait) until they end or `server.drain_s` passes, or a second
/// signal comes; the caller then interrupts what still runs.
async fn serve_until_stopped(
    daemon: &Arc<Daemon>,
    listener: tokio::net::UnixListener,
    idle_exit: Option<Duration>,
) -> ExitCode {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
    let serve = crate::service::server::serve(daemon.clone(), listener, idle_exit);
    tokio::pin!(serve);
    let served = |r: std::io::Result<()>| match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(&format!("accept: {e}")),
    };
    let signal = tokio::select! {
        r = &mut serve => return served(r),
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    };
    daemon.stop_starting();
    let drain = Duration::from_secs(daemon.live().cfg.server.drain_s);
    let n = daemon.running_count();
    if n == 0 {
        tracing::info!("{signal}: stopping");
        return ExitCode::SUCCESS;
    }
    tracing::info!(
        "{signal}: stopping; no new scripts; {n} running may finish within server.drain_s = {} s",
        drain.as_secs()
    );
    let status = format!(
        "stopping: draining {n} running scripts (up to {} s)",
        drain.as_secs()
    );
    let _ = sd_notify::notify(&[
        sd_notify::NotifyState::Stopping,
        sd_notify::NotifyState::Status(&status),
    ]);
    tokio::select! {
        r = &mut serve => return served(r),
        _ = daemon.all_finished() => {
            tracing::info!("every running script finished; stopping");
            // The last result wakes this select and the engines' `script.wait`s at
            // once: keep serving until every connection's answers to the requests
            // it sent so far are written (`Daemon::answers_written`), at most
            // ANSWERS_BOUND (a peer that does not read its answers holds nobody up
            // longer).
            tokio::select! {
                _ = &mut serve => {}
                _ = daemon.answers_written() => {}
                _ = tokio::time::sleep(ANSWERS_BOUND) => tracing::warn!(
                    "stopping: some connections' answers were not written within {} s",
                    ANSWERS_BOUND.as_secs()
                ),
            }
        }
        _ = tokio::time::sleep(drain) => tracing::warn!(
            "server.drain_s = {} s passed with {} scripts running: interrupting them",
            drain.as_secs(),
            daemon.running_count()
        ),
        _ = term.recv() => tracing::info!("SIGTERM again: interrupting the running scripts"),
        _ = int.recv() => tracing::info!("SIGINT again: interrupting the running scripts"),
    }
    ExitCode::SUCCESS
}

/// After the drain, how long the connections may take to write the last answers.
const ANSWERS_BOUND: Duration = Duration::from_secs(5);

/// Bind `--listen PATH`: refuse if a live daemon answers there, replace a stale
/// socket, mode 0666 like scriptgate.socket (the SO_PEERCRED check in `server`
/// is the gate: administrators who are not engines must reach it too), group
/// the first allowed group when we can set it.
fn bind(path: &Path, groups: &[String]) -> std::io::Result<tokio::net::UnixListener> {
    use std::os::unix::fs::FileTypeExt;
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            return Err(std::io::Error::other(format!(
                "{} exists and is not a socket",
                path.display()
            )));
        }
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(std::io::Error::other(format!(
                "{}: another daemon is listening there",
                path.display()
            )));
        }
        std::fs::remove_file(path)?;
    }
    let l = tokio::net::UnixListener::bind(path)?;
    crate::sys::chmod(path, 0o666)?;
    if let Some(g) = groups
        .iter()
        .find_map(|g| nix::unistd::Group::from_name(g).ok().flatten())
    {
        let _ = crate::sys::chown(path, None, Some(g.gid.as_raw()));
    }
    Ok(l)
}
