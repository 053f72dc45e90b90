//! What a `tools/call` answer and a task's state say, read from the raw JSON
//! (the MCP Tasks extension, `io.modelcontextprotocol/tasks`, SEP-2663).
//!
//! scriptgate's client declares the extension on every request, so a server
//! may answer any `tools/call` with a `CreateTaskResult` (`resultType: "task"`)
//! instead of its result. The call is then driven to its end within its own
//! timeout (`Server::call`): `tasks/get` at the server's `pollIntervalMs` until
//! the task is `completed` (its `result` is the call's), `failed` or
//! `cancelled`, and `tasks/cancel` when the call is given up. rmcp 3.11 has the
//! messages (`GetTaskRequest`, `CancelTaskRequest`) but drives no task: its
//! `call_tool` fails on a task answer and leaves polling to its caller.
//!
//! What scriptgate cannot give, it does not pretend to: a task (or a call)
//! that asks for input (`input_required`: elicitation, sampling, roots) fails
//! with the methods it asked for, and a task is cancelled first.

use crate::protocol::framing::clip;
use serde_json::Value;
use std::time::Duration;

/// The poll interval when a task names none (rmcp's servers' default).
pub const DEFAULT_POLL: Duration = Duration::from_millis(1000);
/// The shortest poll interval taken from a server.
pub const MIN_POLL: Duration = Duration::from_millis(10);

/// What the answer to a `tools/call` is (`resultType`; none is `complete`).
#[derive(Debug, PartialEq)]
pub enum Reply {
    /// A `CallToolResult`.
    Complete,
    /// A `CreateTaskResult`: the task's id.
    Task(String),
    /// An `InputRequiredResult` (multi round-trip): what it asks for.
    InputRequired(String),
    /// A task answer without a usable `taskId`, or a `resultType` of no
    /// version scriptgate knows.
    Unreadable(String),
}

pub fn reply(result: &Value) -> Reply {
    match result.get("resultType") {
        None | Some(Value::Null) => Reply::Complete,
        Some(Value::String(t)) if t == "complete" => Reply::Complete,
        Some(Value::String(t)) if t == "task" => match result.get("taskId") {
            Some(Value::String(id)) if !id.is_empty() => Reply::Task(id.clone()),
            _ => Reply::Unreadable("a task answer (resultType \"task\") with no taskId".into()),
        },
        Some(Value::String(t)) if t == "input_required" => {
            Reply::InputRequired(asked_for(result.get("inputRequests")))
        }
        Some(other) => Reply::Unreadable(format!(
            "an answer of resultType {}, which scriptgate does not know",
            clip(&other.to_string(), 100)
        )),
    }
}

/// Where a task is, from its state (a `CreateTaskResult`, or a `tasks/get`
/// answer).
#[derive(Debug, PartialEq)]
pub enum Step<'a> {
    /// Still working: ask again after this long.
    Working(Duration),
    /// Completed: the call's result.
    Completed(&'a Value),
    /// Failed with a JSON-RPC error, or cancelled by the server: why.
    Failed(String),
    /// Waits for input scriptgate cannot give: what it asks for.
    InputRequired(String),
    /// Not a task state scriptgate can read: why.
    Unreadable(String),
}

pub fn step<'a>(task: &'a Value, id: &str) -> Step<'a> {
    if let Some(other) = task.get("taskId").and_then(Value::as_str) {
        if other != id {
            return Step::Unreadable(format!(
                "tasks/get for task {} answered for task {}",
                clip(id, 100),
                clip(other, 100)
            ));
        }
    }
    let message = || {
        task.get("statusMessage")
            .and_then(Value::as_str)
            .map(|m| format!(": {}", clip(m, 1000)))
            .unwrap_or_default()
    };
    match task.get("status").and_then(Value::as_str) {
        Some("working") => Step::Working(poll_interval(task)),
        Some("completed") => match task.get("result") {
            Some(r) if r.is_object() => Step::Completed(r),
            _ => Step::Unreadable("a completed task with no result".into()),
        },
        Some("failed") => {
            let e = task.get("error");
            let text = e
                .and_then(|e| e.get("message"))
                .and_then(Value::as_str)
                .map(|m| clip(m, 1000))
                .unwrap_or_default();
            let code = e
                .and_then(|e| e.get("code"))
                .and_then(Value::as_i64)
                .map(|c| format!(" ({c})"))
                .unwrap_or_default();
            if text.is_empty() {
                Step::Failed(format!("the task failed{}", message()))
            } else {
                Step::Failed(format!("the task failed: {text}{code}"))
            }
        }
        Some("cancelled") => Step::Failed(format!("the server cancelled the task{}", message())),
        Some("input_required") => Step::InputRequired(asked_for(task.get("inputRequests"))),
        Some(other) => Step::Unreadable(format!(
            "a task in status {}, which scriptgate does not know",
            clip(other, 100)
        )),
        None => Step::Unreadable("a task state with no status".into()),
    }
}

