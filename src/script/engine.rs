//! The daemon's view of an engine: whoever started a script and serves its tool
//! calls. A socket connection implements it (`server`), and so does the CLI's
//! in-process engine over MCP servers (`scriptgate run`).

use crate::protocol::rpc::BoxFuture;
use crate::protocol::{Answer, ApprovalRequest, Notification, Status, ToolCall};
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

/// Why the calls still at the engine are abandoned: set once, when the script
/// has ended, before they are dropped; an engine link reads it to tell the
/// engine (`tool.cancelled`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Abandoned {
    /// `cancelled`, `timeout`, `oom`, `interrupted` or `exited`.
    pub reason: &'static str,
    pub message: String,
}

impl Abandoned {
    /// From how the script was made to end (`script::forced`): its status when
    /// it was cancelled, timed out, ran out of memory or was interrupted;
    /// otherwise it ended by itself, `exited`.
    pub fn after(forced: Option<(Status, String)>) -> Abandoned {
        match forced {
            Some((
                s @ (Status::Cancelled | Status::Timeout | Status::Oom | Status::Interrupted),
                why,
            )) => Abandoned {
                reason: s.as_str(),
                message: why,
            },
            _ => Abandoned::exited(),
        }
    }

    /// The script ended by itself with calls outstanding.
    pub fn exited() -> Abandoned {
        Abandoned {
            reason: "exited",
            message: "the script ended before the engine answered".into(),
        }
    }

    /// Cut short (not `exited`): its calls get no grace to come back.
    pub fn cut_short(&self) -> bool {
        self.reason != "exited"
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
    fn tool_call(&self, params: ToolCall, end: CallEnd)
        -> BoxFuture<'_, Result<Answer, LinkError>>;
    /// `approval.request`; `Ok(true)` for `allow_once`.
    fn approval_request(
        &self,
        params: ApprovalRequest,
        timeout: std::time::Duration,
    ) -> BoxFuture<'_, Result<bool, LinkError>>;
    /// Send a notification (`script.progress`, `script.finished`); best effort.
    fn send(&self, notification: Notification);
}
