//! The Unix-socket front end: connections, framing, the SO_PEERCRED check, and
//! dispatch of protocol methods to `Daemon`. Each connection is also the
//! `EngineLink` of the scripts it starts.

use crate::daemon::{Access, Daemon, Peer};
use crate::engine::{BoxFuture, EngineLink, LinkError};
use crate::framing::{read_line, Line};
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

pub struct Conn {
    id: u64,
    tx: mpsc::UnboundedSender<String>,
    pending: Pending,
    next_id: AtomicU64,
    closed: AtomicBool,
}

impl Conn {
    fn send(&self, line: String) {
        let _ = self.tx.send(line);
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
            serde_json::from_value(v)
                .map_err(|e| LinkError::Malformed(format!("tool.call result: {e}")))
        })
    }
    fn approval(&self, params: Value, timeout: Duration) -> BoxFuture<'_, Result<bool, LinkError>> {
        Box::pin(async move {
            let v = self
                .request("approval.request", params, Some(timeout))
                .await?;
            match v.get("decision").and_then(Value::as_str) {
                Some("allow_once") => Ok(true),
                Some("deny") => Ok(false),
                _ => Err(LinkError::Malformed(
                    "approval.request answer needs decision allow_once|deny".into(),
                )),
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
                let (stream, _) = acc?;
                conns.fetch_add(1, Ordering::SeqCst);
                let (d, c, a) = (daemon.clone(), conns.clone(), activity.clone());
                tokio::spawn(async move {
                    connection(d, stream).await;
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

async fn connection(daemon: Arc<Daemon>, stream: UnixStream) {
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
    let (tx, mut rx) = mpsc::unbounded_channel::<String>();
    let conn = Arc::new(Conn {
        id: NEXT_CONN.fetch_add(1, Ordering::Relaxed),
        tx,
        pending: Mutex::new(HashMap::new()),
        next_id: AtomicU64::new(1),
        closed: AtomicBool::new(false),
    });
    let writer = tokio::spawn(async move {
        while let Some(line) = rx.recv().await {
            if write.write_all(line.as_bytes()).await.is_err() {
                break;
            }
        }
    });
    let max = daemon.cfg.server.max_message_bytes;
    let mut reader = BufReader::with_capacity(64 * 1024, read);
    let mut buf = Vec::new();
    loop {
        match read_line(&mut reader, &mut buf, max).await {
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
            Ok(Line::Data) if buf.iter().all(u8::is_ascii_whitespace) => {}
            Ok(Line::Data) => match protocol::parse_line(&buf) {
                Err((id, e)) => conn.send(protocol::response_line(&id, &Err(e))),
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
                    let (d, c) = (daemon.clone(), conn.clone());
                    tokio::spawn(async move {
                        let r = dispatch(&d, peer, &c, &method, params).await;
                        c.send(protocol::response_line(&id, &r));
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
