//! rmcp's transport over an MCP server's stdio: newline-delimited JSON-RPC with
//! scriptgate's bounds and leniencies, and the wire side of the era probe.
//!
//! rmcp (3.11) runs the protocol: the handshake of either era, request ids,
//! cancellation, `ping`, per-request `_meta`. This file holds what rmcp does not:
//! - a line over `MAX_LINE_BYTES`, or one that would parse to too much memory,
//!   ends the connection and fails what waits with the reason (rmcp's own stdio
//!   transport drops a line over 16 MiB and reads on, so the request it
//!   answered waits for its timeout);
//! - the server is not read while `MAX_PENDING` of its requests wait for an
//!   answer or lines wait for its stdin;
//! - a malformed answer fails its request at once;
//! - the raw `result` of our `tools/list`, `tools/call` and `tasks/get` is kept
//!   (rmcp is handed an empty one): rmcp's `Tool` has no `execution` (2025-11-25's
//!   `taskSupport`), and a call's result reaches `ToolResult::from_mcp`, a task's
//!   state `task::step`, as the server wrote them;
//! - the answers to `initialize` and `server/discover` are read leniently
//!   (`lenient_initialize`, `lenient_discover`): rmcp's model refuses an answer
//!   with no `serverInfo`, `ttlMs` or `cacheScope`, or a malformed capability
//!   that scriptgate never uses;
//! - the era probe's own time: rmcp's `ClientLifecycleMode::Auto` waits a fixed
//!   10 s for the answer to `server/discover` before it falls back to
//!   `initialize`, and has no setting for it. Here the probe is given up after
//!   `probe_timeout` by answering it, for rmcp, with an error (which rmcp takes
//!   as a server of the initialize era), and an answer that is not a
//!   `DiscoverResult` of 2026-07-28 or later (an empty `{}` from a server that
//!   answers every method, a list of handshake-era versions only) is turned
//!   into such an error too, as the stdio binding's "any other answer" says;
//! - wire ids: the probe goes out with a string id of its own, and the ids of
//!   the requests after it are rmcp's minus the probes sent, so that a server
//!   of the initialize era sees the ids it saw before there was a probe
//!   (`initialize` 0, then 1, 2, …), and an early answer to id 1 is not taken
//!   for the answer to `initialize`; the ids in answers, in our
//!   `notifications/cancelled` and in a `subscriptions/listen` stream's
//!   `subscriptionId` are mapped both ways.

use crate::protocol::framing::{clip, parse_cost, resume_line, Line};
use crate::protocol::rpc::max_parse_cost;
use rmcp::model::{
    ClientJsonRpcMessage, ClientNotification, ClientRequest, ErrorCode, JsonRpcMessage,
    ProtocolVersion, RequestId, ServerJsonRpcMessage, ServerNotification, ServerRequest,
    ServerResult,
};
use rmcp::service::RoleClient;
use rmcp::transport::Transport;
use serde_json::{json, Value};
use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::time::Instant;

/// The longest line an MCP server may send (a `tools/list` page of a large
/// server fits many times over); a longer one ends the connection.
pub const MAX_LINE_BYTES: usize = 64 << 20;

/// The server's requests not yet answered and messages not yet written to it,
/// at most, before its stdout is read again.
const MAX_PENDING: usize = 1024;

/// Entries of `Raw::abandoned`, at most (they leave it when rmcp writes the
/// request, which it does unless the connection ended).
const MAX_ABANDONED: usize = 4096;

/// The protocol versions scriptgate's client takes from a server's `initialize`
/// answer: those of the `initialize` handshake. 2026-07-28 and later are
/// reached through `server/discover` only.
pub const HANDSHAKE_VERSIONS: [ProtocolVersion; 4] = [
    ProtocolVersion::V_2024_11_05,
    ProtocolVersion::V_2025_03_26,
    ProtocolVersion::V_2025_06_18,
    ProtocolVersion::V_2025_11_25,
];

