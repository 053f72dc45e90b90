//! Tool calls from real scripts, through the real daemon, to a test engine.
use crate::common::*;
use serde_json::{json, Value};
use std::sync::atomic::Ordering;
use std::time::Duration;

const FLEET_SUMMARY: &str = r#"
import agent_tools, collections
sns = [f"SN{i}" for i in range(500)]
results = []
for start in range(0, len(sns), 100):
    batch = sns[start:start + 100]
    results += agent_tools.call_many("fleet__get_device_status", [{"sn": s} for s in batch])
    agent_tools.progress(start + len(batch), len(sns), "querying devices")
offline = [r["sn"] for r in results if not r["online"]]
fw = collections.Counter(r["fw"] for r in results)
assert [r["sn"] for r in results] == sns, "results must come back in input order"
print(f"{len(results)} devices: {len(offline)} offline; firmware {dict(sorted(fw.items()))}")
print("first offline:", ", ".join(offline[:3]))
"#;

#[test]
fn the_500_device_fleet_summary() {
    let rig = Rig::new();
    let e = rig.engine();
    e.call_delay_ms.store(10, Ordering::Relaxed); // 500 calls / 4 in flight: ~1.3 s
    let r = e.run(&rig.token(&rig.snapshot("approval")), FLEET_SUMMARY, &[]);
    assert_eq!(r["status"], "ok", "{r}");
    assert_eq!(r["calls"], 500);
    assert_eq!(r["failures"], 0);
    assert_eq!(r["exit_code"], 0);
    assert_eq!(r["output"], "500 devices: 50 offline; firmware {'1.2': 167, '1.3': 333}\nfirst offline: SN0, SN10, SN20\n");
    let id = r["script_id"].as_str().unwrap();
    assert_eq!(r["details_dir"], format!(".agent/scripts/{id}"));
    assert!(
        r["text"]
            .as_str()
            .unwrap()
            .starts_with("run_script ok: 500 calls, 0 failed, "),
        "{}",
        r["text"]
    );
    assert!(r["text"]
        .as_str()
        .unwrap()
        .ends_with(r["output"].as_str().unwrap()));
    // Artifacts: the code, one line per call, the output.
    let dir = rig.details(id);
    assert_eq!(
        std::fs::read_to_string(dir.join("script.py")).unwrap(),
        FLEET_SUMMARY
    );
    let calls = std::fs::read_to_string(dir.join("calls.jsonl")).unwrap();
    let lines: Vec<Value> = calls
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 500);
    for l in &lines {
        for k in [
            "ts",
            "tool",
            "arguments",
            "duration_ms",
            "is_error",
            "summary",
        ] {
            assert!(l.get(k).is_some(), "calls.jsonl line lacks {k}: {l}");
        }
    }
    assert_eq!(
        std::fs::read_to_string(dir.join("output.txt")).unwrap(),
        r["output"].as_str().unwrap()
    );
    // The engine saw exactly the 500 calls; progress arrived, at most once a second,
    // and ended at the final state.
    assert_eq!(e.calls_seen().len(), 500);
    let progress = e.notifications("script.progress");
    assert!(!progress.is_empty(), "no script.progress notification");
    assert!(progress
        .iter()
        .any(|(p, _)| p["progress"]["total"] == 500
            && p["progress"]["message"] == "querying devices"));
    // The script reports after every batch; the engine gets the first at once, then
    // at most one a second, and the final state: never more than the run's whole
    // seconds allow (checked against the run's own duration, not a guess).
    let secs = r["duration_ms"].as_u64().unwrap() / 1000;
    assert!(
        progress.len() >= 2 && progress.len() as u64 <= secs + 2,
        "{} progress notifications in {} ms",
        progress.len(),
        r["duration_ms"]
    );
    // (The last may follow closely: the final state always goes out before the end.)
    for w in progress[..progress.len() - 1].windows(2) {
        assert!(
            w[1].1.duration_since(w[0].1) >= Duration::from_millis(900),
            "progress more often than once a second"
        );
    }
    assert_eq!(progress.last().unwrap().0["progress"]["done"], 500);
    for (p, _) in &progress {
        assert_eq!(p["script_id"], id);
        assert_eq!(p["state"], "running");
    }
    // script.finished carries the same result object.
    eventually("script.finished", Duration::from_secs(5), || {
        !e.notifications("script.finished").is_empty()
    });
    assert_eq!(e.notifications("script.finished")[0].0, r);
}

