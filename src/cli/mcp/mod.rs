//! The MCP client of `scriptgate run | tools | describe | mcp`: rmcp's (the
//! official Rust SDK) over a server's stdio, with scriptgate's bounds on what a
//! server sends (`transport`). It reaches servers of both eras: it probes with
//! `server/discover` (MCP 2026-07-28, per-request `_meta`, no handshake) and
//! falls back to `initialize` (2024-11-05 to 2025-11-25) for a server that
//! does not answer it as 2026-07-28 does, within `PROBE_TIMEOUT` (rmcp's
//! `ClientLifecycleMode::Auto`, its wait shortened by the transport). Then
//! tools/list (all pages) and tools/call, a call answered with a task driven to
//! its end (`task`), cancellation. It keeps tools as raw JSON so that every
//! annotation the server publishes (readOnlyHint, destructiveHint,
//! execution.taskSupport) is seen.

mod task;
mod transport;

use crate::policy::admit::{self, LeftOut};
use crate::protocol::framing::clip;
use crate::protocol::snapshot::{ToolClass, ToolSpec};
use crate::protocol::ToolResult;
use crate::script::engine::LinkError;
use rmcp::model::{
    CallToolRequest, CallToolRequestParams, CancelTaskParams, CancelTaskRequest,
    CancelledNotificationParam, ClientCapabilities, ClientConfig, ClientRequest,
    ElicitRequestParams, ElicitResult, ElicitationCreateRequestMethod, ErrorCode, GetTaskParams,
    GetTaskRequest, Implementation, ListToolsRequest, PaginatedRequestParams, ProtocolVersion,
    RequestId, ServerNotification, SubscriptionFilter,
};
// MCP 2026-07-28 drops roots (SEP-2577); the servers of 2025-06-18 that
// scriptgate speaks to may still ask for them.
#[allow(deprecated)]
use rmcp::model::{ListRootsResult, Root};
use rmcp::service::{
    serve_client_with_lifecycle, ClientInitializeError, ClientLifecycleMode, NotificationContext,
    PeerRequestOptions, RequestContext, RoleClient, RunningService, ServiceError,
};
use rmcp::ClientHandler;
use serde_json::{json, Value};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::AsyncReadExt;
use tokio::time::Instant;
use transport::{Lines, Reader, Shared, HANDSHAKE_ASKS, HANDSHAKE_VERSIONS};

