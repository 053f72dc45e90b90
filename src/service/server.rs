//! The Unix-socket front end: connections, framing, the SO_PEERCRED check, and
//! dispatch of protocol methods to `Daemon`. Each connection is also the
//! `EngineLink` of the scripts it starts.

use crate::daemon::ratelimit::{RefusalLimiter, Verdict, CONNECTIONS};
use crate::daemon::{Access, Daemon, Peer, PeerGroups};
use crate::policy::auth::Role;
use crate::protocol::refusal::{Reason, Refused};
use crate::protocol::rpc::BoxFuture;
use crate::protocol::rpc::{self, Bounds, CallError, Strict};
use crate::protocol::{
    self, ApprovalAnswer, ApprovalRequest, DaemonRequest, Decision, EngineRequest, Method,
    Notification, RpcError, ToolAnswer, ToolCall, ToolCancelled, ToolResult,
};
use crate::script::engine::{Abandoned, CallEnd, EngineLink, LinkError};
use serde_json::Value;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::{UnixListener, UnixStream};

static NEXT_CONN: AtomicU64 = AtomicU64::new(1);

/// Requests of one engine being answered, counting answers not yet written to
/// its socket: an engine that floods requests and never reads its answers stops
/// being read itself once this many are outstanding.
const MAX_OUTSTANDING: usize = 1024;

/// One engine connection, as the scripts it starts see it.
pub struct Conn {
    id: u64,
    /// The connection's JSON-RPC endpoint (requests to the engine, notifications).
    endpoint: rpc::Endpoint,
}

fn link_error(e: CallError) -> LinkError {
    match e {
        CallError::Answered(e) => LinkError::Answered(e.message),
        CallError::Disconnected | CallError::Closed(_) => LinkError::Disconnected,
        CallError::Timeout { .. } => LinkError::Timeout,
    }
}

impl EngineLink for Conn {
    fn id(&self) -> u64 {
        self.id
    }
    fn tool_call(
        &self,
        params: ToolCall,
        end: CallEnd,
    ) -> BoxFuture<'_, Result<ToolAnswer, LinkError>> {
        Box::pin(async move {
            // Dropped unanswered: the script ended with the call at the engine,
            // which is told so (`tool.cancelled`) and may stop the work.
            let endpoint = self.endpoint.clone();
            let (script_id, call_id) = (params.script_id.clone(), params.call_id.clone());
            let abandoned = move |id| {
                let why = end.get().cloned().unwrap_or_else(Abandoned::exited);
                let n = ToolCancelled {
                    id,
                    script_id,
                    call_id,
                    reason: why.reason.as_str().into(),
                    message: why.message,
                };
                endpoint.notify("tool.cancelled", &n);
            };
            let v = self
                .endpoint
                .request_abandonable(DaemonRequest::TOOL_CALL, &params, None, abandoned)
                .await
                .map_err(link_error)?;
            ToolResult::from_answer(&v)
                .map_err(|e| LinkError::Malformed(format!("tool.call answer: {e}")))
        })
    }
    fn approval_request(
        &self,
        params: ApprovalRequest,
        timeout: Duration,
    ) -> BoxFuture<'_, Result<bool, LinkError>> {
        Box::pin(async move {
            let v = self
                .endpoint
                .request(DaemonRequest::APPROVAL_REQUEST, &params, Some(timeout))
                .await
                .map_err(link_error)?;
            match serde_json::from_value::<ApprovalAnswer>(v) {
                Ok(a) => Ok(a.decision == Decision::AllowOnce),
                Err(e) => Err(LinkError::Malformed(format!(
                    "approval.request answer: {e}; expected {{\"decision\": \"allow_once\" | \"deny\"}}"
                ))),
            }
        })
    }
    fn send(&self, n: Notification) {
        match &n {
            Notification::ScriptProgress(s) => self.endpoint.notify(n.method(), s),
            Notification::ScriptFinished(r) => self.endpoint.notify(n.method(), r),
            Notification::ToolCancelled(c) => self.endpoint.notify(n.method(), c),
        }
    }
}

/// Serve until the listener fails or, when `idle_exit` is set, until there has been
/// no connection and no running script for that long.
///
/// Connections are accepted and checked on a thread of their own (the gate), at
/// a lower CPU priority than the runtime that serves the engines: a local user
/// looping on `connect(2)` makes that thread busy, not the engines' workers.
/// Admitted connections are handed to the runtime.
pub async fn serve(
    daemon: Arc<Daemon>,
    listener: UnixListener,
    idle_exit: Option<Duration>,
) -> std::io::Result<()> {
    let live = Arc::new(Liveness::new());
    let config = daemon.live();
    let sv = &config.cfg.server;
    let gate = Arc::new(Gate {
        daemon: daemon.clone(),
        main: tokio::runtime::Handle::current(),
        table: Arc::new(Table {
            caps: Caps {
                total: sv.max_connections,
                per_uid: sv.max_connections_per_uid,
                admin: sv.max_admin_connections,
            },
            open: Mutex::new(Open::default()),
        }),
        lookups: Mutex::default(),
        pace: Mutex::default(),
        refusals: Mutex::new(RefusalLimiter::new(CONNECTIONS)),
        budget: Arc::new(tokio::sync::Semaphore::new(sv.max_buffered_bytes)),
        admin_budget: Arc::new(tokio::sync::Semaphore::new(0)),
        live: live.clone(),
    });
    let listener = listener.into_std()?;
    // A short backlog: a connection waits behind at most this many others,
    // however fast a peer that loops on connect fills it (systemd's Backlog=
    // is overridden). The gate drains it at full speed.
    nix::sys::socket::listen(
        &listener,
        nix::sys::socket::Backlog::new(LISTEN_BACKLOG).map_err(std::io::Error::from)?,
    )
    .map_err(std::io::Error::from)?;
    let (failed_tx, failed) = tokio::sync::oneshot::channel::<std::io::Error>();
    // Dropped with this future: the gate thread then ends, and the listener with it.
    let (_stop, stop) = tokio::sync::oneshot::channel::<()>();
    std::thread::Builder::new()
        .name("scriptgated-gate".into())
        .spawn(move || {
            lower_priority();
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build();
            let rt = match rt {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = failed_tx.send(e);
                    return;
                }
            };
            rt.block_on(async move {
                let listener = match listener
                    .set_nonblocking(true)
                    .and_then(|()| listener_fd(listener))
                {
                    Ok(l) => l,
                    Err(e) => {
                        let _ = failed_tx.send(e);
                        return;
                    }
                };
                tokio::select! {
                    e = accept_loop(&gate, &listener) => { let _ = failed_tx.send(e); }
                    _ = stop => {}
                }
            });
        })?;
    let idle = idle_for(&daemon, &live, idle_exit);
    tokio::select! {
        e = failed => Err(e.unwrap_or_else(|_| std::io::Error::other("the gate thread ended"))),
        _ = idle => {
            tracing::info!("idle for {:?} with no connection and no script; exiting", idle_exit.unwrap_or_default());
            Ok(())
        }
    }
}

