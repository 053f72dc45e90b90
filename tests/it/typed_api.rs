//! The typed tool API (`from agent_tools import tools`) through the real daemon:
//! a bwrap sandbox, the system's python, the daemon's `tools` answer built from
//! the token's snapshot, and the test engine. What it calls is what `call`,
//! `call_many` and `call_raw` call, under the same policy; bad arguments never
//! leave the script; `help()` and `dir()` work; `run.describe` spells the
//! names as the script does.
use crate::common::*;
use serde_json::{json, Value};
use std::sync::Arc;

/// The fleet snapshot, with a description, and two tools whose names are no
/// Python identifiers: a server `my-srv` and a tool `get.item` whose arguments
/// are `class` (a keyword) and `max-n`; and `ping`, a tool without a server.
fn snapshot(rig: &Rig) -> Value {
    let mut s = rig.snapshot("approval");
    s["tools"][0]["description"] = json!("Status of one device: online or not, and its firmware.");
    let tools = s["tools"].as_array_mut().unwrap();
    tools.push(json!({"name": "my-srv__get.item", "class": "read",
        "input_schema": {"type": "object", "required": ["class"], "properties": {
            "class": {"type": "integer", "description": "The item's class."},
            "max-n": {"type": ["integer", "null"]}}}}));
    tools.push(json!({"name": "ping", "class": "read", "input_schema": {"type": "object"}}));
    s
}

/// The fleet engine, and one that echoes the arguments of the two new tools.
fn handler() -> Handler {
    let fleet = fleet_handler();
    Arc::new(move |tool, args| match tool {
        "my-srv__get.item" | "ping" => Ok(
            json!({"text": "echo", "structured": {"tool": tool, "args": args}, "is_error": false}),
        ),
        _ => fleet(tool, args),
    })
}

const SCRIPT: &str = r#"
import contextlib, inspect, io, json
import agent_tools
from agent_tools import tools, ToolError

out = {"dir": [dir(tools), dir(tools.fleet), dir(tools.my_srv)]}
out["typed"] = tools.fleet.get_device_status(sn="SN0001")
out["call"] = agent_tools.call("fleet__get_device_status", {"sn": "SN0001"})
out["typed_many"] = tools.fleet.get_device_status.many([{"sn": s} for s in ("SN1", "SN10")])
out["call_many"] = agent_tools.call_many("fleet__get_device_status", [{"sn": s} for s in ("SN1", "SN10")])
out["typed_raw"] = tools.fleet.fail.raw()
out["call_raw"] = agent_tools.call_raw("fleet__fail", {})
refused = []
for f, kw in [(tools.fleet.get_device_status, {"sn": "SN1", "serial": "SN1"}),
              (tools.fleet.get_device_status, {}),
              (tools.fleet.get_device_status.raw, {"serial": "SN1"}),
              (tools.fleet.reboot_device, {"sn": "SN1", "tenant": "other"})]:
    try:
        f(**kw)
    except ToolError as e:
        refused.append([e.tool, e.code, e.message])
try:
    tools.fleet.get_device_status.many([{"sn": "SN1"}, {"sn": "SN2", "serial": "SN2"}])
except ToolError as e:
    refused.append([e.tool, e.code, e.message])
out["refused"] = refused
# The same policy: an undeclared write tool is the daemon's refusal, typed or not.
for f in (lambda: tools.fleet.reboot_device(sn="SN1"),
          lambda: agent_tools.call("fleet__reboot_device", {"sn": "SN1"})):
    try:
        f()
    except ToolError as e:
        out.setdefault("denied", []).append([e.code, e.message])
# And the daemon still checks every call that is sent.
try:
    agent_tools.call("fleet__get_device_status", {"sn": "SN1", "bogus": 1})
except ToolError as e:
    out["daemon_checks"] = e.code
out["spelled"] = tools.my_srv.get_item(class_=2, max_n=3)
out["ping"] = tools.ping()
buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    help(tools.fleet.get_device_status)
    help(tools.my_srv.get_item)
out["help"] = buf.getvalue()
out["signature"] = str(inspect.signature(tools.my_srv.get_item))
print(json.dumps(out))
"#;

