//! The mount helper of a pre-made sandbox (a pool member): the one process that
//! puts a run's workspace into a sandbox that already runs.
//!
//! A multithreaded process may not enter another mount namespace (its threads
//! share one filesystem context), so the daemon cannot do it itself. When a
//! member is made, the daemon starts its own binary as `BIN --sandbox-mounter
//! [UID GID]` (the member's identity, which owns what the helper creates in the
//! sandbox) with a pidfd of the member's PID 1 on `FD_TARGET` and one end of a seqpacket
//! socket on `FD_SOCKET`. The helper enters the member's mount namespace
//! through the pidfd (never a path or a pid that could be reused), says
//! `ready`, and waits. At assignment the daemon sends one message: the
//! workspace's path, with two detached trees attached (`sys::mount::Tree`: the
//! workspace, and its `.agent` read-only). The helper makes the mount point
//! (the sandbox's root goes writable for that moment only; nothing in the
//! sandbox runs code yet), moves the workspace onto it and `.agent` onto the
//! workspace's `.agent`, answers `ok` or the error, and exits: one helper
//! serves one assignment, so a second one finds nobody to do it.
//!
//! The helper is root in the host's namespaces (it needs CAP_SYS_ADMIN and
//! CAP_SYS_CHROOT to enter, and CAP_SYS_PTRACE where the member's init is not
//! dumpable); it runs nothing the sandbox gave it, and reads only the daemon's
//! message. A daemon that dies closes the socket, and the helper exits.

use crate::sys::mount;
use std::ffi::OsStr;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// The hidden argument that selects the helper mode.
pub const ARG: &str = "--sandbox-mounter";
/// The pidfd of the member's PID 1.
pub const FD_TARGET: RawFd = 3;
/// The helper's end of the seqpacket socket to the daemon.
pub const FD_SOCKET: RawFd = 4;
/// The longest message: a workspace path (PATH_MAX) and a word.
const MESSAGE_MAX: usize = 4096 + 64;

/// The helper's words to the daemon.
const READY: &[u8] = b"ready";
const OK: &[u8] = b"ok";

/// The helper's `main`, with its arguments after `ARG`: the exit status.
pub fn run(args: &[std::ffi::OsString]) -> i32 {
    let ids: Vec<u32> = args
        .iter()
        .filter_map(|a| a.to_str()?.parse().ok())
        .collect();
    let owner = match ids[..] {
        [] if args.is_empty() => None,
        [uid, gid] if args.len() == 2 => Some(crate::sys::Identity { uid, gid }),
        _ => {
            eprintln!("scriptgate mounter: usage: {ARG} [UID GID]");
            return 2;
        }
    };
    // Placed by the daemon's spawn (`Mounter::start`).
    let (target, socket) = match (
        crate::sys::inherited_fd(FD_TARGET),
        crate::sys::inherited_fd(FD_SOCKET),
    ) {
        (Ok(t), Ok(s)) => (t, s),
        _ => {
            eprintln!("scriptgate mounter: started without its descriptors");
            return 2;
        }
    };
    let say = |what: &[u8]| mount::send_with_fds(socket.as_fd(), what, &[]);
    if let Err(e) = mount::enter_mount_namespace(target.as_fd()) {
        let _ = say(format!("error: entering the sandbox's mount namespace: {e}").as_bytes());
        return 1;
    }
    drop(target);
    if say(READY).is_err() {
        return 1;
    }
    let (path, trees) = match mount::recv_with_fds(socket.as_fd(), MESSAGE_MAX, 2) {
        Ok((bytes, _)) if bytes.is_empty() => return 0, // the daemon let the member go
        Ok((bytes, trees)) if trees.len() == 2 => (bytes, trees),
        Ok(_) => {
            let _ = say(b"error: a message without its two trees");
            return 1;
        }
        Err(e) => {
            let _ = say(format!("error: {e}").as_bytes());
            return 1;
        }
    };
    let mut trees = trees.into_iter();
    let (Some(workspace), Some(agent)) = (trees.next(), trees.next()) else {
        return 1;
    };
    match inject(Path::new(OsStr::from_bytes(&path)), owner, workspace, agent) {
        Ok(()) => {
            let _ = say(OK);
            0
        }
        Err(e) => {
            let _ = say(format!("error: {e}").as_bytes());
            1
        }
    }
}

