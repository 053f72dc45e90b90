//! The mount helper of a pre-made sandbox (a pool member): the one process that
//! puts a run's workspace into a sandbox that already runs.
//!
//! A multithreaded process may not enter another mount namespace (its threads
//! share one filesystem context), so the daemon cannot do it itself. When a
//! member is made, the daemon's own binary is started (by the mount server,
//! below) as `BIN --sandbox-mounter [UID GID]` (the member's identity, which owns what the helper creates in the
//! sandbox) with a pidfd of the member's PID 1 on `FD_TARGET` and one end of a seqpacket
//! socket on `FD_SOCKET`. The helper enters the member's mount namespace
//! through the pidfd (never a path or a pid that could be reused), says
//! `ready`, and waits. At assignment the daemon sends one message: `r` or `w`
//! and the workspace's path, with the workspace's and its `.agent`'s
//! directories attached, as the daemon opened them. The helper goes back to
//! the daemon's mount namespace for a moment, where it makes a detached tree of
//! each (`sys::mount::Tree`: `open_tree` copies only mounts of the caller's
//! namespace; `.agent` read-only, the workspace read-only for `r`), returns to
//! the member's, and makes the mount point
//! (the sandbox's root goes writable for that moment only; nothing in the
//! sandbox runs code yet), moves the workspace onto it and `.agent` onto the
//! workspace's `.agent`, answers `ok` or the error, and exits: one helper
//! serves one assignment, so a second one finds nobody to do it.
//!
//! The helper is root in the host's namespaces (it needs CAP_SYS_ADMIN and
//! CAP_SYS_CHROOT to enter, and CAP_SYS_PTRACE where the member's init is not
//! dumpable); it runs nothing the sandbox gave it, and reads only the daemon's
//! message. A daemon that dies closes the socket, and the helper exits.
//!
//! **The mount server.** The daemon itself keeps none of those three
//! capabilities. Before it drops its own at start-up, it starts `BIN
//! --sandbox-mount-server` (`start_server`), which keeps them and does one
//! thing: for each message from the daemon on its socket (the member's
//! identity, with the pidfd and the helper's socket attached) it starts one
//! helper. It parses nothing else, and ends when the daemon's end closes. The
//! daemon's handle is `Via::Server`; `Via::Exec` starts helpers directly (a
//! process that holds the capabilities itself: the tests).

use crate::sys::mount;
use std::ffi::OsStr;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path};

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
/// How long the daemon waits for each of a helper's answers: "ready" once it
/// is in the member's mount namespace, "ok" once the workspace is in (both
/// take milliseconds).
const ANSWER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);
const OK: &[u8] = b"ok";

/// The hidden argument that selects the mount server.
pub const SERVER_ARG: &str = "--sandbox-mount-server";
/// The server's end of its seqpacket socket to the daemon.
pub const FD_SERVER: RawFd = 3;
/// The longest request to the server: an identity ("UID GID").
const REQUEST_MAX: usize = 64;

/// How the daemon starts a member's helper.
#[derive(Debug, Clone)]
pub enum Via {
    /// Exec this binary as the helper: the caller holds the capabilities.
    Exec(std::path::PathBuf),
    /// Ask this daemon's mount server (`start_server`).
    Server,
}

/// The daemon's end of its mount server.
struct Server {
    socket: std::sync::Mutex<OwnedFd>,
    _child: std::process::Child,
}

/// Set once, at start-up: the server, or why there is none.
static SERVER: std::sync::OnceLock<Result<Server, String>> = std::sync::OnceLock::new();

/// Start the mount server, while this process (the daemon's only thread, as
/// root) still holds `sys::POOL_CAPABILITIES`; the daemon drops them after.
/// Without them (not root, or a bounding set without them) it says why, and
/// `server_missing` says it later. Once per process.
pub fn start_server(exe: &Path) {
    let server = if !nix::unistd::geteuid().is_root() {
        Err("entering a pre-made sandbox to mount a workspace into it takes a root daemon".into())
    } else if !crate::sys::has_pool_capabilities() {
        Err("the daemon lacks CAP_SYS_ADMIN, CAP_SYS_CHROOT or CAP_SYS_PTRACE, which entering a pre-made sandbox takes (its unit's CapabilityBoundingSet=, scriptgated(8) Privileges)".into())
    } else {
        spawn_server(exe).map_err(|e| format!("cannot start the mount server: {e}"))
    };
    let _ = SERVER.set(server);
}

fn spawn_server(exe: &Path) -> io::Result<Server> {
    let (ours, theirs) = seqpacket_pair()?;
    let theirs = crate::sys::dup_high(&theirs)?;
    let child = own_binary(exe, &[SERVER_ARG], &[(&theirs, FD_SERVER)]).spawn()?;
    drop(theirs);
    Ok(Server {
        socket: std::sync::Mutex::new(ours),
        _child: child,
    })
}

/// Why this process has no mount server (None: it has one).
pub fn server_missing() -> Option<String> {
    match SERVER.get() {
        Some(Ok(_)) => None,
        Some(Err(why)) => Some(why.clone()),
        None => Some("this process started no mount server".into()),
    }
}

