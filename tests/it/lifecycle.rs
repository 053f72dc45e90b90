//! The daemon's life as a sysadmin sees it (issue 13): counts that survive a kill,
//! workspace retention, metrics. Real daemon, real socket, real SQLite file, real
//! sandbox.
use crate::common::*;
use serde_json::json;
use std::ffi::OsStr;
use std::time::{Duration, Instant};

/// The audit row's counts are kept current while the script runs: a kill -9 of
/// the daemon leaves the real counts, the same as calls.jsonl holds, not 0.
#[test]
#[ignore = "needs root: the daemon runs scripts as nobody (cargo test -- --include-ignored, as root)"]
fn counts_survive_a_kill_9() {
    require_root("scripts run as nobody");
    let mut rig = Rig::new();
    let token = rig.token(&rig.snapshot("auto"));
    let e = rig.engine();
    let code = "import agent_tools, time\n\
                for i in range(7):\n    agent_tools.call('fleet__list_devices', {})\n\
                for i in range(3):\n    try:\n        agent_tools.call('fleet__fail', {})\n    except Exception:\n        pass\n\
                print('called', flush=True)\ntime.sleep(600)\n";
    let id = e.start(&token, code, &[]).unwrap();
    let out = rig.details(&id).join("output.txt");
    eventually("the calls", Duration::from_secs(20), || {
        std::fs::read_to_string(&out).unwrap_or_default() == "called\n"
    });
    // Within a tick (2 s) of the last call, the running row has the counts.
    let db = rig.state.join("scriptgate.db");
    let row = |db: &std::path::Path| -> (String, i64, i64) {
        let c =
            rusqlite::Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
                .unwrap();
        c.query_row(
            "SELECT status, calls, failures FROM scripts WHERE script_id = ?1",
            [&id],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .unwrap()
    };
    eventually(
        "the counts in the running row",
        Duration::from_secs(5),
        || row(&db) == ("running".into(), 10, 3),
    );
    rig.stop(nix::sys::signal::Signal::SIGKILL);
    // Reopened: the row is interrupted, with the counts calls.jsonl holds.
    rig.start();
    let r = rig
        .engine()
        .request("script.wait", json!({"script_id": id, "token": token}))
        .unwrap();
    assert_eq!(r["status"], "interrupted", "{r}");
    let log = std::fs::read_to_string(rig.details(&id).join("calls.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let failed = lines.iter().filter(|l| l["is_error"] == true).count();
    assert_eq!((lines.len(), failed), (10, 3), "{log}");
    assert_eq!(row(&db), ("interrupted".into(), 10, 3));
    assert_eq!(
        (r["calls"].as_u64(), r["failures"].as_u64()),
        (Some(10), Some(3))
    );
    assert!(
        r["text"]
            .as_str()
            .unwrap()
            .starts_with("run_script interrupted: 10 calls"),
        "{r}"
    );
}

/// `scriptgate metrics` parsed: `name{labels}` → value; every sample's family
/// has its `# TYPE`.
fn parse_metrics(text: &str) -> std::collections::BTreeMap<String, f64> {
    let mut typed = std::collections::BTreeSet::new();
    let mut out = std::collections::BTreeMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            typed.insert(rest.split(' ').next().unwrap().to_string());
            continue;
        }
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let (name, value) = line.rsplit_once(' ').unwrap();
        let family = name.split('{').next().unwrap();
        let base = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| family.strip_suffix(s).filter(|b| typed.contains(*b)))
            .unwrap_or(family);
        assert!(typed.contains(base), "{line}: no # TYPE for {base}");
        let v: f64 = if value == "+Inf" {
            f64::INFINITY
        } else {
            value.parse().unwrap()
        };
        out.insert(name.to_string(), v);
    }
    out
}

fn metrics(rig: &Rig, extra: &[&str]) -> String {
    let o = rig.cli(["metrics"].iter().chain(extra));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout).unwrap()
}