/// Inside the member's mount namespace: the mount point, then the workspace on
/// it, then `.agent` on the workspace's own.
fn inject(
    path: &Path,
    owner: Option<crate::sys::Identity>,
    workspace: OwnedFd,
    agent: OwnedFd,
) -> io::Result<()> {
    mount::root_writable(true)?;
    let point = mount::mount_point(path, owner);
    let back = mount::root_writable(false);
    let point = point?;
    back?;
    mount::attach(workspace, point.as_fd())?;
    let mounted = mount::open_dir(path)?;
    let agent_at = mount::subdir(mounted.as_fd(), OsStr::new(".agent"))?;
    mount::attach(agent, agent_at.as_fd())
}

/// The daemon's handle on one helper: made with its member, used once.
#[derive(Debug)]
pub struct Mounter {
    socket: OwnedFd,
    child: std::process::Child,
    /// Its answer came and it exits by itself: reaped by a thread of its own.
    answered: bool,
}

impl Mounter {
    /// Start the helper for the member whose PID 1 `target` refers to (running
    /// as `owner`; None: as the daemon), and wait until it is inside the
    /// member's mount namespace. Blocking.
    pub fn start(
        exe: &Path,
        target: BorrowedFd,
        owner: Option<crate::sys::Identity>,
        spawn: &dyn Fn(std::process::Command) -> io::Result<std::process::Child>,
    ) -> io::Result<Mounter> {
        let (ours, theirs) = nix::sys::socket::socketpair(
            nix::sys::socket::AddressFamily::Unix,
            nix::sys::socket::SockType::SeqPacket,
            None,
            nix::sys::socket::SockFlag::SOCK_CLOEXEC,
        )?;
        let target = crate::sys::dup_high(&target)?;
        let theirs = crate::sys::dup_high(&theirs)?;
        let mut cmd = std::process::Command::new(exe);
        cmd.arg(ARG);
        if let Some(id) = owner {
            cmd.arg(id.uid.to_string()).arg(id.gid.to_string());
        }
        cmd.env_clear()
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null());
        crate::sys::install_pre_exec(
            &mut cmd,
            crate::sys::ChildSetup {
                identity: None,
                rlimits: vec![],
                dups: vec![
                    (std::os::fd::AsRawFd::as_raw_fd(&target), FD_TARGET),
                    (std::os::fd::AsRawFd::as_raw_fd(&theirs), FD_SOCKET),
                ],
                parent_pid: std::process::id() as libc::pid_t,
            },
        );
        let child = spawn(cmd)?;
        drop((target, theirs));
        let mut helper = Mounter {
            socket: ours,
            child,
            answered: false,
        };
        let said = helper.hear()?;
        if said != READY {
            return Err(helper.failed(&said));
        }
        Ok(helper)
    }

    /// Mount `workspace` (read-only when `read_only`) at `path` inside the
    /// member, and its `.agent` read-only over the workspace's own. Consumes
    /// the helper: it serves one assignment. Blocking.
    pub fn mount(
        mut self,
        path: &Path,
        workspace: BorrowedFd,
        agent: BorrowedFd,
        read_only: bool,
    ) -> io::Result<()> {
        let ws = mount::Tree::of(workspace, read_only)?.into_fd();
        let agent = mount::Tree::of(agent, true)?.into_fd();
        mount::send_with_fds(
            self.socket.as_fd(),
            path.as_os_str().as_bytes(),
            &[ws.as_fd(), agent.as_fd()],
        )?;
        drop((ws, agent));
        let said = self.hear()?;
        if said != OK {
            return Err(self.failed(&said));
        }
        // It exits now; its exit is not waited for on the way to the script.
        self.answered = true;
        drop(crate::sys::wait_child(self.child.id() as i32));
        Ok(())
    }

    fn hear(&mut self) -> io::Result<Vec<u8>> {
        let (bytes, _) = mount::recv_with_fds(self.socket.as_fd(), MESSAGE_MAX, 0)?;
        Ok(bytes)
    }

    /// The helper's error, as it said it (or its silence), with it reaped.
    fn failed(&mut self, said: &[u8]) -> io::Error {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let text = String::from_utf8_lossy(said);
        let text = text.strip_prefix("error: ").unwrap_or(&text);
        if text.is_empty() {
            io::Error::other("the mount helper ended without an answer")
        } else {
            io::Error::other(format!("the mount helper: {text}"))
        }
    }
}

impl Drop for Mounter {
    fn drop(&mut self) {
        // A member let go without an assignment: the helper hears end of file.
        if !self.answered && matches!(self.child.try_wait(), Ok(None)) {
            let _ = mount::send_with_fds(self.socket.as_fd(), b"", &[]);
            let _ = self.child.wait();
        }
    }
}
