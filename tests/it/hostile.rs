//! Hostile scripts and hostile peers, through the real daemon, socket, bwrap and
//! Python: each test is an attack an outside red team made, and asserts the safe
//! outcome (and, where memory is the point, a bound on the daemon's peak RSS).
// The test rig forks and execs children (pre_exec, prctl, rusage): each block
// says why it is sound.
#![allow(unsafe_code)]

use crate::common::*;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;
/// What an attack may add to the daemon's peak resident set.
const ATTACK_RSS_BOUND: u64 = 64 * MIB;

fn daemon_pid(rig: &Rig) -> u32 {
    rig.daemon.as_ref().expect("daemon running").id()
}

/// The daemon's peak RSS after one ordinary script, so that the attack's
/// growth is measured against a daemon that has already run something.
fn warm_peak(rig: &Rig) -> u64 {
    let e = rig.engine();
    let r = e.run(&rig.token(&rig.snapshot("auto")), "print('warm')", &[]);
    assert_eq!(r["status"], "ok", "{r}");
    peak_rss(daemon_pid(rig))
}

fn assert_bounded(rig: &Rig, before: u64, what: &str) {
    let after = peak_rss(daemon_pid(rig));
    eprintln!(
        "{what}: daemon peak RSS {:.1} MiB -> {:.1} MiB",
        before as f64 / MIB as f64,
        after as f64 / MIB as f64
    );
    assert!(
        after.saturating_sub(before) < ATTACK_RSS_BOUND,
        "{what}: the daemon's peak RSS grew by {} MiB (from {} to {} MiB)",
        (after - before) / MIB,
        before / MIB,
        after / MIB
    );
}