/// Resolves once the daemon has had no connection and no running script for
/// `idle_exit` (never without one).
async fn idle_for(daemon: &Daemon, live: &Liveness, idle_exit: Option<Duration>) {
    let Some(d) = idle_exit else {
        return std::future::pending().await;
    };
    // Quiet since: the last wake-up here (a script ended, a connection
    // closed) or the last connection the gate let go, whichever is later.
    let mut woken = std::time::Instant::now();
    loop {
        let now = std::time::Instant::now();
        let quiet = now
            .saturating_duration_since(woken)
            .min(live.quiet_for(now));
        let idle = live.conns.load(Ordering::SeqCst) == 0 && daemon.running_count() == 0;
        if idle && quiet >= d {
            return;
        }
        // Busy: woken when a served connection ends, and every `d` anyway
        // (the last one to go may have been refused, which wakes nobody).
        let wait = if idle { d - quiet } else { d };
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = live.activity.notified() => woken = std::time::Instant::now(),
            _ = daemon.changed() => woken = std::time::Instant::now(),
        }
    }
}

/// Accept until the listener fails; each connection goes to the gate. The
/// backlog is drained at full speed, with plain `accept(2)` (a connection is
/// registered with a reactor only once it is admitted, by the engines' runtime).
async fn accept_loop(
    gate: &Arc<Gate>,
    listener: &tokio::io::unix::AsyncFd<std::os::unix::net::UnixListener>,
) -> std::io::Error {
    let mut backoff = ACCEPT_BACKOFF_MIN;
    loop {
        let mut ready = match listener.readable().await {
            Ok(r) => r,
            Err(e) => return e,
        };
        for _ in 0..ACCEPTS_PER_TURN {
            match listener.get_ref().accept() {
                Ok((stream, _)) => {
                    backoff = ACCEPT_BACKOFF_MIN;
                    gate.check(stream);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    ready.clear_ready();
                    break;
                }
                // Out of descriptors or buffers, or a peer that left before
                // we took it: the daemon and its running scripts go on.
                Err(e) if accept_error_is_transient(&e) => {
                    tracing::warn!("accept failed: {e}; retrying in {backoff:?}");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(ACCEPT_BACKOFF_MAX);
                    break;
                }
                Err(e) => return e,
            }
        }
        drop(ready);
        // The lookups that ended hand their connections over meanwhile.
        tokio::task::yield_now().await;
    }
}

/// The listener, registered with the gate's reactor for readiness only. Sound:
/// the AsyncFd owns the listener, whose descriptor stays open (and the same)
/// until the AsyncFd is dropped (tokio's deprecation is of the unchecked
/// general case; its replacement is an `unsafe fn`, which this crate denies).
#[allow(deprecated)]
fn listener_fd(
    l: std::os::unix::net::UnixListener,
) -> std::io::Result<tokio::io::unix::AsyncFd<std::os::unix::net::UnixListener>> {
    tokio::io::unix::AsyncFd::with_interest(l, tokio::io::Interest::READABLE)
}

/// Connections queued in the listen backlog at most.
const LISTEN_BACKLOG: i32 = 64;

/// Connections accepted between two turns of the gate's other tasks.
const ACCEPTS_PER_TURN: usize = 256;

/// The gate thread's nice value, above the daemon's: under a flood of
/// connections it yields the CPU to the workers that serve the engines.
const GATE_NICENESS: i32 = 19;

fn lower_priority() {
    crate::sys::lower_thread_priority(GATE_NICENESS);
}

const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(10);
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// Errors of `accept` that say nothing about the listener itself.
fn accept_error_is_transient(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(
            libc::EMFILE
                | libc::ENFILE
                | libc::ENOBUFS
                | libc::ENOMEM
                | libc::ECONNABORTED
                | libc::EPROTO
                | libc::EPERM
                | libc::EINTR
        )
    )
}

// ---- the connection verdict: which pool, which cap, refuse or serve (pure) -------------

/// The pool a served connection counts in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pool {
    /// Root and members of `auth.allowed_groups`: `server.max_connections`.
    Engine,
    /// Members of `auth.admin_groups` only: `server.max_admin_connections`.
    Admin,
}

/// The cap a refused connection hit; its -32015 names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cap {
    /// `server.max_connections`: engine connections in all.
    Total,
    /// `server.max_connections_per_uid`: connections of this peer's uid.
    PerUid,
    /// `server.max_admin_connections`: connections of admin-only peers in all.
    Admin,
    /// Connections waiting for their peer's groups to be looked up.
    Checks,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caps {
    pub total: usize,
    pub per_uid: usize,
    pub admin: usize,
}

