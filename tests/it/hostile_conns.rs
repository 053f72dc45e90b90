//! Hostile peers of the socket itself (the security issue's items 1 and 2):
//! peers that may not run scripts (a uid in no group, an admin-only member) and
//! one engine that hogs connections must cost nothing that the engines need.
//!
//! Other uids are real python3 processes started with another uid and gid, as
//! in tests/it/users.rs: engines are in `games` (gid 60), administrators in `list`
//! (gid 38), matched by the peer's primary gid; the uids have no user entry.
//! The connect/close attackers run at nice 19: the point is what the *daemon*
//! spends on them, not how much of the two CPUs four busy loops take from the
//! measuring engine.

use crate::common::*;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;
/// What an attack may add to the daemon's peak resident set (as tests/it/hostile.rs).
const ATTACK_RSS_BOUND: u64 = 64 * MIB;
const GAMES: u32 = 60;
const LIST: u32 = 38;
/// A uid and gid in no group of the config.
const STRANGER: u32 = 40100;
/// An engine uid other than root (primary gid `games`).
const OTHER_ENGINE: u32 = 40101;
/// An admin-only uid (primary gid `list`).
const ADMIN: u32 = 40102;

/// A rig whose engines are root and `games`, administrators `list`.
fn rig(extra: &str) -> Rig {
    require_root("peers of other uids");
    assert_eq!((gid_of("games"), gid_of("list")), (GAMES, LIST));
    let mut rig = Rig::with_config(extra);
    rig.stop(nix::sys::signal::Signal::SIGKILL);
    let text = std::fs::read_to_string(&rig.config).unwrap().replacen(
        "[auth]\n",
        "[auth]\nallowed_groups = [\"games\"]\nadmin_groups = [\"list\"]\n",
        1,
    );
    std::fs::write(&rig.config, text).unwrap();
    let _ = std::fs::remove_file(&rig.socket);
    rig.start();
    rig
}

fn daemon_pid(rig: &Rig) -> u32 {
    rig.daemon.as_ref().expect("daemon running").id()
}

/// python3 running `code` as `uid`:`gid` with the socket as argv[1].
fn python_as(uid: u32, gid: u32, nice: bool, code: &str, rig: &Rig, args: &[&str]) -> Child {
    let mut cmd = if nice {
        let mut c = Command::new("nice");
        c.args(["-n", "19", "python3"]);
        c
    } else {
        Command::new("python3")
    };
    cmd.args(["-c", code])
        .arg(&rig.socket)
        .args(args)
        .uid(uid)
        .gid(gid)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    cmd.spawn().unwrap()
}

/// The first line of a child's stdout.
fn first_line(c: &mut Child) -> String {
    let mut line = String::new();
    BufReader::new(c.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    line
}

/// One daemon.info on a new connection as `uid`:`gid`: the first line answered.
const ONE_INFO: &str = r#"
import json, socket, sys
s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])
try:
    try:
        s.sendall(b'{"jsonrpc":"2.0","id":1,"method":"daemon.info"}\n')
    except OSError:
        pass  # refused at once: the error line is there to read
except OSError:
    pass  # refused at once: the error line is there to read
print(s.makefile('rb').readline().decode().strip(), flush=True)
"#;

fn info_as(rig: &Rig, uid: u32, gid: u32) -> Value {
    let mut c = python_as(uid, gid, false, ONE_INFO, rig, &[]);
    let line = first_line(&mut c);
    c.wait().unwrap();
    serde_json::from_str(&line).unwrap_or_else(|_| json!({ "line": line }))
}

