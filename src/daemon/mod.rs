//! The daemon core, independent of transport: checks and starts scripts, tracks
//! them, and answers the protocol methods. `service::server` drives it from a
//! Unix socket; the CLI's embedded mode drives it in-process.
//!
//! A file per part of its work, each an `impl Daemon` block or a type of its own:
//!
//! - `peers`: who a connection's peer is ([`Daemon::identify`]), its key, roots
//!   and run scope;
//! - `start`: [`Daemon::start`], the steps of a start in their order, and the
//!   refusals' audit; the steps themselves are `admission` (step 1, with no store
//!   and no root: `admission::Admission`), `approval` (2), `record` (4) and
//!   `supervise` (5, the script's life to its recorded end);
//! - `lookup`: finding a script for a connection (`script.wait`, `status`,
//!   `cancel`), `run.revoke` and `run.describe`;
//! - `admin`: `daemon.info`, `admin.list`, `admin.calls`, `admin.prune`;
//! - `lifecycle`: connections being served, a graceful stop;
//! - `live` and `reload`: the configuration in force, which a start takes once
//!   and a reload (SIGHUP) swaps whole.

pub(crate) mod admin;
pub(crate) mod admission;
pub(crate) mod approval;
pub(crate) mod calls;
pub(crate) mod disk;
pub(crate) mod lifecycle;
pub(crate) mod live;
pub(crate) mod lookup;
pub(crate) mod peers;
pub(crate) mod prune;
pub mod ratelimit;
pub(crate) mod record;
pub(crate) mod registry;
pub(crate) mod reload;
pub(crate) mod roots;
pub(crate) mod running;
pub(crate) mod start;
pub(crate) mod supervise;

pub use live::Live;
pub use peers::{Access, Peer, PeerGroups};

use crate::audit::Store;
use crate::config::Config;
use crate::daemon::admission::Rules;
use crate::daemon::peers::Peers;
use crate::daemon::ratelimit::RefusalLimiter;
use crate::daemon::registry::Registry;
use crate::daemon::roots::Roots;
use crate::daemon::running::Running;
use crate::limits::{Backend, Picked};
use crate::policy::auth::{Engines, Role};
use crate::protocol::refusal::{Reason, Refused};
use crate::script::broker::RevokedRuns;
use crate::sys::Spawner;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

pub const VERSION: &str = env!("CARGO_PKG_VERSION");
/// What each running script holds, by script id.
type Usage = std::collections::HashMap<String, crate::protocol::Resources>;

/// `admin.list`'s resources are read at most this often: every answer within
/// it shares one reading (a flood of admin.list costs one pass over /proc or
/// the cgroups per period, not one per request).
pub const USAGE_FRESH: Duration = Duration::from_secs(1);
const AGENT_TOOLS_PY: &str = include_str!("../sandbox/agent_tools.py");

/// The daemon: one per `scriptgated` process (or per embedded CLI run). It
/// owns what outlives a connection: the configuration as loaded, the engines'
/// keys and roots, the audit store, the limit backend and what the start-up
/// preflight found, the running and finished scripts, the revoked runs, and
/// the counted refusals. Made by [`Daemon::new`], shared as an `Arc`; every
/// protocol method is one of its methods, taking the [`Peer`] or [`Access`] the
/// caller established.
pub struct Daemon {
    /// The configuration in force and what derives from it (`reload::Live`):
    /// swapped whole by a reload; each start takes it once.
    live: RwLock<Arc<Live>>,
    /// The file it came from and what reloads made of it (None: embedded).
    loaded: Mutex<Option<live::Loaded>>,
    /// When this daemon started, ms since the epoch.
    started_ms: i64,
    /// `<state>/runtime`, where `agent_tools.py` is (every launch mounts it).
    runtime_dir: PathBuf,
    /// The shared key, the `[[auth.engine]]` entries and the workspace roots.
    peers: Peers,
    pub store: Store,
    pub backend: Picked,
    /// What the start-up preflight found (see `preflight`).
    pub preflight: crate::sandbox::preflight::Preflight,
    spawner: Spawner,
    /// Running and finished scripts, `max_running` slots, pending approvals.
    registry: Arc<Registry<Running>>,
    /// Refused starts past a rate are counted, not recorded one by one.
    refusals: Mutex<RefusalLimiter<Reason>>,
    /// Refused connections counted, not yet written (`audit::connections`).
    refused_connections: Mutex<crate::audit::connections::Refused>,
    revoked: RevokedRuns,
    changed: tokio::sync::Notify,
    /// Set on SIGTERM: no new script starts (graceful stop, `server.drain_s`).
    stopping: std::sync::atomic::AtomicBool,
    /// Held by a workspace retention pass: one at a time (hourly, `admin.prune`).
    prune_pass: tokio::sync::Mutex<()>,
    /// The running scripts' resources as last read, and when (`list_with_usage`):
    /// read at most once per [`USAGE_FRESH`], by one reader at a time.
    usage: tokio::sync::Mutex<Option<(Instant, Arc<Usage>)>>,
    /// The connections being served, by id, until their last answer is queued
    /// (`answers_written`, the barrier before a stop).
    answering: Mutex<std::collections::HashMap<u64, crate::protocol::rpc::Endpoint>>,
    /// The bound on all scripts together as last decided and set (start,
    /// reload): its `problem` is why setting it failed (`bound_all_scripts`).
    all_scripts: Mutex<crate::protocol::AllScripts>,
    /// The teardowns of ended scripts' sandboxes, run after their results
    /// (`script::Teardown`); a stopping daemon waits for them (`settled`).
    teardowns: tokio_util::task::TaskTracker,
}