/// The task's `pollIntervalMs`, at least `MIN_POLL`; `DEFAULT_POLL` if none.
fn poll_interval(task: &Value) -> Duration {
    match task.get("pollIntervalMs").and_then(Value::as_u64) {
        Some(ms) => Duration::from_millis(ms).max(MIN_POLL),
        None => DEFAULT_POLL,
    }
}

/// The methods of `inputRequests` (`elicitation/create`, …), for a message.
fn asked_for(requests: Option<&Value>) -> String {
    let mut methods: Vec<&str> = requests
        .and_then(Value::as_object)
        .into_iter()
        .flat_map(|m| m.values())
        .filter_map(|r| r.get("method").and_then(Value::as_str))
        .collect();
    methods.sort_unstable();
    methods.dedup();
    if methods.is_empty() {
        return "input".into();
    }
    let shown: Vec<String> = methods.iter().take(5).map(|m| clip(m, 60)).collect();
    shown.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn replies_follow_result_type() {
        assert_eq!(reply(&json!({"content": []})), Reply::Complete);
        assert_eq!(
            reply(&json!({"resultType": "complete", "content": []})),
            Reply::Complete
        );
        assert_eq!(
            reply(&json!({"resultType": "task", "taskId": "t1", "status": "working"})),
            Reply::Task("t1".into())
        );
        assert!(matches!(
            reply(&json!({"resultType": "task"})),
            Reply::Unreadable(m) if m.contains("no taskId")
        ));
        assert_eq!(
            reply(&json!({"resultType": "input_required", "inputRequests": {
                "a": {"method": "elicitation/create"}, "b": {"method": "sampling/createMessage"},
                "c": {"method": "elicitation/create"}}})),
            Reply::InputRequired("elicitation/create, sampling/createMessage".into())
        );
        assert!(matches!(
            reply(&json!({"resultType": "stream"})),
            Reply::Unreadable(m) if m.contains("resultType \"stream\"")
        ));
    }

    #[test]
    fn task_states_step() {
        let t = |v: Value| v;
        assert_eq!(
            step(
                &t(json!({"taskId": "a", "status": "working", "pollIntervalMs": 50})),
                "a"
            ),
            Step::Working(Duration::from_millis(50))
        );
        assert_eq!(
            step(&t(json!({"status": "working", "pollIntervalMs": 0})), "a"),
            Step::Working(MIN_POLL)
        );
        assert_eq!(
            step(&t(json!({"status": "working"})), "a"),
            Step::Working(DEFAULT_POLL)
        );
        let done = json!({"taskId": "a", "status": "completed", "result": {"content": []}});
        assert_eq!(step(&done, "a"), Step::Completed(&done["result"]));
        assert!(
            matches!(step(&done, "b"), Step::Unreadable(m) if m.contains("answered for task a"))
        );
        assert_eq!(
            step(
                &t(
                    json!({"status": "failed", "error": {"code": -32603, "message": "disk on fire"}})
                ),
                "a"
            ),
            Step::Failed("the task failed: disk on fire (-32603)".into())
        );
        assert_eq!(
            step(
                &t(json!({"status": "cancelled", "statusMessage": "operator"})),
                "a"
            ),
            Step::Failed("the server cancelled the task: operator".into())
        );
        assert_eq!(
            step(
                &t(
                    json!({"status": "input_required", "inputRequests": {"k": {"method": "elicitation/create"}}})
                ),
                "a"
            ),
            Step::InputRequired("elicitation/create".into())
        );
        assert!(matches!(
            step(&t(json!({"status": "completed"})), "a"),
            Step::Unreadable(_)
        ));
        assert!(matches!(step(&t(json!({})), "a"), Step::Unreadable(_)));
    }
}