/// The version scriptgate's `initialize` asks for.
pub const HANDSHAKE_ASKS: ProtocolVersion = ProtocolVersion::V_2025_06_18;

/// The raw `result` of each answer to a `tools/list`, `tools/call` or
/// `tasks/get` of ours, by (rmcp's) request id, from when the answer is read
/// until its caller takes it (or drops the request).
#[derive(Default)]
struct Raw {
    /// Requests written and not answered yet whose results are kept.
    wanted: HashSet<RequestId>,
    results: HashMap<RequestId, Value>,
    /// Requests dropped before rmcp wrote them: not `wanted` when it does.
    abandoned: HashSet<RequestId>,
}

/// Where the handshake is, for the transport: which answers it waits for, and
/// how rmcp's ids map to the wire's.
#[derive(Default)]
struct Handshake {
    /// Which start of the handshake this is (`Shared::new_session`): part of
    /// the probe's wire id, so that no answer of one start is taken for another.
    session: u32,
    /// `server/discover` requests rmcp sent in this session. rmcp gives them
    /// its first ids; the wire id of every other request is rmcp's minus this.
    discovers: i64,
    /// How long the probe's answer is waited for; `None`: as long as the start.
    probe_timeout: Option<Duration>,
    /// The probe in flight: rmcp's id, its wire id, and when it is given up.
    probe: Option<(RequestId, String, Option<Instant>)>,
    /// Wire ids of probes given up (one per session at most): a late answer
    /// is dropped, and read for `late_modern`.
    given_up: Vec<String>,
    /// A probe given up was answered late with a `DiscoverResult` of the
    /// modern era: the server is one, only slow to start.
    late_modern: bool,
    /// Our `initialize` in flight, whose answer is read leniently.
    initialize: Option<RequestId>,
    /// rmcp sent `initialize` in this session: the server is spoken to in the
    /// handshake era.
    spoke_initialize: bool,
}

impl Handshake {
    fn to_wire(&self, id: &RequestId) -> RequestId {
        match id {
            RequestId::Number(n) => RequestId::Number(n.saturating_sub(self.discovers)),
            other => other.clone(),
        }
    }
}

/// What an answer's wire id is.
enum Wire {
    Ours(RequestId),
    /// The answer to a probe given up.
    GivenUp,
}

/// What the transport and the `Server` share.
pub struct Shared {
    raw: Mutex<Raw>,
    handshake: Mutex<Handshake>,
    /// Why the transport ended the connection, when it was scriptgate's choice
    /// (a line over a bound), for the errors of the calls that waited.
    closed_with: Mutex<Option<String>>,
    /// The server's requests handed to rmcp and not yet answered (by id).
    owed: Mutex<HashSet<RequestId>>,
    /// Those, and the other messages handed to the transport and not yet
    /// written. The server's stdout is not read while there are `MAX_PENDING`:
    /// a server that floods requests (`ping`) and never reads the answers does
    /// not grow the CLI.
    pending: tokio::sync::watch::Sender<usize>,
}

impl Shared {
    pub fn new(probe_timeout: Option<Duration>) -> Arc<Shared> {
        Arc::new(Shared {
            raw: Default::default(),
            handshake: Mutex::new(Handshake {
                probe_timeout,
                ..Default::default()
            }),
            closed_with: Default::default(),
            owed: Default::default(),
            pending: tokio::sync::watch::Sender::new(0),
        })
    }

    /// A second start of the handshake over the same pipes, after the first
    /// failed with nothing left in flight (rmcp's start writes each request
    /// before it reads on). rmcp's ids start again from 0.
    pub fn new_session(&self, probe_timeout: Option<Duration>) {
        let mut hs = self.handshake.lock().unwrap();
        *hs = Handshake {
            session: hs.session + 1,
            probe_timeout,
            given_up: std::mem::take(&mut hs.given_up),
            ..Default::default()
        };
        *self.raw.lock().unwrap() = Raw::default();
        let mut owed = self.owed.lock().unwrap();
        let n = owed.len();
        owed.clear();
        self.pending.send_modify(|p| *p = p.saturating_sub(n));
    }

