//! Users and groups through the real daemon and socket: the SO_PEERCRED gate
//! (engines, admin-only peers, everyone else), per-uid workspace directories,
//! `[[auth.engine]]` keys and workspaces, private workspaces and artifacts, the
//! CLI's choice of daemon, a daemon dying under `scriptgate run`, and `cancel`.
//!
//! Peers of other uids are real processes (python3 clients, or the `scriptgate`
//! CLI itself) started with another uid and gid. The groups are ones every
//! Debian host has (`games`, `irc`, `list`), matched by the peer's primary gid,
//! and the uids have no user entry, so nothing is added to /etc.
use crate::common::*;
use serde_json::{json, Value};
use std::ffi::OsStr;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const GAMES: u32 = 60;
const IRC: u32 = 39;
const LIST: u32 = 38;

/// A rig whose `[auth]` has `auth` added (engines in `games`, administrators
/// in `list` unless `auth` says otherwise), restarted with it.
fn rig_with_auth(auth: &str, extra: &str) -> Rig {
    assert_eq!(
        (gid_of("games"), gid_of("irc"), gid_of("list")),
        (GAMES, IRC, LIST)
    );
    let mut rig = Rig::with_config(extra);
    rig.stop(nix::sys::signal::Signal::SIGKILL);
    let text = std::fs::read_to_string(&rig.config).unwrap();
    // `[[auth.engine]]` tables go after every plain `[auth]` key.
    let (mut plain, tables) = match auth.find("[[auth.engine]]") {
        Some(i) => (auth[..i].to_string(), auth[i..].to_string()),
        None => (auth.to_string(), String::new()),
    };
    if !plain.contains("allowed_groups") {
        plain.push_str("allowed_groups = [\"games\", \"irc\"]\n");
    }
    if !plain.contains("admin_groups") {
        plain.push_str("admin_groups = [\"list\"]\n");
    }
    let text = text.replacen("[auth]\n", &format!("[auth]\n{plain}"), 1) + "\n" + &tables;
    std::fs::write(&rig.config, text).unwrap();
    let _ = std::fs::remove_file(&rig.socket);
    rig.start();
    rig
}

/// A python3 client as `uid`:`gid`: sends each request in turn (params
/// `"LAST_SCRIPT"`: the script the previous answer started) and prints every
/// answer (a line with an `id` and no `method`) or the connection-level error
/// (id null) as it arrives; after such an error, or with no request at all, it
/// waits for the daemon to close and prints `EOF`.
const CLIENT: &str = r#"
import json, socket, sys
s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])
f = s.makefile('rwb')
reqs = json.loads(sys.argv[2])
def answer(i):
    while True:
        line = f.readline()
        if not line:
            print('EOF', flush=True); sys.exit(0)
        m = json.loads(line)
        if 'method' in m:
            continue
        print(json.dumps(m), flush=True)
        if m.get('id') is None or m.get('id') == i:
            return m
last = {}
for i, (method, params) in enumerate(reqs, 1):
    if params == 'LAST_SCRIPT':
        params = {'script_id': last.get('result', {}).get('script_id')}
    f.write((json.dumps({'jsonrpc': '2.0', 'id': i, 'method': method, 'params': params}) + '\n').encode()); f.flush()
    last = answer(i)
    if last.get('id') is None:
        break
# A connection-level error (id null), or no request at all: the daemon closes.
if not reqs:
    last = answer(0)
if last.get('id') is None:
    answer(0)
"#;

/// Run the client as `uid`:`gid`; the answers, in order (`"EOF"` last when
/// the daemon closed the connection).
fn client_as(uid: u32, gid: u32, socket: &Path, reqs: Value) -> Vec<Value> {
    let o = Command::new("python3")
        .args(["-c", CLIENT])
        .arg(socket)
        .arg(reqs.to_string())
        .uid(uid)
        .gid(gid)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "client: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or(Value::String(l.into())))
        .collect()
}

