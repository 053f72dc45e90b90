//! Hostile engines against each other's runs, through the real daemon and socket:
//! finished, running and pending scripts of one engine are not another's to wait
//! on, read or cancel, whoever the two are (bound to an `[[auth.engine]]` entry,
//! unbound, root); a run id cannot spell another engine's run (revocation);
//! revocations are bounded per scope; read-only runs do not write where their
//! engine may not; retention removes only what the daemon recorded, and one
//! engine's huge tree starves no one.
//!
//! Engines of other uids are long-lived python3 clients started with that uid and
//! gid (groups every Debian host has: `games`, `irc`), driven over stdin/stdout.
use crate::common::*;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

const GAMES: u32 = 60;
const IRC: u32 = 39;
const KEY_G: &[u8] = b"engine-g-engine-g-engine-g-engine-g!";

/// A python3 engine as another uid: each stdin line is sent to the daemon; every
/// answer (an `id`, no `method`) is printed; an `approval.request` is printed as
/// `{"approval": params}` and answered `allow_once` unless argv[2] is `silent`.
const PY_ENGINE: &str = r#"
import json, socket, sys, threading
s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])
f = s.makefile('rwb')
silent = sys.argv[2] == 'silent'
lock = threading.Lock()
def send(m):
    with lock:
        f.write((json.dumps(m) + '\n').encode()); f.flush()
def reader():
    for line in f:
        m = json.loads(line)
        if m.get('method') == 'approval.request':
            print(json.dumps({'approval': m['params']}), flush=True)
            if not silent:
                send({'jsonrpc': '2.0', 'id': m['id'], 'result': {'decision': 'allow_once'}})
        elif 'method' not in m:
            print(json.dumps(m), flush=True)
    print(json.dumps({'eof': True}), flush=True)
threading.Thread(target=reader, daemon=True).start()
for line in sys.stdin:
    send(json.loads(line))
"#;

struct PyEngine {
    child: Child,
    stdin: ChildStdin,
    rx: mpsc::Receiver<Value>,
    stash: HashMap<u64, Value>,
    approvals: Vec<Value>,
    next: u64,
}

impl PyEngine {
    fn spawn(uid: u32, gid: u32, socket: &Path, approval: &str) -> PyEngine {
        let mut child = Command::new("python3")
            .args(["-c", PY_ENGINE])
            .arg(socket)
            .arg(approval)
            .uid(uid)
            .gid(gid)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let (tx, rx) = mpsc::channel();
        let out = BufReader::new(child.stdout.take().unwrap());
        std::thread::spawn(move || {
            for line in out.lines() {
                let Ok(line) = line else { break };
                if let Ok(v) = serde_json::from_str::<Value>(&line) {
                    let _ = tx.send(v);
                }
            }
        });
        PyEngine {
            stdin: child.stdin.take().unwrap(),
            child,
            rx,
            stash: HashMap::new(),
            approvals: vec![],
            next: 1,
        }
    }

    fn send(&mut self, method: &str, params: Value) -> u64 {
        let id = self.next;
        self.next += 1;
        let m = json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params});
        writeln!(self.stdin, "{m}").unwrap();
        id
    }

    fn pump(&mut self, timeout: Duration) -> bool {
        match self.rx.recv_timeout(timeout) {
            Ok(v) => {
                if let Some(a) = v.get("approval") {
                    self.approvals.push(a.clone());
                } else if let Some(id) = v.get("id").and_then(Value::as_u64) {
                    self.stash.insert(id, v);
                }
                true
            }
            Err(_) => false,
        }
    }

    fn answer(&mut self, id: u64) -> Value {
        let t0 = std::time::Instant::now();
        loop {
            if let Some(v) = self.stash.remove(&id) {
                return v;
            }
            assert!(t0.elapsed() < Duration::from_secs(60), "no answer to {id}");
            self.pump(Duration::from_millis(200));
        }
    }

    fn request(&mut self, method: &str, params: Value) -> Result<Value, Value> {
        let id = self.send(method, params);
        let m = self.answer(id);
        match m.get("error") {
            Some(e) => Err(e.clone()),
            None => Ok(m["result"].clone()),
        }
    }

    fn approval(&mut self) -> Value {
        let t0 = std::time::Instant::now();
        while self.approvals.is_empty() {
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "no approval.request"
            );
            self.pump(Duration::from_millis(200));
        }
        self.approvals.remove(0)
    }
}

