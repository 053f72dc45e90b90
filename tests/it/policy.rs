//! §3 of the protocol seen from both sides: refused starts and refused calls, the
//! approval flow, token and snapshot checks, argument checks. In every refusal the
//! engine must never receive the call.
use crate::common::*;
use serde_json::{json, Value};

#[test]
fn refused_starts_name_the_tool_and_reason() {
    let rig = Rig::new();
    let e = rig.engine();
    let token = rig.token(&rig.snapshot("approval"));
    for (tool, reason) in [
        ("fleet__nope", "unknown"),
        ("fleet__get_device_status", "not_write"),
        ("fleet__wipe_device", "destructive"),
        ("fleet__export_all", "long_task"),
        ("fleet__retired", "disabled"),
    ] {
        let err = e.start(&token, "print('never runs')", &[tool]).unwrap_err();
        assert_eq!(
            code_reason(&err),
            (-32012, reason.to_string()),
            "{tool}: {err}"
        );
        assert_eq!(err["data"]["tool"], tool);
    }
    let mut ro = rig.snapshot("approval");
    ro["read_only"] = json!(true);
    let err = e
        .start(&rig.token(&ro), "print(1)", &["fleet__reboot_device"])
        .unwrap_err();
    assert_eq!(code_reason(&err), (-32012, "read_only".into()));
    let s = e.seen.lock().unwrap();
    assert!(
        s.calls.is_empty() && s.approvals.is_empty(),
        "a refused start asks and calls nothing"
    );
    assert!(
        !rig.workspace.join(".agent/scripts").exists()
            || std::fs::read_dir(rig.workspace.join(".agent/scripts"))
                .unwrap()
                .count()
                == 0
    );
}

const FORBIDDEN_CALLS: &str = r#"
import agent_tools, json
out = {}
for tool in ["fleet__reboot_device", "fleet__tag_device", "fleet__wipe_device", "fleet__export_all", "fleet__retired", "fleet__nope"]:
    try:
        agent_tools.call(tool, {})
        out[tool] = "called"
    except agent_tools.ToolError as e:
        out[tool] = [e.code, e.message]
print(json.dumps(out))
"#;

fn forbidden(rig: &Rig, snap: &Value) -> (Value, Vec<(String, Value)>) {
    let e = rig.engine();
    let r = e.run(&rig.token(snap), FORBIDDEN_CALLS, &[]);
    assert_eq!(r["status"], "ok", "{r}");
    let out: Value = serde_json::from_str(r["output"].as_str().unwrap()).unwrap();
    (out, e.calls_seen())
}

#[test]
fn calls_the_table_forbids_never_reach_the_engine() {
    let rig = Rig::new();
    let (out, seen) = forbidden(&rig, &rig.snapshot("auto"));
    assert!(seen.is_empty(), "engine received {seen:?}");
    let msg = |t: &str| out[t][1].as_str().unwrap().to_string();
    for t in [
        "fleet__reboot_device",
        "fleet__tag_device",
        "fleet__wipe_device",
        "fleet__export_all",
        "fleet__retired",
        "fleet__nope",
    ] {
        assert_eq!(out[t][0], "denied", "{t}: {out}");
    }
    assert!(
        msg("fleet__reboot_device").contains("did not declare"),
        "{out}"
    );
    assert!(
        msg("fleet__wipe_device").contains("call it directly"),
        "{out}"
    );
    assert!(msg("fleet__export_all").contains("long task"), "{out}");
    assert!(msg("fleet__retired").contains("switched off"), "{out}");
    assert!(msg("fleet__nope").contains("no tool of that name"), "{out}");
    // In a read-only run write tools are not provided at all.
    let mut ro = rig.snapshot("auto");
    ro["read_only"] = json!(true);
    let (out, seen) = forbidden(&rig, &ro);
    assert!(seen.is_empty());
    assert!(
        out["fleet__tag_device"][1]
            .as_str()
            .unwrap()
            .contains("read-only"),
        "{out}"
    );
}

#[test]
fn declared_write_tools_are_called_with_frozen_arguments() {
    let rig = Rig::new();
    let e = rig.engine();
    let code =
        "import agent_tools\nprint(agent_tools.call('fleet__reboot_device', {'sn': 'SN5'}))\n";
    let r = e.run(
        &rig.token(&rig.snapshot("auto")),
        code,
        &["fleet__reboot_device"],
    );
    assert_eq!(r["status"], "ok", "{r}");
    assert_eq!(
        e.calls_seen(),
        vec![(
            "fleet__reboot_device".to_string(),
            json!({"sn": "SN5", "tenant": "acme"})
        )]
    );
    assert!(
        e.seen.lock().unwrap().approvals.is_empty(),
        "auto mode asks nothing"
    );
}