fn error_of(m: &Value) -> (i64, String) {
    code_reason(&m["error"])
}

fn mode_owner(p: &Path) -> (u32, u32, u32) {
    let m = std::fs::metadata(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    (m.mode() & 0o7777, m.uid(), m.gid())
}

fn write_key(path: &Path, key: &[u8], group: u32) {
    std::fs::write(path, key).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o640)).unwrap();
    std::os::unix::fs::chown(path, Some(0), Some(group)).unwrap();
}

fn daemon_fds(rig: &Rig) -> usize {
    let pid = rig.daemon.as_ref().unwrap().id();
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count()
}

#[test]
#[ignore = "needs root (peers of other uids): cargo test --test it users:: -- --include-ignored"]
fn a_peer_in_neither_group_is_refused_before_anything_is_read_and_floods_cost_nothing() {
    require_root("clients of other uids");
    let rig = rig_with_auth("", "");
    // Sends nothing: the error comes first, then the close.
    let got = client_as(40001, 40001, &rig.socket, json!([]));
    assert_eq!(got.len(), 2, "{got:?}");
    assert_eq!(error_of(&got[0]), (-32001, "peer_not_allowed".into()));
    assert!(got[0]["error"]["message"]
        .as_str()
        .unwrap()
        .contains("uid 40001 may not use scriptgated"));
    assert_eq!(got[1], "EOF");
    // A local user looping on connect: each refused at once, none held open,
    // the journal gets a bounded number of lines.
    let fds = daemon_fds(&rig);
    let flood = r#"
import socket, sys
for _ in range(3000):
    s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])
    s.recv(4096); s.close()
"#;
    let t0 = Instant::now();
    let st = Command::new("python3")
        .args(["-c", flood])
        .arg(&rig.socket)
        .uid(40001)
        .gid(40001)
        .status()
        .unwrap();
    assert!(st.success());
    let took = t0.elapsed();
    eprintln!("3000 refused connections in {took:?}");
    let logged = rig
        .log_text()
        .matches("connection refused: uid 40001")
        .count();
    // The gate's rate (crate::daemon::ratelimit::CONNECTIONS): a burst of 20,
    // and one more each 3 s, of which the refusal above took one; a loaded host
    // makes the flood last longer, and so earns more lines, never one a connection.
    let rate = scriptgate::daemon::ratelimit::CONNECTIONS;
    let bound = rate.burst as usize + 1 + (took.as_secs_f64() * rate.per_s).ceil() as usize;
    assert!(
        (1..=bound).contains(&logged),
        "{logged} refusals logged one by one (at most {bound} in {took:?})"
    );
    eventually(
        "the refused connections to be closed",
        Duration::from_secs(10),
        || daemon_fds(&rig) <= fds,
    );
    // The pid is a number, never Rust's `Some(…)`.
    let log = rig.log_text();
    let first = log
        .lines()
        .find(|l| l.contains("connection refused: uid 40001"))
        .unwrap();
    let pid = first
        .split("(pid ")
        .nth(1)
        .and_then(|r| r.split(')').next());
    assert!(
        pid.is_some_and(|p| p.parse::<u32>().is_ok()) && !log.contains("Some("),
        "{first}"
    );
    // Every refused connection is counted, logged or not: a row per minute
    // (the flood spans one or two), however many connections.
    let minutes = 1 + took.as_secs() / 60 + 1;
    let counted = || {
        let o = rig.cli([
            "audit",
            "--refusals",
            "--connections",
            "--uid",
            "40001",
            "--json",
        ]);
        assert!(o.status.success(), "{o:?}");
        let rows: Vec<Value> = serde_json::from_slice(&o.stdout).unwrap();
        (
            rows.len() as u64,
            rows.iter()
                .map(|r| r["count"].as_u64().unwrap())
                .sum::<u64>(),
            rows,
        )
    };
    eventually(
        "3001 refused connections counted (written every 10 s)",
        Duration::from_secs(30),
        || counted().1 == 3001,
    );
    let (n, _, rows) = counted();
    assert!(
        (1..=minutes).contains(&n),
        "{n} rows for {took:?}: {rows:?}"
    );
    assert!(
        rows.iter()
            .all(|r| r["reason"] == "peer_not_allowed" && r["peer_uid"] == 40001),
        "{rows:?}"
    );
    let text = rig.cli(["audit", "--refusals", "--connections"]);
    let text = String::from_utf8(text.stdout).unwrap();
    assert!(text.starts_with("MINUTE"), "{text}");
    assert!(
        text.contains("40001") && text.contains("peer_not_allowed"),
        "{text}"
    );
    let metrics = String::from_utf8(rig.cli(["metrics"]).stdout).unwrap();
    assert!(
        metrics.contains("scriptgate_connections_refused_total{reason=\"peer_not_allowed\"} 3001"),
        "{metrics}"
    );
    // Engines are still served.
    let e = rig.engine();
    assert!(e.request("daemon.info", json!({})).is_ok());
}