#[derive(Debug, thiserror::Error)]
pub enum StartupError {
    #[error("{0}")]
    Config(#[from] crate::config::ConfigError),
    #[error("{0}")]
    Store(#[from] crate::audit::StoreError),
    #[error("{0}")]
    Backend(#[from] crate::limits::BackendError),
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Whose daemon this is: the system's service, or one in a CLI process
/// (`scriptgate run --embedded`, `scriptgate mcp`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hosting {
    /// `scriptgated`: it owns scriptgate.slice, so what pool units are left
    /// there at its start are an earlier daemon's, and go.
    Service,
    /// A daemon inside a CLI process: it owns nothing of the host's and leaves
    /// every unit it did not make alone.
    Embedded,
}

/// A failed file operation of the start-up, with its path.
fn io_error(op: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> StartupError {
    let path = path.to_path_buf();
    move |source| StartupError::Io { op, path, source }
}

impl Daemon {
    /// Open state, pick the backend, write the runtime module. Must run inside a
    /// tokio runtime (the spawner thread enters it).
    pub async fn new(
        cfg: Config,
        key: Vec<u8>,
        hosting: Hosting,
    ) -> Result<(Arc<Daemon>, Vec<crate::audit::Recovered>), StartupError> {
        let engines = Engines::load(&cfg.auth, Some(&key), Path::new("auth.engine"))?;
        let backend = Backend::pick(
            cfg.sandbox.backend,
            &crate::limits::CgroupView::real(),
            cfg.scripts.cpu_quota_percent,
        )
        .await?;
        // What an earlier daemon's pool left, whether this one keeps a pool or
        // not (a root daemon on the systemd backend owns scriptgate.slice).
        if hosting == Hosting::Service {
            backend.backend.clear_stale_members().await;
        }
        let state = cfg.state.dir.clone();
        make_state_dir(&state)?;
        let runtime_dir = write_runtime_module(&state)?;
        let spawner = Spawner::start();
        // The module's compile beside the preflight (both run Python): it adds
        // nothing to the start's length.
        let (preflight, ()) = tokio::join!(
            crate::sandbox::preflight::Preflight::run(&spawner, &cfg, &backend.backend),
            compile_runtime_module(&runtime_dir, &cfg.scripts.python),
        );
        let (store, interrupted) = Store::open(&state.join("scriptgate.db"), admin_gid(&cfg))?;
        // Their sandboxes ended with that daemon, all but one it died making.
        if hosting == Hosting::Service {
            let ids: Vec<String> = interrupted
                .iter()
                .map(|r| r.result.script_id.clone())
                .collect();
            backend.backend.end_units_of(&ids).await;
        }
        // The sandbox init is this binary: resolve its path now, while it is the
        // file this process runs (an upgrade may replace it before the first script).
        let _ = crate::sandbox::init::exe();
        let revoked: RevokedRuns =
            Arc::new(RwLock::new(store.revoked_runs()?.into_iter().collect()));
        let settings = crate::script::Settings::new(
            &cfg,
            runtime_dir.clone(),
            preflight.sandbox.disable_userns,
            backend.backend.clone(),
            &spawner,
        );
        let peers = Peers::new(
            key,
            engines,
            Roots::new(cfg.workspace.roots.clone()),
            cfg.auth.allowed_groups.clone(),
        );
        let registry = Registry::new(cfg.server.max_running);
        let d = Daemon {
            live: RwLock::new(Arc::new(Live {
                rules: Rules::new(&cfg, &preflight),
                settings,
                cfg,
            })),
            loaded: Mutex::new(None),
            started_ms: crate::time::now_ms(),
            runtime_dir,
            peers,
            store,
            backend,
            preflight,
            spawner,
            registry,
            refusals: Mutex::new(RefusalLimiter::new(crate::daemon::ratelimit::STARTS)),
            refused_connections: Mutex::default(),
            revoked,
            changed: tokio::sync::Notify::new(),
            stopping: Default::default(),
            prune_pass: tokio::sync::Mutex::new(()),
            answering: Mutex::default(),
            usage: tokio::sync::Mutex::new(None),
            all_scripts: Mutex::default(),
            teardowns: tokio_util::task::TaskTracker::new(),
        };
        d.peers.engine_dirs_at_start();
        d.bound_all_scripts().await;
        let d = Arc::new(d);
        d.spawn_tickers();
        Ok((d, interrupted))
    }

    /// The daemon's own periodic work, each ending with the daemon: counted
    /// refusals written as a summary at least every 10 s, and running scripts'
    /// counts written to their audit rows at least every checkpoint tick, in
    /// one write, so that a kill -9 leaves real counts (`audit::checkpoint`).
    fn spawn_tickers(self: &Arc<Self>) {
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(10));
            loop {
                tick.tick().await;
                let Some(d) = weak.upgrade() else { break };
                d.flush_refusals().await;
            }
        });
        self.spawn_checkpoints();
    }

    /// Running scripts' counts written every checkpoint tick; a write that
    /// keeps failing (a full state filesystem) is said once, then at most once
    /// a minute, and its recovery once (`audit::checkpoint::Failing`).
    fn spawn_checkpoints(self: &Arc<Self>) {
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(crate::audit::checkpoint::TICK);
            let mut written = crate::audit::checkpoint::Checkpoint::default();
            // A full state filesystem fails every tick: said once a minute.
            let mut failing = crate::audit::checkpoint::Failing::default();
            use crate::audit::checkpoint::Say;
            loop {
                tick.tick().await;
                let Some(d) = weak.upgrade() else { break };
                let now = d.live_counts();
                let alive: Vec<String> = now.iter().map(|(id, _, _)| id.clone()).collect();
                let changed = written.changed(now);
                if changed.is_empty() && alive.is_empty() {
                    continue; // nothing written: neither a failure nor a recovery
                }
                let said = match d.store.checkpoint_counts(changed.clone(), alive).await {
                    Ok(()) => {
                        written.written(&changed);
                        failing.succeeded(std::time::Instant::now())
                    }
                    Err(e) => Some(failing.failed(std::time::Instant::now(), &e.to_string())),
                };
                match said {
                    Some(Say::Warn(line)) => tracing::warn!("{line}"),
                    Some(Say::Quiet(line)) => tracing::debug!("{line}"),
                    Some(Say::Recovered(line)) => tracing::info!("{line}"),
                    None => {}
                }
            }
        });
    }

    /// Who a connection's peer is, decided once, before it is served
    /// (`peers::Peers::identify`). Everything later takes the [`Peer`] this
    /// returns. `groups` is None for root.
    pub fn identify(
        &self,
        uid: u32,
        gid: u32,
        pid: Option<i32>,
        groups: Option<PeerGroups<'_>>,
    ) -> Result<(Role, Peer), Refused> {
        self.peers.identify(uid, gid, pid, groups)
    }

    /// Are there `[[auth.engine]]` entries? (Without them, the gate need not
    /// look up a peer's every group.)
    pub(crate) fn has_engine_entries(&self) -> bool {
        self.peers.has_entries()
    }

    /// A peer identified and admitted: a non-root engine of `workspace.roots`
    /// gets its per-uid directories now (`peers::Peers::connected`).
    pub fn connected(&self, role: Role, peer: Peer) {
        self.peers.connected(role, peer)
    }
}