/// Connections served now: per pool, and of the peer's uid.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    pub engine: usize,
    pub admin: usize,
    pub this_uid: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnVerdict {
    /// Served, counted in its pool.
    Serve(Pool),
    /// Not root nor in any group of the config: one -32001, counted nowhere.
    NotAllowed,
    Full(Cap),
}

/// Whether a connection of a peer with `role` is served, given what is open. A refused peer
/// counts nowhere; any peer is held to its uid's share, then to its pool's cap.
pub fn connection_verdict(role: Role, open: Counts, caps: Caps) -> ConnVerdict {
    let pool = match role {
        Role::Refused => return ConnVerdict::NotAllowed,
        Role::AdminOnly => Pool::Admin,
        Role::Engine { .. } => Pool::Engine,
    };
    if open.this_uid >= caps.per_uid {
        return ConnVerdict::Full(Cap::PerUid);
    }
    match pool {
        Pool::Admin if open.admin >= caps.admin => ConnVerdict::Full(Cap::Admin),
        Pool::Engine if open.engine >= caps.total => ConnVerdict::Full(Cap::Total),
        _ => ConnVerdict::Serve(pool),
    }
}

/// The -32015 for a connection refused at `cap`.
fn too_many(cap: Cap, caps: &Caps, uid: u32) -> Refused {
    let message = match cap {
        Cap::Total => format!(
            "scriptgated already serves server.max_connections = {} connections; close one and retry",
            caps.total
        ),
        Cap::PerUid => format!(
            "uid {uid} already holds server.max_connections_per_uid = {} connections; close one and retry",
            caps.per_uid
        ),
        Cap::Admin => format!(
            "admin-only peers already hold server.max_admin_connections = {} connections; close one and retry",
            caps.admin
        ),
        Cap::Checks => format!(
            "the peer group lookups are at their caps ({MAX_PEER_CHECKS} at once, {MAX_PEER_CHECKS_PER_UID} per uid, {MAX_WAITING_PER_LOOKUP} connections waiting for one); retry"
        ),
    };
    Refused::new(Reason::TooManyConnections, message)
}

/// The connections served, by pool and uid.
struct Table {
    caps: Caps,
    open: Mutex<Open>,
}

#[derive(Default)]
struct Open {
    engine: usize,
    admin: usize,
    /// Only uids with a connection open: as large as the connections at most.
    by_uid: HashMap<u32, usize>,
}

/// One admitted connection's place in the table, given back on drop.
struct Slot {
    table: Arc<Table>,
    pool: Pool,
    uid: u32,
}

impl Table {
    fn try_serve(self: &Arc<Self>, role: Role, uid: u32) -> Result<Slot, ConnVerdict> {
        let mut o = self.open.lock().unwrap_or_else(|p| p.into_inner());
        let counts = Counts {
            engine: o.engine,
            admin: o.admin,
            this_uid: o.by_uid.get(&uid).copied().unwrap_or(0),
        };
        match connection_verdict(role, counts, self.caps) {
            ConnVerdict::Serve(pool) => {
                match pool {
                    Pool::Engine => o.engine += 1,
                    Pool::Admin => o.admin += 1,
                }
                *o.by_uid.entry(uid).or_default() += 1;
                Ok(Slot {
                    table: self.clone(),
                    pool,
                    uid,
                })
            }
            refused => Err(refused),
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut o = self.table.open.lock().unwrap_or_else(|p| p.into_inner());
        match self.pool {
            Pool::Engine => o.engine -= 1,
            Pool::Admin => o.admin -= 1,
        }
        if let Some(n) = o.by_uid.get_mut(&self.uid) {
            *n -= 1;
            if *n == 0 {
                o.by_uid.remove(&self.uid);
            }
        }
    }
}

// ---- the peer check, off the runtime and cached -------------------------------------

/// Group lookups (NSS, on the blocking pool) in flight at once, in all and for
/// one uid; a connection that would start one more is refused (-32015). One
/// lookup serves every connection of the same uid and gid that comes while it
/// runs, up to `MAX_WAITING_PER_LOOKUP` of them. Looked-up peers are cached, so
/// a peer that loops on connect costs one lookup per `GROUPS_TTL`.
const MAX_PEER_CHECKS: usize = 32;
const MAX_PEER_CHECKS_PER_UID: usize = 4;
const MAX_WAITING_PER_LOOKUP: usize = 64;
/// How long a peer's groups are taken as looked up. A change of its
/// supplementary groups is seen this much later (its primary gid is in the key).
const GROUPS_TTL: Duration = Duration::from_secs(2);
/// Peers cached at most; past it, the expired entries go, then the oldest.
const GROUPS_CACHED: usize = 1024;

/// What the gate needs to know of a peer (uid, gid) from NSS.
#[derive(Debug, Clone)]
struct Groups {
    in_allowed: bool,
    in_admin: bool,
    /// Every gid of the peer, for `[[auth.engine]]` entries (engines only).
    gids: Vec<u32>,
}

type Key = (u32, u32);

/// The peers looked up, by (uid, gid), and the lookups in flight with the
/// connections (`W`) that wait for each. Pure: callers pass the time.
struct Lookups<W> {
    cached: HashMap<Key, (std::time::Instant, Arc<Groups>)>,
    pending: HashMap<Key, Vec<W>>,
    /// Lookups in flight per uid (only uids with one).
    by_uid: HashMap<u32, usize>,
}

impl<W> Default for Lookups<W> {
    fn default() -> Self {
        Lookups {
            cached: HashMap::new(),
            pending: HashMap::new(),
            by_uid: HashMap::new(),
        }
    }
}

/// What a connection of a peer not cached gets from `Lookups::begin`.
#[derive(Debug)]
enum Begin<W> {
    Cached(Arc<Groups>, W),
    /// It waits for the lookup in flight for its key.
    Joined,
    /// It waits for a lookup that the caller is to run now.
    Started,
    /// Lookups are at their caps; the connection comes back to be refused.
    Full(W),
}

impl<W> Lookups<W> {
    fn begin(&mut self, key: Key, w: W, now: std::time::Instant) -> Begin<W> {
        if let Some((at, g)) = self.cached.get(&key) {
            if now.saturating_duration_since(*at) < GROUPS_TTL {
                return Begin::Cached(g.clone(), w);
            }
        }
        if let Some(waiting) = self.pending.get_mut(&key) {
            if waiting.len() >= MAX_WAITING_PER_LOOKUP {
                return Begin::Full(w);
            }
            waiting.push(w);
            return Begin::Joined;
        }
        let of_uid = self.by_uid.get(&key.0).copied().unwrap_or(0);
        if self.pending.len() >= MAX_PEER_CHECKS || of_uid >= MAX_PEER_CHECKS_PER_UID {
            return Begin::Full(w);
        }
        *self.by_uid.entry(key.0).or_default() += 1;
        self.pending.insert(key, vec![w]);
        Begin::Started
    }

