//! The daemon core, independent of transport: checks and starts scripts, tracks
//! them, and answers the protocol methods. `server` drives it from a Unix socket;
//! the CLI's embedded mode drives it in-process.
//!
//! A start ([`Daemon::start`]) runs these steps, each refusing with its own error:
//! admit (token, revocation, workspace, plan, identity, writability), seek the
//! approval (bounded per connection, holding no slot), reserve a `max_running`
//! slot, create the record, then make the broker and supervise the script.

pub(crate) mod calls;
pub(crate) mod disk;
pub(crate) mod prune;
pub mod ratelimit;
pub(crate) mod registry;

use crate::audit::{RefusalRow, StartRow, Store};
use crate::config::Config;
use crate::daemon::ratelimit::{RefusalLimiter, Verdict};
use crate::daemon::registry::{Registry, Slot};
use crate::limits::{Backend, Picked};
use crate::policy::auth::{EngineId, Role};
use crate::policy::runs::{RunKey, Scope};
use crate::policy::{Limits, Policy, StartPlan};
use crate::protocol::refusal::{Reason, Refused};
use crate::protocol::snapshot::PermissionMode;
use crate::protocol::token::{self, RunClaims, RunRef, Signed};
use crate::protocol::{
    code, ApprovalRequest, ApprovalTool, DaemonInfo, DaemonLimits, Described, ListedScript,
    Notification, Revoked, RpcError, ScriptRef, ScriptResult, ScriptState, ScriptStatus,
    StartParams, Started, Status,
};
use crate::script::broker::{Broker, BrokerSpec, Live, RevokedRuns};
use crate::script::engine::{EngineLink, LinkError};
use crate::script::{Launch, Stop};
use crate::sys::{resolve_run_as, ArtifactDir, Identity, Spawner, WorkspaceDir};
use crate::time::now_ms;
use serde_json::json;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};
use tokio::sync::watch;

pub const VERSION: &str = env!("CARGO_PKG_VERSION");
/// What each running script holds, by script id.
type Usage = std::collections::HashMap<String, crate::protocol::Resources>;

/// `admin.list`'s resources are read at most this often: every answer within
/// it shares one reading (a flood of admin.list costs one pass over /proc or
/// the cgroups per period, not one per request).
pub const USAGE_FRESH: Duration = Duration::from_secs(1);
/// Why a script whose engine connection closed is cancelled.
const ENGINE_LOST: &str = "engine disconnected";
const AGENT_TOOLS_PY: &str = include_str!("../sandbox/agent_tools.py");

/// Who is on the other end of a connection (from SO_PEERCRED).
#[derive(Debug, Clone, Copy)]
pub struct Peer {
    pub uid: u32,
    pub gid: u32,
    pub pid: Option<i32>,
    /// Root or a member of `auth.admin_groups`: may see and cancel any script.
    pub admin: bool,
    /// The `[[auth.engine]]` entry the peer is bound to (`Daemon::engines`);
    /// None: `auth.token_key_file` and `workspace.roots`.
    pub engine: Option<EngineId>,
}

/// A peer's groups as the gate looked them up (root needs none).
#[derive(Debug, Clone, Copy)]
pub struct PeerGroups<'a> {
    /// In `auth.allowed_groups`: an engine.
    pub in_allowed: bool,
    /// In `auth.admin_groups`: an administrator.
    pub in_admin: bool,
    /// Every gid of the peer, for `[[auth.engine]]` entries.
    pub gids: &'a [u32],
}

/// What the daemon keeps of a running script.
struct Running {
    run_id: String,
    /// `Daemon::run_key`: the run, scoped to the entry (or shared key and uid)
    /// that signed it.
    run_key: RunKey,
    runner: Option<String>,
    unit: Option<String>,
    owner: u64,
    peer_uid: u32,
    run_uid: u32,
    started: Instant,
    details_dir: String,
    /// The workspace's absolute path (journal entries).
    workspace: PathBuf,
    /// The engine's trace id (`SCRIPTGATE_TRACE_ID`).
    trace_id: Option<String>,
    live: Arc<Live>,
    stop: watch::Sender<Option<Stop>>,
    result: watch::Receiver<Option<ScriptResult>>,
}

pub struct Daemon {
    pub cfg: Config,
    key: Vec<u8>,
    /// `[[auth.engine]]`: engines bound to their own keys and workspaces.
    pub engines: crate::policy::auth::Engines,
    pub store: Store,
    pub backend: Picked,
    /// What the start-up preflight found (see `preflight`).
    pub preflight: crate::sandbox::preflight::Preflight,
    spawner: Spawner,
    /// What every script's launch takes from the daemon.
    host: crate::script::Host,
    /// Running and finished scripts, `max_running` slots, pending approvals.
    registry: Arc<Registry<Running>>,
    /// Refused starts past a rate are counted, not recorded one by one.
    refusals: Mutex<RefusalLimiter<Reason>>,
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

fn new_script_id() -> String {
    let mut b = [0u8; 8];
    getrandom::getrandom(&mut b).expect("getrandom");
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// How a start came to be allowed. The audit row keeps it as a string.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Approval {
    /// The engine answered `allow_once` to `approval.request`.
    AllowOnce,
    /// No write tool was declared: nothing to approve.
    NotNeeded,
    /// `permission_mode: auto` asks nothing.
    Auto,
    /// Every declared write tool is in the snapshot's `session_allowed`.
    SessionAllowed,
}

impl Approval {
    pub fn as_str(self) -> &'static str {
        match self {
            Approval::AllowOnce => "allow_once",
            Approval::NotNeeded => "not_needed",
            Approval::Auto => "auto",
            Approval::SessionAllowed => "session_allowed",
        }
    }

    /// Why a start that needs no `approval.request` is allowed; `None` when it
    /// needs one.
    pub fn without_request(plan: &StartPlan, mode: PermissionMode) -> Option<Approval> {
        if plan.needs_approval {
            None
        } else if plan.declared.is_empty() {
            Some(Approval::NotNeeded)
        } else if mode == PermissionMode::Auto {
            Some(Approval::Auto)
        } else {
            Some(Approval::SessionAllowed)
        }
    }
}

/// A start that passed every check that needs no engine and no slot.
struct Admitted {
    claims: RunClaims,
    /// The run as revocation knows it: scoped to the engine entry whose key signed
    /// it (`Daemon::run_key`), so one engine cannot revoke another's run.
    run_key: RunKey,
    workspace: WorkspaceDir,
    /// The workspace's (dev, inode) when retention may remove it once unused
    /// (crate::daemon::prune::vouch).
    vouched: Option<(u64, u64)>,
    policy: Policy,
    plan: StartPlan,
    identity: Identity,
    /// The engine's trace context (`script.start`'s `traceparent`).
    trace: Option<crate::protocol::trace::TraceContext>,
}

/// A script's record in its workspace, created before anything runs.
struct Record {
    art: ArtifactDir,
    details_dir: String,
    calls_log: std::fs::File,
    stdout_file: std::fs::File,
    stderr_file: std::fs::File,
    /// The code the sandbox runs (`script::Launch::script_code`).
    script_code: std::os::fd::OwnedFd,
    limits: Limits,
    /// Why `scripts.disk_max_bytes` is not in force for this script, if it is not.
    disk_note: Option<String>,
}

