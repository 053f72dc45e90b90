//! The MCP client of `scriptgate run | tools | describe | mcp`: rmcp's (the
//! official Rust SDK) over a server's stdio, with scriptgate's bounds on what a
//! server sends: initialize, tools/list (all pages), tools/call, cancellation.
//! It keeps tools as raw JSON so that every annotation the server publishes
//! (readOnlyHint, destructiveHint, execution.taskSupport) is seen.

use crate::protocol::framing::{clip, parse_cost, resume_line, Line};
use crate::protocol::rpc::max_parse_cost;
use crate::protocol::snapshot::{ToolClass, ToolSpec};
use crate::protocol::ToolResult;
use crate::script::engine::LinkError;
use rmcp::model::{
    CallToolRequest, CallToolRequestParams, CancelledNotificationParam, ClientCapabilities,
    ClientConfig, ClientJsonRpcMessage, ClientRequest, ElicitRequestParams, ElicitResult,
    ElicitationCreateRequestMethod, Implementation, JsonRpcMessage, ListToolsRequest,
    PaginatedRequestParams, ProtocolVersion, RequestId, ServerJsonRpcMessage, ServerNotification,
    ServerResult,
};
// MCP's next version drops roots (SEP-2577); the servers of 2025-06-18 that
// scriptgate speaks to may still ask for them.
#[allow(deprecated)]
use rmcp::model::{ListRootsResult, Root};
use rmcp::service::{
    serve_client_with_lifecycle, ClientInitializeError, ClientLifecycleMode, NotificationContext,
    PeerRequestOptions, RequestContext, RoleClient, RunningService, ServiceError,
};
use rmcp::transport::Transport;
use rmcp::ClientHandler;
use serde_json::{json, Value};
use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[derive(Debug, thiserror::Error)]
pub enum McpError {
    #[error("MCP server {name}: {message}")]
    Server { name: String, message: String },
    #[error("--mcp {0:?}: expected NAME=COMMAND (NAME: letters, digits, _ and -)")]
    Spec(String),
}

/// A `--mcp NAME=COMMAND` argument.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerSpec {
    pub name: String,
    pub argv: Vec<String>,
}

impl std::str::FromStr for ServerSpec {
    type Err = McpError;
    fn from_str(s: &str) -> Result<Self, McpError> {
        let (name, cmd) = s.split_once('=').ok_or_else(|| McpError::Spec(s.into()))?;
        let ok_name = !name.is_empty()
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
            && !name.contains("__");
        let argv = shlex::split(cmd)
            .filter(|a| !a.is_empty())
            .ok_or_else(|| McpError::Spec(s.into()))?;
        if !ok_name {
            return Err(McpError::Spec(s.into()));
        }
        Ok(ServerSpec {
            name: name.into(),
            argv,
        })
    }
}

/// The class of a tool from its MCP annotations, with the MCP spec's defaults:
/// `execution.taskSupport: "required"` → long_task; `readOnlyHint: true` → read;
/// otherwise `destructiveHint` (default true) → destructive; otherwise write.
pub fn class_of(tool: &Value) -> ToolClass {
    if tool
        .pointer("/execution/taskSupport")
        .and_then(Value::as_str)
        == Some("required")
    {
        return ToolClass::LongTask;
    }
    let hint = |k: &str| {
        tool.get("annotations")
            .and_then(|a| a.get(k))
            .and_then(Value::as_bool)
    };
    if hint("readOnlyHint") == Some(true) {
        ToolClass::Read
    } else if hint("destructiveHint").unwrap_or(true) {
        ToolClass::Destructive
    } else {
        ToolClass::Write
    }
}

