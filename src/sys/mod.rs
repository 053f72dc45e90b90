//! The privileged seam: every syscall that changes identity, ownership or process
//! state goes through here, so a reviewer reads one file to see what the daemon
//! does with its privileges.

use nix::fcntl::{openat, OFlag};
use nix::sys::stat::{fstat, mkdirat, Mode};
use nix::unistd::{fchown, Gid, Group, Uid, User};
use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};

pub mod mount;
pub mod quota;

/// A uid/gid pair a script runs as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Identity {
    pub uid: u32,
    pub gid: u32,
}

#[derive(Debug, thiserror::Error)]
pub enum SysError {
    #[error("{op} {path}: {source}")]
    Path {
        op: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("{0}")]
    Refused(String),
}

fn path_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(nix::Error) -> SysError + 'a {
    move |e| SysError::Path {
        op,
        path: path.to_path_buf(),
        source: io::Error::from(e),
    }
}

/// Who the script runs as: the peer, or `run_as` when the peer is root. Never root.
pub fn resolve_run_as(peer_uid: u32, peer_gid: u32, run_as: &str) -> Result<Identity, SysError> {
    let id = if peer_uid == 0 {
        let user = User::from_name(run_as).ok().flatten().ok_or_else(|| {
            SysError::Refused(format!("sandbox.run_as user {run_as:?} does not exist"))
        })?;
        Identity {
            uid: user.uid.as_raw(),
            gid: user.gid.as_raw(),
        }
    } else {
        Identity {
            uid: peer_uid,
            gid: peer_gid,
        }
    };
    if id.uid == 0 || id.gid == 0 {
        return Err(SysError::Refused(
            "scripts never run as root (check sandbox.run_as)".into(),
        ));
    }
    let me = Uid::effective().as_raw();
    if me != 0 && me != id.uid {
        return Err(SysError::Refused(format!(
            "the daemon runs as uid {me} and cannot switch to uid {}; run it as root or connect as uid {me}",
            id.uid
        )));
    }
    Ok(id)
}

/// Is this peer uid 0, or a member (primary or supplementary) of one of `groups`?
pub fn peer_in_groups(uid: u32, gid: u32, groups: &[String]) -> bool {
    if uid == 0 {
        return true;
    }
    let wanted: Vec<u32> = groups
        .iter()
        .filter_map(|g| Group::from_name(g).ok().flatten())
        .map(|g| g.gid.as_raw())
        .collect();
    if wanted.contains(&gid) {
        return true;
    }
    let Some(user) = User::from_uid(Uid::from_raw(uid)).ok().flatten() else {
        return false;
    };
    let Ok(name) = CString::new(user.name) else {
        return false;
    };
    nix::unistd::getgrouplist(&name, Gid::from_raw(gid))
        .map(|gs| gs.iter().any(|g| wanted.contains(&g.as_raw())))
        .unwrap_or(false)
}

/// A workspace, opened once beneath its root without following symlinks. Every
/// later use (the record directory, bwrap's bind mount) goes through `dir`, so
/// swapping a path component for a symlink afterwards (during the approval wait,
/// say) changes nothing: the daemon never resolves the path again.
pub struct WorkspaceDir {
    pub dir: OwnedFd,
    /// The directory's path: the root's canonical path plus the components walked.
    pub path: PathBuf,
    /// Owner, group and mode of each directory walked between the root and the
    /// workspace (both excluded): bwrap binds the workspace by descriptor, so
    /// nothing else checks that the script's uid may search its way there.
    between: Vec<(u32, u32, u32)>,
}

impl WorkspaceDir {
    /// May `id` reach the workspace through the directories below its root? A
    /// read-only run in `<root>/run-X/sub` must not let a script read `sub` when
    /// `run-X` is another user's 0700 directory.
    pub fn reachable_by(&self, id: Identity) -> bool {
        self.between
            .iter()
            .all(|&(owner, group, mode)| mode_permits(owner, group, mode, id, 0o1))
    }
}

/// Why a workspace cannot be used (protocol §2: error -32011; the daemon names
/// each with its `data.reason`).
#[derive(Debug, thiserror::Error)]
pub enum WorkspaceError {
    #[error("workspace {0} is not under any of workspace.roots")]
    OutsideRoots(PathBuf),
    #[error("workspace {0} is a workspace root itself; give each run a directory below it")]
    IsRoot(PathBuf),
    #[error("workspace {path}: {component} is a symbolic link; name the directory itself")]
    Symlink { path: PathBuf, component: PathBuf },
    #[error("workspace {path}: {component} is not a directory")]
    NotDirectory { path: PathBuf, component: PathBuf },
    #[error("workspace {path}: {source}")]
    Unusable { path: PathBuf, source: io::Error },
}

impl WorkspaceDir {
    /// Open `path` beneath one of `roots`. The roots are the sysadmin's and are
    /// taken as configured or canonical; below a root, every component is opened
    /// relative to its parent with `O_NOFOLLOW`, and `..` is refused, so the result
    /// lies beneath the root whatever the tree looks like.
    pub fn open(path: &Path, roots: &[PathBuf]) -> Result<WorkspaceDir, WorkspaceError> {
        use std::path::Component;
        let outside = || WorkspaceError::OutsideRoots(path.to_path_buf());
        if !path.is_absolute() || path.components().any(|c| c == Component::ParentDir) {
            return Err(outside());
        }
        for root in roots {
            let Ok(canonical) = std::fs::canonicalize(root) else {
                continue;
            };
            let rest = [root.as_path(), canonical.as_path()]
                .into_iter()
                .find_map(|r| path.strip_prefix(r).ok());
            let Some(rest) = rest else { continue };
            if rest.as_os_str().is_empty() {
                return Err(WorkspaceError::IsRoot(path.to_path_buf()));
            }
            let unusable = |source: io::Error| WorkspaceError::Unusable {
                path: path.to_path_buf(),
                source,
            };
            let mut dir: OwnedFd = File::open(&canonical).map_err(unusable)?.into();
            let mut walked = canonical.clone();
            let mut between = Vec::new();
            for (i, c) in rest.components().enumerate() {
                if i > 0 {
                    let st = fstat(&dir).map_err(|e| unusable(io::Error::from(e)))?;
                    between.push((st.st_uid, st.st_gid, st.st_mode & 0o7777));
                }
                let Component::Normal(name) = c else {
                    return Err(outside());
                };
                walked.push(name);
                let fd = openat(
                    &dir,
                    name,
                    OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC | OFlag::O_RDONLY,
                    Mode::empty(),
                );
                dir = match fd {
                    Ok(fd) => fd,
                    // O_DIRECTORY | O_NOFOLLOW on a symlink gives ENOTDIR (or
                    // ELOOP): look at the entry itself to say which it is.
                    Err(nix::Error::ELOOP | nix::Error::ENOTDIR) => {
                        let link = nix::sys::stat::fstatat(
                            &dir,
                            name,
                            nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
                        )
                        .is_ok_and(|st| st.st_mode & libc::S_IFMT == libc::S_IFLNK);
                        let (path, component) = (path.to_path_buf(), walked);
                        return Err(if link {
                            WorkspaceError::Symlink { path, component }
                        } else {
                            WorkspaceError::NotDirectory { path, component }
                        });
                    }
                    Err(e) => return Err(unusable(io::Error::from(e))),
                };
            }
            return Ok(WorkspaceDir {
                dir,
                path: walked,
                between,
            });
        }
        Err(outside())
    }
}

