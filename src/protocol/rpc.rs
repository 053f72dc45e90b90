//! One JSON-RPC 2.0 connection, both ways, over newline-delimited JSON: the
//! daemon's engine connections, the CLI's socket client and admin client, and the
//! MCP client all use it. It keeps the bookkeeping that was written four times:
//! ids, the answers being waited for, one writer task, notifications, a bound on
//! each line read, and the peer's requests served concurrently with a bound on
//! how many of their answers may be outstanding.
//!
//! What the messages mean is not its business: a `Handler` gets the peer's
//! requests and notifications as method and params, and the typed protocol
//! (`protocol`) gives them their types.

use crate::protocol::framing::{
    parse_cost, read_line, read_line_limited, Line, LineLimits, FREE_LINE_BYTES,
};
use crate::protocol::{self, code, Incoming, RpcError};
use serde::Serialize;
use serde_json::Value;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit, Semaphore};

/// A boxed future that is `Send`: what handlers and engine links return.
pub type BoxFuture<'a, T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;

/// Serves what the other side asks of us.
pub trait Handler: Send + Sync + 'static {
    /// A request from the peer; its answer is sent back with the request's id.
    fn request(
        self: Arc<Self>,
        method: String,
        params: Value,
    ) -> BoxFuture<'static, Result<Value, RpcError>>;
    /// A notification from the peer. Ignored unless overridden.
    fn notification(&self, _method: &str, _params: Value) {}
}

/// Why a request of ours got no result.
#[derive(Debug, Clone, PartialEq)]
pub enum CallError {
    /// The peer answered with a JSON-RPC error.
    Answered(RpcError),
    /// The connection closed (or was closed) before the answer came.
    Disconnected,
    /// No answer within the time given; `id` was the request's id (MCP cancels it by id).
    Timeout { id: u64 },
    /// The peer closed the connection after an error about the connection as a
    /// whole (id null), e.g. scriptgated's -32001 to a peer it does not serve.
    Closed(RpcError),
}

/// How the incoming side is bounded, and what bad lines get.
/// A strict peer's line may parse to at most this many times `max_line` bytes,
/// and at least to `MIN_PARSE_COST`.
pub const MAX_PARSE_COST_PER_LINE_BYTE: usize = 4;
pub const MIN_PARSE_COST: usize = 16 << 20;

pub fn max_parse_cost(max_line: usize) -> usize {
    (MAX_PARSE_COST_PER_LINE_BYTE * max_line).max(MIN_PARSE_COST)
}

pub struct Bounds {
    /// The longest line read; a longer one ends the connection.
    pub max_line: usize,
    /// For a peer that may be hostile (the engine socket): the budget shared by
    /// every connection for partial lines, and how long a started line may take.
    pub shared: Option<(Arc<Semaphore>, Duration)>,
    /// Answers to the peer's requests not yet written: past this many, the peer is
    /// not read until some are (it floods requests and never reads answers).
    pub max_outstanding: usize,
    /// Bytes of answers queued for the peer and not yet written to its socket:
    /// past this, no further request of the peer is taken until they are. An
    /// answer larger than this still goes out, one at a time.
    pub max_queued_bytes: usize,
    /// A server answers malformed lines with a JSON-RPC error and says why it
    /// closes the connection; a client ignores them and just ends.
    pub strict: Option<Strict>,
}

/// What a strict (server) side says about a line it cannot take.
pub struct Strict {
    /// The message of the -32600 sent before closing on a line over `max_line`.
    pub too_long: String,
    /// The message of the -32600 sent before closing on a line not finished in time.
    pub timed_out: String,
}

impl Bounds {
    /// A client's bounds: lines up to `max_line`, malformed lines ignored.
    pub fn client(max_line: usize) -> Bounds {
        Bounds {
            max_line,
            shared: None,
            max_outstanding: 1024,
            max_queued_bytes: usize::MAX,
            strict: None,
        }
    }
}

/// Queued lines the writer joins into one write, up to about this many bytes.
const COALESCE_BYTES: usize = 64 * 1024;