    /// The answer to a probe given up came, and said the server is modern.
    pub fn late_modern(&self) -> bool {
        self.handshake.lock().unwrap().late_modern
    }

    /// The server was spoken to through `initialize` (the handshake era).
    pub fn spoke_initialize(&self) -> bool {
        self.handshake.lock().unwrap().spoke_initialize
    }

    pub fn closed_with(&self) -> Option<String> {
        self.closed_with.lock().unwrap().clone()
    }

    /// The request was answered (or failed): its raw result, if it had one.
    pub fn take(&self, id: &RequestId) -> Option<Value> {
        let mut raw = self.raw.lock().unwrap();
        raw.wanted.remove(id);
        raw.results.remove(id)
    }

    /// The request was dropped: forget it, written or not.
    pub fn abandon(&self, id: RequestId) {
        let mut raw = self.raw.lock().unwrap();
        if !raw.wanted.remove(&id) && raw.results.remove(&id).is_none() {
            if raw.abandoned.len() >= MAX_ABANDONED {
                raw.abandoned.clear();
            }
            raw.abandoned.insert(id);
        }
    }

    /// A message rmcp sends: note what its answer needs, and give it its wire id.
    fn outgoing(&self, item: &mut ClientJsonRpcMessage) {
        let mut hs = self.handshake.lock().unwrap();
        match item {
            JsonRpcMessage::Request(r) => {
                let mut raw = self.raw.lock().unwrap();
                match r.request {
                    ClientRequest::DiscoverRequest(_) => {
                        hs.discovers += 1;
                        let rmcp_id = match &r.id {
                            RequestId::Number(n) => n.to_string(),
                            RequestId::String(s) => s.to_string(),
                        };
                        let wire = format!("scriptgate-discover-{}-{rmcp_id}", hs.session);
                        let until = hs.probe_timeout.map(|t| Instant::now() + t);
                        hs.probe = Some((r.id.clone(), wire.clone(), until));
                        r.id = RequestId::String(wire.into());
                        return;
                    }
                    ClientRequest::InitializeRequest(_) => {
                        hs.initialize = Some(r.id.clone());
                        hs.spoke_initialize = true;
                    }
                    ClientRequest::ListToolsRequest(_)
                    | ClientRequest::CallToolRequest(_)
                    | ClientRequest::GetTaskRequest(_)
                        if !raw.abandoned.remove(&r.id) =>
                    {
                        raw.wanted.insert(r.id.clone());
                    }
                    _ => {}
                }
                r.id = hs.to_wire(&r.id);
            }
            JsonRpcMessage::Notification(n) => {
                if let ClientNotification::CancelledNotification(c) = &mut n.notification {
                    if let Some(id) = &mut c.params.request_id {
                        *id = hs.to_wire(id);
                    }
                }
            }
            _ => {}
        }
    }

    /// The probe's time is up: its answer, for rmcp, is an error that makes it
    /// fall back to `initialize`.
    fn give_up_probe(&self) -> Option<ServerJsonRpcMessage> {
        let mut hs = self.handshake.lock().unwrap();
        let due = matches!(&hs.probe, Some((_, _, Some(at))) if *at <= Instant::now());
        if !due {
            return None;
        }
        let (id, wire, _) = hs.probe.take()?;
        hs.given_up.push(wire);
        let waited = hs.probe_timeout.unwrap_or_default().as_millis();
        Some(not_modern(
            format!("no answer to server/discover within {waited} ms"),
            id,
        ))
    }

    fn probe_deadline(&self) -> Option<Instant> {
        self.handshake.lock().unwrap().probe.as_ref()?.2
    }

