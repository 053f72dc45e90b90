//! The systemd backend's limits, read back: a real systemd booted as PID 1 of a
//! private PID namespace (tests/systemd/boot.sh, by the rig in
//! tests/common/boot.rs that tests/it/systemd.rs boots too), the daemon run inside
//! it with `backend = "systemd"`. With the cgroup v1 memory controller mounted
//! read-only (as the container had it, in the rig's own mount namespace
//! only), systemd starts every scope all the same; the daemon must see that
//! memory_max_bytes is not in force. With it writable, no false alarm.
use crate::common::*;
use serde_json::{json, Value};
use std::process::Stdio;
use std::time::{Duration, Instant};

/// The shared boot rig (common::boot) with the daemon started in it.
struct Booted(crate::common::boot::Booted);

impl std::ops::Deref for Booted {
    type Target = crate::common::boot::Booted;
    fn deref(&self) -> &crate::common::boot::Booted {
        &self.0
    }
}

impl Booted {
    /// Boot the rig (`before` runs in its mount namespace first), then start the
    /// daemon in it, listening on a socket in `dir` (the host sees it).
    fn boot(before: &str, extra_config: &str) -> Booted {
        require_root("boots systemd in a private PID namespace");
        // A systemd in a PID namespace of its own, the host's /var: alone.
        alone();
        let booted = crate::common::boot::Booted::boot("scriptgate-envrig", before, |dir| {
            // The booted systemd has a private /tmp (and the checkout may be under it):
            // the daemon runs from a copy in the rig's directory.
            std::fs::copy(env!("CARGO_BIN_EXE_scriptgated"), dir.join("scriptgated")).unwrap();
            let d = dir.display();
            std::fs::write(
                dir.join("scriptgate.toml"),
                format!(
                    "[auth]\ntoken_key_file = \"{d}/token.key\"\n[workspace]\nroots = [\"{d}/roots\"]\n\
                     [state]\ndir = \"{d}/state\"\n[scripts]\nmemory_max_bytes = 209715200\n\
                     [sandbox]\nbackend = \"systemd\"\n{extra_config}"
                ),
            )
            .unwrap();
        });
        let mut rig = Booted(booted);
        let log = std::fs::File::create(rig.dir.join("daemon.log")).unwrap();
        let sock = rig.dir.join("sock");
        let cfg = rig.dir.join("scriptgate.toml");
        let daemon = rig
            .nsenter(&[rig.dir.join("scriptgated").to_str().unwrap()])
            .arg("--listen")
            .arg(&sock)
            .arg("--config")
            .arg(&cfg)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        rig.0.daemon = Some(daemon);
        let t0 = Instant::now();
        while std::os::unix::net::UnixStream::connect(&sock).is_err() {
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "no socket: {}",
                rig.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        rig
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("daemon.log")).unwrap_or_default()
    }

    fn engine(&self) -> Engine {
        Engine::connect(&self.dir.join("sock"))
    }

    fn token(&self) -> String {
        let snap = fleet_snapshot(&self.dir.join("roots/ws"), "auto");
        scriptgate::protocol::token::mint(KEY, "rig-run", Some("rig"), &snap, 600).unwrap()
    }
}

