//! The wire vectors of `tests/fixtures/wire/` (scriptgate-protocol(7), one
//! record per message, with the exact JSON), replayed with the crate's own wire
//! types. What the daemon writes (`daemon-to-engine.jsonl`) is parsed into its
//! type and written back as the daemon writes it: the line must come out byte for
//! byte. What the daemon reads (`engine-to-daemon.jsonl`) must parse, as the
//! daemon parses it, into the fields the vector holds. Where the daemon's own code
//! makes an error (a refused token, an unknown method, ...), that code makes it
//! here too and must give the vector's error word for word. The Python and
//! TypeScript clients replay the same files (tests/fixtures/wire/README.md).

use super::*;
use crate::protocol::refusal::Refused;
use crate::protocol::token::{self, Signed};
use serde::de::DeserializeOwned;

const ENGINE: &str = include_str!("../../tests/fixtures/wire/engine-to-daemon.jsonl");
const DAEMON: &str = include_str!("../../tests/fixtures/wire/daemon-to-engine.jsonl");

/// One record: its metadata, and `wire`, the message, both parsed and as the
/// exact text it has in the file (the record's last member).
struct Vector {
    name: String,
    kind: String,
    method: Option<String>,
    record: Value,
    raw: &'static str,
}

impl Vector {
    fn wire(&self) -> &Value {
        &self.record["wire"]
    }
}

fn load(file: &'static str) -> Vec<Vector> {
    let mut out = Vec::new();
    for (i, line) in file.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let record: Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("line {}: {e}", i + 1));
        let at = line
            .find(",\"wire\":")
            .unwrap_or_else(|| panic!("line {}: no `wire` member", i + 1));
        let raw = &line[at + ",\"wire\":".len()..line.len() - 1];
        let wire: Value = serde_json::from_str(raw)
            .unwrap_or_else(|e| panic!("line {}: `wire` is not the last member: {e}", i + 1));
        assert_eq!(wire, record["wire"], "line {}", i + 1);
        let s = |k: &str| record[k].as_str().map(str::to_string);
        out.push(Vector {
            name: s("name").unwrap_or_else(|| panic!("line {}: no name", i + 1)),
            kind: s("kind").unwrap_or_else(|| panic!("line {}: no kind", i + 1)),
            method: s("method"),
            raw,
            record,
        });
    }
    let mut names = std::collections::HashSet::new();
    for v in &out {
        assert!(names.insert(v.name.clone()), "{} twice", v.name);
    }
    out
}

/// `v` read as `T` and written back as a JSON value, as the daemon makes its
/// answers (`serde_json::to_value`).
fn again<T: Serialize + DeserializeOwned>(name: &str, v: Value) -> Value {
    let t: T = serde_json::from_value(v).unwrap_or_else(|e| panic!("{name}: {e}"));
    serde_json::to_value(t).unwrap()
}

fn typed_answer(name: &str, method: &str, v: Value) -> Value {
    match method {
        "script.start" => again::<Started>(name, v),
        "script.wait" => again::<ScriptResult>(name, v),
        "script.status" => again::<ScriptStatus>(name, v),
        "script.cancel" | "admin.cancel" => again::<ScriptState>(name, v),
        "run.revoke" => again::<Revoked>(name, v),
        "run.describe" => again::<Described>(name, v),
        "daemon.info" => again::<DaemonInfo>(name, v),
        "admin.list" => again::<AdminList>(name, v),
        "admin.calls" => again::<CallsPage>(name, v),
        "admin.prune" => again::<Pruned>(name, v),
        m => panic!("{name}: no answer type for {m}"),
    }
}