    /// Whether rmcp takes a request of the server's now: none while the probe
    /// waits (rmcp answers none then, and 2026-07-28 servers send none), only
    /// `ping` while `initialize` waits (rmcp answers it and ignores the rest).
    /// Requests rmcp never answers would hold `pending` for good.
    fn takes(&self, request: &ServerRequest) -> bool {
        let hs = self.handshake.lock().unwrap();
        if hs.probe.is_some() {
            return false;
        }
        hs.initialize.is_none() || matches!(request, ServerRequest::PingRequest(_))
    }
}

/// An error answer for rmcp that it takes as "a server of the initialize era":
/// a correlated JSON-RPC error that is none of 2026-07-28's own.
fn not_modern(why: String, id: RequestId) -> ServerJsonRpcMessage {
    let e = rmcp::ErrorData::new(
        ErrorCode::METHOD_NOT_FOUND,
        format!("{why} (taken as a server of the initialize era)"),
        None,
    );
    ServerJsonRpcMessage::error(e, Some(id))
}

/// The answer to our `initialize`, as the client before rmcp read it: only the
/// `tools` capability counts, whatever its value (its `listChanged` if a
/// boolean), a missing `protocolVersion` or `serverInfo` is no error, and the
/// rest (`instructions`, other capabilities) is not kept. rmcp's model requires
/// all three and refuses a malformed capability that scriptgate never uses.
fn lenient_initialize(result: &mut Value) {
    let Some(r) = result.as_object() else { return };
    let version = match r.get("protocolVersion").and_then(Value::as_str) {
        Some(v) => v.to_string(),
        None => HANDSHAKE_ASKS.to_string(),
    };
    *result = json!({
        "protocolVersion": version,
        "capabilities": tools_capability(r.get("capabilities")),
        "serverInfo": server_info(r.get("serverInfo")),
    });
}

/// The answer to `server/discover`, read as `lenient_initialize` reads
/// `initialize`'s: its `supportedVersions` (strings), the `tools` capability
/// and the server's name; `ttlMs`, `cacheScope` and `resultType` need not be
/// there. `Err` (why) when it is no `DiscoverResult` of 2026-07-28 or later:
/// no `supportedVersions`, or only versions of the handshake era (as a server
/// that speaks `server/discover` but offers only those may answer).
fn lenient_discover(result: &mut Value) -> Result<(), String> {
    let Some(r) = result.as_object() else {
        return Err("the answer to server/discover is not an object".into());
    };
    let versions: Vec<&str> = r
        .get("supportedVersions")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    if versions.is_empty() {
        return Err("the answer to server/discover has no supportedVersions".into());
    }
    let modern = |v: &&str| {
        serde_json::from_value::<ProtocolVersion>(json!(v)).is_ok_and(|v| !v.has_initialize())
    };
    if !versions.iter().any(modern) {
        return Err(format!(
            "server/discover lists only versions of the initialize era ({})",
            clip(&versions.join(", "), 200)
        ));
    }
    let info = r
        .get("_meta")
        .and_then(|m| m.get("io.modelcontextprotocol/serverInfo"));
    *result = json!({
        "resultType": "complete",
        "supportedVersions": versions,
        "capabilities": tools_capability(r.get("capabilities")),
        "ttlMs": 0,
        "cacheScope": "private",
        "_meta": {"io.modelcontextprotocol/serverInfo": server_info(info)},
    });
    Ok(())
}

/// An error answer to `server/discover` that is -32022 (unsupported protocol
/// version) listing only versions of the initialize era: use one of them, which
/// is `initialize` (rmcp retries only with a modern version, and otherwise
/// fails). Why, if so.
fn supports_only_handshake_versions(error: &Value) -> Option<String> {
    if error.get("code").and_then(Value::as_i64)
        != Some(ErrorCode::UNSUPPORTED_PROTOCOL_VERSION.0.into())
    {
        return None;
    }
    let supported: Vec<&str> = error
        .pointer("/data/supported")?
        .as_array()?
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let handshake = |v: &&str| HANDSHAKE_VERSIONS.iter().any(|h| h.as_str() == *v);
    (!supported.is_empty() && supported.iter().all(handshake)).then(|| {
        format!(
            "server/discover: the server supports only versions of the initialize era ({})",
            clip(&supported.join(", "), 200)
        )
    })
}