    /// The lookup of `key` ended (`None`: it failed): the connections that waited.
    fn finish(&mut self, key: Key, g: Option<Arc<Groups>>, now: std::time::Instant) -> Vec<W> {
        if let Some(n) = self.by_uid.get_mut(&key.0) {
            *n -= 1;
            if *n == 0 {
                self.by_uid.remove(&key.0);
            }
        }
        if let Some(g) = g {
            self.put(key, g, now);
        }
        self.pending.remove(&key).unwrap_or_default()
    }

    fn put(&mut self, key: Key, g: Arc<Groups>, now: std::time::Instant) {
        if self.cached.len() >= GROUPS_CACHED && !self.cached.contains_key(&key) {
            self.cached
                .retain(|_, (at, _)| now.saturating_duration_since(*at) < GROUPS_TTL);
            if self.cached.len() >= GROUPS_CACHED {
                let oldest = self
                    .cached
                    .iter()
                    .min_by_key(|(_, (at, _))| *at)
                    .map(|(k, _)| *k);
                if let Some(k) = oldest {
                    self.cached.remove(&k);
                }
            }
        }
        self.cached.insert(key, (now, g));
    }
}

/// The NSS lookups of one peer (blocking: `getpwuid`, `getgrnam`, `getgrouplist`).
fn look_up(uid: u32, gid: u32, auth: &crate::config::Auth, engines: bool) -> Groups {
    let in_allowed = crate::sys::peer_in_groups(uid, gid, &auth.allowed_groups);
    Groups {
        in_allowed,
        in_admin: crate::sys::peer_in_groups(uid, gid, &auth.admin_groups),
        gids: if in_allowed && engines {
            crate::sys::peer_gids(uid, gid)
        } else {
            vec![]
        },
    }
}

/// Connections from accept to close, whether served or not yet known, for the
/// idle exit.
struct Liveness {
    conns: AtomicUsize,
    /// When the gate last let a connection go, in ms since `base`.
    last_gone: AtomicU64,
    base: std::time::Instant,
    /// Woken when a served connection ends.
    activity: tokio::sync::Notify,
}

impl Liveness {
    fn new() -> Liveness {
        Liveness {
            conns: AtomicUsize::new(0),
            last_gone: AtomicU64::new(0),
            base: std::time::Instant::now(),
            activity: tokio::sync::Notify::new(),
        }
    }

    /// How long since the gate last let a connection go.
    fn quiet_for(&self, now: std::time::Instant) -> Duration {
        let gone = self.base + Duration::from_millis(self.last_gone.load(Ordering::SeqCst));
        now.saturating_duration_since(gone)
    }
}

/// One accepted connection's count in `Liveness`, from accept to close.
struct Live {
    of: Arc<Liveness>,
    /// Admitted: its end wakes the idle exit (a refusal's does not, so that a
    /// peer looping on connect does not wake the engines' runtime each time).
    served: bool,
}

impl Live {
    fn new(of: &Arc<Liveness>) -> Live {
        of.conns.fetch_add(1, Ordering::SeqCst);
        Live {
            of: of.clone(),
            served: false,
        }
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        let ms = u64::try_from(self.of.base.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.of.last_gone.fetch_max(ms, Ordering::SeqCst);
        self.of.conns.fetch_sub(1, Ordering::SeqCst);
        if self.served {
            self.of.activity.notify_waiters();
        }
    }
}

/// The front door: every accepted connection passes here before it counts.
struct Gate {
    daemon: Arc<Daemon>,
    /// The runtime that serves admitted connections (the gate runs on its own).
    main: tokio::runtime::Handle,
    table: Arc<Table>,
    lookups: Mutex<Lookups<Caller>>,
    /// Refusal lines per uid.
    pace: Mutex<Paces>,
    /// The refused connections: logged one by one within the one refusal
    /// limiter's rate for connections, counted by reason past it; the counts
    /// are logged with the next refusal that is, so a local user who loops on
    /// connect cannot flood the journal.
    refusals: Mutex<RefusalLimiter<GateRefusal>>,
    /// Partial lines of engines (`server.max_buffered_bytes`).
    budget: Arc<tokio::sync::Semaphore>,
    /// Admin-only peers': none. Their lines are at most `ADMIN_MAX_LINE`, below
    /// `FREE_LINE_BYTES`, so they never draw on it.
    admin_budget: Arc<tokio::sync::Semaphore>,
    live: Arc<Liveness>,
}

/// A connection whose peer is known: uid, gid, pid. On the gate, a plain
/// socket; once admitted, the engines' runtime's.
struct Caller<S = std::os::unix::net::UnixStream> {
    stream: S,
    uid: u32,
    gid: u32,
    pid: Option<i32>,
    live: Live,
}

/// A peer's pid as a log line says it: the number, or "unknown" (a peer in
/// another pid namespace has pid 0 in `SO_PEERCRED`).
fn pid_text(pid: Option<i32>) -> String {
    match pid {
        Some(p) if p > 0 => p.to_string(),
        _ => "unknown".into(),
    }
}

impl<S> std::fmt::Debug for Caller<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Caller(uid {}, gid {})", self.uid, self.gid)
    }
}