/// The line the daemon writes for this vector, made from its parsed, typed form.
fn daemon_line(v: &Vector) -> String {
    let incoming = parse_line(v.raw.as_bytes()).unwrap_or_else(|(_, e)| panic!("{}: {e}", v.name));
    let method = v.method.as_deref();
    match (v.kind.as_str(), incoming) {
        ("answer", Incoming::Response { id, result: Ok(r) }) => {
            let r = typed_answer(&v.name, method.expect("an answer names its method"), r);
            response_line(&id, &Ok(r))
        }
        ("error", Incoming::Response { id, result: Err(e) }) => response_line(&id, &Err(e)),
        ("request", Incoming::Request { id, method, params }) => {
            assert_eq!(Some(method.as_str()), v.method.as_deref(), "{}", v.name);
            let id = id.as_u64().expect("the daemon's ids are numbers 1, 2, ...");
            match DaemonRequest::parse(&method, params)
                .unwrap_or_else(|e| panic!("{}: {e}", v.name))
            {
                DaemonRequest::ToolCall(c) => request_line(id, &method, &c),
                DaemonRequest::ApprovalRequest(a) => request_line(id, &method, &a),
            }
        }
        ("notification", Incoming::Notification { method, params }) => {
            assert_eq!(Some(method.as_str()), v.method.as_deref(), "{}", v.name);
            match Notification::parse(&method, params).unwrap_or_else(|e| panic!("{}: {e}", v.name))
            {
                Notification::ScriptProgress(s) => notification_line(&method, &s),
                Notification::ScriptFinished(r) => notification_line(&method, &r),
                Notification::ToolCancelled(c) => notification_line(&method, &c),
            }
        }
        (kind, other) => panic!("{}: a {kind} vector parsed as {other:?}", v.name),
    }
}

#[test]
fn the_daemon_writes_each_vector_byte_for_byte() {
    let vectors = load(DAEMON);
    for v in &vectors {
        assert_eq!(daemon_line(v), format!("{}\n", v.raw), "{}", v.name);
    }
    // Every kind the daemon writes is there, and every method's answer.
    for kind in ["answer", "request", "notification", "error"] {
        assert!(vectors.iter().any(|v| v.kind == kind), "no {kind} vector");
    }
    for m in Method::ALL {
        assert!(
            vectors
                .iter()
                .any(|v| v.kind == "answer" && v.method.as_deref() == Some(m.name())),
            "no answer vector for {}",
            m.name()
        );
    }
    for m in ["tool.call", "approval.request"] {
        assert!(vectors
            .iter()
            .any(|v| v.kind == "request" && v.method.as_deref() == Some(m)));
    }
    for m in ["script.progress", "script.finished", "tool.cancelled"] {
        assert!(vectors
            .iter()
            .any(|v| v.kind == "notification" && v.method.as_deref() == Some(m)));
    }
}

/// Every JSON-RPC code of protocol(7) has an error vector, and every `data.reason`
/// an error vector carries is one the daemon names.
#[test]
fn every_error_code_has_a_vector() {
    let vectors = load(DAEMON);
    let codes: Vec<i64> = vectors
        .iter()
        .filter(|v| v.kind == "error")
        .map(|v| v.wire()["error"]["code"].as_i64().unwrap())
        .collect();
    for c in [
        code::PARSE_ERROR,
        code::INVALID_REQUEST,
        code::METHOD_NOT_FOUND,
        code::INVALID_PARAMS,
        code::INTERNAL,
        code::PEER_NOT_ALLOWED,
        code::TOKEN,
        code::SNAPSHOT,
        code::TOOLS,
        code::APPROVAL,
        code::BUSY,
        code::NOT_FOUND,
        code::STILL_RUNNING,
        code::NOT_ADMIN,
    ] {
        assert!(codes.contains(&c), "no error vector for {c}");
    }
    for v in vectors.iter().filter(|v| v.kind == "error") {
        let e = &v.wire()["error"];
        let Some(reason) = e["data"]["reason"].as_str() else {
            continue;
        };
        let named = refusal::Reason::NAMED
            .iter()
            .find(|r| r.wire() == Some(reason))
            .map(|r| r.code());
        let other = ["not_found", "still_running", "not_admin"].contains(&reason);
        assert!(
            named == e["code"].as_i64() || other,
            "{}: reason {reason} does not come with code {}",
            v.name,
            e["code"]
        );
    }
}

const KEY: &[u8] = b"wire-vectors-key-0123456789abcdef";

fn snap() -> Value {
    json!({"workspace": "/srv/gateway/ws/run-42", "permission_mode": "approval",
           "tools": [{"name": "fleet__get_device_status", "class": "read",
                      "input_schema": {"type": "object", "properties": {"sn": {"type": "string"}}}}]})
}

fn refused(r: Result<impl std::fmt::Debug, Refused>) -> RpcError {
    RpcError::from(r.expect_err("a refusal"))
}

