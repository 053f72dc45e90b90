//! `scriptgate mcp`: code mode for any MCP client. An MCP server over stdio (the
//! official Rust SDK, `rmcp`) whose tool `run_script` runs one Python script
//! against the upstream MCP servers given with `--mcp`, as `scriptgate run` does:
//! through the system daemon when one is installed, else in an embedded daemon.
//! The one approval for declared write tools goes to the user through MCP
//! elicitation; `agent_tools.progress` and the call counts become
//! `notifications/progress`; `notifications/cancelled` cancels the script.

use super::args::McpCmd;
use super::exit::Failure;
use super::run::{CliEngine, EmbeddedDaemon, RunUi, Tools};
use crate::config::Config;
use crate::protocol::rpc::BoxFuture;
use crate::protocol::snapshot::{PermissionMode, Snapshot, SnapshotLimits};
use crate::protocol::{ApprovalRequest, ScriptResult, ScriptStatus, StartParams, Status};
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ElicitRequestParams,
    ElicitationAction, ListToolsResult, PaginatedRequestParams, ProgressNotificationParam,
    ProgressToken, ServerCapabilities, ServerConfig, Tool,
};
use rmcp::service::{Peer, RequestContext, RoleServer};
use rmcp::{ErrorData as McpError, ServerHandler, ServiceExt};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The one tool.
const RUN_SCRIPT: &str = "run_script";
/// At most one progress notification a second per script.
const PROGRESS_EVERY: Duration = Duration::from_secs(1);

/// Where scripts run, chosen once at start.
enum Where {
    Embedded(EmbeddedDaemon),
    Socket {
        path: PathBuf,
        system: bool,
        cfg: Box<Config>,
    },
}

#[derive(Clone)]
struct CodeMode {
    tools: Arc<Tools>,
    runs_in: Arc<Where>,
    /// Fresh workspaces go here.
    base: PathBuf,
    /// The uid scripts run as (the workspace's owner).
    identity: crate::sys::Identity,
    mode: PermissionMode,
    passthrough: bool,
    /// `run_script`'s description: the `describe` text of the upstream tools,
    /// made again when an upstream server's tool list changes.
    describe: Arc<std::sync::RwLock<String>>,
    /// The connected clients, told when the tools change. Closed ones are
    /// dropped whenever one connects, so it holds at most the open sessions and
    /// one closed one.
    clients: Arc<Mutex<Vec<Peer<RoleServer>>>>,
    /// Held (read) by each running script; taken (write) before the process
    /// exits, so that scripts the client's going away cancelled are recorded.
    inflight: Arc<tokio::sync::RwLock<()>>,
}

pub async fn serve(o: McpCmd) -> Result<(), Failure> {
    use super::target::{choose, Facts, Target};
    let target = choose(o.embedded, o.socket.as_deref(), &Facts::gather());
    let (runs_in, cfg, base) = match &target {
        Target::Embedded(why) => {
            let cfg = super::run::embedded_config(o.config.as_deref())?;
            let base = super::run::embedded_workspaces(&cfg);
            std::fs::create_dir_all(&base)
                .map_err(|e| Failure::setup(format!("cannot create {}: {e}", base.display())))?;
            eprintln!(
                "scriptgate mcp: mode: embedded daemon in this process ({why}); records in {}",
                cfg.state.dir.display()
            );
            (
                Where::Embedded(EmbeddedDaemon::start(cfg.clone()).await?),
                cfg,
                base,
            )
        }
        Target::Socket { path, system } => {
            let cfg = super::run::socket_config(o.config.as_deref())?;
            // Connected once now: a refusal or a dead daemon is said at start.
            let c = super::run::connect(path, *system, &cfg).await?;
            eprintln!(
                "scriptgate mcp: mode: {} at {} (scriptgated {}, {} backend)",
                if c.system { "system daemon" } else { "daemon" },
                c.path.display(),
                c.info.version,
                c.info.backend
            );
            let base = super::run::socket_fresh_base(&cfg, path)?;
            drop(c);
            let w = Where::Socket {
                path: path.clone(),
                system: *system,
                cfg: Box::new(cfg.clone()),
            };
            (w, cfg, base)
        }
    };
    let identity = super::run::script_identity(&cfg)?;
    let tools = Tools::start(
        &o.servers.mcp,
        vec![base.display().to_string()],
        &o.servers.class,
        Duration::from_secs(o.call_timeout),
    )
    .await?;
    let describe = describe_text(&cfg, &tools.specs(), o.mode, false);
    let describe = match describe {
        Ok(d) => d,
        Err(e) => {
            tools.shutdown().await;
            return Err(e);
        }
    };
    let tools = Arc::new(tools);
    let server = CodeMode {
        tools: tools.clone(),
        runs_in: Arc::new(runs_in),
        base,
        identity,
        mode: o.mode,
        passthrough: o.passthrough,
        describe: Arc::new(std::sync::RwLock::new(describe)),
        clients: Arc::default(),
        inflight: Arc::default(),
    };
    for upstream in tools.servers() {
        tokio::spawn(follow_tool_list(
            upstream.tools_changed.clone(),
            server.clone(),
            cfg.clone(),
        ));
    }
    let inflight = server.inflight.clone();
    let r = match o.http {
        None => serve_stdio(server).await,
        Some(addr) => serve_http(server, addr).await,
    };
    // The client is gone: its calls were cancelled, and so were their scripts;
    // each ends with its record (a cancel takes at most 30 s, scriptgated(8)).
    if tokio::time::timeout(DRAIN, inflight.write()).await.is_err() {
        eprintln!("scriptgate mcp: scripts still running after {DRAIN:?}; leaving them");
    }
    tools.shutdown().await;
    r
}