#[derive(Debug, thiserror::Error)]
pub enum McpError {
    /// The message quotes the server (its stderr, its errors): shown escaped,
    /// on one line (`text::escape`).
    #[error("MCP server {name}: {}", crate::text::escape(message))]
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
/// `execution` is MCP 2025-11-25's: `Server::list_tools` leaves it out of the
/// tools of a server spoken to in 2026-07-28, whose calls may become tasks
/// that are driven to their end.
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
/// - an `inputSchema` that does not compile as JSON Schema 2020-12 (or whose
///   closed copy does not: `policy::compile_schema`, as every snapshot's
///   tools are compiled): the arguments
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
        Some(s) => match crate::policy::compile_schema(s) {
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

/// A server's tool list as scriptgate keeps it: the tools offered, each
/// reduced to what is read of it, and those left out, with why.
pub struct Listing {
    pub tools: Vec<Value>,
    pub left_out: LeftOut,
}

/// What scriptgate reads of a listed tool, kept in place and the rest dropped
/// (an `outputSchema`, `title`, icons, `_meta`, ...): its name, description
/// and input schema, its boolean `readOnlyHint` and `destructiveHint`, and
/// `execution.taskSupport` "required" (`class_of`). 2026-07-28 has no
/// `execution.taskSupport`: the server decides per call whether to answer
/// with a task, and a task is driven to its end (`call`); what a dual-era
/// server still lists there is of its other era, and does not make the tool
/// `long_task` (`modern`).
fn reduce(tool: &mut Value, modern: bool) {
    let task_required = !modern
        && tool
            .pointer("/execution/taskSupport")
            .and_then(Value::as_str)
            == Some("required");
    let Some(t) = tool.as_object_mut() else {
        return;
    };
    let hints: serde_json::Map<String, Value> = match t.get("annotations") {
        Some(Value::Object(a)) => a
            .iter()
            .filter(|(k, v)| {
                matches!(k.as_str(), "readOnlyHint" | "destructiveHint") && v.is_boolean()
            })
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
        _ => Default::default(),
    };
    t.retain(|k, _| matches!(k.as_str(), "name" | "description" | "inputSchema"));
    if !hints.is_empty() {
        t.insert("annotations".into(), Value::Object(hints));
    }
    if task_required {
        t.insert("execution".into(), json!({"taskSupport": "required"}));
    }
}

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

/// How long the era probe (`server/discover`) is waited for before the server
/// is spoken to through `initialize`. rmcp's Auto mode waits 10 s; a server
/// that answers the probe at all (with a result, or an error as servers of the
/// handshake era do) is not waited for, so this is what a server costs that
/// leaves the probe unanswered. One that answers later, being slow to start,
/// is started again in the 2026-07-28 era (`Server::start`).
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// How long a server may take to start, its handshake included.
const START_TIMEOUT: Duration = Duration::from_secs(60);

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

    /// One capability: the tasks extension (`task`), declared in `initialize`
    /// and, in 2026-07-28, on every request (rmcp's per-request `_meta`). No
    /// `roots` (see `Server::start`), no sampling, no elicitation.
    fn get_info(&self) -> ClientConfig {
        ClientConfig::new(
            ClientCapabilities::builder().enable_tasks().build(),
            Implementation::new("scriptgate", env!("CARGO_PKG_VERSION")),
        )
        .with_protocol_version(HANDSHAKE_ASKS)
    }
}

/// A request that is dropped unanswered (its script ended) is cancelled at the
/// server too, as MCP's cancellation says, and its raw result is forgotten.
struct Abandon<'a> {
    server: &'a Server,
    id: Option<RequestId>,
    reason: &'static str,
}

impl Abandon<'_> {
    /// The request was answered (or failed): take its raw result.
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

/// A task given up before it ended (its call timed out or was dropped, or it
/// asks for what scriptgate cannot give) is cancelled at the server with
/// `tasks/cancel` (the extension's way; `notifications/cancelled` is not for
/// tasks), by a task of its own as `Abandon`'s cancel is.
struct CancelTask<'a> {
    server: &'a Server,
    id: Option<String>,
}

impl CancelTask<'_> {
    /// The task ended at the server: nothing to cancel.
    fn ended(mut self) {
        self.id = None;
    }
}

impl Drop for CancelTask<'_> {
    fn drop(&mut self) {
        let Some(id) = self.id.take() else { return };
        let peer = self.server.service.peer().clone();
        self.server.cancels.spawn(async move {
            let cancel =
                ClientRequest::CancelTaskRequest(CancelTaskRequest::new(CancelTaskParams::new(id)));
            let sent = peer
                .send_request_with_option(cancel, PeerRequestOptions::no_options())
                .await;
            if let Ok(answer) = sent {
                let _ = tokio::time::timeout(Duration::from_secs(5), answer.await_response()).await;
            }
        });
    }
}