#[test]
fn never_more_than_four_calls_in_flight() {
    let rig = Rig::new();
    let e = rig.engine();
    e.call_delay_ms.store(40, Ordering::Relaxed);
    let code = r#"
import agent_tools, threading
def worker(k):
    for i in range(5):
        agent_tools.call("fleet__get_device_status", {"sn": f"SN{k}{i}"})
threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
for t in threads: t.start()
many = agent_tools.call_many("fleet__get_device_status", [{"sn": f"SN{i}"} for i in range(60)])
for t in threads: t.join()
print(len(many), [m["sn"] for m in many[:3]])
"#;
    let r = e.run(&rig.token(&rig.snapshot("auto")), code, &[]);
    assert_eq!(r["status"], "ok", "{r}");
    assert_eq!(r["output"], "60 ['SN0', 'SN1', 'SN2']\n");
    assert_eq!(r["calls"], 100);
    let max = e.seen.lock().unwrap().max_in_flight;
    assert_eq!(
        max, 4,
        "max_concurrency is 4: the daemon must keep exactly that many in flight under load"
    );
}

/// call_many keeps two batches in flight, and the callers of several threads
/// take turns reading the replies (no reader thread): every thread still gets
/// its own results, in input order, and the daemon still holds the engine to
/// four calls at once, each logged.
#[test]
fn pipelined_call_many_keeps_order_and_the_in_flight_cap_across_threads() {
    let rig = Rig::new();
    let e = rig.engine();
    e.call_delay_ms.store(2, Ordering::Relaxed);
    let code = r#"
import agent_tools, threading
out = {}
def worker(k):
    sns = [f"SN{k}-{i}" for i in range(130)]
    got = agent_tools.call_many("fleet__get_device_status", [{"sn": s} for s in sns])
    one = agent_tools.call("fleet__get_device_status", {"sn": f"SN{k}-x"})
    out[k] = ([g["sn"] for g in got] == sns, one["sn"])
threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
for t in threads: t.start()
for t in threads: t.join()
print(sorted(out.items()))
"#;
    let r = e.run(&rig.token(&rig.snapshot("auto")), code, &[]);
    assert_eq!(r["status"], "ok", "{r}");
    assert_eq!(
        r["output"],
        "[(0, (True, 'SN0-x')), (1, (True, 'SN1-x')), (2, (True, 'SN2-x')), (3, (True, 'SN3-x'))]\n"
    );
    assert_eq!(r["calls"], 4 * 131);
    assert_eq!(e.seen.lock().unwrap().max_in_flight, 4);
    let log = std::fs::read_to_string(
        rig.details(r["script_id"].as_str().unwrap())
            .join("calls.jsonl"),
    )
    .unwrap();
    assert_eq!(log.lines().count(), 4 * 131);
}

#[test]
fn snapshot_limits_tighten_concurrency() {
    let rig = Rig::new();
    let e = rig.engine();
    e.call_delay_ms.store(20, Ordering::Relaxed);
    let mut snap = rig.snapshot("auto");
    snap["limits"] = json!({"max_concurrency": 2, "max_calls": 100000});
    let r = e.run(&rig.token(&snap), "import agent_tools\nagent_tools.call_many('fleet__get_device_status', [{'sn': 'x'}] * 20)\n", &[]);
    assert_eq!(r["status"], "ok", "{r}");
    assert_eq!(e.seen.lock().unwrap().max_in_flight, 2);
}