/// Scripts with known outcomes, a refusal and one still running: the metrics say
/// exactly that, and keep saying it across a kill -9 and restart.
#[test]
#[ignore = "needs root: the daemon runs scripts as nobody (cargo test -- --include-ignored, as root)"]
fn metrics_count_what_happened_and_survive_a_restart() {
    require_root("scripts run as nobody");
    let mut rig = Rig::new();
    let e = rig.engine();
    let token = rig.token(&rig.snapshot("auto"));
    let ok = "import agent_tools\nagent_tools.call('fleet__list_devices', {})\nagent_tools.call('fleet__list_devices', {})\ntry:\n    agent_tools.call('fleet__fail', {})\nexcept Exception:\n    pass\n";
    assert_eq!(e.run(&token, ok, &[])["status"], "ok");
    assert_eq!(e.run(&token, "raise SystemExit(3)", &[])["status"], "error");
    let mut snap = rig.snapshot("auto");
    snap["limits"] = json!({"timeout_s": 1});
    let r = e.run(&rig.token(&snap), "import time\ntime.sleep(30)", &[]);
    assert_eq!(r["status"], "timeout", "{r}");
    let expired = rig.token_for("late", &rig.snapshot("auto"), -5);
    assert_eq!(
        code_reason(&e.start(&expired, "print(1)", &[]).unwrap_err()).1,
        "expired"
    );
    let running = e
        .start(&token, "import time\ntime.sleep(600)", &[])
        .unwrap();

    let text = metrics(&rig, &[]);
    let m = parse_metrics(&text);
    let get = |k: &str| *m.get(k).unwrap_or_else(|| panic!("no {k} in\n{text}"));
    assert_eq!(get("scriptgate_scripts_started_total"), 4.0, "{text}");
    assert_eq!(get("scriptgate_scripts_finished_total{status=\"ok\"}"), 1.0);
    assert_eq!(
        get("scriptgate_scripts_finished_total{status=\"error\"}"),
        1.0
    );
    assert_eq!(
        get("scriptgate_scripts_finished_total{status=\"timeout\"}"),
        1.0
    );
    assert_eq!(
        get("scriptgate_scripts_finished_total{status=\"interrupted\"}"),
        0.0
    );
    assert_eq!(get("scriptgate_scripts_running"), 1.0);
    assert_eq!(get("scriptgate_tool_calls_total"), 3.0);
    assert_eq!(get("scriptgate_tool_call_failures_total"), 1.0);
    assert_eq!(
        get("scriptgate_start_refusals_total{reason=\"expired\"}"),
        1.0
    );
    assert_eq!(get("scriptgate_script_duration_seconds_count"), 3.0);
    assert_eq!(
        get("scriptgate_script_duration_seconds_bucket{le=\"+Inf\"}"),
        3.0
    );
    assert!(
        get("scriptgate_script_duration_seconds_bucket{le=\"0.5\"}") <= 2.0,
        "the timeout ran a second: {text}"
    );
    assert_eq!(
        get("scriptgate_script_duration_seconds_bucket{le=\"5\"}"),
        3.0,
        "{text}"
    );
    assert!(get("scriptgate_script_duration_seconds_sum") >= 1.0);
    assert_eq!(
        get(&format!(
            "scriptgate_daemon_info{{version=\"{}\",backend=\"{RIG_BACKEND}\"}}",
            env!("CARGO_PKG_VERSION")
        )),
        1.0,
        "{text}"
    );
    assert_eq!(
        get("scriptgate_limits_enforced_per_script"),
        0.0,
        "rlimit shares limits per uid"
    );
    // The start-up preflight's findings (daemon.info's limits_enforced and sandbox).
    assert_eq!(get("scriptgate_limits_enforced"), 1.0, "{text}");
    assert_eq!(get("scriptgate_sandbox_available"), 1.0, "{text}");

    // --output: the same text, written atomically (no temporary file left).
    let out_dir = tempfile::tempdir().unwrap();
    let prom = out_dir.path().join("scriptgate.prom");
    assert_eq!(metrics(&rig, &["--output", prom.to_str().unwrap()]), "");
    assert_eq!(std::fs::read_to_string(&prom).unwrap(), text);
    assert_eq!(std::fs::read_dir(out_dir.path()).unwrap().count(), 1);

    // kill -9 and a restart: the counters are in the store, and the script that
    // was running is counted as interrupted.
    rig.stop(nix::sys::signal::Signal::SIGKILL);
    rig.start();
    let r = rig
        .engine()
        .request("script.wait", json!({"script_id": running, "token": token}))
        .unwrap();
    assert_eq!(r["status"], "interrupted");
    let m = parse_metrics(&metrics(&rig, &[]));
    assert_eq!(m["scriptgate_scripts_started_total"], 4.0);
    assert_eq!(
        m["scriptgate_scripts_finished_total{status=\"interrupted\"}"],
        1.0
    );
    assert_eq!(m["scriptgate_scripts_finished_total{status=\"ok\"}"], 1.0);
    assert_eq!(m["scriptgate_scripts_running"], 0.0);
    assert_eq!(m["scriptgate_script_duration_seconds_count"], 4.0);
}