/// Do a file's owner, group and mode give `id` the permission bits `want` (0o7
/// bits: 4 read, 2 write, 1 execute/search)? The classic owner/group/other rule,
/// with the script's primary gid only (scripts run with no supplementary groups);
/// ACLs are not consulted.
pub fn mode_permits(owner: u32, group: u32, mode: u32, id: Identity, want: u32) -> bool {
    let bits = if owner == id.uid {
        mode >> 6
    } else if group == id.gid {
        mode >> 3
    } else {
        mode
    };
    bits & want & 0o7 == want & 0o7
}

impl WorkspaceDir {
    /// May `id` create files in the workspace (write and search)?
    pub fn writable_by(&self, id: Identity) -> Result<bool, SysError> {
        let st = fstat(&self.dir).map_err(path_err("stat", &self.path))?;
        Ok(mode_permits(st.st_uid, st.st_gid, st.st_mode, id, 0o3))
    }
}

/// The per-script record directory `<workspace>/.agent/scripts/<id>/`, created
/// relative to the opened workspace without following symlinks (a script may have
/// planted `.agent` as a link before it was first protected) and owned by the uid
/// the script runs as.
pub struct ArtifactDir {
    pub path: PathBuf,
    /// `<workspace>/.agent`, which the sandbox gets read-only over the workspace.
    pub agent: OwnedFd,
    dir: OwnedFd,
    owner: Identity,
}

fn open_dir_at(parent: &OwnedFd, name: &str, path: &Path) -> Result<OwnedFd, SysError> {
    openat(
        parent,
        name,
        OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC | OFlag::O_RDONLY,
        Mode::empty(),
    )
    .map_err(path_err("open (no symlinks)", path))
}

/// `adopt_root_owned`: an existing directory of root's may be handed to `owner`
/// (a root engine's workspace, whose `.agent` `scriptgate run` made as root). For
/// a non-root engine it may not: the daemon changes nothing its uid could not.
fn mkdir_owned(
    parent: &OwnedFd,
    name: &str,
    path: &Path,
    owner: Identity,
    must_be_new: bool,
    adopt_root_owned: bool,
) -> Result<OwnedFd, SysError> {
    let made = match mkdirat(parent, name, Mode::from_bits_truncate(0o700)) {
        Ok(()) => true,
        Err(nix::Error::EEXIST) if !must_be_new => false,
        Err(e) => return Err(path_err("mkdir", path)(e)),
    };
    let fd = open_dir_at(parent, name, path)?;
    let st = fstat(&fd).map_err(path_err("stat", path))?;
    if !made && st.st_uid == 0 && owner.uid != 0 && !adopt_root_owned {
        return Err(SysError::Refused(format!(
            "{} is owned by root, not by the script's uid {}; the daemon does not hand root's directories to an engine: \
             remove it or chown it to uid {} (or use another workspace)",
            path.display(),
            owner.uid,
            owner.uid
        )));
    }
    if st.st_uid != owner.uid && st.st_uid != 0 {
        return Err(SysError::Refused(format!(
            "{} is owned by uid {}, not by the script's uid {} or root",
            path.display(),
            st.st_uid,
            owner.uid
        )));
    }
    fchown(
        &fd,
        Some(Uid::from_raw(owner.uid)),
        Some(Gid::from_raw(owner.gid)),
    )
    .map_err(path_err("chown", path))?;
    Ok(fd)
}

impl ArtifactDir {
    /// `root_engine`: the start is a root engine's; only then may an existing
    /// root-owned `.agent` or `.agent/scripts` be handed to the script's uid.
    pub fn create(
        workspace: &WorkspaceDir,
        script_id: &str,
        owner: Identity,
        root_engine: bool,
    ) -> Result<ArtifactDir, SysError> {
        let agent_path = workspace.path.join(".agent");
        let agent = mkdir_owned(
            &workspace.dir,
            ".agent",
            &agent_path,
            owner,
            false,
            root_engine,
        )?;
        let scripts_path = agent_path.join("scripts");
        let scripts = mkdir_owned(&agent, "scripts", &scripts_path, owner, false, root_engine)?;
        let path = scripts_path.join(script_id);
        let dir = mkdir_owned(&scripts, script_id, &path, owner, true, root_engine)?;
        Ok(ArtifactDir {
            path,
            agent,
            dir,
            owner,
        })
    }

    /// Create a new file in the record directory, owned by the script's uid.
    pub fn create_file(&self, name: &str, mode: u32) -> Result<File, SysError> {
        let p = self.path.join(name);
        let fd = openat(
            &self.dir,
            name,
            OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::from_bits_truncate(mode),
        )
        .map_err(path_err("create", &p))?;
        fchown(
            &fd,
            Some(Uid::from_raw(self.owner.uid)),
            Some(Gid::from_raw(self.owner.gid)),
        )
        .map_err(path_err("chown", &p))?;
        Ok(File::from(fd))
    }
}