#[test]
fn approval_allow_once_asks_once_for_all_write_tools() {
    let rig = Rig::new();
    let e = rig.engine();
    let code = "import agent_tools as t\nt.call('fleet__reboot_device', {'sn': 'A'})\nt.call('fleet__tag_device', {'sn': 'A'})\nt.call('fleet__reboot_device', {'sn': 'B'})\nprint('ok')\n";
    let r = e.run(
        &rig.token(&rig.snapshot("approval")),
        code,
        &["fleet__reboot_device", "fleet__tag_device"],
    );
    assert_eq!(r["status"], "ok", "{r}");
    let s = e.seen.lock().unwrap();
    assert_eq!(s.approvals.len(), 1);
    let a = &s.approvals[0];
    assert_eq!(a["code"], code);
    assert_eq!(a["run_id"], "run-1");
    assert_eq!(a["description"], "test script");
    assert_eq!(a["script_id"], r["script_id"]);
    assert_eq!(
        a["tools"],
        json!([{"name": "fleet__reboot_device", "class": "write"}, {"name": "fleet__tag_device", "class": "write"}])
    );
    assert_eq!(s.calls.len(), 3);
}

#[test]
fn approval_deny_refuses_the_start() {
    let rig = Rig::new();
    let e = rig.engine();
    *e.approval.lock().unwrap() = "deny".into();
    let err = e
        .start(
            &rig.token(&rig.snapshot("approval")),
            "print(1)",
            &["fleet__reboot_device"],
        )
        .unwrap_err();
    assert_eq!(code_reason(&err), (-32013, "denied".into()));
    assert_eq!(e.seen.lock().unwrap().approvals.len(), 1);
    assert!(e.calls_seen().is_empty());
}

#[test]
fn approval_not_answered_in_time_refuses_the_start() {
    let rig = Rig::with_config("[scripts]\napproval_timeout_s = 1\n");
    let e = rig.engine();
    *e.approval.lock().unwrap() = "silent".into();
    let err = e
        .start(
            &rig.token(&rig.snapshot("approval")),
            "print(1)",
            &["fleet__reboot_device"],
        )
        .unwrap_err();
    assert_eq!(code_reason(&err), (-32013, "timeout".into()));
}

#[test]
fn session_allowed_and_auto_need_no_approval() {
    let rig = Rig::new();
    let e = rig.engine();
    *e.approval.lock().unwrap() = "deny".into();
    let code = "import agent_tools\nagent_tools.call('fleet__tag_device', {})\n";
    let r = e.run(
        &rig.token(&rig.snapshot("approval")),
        code,
        &["fleet__tag_device"],
    );
    assert_eq!(
        r["status"], "ok",
        "session_allowed tool runs without asking: {r}"
    );
    let r = e.run(
        &rig.token(&rig.snapshot("auto")),
        "import agent_tools\nagent_tools.call('fleet__reboot_device', {})\n",
        &["fleet__reboot_device"],
    );
    assert_eq!(r["status"], "ok", "{r}");
    assert!(e.seen.lock().unwrap().approvals.is_empty());
    assert_eq!(e.calls_seen().len(), 2);
}