/// A running script's calls count in the totals before it ends (as of the
/// daemon's 2 s checkpoint of its row), and are not counted again when it does.
#[test]
#[ignore = "needs root: the daemon runs scripts as nobody (cargo test -- --include-ignored, as root)"]
fn metrics_count_running_scripts_calls_once() {
    require_root("scripts run as nobody");
    let rig = Rig::new();
    let e = rig.engine();
    let token = rig.token(&rig.snapshot("auto"));
    let code = "import agent_tools, time\nfor _ in range(3):\n    agent_tools.call('fleet__list_devices', {})\ntry:\n    agent_tools.call('fleet__fail', {})\nexcept Exception:\n    pass\ntime.sleep(600)\n";
    let id = e.start(&token, code, &[]).unwrap();
    // The checkpoint is the event waited for; the deadline only bounds a failure.
    let deadline = Instant::now() + Duration::from_secs(30);
    let m = loop {
        let m = parse_metrics(&metrics(&rig, &[]));
        if m["scriptgate_tool_calls_total"] == 4.0 || Instant::now() > deadline {
            break m;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(m["scriptgate_scripts_running"], 1.0);
    assert_eq!(m["scriptgate_tool_calls_total"], 4.0, "{m:?}");
    assert_eq!(m["scriptgate_tool_call_failures_total"], 1.0, "{m:?}");
    e.request("script.cancel", json!({"script_id": id}))
        .unwrap();
    assert_eq!(e.wait(&id)["status"], "cancelled");
    let m = parse_metrics(&metrics(&rig, &[]));
    assert_eq!(m["scriptgate_scripts_running"], 0.0);
    assert_eq!(m["scriptgate_tool_calls_total"], 4.0, "not counted twice");
    assert_eq!(m["scriptgate_tool_call_failures_total"], 1.0);
}

/// Set a directory's modification time `days` ago.
fn age(p: &std::path::Path, days: u64) {
    let t = std::time::SystemTime::now() - Duration::from_secs(days * 86_400);
    std::fs::File::open(p).unwrap().set_modified(t).unwrap();
}

fn age_workspace(ws: &std::path::Path, days: u64) {
    for p in [
        ws.join(".agent/scripts"),
        ws.join(".agent/workspace.json"),
        ws.to_path_buf(),
    ] {
        if p.exists() {
            age(&p, days);
        }
    }
}

fn prune(rig: &Rig, extra: &[&str]) -> std::process::Output {
    rig.cli(["prune"].iter().chain(extra))
}

/// `scriptgate run` through the daemon makes a fresh workspace marked as
/// scriptgate's; once unused for `workspace.retain_days` (30 by default)
/// `scriptgate prune --dry-run` names it and `scriptgate prune` removes it, while
/// an engine's own workspace, however old, and a marked one a script still runs
/// in are kept.
#[test]
#[ignore = "needs root: scripts run as nobody, and the test ages directories (cargo test -- --include-ignored, as root)"]
fn prune_removes_only_old_workspaces_scriptgate_created() {
    require_root("scripts run as nobody");
    let rig = Rig::new();
    let time =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/mcp/venv/bin/mcp-server-time");
    assert!(
        time.exists(),
        "{} is missing: run tools/install-deps first",
        time.display()
    );
    let script = rig.dir.path().join("s.py");
    std::fs::write(&script, "print('hi')\n").unwrap();
    let cli_run = || {
        let mcp = format!("time={}", time.display());
        let o = rig.cli([
            OsStr::new("run"),
            "--mcp".as_ref(),
            mcp.as_ref(),
            script.as_ref(),
        ]);
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert_eq!(o.status.code(), Some(0), "{err}");
        let ws = err
            .lines()
            .find_map(|l| l.strip_prefix("scriptgate: workspace "))
            .unwrap_or_else(|| panic!("{err}"))
            .to_string();
        std::path::PathBuf::from(ws)
    };
    let done = cli_run();
    let busy = cli_run();
    let marker: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(done.join(".agent/workspace.json")).unwrap())
            .unwrap();
    assert_eq!(marker["created_by"], "scriptgate run", "{marker}");
    // The engine's own workspace, used by a script; and a script still running in
    // the second CLI workspace.
    let e = rig.engine();
    assert_eq!(
        e.run(&rig.token(&rig.snapshot("auto")), "print(1)", &[])["status"],
        "ok"
    );
    let running = e
        .start(
            &rig.token(&fleet_snapshot(&busy, "auto")),
            "import time\ntime.sleep(600)",
            &[],
        )
        .unwrap();
    for ws in [&done, &busy, &rig.workspace] {
        age_workspace(ws, 40);
    }
    // And the daemon's record of their last start (retention goes by both).
    let c = rusqlite::Connection::open(rig.state.join("scriptgate.db")).unwrap();
    c.busy_timeout(Duration::from_secs(10)).unwrap();
    c.execute(
        "UPDATE workspaces SET last_at = ?1",
        [std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as i64
            - 40 * 86_400_000],
    )
    .unwrap();

    let o = prune(&rig, &["--dry-run"]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    // The daemon's pass (admin.prune), under a line naming its roots.
    assert_eq!(
        out.lines().next().unwrap(),
        format!(
            "workspaces under {} (workspace.roots), by the daemon at {}:",
            rig.root.display(),
            rig.socket.display()
        ),
        "{out}"
    );
    // The listing (issue 35 item 3), then the line per workspace due.
    assert!(
        out.lines().nth(1).unwrap().starts_with("WORKSPACE "),
        "{out}"
    );
    assert!(
        out.lines()
            .any(|l| l.starts_with(&format!("{} ", done.display()))
                && l.contains("removed at this pass")),
        "{out}"
    );
    assert_eq!(
        out.lines()
            .find(|l| l.starts_with("would remove "))
            .unwrap()
            .split(" (last used")
            .next()
            .unwrap(),
        format!("would remove {}", done.display()),
        "{out}"
    );
    // Then root's own embedded workspaces: none here.
    assert!(
        out.ends_with(&format!(
            "1 workspace would be removed (unused for more than 30 days); 1 kept (recent or in use)\n\
             no embedded workspaces of uid 0: {} has no audit store\n",
            rig.state.join("cli").display()
        )),
        "{out}"
    );
    assert!(done.exists(), "a dry run removes nothing");

    let o = prune(&rig, &[]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        out.lines()
            .nth(1)
            .unwrap()
            .starts_with(&format!("removed {} (last used ", done.display())),
        "{out}"
    );
    assert!(!done.exists());
    assert!(
        busy.join(".agent/scripts").join(&running).exists(),
        "in use: kept"
    );
    assert!(
        rig.workspace.join(".agent/scripts").exists(),
        "an engine's own workspace: kept"
    );
    // Removed and forgotten by the daemon: the next pass has nothing.
    let o = prune(&rig, &[]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.lines()
            .nth(1)
            .unwrap()
            .starts_with("0 workspaces removed"),
        "{out}"
    );
}

/// A fresh installation, before its first script, has no audit store: the
/// metrics are all 0 and the scrape succeeds (node_exporter's timer must not fail).
#[test]
#[ignore = "needs root: the metrics are for root and the admin groups (cargo test -- --include-ignored, as root)"]
fn metrics_before_the_first_script_are_zero() {
    require_root("the metrics are for admins");
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("scriptgate.toml");
    let state = dir.path().join("state");
    std::fs::write(&cfg, format!("[state]\ndir = {state:?}\n")).unwrap();
    let o = cli([OsStr::new("metrics"), "--config".as_ref(), cfg.as_ref()]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        text.contains("\nscriptgate_scripts_started_total 0\n"),
        "{text}"
    );
    assert!(text.contains("\nscriptgate_scripts_running 0\n"), "{text}");
    assert!(
        !state.join("scriptgate.db").exists(),
        "a scrape creates nothing"
    );
}

/// A stop's drain ends with a barrier on the connections' answers, not a fixed
/// grace: 24 connections wait (`script.wait`, by the run's token) on a script
/// that prints 20,000 characters; the daemon is told to stop, and then the
/// script ends: every wait is answered with the whole result before the daemon
/// exits, and it exits 0.
#[test]
#[ignore = "needs root: the script runs as nobody (cargo test -- --include-ignored, as root)"]
fn a_stopping_daemon_writes_every_waiting_answer_before_it_exits() {
    require_root("the script runs as nobody");
    let mut rig = Rig::new();
    let e = rig.engine();
    let token = rig.token(&rig.snapshot("auto"));
    let code = "import os, time\nwhile not os.path.exists('go'):\n    time.sleep(0.02)\nprint('x' * 20000)\n";
    let id = e.start(&token, code, &[]).unwrap();
    let waiters: Vec<Engine> = (0..24).map(|_| rig.engine()).collect();
    let answers: Vec<_> = waiters
        .iter()
        .map(|w| {
            let rx = w.send_request("script.wait", json!({"script_id": id, "token": token}));
            // Answered after the wait was read: requests are read in order.
            w.request("script.status", json!({"script_id": id, "token": token}))
                .unwrap();
            rx
        })
        .collect();
    let pid = nix::unistd::Pid::from_raw(rig.daemon.as_ref().unwrap().id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    // Draining: a new start is refused as `stopping`.
    eventually("the drain", Duration::from_secs(10), || {
        e.start(&token, "print(1)", &[])
            .is_err_and(|err| code_reason(&err).1 == "stopping")
    });
    std::fs::write(rig.workspace.join("go"), "").unwrap();
    for rx in answers {
        let m = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("every wait answered before the exit");
        assert_eq!(m["result"]["status"], "ok", "{m}");
        assert_eq!(m["result"]["output"].as_str().unwrap().len(), 20000);
    }
    let st = rig.daemon.take().unwrap().wait().unwrap();
    assert!(st.success(), "{st}: {}", rig.log_text());
    assert!(
        rig.log_text()
            .contains("every running script finished; stopping"),
        "{}",
        rig.log_text()
    );
}