impl Daemon {
    /// Open state, pick the backend, write the runtime module. Must run inside a
    /// tokio runtime (the spawner thread enters it).
    pub async fn new(
        cfg: Config,
        key: Vec<u8>,
    ) -> Result<(Arc<Daemon>, Vec<crate::audit::Recovered>), StartupError> {
        let io = |op, path: &Path| {
            let path = path.to_path_buf();
            move |source| StartupError::Io { op, path, source }
        };
        let engines =
            crate::policy::auth::Engines::load(&cfg.auth, Some(&key), Path::new("auth.engine"))?;
        let backend = Backend::pick(
            cfg.sandbox.backend,
            &crate::limits::Host::real(),
            cfg.scripts.cpu_quota_percent,
        )
        .await?;
        let state = cfg.state.dir.clone();
        std::fs::create_dir_all(&state).map_err(io("create state dir", &state))?;
        // The runtime dir must be readable by script uids: bwrap binds it as them.
        let runtime_dir = state.join("runtime");
        std::fs::create_dir_all(&runtime_dir).map_err(io("create", &runtime_dir))?;
        let module = runtime_dir.join("agent_tools.py");
        // A name of this process's own: two daemons on one state directory (the
        // CLI's embedded ones, started together) must not rename each other's file
        // away between its write and its chmod.
        let tmp = runtime_dir.join(format!(".agent_tools.py.{}.new", std::process::id()));
        std::fs::write(&tmp, AGENT_TOOLS_PY).map_err(io("write", &tmp))?;
        crate::sys::chmod(&tmp, 0o644).map_err(io("chmod", &tmp))?;
        crate::sys::chmod(&runtime_dir, 0o755).map_err(io("chmod", &runtime_dir))?;
        std::fs::rename(&tmp, &module).map_err(io("rename", &module))?;
        let admin_gid = cfg
            .auth
            .admin_groups
            .iter()
            .find_map(|g| nix::unistd::Group::from_name(g).ok().flatten())
            .map(|g| g.gid.as_raw());
        let spawner = Spawner::start();
        let preflight =
            crate::sandbox::preflight::Preflight::run(&spawner, &cfg, &backend.backend).await;
        let (store, interrupted) = Store::open(&state.join("scriptgate.db"), admin_gid)?;
        // The sandbox init is this binary: resolve its path now, while it is the
        // file this process runs (an upgrade may replace it before the first script).
        let _ = crate::sandbox::init::exe();
        let revoked: RevokedRuns =
            Arc::new(RwLock::new(store.revoked_runs()?.into_iter().collect()));
        let host = crate::script::Host::new(
            &cfg,
            runtime_dir,
            preflight.sandbox.disable_userns,
            backend.backend.clone(),
        );
        let d = Daemon {
            key,
            engines,
            store,
            backend,
            preflight,
            spawner,
            host,
            registry: Registry::new(cfg.server.max_running),
            refusals: Mutex::new(RefusalLimiter::new(crate::daemon::ratelimit::STARTS)),
            revoked,
            changed: tokio::sync::Notify::new(),
            stopping: Default::default(),
            prune_pass: tokio::sync::Mutex::new(()),
            answering: Mutex::default(),
            usage: tokio::sync::Mutex::new(None),
            cfg,
        };
        d.engine_dirs_at_start();
        let d = Arc::new(d);
        // Counted refusals are written as a summary at least every 10 s.
        let weak = Arc::downgrade(&d);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(10));
            loop {
                tick.tick().await;
                let Some(d) = weak.upgrade() else { break };
                d.flush_refusals().await;
            }
        });
        // Running scripts' counts reach the audit row at least every tick, in
        // one write: a kill -9 leaves real counts (crate::audit::checkpoint).
        let weak = Arc::downgrade(&d);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(crate::audit::checkpoint::TICK);
            let mut written = crate::audit::checkpoint::Checkpoint::default();
            loop {
                tick.tick().await;
                let Some(d) = weak.upgrade() else { break };
                let now = d.live_counts();
                let alive = now.iter().map(|(id, _, _)| id.clone()).collect();
                let changed = written.changed(now);
                match d.store.checkpoint_counts(changed.clone(), alive).await {
                    Ok(()) => written.written(&changed),
                    Err(e) => tracing::warn!("{e}"),
                }
            }
        });
        Ok((d, interrupted))
    }

    /// `(script_id, calls, failures)` of every running script.
    fn live_counts(&self) -> Vec<crate::audit::checkpoint::Counts> {
        self.registry
            .all_running()
            .into_iter()
            .map(|(id, r)| {
                let l = &r.live;
                let calls = l.calls.load(Ordering::Relaxed);
                (id, calls, l.failures.load(Ordering::Relaxed))
            })
            .collect()
    }

    /// The workspaces of running scripts (retention leaves them alone).
    pub fn running_workspaces(&self) -> Vec<PathBuf> {
        self.registry
            .all_running()
            .into_iter()
            .map(|(_, r)| r.workspace.clone())
            .collect()
    }

    pub fn running_count(&self) -> usize {
        self.registry.running_count()
    }

    /// Graceful stop, first step: refuse new starts from now on.
    pub fn stop_starting(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        self.changed.notify_waiters();
    }

    /// Refuse a start once the daemon is stopping.
    fn check_not_stopping(&self) -> Result<(), Refused> {
        if self.stopping.load(Ordering::SeqCst) {
            return Err(stopping(self.cfg.server.drain_s));
        }
        Ok(())
    }

    /// Wait until no script runs.
    pub async fn all_finished(&self) {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if self.running_count() == 0 {
                return;
            }
            changed.await;
        }
    }

    /// Wakes when a script starts or ends (idle tracking, STATUS=).
    pub async fn changed(&self) {
        self.changed.notified().await
    }

    pub fn info(&self) -> DaemonInfo {
        let s = &self.cfg.scripts;
        DaemonInfo {
            version: VERSION.into(),
            protocol: crate::protocol::PROTOCOL_VERSION,
            backend: self.backend.kind.as_str().into(),
            backend_notes: self.backend_notes(),
            limits_per_script: self.backend.limits_per_script(),
            limits_enforced: Some(self.preflight.limits.enforced()),
            sandbox: Some(self.preflight.sandbox.info.clone()),
            same_uid: same_uid(
                nix::unistd::geteuid().is_root(),
                &self.cfg.sandbox.run_as,
                self.backend.kind.as_str(),
            ),
            running: self.running_count(),
            disk: Some(disk::info(
                s.disk_max_bytes,
                &self.cfg.workspace.roots,
                true,
            )),
            limits: DaemonLimits {
                max_calls: s.max_calls,
                max_concurrency: s.max_concurrency,
                timeout_s: s.timeout_s,
                memory_max_bytes: s.memory_max_bytes,
                tasks_max: s.tasks_max,
                output_max_bytes: s.output_max_bytes,
                return_max_chars: s.return_max_chars,
                approval_timeout_s: s.approval_timeout_s,
                max_running: self.cfg.server.max_running,
            },
        }
    }

    /// The backend's notes, then what the preflight found not in force.
    pub fn backend_notes(&self) -> Vec<String> {
        let mut v = self.backend.notes.clone();
        v.extend(self.preflight.limits.lines());
        v
    }

    pub fn sandbox_check(&self) -> &crate::sandbox::preflight::SandboxCheck {
        &self.preflight.sandbox
    }

    /// Who a connection's peer is, decided once, before it is served: its role
    /// (root, its groups), its `[[auth.engine]]` entry, and so which key signs
    /// its tokens, where its workspaces lie and whose runs it sees. Everything
    /// later takes the [`Peer`] this returns. `groups` is None for root.
    pub fn identify(
        &self,
        uid: u32,
        gid: u32,
        pid: Option<i32>,
        groups: Option<PeerGroups<'_>>,
    ) -> Result<(Role, Peer), Refused> {
        let auth = &self.cfg.auth;
        let role = crate::policy::auth::role(
            uid == 0,
            groups.is_some_and(|g| g.in_allowed),
            groups.is_some_and(|g| g.in_admin),
        );
        let admin = match role {
            Role::Refused => {
                return Err(Refused::new(
                    Reason::PeerNotAllowed,
                    format!(
                        "uid {uid} may not use scriptgated: not root and not in auth.allowed_groups {:?}",
                        auth.allowed_groups
                    ),
                ))
            }
            Role::AdminOnly => true,
            Role::Engine { admin } => admin,
        };
        let engine = match (role, groups) {
            (Role::Engine { .. }, Some(g)) => self
                .engines
                .for_peer(uid, g.gids)
                .map_err(|m| Refused::new(Reason::EngineAmbiguous, m))?,
            _ => None,
        };
        let peer = Peer {
            uid,
            gid,
            pid,
            admin,
            engine,
        };
        Ok((role, peer))
    }

    /// A peer identified and admitted: a non-root engine that uses
    /// `workspace.roots` (no entry, or an entry without `workspace_roots`) gets
    /// its per-uid directories `<root>/<uid>` now, so that it can make workspaces
    /// in them before it starts anything. A daemon that is not root can only
    /// make its own uid's.
    pub fn connected(&self, role: Role, peer: Peer) {
        if !matches!(role, Role::Engine { .. }) {
            return;
        }
        let explicit = peer
            .engine
            .and_then(|i| self.engines.get(i))
            .is_some_and(|e| !e.roots.is_empty());
        if !explicit {
            self.give_engine_dirs(peer.uid, peer.gid);
        }
    }

    /// At start, the per-uid directories of every `[[auth.engine]]` entry that
    /// uses `workspace.roots`: its user's, or each listed member's of its group,
    /// so that an engine of such an entry finds `<root>/<uid>` even before it
    /// connects (for a daemon that is already running; socket activation starts
    /// one on the first connection, which makes them too).
    fn engine_dirs_at_start(&self) {
        use crate::policy::auth::Match;
        use nix::unistd::{Gid, Group, Uid, User};
        for e in self.engines.iter().filter(|e| e.roots.is_empty()) {
            let who: Vec<(u32, u32)> = match e.matches {
                Match::Uid(uid) => User::from_uid(Uid::from_raw(uid))
                    .ok()
                    .flatten()
                    .map(|u| (uid, u.gid.as_raw()))
                    .into_iter()
                    .collect(),
                Match::Gid(gid) => Group::from_gid(Gid::from_raw(gid))
                    .ok()
                    .flatten()
                    .map(|g| g.mem)
                    .unwrap_or_default()
                    .iter()
                    .filter_map(|name| User::from_name(name).ok().flatten())
                    .map(|u| (u.uid.as_raw(), gid))
                    .collect(),
            };
            for (uid, gid) in who {
                self.give_engine_dirs(uid, gid);
            }
        }
    }

    /// `<root>/<uid>` (0700, the engine's) under each workspace root that
    /// exists, for a non-root engine. A daemon that is not root can only make
    /// its own uid's.
    fn give_engine_dirs(&self, uid: u32, gid: u32) {
        let me = nix::unistd::Uid::effective().as_raw();
        if uid == 0 || (me != 0 && me != uid) {
            return;
        }
        for root in &self.cfg.workspace.roots {
            if !root.is_dir() {
                continue;
            }
            if let Err(e) = crate::sys::ensure_engine_dir(root, Identity { uid, gid }) {
                tracing::warn!(
                    peer_uid = uid,
                    "cannot give uid {uid} its workspace directory: {e}"
                );
            }
        }
    }

    /// Whose run ids a peer's tokens name: its `[[auth.engine]]` entry's, or for
    /// `auth.token_key_file` (which every unbound engine may read) those of its
    /// uid (0: root).
    fn scope(&self, engine: Option<EngineId>, uid: u32) -> Scope {
        match engine.and_then(|i| self.engines.get(i)) {
            Some(e) => Scope::Entry(e.label.clone()),
            None => Scope::Shared(uid),
        }
    }

    /// A run as revocation and visibility know it: (scope, run id), a pair no
    /// run id can spell, so a token one engine signs for another's run id names a
    /// different run.
    fn run_key(&self, engine: Option<EngineId>, uid: u32, run_id: &str) -> RunKey {
        RunKey::new(self.scope(engine, uid), run_id)
    }

    /// The key the tokens of an engine (`Peer::engine`) are signed with.
    fn key_for(&self, engine: Option<EngineId>) -> &[u8] {
        match engine.and_then(|i| self.engines.get(i)) {
            Some(e) => &e.key,
            None => &self.key,
        }
    }

    /// The directories a peer's workspaces must lie under: an engine entry's
    /// `workspace_roots` or per-uid directories, or `workspace.roots`.
    fn roots_for(&self, peer: Peer) -> Vec<PathBuf> {
        match peer.engine.and_then(|i| self.engines.get(i)) {
            Some(e) => {
                crate::policy::auth::peer_roots(&self.cfg.workspace.roots, Some(&e.roots), peer.uid)
            }
            None => self.cfg.workspace.roots.clone(),
        }
    }

    /// `run.describe`: the run_script description for the token's snapshot.
    pub fn describe(
        &self,
        engine: Option<EngineId>,
        token_str: &str,
    ) -> Result<Described, RpcError> {
        let claims = token::verify(token_str, self.key_for(engine), true)?;
        let limits = Limits::effective(&self.cfg.scripts, &claims.snapshot.limits);
        let text = crate::policy::describe::describe(
            &claims.snapshot,
            &limits,
            self.cfg.scripts.return_max_chars,
        );
        Ok(Described {
            tool: crate::policy::describe::run_script_tool(&text),
            text,
        })
    }

    /// `script.start`. Refusals are audited (and logged at warning priority) under
    /// the run the token names once its signature holds, even when the token is
    /// then refused (expired, a bad snapshot).
    pub async fn start(
        self: &Arc<Self>,
        peer: Peer,
        engine: Arc<dyn EngineLink>,
        p: StartParams,
    ) -> Result<Started, RpcError> {
        let (run, r) = match Signed::verify(&p.token, self.key_for(peer.engine)) {
            Ok(signed) => (
                signed.run(),
                self.start_signed(peer, engine, p, signed).await,
            ),
            Err(e) => (None, Err(e)),
        };
        if let Err(e) = &r {
            self.record_refusal(e, run, peer).await;
        }
        r.map_err(RpcError::from)
    }

    /// A refused start: a journal entry and an audit row, unless refusals come
    /// faster than the rate limit; then they are counted and summarised.
    async fn record_refusal(&self, e: &Refused, run: Option<RunRef>, peer: Peer) {
        let verdict = self.refusals.lock().unwrap().admit(now_ms(), e.reason());
        if verdict == Verdict::Count {
            return;
        }
        self.flush_refusals().await;
        let (run_id, runner) = match run {
            Some(RunRef { run_id, runner }) => (Some(run_id), runner),
            None => (None, None),
        };
        crate::audit::journal::start_refused(
            e,
            run_id.as_deref(),
            runner.as_deref(),
            peer.uid,
            peer.pid,
        );
        let _ = self
            .store
            .refusal(RefusalRow {
                run_id,
                runner,
                peer_uid: peer.uid,
                peer_pid: peer.pid,
                code: e.code(),
                reason: e.reason().wire().map(str::to_string),
                message: e.message().to_string(),
            })
            .await;
    }

    /// At a clean stop or idle exit, after the last row: fold the audit store's
    /// write-ahead log into `scriptgate.db` and empty it.
    pub async fn checkpoint_store(&self) {
        match self.store.checkpoint_wal().await {
            Ok(c) if c.busy => tracing::warn!(
                "the audit store's write-ahead log could not all be folded in at stop ({} of {} frames; a reader held it): \
                 scriptgate.db-wal stays beside scriptgate.db, so copy both, or back up with `scriptgate audit backup FILE`",
                c.folded,
                c.frames
            ),
            Ok(c) => tracing::debug!(frames = c.frames, "audit store checkpointed"),
            Err(e) => tracing::warn!("cannot checkpoint the audit store at stop: {e}"),
        }
    }

    /// Write the summary of refusals that were only counted, if there are any.
    pub async fn flush_refusals(&self) {
        let Some(s) = self.refusals.lock().unwrap().take() else {
            return;
        };
        let message = s.message(now_ms());
        crate::audit::journal::refusals_counted(s.count, &message);
        // Named as a refusal recorded alone is (`Store::refusal`): its wire
        // reason, or "other".
        let mut by_reason = std::collections::BTreeMap::<&str, u64>::new();
        for (r, n) in &s.by_reason {
            *by_reason.entry(r.wire().unwrap_or("other")).or_default() += n;
        }
        let by_reason = by_reason
            .into_iter()
            .map(|(r, n)| (r.to_string(), n))
            .collect();
        let _ = self
            .store
            .refusal_counted(
                RefusalRow {
                    run_id: None,
                    runner: None,
                    peer_uid: u32::MAX,
                    peer_pid: None,
                    code: 0,
                    reason: Some("rate_limited".into()),
                    message,
                },
                by_reason,
            )
            .await;
    }

    /// The steps of a start whose token's signature holds.
    async fn start_signed(
        self: &Arc<Self>,
        peer: Peer,
        engine: Arc<dyn EngineLink>,
        p: StartParams,
        signed: Signed,
    ) -> Result<Started, Refused> {
        // 1. Admit: nothing runs unless the run is proven, not revoked, and its
        //    workspace, plan and identity hold.
        self.check_not_stopping()?;
        let admitted = self.admit(peer, &p, signed)?;
        self.preflight.refuse_unenforced(&self.cfg)?;
        let script_id = new_script_id();
        // 2. One approval for all declared write tools. A start waiting for it
        //    holds no max_running slot, so an engine that never answers blocks
        //    only its own starts.
        let approval = self
            .seek_approval(engine.as_ref(), &script_id, &admitted, &p)
            .await?;
        // 3. A max_running slot, held until the script's end is recorded.
        self.check_not_stopping()?;
        let slot = self.registry.reserve_slot()?;
        // 4. The workspace's disk bound, before the record: its files are the
        //    workspace's project's too (crate::daemon::disk).
        let disk_note = disk::bound(
            &self.store,
            &admitted.workspace,
            self.cfg.scripts.disk_max_bytes,
        )
        .await;
        // 5. The record directory and the audit row, before anything runs.
        let mut record = self
            .create_record(&script_id, peer, &p, &admitted, approval)
            .await?;
        record.disk_note = disk_note;
        // 6. Start it; answer once it runs.
        self.supervise(script_id, peer, engine, admitted, record, slot)
            .await
    }

    /// Step 1: the token's claims, freshness and snapshot; the revocation; the
    /// workspace (opened once, here); the plan; the identity the script runs as,
    /// and whether that identity may write the workspace.
    fn admit(&self, peer: Peer, p: &StartParams, signed: Signed) -> Result<Admitted, Refused> {
        let claims = signed.claims()?;
        claims.check_fresh(crate::time::now_unix())?;
        let trace = match &p.traceparent {
            Some(tp) => Some(
                crate::protocol::trace::TraceContext::parse(tp, p.tracestate.as_deref())
                    .map_err(|e| Refused::invalid_params(format!("invalid params: {e}")))?,
            ),
            None if p.tracestate.is_some() => {
                return Err(Refused::invalid_params(
                    "invalid params: `tracestate` without `traceparent`",
                ))
            }
            None => None,
        };
        let claims = claims.parse_snapshot()?;
        let run_key = self.run_key(peer.engine, peer.uid, &claims.run_id);
        if self.revoked.read().unwrap().contains(&run_key) {
            return Err(Refused::new(
                Reason::Revoked,
                format!("run {} was revoked", claims.run_id),
            ));
        }
        let snap = &claims.snapshot;
        // Opened once, beneath its root, never following symlinks; everything
        // later (the record, the sandbox's bind mount) uses this descriptor.
        let workspace = WorkspaceDir::open(&snap.workspace, &self.roots_for(peer))
            .map_err(|e| Refused::new(workspace_reason(&e), e.to_string()).field("workspace"))?;
        self.check_engine_dir(peer, &workspace)?;
        let (policy, plan) = Policy::plan(snap, &p.tools)?;
        if p.code.len() > self.cfg.server.max_message_bytes {
            return Err(Refused::invalid_params(
                "code is larger than max_message_bytes",
            ));
        }
        let identity = resolve_run_as(peer.uid, peer.gid, &self.cfg.sandbox.run_as)
            .map_err(|e| Refused::new(Reason::Identity, e.to_string()))?;
        // A non-root engine's script (its own uid) must be able to reach the
        // workspace the way a file system walk would; bwrap's bind by descriptor
        // would not ask.
        if peer.uid != 0 && !workspace.reachable_by(identity) {
            return Err(Refused::new(
                Reason::NotReachable,
                format!(
                    "workspace {}: uid {} may not search a directory above it (below the root)",
                    workspace.path.display(),
                    identity.uid
                ),
            )
            .field("workspace"));
        }
        // The workspace is the script's to write (protocol §2), unless read-only.
        let writable = workspace
            .writable_by(identity)
            .map_err(|e| Refused::internal(e.to_string()))?;
        // A read-only run still gets its record, `.agent/scripts/<id>`: the daemon
        // makes it only where the engine's own uid could have, so a non-root
        // engine needs the workspace writable, read-only or not. Root engines'
        // read-only runs are unchanged.
        if !writable && (!snap.read_only || peer.uid != 0) {
            return Err(self.not_writable(&workspace, identity, peer, snap.read_only));
        }
        let vouched = crate::daemon::prune::vouch(&workspace.dir, peer.uid, identity.uid);
        Ok(Admitted {
            claims,
            run_key,
            vouched,
            workspace,
            policy,
            plan,
            identity,
            trace,
        })
    }

    /// A per-uid directory `<root>/<uid>` belongs to the engine of that uid:
    /// another non-root engine cannot name a workspace in it, even with a valid
    /// token of the shared key.
    fn check_engine_dir(&self, peer: Peer, workspace: &WorkspaceDir) -> Result<(), Refused> {
        if peer.uid == 0 || peer.engine.is_some() {
            return Ok(());
        }
        let roots: Vec<PathBuf> = self
            .cfg
            .workspace
            .roots
            .iter()
            .filter_map(|r| std::fs::canonicalize(r).ok())
            .collect();
        match crate::policy::auth::engine_dir_owner(&workspace.path, &roots) {
            Some(owner) if owner != peer.uid => Err(Refused::new(
                Reason::OtherEngine,
                format!(
                    "workspace {} lies in the directory of the engine with uid {owner}; uid {} uses its own, {}",
                    workspace.path.display(),
                    peer.uid,
                    roots
                        .first()
                        .map(|r| r.join(peer.uid.to_string()).display().to_string())
                        .unwrap_or_default()
                ),
            )
            .field("workspace")),
            _ => Ok(()),
        }
    }

    fn not_writable(
        &self,
        workspace: &WorkspaceDir,
        identity: Identity,
        peer: Peer,
        read_only: bool,
    ) -> Refused {
        if read_only {
            return Refused::new(
                Reason::NotWritable,
                format!(
                    "workspace {} is not writable by uid {} (gid {}), this engine's own uid: even a read_only run \
                     gets its record .agent/scripts/<id> in the workspace, and the daemon makes it only where the \
                     engine could have itself; use a workspace of this uid (under its own directories), or make this one writable for it",
                    workspace.path.display(),
                    identity.uid,
                    identity.gid,
                ),
            )
            .field("workspace");
        }
        Refused::new(
            Reason::NotWritable,
            format!(
                "workspace {} is not writable by uid {} (gid {}), the identity this run's scripts have{}; \
                 chown the directory to that uid (or make it writable for it), or make the run read_only",
                workspace.path.display(),
                identity.uid,
                identity.gid,
                if peer.uid == 0 {
                    format!(": scripts of root engines run as sandbox.run_as = {:?}", self.cfg.sandbox.run_as)
                } else {
                    ", the engine's own".to_string()
                }
            ),
        )
        .field("workspace")
    }

    /// Step 2: ask the engine when the plan needs it (counted against the
    /// connection's bound while it waits), else say why no one is asked.
    async fn seek_approval(
        &self,
        engine: &dyn EngineLink,
        script_id: &str,
        a: &Admitted,
        p: &StartParams,
    ) -> Result<Approval, Refused> {
        if let Some(approval) =
            Approval::without_request(&a.plan, a.claims.snapshot.permission_mode)
        {
            return Ok(approval);
        }
        let _waiting = self.registry.await_approval(engine.id())?;
        let request = ApprovalRequest {
            script_id: script_id.to_string(),
            run_id: a.claims.run_id.clone(),
            description: p.description.clone(),
            code: p.code.clone(),
            tools: a
                .plan
                .declared
                .iter()
                .map(|(name, class)| ApprovalTool {
                    name: name.clone(),
                    class: class.as_str().into(),
                })
                .collect(),
            traceparent: a.trace.as_ref().map(|t| t.child_traceparent()),
            tracestate: a.trace.as_ref().and_then(|t| t.state.clone()),
        };
        let timeout = Duration::from_secs(self.cfg.scripts.approval_timeout_s);
        match engine.approval_request(request, timeout).await {
            Ok(true) => Ok(Approval::AllowOnce),
            Ok(false) => Err(approval_error(
                Reason::Denied,
                "the engine denied approval for the script's write tools",
            )),
            Err(LinkError::Timeout) => Err(approval_error(
                Reason::Timeout,
                &format!(
                    "approval was not answered within approval_timeout_s = {}",
                    timeout.as_secs()
                ),
            )),
            Err(e) => Err(approval_error(
                Reason::Denied,
                &format!("approval failed: {e}"),
            )),
        }
    }

    /// Step 4: `.agent/scripts/<id>/` with the code and the (empty) logs, owned by
    /// the script's uid; then the audit row. First the state directory's reserve
    /// (`state.reserve_bytes`): a script starts only when its end can be recorded.
    /// A record that cannot be made in full is removed: a refused start leaves
    /// no `script.py` that no audit row names.
    async fn create_record(
        &self,
        script_id: &str,
        peer: Peer,
        p: &StartParams,
        a: &Admitted,
        approval: Approval,
    ) -> Result<Record, Refused> {
        let script_code = crate::sys::sealed_copy(c"scriptgate-script", p.code.as_bytes())
            .map_err(|e| Refused::internal(format!("cannot hold the script's code: {e}")))?;
        let state = &self.cfg.state;
        if let Err(e) = self.store.keep_reserve(state.reserve_bytes) {
            if is_no_space(&e) {
                return Err(no_space(format!(
                    "the filesystem of state.dir {} is full: the {} bytes kept there for \
                     recording scripts' ends (state.reserve_bytes) cannot be set aside ({e}); \
                     free space there, or put workspace roots on a filesystem apart from state.dir",
                    state.dir.display(),
                    state.reserve_bytes
                )));
            }
            tracing::warn!("cannot keep the audit store's reserve: {e}");
        }
        let art = ArtifactDir::create(&a.workspace, script_id, a.identity, peer.uid == 0).map_err(
            |e| {
                record_error(
                    "cannot create the script's record directory",
                    &a.workspace,
                    e,
                )
            },
        )?;
        let details_dir = format!(".agent/scripts/{script_id}");
        let made = async {
            let files = write_record_files(&art, &p.code)
                .map_err(|e| record_error("cannot write the script's record", &a.workspace, e))?;
            self.store
                .insert_started(StartRow {
                    script_id: script_id.to_string(),
                    run_id: a.claims.run_id.clone(),
                    runner: a.claims.runner.clone(),
                    peer_uid: peer.uid,
                    peer_pid: peer.pid,
                    run_uid: a.identity.uid,
                    description: p.description.clone(),
                    code: p.code.clone(),
                    tools: a.plan.declared.iter().map(|(n, _)| n.clone()).collect(),
                    approval: approval.as_str().into(),
                    workspace: a.workspace.path.display().to_string(),
                    backend: self.backend.kind.as_str().into(),
                    unit: self.backend.backend.unit_for(script_id),
                    started_at_ms: now_ms(),
                    details_dir: details_dir.clone(),
                    scope: a.run_key.scope.to_db(),
                    vouched: a.vouched,
                    trace_id: a.trace.as_ref().map(|t| t.trace_id.clone()),
                })
                .await
                .map_err(|e| {
                    if e.is_full() {
                        no_space(format!(
                            "the filesystem of state.dir {} is full: {e}; free space there",
                            state.dir.display()
                        ))
                    } else {
                        Refused::internal(format!("audit store: {e}"))
                    }
                })?;
            Ok::<_, Refused>(files)
        }
        .await;
        let (calls_log, stdout_file, stderr_file) = match made {
            Ok(files) => files,
            Err(e) => {
                remove_record(&art, script_id);
                return Err(e);
            }
        };
        Ok(Record {
            art,
            details_dir,
            calls_log,
            stdout_file,
            stderr_file,
            script_code,
            limits: Limits::effective(&self.cfg.scripts, &a.claims.snapshot.limits),
            disk_note: None,
        })
    }

    /// Step 5: the broker and the launch, the script registered as running, and its
    /// supervisor started. Answers once the sandbox exists (or could not start).
    async fn supervise(
        self: &Arc<Self>,
        script_id: String,
        peer: Peer,
        engine: Arc<dyn EngineLink>,
        a: Admitted,
        rec: Record,
        slot: Slot<Running>,
    ) -> Result<Started, Refused> {
        let (stop_tx, stop_rx) = watch::channel(None);
        let (result_tx, result_rx) = watch::channel(None);
        let running = Arc::new(Running {
            run_id: a.claims.run_id.clone(),
            run_key: a.run_key.clone(),
            runner: a.claims.runner.clone(),
            unit: self.backend.backend.unit_for(&script_id),
            owner: engine.id(),
            peer_uid: peer.uid,
            run_uid: a.identity.uid,
            started: Instant::now(),
            details_dir: rec.details_dir.clone(),
            workspace: a.workspace.path.clone(),
            trace_id: a.trace.as_ref().map(|t| t.trace_id.clone()),
            live: Arc::new(Live::default()),
            stop: stop_tx,
            result: result_rx,
        });
        let (broker, launch) = self.broker_and_launch(&script_id, &engine, &running, a, rec);
        self.register(&script_id, &running);
        let (started_tx, started_rx) = tokio::sync::oneshot::channel();
        let job = Job {
            script_id: script_id.clone(),
            engine,
            running,
            launch,
            broker: Arc::new(broker),
            stop: stop_rx,
            started: started_tx,
            result: result_tx,
            slot,
        };
        tokio::spawn(self.clone().run_to_end(job));
        match started_rx.await {
            Ok(Ok(())) => Ok(Started {
                script_id,
                state: Status::Running,
            }),
            Ok(Err(e)) => Err(Refused::new(
                Reason::Spawn,
                format!("the sandbox could not start: {e}"),
            )
            .script(script_id)),
            Err(_) => Err(Refused::internal(
                "the script supervisor ended before the script started",
            )),
        }
    }

    /// The broker of one script (its policy, budget, concurrency and call log),
    /// and what the runner needs to start its sandbox.
    fn broker_and_launch(
        &self,
        script_id: &str,
        engine: &Arc<dyn EngineLink>,
        running: &Running,
        a: Admitted,
        rec: Record,
    ) -> (Broker, Launch) {
        let broker = Broker::new(BrokerSpec {
            script_id: script_id.to_string(),
            run_id: a.claims.run_id.clone(),
            run_key: a.run_key.clone(),
            token_exp: a.claims.exp,
            policy: a.policy,
            max_calls: rec.limits.max_calls,
            max_concurrency: rec.limits.max_concurrency,
            engine: engine.clone(),
            live: running.live.clone(),
            calls_log: rec.calls_log,
            revoked: self.revoked.clone(),
            max_line: self.cfg.server.max_message_bytes,
            trace: a.trace.clone(),
        });
        let run = crate::script::Run {
            workspace: a.workspace.path.clone(),
            workspace_dir: a.workspace.dir,
            read_only: a.claims.snapshot.read_only,
            script: rec.art.path.join("script.py"),
            agent_dir: rec.art.agent,
            identity: (nix::unistd::Uid::effective().as_raw() != a.identity.uid)
                .then_some(a.identity),
            limits: rec.limits,
            stdout_file: rec.stdout_file,
            stderr_file: rec.stderr_file,
            script_code: rec.script_code,
            notes: rec.disk_note.into_iter().collect(),
        };
        let launch = Launch::new(&self.host, run);
        (broker, launch)
    }

    /// Register a script as running. `run.revoke` adds the run before it scans the
    /// running scripts; checking again after registering means one of the two
    /// always sees the other.
    fn register(&self, script_id: &str, running: &Arc<Running>) {
        self.registry.insert(script_id, running.clone());
        if self.revoked.read().unwrap().contains(&running.run_key) {
            let _ = running.stop.send(Some(Stop::Cancel(format!(
                "run {} was revoked",
                running.run_id
            ))));
        }
        self.changed.notify_waiters();
    }

    /// The supervisor of one script: runs it, then records, deregisters and tells.
    async fn run_to_end(self: Arc<Self>, job: Job) {
        let Job {
            script_id: sid,
            engine,
            running,
            launch,
            broker,
            stop,
            started,
            result: result_tx,
            slot,
        } = job;
        let ticker = tokio::spawn(progress_ticker(
            sid.clone(),
            engine.clone(),
            running.clone(),
        ));
        let outcome = crate::script::run(&self.spawner, launch, broker, stop, started).await;
        ticker.abort();
        let live = &running.live;
        // The last state always goes out before script.finished, so that a
        // progress bar reaches its end.
        if live.dirty.swap(false, Ordering::Relaxed) {
            engine.send(Notification::ScriptProgress(status_of(&sid, &running)));
        }
        // Not the script's doing: no sandbox, no limits, or no engine any more.
        let infrastructure = match &outcome {
            Err(_) => true,
            Ok(e) => e.setup_failed,
        } || matches!(&*running.stop.borrow(), Some(Stop::Cancel(why)) if why == ENGINE_LOST);
        let result = self.build_result(&sid, &running.run_id, &running.details_dir, live, outcome);
        let counts = json!(*live.tool_counts.lock().unwrap());
        if let Err(e) = self.store.finish(&result, counts).await {
            tracing::error!(script_id = %sid, "cannot record the result: {e}");
        }
        // Its end recorded: set the reserve aside again if it was used (and
        // space has come back); otherwise the next start tries.
        let _ = self.store.keep_reserve(self.cfg.state.reserve_bytes);
        // Recorded first, then deregistered and the slot freed, and only then
        // told: whoever hears of the end can start the next script at once.
        self.registry.finish(&sid, running.owner);
        drop(slot);
        crate::audit::journal::script_finished(&crate::audit::journal::Finished {
            result: &result,
            runner: running.runner.as_deref(),
            uid: running.run_uid,
            unit: running.unit.as_deref(),
            workspace: &running.workspace.display().to_string(),
            infrastructure,
            trace_id: running.trace_id.as_deref(),
        });
        engine.send(Notification::ScriptFinished(Box::new(result.clone())));
        let _ = result_tx.send(Some(result));
        self.changed.notify_waiters();
    }

    fn build_result(
        &self,
        sid: &str,
        run_id: &str,
        details_dir: &str,
        live: &Live,
        outcome: Result<crate::script::Ended, std::io::Error>,
    ) -> ScriptResult {
        let calls = live.calls.load(Ordering::Relaxed);
        let failures = live.failures.load(Ordering::Relaxed);
        let e = outcome.unwrap_or_else(|e| crate::script::Ended {
            status: Status::Error,
            exit_code: None,
            duration_ms: 0,
            output: String::new(),
            output_truncated: false,
            error: Some(format!("the sandbox could not start: {e}")),
            memory_peak_bytes: None,
            cpu_usec: None,
            backend_notes: vec![],
            setup_failed: true,
            record_incomplete: vec![],
        });
        let mut record_incomplete = e.record_incomplete;
        record_incomplete.extend(live.calls_log_incomplete());
        let mut notes = vec![];
        if e.output_truncated {
            notes.push(format!(
                "[output truncated to return_max_chars = {} characters; {}]",
                self.cfg.scripts.return_max_chars,
                if record_incomplete
                    .iter()
                    .any(|r| r.starts_with("output.txt"))
                {
                    "output.txt is incomplete, see below".to_string()
                } else {
                    format!("all of it is in {details_dir}/output.txt")
                }
            ));
        }
        if !record_incomplete.is_empty() {
            tracing::error!(script_id = %sid, "the script's record in its workspace is incomplete: {}", record_incomplete.join("; "));
            notes.push(format!(
                "[record incomplete: {}. The output above, the counts and the error are the daemon's own copy (its audit row); free space on the workspace's filesystem]",
                record_incomplete.join("; ")
            ));
        }
        let note = (!notes.is_empty()).then(|| notes.join("\n"));
        ScriptResult {
            script_id: sid.into(),
            run_id: run_id.into(),
            status: e.status,
            exit_code: e.exit_code,
            calls,
            failures,
            duration_ms: e.duration_ms,
            details_dir: details_dir.into(),
            output: e.output,
            output_truncated: e.output_truncated,
            error: if e.status == Status::Ok {
                None
            } else {
                e.error
            },
            text: String::new(),
            memory_peak_bytes: e.memory_peak_bytes,
            cpu_usec: e.cpu_usec,
            backend_notes: e.backend_notes,
            record_incomplete,
        }
        .with_text(note.as_deref())
    }

    /// May this connection see the script? Its starter, or a holder of a valid token
    /// of the script's run (protocol §4). Administrators use the `admin.*` methods.
    /// `run`: the script's run as stored with it (None: a row of before run
    /// scopes, which only its connection and administrators see).
    fn visible(
        &self,
        who: Access,
        owner: Option<u64>,
        run: Option<&RunKey>,
        token: Option<&str>,
    ) -> bool {
        let (conn, engine, uid) = match who {
            Access::Admin => return true,
            Access::Conn(c, engine, uid) => (c, engine, uid),
        };
        if owner == Some(conn) {
            return true;
        }
        let Some(run) = run else { return false };
        token
            .and_then(|t| token::verify(t, self.key_for(engine), false).ok())
            .is_some_and(|c| self.run_key(engine, uid, &c.run_id) == *run)
    }

    fn lookup(&self, who: Access, r: &ScriptRef) -> Result<Lookup, RpcError> {
        let not_found = || match who {
            Access::Admin => RpcError::no_such_script(&r.script_id),
            Access::Conn(..) => RpcError::not_found(&r.script_id),
        };
        if let Some(run) = self.registry.running(&r.script_id) {
            if self.visible(who, Some(run.owner), Some(&run.run_key), r.token.as_deref()) {
                return Ok(Lookup::Running(run));
            }
            return Err(not_found());
        }
        let owner = self.registry.finished_owner(&r.script_id);
        match self.store.run_of(&r.script_id) {
            // The row keeps the run's scope beside its id: a token shows the
            // result only when it names that run in that scope.
            Ok(Some((res, scope))) => {
                let run = scope.map(|s| RunKey::new(s, &res.run_id));
                if self.visible(who, owner, run.as_ref(), r.token.as_deref()) {
                    Ok(Lookup::Done(Box::new(res)))
                } else {
                    Err(not_found())
                }
            }
            Ok(None) => Err(not_found()),
            Err(e) => Err(RpcError::internal(e.to_string())),
        }
    }

    pub async fn wait(&self, who: Access, r: ScriptRef) -> Result<ScriptResult, RpcError> {
        self.wait_turn(who, r, async {}).await
    }

    /// `wait`, with `turn` awaited once the result is there and before it is
    /// copied out: many waits of one script that ends together copy its result
    /// one at a time, as their connection takes their answers.
    pub async fn wait_turn(
        &self,
        who: Access,
        r: ScriptRef,
        turn: impl std::future::Future<Output = ()>,
    ) -> Result<ScriptResult, RpcError> {
        let still_running = || {
            RpcError::with_data(
                code::STILL_RUNNING,
                format!("script {} is still running", r.script_id),
                serde_json::json!({"reason": "still_running"}),
            )
        };
        let run = match self.lookup(who, &r)? {
            Lookup::Done(res) => {
                drop(res);
                turn.await;
                return match self.lookup(who, &r)? {
                    Lookup::Done(res) => Ok(*res),
                    Lookup::Running(_) => Err(still_running()),
                };
            }
            Lookup::Running(run) => run,
        };
        let mut rx = run.result.clone();
        let done = async {
            loop {
                if rx.borrow_and_update().is_some() {
                    return true;
                }
                if rx.changed().await.is_err() {
                    return rx.borrow().is_some();
                }
            }
        };
        let done = match r.timeout_s {
            Some(t) if t >= 0.0 => tokio::time::timeout(Duration::from_secs_f64(t.min(1e7)), done)
                .await
                .unwrap_or(false),
            _ => done.await,
        };
        if !done {
            return Err(still_running());
        }
        turn.await;
        let res = rx.borrow().clone();
        res.ok_or_else(still_running)
    }

    pub fn status(&self, who: Access, r: ScriptRef) -> Result<ScriptStatus, RpcError> {
        Ok(match self.lookup(who, &r)? {
            Lookup::Running(run) => status_of(&r.script_id, &run),
            Lookup::Done(res) => ScriptStatus {
                script_id: res.script_id,
                state: res.status,
                calls: res.calls,
                failures: res.failures,
                elapsed_ms: res.duration_ms,
                progress: None,
            },
        })
    }

    pub async fn cancel(
        &self,
        who: Access,
        r: ScriptRef,
        why: &str,
    ) -> Result<ScriptState, RpcError> {
        let run = match self.lookup(who, &r)? {
            Lookup::Done(res) => {
                return Ok(ScriptState {
                    script_id: res.script_id,
                    state: res.status,
                    already_finished: true,
                })
            }
            Lookup::Running(run) => run,
        };
        let _ = run.stop.send(Some(Stop::Cancel(why.into())));
        let state = self
            .wait(
                who,
                ScriptRef {
                    timeout_s: Some(30.0),
                    ..r.clone()
                },
            )
            .await
            .map(|res| res.status);
        Ok(ScriptState {
            script_id: r.script_id,
            state: state.unwrap_or(Status::Cancelled),
            already_finished: false,
        })
    }

    /// `run.revoke`: refuse further starts and calls of the run, cancel its scripts.
    pub async fn revoke(&self, peer: Peer, token_str: &str) -> Result<Revoked, RpcError> {
        let claims = token::verify(token_str, self.key_for(peer.engine), false)?;
        let run_key = self.run_key(peer.engine, peer.uid, &claims.run_id);
        // At most REVOCATIONS_PER_SCOPE of a scope, in memory and in the store:
        // past it the scope's oldest is dropped (scriptgate-protocol(7), run.revoke).
        // The store's write is queued under the set's lock: both see the
        // revocations in one order and drop the same oldest.
        let (dropped, stored) = {
            let mut set = self.revoked.write().unwrap();
            (set.insert(run_key.clone()), self.store.revoke(&run_key))
        };
        if let Some(d) = dropped {
            // The first drop of a scope, then one line per 1,000: a flooding
            // engine does not flood the journal too.
            if d.count == 1 || d.count % 1000 == 0 {
                tracing::warn!(
                    "run.revoke: {} keeps at most {} run revocations; dropped the oldest                      (run {:?}; {} dropped so far): its run may start again",
                    d.run.scope,
                    crate::policy::runs::REVOCATIONS_PER_SCOPE,
                    d.run.run_id,
                    d.count
                );
            }
        }
        stored
            .await
            .map_err(|e| RpcError::internal(e.to_string()))?;
        let targets = self.registry.running_where(|r| r.run_key == run_key);
        for r in &targets {
            let _ = r.stop.send(Some(Stop::Cancel(format!(
                "run {} was revoked",
                claims.run_id
            ))));
        }
        for r in &targets {
            let mut rx = r.result.clone();
            let _ =
                tokio::time::timeout(Duration::from_secs(30), rx.wait_for(Option::is_some)).await;
        }
        Ok(Revoked {
            run_id: claims.run_id,
            cancelled: targets.len(),
        })
    }

    /// A connection is served: its answers count in [`Daemon::answers_written`]
    /// until [`Daemon::served`].
    pub fn serving(&self, conn: u64, peer: crate::protocol::rpc::Endpoint) {
        self.answering.lock().unwrap().insert(conn, peer);
    }

    /// The connection is done: its last answers were written, or given up.
    pub fn served(&self, conn: u64) {
        self.answering.lock().unwrap().remove(&conn);
    }

    /// Until every connection's answers to the requests taken so far are
    /// written (`rpc::Endpoint::answers_written`): the barrier between the
    /// last script's end and the exit of a stopping daemon, so that the
    /// `script.wait`s that end woke are answered. The caller bounds it.
    pub async fn answers_written(&self) {
        let all: Vec<crate::protocol::rpc::Endpoint> =
            self.answering.lock().unwrap().values().cloned().collect();
        for e in all {
            e.answers_written().await;
        }
    }

    /// A connection closed: its scripts lose their engine and are cancelled.
    pub fn disconnected(&self, conn: u64) {
        for r in self.registry.running_where(|r| r.owner == conn) {
            let _ = r.stop.send(Some(Stop::Cancel(ENGINE_LOST.into())));
        }
    }

    /// Shutdown: stop every script as `interrupted` and wait (bounded) for records.
    pub async fn interrupt_all(&self, grace: Duration) {
        let all = self.registry.running_where(|_| true);
        for r in &all {
            let _ = r.stop.send(Some(Stop::Interrupt));
        }
        let deadline = tokio::time::Instant::now() + grace;
        for r in &all {
            let mut rx = r.result.clone();
            let _ = tokio::time::timeout_at(deadline, rx.wait_for(Option::is_some)).await;
        }
    }

    /// Running scripts with what each holds now, for `admin.list`: the
    /// resources are read (blocking file reads, on the blocking pool) at most
    /// once per [`USAGE_FRESH`] for all callers.
    pub async fn list_with_usage(self: &Arc<Self>) -> Vec<ListedScript> {
        let usage = {
            let mut last = self.usage.lock().await;
            match &*last {
                Some((at, u)) if at.elapsed() < USAGE_FRESH => u.clone(),
                _ => {
                    let d = self.clone();
                    let u = tokio::task::spawn_blocking(move || d.read_usage())
                        .await
                        .unwrap_or_default();
                    let u = Arc::new(u);
                    *last = Some((Instant::now(), u.clone()));
                    u
                }
            }
        };
        self.list_running(&usage)
    }

    /// What each running script whose sandbox exists holds now.
    fn read_usage(&self) -> Usage {
        self.registry
            .all_running()
            .into_iter()
            .filter_map(|(id, r)| {
                let pid = r.live.sandbox_pid.load(Ordering::Relaxed);
                (pid > 0).then(|| (id, self.backend.backend.usage(pid as u32)))
            })
            .collect()
    }

    /// Running scripts, for `scriptgate ps` (admin), with the resources of
    /// `usage` (`list_with_usage`).
    pub fn list_running(&self, usage: &Usage) -> Vec<ListedScript> {
        let now = Instant::now();
        self.registry
            .all_running()
            .into_iter()
            .map(|(id, r)| {
                let pid = r.live.sandbox_pid.load(Ordering::Relaxed);
                ListedScript {
                    status: status_of(&id, &r),
                    run_id: r.run_id.clone(),
                    peer_uid: r.peer_uid,
                    uid: r.run_uid,
                    unit: r.unit.clone(),
                    age_ms: now.duration_since(r.started).as_millis() as u64,
                    resources: (pid > 0).then(|| usage.get(&id).cloned()).flatten(),
                }
            })
            .collect()
    }

    /// `admin.calls`: a page of the script's calls.jsonl, found from its audit
    /// row (or, running, from what the daemon keeps of it) and opened without
    /// following a link (`calls`).
    pub async fn calls_page(
        self: &Arc<Self>,
        p: crate::protocol::CallsParams,
    ) -> Result<crate::protocol::CallsPage, RpcError> {
        let d = self.clone();
        tokio::task::spawn_blocking(move || {
            let (workspace, details_dir, run_uid) = match d.registry.running(&p.script_id) {
                Some(r) => (r.workspace.clone(), r.details_dir.clone(), r.run_uid),
                None => {
                    let db = d.cfg.state.dir.join("scriptgate.db");
                    let row = crate::audit::Reader::open(&db)
                        .map_err(|e| RpcError::internal(e.to_string()))?
                        .script(&p.script_id)
                        .map_err(|e| RpcError::internal(e.to_string()))?
                        .ok_or_else(|| RpcError::no_such_script(&p.script_id))?;
                    let text = |k: &str| row[k].as_str().unwrap_or_default().to_string();
                    let run_uid = row["run_uid"]
                        .as_u64()
                        .and_then(|u| u32::try_from(u).ok())
                        .ok_or_else(|| {
                            RpcError::internal(format!(
                                "script {}: no run_uid recorded",
                                p.script_id
                            ))
                        })?;
                    (
                        PathBuf::from(text("workspace")),
                        text("details_dir"),
                        run_uid,
                    )
                }
            };
            let path = workspace.join(details_dir).join("calls.jsonl");
            let f = calls::open_no_links(&path, run_uid)
                .map_err(|e| RpcError::internal(format!("cannot open {}: {e}", path.display())))?;
            calls::page(&p.script_id, f, p.offset, p.limit)
        })
        .await
        .map_err(|e| RpcError::internal(e.to_string()))?
    }

    /// One workspace retention pass (`workspace.retain_days`): the hourly one,
    /// and `admin.prune`'s. One at a time; a dry run only plans. Removed and
    /// gone workspaces are forgotten by the store.
    pub async fn prune_workspaces(
        &self,
        dry_run: bool,
    ) -> Result<crate::protocol::Pruned, RpcError> {
        let _one = self.prune_pass.lock().await;
        let ws = &self.cfg.workspace;
        let (days, roots) = (ws.retain_days, ws.roots.clone());
        if days == 0 {
            return Ok(crate::protocol::Pruned {
                dry_run,
                roots,
                ..Default::default()
            });
        }
        let busy = self.running_workspaces();
        // Only the workspaces the daemon recorded as scriptgate's own (prune).
        let vouched = self
            .store
            .vouched_workspaces()
            .map_err(|e| RpcError::internal(e.to_string()))?;
        let r = roots.clone();
        let (plan, failed) = tokio::task::spawn_blocking(move || {
            let in_use = |p: &Path| busy.iter().any(|b| b.starts_with(p));
            if dry_run {
                let now = crate::time::now_ms();
                (prune::plan(&r, &vouched, days, now, &in_use), vec![])
            } else {
                prune::run_pass(&r, &vouched, days, &in_use)
            }
        })
        .await
        .map_err(|e| RpcError::internal(e.to_string()))?;
        if !dry_run {
            let forget = prune::to_forget(&plan, &failed);
            if let Err(e) = self.store.forget_workspaces(forget).await {
                tracing::warn!("workspace retention: {e}");
            }
        }
        Ok(prune::pruned(&plan, &failed, days, dry_run, &roots))
    }
}

