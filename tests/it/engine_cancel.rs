//! Issue 20 at the wire: a script's end reaches the engine's calls
//! (`tool.cancelled`), `script.cancel` answers once the processes are dead, the
//! engine's trace runs through the sandbox, and `run.describe` gives the model
//! a ready-made tool. Through the real daemon, socket, bwrap and Python.

use crate::common::*;
use serde_json::{json, Value};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// A handler that holds every call until `release`, then answers "late".
struct Held(Arc<(Mutex<bool>, Condvar)>);

impl Held {
    fn new() -> Held {
        Held(Arc::new((Mutex::new(false), Condvar::new())))
    }
    fn handler(&self) -> Handler {
        let gate = self.0.clone();
        Arc::new(move |_, _| {
            let (m, cv) = &*gate;
            let g = m.lock().unwrap();
            let _ = cv
                .wait_timeout_while(g, Duration::from_secs(60), |open| !*open)
                .unwrap();
            Ok(json!({"text": "late", "is_error": false}))
        })
    }
    fn release(&self) {
        *self.0 .0.lock().unwrap() = true;
        self.0 .1.notify_all();
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.release();
    }
}

const FOUR_HELD: &str = r#"
import agent_tools
agent_tools.call_many("fleet__get_device_status", [{"sn": "SN%d" % i} for i in range(4)])
"#;

/// The ids of the `tool.call` requests the engine got.
fn tool_call_ids(e: &Engine) -> Vec<u64> {
    e.raw_lines
        .lock()
        .unwrap()
        .iter()
        .filter(|m| m["method"] == "tool.call")
        .filter_map(|m| m["id"].as_u64())
        .collect()
}

fn index_of(e: &Engine, pred: impl Fn(&Value) -> bool) -> usize {
    e.raw_lines
        .lock()
        .unwrap()
        .iter()
        .position(pred)
        .expect("no such message")
}

#[test]
fn a_cancel_abandons_the_calls_at_the_engine_at_once_and_says_so() {
    let rig = Rig::new();
    let e = rig.engine();
    let held = Held::new();
    e.set_handler(held.handler());
    let id = e
        .start(&rig.token(&rig.snapshot("auto")), FOUR_HELD, &[])
        .unwrap();
    eventually("four calls at the engine", Duration::from_secs(30), || {
        e.seen.lock().unwrap().in_flight == 4
    });
    let t0 = Instant::now();
    let answer = e
        .request("script.cancel", json!({"script_id": id}))
        .unwrap();
    let took = t0.elapsed();
    assert_eq!(answer["state"], "cancelled", "{answer}");
    // The old daemon waited 3 s for the answers of the calls it had already
    // given up; now nothing waits on them (figures: docs/BENCHMARKS.md).
    assert!(
        took < Duration::from_millis(2500),
        "script.cancel took {took:?}"
    );
    eprintln!("script.cancel answered in {took:?}");
    // Each call still at the engine is abandoned, by its JSON-RPC id, before
    // script.finished.
    let cancelled = e.notifications("tool.cancelled");
    let mut ids: Vec<u64> = cancelled
        .iter()
        .map(|(p, _)| p["id"].as_u64().unwrap())
        .collect();
    ids.sort();
    let mut sent = tool_call_ids(&e);
    sent.sort();
    assert_eq!(ids, sent, "{cancelled:?}");
    for (p, _) in &cancelled {
        assert_eq!(p["script_id"], id.as_str());
        assert_eq!(p["reason"], "cancelled");
        assert_eq!(p["message"], "cancelled by the engine");
        assert!(p["call_id"].as_str().is_some_and(|c| !c.is_empty()));
    }
    let finished = index_of(&e, |m| m["method"] == "script.finished");
    let last_cancel = e
        .raw_lines
        .lock()
        .unwrap()
        .iter()
        .rposition(|m| m["method"] == "tool.cancelled")
        .unwrap();
    assert!(
        last_cancel < finished,
        "tool.cancelled after script.finished"
    );
    // The record counts them, with no answer.
    let r = e.wait(&id);
    assert_eq!(r["calls"], 4, "{r}");
    let log = std::fs::read_to_string(rig.details(&id).join("calls.jsonl")).unwrap();
    assert_eq!(
        log.matches("no answer: the script ended before the engine answered")
            .count(),
        4,
        "{log}"
    );
    // Answers that come after are ignored; the connection serves on.
    held.release();
    eventually("the late answers sent", Duration::from_secs(30), || {
        e.seen.lock().unwrap().in_flight == 0
    });
    let info = e.request("daemon.info", json!({})).unwrap();
    assert_eq!(info["running"], 0, "{info}");
    assert_eq!(e.wait(&id)["status"], "cancelled");
}

