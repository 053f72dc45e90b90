//! Wire types of the engine protocol (scriptgate-protocol(7)): JSON-RPC 2.0, one
//! message per line. Only types and constructors live here; no I/O.

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

pub const PROTOCOL_VERSION: u32 = 1;

/// JSON-RPC error codes used by scriptgated.
pub mod code {
    pub const PARSE_ERROR: i64 = -32700;
    pub const INVALID_REQUEST: i64 = -32600;
    pub const METHOD_NOT_FOUND: i64 = -32601;
    pub const INVALID_PARAMS: i64 = -32602;
    pub const INTERNAL: i64 = -32603;
    /// The peer is neither uid 0 nor in `auth.allowed_groups`.
    pub const PEER_NOT_ALLOWED: i64 = -32001;
    /// Token refused; `data.reason` says why.
    pub const TOKEN: i64 = -32010;
    /// Snapshot refused; `data.reason` and `data.field`.
    pub const SNAPSHOT: i64 = -32011;
    /// A tool named in `script.start`'s `tools` is refused; `data.tool`, `data.reason`.
    pub const TOOLS: i64 = -32012;
    /// Approval denied or not answered in time.
    pub const APPROVAL: i64 = -32013;
    /// The daemon runs `max_running` scripts already.
    pub const BUSY: i64 = -32015;
    /// No such script, or not visible to this connection.
    pub const NOT_FOUND: i64 = -32016;
    /// `script.wait` timed out; the script still runs.
    pub const STILL_RUNNING: i64 = -32017;
    /// Admin method refused: the peer is not root nor in `auth.admin_groups`.
    pub const NOT_ADMIN: i64 = -32018;
}

/// A JSON-RPC error object.
///
/// ```json
/// {"code": -32010, "message": "run token expired", "data": {"reason": "expired"}}
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, thiserror::Error)]
#[error("{message} ({code})")]
pub struct RpcError {
    pub code: i64,
    pub message: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub data: Option<Value>,
}

impl RpcError {
    pub fn new(code: i64, message: impl Into<String>) -> Self {
        RpcError {
            code,
            message: message.into(),
            data: None,
        }
    }
    pub fn with_data(code: i64, message: impl Into<String>, data: Value) -> Self {
        RpcError {
            code,
            message: message.into(),
            data: Some(data),
        }
    }
    pub fn invalid_params(message: impl Into<String>) -> Self {
        Self::new(code::INVALID_PARAMS, message)
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(code::INTERNAL, message)
    }
    pub fn not_found(script_id: &str) -> Self {
        Self::with_data(
            code::NOT_FOUND,
            format!("no script {script_id} visible to this connection"),
            json!({"reason": "not_found", "script_id": script_id}),
        )
    }
    /// The `data.reason` string, when there is one.
    pub fn reason(&self) -> Option<&str> {
        self.data.as_ref()?.get("reason")?.as_str()
    }
}

/// One incoming line, classified.
#[derive(Debug)]
pub enum Incoming {
    /// `{"jsonrpc":"2.0","id":1,"method":"script.start","params":{…}}`
    Request {
        id: Value,
        method: String,
        params: Value,
    },
    /// `{"jsonrpc":"2.0","method":"x","params":{…}}` (no id)
    Notification { method: String, params: Value },
    /// `{"jsonrpc":"2.0","id":7,"result":{…}}` or `…"error":{…}}`: answers a request we sent.
    Response {
        id: Value,
        result: Result<Value, RpcError>,
    },
}

