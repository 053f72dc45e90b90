//! `scriptgate mcp --http`: MCP's Streamable HTTP on loopback (rmcp's service
//! under hyper), for the user who started it:
//! - every request carries the bearer token kept in the user's state directory
//!   (`Authorization: Bearer …`, compared in constant time); one without it gets
//!   401 before its body is read;
//! - each request is given its `Origin`: the principal the token names, and a
//!   token cancelled when its TCP connection closes (the handler cancels, or
//!   makes a task of, the script of a client that went away);
//! - what one client can hold is bounded: connections (other local users'
//!   apart from this user's: `peer`), the time a request may take to arrive,
//!   its size and its cost once parsed, the bytes of all requests in flight,
//!   and the MCP sessions of each principal;
//! - a `subscriptions/listen` request's `taskIds` reach the handler
//!   (`ListenTaskIds`) and its acknowledgement, which lists those accepted.

use super::line::Line;
use super::scripts::Principal;
use super::server::{CodeMode, ListenTaskIds, Origin};
use super::stdio::{listen_refusal, listen_task_ids, with_task_ids};
use super::tasks::Tasks;
use crate::cli::exit::Failure;
use crate::protocol::framing::parse_cost;
use hyper::body::{Body, Bytes, Frame, Incoming, SizeHint};
use hyper::{Method, Request, Response, StatusCode};
use rmcp::transport::common::server_side_http::{ServerSseMessage, SessionId};
use rmcp::transport::streamable_http_server::session::local::{
    LocalSessionManager, LocalSessionManagerError,
};
use rmcp::transport::streamable_http_server::{
    SessionManager, StreamableHttpServerConfig, StreamableHttpService,
};
use serde_json::Value;
use sha2::{Digest as _, Sha256};
use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::path::Path;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// A request's headers must have come within this time (an idle keep-alive
/// connection waits for its next request's headers as long, then is closed).
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// Then its body must have come whole, and its share of `MAX_IN_FLIGHT` been
/// given, within this time: a request arrives within 30 s in all.
const BODY_TIMEOUT: Duration = Duration::from_secs(20);
/// Connections of this user (or root) served at once; more wait in the listen
/// backlog. HTTP/1.1 carries one request at a time on a connection.
const MAX_OWN_CONNECTIONS: usize = 64;
/// Connections of other local users (or of a user that cannot be told) at once:
/// one more closes the oldest of them. They cannot take this user's.
const MAX_OTHER_CONNECTIONS: usize = 8;
/// The largest request body (rmcp's own bound): one connection's bytes in flight.
const MAX_BODY: usize = 4 << 20;
/// The most a body may cost once parsed (`parse_cost`), as the daemon's socket
/// allows a 4 MiB line (`rpc::max_parse_cost`).
const MAX_COST: usize = 16 << 20;
/// What the requests in flight hold at once, until their answer ends: each its
/// body twice (ours, and rmcp's copy as it parses) and its cost once parsed,
/// past `FREE_COST`. A request waits for its share within `BODY_TIMEOUT`, else
/// gets 503.
const MAX_IN_FLIGHT: usize = 96 << 20;
/// What a request may hold without a share of `MAX_IN_FLIGHT` (every small
/// request), and what a connection may buffer (hyper's read buffer).
const FREE_COST: usize = 64 << 10;
/// The most one request holds.
const MAX_HOLD: usize = MAX_COST + 2 * MAX_BODY;
/// MCP sessions (clients of the handshake era) per principal: each holds a
/// server task and its channels until the client ends it (DELETE) or 5 minutes
/// pass without a request.
const MAX_SESSIONS: usize = 32;
/// The longest SSE event held while looking for a listen's acknowledgement.
const MAX_ACK_EVENT: usize = 64 << 10;
/// The token's random bytes (written as hex).
const TOKEN_BYTES: usize = 32;

tokio::task_local! {
    /// The principal of the request `create_session` is called for (rmcp calls
    /// it inside the request's own future).
    static WHO: Principal;
}