#[test]
fn bad_tokens_are_refused_before_anything_runs() {
    let rig = Rig::new();
    let e = rig.engine();
    let snap = rig.snapshot("auto");
    let good = rig.token(&snap);
    let reason = |t: &str| code_reason(&e.start(t, "print(1)", &[]).unwrap_err());
    // Signed with another key.
    let other = scriptgate::protocol::token::mint(
        b"some-other-key-some-other-key-!!!",
        "run-1",
        None,
        &snap,
        60,
    )
    .unwrap();
    assert_eq!(reason(&other), (-32010, "signature".into()));
    // Expired.
    assert_eq!(
        reason(&rig.token_for("run-1", &snap, -10)),
        (-32010, "expired".into())
    );
    // alg: none.
    use base64::Engine as _;
    let b64 = |v: &Value| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v.to_string());
    let claims = json!({"run_id": "run-1", "exp": 4102444800u64, "iat": 0, "snapshot": snap});
    let none = format!(
        "{}.{}.",
        b64(&json!({"alg": "none", "typ": "JWT"})),
        b64(&claims)
    );
    assert_eq!(reason(&none), (-32010, "algorithm".into()));
    // Tampered snapshot: make the destructive tool a read tool.
    let parts: Vec<&str> = good.split('.').collect();
    let mut c: Value = serde_json::from_slice(
        &base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(parts[1])
            .unwrap(),
    )
    .unwrap();
    c["snapshot"]["tools"][5]["class"] = json!("read");
    let forged = format!("{}.{}.{}", parts[0], b64(&c), parts[2]);
    assert_eq!(reason(&forged), (-32010, "signature".into()));
    assert_eq!(reason("not.a.token"), (-32010, "malformed".into()));
    // Workspace outside the roots.
    let mut out = snap.clone();
    out["workspace"] = json!("/usr");
    let err = e.start(&rig.token(&out), "print(1)", &[]).unwrap_err();
    assert_eq!(code_reason(&err), (-32011, "outside_roots".into()));
    assert_eq!(err["data"]["field"], "workspace");
    // A bad snapshot names its field.
    let mut bad = snap.clone();
    bad["permission_mode"] = json!("yolo");
    let t = jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
        &json!({"run_id": "r", "exp": 4102444800u64, "iat": 0, "snapshot": bad}),
        &jsonwebtoken::EncodingKey::from_secret(KEY),
    )
    .unwrap();
    let err = e.start(&t, "print(1)", &[]).unwrap_err();
    assert_eq!(code_reason(&err), (-32011, "invalid_value".into()));
    assert_eq!(err["data"]["field"], "permission_mode");
    assert!(e.calls_seen().is_empty());
}

#[test]
fn arguments_are_validated_after_merging_frozen_ones() {
    let rig = Rig::new();
    let e = rig.engine();
    let code = r#"
import agent_tools, json
out = []
for tool, args in [
    ("fleet__get_device_status", {"sn": 42}),
    ("fleet__get_device_status", {"sn": "SN1", "extra": True}),
    ("fleet__get_device_status", {}),
    ("fleet__reboot_device", {"sn": "SN1", "tenant": "evil"}),
]:
    try:
        agent_tools.call(tool, args)
        out.append("called")
    except agent_tools.ToolError as e:
        out.append([e.code, e.message])
print(json.dumps(out))
"#;
    let r = e.run(
        &rig.token(&rig.snapshot("auto")),
        code,
        &["fleet__reboot_device"],
    );
    assert_eq!(r["status"], "ok", "{r}");
    let out: Value = serde_json::from_str(r["output"].as_str().unwrap()).unwrap();
    for (i, needle) in ["/sn", "extra", "sn", "fixed by the run"]
        .iter()
        .enumerate()
    {
        assert_eq!(out[i][0], "invalid_arguments", "{out}");
        assert!(
            out[i][1].as_str().unwrap().contains(needle),
            "{}: {}",
            needle,
            out[i][1]
        );
    }
    assert!(
        e.calls_seen().is_empty(),
        "no invalid call reaches the engine"
    );
    assert_eq!(r["failures"], 4);
}