/// On whose behalf a script is looked up.
#[derive(Debug, Clone, Copy)]
pub enum Access {
    /// A connection (the `[[auth.engine]]` entry its peer is bound to, and its
    /// uid): sees the scripts it started, or those of a run it has a token for
    /// (signed with its key, in its scope: `Daemon::run_key`).
    Conn(u64, Option<EngineId>, u32),
    /// An administrator (`admin.*` methods, checked by the caller): sees every script.
    Admin,
}

enum Lookup {
    Running(Arc<Running>),
    Done(Box<ScriptResult>),
}

/// A started script, handed to its supervisor.
struct Job {
    script_id: String,
    engine: Arc<dyn EngineLink>,
    running: Arc<Running>,
    launch: Launch,
    broker: Arc<Broker>,
    stop: watch::Receiver<Option<Stop>>,
    /// Answered once the sandbox exists, or could not be spawned.
    started: tokio::sync::oneshot::Sender<Result<(), String>>,
    result: watch::Sender<Option<ScriptResult>>,
    /// Freed once the result is recorded and the script deregistered.
    slot: Slot<Running>,
}

fn approval_error(reason: Reason, message: &str) -> Refused {
    Refused::new(reason, message)
}

/// A `script.start` while the daemon drains for a stop or restart.
fn stopping(drain_s: u64) -> Refused {
    Refused::new(
        Reason::Stopping,
        format!(
            "scriptgated is stopping: it lets running scripts finish (up to server.drain_s = {drain_s} s) and starts no new ones; retry once it is back (socket activation starts it again on the next connection)"
        ),
    )
}

