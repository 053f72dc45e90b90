//! The Unix-socket front end: connections, framing, the SO_PEERCRED check, and
//! dispatch of protocol methods to `Daemon`. Each connection is also the
//! `EngineLink` of the scripts it starts.

use crate::auth::Role;
use crate::daemon::{Access, Daemon, Peer};
use crate::engine::{BoxFuture, EngineLink, LinkError};
use crate::protocol::{
    self, code, ApprovalAnswer, ApprovalRequest, DaemonRequest, Decision, EngineRequest, Method,
    Notification, RpcError, ToolCall, ToolResult,
};
use crate::rpc::{self, Bounds, CallError, Strict};
use serde_json::Value;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
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
    peer: rpc::Peer,
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
    fn tool_call(&self, params: ToolCall) -> BoxFuture<'_, Result<ToolResult, LinkError>> {
        Box::pin(async move {
            let v = self
                .peer
                .request(DaemonRequest::TOOL_CALL, &params, None)
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
                .peer
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
            Notification::ScriptProgress(s) => self.peer.notify(n.method(), s),
            Notification::ScriptFinished(r) => self.peer.notify(n.method(), r),
        }
    }
}

/// Serve until the listener fails or, when `idle_exit` is set, until there has been
/// no connection and no running script for that long.
pub async fn serve(
    daemon: Arc<Daemon>,
    listener: UnixListener,
    idle_exit: Option<Duration>,
) -> std::io::Result<()> {
    let conns = Arc::new(AtomicUsize::new(0));
    let activity = Arc::new(tokio::sync::Notify::new());
    let budget = Arc::new(tokio::sync::Semaphore::new(
        daemon.cfg.server.max_buffered_bytes,
    ));
    let mut backoff = ACCEPT_BACKOFF_MIN;
    loop {
        let idle = async {
            match idle_exit {
                Some(d) => loop {
                    if conns.load(Ordering::SeqCst) == 0 && daemon.running_count() == 0 {
                        tokio::select! {
                            _ = tokio::time::sleep(d) => {
                                if conns.load(Ordering::SeqCst) == 0 && daemon.running_count() == 0 { return; }
                            }
                            _ = activity.notified() => {}
                            _ = daemon.changed() => {}
                        }
                    } else {
                        tokio::select! {
                            _ = activity.notified() => {}
                            _ = daemon.changed() => {}
                        }
                    }
                },
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            acc = listener.accept() => {
                let stream = match acc {
                    Ok((stream, _)) => {
                        backoff = ACCEPT_BACKOFF_MIN;
                        stream
                    }
                    // Out of descriptors or buffers, or a peer that left before
                    // we took it: the daemon and its running scripts go on.
                    Err(e) if accept_error_is_transient(&e) => {
                        tracing::warn!("accept failed: {e}; retrying in {backoff:?}");
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(ACCEPT_BACKOFF_MAX);
                        continue;
                    }
                    Err(e) => return Err(e),
                };
                let max = daemon.cfg.server.max_connections;
                if conns.load(Ordering::SeqCst) >= max {
                    refuse_connection(&stream, max);
                    continue;
                }
                conns.fetch_add(1, Ordering::SeqCst);
                let (d, c, a, b) = (daemon.clone(), conns.clone(), activity.clone(), budget.clone());
                tokio::spawn(async move {
                    connection(d, stream, b).await;
                    c.fetch_sub(1, Ordering::SeqCst);
                    a.notify_waiters();
                });
            }
            _ = idle => {
                tracing::info!("idle for {:?} with no connection and no script; exiting", idle_exit.unwrap_or_default());
                return Ok(());
            }
        }
    }
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

/// One connection over `server.max_connections`: a clear error, then closed. The
/// new socket's send buffer is empty, so the line goes out without waiting.
fn refuse_connection(stream: &UnixStream, max: usize) {
    tracing::warn!("connection refused: server.max_connections = {max} connections are open");
    let e = RpcError::too_many_connections(max);
    let _ = stream.try_write(protocol::response_line(&Value::Null, &Err(e)).as_bytes());
}

/// One engine connection: the peer check, then JSON-RPC both ways until it
/// closes; then its scripts are told (they are cancelled).
async fn connection(daemon: Arc<Daemon>, stream: UnixStream, budget: Arc<tokio::sync::Semaphore>) {
    let cred = match stream.peer_cred() {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!("SO_PEERCRED failed: {e}");
            return;
        }
    };
    let (uid, gid) = (cred.uid(), cred.gid());
    let auth = &daemon.cfg.auth;
    // The gate (the socket is 0666: this is the only one). Nothing is read from
    // a refused peer: one error line with a non-blocking write, then closed.
    let role = crate::auth::role(
        uid == 0,
        crate::sys::peer_in_groups(uid, gid, &auth.allowed_groups),
        crate::sys::peer_in_groups(uid, gid, &auth.admin_groups),
    );
    let admin = match role {
        Role::Refused => {
            refused_log(uid, cred.pid());
            let e = RpcError::peer_not_allowed(uid, &auth.allowed_groups);
            let _ = stream.try_write(protocol::response_line(&Value::Null, &Err(e)).as_bytes());
            return;
        }
        Role::AdminOnly => true,
        Role::Engine { admin } => admin,
    };
    let engine = match role {
        Role::Engine { .. } if uid != 0 => {
            match daemon
                .engines
                .for_peer(uid, &crate::sys::peer_gids(uid, gid))
            {
                Ok(e) => e,
                Err(message) => {
                    tracing::warn!(
                        peer_uid = uid,
                        peer_pid = cred.pid(),
                        "connection refused: {message}"
                    );
                    let e =
                        RpcError::with_reason(code::PEER_NOT_ALLOWED, message, "engine_ambiguous");
                    let _ =
                        stream.try_write(protocol::response_line(&Value::Null, &Err(e)).as_bytes());
                    return;
                }
            }
        }
        _ => None,
    };
    if matches!(role, Role::Engine { .. }) && uid != 0 {
        engine_dirs(&daemon, uid, gid, engine);
    }
    let (read, write) = stream.into_split();
    let peer = Peer {
        uid,
        gid,
        pid: cred.pid(),
        admin,
        engine,
    };
    let (rpc_peer, writer) = rpc::Peer::new(write);
    let conn = Arc::new(Conn {
        id: NEXT_CONN.fetch_add(1, Ordering::Relaxed),
        peer: rpc_peer,
    });
    let sv = &daemon.cfg.server;
    let bounds = Bounds {
        max_line: sv.max_message_bytes,
        shared: Some((budget, Duration::from_secs(sv.line_timeout_s))),
        max_outstanding: MAX_OUTSTANDING,
        strict: Some(Strict {
            too_long: format!(
                "message longer than max_message_bytes = {}; closing the connection",
                sv.max_message_bytes
            ),
            timed_out: format!(
                "a message was not completed within server.line_timeout_s = {} s; closing the connection",
                sv.line_timeout_s
            ),
        }),
    };
    let handler = Arc::new(Engine {
        daemon: daemon.clone(),
        peer,
        admin_only: role == Role::AdminOnly,
        conn: conn.clone(),
    });
    conn.peer.serve(read, &bounds, handler).await;
    daemon.disconnected(conn.id);
    drop(conn);
    // Let queued answers (a -32600 for a line over the bounds) reach the peer before closing.
    let _ = tokio::time::timeout(Duration::from_secs(2), writer).await;
}

/// The daemon side of one engine connection: serves the engine's requests.
struct Engine {
    daemon: Arc<Daemon>,
    peer: Peer,
    /// In `auth.admin_groups` only: `daemon.info` and `admin.*`, nothing else.
    admin_only: bool,
    conn: Arc<Conn>,
}

impl rpc::Handler for Engine {
    fn request(
        self: Arc<Self>,
        method: String,
        params: Value,
    ) -> BoxFuture<'static, Result<Value, RpcError>> {
        Box::pin(async move { self.dispatch(&method, params).await })
    }
}

