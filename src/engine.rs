//! The daemon's view of an engine: whoever started a script and serves its tool
//! calls. A socket connection implements it (`server`), and so does the CLI's
//! in-process engine over MCP servers (`scriptgate run`).

use crate::protocol::{ApprovalRequest, Notification, ToolCall, ToolResult};
use serde_json::Value;
use std::future::Future;
use std::pin::Pin;

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

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

/// What the daemon needs of an engine. Implementations are typed; `approval` and
/// `notify` take the params as JSON for callers that still build them so (they
/// are parsed into the typed messages, which is the shape the wire carries).
pub trait EngineLink: Send + Sync {
    /// Identifies the connection; scripts are visible to the connection that started them.
    fn id(&self) -> u64;
    /// `tool.call`: one tool call of a script.
    fn tool_call(&self, params: ToolCall) -> BoxFuture<'_, Result<ToolResult, LinkError>>;
    /// `approval.request`; `Ok(true)` for `allow_once`.
    fn approval_request(
        &self,
        params: ApprovalRequest,
        timeout: std::time::Duration,
    ) -> BoxFuture<'_, Result<bool, LinkError>>;
    /// Send a notification (`script.progress`, `script.finished`); best effort.
    fn send(&self, notification: Notification);

    /// `approval_request` with JSON params.
    fn approval(
        &self,
        params: Value,
        timeout: std::time::Duration,
    ) -> BoxFuture<'_, Result<bool, LinkError>> {
        match serde_json::from_value::<ApprovalRequest>(params) {
            Ok(p) => self.approval_request(p, timeout),
            Err(e) => Box::pin(std::future::ready(Err(LinkError::Malformed(format!(
                "approval.request params: {e}"
            ))))),
        }
    }

    /// `send` with the method and JSON params.
    fn notify(&self, method: &str, params: Value) {
        match Notification::parse(method, params) {
            Ok(n) => self.send(n),
            Err(e) => tracing::error!("not sent: a malformed notification {e}"),
        }
    }
}
