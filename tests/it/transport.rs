//! The socket, the framing, the peer check, bad input, and daemon life cycle.
use crate::common::*;
use serde_json::{json, Value};
use std::ffi::OsStr;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

fn line_client(rig: &Rig) -> (UnixStream, BufReader<UnixStream>) {
    let s = UnixStream::connect(&rig.socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let r = BufReader::new(s.try_clone().unwrap());
    (s, r)
}

fn next(r: &mut BufReader<UnixStream>) -> Value {
    let mut l = String::new();
    r.read_line(&mut l).unwrap();
    serde_json::from_str(&l).unwrap_or_else(|_| panic!("not JSON: {l:?}"))
}

#[test]
fn malformed_json_unknown_methods_and_bad_params_keep_the_connection() {
    let rig = Rig::new();
    let (mut s, mut r) = line_client(&rig);
    s.write_all(b"{this is not json\n").unwrap();
    let m = next(&mut r);
    assert_eq!(m["error"]["code"], -32700);
    assert_eq!(m["id"], Value::Null);
    s.write_all(b"{\"jsonrpc\":\"2.0\",\"id\":7,\"method\":\"script.launch\",\"params\":{}}\n")
        .unwrap();
    let m = next(&mut r);
    assert_eq!(
        (m["id"].as_i64(), m["error"]["code"].as_i64()),
        (Some(7), Some(-32601))
    );
    s.write_all(
        b"{\"jsonrpc\":\"2.0\",\"id\":8,\"method\":\"script.start\",\"params\":{\"code\":1}}\n",
    )
    .unwrap();
    let m = next(&mut r);
    assert_eq!(
        (m["id"].as_i64(), m["error"]["code"].as_i64()),
        (Some(8), Some(-32602))
    );
    s.write_all(b"[1,2,3]\n").unwrap();
    assert_eq!(next(&mut r)["error"]["code"], -32600);
    s.write_all(b"{\"jsonrpc\":\"2.0\",\"id\":9,\"method\":\"daemon.info\"}\n")
        .unwrap();
    let m = next(&mut r);
    assert_eq!(m["id"], 9);
    assert_eq!(m["result"]["protocol"], 1);
    assert_eq!(m["result"]["backend"], RIG_BACKEND);
    // The rig sets no [scripts]: the daemon reports the built-in defaults.
    let d = scriptgate::config::Scripts::default();
    assert_eq!(m["result"]["limits"]["max_calls"], d.max_calls);
    assert_eq!(m["result"]["limits"]["timeout_s"], d.timeout_s);
}

#[test]
fn an_oversized_line_gets_32600_and_the_connection_closes() {
    let rig = Rig::with_config("[server]\nmax_message_bytes = 4096\n");
    let (mut s, mut r) = line_client(&rig);
    let mut big = vec![b'x'; 10_000];
    big.push(b'\n');
    let _ = s.write_all(&big);
    let m = next(&mut r);
    assert_eq!(m["error"]["code"], -32600, "{m}");
    let mut rest = String::new();
    assert_eq!(
        r.read_to_string(&mut rest).unwrap_or(0),
        0,
        "connection closed after the error"
    );
    // The daemon is still up for others.
    assert_eq!(
        rig.engine().request("daemon.info", json!({})).unwrap()["protocol"],
        1
    );
}

#[test]
fn garbage_on_the_tool_channel_loses_nothing() {
    let rig = Rig::with_config("[server]\nmax_message_bytes = 65536\n");
    let e = rig.engine();
    let code = r#"
import os, agent_tools
agent_tools.call("fleet__list_devices", {})   # opens the channel
os.write(3, b"garbage\n{]\n[1]\n" + b"y" * 200000 + b"\n" + b'{"op": "explode", "id": 99}\n')
print(agent_tools.call("fleet__get_device_status", {"sn": "SN3"})["sn"])
"#;
    let r = e.run(&rig.token(&rig.snapshot("auto")), code, &[]);
    assert_eq!(r["status"], "ok", "{r}");
    assert_eq!(r["output"], "SN3\n");
    assert_eq!(r["calls"], 2);
    assert_eq!(e.request("daemon.info", json!({})).unwrap()["protocol"], 1);
}

#[test]
#[ignore = "needs root (cargo test -- --include-ignored, as root)"]
fn peers_outside_the_allowed_groups_are_refused() {
    require_root("connects as another uid");
    let rig = Rig::new();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&rig.socket, std::fs::Permissions::from_mode(0o666)).unwrap();
    let probe = format!(
        "import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({:?})\nf = s.makefile()\nprint(f.readline().strip())\nprint(repr(f.readline()))\n",
        rig.socket.to_str().unwrap()
    );
    use std::os::unix::process::CommandExt;
    let out = std::process::Command::new("/usr/bin/python3")
        .arg("-c")
        .arg(probe)
        .uid(NOBODY)
        .gid(NOBODY)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let mut lines = text.lines();
    let first: Value = serde_json::from_str(lines.next().unwrap_or(""))
        .unwrap_or_else(|_| panic!("{text} {}", String::from_utf8_lossy(&out.stderr)));
    assert_eq!(first["error"]["code"], -32001, "{first}");
    assert_eq!(lines.next(), Some("''"), "disconnected after the refusal");
}