/// A new root connection's answer to daemon.info, and the connection.
fn root_info(rig: &Rig) -> (Value, UnixStream) {
    let s = UnixStream::connect(&rig.socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let _ = (&s).write_all(b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"daemon.info\"}\n");
    let mut line = String::new();
    BufReader::new(&s).read_line(&mut line).unwrap();
    (serde_json::from_str(&line).unwrap(), s)
}

fn log_lines(rig: &Rig) -> usize {
    rig.log_text().lines().count()
}

fn assert_bounded(rig: &Rig, before: u64, what: &str) -> u64 {
    let after = peak_rss(daemon_pid(rig));
    let grew = after.saturating_sub(before);
    eprintln!(
        "{what}: daemon peak RSS {:.1} MiB -> {:.1} MiB (+{:.1} MiB)",
        before as f64 / MIB as f64,
        after as f64 / MIB as f64,
        grew as f64 / MIB as f64
    );
    assert!(
        grew < ATTACK_RSS_BOUND,
        "{what}: the daemon's peak RSS grew by {} MiB",
        grew / MIB
    );
    grew
}

fn warm_peak(rig: &Rig) -> u64 {
    let e = rig.engine();
    let r = e.run(&rig.token(&rig.snapshot("auto")), "print('warm')", &[]);
    assert_eq!(r["status"], "ok", "{r}");
    peak_rss(daemon_pid(rig))
}

/// The daemon's CPU time so far (utime + stime), in clock ticks.
fn cpu_ticks(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let rest = &s[s.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

/// Wait until the daemon has done what it will with what it was sent: less
/// than a tick of CPU over a quarter of a second.
fn quiescent(pid: u32) {
    let mut last = cpu_ticks(pid);
    let mut still = 0;
    eventually("the daemon to go quiet", Duration::from_secs(120), || {
        let now = cpu_ticks(pid);
        still = if now <= last + 1 { still + 1 } else { 0 };
        last = now;
        still >= 10
    });
}

// ---- item 1: anyone can lock the engines out ------------------------------------

/// Connect and close in a loop until stdin closes; prints how many.
const CONNECT_LOOP: &str = r#"
import socket, sys, threading
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
print("go", flush=True)
n = 0
while not stop.is_set():
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(sys.argv[1])
    except OSError:
        pass
    s.close()
    n += 1
print(n, flush=True)
"#;

/// daemon.info round trips on `e` for `d`.
fn round_trips(e: &Engine, d: Duration) -> u64 {
    let t0 = Instant::now();
    let mut n = 0;
    while t0.elapsed() < d {
        let m = e.request_msg("daemon.info", json!(null), Duration::from_secs(30));
        assert!(m.get("result").is_some(), "{m}");
        n += 1;
    }
    n
}

fn signal_all(pids: &[u32], sig: nix::sys::signal::Signal) {
    for &p in pids {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(p as i32), sig).unwrap();
    }
}

#[test]
#[ignore = "needs root (peers of other uids)"]
fn strangers_looping_on_connect_do_not_lock_the_engines_out() {
    // It measures the daemon under load (latency, throughput, peak RSS): alone.
    alone();
    let rig = rig("");
    let engine = rig.engine();
    let log_before = log_lines(&rig);
    let mut attackers: Vec<Child> = (0..4)
        .map(|_| python_as(STRANGER, STRANGER, true, CONNECT_LOOP, &rig, &[]))
        .collect();
    for a in &mut attackers {
        assert_eq!(first_line(a).trim(), "go");
    }
    let pids: Vec<u32> = attackers.iter().map(Child::id).collect();
    // Windows with the attackers stopped and running, interleaved, so that the
    // other load of the machine weighs on both alike; the median of the pairs'
    // ratios is not moved by a burst of that load in a few of them.
    let window = Duration::from_millis(250);
    let (mut quiet, mut attacked) = (0u64, 0u64);
    let mut ratios = vec![];
    let (mut served, mut tried) = (0, 0);
    let mut connects = vec![];
    for _ in 0..20 {
        signal_all(&pids, nix::sys::signal::Signal::SIGSTOP);
        let q = round_trips(&engine, window);
        signal_all(&pids, nix::sys::signal::Signal::SIGCONT);
        let a = round_trips(&engine, window);
        (quiet, attacked) = (quiet + q, attacked + a);
        ratios.push(a as f64 / q as f64);
        // New engine connections while the attack goes on.
        for _ in 0..5 {
            tried += 1;
            let t = Instant::now();
            if root_info(&rig).0.get("result").is_some() {
                served += 1;
            }
            connects.push(t.elapsed());
        }
    }
    let mut made = 0u64;
    for mut a in attackers {
        drop(a.stdin.take());
        made += first_line(&mut a).trim().parse::<u64>().unwrap_or(0);
        a.wait().unwrap();
    }
    ratios.sort_by(f64::total_cmp);
    let ratio = (ratios[9] + ratios[10]) / 2.0;
    connects.sort();
    let (median, p90, slowest) = (
        connects[connects.len() / 2],
        connects[connects.len() * 9 / 10],
        connects[connects.len() - 1],
    );
    let logged = log_lines(&rig) - log_before;
    eprintln!(
        "connect loop: {made} hostile connects; engine connects served {served}/{tried} \
         (connect + daemon.info: median {median:?}, p90 {p90:?}, slowest {slowest:?}); \
         round trips {quiet} quiet vs {attacked} attacked (overall {:.3}, median of 20 \
         window pairs {ratio:.3}); {logged} log lines",
        attacked as f64 / quiet as f64
    );
    assert!(made > 1000, "the attack hardly ran: {made} connects");
    // The gate drains a short backlog at full speed: an engine's connect does
    // not wait behind the attacker's (median 1.9 ms measured; 135 ms with a
    // backlog of 1024, and a gate that paused past 10,000 refusals a second
    // kept it full: 0.44 s at worst).
    // The bound is loose (a shared CI machine): 50x what was measured.
    assert!(
        median < Duration::from_millis(100),
        "an engine's connect took {median:?} (median) while strangers looped on connect"
    );
    assert!(
        served * 10 >= tried * 9,
        "engine connects served {served} of {tried}"
    );
    // The goal, >= 0.9, is a benchmark figure (docs/BENCHMARKS.md, "Under
    // attack"; this test prints it): on a shared 2-core machine it measured
    // 0.91-1.02, so a bound there would flake. This bound is the one that fails
    // on the daemon before the gate thread (0.057) with room to spare.
    assert!(
        ratio >= 0.5,
        "throughput fell to {ratio:.3} of its quiet value (goal: 0.9)"
    );
    assert!(
        logged <= 100,
        "{logged} log lines for {made} refused connections"
    );
}

#[test]
#[ignore = "needs root (peers of other uids)"]
fn an_engine_holding_its_share_of_connections_locks_no_other_engine_out() {
    // It measures the daemon under load (latency, throughput, peak RSS): alone.
    alone();
    let rig = rig("");
    // Root opens 300 connections and keeps those served.
    let mut held = vec![];
    let mut refusal = None;
    for _ in 0..300 {
        let (m, s) = root_info(&rig);
        if m.get("result").is_some() {
            held.push(s);
        } else {
            refusal.get_or_insert(m);
        }
    }
    let refusal = refusal.expect("root was never refused");
    eprintln!("root holds {} connections; then: {refusal}", held.len());
    assert_eq!(held.len(), 64, "server.max_connections_per_uid = 64");
    assert_eq!(
        code_reason(&refusal["error"]),
        (-32015, "too_many_connections".into())
    );
    assert!(
        refusal["error"]["message"]
            .as_str()
            .unwrap()
            .contains("server.max_connections_per_uid = 64"),
        "{refusal}"
    );
    // Another engine uid is served meanwhile.
    let m = info_as(&rig, OTHER_ENGINE, GAMES);
    assert!(m.get("result").is_some(), "{m}");
    // Once root closes one, root is served again.
    drop(held.pop());
    eventually("root served again", Duration::from_secs(20), || {
        root_info(&rig).0.get("result").is_some()
    });
}

// ---- item 2: an admin-only member can hold or bloat the daemon --------------------

/// Open argv[2] connections, each asking daemon.info; keep the served ones
/// until stdin closes. Prints `served refused` and the first refusal.
const ADMIN_HOLD: &str = r#"
import json, socket, sys
held, refused, first = [], 0, None
for i in range(int(sys.argv[2])):
    s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])
    try:
        s.sendall(b'{"jsonrpc":"2.0","id":1,"method":"daemon.info"}\n')
    except OSError:
        pass  # refused at once: the error line is there to read
    m = json.loads(s.makefile('rb').readline())
    if 'result' in m:
        held.append(s)
    else:
        refused += 1; first = first or m; s.close()
