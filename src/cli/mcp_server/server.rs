//! The MCP server's handler: `run_script` (and, with `--passthrough`, the upstream
//! tools) for clients of both protocol eras, tasks, and subscriptions. rmcp does
//! the protocol (`initialize` or `server/discover`, per-request `_meta`,
//! `resultType`, the version checks, the error codes); this is what
//! `scriptgate mcp` answers.
//!
//! A call's era decides how its one approval is asked: an `initialize` client
//! (2025-11-25 and before) is sent `elicitation/create`; a 2026-07-28 client,
//! to which a server may send no request, gets an `InputRequiredResult` and
//! retries with the answer (`approval`). A 2026-07-28 request that declares the
//! tasks extension gets a task handle once its script has run `--task-after`
//! (`tasks`); every other call blocks until its script ends, with progress.

use super::approval::{self, Grants, Redeemed, Subject};
use super::line::Line;
use super::result;
use super::scripts::{Claim, Launch, Principal, RequestKey, Script, Scripts};
use super::tasks::Tasks;
use super::ui::{Approval, McpUi};
use crate::cli::run::{CliEngine, Tools};
use crate::protocol::snapshot::{PermissionMode, Snapshot, SnapshotLimits};
use crate::protocol::StartParams;
use rmcp::model::{
    CacheScope, CallToolRequestParams, CallToolResponse, CancelTaskParams, ClientCapabilities,
    GetTaskParams, GetTaskResult, Implementation, ListToolsResult, PaginatedRequestParams,
    ProtocolVersion, ServerCapabilities, ServerConfig, ServerNotification, SubscriptionFilter,
    TaskStatusNotification, TaskStatusNotificationParams, Tool,
};
use rmcp::service::{Peer, RequestContext, RoleServer, SubscriptionContext};
use rmcp::{ErrorData as McpError, ServerHandler};
use serde_json::{json, Value};
use sha2::{Digest as _, Sha256};
use std::borrow::Cow;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// The one tool.
const RUN_SCRIPT: &str = "run_script";
/// How long a client may cache the tool list (`ttlMs`): it changes only when an
/// upstream server's does, which `listChanged` and `subscriptions/listen` say.
const TOOLS_TTL_MS: u64 = 60_000;
/// The protocol versions served, exactly: each is tested (tests/hosts, the
/// conformance suite). A client pinned to another gets rmcp's
/// `UnsupportedProtocolVersion` answer, which its SDK falls back from.
const VERSIONS: [ProtocolVersion; 5] = [
    ProtocolVersion::V_2024_11_05,
    ProtocolVersion::V_2025_03_26,
    ProtocolVersion::V_2025_06_18,
    ProtocolVersion::V_2025_11_25,
    ProtocolVersion::V_2026_07_28,
];

/// Put in a request's extensions by the transport that read it (`--http`: in
/// the HTTP request's, which rmcp hands on as `http::request::Parts`): who sent
/// it, and a token cancelled when its connection closes.
#[derive(Clone)]
pub(super) struct Origin {
    pub(super) who: Principal,
    pub(super) gone: CancellationToken,
    /// The HTTP connection, asked whether its client hung up.
    pub(super) line: Option<Arc<Line>>,
}

/// The `taskIds` of a `subscriptions/listen` request's filter (the tasks
/// extension), which rmcp's `SubscriptionFilter` does not model: the
/// transport that read the request puts them in its extensions.
#[derive(Clone, Debug, Default)]
pub(super) struct ListenTaskIds(pub(super) Vec<String>);

#[derive(Clone)]
pub(super) struct CodeMode {
    pub(super) tools: Arc<Tools>,
    pub(super) scripts: Arc<Scripts>,
    pub(super) grants: Arc<Grants>,
    pub(super) tasks: Arc<Tasks>,
    /// Fresh workspaces go here.
    pub(super) base: PathBuf,
    /// The uid scripts run as (the workspace's owner).
    pub(super) identity: crate::sys::Identity,
    pub(super) mode: PermissionMode,
    pub(super) passthrough: bool,
    /// How long a call whose request declared the tasks extension waits for its
    /// script before answering with a task.
    pub(super) task_after: Duration,
    /// `run_script`'s description: the `describe` text of the upstream tools,
    /// made again when an upstream server's tool list changes.
    pub(super) describe: Arc<std::sync::RwLock<String>>,
    /// Clients of the handshake era, told when the tools change. Closed ones
    /// are dropped whenever one connects, so it holds at most the open sessions
    /// and one closed one.
    pub(super) clients: Arc<Mutex<Vec<Peer<RoleServer>>>>,
    /// Counts the tool list's changes: each `subscriptions/listen` stream
    /// watches it (a change between two waits is not lost).
    pub(super) tools_changed: Arc<tokio::sync::watch::Sender<u64>>,
}