impl Engine {
    /// The method is looked up first (-32601), then the admin check for admin
    /// methods, and only then are the params parsed (-32602).
    async fn dispatch(&self, method: &str, params: Value) -> Result<Value, RpcError> {
        let method = Method::from_name(method)?;
        if method.admin_only() && !self.peer.admin {
            return Err(RpcError::not_admin());
        }
        if self.admin_only && !method.admin_only() && method != Method::DaemonInfo {
            return Err(RpcError::admin_only_peer(
                self.peer.uid,
                &self.daemon.cfg.auth.allowed_groups,
            ));
        }
        let engine = self.peer.engine;
        let (d, conn, who) = (
            &self.daemon,
            &self.conn,
            Access::Conn(self.conn.id, engine, self.peer.uid),
        );
        match EngineRequest::parse(method, params)? {
            EngineRequest::ScriptStart(sp) => {
                let link: Arc<dyn EngineLink> = conn.clone();
                to_value(d.start(self.peer, link, sp).await?)
            }
            EngineRequest::ScriptWait(r) => to_value(d.wait(who, r).await?),
            EngineRequest::ScriptStatus(r) => to_value(d.status(who, r)?),
            EngineRequest::ScriptCancel(r) => {
                to_value(d.cancel(who, r, "cancelled by the engine").await?)
            }
            EngineRequest::RunRevoke(t) => to_value(d.revoke(self.peer, &t.token).await?),
            EngineRequest::RunDescribe(t) => to_value(d.describe(engine, &t.token)?),
            EngineRequest::DaemonInfo => to_value(d.info()),
            EngineRequest::AdminList => to_value(protocol::AdminList {
                scripts: d.list_running(),
            }),
            EngineRequest::AdminCancel(r) => {
                let why = format!("cancelled by an administrator (uid {})", self.peer.uid);
                to_value(d.cancel(Access::Admin, r, &why).await?)
            }
        }
    }
}