/// How long scripts cancelled at exit may take to end.
const DRAIN: Duration = Duration::from_secs(45);

/// The `describe` text for `scriptgate mcp`, which offers no never-callable tool.
fn describe_text(
    cfg: &Config,
    specs: &[crate::protocol::snapshot::ToolSpec],
    mode: PermissionMode,
    read_only: bool,
) -> Result<String, Failure> {
    super::run::describe_text(
        cfg,
        specs,
        mode,
        read_only,
        crate::policy::describe::NeverCallable::NotOffered,
    )
}

/// Each `notifications/tools/list_changed` of an upstream server: list the tools
/// again, make the description again, and tell the clients with the same
/// notification. Ends with the process.
async fn follow_tool_list(changed: Arc<tokio::sync::Notify>, server: CodeMode, cfg: Config) {
    loop {
        changed.notified().await;
        if let Err(e) = server.tools.refresh().await {
            eprintln!(
                "scriptgate mcp: the tool list changed and could not be read again: {}",
                e.message
            );
            continue;
        }
        match describe_text(&cfg, &server.tools.specs(), server.mode, false) {
            Ok(d) => *server.describe.write().unwrap_or_else(|p| p.into_inner()) = d,
            Err(e) => eprintln!("scriptgate mcp: the new tool list: {}", e.message),
        }
        let clients = server
            .clients
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        for c in clients {
            let _ = c.notify_tool_list_changed().await;
        }
    }
}

async fn serve_stdio(server: CodeMode) -> Result<(), Failure> {
    let running = server
        .serve(rmcp::transport::stdio())
        .await
        .map_err(|e| Failure::setup(format!("MCP client: {e}")))?;
    running
        .waiting()
        .await
        .map_err(|e| Failure::setup(format!("MCP server: {e}")))?;
    Ok(())
}