/// The mount server's `main`: start one helper per request, until the
/// daemon's end closes. It keeps the daemon's capabilities and the pool's,
/// no more; the helpers that ended are reaped before each request.
pub fn serve() -> i32 {
    if let Err(e) = crate::sys::drop_daemon_capabilities(false, true) {
        eprintln!("scriptgate mount server: {e}");
        return 1;
    }
    let Ok(socket) = crate::sys::inherited_fd(FD_SERVER) else {
        eprintln!("scriptgate mount server: started without its socket");
        return 2;
    };
    let exe = crate::sandbox::init::exe();
    loop {
        // The helpers that have ended since the last request.
        crate::sys::reap_exited_children();
        let (request, fds) = match mount::recv_with_fds(socket.as_fd(), REQUEST_MAX, 2) {
            Ok((bytes, _)) if bytes.is_empty() => return 0, // the daemon is gone
            Ok(r) => r,
            Err(e) => {
                eprintln!("scriptgate mount server: {e}");
                return 1;
            }
        };
        // "helper [UID GID]", with the member's init and the helper's socket;
        // anything else is dropped (the daemon is the only peer).
        let Ok([target, helper]) = <[OwnedFd; 2]>::try_from(fds) else {
            continue;
        };
        let words: Vec<&str> = std::str::from_utf8(&request)
            .unwrap_or("")
            .split_whitespace()
            .collect();
        let Some((&"helper", ids)) = words.split_first() else {
            continue;
        };
        let spawned = helper_command(&exe, ids, target.as_fd(), helper.as_fd())
            .and_then(|(mut cmd, _copies)| cmd.spawn());
        if let Err(e) = spawned {
            let _ = mount::send_with_fds(
                helper.as_fd(),
                format!("error: cannot start the mount helper: {e}").as_bytes(),
                &[],
            );
        }
    }
}

/// A connected pair of close-on-exec seqpacket sockets.
fn seqpacket_pair() -> io::Result<(OwnedFd, OwnedFd)> {
    Ok(nix::sys::socket::socketpair(
        nix::sys::socket::AddressFamily::Unix,
        nix::sys::socket::SockType::SeqPacket,
        None,
        nix::sys::socket::SockFlag::SOCK_CLOEXEC,
    )?)
}

/// The command that execs this binary as one member's helper, with `target`
/// and `socket` on its fixed descriptors and `ids` (empty, or "UID GID") as
/// its arguments; the copies it dup2s from are returned, to be dropped once
/// it is spawned.
fn helper_command(
    exe: &Path,
    ids: &[&str],
    target: BorrowedFd,
    socket: BorrowedFd,
) -> io::Result<(std::process::Command, [OwnedFd; 2])> {
    let target = crate::sys::dup_high(&target)?;
    let socket = crate::sys::dup_high(&socket)?;
    let args: Vec<&str> = std::iter::once(ARG).chain(ids.iter().copied()).collect();
    let cmd = own_binary(exe, &args, &[(&target, FD_TARGET), (&socket, FD_SOCKET)]);
    Ok((cmd, [target, socket]))
}

