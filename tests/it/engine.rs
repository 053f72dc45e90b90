//! The engine interface is strict (issue: strict answers): tool answers in exactly
//! two shapes, approval answers in one, JSON-RPC 2.0 on every message, a
//! workspace the script can write, and progress that starts at once and ends at
//! the final state. Through the real daemon, socket, bwrap and Python.

use crate::common::*;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;

fn answering(answer: Value) -> Handler {
    Arc::new(move |_, _| Ok(answer.clone()))
}

/// Run `code` with every tool call answered by `answer`; the script's output.
fn run_with_answer(answer: Value, code: &str) -> (Rig, Value) {
    let rig = Rig::new();
    let e = rig.engine();
    e.set_handler(answering(answer));
    let r = e.run(&rig.token(&rig.snapshot("auto")), code, &[]);
    drop(e);
    (rig, r)
}

const SHOW: &str = r#"
import agent_tools
try:
    print(repr(agent_tools.call("fleet__get_device_status", {"sn": "SN1"})))
except agent_tools.ToolError as e:
    print("ToolError", e.code, e.message)
"#;

#[test]
fn an_mcp_call_tool_result_is_converted() {
    let (_, r) = run_with_answer(
        json!({"content": [{"type": "text", "text": "SN1 online"}], "structuredContent": {"online": true}}),
        SHOW,
    );
    assert_eq!(r["output"], "{'online': True}\n", "{r}");
    let (_, r) = run_with_answer(
        json!({"content": [{"type": "text", "text": "boom"}], "isError": true}),
        SHOW,
    );
    assert_eq!(r["output"], "ToolError tool_error boom\n", "{r}");
}

/// What mcp 2.3.0's `CallToolResult.model_dump(by_alias=True, mode="json")` gives,
/// byte for byte (nulls and `resultType` included): MCP lets a `Result` carry
/// keys the daemon does not know, and new spec versions add them.
#[test]
fn the_mcp_sdks_own_dump_is_accepted_with_keys_scriptgate_ignores() {
    let (_, r) = run_with_answer(
        json!({"_meta": null, "content": [{"type": "text", "text": "SN1 online", "annotations": null, "_meta": null}],
               "structuredContent": {"online": true}, "isError": false, "resultType": "complete"}),
        SHOW,
    );
    assert_eq!(r["output"], "{'online': True}\n", "{r}");
    assert_eq!(r["failures"], 0, "{r}");
    let (_, r) = run_with_answer(
        json!({"content": [{"type": "text", "text": "boom"}], "isError": true,
               "resultType": "complete", "_meta": {"progressToken": 1}, "x-vendor": [1, 2]}),
        SHOW,
    );
    assert_eq!(r["output"], "ToolError tool_error boom\n", "{r}");
}

#[test]
fn the_documented_shape_needs_text_and_is_error() {
    let (_, r) = run_with_answer(
        json!({"text": "SN1 online", "structured": null, "is_error": false}),
        SHOW,
    );
    assert_eq!(r["output"], "'SN1 online'\n", "{r}");
    let (_, r) = run_with_answer(json!({"text": "SN1 online", "is_error": false}), SHOW);
    assert_eq!(
        r["output"], "'SN1 online'\n",
        "structured may be left out: {r}"
    );
}

#[test]
fn any_other_answer_fails_the_call_as_engine() {
    for (answer, problem) in [
        (json!({"foo": 1}), "neither `text`"),
        (json!({"text": "x"}), "`is_error` must be present"),
        (
            json!({"text": "x", "is_error": false, "extra": 1}),
            "unknown field `extra`",
        ),
        (
            json!({"text": 5, "is_error": false}),
            "`text` must be a string",
        ),
        (
            json!({"content": "boom", "isError": true}),
            "`content` must be an array",
        ),
        (
            json!({"content": [], "isError": "yes"}),
            "`isError` must be a boolean",
        ),
        (
            json!({"content": [], "is_error": true}),
            "`is_error` belongs to the {text, structured, is_error} answer",
        ),
        (
            json!({"content": [], "structuredContent": [1]}),
            "`structuredContent` must be an object",
        ),
        (
            json!({"content": [], "_meta": "m"}),
            "`_meta` must be an object",
        ),
        (
            json!({"content": [{"text": "no type"}]}),
            "content[0] has no string `type`",
        ),
        (json!("ok"), "must be a JSON object"),
    ] {
        let (rig, r) = run_with_answer(answer.clone(), SHOW);
        let out = r["output"].as_str().unwrap();
        assert!(
            out.starts_with("ToolError engine ") && out.contains(problem),
            "{answer} gave {out:?}"
        );
        assert_eq!(r["failures"], 1);
        // Logged for the sysadmin, once per script.
        let log = rig.log_text();
        assert_eq!(log.matches("tool.call answer:").count(), 1, "{log}");
    }
}