/// Parse one line. `Err` carries the error to send back (with the id when known).
pub fn parse_line(line: &[u8]) -> Result<Incoming, (Value, RpcError)> {
    let v: Value = serde_json::from_slice(line).map_err(|e| {
        (
            Value::Null,
            RpcError::new(code::PARSE_ERROR, format!("parse error: {e}")),
        )
    })?;
    let Value::Object(mut m) = v else {
        return Err((
            Value::Null,
            RpcError::new(code::INVALID_REQUEST, "a message must be a JSON object"),
        ));
    };
    let id = m.remove("id");
    // JSON-RPC 2.0: every message says so. A request without it is refused; an
    // answer without it fails the request it answers (so the failure is seen).
    let versioned = m.remove("jsonrpc").is_some_and(|v| v == "2.0");
    let unversioned = || RpcError::new(code::INVALID_REQUEST, "`jsonrpc` must be \"2.0\"");
    if !versioned
        && !m.contains_key("method")
        && (m.contains_key("result") || m.contains_key("error"))
    {
        if let Some(id) = id.as_ref().filter(|i| !i.is_null()) {
            return Ok(Incoming::Response {
                id: id.clone(),
                result: Err(unversioned()),
            });
        }
    }
    if !versioned {
        return Err((id.unwrap_or(Value::Null), unversioned()));
    }
    if let Some(method) = m.remove("method") {
        let Value::String(method) = method else {
            return Err((
                id.unwrap_or(Value::Null),
                RpcError::new(code::INVALID_REQUEST, "`method` must be a string"),
            ));
        };
        let params = m.remove("params").unwrap_or(Value::Null);
        return Ok(match id {
            Some(id) if !id.is_null() => Incoming::Request { id, method, params },
            _ => Incoming::Notification { method, params },
        });
    }
    let Some(id) = id else {
        return Err((
            Value::Null,
            RpcError::new(
                code::INVALID_REQUEST,
                "message has neither `method` nor `id`",
            ),
        ));
    };
    if let Some(err) = m.remove("error") {
        let err = serde_json::from_value(err)
            .unwrap_or_else(|_| RpcError::new(code::INTERNAL, "malformed error object"));
        return Ok(Incoming::Response {
            id,
            result: Err(err),
        });
    }
    match m.remove("result") {
        Some(result) => Ok(Incoming::Response {
            id,
            result: Ok(result),
        }),
        None => Err((
            id,
            RpcError::new(
                code::INVALID_REQUEST,
                "response has neither `result` nor `error`",
            ),
        )),
    }
}

pub fn request_line(id: u64, method: &str, params: &Value) -> String {
    json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}).to_string() + "\n"
}

pub fn notification_line(method: &str, params: &Value) -> String {
    json!({"jsonrpc": "2.0", "method": method, "params": params}).to_string() + "\n"
}

pub fn response_line(id: &Value, result: &Result<Value, RpcError>) -> String {
    match result {
        Ok(v) => json!({"jsonrpc": "2.0", "id": id, "result": v}),
        Err(e) => json!({"jsonrpc": "2.0", "id": id, "error": e}),
    }
    .to_string()
        + "\n"
}

/// `script.start` params.
///
/// ```json
/// {"token": "eyJ…", "code": "import agent_tools\n…", "tools": ["fleet__reboot_device"], "description": "reboot stale devices"}
/// ```
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StartParams {
    pub token: String,
    pub code: String,
    #[serde(default)]
    pub tools: Vec<String>,
    #[serde(default)]
    pub description: String,
}

/// Params of `script.wait`, `script.status`, `script.cancel`.
///
/// ```json
/// {"script_id": "4f1c…", "timeout_s": 30, "token": "eyJ…"}
/// ```
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScriptRef {
    pub script_id: String,
    #[serde(default)]
    pub timeout_s: Option<f64>,
    /// A valid token of the script's run grants access from any connection.
    #[serde(default)]
    pub token: Option<String>,
}

/// What a tool call returns, from the engine to the daemon and on to the script.
///
/// ```json
/// {"text": "online", "structured": {"sn": "A1", "online": true}, "is_error": false}
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolResult {
    pub text: String,
    pub structured: Option<Value>,
    pub is_error: bool,
}