/// What the forked child does before it execs bwrap.
#[derive(Debug, Clone)]
pub struct ChildSetup {
    /// Switch to this identity (None: the daemon already is that uid).
    pub identity: Option<Identity>,
    /// `(resource, limit)` pairs applied with setrlimit.
    pub rlimits: Vec<(libc::__rlimit_resource_t, u64)>,
    /// `(from, to)`: descriptors to place at fixed numbers, each `to` at most
    /// `HIGHEST_FIXED_FD` and each `from` above it.
    pub dups: Vec<(RawFd, RawFd)>,
    /// The daemon's pid, to notice a parent that died before PDEATHSIG was armed.
    pub parent_pid: libc::pid_t,
}

/// Install the child setup as a `pre_exec` hook. Everything in the hook is a raw,
/// async-signal-safe syscall: no allocation, no locks.
pub fn install_pre_exec(cmd: &mut std::process::Command, s: ChildSetup) {
    assert!(
        s.dups
            .iter()
            .all(|&(from, to)| from > HIGHEST_FIXED_FD && to <= HIGHEST_FIXED_FD),
        "fixed fds must not collide with their sources"
    );
    let hook = move || -> io::Result<()> {
        let check = |rc: libc::c_int| {
            if rc == -1 {
                Err(io::Error::last_os_error())
            } else {
                Ok(())
            }
        };
        // SAFETY: plain syscalls on integers and stack data between fork and exec;
        // none allocates or takes a lock, so they are async-signal-safe.
        unsafe {
            // 1. The fixed descriptors: dup2 clears close-on-exec on these only.
            for &(from, to) in &s.dups {
                check(libc::dup2(from, to))?;
            }
            // 2. Limits, while we may still lower them as root.
            for &(res, lim) in &s.rlimits {
                let r = libc::rlimit {
                    rlim_cur: lim,
                    rlim_max: lim,
                };
                check(libc::setrlimit(res, &r))?;
            }
            // 3. Identity: groups first (needs CAP_SETGID), then gid, then uid; after
            //    setresuid to a non-root uid every capability is gone.
            //    A child started as another uid gets umask 0022, whatever the
            //    daemon's own (scriptgate.service gives it 0077, for its files).
            if let Some(id) = s.identity {
                libc::umask(0o022);
                check(libc::setgroups(0, std::ptr::null()))?;
                check(libc::setresgid(id.gid, id.gid, id.gid))?;
                check(libc::setresuid(id.uid, id.uid, id.uid))?;
            }
            // 4. PDEATHSIG is cleared by a uid change, so arm it after; then make sure
            //    the daemon did not die before it was armed.
            check(libc::prctl(
                libc::PR_SET_PDEATHSIG,
                libc::SIGKILL as libc::c_ulong,
                0,
                0,
                0,
            ))?;
            if libc::getppid() != s.parent_pid {
                libc::_exit(1);
            }
            // 5. No privilege gain through setuid binaries inside the sandbox.
            check(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))?;
        }
        Ok(())
    };
    // SAFETY: the hook only makes async-signal-safe syscalls (see above).
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(cmd, hook);
    }
}