/// A line for the peer, with the permit of the request it answers (if any),
/// released once the line is written.
type Outgoing = (String, Option<OwnedSemaphorePermit>);

type Waiters = HashMap<u64, oneshot::Sender<Result<Value, RpcError>>>;

/// The sending half of a connection, shared by whoever talks to the peer. The
/// writer task ends when every clone is dropped or `close` is called, after the
/// lines already queued are written.
#[derive(Clone)]
pub struct Endpoint {
    shared: Arc<Shared>,
    queued: Arc<Queued>,
}

/// Bytes of answers queued for the writer, shared with it (it cannot hold
/// `Shared`: that holds the sender whose drop ends it).
#[derive(Default)]
struct Queued {
    bytes: std::sync::atomic::AtomicUsize,
    /// Held by whoever is about to queue an answer: the queue is drained below
    /// the bound first, and one answer at a time is made and queued, so that the
    /// queue stays within the bound plus one answer.
    turn: Arc<tokio::sync::Mutex<()>>,
    /// Set once the writer has ended: nothing more will drain.
    gone: std::sync::atomic::AtomicBool,
    drained: tokio::sync::Notify,
}

struct Shared {
    tx: Mutex<Option<mpsc::UnboundedSender<Outgoing>>>,
    /// `None` once the connection's read side ended: no answer can come.
    pending: Mutex<Option<Waiters>>,
    next_id: AtomicU64,
    /// An error the peer sent with id null: why it is about to close.
    closed_with: Mutex<Option<RpcError>>,
    /// While `serve` reads: its permits for the peer's requests (each held from
    /// the request's arrival until its answer is written) and how many there are.
    outstanding: Mutex<Option<(Arc<Semaphore>, u32)>>,
}

/// A request waiting for its answer. Dropped unsettled (its future was), it
/// frees its slot in `pending` and says so through `abandoned`.
struct Waiting<'a, F: FnOnce(u64)> {
    shared: &'a Shared,
    id: u64,
    abandoned: Option<F>,
}

impl<F: FnOnce(u64)> Waiting<'_, F> {
    /// The request ended (answered, timed out, disconnected): free its slot.
    fn settle(&mut self) {
        self.abandoned = None;
        if let Some(p) = self.shared.pending.lock().unwrap().as_mut() {
            p.remove(&self.id);
        }
    }
}

impl<F: FnOnce(u64)> Drop for Waiting<'_, F> {
    fn drop(&mut self) {
        if let Some(f) = self.abandoned.take() {
            self.settle();
            f(self.id);
        }
    }
}

