//! A pre-made sandbox (a pool member): the sandbox of `member_args`, made before
//! its run is known, its Python waiting in `member.py` with `agent_tools`
//! imported, and its mount helper (`mounter`) inside its mount namespace.
//!
//! A member is used once, in two steps that consume it: `mount` puts the run's
//! workspace in (the helper serves one assignment and exits), then `go` sends
//! the script, whose arrival (the pipe's close) starts it. A member sent a
//! script with no workspace mounted refuses it (`member.py`).
//!
//! On a backend that places sandboxes in units, a member is made behind the
//! cold path's gate and placed in a unit of its own (`limits::member`) before
//! its first instruction: it waits under idle limits, never outside a unit.
//!
//! The pool that keeps members and hands them to runs is not in this file.

use crate::limits::member::Waiting;
use crate::sandbox::abi::*;
use crate::sandbox::mounter::{Mounter, Via};
use crate::sandbox::{member_args, RealHost, SandboxSpec};
use crate::sys::{
    channel_pipe, dup_high, give_pipe, install_cloexec_above_fixed, install_ignore_sigxfsz,
    install_pre_exec, ChildSetup, Identity, PidFd,
};
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::process::{Child, Command, Stdio};

/// A waiting member.
pub struct Member {
    /// bwrap.
    pub child: Child,
    /// The sandbox's PID 1 (our init), by pidfd.
    pub init: PidFd,
    /// Python's stdin: the run header and the script, then end of file.
    script: Option<OwnedFd>,
    mounter: Option<Mounter>,
    /// Its own unit, on a backend that places sandboxes in units.
    pub unit: Option<Waiting>,
    /// Our ends: the tool channel (fd 3 we read, fd 4 we write), the init's
    /// usage report, and the script's stdout and stderr.
    pub requests: OwnedFd,
    pub replies: OwnedFd,
    pub usage: OwnedFd,
    pub stdout: OwnedFd,
    pub stderr: OwnedFd,
}

impl Member {
    /// Make a member: bwrap with `member_args(spec)` as `identity` under
    /// `rlimits`, its init's pidfd from `--info-fd`, and its mount helper
    /// (`mounter::Via`) inside. Both are started by `spawn`, which must spawn
    /// from a thread that outlives them (their parent-death signals fire when
    /// the spawning thread exits: `sys::Spawner`). With `place`, bwrap waits
    /// behind the gate until `place` has put it (by pid) in its unit. Blocking:
    /// it returns once the helper is in place.
    // One argument over clippy's seven: each is one thing a member is made of.
    #[allow(clippy::too_many_arguments)]
    pub fn make(
        spec: &SandboxSpec,
        bwrap: &Path,
        mounter: &Via,
        identity: Option<Identity>,
        rlimits: Vec<(libc::__rlimit_resource_t, u64)>,
        spawn: &dyn Fn(Command) -> io::Result<Child>,
        place: Option<&dyn Fn(u32) -> io::Result<Waiting>>,
    ) -> io::Result<Member> {
        let (req_r, req_w) = channel_pipe()?;
        let (rep_r, rep_w) = channel_pipe()?;
        let (info_r, info_w) = channel_pipe()?;
        let (usage_r, usage_w) = channel_pipe()?;
        let seccomp_r = crate::sandbox::seccomp::in_a_pipe()?;
        let (script_r, script_w) = channel_pipe()?;
        let (out_r, out_w) = channel_pipe()?;
        let (err_r, err_w) = channel_pipe()?;
        if let Some(id) = identity {
            give_pipe(&out_w, id)?;
            give_pipe(&err_w, id)?;
            give_pipe(&script_r, id)?;
        }
        let mut fixed = vec![
            (dup_high(&req_w)?, FD_REQUESTS),
            (dup_high(&rep_r)?, FD_REPLIES),
            (dup_high(&info_w)?, FD_INFO),
            (dup_high(&usage_w)?, FD_USAGE),
            (dup_high(&seccomp_r)?, FD_SECCOMP),
        ];
        drop((req_w, rep_r, info_w, usage_w, seccomp_r));
        let gate = match place {
            Some(_) => {
                let (gate_r, gate_w) = channel_pipe()?;
                fixed.push((dup_high(&gate_r)?, FD_GATE));
                Some(gate_w)
            }
            None => None,
        };
        let mut cmd = match gate {
            Some(_) => crate::sandbox::gated(bwrap),
            None => Command::new(bwrap),
        };
        cmd.env_clear()
            .args(member_args(spec, &RealHost))
            .stdin(Stdio::from(script_r))
            .stdout(Stdio::from(out_w))
            .stderr(Stdio::from(err_w));
        install_pre_exec(
            &mut cmd,
            ChildSetup {
                identity,
                rlimits,
                dups: fixed.iter().map(|(fd, to)| (fd.as_raw_fd(), *to)).collect(),
                parent_pid: std::process::id() as libc::pid_t,
            },
        );
        install_ignore_sigxfsz(&mut cmd);
        install_cloexec_above_fixed(&mut cmd);
        let mut child = spawn(cmd)?;
        drop(fixed);
        // Into its unit, then through the gate; without "go" the gate exits.
        let unit = match (place, gate) {
            (Some(place), Some(gate)) => match place(child.id()) {
                Ok(unit) => {
                    if let Err(e) = std::fs::File::from(gate).write_all(b"go\n") {
                        let _ = child.wait();
                        unit.release();
                        return Err(e);
                    }
                    Some(unit)
                }
                Err(e) => {
                    drop(gate);
                    let _ = child.wait();
                    return Err(io::Error::other(format!(
                        "cannot place a pre-made sandbox in its unit: {e}"
                    )));
                }
            },
            _ => None,
        };
        let pid = match child_pid(info_r) {
            Some(pid) => pid,
            None => {
                let _ = child.kill();
                let _ = child.wait();
                if let Some(u) = unit {
                    u.release();
                }
                let mut why = String::new();
                let _ = std::fs::File::from(err_r).read_to_string(&mut why);
                return Err(io::Error::other(format!(
                    "the pool member's bwrap ended before its sandbox existed: {}",
                    why.trim()
                )));
            }
        };
        let init = PidFd::open_as(pid, identity)?;
        // The helper enters the mount namespace as it is when it enters: only
        // once bwrap has built it, which member.py's first line says.
        let mounter =
            ready(&req_r).and_then(|()| Mounter::start(mounter, init.as_fd(), identity, spawn));
        let mounter = match mounter {
            Ok(m) => m,
            Err(e) => {
                let _ = init.kill();
                let _ = child.wait();
                if let Some(u) = unit {
                    u.release();
                }
                return Err(e);
            }
        };
        Ok(Member {
            child,
            init,
            script: Some(script_w),
            mounter: Some(mounter),
            unit,
            requests: req_r,
            replies: rep_w,
            usage: usage_r,
            stdout: out_r,
            stderr: err_r,
        })
    }