/// MCP's Streamable HTTP at `http://ADDR/mcp`, on loopback only, for the bearer
/// of the token in `token_file` (made if missing). The `Host` header must name
/// a loopback host and a browser's `Origin` must be this server's own (DNS
/// rebinding, which the MCP spec asks servers to stop).
pub(super) async fn serve_http(
    server: CodeMode,
    addr: std::net::SocketAddr,
    token_file: &Path,
) -> Result<(), Failure> {
    if !addr.ip().is_loopback() {
        return Err(Failure::usage(format!(
            "--http {addr}: loopback addresses only (127.0.0.1:PORT or [::1]:PORT)"
        )));
    }
    let token = load_token(token_file)?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| Failure::setup(format!("--http {addr}: {e}")))?;
    let bound = listener
        .local_addr()
        .map_err(|e| Failure::setup(format!("--http {addr}: {e}")))?;
    let port = bound.port();
    let config = StreamableHttpServerConfig::default()
        .with_allowed_origins([
            format!("http://localhost:{port}"),
            format!("http://127.0.0.1:{port}"),
            format!("http://[::1]:{port}"),
        ])
        .enforce_origin_validation()
        .with_max_request_body_bytes(MAX_BODY);
    let sessions = Arc::new(Capped::default());
    let tasks = server.tasks.clone();
    let rmcp = StreamableHttpService::new(move || Ok(server.clone()), sessions.clone(), config);
    let gate = Arc::new(Gate {
        rmcp,
        key: Sha256::digest(&token).into(),
        who: principal_of(&token),
        in_flight: Arc::new(Semaphore::new(MAX_IN_FLIGHT)),
        sessions,
        tasks,
    });
    tell_how_to_connect(bound, token, token_file);
    let own = Arc::new(Semaphore::new(MAX_OWN_CONNECTIONS));
    let others = Arc::new(Others::default());
    let me = nix::unistd::geteuid().as_raw();
    let mut told = false;
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                eprintln!("scriptgate mcp: accept: {e}");
                // EMFILE and the like: give the connections that end a moment.
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let uid = super::peer::uid_of_peer(bound, peer);
        if let Err(e) = &uid {
            if !told {
                told = true;
                eprintln!("scriptgate mcp: cannot tell which user a connection comes from ({e}); such connections share the {MAX_OTHER_CONNECTIONS} slots of other users'");
            }
        }
        // This user's connection holds one of MAX_OWN_CONNECTIONS (past them,
        // it waits, and the next ones in the listen backlog); another user's, a
        // place among theirs.
        let (slot, other) = match uid {
            Ok(u) if u == me || u == 0 => {
                let Ok(p) = own.clone().acquire_owned().await else {
                    return Ok(());
                };
                (Some(p), None)
            }
            _ => (None, Some(others.join())),
        };
        tokio::spawn(serve_connection(
            gate.clone(),
            others.clone(),
            stream,
            slot,
            other,
        ));
    }
}

/// Where clients reach the server, and with which header: on stderr.
fn tell_how_to_connect(bound: std::net::SocketAddr, token: Vec<u8>, token_file: &Path) {
    let url = format!("http://{bound}/mcp");
    let token = String::from_utf8_lossy(&token).into_owned();
    eprintln!("scriptgate mcp: Streamable HTTP at {url}");
    eprintln!(
        "scriptgate mcp: every request needs the header \"Authorization: Bearer {token}\" (the token is in {}, kept across restarts); for a client's mcpServers:",
        crate::text::escape(&token_file.display().to_string())
    );
    eprintln!(
        "  {}",
        serde_json::json!({"scriptgate": {"type": "http", "url": url, "headers": {"Authorization": format!("Bearer {token}")}}})
    );
    drop(token);
}