/// A placeholder process, as `identity`, that lives until the write end returned
/// with it is closed or its holder dies, however it dies: a shell reading a line
/// that never comes from a pipe on its stdin. A systemd scope's keeper and the
/// limits preflight's placeholder. (A `sleep infinity` would outlive a daemon
/// killed with SIGKILL: the kernel sends the parent-death signal with the dying
/// parent's credentials, and a root daemon without CAP_KILL may not signal
/// another uid.) Nothing but the placeholder holds the read end: both ends are
/// close-on-exec, and the command's copy of the read end closes when it drops.
pub fn placeholder(identity: Option<Identity>) -> io::Result<(std::process::Command, OwnedFd)> {
    let (read, write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
    let sh = ["/usr/bin/sh", "/bin/sh"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
        .unwrap_or("sh");
    let mut k = std::process::Command::new(sh);
    k.args(["-c", "read -r line"])
        .env_clear()
        .stdin(std::process::Stdio::from(read))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    install_pre_exec(
        &mut k,
        ChildSetup {
            identity,
            rlimits: vec![],
            dups: vec![],
            parent_pid: std::process::id() as libc::pid_t,
        },
    );
    Ok((k, write))
}

/// The highest descriptor number a child gets fixed: `dups` place descriptors
/// at most here, and their sources are raised above it (the sandbox's ABI,
/// `sandbox::abi`, is held to it).
pub const HIGHEST_FIXED_FD: RawFd = 11;

/// A close-on-exec duplicate of `fd` numbered above the fixed descriptors, to be
/// placed at one of them in a child (`ChildSetup::dups`).
pub fn dup_high(fd: &impl std::os::fd::AsFd) -> io::Result<OwnedFd> {
    // SAFETY: F_DUPFD_CLOEXEC on a valid fd returns a new fd we then own.
    let n = unsafe {
        libc::fcntl(
            fd.as_fd().as_raw_fd(),
            libc::F_DUPFD_CLOEXEC,
            HIGHEST_FIXED_FD + 1,
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: n is a fresh descriptor from fcntl.
    Ok(unsafe { OwnedFd::from_raw_fd(n) })
}

/// A pipe whose ends are close-on-exec and numbered above the fixed descriptors
/// (so `dup2` onto them cannot clobber a twin).
pub fn channel_pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let (r, w) = nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(io::Error::from)?;
    Ok((raise_fd(r)?, raise_fd(w)?))
}

/// `bytes` in a sealed memfd, its offset at 0: a copy in memory that no one can
/// change or swap for something else (a file in a workspace could become a FIFO
/// that blocks whoever opens it, or another script). bwrap reads the script from it.
pub fn sealed_copy(name: &std::ffi::CStr, bytes: &[u8]) -> io::Result<OwnedFd> {
    use nix::fcntl::{fcntl, FcntlArg, SealFlag};
    use nix::sys::memfd::{memfd_create, MFdFlags};
    let fd = memfd_create(name, MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING)?;
    let mut f = std::fs::File::from(fd);
    io::Write::write_all(&mut f, bytes)?;
    let seals = SealFlag::F_SEAL_SEAL
        | SealFlag::F_SEAL_SHRINK
        | SealFlag::F_SEAL_GROW
        | SealFlag::F_SEAL_WRITE;
    fcntl(&f, FcntlArg::F_ADD_SEALS(seals))?;
    io::Seek::seek(&mut f, io::SeekFrom::Start(0))?;
    Ok(OwnedFd::from(f))
}

fn raise_fd(fd: OwnedFd) -> io::Result<OwnedFd> {
    if fd.as_raw_fd() > HIGHEST_FIXED_FD {
        return Ok(fd);
    }
    // SAFETY: F_DUPFD_CLOEXEC on a valid fd returns a new fd we then own.
    let n = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, HIGHEST_FIXED_FD + 1) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: n is a fresh descriptor from fcntl.
    Ok(unsafe { OwnedFd::from_raw_fd(n) })
}

/// A process handle that cannot be confused with a later process of the same pid.
pub struct PidFd {
    fd: OwnedFd,
    /// The uid the process runs as, when a root daemon switched to it for the
    /// process (`ChildSetup::identity`); None: the caller's own, or one it may
    /// signal as it is.
    runs_as: Option<u32>,
}

impl std::os::fd::AsFd for PidFd {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl PidFd {
    /// A process of the caller's own uid (or one it may signal as it is).
    pub fn open(pid: i32) -> io::Result<PidFd> {
        PidFd::open_as(pid, None)
    }

    /// A process that runs as `runs_as` (the script's identity; None: the
    /// caller's own): `kill` then signals it as that uid.
    pub fn open_as(pid: i32, runs_as: Option<Identity>) -> io::Result<PidFd> {
        // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(PidFd {
            // SAFETY: fd is a fresh descriptor returned by pidfd_open.
            fd: unsafe { OwnedFd::from_raw_fd(fd as RawFd) },
            runs_as: runs_as.map(|id| id.uid),
        })
    }

    /// SIGKILL the process; if it is the init of a PID namespace, the kernel then
    /// kills every process in that namespace.
    ///
    /// A root daemon keeps no CAP_KILL: a process it started as the script's uid
    /// is signalled by a thread of its own that takes that uid as its effective
    /// uid first (`as_thread_euid`), and the kernel lets a uid signal its own
    /// processes. (CAP_SETUID, which the daemon keeps to start scripts as their
    /// uid, is what that switch takes.)
    pub fn kill(&self) -> io::Result<()> {
        let send = || {
            // SAFETY: pidfd_send_signal on a pidfd we own, with no siginfo.
            let rc = unsafe {
                libc::syscall(
                    libc::SYS_pidfd_send_signal,
                    self.fd.as_raw_fd(),
                    libc::SIGKILL,
                    std::ptr::null::<libc::siginfo_t>(),
                    0,
                )
            };
            if rc < 0 {
                let e = io::Error::last_os_error();
                // ESRCH: it is gone already, which is what we wanted.
                if e.raw_os_error() != Some(libc::ESRCH) {
                    return Err(e);
                }
            }
            Ok(())
        };
        match self.runs_as {
            Some(uid) if uid != Uid::effective().as_raw() => as_thread_euid(uid, send)?,
            _ => send(),
        }
    }
}

/// Run `f` on a thread of its own whose effective uid is `uid` (its real and
/// saved uids stay the caller's); the thread ends with `f`, and with it the
/// changed credentials. Credentials are per thread in the kernel: the raw
/// setresuid(2) changes only the calling thread's (glibc's wrapper would change
/// every thread's). Taking a uid other than the real or saved one takes
/// CAP_SETUID; the change clears the thread's effective capabilities.
fn as_thread_euid<T: Send>(uid: u32, f: impl FnOnce() -> T + Send) -> io::Result<T> {
    std::thread::scope(|s| {
        std::thread::Builder::new()
            .name("scriptgate-signal".into())
            .spawn_scoped(s, move || {
                // -1: the real and saved uids stay as they are.
                let keep = libc::uid_t::MAX;
                // SAFETY: a raw syscall on integers; it changes this thread's
                // credentials only, and this thread runs nothing but `f` after it.
                let rc = unsafe { libc::syscall(libc::SYS_setresuid, keep, uid, keep) };
                if rc != 0 {
                    return Err(io::Error::last_os_error());
                }
                Ok(f())
            })?
            .join()
            .map_err(|_| io::Error::other("the signalling thread panicked"))?
    })
}

/// Keep only the capabilities the daemon needs, when it runs as root (each one's
/// use, as scriptgate.service's CapabilityBoundingSet= lists it, which has
/// these and `POOL_CAPABILITIES`):
/// - CAP_SETUID, CAP_SETGID: a child switches to the script's uid and gid and
///   drops every supplementary group before it execs bwrap (`install_pre_exec`);
///   a thread takes the script's uid to signal its sandbox (`PidFd::kill`);
/// - CAP_CHOWN: the script's record directory and files, and its stdout and
///   stderr pipes, are given to its uid (`ArtifactDir`, `give_pipe`); an
///   engine's `<root>/<uid>` to that engine (`ensure_engine_dir`); the audit
///   store to the admin group;
/// - CAP_DAC_OVERRIDE: workspaces are engines' directories (0700, say): the
///   daemon walks to them, opens them, writes the record into them and removes
///   expired ones (retention) whatever their modes;
/// - CAP_FOWNER: retention removes what scripts left in sticky directories of
///   their workspaces, and `scripts.disk_max_bytes` gives workspaces' files,
///   owned by the engines, a project id (`quota::set_project`).
///
/// With `quotas` (`scripts.disk_max_bytes` set), CAP_SYS_ADMIN too, which setting
/// a project quota's limit takes (`quota::set_project_limit`). With `pool`,
/// `POOL_CAPABILITIES`: only the mount server calls it so (`sandbox::mounter`),
/// started before the daemon drops them and able to hold no more than the
/// daemon had (no_new_privs); its helpers enter a pre-made sandbox's mount
/// namespace and mount the workspace into it. (bwrap needs none:
/// it builds the sandbox in a user namespace of its own, as the script's uid.)
/// No CAP_KILL (its sandboxes are signalled as their own uid) and no
/// CAP_DAC_READ_SEARCH (CAP_DAC_OVERRIDE covers every read and search it does).
///
/// Capabilities are per thread: it refuses to run once the process has more than
/// one (the others would keep theirs); threads started after it inherit the
/// smaller sets.
pub fn drop_daemon_capabilities(quotas: bool, pool: bool) -> Result<(), CapabilityError> {
    use caps::{CapSet, Capability as C};
    if !Uid::effective().is_root() {
        return Ok(());
    }
    if !single_threaded() {
        return Err(CapabilityError::Threads);
    }
    let keep: caps::CapsHashSet = DAEMON_CAPABILITIES
        .iter()
        .copied()
        .chain(quotas.then_some(C::CAP_SYS_ADMIN))
        .chain(POOL_CAPABILITIES.iter().copied().filter(|_| pool))
        .collect();
    let have = caps::read(None, CapSet::Permitted).map_err(CapabilityError::Read)?;
    let keep: caps::CapsHashSet = keep.intersection(&have).copied().collect();
    caps::set(None, CapSet::Effective, &keep).map_err(CapabilityError::SetEffective)?;
    caps::set(None, CapSet::Permitted, &keep).map_err(CapabilityError::SetPermitted)?;
    caps::clear(None, CapSet::Inheritable).map_err(CapabilityError::ClearInheritable)?;
    Ok(())
}

/// The capabilities a root daemon keeps ([`drop_daemon_capabilities`] says for
/// what); scriptgate.service's CapabilityBoundingSet= has these and, for the
/// mount server, `POOL_CAPABILITIES`.
pub const DAEMON_CAPABILITIES: [caps::Capability; 5] = [
    caps::Capability::CAP_SETUID,
    caps::Capability::CAP_SETGID,
    caps::Capability::CAP_CHOWN,
    caps::Capability::CAP_DAC_OVERRIDE,
    caps::Capability::CAP_FOWNER,
];

/// Does this process hold `POOL_CAPABILITIES` (permitted)? A root daemon
/// whose unit's bounding set leaves them out cannot enter a pre-made sandbox.
pub fn has_pool_capabilities() -> bool {
    caps::read(None, caps::CapSet::Permitted)
        .is_ok_and(|have| POOL_CAPABILITIES.iter().all(|c| have.contains(c)))
}

/// What a root daemon with a pool keeps besides (`drop_daemon_capabilities`):
/// setns into a mount namespace takes CAP_SYS_ADMIN and CAP_SYS_CHROOT,
/// mounting there CAP_SYS_ADMIN, and reaching a non-dumpable process's
/// namespace (the sandbox's init is not dumpable) CAP_SYS_PTRACE.
pub const POOL_CAPABILITIES: [caps::Capability; 3] = [
    caps::Capability::CAP_SYS_ADMIN,
    caps::Capability::CAP_SYS_CHROOT,
    caps::Capability::CAP_SYS_PTRACE,
];

/// Which step of [`drop_daemon_capabilities`] failed; the caps crate's words.
#[derive(Debug, thiserror::Error)]
pub enum CapabilityError {
    /// Called with more than one thread, whose others would keep theirs.
    #[error("more than one thread: the others would keep every capability")]
    Threads,
    /// Reading the permitted set.
    #[error("{0}")]
    Read(#[source] caps::errors::CapsError),
    /// Narrowing the effective set to the kept ones.
    #[error("{0}")]
    SetEffective(#[source] caps::errors::CapsError),
    /// Narrowing the permitted set to the kept ones.
    #[error("{0}")]
    SetPermitted(#[source] caps::errors::CapsError),
    /// Clearing the inheritable set.
    #[error("{0}")]
    ClearInheritable(#[source] caps::errors::CapsError),
}

/// Raise the soft limit on open descriptors to the hard limit: each connection
/// and each running script holds descriptors, and the usual soft default of 1024
/// is far below what `server.max_connections` and `max_running` need. Returns
/// the new soft limit.
pub fn raise_nofile() -> io::Result<u64> {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).map_err(io::Error::from)?;
    if soft < hard {
        setrlimit(Resource::RLIMIT_NOFILE, hard, hard).map_err(io::Error::from)?;
    }
    Ok(hard)
}

/// A long-lived thread that performs every sandbox spawn.
///
/// bwrap's `--die-with-parent` and our PDEATHSIG fire when the spawning *thread*
/// exits, so spawning from tokio's blocking pool (whose threads come and go) would
/// kill running scripts at random. This thread lives as long as the process.
///
/// Children are plain `std` children: tokio never reaps them, so their pid stays
/// ours until `wait_child` reaps it (a pidfd on it can then never hit another
/// process), and `wait4` gives the tree's resource usage.
#[derive(Clone)]
pub struct Spawner {
    tx: std::sync::mpsc::Sender<SpawnJob>,
}

type SpawnJob = (
    std::process::Command,
    tokio::sync::oneshot::Sender<io::Result<std::process::Child>>,
);

impl Spawner {
    pub fn start() -> Spawner {
        let (tx, rx) = std::sync::mpsc::channel::<SpawnJob>();
        std::thread::Builder::new()
            .name("scriptgate-spawner".into())
            .spawn(move || {
                for (mut cmd, reply) in rx {
                    let _ = reply.send(cmd.spawn());
                }
            })
            .expect("spawn the spawner thread");
        Spawner { tx }
    }

    /// `spawn`, for a thread outside the runtime (the pool's keeper).
    pub fn spawn_blocking(&self, cmd: std::process::Command) -> io::Result<std::process::Child> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.tx
            .send((cmd, tx))
            .map_err(|_| io::Error::other("spawner thread is gone"))?;
        rx.blocking_recv()
            .map_err(|_| io::Error::other("spawner thread is gone"))?
    }

    pub async fn spawn(&self, cmd: std::process::Command) -> io::Result<std::process::Child> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.tx
            .send((cmd, tx))
            .map_err(|_| io::Error::other("spawner thread is gone"))?;
        rx.await
            .map_err(|_| io::Error::other("spawner thread is gone"))?
    }
}

/// How a reaped child ended, with the resources it and its reaped descendants used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exit {
    pub code: Option<i32>,
    pub signal: Option<i32>,
    /// Largest resident set of any single process of the tree.
    pub max_rss_bytes: u64,
    /// User plus system CPU time of the tree.
    pub cpu_usec: u64,
}

/// Reap `pid` (our child) on a thread of its own; resolves when it has exited.
pub fn wait_child(pid: i32) -> tokio::sync::oneshot::Receiver<io::Result<Exit>> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("scriptgate-reaper".into())
        .spawn(move || {
            let r = loop {
                let mut status = 0;
                // SAFETY: an all-zero rusage is a valid value for wait4 to fill.
                let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
                // SAFETY: wait4 on our own child with valid out-pointers.
                let rc = unsafe { libc::wait4(pid, &mut status, 0, &mut ru) };
                if rc == pid {
                    let tv = |t: libc::timeval| t.tv_sec as u64 * 1_000_000 + t.tv_usec as u64;
                    break Ok(Exit {
                        code: libc::WIFEXITED(status).then(|| libc::WEXITSTATUS(status)),
                        signal: libc::WIFSIGNALED(status).then(|| libc::WTERMSIG(status)),
                        max_rss_bytes: ru.ru_maxrss as u64 * 1024,
                        cpu_usec: tv(ru.ru_utime) + tv(ru.ru_stime),
                    });
                }
                let e = io::Error::last_os_error();
                if e.raw_os_error() != Some(libc::EINTR) {
                    break Err(e);
                }
            };
            let _ = tx.send(r);
        })
        .expect("spawn a reaper thread");
    rx
}