impl Drop for PyEngine {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An engine of the matrix: root (this process), or a python3 client of a uid.
enum Conn {
    Root(Engine),
    Py(PyEngine),
}

impl Conn {
    fn request(&mut self, method: &str, params: Value) -> Result<Value, Value> {
        match self {
            Conn::Root(e) => e.request(method, params),
            Conn::Py(p) => p.request(method, params),
        }
    }
}

struct Who {
    name: &'static str,
    key: &'static [u8],
    ws: PathBuf,
    conn: Conn,
    /// A second connection, whose engine never answers an approval (pending).
    silent: Conn,
}

impl Who {
    fn token(&self, run_id: &str, mode: &str) -> String {
        scriptgate::protocol::token::mint(
            self.key,
            run_id,
            None,
            &fleet_snapshot(&self.ws, mode),
            600,
        )
        .unwrap()
    }
}

/// A rig with `[auth]` extended (engines in `games` and `irc`), restarted.
fn rig_with_auth(auth: &str) -> Rig {
    let mut rig = Rig::new();
    rig.stop(nix::sys::signal::Signal::SIGKILL);
    let text = std::fs::read_to_string(&rig.config).unwrap();
    let (plain, tables) = match auth.find("[[auth.engine]]") {
        Some(i) => (auth[..i].to_string(), auth[i..].to_string()),
        None => (auth.to_string(), String::new()),
    };
    let plain = format!("allowed_groups = [\"games\", \"irc\"]\n{plain}");
    let text = text.replacen("[auth]\n", &format!("[auth]\n{plain}"), 1) + "\n" + &tables;
    std::fs::write(&rig.config, text).unwrap();
    let _ = std::fs::remove_file(&rig.socket);
    rig.start();
    rig
}

fn write_key(path: &Path, key: &[u8], group: u32) {
    std::fs::write(path, key).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o640)).unwrap();
    std::os::unix::fs::chown(path, Some(0), Some(group)).unwrap();
}

/// `<root>/<uid>/ws`, the engine's own workspace (the per-uid directory is made
/// by the daemon when the engine connects).
fn own_workspace(rig: &Rig, uid: u32, gid: u32) -> PathBuf {
    let dir = rig.root.join(uid.to_string());
    eventually("the per-uid directory", Duration::from_secs(10), || {
        dir.exists()
    });
    let ws = dir.join("ws");
    std::fs::create_dir_all(&ws).unwrap();
    std::os::unix::fs::chown(&ws, Some(uid), Some(gid)).unwrap();
    ws
}

fn py(rig: &Rig, uid: u32, gid: u32, approval: &str) -> Conn {
    Conn::Py(PyEngine::spawn(uid, gid, &rig.socket, approval))
}

/// The matrix of engines: bound (the `games` entry), two unbound of different
/// uids (the shared key), and root.
fn engines(rig: &Rig) -> Vec<Who> {
    let g = py(rig, 7001, GAMES, "allow");
    let u = py(rig, 7002, IRC, "allow");
    let u2 = py(rig, 7003, IRC, "allow");
    let mut out = vec![];
    for (name, uid, gid, key, conn) in [
        ("bound", 7001, GAMES, KEY_G, g),
        ("unbound", 7002, IRC, KEY, u),
        ("unbound2", 7003, IRC, KEY, u2),
    ] {
        let ws = own_workspace(rig, uid, gid);
        out.push(Who {
            name,
            key,
            ws,
            conn,
            silent: py(rig, uid, gid, "silent"),
        });
    }
    out.push(Who {
        name: "root",
        key: KEY,
        ws: rig.workspace.clone(),
        conn: Conn::Root(rig.engine()),
        silent: Conn::Root({
            let e = rig.engine();
            *e.approval.lock().unwrap() = "silent".into();
            e
        }),
    });
    out
}