/// One accepted connection, HTTP/1.1 until it ends (or, another user's, until
/// it is evicted), holding its `slot` or its place among other users'.
async fn serve_connection(
    gate: Arc<Gate>,
    others: Arc<Others>,
    stream: tokio::net::TcpStream,
    slot: Option<tokio::sync::OwnedSemaphorePermit>,
    other: Option<(u64, CancellationToken)>,
) {
    // Cancelled when this connection ends, however it ends.
    let gone = CancellationToken::new();
    let _closed = gone.clone().drop_guard();
    let line = Line::of(&stream).map(Arc::new);
    let svc = {
        let (gone, line) = (gone.clone(), line.clone());
        hyper::service::service_fn(move |req| {
            let (gate, gone, line) = (gate.clone(), gone.clone(), line.clone());
            async move { Ok::<_, Infallible>(gate.respond(req, gone, line).await) }
        })
    };
    // Every path is the MCP endpoint; /mcp is the one documented.
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT)
        .max_buf_size(FREE_COST)
        .serve_connection(hyper_util::rt::TokioIo::new(stream), svc);
    match other {
        None => {
            let _ = conn.await;
        }
        Some((id, evicted)) => {
            tokio::select! {
                _ = conn => {}
                () = evicted.cancelled() => {}
            }
            others.remove(id);
        }
    }
    if let Some(l) = line {
        l.end();
    }
    drop(slot);
}

/// The token in `path` (made if missing): at least 32 characters, visible ASCII.
fn load_token(path: &Path) -> Result<Vec<u8>, Failure> {
    let raw = super::secret::load_or_make(path, TOKEN_BYTES, |b| hex(b).into_bytes())?;
    let token = raw.trim_ascii().to_vec();
    if token.len() < TOKEN_BYTES || !token.iter().all(|b| b.is_ascii_graphic()) {
        return Err(Failure::setup(format!(
            "{}: the token must be at least {TOKEN_BYTES} visible ASCII characters (remove the file to make a new one)",
            crate::text::escape(&path.display().to_string())
        )));
    }
    Ok(token)
}

/// The principal a token names: a digest of it, never the token.
fn principal_of(token: &[u8]) -> Principal {
    let d = Sha256::digest([b"scriptgate mcp --http principal\0".as_slice(), token].concat());
    Principal::new(format!("http:{}", &hex(&d)[..16]))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Other users' connections, oldest first: each one's id, and the token that
/// closes it when a newer one needs its place.
#[derive(Default)]
struct Others {
    open: Mutex<VecDeque<(u64, CancellationToken)>>,
    next: std::sync::atomic::AtomicU64,
}

impl Others {
    /// A place for one more: past `MAX_OTHER_CONNECTIONS`, the oldest is closed.
    fn join(&self) -> (u64, CancellationToken) {
        let id = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let token = CancellationToken::new();
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        while open.len() >= MAX_OTHER_CONNECTIONS {
            if let Some((_, oldest)) = open.pop_front() {
                oldest.cancel();
            }
        }
        open.push_back((id, token.clone()));
        (id, token)
    }

    fn remove(&self, id: u64) {
        self.open
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|(i, _)| *i != id);
    }
}

/// What every request goes through before rmcp's service.
struct Gate {
    rmcp: StreamableHttpService<CodeMode, Capped>,
    /// SHA-256 of the token: compared with the presented one's.
    key: [u8; 32],
    /// The principal the token names.
    who: Principal,
    /// `MAX_IN_FLIGHT`.
    in_flight: Arc<Semaphore>,
    sessions: Arc<Capped>,
    tasks: Arc<Tasks>,
}