/// MCP's Streamable HTTP at `http://ADDR/mcp`, on loopback only. The `Host`
/// header must name a loopback host and a browser's `Origin` must be this
/// server's own (DNS rebinding, which the MCP spec asks servers to stop); a client
/// that sends no `Origin` (not a browser) is served.
async fn serve_http(server: CodeMode, addr: std::net::SocketAddr) -> Result<(), Failure> {
    use rmcp::transport::streamable_http_server::{
        session::local::LocalSessionManager, StreamableHttpServerConfig, StreamableHttpService,
    };
    if !addr.ip().is_loopback() {
        return Err(Failure::usage(format!(
            "--http {addr}: loopback addresses only (127.0.0.1:PORT or [::1]:PORT)"
        )));
    }
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
        .enforce_origin_validation();
    let service = StreamableHttpService::new(
        move || Ok(server.clone()),
        Arc::new(Capped(LocalSessionManager::default())),
        config,
    );
    let connections = Arc::new(tokio::sync::Semaphore::new(MAX_HTTP_CONNECTIONS));
    eprintln!("scriptgate mcp: Streamable HTTP at http://{bound}/mcp");
    loop {
        // Past MAX_HTTP_CONNECTIONS at once, the next waits in the listen backlog.
        let Ok(slot) = connections.clone().acquire_owned().await else {
            return Ok(());
        };
        let (stream, _) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                eprintln!("scriptgate mcp: accept: {e}");
                continue;
            }
        };
        let service = service.clone();
        tokio::spawn(async move {
            let _slot = slot;
            // Every path is the MCP endpoint; /mcp is the one documented.
            let svc = hyper_util::service::TowerToHyperService::new(service);
            let io = hyper_util::rt::TokioIo::new(stream);
            // A connection that sends no request headers within HEADER_TIMEOUT is
            // closed, so idle ones cannot hold the MAX_HTTP_CONNECTIONS slots.
            let _ = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .serve_connection(io, svc)
                .await;
        });
    }
}

/// `run_script` as `run.describe` gives it to engines (the same input schema), with
/// the schema of its `structuredContent` and annotations.
/// How long an HTTP connection may take to send a request's headers, idle
/// keep-alive included.
const HEADER_TIMEOUT: Duration = Duration::from_secs(30);
/// HTTP connections served at once (`--http`).
const MAX_HTTP_CONNECTIONS: usize = 64;
/// MCP sessions at once (`--http`): each holds a server task and its channels
/// until the client ends it (DELETE) or 5 minutes pass without a request.
pub const MAX_HTTP_SESSIONS: usize = 32;

/// rmcp's in-memory sessions, at most `MAX_HTTP_SESSIONS` of them: one more is
/// refused (the client gets an HTTP error naming the bound).
struct Capped(rmcp::transport::streamable_http_server::session::local::LocalSessionManager);

#[derive(Debug, thiserror::Error)]
enum SessionError {
    #[error("{0}")]
    Local(
        #[from] rmcp::transport::streamable_http_server::session::local::LocalSessionManagerError,
    ),
    #[error("too many MCP sessions at once (at most {MAX_HTTP_SESSIONS}); end one (DELETE) or wait 5 minutes")]
    TooMany,
}

impl rmcp::transport::streamable_http_server::SessionManager for Capped {
    type Error = SessionError;
    type Transport = <rmcp::transport::streamable_http_server::session::local::LocalSessionManager as rmcp::transport::streamable_http_server::SessionManager>::Transport;

    async fn create_session(
        &self,
    ) -> Result<
        (
            rmcp::transport::common::server_side_http::SessionId,
            Self::Transport,
        ),
        SessionError,
    > {
        // The count and the insert are two steps: requests racing past the check
        // exceed the bound by at most the connections served at once.
        if self.0.sessions.read().await.len() >= MAX_HTTP_SESSIONS {
            return Err(SessionError::TooMany);
        }
        Ok(self.0.create_session().await?)
    }
    async fn initialize_session(
        &self,
        id: &rmcp::transport::common::server_side_http::SessionId,
        message: rmcp::model::ClientJsonRpcMessage,
    ) -> Result<rmcp::model::ServerJsonRpcMessage, SessionError> {
        Ok(self.0.initialize_session(id, message).await?)
    }
    async fn has_session(
        &self,
        id: &rmcp::transport::common::server_side_http::SessionId,
    ) -> Result<bool, SessionError> {
        Ok(self.0.has_session(id).await?)
    }
    async fn close_session(
        &self,
        id: &rmcp::transport::common::server_side_http::SessionId,
    ) -> Result<(), SessionError> {
        Ok(self.0.close_session(id).await?)
    }
    async fn create_stream(
        &self,
        id: &rmcp::transport::common::server_side_http::SessionId,
        message: rmcp::model::ClientJsonRpcMessage,
    ) -> Result<
        impl futures::Stream<Item = rmcp::transport::common::server_side_http::ServerSseMessage>
            + Send
            + Sync
            + 'static,
        SessionError,
    > {
        Ok(self.0.create_stream(id, message).await?)
    }
    async fn accept_message(
        &self,
        id: &rmcp::transport::common::server_side_http::SessionId,
        message: rmcp::model::ClientJsonRpcMessage,
    ) -> Result<(), SessionError> {
        Ok(self.0.accept_message(id, message).await?)
    }
    async fn create_standalone_stream(
        &self,
        id: &rmcp::transport::common::server_side_http::SessionId,
    ) -> Result<
        impl futures::Stream<Item = rmcp::transport::common::server_side_http::ServerSseMessage>
            + Send
            + Sync
            + 'static,
        SessionError,
    > {
        Ok(self.0.create_standalone_stream(id).await?)
    }
    async fn resume(
        &self,
        id: &rmcp::transport::common::server_side_http::SessionId,
        last_event_id: String,
    ) -> Result<
        impl futures::Stream<Item = rmcp::transport::common::server_side_http::ServerSseMessage>
            + Send
            + Sync
            + 'static,
        SessionError,
    > {
        Ok(self.0.resume(id, last_event_id).await?)
    }
}