#[test]
fn typed_calls_are_the_string_api_calls_and_bad_arguments_are_never_sent() {
    let rig = Rig::new();
    let e = rig.engine();
    e.set_handler(handler());
    let token = rig.token(&snapshot(&rig));
    let r = e.run(&token, SCRIPT, &[]);
    assert_eq!(r["status"], "ok", "{r}");
    let out: Value = serde_json::from_str(r["output"].as_str().unwrap().trim()).unwrap();

    assert_eq!(
        out["dir"],
        json!([
            ["fleet", "my_srv", "ping"],
            [
                "fail",
                "get_device_status",
                "list_devices",
                "reboot_device",
                "tag_device"
            ],
            ["get_item"]
        ]),
        "destructive, long-task and disabled tools are not there"
    );
    assert_eq!(out["typed"], out["call"]);
    assert_eq!(
        out["typed"],
        json!({"sn": "SN0001", "online": true, "fw": "1.3"})
    );
    assert_eq!(out["typed_many"], out["call_many"]);
    assert_eq!(out["typed_many"][1]["online"], false);
    assert_eq!(out["typed_raw"], out["call_raw"]);
    assert_eq!(
        out["typed_raw"],
        json!({"text": "device unreachable", "structured": null, "is_error": true})
    );

    let sig = "tools.fleet.get_device_status(*, sn: str)";
    let refused = |tool: &str, why: &str, sig: &str| {
        json!([tool, "invalid_arguments", format!("{why}; {sig}")])
    };
    assert_eq!(
        out["refused"],
        json!([
            refused("fleet__get_device_status", "unknown argument 'serial'", sig),
            refused(
                "fleet__get_device_status",
                "missing required argument 'sn'",
                sig
            ),
            refused("fleet__get_device_status", "unknown argument 'serial'", sig),
            refused(
                "fleet__reboot_device",
                "unknown argument 'tenant'",
                "tools.fleet.reboot_device(*, sn: str = None)"
            ),
            refused("fleet__get_device_status", "unknown argument 'serial'", sig),
        ])
    );
    let denied = out["denied"].as_array().unwrap();
    assert_eq!(denied.len(), 2);
    assert_eq!(
        denied[0], denied[1],
        "the typed call is refused as call() is"
    );
    assert_eq!(denied[0][0], "denied");
    assert_eq!(out["daemon_checks"], "invalid_arguments");
    assert_eq!(
        out["spelled"],
        json!({"tool": "my-srv__get.item", "args": {"class": 2, "max-n": 3}})
    );
    assert_eq!(out["ping"], json!({"tool": "ping", "args": {}}));

    let help = out["help"].as_str().unwrap();
    for want in [
        "get_device_status(*, sn: str)\n    fleet__get_device_status: Status of one device: online or not, and its firmware.\n",
        "        sn (str, required)\n",
        "get_item(*, class_: int, max_n: int | None = None)\n    my-srv__get.item: no description given.\n",
        "        class_ (int, required, sent as 'class'): The item's class.\n",
        "        max_n (int | None, optional, sent as 'max-n')\n",
        "agent_tools.call('my-srv__get.item', args) is the same call by name.",
    ] {
        assert!(help.contains(want), "help() lacks {want:?}:\n{help}");
    }

    // What reached the engine: the good calls only, nothing the script refused.
    let sent: Vec<(String, Value)> = e.calls_seen();
    let status = |sn: &str| ("fleet__get_device_status".to_string(), json!({"sn": sn}));
    assert_eq!(
        sent,
        vec![
            status("SN0001"),
            status("SN0001"),
            status("SN1"),
            status("SN10"),
            status("SN1"),
            status("SN10"),
            ("fleet__fail".into(), json!({})),
            ("fleet__fail".into(), json!({})),
            ("my-srv__get.item".into(), json!({"class": 2, "max-n": 3})),
            ("ping".into(), json!({})),
        ]
    );
    // The record: those calls and the daemon's three refusals (two undeclared
    // writes, one bad key), and no line of the five refused in the script.
    let log = std::fs::read_to_string(
        rig.details(r["script_id"].as_str().unwrap())
            .join("calls.jsonl"),
    )
    .unwrap();
    let lines: Vec<Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 13, "{log}");
    assert_eq!(r["calls"], 13);
    assert!(!log.contains("serial") && !log.contains("other"), "{log}");

    // run.describe spells the names as the script does.
    let d = e.request("run.describe", json!({"token": token})).unwrap();
    let text = d["text"].as_str().unwrap();
    assert_eq!(
        out["signature"],
        "(*, class_: int, max_n: int | None = None)"
    );
    for want in [
        "    tools.my_srv.get_item(class_: int, max_n: int | None = None)  # my-srv__get.item\n",
        "    tools.ping()  # ping\n",
        "    tools.fleet.get_device_status(sn: str)  # fleet__get_device_status\n",
        "from agent_tools import tools, ToolError\n",
    ] {
        assert!(text.contains(want), "run.describe lacks {want:?}:\n{text}");
    }
}