/// Refused peers logged one by one per minute; past that they are counted and
/// the count is logged with the next refusal of a later minute, so that a local
/// user who loops on connect cannot flood the journal.
const REFUSED_LOGGED_PER_MIN: u64 = 20;

/// (minute, refusals in it).
static REFUSED: std::sync::Mutex<(u64, u64)> = std::sync::Mutex::new((0, 0));

fn refused_log(uid: u32, pid: Option<i32>) {
    let minute = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() / 60)
        .unwrap_or(0);
    let mut r = REFUSED.lock().unwrap_or_else(|p| p.into_inner());
    if r.0 != minute {
        if r.1 > REFUSED_LOGGED_PER_MIN {
            tracing::warn!(
                "{} more connections from peers not in auth.allowed_groups nor auth.admin_groups were refused in a minute (logged: the first {REFUSED_LOGGED_PER_MIN})",
                r.1 - REFUSED_LOGGED_PER_MIN
            );
        }
        *r = (minute, 0);
    }
    r.1 += 1;
    if r.1 <= REFUSED_LOGGED_PER_MIN {
        tracing::warn!(
            peer_uid = uid,
            peer_pid = pid,
            "connection refused: uid {uid} is not root nor in auth.allowed_groups or auth.admin_groups"
        );
    }
}

/// The per-uid directories `<root>/<uid>` of a non-root engine that uses
/// `workspace.roots` (no entry, or an entry without `workspace_roots`), created on
/// its first connection so that it can make workspaces in them before it starts
/// anything. A daemon that is not root can only make its own uid's.
fn engine_dirs(daemon: &Daemon, uid: u32, gid: u32, engine: Option<usize>) {
    let explicit = engine
        .and_then(|i| daemon.engines.list.get(i))
        .is_some_and(|e| !e.roots.is_empty());
    let me = nix::unistd::Uid::effective().as_raw();
    if explicit || (me != 0 && me != uid) {
        return;
    }
    for root in &daemon.cfg.workspace.roots {
        if !root.is_dir() {
            continue;
        }
        let owner = crate::sys::Identity { uid, gid };
        if let Err(e) = crate::sys::ensure_engine_dir(root, owner) {
            tracing::warn!(
                peer_uid = uid,
                "cannot give uid {uid} its workspace directory: {e}"
            );
        }
    }
}

fn to_value<T: serde::Serialize>(v: T) -> Result<Value, RpcError> {
    serde_json::to_value(v).map_err(|e| RpcError::internal(e.to_string()))
}