fn run_script_tool(describe: &str) -> Tool {
    let mut t = crate::policy::describe::run_script_tool(describe);
    t["outputSchema"] = json!({
        "type": "object",
        "properties": {
            "status": {"type": "string", "description": "ok, error, timeout, oom, limit, cancelled, interrupted, or refused (the script never started)"},
            "script_id": {"type": "string"},
            "calls": {"type": "integer"},
            "failures": {"type": "integer"},
            "duration_ms": {"type": "integer"},
            "exit_code": {"type": ["integer", "null"]},
            "details_dir": {"type": "string"},
            "workspace": {"type": "string"},
            "output_truncated": {"type": "boolean"}
        },
        "required": ["status"]
    });
    t["annotations"] = json!({"title": "Run a Python script over the tools", "readOnlyHint": false, "destructiveHint": false, "openWorldHint": true});
    serde_json::from_value(t).expect("the run_script tool is well-formed")
}

/// The upstream tools offered directly (`--passthrough`): those a script may call.
fn passthrough_tools(tools: &Tools) -> Vec<Tool> {
    use crate::protocol::snapshot::ToolClass;
    tools
        .specs()
        .iter()
        .filter(|t| t.script_callable())
        .filter_map(|t| {
            serde_json::from_value(json!({
                "name": t.name,
                "description": t.description.clone().unwrap_or_default(),
                "inputSchema": t.input_schema.clone().unwrap_or_else(|| json!({"type": "object"})),
                "annotations": {"readOnlyHint": t.class == ToolClass::Read},
            }))
            .ok()
        })
        .collect()
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct RunArgs {
    code: String,
    #[serde(default)]
    tools: Vec<String>,
    #[serde(default)]
    description: String,
}

impl ServerHandler for CodeMode {
    fn get_info(&self) -> ServerConfig {
        let caps = ServerCapabilities::builder()
            .enable_tools()
            .enable_tool_list_changed()
            .build();
        let me = serde_json::from_value(json!({
            "name": "scriptgate",
            "version": env!("CARGO_PKG_VERSION"),
        }))
        .expect("the server info is well-formed");
        ServerConfig::new(caps).with_server_info(me).with_instructions(
            "run_script runs one Python script that calls the tools below in loops; only what it prints comes back.",
        )
    }

    async fn on_initialized(&self, context: rmcp::service::NotificationContext<RoleServer>) {
        let mut clients = self.clients.lock().unwrap_or_else(|p| p.into_inner());
        clients.retain(|c| !c.is_transport_closed());
        clients.push(context.peer);
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, McpError> {
        let describe = self
            .describe
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let mut tools = vec![run_script_tool(&describe)];
        if self.passthrough {
            tools.extend(passthrough_tools(&self.tools));
        }
        Ok(ListToolsResult::with_all_items(tools))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, McpError> {
        let args = Value::Object(request.arguments.unwrap_or_default());
        if request.name == RUN_SCRIPT {
            let args: RunArgs = serde_json::from_value(args)
                .map_err(|e| McpError::invalid_params(format!("run_script: {e}"), None))?;
            return Ok(self.run_script(args, context).await.into());
        }
        let callable = self.passthrough
            && self
                .tools
                .specs()
                .iter()
                .any(|t| t.name == request.name && t.script_callable());
        if !callable {
            return Err(McpError::invalid_params(
                format!("no tool {:?}", request.name),
                None,
            ));
        }
        let r = self.tools.call(&request.name, args).await;
        Ok(match r {
            Ok(r) => tool_result(r.text, r.structured, r.is_error),
            Err(e) => tool_result(e.to_string(), None, true),
        }
        .into())
    }
}

fn tool_result(text: String, structured: Option<Value>, is_error: bool) -> CallToolResult {
    let mut v = json!({
        "content": [{"type": "text", "text": text}],
        "isError": is_error,
    });
    if let Some(s) = structured {
        v["structuredContent"] = s;
    }
    serde_json::from_value(v).expect("a text result is well-formed")
}

impl CodeMode {
    async fn run_script(
        &self,
        args: RunArgs,
        context: RequestContext<RoleServer>,
    ) -> CallToolResult {
        // Held for the whole run: the exit waits for it (`DRAIN`).
        let _running = self.inflight.read().await;
        let ui = Arc::new(McpUi::new(
            context.peer.clone(),
            context.meta.get_progress_token(),
            self.mode,
        ));
        let pacer = tokio::spawn(ui.clone().pace());
        let r = match super::run::fresh_workspace(&self.base, &self.identity) {
            Ok(ws) => self
                .start_and_wait(ws.clone(), args, ui.clone(), &context)
                .await
                .map(|res| (ws, res)),
            Err(f) => Err(f),
        };
        pacer.abort();
        let _ = pacer.await;
        if let Ok((_, res)) = &r {
            ui.finish(res).await;
        }
        let hint = ui.why_not_asked();
        match r {
            Ok((ws, res)) => {
                let workspace = ws.display().to_string();
                let structured = json!({
                    "status": res.status.as_str(),
                    "script_id": res.script_id,
                    "calls": res.calls,
                    "failures": res.failures,
                    "duration_ms": res.duration_ms,
                    "exit_code": res.exit_code,
                    "details_dir": res.details_dir,
                    "workspace": workspace,
                    "output_truncated": res.output_truncated,
                });
                let text = match hint {
                    Some(h) => format!("{}\n{h}\n", res.text.trim_end()),
                    None => res.text,
                };
                tool_result(text, Some(structured), res.status != Status::Ok)
            }
            Err(f) => {
                let text = match hint {
                    Some(h) => format!("{}\n{h}", f.message),
                    None => f.message,
                };
                tool_result(text, Some(json!({"status": "refused"})), true)
            }
        }
    }

    async fn start_and_wait(
        &self,
        ws: PathBuf,
        args: RunArgs,
        ui: Arc<McpUi>,
        context: &RequestContext<RoleServer>,
    ) -> Result<ScriptResult, Failure> {
        let snap = Snapshot {
            workspace: ws,
            read_only: false,
            permission_mode: self.mode,
            session_allowed: vec![],
            tools: self.tools.specs(),
            limits: SnapshotLimits::default(),
        };
        let params = StartParams {
            token: String::new(),
            code: args.code,
            tools: args.tools,
            description: if args.description.is_empty() {
                "scriptgate mcp run_script".into()
            } else {
                args.description
            },
            traceparent: None,
            tracestate: None,
        };
        let engine = Arc::new(CliEngine {
            tools: self.tools.clone(),
            ui,
        });
        let ct = context.ct.clone();
        let cancelled = async move { ct.cancelled().await };
        match &*self.runs_in {
            Where::Embedded(d) => d.run(snap, params, engine, cancelled).await,
            Where::Socket { path, system, cfg } => {
                let c = super::run::connect(path, *system, cfg).await?;
                super::run::run_socket(c, cfg, snap, params, engine, cancelled).await
            }
        }
    }
}

/// One `run_script` call's side of the MCP client: its approval through
/// elicitation and its progress on the call's `progressToken`.
struct McpUi {
    peer: Peer<RoleServer>,
    token: Option<ProgressToken>,
    mode: PermissionMode,
    state: Mutex<Progress>,
    wake: tokio::sync::Notify,
}

#[derive(Default)]
struct Progress {
    /// The newest `script.progress` not yet sent.
    latest: Option<ScriptStatus>,
    /// The last value sent: MCP progress only grows.
    value: f64,
    /// An approval was needed and the client could not be asked.
    not_asked: bool,
}

impl McpUi {
    fn new(peer: Peer<RoleServer>, token: Option<ProgressToken>, mode: PermissionMode) -> McpUi {
        McpUi {
            peer,
            token,
            mode,
            state: Mutex::default(),
            wake: tokio::sync::Notify::new(),
        }
    }

    fn can_elicit(&self) -> bool {
        self.peer
            .supported_elicitation_modes()
            .contains(&rmcp::service::ElicitationMode::Form)
    }

    /// Why the user was not asked, for the result text.
    fn why_not_asked(&self) -> Option<String> {
        let s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        (s.not_asked && self.mode == PermissionMode::Approval).then(|| {
            "scriptgate: the declared write tools need the user's approval, and this MCP client cannot be asked (it does not declare the elicitation capability): they were denied. To allow declared write tools without asking, start scriptgate mcp with --mode auto.".to_string()
        })
    }

    /// Sends the newest progress at most once a second.
    async fn pace(self: Arc<Self>) {
        loop {
            self.wake.notified().await;
            let latest = self
                .state
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .latest
                .take();
            if let Some(p) = latest {
                let (done, total, msg) = match &p.progress {
                    Some(pr) if pr.total > 0 => {
                        (pr.done as f64, Some(pr.total as f64), pr.message.clone())
                    }
                    Some(pr) => (p.calls as f64, None, pr.message.clone()),
                    None => (p.calls as f64, None, String::new()),
                };
                let message = format!(
                    "{}{} calls, {} failed",
                    if msg.is_empty() {
                        String::new()
                    } else {
                        format!("{msg} (")
                    },
                    p.calls,
                    p.failures
                ) + if msg.is_empty() { "" } else { ")" };
                self.send(done, total, message).await;
            }
            tokio::time::sleep(PROGRESS_EVERY).await;
        }
    }

    /// The final state, before the result.
    async fn finish(&self, r: &ScriptResult) {
        let message = format!(
            "{}: {} calls, {} failed",
            r.status.as_str(),
            r.calls,
            r.failures
        );
        let value = self.state.lock().unwrap_or_else(|p| p.into_inner()).value;
        self.send(value.max(r.calls as f64), None, message).await;
    }

    async fn send(&self, value: f64, total: Option<f64>, message: String) {
        let Some(token) = &self.token else {
            return;
        };
        let value = {
            let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
            s.value = s.value.max(value);
            s.value
        };
        let mut p = json!({"progressToken": token, "progress": value, "message": message});
        if let Some(t) = total {
            p["total"] = json!(t.max(value));
        }
        if let Ok(p) = serde_json::from_value::<ProgressNotificationParam>(p) {
            let _ = self.peer.notify_progress(p).await;
        }
    }
}

impl RunUi for McpUi {
    fn approve(self: Arc<Self>, p: ApprovalRequest) -> BoxFuture<'static, bool> {
        Box::pin(async move {
            if !self.can_elicit() {
                self.state
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .not_asked = true;
                return false;
            }
            let tools: Vec<String> = p
                .tools
                .iter()
                .map(|t| format!("{} ({})", t.name, t.class))
                .collect();
            let message = format!(
                "A script asks to use write tools, once: {}.\nWhat it is for: {}\n--- script ---\n{}\n--------------",
                tools.join(", "),
                p.description,
                p.code.trim_end()
            );
            let params: ElicitRequestParams = match serde_json::from_value(json!({
                "mode": "form",
                "message": message,
                "requestedSchema": {
                    "type": "object",
                    "properties": {"allow": {"type": "boolean", "title": "Allow these write tools for this script", "default": false}},
                    "required": ["allow"]
                }
            })) {
                Ok(p) => p,
                Err(_) => return false,
            };
            match self.peer.create_elicitation(params).await {
                Ok(r) => {
                    r.action == ElicitationAction::Accept
                        && r.content.as_ref().and_then(|c| c.get("allow")) == Some(&json!(true))
                }
                Err(e) => {
                    eprintln!("scriptgate mcp: the approval could not be asked: {e}; denied");
                    false
                }
            }
        })
    }

    fn progress(&self, p: &ScriptStatus) {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).latest = Some(p.clone());
        self.wake.notify_one();
    }
}
