//! The protocol examples of scriptgate-protocol(7), read back: every JSON example
//! in the page's `.nf`/`.fi` blocks parses as JSON, the snapshot example is a
//! snapshot the daemon accepts, and the refusal the page shows for that snapshot
//! without one `input_schema` is the refusal the daemon gives. The page is a
//! contract for engine authors; this keeps it from drifting from the code.
use serde_json::Value;

const PAGE: &str = include_str!("../../man/scriptgate-protocol.7");

/// The page's no-fill blocks, roff escapes undone (`\e` is a backslash).
fn blocks() -> Vec<String> {
    let mut out = vec![];
    let mut cur: Option<String> = None;
    for line in PAGE.lines() {
        match (line, &mut cur) {
            (".nf", None) => cur = Some(String::new()),
            (".fi", Some(_)) => out.push(cur.take().unwrap()),
            (l, Some(b)) => {
                b.push_str(l);
                b.push('\n');
            }
            _ => {}
        }
    }
    assert!(cur.is_none(), "an .nf block without .fi");
    out.into_iter()
        .map(|b| {
            b.replace("\\e", "\\")
                .replace("\\(ga", "`")
                .replace("\\(aq", "'")
                .replace("\\-", "-")
        })
        .collect()
}

/// Blocks that are one JSON value (they start with `{` in the first column); the
/// others are sketches of message shapes (`{...}` placeholders), not examples.
fn examples() -> Vec<Value> {
    blocks()
        .iter()
        .filter(|b| b.starts_with('{'))
        .map(|b| serde_json::from_str(b).unwrap_or_else(|e| panic!("{e}:\n{b}")))
        .collect()
}

#[test]
fn every_json_example_parses() {
    let ex = examples();
    // Snapshot, start refusal, fd-3 error reply, two tool.call answers, a result.
    assert!(ex.len() >= 6, "{} examples: {ex:?}", ex.len());
}

fn snapshot_example() -> Value {
    examples()
        .into_iter()
        .find(|v| v.get("tools").is_some() && v.get("workspace").is_some())
        .expect("the snapshot example")
}

#[test]
fn the_snapshot_example_is_accepted() {
    let snap = scriptgate::protocol::snapshot::parse_snapshot(snapshot_example());
    assert!(snap.is_ok(), "{:?}", snap.err());
}

#[test]
fn the_documented_refusal_is_the_daemons() {
    let mut snap = snapshot_example();
    let tools = snap["tools"].as_array_mut().unwrap();
    let i = tools
        .iter()
        .position(|t| t["name"] == "fleet__query_logs")
        .unwrap();
    tools[i].as_object_mut().unwrap().remove("input_schema");
    let e = scriptgate::protocol::RpcError::from(
        scriptgate::protocol::snapshot::parse_snapshot(snap).unwrap_err(),
    );
    let documented = examples()
        .into_iter()
        .find(|v| v["error"]["code"] == -32011)
        .expect("the -32011 example");
    let documented = &documented["error"];
    assert_eq!(e.code, documented["code"].as_i64().unwrap());
    assert_eq!(e.message, documented["message"].as_str().unwrap());
    assert_eq!(e.data.as_ref(), Some(&documented["data"]));
}

/// The refusal the page shows for `call("fleet__query_logs", {"since": 2**64})`
/// is the daemon's, word for word (NUMBERS).
#[test]
fn the_documented_number_refusal_is_the_daemons() {
    use scriptgate::protocol::numbers;
    let documented = examples()
        .into_iter()
        .find(|v| v["error"]["code"] == "invalid_arguments" && v["id"] == 8)
        .expect("the number refusal example");
    let line = br#"{"id": 8, "op": "call", "tool": "fleet__query_logs", "args": {"since": 18446744073709551616}}"#;
    let scan = numbers::scan(line);
    let altered = scan.args.expect("2**64 is flagged");
    assert_eq!(
        documented["error"]["message"],
        numbers::refusal_message("fleet__query_logs", &altered)
    );
}