#[test]
#[ignore = "needs root (peers of other uids): cargo test --test it users:: -- --include-ignored"]
fn an_admin_only_peer_gets_admin_methods_and_a_clear_refusal_for_engine_methods() {
    require_root("clients of other uids");
    let rig = rig_with_auth("", "");
    let token = rig.token(&rig.snapshot("auto"));
    let got = client_as(
        40002,
        LIST,
        &rig.socket,
        json!([
            ["daemon.info", {}],
            ["admin.list", {}],
            ["script.start", {"token": token, "code": "print(1)", "tools": [], "description": "x"}],
            ["run.describe", {"token": token}],
            ["admin.cancel", {"script_id": "0000"}]
        ]),
    );
    assert_eq!(got[0]["result"]["protocol"], 1, "{got:?}");
    assert!(got[1]["result"]["scripts"].is_array(), "{got:?}");
    for g in &got[2..4] {
        assert_eq!(error_of(g), (-32001, "admin_only".into()), "{g}");
        assert!(g["error"]["message"]
            .as_str()
            .unwrap()
            .contains("is an administrator (auth.admin_groups) but not an engine"));
    }
    assert_eq!(
        got[4]["error"]["message"], "no script 0000 is running or recorded",
        "admins are not told about connections"
    );
    // An engine that is no administrator gets no admin method.
    let got = client_as(40003, GAMES, &rig.socket, json!([["admin.list", {}]]));
    assert_eq!(error_of(&got[0]), (-32018, "not_admin".into()));
}

/// `scriptgate` as another uid, with no terminal.
fn cli_as(uid: u32, gid: u32, args: &[&std::ffi::OsStr], env: &[(&str, &Path)]) -> Output {
    cli_with(args, |c| {
        c.stdin(Stdio::null()).env_remove("SCRIPTGATE_SOCKET");
        if uid != 0 {
            c.uid(uid).gid(gid).env("HOME", "/nonexistent");
        }
        for (k, v) in env {
            c.env(k, v);
        }
    })
}

fn time_server() -> String {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/mcp/venv/bin/mcp-server-time");
    assert!(p.exists(), "run tools/install-deps first");
    format!("time={}", p.display())
}