/// `close_range(2)` flag: mark close-on-exec instead of closing.
const CLOSE_RANGE_CLOEXEC: libc::c_uint = 1 << 2;

/// Mark every descriptor numbered `lowest` or above close-on-exec, so that nothing
/// the process inherited or opened carelessly reaches a child. Async-signal-safe
/// (raw syscalls only), so it also runs between fork and exec.
fn cloexec_from_raw(lowest: RawFd) -> io::Result<()> {
    // SAFETY: close_range with CLOSE_RANGE_CLOEXEC only changes descriptor flags.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_close_range,
            lowest as libc::c_uint,
            libc::c_uint::MAX,
            CLOSE_RANGE_CLOEXEC,
        )
    };
    if rc == 0 {
        return Ok(());
    }
    // Kernels before 5.11: walk the descriptor table up to the limit.
    // SAFETY: an all-zero rlimit is a valid value for getrlimit to fill.
    let mut lim: libc::rlimit = unsafe { std::mem::zeroed() };
    // SAFETY: getrlimit with a valid out-pointer.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let top = lim.rlim_cur.min(1 << 20) as RawFd;
    for fd in lowest..top {
        // SAFETY: fcntl on a number that may not be open; EBADF is ignored.
        unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFD);
            if flags >= 0 && flags & libc::FD_CLOEXEC == 0 {
                libc::fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC);
            }
        }
    }
    Ok(())
}

