//! The script channel: `agent_tools` inside the sandbox writes requests to fd 3
//! and reads replies from fd 4, one JSON object per line (protocol §8). Parsing
//! is total and bounded: any bytes give a `Request` or a `BadRequest`.

use super::framing::{clip, clip_marked};
use super::Progress;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Items in one `call_many` request: what `agent_tools` sends (protocol §8).
pub const MAX_BATCH: usize = 50;
/// Bytes of a name the script sent that are quoted back (tool names in the
/// snapshot are at most 128 bytes, so a longer name can match nothing).
pub const MAX_NAME_BYTES: usize = 128;
/// Bytes of a progress message kept.
pub const MAX_PROGRESS_MESSAGE_BYTES: usize = 500;
/// Bytes of an uncaught `ToolError` code kept.
pub const MAX_CODE_BYTES: usize = 32;

/// A request line on fd 3 as `agent_tools` writes it. Every field is taken
/// as any JSON value and normalised by `parse_request` (a wrong type reads as
/// empty), so that a script gets an answer, not a dropped line. `id` is read
/// before the `op`, so that even a bad request is answered with its id.
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum WireRequest {
    /// One call.
    ///
    /// ```json
    /// {"id": 1, "op": "call", "tool": "fleet__get_device_status", "args": {"sn": "A1"}}
    /// ```
    Call {
        #[serde(default)]
        tool: Value,
        #[serde(default = "empty_object")]
        args: Value,
    },
    /// One tool for each args dict, at most `MAX_BATCH`.
    ///
    /// ```json
    /// {"id": 2, "op": "call_many", "tool": "fleet__get_device_status", "args_list": [{"sn": "A1"}, {"sn": "A2"}]}
    /// ```
    CallMany {
        #[serde(default)]
        tool: Value,
        #[serde(default)]
        args_list: Value,
    },
    /// Progress for the engine; no reply.
    ///
    /// ```json
    /// {"op": "progress", "done": 1, "total": 9, "message": "devices"}
    /// ```
    Progress {
        #[serde(default)]
        done: Value,
        #[serde(default)]
        total: Value,
        #[serde(default)]
        message: Value,
    },
    /// The script is ending on an uncaught `ToolError` with this code; no reply.
    ///
    /// ```json
    /// {"op": "uncaught", "code": "limit", "tool": "fleet__get_device_status"}
    /// ```
    Uncaught {
        #[serde(default)]
        code: Value,
    },
    /// The tools the script can call, for `agent_tools.tools` (the typed API).
    ///
    /// ```json
    /// {"id": 3, "op": "tools"}
    /// ```
    Tools {},
}

fn empty_object() -> Value {
    Value::Object(Default::default())
}

impl WireRequest {
    /// The request in a parsed object, by its `op`, with the same defaults as
    /// the serde derive. Its fields are moved, not copied: serde's path for a
    /// tagged enum buffers a second copy of the whole request first, which
    /// doubles what a hostile line costs to parse.
    fn from_object(mut m: serde_json::Map<String, Value>) -> Option<WireRequest> {
        let op = match m.get("op") {
            Some(Value::String(op)) => op.clone(),
            _ => return None,
        };
        let args = m.remove("args").unwrap_or_else(empty_object);
        let mut take = |k: &str| m.remove(k).unwrap_or(Value::Null);
        Some(match op.as_str() {
            "call" => WireRequest::Call {
                tool: take("tool"),
                args,
            },
            "call_many" => WireRequest::CallMany {
                tool: take("tool"),
                args_list: take("args_list"),
            },
            "progress" => WireRequest::Progress {
                done: take("done"),
                total: take("total"),
                message: take("message"),
            },
            "uncaught" => WireRequest::Uncaught { code: take("code") },
            "tools" => WireRequest::Tools {},
            _ => return None,
        })
    }
}

/// One request from the script on fd 3, parsed and bounded.
#[derive(Debug, Clone, PartialEq)]
pub enum Request {
    Call {
        id: Value,
        tool: String,
        args: Value,
    },
    CallMany {
        id: Value,
        tool: String,
        args_list: Vec<Value>,
    },
    Progress(Progress),
    /// The script is ending on an uncaught `ToolError` with this code.
    Uncaught {
        code: String,
    },
    /// The tools the script can call (`policy::describe::script_tools`).
    Tools {
        id: Value,
    },
}