#[test]
fn tool_errors_reach_the_script_three_ways() {
    let rig = Rig::new();
    let e = rig.engine();
    let code = r#"
import agent_tools
from agent_tools import ToolError
try:
    agent_tools.call("fleet__fail", {})
except ToolError as e:
    print("call:", e.tool, e.code, e.message)
items = agent_tools.call_many("fleet__get_device_status", [{"sn": "SN1"}, {}, {"sn": "SN2"}], return_errors=True)
print("many:", [type(i).__name__ for i in items], items[1].code)
raw = agent_tools.call_raw("fleet__fail", {})
print("raw:", raw)
try:
    agent_tools.call_many("fleet__fail", [{}, {}])
except ToolError as e:
    print("many raises:", e.code)
try:
    agent_tools.call("fleet__list_devices", {"site": "boom"})
except ToolError as e:
    print("engine:", e.code, e.message)
try:
    agent_tools.call_raw("fleet__list_devices", {"site": "boom"})
    print("raw engine: returned")
except ToolError as e:
    print("raw engine raises:", e.code, e.message)
"#;
    e.set_handler(std::sync::Arc::new(|tool, args| {
        if tool == "fleet__list_devices" && args["site"] == "boom" {
            return Err("backend exploded".into());
        }
        fleet_handler()(tool, args)
    }));
    let r = e.run(&rig.token(&rig.snapshot("auto")), code, &[]);
    assert_eq!(r["status"], "ok", "{r}");
    let out = r["output"].as_str().unwrap();
    assert!(
        out.contains("call: fleet__fail tool_error device unreachable\n"),
        "{out}"
    );
    assert!(
        out.contains("many: ['dict', 'ToolError', 'dict'] invalid_arguments\n"),
        "{out}"
    );
    assert!(
        out.contains("raw: {'text': 'device unreachable', 'structured': None, 'is_error': True}\n"),
        "{out}"
    );
    assert!(out.contains("many raises: tool_error\n"), "{out}");
    assert!(out.contains("engine: engine backend exploded\n"), "{out}");
    // A broken engine is never taken for the tool's answer, call_raw included.
    assert!(
        out.contains("raw engine raises: engine backend exploded\n"),
        "{out}"
    );
    // calls: 1 + 3 + 1 + 2 + 1 + 1 = 9, of which the invalid one never reached the engine.
    assert_eq!(r["calls"], 9);
    assert_eq!(r["failures"], 7);
    assert_eq!(e.calls_seen().len(), 8);
}

#[test]
fn budget_overrun_gives_limit() {
    let rig = Rig::new();
    let e = rig.engine();
    let mut snap = rig.snapshot("auto");
    snap["limits"] = json!({"max_calls": 5});
    let code = r#"
import agent_tools
for i in range(10):
    try:
        agent_tools.call("fleet__get_device_status", {"sn": f"SN{i}"})
    except agent_tools.ToolError as e:
        print(i, e.code)
        if i == 6:
            raise
"#;
    let r = e.run(&rig.token(&snap), code, &[]);
    assert_eq!(r["status"], "limit", "{r}");
    assert_eq!(r["output"], "5 limit\n6 limit\n");
    assert_eq!(
        e.calls_seen().len(),
        5,
        "the engine sees exactly max_calls calls"
    );
    let err = r["error"].as_str().unwrap();
    assert!(err.contains("ToolError") && err.contains("budget"), "{err}");
    assert!(
        r["text"]
            .as_str()
            .unwrap()
            .starts_with("run_script limit: 7 calls, 2 failed"),
        "{}",
        r["text"]
    );
}

#[test]
fn long_output_is_truncated_in_the_result_but_complete_on_disk() {
    let rig = Rig::new();
    let e = rig.engine();
    let code = "import sys\nfor i in range(1000):\n    print(f'{i:05d}' + 'é' * 44)\n";
    let r = e.run(&rig.token(&rig.snapshot("auto")), code, &[]);
    assert_eq!(r["status"], "ok", "{r}");
    assert_eq!(r["output_truncated"], true);
    let max = scriptgate::config::Scripts::default().return_max_chars;
    assert_eq!(r["output"].as_str().unwrap().chars().count(), max);
    let text = r["text"].as_str().unwrap();
    assert!(text.contains(&format!("[output truncated to return_max_chars = {max} characters; all of it is in .agent/scripts/")), "{}", &text[text.len() - 300..]);
    let full = std::fs::read_to_string(
        rig.details(r["script_id"].as_str().unwrap())
            .join("output.txt"),
    )
    .unwrap();
    assert_eq!(full.lines().count(), 1000);
    assert_eq!(full.chars().count(), 1000 * 50);
}

