//! The daemon's view of an engine: whoever started a script and serves its tool
//! calls. A socket connection implements it (`server`), and so does the CLI's
//! in-process engine over MCP servers (`scriptgate run`).

use crate::protocol::rpc::BoxFuture;
use crate::protocol::{ApprovalRequest, Notification, Status, ToolAnswer, ToolCall};
use std::sync::{Arc, OnceLock};

/// Why a request to the engine did not produce an answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LinkError {
    /// The engine answered with a JSON-RPC error (message kept).
    #[error("{0}")]
    Answered(String),
    /// The engine's answer was not of the expected shape.
    #[error("malformed answer from the engine: {0}")]
    Malformed(String),
    #[error("engine disconnected")]
    Disconnected,
    #[error("the engine did not answer in time")]
    Timeout,
}

/// Why a call still at the engine is abandoned: how its script ended. The
/// wire spells it as `tool.cancelled`'s `reason`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AbandonReason {
    Cancelled,
    Timeout,
    Oom,
    Interrupted,
    /// The script ended by itself.
    Exited,
}

impl AbandonReason {
    /// Its wire name (scriptgate-protocol(7), `tool.cancelled`).
    pub const fn as_str(self) -> &'static str {
        match self {
            AbandonReason::Cancelled => "cancelled",
            AbandonReason::Timeout => "timeout",
            AbandonReason::Oom => "oom",
            AbandonReason::Interrupted => "interrupted",
            AbandonReason::Exited => "exited",
        }
    }
}

/// Why the calls still at the engine are abandoned: set once, when the script
/// has ended, before they are dropped; an engine link reads it to tell the
/// engine (`tool.cancelled`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Abandoned {
    pub reason: AbandonReason,
    pub message: String,
}

impl Abandoned {
    /// From how the script was made to end (`script::forced`): its status when
    /// it was cancelled, timed out, ran out of memory or was interrupted;
    /// otherwise it ended by itself, `exited`.
    pub fn after(forced: Option<(Status, String)>) -> Abandoned {
        let reason = match forced.as_ref().map(|(s, _)| s) {
            Some(Status::Cancelled) => AbandonReason::Cancelled,
            Some(Status::Timeout) => AbandonReason::Timeout,
            Some(Status::Oom) => AbandonReason::Oom,
            Some(Status::Interrupted) => AbandonReason::Interrupted,
            _ => return Abandoned::exited(),
        };
        let message = forced.map(|(_, why)| why).unwrap_or_default();
        Abandoned { reason, message }
    }

    /// The script ended by itself with calls outstanding.
    pub fn exited() -> Abandoned {
        Abandoned {
            reason: AbandonReason::Exited,
            message: "the script ended before the engine answered".into(),
        }
    }

    /// Cut short (not `exited`): its calls get no grace to come back.
    pub fn cut_short(&self) -> bool {
        self.reason != AbandonReason::Exited
    }
}

/// One per script, shared by its calls.
pub type CallEnd = Arc<OnceLock<Abandoned>>;

/// What the daemon needs of an engine, in the typed messages the wire carries.
pub trait EngineLink: Send + Sync {
    /// Identifies the connection; scripts are visible to the connection that started them.
    fn id(&self) -> u64;
    /// `tool.call`: one tool call of a script. A future dropped before its answer
    /// came is an abandoned call: the link tells the engine, with `end`'s reason.
    fn tool_call(
        &self,
        params: ToolCall,
        end: CallEnd,
    ) -> BoxFuture<'_, Result<ToolAnswer, LinkError>>;
    /// `approval.request`; `Ok(true)` for `allow_once`.
    fn approval_request(
        &self,
        params: ApprovalRequest,
        timeout: std::time::Duration,
    ) -> BoxFuture<'_, Result<bool, LinkError>>;
    /// Send a notification (`script.progress`, `script.finished`); best effort.
    fn send(&self, notification: Notification);
}