/// One running MCP server.
pub struct Server {
    pub name: String,
    service: RunningService<RoleClient, Client>,
    shared: Arc<Shared>,
    /// Spoken to in MCP 2026-07-28 (through `server/discover`), not through
    /// `initialize`.
    modern: bool,
    /// The server's stdin, closed at shutdown (rmcp's close waits on a write
    /// that a server which does not read never lets finish).
    stdin: Arc<tokio::sync::Mutex<Option<tokio::process::ChildStdin>>>,
    /// The cancels of abandoned calls and tasks, sent before the server is
    /// shut down.
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

/// Why the handshake failed, in a few words.
fn why_not_started(e: &ClientInitializeError) -> String {
    match e {
        ClientInitializeError::ConnectionClosed(_) => {
            "the server exited (or closed its stdout)".into()
        }
        ClientInitializeError::TransportError { .. } => {
            "the server exited (or closed its stdin)".into()
        }
        // The probe's answer said "an initialize-era server"; the fallback's
        // failure is the one to tell.
        ClientInitializeError::LegacyFallbackFailed { fallback, .. } => why_not_started(fallback),
        ClientInitializeError::JsonRpcError(d) => format!(
            "the server answered with the error {}: {}",
            d.code.0,
            clip(&d.message, 300)
        ),
        ClientInitializeError::NoCompatibleProtocolVersion {
            server_supported, ..
        } => {
            let listed: Vec<&str> = server_supported.iter().map(|v| v.as_str()).collect();
            format!(
                "server/discover lists MCP versions {}, none of which scriptgate speaks \
                 ({} through server/discover, {} to {} through initialize)",
                clip(&listed.join(", "), 300),
                ProtocolVersion::V_2026_07_28,
                HANDSHAKE_VERSIONS[0],
                HANDSHAKE_VERSIONS[HANDSHAKE_VERSIONS.len() - 1]
            )
        }
        e => clip(&e.to_string(), 300),
    }
}

/// `initialize` was refused with -32022 (unsupported protocol version): the
/// server speaks 2026-07-28 (a dual-era server that read the probe first serves
/// that era only from then on, as the official Python SDK's does).
fn initialize_refused_as_modern(e: &ClientInitializeError) -> bool {
    match e {
        ClientInitializeError::LegacyFallbackFailed { fallback, .. } => {
            initialize_refused_as_modern(fallback)
        }
        ClientInitializeError::JsonRpcError(d) => d.code == ErrorCode::UNSUPPORTED_PROTOCOL_VERSION,
        _ => false,
    }
}

/// An error answer's text; for -32021 (missing required client capability),
/// with the capabilities the server named.
fn error_text(e: &rmcp::ErrorData) -> String {
    let message = clip(&e.message, 4096);
    if e.code != ErrorCode::MISSING_REQUIRED_CLIENT_CAPABILITY {
        return message;
    }
    let mut names = Vec::new();
    let required = e
        .data
        .as_ref()
        .and_then(|d| d.get("requiredCapabilities"))
        .and_then(Value::as_object);
    for (k, v) in required.into_iter().flatten() {
        match v.as_object() {
            Some(ext) if k == "extensions" => names.extend(ext.keys().cloned()),
            _ => names.push(k.clone()),
        }
    }
    let names = if names.is_empty() {
        "(none named)".to_string()
    } else {
        clip(&names.join(", "), 500)
    };
    format!(
        "{message} (-32021: the tool needs client capabilities scriptgate does not have: {names})"
    )
}

/// How a server was started, for its errors: its command line (shell-quoted)
/// and the directory it was started in.
fn started_as(spec: &ServerSpec) -> (String, String) {
    let cwd = match std::env::current_dir() {
        Ok(d) => d.display().to_string(),
        Err(e) => format!("a working directory that cannot be named ({e})"),
    };
    let command = shlex::try_join(spec.argv.iter().map(String::as_str))
        .unwrap_or_else(|_| spec.argv.join(" "));
    (command, cwd)
}

/// The server's process, its stdio piped, in a process group of its own so
/// that shutdown also reaches what it spawned (npx → node).
fn spawn_server(spec: &ServerSpec) -> std::io::Result<tokio::process::Child> {
    let mut cmd = tokio::process::Command::new(&spec.argv[0]);
    cmd.args(&spec.argv[1..])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    cmd.process_group(0);
    cmd.spawn()
}

/// A server of the handshake era that answered with a version scriptgate does
/// not speak through `initialize`.
fn unspoken_version(v: &ProtocolVersion) -> String {
    format!(
        "initialize: the server answered with MCP version {}, which scriptgate does not speak \
         through initialize (it asks for {}, and takes {} to {}; {} has no initialize, \
         and this server did not answer server/discover as that version does)",
        clip(v.as_str(), 100),
        HANDSHAKE_ASKS,
        HANDSHAKE_VERSIONS[0],
        HANDSHAKE_VERSIONS[HANDSHAKE_VERSIONS.len() - 1],
        ProtocolVersion::V_2026_07_28,
    )
}

impl Server {
    /// Start the server and reach it in either era (rmcp's client, Auto mode):
    /// `server/discover` first, `initialize` if it does not answer as a
    /// 2026-07-28 server within `PROBE_TIMEOUT`. No `roots` capability is
    /// advertised (a server such as server-filesystem would then trade the
    /// directories on its command line for ours); `roots` only answers a
    /// server that asks anyway. A failure names the command and the directory
    /// it was started in, and ends with the server's last stderr lines.
    pub async fn start(
        spec: &ServerSpec,
        roots: Vec<String>,
        call_timeout: Duration,
    ) -> Result<Server, McpError> {
        let (command, cwd) = started_as(spec);
        // What was run, and where: a relative path in it is relative to there.
        let err = |message: String| McpError::Server {
            name: spec.name.clone(),
            message: format!("started as `{command}` in {cwd}; {message}"),
        };
        let mut child = spawn_server(spec).map_err(|e| McpError::Server {
            name: spec.name.clone(),
            message: format!("cannot start `{command}` in {cwd}: {e}"),
        })?;
        let pgid = child.id().map(|p| p as i32);
        let stdin = child.stdin.take().expect("piped");
        let stdout = child.stdout.take().expect("piped");
        let (stderr_tail, stderr_read) = keep_stderr_tail(child.stderr.take().expect("piped"));
        let shared = Shared::new(Some(PROBE_TIMEOUT));
        let reader = Reader::new(stdout);
        let stdin = Arc::new(tokio::sync::Mutex::new(Some(stdin)));
        let tools_changed = Arc::new(tokio::sync::Notify::new());
        let client = || Client {
            roots: roots.clone(),
            tools_changed: tools_changed.clone(),
        };
        let lines = || Lines::new(reader.clone(), stdin.clone(), shared.clone());
        let modern = || vec![ProtocolVersion::V_2026_07_28];
        let deadline = Instant::now() + START_TIMEOUT;
        let handshake = |mode| {
            tokio::time::timeout_at(
                deadline,
                serve_client_with_lifecycle(client(), lines(), mode),
            )
        };
        let mut started = handshake(ClientLifecycleMode::Auto {
            preferred_versions: modern(),
            legacy_version: Some(HANDSHAKE_ASKS),
        })
        .await;
        if let Ok(Err(e)) = &started {
            // The probe was given up, and the server is modern all the same:
            // slow to start, it answered the probe after `PROBE_TIMEOUT`, then
            // refused the `initialize` that followed. Once more, in its era
            // only (rmcp's Auto mode does not come back from its fallback).
            if shared.closed_with().is_none()
                && (shared.late_modern() || initialize_refused_as_modern(e))
            {
                shared.new_session(None);
                let preferred_versions = modern();
                started = handshake(ClientLifecycleMode::Discover { preferred_versions }).await;
            }
        }
        let phase = if shared.spoke_initialize() {
            "initialize"
        } else {
            "server/discover"
        };
        let why = match started {
            Ok(Ok(s)) => Ok(s),
            Ok(Err(e)) => Err(shared.closed_with().unwrap_or_else(|| why_not_started(&e))),
            Err(_) => Err(format!("no answer within {} s", START_TIMEOUT.as_secs())),
        };
        let service = match why {
            Ok(s) => s,
            Err(why) => {
                end_group(pgid, stderr_read).await;
                let tail = stderr_note(&stderr_tail);
                return Err(err(format!("{phase} failed: {why}{tail}")));
            }
        };
        let info = service.peer_info();
        let tools = info.as_ref().and_then(|i| i.capabilities.tools.clone());
        let version = info.map(|i| i.protocol_version.clone());
        let server = Server {
            name: spec.name.clone(),
            service,
            modern: !shared.spoke_initialize(),
            shared,
            stdin,
            cancels: Default::default(),
            child: tokio::sync::Mutex::new(child),
            pgid,
            stderr_tail,
            call_timeout,
            tools_changed,
        };
        server.accepted(version, tools).await.map_err(err)
    }