impl ToolResult {
    /// The engine's answer to `tool.call`, in exactly one of its two shapes (§5):
    ///
    /// ```json
    /// {"text": "SN1 online", "structured": {"online": true}, "is_error": false}
    /// {"content": [{"type": "text", "text": "boom"}], "isError": true}
    /// ```
    ///
    /// The first needs `text` and `is_error` (`structured` may be left out: null);
    /// the second is an MCP `CallToolResult` (`content`, optional
    /// `structuredContent`, `isError`, `_meta`), converted as `scriptgate run`
    /// converts MCP results. Anything else — an unknown key, a wrong type, neither
    /// `text` nor `content` — is an error naming the problem: a failed call, never
    /// an empty success.
    pub fn from_answer(v: &Value) -> Result<ToolResult, String> {
        let Value::Object(m) = v else {
            return Err("the answer must be a JSON object".into());
        };
        let unknown = |allowed: &[&str]| {
            m.keys()
                .find(|k| !allowed.contains(&k.as_str()))
                .map(|k| format!("unknown field `{k}`"))
        };
        if m.contains_key("content") {
            if let Some(e) = unknown(&["content", "structuredContent", "isError", "_meta"]) {
                return Err(format!("{e} in an MCP CallToolResult"));
            }
            let Some(items) = m["content"].as_array() else {
                return Err("`content` must be an array of content items".into());
            };
            if let Some(i) = items
                .iter()
                .position(|c| !c.get("type").is_some_and(Value::is_string))
            {
                return Err(format!("content[{i}] has no string `type`"));
            }
            if m.get("isError").is_some_and(|e| !e.is_boolean()) {
                return Err("`isError` must be a boolean".into());
            }
            return Ok(ToolResult::from_mcp(v));
        }
        if !m.contains_key("text") {
            return Err(
                "neither `text` ({text, structured, is_error}) nor `content` (an MCP CallToolResult)"
                    .into(),
            );
        }
        if let Some(e) = unknown(&["text", "structured", "is_error"]) {
            return Err(e);
        }
        let Some(text) = m["text"].as_str() else {
            return Err("`text` must be a string".into());
        };
        let Some(is_error) = m.get("is_error").and_then(Value::as_bool) else {
            return Err("`is_error` must be present and a boolean".into());
        };
        Ok(ToolResult {
            text: text.to_string(),
            structured: m.get("structured").cloned().filter(|s| !s.is_null()),
            is_error,
        })
    }

    /// An MCP `tools/call` result as `{text, structured, is_error}`: text contents
    /// joined, other content kinds named with their type and size.
    pub fn from_mcp(r: &Value) -> ToolResult {
        use base64::Engine as _;
        let mut parts = Vec::new();
        for c in r
            .get("content")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let kind = c.get("type").and_then(Value::as_str).unwrap_or("?");
            let mime = c.get("mimeType").and_then(Value::as_str).unwrap_or(kind);
            let size = |b64: Option<&Value>| {
                b64.and_then(Value::as_str)
                    .and_then(|d| base64::engine::general_purpose::STANDARD.decode(d).ok())
                    .map_or(0, |d| d.len())
            };
            let text = |v: &Value| v.get("text").and_then(Value::as_str).map(str::to_string);
            parts.push(match kind {
                "text" => text(c).unwrap_or_default(),
                "image" | "audio" => format!("[{mime}, {} bytes]", size(c.get("data"))),
                "resource_link" => format!(
                    "[resource link {}]",
                    c.get("uri").and_then(Value::as_str).unwrap_or("")
                ),
                "resource" => {
                    let res = c.get("resource").cloned().unwrap_or(Value::Null);
                    text(&res).unwrap_or_else(|| {
                        let mime = res
                            .get("mimeType")
                            .and_then(Value::as_str)
                            .unwrap_or("resource");
                        format!(
                            "[{mime}, {} bytes, {}]",
                            size(res.get("blob")),
                            res.get("uri").and_then(Value::as_str).unwrap_or("")
                        )
                    })
                }
                other => format!("[{other} content]"),
            });
        }
        ToolResult {
            text: parts.join("\n"),
            structured: r.get("structuredContent").cloned().filter(|v| !v.is_null()),
            is_error: r.get("isError").and_then(Value::as_bool).unwrap_or(false),
        }
    }
}

/// The engine's answer to `approval.request`.
///
/// ```json
/// {"decision": "allow_once"}
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApprovalAnswer {
    pub decision: Decision,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Decision {
    AllowOnce,
    Deny,
}

/// Why a script ended (§6 `status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Running,
    Ok,
    Error,
    Timeout,
    Cancelled,
    Oom,
    Limit,
    Interrupted,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Running => "running",
            Status::Ok => "ok",
            Status::Error => "error",
            Status::Timeout => "timeout",
            Status::Cancelled => "cancelled",
            Status::Oom => "oom",
            Status::Limit => "limit",
            Status::Interrupted => "interrupted",
        }
    }
    pub fn parse(s: &str) -> Option<Status> {
        serde_json::from_value(Value::String(s.to_string())).ok()
    }
}