/// The state directory and whichever of its parents are missing, each 0755
/// whatever the umask (scriptgate.service's is 0077): script uids pass through
/// it to `runtime/` and `exec/`. One that exists is left as it is (the unit's
/// StateDirectory=, or an admin's).
fn make_state_dir(state: &Path) -> Result<(), StartupError> {
    let missing: Vec<&Path> = state.ancestors().take_while(|p| !p.exists()).collect();
    std::fs::create_dir_all(state).map_err(io_error("create state dir", state))?;
    for dir in missing.into_iter().rev() {
        crate::sys::chmod(dir, 0o755).map_err(io_error("chmod", dir))?;
    }
    Ok(())
}

/// `<state>/runtime/`: `agent_tools.py`, the module every sandbox mounts
/// read-only, and `member.py`, a pool member's program (`sandbox::member`); the
/// directory must be readable by script uids (bwrap binds it as them).
pub(crate) fn write_runtime_module(state: &Path) -> Result<PathBuf, StartupError> {
    let runtime_dir = state.join("runtime");
    std::fs::create_dir_all(&runtime_dir).map_err(io_error("create", &runtime_dir))?;
    crate::sys::chmod(&runtime_dir, 0o755).map_err(io_error("chmod", &runtime_dir))?;
    for (name, text) in [
        ("agent_tools.py", AGENT_TOOLS_PY),
        (crate::sandbox::MEMBER_PY_NAME, crate::sandbox::MEMBER_PY),
    ] {
        let file = runtime_dir.join(name);
        // A name of this process's own: two daemons on one state directory (the
        // CLI's embedded ones, started together) must not rename each other's
        // file away between its write and its chmod.
        let tmp = runtime_dir.join(format!(".{name}.{}.new", std::process::id()));
        std::fs::write(&tmp, text).map_err(io_error("write", &tmp))?;
        crate::sys::chmod(&tmp, 0o644).map_err(io_error("chmod", &tmp))?;
        std::fs::rename(&tmp, &file).map_err(io_error("rename", &file))?;
    }
    Ok(runtime_dir)
}

