//! The Unix-socket front end: connections, framing, the SO_PEERCRED check, and
//! dispatch of protocol methods to `Daemon`. Each connection is also the
//! `EngineLink` of the scripts it starts.

use crate::daemon::{Access, Daemon, Peer};
use crate::engine::{BoxFuture, EngineLink, LinkError};
use crate::framing::{read_line_limited, Line, LineLimits, FREE_LINE_BYTES};
use crate::protocol::{self, code, Incoming, RpcError, ScriptRef, StartParams, ToolResult};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{mpsc, oneshot};

static NEXT_CONN: AtomicU64 = AtomicU64::new(1);

type Pending = Mutex<HashMap<u64, oneshot::Sender<Result<Value, RpcError>>>>;

/// Requests of one engine being answered, counting answers not yet written to
/// its socket: an engine that floods requests and never reads its answers stops
/// being read itself once this many are outstanding.
const MAX_OUTSTANDING: usize = 1024;

/// A line for the engine, with the permit of the request it answers (if any),
/// released once the line is written.
type Outgoing = (String, Option<tokio::sync::OwnedSemaphorePermit>);

pub struct Conn {
    id: u64,
    tx: mpsc::UnboundedSender<Outgoing>,
    outstanding: Arc<tokio::sync::Semaphore>,
    pending: Pending,
    next_id: AtomicU64,
    closed: AtomicBool,
}

impl Conn {
    fn send(&self, line: String) {
        let _ = self.tx.send((line, None));
    }

    /// Send the answer to one of the engine's requests; `permit` is released
    /// once it is written.
    fn answer(&self, line: String, permit: tokio::sync::OwnedSemaphorePermit) {
        let _ = self.tx.send((line, Some(permit)));
    }

    async fn request(
        &self,
        method: &str,
        params: Value,
        timeout: Option<Duration>,
    ) -> Result<Value, LinkError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        {
            let mut p = self.pending.lock().unwrap();
            if self.closed.load(Ordering::SeqCst) {
                return Err(LinkError::Disconnected);
            }
            p.insert(id, tx);
        }
        self.send(protocol::request_line(id, method, &params));
        let answer = match timeout {
            Some(t) => match tokio::time::timeout(t, rx).await {
                Ok(a) => a,
                Err(_) => {
                    self.pending.lock().unwrap().remove(&id);
                    return Err(LinkError::Timeout);
                }
            },
            None => rx.await,
        };
        match answer {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(LinkError::Answered(e.message)),
            Err(_) => Err(LinkError::Disconnected),
        }
    }
}

impl EngineLink for Conn {
    fn id(&self) -> u64 {
        self.id
    }
    fn tool_call(&self, params: Value) -> BoxFuture<'_, Result<ToolResult, LinkError>> {
        Box::pin(async move {
            let v = self.request("tool.call", params, None).await?;
            ToolResult::from_answer(&v)
                .map_err(|e| LinkError::Malformed(format!("tool.call answer: {e}")))
        })
    }
    fn approval(&self, params: Value, timeout: Duration) -> BoxFuture<'_, Result<bool, LinkError>> {
        Box::pin(async move {
            let v = self
                .request("approval.request", params, Some(timeout))
                .await?;
            match serde_json::from_value::<protocol::ApprovalAnswer>(v) {
                Ok(a) => Ok(a.decision == protocol::Decision::AllowOnce),
                Err(e) => Err(LinkError::Malformed(format!(
                    "approval.request answer: {e}; expected {{\"decision\": \"allow_once\" | \"deny\"}}"
                ))),
            }
        })
    }
    fn notify(&self, method: &str, params: Value) {
        self.send(protocol::notification_line(method, &params));
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
    let e = RpcError::with_data(
        code::BUSY,
        format!("scriptgated already serves server.max_connections = {max} connections; close one and retry"),
        json!({"reason": "too_many_connections"}),
    );
    let _ = stream.try_write(protocol::response_line(&Value::Null, &Err(e)).as_bytes());
}