#[test]
fn undeclared_arguments_never_reach_the_engine() {
    let rig = Rig::new();
    let e = rig.engine();
    let mut snap = rig.snapshot("auto");
    // Open schemas, as MCP servers publish them: no additionalProperties anywhere;
    // the frozen `tenant` is not even listed.
    snap["tools"][0]["input_schema"] = json!({"type": "object", "required": ["sn"], "properties": {
        "sn": {"type": "string"},
        "filter": {"type": "object", "properties": {"fw": {"type": "string"}}}}});
    snap["tools"][3]["input_schema"] =
        json!({"type": "object", "properties": {"sn": {"type": "string"}}});
    let code = r#"
import agent_tools, json
out = []
for tool, args in [
    ("fleet__get_device_status", {"sn": "SN1", "extra": 1}),
    ("fleet__get_device_status", {"sn": "SN1", "filter": {"fw": "1.2", "deep": True}}),
    ("fleet__list_devices", {"everything": True}),
    ("fleet__reboot_device", {"sn": "SN2", "force": True}),
    ("fleet__get_device_status", {"sn": "SN3", "filter": {"fw": "1.3"}}),
    ("fleet__reboot_device", {"sn": "SN4"}),
]:
    try:
        agent_tools.call(tool, args)
        out.append("called")
    except agent_tools.ToolError as e:
        out.append([e.tool, e.code, e.message])
items = agent_tools.call_many("fleet__list_devices", [{"site": "a"}, {"site": "b", "limit": 5}], return_errors=True)
out.append([i if isinstance(i, dict) else [i.code, i.message] for i in items])
print(json.dumps(out))
"#;
    let r = e.run(&rig.token(&snap), code, &["fleet__reboot_device"]);
    assert_eq!(r["status"], "ok", "{r}");
    let out: Value = serde_json::from_str(r["output"].as_str().unwrap()).unwrap();
    assert_eq!(
        out[0],
        json!(["fleet__get_device_status", "invalid_arguments",
               "fleet__get_device_status: argument `extra` is not declared in the tool's schema (its arguments are: filter, sn)"])
    );
    assert_eq!(
        out[1],
        json!([
            "fleet__get_device_status",
            "invalid_arguments",
            "fleet__get_device_status: key `deep` at /filter is not declared in the tool's schema"
        ])
    );
    assert_eq!(
        out[2],
        json!(["fleet__list_devices", "invalid_arguments",
               "fleet__list_devices: argument `everything` is not declared in the tool's schema (its arguments are: site)"])
    );
    assert_eq!(
        out[3],
        json!(["fleet__reboot_device", "invalid_arguments",
               "fleet__reboot_device: argument `force` is not declared in the tool's schema (its arguments are: sn)"])
    );
    assert_eq!((&out[4], &out[5]), (&json!("called"), &json!("called")));
    assert_eq!(out[6][0]["devices"], json!(["SN1", "SN2", "SN3"]));
    assert_eq!(out[6][1][0], "invalid_arguments");
    assert!(
        out[6][1][1].as_str().unwrap().contains("argument `limit`"),
        "{out}"
    );
    // The engine saw exactly the calls whose every key is declared (or frozen).
    assert_eq!(
        e.calls_seen(),
        vec![
            (
                "fleet__get_device_status".to_string(),
                json!({"sn": "SN3", "filter": {"fw": "1.3"}})
            ),
            (
                "fleet__reboot_device".to_string(),
                json!({"sn": "SN4", "tenant": "acme"})
            ),
            ("fleet__list_devices".to_string(), json!({"site": "a"})),
        ]
    );
    assert_eq!(r["failures"], 5);
}

#[test]
fn a_callable_tool_without_a_schema_refuses_the_snapshot() {
    let rig = Rig::new();
    let e = rig.engine();
    let sign = |snap: &Value| {
        // Signed by hand: token::mint refuses such a snapshot itself.
        jsonwebtoken::encode(
            &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
            &json!({"run_id": "r", "exp": 4102444800u64, "iat": 0, "snapshot": snap}),
            &jsonwebtoken::EncodingKey::from_secret(KEY),
        )
        .unwrap()
    };
    for i in [1, 4] {
        // fleet__list_devices (read), fleet__tag_device (write)
        let mut snap = rig.snapshot("auto");
        snap["tools"][i]
            .as_object_mut()
            .unwrap()
            .remove("input_schema");
        let err = e
            .start(&sign(&snap), "print('never runs')", &[])
            .unwrap_err();
        assert_eq!(code_reason(&err), (-32011, "missing_field".into()), "{err}");
        assert_eq!(err["data"]["field"], format!("tools[{i}].input_schema"));
    }
    // The fleet's destructive, long-task and disabled tools have none, and run.
    let snap = rig.snapshot("auto");
    for i in [5, 6, 7] {
        assert!(snap["tools"][i].get("input_schema").is_none());
    }
    let r = e.run(&sign(&snap), "print('runs')", &[]);
    assert_eq!(r["status"], "ok", "{r}");
    assert!(e.calls_seen().is_empty());
}

#[test]
fn revoking_a_run_cancels_its_scripts_and_refuses_new_ones() {
    let rig = Rig::new();
    let e = rig.engine();
    let token = rig.token(&rig.snapshot("auto"));
    let id = e
        .start(&token, "import time\ntime.sleep(60)\n", &[])
        .unwrap();
    let r = e.request("run.revoke", json!({"token": token})).unwrap();
    assert_eq!(r, json!({"run_id": "run-1", "cancelled": 1}));
    let res = e.wait(&id);
    assert_eq!(res["status"], "cancelled");
    assert_eq!(res["error"], "run run-1 was revoked");
    assert_eq!(
        code_reason(&e.start(&token, "print(1)", &[]).unwrap_err()),
        (-32010, "revoked".into())
    );
    // Revocation survives a restart.
    drop(e);
    let mut rig = rig;
    rig.stop(nix::sys::signal::Signal::SIGTERM);
    rig.start();
    let e = rig.engine();
    assert_eq!(
        code_reason(&e.start(&token, "print(1)", &[]).unwrap_err()),
        (-32010, "revoked".into())
    );
}