print(len(held), refused, json.dumps(first), flush=True)
sys.stdin.read()
"#;

#[test]
#[ignore = "needs root (peers of other uids)"]
fn an_admin_only_member_cannot_hold_the_engines_connections() {
    // It measures the daemon under load (latency, throughput, peak RSS): alone.
    alone();
    let rig = rig("");
    let mut admin = python_as(ADMIN, LIST, false, ADMIN_HOLD, &rig, &["300"]);
    let line = first_line(&mut admin);
    let mut f = line.trim().splitn(3, ' ');
    let served: usize = f.next().unwrap().parse().unwrap();
    let refused: usize = f.next().unwrap().parse().unwrap();
    let first: Value = serde_json::from_str(f.next().unwrap()).unwrap();
    eprintln!("admin-only member: {served} served, {refused} refused: {first}");
    assert_eq!((served, refused), (16, 284));
    assert_eq!(
        code_reason(&first["error"]),
        (-32015, "too_many_connections".into())
    );
    assert!(
        first["error"]["message"]
            .as_str()
            .unwrap()
            .contains("server.max_admin_connections = 16"),
        "{first}"
    );
    // The engines are served meanwhile, root and another uid.
    assert!(root_info(&rig).0.get("result").is_some());
    let m = info_as(&rig, OTHER_ENGINE, GAMES);
    assert!(m.get("result").is_some(), "{m}");
    drop(admin.stdin.take());
    admin.wait().unwrap();
}