impl Gate {
    /// The peer check of a connection just accepted: on the gate's thread only
    /// when its groups are cached (or it is root); else looked up on the
    /// blocking pool, one lookup for every connection of the same uid and gid.
    fn check(self: &Arc<Self>, stream: std::os::unix::net::UnixStream) {
        let live = Live::new(&self.live);
        let cred =
            nix::sys::socket::getsockopt(&stream, nix::sys::socket::sockopt::PeerCredentials);
        let cred = match cred {
            Ok(c) => c,
            Err(e) => {
                self.log_refusal(GateRefusal::PeerCred, || format!("SO_PEERCRED failed: {e}"));
                return;
            }
        };
        let c = Caller {
            stream,
            uid: cred.uid(),
            gid: cred.gid(),
            pid: Some(cred.pid()),
            live,
        };
        if c.uid == 0 {
            return self.let_in(c, None);
        }
        let key = (c.uid, c.gid);
        let begin = self
            .lookups
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .begin(key, c, std::time::Instant::now());
        match begin {
            Begin::Cached(g, c) => self.let_in(c, Some(&g)),
            Begin::Joined => {}
            Begin::Full(c) => self.refuse_full(c, Cap::Checks),
            Begin::Started => {
                let gate = self.clone();
                tokio::spawn(async move {
                    let d = gate.daemon.clone();
                    let engines = d.has_engine_entries();
                    let g = tokio::task::spawn_blocking(move || {
                        look_up(key.0, key.1, &d.live().cfg.auth, engines)
                    })
                    .await;
                    let failed = g.as_ref().err().map(ToString::to_string);
                    let g = g.ok().map(Arc::new);
                    let waiting = gate
                        .lookups
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .finish(key, g.clone(), std::time::Instant::now());
                    match (g, failed) {
                        (Some(g), _) => {
                            for c in waiting {
                                gate.let_in(c, Some(&g));
                            }
                        }
                        (None, e) => gate.log_refusal(GateRefusal::PeerCheck, || {
                            format!("peer check failed: {}", e.unwrap_or_default())
                        }),
                    }
                });
            }
        }
    }

    /// Admit or refuse a peer whose groups are known (`None`: root).
    fn let_in(self: &Arc<Self>, c: Caller, g: Option<&Groups>) {
        let groups = g.map(|g| PeerGroups {
            in_allowed: g.in_allowed,
            in_admin: g.in_admin,
            gids: &g.gids,
        });
        let (role, peer) = match self.daemon.identify(c.uid, c.gid, c.pid, groups) {
            Ok(who) => who,
            Err(e) if e.reason() == Reason::PeerNotAllowed => {
                return self.refuse(c, e, |c| {
                    format!(
                        "connection refused: uid {} (pid {}) is not root nor in auth.allowed_groups or auth.admin_groups",
                        c.uid, pid_text(c.pid)
                    )
                })
            }
            Err(e) => {
                let line = format!(
                    "connection refused (uid {}, pid {}): {}",
                    c.uid,
                    pid_text(c.pid),
                    e.message()
                );
                return self.refuse(c, e, |_| line);
            }
        };
        let slot = match self.table.try_serve(role, c.uid) {
            Ok(s) => s,
            Err(ConnVerdict::Full(cap)) => return self.refuse_full(c, cap),
            Err(_) => return,
        };
        let Caller {
            stream,
            uid,
            gid,
            pid,
            mut live,
        } = c;
        // To the engines' runtime.
        if stream.set_nonblocking(true).is_err() {
            return;
        }
        live.served = true;
        let gate = self.clone();
        self.main.spawn(async move {
            if let Ok(stream) = UnixStream::from_std(stream) {
                let c = Caller {
                    stream,
                    uid,
                    gid,
                    pid,
                    live,
                };
                connection(&gate, c, role, peer).await;
            }
            drop(slot);
        });
    }

    fn refuse_full(&self, c: Caller, cap: Cap) {
        let e = too_many(cap, &self.table.caps, c.uid);
        let message = e.message().to_string();
        self.refuse(c, e, |c| {
            format!(
                "connection refused (uid {}, pid {}): {message}",
                c.uid,
                pid_text(c.pid)
            )
        });
    }

    /// Log a refused connection (`line` is only built when it is logged).
    fn log_refusal(&self, reason: GateRefusal, line: impl FnOnce() -> String) {
        let now = crate::time::now_ms();
        let mut limiter = self.refusals.lock().unwrap_or_else(|p| p.into_inner());
        if limiter.observe(now, reason) == Verdict::Count {
            return;
        }
        // The counts, at most once a minute, with a refusal that is logged.
        if let Some(s) = limiter.take_after(now, 60_000) {
            tracing::warn!("{}", s.message(now));
        }
        drop(limiter);
        tracing::warn!(reason = reason.as_str(), "{}", line());
    }

    /// One error line for a peer not served, logged (within `log_refusal`'s
    /// limit), then closed (on drop). The new socket's send buffer is empty, so
    /// the line goes out without waiting. Past `REFUSAL_LINES_PER_UID_PER_S` of
    /// one uid (root excepted), its connections are just closed, with no line
    /// and no log: a peer looping on connect costs an accept and a close. The
    /// gate never waits: the listen backlog is drained at full speed.
    fn refuse(&self, c: Caller, e: Refused, line: impl FnOnce(&Caller) -> String) {
        // Every refusal is counted (per uid and minute, bounded), logged or not.
        self.daemon
            .count_refused_connection(c.uid, e.reason().as_str());
        if c.uid != 0 {
            let allowed = self
                .pace
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take(c.uid, std::time::Instant::now());
            if !allowed {
                return;
            }
        }
        self.log_refusal(GateRefusal::Peer(e.reason()), || line(&c));
        // Straight to the socket: tokio's try_write would not even try before
        // its reactor has seen the new socket writable.
        use nix::sys::socket::MsgFlags;
        use std::os::fd::AsRawFd;
        let line = protocol::response_line(&Value::Null, &Err(e.into()));
        let _ = nix::sys::socket::send(
            c.stream.as_raw_fd(),
            line.as_bytes(),
            MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_NOSIGNAL,
        );
    }
}