/// At start-up: whatever the daemon inherited above stdio (a shell's stray
/// descriptors) stays out of every child. LISTEN_FDS sockets are close-on-exec
/// already.
pub fn cloexec_inherited_fds() -> io::Result<()> {
    cloexec_from_raw(3)
}

/// For the sandbox init (`sandbox::init`): every descriptor from `lowest` up is
/// close-on-exec, so the script it starts gets only what the init leaves open.
pub fn cloexec_from(lowest: RawFd) -> io::Result<()> {
    cloexec_from_raw(lowest)
}

/// For the sandbox init: close the descriptors `from..=to` (those not open are
/// skipped), so that it holds none of the script's ends.
pub fn close_fds(from: RawFd, to: RawFd) {
    // SAFETY: close_range(2) closes only numbers in the range and owns nothing
    // Rust holds: the init calls it before it opens anything of its own there.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_close_range,
            from as libc::c_uint,
            to as libc::c_uint,
            0 as libc::c_uint,
        )
    };
    if rc != 0 {
        for fd in from..=to {
            // SAFETY: as above; EBADF for a number that is not open is ignored.
            unsafe {
                libc::close(fd);
            }
        }
    }
}

/// For the sandbox init: own the descriptor it was started with at number `fd`.
pub fn inherited_fd(fd: RawFd) -> io::Result<OwnedFd> {
    // SAFETY: F_GETFD only reads the descriptor's flags; it fails if `fd` is not open.
    if unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is open (checked above) and nothing else in this process owns
    // it: the init was exec'd with it and takes it once, first thing.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A second `pre_exec` hook, after `install_pre_exec`'s: every descriptor above
/// the fixed ones is close-on-exec at the exec, whoever opened it and however, so
/// the child gets exactly stdio and its `dups`.
pub fn install_cloexec_above_fixed(cmd: &mut std::process::Command) {
    let hook = || cloexec_from_raw(HIGHEST_FIXED_FD + 1);
    // SAFETY: the hook makes only raw syscalls (close_range, getrlimit, fcntl),
    // which are async-signal-safe.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(cmd, hook);
    }
}

/// Reap every child of this process that has exited, without blocking: for
/// a process that does not wait for each one it starts (the mount server).
/// (SIGCHLD ignored would reap them too, but then a failed spawn's own wait,
/// in std's `Command::spawn`, finds no child and panics.)
pub fn reap_exited_children() {
    use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
    while let Ok(status) = waitpid(None, Some(WaitPidFlag::WNOHANG)) {
        if status == WaitStatus::StillAlive {
            break;
        }
    }
}

/// A `pre_exec` hook: SIGXFSZ ignored, so that a write past RLIMIT_FSIZE fails
/// with EFBIG instead of killing the writer. An ignored signal stays ignored
/// across exec (bwrap's, the sandbox init's, the script's).
pub fn install_ignore_sigxfsz(cmd: &mut std::process::Command) {
    let hook = || {
        // SAFETY: signal(2) is async-signal-safe.
        if unsafe { libc::signal(libc::SIGXFSZ, libc::SIG_IGN) } == libc::SIG_ERR {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    };
    // SAFETY: the hook makes one async-signal-safe syscall.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(cmd, hook);
    }
}

