//! Project quotas (ext4 with the `project` feature, XFS with `prjquota`): the
//! project id of a workspace's files (`FS_IOC_FSGETXATTR`/`FS_IOC_FSSETXATTR`,
//! inherited by what is created below a directory marked `PROJINHERIT`), and the
//! project's block limit (`quotactl_fd`, Linux 5.14). Everything goes through a
//! descriptor of the workspace, opened beneath its root; no path is resolved.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// `struct fsxattr` of <linux/fs.h>.
#[repr(C)]
#[derive(Default)]
struct FsXattr {
    xflags: u32,
    extsize: u32,
    nextents: u32,
    projid: u32,
    cowextsize: u32,
    pad: [u8; 8],
}

/// `struct if_dqblk` of <linux/quota.h>.
#[repr(C)]
#[derive(Default)]
struct IfDqblk {
    bhardlimit: u64,
    bsoftlimit: u64,
    curspace: u64,
    ihardlimit: u64,
    isoftlimit: u64,
    curinodes: u64,
    btime: u64,
    itime: u64,
    valid: u32,
}

const FS_XFLAG_PROJINHERIT: u32 = 0x200;
nix::ioctl_read!(fs_getxattr, b'X', 31, FsXattr);
nix::ioctl_write_ptr!(fs_setxattr, b'X', 32, FsXattr);

/// `quotactl_fd(2)`: 443 in the generic system call table, which x86_64 and
/// aarch64 share here.
const SYS_QUOTACTL_FD: libc::c_long = 443;
const PRJQUOTA: u32 = 2;
const Q_SETQUOTA: u32 = 0x800008;
/// `XQM_CMD(5)`: the quota subsystem's state, `struct fs_quota_stat`.
const Q_XGETQSTAT: u32 = (b'X' as u32) << 8 | 5;
const FS_QUOTA_PDQ_ACCT: u16 = 1 << 4;
const FS_QUOTA_PDQ_ENFD: u16 = 1 << 5;
const QIF_BLIMITS: u32 = 1;
/// `if_dqblk`'s block limits count these.
const QIF_DQBLKSIZE: u64 = 1024;

fn qcmd(cmd: u32) -> libc::c_int {
    ((cmd << 8) | PRJQUOTA) as libc::c_int
}

