//! `systemctl reload scriptgate` (SIGHUP) through the real daemon: the live
//! keys apply to the scripts that start after it while a running one keeps
//! what it started with, a key that needs a restart is named pending, and a
//! file that does not check is refused with the running configuration kept
//! (scriptgated(8) RELOAD). The systemd unit's reload is in `systemd.rs`.

use crate::common::*;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde_json::Value;
use std::time::Duration;

fn hangup(rig: &Rig) {
    let pid = rig.daemon.as_ref().unwrap().id() as i32;
    kill(Pid::from_raw(pid), Signal::SIGHUP).unwrap();
}

/// Wait for the `n`th log line holding `what` (a reload's line), and return it.
fn nth_line(rig: &Rig, what: &str, n: usize) -> String {
    let mut line = String::new();
    eventually(what, Duration::from_secs(20), || {
        let log = rig.log_text();
        match log.lines().filter(|l| l.contains(what)).nth(n - 1) {
            Some(l) => {
                line = l.to_string();
                true
            }
            None => false,
        }
    });
    line
}

fn status(rig: &Rig) -> String {
    let o = rig.cli(["status"]);
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn status_json(rig: &Rig) -> Value {
    serde_json::from_slice(&rig.cli(["status", "--json"]).stdout).unwrap()
}

#[test]
fn a_reload_applies_live_keys_to_new_scripts_keeps_running_ones_and_refuses_a_broken_file() {
    let rig = Rig::with_config("[scripts]\ntimeout_s = 120\n");
    let e = rig.engine();
    let token = rig.token(&rig.snapshot("auto"));
    let j = status_json(&rig);
    assert_eq!(j["daemon"]["config"]["on_disk"], "same", "{j}");
    assert!(j["daemon"]["started_ms"].as_i64().unwrap() > 0, "{j}");
    let t = status(&rig);
    assert!(t.contains("config   as on disk: "), "{t}");
    assert!(t.contains(" since "), "{t}");

    // A script that runs until told, started under timeout_s = 120.
    let waits = "import os, time\nwhile not os.path.exists('stop'):\n    time.sleep(0.05)\n";
    let old = e.start(&token, waits, &[]).unwrap();

    // The file changed: status says so before the reload.
    let text = std::fs::read_to_string(&rig.config).unwrap();
    let changed =
        text.replace("timeout_s = 120", "timeout_s = 2") + "[server]\nmax_connections = 100\n";
    assert_ne!(changed, text);
    std::fs::write(&rig.config, &changed).unwrap();
    let t = status(&rig);
    assert!(t.contains("config   changed on disk since "), "{t}");
    assert!(t.contains(", not reloaded: "), "{t}");

    hangup(&rig);
    let line = nth_line(&rig, "SIGHUP: configuration reloaded", 1);
    assert!(
        line.contains("in force for new scripts: scripts.timeout_s"),
        "{line}"
    );
    let pending = nth_line(&rig, "SIGHUP: pending restart: ", 1);
    assert!(
        pending.contains("pending restart: server.max_connections ("),
        "{pending}"
    );
    assert!(pending.contains("WARN"), "{pending}");

    // A new script gets the new timeout.
    let r = e.run(&token, "import time\ntime.sleep(60)", &[]);
    assert_eq!(r["status"], "timeout", "{r}");
    // The one started before still runs: its 2 s are long past, its 120 s not.
    let s = e.request("script.status", serde_json::json!({"script_id": old}));
    assert_eq!(s.as_ref().unwrap()["state"], "running", "{s:?}");
    let j = status_json(&rig);
    let c = &j["daemon"]["config"];
    assert_eq!(c["on_disk"], "same", "{j}");
    assert_eq!(
        c["pending_restart"],
        serde_json::json!(["server.max_connections"])
    );
    assert_eq!(c["last_reload"]["error"], Value::Null, "{j}");
    assert_eq!(j["daemon"]["limits"]["timeout_s"], 2, "{j}");
    let t = status(&rig);
    assert!(
        t.contains("pending  pending restart: server.max_connections ("),
        "{t}"
    );

    // A file that does not check: refused at err, the running one kept.
    std::fs::write(
        &rig.config,
        changed.replace("timeout_s = 2", "timeout_s = \"soon\""),
    )
    .unwrap();
    hangup(&rig);
    let refused = nth_line(&rig, "SIGHUP: configuration not reloaded", 1);
    assert!(refused.contains("ERROR"), "{refused}");
    assert!(refused.contains("the running one is kept: "), "{refused}");
    assert!(
        refused.contains("invalid type: string \"soon\""),
        "{refused}"
    );
    // (`scriptgate status` reads the file too, and refuses it: daemon.info.)
    let j = e.request("daemon.info", serde_json::json!({})).unwrap();
    let c = &j["config"];
    assert_eq!(c["on_disk"], "changed", "{j}");
    assert!(
        c["last_reload"]["error"]
            .as_str()
            .unwrap()
            .contains("invalid type"),
        "{j}"
    );
    assert_eq!(j["limits"]["timeout_s"], 2, "{j}");
    let r = e.run(&token, "import time\ntime.sleep(60)", &[]);
    assert_eq!(r["status"], "timeout", "{r}");
    assert!(r["duration_ms"].as_u64().unwrap() < 30_000, "{r}");

    // The old script ends as it would have: ok, long past the new timeout.
    std::fs::write(rig.workspace.join("stop"), "").unwrap();
    let done = e.wait(&old);
    assert_eq!(done["status"], "ok", "{done}");
    assert!(done["duration_ms"].as_u64().unwrap() > 2_000, "{done}");
}