/// The reason of a workspace that cannot be used.
fn workspace_reason(e: &crate::sys::WorkspaceError) -> Reason {
    use crate::sys::WorkspaceError as W;
    match e {
        W::OutsideRoots(_) => Reason::OutsideRoots,
        W::IsRoot(_) => Reason::IsRoot,
        W::Symlink { .. } => Reason::Symlink,
        W::NotDirectory { .. } => Reason::NotDirectory,
        W::Unusable { .. } => Reason::WorkspaceMissing,
    }
}

fn status_of(script_id: &str, r: &Running) -> ScriptStatus {
    ScriptStatus {
        script_id: script_id.to_string(),
        state: Status::Running,
        calls: r.live.calls.load(Ordering::Relaxed),
        failures: r.live.failures.load(Ordering::Relaxed),
        elapsed_ms: r.started.elapsed().as_millis() as u64,
        progress: r.live.progress.lock().unwrap().clone(),
    }
}

/// `daemon.info`'s `same_uid`: what sharing a uid means for scripts. Root
/// engines' scripts share `run_as`; a non-root engine's scripts share its uid.
fn same_uid(root_daemon: bool, run_as: &str, backend: &str) -> Vec<String> {
    let mut v = vec![
        format!(
            "scripts of root engines all run as sandbox.run_as = {run_as:?}; a non-root engine's scripts run as its own uid"
        ),
        "scripts of one uid share that uid's kernel quotas with each other and with every other process of that uid: \
         inotify instances and watches, pipe buffer pages (and, on the rlimit backend, RLIMIT_NPROC); \
         one script can use them up for the others"
            .to_string(),
        "any process of that uid may send signals to a script's processes".to_string(),
        "script ids are in no command line, environment or mount table; \
         an id alone shows nothing: a lookup needs the starting connection or a token of the script's own run"
            .to_string(),
    ];
    if backend != "rlimit" {
        v.push("unit and cgroup names carry the script id, and every user can read them".into());
    }
    v.push(if root_daemon {
        "the interpreter and the sandbox init run from execute-only copies (unless a warning in the journal \
         says they could not be made for a script), so other processes of the uid \
         cannot read a script's memory, environment, descriptors or files through /proc/PID; \
         a program the script runs that its uid may read (e.g. /bin/sh) has no such protection while it runs"
            .into()
    } else {
        "the daemon is not root: scripts run as its own uid, and every process of that uid may read them through /proc/PID"
            .into()
    });
    v
}