    /// A server just started, kept if it speaks a version of ours and offers
    /// tools (shut down if not, and why); a 2026-07-28 one whose tool list may
    /// change is followed.
    async fn accepted(
        self,
        version: Option<ProtocolVersion>,
        tools: Option<rmcp::model::ToolsCapability>,
    ) -> Result<Server, String> {
        if let Some(v) = version.filter(|v| !self.modern && !HANDSHAKE_VERSIONS.contains(v)) {
            self.shutdown().await;
            return Err(unspoken_version(&v));
        }
        let Some(tools) = tools else {
            self.shutdown().await;
            return Err("the server offers no tools".into());
        };
        if self.modern && tools.list_changed == Some(true) {
            self.follow_tool_list();
        }
        Ok(self)
    }

    /// In 2026-07-28 a server tells of a changed tool list only on a
    /// `subscriptions/listen` stream (rmcp's `Peer::listen`, its notifications
    /// bounded by rmcp's channel of 64, past which the stream ends): opened
    /// once, for the life of the connection. Servers of the handshake era send
    /// the notification unasked (`Client::on_tool_list_changed`).
    fn follow_tool_list(&self) {
        let peer = self.service.peer().clone();
        let changed = self.tools_changed.clone();
        tokio::spawn(async move {
            let filter = SubscriptionFilter::builder().tools_list_changed().build();
            let Ok(mut stream) = peer.listen(filter).await else {
                return;
            };
            while let Ok(Some(n)) = stream.next().await {
                if matches!(n, ServerNotification::ToolListChangedNotification(_)) {
                    changed.notify_one();
                }
            }
        });
    }