#[test]
fn calls_cut_by_a_timeout_or_left_by_an_exit_are_abandoned_with_that_reason() {
    let rig = Rig::new();
    let e = rig.engine();
    let held = Held::new();
    e.set_handler(held.handler());
    let mut snap = rig.snapshot("auto");
    snap["limits"] = json!({"timeout_s": 2});
    let r = e.run(&rig.token(&snap), FOUR_HELD, &[]);
    assert_eq!(r["status"], "timeout", "{r}");
    let reasons: Vec<Value> = e
        .notifications("tool.cancelled")
        .into_iter()
        .map(|(p, _)| p["reason"].clone())
        .collect();
    assert_eq!(reasons, vec![json!("timeout"); 4]);

    // A script that exits by itself with a call outstanding: the call gets a
    // grace to come back, then is abandoned as `exited`.
    let e = rig.engine();
    e.set_handler(held.handler());
    let code = r#"
import os, threading, agent_tools
threading.Thread(target=agent_tools.call, args=("fleet__list_devices", {}), daemon=True).start()
while not os.path.exists("/proc/self"):
    pass
import time
time.sleep(0.5)
print("leaving")
os._exit(0)
"#;
    let r = e.run(&rig.token(&rig.snapshot("auto")), code, &[]);
    assert_eq!(r["status"], "ok", "{r}");
    let c = e.notifications("tool.cancelled");
    assert_eq!(c.len(), 1, "{c:?}");
    assert_eq!(c[0].0["reason"], "exited");
    assert_eq!(
        c[0].0["message"],
        "the script ended before the engine answered"
    );
}

const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

