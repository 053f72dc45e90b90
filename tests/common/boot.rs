//! The systemd boot rig: a real systemd booted as PID 1 of a private PID, mount,
//! UTS and IPC namespace (tests/systemd/boot.sh), for tests/it/systemd.rs (the
//! project's units, socket-activated) and tests/it/systemd_limits.rs (the daemon run
//! in it with `backend = "systemd"`). The rig shares the host's root file system,
//! so what it needs lives in its directory under /var/lib, removed afterwards; its
//! /run, /tmp and /var/tmp are private.

use super::{chown_to_script_uid, KEY};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

pub struct Booted {
    /// `/var/lib/<name>-<pid>-<random>`: boot.sh, token.key, roots/ws (the
    /// script uid's), and whatever the test's `prepare` put there.
    pub dir: PathBuf,
    unshare: Child,
    /// The namespace's PID 1 (systemd), as the host sees it.
    pub pid1: i32,
    /// A process the test started in the rig (the daemon), reaped when the rig
    /// goes: killing PID 1 ends it.
    pub daemon: Option<Child>,
}

impl Booted {
    /// Make the rig's directory `/var/lib/<name>-…` (boot.sh, a token.key of
    /// `KEY`, roots/ws), let `prepare` add to it, then boot systemd there and wait
    /// until it is running (or degraded). `before` is shell run in the rig's mount
    /// namespace before boot.sh (empty: boot.sh is run directly).
    pub fn boot(name: &str, before: &str, prepare: impl FnOnce(&Path)) -> Booted {
        let dir = PathBuf::from(format!(
            "/var/lib/{name}-{}-{}",
            std::process::id(),
            rand_suffix()
        ));
        std::fs::create_dir_all(dir.join("roots/ws")).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        chown_to_script_uid(&dir.join("roots/ws"));
        let src = Path::new(env!("CARGO_MANIFEST_DIR"));
        std::fs::copy(src.join("tests/systemd/boot.sh"), dir.join("boot.sh")).unwrap();
        std::fs::write(dir.join("token.key"), KEY).unwrap();
        std::fs::set_permissions(
            dir.join("token.key"),
            std::fs::Permissions::from_mode(0o600),
        )
        .unwrap();
        prepare(&dir);
        let init = if before.is_empty() {
            dir.join("boot.sh")
        } else {
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
            dir.join("start.sh")
        };
        let unshare = Command::new("setsid")
            .args(["unshare", "--pid", "--fork", "--mount", "--uts", "--ipc"])
            .args(["--mount-proc", "--propagation", "private"])
            .arg(init)
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
        let rig = Booted {
            dir,
            unshare,
            pid1,
            daemon: None,
        };
        let t0 = Instant::now();
        loop {
            let o = rig.sh("systemctl is-system-running");
            let state = String::from_utf8_lossy(&o.stdout).trim().to_string();
            if state == "running" || state == "degraded" {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "the rig's systemd did not come up: {state}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        rig
    }

    /// `argv` in the rig's namespaces, not yet run.
    pub fn nsenter(&self, argv: &[&str]) -> Command {
        nsenter(self.pid1, argv)
    }

    /// `sh -c cmd` in the rig, run to the end.
    pub fn sh(&self, cmd: &str) -> Output {
        self.nsenter(&["sh", "-c", cmd]).output().unwrap()
    }

    /// `sh -c cmd` in the rig, which must succeed; its stdout.
    pub fn sh_ok(&self, cmd: &str) -> String {
        let o = self.sh(cmd);
        assert!(
            o.status.success(),
            "{cmd}: {}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    }
}

/// `argv` in the namespaces of the rig whose PID 1 is `pid1` (for a thread that
/// does not hold the rig).
pub fn nsenter(pid1: i32, argv: &[&str]) -> Command {
    let mut c = Command::new("nsenter");
    c.args(["-t", &pid1.to_string(), "-m", "-p", "-u", "-i"])
        .args(argv);
    c
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

fn rand_suffix() -> u32 {
    let mut b = [0u8; 4];
    getrandom::getrandom(&mut b).unwrap();
    u32::from_le_bytes(b)
}

/// The `systemd` process below `pid` (setsid forks when it is a group leader: look
/// a level or two deeper if need be).
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