    /// Send one request; its raw result.
    async fn request(&self, request: ClientRequest, timeout: Duration) -> Result<Value, LinkError> {
        let name = &self.name;
        let failed = |e: ServiceError| match e {
            ServiceError::McpError(e) => format!("MCP server {name}: {}", error_text(&e)),
            ServiceError::TransportClosed | ServiceError::TransportSend(_) => {
                match self.shared.closed_with() {
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
    /// `MAX_TOOLS` tools and `MAX_TOOLS_BYTES`: a server whose cursor never
    /// ends, or comes back to a page already read, gets an error, not a CLI
    /// that hangs or grows. Each page is taken apart as it comes: a tool is
    /// reduced to what is read of it (`reduce`), then kept or left out by
    /// `policy::admit` (its name, its description, its schema's size once its
    /// unknown keywords are dropped), and what is kept is bounded in total.
    pub async fn list_tools(&self) -> Result<Listing, McpError> {
        let err = |message: String| McpError::Server {
            name: self.name.clone(),
            message,
        };
        let mut list = admit::List::new(&self.name);
        let mut out = Vec::new();
        let (mut bytes, mut listed) = (0usize, 0usize);
        let mut seen = std::collections::HashSet::new();
        let mut cursor: Option<String> = None;
        for _ in 0..MAX_TOOL_PAGES {
            let params = PaginatedRequestParams::default().with_cursor(cursor.take());
            let mut r = self
                .request(
                    ClientRequest::ListToolsRequest(ListToolsRequest::with_param(params)),
                    Duration::from_secs(60),
                )
                .await
                .map_err(|e| err(format!("tools/list: {e}")))?;
            bytes += admit::json_len(&r);
            if bytes > MAX_TOOLS_BYTES {
                return Err(err(format!(
                    "tools/list: more than {} MiB of pages; scriptgate takes at most that much from one server",
                    MAX_TOOLS_BYTES >> 20
                )));
            }
            let page = match r.get_mut("tools").map(Value::take) {
                Some(Value::Array(page)) => page,
                _ => Vec::new(),
            };
            listed += page.len();
            if listed > MAX_TOOLS {
                return Err(err(format!(
                    "tools/list: more than {MAX_TOOLS} tools; scriptgate takes at most that many from one server"
                )));
            }
            for mut tool in page {
                reduce(&mut tool, self.modern);
                if let Some(kept) = list.admit(tool).map_err(err)? {
                    out.push(kept);
                }
            }
            match r.get("nextCursor").filter(|c| !c.is_null()) {
                None => {
                    return Ok(Listing {
                        tools: out,
                        left_out: list.left_out,
                    })
                }
                Some(Value::String(c)) => {
                    // Kept as hashes: a server's cursors may be long.
                    if !seen.insert(cursor_hash(c)) {
                        return Err(err(format!(
                            "tools/list: nextCursor {:?} came back after {} pages; the server's pages go round in a circle",
                            clip(c, 200),
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
            "tools/list: nextCursor did not end within {MAX_TOOL_PAGES} pages ({listed} tools so far); scriptgate reads at most that many pages"
        )))
    }

    /// Call a tool. A call the server answers with a task is driven to the
    /// task's end within the call's timeout (`task`).
    pub async fn call(&self, tool: &str, arguments: Value) -> Result<ToolResult, LinkError> {
        let deadline = Instant::now() + self.call_timeout;
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
        let name = &self.name;
        match task::reply(&r) {
            task::Reply::Complete => Ok(ToolResult::from_mcp(&r)),
            task::Reply::Task(id) => self.drive(tool, id, r, deadline).await,
            task::Reply::InputRequired(what) => Err(LinkError::Answered(format!(
                "MCP server {name}: {tool} asks for input scriptgate cannot give ({what})"
            ))),
            task::Reply::Unreadable(why) => Err(LinkError::Answered(format!(
                "MCP server {name}: {tool}: {why}"
            ))),
        }
    }

    /// Poll the task the call became (`tasks/get`, at the server's
    /// `pollIntervalMs`) until it ends or `deadline`; a task given up is
    /// cancelled (`CancelTask`), also when the call is dropped.
    async fn drive(
        &self,
        tool: &str,
        id: String,
        created: Value,
        deadline: Instant,
    ) -> Result<ToolResult, LinkError> {
        let fail = |why: String| {
            LinkError::Answered(format!(
                "MCP server {}: {tool} (task {}): {why}",
                self.name,
                clip(&id, 100)
            ))
        };
        let timed_out = || {
            fail(format!(
                "the task did not finish within {} s; cancelled",
                self.call_timeout.as_secs()
            ))
        };
        let cancel = CancelTask {
            server: self,
            id: Some(id.clone()),
        };
        let mut state = created;
        loop {
            match task::step(&state, &id) {
                task::Step::Completed(result) => {
                    cancel.ended();
                    return Ok(ToolResult::from_mcp(result));
                }
                task::Step::Failed(why) => {
                    cancel.ended();
                    return Err(fail(why));
                }
                task::Step::InputRequired(what) => {
                    return Err(fail(format!(
                        "the task asks for input scriptgate cannot give ({what}); cancelled"
                    )))
                }
                task::Step::Unreadable(why) => return Err(fail(format!("{why}; cancelled"))),
                task::Step::Working(poll) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if poll >= left {
                        tokio::time::sleep(left).await;
                        return Err(timed_out());
                    }
                    tokio::time::sleep(poll).await;
                }
            }
            let get = GetTaskRequest::new(GetTaskParams::new(id.clone()));
            let left = deadline.saturating_duration_since(Instant::now());
            state = match self.request(ClientRequest::GetTaskRequest(get), left).await {
                Ok(s) => s,
                Err(_) if Instant::now() >= deadline => return Err(timed_out()),
                Err(e) => return Err(fail(format!("tasks/get: {e}; cancelled"))),
            };
        }
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
            serde_json::from_str(include_str!("../../../tests/fixtures/mcp-tools.json")).unwrap();
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
    fn a_servers_text_in_an_error_is_escaped() {
        let e = McpError::Server {
            name: "x".into(),
            message: "its stderr ends with: \x1b]0;pwned\x07\nb\u{202e}c\u{200b}d\u{2028}e\u{7f}"
                .into(),
        };
        assert_eq!(
            e.to_string(),
            "MCP server x: its stderr ends with: \\x1b]0;pwned\\x07\\x0ab\\u202ec\\u200bd\\u2028e\\x7f"
        );
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