#[test]
fn scripts_are_visible_to_their_connection_or_a_token_of_their_run() {
    let rig = Rig::new();
    let e = rig.engine();
    let token = rig.token(&rig.snapshot("auto"));
    let r = e.run(&token, "print('hi')", &[]);
    let id = r["script_id"].as_str().unwrap();
    let other = rig.engine();
    // Root is no exception here: engine methods follow protocol §4 for every peer.
    let nf = other
        .request("script.wait", json!({"script_id": id}))
        .unwrap_err();
    assert_eq!(code_reason(&nf), (-32016, "not_found".into()));
    let wrong_run = rig.token_for("run-2", &rig.snapshot("auto"), 60);
    assert_eq!(
        other
            .request(
                "script.status",
                json!({"script_id": id, "token": wrong_run})
            )
            .unwrap_err()["code"],
        -32016
    );
    assert_eq!(
        other
            .request("script.wait", json!({"script_id": id, "token": token}))
            .unwrap(),
        r
    );
    assert_eq!(
        other
            .request("script.cancel", json!({"script_id": "nope"}))
            .unwrap_err()["code"],
        -32016
    );
}

#[test]
fn results_survive_a_restart_and_sigterm_interrupts_running_scripts() {
    // drain_s = 0: SIGTERM interrupts at once (the drain is tested in tests/it/systemd.rs).
    let mut rig = Rig::with_config("[server]\ndrain_s = 0\n");
    let token = rig.token(&rig.snapshot("auto"));
    let e = rig.engine();
    let done = e.run(&token, "print('kept')", &[]);
    let running = e
        .start(
            &token,
            "import time\nprint('started', flush=True)\ntime.sleep(600)\n",
            &[],
        )
        .unwrap();
    eventually("output", Duration::from_secs(10), || {
        std::fs::read_to_string(rig.details(&running).join("output.txt")).unwrap_or_default()
            == "started\n"
    });
    rig.stop(nix::sys::signal::Signal::SIGTERM);
    rig.start();
    let e = rig.engine();
    let r = e
        .request(
            "script.wait",
            json!({"script_id": done["script_id"], "token": token}),
        )
        .unwrap();
    assert_eq!(r, done);
    let r = e
        .request("script.wait", json!({"script_id": running, "token": token}))
        .unwrap();
    assert_eq!(r["status"], "interrupted", "{r}");
    assert_eq!(
        r["output"], "started\n",
        "output printed before the stop is kept"
    );
    assert!(r["text"]
        .as_str()
        .unwrap()
        .starts_with("run_script interrupted:"));
}

#[test]
fn kill_9_mid_script_leaves_an_interrupted_record_and_no_process() {
    let mut rig = Rig::new();
    let token = rig.token(&rig.snapshot("auto"));
    let e = rig.engine();
    let marker = format!("sg-kill9-marker-{}", std::process::id());
    let code = format!("import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', '{marker}'], start_new_session=True)\ntime.sleep(600)\n");
    let id = e.start(&token, &code, &[]).unwrap();
    eventually("child", Duration::from_secs(10), || {
        processes_with(&marker).len() == 1
    });
    rig.stop(nix::sys::signal::Signal::SIGKILL);
    eventually(
        "no process left after kill -9",
        Duration::from_secs(10),
        || processes_with(&marker).is_empty(),
    );
    rig.start();
    let r = rig
        .engine()
        .request("script.wait", json!({"script_id": id, "token": token}))
        .unwrap();
    assert_eq!(r["status"], "interrupted");
    let db = rusqlite::Connection::open(rig.state.join("scriptgate.db")).unwrap();
    let ok: String = db
        .query_row("PRAGMA integrity_check", [], |r| r.get(0))
        .unwrap();
    assert_eq!(ok, "ok");
    // Its journal entry is written at the restart (stderr here: no journal socket).
    let log = rig.log_text();
    assert!(
        log.contains(&format!("script {id} of run run-1 finished: interrupted")),
        "{log}"
    );
    assert!(
        log.contains(scriptgate::audit::journal::SCRIPT_FINISHED),
        "the entry carries its MESSAGE_ID: {log}"
    );
}