/// Open argv[2] connections; on each served one, send argv[3] admin.list
/// requests and never read. Prints how many connections were served once every
/// request is written (or the daemon stopped reading), then waits for stdin.
const ADMIN_FLOOD: &str = r#"
import json, socket, sys
conns, n = int(sys.argv[2]), int(sys.argv[3])
batch = b''.join(b'{"jsonrpc":"2.0","id":%d,"method":"admin.list"}\n' % i for i in range(2, n + 2))
held = []
for i in range(conns):
    s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])
    try:
        s.sendall(b'{"jsonrpc":"2.0","id":1,"method":"daemon.info"}\n')
    except OSError:
        pass  # refused at once: the error line is there to read
    if b'"result"' not in s.makefile('rb').readline():
        s.close(); continue
    s.settimeout(0.2)
    try:
        s.sendall(batch)
    except OSError:
        pass
    held.append(s)
print(len(held), flush=True)
sys.stdin.read()
"#;

#[test]
#[ignore = "needs root (peers of other uids)"]
fn unread_admin_answers_are_bounded_in_memory() {
    // It measures the daemon under load (latency, throughput, peak RSS): alone.
    alone();
    // Room for all 240 connections: the bound on unread answers alone must hold.
    let rig = rig("[server]\nmax_admin_connections = 240\nmax_connections_per_uid = 240\n");
    let before = warm_peak(&rig);
    // 20 scripts running: each admin.list answer lists them all.
    let e = std::sync::Arc::new(rig.engine());
    let token = rig.token(&rig.snapshot("auto"));
    let ids: Vec<String> = (0..20)
        .map(|_| {
            e.start(&token, "import time\ntime.sleep(600)", &[])
                .unwrap()
        })
        .collect();
    let list = e.request("admin.list", json!({})).unwrap();
    assert_eq!(list["scripts"].as_array().unwrap().len(), 20);
    let answer_bytes = list.to_string().len();
    let mut admin = python_as(ADMIN, LIST, false, ADMIN_FLOOD, &rig, &["240", "1024"]);
    let served: usize = first_line(&mut admin).trim().parse().unwrap();
    assert_eq!(served, 240);
    quiescent(daemon_pid(&rig));
    // An engine's request is answered at once meanwhile.
    let t0 = Instant::now();
    assert!(root_info(&rig).0.get("result").is_some());
    let latency = t0.elapsed();
    eprintln!(
        "admin flood: {served} connections x 1024 admin.list of {answer_bytes} bytes unread; \
         engine daemon.info answered in {latency:?}"
    );
    let grew = assert_bounded(&rig, before, "unread admin.list answers");
    let _ = grew;
    assert!(latency < Duration::from_secs(2), "{latency:?}");
    drop(admin.stdin.take());
    admin.wait().unwrap();
    for id in ids {
        let _ = e.request("script.cancel", json!({ "script_id": id }));
    }
}

/// argv[2] connections, each sending argv[3] bytes with no newline (a thread
/// each); prints `started` once the daemon has stopped reading each (a send
/// blocked for a second) or closed it.
const ADMIN_PARTIAL: &str = r#"
import socket, sys, threading
conns, size = int(sys.argv[2]), int(sys.argv[3])
started = threading.Semaphore(0)
socks = []
def send(s):
    chunk = b' ' * 65536
    s.settimeout(1.0)
    sent = 0
    try:
        while sent < size:
            s.sendall(chunk); sent += len(chunk)
    except OSError:
        pass
    started.release()
for i in range(conns):
    s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])
    socks.append(s)
    threading.Thread(target=send, args=(s,), daemon=True).start()
for i in range(conns):
    started.acquire()
print("started", flush=True)
sys.stdin.read()
"#;