    /// Let a member go unused: its sandbox killed, bwrap and the mount helper
    /// reaped. Blocking.
    pub fn discard(mut self) {
        let _ = self.init.kill();
        drop(self.mounter.take());
        let _ = self.child.wait();
        if let Some(u) = self.unit.take() {
            u.release();
        }
    }

    /// Mount the run's workspace at `path` (read-only when `read_only`) and its
    /// `.agent` read-only over the workspace's own. Once only: the helper
    /// serves one assignment, and a second is refused.
    pub fn mount(
        &mut self,
        path: &Path,
        workspace: BorrowedFd,
        agent: BorrowedFd,
        read_only: bool,
    ) -> io::Result<()> {
        let Some(helper) = self.mounter.take() else {
            return Err(io::Error::other(
                "this pool member was assigned already: a member serves one run",
            ));
        };
        helper.mount(path, workspace, agent, read_only)
    }

    /// Send the script (`Go::go`). Once only.
    pub fn go(&mut self, workspace: &Path, name: &str, code: &[u8]) -> io::Result<()> {
        self.take_go()
            .ok_or_else(|| io::Error::other("this pool member was sent its script already"))?
            .go(workspace, name, code)
    }

    /// The end that sends the script, apart from the member (None: taken).
    pub fn take_go(&mut self) -> Option<Go> {
        self.script.take().map(Go)
    }
}

/// The pipe to a member's Python: its one script goes through it.
pub struct Go(OwnedFd);

impl Go {
    /// Send the script: its header (the workspace's path and the script's file
    /// name), then its code; the pipe's close starts it. Blocking (a script
    /// larger than the pipe waits for Python to read it).
    pub fn go(self, workspace: &Path, name: &str, code: &[u8]) -> io::Result<()> {
        let workspace = workspace
            .to_str()
            .ok_or_else(|| io::Error::other("a workspace path that is not UTF-8"))?;
        let header = serde_json::json!({ "workspace": workspace, "name": name });
        let mut bytes = serde_json::to_vec(&header).map_err(io::Error::other)?;
        bytes.push(b'\n');
        bytes.extend_from_slice(code);
        std::fs::File::from(self.0).write_all(&bytes)
    }
}

/// member.py's first line on the tool channel, read a byte at a time so that
/// nothing after it is taken from the script's channel.
fn ready(requests: &OwnedFd) -> io::Result<()> {
    const READY: &[u8] = b"{\"op\": \"member-ready\"}\n";
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while line.len() < READY.len() {
        if nix::unistd::read(requests, &mut byte)? == 0 {
            break;
        }
        line.push(byte[0]);
        if byte[0] == b'\n' {
            break;
        }
    }
    if line == READY {
        Ok(())
    } else {
        Err(io::Error::other(
            "the pool member's Python ended before it was ready",
        ))
    }
}

/// bwrap's `{"child-pid": N}` from `--info-fd`, read until it parses (bwrap
/// may keep the pipe open); end of file first: bwrap failed.
fn child_pid(fd: OwnedFd) -> Option<i32> {
    let mut file = std::fs::File::from(fd);
    let mut buf = Vec::new();
    let mut chunk = [0u8; 512];
    while buf.len() < crate::sandbox::INFO_MAX {
        match file.read(&mut chunk) {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
        if let Some(pid) = crate::sandbox::parse_child_pid(&buf) {
            return pid;
        }
    }
    None
}