impl Endpoint {
    /// A peer writing to `write`, and the writer task (it ends once every line
    /// queued before the last `Endpoint` clone went away is written).
    pub fn new<W: AsyncWrite + Unpin + Send + 'static>(
        mut write: W,
    ) -> (Endpoint, tokio::task::JoinHandle<()>) {
        let (tx, mut rx) = mpsc::unbounded_channel::<Outgoing>();
        let queued = Arc::new(Queued::default());
        let q = queued.clone();
        let writer = tokio::spawn(async move {
            // Lines queued together (a script's four calls in flight, say) go out
            // in one write: fewer syscalls and wake-ups of the peer per line.
            let mut permits = Vec::new();
            while let Some((mut out, permit)) = rx.recv().await {
                // Answers (the lines with a permit) count in `queued` until written.
                let mut answers = if permit.is_some() { out.len() } else { 0 };
                permits.push(permit);
                while out.len() < COALESCE_BYTES {
                    match rx.try_recv() {
                        Ok((line, permit)) => {
                            if permit.is_some() {
                                answers += line.len();
                            }
                            out.push_str(&line);
                            permits.push(permit);
                        }
                        Err(_) => break,
                    }
                }
                if write.write_all(out.as_bytes()).await.is_err() {
                    break;
                }
                permits.clear();
                if answers > 0 {
                    q.bytes.fetch_sub(answers, Ordering::SeqCst);
                    q.drained.notify_waiters();
                }
            }
            q.gone.store(true, Ordering::SeqCst);
            q.drained.notify_waiters();
        });
        let peer = Endpoint {
            shared: Arc::new(Shared {
                tx: Mutex::new(Some(tx)),
                pending: Mutex::new(Some(HashMap::new())),
                next_id: AtomicU64::new(1),
                closed_with: Mutex::new(None),
                outstanding: Mutex::new(None),
            }),
            queued,
        };
        (peer, writer)
    }

    fn send(&self, line: String, permit: Option<OwnedSemaphorePermit>) {
        if let Some(tx) = self.shared.tx.lock().unwrap().as_ref() {
            let len = line.len();
            if permit.is_some() {
                self.queued.bytes.fetch_add(len, Ordering::SeqCst);
            }
            // Once the writer has ended (`gone`), nobody waits on the count.
            let _ = tx.send((line, permit));
        }
    }

    /// Until the answers queued for the peer are at most `max` bytes (or the
    /// writer has ended: the peer is gone).
    async fn drained(&self, max: usize) {
        let q = &self.queued;
        loop {
            let wake = q.drained.notified();
            tokio::pin!(wake);
            wake.as_mut().enable();
            if q.gone.load(Ordering::SeqCst) || q.bytes.load(Ordering::SeqCst) <= max {
                return;
            }
            wake.await;
        }
    }

    /// The turn to queue one answer: once no other answer is being made and
    /// queued, and the answers queued are at most `max` bytes.
    async fn turn(&self, max: usize) -> tokio::sync::OwnedMutexGuard<()> {
        let g = self.queued.turn.clone().lock_owned().await;
        self.drained(max).await;
        g
    }

    /// Send a notification; best effort.
    pub fn notify<P: Serialize + ?Sized>(&self, method: &str, params: &P) {
        self.send(protocol::notification_line(method, params), None);
    }

    /// Send a request and wait for its answer, at most `timeout` when given.
    pub async fn request<P: Serialize + ?Sized>(
        &self,
        method: &str,
        params: &P,
        timeout: Option<Duration>,
    ) -> Result<Value, CallError> {
        self.request_abandonable(method, params, timeout, |_| {})
            .await
    }

    /// `request`, and `abandoned(id)` if the future is dropped before it ended
    /// (its caller gave up: a script that ended with the call at the engine).
    /// Either way the request's slot is freed: an answer that comes later finds
    /// nobody waiting and is dropped.
    pub async fn request_abandonable<P: Serialize + ?Sized, F: FnOnce(u64)>(
        &self,
        method: &str,
        params: &P,
        timeout: Option<Duration>,
        abandoned: F,
    ) -> Result<Value, CallError> {
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        match self.shared.pending.lock().unwrap().as_mut() {
            Some(p) => p.insert(id, tx),
            None => return Err(self.disconnected()),
        };
        let mut waiting = Waiting {
            shared: &self.shared,
            id,
            abandoned: Some(abandoned),
        };
        self.send(protocol::request_line(id, method, params), None);
        let answer = match timeout {
            Some(t) => match tokio::time::timeout(t, rx).await {
                Ok(a) => a,
                Err(_) => {
                    waiting.settle();
                    return Err(CallError::Timeout { id });
                }
            },
            None => rx.await,
        };
        waiting.settle();
        match answer {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(CallError::Answered(e)),
            Err(_) => Err(self.disconnected()),
        }
    }

    fn disconnected(&self) -> CallError {
        match self.shared.closed_with.lock().unwrap().clone() {
            Some(e) => CallError::Closed(e),
            None => CallError::Disconnected,
        }
    }

    /// Fail every request waiting for an answer, and refuse new ones.
    pub fn fail_pending(&self) {
        self.shared.pending.lock().unwrap().take();
    }

    /// Stop sending: the writer writes what is queued and then ends (closing the
    /// write side, e.g. an MCP server's stdin). Waiting requests fail.
    pub fn close(&self) {
        self.fail_pending();
        self.shared.tx.lock().unwrap().take();
    }

    fn answered(&self, id: &Value, result: Result<Value, RpcError>) {
        if let (Value::Null, Err(e)) = (id, &result) {
            *self.shared.closed_with.lock().unwrap() = Some(e.clone());
            return;
        }
        let slot = id.as_u64().and_then(|i| {
            self.shared
                .pending
                .lock()
                .unwrap()
                .as_mut()
                .and_then(|p| p.remove(&i))
        });
        if let Some(s) = slot {
            let _ = s.send(result);
        }
    }

    /// Read the peer's messages until its side ends (or a line breaks the bounds),
    /// serving its requests with `handler`, each in its own task. On return the
    /// requests still waiting have failed (`CallError::Disconnected`); sending
    /// goes on until `close` or the last clone is dropped.
    pub async fn serve<R, H>(&self, read: R, bounds: &Bounds, handler: Arc<H>)
    where
        R: AsyncRead + Unpin,
        H: Handler + ?Sized,
    {
        let outstanding = Arc::new(Semaphore::new(bounds.max_outstanding));
        *self.shared.outstanding.lock().unwrap() = u32::try_from(bounds.max_outstanding)
            .ok()
            .map(|n| (outstanding.clone(), n));
        let mut reader = BufReader::with_capacity(64 * 1024, read);
        let mut buf = Vec::new();
        loop {
            // A large line's buffer is not kept for the connection's lifetime.
            if buf.capacity() > FREE_LINE_BYTES {
                buf = Vec::new();
            }
            let line = match &bounds.shared {
                Some((budget, timeout)) => {
                    let limits = LineLimits {
                        max: bounds.max_line,
                        budget,
                        timeout: *timeout,
                    };
                    read_line_limited(&mut reader, &mut buf, &limits).await
                }
                None => read_line(&mut reader, &mut buf, bounds.max_line).await,
            };
            let strict = bounds.strict.as_ref();
            match line {
                Ok(Line::Eof) | Err(_) => break,
                Ok(Line::TooLong) => {
                    if let Some(s) = strict {
                        self.refuse_line(&s.too_long);
                    }
                    break;
                }
                Ok(Line::TimedOut) => {
                    if let Some(s) = strict {
                        self.refuse_line(&s.timed_out);
                    }
                    break;
                }
                Ok(Line::Data) if buf.iter().all(u8::is_ascii_whitespace) => {}
                // A line is bounded in what it parses to, too: a line of tiny
                // objects parses to ~100 times its size. A server says so to its
                // peer; a client (an MCP server's stdout) fails what waits with it.
                Ok(Line::Data) if parse_cost(&buf) > max_parse_cost(bounds.max_line) => {
                    let message = format!(
                        "message too large once parsed (about {} bytes; at most {}); closing the connection",
                        parse_cost(&buf),
                        max_parse_cost(bounds.max_line)
                    );
                    match strict {
                        Some(_) => self.refuse_line(&message),
                        None => {
                            let e = RpcError::new(code::INVALID_REQUEST, message);
                            *self.shared.closed_with.lock().unwrap() = Some(e);
                        }
                    }
                    break;
                }
                Ok(Line::Data) => {
                    if !self
                        .incoming(&buf, strict.is_some(), bounds, &outstanding, &handler)
                        .await
                    {
                        break;
                    }
                }
            }
        }
        self.fail_pending();
    }

    /// Until the answer to every request of the peer taken so far is written
    /// (to the socket: the peer reads it even after we close), or the writer
    /// has ended; no further request is taken while this waits. A barrier for
    /// a daemon about to exit (bound it with a timeout: an answer may wait on a
    /// peer that does not read).
    pub async fn answers_written(&self) {
        let held = self.shared.outstanding.lock().unwrap().clone();
        if let Some((permits, n)) = held {
            let _all = permits.acquire_many_owned(n).await;
        }
    }

    /// A -32600 with no id: the line that broke the bounds cannot be answered.
    fn refuse_line(&self, message: &str) {
        let e = RpcError::new(code::INVALID_REQUEST, message);
        self.send(protocol::response_line(&Value::Null, &Err(e)), None);
    }

    /// One complete line. `false` when the connection is to end.
    async fn incoming<H: Handler + ?Sized>(
        &self,
        line: &[u8],
        strict: bool,
        bounds: &Bounds,
        outstanding: &Arc<Semaphore>,
        handler: &Arc<H>,
    ) -> bool {
        match protocol::parse_line(line) {
            Err((id, e)) => {
                if strict {
                    let Ok(permit) = outstanding.clone().acquire_owned().await else {
                        return false;
                    };
                    let _turn = self.turn(bounds.max_queued_bytes).await;
                    self.send(protocol::response_line(&id, &Err(e)), Some(permit));
                }
            }
            Ok(Incoming::Response { id, result }) => self.answered(&id, result),
            Ok(Incoming::Notification { method, params }) => handler.notification(&method, params),
            Ok(Incoming::Request { id, method, params }) => {
                self.drained(bounds.max_queued_bytes).await;
                let Ok(permit) = outstanding.clone().acquire_owned().await else {
                    return false;
                };
                let fut = handler.clone().request(method, params);
                let answering = Arc::new(Answering {
                    peer: self.clone(),
                    max: bounds.max_queued_bytes,
                    turn: tokio::sync::Mutex::new(None),
                });
                tokio::spawn(async move {
                    let r = ANSWERING.scope(answering.clone(), fut).await;
                    // The answer is made into its line and queued in its turn
                    // only (the handler may have taken it already).
                    answering.take().await;
                    let line = protocol::response_line(&id, &r);
                    drop(r);
                    answering.peer.send(line, Some(permit));
                });
            }
        }
        true
    }
}