fn jwt(header: Value, claims: Value, key: &[u8]) -> String {
    use base64::Engine as _;
    let b = |v: &Value| {
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(serde_json::to_vec(v).unwrap())
    };
    let input = format!("{}.{}", b(&header), b(&claims));
    let sig = jsonwebtoken::crypto::sign(
        input.as_bytes(),
        &jsonwebtoken::EncodingKey::from_secret(key),
        jsonwebtoken::Algorithm::HS256,
    )
    .unwrap();
    format!("{input}.{sig}")
}

/// The errors the daemon's code in protocol/ makes, made by that code.
fn made_by_the_daemon(name: &str) -> Option<(Value, RpcError)> {
    let one = || json!(1);
    let sid = "4f1c9e0a2b3d5e6f";
    let start = |token: &str| Signed::verify(token, KEY).and_then(Signed::claims);
    Some(match name {
        "-32700:parse" => {
            let (id, e) = parse_line(b"{not json").unwrap_err();
            (id, e)
        }
        "-32600:no-jsonrpc" => parse_line(br#"{"id":7,"method":"daemon.info"}"#).unwrap_err(),
        "-32601" => (one(), Method::from_name("script.nope").unwrap_err()),
        "-32602:unknown-field" => (
            one(),
            EngineRequest::parse(
                Method::ScriptWait,
                json!({"script_id": "x", "colour": "red"}),
            )
            .unwrap_err(),
        ),
        "-32602:missing-field" => (
            one(),
            EngineRequest::parse(Method::RunRevoke, Value::Null).unwrap_err(),
        ),
        "-32602:traceparent" => {
            let e = trace::TraceContext::parse("00-zz", None).unwrap_err();
            // As the start's admission words it.
            (
                one(),
                RpcError::from(Refused::invalid_params(format!("invalid params: {e}"))),
            )
        }
        "-32010:malformed" => (one(), refused(token::verify("not-a-token", KEY, true))),
        "-32010:signature" => {
            let t = token::mint(
                b"another-key-0123456789abcdef012345",
                "run-42",
                None,
                &snap(),
                600,
            )
            .unwrap();
            (one(), refused(token::verify(&t, KEY, true)))
        }
        "-32010:algorithm" => {
            let t = jwt(
                json!({"alg": "none", "typ": "JWT"}),
                json!({"run_id": "run-42"}),
                KEY,
            );
            (one(), refused(Signed::verify(&t, KEY)))
        }
        "-32010:expired" => {
            let t = token::mint(KEY, "run-42", None, &snap(), 600).unwrap();
            let claims = start(&t).unwrap();
            (one(), refused(claims.check_fresh(claims.exp)))
        }
        "-32010:missing_claim" => {
            let t = jwt(
                json!({"alg": "HS256", "typ": "JWT"}),
                json!({"iat": 1, "exp": 2, "snapshot": snap()}),
                KEY,
            );
            (one(), refused(start(&t)))
        }
        "-32011:missing_field" => {
            // protocol(7)'s own example: its snapshot with fleet__query_logs's
            // input_schema left out.
            let snap = json!({"workspace": "/srv/gateway/ws/run-42", "permission_mode": "approval",
                "tools": [{"name": "fleet__get_device_status", "class": "read", "input_schema": {"type": "object"}},
                          {"name": "fleet__reboot_device", "class": "write", "input_schema": {"type": "object"}},
                          {"name": "fleet__query_logs", "class": "read"}]});
            (one(), refused(snapshot::parse_snapshot(snap)))
        }
        "-32016" => (one(), RpcError::not_found(sid)),
        "-32016:admin" => (one(), RpcError::no_such_script(sid)),
        "-32018" => (one(), RpcError::not_admin()),
        _ => return None,
    })
}

#[test]
fn the_daemons_own_code_makes_the_error_vectors() {
    let mut made = 0;
    for v in load(DAEMON).iter().filter(|v| v.kind == "error") {
        let Some((id, e)) = made_by_the_daemon(&v.name) else {
            continue;
        };
        assert_eq!(
            response_line(&id, &Err(e)),
            format!("{}\n", v.raw),
            "{}",
            v.name
        );
        made += 1;
    }
    assert_eq!(
        made, 15,
        "every error the code in protocol/ makes is checked"
    );
}

/// A start's trace context reaches its calls and its approval with the start's
/// span as their parent.
#[test]
fn the_trace_vectors_are_one_trace() {
    let engine = load(ENGINE);
    let daemon = load(DAEMON);
    let find = |vs: &[Vector], n: &str| vs.iter().find(|v| v.name == n).unwrap().wire().clone();
    let start = find(&engine, "script.start+trace")["params"].clone();
    let ctx = trace::TraceContext::parse(
        start["traceparent"].as_str().unwrap(),
        start["tracestate"].as_str(),
    )
    .unwrap();
    for n in ["tool.call+trace", "approval.request+trace"] {
        let p = &find(&daemon, n)["params"];
        assert_eq!(
            p["traceparent"].as_str(),
            Some(ctx.child_traceparent().as_str()),
            "{n}"
        );
        assert_eq!(p["tracestate"], start["tracestate"], "{n}");
    }
}

/// Equal as the daemon reads them: numbers by value (`timeout_s` 30 is 30.0).
fn same(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => x == y || x.as_f64() == y.as_f64(),
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(a, b)| same(a, b))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len() && x.iter().all(|(k, a)| y.get(k).is_some_and(|b| same(a, b)))
        }
        _ => a == b,
    }
}