/// The snapshot entry for one listed MCP tool, and a warning for the user when the
/// tool's schema had to be replaced.
///
/// The daemon checks a script's arguments against the schema as a closed one (a key
/// the schema does not declare is refused; see `policy::closed_schema`), so the
/// server's `inputSchema` is passed on as it is. Two cases need a decision:
/// - no `inputSchema` (the MCP spec requires one): the tool declares no arguments, so
///   it gets `{"type": "object", "properties": {}}` and scripts may call it with `{}`
///   only;
/// - an `inputSchema` that does not compile as JSON Schema 2020-12: the arguments
///   cannot be checked, so a `read` or `write` tool is switched off for scripts
///   (`enabled: false`); a `destructive` or `long_task` tool, never called from a
///   script anyway, just goes without a schema.
pub fn tool_spec(full: String, tool: &Value, class: ToolClass) -> (ToolSpec, Option<String>) {
    let callable = matches!(class, ToolClass::Read | ToolClass::Write);
    let (input_schema, enabled, warning) = match tool.get("inputSchema").filter(|s| !s.is_null())
    {
        None => (
            Some(json!({"type": "object", "properties": {}})),
            true,
            callable.then(|| {
                format!("{full}: the server gives no input schema; scripts may call it with no arguments only")
            }),
        ),
        Some(s) => match jsonschema::draft202012::new(s) {
            Ok(_) => (Some(s.clone()), true, None),
            Err(e) if callable => (
                None,
                false,
                Some(format!(
                    "{full}: its input schema does not compile ({e}); its arguments cannot be checked, so scripts cannot call it"
                )),
            ),
            Err(_) => (None, true, None),
        },
    };
    let spec = ToolSpec {
        name: full,
        class,
        enabled,
        input_schema,
        frozen: Default::default(),
        description: tool
            .get("description")
            .and_then(Value::as_str)
            .map(str::to_string),
    };
    (spec, warning)
}

/// The longest line an MCP server may send (a `tools/list` page of a large
/// server fits many times over); a longer one ends the connection.
pub const MAX_LINE_BYTES: usize = 64 << 20;

fn cursor_hash(c: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    c.hash(&mut h);
    h.finish()
}

/// The most `tools/list` pages read from one server.
pub const MAX_TOOL_PAGES: usize = 1000;
/// The most tools taken from one server.
pub const MAX_TOOLS: usize = 100_000;
/// The most bytes of `tools/list` pages taken from one server (as re-serialised).
pub const MAX_TOOLS_BYTES: usize = 256 << 20;

/// The raw `result` of each answer to a `tools/list` or `tools/call` of ours,
/// by request id, from when the answer is read until its caller takes it (or
/// drops the call). rmcp parses every result into its model, whose `Tool` has no
/// `execution` (MCP 2025-11-25's `taskSupport`, which makes a tool `long_task`,
/// never callable): the raw page keeps every field a server publishes, and a
/// call's result reaches `ToolResult::from_mcp` as the server wrote it.
#[derive(Default)]
struct Raw {
    /// Requests written and not answered yet whose results are kept.
    wanted: HashSet<RequestId>,
    results: HashMap<RequestId, Value>,
    /// Calls dropped before rmcp wrote them: not `wanted` when it does.
    abandoned: HashSet<RequestId>,
    /// Our `initialize`, whose answer is read leniently (`lenient_initialize`).
    initialize: Option<RequestId>,
}

/// Entries of `Raw::abandoned`, at most (they leave it when rmcp writes the
/// request, which it does unless the connection ended).
const MAX_ABANDONED: usize = 4096;

/// What the transport and the calls share.
struct Shared {
    raw: Mutex<Raw>,
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
    /// The call was answered (or failed): its raw result, if it had one.
    fn take(&self, id: &RequestId) -> Option<Value> {
        let mut raw = self.raw.lock().unwrap();
        raw.wanted.remove(id);
        raw.results.remove(id)
    }

    /// The call was dropped: forget it, written or not.
    fn abandon(&self, id: RequestId) {
        let mut raw = self.raw.lock().unwrap();
        if !raw.wanted.remove(&id) && raw.results.remove(&id).is_none() {
            if raw.abandoned.len() >= MAX_ABANDONED {
                raw.abandoned.clear();
            }
            raw.abandoned.insert(id);
        }
    }
}

/// The protocol versions scriptgate's client takes from a server's `initialize`
/// answer: those of the `initialize` handshake (2026-07-28 has none, and rmcp
/// would switch to its rules).
const VERSIONS: [ProtocolVersion; 4] = [
    ProtocolVersion::V_2024_11_05,
    ProtocolVersion::V_2025_03_26,
    ProtocolVersion::V_2025_06_18,
    ProtocolVersion::V_2025_11_25,
];

