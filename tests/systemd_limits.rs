//! The systemd backend's limits, read back: a real systemd booted as PID 1 of a
//! private PID namespace (tests/systemd/boot.sh, as tests/systemd.rs boots it),
//! the daemon run inside it with `backend = "systemd"`. With the cgroup v1 memory
//! controller mounted read-only (as the container had it, in the rig's
//! own mount namespace only), systemd starts every scope all the same; the daemon
//! must see that memory_max_bytes is not in force. With it writable, no false
//! alarm.
mod common;
use common::*;
use serde_json::{json, Value};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

struct Booted {
    dir: PathBuf,
    unshare: Child,
    pid1: i32,
    daemon: Option<Child>,
}

impl Booted {
    /// Boot the rig (`before` runs in its mount namespace first), then start the
    /// daemon in it, listening on a socket in `dir` (the host sees it).
    fn boot(before: &str, extra_config: &str) -> Booted {
        require_root("boots systemd in a private PID namespace");
        let mut b = [0u8; 4];
        getrandom::getrandom(&mut b).unwrap();
        let dir = PathBuf::from(format!(
            "/var/lib/scriptgate-envrig-{}-{}",
            std::process::id(),
            u32::from_le_bytes(b)
        ));
        std::fs::create_dir_all(dir.join("roots/ws")).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        chown_to_script_uid(&dir.join("roots/ws"));
        let src = Path::new(env!("CARGO_MANIFEST_DIR"));
        std::fs::copy(src.join("tests/systemd/boot.sh"), dir.join("boot.sh")).unwrap();
        // The booted systemd has a private /tmp (and the checkout may be under it):
        // the daemon runs from a copy in the rig's directory.
        std::fs::copy(env!("CARGO_BIN_EXE_scriptgated"), dir.join("scriptgated")).unwrap();
        std::fs::write(
            dir.join("start.sh"),
            format!(
                "#!/bin/sh\nset -e\n{before}\nexec {}/boot.sh\n",
                dir.display()
            ),
        )
        .unwrap();
        std::fs::set_permissions(dir.join("start.sh"), std::fs::Permissions::from_mode(0o755))
            .unwrap();
        std::fs::write(dir.join("token.key"), KEY).unwrap();
        std::fs::set_permissions(
            dir.join("token.key"),
            std::fs::Permissions::from_mode(0o600),
        )
        .unwrap();
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
        let unshare = Command::new("setsid")
            .args(["unshare", "--pid", "--fork", "--mount", "--uts", "--ipc"])
            .args(["--mount-proc", "--propagation", "private"])
            .arg(dir.join("start.sh"))
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(dir.join("boot.log")).unwrap())
            .stderr(std::fs::File::create(dir.join("boot.err")).unwrap())
            .spawn()
            .unwrap();
        let t0 = Instant::now();
        let pid1 = loop {
            if let Some(p) = systemd_below(unshare.id() as i32) {
                break p;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "systemd did not start: {}",
                std::fs::read_to_string(dir.join("boot.err")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        let mut rig = Booted {
            dir,
            unshare,
            pid1,
            daemon: None,
        };
        let t0 = Instant::now();
        loop {
            let o = rig
                .nsenter(&["systemctl", "is-system-running"])
                .output()
                .unwrap();
            let state = String::from_utf8_lossy(&o.stdout).trim().to_string();
            if state == "running" || state == "degraded" {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "no systemd: {state}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
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
        rig.daemon = Some(daemon);
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

    fn nsenter(&self, argv: &[&str]) -> Command {
        let mut c = Command::new("nsenter");
        c.args(["-t", &self.pid1.to_string(), "-m", "-p", "-u", "-i"])
            .args(argv);
        c
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

impl Drop for Booted {
    fn drop(&mut self) {
        // PID 1 of the namespace: the kernel ends every process in it, the daemon too.
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.pid1),
            nix::sys::signal::Signal::SIGKILL,
        );
        if let Some(mut d) = self.daemon.take() {
            let _ = d.wait();
        }
        let _ = self.unshare.kill();
        let _ = self.unshare.wait();
        let t0 = Instant::now();
        while Path::new(&format!("/proc/{}", self.pid1)).exists()
            && t0.elapsed() < Duration::from_secs(10)
        {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The `systemd` process below `pid` (setsid may fork once more).
fn systemd_below(pid: i32) -> Option<i32> {
    let mut frontier = vec![pid];
    for _ in 0..3 {
        let mut next = vec![];
        for e in std::fs::read_dir("/proc").unwrap().flatten() {
            let Ok(p) = e.file_name().to_string_lossy().parse::<i32>() else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else {
                continue;
            };
            let ppid = stat
                .rsplit(')')
                .next()
                .and_then(|r| r.split_whitespace().nth(1))
                .and_then(|x| x.parse::<i32>().ok());
            if ppid.is_some_and(|pp| frontier.contains(&pp)) {
                next.push(p);
            }
        }
        if let Some(p) = next.iter().find(|p| {
            std::fs::read_to_string(format!("/proc/{p}/comm")).is_ok_and(|c| c.trim() == "systemd")
        }) {
            return Some(*p);
        }
        frontier = next;
    }
    None
}

/// The start-up line, from the rig's journal (the daemon logs there when it has
/// one), and whether it was a warning.
fn ready_line(rig: &Booted) -> (String, bool) {
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
                v["PRIORITY"] == "4",
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
    let (line, warning) = ready_line(&rig);
    assert!(warning, "{line}");
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
    let (line, warning) = ready_line(&rig);
    assert!(!warning, "{line}");
    assert!(
        line.contains("(backend systemd; as configured; limits in force; sandbox ok"),
        "{line}"
    );
    let e = rig.engine();
    let info = e.request("daemon.info", json!({})).unwrap();
    assert_eq!(info["limits_enforced"], true, "{info}");
    assert_eq!(info["backend_notes"], json!([]), "{info}");
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