#[test]
fn the_daemon_reads_each_engine_vector() {
    let vectors = load(ENGINE);
    for v in &vectors {
        let incoming =
            parse_line(v.raw.as_bytes()).unwrap_or_else(|(_, e)| panic!("{}: {e}", v.name));
        match (v.kind.as_str(), incoming) {
            ("request", Incoming::Request { id, method, params }) => {
                assert!(id.is_u64(), "{}", v.name);
                let m = Method::from_name(&method).unwrap();
                let sent = params.clone();
                let typed =
                    EngineRequest::parse(m, params).unwrap_or_else(|e| panic!("{}: {e}", v.name));
                // The typed params, written back, are the params sent: no field
                // was dropped or taken for another.
                let back = match typed {
                    EngineRequest::ScriptStart(p) => serde_json::to_value(p),
                    EngineRequest::ScriptWait(r)
                    | EngineRequest::ScriptStatus(r)
                    | EngineRequest::ScriptCancel(r)
                    | EngineRequest::AdminCancel(r) => serde_json::to_value(r),
                    EngineRequest::RunRevoke(t) | EngineRequest::RunDescribe(t) => {
                        serde_json::to_value(t)
                    }
                    EngineRequest::AdminCalls(p) => serde_json::to_value(p),
                    EngineRequest::AdminPrune(p) => serde_json::to_value(p),
                    EngineRequest::DaemonInfo | EngineRequest::AdminList => Ok(Value::Null),
                }
                .unwrap();
                assert!(same(&back, &sent), "{}: {back} is not {sent}", v.name);
            }
            (kind @ ("answer" | "error"), Incoming::Response { result, .. }) => {
                match v.method.as_deref() {
                    Some("tool.call") => match result {
                        Ok(r) => {
                            let a = ToolResult::from_answer(&r)
                                .unwrap_or_else(|e| panic!("{}: {e}", v.name));
                            let expected: ToolResult =
                                serde_json::from_value(v.record["daemon_reads"].clone()).unwrap();
                            assert_eq!(a.result, expected, "{}", v.name);
                        }
                        Err(e) => {
                            assert_eq!(kind, "error", "{}", v.name);
                            // A JSON-RPC error answer: a failed call, its message the text.
                            assert_eq!(Some(&json!(e.code)), v.wire()["error"].get("code"));
                            assert!(!e.message.is_empty(), "{}", v.name);
                        }
                    },
                    Some("approval.request") => {
                        let a: ApprovalAnswer = serde_json::from_value(result.unwrap()).unwrap();
                        let expected = v.wire()["result"]["decision"].as_str().unwrap();
                        assert_eq!(serde_json::to_value(a.decision).unwrap(), json!(expected));
                    }
                    m => panic!("{}: an answer to {m:?}", v.name),
                }
            }
            (kind, other) => panic!("{}: a {kind} vector parsed as {other:?}", v.name),
        }
    }
    for m in Method::ALL {
        assert!(
            vectors
                .iter()
                .any(|v| v.kind == "request" && v.method.as_deref() == Some(m.name())),
            "no request vector for {}",
            m.name()
        );
    }
}