/// `{"tools": {...}}` if the capabilities have `tools` at all (with its
/// `listChanged` if a boolean), else `{}`.
fn tools_capability(capabilities: Option<&Value>) -> Value {
    match capabilities.and_then(|c| c.get("tools")) {
        None => json!({}),
        Some(t) => match t.get("listChanged").and_then(Value::as_bool) {
            Some(b) => json!({"tools": {"listChanged": b}}),
            None => json!({"tools": {}}),
        },
    }
}

fn server_info(info: Option<&Value>) -> Value {
    let text = |k: &str| {
        info.and_then(|i| i.get(k))
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string()
    };
    json!({"name": text("name"), "version": text("version")})
}

/// The read side of the server's stdout, shared by the transports of the
/// handshake's starts (rmcp drops a transport whose start failed).
pub struct Reader {
    read: tokio::io::BufReader<tokio::process::ChildStdout>,
    /// The line being read: kept across calls, as rmcp may drop a `receive`
    /// between two reads of one line.
    buf: Vec<u8>,
}

impl Reader {
    pub fn new(stdout: tokio::process::ChildStdout) -> Arc<tokio::sync::Mutex<Reader>> {
        Arc::new(tokio::sync::Mutex::new(Reader {
            read: tokio::io::BufReader::with_capacity(64 * 1024, stdout),
            buf: Vec::new(),
        }))
    }
}

/// The transport rmcp is handed.
pub struct Lines {
    reader: Arc<tokio::sync::Mutex<Reader>>,
    write: Arc<tokio::sync::Mutex<Option<tokio::process::ChildStdin>>>,
    shared: Arc<Shared>,
}

impl Lines {
    pub fn new(
        reader: Arc<tokio::sync::Mutex<Reader>>,
        write: Arc<tokio::sync::Mutex<Option<tokio::process::ChildStdin>>>,
        shared: Arc<Shared>,
    ) -> Lines {
        Lines {
            reader,
            write,
            shared,
        }
    }
}

/// What `Lines::answer` made of a message.
enum Routed {
    /// Not an answer: for rmcp to parse.
    Other,
    /// An answer for rmcp to parse; if it cannot, its request fails at once.
    Parse(RequestId),
    /// An answer whose raw result is kept.
    Kept(RequestId),
    /// An answer the handshake does not wait for, or a late one: dropped.
    Skip,
    /// What rmcp is handed instead.
    Instead(Box<ServerJsonRpcMessage>),
}

impl Lines {
    /// A request of the server's is owed an answer until it is written, or
    /// until the server cancels it (rmcp then answers nothing).
    fn count_owed(&self, msg: &ServerJsonRpcMessage) {
        let mut owed = self.shared.owed.lock().unwrap();
        let changed = match msg {
            JsonRpcMessage::Request(r) => owed.insert(r.id.clone()).then_some(1isize),
            JsonRpcMessage::Notification(n) => match &n.notification {
                ServerNotification::CancelledNotification(c) => c
                    .params
                    .request_id
                    .as_ref()
                    .and_then(|id| owed.remove(id).then_some(-1)),
                _ => None,
            },
            _ => None,
        };
        if let Some(d) = changed {
            self.shared
                .pending
                .send_modify(|n| *n = n.saturating_add_signed(d));
        }
    }

    fn close_with(&self, why: String) {
        *self.shared.closed_with.lock().unwrap() = Some(why);
    }