impl Gate {
    async fn respond(
        &self,
        req: Request<Incoming>,
        gone: CancellationToken,
        line: Option<Arc<Line>>,
    ) -> Response<Reply> {
        let deadline = Instant::now() + BODY_TIMEOUT;
        if !self.authorized(req.headers()) {
            let mut r = text(
                StatusCode::UNAUTHORIZED,
                "Unauthorized: this server needs its bearer token (Authorization: Bearer TOKEN; see scriptgate(1), --http)",
            );
            r.headers_mut().insert(
                hyper::header::WWW_AUTHENTICATE,
                hyper::header::HeaderValue::from_static("Bearer realm=\"scriptgate mcp\""),
            );
            return r;
        }
        // A session is its principal's only.
        let session = req
            .headers()
            .get("mcp-session-id")
            .and_then(|v| v.to_str().ok());
        if session.is_some_and(|id| self.sessions.owner(id).is_some_and(|p| p != self.who)) {
            return text(StatusCode::NOT_FOUND, "Not Found: Session not found");
        }
        let (mut parts, body) = req.into_parts();
        let (bytes, share) = if parts.method == Method::POST {
            match self.read_body(body, deadline).await {
                Ok(b) => b,
                Err(r) => return r,
            }
        } else {
            (Bytes::new(), None)
        };
        let mut ack = None;
        if is_listen(&bytes) {
            let v = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
            let ids = listen_task_ids(&v);
            if let Some(e) = listen_refusal(&v, &ids) {
                return json(StatusCode::BAD_REQUEST, &e);
            }
            if !ids.is_empty() {
                let accepted: Vec<String> = ids
                    .iter()
                    .filter(|id| self.tasks.opens(id, &self.who))
                    .cloned()
                    .collect();
                ack = Some(accepted);
            }
            parts.extensions.insert(ListenTaskIds(ids));
        }
        parts.extensions.insert(Origin {
            who: self.who.clone(),
            gone,
            line,
        });
        let req = Request::from_parts(parts, Once(Some(bytes)));
        let r = WHO.scope(self.who.clone(), self.rmcp.handle(req)).await;
        r.map(|b| Reply::new(Box::pin(b), share, ack))
    }

    /// Whether the request carries exactly one `Authorization: Bearer` with the
    /// token (its digest compared in constant time).
    fn authorized(&self, headers: &hyper::HeaderMap) -> bool {
        let mut values = headers.get_all(hyper::header::AUTHORIZATION).iter();
        let (Some(v), None) = (values.next(), values.next()) else {
            return false;
        };
        let v = v.as_bytes();
        let Some(sp) = v.iter().position(|&b| b == b' ') else {
            return false;
        };
        if !v[..sp].eq_ignore_ascii_case(b"bearer") {
            return false;
        }
        let given: [u8; 32] = Sha256::digest(v[sp..].trim_ascii()).into();
        let diff = given
            .iter()
            .zip(self.key.iter())
            .fold(0u8, |d, (a, b)| d | (a ^ b));
        std::hint::black_box(diff) == 0
    }

