//! Mounting a directory into a sandbox that already runs (a pool member's
//! assignment, `sandbox::mounter`), with the new mount API: the daemon makes a
//! detached copy of the directory's tree (`Tree::of`), with its attributes set
//! before anyone inside can see it; a helper that entered the sandbox's mount
//! namespace (`enter_mount_namespace`) makes the mount point and moves the tree
//! onto it (`attach`). This is how systemd's `systemctl bind` mounts into a
//! running unit (`mount_in_namespace`). A plain directory descriptor never
//! crosses into a sandbox (runc's CVE-2024-21626): only mounts do.
//!
//! Kernels: open_tree and move_mount since 5.2, mount_setattr since 5.12,
//! setns on a pidfd since 5.8. Where one is missing the call says ENOSYS.

use nix::fcntl::{openat, OFlag, AT_FDCWD};
use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags};
use nix::sys::stat::{mkdirat, Mode};
use std::ffi::{CString, OsStr};
use std::io;
use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path};

fn check(rc: libc::c_long) -> io::Result<libc::c_long> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

fn c_path(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a NUL byte in a path"))
}

/// Set or clear mount attributes on `fd` (a mount, or a directory on one); with
/// `tree`, on every mount below it too, and make them private (no mount event
/// propagates into or out of them).
fn set_attributes(fd: BorrowedFd, set: u64, clear: u64, tree: bool) -> io::Result<()> {
    let attr = libc::mount_attr {
        attr_set: set,
        attr_clr: clear,
        propagation: if tree { libc::MS_PRIVATE } else { 0 },
        userns_fd: 0,
    };
    let flags = libc::AT_EMPTY_PATH | if tree { libc::AT_RECURSIVE } else { 0 };
    // SAFETY: mount_setattr reads `attr` (its size passed with it) and an empty
    // path; `fd` is a live descriptor for the call's length.
    check(unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            fd.as_raw_fd(),
            c"".as_ptr(),
            flags,
            &attr as *const libc::mount_attr,
            std::mem::size_of::<libc::mount_attr>(),
        )
    })?;
    Ok(())
}

/// A detached copy of a directory's mount tree: attached nowhere until it is
/// moved, and gone with its descriptor if it never is.
#[derive(Debug)]
pub struct Tree(OwnedFd);

impl Tree {
    /// The tree at `dir` (a directory the daemon opened without following
    /// symlinks), with every mount in it nosuid, nodev and private, and
    /// read-only when `read_only`: what bwrap's `--bind-fd`/`--ro-bind-fd` give
    /// the cold path.
    pub fn of(dir: BorrowedFd, read_only: bool) -> io::Result<Tree> {
        let flags = libc::OPEN_TREE_CLONE
            | libc::OPEN_TREE_CLOEXEC
            | libc::AT_EMPTY_PATH as libc::c_uint
            | libc::AT_RECURSIVE as libc::c_uint;
        // SAFETY: open_tree on a live descriptor with an empty path; it returns
        // a new descriptor or -1.
        let fd = check(unsafe {
            libc::syscall(libc::SYS_open_tree, dir.as_raw_fd(), c"".as_ptr(), flags)
        })?;
        // SAFETY: a fresh descriptor open_tree returned, owned by nobody else.
        let tree = Tree(unsafe { OwnedFd::from_raw_fd(fd as RawFd) });
        let ro = if read_only {
            libc::MOUNT_ATTR_RDONLY
        } else {
            0
        };
        set_attributes(
            tree.0.as_fd(),
            libc::MOUNT_ATTR_NOSUID | libc::MOUNT_ATTR_NODEV | ro,
            0,
            true,
        )?;
        Ok(tree)
    }

    pub fn into_fd(self) -> OwnedFd {
        self.0
    }
}

/// Enter the mount namespace of the process `pidfd` refers to (a pidfd cannot
/// name a later process that reuses the pid), or the one a namespace
/// descriptor (`own_mount_namespace`) refers to. Only a process that shares
/// its filesystem context with no other thread may: a single-threaded helper,
/// never the daemon. Root and current directory become the namespace's root.
pub fn enter_mount_namespace(pidfd: BorrowedFd) -> io::Result<()> {
    // SAFETY: setns on a live descriptor; it changes only this process's namespace.
    check(unsafe { libc::syscall(libc::SYS_setns, pidfd.as_raw_fd(), libc::CLONE_NEWNS) })?;
    Ok(())
}

