//! The MCP server's handler: `run_script` (and, with `--passthrough`, the upstream
//! tools), for clients of both protocol eras.

use crate::cli::exit::Failure;
use crate::cli::run::{CliEngine, EmbeddedDaemon, Tools};
use crate::config::Config;
use crate::protocol::snapshot::{PermissionMode, Snapshot, SnapshotLimits};
use crate::protocol::{ScriptResult, StartParams, Status};
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ListToolsResult,
    PaginatedRequestParams, ServerCapabilities, ServerConfig, Tool,
};
use rmcp::service::{Peer, RequestContext, RoleServer};
use rmcp::{ErrorData as McpError, ServerHandler};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use super::ui::McpUi;

/// The one tool.
const RUN_SCRIPT: &str = "run_script";

/// Where scripts run, chosen once at start.
pub(super) enum Where {
    Embedded(EmbeddedDaemon),
    Socket {
        path: PathBuf,
        system: bool,
        cfg: Box<Config>,
    },
}

#[derive(Clone)]
pub(super) struct CodeMode {
    pub(super) tools: Arc<Tools>,
    pub(super) runs_in: Arc<Where>,
    /// Fresh workspaces go here.
    pub(super) base: PathBuf,
    /// The uid scripts run as (the workspace's owner).
    pub(super) identity: crate::sys::Identity,
    pub(super) mode: PermissionMode,
    pub(super) passthrough: bool,
    /// `run_script`'s description: the `describe` text of the upstream tools,
    /// made again when an upstream server's tool list changes.
    pub(super) describe: Arc<std::sync::RwLock<String>>,
    /// The connected clients, told when the tools change. Closed ones are
    /// dropped whenever one connects, so it holds at most the open sessions and
    /// one closed one.
    pub(super) clients: Arc<Mutex<Vec<Peer<RoleServer>>>>,
    /// Held (read) by each running script; taken (write) before the process
    /// exits, so that scripts the client's going away cancelled are recorded.
    pub(super) inflight: Arc<tokio::sync::RwLock<()>>,
}

/// `run_script` as `run.describe` gives it to engines (the same input schema), with
/// the schema of its `structuredContent` and annotations.
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
        let r = match crate::cli::run::fresh_workspace(&self.base, &self.identity) {
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
                let c = crate::cli::run::connect(path, *system, cfg).await?;
                crate::cli::run::run_socket(c, cfg, snap, params, engine, cancelled).await
            }
        }
    }
}