/// The answer to our `initialize`, as the client before rmcp read it: only the
/// `tools` capability counts, whatever its value (its `listChanged` if a
/// boolean), a missing `protocolVersion` or `serverInfo` is no error, and the
/// rest (`instructions`, other capabilities) is not kept. rmcp's model requires
/// all three and refuses a malformed capability that scriptgate never uses.
fn lenient_initialize(result: &mut Value) {
    let Some(r) = result.as_object() else { return };
    let text = |v: Option<&Value>| v.and_then(Value::as_str).unwrap_or("").to_string();
    let tools = r.get("capabilities").and_then(|c| c.get("tools")).map(|t| {
        match t.get("listChanged").and_then(Value::as_bool) {
            Some(b) => json!({ "listChanged": b }),
            None => json!({}),
        }
    });
    let version = match r.get("protocolVersion").and_then(Value::as_str) {
        Some(v) => v.to_string(),
        None => ProtocolVersion::V_2025_06_18.to_string(),
    };
    let info = r.get("serverInfo");
    *result = json!({
        "protocolVersion": version,
        "capabilities": tools.map(|t| json!({ "tools": t })).unwrap_or(json!({})),
        "serverInfo": {
            "name": text(info.and_then(|i| i.get("name"))),
            "version": text(info.and_then(|i| i.get("version"))),
        },
    });
}

/// The server's requests not yet answered and messages not yet written to it,
/// at most, before its stdout is read again.
const MAX_PENDING: usize = 1024;

/// rmcp's transport over the server's stdio: newline-delimited JSON-RPC with
/// scriptgate's bounds. rmcp's own stdio transport drops a line over 16 MiB and
/// reads on, so the request it answered waits for its timeout; here a line over
/// `MAX_LINE_BYTES`, or one that would parse to too much memory, ends the
/// connection and fails what waits with the reason.
struct Lines {
    read: tokio::io::BufReader<tokio::process::ChildStdout>,
    /// The line being read: kept across calls, as rmcp may drop a `receive`
    /// between two reads of one line.
    buf: Vec<u8>,
    write: Arc<tokio::sync::Mutex<Option<tokio::process::ChildStdin>>>,
    shared: Arc<Shared>,
}

/// What `Lines::answer` made of a message.
enum Answer {
    /// Not an answer: for rmcp to parse.
    Other,
    /// An answer for rmcp to parse; if it cannot, its request fails at once.
    Parse(RequestId),
    /// An answer whose raw result is kept.
    Kept(RequestId),
    /// An answer before the answer to `initialize`: dropped.
    Skip,
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

    /// An answer (a message with an id and no method): keep the raw result of
    /// one to a request in `wanted` and hand rmcp an empty result in its place
    /// (its model of the result is not used, and parsing it costs more than the
    /// rest of a call); read the answer to `initialize` leniently, and drop
    /// other answers until it came (rmcp's handshake takes any answer as its).
    /// An `error` wins over a `result`, as before rmcp.
    fn answer(&self, msg: &mut Value) -> Answer {
        if msg.get("method").is_some() {
            return Answer::Other;
        }
        let Some(id) = msg.get("id").cloned() else {
            return Answer::Other;
        };
        let Ok(mut id) = serde_json::from_value::<RequestId>(id) else {
            return Answer::Other;
        };
        // rmcp matches the id "3" to the request 3; so does this.
        if let RequestId::String(s) = &id {
            if let Ok(n) = s.parse::<i64>() {
                id = RequestId::Number(n);
            }
        }
        let Some(m) = msg.as_object_mut() else {
            return Answer::Other;
        };
        if m.contains_key("error") {
            m.remove("result");
        }
        let mut raw = self.shared.raw.lock().unwrap();
        if let Some(init) = &raw.initialize {
            if *init != id {
                return Answer::Skip;
            }
            raw.initialize = None;
            if let Some(result) = m.get_mut("result") {
                lenient_initialize(result);
            }
            return Answer::Parse(id);
        }
        match m.get_mut("result") {
            Some(result) if raw.wanted.remove(&id) => {
                raw.results.insert(id.clone(), result.take());
                Answer::Kept(id)
            }
            _ => Answer::Parse(id),
        }
    }
}

impl Transport<RoleClient> for Lines {
    type Error = std::io::Error;