fn lines(path: &std::path::Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

// ---- broker abuse ---------------------------------------------------------------

#[test]
fn a_script_that_never_reads_its_replies_stalls_only_itself() {
    let rig = Rig::new();
    let before = warm_peak(&rig);
    // 8 MiB of 2-byte garbage lines on fd 3, each worth an error reply, while fd 4
    // is never read. Once fd 3 stays unwritable for 2 s, the daemon has stopped
    // reading it: the script says how far it got and exits.
    let code = r#"
import os, select
os.set_blocking(3, False)
chunk = b"x\n" * 32768
total, blocked = 0, False
while total < 8 << 20:
    try:
        total += os.write(3, chunk)
    except BlockingIOError:
        if not select.select([], [3], [], 2.0)[1]:
            blocked = True
            break
print("written", total, "blocked", blocked, flush=True)
"#;
    let e = rig.engine();
    let r = e.run(&rig.token(&rig.snapshot("auto")), code, &[]);
    assert_eq!(r["status"], "ok", "{r}");
    let out = r["output"].as_str().unwrap();
    assert!(
        out.contains("blocked True"),
        "the daemon kept reading fd 3 while 4M replies queued: {out}"
    );
    assert_bounded(&rig, before, "unread replies");
    // And the daemon serves the next script as before.
    let r = e.run(&rig.token(&rig.snapshot("auto")), "print('next')", &[]);
    assert_eq!(r["output"], "next\n");
}

#[test]
fn refusals_quote_little_of_what_the_script_sent() {
    let rig = Rig::new();
    let before = warm_peak(&rig);
    let code = r#"
import agent_tools
from agent_tools import ToolError
chan = agent_tools._channel()
name = "A" * 100_000
try:
    agent_tools.call(name, {})
except ToolError as e:
    print("call", e.code, len(e.message))
errs = agent_tools.call_many(name, [{}] * 50, return_errors=True)
print("many", len(errs), max(len(x.message) for x in errs))
# More than 50 items in one request: refused as a whole.
r = chan.request({"op": "call_many", "tool": "fleet__get_device_status", "args_list": [{"sn": "x"}] * 51})
print("51", r["error"]["code"])
# 20,000 items under a 40 KB name: one refusal, not 20,000 copies of the name.
r = chan.request({"op": "call_many", "tool": "B" * 40_000, "args_list": [{}] * 20_000})
print("flood", r["error"]["code"], len(r["error"]["message"]))
"#;
    let e = rig.engine();
    let r = e.run(&rig.token(&rig.snapshot("auto")), code, &[]);
    assert_eq!(r["status"], "ok", "{r}");
    let out: Vec<Vec<&str>> = r["output"]
        .as_str()
        .unwrap()
        .lines()
        .map(|l| l.split(' ').collect())
        .collect();
    let num = |s: &str| s.parse::<usize>().unwrap();
    assert_eq!(out[0][..2], ["call", "denied"]);
    assert!(
        num(out[0][2]) <= 1100,
        "refusal message of {} bytes",
        out[0][2]
    );
    assert_eq!(out[1][..2], ["many", "50"]);
    assert!(
        num(out[1][2]) <= 1100,
        "item message of {} bytes",
        out[1][2]
    );
    assert_eq!(out[2], ["51", "invalid_arguments"]);
    assert_eq!(out[3][..2], ["flood", "invalid_arguments"]);
    assert!(num(out[3][2]) <= 1100);
    assert!(e.calls_seen().is_empty(), "nothing reached the engine");
    assert_bounded(&rig, before, "refusal amplification");
}

/// A script that sends calls and exits before their answers come back.
const CALL_AND_EXIT: &str = r#"
import os
w = os.fdopen(3, "w", closefd=False)
for i in range(4):
    w.write('{"id": %d, "op": "call", "tool": "fleet__get_device_status", "args": {"sn": "SN%d"}}\n' % (i, i + 1))
w.flush()
os._exit(0)
"#;

#[test]
fn calls_that_reached_the_engine_are_recorded_when_the_script_exits_first() {
    let rig = Rig::new();
    let e = rig.engine();
    e.call_delay_ms
        .store(300, std::sync::atomic::Ordering::Relaxed);
    let r = e.run(&rig.token(&rig.snapshot("auto")), CALL_AND_EXIT, &[]);
    assert_eq!(r["status"], "ok", "{r}");
    assert_eq!(e.calls_seen().len(), 4, "every call reached the engine");
    assert_eq!(r["calls"], 4, "{r}");
    let sid = r["script_id"].as_str().unwrap();
    let log = lines(&rig.details(sid).join("calls.jsonl"));
    assert_eq!(log.len(), 4);
    for l in &log {
        assert_eq!(l["is_error"], false, "{l}");
        assert!(l["summary"].as_str().unwrap().contains("online"), "{l}");
    }
    let row: i64 = rusqlite::Connection::open(rig.state.join("scriptgate.db"))
        .unwrap()
        .query_row(
            "SELECT calls FROM scripts WHERE script_id = ?1",
            [sid],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(row, 4, "the audit row counts them too");
}

#[test]
fn calls_the_engine_never_answers_are_still_logged_after_the_script_ends() {
    let rig = Rig::new();
    let e = rig.engine();
    // Longer than the broker's grace after the script's end.
    e.call_delay_ms
        .store(20_000, std::sync::atomic::Ordering::Relaxed);
    let r = e.run(&rig.token(&rig.snapshot("auto")), CALL_AND_EXIT, &[]);
    assert_eq!(e.calls_seen().len(), 4);
    assert_eq!(r["calls"], 4, "{r}");
    let log = lines(
        &rig.details(r["script_id"].as_str().unwrap())
            .join("calls.jsonl"),
    );
    assert_eq!(log.len(), 4);
    for l in &log {
        assert_eq!(l["is_error"], Value::Null, "unknown, not a failure: {l}");
        assert!(
            l["summary"].as_str().unwrap().starts_with("no answer"),
            "{l}"
        );
    }
}

#[test]
fn calls_jsonl_is_bounded_in_bytes() {
    let rig = Rig::new();
    let before = warm_peak(&rig);
    let code = r#"
import agent_tools
big = "A" * 1_000_000
for i in range(50):
    try:
        agent_tools.call("fleet__nope", {"x": big})
    except agent_tools.ToolError:
        pass
print(agent_tools.call("fleet__get_device_status", {"sn": "SN" + "1" * 100_000})["online"])
"#;
    let e = rig.engine();
    let r = e.run(&rig.token(&rig.snapshot("auto")), code, &[]);
    assert_eq!(r["status"], "ok", "{r}");
    assert_eq!(r["calls"], 51);
    let path = rig
        .details(r["script_id"].as_str().unwrap())
        .join("calls.jsonl");
    let size = std::fs::metadata(&path).unwrap().len();
    assert!(
        size < 51 * 6 * 1024,
        "50 MB of arguments made a {size}-byte log"
    );
    let log = lines(&path);
    assert_eq!(log.len(), 51);
    assert!(log[0]["arguments_bytes"].as_u64().unwrap() > 1_000_000);
    assert!(log[50]["arguments_bytes"].as_u64().unwrap() > 100_000);
    // The engine got the whole argument: only the log is cut.
    assert_eq!(e.calls_seen()[0].1["sn"].as_str().unwrap().len(), 100_002);
    assert_bounded(&rig, before, "50 refused calls of 1 MB");
}

#[test]
fn tool_counts_do_not_grow_with_invented_names() {
    let rig = Rig::new();
    let code = r#"
import agent_tools
for i in range(3000):
    try:
        agent_tools.call("fleet__made_up_%d" % i, {})
    except agent_tools.ToolError:
        pass
agent_tools.call("fleet__get_device_status", {"sn": "SN1"})
"#;
    let e = rig.engine();
    let r = e.run(&rig.token(&rig.snapshot("auto")), code, &[]);
    assert_eq!(r["status"], "ok", "{r}");
    let counts: String = rusqlite::Connection::open(rig.state.join("scriptgate.db"))
        .unwrap()
        .query_row(
            "SELECT tool_counts FROM scripts WHERE script_id = ?1",
            [r["script_id"].as_str().unwrap()],
            |r| r.get(0),
        )
        .unwrap();
    let counts: Value = serde_json::from_str(&counts).unwrap();
    assert_eq!(
        counts,
        json!({"(not in the snapshot)": 3000, "fleet__get_device_status": 1})
    );
}

// ---- protocol abuse and resource exhaustion ----------------------------------------

/// Set the daemon's descriptor limit (soft and hard) before it starts.
fn nofile(cmd: &mut std::process::Command, n: u64) {
    use std::os::unix::process::CommandExt;
    // SAFETY: setrlimit is async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            let r = libc::rlimit {
                rlim_cur: n,
                rlim_max: n,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &r) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// A connection to `socket` if the listener takes it now (EAGAIN: its backlog
/// is full), without waiting.
fn connect_now(socket: &std::path::Path) -> Option<UnixStream> {
    use nix::sys::socket::{
        connect, socket as new_socket, AddressFamily, SockFlag, SockType, UnixAddr,
    };
    let fd = new_socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
        None,
    )
    .ok()?;
    connect(
        std::os::fd::AsRawFd::as_raw_fd(&fd),
        &UnixAddr::new(socket).ok()?,
    )
    .ok()?;
    Some(UnixStream::from(fd))
}

#[test]
fn running_out_of_descriptors_does_not_stop_the_daemon() {
    // No pre-made sandboxes (SCRIPTGATE_TEST_POOL): each holds seven of the
    // daemon's descriptors, and the test's arithmetic is the daemon's own 64.
    let mut rig = Rig::with_config("[sandbox]\npool_size = 0\n");
    rig.stop(nix::sys::signal::Signal::SIGKILL);
    rig.start_with(|c| nofile(c, 64));
    // More connections than descriptors: accept fails with EMFILE. Connected
    // without blocking: once the listen backlog is full too (sooner when
    // pre-made sandboxes hold some of the daemon's 64), a blocking connect would
    // wait for ever.
    let hogs: Vec<UnixStream> = (0..100).filter_map(|_| connect_now(&rig.socket)).collect();
    eventually(
        "an accept error in the log",
        Duration::from_secs(20),
        || rig.log_text().contains("accept failed"),
    );
    drop(hogs);
    let pid = daemon_pid(&rig);
    assert!(
        rig.daemon.as_mut().unwrap().try_wait().unwrap().is_none(),
        "the daemon exited on EMFILE: {}",
        rig.log_text()
    );
    // Once descriptors are free again, engines are served as before.
    let r = rig
        .engine()
        .run(&rig.token(&rig.snapshot("auto")), "print(42)", &[]);
    assert_eq!(r["output"], "42\n", "{r}");
    assert_eq!(daemon_pid(&rig), pid);
}

#[test]
fn connections_over_max_connections_get_a_clear_refusal() {
    let rig = Rig::with_config("[server]\nmax_connections = 3\n");
    // The first line a new connection gets in answer to daemon.info, and the
    // connection.
    let first_line = || {
        let s = UnixStream::connect(&rig.socket).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let _ = (&s).write_all(b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"daemon.info\"}\n");
        let mut line = String::new();
        BufReader::new(&s).read_line(&mut line).unwrap();
        (serde_json::from_str::<Value>(&line).unwrap(), s)
    };
    // Three served connections (the rig's readiness probe may still count for a
    // moment: a refused one is retried).
    let mut held = vec![];
    for attempt in 0.. {
        assert!(attempt < 1000, "three connections were never served");
        if held.len() == 3 {
            break;
        }
        let (msg, s) = first_line();
        if msg.get("result").is_some() {
            held.push(s);
        }
    }
    let (msg, _) = first_line();
    assert_eq!(
        code_reason(&msg["error"]),
        (-32015, "too_many_connections".to_string()),
        "{msg}"
    );
    assert!(msg["error"]["message"]
        .as_str()
        .unwrap()
        .contains("max_connections = 3"));
    // One engine leaves; a new one is served.
    drop(held.pop());
    eventually("a free connection", Duration::from_secs(20), || {
        first_line().0.get("result").is_some()
    });
}

#[test]
fn partial_lines_are_bounded_in_memory_and_time() {
    let rig = Rig::with_config(
        "[server]\nmax_message_bytes = 8388608\nmax_buffered_bytes = 8388608\nline_timeout_s = 3\n",
    );
    let before = warm_peak(&rig);
    // 40 connections, each sending 6 MiB with no newline.
    let attackers: Vec<_> = (0..40)
        .map(|_| {
            let s = UnixStream::connect(&rig.socket).unwrap();
            let mut w = s.try_clone().unwrap();
            let writer = std::thread::spawn(move || {
                let chunk = vec![b' '; 64 * 1024];
                for _ in 0..96 {
                    if w.write_all(&chunk).is_err() {
                        break;
                    }
                }
            });
            (s, writer)
        })
        .collect();
    // Meanwhile an honest engine is served: its lines need no share of the budget.
    let r = rig
        .engine()
        .run(&rig.token(&rig.snapshot("auto")), "print('served')", &[]);
    assert_eq!(r["output"], "served\n", "{r}");
    // Each unfinished line is cut off after line_timeout_s with a clear error.
    for (s, writer) in attackers {
        s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
        let mut first = String::new();
        BufReader::new(&s)
            .read_line(&mut first)
            .expect("the daemon closes a connection whose line never ends");
        let msg: Value = serde_json::from_str(&first).unwrap();
        assert_eq!(msg["error"]["code"], -32600, "{msg}");
        assert!(
            msg["error"]["message"]
                .as_str()
                .unwrap()
                .contains("line_timeout_s"),
            "{msg}"
        );
        drop(s);
        writer.join().unwrap();
    }
    assert_bounded(&rig, before, "40 partial lines of 6 MiB");
}

#[test]
fn starts_waiting_for_approval_hold_no_running_slot() {
    let rig = Rig::with_config("[server]\nmax_running = 4\n");
    let a = std::sync::Arc::new(rig.engine());
    *a.approval.lock().unwrap() = "silent".into();
    let token = rig.token(&rig.snapshot("approval"));
    // Engine A asks for four approved starts and never answers any approval.
    let starts: Vec<_> = (0..4)
        .map(|_| {
            let (a, token) = (a.clone(), token.clone());
            std::thread::spawn(move || a.start(&token, "print(1)", &["fleet__reboot_device"]))
        })
        .collect();
    eventually("A's approval request", Duration::from_secs(30), || {
        !a.seen.lock().unwrap().approvals.is_empty()
    });
    // Engine B is served at once, although A waits on four starts.
    let b = rig.engine();
    let r = b.run(&rig.token(&rig.snapshot("auto")), "print('b')", &[]);
    assert_eq!(r["output"], "b\n", "{r}");
    // A has one start waiting (max_running / 4 per connection); the others were
    // refused at once, saying why.
    let mut refused = 0;
    let mut waiting = vec![];
    for t in starts {
        if t.is_finished() {
            let e = t.join().unwrap().unwrap_err();
            assert_eq!(code_reason(&e), (-32015, "approvals_pending".into()), "{e}");
            refused += 1;
        } else {
            waiting.push(t);
        }
    }
    assert_eq!((refused, waiting.len()), (3, 1));
    assert_eq!(a.seen.lock().unwrap().approvals.len(), 1);
}

#[test]
fn a_flood_of_refused_starts_is_counted_not_recorded_one_by_one() {
    let mut rig = Rig::new();
    let forged = format!(
        "{}x",
        rig.token(&rig.snapshot("auto"))
            .trim_end_matches(char::is_alphanumeric)
    );
    let e = rig.engine();
    let n = 2000;
    let t0 = Instant::now();
    let mut batch = String::new();
    for i in 0..n {
        batch.push_str(
            &json!({"jsonrpc": "2.0", "id": 100_000 + i, "method": "script.start",
                "params": {"token": forged, "code": "print(1)", "tools": [], "description": ""}})
            .to_string(),
        );
        batch.push('\n');
    }
    e.send_raw(batch.as_bytes());
    eventually("every refusal answered", Duration::from_secs(60), || {
        e.raw_lines
            .lock()
            .unwrap()
            .iter()
            .filter(|m| m.get("error").is_some())
            .count()
            >= n
    });
    let elapsed = t0.elapsed().as_secs_f64();
    // On the way out the daemon writes the summary of what it only counted.
    rig.stop(nix::sys::signal::Signal::SIGTERM);
    let db = rusqlite::Connection::open(rig.state.join("scriptgate.db")).unwrap();
    let single: i64 = db
        .query_row(
            "SELECT count(*) FROM refusals WHERE reason = 'signature'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    let bound = scriptgate::daemon::ratelimit::STARTS.burst
        + scriptgate::daemon::ratelimit::STARTS.per_s * (elapsed + 1.0);
    assert!(
        (single as f64) <= bound,
        "{single} refusals recorded one by one in {elapsed:.1} s"
    );
    let mut stmt = db
        .prepare("SELECT message FROM refusals WHERE reason = 'rate_limited'")
        .unwrap();
    let counted: i64 = stmt
        .query_map([], |r| r.get::<_, String>(0))
        .unwrap()
        .map(|m| {
            let m = m.unwrap();
            assert!(m.contains("signature ×"), "{m}");
            m.split(' ').next().unwrap().parse::<i64>().unwrap()
        })
        .sum();
    assert_eq!(single + counted, n as i64, "every refusal is accounted for");
}

// ---- escapes: the workspace is what was checked ---------------------------------------

#[test]
fn a_workspace_swapped_for_a_symlink_during_approval_is_not_followed() {
    let rig = Rig::new();
    let inner = rig.workspace.join("inner");
    std::fs::create_dir(&inner).unwrap();
    chown_to_script_uid(&inner);
    let outside = rig.dir.path().join("outside");
    std::fs::create_dir(&outside).unwrap();
    let mut snap = rig.snapshot("approval");
    snap["workspace"] = json!(inner);
    let token = rig.token(&snap);
    let e = std::sync::Arc::new(rig.engine());
    *e.approval.lock().unwrap() = "silent".into();
    let starter = {
        let (e, token) = (e.clone(), token.clone());
        std::thread::spawn(move || {
            let code = "import os\nopen('marker.txt', 'w').write('x')\nprint(os.getcwd())";
            let id = e.start(&token, code, &["fleet__reboot_device"]).unwrap();
            e.wait(&id)
        })
    };
    eventually("the approval request", Duration::from_secs(30), || {
        !e.seen.lock().unwrap().approvals.is_empty()
    });
    // While the daemon waits for approval, the workspace becomes a symlink out.
    let moved = rig.workspace.join("inner.moved");
    std::fs::rename(&inner, &moved).unwrap();
    std::os::unix::fs::symlink(&outside, &inner).unwrap();
    let req_id = e
        .raw_lines
        .lock()
        .unwrap()
        .iter()
        .find(|m| m["method"] == "approval.request")
        .map(|m| m["id"].clone())
        .unwrap();
    e.send_raw(
        format!(
            "{}\n",
            json!({"jsonrpc": "2.0", "id": req_id, "result": {"decision": "allow_once"}})
        )
        .as_bytes(),
    );
    let r = starter.join().unwrap();
    assert_eq!(r["status"], "ok", "{r}");
    assert!(
        std::fs::read_dir(&outside).unwrap().next().is_none(),
        "nothing may be created outside the roots"
    );
    assert!(moved.join("marker.txt").exists());
    assert!(moved
        .join(".agent/scripts")
        .join(r["script_id"].as_str().unwrap())
        .join("script.py")
        .exists());
}

#[test]
fn workspaces_are_refused_when_they_are_a_root_a_symlink_or_climb_out() {
    let rig = Rig::new();
    let link = rig.root.join("link");
    std::os::unix::fs::symlink(&rig.workspace, &link).unwrap();
    let e = rig.engine();
    for (ws, reason) in [
        (rig.root.clone(), "is_root"),
        (link, "symlink"),
        (rig.workspace.join("../ws"), "outside_roots"),
        (rig.dir.path().to_path_buf(), "outside_roots"),
        (rig.workspace.join("missing"), "workspace_missing"),
    ] {
        let mut snap = rig.snapshot("auto");
        snap["workspace"] = json!(ws);
        let err = e.start(&rig.token(&snap), "print(1)", &[]).unwrap_err();
        assert_eq!(
            code_reason(&err),
            (-32011, reason.to_string()),
            "{}: {err}",
            ws.display()
        );
        assert_eq!(err["data"]["field"], "workspace");
    }
}

#[test]
fn a_request_of_tiny_objects_is_bounded_by_what_it_parses_to() {
    let rig = Rig::new();
    let before = warm_peak(&rig);
    // 4 MiB of `{"":0}`: within the line limit, but ~500 MB once parsed.
    let code = r#"
import agent_tools
r = agent_tools._channel().request(
    {"op": "call", "tool": "fleet__get_device_status", "args": {"sn": [{"": 0}] * 600_000}})
print(r["error"]["code"], r["error"]["message"][:29])
"#;
    let e = rig.engine();
    let r = e.run(&rig.token(&rig.snapshot("auto")), code, &[]);
    assert_eq!(
        r["output"], "invalid_request request too large once parsed\n",
        "{r}"
    );
    assert!(e.calls_seen().is_empty());
    assert_bounded(&rig, before, "a 4 MiB request of tiny objects");
}

#[test]
fn an_engine_line_of_tiny_objects_is_refused_unparsed() {
    let rig = Rig::with_config("[server]\nmax_message_bytes = 1048576\n");
    let before = warm_peak(&rig);
    let mut s = UnixStream::connect(&rig.socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let params = vec![r#"{"":0}"#; 120_000].join(",");
    let line = format!(
        "{{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"daemon.info\",\"params\":[{params}]}}\n"
    );
    assert!(line.len() < 1 << 20);
    s.write_all(line.as_bytes()).unwrap();
    let mut answer = String::new();
    BufReader::new(&s).read_line(&mut answer).unwrap();
    let msg: Value = serde_json::from_str(&answer).unwrap();
    assert_eq!(msg["error"]["code"], -32600, "{msg}");
    assert!(msg["error"]["message"]
        .as_str()
        .unwrap()
        .contains("too large once parsed"));
    assert_bounded(&rig, before, "an engine line of tiny objects");
}