fn script_file(dir: &Path, code: &str) -> PathBuf {
    let p = dir.join(format!("s{}.py", std::process::id()));
    std::fs::write(&p, code).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
    p
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
#[ignore = "needs root (peers of other uids): cargo test --test it users:: -- --include-ignored"]
fn a_non_root_engine_runs_with_the_defaults_in_its_own_private_directory() {
    require_root("clients of other uids");
    let rig = rig_with_auth("", "");
    write_key(&rig.key_file, KEY, GAMES);
    // The workspace root as the package makes it: root's, 0755.
    std::fs::set_permissions(&rig.root, std::fs::Permissions::from_mode(0o755)).unwrap();
    let script = script_file(
        rig.dir.path(),
        "import os\nopen('made.txt', 'w').write('x')\nprint(os.getuid(), os.getcwd())\n",
    );
    let time = time_server();
    let args: Vec<&std::ffi::OsStr> = vec![
        "run".as_ref(),
        "--mcp".as_ref(),
        time.as_ref(),
        "--socket".as_ref(),
        rig.socket.as_os_str(),
        "--config".as_ref(),
        rig.config.as_os_str(),
        "--json".as_ref(),
        script.as_os_str(),
    ];
    let o = cli_as(40003, GAMES, &args, &[]);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}{}",
        text(&o.stdout),
        text(&o.stderr)
    );
    let err = text(&o.stderr);
    assert!(err.starts_with("scriptgate: mode: daemon at "), "{err}");
    let mine = rig.root.join("40003");
    assert_eq!(
        mode_owner(&mine),
        (0o700, 40003, GAMES),
        "the per-uid directory"
    );
    let ws = err
        .lines()
        .find_map(|l| l.strip_prefix("scriptgate: workspace "))
        .map(PathBuf::from)
        .unwrap_or_else(|| panic!("{err}"));
    assert_eq!(ws.parent(), Some(mine.as_path()), "{err}");
    let r: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        r["output"].as_str().unwrap(),
        format!("40003 {}\n", ws.display()),
        "ran as the engine's uid in the fresh workspace"
    );
    // Private: the workspace, the record and every artifact.
    assert_eq!(mode_owner(&ws), (0o700, 40003, GAMES));
    assert_eq!(mode_owner(&ws.join("made.txt")).1, 40003);
    let rec = ws
        .join(".agent/scripts")
        .join(r["script_id"].as_str().unwrap());
    for d in [ws.join(".agent"), ws.join(".agent/scripts"), rec.clone()] {
        assert_eq!(mode_owner(&d), (0o700, 40003, GAMES), "{}", d.display());
    }
    for f in ["script.py", "calls.jsonl", "output.txt", "stderr.txt"] {
        assert_eq!(mode_owner(&rec.join(f)), (0o600, 40003, GAMES), "{f}");
    }
    // Another engine of the same group, with the same (shared) key, cannot
    // name a workspace in that directory.
    let snap = fleet_snapshot(&ws, "auto");
    let token = rig.token(&snap);
    let got = client_as(
        40004,
        GAMES,
        &rig.socket,
        json!([["script.start", {"token": token, "code": "print(1)", "tools": [], "description": "x"}]]),
    );
    assert_eq!(
        error_of(&got[0]),
        (-32011, "other_engine".into()),
        "{got:?}"
    );
    assert!(
        rig.root.join("40004").is_dir(),
        "its own was made on connect"
    );
    // Nor list it.
    let ls = Command::new("ls")
        .arg(&mine)
        .uid(40004)
        .gid(GAMES)
        .output()
        .unwrap();
    assert!(!ls.status.success());
    // Nor read, through a read-only run, a directory that lies below another
    // user's 0700 directory (bwrap binds by descriptor and would not ask).
    let private = rig.root.join("run-private");
    std::fs::create_dir_all(private.join("sub")).unwrap();
    std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o700)).unwrap();
    std::fs::write(private.join("sub/secret.txt"), "root's").unwrap();
    let mut snap = fleet_snapshot(&private.join("sub"), "auto");
    snap["read_only"] = json!(true);
    let got = client_as(
        40004,
        GAMES,
        &rig.socket,
        json!([["script.start", {"token": rig.token(&snap), "code": "print(open('secret.txt').read())", "tools": [], "description": "x"}]]),
    );
    assert_eq!(
        error_of(&got[0]),
        (-32011, "not_reachable".into()),
        "{got:?}"
    );
    // A root-owned directory named after an engine's uid is handed over on connect
    // only when empty: root's files in it are not the engine's to read.
    let (kept, taken) = (rig.root.join("40006"), rig.root.join("40007"));
    std::fs::create_dir(&kept).unwrap();
    std::fs::write(kept.join("roots-file"), "root's").unwrap();
    std::fs::create_dir(&taken).unwrap();
    for uid in [40006, 40007] {
        client_as(uid, GAMES, &rig.socket, json!([["daemon.info", {}]]));
    }
    assert_eq!(mode_owner(&kept).1, 0, "not empty: not handed over");
    assert_eq!(
        mode_owner(&taken),
        (0o700, 40007, GAMES),
        "empty: handed over"
    );
}