#[test]
#[ignore = "needs root (peers of other uids)"]
fn admin_partial_lines_leave_the_engines_their_budget() {
    // It measures the daemon under load (latency, throughput, peak RSS): alone.
    alone();
    let rig = rig(
        "[server]\nmax_message_bytes = 8388608\nmax_buffered_bytes = 8388608\nline_timeout_s = 20\n",
    );
    let before = warm_peak(&rig);
    let e = rig.engine();
    let big = "x".repeat(300 * 1024);
    e.set_handler(std::sync::Arc::new(move |_, _| {
        Ok(json!({"text": big.clone(), "structured": null, "is_error": false}))
    }));
    let mut admin = python_as(
        ADMIN,
        LIST,
        false,
        ADMIN_PARTIAL,
        &rig,
        &["4", &(6 << 20).to_string()],
    );
    assert_eq!(first_line(&mut admin).trim(), "started");
    // The engine's 300 KiB answer needs ~236 KiB of the shared budget.
    let code = r#"
import agent_tools, time
t = time.time()
agent_tools.call("fleet__list_devices", {})
print("%.3f" % (time.time() - t))
"#;
    let t0 = Instant::now();
    let r = e.run(&rig.token(&rig.snapshot("auto")), code, &[]);
    let took = t0.elapsed();
    assert_eq!(r["status"], "ok", "{r}");
    let call_s: f64 = r["output"].as_str().unwrap().trim().parse().unwrap();
    eprintln!(
        "admin partial lines: the engine's 300 KiB answer took {call_s:.3} s (script {took:?})"
    );
    assert!(call_s < 5.0, "the engine's answer waited {call_s} s");
    assert_bounded(&rig, before, "admin partial lines");
    drop(admin.stdin.take());
    admin.wait().unwrap();
}

// ---- unread answers: reserved before they are made, not only checked ----------------

#[test]
#[ignore = "needs root (a daemon of its own)"]
fn many_waits_of_one_script_that_are_never_read_are_bounded_in_memory() {
    // It measures the daemon under load (latency, throughput, peak RSS): alone.
    alone();
    let rig = rig("");
    let before = warm_peak(&rig);
    let e = rig.engine();
    // The script prints near return_max_chars of a character JSON escapes to
    // six bytes, then calls a tool that answers only when the test says so.
    let (entered_tx, entered) = std::sync::mpsc::channel::<()>();
    let (release, release_rx) = std::sync::mpsc::channel::<()>();
    let (entered_tx, release_rx) = (
        std::sync::Mutex::new(entered_tx),
        std::sync::Mutex::new(release_rx),
    );
    e.set_handler(std::sync::Arc::new(move |_, _| {
        entered_tx.lock().unwrap().send(()).unwrap();
        release_rx.lock().unwrap().recv().unwrap();
        Ok(json!({"text": "ok", "structured": null, "is_error": false}))
    }));
    let token = rig.token(&rig.snapshot("auto"));
    let code = r#"
import agent_tools
print('\x01' * 19900)
agent_tools.call("fleet__list_devices", {})
"#;
    let id = e.start(&token, code, &[]).unwrap();
    entered
        .recv_timeout(Duration::from_secs(60))
        .expect("the script's tool call");
    // Another connection (the token grants it the script) pipelines 1023
    // script.wait with no timeout and a daemon.info (1024 requests being
    // answered, the most a connection has), reads the daemon.info's
    // answer (every wait has been taken by then), and reads nothing more.
    let s = UnixStream::connect(&rig.socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut batch = String::new();
    for i in 1..=1023 {
        let m = json!({"jsonrpc": "2.0", "id": i, "method": "script.wait",
                       "params": {"script_id": id, "token": token}});
        batch.push_str(&format!("{m}\n"));
    }
    batch.push_str("{\"jsonrpc\":\"2.0\",\"id\":\"info\",\"method\":\"daemon.info\"}\n");
    (&s).write_all(batch.as_bytes()).unwrap();
    let mut line = String::new();
    BufReader::new(&s).read_line(&mut line).unwrap();
    let m: Value = serde_json::from_str(&line).unwrap();
    assert_eq!(m["id"], "info", "{m}");
    // The script ends: 1023 answers of ~120 KB each are due at once.
    release.send(()).unwrap();
    let r = e.wait(&id);
    assert_eq!(r["status"], "ok", "{r}");
    let answer_bytes = r.to_string().len();
    quiescent(daemon_pid(&rig));
    eprintln!("1023 unread script.wait of a result of {answer_bytes} bytes in JSON");
    assert!(answer_bytes > 100_000, "{answer_bytes}");
    assert_bounded(&rig, before, "1023 unread script.wait answers");
    // The engine is served meanwhile.
    assert!(root_info(&rig).0.get("result").is_some());
    drop(s);
}