/// The codes a script's `ToolError` can carry (scriptgate-protocol(7),
/// "ToolError"), as the wire spells them: the reply's `error.code`, or a
/// result's `code`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolErrorCode {
    /// The snapshot's call table refuses the call.
    Denied,
    /// The arguments fail the tool's closed schema, or a number would be altered.
    InvalidArguments,
    /// The run's budget (`max_calls`, a tool's own) is spent.
    Limit,
    /// The tool answered with `is_error`.
    ToolError,
    /// The run was revoked (`run.revoke`).
    Revoked,
    /// The run's token expired (`exp`).
    Expired,
    /// The engine failed to answer properly: a malformed answer, a JSON-RPC
    /// error, a lost engine.
    Engine,
    /// The request line itself cannot be served.
    InvalidRequest,
}

impl ToolErrorCode {
    /// Every code, in the man page's order.
    pub const ALL: [ToolErrorCode; 8] = [
        ToolErrorCode::Denied,
        ToolErrorCode::InvalidArguments,
        ToolErrorCode::Limit,
        ToolErrorCode::ToolError,
        ToolErrorCode::Revoked,
        ToolErrorCode::Expired,
        ToolErrorCode::Engine,
        ToolErrorCode::InvalidRequest,
    ];

    /// Its wire name.
    pub const fn as_str(self) -> &'static str {
        match self {
            ToolErrorCode::Denied => "denied",
            ToolErrorCode::InvalidArguments => "invalid_arguments",
            ToolErrorCode::Limit => "limit",
            ToolErrorCode::ToolError => "tool_error",
            ToolErrorCode::Revoked => "revoked",
            ToolErrorCode::Expired => "expired",
            ToolErrorCode::Engine => "engine",
            ToolErrorCode::InvalidRequest => "invalid_request",
        }
    }

    /// The code a wire name spells, if it spells one (an uncaught `ToolError`
    /// the script reports, a refusal's code from `policy`).
    pub fn from_wire(name: &str) -> Option<ToolErrorCode> {
        ToolErrorCode::ALL.into_iter().find(|c| c.as_str() == name)
    }
}

impl std::fmt::Display for ToolErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A request line that cannot be served; answered as `{"id", "error"}`.
#[derive(Debug, Clone, PartialEq)]
pub struct BadRequest {
    pub id: Value,
    pub code: ToolErrorCode,
    pub message: String,
}

impl BadRequest {
    fn new(id: Value, code: ToolErrorCode, message: impl Into<String>) -> BadRequest {
        BadRequest {
            id,
            code,
            message: message.into(),
        }
    }
}

/// The mark of a clipped name: it starts with a space, which no snapshot tool
/// name may hold, so a clipped name can match no tool, whatever its length.
pub const CLIPPED_NAME_MARK: &str = " …";

/// A tool name the script sent: whole when it fits in `MAX_NAME_BYTES`, else
/// cut at a character boundary and marked with `CLIPPED_NAME_MARK`.
pub fn clip_name(s: &str) -> String {
    clip_marked(s, MAX_NAME_BYTES, CLIPPED_NAME_MARK)
}

fn name(v: &Value) -> String {
    match v {
        Value::String(s) => clip_name(s),
        _ => String::new(),
    }
}

fn text(v: &Value, max: usize) -> String {
    match v {
        Value::String(s) => clip(s, max),
        _ => String::new(),
    }
}

/// The `id` of a request line without parsing the rest of it (the other fields
/// are skipped, not built): for answering a line that is refused unparsed. Only
/// a number or a string is taken; anything else, or a malformed line, is null.
pub fn request_id(line: &[u8]) -> Value {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Id {
        Number(serde_json::Number),
        Text(String),
    }
    #[derive(Deserialize)]
    struct IdOnly {
        id: Option<Id>,
    }
    match serde_json::from_slice::<IdOnly>(line) {
        Ok(IdOnly {
            id: Some(Id::Number(n)),
        }) => Value::Number(n),
        Ok(IdOnly {
            id: Some(Id::Text(t)),
        }) => Value::String(t),
        _ => Value::Null,
    }
}