/// Refusals with a line, per uid, per second sustained and in a burst.
const REFUSAL_LINES_PER_UID_PER_S: f64 = 1000.0;
const REFUSAL_LINE_BURST: f64 = 1000.0;
/// Uids whose refusals are tracked at most; past it, those whose bucket is
/// full again are dropped, and while it stays full a new uid gets no line.
const PACED_UIDS: usize = 4096;

/// A token bucket over one uid's refusal lines. Pure: callers pass the time.
#[derive(Debug, Clone, Copy)]
struct Pace {
    tokens: f64,
    at: std::time::Instant,
}

impl Pace {
    fn new(now: std::time::Instant) -> Pace {
        Pace {
            tokens: REFUSAL_LINE_BURST,
            at: now,
        }
    }

    fn refill(&mut self, now: std::time::Instant) {
        let accrued =
            now.saturating_duration_since(self.at).as_secs_f64() * REFUSAL_LINES_PER_UID_PER_S;
        self.tokens = (self.tokens + accrued).min(REFUSAL_LINE_BURST);
        self.at = now;
    }

    /// Take one refusal line's token: whether there was one.
    fn take(&mut self, now: std::time::Instant) -> bool {
        self.refill(now);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// Each uid's bucket, bounded in uids.
#[derive(Debug, Default)]
struct Paces {
    by_uid: HashMap<u32, Pace>,
}

impl Paces {
    fn take(&mut self, uid: u32, now: std::time::Instant) -> bool {
        if !self.by_uid.contains_key(&uid) && self.by_uid.len() >= PACED_UIDS {
            self.by_uid.retain(|_, p| {
                p.refill(now);
                p.tokens < REFUSAL_LINE_BURST
            });
            if self.by_uid.len() >= PACED_UIDS {
                return false;
            }
        }
        self.by_uid
            .entry(uid)
            .or_insert_with(|| Pace::new(now))
            .take(now)
    }
}

/// Lines an admin-only peer may send, at most: its requests are tiny
/// (`daemon.info` and the `admin.*` methods), and lines this short need no
/// share of the partial-line budget of the engines.
const ADMIN_MAX_LINE: usize = 16 * 1024;
/// An admin-only peer's requests answered at once.
const ADMIN_MAX_OUTSTANDING: usize = 16;
/// Bytes of answers queued for a peer that it has not read yet, past which no
/// further request of it is taken: an admin-only peer, an engine.
const ADMIN_MAX_QUEUED_BYTES: usize = 64 * 1024;
const ENGINE_MAX_QUEUED_BYTES: usize = 1 << 20;

/// One admitted connection: JSON-RPC both ways until it closes; then its
/// scripts are told (they are cancelled).
async fn connection(gate: &Gate, c: Caller<UnixStream>, role: Role, peer: Peer) {
    let daemon = &gate.daemon;
    // Counted (for the idle exit) until this returns.
    let Caller {
        stream,
        live: _live,
        ..
    } = c;
    daemon.connected(role, peer);
    let (read, write) = stream.into_split();
    let (endpoint, writer) = rpc::Endpoint::new(write);
    let id = NEXT_CONN.fetch_add(1, Ordering::Relaxed);
    // Its answers count in the stop's barrier while it is read (the clone is
    // dropped before the writer is awaited: the writer ends with the last one).
    daemon.serving(id, endpoint.clone());
    let conn = Arc::new(Conn { id, endpoint });
    let config = daemon.live();
    let sv = &config.cfg.server;
    let timed_out = format!(
        "a message was not completed within server.line_timeout_s = {} s; closing the connection",
        sv.line_timeout_s
    );
    let timeout = Duration::from_secs(sv.line_timeout_s);
    let bounds = if role == Role::AdminOnly {
        Bounds {
            max_line: ADMIN_MAX_LINE,
            shared: Some((gate.admin_budget.clone(), timeout)),
            max_outstanding: ADMIN_MAX_OUTSTANDING,
            max_queued_bytes: ADMIN_MAX_QUEUED_BYTES,
            strict: Some(Strict {
                too_long: format!(
                    "message longer than {ADMIN_MAX_LINE} bytes, the most an admin-only peer may send; closing the connection"
                ),
                timed_out,
            }),
        }
    } else {
        Bounds {
            max_line: sv.max_message_bytes,
            shared: Some((gate.budget.clone(), timeout)),
            max_outstanding: MAX_OUTSTANDING,
            max_queued_bytes: ENGINE_MAX_QUEUED_BYTES,
            strict: Some(Strict {
                too_long: format!(
                    "message longer than max_message_bytes = {}; closing the connection",
                    sv.max_message_bytes
                ),
                timed_out,
            }),
        }
    };
    let handler = Arc::new(Session {
        daemon: daemon.clone(),
        peer,
        admin_only: role == Role::AdminOnly,
        conn: conn.clone(),
    });
    conn.endpoint.serve(read, &bounds, handler).await;
    daemon.served(conn.id);
    daemon.disconnected(conn.id);
    drop(conn);
    // Let queued answers (a -32600 for a line over the bounds) reach the peer before closing.
    let _ = tokio::time::timeout(Duration::from_secs(2), writer).await;
}

/// The daemon side of one engine connection (a session): serves its requests.
struct Session {
    daemon: Arc<Daemon>,
    peer: Peer,
    /// In `auth.admin_groups` only: `daemon.info` and `admin.*`, nothing else.
    admin_only: bool,
    conn: Arc<Conn>,
}

impl rpc::Handler for Session {
    fn request(
        self: Arc<Self>,
        method: String,
        params: Value,
    ) -> BoxFuture<'static, Result<Value, RpcError>> {
        Box::pin(async move { self.dispatch(&method, params).await })
    }
}

impl Session {
    /// The method is looked up first (-32601), then the admin check for admin
    /// methods, and only then are the params parsed (-32602).
    async fn dispatch(&self, method: &str, params: Value) -> Result<Value, RpcError> {
        let method = Method::from_name(method)?;
        if method.admin_only() && !self.peer.admin() {
            return Err(RpcError::not_admin());
        }
        if self.admin_only && !method.admin_only() && method != Method::DaemonInfo {
            return Err(admin_only_peer(
                self.peer.uid(),
                &self.daemon.live().cfg.auth.allowed_groups,
            )
            .into());
        }
        let engine = self.peer.engine();
        let (d, conn, who) = (
            &self.daemon,
            &self.conn,
            Access::Conn(self.conn.id, engine, self.peer.uid()),
        );
        match EngineRequest::parse(method, params)? {
            EngineRequest::ScriptStart(sp) => {
                let link: Arc<dyn EngineLink> = conn.clone();
                to_value(d.start(self.peer, link, sp).await?)
            }
            EngineRequest::ScriptWait(r) => {
                // Made in this connection's turn: a script's result is copied
                // for one of its waits at a time, as the engine reads them.
                to_value(d.wait_turn(who, r, rpc::answer_turn()).await?)
            }
            EngineRequest::ScriptStatus(r) => to_value(d.status(who, r)?),
            EngineRequest::ScriptCancel(r) => {
                to_value(d.cancel(who, r, "cancelled by the engine").await?)
            }
            EngineRequest::RunRevoke(t) => to_value(d.revoke(self.peer, &t.token).await?),
            EngineRequest::RunDescribe(t) => to_value(d.describe(engine, &t.token)?),
            EngineRequest::DaemonInfo => to_value(d.info()),
            EngineRequest::AdminList => {
                // Made in this connection's turn, as the peer reads its answers:
                // a peer that floods admin.list holds one answer in the making.
                rpc::answer_turn().await;
                to_value(protocol::AdminList {
                    scripts: d.list_with_usage().await,
                })
            }
            EngineRequest::AdminCancel(r) => {
                let why = format!("cancelled by an administrator (uid {})", self.peer.uid());
                to_value(d.cancel(Access::Admin, r, &why).await?)
            }
            EngineRequest::AdminCalls(p) => {
                // A page (up to 1 MiB) is read only in the connection's turn.
                rpc::answer_turn().await;
                to_value(d.calls_page(p).await?)
            }
            EngineRequest::AdminPrune(p) => {
                to_value(d.prune_workspaces(p.dry_run, p.as_of_ms).await?)
            }
        }
    }
}

/// Why the gate refused a connection, as its log line and the counts name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum GateRefusal {
    /// `SO_PEERCRED` failed: the peer is unknown.
    PeerCred,
    /// Its groups could not be looked up.
    PeerCheck,
    /// Refused for who it is or what is open (`Refused`'s reason).
    Peer(Reason),
}