/// Check that the process `pidfd` refers to is a sandbox, before its mount
/// namespace is entered: alive, and in a mount namespace and a user namespace
/// other than this process's (a pre-made sandbox's init is in bwrap's own;
/// a pidfd of a host process, or of this one, is refused). The namespaces are
/// read at the pid the pidfd's fdinfo gives, then the fdinfo is read again:
/// were the pid reused between the two, the process the pidfd refers to would
/// have ended, and that is refused too. (No signal 0 to ask: the helper has
/// no CAP_KILL, and the init is another uid's.)
pub fn check_sandbox_target(pidfd: BorrowedFd) -> io::Result<()> {
    let pid = pidfd_pid(pidfd)?;
    let ns = |who: &str, kind: &str| -> io::Result<(u64, u64)> {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(format!("/proc/{who}/ns/{kind}"))?;
        Ok((m.dev(), m.ino()))
    };
    let theirs = (ns(&pid.to_string(), "mnt")?, ns(&pid.to_string(), "user")?);
    let ours = (ns("self", "mnt")?, ns("self", "user")?);
    // Still the same process: a pid is reused only once its process ended,
    // and then the pidfd's fdinfo says -1.
    if pidfd_pid(pidfd)? != pid {
        return Err(io::Error::other(
            "the sandbox's init ended while it was checked",
        ));
    }
    if theirs.0 == ours.0 {
        return Err(io::Error::other(
            "the target shares this process's mount namespace: not a sandbox",
        ));
    }
    if theirs.1 == ours.1 {
        return Err(io::Error::other(
            "the target is in this process's user namespace: not a sandbox",
        ));
    }
    Ok(())
}

/// The pid (in this process's pid namespace) of the process a pidfd refers
/// to, from its fdinfo; an error once it has ended.
fn pidfd_pid(pidfd: BorrowedFd) -> io::Result<i32> {
    let fdinfo = format!("/proc/self/fdinfo/{}", pidfd.as_raw_fd());
    let text = std::fs::read_to_string(&fdinfo)?;
    let pid: i32 = text
        .lines()
        .find_map(|l| l.strip_prefix("Pid:"))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| io::Error::other(format!("{fdinfo} has no Pid: line (not a pidfd)")))?;
    if pid <= 0 {
        return Err(io::Error::other(
            "the sandbox's init has ended, or is not visible from here",
        ));
    }
    Ok(pid)
}

/// A descriptor of this process's mount namespace, to come back to it
/// (`enter_mount_namespace`).
pub fn own_mount_namespace() -> io::Result<OwnedFd> {
    Ok(std::fs::File::open("/proc/self/ns/mnt")?.into())
}

/// Make the root mount of the current namespace writable (`true`) or read-only
/// again, to make a mount point on it.
pub fn root_writable(writable: bool) -> io::Result<()> {
    let root = openat(
        AT_FDCWD,
        "/",
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )?;
    let (set, clear) = if writable {
        (0, libc::MOUNT_ATTR_RDONLY)
    } else {
        (libc::MOUNT_ATTR_RDONLY, 0)
    };
    set_attributes(root.as_fd(), set, clear, false)
}

/// The directory at the absolute `path`, made where missing (mode 0755, owned
/// by `owner`), never through a symlink or `..`: returned as an `O_PATH`
/// descriptor to mount on. A sandbox's own filesystems (its root, its `/tmp`)
/// belong to its user namespace, where only the script's uid is mapped: a
/// directory made there by root would fail (EOVERFLOW), so it is made with
/// the script's uid and gid as the filesystem identity.
pub fn mount_point(path: &Path, owner: Option<crate::sys::Identity>) -> io::Result<OwnedFd> {
    let Some(id) = owner else {
        return mount_point_as_is(path);
    };
    let uid = nix::unistd::setfsuid(nix::unistd::Uid::from_raw(id.uid));
    let gid = nix::unistd::setfsgid(nix::unistd::Gid::from_raw(id.gid));
    let point = mount_point_as_is(path);
    nix::unistd::setfsgid(gid);
    nix::unistd::setfsuid(uid);
    point
}

fn mount_point_as_is(path: &Path) -> io::Result<OwnedFd> {
    let mut at = openat(
        AT_FDCWD,
        "/",
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )?;
    let refuse = |why: &str| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{}: {why}", path.display()),
        )
    };
    let mut parts = path.components();
    if parts.next() != Some(Component::RootDir) {
        return Err(refuse("not an absolute path"));
    }
    for part in parts {
        let Component::Normal(name) = part else {
            return Err(refuse("not a plain path"));
        };
        let open = |at: &OwnedFd| {
            openat(
                at,
                name,
                OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
                Mode::empty(),
            )
        };
        let next = match open(&at) {
            Err(nix::errno::Errno::ENOENT) => {
                match mkdirat(&at, name, Mode::from_bits_truncate(0o755)) {
                    Ok(()) | Err(nix::errno::Errno::EEXIST) => {}
                    Err(e) => return Err(e.into()),
                }
                open(&at)?
            }
            r => r?,
        };
        at = next;
    }
    Ok(at)
}

/// Move a detached tree onto the directory `at` (from `mount_point`).
pub fn attach(tree: OwnedFd, at: BorrowedFd) -> io::Result<()> {
    // SAFETY: move_mount between two live descriptors with empty paths.
    check(unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            tree.as_raw_fd(),
            c"".as_ptr(),
            at.as_raw_fd(),
            c"".as_ptr(),
            libc::MOVE_MOUNT_F_EMPTY_PATH | libc::MOVE_MOUNT_T_EMPTY_PATH,
        )
    })?;
    Ok(())
}