#[test]
#[ignore = "needs root (peers of other uids): cargo test --test it users:: -- --include-ignored"]
fn engine_entries_bind_each_engine_to_its_own_key_and_workspaces() {
    require_root("clients of other uids");
    let d = tempfile::Builder::new()
        .prefix("sg-users-")
        .tempdir()
        .unwrap();
    std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let (k1, k2) = (d.path().join("a.key"), d.path().join("b.key"));
    const KEY_A: &[u8] = b"engine-a-engine-a-engine-a-engine-a!";
    const KEY_B: &[u8] = b"engine-b-engine-b-engine-b-engine-b!";
    write_key(&k1, KEY_A, GAMES);
    write_key(&k2, KEY_B, IRC);
    let own = d.path().join("gw-a");
    let ws_a = own.join("ws");
    std::fs::create_dir_all(&ws_a).unwrap();
    std::os::unix::fs::chown(&ws_a, Some(40011), Some(GAMES)).unwrap();
    let rig = rig_with_auth(
        &format!(
            "[[auth.engine]]\ngroup = \"games\"\ntoken_key_file = {k1:?}\nworkspace_roots = [{own:?}]\n\
             [[auth.engine]]\ngroup = \"irc\"\ntoken_key_file = {k2:?}\n"
        ),
        "",
    );
    let start = |key: &[u8], ws: &Path| {
        let t =
            scriptgate::protocol::token::mint(key, "run-e", None, &fleet_snapshot(ws, "auto"), 600)
                .unwrap();
        json!(["script.start", {"token": t, "code": "import os\nprint(os.getuid())", "tools": [], "description": "x"}])
    };
    // A with its key, in its own root: runs.
    let got = client_as(
        40011,
        GAMES,
        &rig.socket,
        json!([start(KEY_A, &ws_a), ["script.wait", "LAST_SCRIPT"]]),
    );
    assert_eq!(
        (
            got[1]["result"]["status"].as_str(),
            got[1]["result"]["output"].as_str()
        ),
        (Some("ok"), Some("40011\n")),
        "{got:?}"
    );
    // A with the shared key, or B's: signature.
    let got = client_as(40011, GAMES, &rig.socket, json!([start(KEY, &ws_a)]));
    assert_eq!(error_of(&got[0]), (-32010, "signature".into()), "{got:?}");
    let got = client_as(40011, GAMES, &rig.socket, json!([start(KEY_B, &ws_a)]));
    assert_eq!(error_of(&got[0]), (-32010, "signature".into()));
    // B with its own key but A's workspace: outside its roots, which are its
    // per-uid directories (made on connect).
    let got = client_as(40012, IRC, &rig.socket, json!([start(KEY_B, &ws_a)]));
    assert_eq!(
        error_of(&got[0]),
        (-32011, "outside_roots".into()),
        "{got:?}"
    );
    assert_eq!(mode_owner(&rig.root.join("40012")), (0o700, 40012, IRC));
    assert!(
        !rig.root.join("40011").exists(),
        "A has explicit roots: no per-uid directory"
    );
    let ws_b = rig.root.join("40012/ws");
    std::fs::create_dir(&ws_b).unwrap();
    std::os::unix::fs::chown(&ws_b, Some(40012), Some(IRC)).unwrap();
    let got = client_as(
        40012,
        IRC,
        &rig.socket,
        json!([start(KEY_B, &ws_b), ["script.wait", "LAST_SCRIPT"]]),
    );
    assert_eq!(got[1]["result"]["output"], "40012\n", "{got:?}");
    // Both engines used the run id "run-e". B revoking its own "run-e" (with its
    // key) revokes B's run only: A's run of the same id still starts; B's does not.
    let tb = scriptgate::protocol::token::mint(
        KEY_B,
        "run-e",
        None,
        &fleet_snapshot(&ws_b, "auto"),
        600,
    )
    .unwrap();
    let got = client_as(
        40012,
        IRC,
        &rig.socket,
        json!([["run.revoke", {"token": tb}], start(KEY_B, &ws_b)]),
    );
    assert_eq!(got[0]["result"]["run_id"], "run-e", "{got:?}");
    assert_eq!(error_of(&got[1]), (-32010, "revoked".into()), "{got:?}");
    let got = client_as(
        40011,
        GAMES,
        &rig.socket,
        json!([start(KEY_A, &ws_a), ["script.wait", "LAST_SCRIPT"]]),
    );
    assert_eq!(
        got[1]["result"]["status"], "ok",
        "another engine's revocation of the same run id: {got:?}"
    );
}