/// The scripts of one engine, all of its run "run-7": finished, running, and
/// pending (waiting for an approval its engine never gives).
struct Scripts {
    finished: String,
    running: String,
    pending: String,
}

fn start_scripts(w: &mut Who) -> Scripts {
    let t = w.token("run-7", "auto");
    let start = |c: &mut Conn, code: &str| {
        c.request(
            "script.start",
            json!({"token": t, "code": code, "tools": [], "description": "x"}),
        )
        .unwrap_or_else(|e| panic!("start refused: {e}"))["script_id"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let finished = start(&mut w.conn, "print('secret of the owner')");
    let r = w
        .conn
        .request("script.wait", json!({"script_id": finished}))
        .unwrap();
    assert_eq!(r["output"], "secret of the owner\n", "{} {r}", w.name);
    let running = start(&mut w.conn, "import time\ntime.sleep(120)");
    // Pending: a write tool under `approval`, asked of an engine that never answers.
    let params = json!({"token": w.token("run-7", "approval"), "code": "print(1)",
                        "tools": ["fleet__reboot_device"], "description": "x"});
    let pending = match &mut w.silent {
        Conn::Py(p) => {
            p.send("script.start", params);
            p.approval()["script_id"].as_str().unwrap().to_string()
        }
        Conn::Root(e) => {
            let line =
                json!({"jsonrpc": "2.0", "id": 999, "method": "script.start", "params": params});
            e.send_raw(format!("{line}\n").as_bytes());
            let mut id = None;
            eventually("approval.request", Duration::from_secs(30), || {
                id = e.seen.lock().unwrap().approvals.first().cloned();
                id.is_some()
            });
            id.unwrap()["script_id"].as_str().unwrap().to_string()
        }
    };
    Scripts {
        finished,
        running,
        pending,
    }
}

/// A rig with one `[[auth.engine]]` entry, for group `games` and its key; the
/// key's directory lives as long as the returned guard.
fn games_rig() -> (tempfile::TempDir, Rig) {
    let d = tempfile::Builder::new().prefix("sg-k-").tempdir().unwrap();
    let k = d.path().join("g.key");
    write_key(&k, KEY_G, GAMES);
    let rig = rig_with_auth(&format!(
        "[[auth.engine]]\ngroup = \"games\"\ntoken_key_file = {k:?}\n"
    ));
    (d, rig)
}

/// Engine A, knowing B's script ids (from `ps`, or guessed), with a token of
/// B's run id signed with A's own key, can neither wait on, read the status of,
/// nor cancel any of B's scripts (finished, running, pending), whoever A and B
/// are. B still sees its own, and its running script is not cancelled.
#[test]
#[ignore = "needs root: engines of other uids (cargo test -- --include-ignored, as root)"]
fn no_engine_sees_or_cancels_another_engines_scripts() {
    require_root("engines of other uids");
    let (_key, rig) = games_rig();
    let mut who = engines(&rig);
    let scripts: Vec<Scripts> = who.iter_mut().map(start_scripts).collect();
    let mut tried = 0;
    for a in 0..who.len() {
        for (b, s) in scripts.iter().enumerate() {
            if a == b {
                continue;
            }
            let t = who[a].token("run-7", "auto");
            for (kind, id) in [
                ("finished", &s.finished),
                ("running", &s.running),
                ("pending", &s.pending),
            ] {
                for method in ["script.wait", "script.status", "script.cancel"] {
                    let p = json!({"script_id": id, "token": t, "timeout_s": 0});
                    let got = who[a].conn.request(method, p);
                    let e = got.err().unwrap_or_else(|| {
                        panic!(
                            "{} got {method} of {}'s {kind} script",
                            who[a].name, who[b].name
                        )
                    });
                    assert_eq!(
                        code_reason(&e),
                        (-32016, "not_found".into()),
                        "{} {method} {}'s {kind}: {e}",
                        who[a].name,
                        who[b].name
                    );
                    tried += 1;
                }
            }
        }
    }
    assert_eq!(tried, 4 * 3 * 3 * 3);
    // The owners, with their own token on a new connection, still see theirs; the
    // running scripts were not cancelled.
    for (w, s) in who.iter_mut().zip(&scripts) {
        let t = w.token("run-7", "auto");
        let r = w
            .conn
            .request("script.wait", json!({"script_id": s.finished, "token": t}))
            .unwrap();
        assert_eq!(r["output"], "secret of the owner\n", "{}", w.name);
        let st = w
            .conn
            .request("script.status", json!({"script_id": s.running}))
            .unwrap();
        assert_eq!(st["state"], "running", "{} {st}", w.name);
        w.conn
            .request("script.cancel", json!({"script_id": s.running}))
            .unwrap();
    }
}

/// Unbound run ids used to be the bare id and bound ones `<label> <id>`: a token
/// of the shared key whose run id spelled `[[auth.engine]] group = "games" run-9`
/// revoked the bound engine's run-9 (its running script cancelled, its next start
/// refused, across restarts). Now the pair (scope, run id) cannot be spelled.
/// Run ids with control characters, or over 256 bytes, are refused.
#[test]
#[ignore = "needs root: engines of other uids (cargo test -- --include-ignored, as root)"]
fn a_run_id_cannot_spell_another_engines_run() {
    require_root("engines of other uids");
    let (_key, mut rig) = games_rig();
    let mut g = PyEngine::spawn(7001, GAMES, &rig.socket, "allow");
    let mut u = PyEngine::spawn(7002, IRC, &rig.socket, "allow");
    let ws_g = own_workspace(&rig, 7001, GAMES);
    let ws_u = own_workspace(&rig, 7002, IRC);
    let tok = |key: &[u8], run: &str, ws: &Path| {
        scriptgate::protocol::token::mint(key, run, None, &fleet_snapshot(ws, "auto"), 600).unwrap()
    };
    let start = |e: &mut PyEngine, t: &str, code: &str| {
        e.request(
            "script.start",
            json!({"token": t, "code": code, "tools": [], "description": "x"}),
        )
    };
    let tg = tok(KEY_G, "run-9", &ws_g);
    let running = start(&mut g, &tg, "import time\ntime.sleep(120)").unwrap()["script_id"]
        .as_str()
        .unwrap()
        .to_string();
    let spelled = r#"[[auth.engine]] group = "games" run-9"#;
    let tu = tok(KEY, spelled, &ws_u);
    let r = u.request("run.revoke", json!({"token": tu})).unwrap();
    assert_eq!(r["cancelled"], 0, "{r}");
    let e = u
        .request("script.status", json!({"script_id": running, "token": tu}))
        .unwrap_err();
    assert_eq!(code_reason(&e).1, "not_found", "{e}");
    let st = g
        .request("script.status", json!({"script_id": running}))
        .unwrap();
    assert_eq!(st["state"], "running", "{st}");
    // The unbound engine's own run of that id is what it revoked.
    let e = start(&mut u, &tu, "print(1)").unwrap_err();
    assert_eq!(code_reason(&e), (-32010, "revoked".into()), "{e}");
    g.request("script.cancel", json!({"script_id": running}))
        .unwrap();
    drop((g, u));
    // After a restart (the revocation is stored): run-9 of the bound engine starts.
    rig.stop(nix::sys::signal::Signal::SIGTERM);
    let _ = std::fs::remove_file(&rig.socket);
    rig.start();
    let mut g = PyEngine::spawn(7001, GAMES, &rig.socket, "allow");
    let id = start(&mut g, &tg, "print('still mine')").unwrap()["script_id"]
        .as_str()
        .unwrap()
        .to_string();
    let r = g.request("script.wait", json!({"script_id": id})).unwrap();
    assert_eq!(r["output"], "still mine\n", "{r}");
    // Bounded, printable run ids.
    for bad in ["run\n9".to_string(), "r\u{1b}[2J".into(), "r".repeat(257)] {
        let e = start(&mut g, &tok(KEY_G, &bad, &ws_g), "print(1)").unwrap_err();
        assert_eq!(code_reason(&e), (-32010, "malformed".into()), "{e}");
        assert_eq!(e["data"]["field"], "run_id", "{e}");
    }
    let ok = "r".repeat(256);
    let id = start(&mut g, &tok(KEY_G, &ok, &ws_g), "print(2)").unwrap()["script_id"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(
        g.request("script.wait", json!({"script_id": id})).unwrap()["status"],
        "ok"
    );
}

/// `run.revoke` takes expired tokens, and any engine mints its own run ids: an
/// engine revoking ever new ones grew the daemon's set and the `revocations`
/// table without end. Now each scope keeps at most
/// `REVOCATIONS_PER_SCOPE`, the oldest dropped: the flooding engine's newest
/// revocations still refuse its runs, another engine's are untouched, and the
/// same holds after a restart (the store keeps the bound too).
#[test]
#[ignore = "needs root: engines of other uids (cargo test -- --include-ignored, as root)"]
fn revocations_are_bounded_per_scope() {
    // registry::REVOCATIONS_PER_SCOPE, as scriptgate-protocol(7) names it.
    const BOUND: usize = 10_000;
    require_root("engines of other uids");
    let (_key, mut rig) = games_rig();
    let mut g = PyEngine::spawn(7001, GAMES, &rig.socket, "allow");
    let mut u = PyEngine::spawn(7002, IRC, &rig.socket, "allow");
    let ws_g = own_workspace(&rig, 7001, GAMES);
    let ws_u = own_workspace(&rig, 7002, IRC);
    let tok = |key: &[u8], run: &str, ws: &Path| {
        scriptgate::protocol::token::mint(key, run, None, &fleet_snapshot(ws, "auto"), 600).unwrap()
    };
    // The bound engine's revocation, in a scope of its own.
    let tg = tok(KEY_G, "g-run", &ws_g);
    g.request("run.revoke", json!({"token": tg})).unwrap();
    // The unbound engine revokes BOUND + 50 fresh run ids, in batches (a batch's
    // requests run concurrently; its answers are read before the next): the
    // first batch, f0..f49, is the oldest, and is what gets dropped.
    let n = BOUND + 50;
    let mut i = 0;
    while i < n {
        let end = if i == 0 { 50 } else { (i + 500).min(n) };
        let ids: Vec<u64> = (i..end)
            .map(|j| {
                u.send(
                    "run.revoke",
                    json!({"token": tok(KEY, &format!("f{j}"), &ws_u)}),
                )
            })
            .collect();
        for id in ids {
            let a = u.answer(id);
            assert!(a.get("error").is_none(), "{a}");
        }
        i = end;
    }
    let db = rig.state.join("scriptgate.db");
    let rows = |scope: &str| -> i64 {
        let c =
            rusqlite::Connection::open_with_flags(&db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
                .unwrap();
        c.busy_timeout(Duration::from_secs(10)).unwrap();
        c.query_row(
            "SELECT count(*) FROM revocations WHERE scope = ?1",
            [scope],
            |r| r.get(0),
        )
        .unwrap()
    };
    let start = |e: &mut PyEngine, t: &str| {
        e.request(
            "script.start",
            json!({"token": t, "code": "print(1)", "tools": [], "description": "x"}),
        )
    };
    let check = |g: &mut PyEngine, u: &mut PyEngine, after: &str| {
        assert_eq!(
            rows("uid:7002"),
            BOUND as i64,
            "{after}: the table is bounded"
        );
        assert_eq!(
            rows(r#"entry:[[auth.engine]] group = "games""#),
            1,
            "{after}"
        );
        for j in [n - 1, n - BOUND] {
            let e = start(u, &tok(KEY, &format!("f{j}"), &ws_u)).unwrap_err();
            assert_eq!(
                code_reason(&e),
                (-32010, "revoked".into()),
                "{after}: f{j} {e}"
            );
        }
        let e = start(g, &tg).unwrap_err();
        assert_eq!(
            code_reason(&e),
            (-32010, "revoked".into()),
            "{after}: another scope's revocation {e}"
        );
    };
    check(&mut g, &mut u, "running");
    // The oldest were dropped (in memory too): their runs start again.
    let r = start(&mut u, &tok(KEY, "f0", &ws_u)).unwrap();
    let w = u
        .request("script.wait", json!({"script_id": r["script_id"]}))
        .unwrap();
    assert_eq!(w["status"], "ok", "{w}");
    assert!(rig
        .log_text()
        .contains("keeps at most 10000 run revocations; dropped the oldest"));
    drop((g, u));
    rig.stop(nix::sys::signal::Signal::SIGTERM);
    let _ = std::fs::remove_file(&rig.socket);
    rig.start();
    let mut g = PyEngine::spawn(7001, GAMES, &rig.socket, "allow");
    let mut u = PyEngine::spawn(7002, IRC, &rig.socket, "allow");
    check(&mut g, &mut u, "after a restart");
    let e = start(&mut u, &tok(KEY, &format!("f{}", n - BOUND - 1), &ws_u));
    assert!(e.is_ok(), "dropped before the restart: {e:?}");
}

/// An unbound engine ran read-only in a root engine's `ROOT/shared` (0755) and
/// `ROOT/private` (0700): the daemon made `.agent` there and chowned it to the
/// engine, whose marker then let retention delete the workspace, and the root
/// engine's next start failed. Now the start is refused, saying why, nothing is
/// created, and the root engine's runs there are unchanged.
#[test]
#[ignore = "needs root: engines of other uids (cargo test -- --include-ignored, as root)"]
fn a_read_only_run_writes_nothing_where_its_engine_may_not() {
    require_root("engines of other uids");
    let rig = rig_with_auth("");
    let mut u = PyEngine::spawn(7002, IRC, &rig.socket, "allow");
    for (name, mode) in [("shared", 0o755), ("private", 0o700)] {
        let ws = rig.root.join(name);
        std::fs::create_dir(&ws).unwrap();
        std::fs::set_permissions(&ws, std::fs::Permissions::from_mode(mode)).unwrap();
        let mut snap = fleet_snapshot(&ws, "auto");
        snap["read_only"] = json!(true);
        let t = scriptgate::protocol::token::mint(KEY, "run-ro", None, &snap, 600).unwrap();
        let e = u
            .request(
                "script.start",
                json!({"token": t, "code": "print(1)", "tools": [], "description": "x"}),
            )
            .unwrap_err();
        assert_eq!(
            code_reason(&e),
            (-32011, "not_writable".into()),
            "{name}: {e}"
        );
        let msg = e["message"].as_str().unwrap();
        assert!(
            msg.contains("not writable by uid 7002")
                && msg.contains("even a read_only run")
                && msg.contains(".agent/scripts/<id>"),
            "{msg}"
        );
        assert!(!ws.join(".agent").exists(), "{name}: nothing created");
        // The root engine's read-only start there is taken as before (in the
        // 0700 one its scripts' uid, nobody, cannot enter: the sandbox says so).
        let e = rig.engine();
        let r = e.run(&rig.token_for("run-root", &snap, 600), "print('root')", &[]);
        if name == "shared" {
            assert_eq!(r["output"], "root\n", "{name}: {r}");
        } else {
            assert!(!r["text"].as_str().unwrap().contains("owned by uid"), "{r}");
        }
    }
}

/// The marker `scriptgate run` writes into a fresh workspace (crate::daemon::prune).
fn mark_created(ws: &Path) {
    std::fs::create_dir(ws.join(".agent")).unwrap();
    std::fs::set_permissions(ws.join(".agent"), std::fs::Permissions::from_mode(0o700)).unwrap();
    std::fs::write(
        ws.join(".agent/workspace.json"),
        "{\"created_by\": \"scriptgate run\"}\n",
    )
    .unwrap();
}

/// Age a workspace's times `days` back (its directory, `.agent/scripts`, marker).
fn age_workspace(ws: &Path, days: u64) {
    let t = std::time::SystemTime::now() - Duration::from_secs(days * 86_400);
    for p in [
        ws.join(".agent/scripts"),
        ws.join(".agent/workspace.json"),
        ws.to_path_buf(),
    ] {
        if p.exists() {
            std::fs::File::open(&p).unwrap().set_modified(t).unwrap();
        }
    }
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// Age the daemon's record of every workspace `days` back (its last recorded
/// start: a workspace is old only when that and its times are).
fn age_records(rig: &Rig, days: u64) {
    let c = rusqlite::Connection::open(rig.state.join("scriptgate.db")).unwrap();
    c.busy_timeout(Duration::from_secs(10)).unwrap();
    let at = now_ms() - (days * 86_400_000) as i64;
    c.execute("UPDATE workspaces SET last_at = ?1", [at])
        .unwrap();
}

/// `scriptgate prune` through the rig's daemon: its report, under the line
/// that names the roots (left out here).
fn prune(rig: &Rig) -> String {
    let o = rig.cli(["prune"]);
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.status.success(),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let (head, report) = out.split_once('\n').unwrap_or_default();
    let by = format!(
        " (workspace.roots), by the daemon at {}:",
        rig.socket.display()
    );
    assert!(
        head.starts_with("workspaces under ") && head.ends_with(&by),
        "{out}"
    );
    // Then root's own embedded workspaces: none under this rig.
    let embedded = format!(
        "no embedded workspaces of uid 0: {} has no audit store\n",
        rig.state.join("cli").display()
    );
    report
        .strip_suffix(&embedded)
        .unwrap_or_else(|| panic!("no line for root's embedded workspaces: {out}"))
        .to_string()
}

/// A marker is no longer enough: `scriptgate prune` removes a workspace only if
/// the daemon recorded it (a script of its engine ran in it, the engine's own
/// marker, the directory of its uid). A marker an engine wrote into a directory
/// that is not its own (as the read-only hole let it) keeps nothing from harm
/// before; now such a directory is never removed.
#[test]
#[ignore = "needs root: engines of other uids, aged directories (cargo test -- --include-ignored, as root)"]
fn retention_removes_only_what_the_daemon_recorded() {
    require_root("engines of other uids");
    let rig = rig_with_auth("");
    let mut u = PyEngine::spawn(7002, IRC, &rig.socket, "allow");
    let mine = own_workspace(&rig, 7002, IRC);
    // The engine's own fresh workspace (as `scriptgate run` makes one), used.
    let fresh = mine.parent().unwrap().join("run-fresh");
    std::fs::create_dir(&fresh).unwrap();
    mark_created(&fresh);
    for p in [
        fresh.clone(),
        fresh.join(".agent"),
        fresh.join(".agent/workspace.json"),
    ] {
        std::os::unix::fs::chown(&p, Some(7002), Some(IRC)).unwrap();
    }
    let t =
        scriptgate::protocol::token::mint(KEY, "run-p", None, &fleet_snapshot(&fresh, "auto"), 600)
            .unwrap();
    let id = u
        .request(
            "script.start",
            json!({"token": t, "code": "print(1)", "tools": [], "description": "x"}),
        )
        .unwrap()["script_id"]
        .as_str()
        .unwrap()
        .to_string();
    u.request("script.wait", json!({"script_id": id})).unwrap();
    // A root engine's directory with a marker the unbound engine owns (what the
    // read-only hole let it write), and its own workspace with a planted marker
    // no script ran under: neither was recorded.
    let shared = rig.root.join("shared");
    std::fs::create_dir_all(shared.join(".agent")).unwrap();
    std::fs::write(shared.join("data"), "the root engine's").unwrap();
    std::fs::write(shared.join(".agent/workspace.json"), "{}").unwrap();
    for p in [shared.join(".agent"), shared.join(".agent/workspace.json")] {
        std::os::unix::fs::chown(&p, Some(7002), Some(IRC)).unwrap();
    }
    for ws in [&fresh, &shared, &rig.workspace] {
        age_workspace(ws, 40);
    }
    // The directory's times alone (a script can set them) do not make it old.
    let out = prune(&rig);
    assert!(
        out.ends_with(
            "0 workspaces removed (unused for more than 30 days); 1 kept (recent or in use)\n"
        ),
        "{out}"
    );
    assert!(fresh.exists());
    age_records(&rig, 40);
    let out = prune(&rig);
    assert!(
        out.starts_with(&format!("removed {} (last used ", fresh.display())),
        "{out}"
    );
    assert!(
        out.ends_with(
            "1 workspace removed (unused for more than 30 days); 0 kept (recent or in use)\n"
        ),
        "{out}"
    );
    assert!(!fresh.exists());
    assert_eq!(
        std::fs::read_to_string(shared.join("data")).unwrap(),
        "the root engine's"
    );
    assert!(rig.workspace.exists());
}

/// A tree of 20,001 entries in one engine's area used to use up the pass's
/// 20,000-entry scan before the next root was looked at: another engine's expired
/// workspace was never removed. A pass now looks only at the recorded workspaces
/// and bounds its removals per owner.
#[test]
#[ignore = "needs root: scripts run as nobody, aged directories (cargo test -- --include-ignored, as root)"]
fn one_engines_huge_tree_does_not_starve_retention() {
    require_root("scripts run as nobody");
    let mut rig = Rig::new();
    rig.stop(nix::sys::signal::Signal::SIGKILL);
    let first = rig.dir.path().join("first-root");
    let crowded = first.join("7002");
    std::fs::create_dir_all(&crowded).unwrap();
    for i in 0..20_001 {
        std::fs::File::create(crowded.join(format!("f{i}"))).unwrap();
    }
    let text = std::fs::read_to_string(&rig.config).unwrap().replacen(
        &format!("roots = [{:?}]", rig.root),
        &format!("roots = [{first:?}, {:?}]", rig.root),
        1,
    );
    std::fs::write(&rig.config, text).unwrap();
    let _ = std::fs::remove_file(&rig.socket);
    rig.start();
    // The root engine's fresh workspace, as `scriptgate run` makes it as root.
    let ws = rig.root.join("run-old");
    std::fs::create_dir(&ws).unwrap();
    mark_created(&ws);
    chown_to_script_uid(&ws);
    let e = rig.engine();
    let r = e.run(&rig.token(&fleet_snapshot(&ws, "auto")), "print(1)", &[]);
    assert_eq!(r["status"], "ok", "{r}");
    age_workspace(&ws, 40);
    age_records(&rig, 40);
    let t0 = std::time::Instant::now();
    let out = prune(&rig);
    eprintln!("prune pass with a 20,001-entry tree: {:?}", t0.elapsed());
    assert!(
        out.starts_with(&format!("removed {} (last used ", ws.display())),
        "{out}"
    );
    assert!(!ws.exists());
    assert_eq!(std::fs::read_dir(&crowded).unwrap().count(), 20_001);
}

/// A workspace the engine may write (0777) but whose `.agent` is root's: the
/// daemon used to chown root's directory to the engine's uid; it now refuses,
/// saying whose it is and what to do, and changes nothing.
#[test]
#[ignore = "needs root: engines of other uids (cargo test -- --include-ignored, as root)"]
fn roots_agent_directory_is_not_handed_to_an_engine() {
    require_root("engines of other uids");
    let rig = rig_with_auth("");
    let mut u = PyEngine::spawn(7002, IRC, &rig.socket, "allow");
    let ws = rig.root.join("open");
    std::fs::create_dir_all(ws.join(".agent")).unwrap();
    std::fs::set_permissions(&ws, std::fs::Permissions::from_mode(0o777)).unwrap();
    let t =
        scriptgate::protocol::token::mint(KEY, "run-o", None, &fleet_snapshot(&ws, "auto"), 600)
            .unwrap();
    let e = u
        .request(
            "script.start",
            json!({"token": t, "code": "print(1)", "tools": [], "description": "x"}),
        )
        .unwrap_err();
    let msg = e["message"].as_str().unwrap();
    assert!(
        msg.contains("is owned by root, not by the script's uid 7002")
            && msg.contains("chown it to uid 7002"),
        "{e}"
    );
    use std::os::unix::fs::MetadataExt;
    assert_eq!(std::fs::metadata(ws.join(".agent")).unwrap().uid(), 0);
    assert!(!ws.join(".agent/scripts").exists());
}