    /// The body, whole within the deadline, with its share of `MAX_IN_FLIGHT`
    /// (`hold`, past `FREE_COST`), or the answer that refuses it. A share is
    /// asked for once, never added to while held (requests holding part of what
    /// they need and waiting for the rest would stop each other): a body past
    /// `FREE_COST` bytes first holds the most a request may, and gives back what
    /// it does not need once read.
    async fn read_body(
        &self,
        mut body: Incoming,
        deadline: Instant,
    ) -> Result<(Bytes, Option<OwnedSemaphorePermit>), Response<Reply>> {
        let too_large = || {
            text(
                StatusCode::PAYLOAD_TOO_LARGE,
                &format!("Payload Too Large: a request body is at most {MAX_BODY} bytes"),
            )
        };
        let mut share = None;
        let declared = body.size_hint().exact();
        if let Some(n) = declared {
            if n > MAX_BODY as u64 {
                return Err(too_large());
            }
            if n as usize > FREE_COST {
                share = Some(self.share(MAX_HOLD - FREE_COST, deadline).await?);
            }
        }
        let mut buf = Vec::with_capacity(declared.map_or(0, |n| n as usize));
        loop {
            let frame = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx));
            match tokio::time::timeout_at(deadline, frame).await {
                Err(_) => {
                    return Err(text(
                        StatusCode::REQUEST_TIMEOUT,
                        &format!(
                            "Request Timeout: the body must come within {} s of the headers",
                            BODY_TIMEOUT.as_secs()
                        ),
                    ))
                }
                Ok(None) => break,
                Ok(Some(Err(e))) => {
                    return Err(text(
                        StatusCode::BAD_REQUEST,
                        &format!("Bad Request: the body: {e}"),
                    ))
                }
                Ok(Some(Ok(f))) => {
                    let Ok(data) = f.into_data() else { continue };
                    let len = buf.len() + data.len();
                    if len > MAX_BODY {
                        return Err(too_large());
                    }
                    if len > FREE_COST && share.is_none() {
                        // A body of unknown length, past what is free.
                        share = Some(self.share(MAX_HOLD - FREE_COST, deadline).await?);
                    }
                    buf.extend_from_slice(&data);
                }
            }
        }
        let cost = parse_cost(&buf);
        if cost > MAX_COST {
            return Err(text(
                StatusCode::PAYLOAD_TOO_LARGE,
                &format!("Payload Too Large: this body would take about {cost} bytes once parsed; at most {MAX_COST}"),
            ));
        }
        let need = hold(buf.len(), cost).saturating_sub(FREE_COST);
        match &mut share {
            Some(held) => {
                let spare = held.num_permits() - need;
                drop(held.split(spare));
            }
            None if need > 0 => share = Some(self.share(need, deadline).await?),
            None => {}
        }
        Ok((Bytes::from(buf), share))
    }

    /// `n` of `MAX_IN_FLIGHT`, waiting until the deadline at most.
    async fn share(
        &self,
        n: usize,
        deadline: Instant,
    ) -> Result<OwnedSemaphorePermit, Response<Reply>> {
        let n = u32::try_from(n).unwrap_or(u32::MAX);
        let acquire = self.in_flight.clone().acquire_many_owned(n);
        match tokio::time::timeout_at(deadline, acquire).await {
            Ok(Ok(p)) => Ok(p),
            _ => {
                let mut r = text(
                    StatusCode::SERVICE_UNAVAILABLE,
                    &format!("Service Unavailable: large requests in flight hold the {MAX_IN_FLIGHT} bytes they may; try again"),
                );
                r.headers_mut().insert(
                    hyper::header::RETRY_AFTER,
                    hyper::header::HeaderValue::from_static("1"),
                );
                Err(r)
            }
        }
    }
}

/// What a request of `len` bytes that costs `cost` once parsed holds: its body,
/// rmcp's copy of it (collected before parsing), and what it parses to.
fn hold(len: usize, cost: usize) -> usize {
    2 * len + cost
}

/// Whether a body is a `subscriptions/listen` request (read without building
/// anything but its method).
fn is_listen(body: &[u8]) -> bool {
    #[derive(serde::Deserialize)]
    struct Peek {
        method: Option<String>,
    }
    serde_json::from_slice::<Peek>(body)
        .is_ok_and(|p| p.method.as_deref() == Some("subscriptions/listen"))
}

/// A JSON-RPC error the transport answers itself.
fn json(status: StatusCode, body: &Value) -> Response<Reply> {
    let mut r = Response::new(Reply::new(
        Box::pin(Once(Some(Bytes::from(body.to_string())))),
        None,
        None,
    ));
    *r.status_mut() = status;
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    r
}

/// A refusal, which closes the connection (its body, if any, is not read).
fn text(status: StatusCode, message: &str) -> Response<Reply> {
    let mut r = Response::new(Reply::new(
        Box::pin(Once(Some(Bytes::from(format!("{message}\n"))))),
        None,
        None,
    ));
    *r.status_mut() = status;
    let h = r.headers_mut();
    h.insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    h.insert(
        hyper::header::CONNECTION,
        hyper::header::HeaderValue::from_static("close"),
    );
    r
}

/// A body of one chunk (or none).
struct Once(Option<Bytes>);

impl Body for Once {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        Poll::Ready(self.get_mut().0.take().map(|b| Ok(Frame::data(b))))
    }

    fn is_end_stream(&self) -> bool {
        self.0.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.0.as_ref().map_or(0, |b| b.len() as u64))
    }
}

type Inner = Pin<Box<dyn Body<Data = Bytes, Error = Infallible> + Send + Sync>>;

/// An answer's body: it holds its request's share of `MAX_IN_FLIGHT` until it
/// ends (or the connection closes), and, for a listen that named task ids,
/// adds those accepted to the acknowledgement on its SSE stream.
struct Reply {
    inner: Inner,
    _share: Option<OwnedSemaphorePermit>,
    /// The accepted task ids and the start of an SSE event, until the
    /// acknowledgement has passed.
    ack: Option<(Vec<String>, Vec<u8>)>,
    out: VecDeque<Frame<Bytes>>,
}