/// `script.progress`: the first as soon as something changed, then at most one per
/// second, each only when something changed since the last.
async fn progress_ticker(script_id: String, engine: Arc<dyn EngineLink>, run: Arc<Running>) {
    let mut last: Option<tokio::time::Instant> = None;
    loop {
        run.live.changed.notified().await;
        if let Some(t) = last {
            tokio::time::sleep_until(t + Duration::from_secs(1)).await;
        }
        if run.live.dirty.swap(false, Ordering::Relaxed) {
            engine.send(Notification::ScriptProgress(status_of(&script_id, &run)));
            last = Some(tokio::time::Instant::now());
        }
    }
}

/// The record's files: `script.py` with the code, and the empty logs.
fn write_record_files(
    art: &ArtifactDir,
    code: &str,
) -> Result<(std::fs::File, std::fs::File, std::fs::File), crate::sys::SysError> {
    let io_err = |op, name: &str| {
        let path = art.path.join(name);
        move |source| crate::sys::SysError::Path { op, path, source }
    };
    let mut f = art.create_file("script.py", 0o600)?;
    std::io::Write::write_all(&mut f, code.as_bytes()).map_err(io_err("write", "script.py"))?;
    Ok((
        art.create_file("calls.jsonl", 0o600)?,
        art.create_file("output.txt", 0o600)?,
        art.create_file("stderr.txt", 0o600)?,
    ))
}