/// `run_script` as `run.describe` gives it to engines (the same input schema), with
/// the schema of its `structuredContent` and annotations.
fn run_script_tool(describe: &str) -> Tool {
    let mut t = crate::policy::describe::run_script_tool(describe);
    t["outputSchema"] = result::output_schema();
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

fn me() -> Implementation {
    Implementation::new("scriptgate", env!("CARGO_PKG_VERSION"))
}

/// Whether a request speaks 2026-07-28 or later (no `initialize`, no requests
/// from the server).
fn modern(context: &RequestContext<RoleServer>) -> bool {
    context
        .protocol_version()
        .is_some_and(|v| v.as_str() >= ProtocolVersion::V_2026_07_28.as_str())
}

/// The origin a transport put in the request: `--http`'s (inside the HTTP
/// parts rmcp hands on), else the local user over stdio.
fn origin(context: &RequestContext<RoleServer>) -> Option<Origin> {
    context
        .extensions
        .get::<::http::request::Parts>()
        .and_then(|p| p.extensions.get::<Origin>())
        .or_else(|| context.extensions.get::<Origin>())
        .cloned()
}

fn who(context: &RequestContext<RoleServer>) -> Principal {
    origin(context).map_or_else(Principal::local, |o| o.who)
}

/// Whether the client can show a form (elicitation, form mode, declared in this
/// request or at `initialize`).
fn can_ask(caps: Option<&ClientCapabilities>) -> bool {
    caps.and_then(|c| c.elicitation.as_ref())
        .is_some_and(|e| e.form.is_some() || e.url.is_none())
}

impl ServerHandler for CodeMode {
    fn get_info(&self) -> ServerConfig {
        let caps = ServerCapabilities::builder()
            .enable_tools()
            .enable_tool_list_changed()
            .enable_tasks()
            .build();
        ServerConfig::new(caps).with_server_info(me()).with_instructions(
            "run_script runs one Python script that calls the tools below in loops; only what it prints comes back.",
        )
    }

    fn supported_protocol_versions(&self) -> Cow<'static, [ProtocolVersion]> {
        Cow::Owned(VERSIONS.to_vec())
    }

    async fn on_initialized(&self, context: rmcp::service::NotificationContext<RoleServer>) {
        let mut clients = self.clients.lock().unwrap_or_else(|p| p.into_inner());
        clients.retain(|c| !c.is_transport_closed());
        clients.push(context.peer);
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
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
        let mut r = ListToolsResult::with_all_items(tools);
        r.ttl_ms = Some(TOOLS_TTL_MS);
        // The list is this user's upstream servers: not for shared caches.
        r.cache_scope = Some(CacheScope::Private);
        if modern(&context) {
            r.meta = Some(server_meta());
        }
        Ok(r)
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, McpError> {
        let stamp = modern(&context);
        let mut answer = self.call(request, context).await?;
        if stamp {
            match &mut answer {
                CallToolResponse::Complete(r) => r.meta = Some(server_meta()),
                CallToolResponse::Task(t) => t.meta = Some(server_meta()),
                CallToolResponse::InputRequired(r) => r.meta = Some(server_meta()),
                _ => {}
            }
        }
        Ok(answer)
    }

    async fn get_task(
        &self,
        request: GetTaskParams,
        context: RequestContext<RoleServer>,
    ) -> Result<GetTaskResult, McpError> {
        let task = self
            .tasks
            .get(&self.scripts, &request.task_id, &who(&context))
            .await?;
        let mut r = GetTaskResult::new(task);
        r.meta = Some(server_meta());
        Ok(r)
    }

    async fn cancel_task(
        &self,
        request: CancelTaskParams,
        context: RequestContext<RoleServer>,
    ) -> Result<(), McpError> {
        self.tasks
            .cancel(&self.scripts, &request.task_id, &who(&context))
            .await
    }

    fn accepted_subscription_filter(
        &self,
        requested: &SubscriptionFilter,
    ) -> Option<SubscriptionFilter> {
        let mut f = SubscriptionFilter::new();
        f.tools_list_changed = requested.tools_list_changed;
        Some(f)
    }

    async fn listen(&self, context: SubscriptionContext) -> Result<(), McpError> {
        let rc = context.request_context();
        let who = who(rc);
        let task_ids = rc
            .extensions
            .get::<::http::request::Parts>()
            .and_then(|p| p.extensions.get::<ListenTaskIds>())
            .or_else(|| rc.extensions.get::<ListenTaskIds>())
            .cloned()
            .unwrap_or_default()
            .0;
        let tools = context.accepted().tools_list_changed == Some(true);
        // The client gone (stdin closed, its connection dropped): the stream
        // ends now, not when rmcp gives up on the requests in flight.
        let gone = origin(rc).map(|o| o.gone).unwrap_or_default();
        let mut finished = self.scripts.subscribe();
        let mut changes = self.tools_changed.subscribe();
        // Tasks already finished when the stream opens are told at once.
        for id in &task_ids {
            self.tell_task(&context, &who, id).await;
        }
        loop {
            tokio::select! {
                () = context.cancelled() => return Ok(()),
                () = gone.cancelled() => return Ok(()),
                Ok(()) = changes.changed(), if tools => {
                    if context.sink().notify_tool_list_changed().await.is_err() {
                        return Ok(());
                    }
                }
                r = finished.recv(), if !task_ids.is_empty() => match r {
                    Ok(script) => {
                        for id in task_ids.iter().filter(|id| self.tasks.names(id, &who, &script)) {
                            self.tell_task(&context, &who, id).await;
                        }
                    }
                    // Missed some: tell every task's state again.
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {
                        for id in &task_ids {
                            self.tell_task(&context, &who, id).await;
                        }
                    }
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => return Ok(()),
                },
            }
        }
    }
}

/// `_meta` with this server's identity, as 2026-07-28 asks of every result.
fn server_meta() -> rmcp::model::MetaObject {
    let mut m = rmcp::model::MetaObject::new();
    m.insert(
        "io.modelcontextprotocol/serverInfo".into(),
        serde_json::to_value(me()).expect("an Implementation serializes"),
    );
    m
}

impl CodeMode {
    async fn call(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, McpError> {
        let CallToolRequestParams {
            name,
            arguments,
            input_responses,
            request_state,
            ..
        } = request;
        let args = Value::Object(arguments.unwrap_or_default());
        if name == RUN_SCRIPT {
            let args: RunArgs = serde_json::from_value(args)
                .map_err(|e| McpError::invalid_params(format!("run_script: {e}"), None))?;
            return Ok(self
                .run_script(args, request_state, input_responses, context)
                .await);
        }
        let callable = self.passthrough
            && self
                .tools
                .specs()
                .iter()
                .any(|t| t.name == name && t.script_callable());
        if !callable {
            return Err(McpError::invalid_params(format!("no tool {name:?}"), None));
        }
        let r = self.tools.call(&name, args).await;
        Ok(match r {
            Ok(r) => result::text_result(r.text, r.structured, r.is_error),
            Err(e) => result::text_result(e.to_string(), None, true),
        }
        .into())
    }

    fn snapshot(&self, workspace: PathBuf) -> Snapshot {
        Snapshot {
            workspace,
            read_only: false,
            permission_mode: self.mode,
            session_allowed: vec![],
            tools: self.tools.specs(),
            limits: SnapshotLimits::default(),
        }
    }

    /// The declared write tools that need the user's approval, as `(name,
    /// class)`; empty when none do (or the start will be refused anyway, which
    /// the start then says).
    fn to_approve(&self, args: &RunArgs) -> Vec<(String, String)> {
        if self.mode != PermissionMode::Approval || args.tools.is_empty() {
            return vec![];
        }
        match crate::policy::Policy::plan(&self.snapshot(self.base.clone()), &args.tools) {
            Ok((_, plan)) if plan.needs_approval => plan
                .declared
                .into_iter()
                .map(|(n, c)| (n, c.as_str().to_string()))
                .collect(),
            _ => vec![],
        }
    }

    async fn run_script(
        &self,
        args: RunArgs,
        request_state: Option<String>,
        input_responses: Option<rmcp::model::InputResponses>,
        context: RequestContext<RoleServer>,
    ) -> CallToolResponse {
        let who = who(&context);
        let caps = context.client_capabilities();
        let modern = modern(&context);
        let as_task = modern && caps.as_ref().is_some_and(|c| c.supports_tasks());
        let subject = Subject::of(&args.code, &args.tools, &args.description, self.mode);
        let key: RequestKey =
            Sha256::digest([who.as_str().as_bytes(), b"\0", subject.bytes()].concat()).into();
        // The grant a retry redeems, and why the user said no, if they did.
        let mut grant = None;
        let mut said_no = None;
        let approval = if self.mode == PermissionMode::Auto {
            Approval::Decided(true)
        } else if !modern {
            if can_ask(caps.as_ref()) {
                Approval::Elicit
            } else {
                Approval::CannotAsk
            }
        } else if let Some(state) = request_state {
            // A retry: the state must verify for this client and this script.
            let nonce = match self.grants.open(&state, &who, subject) {
                Ok(n) => n,
                Err(r) => return result::refused(&r.message(), None).into(),
            };
            let Some(answer) = approval::answer(input_responses.as_ref()) else {
                // No answer: ask again.
                return self.ask(&who, subject, &args).into();
            };
            match self.grants.redeem(&nonce) {
                Err(r) => return result::refused(&r.message(), None).into(),
                Ok(Redeemed::First) => {}
                Ok(Redeemed::Again(started)) => {
                    // This grant was used: never a second script. A re-issue of
                    // the call that used it gets that call's script.
                    return match started.as_deref().and_then(|id| self.scripts.get(id)) {
                        Some(s) if s.owner == who => {
                            s.set_claim(Claim::Call);
                            self.answer(s, as_task, &who, &context).await
                        }
                        _ => result::refused(&used_already(started.as_deref()), None).into(),
                    };
                }
            }
            grant = Some(nonce);
            match answer {
                Ok(()) => Approval::Decided(true),
                Err(why) => {
                    // The start is refused (and recorded); the answer says why.
                    said_no = Some(why);
                    Approval::Decided(false)
                }
            }
        } else if self.to_approve(&args).is_empty() {
            Approval::Decided(false)
        } else if can_ask(caps.as_ref()) {
            return self.ask(&who, subject, &args).into();
        } else {
            Approval::CannotAsk
        };
        // A re-issue of a call whose client went away before its answer: the
        // same script, not a second run.
        if let Some(s) = self.scripts.adopt_orphan(&who, &key) {
            return self.answer(s, as_task, &who, &context).await;
        }
        let ui = Arc::new(McpUi::new(
            context.peer.clone(),
            context.meta.get_progress_token(),
            approval,
        ));
        // A call that leaves its script to run on when its client goes: the
        // connection to ask whether it went, from the start.
        let line = origin(&context).and_then(|o| o.line).filter(|_| as_task);
        let launch = match self.launch(args, &ui, &who, key, line) {
            Ok(l) => l,
            Err(f) => return result::refused(&f.message, None).into(),
        };
        match self.scripts.start(launch).await {
            Ok(s) => {
                if let Some(nonce) = &grant {
                    self.grants.bind(nonce, &s.id);
                }
                self.answer(s, as_task, &who, &context).await
            }
            Err(f) => {
                let note = match (ui.why_not_asked(), said_no) {
                    (Some(n), _) => Some(n.to_string()),
                    (None, Some(why)) => Some(format!("scriptgate: {why}.")),
                    (None, None) => None,
                };
                result::refused(&f.message, note.as_deref()).into()
            }
        }
    }

    /// What starts the script of `args` in a fresh workspace, with the engine
    /// that serves its calls through `ui`; or why no workspace can be made.
    fn launch(
        &self,
        args: RunArgs,
        ui: &Arc<McpUi>,
        who: &Principal,
        key: RequestKey,
        line: Option<Arc<Line>>,
    ) -> Result<Launch, crate::cli::exit::Failure> {
        let workspace = crate::cli::run::fresh_workspace(&self.base, &self.identity)?;
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
        Ok(Launch {
            snap: self.snapshot(workspace.clone()),
            workspace,
            params,
            engine: Arc::new(CliEngine {
                tools: self.tools.clone(),
                ui: ui.clone(),
            }),
            ui: ui.clone(),
            owner: who.clone(),
            key,
            line,
        })
    }

    /// The `InputRequiredResult` that asks for the approval.
    fn ask(
        &self,
        who: &Principal,
        subject: Subject,
        args: &RunArgs,
    ) -> rmcp::model::InputRequiredResult {
        let tools = self.to_approve(args);
        self.grants
            .ask(who, subject, &tools, &args.description, &args.code)
    }

    /// Answer a call with its script: its result once it ends; a task handle
    /// once it has run `task_after` (where the request declared tasks). A call
    /// whose client goes away (cancelled, or its connection closed) cancels
    /// its script, unless the request declared tasks: then the script runs on
    /// for a re-issue of the call (which gets it) or for `tasks/get`.
    async fn answer(
        &self,
        s: Arc<Script>,
        as_task: bool,
        who: &Principal,
        context: &RequestContext<RoleServer>,
    ) -> CallToolResponse {
        let origin = origin(context);
        let line = origin.as_ref().and_then(|o| o.line.clone());
        let mut guard = Abandon {
            turn: s.hold(line.filter(|_| as_task)),
            script: s.clone(),
            keep: as_task,
            armed: true,
        };
        // Over HTTP in 2026-07-28, rmcp cancels the call when its stream
        // closes, which is also how such a client cancels.
        let stream_call = as_task && origin.is_some();
        let gone = origin.map(|o| o.gone).unwrap_or_default();
        let after = tokio::time::sleep(self.task_after);
        tokio::pin!(after);
        tokio::select! {
            d = s.wait() => {
                guard.armed = false;
                s.settle(guard.turn, Claim::Delivered);
                d.answer.clone().into()
            }
            () = &mut after, if as_task => {
                guard.armed = false;
                s.settle(guard.turn, Claim::Task);
                self.tasks.handle(&s, who).into()
            }
            () = context.ct.cancelled() => {
                if stream_call {
                    // Its stream closed: the script runs on for a re-issue or
                    // `tasks/get` (the guard makes it an orphan).
                    drop(guard);
                    return result::refused("the client's stream closed", None).into();
                }
                // The client cancelled the call (`notifications/cancelled`).
                guard.keep = false;
                drop(guard);
                s.wait().await.answer.clone().into()
            }
            () = gone.cancelled() => {
                // The client's connection closed: nobody reads this answer.
                drop(guard);
                result::refused("the client's connection closed", None).into()
            }
        }
    }

    /// Send `notifications/tasks` with the state of task `id` on a
    /// subscription, if it has finished. rmcp's `SubscriptionSink` refuses task
    /// notifications (its filter has no `taskIds`), so it goes out on the
    /// subscription's peer with the subscription's id, as the sink would.
    async fn tell_task(&self, sub: &SubscriptionContext, who: &Principal, id: &str) {
        let Ok(task) = self.tasks.get(&self.scripts, id, who).await else {
            return;
        };
        if !task.status().is_terminal() {
            return;
        }
        let mut n = TaskStatusNotification::new(TaskStatusNotificationParams::from(task));
        let mut meta = rmcp::model::NotificationMetaObject::new();
        meta.set_subscription_id(sub.request_context().id.clone());
        n.extensions.insert(meta);
        let _ = sub
            .request_context()
            .peer
            .send_notification(ServerNotification::TaskStatusNotification(n))
            .await;
    }
}

fn used_already(started: Option<&str>) -> String {
    match started {
        Some(id) if !id.is_empty() => format!("script refused: this approval was used already, by script {id} (see `scriptgate show {id}`); call run_script again to be asked again"),
        _ => "script refused: this approval was used already (its script is starting, or its start was refused); call run_script again to be asked again".into(),
    }
}

/// A call that ends before its answer (its future dropped: the client went
/// away): its script is cancelled, or, where the request declared tasks, left
/// to run for a re-issue or `tasks/get`.
struct Abandon {
    script: Arc<Script>,
    /// The call's turn (`Script::hold`).
    turn: u64,
    keep: bool,
    armed: bool,
}

impl Drop for Abandon {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        self.script.release(self.turn, self.keep);
    }
}