    /// An answer (a message with an id and no method), its id made rmcp's:
    /// keep the raw result of one to a request in `wanted` and hand rmcp an
    /// empty result in its place (its model of the result is not used, and
    /// parsing it costs more than the rest of a call); read the answers to
    /// `server/discover` and `initialize` leniently, and drop other answers
    /// until they came (rmcp's handshake fails on any other). An `error` wins
    /// over a `result`, as before rmcp.
    fn answer(&self, msg: &mut Value) -> Routed {
        if msg.get("method").is_some() {
            self.subscription_id(msg);
            return Routed::Other;
        }
        let Some(m) = msg.as_object_mut() else {
            return Routed::Other;
        };
        if m.contains_key("error") {
            m.remove("result");
        }
        let mut hs = self.shared.handshake.lock().unwrap();
        let wire = m
            .get("id")
            .and_then(|id| serde_json::from_value::<RequestId>(id.clone()).ok());
        let Some(wire) = wire else {
            // An error with no id (JSON-RPC's answer to a request whose id could
            // not be read): rmcp takes it as the answer to the handshake's
            // request it waits for, so that one waits no more.
            if m.contains_key("error") {
                hs.probe = None;
                hs.initialize = None;
            }
            return Routed::Other;
        };
        let id = match Self::rmcp_id(&hs, wire) {
            Wire::Ours(id) => id,
            Wire::GivenUp => {
                if let Some(r) = m.get_mut("result") {
                    hs.late_modern |= lenient_discover(r).is_ok();
                }
                return Routed::Skip;
            }
        };
        m.insert(
            "id".into(),
            serde_json::to_value(&id).unwrap_or(Value::Null),
        );
        if let Some((probe, _, _)) = &hs.probe {
            if *probe != id {
                return Routed::Skip;
            }
            hs.probe = None;
            let legacy = match m.get_mut("result") {
                Some(result) => lenient_discover(result).err(),
                None => m.get("error").and_then(supports_only_handshake_versions),
            };
            return match legacy {
                Some(why) => Routed::Instead(Box::new(not_modern(why, id))),
                None => Routed::Parse(id),
            };
        }
        if let Some(init) = &hs.initialize {
            if *init != id {
                return Routed::Skip;
            }
            hs.initialize = None;
            if let Some(result) = m.get_mut("result") {
                lenient_initialize(result);
            }
            return Routed::Parse(id);
        }
        drop(hs);
        let mut raw = self.shared.raw.lock().unwrap();
        match m.get_mut("result") {
            Some(result) if raw.wanted.remove(&id) => {
                raw.results.insert(id.clone(), result.take());
                Routed::Kept(id)
            }
            _ => Routed::Parse(id),
        }
    }

    /// A notification of a `subscriptions/listen` stream names the stream by
    /// the listen request's wire id (`_meta`'s `subscriptionId`): rmcp knows
    /// it by its own.
    fn subscription_id(&self, msg: &mut Value) {
        let Some(sid) = msg.pointer_mut("/params/_meta/io.modelcontextprotocol~1subscriptionId")
        else {
            return;
        };
        let Ok(wire) = serde_json::from_value::<RequestId>(sid.clone()) else {
            return;
        };
        if let Wire::Ours(id) = Self::rmcp_id(&self.shared.handshake.lock().unwrap(), wire) {
            *sid = serde_json::to_value(&id).unwrap_or(Value::Null);
        }
    }

    /// rmcp's id for a wire id: the probe's own string, or a number (rmcp
    /// matches the id "3" to the request 3; so does this) plus the probes sent.
    fn rmcp_id(hs: &Handshake, wire: RequestId) -> Wire {
        let n = match &wire {
            RequestId::Number(n) => Some(*n),
            RequestId::String(s) => {
                if let Some((probe, w, _)) = &hs.probe {
                    if **s == **w {
                        return Wire::Ours(probe.clone());
                    }
                }
                if hs.given_up.iter().any(|g| **g == **s) {
                    return Wire::GivenUp;
                }
                s.parse::<i64>().ok()
            }
        };
        match n {
            Some(n) => Wire::Ours(RequestId::Number(n.saturating_add(hs.discovers))),
            None => Wire::Ours(wire),
        }
    }
}