#[test]
fn a_token_that_expires_mid_script_refuses_further_calls() {
    let rig = Rig::new();
    let e = rig.engine();
    // 5 s: the first call must come before `exp` (whole seconds, so as little
    // as 4 s after minting) even on a loaded machine; 2 s was flaky there.
    let token = rig.token_for("run-1", &rig.snapshot("auto"), 5);
    // The script waits for the event itself, the clock passing the token's `exp`
    // (whole seconds), instead of sleeping for a guessed while.
    use base64::Engine as _;
    let claims: Value = serde_json::from_slice(
        &base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(token.split('.').nth(1).unwrap())
            .unwrap(),
    )
    .unwrap();
    let exp = claims["exp"].as_i64().unwrap();
    let code = format!(
        r#"
import agent_tools, time
agent_tools.call("fleet__list_devices", {{}})
while int(time.time()) <= {exp}:
    time.sleep(0.02)
try:
    agent_tools.call("fleet__list_devices", {{}})
except agent_tools.ToolError as e:
    print(e.code, e.message)
"#
    );
    let code = code.as_str();
    let r = e.run(&token, code, &[]);
    assert_eq!(r["status"], "ok", "{r}");
    assert_eq!(r["output"], "expired the run token of run run-1 expired\n");
    assert_eq!(e.calls_seen().len(), 1);
}

/// Compiling a snapshot's schemas leaves no lasting memory in the daemon: after a
/// dozen scripts, each of which compiles every schema of its snapshot and has good
/// and bad arguments validated, the daemon's heap (its anonymous resident memory)
/// is still close to a fresh one's. jsonschema 0.26 kept ~14 MiB of meta-schema
/// validators (all five drafts) for good after the first script start, taking an
/// idle daemon from 9 to 33 MiB (docs/BENCHMARKS.md, "Daemon memory"). The binary's
/// code pages are left out: they grow with the code paths run, and by build.
/// Not a timing test: resident memory does not depend on the machine's load, and
/// the bound is a few times the growth measured here but well under what the old
/// meta-schema validators alone held.
#[test]
fn compiled_schemas_leave_no_lasting_memory_in_the_daemon() {
    const MIB: u64 = 1 << 20;
    const SCRIPTS: usize = 12;
    const GROWTH_BOUND: u64 = 8 * MIB;
    let rig = Rig::new();
    let pid = rig.daemon.as_ref().expect("daemon running").id();
    let (fresh, fresh_anon) = (rss(pid), rss_anon(pid));
    let e = rig.engine();
    let token = rig.token(&rig.snapshot("auto"));
    let code = r#"
import agent_tools
agent_tools.call("fleet__get_device_status", {"sn": "SN1"})
agent_tools.call("fleet__list_devices", {"site": "lab"})
try:
    agent_tools.call("fleet__get_device_status", {"sn": 1, "extra": True})
except agent_tools.ToolError as e:
    assert e.code == "invalid_arguments", e.code
"#;
    for i in 0..SCRIPTS {
        let r = e.run(&token, code, &[]);
        assert_eq!(r["status"], "ok", "script {i}: {r}");
        assert_eq!(r["failures"], 1, "{r}");
    }
    assert_eq!(
        e.calls_seen().len(),
        2 * SCRIPTS,
        "the bad call never reaches the engine"
    );
    let (after, after_anon) = (rss(pid), rss_anon(pid));
    let mib = |b: u64| b as f64 / MIB as f64;
    eprintln!(
        "daemon RSS (anonymous part): fresh {:.1} MiB ({:.1}), after {SCRIPTS} scripts {:.1} MiB ({:.1})",
        mib(fresh),
        mib(fresh_anon),
        mib(after),
        mib(after_anon)
    );
    assert!(
        after_anon.saturating_sub(fresh_anon) < GROWTH_BOUND,
        "the daemon's heap grew by {:.1} MiB over {SCRIPTS} scripts (anonymous RSS from {:.1} to {:.1} MiB): \
         something the first script start builds (e.g. schema machinery) is held for good",
        mib(after_anon.saturating_sub(fresh_anon)),
        mib(fresh_anon),
        mib(after_anon)
    );
}