#[test]
fn the_engines_trace_runs_through_the_script_to_every_call_and_the_records() {
    let rig = Rig::new();
    let e = rig.engine();
    let code = r#"
import agent_tools
agent_tools.call_many("fleet__get_device_status", [{"sn": "SN1"}, {"sn": "SN2"}, {"sn": "SN3"}])
agent_tools.call("fleet__reboot_device", {"sn": "SN1"})
"#;
    let r = e
        .request(
            "script.start",
            json!({"token": rig.token(&rig.snapshot("approval")), "code": code,
                   "tools": ["fleet__reboot_device"], "traceparent": TP, "tracestate": "congo=t61rcWkgMzE"}),
        )
        .unwrap();
    let id = r["script_id"].as_str().unwrap().to_string();
    let res = e.wait(&id);
    assert_eq!(res["status"], "ok", "{res}");
    // The approval and every call name the script's trace, with the engine's
    // span that started it as their parent; each call has a span id of its own.
    let seen = e.seen.lock().unwrap().approvals.clone();
    assert_eq!(seen[0]["traceparent"], TP);
    assert_eq!(seen[0]["tracestate"], "congo=t61rcWkgMzE");
    let calls: Vec<Value> = e
        .raw_lines
        .lock()
        .unwrap()
        .iter()
        .filter(|m| m["method"] == "tool.call")
        .map(|m| m["params"].clone())
        .collect();
    assert_eq!(calls.len(), 4);
    let mut spans: Vec<String> = vec![];
    for c in &calls {
        assert_eq!(c["traceparent"], TP, "{c}");
        assert_eq!(c["tracestate"], "congo=t61rcWkgMzE", "{c}");
        let s = c["span_id"].as_str().unwrap().to_string();
        assert!(
            s.len() == 16 && s.bytes().all(|b| b.is_ascii_hexdigit()),
            "{s}"
        );
        spans.push(s);
    }
    let mut unique = spans.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), 4, "one span id per call: {spans:?}");
    // calls.jsonl carries each call's span id.
    let log = std::fs::read_to_string(rig.details(&id).join("calls.jsonl")).unwrap();
    let mut logged: Vec<String> = log
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["span_id"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    logged.sort();
    assert_eq!(logged, unique);
    // The audit row and the journal entry carry the trace id.
    let db = rusqlite::Connection::open(rig.state.join("scriptgate.db")).unwrap();
    let trace: Option<String> = db
        .query_row(
            "SELECT trace_id FROM scripts WHERE script_id = ?1",
            [&id],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(trace.as_deref(), Some("4bf92f3577b34da6a3ce929d0e0e4736"));
    eventually("the finished entry", Duration::from_secs(10), || {
        rig.log_text()
            .contains("scriptgate_trace_id=\"4bf92f3577b34da6a3ce929d0e0e4736\"")
            || rig
                .log_text()
                .contains("scriptgate_trace_id=4bf92f3577b34da6a3ce929d0e0e4736")
    });

    // Without a trace, none of it is there.
    let r = e.run(
        &rig.token(&rig.snapshot("auto")),
        "import agent_tools\nagent_tools.call('fleet__list_devices', {})\n",
        &[],
    );
    assert_eq!(r["status"], "ok");
    let last = e
        .raw_lines
        .lock()
        .unwrap()
        .iter()
        .rev()
        .find(|m| m["method"] == "tool.call")
        .cloned()
        .unwrap();
    for k in ["traceparent", "tracestate", "span_id"] {
        assert!(last["params"].get(k).is_none(), "{last}");
    }
}

#[test]
fn a_malformed_trace_context_is_refused_by_name() {
    let rig = Rig::new();
    let e = rig.engine();
    let token = rig.token(&rig.snapshot("auto"));
    for (params, says) in [
        (
            json!({"traceparent": "00-xyz-00f067aa0ba902b7-01"}),
            "`traceparent` must be",
        ),
        (
            json!({"tracestate": "a=b"}),
            "`tracestate` without `traceparent`",
        ),
        (
            json!({"traceparent": TP, "tracestate": "x".repeat(600)}),
            "`tracestate` is 600 bytes",
        ),
    ] {
        let mut p = json!({"token": token, "code": "print(1)"});
        for (k, v) in params.as_object().unwrap() {
            p[k] = v.clone();
        }
        let err = e.request("script.start", p).unwrap_err();
        assert_eq!(err["code"], -32602, "{err}");
        assert!(err["message"].as_str().unwrap().contains(says), "{err}");
    }
}

#[test]
fn run_describe_gives_the_descriptions_and_a_ready_made_tool() {
    let rig = Rig::new();
    let e = rig.engine();
    let mut snap = rig.snapshot("auto");
    snap["tools"][0]["description"] =
        json!("Status of one device:\n online or not, and its firmware.");
    let d = e
        .request("run.describe", json!({"token": rig.token(&snap)}))
        .unwrap();
    let text = d["text"].as_str().unwrap();
    assert!(
        text.contains("tools.fleet.get_device_status(sn: str)  # fleet__get_device_status\n        Status of one device: online or not, and its firmware.\n"),
        "{text}"
    );
    assert_eq!(d["tool"]["name"], "run_script");
    assert_eq!(d["tool"]["description"], d["text"]);
    assert_eq!(d["tool"]["inputSchema"]["required"], json!(["code"]));
    // A description is no way round the snapshot's strictness: other unknown
    // keys are still refused.
    snap["tools"][0]["descripton"] = json!("typo");
    let err = scriptgate::protocol::token::mint(b"k", "run-1", None, &snap, 60).unwrap_err();
    assert!(err.to_string().contains("descripton"), "{err}");
}