impl GateRefusal {
    fn as_str(self) -> &'static str {
        match self {
            GateRefusal::PeerCred => "peer_cred",
            GateRefusal::PeerCheck => "peer_check",
            GateRefusal::Peer(r) => r.as_str(),
        }
    }
}

impl std::fmt::Display for GateRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An engine method from a peer that is only an administrator.
fn admin_only_peer(uid: u32, allowed_groups: &[String]) -> Refused {
    Refused::new(
        Reason::AdminOnly,
        format!(
            "uid {uid} is an administrator (auth.admin_groups) but not an engine: it may use daemon.info and admin.* only; scripts and tokens are for root and members of auth.allowed_groups {allowed_groups:?}"
        ),
    )
}

fn to_value<T: serde::Serialize>(v: T) -> Result<Value, RpcError> {
    serde_json::to_value(v).map_err(|e| RpcError::internal(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::code;

    const CAPS: Caps = Caps {
        total: 256,
        per_uid: 64,
        admin: 16,
    };
    const ENGINE: Role = Role::Engine { admin: false };

    #[test]
    fn a_pid_is_logged_as_a_number_or_unknown() {
        assert_eq!(pid_text(Some(1251)), "1251");
        assert_eq!(pid_text(Some(0)), "unknown");
        assert_eq!(pid_text(None), "unknown");
    }

    fn counts(engine: usize, admin: usize, this_uid: usize) -> Counts {
        Counts {
            engine,
            admin,
            this_uid,
        }
    }

    #[test]
    fn a_peer_in_no_group_counts_nowhere() {
        for open in [counts(0, 0, 0), counts(256, 16, 64)] {
            assert_eq!(
                connection_verdict(Role::Refused, open, CAPS),
                ConnVerdict::NotAllowed
            );
        }
    }

    #[test]
    fn each_uid_has_its_share_root_included() {
        assert_eq!(
            connection_verdict(ENGINE, counts(63, 0, 63), CAPS),
            ConnVerdict::Serve(Pool::Engine)
        );
        for role in [ENGINE, Role::Engine { admin: true }] {
            assert_eq!(
                connection_verdict(role, counts(64, 0, 64), CAPS),
                ConnVerdict::Full(Cap::PerUid)
            );
        }
        // Another uid is served while one holds its whole share.
        assert_eq!(
            connection_verdict(ENGINE, counts(64, 0, 0), CAPS),
            ConnVerdict::Serve(Pool::Engine)
        );
        // The global cap is behind the shares.
        assert_eq!(
            connection_verdict(ENGINE, counts(256, 0, 3), CAPS),
            ConnVerdict::Full(Cap::Total)
        );
    }

    #[test]
    fn admin_only_peers_have_a_pool_of_their_own() {
        assert_eq!(
            connection_verdict(Role::AdminOnly, counts(256, 15, 15), CAPS),
            ConnVerdict::Serve(Pool::Admin),
            "engines filling theirs leave the admin pool"
        );
        assert_eq!(
            connection_verdict(Role::AdminOnly, counts(0, 16, 0), CAPS),
            ConnVerdict::Full(Cap::Admin)
        );
        assert_eq!(
            connection_verdict(ENGINE, counts(0, 16, 0), CAPS),
            ConnVerdict::Serve(Pool::Engine),
            "a full admin pool takes nothing from the engines"
        );
    }

    #[test]
    fn refusals_name_the_cap() {
        for (cap, key) in [
            (Cap::Total, "server.max_connections = 256"),
            (Cap::PerUid, "server.max_connections_per_uid = 64"),
            (Cap::Admin, "server.max_admin_connections = 16"),
        ] {
            let e = too_many(cap, &CAPS, 7);
            assert!(e.message().contains(key), "{}", e.message());
            assert_eq!(e.code(), code::BUSY);
        }
    }

    #[test]
    fn refusal_lines_are_paced_per_uid_and_never_wait() {
        let mut p = Paces::default();
        let t0 = std::time::Instant::now();
        for _ in 0..REFUSAL_LINE_BURST as usize {
            assert!(p.take(7, t0));
        }
        assert!(!p.take(7, t0), "past the burst: no line");
        assert!(p.take(8, t0), "another uid has its own bucket");
        // A second later the bucket is full again, not fuller.
        let t1 = t0 + Duration::from_secs(1);
        for _ in 0..REFUSAL_LINE_BURST as usize {
            assert!(p.take(7, t1));
        }
        assert!(!p.take(7, t1));
        // Bounded in uids; a uid whose bucket refilled makes room.
        for uid in 1000..(1000 + PACED_UIDS as u32) {
            p.take(uid, t1);
        }
        assert!(p.by_uid.len() <= PACED_UIDS);
        let t2 = t1 + Duration::from_secs(2);
        assert!(p.take(99_999, t2));
        assert!(p.by_uid.len() <= PACED_UIDS);
    }

    fn groups() -> Arc<Groups> {
        Arc::new(Groups {
            in_allowed: true,
            in_admin: false,
            gids: vec![],
        })
    }

    #[test]
    fn the_group_cache_is_bounded_and_evicts_the_oldest_only() {
        let mut l = Lookups::<u32>::default();
        let t0 = std::time::Instant::now();
        // An engine looked up first, then many peers within its TTL.
        l.put((5, 60), groups(), t0);
        let t1 = t0 + Duration::from_millis(1);
        for uid in 0..(GROUPS_CACHED as u32 - 1) {
            l.put((100_000 + uid, uid), groups(), t1);
        }
        assert_eq!(l.cached.len(), GROUPS_CACHED);
        // One more: the oldest goes (the first), not all of them.
        let t2 = t1 + Duration::from_millis(1);
        l.put((7, 7), groups(), t2);
        assert_eq!(l.cached.len(), GROUPS_CACHED);
        assert!(!l.cached.contains_key(&(5, 60)));
        assert!(matches!(l.begin((100_000, 0), 1, t2), Begin::Cached(..)));
        assert!(matches!(l.begin((7, 7), 1, t2), Begin::Cached(..)));
        // Past the TTL the expired go first.
        let t3 = t2 + GROUPS_TTL;
        l.put((8, 8), groups(), t3);
        assert!(l.cached.len() <= 2, "{}", l.cached.len());
    }

    #[test]
    fn one_lookup_per_peer_and_a_share_per_uid() {
        let mut l = Lookups::<u32>::default();
        let t = std::time::Instant::now();
        // Connections of one (uid, gid) wait for one lookup.
        assert!(matches!(l.begin((40100, 1), 0, t), Begin::Started));
        for i in 1..MAX_WAITING_PER_LOOKUP as u32 {
            assert!(matches!(l.begin((40100, 1), i, t), Begin::Joined));
        }
        assert!(matches!(l.begin((40100, 1), 99, t), Begin::Full(99)));
        // One uid (say, with many gids) has MAX_PEER_CHECKS_PER_UID in flight.
        for gid in 2..=MAX_PEER_CHECKS_PER_UID as u32 {
            assert!(matches!(l.begin((40100, gid), 0, t), Begin::Started));
        }
        assert!(matches!(l.begin((40100, 1000), 0, t), Begin::Full(0)));
        // Many uids (subuids) fill the slots left; then even an engine waits
        // for one: it is refused with -32015 and retries.
        let mut uid = 50_000;
        while l.pending.len() < MAX_PEER_CHECKS {
            assert!(matches!(l.begin((uid, uid), 0, t), Begin::Started));
            uid += 1;
        }
        assert!(matches!(l.begin((5, 60), 0, t), Begin::Full(0)));
        // A lookup ends: its waiters come back, and its result is cached.
        let w = l.finish((40100, 1), Some(groups()), t);
        assert_eq!(w.len(), MAX_WAITING_PER_LOOKUP);
        assert!(matches!(l.begin((40100, 1), 0, t), Begin::Cached(..)));
        assert!(matches!(l.begin((5, 60), 0, t), Begin::Started));
        // A failed lookup caches nothing.
        assert_eq!(l.finish((5, 60), None, t), vec![0]);
        assert!(matches!(l.begin((5, 60), 1, t), Begin::Started));
        assert_eq!(l.by_uid[&40100], MAX_PEER_CHECKS_PER_UID - 1);
    }
}