#[test]
fn output_beyond_output_max_bytes_is_dropped_with_a_note() {
    let rig = Rig::with_config("[scripts]\noutput_max_bytes = 1000\n");
    let e = rig.engine();
    let r = e.run(
        &rig.token(&rig.snapshot("auto")),
        "print('x' * 4999)\n",
        &[],
    );
    assert_eq!(r["status"], "ok", "{r}");
    let full = std::fs::read_to_string(
        rig.details(r["script_id"].as_str().unwrap())
            .join("output.txt"),
    )
    .unwrap();
    assert!(full.starts_with(&"x".repeat(1000)));
    assert!(full.ends_with("[scriptgate: 4000 more bytes were printed and dropped; the limit is output_max_bytes = 1000]\n"), "{full}");
}

#[test]
fn status_shows_live_counters_and_progress() {
    let rig = Rig::new();
    let e = rig.engine();
    let code = r#"
import agent_tools, time
agent_tools.call("fleet__list_devices", {})
agent_tools.progress(1, 3, "one down")
time.sleep(30)
"#;
    let t0 = std::time::Instant::now();
    let id = e
        .start(&rig.token(&rig.snapshot("auto")), code, &[])
        .unwrap();
    eventually("progress in status", Duration::from_secs(10), || {
        let s = e
            .request("script.status", json!({"script_id": id}))
            .unwrap();
        s["progress"]["message"] == "one down"
    });
    let s = e
        .request("script.status", json!({"script_id": id}))
        .unwrap();
    assert_eq!(
        (
            s["state"].as_str(),
            s["calls"].as_u64(),
            s["failures"].as_u64()
        ),
        (Some("running"), Some(1), Some(0))
    );
    assert_eq!(
        s["progress"],
        json!({"done": 1, "total": 3, "message": "one down"})
    );
    // Elapsed since the start: not more than this test has waited since asking.
    let elapsed = s["elapsed_ms"].as_u64().unwrap();
    assert!(
        elapsed > 0 && elapsed <= t0.elapsed().as_millis() as u64,
        "elapsed_ms {elapsed} > {} ms since the start request",
        t0.elapsed().as_millis()
    );
    let w = e
        .request("script.wait", json!({"script_id": id, "timeout_s": 0.2}))
        .unwrap_err();
    assert_eq!(code_reason(&w), (-32017, "still_running".into()));
    let c = e
        .request("script.cancel", json!({"script_id": id}))
        .unwrap();
    assert_eq!(c, json!({"script_id": id, "state": "cancelled"}));
    let r = e.wait(&id);
    assert_eq!(r["status"], "cancelled");
    assert_eq!(r["error"], "cancelled by the engine");
    let s = e
        .request("script.status", json!({"script_id": id}))
        .unwrap();
    assert_eq!(s["state"], "cancelled");
}

#[test]
fn a_loop_of_refused_calls_cannot_fill_the_disk() {
    let rig = Rig::new();
    let e = rig.engine();
    let mut snap = rig.snapshot("auto");
    snap["limits"] = json!({"max_calls": 10});
    let code = "import agent_tools\nfor i in range(3000):\n    try:\n        agent_tools.call('fleet__wipe_device', {})\n    except agent_tools.ToolError:\n        pass\n";
    let r = e.run(&rig.token(&snap), code, &[]);
    assert_eq!(r["status"], "ok", "{r}");
    assert_eq!(r["calls"], 3000, "every call is counted");
    let log = std::fs::read_to_string(
        rig.details(r["script_id"].as_str().unwrap())
            .join("calls.jsonl"),
    )
    .unwrap();
    assert_eq!(
        log.lines().count(),
        10 + 1000 + 1,
        "max_calls + 1000 lines, then one line saying so"
    );
    assert!(log
        .lines()
        .last()
        .unwrap()
        .contains("calls.jsonl is full (1010 lines)"));
    assert!(e.calls_seen().is_empty());
}