fn quotactl(fd: BorrowedFd, cmd: u32, id: u32, addr: *mut libc::c_void) -> io::Result<()> {
    // SAFETY: quotactl_fd reads an open descriptor and, for the commands used
    // here, reads or writes one structure at `addr`, which the callers pass as
    // a live, correctly sized value (or a zeroed buffer larger than the kernel's
    // `fs_quota_stat`).
    let r = unsafe {
        libc::syscall(
            SYS_QUOTACTL_FD,
            fd.as_raw_fd(),
            qcmd(cmd) as libc::c_uint,
            id as libc::c_int,
            addr,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Whether this process may set a project's limit (CAP_SYS_ADMIN in its
/// effective set).
pub fn may_set_limits() -> bool {
    caps::has_cap(
        None,
        caps::CapSet::Effective,
        caps::Capability::CAP_SYS_ADMIN,
    )
    .unwrap_or(false)
}

/// What the workspace's filesystem does with project quotas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProjectQuotas {
    /// Accounted and their limits enforced.
    Enforced,
    /// Accounted, not enforced (ext4 mounted without `prjquota`, say).
    AccountedOnly,
    /// None: the filesystem or the kernel has no project quotas.
    Off,
    /// Not known: this process may not ask (`quotactl_fd` refused with EPERM,
    /// as a seccomp filter without it does).
    Refused,
}

/// Whether project quotas are on for the filesystem of `dir`.
pub fn project_quotas(dir: BorrowedFd) -> ProjectQuotas {
    // `struct fs_quota_stat` is 80 bytes; its flags are the u16 at offset 2.
    let mut stat = [0u8; 128];
    // Q_XGETQSTAT needs no capability: EPERM is a filter's.
    match quotactl(dir, Q_XGETQSTAT, 0, stat.as_mut_ptr().cast()) {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(libc::EPERM) => return ProjectQuotas::Refused,
        Err(_) => return ProjectQuotas::Off,
    }
    let flags = u16::from_ne_bytes([stat[2], stat[3]]);
    match (
        flags & FS_QUOTA_PDQ_ACCT != 0,
        flags & FS_QUOTA_PDQ_ENFD != 0,
    ) {
        (_, true) => ProjectQuotas::Enforced,
        (true, false) => ProjectQuotas::AccountedOnly,
        _ => ProjectQuotas::Off,
    }
}

/// The project id of the file at `fd`, and whether it passes it on (a
/// directory marked `PROJINHERIT`).
pub fn project_of(fd: BorrowedFd) -> io::Result<(u32, bool)> {
    let mut x = FsXattr::default();
    // SAFETY: FS_IOC_FSGETXATTR writes one `struct fsxattr` into `x`.
    unsafe { fs_getxattr(fd.as_raw_fd(), &mut x) }.map_err(io::Error::from)?;
    Ok((x.projid, x.xflags & FS_XFLAG_PROJINHERIT != 0))
}

/// Give the file at `fd` project `id` (and, for a directory, `PROJINHERIT`, so
/// what is created below it gets the same). Its blocks are charged to `id` from
/// now on.
pub fn set_project(fd: BorrowedFd, id: u32, directory: bool) -> io::Result<()> {
    let mut x = FsXattr::default();
    // SAFETY: FS_IOC_FSGETXATTR writes one `struct fsxattr` into `x`.
    unsafe { fs_getxattr(fd.as_raw_fd(), &mut x) }.map_err(io::Error::from)?;
    x.projid = id;
    if directory {
        x.xflags |= FS_XFLAG_PROJINHERIT;
    }
    // SAFETY: FS_IOC_FSSETXATTR reads the `struct fsxattr` at `&x`.
    unsafe { fs_setxattr(fd.as_raw_fd(), &x) }.map_err(io::Error::from)?;
    Ok(())
}

/// Give every directory and regular file below (and at) `root` project `id`,
/// visiting at most `max` of them; symbolic links and special files are
/// skipped, nothing is followed. Answers how many were given it, or `None`
/// when there were more than `max`.
pub fn set_project_tree(root: BorrowedFd, id: u32, max: usize) -> io::Result<Option<usize>> {
    use nix::dir::{Dir, Type};
    use nix::fcntl::{openat, OFlag};
    use nix::sys::stat::Mode;
    let mut count = 0usize;
    let dup = |fd: BorrowedFd| -> io::Result<OwnedFd> {
        // SAFETY: F_DUPFD_CLOEXEC returns a new descriptor this function owns.
        let r = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 0) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `r` is a descriptor just made, owned by no one else.
        Ok(unsafe { OwnedFd::from_raw_fd(r) })
    };
    let mut stack = vec![dup(root)?];
    while let Some(dir) = stack.pop() {
        set_project(std::os::fd::AsFd::as_fd(&dir), id, true)?;
        count += 1;
        if count > max {
            return Ok(None);
        }
        let mut entries =
            Dir::from_fd(dup(std::os::fd::AsFd::as_fd(&dir))?).map_err(io::Error::from)?;
        for e in entries.iter() {
            let e = e.map_err(io::Error::from)?;
            let name = e.file_name();
            if name.to_bytes() == b"." || name.to_bytes() == b".." {
                continue;
            }
            let flags = OFlag::O_RDONLY
                | OFlag::O_NOFOLLOW
                | OFlag::O_NONBLOCK
                | OFlag::O_NOCTTY
                | OFlag::O_CLOEXEC;
            match e.file_type() {
                Some(Type::Directory) => {
                    let fd = openat(&dir, name, flags | OFlag::O_DIRECTORY, Mode::empty())
                        .map_err(io::Error::from)?;
                    stack.push(fd);
                }
                Some(Type::File) => {
                    let fd = openat(&dir, name, flags, Mode::empty()).map_err(io::Error::from)?;
                    set_project(std::os::fd::AsFd::as_fd(&fd), id, false)?;
                    count += 1;
                    if count > max {
                        return Ok(None);
                    }
                }
                _ => {}
            }
        }
    }
    Ok(Some(count))
}

/// Set project `id`'s block limit to `bytes` (rounded up to whole KiB; 0 removes
/// it) on the filesystem of `dir`.
pub fn set_project_limit(dir: BorrowedFd, id: u32, bytes: u64) -> io::Result<()> {
    let mut q = IfDqblk {
        bhardlimit: bytes.div_ceil(QIF_DQBLKSIZE),
        bsoftlimit: 0,
        valid: QIF_BLIMITS,
        ..Default::default()
    };
    quotactl(dir, Q_SETQUOTA, id, (&mut q as *mut IfDqblk).cast())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_structures_are_the_kernels_size() {
        assert_eq!(std::mem::size_of::<FsXattr>(), 28);
        assert_eq!(std::mem::size_of::<IfDqblk>(), 72);
        assert_eq!(qcmd(Q_SETQUOTA), 0x8000_0802u32 as i32);
    }

    #[test]
    fn a_filesystem_without_project_quotas_says_so() {
        // tmpfs (and this test host's kernel, built without quotas) has none.
        let d = tempfile::tempdir().unwrap();
        let f = std::fs::File::open(d.path()).unwrap();
        let q = project_quotas(std::os::fd::AsFd::as_fd(&f));
        assert_ne!(q, ProjectQuotas::Enforced, "{q:?}");
    }
}