impl Transport<RoleClient> for Lines {
    type Error = std::io::Error;

    fn send(
        &mut self,
        mut item: ClientJsonRpcMessage,
    ) -> impl Future<Output = Result<(), std::io::Error>> + Send + 'static {
        self.shared.outgoing(&mut item);
        let line = serde_json::to_vec(&item).map(|mut l| {
            l.push(b'\n');
            l
        });
        let (write, shared) = (self.write.clone(), self.shared.clone());
        // An answer to the server's request was counted when the request was read.
        let answers = match &item {
            JsonRpcMessage::Response(r) => Some(&r.id),
            JsonRpcMessage::Error(e) => e.id.as_ref(),
            _ => None,
        };
        let owed = answers.is_some_and(|id| shared.owed.lock().unwrap().remove(id));
        if !owed {
            shared.pending.send_modify(|n| *n += 1);
        }
        async move {
            let written = async {
                let line = line?;
                let mut w = write.lock().await;
                let w = w.as_mut().ok_or(std::io::ErrorKind::BrokenPipe)?;
                w.write_all(&line).await?;
                w.flush().await
            }
            .await;
            shared.pending.send_modify(|n| *n = n.saturating_sub(1));
            written
        }
    }

    async fn receive(&mut self) -> Option<ServerJsonRpcMessage> {
        let mut reader = self.reader.lock().await;
        let Reader { read, buf } = &mut *reader;
        loop {
            let mut pending = self.shared.pending.subscribe();
            let _ = pending.wait_for(|n| *n < MAX_PENDING).await;
            let got = match self.shared.probe_deadline() {
                None => resume_line(read, buf, MAX_LINE_BYTES).await,
                // `resume_line` keeps a partial line in `buf`: dropping it
                // for the deadline loses nothing.
                Some(at) => tokio::select! {
                    got = resume_line(read, buf, MAX_LINE_BYTES) => got,
                    _ = tokio::time::sleep_until(at) => match self.shared.give_up_probe() {
                        Some(instead) => return Some(instead),
                        None => continue,
                    },
                },
            };
            match got {
                Ok(Line::Eof | Line::TimedOut) | Err(_) => return None,
                Ok(Line::TooLong) => {
                    self.close_with(format!(
                        "a message longer than {} MiB; closing the connection",
                        MAX_LINE_BYTES >> 20
                    ));
                    return None;
                }
                Ok(Line::Data) => {}
            }
            let line = std::mem::take(buf);
            if line.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            // A line is bounded in what it parses to, too: a line of tiny
            // objects parses to ~100 times its size.
            let (cost, max) = (parse_cost(&line), max_parse_cost(MAX_LINE_BYTES));
            if cost > max {
                self.close_with(format!(
                    "message too large once parsed (about {cost} bytes; at most {max}); closing the connection"
                ));
                return None;
            }
            // What is not JSON-RPC is skipped, as a client does.
            let Ok(mut msg) = serde_json::from_slice::<Value>(&line) else {
                continue;
            };
            drop(line);
            let id = match self.answer(&mut msg) {
                Routed::Kept(id) => {
                    return Some(ServerJsonRpcMessage::response(ServerResult::empty(()), id))
                }
                Routed::Instead(instead) => return Some(*instead),
                Routed::Skip => continue,
                Routed::Parse(id) => Some(id),
                Routed::Other => None,
            };
            match (serde_json::from_value::<ServerJsonRpcMessage>(msg), id) {
                (Ok(JsonRpcMessage::Request(r)), _) if !self.shared.takes(&r.request) => {}
                (Ok(msg), _) => {
                    self.count_owed(&msg);
                    return Some(msg);
                }
                // A malformed answer fails its request now, not at its timeout.
                (Err(e), Some(id)) => {
                    let e = rmcp::ErrorData::internal_error(
                        format!("a malformed answer: {}", clip(&e.to_string(), 200)),
                        None,
                    );
                    return Some(ServerJsonRpcMessage::error(e, Some(id)));
                }
                (Err(_), None) => {}
            }
        }
    }

    fn close(&mut self) -> impl Future<Output = Result<(), std::io::Error>> + Send {
        let write = self.write.clone();
        async move {
            write.lock().await.take();
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn discover_answers_are_modern_only_with_a_modern_version() {
        let mut r = json!({"supportedVersions": ["2026-07-28"], "capabilities": {"tools": {"listChanged": true}},
                           "_meta": {"io.modelcontextprotocol/serverInfo": {"name": "n", "version": "1"}}});
        assert!(lenient_discover(&mut r).is_ok());
        assert_eq!(r["capabilities"], json!({"tools": {"listChanged": true}}));
        assert_eq!(
            r["_meta"]["io.modelcontextprotocol/serverInfo"]["name"],
            "n"
        );
        // rmcp reads what is left.
        let parsed: rmcp::model::DiscoverResult = serde_json::from_value(r).unwrap();
        assert_eq!(parsed.supported_versions, [ProtocolVersion::V_2026_07_28]);
        let mut empty = json!({});
        assert!(lenient_discover(&mut empty)
            .unwrap_err()
            .contains("no supportedVersions"));
        let mut old = json!({"supportedVersions": ["2025-06-18", "2025-11-25"]});
        assert!(lenient_discover(&mut old)
            .unwrap_err()
            .contains("only versions of the initialize era (2025-06-18, 2025-11-25)"));
        // A version after 2026-07-28 is the modern era too (rmcp then finds
        // no version in common, and says so).
        let mut later = json!({"supportedVersions": ["2027-01-01"]});
        assert!(lenient_discover(&mut later).is_ok());
    }

    #[test]
    fn an_unsupported_version_error_naming_only_old_versions_means_initialize() {
        let e = |supported: Value| json!({"code": -32022, "message": "no", "data": {"supported": supported}});
        assert!(
            supports_only_handshake_versions(&e(json!(["2025-11-25", "2025-06-18"])))
                .unwrap()
                .contains("only versions of the initialize era (2025-11-25, 2025-06-18)")
        );
        // A modern version among them: rmcp retries with it, or says none is shared.
        assert_eq!(
            supports_only_handshake_versions(&e(json!(["2025-11-25", "2026-07-28"]))),
            None
        );
        assert_eq!(supports_only_handshake_versions(&e(json!([]))), None);
        assert_eq!(
            supports_only_handshake_versions(&json!({"code": -32601, "message": "no"})),
            None
        );
    }

    #[test]
    fn wire_ids_skip_the_probes() {
        let hs = Handshake {
            discovers: 1,
            probe: Some((RequestId::Number(0), "scriptgate-discover-0-0".into(), None)),
            given_up: vec!["scriptgate-discover-0-9".into()],
            ..Default::default()
        };
        assert_eq!(hs.to_wire(&RequestId::Number(1)), RequestId::Number(0));
        let ours = |w: RequestId| match Lines::rmcp_id(&hs, w) {
            Wire::Ours(id) => Some(id),
            Wire::GivenUp => None,
        };
        assert_eq!(ours(RequestId::Number(0)), Some(RequestId::Number(1)));
        assert_eq!(
            ours(RequestId::String("4".into())),
            Some(RequestId::Number(5))
        );
        assert_eq!(
            ours(RequestId::String("scriptgate-discover-0-0".into())),
            Some(RequestId::Number(0))
        );
        assert_eq!(
            ours(RequestId::String("scriptgate-discover-0-9".into())),
            None
        );
        assert_eq!(
            ours(RequestId::String("x".into())),
            Some(RequestId::String("x".into()))
        );
    }
}