/// scriptgated with this config text: its exit status and stderr.
fn daemon_with(dir: &Path, config: &str) -> (Option<i32>, String) {
    crate::common::shared();
    let cfg = dir.join("bad.toml");
    std::fs::write(&cfg, config).unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_scriptgated"))
        .arg("--listen")
        .arg(dir.join("never.sock"))
        .arg("--config")
        .arg(&cfg)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    (o.status.code(), text(&o.stderr))
}

#[test]
#[ignore = "needs root (key files owned by root): cargo test --test it users:: -- --include-ignored"]
fn engine_entry_errors_are_clear() {
    require_root("key files owned by root");
    let d = tempfile::Builder::new()
        .prefix("sg-users-")
        .tempdir()
        .unwrap();
    let (g, a, b) = (
        d.path().join("g.key"),
        d.path().join("a.key"),
        d.path().join("b.key"),
    );
    write_key(&g, KEY, 0);
    write_key(&a, b"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", 0);
    write_key(&b, b"bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb", 0);
    let head = format!(
        "[sandbox]\nbackend = \"rlimit\"\n[state]\ndir = {:?}\n[auth]\ntoken_key_file = {g:?}\n",
        d.path().join("state")
    );
    let cases = [
        (
            format!("[[auth.engine]]\ngroup = \"no-such-group-xyz\"\ntoken_key_file = {a:?}\n"),
            "no group \"no-such-group-xyz\" on this host",
        ),
        (
            format!("[[auth.engine]]\nuser = \"nobody\"\ntoken_key_file = {:?}\n", d.path().join("missing.key")),
            "missing.key: cannot read",
        ),
        (
            format!("[[auth.engine]]\nuser = \"nobody\"\ntoken_key_file = {a:?}\n[[auth.engine]]\ngroup = \"nogroup\"\ntoken_key_file = {b:?}\n"),
            "overlap: the user is a member of the group",
        ),
        (
            format!("[[auth.engine]]\ngroup = \"games\"\ntoken_key_file = {a:?}\n[[auth.engine]]\ngroup = \"60\"\ntoken_key_file = {b:?}\n"),
            "match the same peers",
        ),
        (
            format!("[[auth.engine]]\ngroup = \"games\"\ntoken_key_file = {a:?}\n[[auth.engine]]\ngroup = \"irc\"\ntoken_key_file = {a:?}\n"),
            "have the same key, so either engine could act as the other",
        ),
        (
            format!("[[auth.engine]]\ngroup = \"games\"\ntoken_key_file = {g:?}\n"),
            "same as auth.token_key_file's",
        ),
        (
            format!("[[auth.engine]]\ngroup = \"games\"\nuser = \"nobody\"\ntoken_key_file = {a:?}\n"),
            "exactly one of `user` or `group`",
        ),
    ];
    for (entries, want) in cases {
        let (code, err) = daemon_with(d.path(), &format!("{head}{entries}"));
        assert_eq!(code, Some(1), "{entries}: {err}");
        assert!(err.contains(want), "{entries}\nwanted {want:?} in: {err}");
    }
}

