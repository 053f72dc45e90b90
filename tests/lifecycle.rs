//! The daemon's life as a sysadmin sees it (issue 13): counts that survive a kill,
//! workspace retention, metrics. Real daemon, real socket, real SQLite file, real
//! sandbox.
mod common;
use common::*;
use serde_json::json;
use std::time::Duration;

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