impl Reply {
    fn new(inner: Inner, share: Option<OwnedSemaphorePermit>, ack: Option<Vec<String>>) -> Reply {
        Reply {
            inner,
            _share: share,
            ack: ack.map(|ids| (ids, Vec::new())),
            out: VecDeque::new(),
        }
    }

    /// Stop looking: what is held goes out as it came.
    fn give_up(&mut self) {
        if let Some((_, held)) = self.ack.take() {
            if !held.is_empty() {
                self.out.push_back(Frame::data(Bytes::from(held)));
            }
        }
    }

    /// The whole SSE events held, each as it came or, the acknowledgement, with
    /// the task ids.
    fn take_events(&mut self) {
        while let Some((ids, held)) = &mut self.ack {
            let Some(end) = held.windows(2).position(|w| w == b"\n\n") else {
                if held.len() > MAX_ACK_EVENT {
                    self.give_up();
                }
                return;
            };
            let event: Vec<u8> = held.drain(..end + 2).collect();
            match patch_ack(&event, ids) {
                Some(patched) => {
                    self.out.push_back(Frame::data(Bytes::from(patched)));
                    self.give_up();
                }
                None => self.out.push_back(Frame::data(Bytes::from(event))),
            }
        }
    }
}

/// An SSE event that carries `notifications/subscriptions/acknowledged`, with
/// `taskIds` set to `ids` (`stdio::with_task_ids`); `None` for another event.
fn patch_ack(event: &[u8], ids: &[String]) -> Option<Vec<u8>> {
    let text = std::str::from_utf8(event).ok()?;
    let mut found = false;
    let mut out = String::with_capacity(event.len() + 64);
    for line in text.split_inclusive('\n') {
        if let Some(data) = line.strip_prefix("data:") {
            let json = data
                .strip_prefix(' ')
                .unwrap_or(data)
                .trim_end_matches('\n');
            let v: serde_json::Value = serde_json::from_str(json).ok()?;
            if v.get("method").and_then(|m| m.as_str())
                != Some("notifications/subscriptions/acknowledged")
            {
                return None;
            }
            found = true;
            out.push_str("data: ");
            out.push_str(&with_task_ids(v, ids).to_string());
            out.push('\n');
        } else {
            out.push_str(line);
        }
    }
    found.then(|| out.into_bytes())
}

impl Body for Reply {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let this = self.get_mut();
        loop {
            if let Some(f) = this.out.pop_front() {
                return Poll::Ready(Some(Ok(f)));
            }
            if this.ack.is_none() {
                return this.inner.as_mut().poll_frame(cx);
            }
            match std::task::ready!(this.inner.as_mut().poll_frame(cx)) {
                None => {
                    this.give_up();
                    if this.out.is_empty() {
                        return Poll::Ready(None);
                    }
                }
                Some(Err(e)) => match e {},
                Some(Ok(f)) => match f.into_data() {
                    Ok(data) => {
                        if let Some((_, held)) = &mut this.ack {
                            held.extend_from_slice(&data);
                        }
                        this.take_events();
                    }
                    Err(other) => {
                        this.give_up();
                        this.out.push_back(other);
                    }
                },
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.out.is_empty() && self.ack.is_none() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        if self.ack.is_none() && self.out.is_empty() {
            self.inner.size_hint()
        } else {
            SizeHint::default()
        }
    }
}

/// rmcp's in-memory sessions, at most `MAX_SESSIONS` of each principal's: one
/// more is refused (the client gets an HTTP error naming the bound).
#[derive(Default)]
struct Capped {
    local: LocalSessionManager,
    /// Each session's principal.
    owners: Mutex<HashMap<SessionId, Principal>>,
    /// Held from the count to the insert, so that racing requests cannot pass
    /// the bound together.
    creating: tokio::sync::Mutex<()>,
}

impl Capped {
    fn owner(&self, id: &str) -> Option<Principal> {
        self.owners
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .cloned()
    }
}

#[derive(Debug, thiserror::Error)]
enum SessionError {
    #[error("{0}")]
    Local(#[from] LocalSessionManagerError),
    #[error("too many MCP sessions at once (at most {MAX_SESSIONS}); end one (DELETE) or wait 5 minutes")]
    TooMany,
}

impl SessionManager for Capped {
    type Error = SessionError;
    type Transport = <LocalSessionManager as SessionManager>::Transport;

