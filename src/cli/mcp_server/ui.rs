//! One `run_script` call's side of its MCP client: the approval (asked through
//! `elicitation/create` in the handshake era; decided before the start in
//! 2026-07-28, see `approval`) and the progress on the call's `progressToken`,
//! which also becomes the task's status message.

use crate::cli::run::RunUi;
use crate::protocol::rpc::BoxFuture;
use crate::protocol::{ApprovalRequest, ScriptResult, ScriptStatus};
use rmcp::model::{
    ElicitRequestParams, ElicitationAction, ProgressNotificationParam, ProgressToken,
};
use rmcp::service::{Peer, RoleServer};
use serde_json::{json, Value};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// At most one progress notification a second per script.
const PROGRESS_EVERY: Duration = Duration::from_secs(1);

/// How the one approval of a script's declared write tools is answered.
pub(super) enum Approval {
    /// Ask the client with `elicitation/create` (handshake era, elicitation
    /// declared).
    Elicit,
    /// Already decided: `--mode auto`, or the user's answer to the
    /// `InputRequiredResult` of 2026-07-28.
    Decided(bool),
    /// The client cannot be asked: denied, and the result says why.
    CannotAsk,
}

pub(super) struct McpUi {
    peer: Peer<RoleServer>,
    token: Option<ProgressToken>,
    approval: Approval,
    state: Mutex<Progress>,
    wake: tokio::sync::Notify,
}

#[derive(Default)]
struct Progress {
    /// The newest `script.progress` not yet sent.
    latest: Option<ScriptStatus>,
    /// The newest progress as one line: the task's status message.
    line: String,
    /// The last value sent: MCP progress only grows.
    value: f64,
    /// An approval was needed and the client could not be asked.
    not_asked: bool,
    /// No more notifications: the call was answered (with a task) or is gone.
    detached: bool,
}

/// Why a client that cannot be asked had its write tools denied.
pub(super) const CANNOT_ASK: &str = "scriptgate: the declared write tools need the user's approval, and this MCP client cannot be asked (it declares no form elicitation in this request): they were denied. To allow declared write tools without asking, start scriptgate mcp with --mode auto.";

impl McpUi {
    pub(super) fn new(
        peer: Peer<RoleServer>,
        token: Option<ProgressToken>,
        approval: Approval,
    ) -> McpUi {
        McpUi {
            peer,
            token,
            approval,
            state: Mutex::default(),
            wake: tokio::sync::Notify::new(),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, Progress> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Why the user was not asked, for the result.
    pub(super) fn why_not_asked(&self) -> Option<&'static str> {
        self.state().not_asked.then_some(CANNOT_ASK)
    }

    /// The newest progress, as a task's status message.
    pub(super) fn line(&self) -> String {
        let line = &self.state().line;
        if line.is_empty() {
            "running".into()
        } else {
            line.clone()
        }
    }

    /// Send no more progress: the call was answered with a task, or its client
    /// went away.
    pub(super) fn detach(&self) {
        self.state().detached = true;
    }

    /// Sends the newest progress at most once a second, while attached.
    pub(super) async fn pace(self: Arc<Self>) {
        loop {
            self.wake.notified().await;
            let latest = self.state().latest.take();
            if let Some(p) = latest {
                let (done, total) = match &p.progress {
                    Some(pr) if pr.total > 0 => (pr.done as f64, Some(pr.total as f64)),
                    _ => (p.calls as f64, None),
                };
                self.send(done, total, progress_line(&p)).await;
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
        let value = self.state().value;
        self.send(value.max(r.calls as f64), None, message).await;
    }

    async fn send(&self, value: f64, total: Option<f64>, message: String) {
        let Some(token) = &self.token else {
            return;
        };
        let value = {
            let mut s = self.state();
            if s.detached {
                return;
            }
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

/// One line for a `script.progress`: the script's own message (escaped: a
/// client shows it), and the call counts.
fn progress_line(p: &ScriptStatus) -> String {
    let counts = format!("{} calls, {} failed", p.calls, p.failures);
    match p.progress.as_ref().map(|pr| pr.message.as_str()) {
        Some(m) if !m.is_empty() => format!("{} ({counts})", crate::text::escape(m)),
        _ => counts,
    }
}

impl RunUi for McpUi {
    fn approve(self: Arc<Self>, p: ApprovalRequest) -> BoxFuture<'static, bool> {
        Box::pin(async move {
            match self.approval {
                Approval::Decided(yes) => return yes,
                Approval::CannotAsk => {
                    self.state().not_asked = true;
                    return false;
                }
                Approval::Elicit => {}
            }
            let tools: Vec<(String, String)> = p
                .tools
                .iter()
                .map(|t| (t.name.clone(), t.class.to_string()))
                .collect();
            let form = form(&tools, &p.description, &p.code);
            match self.peer.create_elicitation(form).await {
                Ok(r) => {
                    r.action == ElicitationAction::Accept
                        && r.content.as_ref().and_then(|c| c.get("allow")) == Some(&json!(true))
                }
                Err(e) => {
                    // The client's error quotes what the client said.
                    eprintln!(
                        "scriptgate mcp: the approval could not be asked: {}; denied",
                        crate::text::Untrusted::line(&e.to_string())
                    );
                    false
                }
            }
        })
    }

    fn progress(&self, p: &ScriptStatus) {
        {
            let mut s = self.state();
            s.line = progress_line(p);
            s.latest = Some(p.clone());
        }
        self.wake.notify_one();
    }
}

/// The approval form, for `elicitation/create` (handshake era) and for the
/// `InputRequiredResult` (2026-07-28): the tools, what the script is for, and
/// the script with numbered lines; everything the script's author wrote is
/// escaped.
pub(super) fn form(
    tools: &[(String, String)],
    description: &str,
    code: &str,
) -> ElicitRequestParams {
    serde_json::from_value(form_value(tools, description, code))
        .expect("the approval form is well-formed")
}

pub(super) fn form_value(tools: &[(String, String)], description: &str, code: &str) -> Value {
    use crate::text::{escape, numbered_source};
    let tools: Vec<String> = tools
        .iter()
        .map(|(name, class)| format!("{} ({class})", escape(name)))
        .collect();
    let message = format!(
        "A script asks to use write tools, once: {}.\nWhat it is for: {}\n--- script ---\n{}--------------",
        tools.join(", "),
        escape(description),
        numbered_source(code)
    );
    json!({
        "mode": "form",
        "message": message,
        "requestedSchema": {
            "type": "object",
            "properties": {"allow": {"type": "boolean", "title": "Allow these write tools for this script", "default": false}},
            "required": ["allow"]
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_form_shows_escaped_text_and_numbered_lines() {
        let f = form_value(
            &[("srv__reboot_all".into(), "write".into())],
            "status\u{202e}",
            "tools.srv.reboot_all()  # \x1b[2K\x1b[1G   2 | print(tools.srv.get_status())\n",
        );
        let m = f["message"].as_str().unwrap();
        assert!(m.contains("srv__reboot_all (write)"), "{m}");
        assert!(m.contains("status\\u202e"), "{m}");
        assert!(
            m.contains("   1 | tools.srv.reboot_all()  # \\x1b[2K\\x1b[1G   2 | print"),
            "{m}"
        );
        assert!(
            !m.chars().any(|c| crate::text::is_unsafe(c) && c != '\n'),
            "{m}"
        );
    }
}