/// Remove a record that could not be made in full (its files, then its
/// directory), by descriptor beneath `.agent`, never following a symlink.
fn remove_record(art: &ArtifactDir, script_id: &str) {
    use nix::fcntl::{openat, OFlag};
    use nix::unistd::{unlinkat, UnlinkatFlags};
    let dir_flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let mode = nix::sys::stat::Mode::empty();
    let removed = (|| {
        let scripts = openat(&art.agent, "scripts", dir_flags, mode)?;
        let dir = openat(&scripts, script_id, dir_flags, mode)?;
        for name in ["script.py", "calls.jsonl", "output.txt", "stderr.txt"] {
            match unlinkat(&dir, name, UnlinkatFlags::NoRemoveDir) {
                Ok(()) | Err(nix::errno::Errno::ENOENT) => {}
                Err(e) => return Err(e),
            }
        }
        unlinkat(&scripts, script_id, UnlinkatFlags::RemoveDir)
    })();
    if let Err(e) = removed {
        tracing::warn!(script_id = %script_id, "cannot remove the record of a refused start, {}: {e}", art.path.display());
    }
}

/// ENOSPC or EDQUOT.
fn is_no_space(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT))
}

/// A start refused for want of disk space.
fn no_space(message: String) -> Refused {
    Refused::new(Reason::NoSpace, message)
}