#[test]
#[ignore = "needs root (peers of other uids): cargo test --test it users:: -- --include-ignored"]
fn the_cli_never_falls_back_silently() {
    require_root("clients of other uids");
    let rig = rig_with_auth("", "");
    let script = script_file(rig.dir.path(), "print('hi')\n");
    let time = time_server();
    let run = |uid: u32, gid: u32, extra: &[&str], env: &[(&str, &Path)]| {
        let mut args: Vec<&std::ffi::OsStr> = vec!["run".as_ref(), "--mcp".as_ref(), time.as_ref()];
        args.extend(extra.iter().map(std::ffi::OsStr::new));
        args.extend([
            "--config".as_ref(),
            rig.config.as_os_str(),
            script.as_os_str(),
        ]);
        cli_as(uid, gid, &args, env)
    };
    // A system socket that is there but dead (the daemon crashed): an error.
    let dead = rig.dir.path().join("dead.sock");
    drop(std::os::unix::net::UnixListener::bind(&dead).unwrap());
    let o = run(0, 0, &[], &[("SCRIPTGATE_SOCKET", &dead)]);
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(10), "{err}");
    assert!(
        err.contains(&format!(
            "the system daemon at {} cannot be reached",
            dead.display()
        )),
        "{err}"
    );
    assert!(err.contains("--embedded"), "{err}");
    assert!(!err.contains("scriptgate: mode:"), "{err}");
    // A system daemon that refuses the user: an error, not an embedded run.
    let o = run(40001, 40001, &[], &[("SCRIPTGATE_SOCKET", &rig.socket)]);
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(10), "{err}");
    assert!(
        err.contains("refused this client: uid 40001 may not use scriptgated"),
        "{err}"
    );
    assert_eq!(
        std::fs::read_dir(&rig.root).unwrap().count(),
        1,
        "nothing was made but the rig's own workspace"
    );
    // Asked for (by the user the system daemon refuses): embedded, and the one
    // line says so.
    let home = rig.dir.path().join("home");
    std::fs::create_dir(&home).unwrap();
    std::os::unix::fs::chown(&home, Some(40001), Some(40001)).unwrap();
    let o = run(
        40001,
        40001,
        &["--embedded"],
        &[("SCRIPTGATE_SOCKET", &rig.socket), ("HOME", &home)],
    );
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert_eq!(
        err.lines()
            .filter(|l| l.starts_with("scriptgate: mode: "))
            .collect::<Vec<_>>(),
        vec![format!(
            "scriptgate: mode: embedded daemon in this process (asked for with --embedded); records in {}/.local/state/scriptgate",
            home.display()
        )]
    );
    assert_eq!(text(&o.stdout).lines().last(), Some("hi"));
    // The system daemon, found by SCRIPTGATE_SOCKET: named.
    let ws = rig.workspace.display().to_string();
    let o = run(
        0,
        0,
        &["--workspace", &ws],
        &[("SCRIPTGATE_SOCKET", &rig.socket)],
    );
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert!(
        err.starts_with(&format!(
            "scriptgate: mode: system daemon at {} (scriptgated ",
            rig.socket.display()
        )),
        "{err}"
    );
}