/// `agent_tools.py` compiled once, by the scripts' interpreter, into
/// `runtime/__pycache__`: every script that imports it (nearly all) would
/// otherwise compile it anew (PYTHONDONTWRITEBYTECODE; about 6 ms of a 20 ms
/// start here). A checked-hash .pyc: Python uses it only while it matches the
/// source byte for byte, whatever the files' times. Not made (said at debug
/// level): scripts compile it themselves, as before.
async fn compile_runtime_module(runtime_dir: &Path, python: &Path) {
    const COMPILE: &str = "import importlib.util as u, py_compile as p, sys\n\
        c = u.cache_from_source(sys.argv[1])\n\
        p.compile(sys.argv[1], cfile=c, doraise=True, invalidation_mode=p.PycInvalidationMode.CHECKED_HASH)\n\
        print(c)";
    let module = runtime_dir.join("agent_tools.py");
    let out = tokio::process::Command::new(python)
        .arg("-I")
        .arg("-c")
        .arg(COMPILE)
        .arg(&module)
        .env_clear()
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .output();
    let out = match tokio::time::timeout(std::time::Duration::from_secs(30), out).await {
        Ok(Ok(o)) if o.status.success() => o,
        Ok(Ok(o)) => {
            let why = String::from_utf8_lossy(&o.stderr);
            return tracing::debug!("agent_tools.py not compiled ahead: {}", why.trim());
        }
        Ok(Err(e)) => return tracing::debug!("agent_tools.py not compiled ahead: {e}"),
        Err(_) => return tracing::debug!("agent_tools.py not compiled ahead: took over 30 s"),
    };
    let pyc = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    // Readable by the scripts' uids, whatever the daemon's umask.
    for (path, mode) in [(pyc.parent(), 0o755), (Some(pyc.as_path()), 0o644)] {
        if let Some(path) = path.filter(|p| p.starts_with(runtime_dir)) {
            if let Err(e) = crate::sys::chmod(path, mode) {
                tracing::debug!(
                    "agent_tools.py's compiled copy: chmod {}: {e}",
                    path.display()
                );
            }
        }
    }
}

/// The gid of the first of `auth.admin_groups` that exists (the audit store's
/// group).
fn admin_gid(cfg: &Config) -> Option<u32> {
    cfg.auth
        .admin_groups
        .iter()
        .find_map(|g| nix::unistd::Group::from_name(g).ok().flatten())
        .map(|g| g.gid.as_raw())
}