async fn connection(daemon: Arc<Daemon>, stream: UnixStream, budget: Arc<tokio::sync::Semaphore>) {
    let cred = match stream.peer_cred() {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!("SO_PEERCRED failed: {e}");
            return;
        }
    };
    let (uid, gid) = (cred.uid(), cred.gid());
    let (read, mut write) = stream.into_split();
    let auth = &daemon.cfg.auth;
    if !crate::sys::peer_in_groups(uid, gid, &auth.allowed_groups) {
        tracing::warn!(
            peer_uid = uid,
            peer_pid = cred.pid(),
            "connection refused: uid {uid} is not root nor in auth.allowed_groups"
        );
        let e = RpcError::with_data(
            code::PEER_NOT_ALLOWED,
            format!(
                "uid {uid} may not use scriptgated: not root and not in auth.allowed_groups {:?}",
                auth.allowed_groups
            ),
            json!({"reason": "peer_not_allowed"}),
        );
        let _ = write
            .write_all(protocol::response_line(&Value::Null, &Err(e)).as_bytes())
            .await;
        return;
    }
    let peer = Peer {
        uid,
        gid,
        pid: cred.pid(),
        admin: crate::sys::peer_in_groups(uid, gid, &auth.admin_groups),
    };
    let (tx, mut rx) = mpsc::unbounded_channel::<Outgoing>();
    let conn = Arc::new(Conn {
        id: NEXT_CONN.fetch_add(1, Ordering::Relaxed),
        tx,
        outstanding: Arc::new(tokio::sync::Semaphore::new(MAX_OUTSTANDING)),
        pending: Mutex::new(HashMap::new()),
        next_id: AtomicU64::new(1),
        closed: AtomicBool::new(false),
    });
    let writer = tokio::spawn(async move {
        while let Some((line, permit)) = rx.recv().await {
            if write.write_all(line.as_bytes()).await.is_err() {
                break;
            }
            drop(permit);
        }
    });
    let sv = &daemon.cfg.server;
    let max = sv.max_message_bytes;
    let limits = LineLimits {
        max,
        budget: &budget,
        timeout: Duration::from_secs(sv.line_timeout_s),
    };
    let mut reader = BufReader::with_capacity(64 * 1024, read);
    let mut buf = Vec::new();
    loop {
        // A large line's buffer is not kept for the connection's lifetime.
        if buf.capacity() > FREE_LINE_BYTES {
            buf = Vec::new();
        }
        match read_line_limited(&mut reader, &mut buf, &limits).await {
            Ok(Line::Eof) | Err(_) => break,
            Ok(Line::TooLong) => {
                let e = RpcError::new(
                    code::INVALID_REQUEST,
                    format!(
                        "message longer than max_message_bytes = {max}; closing the connection"
                    ),
                );
                conn.send(protocol::response_line(&Value::Null, &Err(e)));
                break;
            }
            Ok(Line::TimedOut) => {
                let e = RpcError::new(
                    code::INVALID_REQUEST,
                    format!(
                        "a message was not completed within server.line_timeout_s = {} s; closing the connection",
                        sv.line_timeout_s
                    ),
                );
                conn.send(protocol::response_line(&Value::Null, &Err(e)));
                break;
            }
            Ok(Line::Data) if buf.iter().all(u8::is_ascii_whitespace) => {}
            Ok(Line::Data) => match protocol::parse_line(&buf) {
                Err((id, e)) => {
                    let Ok(permit) = conn.outstanding.clone().acquire_owned().await else {
                        break;
                    };
                    conn.answer(protocol::response_line(&id, &Err(e)), permit);
                }
                Ok(Incoming::Response { id, result }) => {
                    let slot = id
                        .as_u64()
                        .and_then(|i| conn.pending.lock().unwrap().remove(&i));
                    if let Some(s) = slot {
                        let _ = s.send(result);
                    }
                }
                Ok(Incoming::Notification { .. }) => {}
                Ok(Incoming::Request { id, method, params }) => {
                    let Ok(permit) = conn.outstanding.clone().acquire_owned().await else {
                        break;
                    };
                    let (d, c) = (daemon.clone(), conn.clone());
                    tokio::spawn(async move {
                        let r = dispatch(&d, peer, &c, &method, params).await;
                        c.answer(protocol::response_line(&id, &r), permit);
                    });
                }
            },
        }
    }
    {
        let mut p = conn.pending.lock().unwrap();
        conn.closed.store(true, Ordering::SeqCst);
        p.clear();
    }
    daemon.disconnected(conn.id);
    drop(conn);
    // Let queued answers (the -32600 above) reach the peer before closing.
    let _ = tokio::time::timeout(Duration::from_secs(2), writer).await;
}

/// Params of `run.revoke` and `run.describe`: `{"token": "eyJ…"}`.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenParam {
    token: String,
}

fn params<T: serde::de::DeserializeOwned>(v: Value) -> Result<T, RpcError> {
    let v = if v.is_null() { json!({}) } else { v };
    serde_json::from_value(v).map_err(|e| RpcError::invalid_params(format!("invalid params: {e}")))
}

fn require_admin(peer: &Peer) -> Result<(), RpcError> {
    if peer.admin {
        Ok(())
    } else {
        Err(RpcError::with_data(
            code::NOT_ADMIN,
            "this method is for root and members of auth.admin_groups",
            json!({"reason": "not_admin"}),
        ))
    }
}

async fn dispatch(
    d: &Arc<Daemon>,
    peer: Peer,
    conn: &Arc<Conn>,
    method: &str,
    p: Value,
) -> Result<Value, RpcError> {
    match method {
        "script.start" => {
            let sp: StartParams = params(p)?;
            let link: Arc<dyn EngineLink> = conn.clone();
            d.start(peer, link, sp).await
        }
        "script.wait" => d.wait(Access::Conn(conn.id), params(p)?).await,
        "script.status" => d.status(Access::Conn(conn.id), params(p)?),
        "script.cancel" => {
            d.cancel(Access::Conn(conn.id), params(p)?, "cancelled by the engine")
                .await
        }
        "run.revoke" => d.revoke(&params::<TokenParam>(p)?.token).await,
        "run.describe" => d.describe(&params::<TokenParam>(p)?.token),
        "daemon.info" => Ok(d.info()),
        "admin.list" => {
            require_admin(&peer)?;
            Ok(json!({"scripts": d.list_running()}))
        }
        "admin.cancel" => {
            require_admin(&peer)?;
            let r: ScriptRef = params(p)?;
            d.cancel(
                Access::Admin,
                r,
                &format!("cancelled by an administrator (uid {})", peer.uid),
            )
            .await
        }
        _ => Err(RpcError::new(
            code::METHOD_NOT_FOUND,
            format!("unknown method {method:?}"),
        )),
    }
}