/// How long a connect waits in a full listen backlog.
const CONNECT_WAIT: Duration = Duration::from_secs(30);

/// Connect to a Unix socket, waiting (at most `CONNECT_WAIT`) in the listener's
/// queue when its backlog is full, where a plain non-blocking `connect(2)`
/// fails with EAGAIN: scriptgated's backlog is short, and full while a local
/// peer loops on connect.
pub async fn connect_unix(path: &std::path::Path) -> std::io::Result<tokio::net::UnixStream> {
    match tokio::net::UnixStream::connect(path).await {
        Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => {}
        r => return r,
    }
    let path = path.to_path_buf();
    let s = tokio::task::spawn_blocking(move || -> std::io::Result<_> {
        use nix::sys::socket::{self as so, sockopt};
        use std::os::fd::AsRawFd;
        let fd = so::socket(
            so::AddressFamily::Unix,
            so::SockType::Stream,
            so::SockFlag::SOCK_CLOEXEC,
            None,
        )?;
        let wait = nix::sys::time::TimeVal::new(CONNECT_WAIT.as_secs() as _, 0);
        so::setsockopt(&fd, sockopt::SendTimeout, &wait)?;
        so::connect(fd.as_raw_fd(), &so::UnixAddr::new(&path)?)?;
        let s = std::os::unix::net::UnixStream::from(fd);
        s.set_nonblocking(true)?;
        Ok(s)
    })
    .await
    .map_err(std::io::Error::other)??;
    tokio::net::UnixStream::from_std(s)
}