/// The result object (§6).
///
/// ```json
/// {"script_id": "…", "run_id": "run-42", "status": "ok", "exit_code": 0, "calls": 500,
///  "failures": 0, "duration_ms": 3120, "details_dir": ".agent/scripts/…", "output": "…",
///  "output_truncated": false, "error": null, "text": "run_script ok: 500 calls, …"}
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScriptResult {
    pub script_id: String,
    pub run_id: String,
    pub status: Status,
    pub exit_code: Option<i32>,
    pub calls: u64,
    pub failures: u64,
    pub duration_ms: u64,
    pub details_dir: String,
    pub output: String,
    pub output_truncated: bool,
    pub error: Option<String>,
    pub text: String,
    /// Peak memory of the script's unit/cgroup, when the backend knows it (extension).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_peak_bytes: Option<u64>,
    /// CPU time of the script's unit/cgroup, when the backend knows it (extension).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_usec: Option<u64>,
}

impl ScriptResult {
    /// Fill `text` exactly as §6 says: one summary line, then the output, then
    /// (when not `ok`) the error tail. `truncated_note` follows a truncated output.
    pub fn with_text(mut self, truncated_note: Option<&str>) -> ScriptResult {
        let mut t = format!(
            "run_script {}: {} calls, {} failed, {:.1} s, details in {}\n",
            self.status.as_str(),
            self.calls,
            self.failures,
            self.duration_ms as f64 / 1000.0,
            self.details_dir
        );
        let add_line = |t: &mut String, s: &str| {
            if !t.ends_with('\n') {
                t.push('\n');
            }
            t.push_str(s);
            if !t.ends_with('\n') {
                t.push('\n');
            }
        };
        t.push_str(&self.output);
        if let Some(note) = truncated_note {
            add_line(&mut t, note);
        }
        if self.status != Status::Ok {
            if let Some(err) = self.error.as_deref().filter(|e| !e.is_empty()) {
                add_line(&mut t, &format!("error: {err}"));
            }
        }
        self.text = t;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classifies_requests_notifications_and_responses() {
        assert!(matches!(
            parse_line(br#"{"jsonrpc":"2.0","id":1,"method":"daemon.info"}"#),
            Ok(Incoming::Request { method, .. }) if method == "daemon.info"
        ));
        assert!(matches!(
            parse_line(br#"{"jsonrpc":"2.0","method":"x","params":{}}"#),
            Ok(Incoming::Notification { .. })
        ));
        assert!(matches!(
            parse_line(br#"{"jsonrpc":"2.0","id":"a","result":{"decision":"deny"}}"#),
            Ok(Incoming::Response { result: Ok(_), .. })
        ));
        assert!(matches!(
            parse_line(br#"{"jsonrpc":"2.0","id":3,"error":{"code":-1,"message":"no"}}"#),
            Ok(Incoming::Response { result: Err(e), .. }) if e.message == "no"
        ));
        let (_, e) = parse_line(b"{not json").unwrap_err();
        assert_eq!(e.code, code::PARSE_ERROR);
        let (_, e) = parse_line(b"[1,2]").unwrap_err();
        assert_eq!(e.code, code::INVALID_REQUEST);
    }

    fn result(status: Status, output: &str, error: Option<&str>) -> ScriptResult {
        ScriptResult {
            script_id: "x".into(),
            run_id: "r".into(),
            status,
            exit_code: None,
            calls: 500,
            failures: 1,
            duration_ms: 3120,
            details_dir: ".agent/scripts/x".into(),
            output: output.into(),
            output_truncated: false,
            error: error.map(str::to_string),
            text: String::new(),
            memory_peak_bytes: None,
            cpu_usec: None,
        }
    }

    #[test]
    fn result_text_has_summary_output_and_error_tail() {
        let t = result(Status::Ok, "hello\n", None).with_text(None).text;
        assert_eq!(
            t,
            "run_script ok: 500 calls, 1 failed, 3.1 s, details in .agent/scripts/x\nhello\n"
        );
        let t = result(Status::Error, "partial", Some("Traceback…\nValueError: x"))
            .with_text(None)
            .text;
        assert_eq!(
            t,
            "run_script error: 500 calls, 1 failed, 3.1 s, details in .agent/scripts/x\npartial\nerror: Traceback…\nValueError: x\n"
        );
        let t = result(Status::Ok, "abc", None)
            .with_text(Some("[cut]"))
            .text;
        assert!(t.ends_with("\nabc\n[cut]\n"), "{t}");
    }
}