/// Parse one fd-3 line. Pure and total: any bytes give a request or a
/// `BadRequest`. Names are clipped to `MAX_NAME_BYTES` (plus a marker that no
/// snapshot name can hold, so a clipped name matches no tool) and `call_many` takes at most `MAX_BATCH` items.
pub fn parse_request(line: &[u8]) -> Result<Request, BadRequest> {
    let Ok(Value::Object(mut req)) = serde_json::from_slice::<Value>(line) else {
        return Err(BadRequest::new(
            Value::Null,
            ToolErrorCode::InvalidRequest,
            "not a JSON object",
        ));
    };
    let id = req.remove("id").unwrap_or(Value::Null);
    let Some(wire) = WireRequest::from_object(req) else {
        return Err(BadRequest::new(
            id,
            ToolErrorCode::InvalidRequest,
            "unknown op; use agent_tools",
        ));
    };
    match wire {
        WireRequest::Call { tool, args } => Ok(Request::Call {
            id,
            tool: name(&tool),
            args,
        }),
        WireRequest::CallMany { tool, args_list } => {
            let tool = name(&tool);
            match args_list {
                Value::Array(a) if a.len() <= MAX_BATCH => Ok(Request::CallMany {
                    id,
                    tool,
                    args_list: a,
                }),
                Value::Array(a) => Err(BadRequest::new(
                    id,
                    ToolErrorCode::InvalidArguments,
                    format!(
                        "call_many sends at most {MAX_BATCH} items per request, not {}; agent_tools.call_many batches them",
                        a.len()
                    ),
                )),
                _ => Err(BadRequest::new(
                    id,
                    ToolErrorCode::InvalidArguments,
                    "args_list must be a list of dicts",
                )),
            }
        }
        WireRequest::Progress {
            done,
            total,
            message,
        } => Ok(Request::Progress(Progress {
            done: done.as_i64().unwrap_or(0),
            total: total.as_i64().unwrap_or(0),
            message: text(&message, MAX_PROGRESS_MESSAGE_BYTES),
        })),
        WireRequest::Uncaught { code } => Ok(Request::Uncaught {
            code: text(&code, MAX_CODE_BYTES),
        }),
        WireRequest::Tools {} => Ok(Request::Tools { id }),
    }
}

/// A reply line on fd 4.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Reply {
    /// The answer to `call`, or to a request that could not be served.
    ///
    /// ```json
    /// {"id": 1, "result": {"text": "online", "structured": {"online": true}, "is_error": false}}
    /// {"id": 1, "error": {"code": "denied", "message": "fleet__reboot_device is a write tool …"}}
    /// ```
    One {
        id: Value,
        #[serde(flatten)]
        outcome: Outcome,
    },
    /// The answer to `call_many`: one outcome per item, in input order.
    ///
    /// ```json
    /// {"id": 2, "results": [{"result": {…}}, {"error": {"code": "invalid_arguments", "message": "…"}}]}
    /// ```
    Many { id: Value, results: Vec<Outcome> },
}

impl Reply {
    /// The line to write, newline included.
    pub fn line(&self) -> String {
        serde_json::to_string(self).unwrap_or_default() + "\n"
    }
}

/// The answer to `tools`, newline included: each tool the script can call,
/// with its typed path, class, description and keyword arguments
/// (`policy::describe::script_tools`), given already serialized (`tools`, a
/// JSON array made once per script).
///
/// ```json
/// {"id": 3, "tools": [{"name": "fleet__get_device_status", "path": ["fleet", "get_device_status"], "class": "read",
///   "description": "…", "params": [{"key": "sn", "name": "sn", "required": true, "schema": {"type": "string"}}], "more": false}]}
/// ```
pub fn tools_reply_line(id: &Value, tools: &str) -> String {
    format!("{{\"id\":{id},\"tools\":{tools}}}\n")
}

/// How one call went, as the script sees it.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The engine answered (`is_error` may still be true: `code` is then
    /// `tool_error`, or `engine` when the engine failed to answer properly).
    Result(CallResult),
    /// Refused before reaching the engine.
    Error(ErrorReply),
}