#[test]
#[ignore = "needs root (kills its daemon): cargo test --test it users:: -- --include-ignored"]
fn a_daemon_killed_under_scriptgate_run_is_exit_7() {
    require_root("scripts of root run as nobody");
    let mut rig = Rig::new();
    let script = script_file(
        rig.dir.path(),
        "import time\nprint('started', flush=True)\ntime.sleep(120)\n",
    );
    let time = time_server();
    let child = rig
        .cli_command([
            OsStr::new("run"),
            "--mcp".as_ref(),
            time.as_ref(),
            "--workspace".as_ref(),
            rig.workspace.as_ref(),
            script.as_ref(),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let scripts = rig.workspace.join(".agent/scripts");
    eventually("the script to run", Duration::from_secs(30), || {
        std::fs::read_dir(&scripts)
            .ok()
            .and_then(|mut d| d.next())
            .and_then(|e| std::fs::read_to_string(e.ok()?.path().join("output.txt")).ok())
            == Some("started\n".into())
    });
    rig.stop(nix::sys::signal::Signal::SIGKILL);
    let o = child.wait_with_output().unwrap();
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(7), "{err}");
    assert!(err.contains("went away while script"), "{err}");
    assert!(err.contains("the script was interrupted"), "{err}");
}

#[test]
#[ignore = "needs root (scripts of root run as nobody): cargo test --test it users:: -- --include-ignored"]
fn cancel_of_a_finished_script_says_so_and_exits_13() {
    require_root("scripts of root run as nobody");
    let rig = Rig::new();
    let e = rig.engine();
    let r = e.run(&rig.token(&rig.snapshot("auto")), "print(1)", &[]);
    let id = r["script_id"].as_str().unwrap();
    let admin = |args: &[&str]| rig.cli(args);
    let o = admin(&["cancel", id]);
    assert_eq!(o.status.code(), Some(13));
    assert_eq!(
        text(&o.stderr),
        format!("scriptgate cancel: script {id} had already finished (ok); nothing to cancel\n")
    );
    let o = admin(&["cancel", id, "--json"]);
    assert_eq!(o.status.code(), Some(13));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        (v["state"].as_str(), v["already_finished"].as_bool()),
        (Some("ok"), Some(true))
    );
    let o = admin(&["cancel", "0123456789abcdef"]);
    assert_eq!(o.status.code(), Some(13));
    assert_eq!(
        text(&o.stderr),
        "scriptgate cancel: no script 0123456789abcdef is running or recorded\n"
    );
    // A running one is cancelled, and says so.
    let sid = e
        .start(
            &rig.token(&rig.snapshot("auto")),
            "import time\ntime.sleep(60)",
            &[],
        )
        .unwrap();
    let o = admin(&["cancel", &sid]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    assert_eq!(text(&o.stdout), format!("{sid}: cancelled\n"));
}

/// A `[[auth.engine]]` user that uses `workspace.roots` finds `<root>/<uid>`
/// when the daemon has started, before it first connects: examples/engine.py
/// prepares its workspace there first, and failed with PermissionError when
/// the directory was made only on the first connection.
#[test]
#[ignore = "needs root (directories of other uids): cargo test --test it users:: -- --include-ignored"]
fn engine_entries_get_their_per_uid_directories_when_the_daemon_starts() {
    require_root("directories of other uids");
    let d = tempfile::Builder::new()
        .prefix("sg-users-")
        .tempdir()
        .unwrap();
    std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let nobody = nix::unistd::User::from_name("nobody").unwrap().unwrap();
    let (uid, gid) = (nobody.uid.as_raw(), nobody.gid.as_raw());
    let k = d.path().join("nobody.key");
    write_key(&k, b"engine-n-engine-n-engine-n-engine-n!", gid);
    let rig = rig_with_auth(
        &format!("[[auth.engine]]\nuser = \"nobody\"\ntoken_key_file = {k:?}\n"),
        "",
    );
    // No connection as nobody: the daemon made it at start.
    assert_eq!(
        mode_owner(&rig.root.join(uid.to_string())),
        (0o700, uid, gid)
    );
}