/// Give a pipe (both ends: it is one inode) to the script's identity, so that the
/// script can reopen its own stdout/stderr through `/dev/stdout` (a
/// `/proc/self/fd` link, which checks the pipe's owner and mode 0600).
pub fn give_pipe(fd: &impl std::os::fd::AsFd, to: Identity) -> io::Result<()> {
    fchown(fd, Some(Uid::from_raw(to.uid)), Some(Gid::from_raw(to.gid))).map_err(io::Error::from)
}

/// Change a path's permission bits (following a final symlink, as chmod(1) does;
/// the callers name paths in directories only root or the daemon can write).
pub fn chmod(path: &Path, mode: u32) -> io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
}

/// Change a path's owner and/or group (None leaves that one as it is).
pub fn chown(path: &Path, uid: Option<u32>, gid: Option<u32>) -> io::Result<()> {
    nix::unistd::chown(path, uid.map(Uid::from_raw), gid.map(Gid::from_raw))
        .map_err(io::Error::from)
}

/// A signal the daemon or the CLI sends to a process group it started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupSignal {
    Terminate,
    Kill,
}

/// Send `sig` to the process group `pgid` (a child started with
/// `process_group(0)`, whose pgid is its pid). ESRCH (the group is gone) is Ok.
pub fn signal_group(pgid: i32, sig: GroupSignal) -> io::Result<()> {
    use nix::sys::signal::{killpg, Signal};
    if pgid <= 1 {
        // killpg(0) would signal our own group and killpg(1) init's: never meant.
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    let sig = match sig {
        GroupSignal::Terminate => Signal::SIGTERM,
        GroupSignal::Kill => Signal::SIGKILL,
    };
    match killpg(nix::unistd::Pid::from_raw(pgid), sig) {
        Ok(()) | Err(nix::Error::ESRCH) => Ok(()),
        Err(e) => Err(io::Error::from(e)),
    }
}

/// Whether `activated_sockets` has handed out the LISTEN_FDS descriptors.
static ACTIVATION_TAKEN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Is this process running a single thread? Changing the environment is only
/// sound then (another thread might be reading it: getenv is not locked against
/// setenv in glibc).
fn single_threaded() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
        s.lines()
            .any(|l| l.strip_prefix("Threads:").map(str::trim) == Some("1"))
    })
}

/// Take the listening sockets systemd passed (LISTEN_FDS, unsetting the variables
/// so no child sees them), as owned descriptors. Only the first call gets them:
/// later calls return nothing, so no descriptor is ever owned twice. It must run
/// before any thread exists (it changes the environment): with more than one
/// thread it refuses.
pub fn activated_sockets() -> io::Result<Vec<OwnedFd>> {
    use std::sync::atomic::Ordering;
    if !single_threaded() {
        return Err(io::Error::other(
            "LISTEN_FDS must be taken before any thread starts",
        ));
    }
    if ACTIVATION_TAKEN.swap(true, Ordering::SeqCst) {
        return Ok(Vec::new());
    }
    // SAFETY: the process has one thread (checked above), so nothing reads the
    // environment while sd_notify unsets LISTEN_PID/LISTEN_FDS/LISTEN_FDNAMES.
    let fds = unsafe { sd_notify::listen_fds_and_unset_env() };
    // Malformed LISTEN_* variables: as if not socket-activated (as before), and
    // `--listen` or the "no socket" error takes over.
    let Ok(fds) = fds else {
        return Ok(Vec::new());
    };
    Ok(fds
        // SAFETY: systemd passed these descriptors to this process (LISTEN_FDS,
        // checked against LISTEN_PID by sd_notify, which also set each one
        // close-on-exec, so each is open), and the flag above makes this the only
        // place that ever takes them, once.
        .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) })
        .collect())
}

/// Whether standard error is systemd's journal stream: `JOURNAL_STREAM`, which
/// systemd sets to that stream's `dev:ino`, names the file at fd 2. Its lines
/// may then carry a `<N>` priority prefix (sd-daemon(3)).
pub fn stderr_is_journal() -> bool {
    let Some((dev, ino)) = std::env::var("JOURNAL_STREAM").ok().and_then(|v| {
        let (d, i) = v.split_once(':')?;
        Some((d.parse::<u64>().ok()?, i.parse::<u64>().ok()?))
    }) else {
        return false;
    };
    nix::sys::stat::fstat(std::io::stderr()).is_ok_and(|st| st.st_dev == dev && st.st_ino == ino)
}

/// The watchdog interval systemd asks for (WATCHDOG_USEC for this pid), unsetting
/// the variables so no child inherits them. Like `activated_sockets`, only with a
/// single thread; with more it leaves the environment alone and answers None.
pub fn take_watchdog() -> Option<std::time::Duration> {
    if !single_threaded() {
        return None;
    }
    // SAFETY: the process has one thread (checked above), so nothing reads the
    // environment while sd_notify unsets WATCHDOG_USEC/WATCHDOG_PID.
    unsafe { sd_notify::watchdog_enabled_and_unset_env() }
}

/// Raise the calling thread's nice value by `by` (at most to 19); best effort.
/// On Linux the nice value is per thread.
pub fn lower_thread_priority(by: i32) {
    // SAFETY: plain syscalls about the calling thread.
    unsafe {
        let tid = libc::gettid() as libc::id_t;
        *libc::__errno_location() = 0;
        let now = libc::getpriority(libc::PRIO_PROCESS as _, tid);
        if now != -1 || *libc::__errno_location() == 0 {
            libc::setpriority(libc::PRIO_PROCESS as _, tid, (now + by).min(19));
        }
    }
}

/// The peer's primary gid and the supplementary groups its user has in the
/// group database (none when the uid has no user entry).
pub fn peer_gids(uid: u32, gid: u32) -> Vec<u32> {
    let mut gids = vec![gid];
    if let Some(user) = User::from_uid(Uid::from_raw(uid)).ok().flatten() {
        if let Ok(name) = CString::new(user.name) {
            if let Ok(gs) = nix::unistd::getgrouplist(&name, Gid::from_raw(gid)) {
                gids.extend(gs.iter().map(|g| g.as_raw()));
            }
        }
    }
    gids.sort_unstable();
    gids.dedup();
    gids
}