#[test]
fn max_running_refuses_with_32015() {
    let rig = Rig::with_config("[server]\nmax_running = 1\n");
    let e = rig.engine();
    let token = rig.token(&rig.snapshot("auto"));
    let id = e.start(&token, "import time\ntime.sleep(60)", &[]).unwrap();
    let err = e.start(&token, "print(1)", &[]).unwrap_err();
    assert_eq!(err["code"], -32015);
    e.request("script.cancel", json!({"script_id": id}))
        .unwrap();
    assert_eq!(
        e.run(&token, "print(2)", &[])["status"],
        "ok",
        "the slot is free again"
    );
}

#[test]
fn bad_config_or_key_stops_the_daemon_before_any_socket_exists() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("s.sock");
    let cfg = dir.path().join("c.toml");
    let key = dir.path().join("k");
    std::fs::write(&key, b"too short").unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
    let run = |text: &str| {
        crate::common::shared();
        std::fs::write(&cfg, text).unwrap();
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_scriptgated"))
            .arg("--listen")
            .arg(&sock)
            .arg("--config")
            .arg(&cfg)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1));
        assert!(!sock.exists(), "no socket may be created");
        String::from_utf8_lossy(&out.stderr).to_string()
    };
    let err = run("[server]\nmax_running = 4\nmax_runing = 5\n");
    assert!(
        err.contains(cfg.to_str().unwrap()) && err.contains("line 3") && err.contains("max_runing"),
        "{err}"
    );
    let err = run("[scripts]\ntimeout_s = \"long\"\n");
    assert!(err.contains("line 2"), "{err}");
    let err = run(&format!("[auth]\ntoken_key_file = {key:?}\n"));
    assert!(
        err.contains(key.to_str().unwrap()) && err.contains("at least 32"),
        "{err}"
    );
    let err = run(&format!(
        "[auth]\ntoken_key_file = {:?}\n",
        dir.path().join("missing")
    ));
    assert!(err.contains("cannot read"), "{err}");
}

#[test]
fn token_mint_cli_makes_tokens_the_daemon_accepts() {
    let rig = Rig::new();
    let snap_file = rig.dir.path().join("snap.json");
    std::fs::write(&snap_file, rig.snapshot("auto").to_string()).unwrap();
    let out = rig.cli([
        OsStr::new("token"),
        "mint".as_ref(),
        "--key".as_ref(),
        rig.key_file.as_ref(),
        "--run-id".as_ref(),
        "cli-run".as_ref(),
        "--snapshot".as_ref(),
        snap_file.as_ref(),
        "--ttl".as_ref(),
        "60".as_ref(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let token = String::from_utf8(out.stdout).unwrap();
    let r = rig.engine().run(token.trim(), "print('minted')", &[]);
    assert_eq!(
        (r["status"].as_str(), r["run_id"].as_str()),
        (Some("ok"), Some("cli-run"))
    );
}

#[test]
fn run_describe_gives_the_model_facing_description() {
    let rig = Rig::new();
    let e = rig.engine();
    let mut snap = rig.snapshot("approval");
    snap["limits"] = json!({"max_calls": 300});
    let d = e
        .request("run.describe", json!({"token": rig.token(&snap)}))
        .unwrap();
    let text = d["text"].as_str().unwrap();
    assert!(
        text.contains("at most 300 tool calls per script (4 at a time)"),
        "{text}"
    );
    assert!(
        text.contains("    tools.fleet.get_device_status(sn: str)  # fleet__get_device_status\n"),
        "{text}"
    );
    assert!(
        text.contains("    tools.fleet.reboot_device(sn: str = None)  # fleet__reboot_device\n"),
        "frozen tenant left out: {text}"
    );
    assert!(
        text.contains("    fleet__wipe_device (destructive, confirmed one call at a time)"),
        "{text}"
    );
    assert!(
        text.contains("    fleet__export_all (runs as a long task)"),
        "{text}"
    );
    assert!(
        !text.contains("fleet__retired"),
        "disabled tools are not provided"
    );
    let bad = e
        .request("run.describe", json!({"token": "x.y.z"}))
        .unwrap_err();
    assert_eq!(code_reason(&bad), (-32010, "malformed".into()));
}