/// ```json
/// {"text": "boom", "structured": null, "is_error": true, "code": "tool_error"}
/// ```
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CallResult {
    pub text: String,
    pub structured: Option<Value>,
    pub is_error: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub code: Option<ToolErrorCode>,
}

/// ```json
/// {"code": "denied", "message": "…"}
/// ```
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ErrorReply {
    pub code: ToolErrorCode,
    pub message: String,
}

/// One line of `calls.jsonl` (protocol §7).
///
/// ```json
/// {"ts": "2026-11-30T07:00:00.123Z", "tool": "fleet__get_device_status", "arguments": {"sn": "A1"},
///  "duration_ms": 41, "is_error": false, "summary": "online"}
/// ```
/// `arguments` longer than the log keeps become a clipped string, with
/// `arguments_bytes` their full size; `is_error` is null for a call the
/// script's end cut off before the engine answered.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CallLogLine {
    pub ts: String,
    pub tool: String,
    pub arguments: Value,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub arguments_bytes: Option<usize>,
    pub duration_ms: u64,
    pub is_error: Option<bool>,
    pub summary: String,
    /// The call's span id, when the script was started with a trace.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub span_id: Option<String>,
}

/// The last line of a full `calls.jsonl`.
///
/// ```json
/// {"ts": "2026-11-30T07:00:00.123Z", "summary": "calls.jsonl is full (1500 lines); later calls are counted but not logged"}
/// ```
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CallLogFull {
    pub ts: String,
    pub summary: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tool_error_codes_are_spelled_on_the_wire_as_the_man_page_lists_them() {
        let names: Vec<&str> = ToolErrorCode::ALL.iter().map(|c| c.as_str()).collect();
        assert_eq!(
            names,
            [
                "denied",
                "invalid_arguments",
                "limit",
                "tool_error",
                "revoked",
                "expired",
                "engine",
                "invalid_request"
            ]
        );
        for c in ToolErrorCode::ALL {
            assert_eq!(
                serde_json::to_value(c).unwrap(),
                serde_json::json!(c.as_str())
            );
            assert_eq!(ToolErrorCode::from_wire(c.as_str()), Some(c));
            assert_eq!(c.to_string(), c.as_str());
        }
        assert_eq!(ToolErrorCode::from_wire("Denied"), None);
        // An error reply is the bytes it always was.
        let reply = ErrorReply {
            code: ToolErrorCode::InvalidArguments,
            message: "m".into(),
        };
        assert_eq!(
            serde_json::to_string(&reply).unwrap(),
            r#"{"code":"invalid_arguments","message":"m"}"#
        );
    }

    #[test]
    fn request_id_skips_the_rest() {
        assert_eq!(
            request_id(br#"{"op": "call", "args": [1, {"a": 2}], "id": 7}"#),
            7
        );
        assert_eq!(request_id(br#"{"id": "x", "op": "call"}"#), "x");
        assert_eq!(request_id(br#"{"id": {"deep": 1}}"#), Value::Null);
        assert_eq!(request_id(b"not json"), Value::Null);
    }

    #[test]
    fn the_tools_request_is_answered_with_the_list() {
        assert_eq!(
            parse_request(br#"{"id": 3, "op": "tools"}"#),
            Ok(Request::Tools { id: 3.into() })
        );
        let line = tools_reply_line(&"x\"y".into(), r#"[{"name":"a__b"}]"#);
        assert_eq!(
            line,
            "{\"id\":\"x\\\"y\",\"tools\":[{\"name\":\"a__b\"}]}\n"
        );
        let back: Value = serde_json::from_str(&line).unwrap();
        assert_eq!(back["tools"][0]["name"], "a__b");
    }

    #[test]
    fn clipped_names_carry_a_mark_no_tool_name_holds() {
        let sent = format!("{}\u{1F600}", "a".repeat(125));
        let clipped = clip_name(&sent);
        assert_eq!(clipped, format!("{} …", "a".repeat(125)));
        assert!(clipped.contains(' '));
        assert_eq!(clip_name("fleet__x"), "fleet__x");
    }
}