/// The start-up line, from the rig's journal (the daemon logs there when it has
/// one), and its journal priority.
fn ready_line(rig: &Booted) -> (String, String) {
    let t0 = Instant::now();
    loop {
        let o = rig
            .nsenter(&["journalctl", "--no-pager", "-o", "json"])
            .output()
            .unwrap();
        let found = String::from_utf8_lossy(&o.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .find(|v| {
                v["MESSAGE"]
                    .as_str()
                    .is_some_and(|m| m.starts_with("scriptgated ready"))
            });
        if let Some(v) = found {
            return (
                v["MESSAGE"].as_str().unwrap().to_string(),
                v["PRIORITY"].as_str().unwrap_or("").to_string(),
            );
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "no ready line: {}",
            rig.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
#[ignore = "needs root: boots systemd in a private PID namespace"]
fn a_read_only_memory_controller_is_seen_and_refused_when_required() {
    // Read-only in the rig's mount namespace only (propagation is private).
    let rig = Booted::boot(
        "mount -o remount,bind,ro /sys/fs/cgroup/memory",
        "require_enforced_limits = true\n",
    );
    let (line, priority) = ready_line(&rig);
    assert_eq!(
        priority, "3",
        "required and not in force: no script can run, err: {line}"
    );
    assert!(
        line.contains("(backend systemd; as configured; LIMITS NOT ENFORCED: memory_max_bytes = 209715200 is not in force: the script is in memory cgroup "),
        "{line}"
    );
    let e = rig.engine();
    let info = e.request("daemon.info", json!({})).unwrap();
    assert_eq!(info["backend"], "systemd", "{info}");
    assert_eq!(info["limits_enforced"], false, "{info}");
    let notes: Vec<String> = serde_json::from_value(info["backend_notes"].clone()).unwrap();
    assert!(
        notes[0].starts_with("memory_max_bytes = 209715200 is not in force"),
        "{notes:?}"
    );
    assert!(
        !notes.iter().any(|n| n.starts_with("tasks_max")),
        "the pids controller is writable, and its limit is in force: {notes:?}"
    );
    let refused: Value = e.start(&rig.token(), "print('never')", &[]).unwrap_err();
    assert_eq!(
        code_reason(&refused),
        (-32603, "limits_not_enforced".to_string()),
        "{refused}"
    );
}

#[test]
#[ignore = "needs root: boots systemd in a private PID namespace"]
fn writable_controllers_are_read_back_as_in_force() {
    let rig = Booted::boot("true", "require_enforced_limits = true\n");
    let (line, priority) = ready_line(&rig);
    assert_eq!(priority, "5", "in force: notice: {line}");
    assert!(
        line.contains("(backend systemd; as configured; limits in force; sandbox ok"),
        "{line}"
    );
    let e = rig.engine();
    let info = e.request("daemon.info", json!({})).unwrap();
    assert_eq!(info["limits_enforced"], true, "{info}");
    assert_eq!(info["backend_notes"], json!([]), "{info}");
    // All scripts together: scriptgate.slice carries the bound (here derived:
    // 4096 tasks), set over D-Bus at start and read back (on this hybrid host
    // from the v1 hierarchies).
    let all = &info["all_scripts"];
    assert_eq!(
        (&all["tasks_max"], &all["in_force"], &all["problem"]),
        (&json!(4096), &json!(true), &json!(null)),
        "{info}"
    );
    let o = rig
        .nsenter(&["systemctl", "show", "-P", "TasksMax", "scriptgate.slice"])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), "4096", "{o:?}");
    let r = e.run(&rig.token(), "print('in force')", &[]);
    assert_eq!(r["status"], "ok", "{r}");
    assert!(r.get("backend_notes").is_none(), "{r}");

    // The controller goes read-only after start-up: the start-up check passed, so
    // the start is accepted; the script's own read-back fails, and it ends before
    // it runs (the gate stays shut), saying why.
    let o = rig
        .nsenter(&["mount", "-o", "remount,bind,ro", "/sys/fs/cgroup/memory"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{o:?}");
    let marker = rig.dir.join("roots/ws/ran");
    let code = format!("open({:?}, 'w').write('x')", marker.display().to_string());
    let r = e.run(&rig.token(), &code, &[]);
    assert_eq!(r["status"], "error", "{r}");
    let err = r["error"].as_str().unwrap();
    assert!(err.starts_with("limits not enforced: memory_max_bytes = 209715200 is not in force: the script is in memory cgroup "), "{r}");
    assert!(
        err.contains("sandbox.require_enforced_limits = true"),
        "{r}"
    );
    assert!(
        r["backend_notes"][0]
            .as_str()
            .unwrap()
            .starts_with("memory_max_bytes = 209715200 is not in force"),
        "{r}"
    );
    assert!(!marker.exists(), "the script never ran");
}

/// `admin.list`'s resources under a real unit: a script holding 64 MiB in its
/// scope is read from its cgroups (here a hybrid host: the v1 memory, pids and
/// cpuacct controllers), not from /proc; the tasks are the scope's (bwrap, the
/// init, python and the keeper).
#[test]
#[ignore = "needs root: boots systemd in a private PID namespace"]
fn ps_reads_a_running_scripts_scope() {
    let rig = Booted::boot("true", "");
    let e = rig.engine();
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let tx = std::sync::Mutex::new(tx);
    let fleet = fleet_handler();
    e.set_handler(std::sync::Arc::new(move |tool, args| {
        if tool == "fleet__list_devices" {
            let _ = tx.lock().unwrap().send(());
        }
        fleet(tool, args)
    }));
    let code = "import agent_tools\n\
                held = bytearray(64 << 20)\n\
                for i in range(0, len(held), 4096): held[i] = 1\n\
                agent_tools.call('fleet__list_devices', {})\n\
                import time\n\
                time.sleep(3600)\n";
    let id = e.start(&rig.token(), code, &[]).unwrap();
    rx.recv_timeout(Duration::from_secs(60))
        .unwrap_or_else(|_| panic!("the script's call: {}", rig.log()));
    let list = e.request("admin.list", json!({})).unwrap();
    let me = list["scripts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["script_id"] == id.as_str())
        .unwrap_or_else(|| panic!("{list}"))
        .clone();
    assert_eq!(me["unit"], format!("scriptgate-{id}.scope"), "{me}");
    let r = &me["resources"];
    assert_eq!(r["source"], "cgroup", "{me}");
    assert!(r["memory_bytes"].as_u64().unwrap() >= 64 << 20, "{me}");
    assert!(r["memory_peak_bytes"].as_u64().unwrap() >= 64 << 20, "{me}");
    assert!(r["cpu_usec"].as_u64().unwrap() > 0, "{me}");
    assert!(r["tasks"].as_u64().unwrap() >= 3, "{me}");
    e.request("script.cancel", json!({"script_id": id}))
        .unwrap();
}