    async fn create_session(&self) -> Result<(SessionId, Self::Transport), SessionError> {
        let who = WHO
            .try_with(Principal::clone)
            .unwrap_or_else(|_| Principal::new("http:?"));
        let _one = self.creating.lock().await;
        let live: std::collections::HashSet<SessionId> =
            self.local.sessions.read().await.keys().cloned().collect();
        {
            let mut owners = self.owners.lock().unwrap_or_else(|p| p.into_inner());
            // Sessions rmcp ended on its own are gone from the count.
            owners.retain(|id, _| live.contains(id));
            if owners.values().filter(|p| **p == who).count() >= MAX_SESSIONS {
                return Err(SessionError::TooMany);
            }
        }
        let (id, t) = self.local.create_session().await?;
        self.owners
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id.clone(), who);
        Ok((id, t))
    }
    async fn initialize_session(
        &self,
        id: &SessionId,
        message: rmcp::model::ClientJsonRpcMessage,
    ) -> Result<rmcp::model::ServerJsonRpcMessage, SessionError> {
        Ok(self.local.initialize_session(id, message).await?)
    }
    async fn has_session(&self, id: &SessionId) -> Result<bool, SessionError> {
        Ok(self.local.has_session(id).await?)
    }
    async fn close_session(&self, id: &SessionId) -> Result<(), SessionError> {
        self.owners
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
        Ok(self.local.close_session(id).await?)
    }
    async fn create_stream(
        &self,
        id: &SessionId,
        message: rmcp::model::ClientJsonRpcMessage,
    ) -> Result<impl futures::Stream<Item = ServerSseMessage> + Send + Sync + 'static, SessionError>
    {
        Ok(self.local.create_stream(id, message).await?)
    }
    async fn accept_message(
        &self,
        id: &SessionId,
        message: rmcp::model::ClientJsonRpcMessage,
    ) -> Result<(), SessionError> {
        Ok(self.local.accept_message(id, message).await?)
    }
    async fn create_standalone_stream(
        &self,
        id: &SessionId,
    ) -> Result<impl futures::Stream<Item = ServerSseMessage> + Send + Sync + 'static, SessionError>
    {
        Ok(self.local.create_standalone_stream(id).await?)
    }
    async fn resume(
        &self,
        id: &SessionId,
        last_event_id: String,
    ) -> Result<impl futures::Stream<Item = ServerSseMessage> + Send + Sync + 'static, SessionError>
    {
        Ok(self.local.resume(id, last_event_id).await?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_acknowledgement_gets_the_accepted_task_ids_and_nothing_else_changes() {
        let ack = br#"{"jsonrpc":"2.0","method":"notifications/subscriptions/acknowledged","params":{"notifications":{"toolsListChanged":true}}}"#;
        let event = [b"data: ".as_slice(), ack, b"\nid: 7\n\n"].concat();
        let ids = vec!["t1".to_string()];
        let patched = String::from_utf8(patch_ack(&event, &ids).unwrap()).unwrap();
        assert!(patched.ends_with("\nid: 7\n\n"), "{patched}");
        let v: serde_json::Value = serde_json::from_str(
            patched
                .lines()
                .next()
                .unwrap()
                .strip_prefix("data: ")
                .unwrap(),
        )
        .unwrap();
        assert_eq!(
            v["params"]["notifications"]["taskIds"],
            serde_json::json!(["t1"])
        );
        assert_eq!(v["params"]["notifications"]["toolsListChanged"], true);
        // Another message, a priming event: not touched.
        assert!(patch_ack(
            b"data: {\"jsonrpc\":\"2.0\",\"id\":1,\"result\":{}}\n\n",
            &ids
        )
        .is_none());
        assert!(patch_ack(b"id: 0\nretry: 3000\ndata:\n\n", &ids).is_none());
    }

    /// The acknowledgement split across frames, after a priming event, is
    /// found; what follows passes as it came.
    #[tokio::test]
    async fn a_reply_patches_the_acknowledgement_across_frames() {
        struct Frames(VecDeque<Bytes>);
        impl Body for Frames {
            type Data = Bytes;
            type Error = Infallible;
            fn poll_frame(
                self: Pin<&mut Self>,
                _cx: &mut Context<'_>,
            ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
                Poll::Ready(self.get_mut().0.pop_front().map(|b| Ok(Frame::data(b))))
            }
        }
        let ack = r#"data: {"jsonrpc":"2.0","method":"notifications/subscriptions/acknowledged","params":{"notifications":{}}}"#;
        let frames: VecDeque<Bytes> = [
            "retry: 3000\n\n".to_string(),
            ack[..20].to_string(),
            format!("{}\n\ndata: {{\"later\":1}}", &ack[20..]),
            "\n\n".to_string(),
        ]
        .into_iter()
        .map(Bytes::from)
        .collect();
        let mut r = Reply::new(Box::pin(Frames(frames)), None, Some(vec!["a".into()]));
        let mut all = Vec::new();
        while let Some(f) = std::future::poll_fn(|cx| Pin::new(&mut r).poll_frame(cx)).await {
            all.extend_from_slice(&f.unwrap().into_data().unwrap());
        }
        let all = String::from_utf8(all).unwrap();
        assert!(all.starts_with("retry: 3000\n\n"), "{all}");
        assert!(all.contains(r#""taskIds":["a"]"#), "{all}");
        assert!(all.ends_with("data: {\"later\":1}\n\n"), "{all}");
    }

    /// An event that never ends is not held past `MAX_ACK_EVENT`.
    #[tokio::test]
    async fn a_reply_holds_a_bounded_event() {
        let long = Bytes::from(vec![b'x'; MAX_ACK_EVENT + 1]);
        let mut r = Reply::new(Box::pin(Once(Some(long))), None, Some(vec![]));
        let f = std::future::poll_fn(|cx| Pin::new(&mut r).poll_frame(cx))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(f.into_data().unwrap().len(), MAX_ACK_EVENT + 1);
        assert!(r.ack.is_none());
    }

    #[test]
    fn the_principal_names_the_token_without_holding_it() {
        let t = b"0123456789abcdef0123456789abcdef";
        let p = principal_of(t);
        assert!(p.as_str().starts_with("http:"));
        assert_eq!(p.as_str().len(), 5 + 16);
        assert!(!p.as_str().contains("0123456789abcdef"));
        assert_eq!(p, principal_of(t));
        assert_ne!(p, principal_of(b"0123456789abcdef0123456789abcdeX"));
    }

    #[test]
    fn a_token_file_too_short_or_with_spaces_inside_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let made = load_token(&d.path().join("t")).unwrap();
        assert_eq!(made.len(), 64);
        assert!(made.iter().all(u8::is_ascii_hexdigit));
        use std::os::unix::fs::OpenOptionsExt;
        for (name, content) in [
            ("short", "abc\n"),
            ("spaced", "0123456789abcdef 0123456789abcdef\n"),
        ] {
            let p = d.path().join(name);
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&p)
                .unwrap();
            std::io::Write::write_all(&mut f, content.as_bytes()).unwrap();
            assert!(load_token(&p).is_err(), "{name}");
        }
        // One's own, with a newline at the end: the newline is not part of it.
        let p = d.path().join("own");
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&p)
            .unwrap();
        std::io::Write::write_all(&mut f, b"my-own-token-of-at-least-32-characters\n").unwrap();
        assert_eq!(
            load_token(&p).unwrap(),
            b"my-own-token-of-at-least-32-characters"
        );
    }
}