/// The directory `name` under `dir`, without following a symlink, as an
/// `O_PATH` descriptor to mount on.
pub fn subdir(dir: BorrowedFd, name: &OsStr) -> io::Result<OwnedFd> {
    Ok(openat(
        dir,
        name,
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )?)
}

/// An absolute path opened as an `O_PATH` directory descriptor (the mount on
/// it, if any, is what it refers to).
pub fn open_dir(path: &Path) -> io::Result<OwnedFd> {
    Ok(openat(
        AT_FDCWD,
        c_path(path)?.as_c_str(),
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )?)
}

/// Send `bytes` with `fds` attached (SCM_RIGHTS) on a seqpacket socket.
pub fn send_with_fds(socket: BorrowedFd, bytes: &[u8], fds: &[BorrowedFd]) -> io::Result<()> {
    let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
    let cmsg = [ControlMessage::ScmRights(&raw)];
    let cmsgs: &[ControlMessage] = if raw.is_empty() { &[] } else { &cmsg };
    sendmsg::<()>(
        socket.as_raw_fd(),
        &[IoSlice::new(bytes)],
        cmsgs,
        MsgFlags::MSG_NOSIGNAL,
        None,
    )?;
    Ok(())
}

/// Receive one message of at most `max` bytes and at most `max_fds` descriptors
/// (close-on-exec) from a seqpacket socket. A message cut short is an error.
pub fn recv_with_fds(
    socket: BorrowedFd,
    max: usize,
    max_fds: usize,
) -> io::Result<(Vec<u8>, Vec<OwnedFd>)> {
    let mut buf = vec![0u8; max];
    let mut space = nix::cmsg_space!([RawFd; 4]);
    assert!(max_fds <= 4, "room for four descriptors");
    let mut iov = [IoSliceMut::new(&mut buf)];
    let msg = recvmsg::<()>(
        socket.as_raw_fd(),
        &mut iov,
        Some(&mut space),
        MsgFlags::MSG_CMSG_CLOEXEC,
    )?;
    let mut fds = Vec::new();
    for c in msg.cmsgs()? {
        if let ControlMessageOwned::ScmRights(list) = c {
            for fd in list {
                // SAFETY: the kernel installed these descriptors for us.
                fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
            }
        }
    }
    let truncated = msg
        .flags
        .intersects(MsgFlags::MSG_TRUNC | MsgFlags::MSG_CTRUNC);
    let n = msg.bytes;
    if truncated || fds.len() > max_fds {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "a message larger than expected",
        ));
    }
    buf.truncate(n);
    Ok((buf, fds))
}

#[cfg(test)]
mod tests {
    use super::check_sandbox_target;
    use crate::sys::PidFd;
    use std::io::BufRead;
    use std::os::fd::AsFd;
    use std::process::{Command, Stdio};

    /// Only a live process in a mount and a user namespace of its own passes:
    /// this process, a host child and a dead sandbox are refused.
    #[test]
    #[ignore = "needs root (unshare -m); .ci/run runs it"]
    fn a_target_is_a_live_process_in_namespaces_of_its_own() {
        let me = PidFd::open(std::process::id() as i32).unwrap();
        let e = check_sandbox_target(me.as_fd()).unwrap_err();
        assert!(
            e.to_string().contains("mount namespace: not a sandbox"),
            "{e}"
        );

        let mut host = Command::new("sleep").arg("60").spawn().unwrap();
        let fd = PidFd::open(host.id() as i32).unwrap();
        assert!(check_sandbox_target(fd.as_fd()).is_err());
        host.kill().unwrap();
        host.wait().unwrap();

        // Its own mount namespace, in the host's user namespace: refused.
        let mut mnt_only = in_namespaces("-m");
        let fd = PidFd::open(mnt_only.id() as i32).unwrap();
        let e = check_sandbox_target(fd.as_fd()).unwrap_err();
        assert!(
            e.to_string().contains("user namespace: not a sandbox"),
            "{e}"
        );
        mnt_only.kill().unwrap();
        mnt_only.wait().unwrap();

        let mut sandbox = in_namespaces("-Urm");
        let fd = PidFd::open(sandbox.id() as i32).unwrap();
        check_sandbox_target(fd.as_fd()).unwrap();
        sandbox.kill().unwrap();
        sandbox.wait().unwrap();
        // Dead, reaped: its pid may be anyone's now, and the pidfd says so.
        let e = check_sandbox_target(fd.as_fd()).unwrap_err();
        assert!(e.to_string().contains("has ended"), "{e}");
    }

    /// A `sleep` in new namespaces (`unshare FLAGS`), once it is in them.
    fn in_namespaces(flags: &str) -> std::process::Child {
        let mut child = Command::new("unshare")
            .args([flags, "sh", "-c", "echo in; exec sleep 60"])
            .stdout(Stdio::piped())
            .spawn()
            .expect("unshare (util-linux)");
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.as_mut().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(
            line, "in\n",
            "unshare {flags} (as root, with user namespaces)"
        );
        child
    }
}