/// One request being answered: its connection, and its turn once taken.
struct Answering {
    peer: Endpoint,
    max: usize,
    turn: tokio::sync::Mutex<Option<tokio::sync::OwnedMutexGuard<()>>>,
}

impl Answering {
    async fn take(&self) {
        let mut t = self.turn.lock().await;
        if t.is_none() {
            *t = Some(self.peer.turn(self.max).await);
        }
    }
}

tokio::task_local! {
    static ANSWERING: Arc<Answering>;
}

/// In a `Handler`'s request: wait for this connection's turn to queue an answer
/// (its unread answers drained below `Bounds::max_queued_bytes`, no other answer
/// being queued), and keep it until this request's answer is queued. A handler
/// whose answer is large calls it before making the answer, so that answers
/// that become ready together (every `script.wait` of one script) are made one
/// at a time, as the peer reads them. Elsewhere it returns at once.
pub async fn answer_turn() {
    if let Ok(a) = ANSWERING.try_with(Arc::clone) {
        a.take().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt};

    struct Echo;
    impl Handler for Echo {
        fn request(
            self: Arc<Self>,
            method: String,
            params: Value,
        ) -> BoxFuture<'static, Result<Value, RpcError>> {
            Box::pin(async move {
                match method.as_str() {
                    "echo" => Ok(params),
                    _ => Err(RpcError::new(code::METHOD_NOT_FOUND, "no")),
                }
            })
        }
    }

    #[tokio::test]
    async fn requests_both_ways_and_bounded_lines() {
        let (a, b) = tokio::net::UnixStream::pair().unwrap();
        let (ar, aw) = a.into_split();
        let (peer, _w) = Endpoint::new(aw);
        let p2 = peer.clone();
        let served = tokio::spawn(async move {
            let bounds = Bounds {
                strict: Some(Strict {
                    too_long: "too long".into(),
                    timed_out: "slow".into(),
                }),
                ..Bounds::client(64)
            };
            p2.serve(ar, &bounds, Arc::new(Echo)).await;
        });
        let (br, mut bw) = b.into_split();
        let mut lines = tokio::io::BufReader::new(br).lines();
        // The peer asks us; we answer with our own id space.
        bw.write_all(b"{\"jsonrpc\":\"2.0\",\"id\":5,\"method\":\"echo\",\"params\":[1]}\n")
            .await
            .unwrap();
        let l: Value = serde_json::from_str(&lines.next_line().await.unwrap().unwrap()).unwrap();
        assert_eq!(
            (l["id"].clone(), l["result"].clone()),
            (5.into(), [1].into())
        );
        // We ask the peer.
        let ask = tokio::spawn({
            let peer = peer.clone();
            async move { peer.request("ping", &Value::Null, None).await }
        });
        let l: Value = serde_json::from_str(&lines.next_line().await.unwrap().unwrap()).unwrap();
        assert_eq!(l["method"], "ping");
        let answer = format!("{{\"jsonrpc\":\"2.0\",\"id\":{},\"result\":7}}\n", l["id"]);
        bw.write_all(answer.as_bytes()).await.unwrap();
        assert_eq!(ask.await.unwrap(), Ok(Value::from(7)));
        // A malformed line gets -32700 and the connection stays.
        bw.write_all(b"{nope\n").await.unwrap();
        let l: Value = serde_json::from_str(&lines.next_line().await.unwrap().unwrap()).unwrap();
        assert_eq!(l["error"]["code"], code::PARSE_ERROR);
        // A line over the bound is refused and ends the connection.
        bw.write_all(&[b'x'; 100]).await.unwrap();
        let l: Value = serde_json::from_str(&lines.next_line().await.unwrap().unwrap()).unwrap();
        assert_eq!(l["error"]["message"], "too long");
        served.await.unwrap();
        assert_eq!(
            peer.request("x", &Value::Null, None).await,
            Err(CallError::Disconnected)
        );
    }

    #[tokio::test]
    async fn a_peer_that_reads_no_answers_is_not_read_past_the_queued_bytes() {
        struct Count(std::sync::atomic::AtomicUsize);
        impl Handler for Count {
            fn request(
                self: Arc<Self>,
                _method: String,
                _params: Value,
            ) -> BoxFuture<'static, Result<Value, RpcError>> {
                self.0.fetch_add(1, Ordering::SeqCst);
                Box::pin(async { Ok(Value::String("x".repeat(1000))) })
            }
        }
        // Requests trickle in (a small pipe: the reader waits between lines);
        // answers go to a pipe of 8 KiB that is never read.
        let (req_r, mut req_w) = tokio::io::duplex(256);
        let (ans_w, _ans_r) = tokio::io::duplex(8 * 1024);
        let (peer, _w) = Endpoint::new(ans_w);
        let count = Arc::new(Count(std::sync::atomic::AtomicUsize::new(0)));
        let served = tokio::spawn({
            let (peer, count) = (peer.clone(), count.clone());
            async move {
                let bounds = Bounds {
                    max_queued_bytes: 16 * 1024,
                    ..Bounds::client(1 << 20)
                };
                peer.serve(req_r, &bounds, count).await;
            }
        });
        let writer = tokio::spawn(async move {
            for i in 0..500 {
                let line = format!("{{\"jsonrpc\":\"2.0\",\"id\":{i},\"method\":\"m\"}}\n");
                if req_w.write_all(line.as_bytes()).await.is_err() {
                    break;
                }
            }
        });
        let (mut last, mut still) = (usize::MAX, 0);
        while still < 20 {
            tokio::time::sleep(Duration::from_millis(10)).await;
            let n = count.0.load(Ordering::SeqCst);
            (last, still) = if n == last { (n, still + 1) } else { (n, 0) };
        }
        // ~8 answers of ~1 KiB in the pipe, ~16 queued, and the one past the bound.
        assert!(
            (10..40).contains(&last),
            "{last} requests taken from a peer that reads no answers"
        );
        served.abort();
        writer.abort();
    }

    /// The stop's barrier: `answers_written` waits for the answer of a request
    /// still being made, and ends once it is written.
    #[tokio::test]
    async fn answers_written_waits_for_the_answers_of_requests_taken() {
        struct Held(tokio::sync::Mutex<Option<tokio::sync::oneshot::Receiver<()>>>);
        impl Handler for Held {
            fn request(
                self: Arc<Self>,
                _method: String,
                _params: Value,
            ) -> BoxFuture<'static, Result<Value, RpcError>> {
                Box::pin(async move {
                    let first = self.0.lock().await.take();
                    if let Some(rx) = first {
                        let _ = rx.await;
                    }
                    Ok(Value::from("late"))
                })
            }
        }
        let (go, held) = tokio::sync::oneshot::channel();
        let (a, b) = tokio::net::UnixStream::pair().unwrap();
        let (ar, aw) = a.into_split();
        let (peer, _w) = Endpoint::new(aw);
        // Before anything is served there is nothing to wait for.
        peer.answers_written().await;
        tokio::spawn({
            let peer = peer.clone();
            async move {
                let h = Arc::new(Held(tokio::sync::Mutex::new(Some(held))));
                peer.serve(ar, &Bounds::client(1 << 20), h).await;
            }
        });
        let (br, mut bw) = b.into_split();
        let mut lines = tokio::io::BufReader::new(br).lines();
        bw.write_all(b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"m\"}\n")
            .await
            .unwrap();
        // Taken (the second request is answered at once, after the first was read).
        bw.write_all(b"{\"jsonrpc\":\"2.0\",\"id\":2,\"method\":\"m\"}\n")
            .await
            .unwrap();
        let l: Value = serde_json::from_str(&lines.next_line().await.unwrap().unwrap()).unwrap();
        assert_eq!(l["id"], 2);
        let barrier = peer.answers_written();
        tokio::pin!(barrier);
        assert!(
            tokio::time::timeout(Duration::from_millis(50), &mut barrier)
                .await
                .is_err(),
            "the first answer is still being made"
        );
        go.send(()).unwrap();
        barrier.await;
        let l: Value = serde_json::from_str(&lines.next_line().await.unwrap().unwrap()).unwrap();
        assert_eq!(
            (l["id"].clone(), l["result"].clone()),
            (1.into(), "late".into())
        );
    }

    #[tokio::test]
    async fn a_request_times_out_with_its_id() {
        let (a, _b) = tokio::net::UnixStream::pair().unwrap();
        let (peer, _w) = Endpoint::new(a);
        let r = peer
            .request("x", &Value::Null, Some(Duration::from_millis(10)))
            .await;
        assert_eq!(r, Err(CallError::Timeout { id: 1 }));
    }
}
