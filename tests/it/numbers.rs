//! Numbers a script sends reach the engine exactly as written, or the call is
//! refused with `invalid_arguments` naming the number (scriptgate-protocol(7),
//! "Numbers"): never altered. Through the real daemon, from a real script, to
//! the test engine, and into calls.jsonl.
use crate::common::*;
use serde_json::{json, Value};

/// A snapshot with one free-form read tool that echoes its arguments, and a
/// timeout that bounds a script that would otherwise wait for a reply that
/// never comes (what a NaN did before: its line was refused with no id).
fn echo_rig() -> (Rig, Value) {
    let rig = Rig::new();
    let snap = json!({
        "workspace": rig.workspace, "permission_mode": "auto",
        "tools": [{"name": "num__echo", "class": "read",
                   "input_schema": {"type": "object", "additionalProperties": true}}],
        "limits": {"timeout_s": 60}
    });
    (rig, snap)
}

fn echo_engine(rig: &Rig) -> Engine {
    let e = rig.engine();
    e.set_handler(std::sync::Arc::new(|_tool, args| {
        Ok(json!({"text": args.to_string(), "structured": args, "is_error": false}))
    }));
    e
}

fn calls_log(rig: &Rig, id: &str) -> Vec<(String, Value)> {
    std::fs::read_to_string(rig.details(id).join("calls.jsonl"))
        .unwrap()
        .lines()
        .map(|l| (l.to_string(), serde_json::from_str(l).unwrap()))
        .collect()
}

/// The values of issue 32, as Python writes them, and whether they pass.
const VALUES: &[(&str, &str, bool)] = &[
    ("2^53", "9007199254740992", true),
    ("2^53+1", "9007199254740993", true),
    ("2^64-1", "18446744073709551615", true),
    ("2^64", "18446744073709551616", false),
    ("2^64+1", "18446744073709551617", false),
    ("2^70", "1180591620717411303424", false),
    ("-2^63", "-9223372036854775808", true),
    ("-2^64-5", "-18446744073709551621", false),
];

const INTEGERS: &str = r#"
import agent_tools, json
V = [("2^53", 2**53), ("2^53+1", 2**53 + 1), ("2^64-1", 2**64 - 1), ("2^64", 2**64),
     ("2^64+1", 2**64 + 1), ("2^70", 2**70), ("-2^63", -2**63), ("-2^64-5", -2**64 - 5)]
out = {}
for name, v in V:
    for where, args in (("top", {"n": v}), ("nested", {"deep": {"list": [0, {"n": v}]}})):
        try:
            r = agent_tools.call("num__echo", {"case": f"{name} {where}", **args})
            got = r["n"] if where == "top" else r["deep"]["list"][1]["n"]
            out[f"{name} {where}"] = ["ok", got == v and type(got) is int]
        except agent_tools.ToolError as e:
            out[f"{name} {where}"] = [e.code, e.message]
many = agent_tools.call_many("num__echo", [{"case": f"{name} many", "n": v} for name, v in V],
                             return_errors=True)
for (name, v), r in zip(V, many):
    if isinstance(r, agent_tools.ToolError):
        out[f"{name} many"] = [r.code, r.message]
    else:
        out[f"{name} many"] = ["ok", r["n"] == v and type(r["n"]) is int]
print(json.dumps(out))
"#;

