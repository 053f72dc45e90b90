//! One `run_script` call's side of an MCP client of the handshake era: its
//! approval through `elicitation/create` and its progress on the call's
//! `progressToken`.

use crate::cli::run::RunUi;
use crate::protocol::rpc::BoxFuture;
use crate::protocol::snapshot::PermissionMode;
use crate::protocol::{ApprovalRequest, ScriptResult, ScriptStatus};
use rmcp::model::{
    ElicitRequestParams, ElicitationAction, ProgressNotificationParam, ProgressToken,
};
use rmcp::service::{Peer, RoleServer};
use serde_json::json;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// One `run_script` call's side of the MCP client: its approval through
/// elicitation and its progress on the call's `progressToken`.
/// At most one progress notification a second per script.
const PROGRESS_EVERY: Duration = Duration::from_secs(1);

pub(super) struct McpUi {
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
    pub(super) fn new(
        peer: Peer<RoleServer>,
        token: Option<ProgressToken>,
        mode: PermissionMode,
    ) -> McpUi {
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
    pub(super) fn why_not_asked(&self) -> Option<String> {
        let s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        (s.not_asked && self.mode == PermissionMode::Approval).then(|| {
            "scriptgate: the declared write tools need the user's approval, and this MCP client cannot be asked (it does not declare the elicitation capability): they were denied. To allow declared write tools without asking, start scriptgate mcp with --mode auto.".to_string()
        })
    }

    /// Sends the newest progress at most once a second.
    pub(super) async fn pace(self: Arc<Self>) {
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
    pub(super) async fn finish(&self, r: &ScriptResult) {
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