/// The per-uid directory `<root>/<uid>` of an engine (scriptgated(8)), created
/// on first use: owned by the engine's uid and primary gid, mode 0700, so that
/// the engine and its scripts (which run as its uid) can use it and no other
/// engine can even list it. Created relative to the opened root, never through a
/// symlink. An existing one must be a directory owned by that uid, whose mode is
/// then the owner's to choose; one owned by root (made by the sysadmin, or left
/// by a daemon killed between the mkdir and the chown) is handed over.
pub fn ensure_engine_dir(root: &Path, owner: Identity) -> Result<PathBuf, SysError> {
    let root_fd = nix::fcntl::open(
        root,
        OFlag::O_DIRECTORY | OFlag::O_CLOEXEC | OFlag::O_RDONLY,
        Mode::empty(),
    )
    .map_err(path_err("open", root))?;
    let name = owner.uid.to_string();
    let path = root.join(&name);
    let created = match mkdirat(&root_fd, name.as_str(), Mode::from_bits_truncate(0o700)) {
        Ok(()) => true,
        Err(nix::Error::EEXIST) => false,
        Err(e) => return Err(path_err("mkdir", &path)(e)),
    };
    let fd = open_dir_at(&root_fd, &name, &path)?;
    let st = fstat(&fd).map_err(path_err("stat", &path))?;
    if st.st_uid == owner.uid {
        return Ok(path);
    }
    // A root-owned directory of that name is handed over only when it is new or
    // empty: whatever root keeps in `<root>/1001` is not uid 1001's to read.
    if st.st_uid == 0 && !created {
        let listed =
            std::fs::read_dir(format!("/proc/self/fd/{}", fd.as_raw_fd())).map_err(|source| {
                SysError::Path {
                    op: "list",
                    path: path.clone(),
                    source,
                }
            })?;
        if listed.take(1).count() > 0 {
            return Err(SysError::Refused(format!(
                "{} is root's and not empty, so it is not handed over to the engine with uid {}; move its contents elsewhere, or chown it to uid {} yourself",
                path.display(),
                owner.uid,
                owner.uid
            )));
        }
    }
    if st.st_uid != 0 {
        return Err(SysError::Refused(format!(
            "{} is owned by uid {}, not by the engine's uid {}; remove it or chown it to uid {}",
            path.display(),
            st.st_uid,
            owner.uid,
            owner.uid
        )));
    }
    nix::sys::stat::fchmod(&fd, Mode::from_bits_truncate(0o700))
        .map_err(path_err("chmod", &path))?;
    fchown(
        &fd,
        Some(Uid::from_raw(owner.uid)),
        Some(Gid::from_raw(owner.gid)),
    )
    .map_err(path_err("chown", &path))?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without CAP_KILL a root process cannot signal a process of another uid;
    /// `PidFd::kill` of one opened with that uid can (the signal goes from a
    /// thread that takes the uid), which is why the daemon keeps no CAP_KILL.
    #[test]
    fn a_process_of_another_uid_is_killed_without_cap_kill() {
        use std::os::unix::process::ExitStatusExt;
        if !Uid::effective().is_root() {
            eprintln!("skipped: needs root");
            return;
        }
        let id = Identity {
            uid: 65534,
            gid: 65534,
        };
        let mut cmd = std::process::Command::new("sleep");
        cmd.arg("600");
        install_pre_exec(
            &mut cmd,
            ChildSetup {
                identity: Some(id),
                rlimits: vec![],
                dups: vec![],
                parent_pid: std::process::id() as libc::pid_t,
            },
        );
        let mut child = cmd.spawn().unwrap();
        let pid = child.id() as i32;
        // Capabilities are per thread: this one alone gives up CAP_KILL, as the
        // daemon does (and the thread `kill` starts inherits that).
        let (plain, as_owner) = std::thread::spawn(move || {
            use caps::{CapSet, Capability};
            caps::drop(None, CapSet::Effective, Capability::CAP_KILL).unwrap();
            caps::drop(None, CapSet::Permitted, Capability::CAP_KILL).unwrap();
            let plain = PidFd::open(pid).unwrap().kill();
            let as_owner = PidFd::open_as(pid, Some(id)).unwrap().kill();
            (plain, as_owner)
        })
        .join()
        .unwrap();
        let refused = plain.expect_err("a kill as root, without CAP_KILL");
        assert_eq!(refused.raw_os_error(), Some(libc::EPERM));
        as_owner.unwrap();
        assert_eq!(child.wait().unwrap().signal(), Some(libc::SIGKILL));
        // The calling thread's credentials are its own still.
        assert!(Uid::effective().is_root());
        assert!(caps::has_cap(None, caps::CapSet::Effective, caps::Capability::CAP_KILL).unwrap());
    }

    /// The owner's bits for the owner, the group's for the primary group only,
    /// the others' for everyone else; each bit asked for must be there.
    #[test]
    fn mode_permits_takes_the_one_class_that_applies() {
        let me = Identity {
            uid: 1000,
            gid: 100,
        };
        let table = [
            // (owner, group, mode, want, expected, why)
            (1000, 0, 0o700, 0o3, true, "the owner with rwx"),
            (
                1000,
                100,
                0o077,
                0o3,
                false,
                "the owner gets the owner's bits, not the group's",
            ),
            (0, 100, 0o070, 0o3, true, "the primary group"),
            (
                0,
                100,
                0o707,
                0o3,
                false,
                "the group's bits, not the others'",
            ),
            (0, 0, 0o007, 0o3, true, "others"),
            (0, 0, 0o005, 0o3, false, "others without write"),
            (1000, 0, 0o500, 0o1, true, "search alone"),
            (1000, 0, 0o300, 0o5, false, "read and search, but no read"),
            (
                1000,
                0,
                0o40700,
                0o3,
                true,
                "the file type bits are not permission bits",
            ),
        ];
        for (owner, group, mode, want, expected, why) in table {
            assert_eq!(
                mode_permits(owner, group, mode, me, want),
                expected,
                "{why}"
            );
        }
    }
}