/// 2^53, 2^53+1, 2^64-1 and -2^63 reach the engine exactly, at the top level,
/// nested, and as items of `call_many`; 2^64, 2^64+1, 2^70 and -2^64-5 are
/// refused, each naming the number and where it is, and never reach the
/// engine; calls.jsonl holds what the engine got, digit for digit, and the
/// refused calls' arguments as the script sent them.
#[test]
fn integers_reach_the_engine_exactly_or_are_refused() {
    let (rig, snap) = echo_rig();
    let e = echo_engine(&rig);
    let r = e.run(&rig.token(&snap), INTEGERS, &[]);
    assert_eq!(r["status"], "ok", "{r}");
    let out: Value = serde_json::from_str(r["output"].as_str().unwrap()).unwrap();

    // What the engine was handed, by case.
    let seen: std::collections::BTreeMap<String, Value> = e
        .calls_seen()
        .into_iter()
        .map(|(_, a)| (a["case"].as_str().unwrap().to_string(), a))
        .collect();
    let got = |a: &Value, case: &str| {
        if case.ends_with(" nested") {
            a["deep"]["list"][1]["n"].clone()
        } else {
            a["n"].clone()
        }
    };
    let mut report = vec![];
    for &(name, _, _) in VALUES {
        for place in ["top", "nested", "many"] {
            let case = format!("{name} {place}");
            report.push(format!(
                "{case}: engine got {}; script saw {}",
                seen.get(&case)
                    .map_or("nothing".into(), |a| got(a, &case).to_string()),
                out[&case]
            ));
        }
    }
    let report = report.join("\n");
    for &(name, digits, passes) in VALUES {
        let exact: Value = serde_json::from_str(digits).unwrap();
        assert!(exact.is_i64() || exact.is_u64() || !passes, "{digits}");
        for place in ["top", "nested", "many"] {
            let case = format!("{name} {place}");
            if passes {
                let a = seen
                    .get(&case)
                    .unwrap_or_else(|| panic!("{case} never reached the engine\n{report}"));
                assert_eq!(got(a, &case), exact, "{case}\n{report}");
                assert_eq!(out[&case], json!(["ok", true]), "{case}\n{report}");
            } else {
                assert!(
                    !seen.contains_key(&case),
                    "{case} reached the engine as {}\n{report}",
                    got(&seen[&case], &case)
                );
                assert_eq!(out[&case][0], "invalid_arguments", "{case}\n{report}");
                let m = out[&case][1].as_str().unwrap();
                let at = if place == "nested" {
                    "/deep/list/1/n"
                } else {
                    "/n"
                };
                assert!(
                    m.starts_with("num__echo: ")
                        && m.contains(&format!("the integer {digits} at {at} "))
                        && m.contains("64-bit"),
                    "{case}: {m}"
                );
            }
        }
    }
    assert_eq!(seen.len(), 12, "{report}");
    assert_eq!(r["calls"], 24);
    assert_eq!(r["failures"], 12);

    // calls.jsonl: what the engine got, digit for digit; the refused ones'
    // arguments as the script sent them (text: no parsed value holds them).
    let id = r["script_id"].as_str().unwrap();
    let log = calls_log(&rig, id);
    assert_eq!(log.len(), 24);
    for (raw, l) in &log {
        let case = match &l["arguments"] {
            Value::String(text) => {
                let sent: Value = serde_json::from_str(text).unwrap_or_default();
                assert_eq!(l["arguments_bytes"], text.len(), "{raw}");
                assert_eq!(l["is_error"], true, "{raw}");
                let s = l["summary"].as_str().unwrap();
                assert!(s.starts_with("refused (invalid_arguments): "), "{raw}");
                let case = sent["case"].as_str().unwrap().to_string();
                let digits = VALUES
                    .iter()
                    .find(|v| case.starts_with(&format!("{} ", v.0)))
                    .unwrap()
                    .1;
                assert!(text.contains(digits), "{raw}");
                assert!(!seen.contains_key(&case));
                case
            }
            args => {
                let case = args["case"].as_str().unwrap().to_string();
                assert_eq!(args, &seen[&case], "{raw}");
                let digits = VALUES
                    .iter()
                    .find(|v| case.starts_with(&format!("{} ", v.0)))
                    .unwrap()
                    .1;
                assert!(raw.contains(&format!("\"n\":{digits}")), "{raw}");
                case
            }
        };
        assert!(out.get(&case).is_some(), "{case}");
    }
}

const FLOATS: &str = r#"
import agent_tools, json, math, random, struct
rng = random.Random(32)
vals = [0.1, 0.30000000000000004, 1e300, 5e-324, -0.0, 2.0**64, 1658206780088562.2, 1.7976931348623157e308]
while len(vals) < 1500:
    f = struct.unpack("<d", struct.pack("<Q", rng.getrandbits(64)))[0]
    if math.isfinite(f):
        vals.append(f)
vals += [rng.random() * 10.0 ** rng.randint(-300, 300) for _ in range(500)]
res = agent_tools.call_many("num__echo", [{"x": v} for v in vals], return_errors=True)
bad = [[repr(v), repr(r)] for v, r in zip(vals, res)
       if isinstance(r, agent_tools.ToolError) or struct.pack("<d", r["x"]) != struct.pack("<d", v)]
with open("sent.json", "w") as f:
    json.dump([repr(v) for v in vals], f)
print(json.dumps({"bad": bad[:5], "bad_count": len(bad)}))
"#;