    fn send(
        &mut self,
        item: ClientJsonRpcMessage,
    ) -> impl Future<Output = Result<(), std::io::Error>> + Send + 'static {
        if let JsonRpcMessage::Request(r) = &item {
            let mut raw = self.shared.raw.lock().unwrap();
            match r.request {
                ClientRequest::ListToolsRequest(_) | ClientRequest::CallToolRequest(_)
                    if !raw.abandoned.remove(&r.id) =>
                {
                    raw.wanted.insert(r.id.clone());
                }
                ClientRequest::InitializeRequest(_) => raw.initialize = Some(r.id.clone()),
                _ => {}
            }
        }
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
            shared.pending.send_modify(|n| *n -= 1);
            written
        }
    }

    async fn receive(&mut self) -> Option<ServerJsonRpcMessage> {
        loop {
            let mut pending = self.shared.pending.subscribe();
            let _ = pending.wait_for(|n| *n < MAX_PENDING).await;
            match resume_line(&mut self.read, &mut self.buf, MAX_LINE_BYTES).await {
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
            let line = std::mem::take(&mut self.buf);
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
            let answer = self.answer(&mut msg);
            let id = match answer {
                Answer::Kept(id) => {
                    return Some(ServerJsonRpcMessage::response(ServerResult::empty(()), id))
                }
                Answer::Skip => continue,
                Answer::Parse(id) => Some(id),
                Answer::Other => None,
            };
            match (serde_json::from_value::<ServerJsonRpcMessage>(msg), id) {
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

/// What scriptgate serves of a server's requests (`ping`, by rmcp, and
/// `roots/list`) and notifications (`notifications/tools/list_changed`).
struct Client {
    roots: Vec<String>,
    tools_changed: Arc<tokio::sync::Notify>,
}

impl ClientHandler for Client {
    #[allow(deprecated)]
    async fn list_roots(
        &self,
        _: RequestContext<RoleClient>,
    ) -> Result<ListRootsResult, rmcp::ErrorData> {
        Ok(ListRootsResult::new(
            self.roots
                .iter()
                .map(|r| Root::new(format!("file://{r}")).with_name(r.clone()))
                .collect(),
        ))
    }

    /// Not a capability of ours: refused as any method scriptgate does not serve
    /// (rmcp's default declines, as if a user had).
    async fn create_elicitation(
        &self,
        _: ElicitRequestParams,
        _: RequestContext<RoleClient>,
    ) -> Result<ElicitResult, rmcp::ErrorData> {
        Err(rmcp::ErrorData::method_not_found::<
            ElicitationCreateRequestMethod,
        >())
    }

    /// A changed tool list wakes whoever watches `Server::tools_changed`.
    async fn on_tool_list_changed(&self, _: NotificationContext<RoleClient>) {
        self.tools_changed.notify_one();
    }

    /// No capability: no `roots` (see `Server::start`), no sampling, no
    /// elicitation.
    fn get_info(&self) -> ClientConfig {
        ClientConfig::new(
            ClientCapabilities::default(),
            Implementation::new("scriptgate", env!("CARGO_PKG_VERSION")),
        )
        .with_protocol_version(ProtocolVersion::V_2025_06_18)
    }
}

/// A call that is dropped unanswered (its script ended) is cancelled at the
/// server too, as MCP's cancellation says, and its raw result is forgotten.
struct Abandon<'a> {
    server: &'a Server,
    id: Option<RequestId>,
    reason: &'static str,
}

impl Abandon<'_> {
    /// The call was answered (or failed): take its raw result.
    fn answered(mut self) -> Option<Value> {
        let id = self.id.take()?;
        self.server.shared.take(&id)
    }
}

impl Drop for Abandon<'_> {
    /// The cancel is sent by a task of its own: writing it may wait on a server
    /// that does not read, which no call waits for.
    fn drop(&mut self) {
        let Some(id) = self.id.take() else { return };
        self.server.shared.abandon(id.clone());
        let peer = self.server.service.peer().clone();
        let cancel = CancelledNotificationParam::new(Some(id), Some(self.reason.into()));
        self.server.cancels.spawn(async move {
            let _ = peer.notify_cancelled(cancel).await;
        });
    }
}

/// One running MCP server.
pub struct Server {
    pub name: String,
    service: RunningService<RoleClient, Client>,
    shared: Arc<Shared>,
    /// The server's stdin, closed at shutdown (rmcp's close waits on a write
    /// that a server which does not read never lets finish).
    stdin: Arc<tokio::sync::Mutex<Option<tokio::process::ChildStdin>>>,
    /// The cancels of abandoned calls, sent before the server is shut down.
    cancels: tokio_util::task::TaskTracker,
    child: tokio::sync::Mutex<tokio::process::Child>,
    pgid: Option<i32>,
    stderr_tail: Arc<Mutex<Vec<u8>>>,
    pub call_timeout: Duration,
    /// Woken when the server says its tool list changed.
    pub tools_changed: Arc<tokio::sync::Notify>,
}

/// Keep the last 4 KiB of what the server writes on stderr (for error messages).
/// The task ends when stderr closes: a failed start waits for it, so that what
/// a server printed just before it exited is in the error.
fn keep_stderr_tail(
    mut stderr: tokio::process::ChildStderr,
) -> (Arc<Mutex<Vec<u8>>>, tokio::task::JoinHandle<()>) {
    let stderr_tail = Arc::new(Mutex::new(Vec::new()));
    let tail = stderr_tail.clone();
    let reader = tokio::spawn(async move {
        let mut buf = [0u8; 4096];
        while let Ok(n) = stderr.read(&mut buf).await {
            if n == 0 {
                break;
            }
            let mut t = tail.lock().unwrap();
            t.extend_from_slice(&buf[..n]);
            let excess = t.len().saturating_sub(4096);
            t.drain(..excess);
        }
    });
    (stderr_tail, reader)
}

/// End a server that never finished its handshake, and what it left running
/// (npx → node): its process group is killed (`kill_on_drop` ends the server
/// itself only). First its stderr is read to its end, for up to a second (a
/// server that exits closes it), so that the error has what it printed last.
async fn end_group(pgid: Option<i32>, mut stderr_read: tokio::task::JoinHandle<()>) {
    let read = tokio::time::timeout(Duration::from_secs(1), &mut stderr_read).await;
    if let Some(pg) = pgid {
        let _ = crate::sys::signal_group(pg, crate::sys::GroupSignal::Kill);
    }
    if read.is_err() {
        let _ = tokio::time::timeout(Duration::from_millis(200), stderr_read).await;
    }
}

fn stderr_note(tail: &Mutex<Vec<u8>>) -> String {
    let t = tail.lock().unwrap();
    let s = String::from_utf8_lossy(&t);
    let s = s.trim();
    if s.is_empty() {
        return String::new();
    }
    let last: Vec<&str> = s.lines().rev().take(5).collect();
    let last: Vec<&str> = last.into_iter().rev().collect();
    format!("; its stderr ends with: {}", last.join(" | "))
}

impl Server {
    /// Start the server and run MCP's `initialize` handshake (rmcp's client).
    /// No `roots` capability is advertised (a server such as server-filesystem
    /// would then trade the directories on its command line for ours); `roots`
    /// only answers a server that asks anyway.
    pub async fn start(
        spec: &ServerSpec,
        roots: Vec<String>,
        call_timeout: Duration,
    ) -> Result<Server, McpError> {
        let err = |message: String| McpError::Server {
            name: spec.name.clone(),
            message,
        };
        let mut cmd = tokio::process::Command::new(&spec.argv[0]);
        cmd.args(&spec.argv[1..])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        // Its own process group, so that shutdown also reaches what it spawned (npx → node).
        cmd.process_group(0);
        let mut child = cmd
            .spawn()
            .map_err(|e| err(format!("cannot start {:?}: {e}", spec.argv[0])))?;
        let pgid = child.id().map(|p| p as i32);
        let stdin = child.stdin.take().expect("piped");
        let stdout = child.stdout.take().expect("piped");
        let (stderr_tail, stderr_read) = keep_stderr_tail(child.stderr.take().expect("piped"));
        let shared = Arc::new(Shared {
            raw: Default::default(),
            closed_with: Default::default(),
            owed: Default::default(),
            pending: tokio::sync::watch::Sender::new(0),
        });
        let stdin = Arc::new(tokio::sync::Mutex::new(Some(stdin)));
        let transport = Lines {
            read: tokio::io::BufReader::with_capacity(64 * 1024, stdout),
            buf: Vec::new(),
            write: stdin.clone(),
            shared: shared.clone(),
        };
        let tools_changed = Arc::new(tokio::sync::Notify::new());
        let client = Client {
            roots,
            tools_changed: tools_changed.clone(),
        };
        let started = tokio::time::timeout(
            Duration::from_secs(60),
            serve_client_with_lifecycle(client, transport, ClientLifecycleMode::Initialize),
        )
        .await;
        let service = match started {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                let why = shared.closed_with.lock().unwrap().clone();
                let why = why.unwrap_or_else(|| match e {
                    ClientInitializeError::ConnectionClosed(_) => {
                        "the server exited (or closed its stdout)".into()
                    }
                    e => clip(&e.to_string(), 300),
                });
                end_group(pgid, stderr_read).await;
                return Err(err(format!(
                    "initialize failed: {why}{}",
                    stderr_note(&stderr_tail)
                )));
            }
            Err(_) => {
                end_group(pgid, stderr_read).await;
                return Err(err(format!(
                    "initialize failed: no answer within 60 s{}",
                    stderr_note(&stderr_tail)
                )));
            }
        };
        let info = service.peer_info();
        let offers_tools = info
            .as_ref()
            .is_some_and(|i| i.capabilities.tools.is_some());
        let version = info.map(|i| i.protocol_version.clone());
        let server = Server {
            name: spec.name.clone(),
            service,
            shared,
            stdin,
            cancels: Default::default(),
            child: tokio::sync::Mutex::new(child),
            pgid,
            stderr_tail,
            call_timeout,
            tools_changed,
        };
        if let Some(v) = version.filter(|v| !VERSIONS.contains(v)) {
            server.shutdown().await;
            return Err(err(format!(
                "initialize: the server answered with MCP version {}, which scriptgate does not speak \
                 (it asks for {}, and takes {} to {})",
                clip(v.as_str(), 100),
                ProtocolVersion::V_2025_06_18,
                VERSIONS[0],
                VERSIONS[VERSIONS.len() - 1]
            )));
        }
        if !offers_tools {
            server.shutdown().await;
            return Err(err("the server offers no tools".into()));
        }
        Ok(server)
    }

    /// Send one request; its raw result.
    async fn request(&self, request: ClientRequest, timeout: Duration) -> Result<Value, LinkError> {
        let name = &self.name;
        let failed = |e: ServiceError| match e {
            ServiceError::McpError(e) => format!("MCP server {name}: {}", clip(&e.message, 4096)),
            ServiceError::TransportClosed | ServiceError::TransportSend(_) => {
                match self.shared.closed_with.lock().unwrap().clone() {
                    Some(why) => format!("MCP server {name}: {why}"),
                    None => format!("MCP server {name} exited{}", stderr_note(&self.stderr_tail)),
                }
            }
            e => format!("MCP server {name}: {}", clip(&e.to_string(), 300)),
        };
        let handle = self
            .service
            .peer()
            .send_request_with_option(request, PeerRequestOptions::no_options())
            .await
            .map_err(|e| LinkError::Answered(failed(e)))?;
        let mut guard = Abandon {
            server: self,
            id: Some(handle.id.clone()),
            reason: "the script that made the call ended",
        };
        // Our timeout, not rmcp's: rmcp's waits until its cancel is written,
        // which a server that does not read never lets happen; the guard sends
        // the cancel without anyone waiting on it.
        let Ok(answer) = tokio::time::timeout(timeout, handle.await_response()).await else {
            guard.reason = "timeout";
            return Err(LinkError::Answered(format!(
                "MCP server {name} did not answer within {} s",
                timeout.as_secs()
            )));
        };
        let raw = guard.answered();
        match answer {
            Ok(_) => raw.ok_or_else(|| {
                LinkError::Answered(format!(
                    "MCP server {name}: an answer whose result scriptgate could not read"
                ))
            }),
            Err(e) => Err(LinkError::Answered(failed(e))),
        }
    }

    /// All tools, following `nextCursor` for at most `MAX_TOOL_PAGES` pages,
    /// `MAX_TOOLS` tools and `MAX_TOOLS_BYTES`: a server whose cursor never ends, or comes back to a
    /// page already read, gets an error, not a CLI that hangs or grows.
    pub async fn list_tools(&self) -> Result<Vec<Value>, McpError> {
        let err = |message: String| McpError::Server {
            name: self.name.clone(),
            message,
        };
        let mut out = Vec::new();
        let mut bytes = 0usize;
        let mut seen = std::collections::HashSet::new();
        let mut cursor: Option<String> = None;
        for _ in 0..MAX_TOOL_PAGES {
            let params = PaginatedRequestParams::default().with_cursor(cursor.take());
            let r = self
                .request(
                    ClientRequest::ListToolsRequest(ListToolsRequest::with_param(params)),
                    Duration::from_secs(60),
                )
                .await
                .map_err(|e| err(format!("tools/list: {e}")))?;
            bytes += r.to_string().len();
            if bytes > MAX_TOOLS_BYTES {
                return Err(err(format!(
                    "tools/list: more than {} MiB of pages; scriptgate takes at most that much from one server",
                    MAX_TOOLS_BYTES >> 20
                )));
            }
            out.extend(
                r.get("tools")
                    .and_then(Value::as_array)
                    .cloned()
                    .unwrap_or_default(),
            );
            if out.len() > MAX_TOOLS {
                return Err(err(format!(
                    "tools/list: more than {MAX_TOOLS} tools; scriptgate takes at most that many from one server"
                )));
            }
            match r.get("nextCursor").filter(|c| !c.is_null()) {
                None => return Ok(out),
                Some(Value::String(c)) => {
                    // Kept as hashes: a server's cursors may be long.
                    if !seen.insert(cursor_hash(c)) {
                        return Err(err(format!(
                            "tools/list: nextCursor {c:?} came back after {} pages; the server's pages go round in a circle",
                            seen.len()
                        )));
                    }
                    cursor = Some(c.clone());
                }
                Some(c) => {
                    return Err(err(format!(
                        "tools/list: nextCursor {} is not a string (MCP's cursors are)",
                        clip(&c.to_string(), 200)
                    )))
                }
            }
        }
        Err(err(format!(
            "tools/list: nextCursor did not end within {MAX_TOOL_PAGES} pages ({} tools so far); scriptgate reads at most that many pages",
            out.len()
        )))
    }

    pub async fn call(&self, tool: &str, arguments: Value) -> Result<ToolResult, LinkError> {
        let mut params = CallToolRequestParams::new(tool.to_string());
        match arguments {
            Value::Object(a) => params = params.with_arguments(a),
            Value::Null => {}
            other => {
                return Err(LinkError::Answered(format!(
                    "{tool}: the arguments of an MCP tool are an object, not {other}"
                )))
            }
        }
        let r = self
            .request(
                ClientRequest::CallToolRequest(CallToolRequest::new(params)),
                self.call_timeout,
            )
            .await?;
        Ok(ToolResult::from_mcp(&r))
    }

    /// Send the cancels still owed, close stdin, give the server a moment, then
    /// end its process group.
    pub async fn shutdown(&self) {
        self.cancels.close();
        let _ = tokio::time::timeout(Duration::from_millis(500), self.cancels.wait()).await;
        if let Ok(mut stdin) = self.stdin.try_lock() {
            stdin.take();
        }
        self.service.cancellation_token().cancel();
        let mut child = self.child.lock().await;
        if tokio::time::timeout(Duration::from_millis(500), child.wait())
            .await
            .is_err()
        {
            if let Some(pg) = self.pgid {
                let _ = crate::sys::signal_group(pg, crate::sys::GroupSignal::Terminate);
            }
            if tokio::time::timeout(Duration::from_secs(2), child.wait())
                .await
                .is_err()
            {
                let _ = child.start_kill();
                let _ = child.wait().await;
            }
        }
        if let Some(pg) = self.pgid {
            let _ = crate::sys::signal_group(pg, crate::sys::GroupSignal::Kill);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The one table of MCP tools and their snapshot entries that both clients
    /// (`Tool.from_mcp`, `toolFromMcp`) are tested on too.
    #[test]
    fn the_shared_table_of_mcp_tools_maps_as_the_clients_do() {
        let table: Value =
            serde_json::from_str(include_str!("../../tests/fixtures/mcp-tools.json")).unwrap();
        let cases = table["cases"].as_array().unwrap();
        assert!(cases.len() >= 10);
        for c in cases {
            let what = c["what"].as_str().unwrap();
            let server = c["server"].as_str().unwrap();
            let spec = format!("{server}=cmd").parse::<ServerSpec>();
            if c["error"] == true {
                assert!(spec.is_err(), "{what}");
                continue;
            }
            let spec = spec.unwrap_or_else(|e| panic!("{what}: {e}"));
            let tool = &c["tool"];
            let full = format!("{}__{}", spec.name, tool["name"].as_str().unwrap());
            let (entry, _) = tool_spec(full, tool, class_of(tool));
            let got = json!({
                "name": entry.name,
                "class": entry.class.as_str(),
                "enabled": entry.enabled,
                "input_schema": entry.input_schema,
                "description": entry.description,
            });
            assert_eq!(got, c["expect"], "{what}");
        }
    }

    #[test]
    fn classes_follow_annotations_and_spec_defaults() {
        assert_eq!(
            class_of(&json!({"annotations": {"readOnlyHint": true}})),
            ToolClass::Read
        );
        assert_eq!(
            class_of(&json!({"annotations": {"readOnlyHint": false, "destructiveHint": false}})),
            ToolClass::Write
        );
        assert_eq!(
            class_of(&json!({"annotations": {"readOnlyHint": false}})),
            ToolClass::Destructive
        );
        assert_eq!(
            class_of(&json!({})),
            ToolClass::Destructive,
            "no annotations: the spec's defaults"
        );
        assert_eq!(
            class_of(
                &json!({"annotations": {"readOnlyHint": true}, "execution": {"taskSupport": "required"}})
            ),
            ToolClass::LongTask
        );
        assert_eq!(
            class_of(
                &json!({"annotations": {"readOnlyHint": true}, "execution": {"taskSupport": "optional"}})
            ),
            ToolClass::Read
        );
    }

    #[test]
    fn tool_specs_keep_the_schema_and_decide_when_there_is_none() {
        let schema = json!({"type": "object", "properties": {"tz": {"type": "string"}}});
        let (s, w) = tool_spec(
            "t__now".into(),
            &json!({"name": "now", "inputSchema": schema}),
            ToolClass::Read,
        );
        assert_eq!((s.input_schema, s.enabled, w), (Some(schema), true, None));
        // No inputSchema: no arguments.
        let (s, w) = tool_spec("t__ping".into(), &json!({"name": "ping"}), ToolClass::Read);
        assert_eq!(
            s.input_schema,
            Some(json!({"type": "object", "properties": {}}))
        );
        assert!(s.enabled);
        assert!(w.unwrap().contains("no arguments only"));
        let (_, w) = tool_spec(
            "t__rm".into(),
            &json!({"name": "rm"}),
            ToolClass::Destructive,
        );
        assert_eq!(w, None, "never called from a script: nothing to warn about");
        // A schema that does not compile: not callable from scripts.
        let bad = json!({"name": "x", "inputSchema": {"type": 12}});
        let (s, w) = tool_spec("t__x".into(), &bad, ToolClass::Write);
        assert_eq!((s.input_schema, s.enabled), (None, false));
        assert!(w.unwrap().contains("scripts cannot call it"));
        let (s, w) = tool_spec("t__x".into(), &bad, ToolClass::LongTask);
        assert_eq!((s.input_schema, s.enabled, w), (None, true, None));
        // Whatever the case, the snapshot built from them is accepted.
        let tools: Vec<ToolSpec> = [
            tool_spec("a__1".into(), &json!({}), ToolClass::Read).0,
            tool_spec("a__2".into(), &bad, ToolClass::Read).0,
            tool_spec("a__3".into(), &bad, ToolClass::Destructive).0,
        ]
        .into();
        let snap = crate::protocol::snapshot::parse_snapshot(
            json!({"workspace": "/w", "permission_mode": "auto", "tools": tools}),
        )
        .unwrap();
        assert!(crate::policy::Policy::plan(&snap, &[]).is_ok());
    }

    #[test]
    fn results_join_text_and_name_other_content() {
        let r = ToolResult::from_mcp(&json!({"content": [
            {"type": "text", "text": "hello"},
            {"type": "image", "mimeType": "image/png", "data": "AAECAw=="},
            {"type": "resource_link", "uri": "file:///x"},
            {"type": "resource", "resource": {"uri": "mem://a", "mimeType": "application/gzip", "blob": "AAAA"}},
            {"type": "resource", "resource": {"uri": "mem://b", "text": "inline"}}
        ], "structuredContent": {"a": 1}, "isError": true}));
        assert_eq!(r.text, "hello\n[image/png, 4 bytes]\n[resource link file:///x]\n[application/gzip, 3 bytes, mem://a]\ninline");
        assert_eq!(r.structured, Some(json!({"a": 1})));
        assert!(r.is_error);
    }

    #[test]
    fn server_specs_split_like_a_shell() {
        let s: ServerSpec = "fs=npx -y '@modelcontextprotocol/server-filesystem' \"/srv/my dir\""
            .parse()
            .unwrap();
        assert_eq!(s.name, "fs");
        assert_eq!(
            s.argv,
            [
                "npx",
                "-y",
                "@modelcontextprotocol/server-filesystem",
                "/srv/my dir"
            ]
        );
        assert!("noequals".parse::<ServerSpec>().is_err());
        assert!(
            "a__b=cmd".parse::<ServerSpec>().is_err(),
            "__ separates server and tool names"
        );
        assert!("x=".parse::<ServerSpec>().is_err());
    }
}