#[test]
fn a_malformed_answer_is_logged_once_per_script() {
    let (rig, r) = run_with_answer(
        json!({"bogus": true}),
        r#"
import agent_tools
errs = agent_tools.call_many("fleet__get_device_status", [{"sn": "SN%d" % i} for i in range(20)], return_errors=True)
print(sorted({e.code for e in errs}))
"#,
    );
    assert_eq!(r["output"], "['engine']\n", "{r}");
    assert_eq!(rig.log_text().matches("tool.call answer:").count(), 1);
}

#[test]
fn a_malformed_approval_answer_refuses_the_start() {
    let rig = Rig::new();
    let e = rig.engine();
    *e.approval.lock().unwrap() = "sure".into();
    let err = e
        .start(
            &rig.token(&rig.snapshot("approval")),
            "print(1)",
            &["fleet__reboot_device"],
        )
        .unwrap_err();
    assert_eq!(err["code"], -32013, "{err}");
    assert!(
        err["message"]
            .as_str()
            .unwrap()
            .contains("approval.request answer"),
        "{err}"
    );
}

#[test]
fn messages_without_jsonrpc_2_0_are_refused() {
    let rig = Rig::new();
    let e = rig.engine();
    e.send_raw(b"{\"id\": 77, \"method\": \"daemon.info\"}\n");
    eventually("the refusal", Duration::from_secs(20), || {
        e.raw_lines.lock().unwrap().iter().any(|m| m["id"] == 77)
    });
    let m = e
        .raw_lines
        .lock()
        .unwrap()
        .iter()
        .find(|m| m["id"] == 77)
        .cloned()
        .unwrap();
    assert_eq!(m["error"]["code"], -32600, "{m}");
    assert!(m["error"]["message"].as_str().unwrap().contains("jsonrpc"));
    // The connection stays usable.
    assert!(e.request("daemon.info", json!({})).is_ok());
}

#[test]
fn a_workspace_the_script_cannot_write_is_refused_at_start() {
    use std::os::unix::fs::PermissionsExt;
    let rig = Rig::new();
    // Read-only for everyone: neither nobody (a root engine's scripts) nor the
    // engine's own uid may write it.
    let ws = rig.root.join("read-only");
    std::fs::create_dir(&ws).unwrap();
    std::fs::set_permissions(&ws, std::fs::Permissions::from_mode(0o555)).unwrap();
    let mut snap = rig.snapshot("auto");
    snap["workspace"] = json!(ws);
    let e = rig.engine();
    let err = e.start(&rig.token(&snap), "print(1)", &[]).unwrap_err();
    assert_eq!(
        code_reason(&err),
        (-32011, "not_writable".to_string()),
        "{err}"
    );
    assert_eq!(err["data"]["field"], "workspace");
    let msg = err["message"].as_str().unwrap();
    assert!(msg.contains(&format!("uid {}", script_uid())), "{msg}");
    // A read-only run needs no write access.
    snap["read_only"] = json!(true);
    let r = e.run(&rig.token(&snap), "print('read')", &[]);
    assert_eq!(r["output"], "read\n", "{r}");
}

#[test]
fn progress_starts_at_once_and_ends_at_the_final_state() {
    let rig = Rig::new();
    let e = rig.engine();
    let code = r#"
import agent_tools
for i in range(1, 201):
    agent_tools.progress(i, 200, "device %d" % i)
"#;
    let r = e.run(&rig.token(&rig.snapshot("auto")), code, &[]);
    assert_eq!(r["status"], "ok", "{r}");
    let progress = e.notifications("script.progress");
    let finished = e.notifications("script.finished");
    assert!(
        !progress.is_empty(),
        "a short script still reports progress"
    );
    let (last, last_at) = progress.last().unwrap();
    assert_eq!(last["progress"]["done"], 200, "{last}");
    assert_eq!(last["progress"]["message"], "device 200");
    assert!(
        *last_at <= finished[0].1,
        "the last progress precedes the end"
    );
    // At most one per second in between: this script ran well under a second
    // after its first progress, so the first and the final state are all.
    assert!(progress.len() <= 2 + r["duration_ms"].as_u64().unwrap() as usize / 1000);
}