/// Every float Python writes reaches the engine as the same f64 (2000 of
/// them: random bits over the whole range, subnormals, -0.0, a tie).
#[test]
fn every_float_python_writes_reaches_the_engine_exactly() {
    let (rig, snap) = echo_rig();
    let e = echo_engine(&rig);
    let r = e.run(&rig.token(&snap), FLOATS, &[]);
    assert_eq!(r["status"], "ok", "{r}");
    let out: Value = serde_json::from_str(r["output"].as_str().unwrap()).unwrap();
    assert_eq!(out["bad_count"], 0, "{}", out["bad"]);
    let sent: Value =
        serde_json::from_slice(&std::fs::read(rig.workspace.join("sent.json")).unwrap()).unwrap();
    let sent: Vec<f64> = sent
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().parse().unwrap())
        .collect();
    let mut seen: Vec<f64> = e
        .calls_seen()
        .iter()
        .map(|(_, a)| a["x"].as_f64().unwrap())
        .collect();
    assert_eq!(seen.len(), sent.len());
    let bits = |v: &mut Vec<f64>| {
        let mut b: Vec<u64> = v.iter().map(|f| f.to_bits()).collect();
        b.sort_unstable();
        b
    };
    assert_eq!(bits(&mut seen), bits(&mut sent.clone()));
}

/// What Python's json writes that JSON has no number for (float("nan"),
/// float("inf")) and what only a script writing fd 3 itself can send (more
/// digits than a float holds, `-0`, `1e400`): refused, naming it, in the call
/// that holds it and only there, and the script gets its reply (a NaN used to
/// make the whole line unreadable: no reply, the script waited to its timeout).
#[test]
fn numbers_no_float_holds_are_refused_by_name() {
    let (rig, snap) = echo_rig();
    let e = echo_engine(&rig);
    let code = r#"
import agent_tools, json, os
out = []
for v in (float("nan"), float("inf"), -float("inf")):
    try:
        agent_tools.call("num__echo", {"v": [1, v]})
        out.append("called")
    except agent_tools.ToolError as e:
        out.append([e.code, e.message])
many = agent_tools.call_many("num__echo", [{"v": 1}, {"v": float("nan")}, {"v": 2}], return_errors=True)
out.append([m.code if isinstance(m, agent_tools.ToolError) else m["v"] for m in many])
# fd 3 by hand, after agent_tools' own calls (each line answered in order).
r = os.fdopen(4, "rb", closefd=False)
for i, text in enumerate([b"0.1000000000000000000001", b"1e-400", b"-0", b"1e400", b"0.5",
                          b"-0.0", b"123456789012345678901234567890123456789012345678901234567890"]):
    os.write(3, b'{"id": "raw%d", "op": "call", "tool": "num__echo", "args": {"k\\u001b[2J": %s}}\n' % (i, text))
    reply = json.loads(r.readline())
    out.append([reply["id"], reply.get("error") or reply["result"]["structured"]])
print(json.dumps(out))
"#;
    let r = e.run(&rig.token(&snap), code, &[]);
    assert_eq!(r["status"], "ok", "{r}");
    let out: Value = serde_json::from_str(r["output"].as_str().unwrap()).unwrap();
    for (i, word) in ["NaN", "Infinity", "-Infinity"].iter().enumerate() {
        assert_eq!(out[i][0], "invalid_arguments", "{out}");
        let m = out[i][1].as_str().unwrap();
        assert!(
            m.contains(&format!("{word} at /v/1 is not a JSON number")),
            "{m}"
        );
    }
    assert_eq!(out[3], json!([1, "invalid_arguments", 2]), "{out}");
    let refused = |i: usize, what: &str| {
        let reply = &out[4 + i];
        assert_eq!(reply[0], format!("raw{i}"), "{reply}");
        assert_eq!(reply[1]["code"], "invalid_arguments", "{reply}");
        let m = reply[1]["message"].as_str().unwrap();
        assert!(m.contains(what), "{m}");
        assert!(
            m.contains(" at /k\\x1b[2J "),
            "the key is the script's text, escaped: {m}"
        );
        assert!(!m.contains('\x1b'));
    };
    refused(0, "the number 0.1000000000000000000001 at");
    refused(1, "the number 1e-400 at");
    refused(2, "the integer -0 at");
    refused(3, "the number 1e400 at");
    assert_eq!(out[8][1], json!({"k\u{1b}[2J": 0.5}));
    assert_eq!(
        out[9][1]["k\u{1b}[2J"].as_f64().map(f64::is_sign_negative),
        Some(true)
    );
    refused(
        6,
        "the integer 1234567890123456789012345678901234567890… (60 characters) at",
    );
    // The engine got the good ones only.
    let seen = e.calls_seen();
    let vs: Vec<Value> = seen
        .iter()
        .filter_map(|(_, a)| a.get("v").cloned())
        .collect();
    assert_eq!(vs, [json!(1), json!(2)], "{seen:?}");
    assert_eq!(seen.len(), 4, "{seen:?}");
}