/// `exe` (this binary) with `args`, no environment, stdin and stdout on
/// /dev/null (stderr the daemon's), and each descriptor of `fds` dup2'ed to
/// its fixed number in the child; nothing else crosses the exec.
fn own_binary(exe: &Path, args: &[&str], fds: &[(&OwnedFd, RawFd)]) -> std::process::Command {
    let mut cmd = std::process::Command::new(exe);
    cmd.args(args)
        .env_clear()
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null());
    crate::sys::install_pre_exec(
        &mut cmd,
        crate::sys::ChildSetup {
            identity: None,
            rlimits: vec![],
            dups: fds
                .iter()
                .map(|(fd, to)| (std::os::fd::AsRawFd::as_raw_fd(*fd), *to))
                .collect(),
            parent_pid: std::process::id() as libc::pid_t,
        },
    );
    cmd
}

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
    // Its own namespace, to come back to; the member's is entered again by
    // the pidfd (inside, /proc is the sandbox's, where this process has no
    // /proc/self).
    let entered = mount::own_mount_namespace().and_then(|home| {
        mount::check_sandbox_target(target.as_fd())?;
        mount::enter_mount_namespace(target.as_fd())?;
        Ok(home)
    });
    let home = match entered {
        Ok(ns) => ns,
        Err(e) => {
            let _ = say(format!("error: entering the sandbox's mount namespace: {e}").as_bytes());
            return 1;
        }
    };
    if say(READY).is_err() {
        return 1;
    }
    let (message, dirs) = match mount::recv_with_fds(socket.as_fd(), MESSAGE_MAX, 2) {
        Ok((bytes, _)) if bytes.is_empty() => return 0, // the daemon let the member go
        Ok((bytes, dirs)) if dirs.len() == 2 => (bytes, dirs),
        Ok(_) => {
            let _ = say(b"error: a message without its two directories");
            return 1;
        }
        Err(e) => {
            let _ = say(format!("error: {e}").as_bytes());
            return 1;
        }
    };
    let read_only = match message.first() {
        Some(b'r') => true,
        Some(b'w') => false,
        _ => {
            let _ = say(b"error: a message that says neither r nor w");
            return 1;
        }
    };
    let path = Path::new(OsStr::from_bytes(&message[1..]));
    // The workspace's path as the daemon checked it against its roots: whole,
    // with no `..` to climb out of where it is made inside the sandbox.
    if !path.is_absolute()
        || path
            .components()
            .any(|c| !matches!(c, Component::RootDir | Component::Normal(_)))
    {
        let _ = say(b"error: a workspace path that is not absolute and plain");
        return 1;
    }
    let done = trees(home.as_fd(), target.as_fd(), &dirs, read_only)
        .and_then(|(workspace, agent)| inject(path, owner, workspace, agent));
    match done {
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

/// The detached trees of the workspace and its `.agent`, made in the daemon's
/// mount namespace (`home`, where the directories are), then back in the
/// member's (by the pidfd of its init, which waits as long as the member).
fn trees(
    home: BorrowedFd,
    member: BorrowedFd,
    dirs: &[OwnedFd],
    read_only: bool,
) -> io::Result<(OwnedFd, OwnedFd)> {
    mount::enter_mount_namespace(home)?;
    let made = mount::Tree::of(dirs[0].as_fd(), read_only).and_then(|ws| {
        let agent = mount::Tree::of(dirs[1].as_fd(), true)?;
        Ok((ws.into_fd(), agent.into_fd()))
    });
    mount::enter_mount_namespace(member)?;
    made
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
    /// The helper, when this process started it (`Via::Exec`); the mount
    /// server's helpers are the server's children.
    child: Option<std::process::Child>,
    /// Its answer came and it exits by itself: reaped by a thread of its own.
    answered: bool,
}

impl Mounter {
    /// Start the helper for the member whose PID 1 `target` refers to (running
    /// as `owner`; None: as the daemon), and wait until it is inside the
    /// member's mount namespace. Blocking.
    pub fn start(
        via: &Via,
        target: BorrowedFd,
        owner: Option<crate::sys::Identity>,
        spawn: &dyn Fn(std::process::Command) -> io::Result<std::process::Child>,
    ) -> io::Result<Mounter> {
        let (ours, theirs) = seqpacket_pair()?;
        // A helper that never answers fails its member (or its run, which
        // then starts cold), never holds it.
        nix::sys::socket::setsockopt(
            &ours,
            nix::sys::socket::sockopt::ReceiveTimeout,
            &nix::sys::time::TimeVal::new(ANSWER_TIMEOUT.as_secs() as _, 0),
        )?;
        let ids: Vec<String> = owner
            .map(|id| vec![id.uid.to_string(), id.gid.to_string()])
            .unwrap_or_default();
        let child = match via {
            Via::Exec(exe) => {
                let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
                let (cmd, _copies) = helper_command(exe, &ids, target, theirs.as_fd())?;
                Some(spawn(cmd)?)
            }
            Via::Server => {
                let Some(Ok(server)) = SERVER.get() else {
                    return Err(io::Error::other(
                        server_missing().unwrap_or_else(|| "no mount server".into()),
                    ));
                };
                let socket = server.socket.lock().unwrap_or_else(|p| p.into_inner());
                let request = std::iter::once("helper".to_string())
                    .chain(ids)
                    .collect::<Vec<_>>()
                    .join(" ");
                mount::send_with_fds(
                    socket.as_fd(),
                    request.as_bytes(),
                    &[target, theirs.as_fd()],
                )?;
                None
            }
        };
        drop(theirs);
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
        let mut message = vec![if read_only { b'r' } else { b'w' }];
        message.extend_from_slice(path.as_os_str().as_bytes());
        mount::send_with_fds(self.socket.as_fd(), &message, &[workspace, agent])?;
        let said = self.hear()?;
        if said != OK {
            return Err(self.failed(&said));
        }
        // It exits now; its exit is not waited for on the way to the script.
        self.answered = true;
        if let Some(child) = &self.child {
            drop(crate::sys::wait_child(child.id() as i32));
        }
        Ok(())
    }

    fn hear(&mut self) -> io::Result<Vec<u8>> {
        match mount::recv_with_fds(self.socket.as_fd(), MESSAGE_MAX, 0) {
            Ok((bytes, _)) => Ok(bytes),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                let e = io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "the mount helper did not answer within {} s",
                        ANSWER_TIMEOUT.as_secs()
                    ),
                );
                if let Some(child) = &mut self.child {
                    let _ = child.kill();
                    let _ = child.wait();
                }
                Err(e)
            }
            Err(e) => Err(e),
        }
    }

    /// The helper's error, as it said it (or its silence), with it reaped.
    fn failed(&mut self, said: &[u8]) -> io::Error {
        if let Some(child) = &mut self.child {
            let _ = child.kill();
            let _ = child.wait();
        }
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
        if self.answered {
            return;
        }
        let _ = mount::send_with_fds(self.socket.as_fd(), b"", &[]);
        if let Some(child) = &mut self.child {
            let _ = child.wait();
        }
    }
}