/// A record that could not be made: a full filesystem is named as such.
fn record_error(what: &str, workspace: &WorkspaceDir, e: crate::sys::SysError) -> Refused {
    match &e {
        crate::sys::SysError::Path { source, .. } if is_no_space(source) => no_space(format!(
            "{what}: {e}: the filesystem of workspace {} is full; free space there \
             (scripts.file_max_bytes bounds each file a script writes, not their total: \
             a filesystem quota does)",
            workspace.path.display()
        )),
        _ => Refused::internal(format!("{what}: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::Approval;
    use crate::policy::StartPlan;
    use crate::protocol::snapshot::{PermissionMode, ToolClass};

    #[test]
    fn approval_says_why_a_start_may_run_as_the_audit_spells_it() {
        let plan = |needs_approval, declared: &[&str]| StartPlan {
            needs_approval,
            declared: declared
                .iter()
                .map(|n| (n.to_string(), ToolClass::Write))
                .collect(),
        };
        let cases = [
            (plan(true, &["w"]), PermissionMode::Approval, None),
            (
                plan(false, &[]),
                PermissionMode::Approval,
                Some("not_needed"),
            ),
            (plan(false, &[]), PermissionMode::Auto, Some("not_needed")),
            (plan(false, &["w"]), PermissionMode::Auto, Some("auto")),
            (
                plan(false, &["w"]),
                PermissionMode::Approval,
                Some("session_allowed"),
            ),
        ];
        for (plan, mode, want) in cases {
            assert_eq!(
                Approval::without_request(&plan, mode).map(Approval::as_str),
                want,
                "{plan:?} {mode:?}"
            );
        }
        assert_eq!(Approval::AllowOnce.as_str(), "allow_once");
    }
}
