//! What a `run_script` call answers: one `CallToolResult` for a script's result,
//! the same whether it is answered at once or read later through `tasks/get`.
//! The text is the summary line, the output and the error's tail; the
//! `structuredContent` carries the same (fields, output, error tail), for hosts
//! that hand their model the structured result instead of the text.

use crate::protocol::{ScriptResult, Status};
use rmcp::model::{CallToolResult, ContentBlock};
use serde_json::{json, Value};
use std::path::Path;

/// The `outputSchema` of `run_script`: what `structuredContent` holds.
pub(super) fn output_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "status": {"type": "string", "description": "ok, error, timeout, oom, limit, cancelled, interrupted, or refused (the script never started)"},
            "output": {"type": "string", "description": "What the script printed (clipped as the text is)"},
            "error": {"type": ["string", "null"], "description": "Why it did not end ok: the error's last lines, or why it was refused"},
            "script_id": {"type": "string"},
            "calls": {"type": "integer"},
            "failures": {"type": "integer"},
            "duration_ms": {"type": "integer"},
            "exit_code": {"type": ["integer", "null"]},
            "details_dir": {"type": "string"},
            "workspace": {"type": "string"},
            "output_truncated": {"type": "boolean"},
            "note": {"type": "string", "description": "What scriptgate adds, e.g. why the user was not asked"}
        },
        "required": ["status"]
    })
}

/// A finished script's answer. `note` (e.g. why the user could not be asked) is
/// a line after the text and a field of the structured content.
pub(super) fn of_script(
    res: &ScriptResult,
    workspace: &Path,
    note: Option<&str>,
) -> CallToolResult {
    let mut structured = json!({
        "status": res.status.as_str(),
        "output": res.output,
        "error": res.error,
        "script_id": res.script_id,
        "calls": res.calls,
        "failures": res.failures,
        "duration_ms": res.duration_ms,
        "exit_code": res.exit_code,
        "details_dir": res.details_dir,
        "workspace": workspace.display().to_string(),
        "output_truncated": res.output_truncated,
    });
    let text = match note {
        Some(n) => {
            structured["note"] = json!(n);
            format!("{}\n{n}\n", res.text.trim_end())
        }
        None => res.text.clone(),
    };
    text_result(text, Some(structured), res.status != Status::Ok)
}

/// A script that never started: why.
pub(super) fn refused(message: &str, note: Option<&str>) -> CallToolResult {
    let mut structured = json!({"status": "refused", "error": message});
    let text = match note {
        Some(n) => {
            structured["note"] = json!(n);
            format!("{message}\n{n}")
        }
        None => message.to_string(),
    };
    text_result(text, Some(structured), true)
}

/// A script that started and whose end is not known (the daemon went away).
pub(super) fn lost(message: &str) -> CallToolResult {
    let structured = json!({"status": "interrupted", "error": message});
    text_result(message.to_string(), Some(structured), true)
}

/// A text result (rmcp's constructors: `resultType` is set for peers of
/// 2026-07-28, and rmcp strips it for older ones).
pub(super) fn text_result(
    text: String,
    structured: Option<Value>,
    is_error: bool,
) -> CallToolResult {
    let content = vec![ContentBlock::text(text)];
    let mut r = if is_error {
        CallToolResult::error(content)
    } else {
        CallToolResult::success(content)
    };
    r.structured_content = structured;
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    fn result(status: Status, output: &str, error: Option<&str>) -> ScriptResult {
        ScriptResult {
            script_id: "0123456789abcdef".into(),
            run_id: "r".into(),
            status,
            exit_code: Some(1),
            calls: 3,
            failures: 1,
            duration_ms: 1200,
            details_dir: ".agent/scripts/0123456789abcdef".into(),
            output: output.into(),
            output_truncated: false,
            error: error.map(String::from),
            text: String::new(),
            memory_peak_bytes: None,
            cpu_usec: None,
            backend_notes: vec![],
            record_incomplete: vec![],
            pre_made: None,
        }
        .with_text(None)
    }

    #[test]
    fn the_structured_content_carries_the_output_and_the_error_tail() {
        let r = result(
            Status::Error,
            "before\n",
            Some("ZeroDivisionError: division by zero"),
        );
        let a = of_script(&r, Path::new("/ws"), None);
        let v = serde_json::to_value(&a).unwrap();
        assert_eq!(v["resultType"], "complete", "{v}");
        assert_eq!(v["isError"], true);
        let s = &v["structuredContent"];
        assert_eq!(s["status"], "error");
        assert_eq!(s["output"], "before\n");
        assert_eq!(s["error"], "ZeroDivisionError: division by zero");
        assert_eq!(s["workspace"], "/ws");
        let text = v["content"][0]["text"].as_str().unwrap();
        assert!(
            text.starts_with("run_script error: 3 calls, 1 failed, 1.2 s"),
            "{text}"
        );
        assert!(
            text.contains("before\n")
                && text.ends_with("error: ZeroDivisionError: division by zero\n")
        );
        // Every field is in the schema.
        let schema = output_schema();
        for k in s.as_object().unwrap().keys() {
            assert!(
                schema["properties"].get(k).is_some(),
                "{k} not in the outputSchema"
            );
        }
    }

    #[test]
    fn a_note_follows_the_text_and_is_a_field() {
        let a = refused(
            "script refused: approval denied",
            Some("the client cannot be asked"),
        );
        let v = serde_json::to_value(&a).unwrap();
        assert_eq!(v["structuredContent"]["status"], "refused");
        assert_eq!(v["structuredContent"]["note"], "the client cannot be asked");
        assert_eq!(
            v["content"][0]["text"],
            "script refused: approval denied\nthe client cannot be asked"
        );
    }
}
