//! The bubblewrap sandbox. `bwrap_args` is pure: it turns a spec into bwrap's argv
//! (unit-tested below); the spawn itself lives in `sys`, the privileged seam.

pub mod abi;
pub(crate) mod diagnose;
pub(crate) mod init;
pub mod member;
pub(crate) mod mounter;
pub mod pool;
pub(crate) mod preflight;
pub(crate) mod seccomp;

use abi::*;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// A pool member's Python program (`member.py`), written beside `agent_tools.py`
/// in the runtime directory: it waits on its stdin for its one script.
pub const MEMBER_PY: &str = include_str!("member.py");
pub const MEMBER_PY_NAME: &str = "member.py";

/// Where the embedded `agent_tools.py` is mounted inside the sandbox.
pub const RUNTIME_MOUNT: &str = "/run/scriptgate";

/// Where the script (`.agent/scripts/<id>/script.py`, opened by the daemon) is
/// inside the sandbox: bwrap copies it from its descriptor into a read-only file
/// there (`--ro-bind-data`). No script id is then in any command line (bwrap's,
/// the init's, Python's), which every user of the host can read with `ps`, nor
/// in the sandbox's `/proc/PID/mountinfo`, which is world-readable too (a bind
/// of the record directory showed its path there).
pub const SCRIPT_MOUNT: &str = "/run/scriptgate-script";

/// Host directories mounted read-only when they exist (symlinks are recreated as
/// symlinks, so merged-/usr systems get `/lib -> usr/lib`).
const SYSTEM_DIRS: &[&str] = &[
    "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
];

/// The few files of `/etc` a Python needs; the rest of `/etc` stays out.
const ETC_FILES: &[&str] = &[
    "/etc/ld.so.cache",
    "/etc/localtime",
    "/etc/nsswitch.conf",
    "/etc/passwd",
    "/etc/group",
    "/etc/mime.types",
    "/etc/ssl/certs/ca-certificates.crt",
];

/// Host device nodes bound into the sandbox's `/dev` (bwrap's `--dev` set, less
/// `/dev/tty`, `/dev/ptmx` and `/dev/pts`: scripts get no terminal, and ptys come
/// from one host-wide pool, `kernel.pty.max`, that a script could drain).
const DEV_NODES: &[&str] = &[
    "/dev/null",
    "/dev/zero",
    "/dev/full",
    "/dev/random",
    "/dev/urandom",
];

/// The `/dev` tmpfs holds only mount points and symlinks and is remounted
/// read-only; the size is a backstop.
const DEV_TMPFS_BYTES: u64 = 64 << 10;

/// glibc malloc arenas a script's processes may create. Each reserves 64 MiB of
/// address space, and up to 8 per CPU are made for threads; under the rlimit
/// backend's RLIMIT_AS (1 GiB by default) that allowed only ~14 Python threads.
/// Python holds the GIL, so two arenas cost it nothing.
pub const MALLOC_ARENA_MAX: &str = "2";

/// Where `libgcc_s.so.1` may be; the first found is preloaded into every process
/// of the sandbox. glibc loads it with `dlopen` when a thread exits or is
/// cancelled (its unwinder); a script that used up its address space with thread
/// stacks (the rlimit backend's RLIMIT_AS) had no room left for that `dlopen`, and
/// its first refused thread killed it ("libgcc_s.so.1 must be installed for
/// pthread_exit to work") where Python would have raised RuntimeError.
pub fn libgcc_s_candidates() -> Vec<PathBuf> {
    let triplet = if cfg!(target_arch = "x86_64") {
        "x86_64-linux-gnu"
    } else if cfg!(target_arch = "aarch64") {
        "aarch64-linux-gnu"
    } else {
        "riscv64-linux-gnu"
    };
    let mut v: Vec<PathBuf> = ["/usr/lib", "/lib"]
        .iter()
        .map(|d| Path::new(d).join(triplet).join("libgcc_s.so.1"))
        .collect();
    for d in ["/usr/lib64", "/lib64", "/usr/lib", "/lib"] {
        v.push(Path::new(d).join("libgcc_s.so.1"));
    }
    v
}

/// The sandbox's PID 1 is the daemon's own binary in its init mode
/// (`sandbox::init`, which says what it does), bound read-only at
/// `sandbox::init::MOUNT` and started as `MOUNT --sandbox-init REPORT_FD PROGRAM
/// ARGS...`.
pub use crate::sandbox::init::{ARG as INIT_ARG, MOUNT as INIT_MOUNT};

/// For the binaries' `main`: `Some(status)` when started in one of the hidden
/// modes of the sandbox's own helpers (the init, `init`; the pool's mount
/// helper, `mounter`), the process having done its work; `None` otherwise.
pub fn helper_dispatch() -> Option<i32> {
    let args: Vec<OsString> = std::env::args_os().skip(1).collect();
    if args.first()? == mounter::ARG {
        return Some(mounter::run(&args[1..]));
    }
    if args[0] == mounter::SERVER_ARG && args.len() == 1 {
        return Some(mounter::serve());
    }
    init::dispatch()
}

#[derive(Debug, Clone)]
pub struct SandboxSpec {
    /// The workspace's path: where the directory open at `FD_WORKSPACE` is mounted,
    /// and the working directory.
    workspace: PathBuf,
    read_only: bool,
    /// Host directory holding `agent_tools.py` (mounted read-only at RUNTIME_MOUNT).
    runtime_dir: PathBuf,
    /// The interpreter (`scripts.python`).
    python: PathBuf,
    /// The script's record file, inside the workspace's `.agent` tree (on the
    /// host): only its name is used. Its code reaches the sandbox from
    /// `FD_SCRIPT` (a sealed memfd), at `SCRIPT_MOUNT`; this path is never in
    /// the argv (it holds the script id).
    script: PathBuf,
    /// Size of the private `/tmp`.
    tmp_size_bytes: u64,
    /// Pass `--disable-userns`. It writes `/proc/sys/user/max_user_namespaces`
    /// inside the sandbox, which fails where `/proc/sys` is read-only (containers)
    /// and bwrap before 0.8 does not know it; `preflight` then turns it off, and the
    /// seccomp filter alone keeps the script from making a user namespace.
    disable_userns: bool,
    /// The sandbox's init: this binary (`sandbox::init::exe()`), bound read-only.
    init: PathBuf,
    /// `scripts.nofile_max`: RLIMIT_NOFILE of the sandbox's processes.
    nofile_max: u64,
    /// Execute-only copies of the interpreter and the init, bound in their
    /// place (see `ExecOnly`); `None` where they would not help (the daemon is
    /// not root, or the script runs as the daemon's uid).
    exec_only: Option<ExecOnly>,
}

/// What every sandbox of one daemon shares, from its configuration and what
/// it found at start: made once ([`SandboxBase::new`]); each script's
/// [`SandboxSpec`] adds its workspace and record.
#[derive(Debug, Clone)]
pub struct SandboxBase {
    runtime_dir: PathBuf,
    python: PathBuf,
    tmp_size_bytes: u64,
    disable_userns: bool,
    init: PathBuf,
    nofile_max: u64,
}

impl SandboxBase {
    /// `runtime_dir` holds `agent_tools.py`; `disable_userns` is the
    /// preflight's answer; the init is this binary (`init::exe`).
    pub fn new(
        runtime_dir: PathBuf,
        python: PathBuf,
        tmp_size_bytes: u64,
        disable_userns: bool,
        nofile_max: u64,
    ) -> SandboxBase {
        SandboxBase {
            runtime_dir,
            python,
            tmp_size_bytes,
            disable_userns,
            init: init::exe(),
            nofile_max,
        }
    }
}

impl SandboxBase {
    /// The same, with another binary as the sandbox's init (one whose
    /// `--sandbox-init` mode it is: a test binary is not).
    pub fn with_init(mut self, init: PathBuf) -> SandboxBase {
        self.init = init;
        self
    }
}

impl SandboxSpec {
    /// One script's sandbox: `base`, its workspace, and its record's
    /// `script.py`. The execute-only copies come later, from the runner
    /// ([`SandboxSpec::set_exec_only`]).
    pub fn new(
        base: &SandboxBase,
        workspace: PathBuf,
        read_only: bool,
        script: PathBuf,
    ) -> SandboxSpec {
        SandboxSpec {
            workspace,
            read_only,
            runtime_dir: base.runtime_dir.clone(),
            python: base.python.clone(),
            script,
            tmp_size_bytes: base.tmp_size_bytes,
            disable_userns: base.disable_userns,
            init: base.init.clone(),
            nofile_max: base.nofile_max,
            exec_only: None,
        }
    }

    pub fn runtime_dir(&self) -> &Path {
        &self.runtime_dir
    }

    pub fn workspace(&self) -> &Path {
        &self.workspace
    }

    pub fn read_only(&self) -> bool {
        self.read_only
    }

    /// The script's file name inside the sandbox (under `SCRIPT_MOUNT`).
    pub fn script_name(&self) -> &std::ffi::OsStr {
        self.script.file_name().unwrap_or_default()
    }

    pub fn python(&self) -> &Path {
        &self.python
    }

    pub fn init(&self) -> &Path {
        &self.init
    }

    pub fn nofile_max(&self) -> u64 {
        self.nofile_max
    }

    pub fn exec_only(&self) -> Option<&ExecOnly> {
        self.exec_only.as_ref()
    }

    /// Bind these execute-only copies in place of the interpreter and the init.
    pub fn set_exec_only(&mut self, copies: ExecOnly) {
        self.exec_only = Some(copies);
    }
}

/// Execute-only (mode 0111, root-owned) copies of the interpreter and of the
/// init. The kernel makes a process non-dumpable at execve when it cannot read
/// the executable (fs/exec.c `would_dump`), and moves its mm's user namespace up
/// to one where the file's owner is mapped: the host's. A process of the
/// script's uid outside the sandbox, owner of the sandbox's user namespace and so
/// capable in it, is then not capable where it counts, and
/// `/proc/PID/{root,cwd,environ,mem,fd}` of the init and of Python are closed to
/// it from their first instruction (they showed the script's private /tmp and
/// its workspace). Any other program a script execs (`/bin/sh`) is readable,
/// dumpable, and open to it again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecOnly {
    /// The copy of the interpreter, bound over `python_at`.
    pub python: PathBuf,
    /// The interpreter's own file (`scripts.python` with its links resolved), so
    /// that `sys.executable` and `sys.prefix` are those of `scripts.python`.
    pub python_at: PathBuf,
    /// The copy of the init (this binary), bound at `INIT_MOUNT`.
    pub init: PathBuf,
}

/// What a host path is, as far as the sandbox layout cares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry {
    Missing,
    Plain,
    Symlink(PathBuf),
}

/// What exists on the host, so that `bwrap_args` stays pure.
pub trait HostView {
    fn entry(&self, path: &Path) -> Entry;
}

pub struct RealHost;

impl HostView for RealHost {
    fn entry(&self, path: &Path) -> Entry {
        match std::fs::symlink_metadata(path) {
            Err(_) => Entry::Missing,
            Ok(m) if m.file_type().is_symlink() => match std::fs::read_link(path) {
                Ok(t) => Entry::Symlink(t),
                Err(_) => Entry::Missing,
            },
            Ok(_) => Entry::Plain,
        }
    }
}

fn push(args: &mut Vec<OsString>, items: &[&dyn AsRef<std::ffi::OsStr>]) {
    args.extend(items.iter().map(|s| s.as_ref().to_os_string()));
}

/// bwrap's argv (without the program name). The order matters: later mounts cover
/// earlier ones, so the workspace comes after the system dirs and `.agent` is
/// remounted read-only over the workspace last.
///
/// It is one long function on purpose (about 130 lines): the argv is one ordered
/// list, read top to bottom as the sandbox's layout, and split into helpers the
/// order that makes it safe would no longer be visible in one place. The golden
/// file `tests/fixtures/bwrap-argv.txt` pins the whole of it.
pub fn bwrap_args(spec: &SandboxSpec, host: &dyn HostView) -> Vec<OsString> {
    args(spec, host, false)
}

/// A pool member's argv: `bwrap_args` without the workspace, its `.agent`, the
/// script or the working directory, which come at assignment
/// (`mounter`, `MEMBER_PY`); Python runs `member.py`, which waits on its stdin
/// for the script. Nothing of any run is in it.
pub fn member_args(spec: &SandboxSpec, host: &dyn HostView) -> Vec<OsString> {
    args(spec, host, true)
}

fn args(spec: &SandboxSpec, host: &dyn HostView, member: bool) -> Vec<OsString> {
    let mut a: Vec<OsString> = Vec::new();
    isolation(&mut a, spec.disable_userns);
    host_mounts(&mut a, spec, host);
    dev_and_tmp(&mut a, spec.tmp_size_bytes);
    let script = if member {
        member_mounts(&mut a, spec)
    } else {
        our_mounts(&mut a, spec)
    };
    environment(&mut a, host);
    // The seccomp program (see `seccomp`), loaded just before the init's exec, so the
    // init and everything it starts carry it.
    push(&mut a, &[&"--seccomp", &FD_SECCOMP.to_string()]);
    // PID 1 is the init, which runs the script. The script's Python: -s, no user
    // site-packages; -B, no .pyc writes. PYTHONPATH is ours alone because the
    // environment was cleared.
    push(
        &mut a,
        &[&"--", &INIT_MOUNT, &INIT_ARG, &FD_USAGE.to_string()],
    );
    push(&mut a, &[&spec.python, &"-s", &"-B", &script]);
    a
}

/// The namespaces, the session, the capabilities and environment dropped, our
/// init as PID 1 and where bwrap says its pid.
fn isolation(a: &mut Vec<OsString>, disable_userns: bool) {
    // Namespaces: all of them (no network, not even loopback to the host), and an
    // explicit user namespace so that --disable-userns can forbid nested ones.
    push(a, &[&"--unshare-all", &"--unshare-user"]);
    if disable_userns {
        push(a, &[&"--disable-userns"]);
    }
    // The sandbox dies with its supervisor, has no controlling terminal (no TIOCSTI)
    // and no capabilities, and sees only the environment set below.
    push(
        a,
        &[
            &"--die-with-parent",
            &"--new-session",
            &"--cap-drop",
            &"ALL",
            &"--clearenv",
        ],
    );
    // No bwrap process inside the sandbox: its PID 1 is our init (`sandbox::init`).
    // bwrap then waits for that child itself, so nothing of the sandbox outlives
    // the outer bwrap (bwrap's own init was left behind, a zombie of whoever
    // inherited it, and its rusage never reached the daemon).
    push(a, &[&"--as-pid-1"]);
    // bwrap writes {"child-pid": N}, the sandbox's PID 1, so the supervisor can
    // kill the whole namespace even before --die-with-parent is armed.
    push(a, &[&"--info-fd", &FD_INFO.to_string()]);
}

/// What of the host the script sees, read-only: the system directories and
/// `/etc` files, the interpreter (its prefix, or its execute-only copy), `/proc`.
fn host_mounts(a: &mut Vec<OsString>, spec: &SandboxSpec, host: &dyn HostView) {
    for dir in SYSTEM_DIRS {
        match host.entry(Path::new(dir)) {
            Entry::Symlink(target) => push(a, &[&"--symlink", &target, dir]),
            Entry::Plain => push(a, &[&"--ro-bind", dir, dir]),
            Entry::Missing => {}
        }
    }
    for f in ETC_FILES {
        // A symlinked file (e.g. /etc/localtime) is bound as its target's content.
        if host.entry(Path::new(f)) != Entry::Missing {
            push(a, &[&"--ro-bind", f, f]);
        }
    }
    // An interpreter outside the system dirs (a venv, /opt/python) brings its prefix.
    if !SYSTEM_DIRS.iter().any(|d| spec.python.starts_with(d)) {
        if let Some(prefix) = spec.python.parent().and_then(Path::parent) {
            push(a, &[&"--ro-bind", &prefix, &prefix]);
        }
    }
    // Python runs from its execute-only copy, at its own path (see `ExecOnly`).
    if let Some(x) = &spec.exec_only {
        push(a, &[&"--ro-bind", &x.python, &x.python_at]);
    }
    push(a, &[&"--proc", &"/proc"]);
}

/// `/dev`, built by hand, and the private, bounded `/tmp`.
fn dev_and_tmp(a: &mut Vec<OsString>, tmp_size_bytes: u64) {
    // /dev is built by hand, not with --dev (an unbounded tmpfs writable by the
    // script, and a devpts that hands out ptys from the host-wide pool): a small
    // tmpfs with the device nodes bound in, the /proc/self/fd links, and
    // /dev/shm as a link to /tmp, so that POSIX shared memory and semaphores
    // (Python's multiprocessing) share /tmp's bound. Then /dev goes read-only.
    // --remount-ro is not recursive (checked): the device binds stay usable, and
    // a read-only mount does not stop writes to device nodes anyway.
    push(
        a,
        &[&"--size", &DEV_TMPFS_BYTES.to_string(), &"--tmpfs", &"/dev"],
    );
    for node in DEV_NODES {
        push(a, &[&"--dev-bind-try", node, node]);
    }
    for (target, link) in [
        ("/proc/self/fd", "/dev/fd"),
        ("/proc/self/fd/0", "/dev/stdin"),
        ("/proc/self/fd/1", "/dev/stdout"),
        ("/proc/self/fd/2", "/dev/stderr"),
        ("/tmp", "/dev/shm"),
    ] {
        push(a, &[&"--symlink", &target, &link]);
    }
    push(a, &[&"--remount-ro", &"/dev"]);
    push(
        a,
        &[&"--size", &tmp_size_bytes.to_string(), &"--tmpfs", &"/tmp"],
    );
}

/// scriptgate's own mounts: `agent_tools`, the init, the script, the workspace and
/// its `.agent`; then the root read-only and the workspace as working directory.
/// Returns where the script is inside.
fn our_mounts(a: &mut Vec<OsString>, spec: &SandboxSpec) -> PathBuf {
    runtime_and_init(a, spec);
    let script = Path::new(SCRIPT_MOUNT).join(spec.script.file_name().unwrap_or_default());
    push(a, &[&"--ro-bind-data", &FD_SCRIPT.to_string(), &script]);
    // The workspace and its `.agent` come as descriptors the daemon opened without
    // following symlinks: what is mounted is what was checked.
    let ws = &spec.workspace;
    let agent = ws.join(".agent");
    let bind = if spec.read_only {
        "--ro-bind-fd"
    } else {
        "--bind-fd"
    };
    push(a, &[&bind, &FD_WORKSPACE.to_string(), ws]);
    push(a, &[&"--ro-bind-fd", &FD_AGENT.to_string(), &agent]);
    // The root tmpfs bwrap builds the tree on goes read-only: writable are only the
    // workspace (unless read-only) and the private /tmp.
    push(a, &[&"--remount-ro", &"/"]);
    push(a, &[&"--chdir", ws]);
    script
}

/// A pool member's own mounts: `agent_tools` (with `member.py`) and the init,
/// then the root read-only. Returns the program Python runs.
fn member_mounts(a: &mut Vec<OsString>, spec: &SandboxSpec) -> PathBuf {
    runtime_and_init(a, spec);
    push(a, &[&"--remount-ro", &"/"]);
    Path::new(RUNTIME_MOUNT).join(MEMBER_PY_NAME)
}

/// `agent_tools` and the init, read-only.
fn runtime_and_init(a: &mut Vec<OsString>, spec: &SandboxSpec) {
    push(a, &[&"--ro-bind", &spec.runtime_dir, &RUNTIME_MOUNT]);
    let init = spec.exec_only.as_ref().map_or(&spec.init, |x| &x.init);
    push(a, &[&"--ro-bind", init, &INIT_MOUNT]);
}

/// The environment the script starts with (bwrap cleared the rest).
fn environment(a: &mut Vec<OsString>, host: &dyn HostView) {
    // libgcc_s in every process from its start (see `libgcc_s_candidates`); none
    // on the host, no preload (ld.so would complain at every exec).
    let libgcc = libgcc_s_candidates()
        .into_iter()
        .find(|p| host.entry(p) != Entry::Missing);
    if let Some(p) = &libgcc {
        push(a, &[&"--setenv", &"LD_PRELOAD", p]);
    }
    for (k, v) in [
        ("PATH", "/usr/local/bin:/usr/bin:/bin"),
        ("HOME", "/tmp"),
        ("TMPDIR", "/tmp"),
        ("LANG", "C.UTF-8"),
        ("PYTHONPATH", RUNTIME_MOUNT),
        ("PYTHONDONTWRITEBYTECODE", "1"),
        ("PYTHONIOENCODING", "utf-8"),
        ("PYTHONUNBUFFERED", "1"),
        ("MALLOC_ARENA_MAX", MALLOC_ARENA_MAX),
    ] {
        push(a, &[&"--setenv", &k, &v]);
    }
}

/// The preflight's argv (see `preflight`): the namespaces, isolation flags and
/// seccomp program of `bwrap_args`, the system dirs, `/proc` and a `/tmp`, and the
/// configured Python doing nothing. It fails where a script's sandbox would fail
/// to be made, and costs one short bwrap and one Python start.
pub fn probe_args(python: &Path, disable_userns: bool, host: &dyn HostView) -> Vec<OsString> {
    let mut a: Vec<OsString> = Vec::new();
    push(&mut a, &[&"--unshare-all", &"--unshare-user"]);
    if disable_userns {
        push(&mut a, &[&"--disable-userns"]);
    }
    push(
        &mut a,
        &[
            &"--die-with-parent",
            &"--new-session",
            &"--cap-drop",
            &"ALL",
            &"--clearenv",
            &"--as-pid-1",
        ],
    );
    for dir in SYSTEM_DIRS {
        match host.entry(Path::new(dir)) {
            Entry::Symlink(target) => push(&mut a, &[&"--symlink", &target, dir]),
            Entry::Plain => push(&mut a, &[&"--ro-bind", dir, dir]),
            Entry::Missing => {}
        }
    }
    if !SYSTEM_DIRS.iter().any(|d| python.starts_with(d)) {
        if let Some(prefix) = python.parent().and_then(Path::parent) {
            push(&mut a, &[&"--ro-bind", &prefix, &prefix]);
        }
    }
    push(&mut a, &[&"--proc", &"/proc", &"--tmpfs", &"/tmp"]);
    push(&mut a, &[&"--remount-ro", &"/", &"--chdir", &"/"]);
    push(&mut a, &[&"--seccomp", &FD_SECCOMP.to_string()]);
    push(&mut a, &[&"--", &python, &"-I", &"-S", &"-c", &"pass"]);
    a
}

/// The execute-only copies for a sandbox (see `ExecOnly`), kept in `dir` (the
/// daemon's `<state>/exec`, mode 0711: bwrap, run as the script's uid, binds them
/// by path, and nobody may list them). Each copy is named after its source's
/// identity (device, inode, size, modification time), so that a replaced
/// interpreter or daemon binary gets a fresh copy at the next script, and two
/// daemons on one state directory agree on the name; older copies of the same
/// source are removed. Only for a daemon running as root (the copy must belong
/// to another uid than the script's).
pub fn exec_only(python: &Path, init: &Path, dir: &Path) -> std::io::Result<ExecOnly> {
    let python_at = std::fs::canonicalize(python)?;
    Ok(ExecOnly {
        python: exec_only_copy(&python_at, dir)?,
        python_at,
        init: exec_only_copy(init, dir)?,
    })
}

fn exec_only_copy(src: &Path, dir: &Path) -> std::io::Result<PathBuf> {
    use std::io::{Error, ErrorKind};
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
    let src = std::fs::canonicalize(src)?;
    let st = std::fs::metadata(&src)?;
    if !st.is_file() {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            format!("{} is not a file", src.display()),
        ));
    }
    // A `#!` script (a pyenv shim, a Nix wrapper) is read by its interpreter: an
    // execute-only copy of it would not run at all.
    let mut magic = [0u8; 4];
    std::io::Read::read_exact(&mut std::fs::File::open(&src)?, &mut magic)?;
    if &magic != b"\x7fELF" {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            format!(
                "{} is not an ELF executable (a script is read by its interpreter, so an execute-only copy could not run)",
                src.display()
            ),
        ));
    }
    let base = src
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("program")
        .to_string();
    let name = format!(
        "{base}@{:x}-{:x}-{:x}-{}.{:09}",
        st.dev(),
        st.ino(),
        st.size(),
        st.mtime(),
        st.mtime_nsec()
    );
    let dest = dir.join(&name);
    let good = |m: &std::fs::Metadata| {
        m.is_file()
            && m.uid() == nix::unistd::geteuid().as_raw()
            && m.mode() & 0o7777 == 0o111
            && m.size() == st.size()
            && m.nlink() == 1
    };
    if std::fs::symlink_metadata(&dest).is_ok_and(|m| good(&m)) {
        return Ok(dest);
    }
    std::fs::create_dir_all(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711))?;
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = dir.join(format!(".{name}.{}.{seq}.new", std::process::id()));
    let made = (|| {
        let mut from = std::fs::File::open(&src)?;
        let mut to = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o100)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&tmp)?;
        std::io::copy(&mut from, &mut to)?;
        // The source may have been replaced while it was copied.
        if to.metadata()?.len() != st.size() {
            return Err(Error::other(format!(
                "{} changed while it was copied",
                src.display()
            )));
        }
        to.set_permissions(std::fs::Permissions::from_mode(0o111))?;
        drop(to);
        std::fs::rename(&tmp, &dest)
    })();
    if let Err(e) = made {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    // Older copies of this source (a sandbox that bound one keeps its inode).
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            let n = e.file_name();
            let n = n.to_string_lossy();
            if n != name && n.starts_with(&format!("{base}@")) {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
    Ok(dest)
}

/// Parse the init's report (see `sandbox::init`): the largest resident set of any process
/// of the script's tree, in bytes.
pub fn parse_usage_report(bytes: &[u8]) -> Option<Report> {
    let v: serde_json::Value = serde_json::from_slice(bytes).ok()?;
    Some(Report {
        max_rss_bytes: v.get("max_rss_kib")?.as_u64()?.checked_mul(1024)?,
        status: v
            .get("status")
            .and_then(|s| s.as_i64())
            .and_then(|s| i32::try_from(s).ok()),
        cpu_usec: v.get("cpu_usec").and_then(|c| c.as_u64()),
    })
}

/// The gate: a shell that waits for "go" on `FD_GATE` before it execs bwrap, so
/// that the sandbox's first instruction already runs inside its unit (cold
/// sandboxes and pre-made ones alike). A gate in `pre_exec` would deadlock:
/// spawning waits for the exec. Closed without "go", it exits 125.
fn gate_script() -> String {
    format!(
        r#"IFS= read -r go <&{FD_GATE} && [ "$go" = go ] || exit 125; exec {FD_GATE}<&-; exec "$0" "$@""#
    )
}

/// `bwrap` behind the gate (`gate_script`): the command for a sandbox that is
/// placed in its unit before it runs.
pub fn gated(bwrap: &Path) -> std::process::Command {
    let mut c = std::process::Command::new("/bin/sh");
    c.arg("-c").arg(gate_script()).arg(bwrap);
    c
}

/// The most of bwrap's `--info-fd` JSON that is read.
pub const INFO_MAX: usize = 4096;

/// bwrap's `--info-fd` JSON (`{"child-pid": N, ...}`), as far as it has come:
/// None while it does not parse yet (bwrap may keep the pipe open after it, so
/// it is read until complete, not to end of file); then the pid it names.
pub fn parse_child_pid(bytes: &[u8]) -> Option<Option<i32>> {
    let v = serde_json::from_slice::<serde_json::Value>(bytes).ok()?;
    Some(
        v.get("child-pid")
            .and_then(|p| p.as_i64())
            .map(|p| p as i32),
    )
}

/// The sandbox init's report (`init`): written once every process of the
/// script is reaped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Report {
    /// The largest resident set of any process of the tree.
    pub max_rss_bytes: u64,
    /// The script's exit status (128 + signal when killed by one).
    pub status: Option<i32>,
    /// User plus system CPU time of the script's processes.
    pub cpu_usec: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    struct FakeHost(HashMap<&'static str, Option<&'static str>>);
    impl HostView for FakeHost {
        fn entry(&self, path: &Path) -> Entry {
            match self.0.get(path.to_str().unwrap()) {
                None => Entry::Missing,
                Some(None) => Entry::Plain,
                Some(Some(t)) => Entry::Symlink(t.into()),
            }
        }
    }

    fn spec(read_only: bool) -> SandboxSpec {
        SandboxSpec {
            workspace: "/srv/ws/run-42".into(),
            read_only,
            runtime_dir: "/var/lib/scriptgate/runtime".into(),
            python: "/usr/bin/python3".into(),
            script: "/srv/ws/run-42/.agent/scripts/abc/script.py".into(),
            tmp_size_bytes: 1 << 20,
            disable_userns: true,
            init: "/usr/libexec/scriptgated".into(),
            nofile_max: 1024,
            exec_only: None,
        }
    }

    fn argv(read_only: bool) -> Vec<String> {
        let host = FakeHost(HashMap::from([
            ("/usr", None),
            ("/lib", Some("usr/lib")),
            ("/bin", Some("usr/bin")),
            ("/etc/passwd", None),
        ]));
        bwrap_args(&spec(read_only), &host)
            .into_iter()
            .map(|s| s.into_string().unwrap())
            .collect()
    }

    fn has(a: &[String], seq: &[&str]) -> bool {
        a.windows(seq.len()).any(|w| w == seq)
    }

    #[test]
    fn isolation_flags_are_present() {
        let a = argv(false);
        for f in [
            "--unshare-all",
            "--unshare-user",
            "--disable-userns",
            "--die-with-parent",
            "--new-session",
            "--clearenv",
        ] {
            assert!(a.contains(&f.to_string()), "{f} missing");
        }
        assert!(has(&a, &["--cap-drop", "ALL"]));
        assert!(has(&a, &["--ro-bind", "/usr", "/usr"]));
        assert!(has(&a, &["--symlink", "usr/lib", "/lib"]));
        assert!(!a.iter().any(|s| s == "/lib64"), "absent dirs are skipped");
        assert!(has(&a, &["--ro-bind", "/etc/passwd", "/etc/passwd"]));
        assert!(!a.iter().any(|s| s == "/etc/ld.so.cache"));
        assert!(has(&a, &["--size", "1048576", "--tmpfs", "/tmp"]));
        assert!(has(&a, &["--chdir", "/srv/ws/run-42"]));
        assert!(has(&a, &["--remount-ro", "/"]));
        assert!(has(&a, &["--info-fd", "5"]));
        assert!(has(&a, &["--seccomp", "8"]));
        assert!(has(&a, &["--setenv", "MALLOC_ARENA_MAX", "2"]));
        assert!(has(
            &a,
            &[
                "--ro-bind",
                "/usr/libexec/scriptgated",
                "/run/scriptgate-init"
            ]
        ));
    }

    #[test]
    fn the_init_is_pid_1_and_runs_the_script() {
        let a = argv(false);
        assert!(a.contains(&"--as-pid-1".to_string()));
        let dashdash = a.iter().position(|s| s == "--").unwrap();
        assert_eq!(
            &a[dashdash..],
            [
                "--",
                "/run/scriptgate-init",
                "--sandbox-init",
                "7",
                "/usr/bin/python3",
                "-s",
                "-B",
                "/run/scriptgate-script/script.py"
            ]
        );
        assert_eq!(FD_USAGE, 7);
        assert!(
            [
                FD_REQUESTS,
                FD_REPLIES,
                FD_INFO,
                FD_GATE,
                FD_USAGE,
                FD_SECCOMP,
                FD_WORKSPACE,
                FD_SCRIPT
            ]
            .iter()
            .all(|&fd| fd < FD_AGENT),
            "sys bounds the fixed descriptors by FD_AGENT"
        );
    }

    #[test]
    fn dev_is_built_by_hand_and_read_only() {
        let a = argv(false);
        assert!(!a.contains(&"--dev".to_string()), "no bwrap --dev");
        assert!(has(&a, &["--size", "65536", "--tmpfs", "/dev"]));
        for n in [
            "/dev/null",
            "/dev/zero",
            "/dev/full",
            "/dev/random",
            "/dev/urandom",
        ] {
            assert!(has(&a, &["--dev-bind-try", n, n]), "{n}");
        }
        assert!(has(&a, &["--symlink", "/proc/self/fd", "/dev/fd"]));
        assert!(has(&a, &["--symlink", "/proc/self/fd/2", "/dev/stderr"]));
        assert!(has(&a, &["--symlink", "/tmp", "/dev/shm"]));
        assert!(
            !a.iter()
                .any(|s| s.starts_with("/dev/pt") || s == "/dev/tty"),
            "no terminals"
        );
        // Read-only after everything under /dev is in place.
        let ro = a
            .windows(2)
            .position(|w| w == ["--remount-ro", "/dev"])
            .unwrap();
        let last_dev = a
            .iter()
            .rposition(|s| s.starts_with("/dev/") && s != "/dev/shm")
            .unwrap();
        assert!(ro > last_dev);
    }

    #[test]
    fn usage_report() {
        assert_eq!(
            parse_usage_report(b"{\"max_rss_kib\": 2048}\n").map(|r| r.max_rss_bytes),
            Some(2 << 20)
        );
        assert_eq!(parse_usage_report(b""), None);
        assert_eq!(parse_usage_report(b"{\"max_rss_kib\": -1}"), None);
        assert_eq!(
            parse_usage_report(b"{\"max_rss_kib\": 1, \"status\": 143, \"cpu_usec\": 5}\n"),
            Some(Report {
                max_rss_bytes: 1024,
                status: Some(143),
                cpu_usec: Some(5)
            })
        );
    }

    #[test]
    fn workspace_rw_with_agent_read_only_on_top() {
        let a = argv(false);
        let ws = a
            .windows(3)
            .position(|w| w == ["--bind-fd", "9", "/srv/ws/run-42"])
            .expect("the workspace is bound from its descriptor");
        let agent = a
            .windows(3)
            .position(|w| w == ["--ro-bind-fd", "11", "/srv/ws/run-42/.agent"])
            .expect(".agent is bound read-only from its descriptor");
        assert!(
            agent > ws,
            ".agent must be mounted after (over) the workspace"
        );
        assert!(
            !a.iter().any(|s| s == "--bind"),
            "nothing is bound writable by path"
        );
    }

    /// `ps` shows every user every command line: no script id in bwrap's argv
    /// (the init's and Python's are at its end). The script comes by fd.
    #[test]
    fn no_script_id_in_the_argv() {
        for a in [argv(false), argv(true)] {
            assert!(!a.iter().any(|s| s.contains("abc")), "{a:?}");
            let path = "/run/scriptgate-script/script.py";
            assert!(has(&a, &["--ro-bind-data", "10", path]));
            let bind = a.iter().position(|s| s == path).unwrap();
            let ro = a.windows(2).position(|w| w == ["--remount-ro", "/"]);
            assert!(bind < ro.unwrap(), "mounted before / goes read-only");
        }
    }

    #[test]
    fn execute_only_copies_are_bound_in_place() {
        let mut s = spec(false);
        s.exec_only = Some(ExecOnly {
            python: "/var/lib/scriptgate/exec/python3.11@1-2-3-4.5".into(),
            python_at: "/usr/bin/python3.11".into(),
            init: "/var/lib/scriptgate/exec/scriptgated@1-2-3-4.5".into(),
        });
        let host = FakeHost(HashMap::from([("/usr", None)]));
        let a: Vec<String> = bwrap_args(&s, &host)
            .into_iter()
            .map(|s| s.into_string().unwrap())
            .collect();
        let usr = a
            .windows(3)
            .position(|w| w == ["--ro-bind", "/usr", "/usr"])
            .unwrap();
        let py = a
            .windows(3)
            .position(|w| {
                w == [
                    "--ro-bind",
                    "/var/lib/scriptgate/exec/python3.11@1-2-3-4.5",
                    "/usr/bin/python3.11",
                ]
            })
            .expect("the interpreter's copy is bound at its own path");
        assert!(py > usr, "over /usr");
        assert!(has(
            &a,
            &[
                "--ro-bind",
                "/var/lib/scriptgate/exec/scriptgated@1-2-3-4.5",
                INIT_MOUNT
            ]
        ));
        assert!(!a.iter().any(|x| x == "/usr/libexec/scriptgated"));
        // Still started by its configured name: sys.executable is unchanged.
        assert!(a.ends_with(
            &[
                "/usr/bin/python3",
                "-s",
                "-B",
                "/run/scriptgate-script/script.py"
            ]
            .map(String::from)
        ));
    }

    #[test]
    fn libgcc_s_is_preloaded_when_the_host_has_it() {
        assert!(!argv(false).iter().any(|s| s == "LD_PRELOAD"));
        let lib = libgcc_s_candidates()[1].to_str().unwrap().to_string();
        let leaked: &'static str = Box::leak(lib.clone().into_boxed_str());
        let host = FakeHost(HashMap::from([("/usr", None), (leaked, None)]));
        let a: Vec<String> = bwrap_args(&spec(false), &host)
            .into_iter()
            .map(|s| s.into_string().unwrap())
            .collect();
        assert!(has(&a, &["--setenv", "LD_PRELOAD", &lib]), "{a:?}");
    }

    #[test]
    fn an_execute_only_copy_follows_its_source() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let d = tempfile::tempdir().unwrap();
        let src = d.path().join("prog");
        std::fs::write(&src, b"\x7fELF one").unwrap();
        let dir = d.path().join("exec");
        let first = exec_only_copy(&src, &dir).unwrap();
        let m = std::fs::metadata(&first).unwrap();
        assert_eq!(m.mode() & 0o7777, 0o111);
        assert_eq!(m.uid(), nix::unistd::geteuid().as_raw());
        assert_eq!(std::fs::metadata(&dir).unwrap().mode() & 0o777, 0o711);
        assert_eq!(
            exec_only_copy(&src, &dir).unwrap(),
            first,
            "kept while unchanged"
        );
        // Replaced (a new inode): a new copy, the old one removed.
        let new = d.path().join("prog.new");
        std::fs::write(&new, b"\x7fELF second").unwrap();
        std::fs::rename(&new, &src).unwrap();
        let second = exec_only_copy(&src, &dir).unwrap();
        assert_ne!(second, first);
        assert!(!first.exists());
        std::fs::set_permissions(&second, std::fs::Permissions::from_mode(0o600)).unwrap();
        let m = std::fs::metadata(&second).unwrap();
        assert_eq!(m.len(), 11);
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(names.len(), 1, "{names:?}");
        // A copy whose mode was changed is made again.
        let third = exec_only_copy(&src, &dir).unwrap();
        assert_eq!(third, second);
        assert_eq!(std::fs::metadata(&third).unwrap().mode() & 0o7777, 0o111);
    }

    #[test]
    fn a_script_interpreter_gets_no_execute_only_copy() {
        let d = tempfile::tempdir().unwrap();
        let shim = d.path().join("python3");
        std::fs::write(&shim, b"#!/bin/sh\nexec /usr/bin/python3 \"$@\"\n").unwrap();
        let e = exec_only_copy(&shim, &d.path().join("exec")).unwrap_err();
        assert!(e.to_string().contains("not an ELF executable"), "{e}");
        assert!(!d.path().join("exec").exists(), "nothing copied");
    }

    #[test]
    fn read_only_run_mounts_the_workspace_read_only() {
        let a = argv(true);
        assert!(!a.iter().any(|s| s == "--bind-fd" || s == "--bind"));
        assert!(has(&a, &["--ro-bind-fd", "9", "/srv/ws/run-42"]));
    }

    #[test]
    fn without_disable_userns_only_that_flag_goes() {
        let mut s = spec(false);
        s.disable_userns = false;
        let host = FakeHost(HashMap::from([("/usr", None)]));
        let without: Vec<OsString> = bwrap_args(&s, &host);
        s.disable_userns = true;
        let mut with = bwrap_args(&s, &host);
        assert_eq!(with[2], "--disable-userns");
        with.remove(2);
        assert_eq!(with, without);
    }

    #[test]
    fn the_probe_makes_the_same_namespaces_and_runs_python() {
        let host = FakeHost(HashMap::from([("/usr", None), ("/lib", Some("usr/lib"))]));
        let probe = |d| -> Vec<String> {
            probe_args(Path::new("/usr/bin/python3"), d, &host)
                .into_iter()
                .map(|s| s.into_string().unwrap())
                .collect()
        };
        let real = argv(false);
        let a = probe(true);
        assert_eq!(a[..3], real[..3], "the namespace flags are the script's");
        for f in [
            "--die-with-parent",
            "--new-session",
            "--clearenv",
            "--as-pid-1",
        ] {
            assert!(a.contains(&f.to_string()), "{f}");
        }
        assert!(has(&a, &["--seccomp", "8"]));
        assert!(has(&a, &["--proc", "/proc"]));
        assert!(has(&a, &["--symlink", "usr/lib", "/lib"]));
        assert!(
            a.ends_with(&["--", "/usr/bin/python3", "-I", "-S", "-c", "pass"].map(String::from))
        );
        assert!(!probe(false).contains(&"--disable-userns".to_string()));
    }

    #[test]
    fn python_outside_system_dirs_brings_its_prefix() {
        let mut s = spec(false);
        s.python = "/opt/py/bin/python3".into();
        let a: Vec<String> = bwrap_args(&s, &FakeHost(HashMap::new()))
            .into_iter()
            .map(|s| s.into_string().unwrap())
            .collect();
        assert!(has(&a, &["--ro-bind", "/opt/py", "/opt/py"]));
    }

    /// bwrap's whole argv for a fake host, one argument per line (Rust-quoted, so
    /// the embedded init program stays on one line): every flag and mount, and
    /// their order, is reviewed as a diff of `tests/fixtures/bwrap-argv*.txt`.
    #[test]
    fn argv_matches_the_golden_files() {
        let lines = |a: Vec<String>| a.iter().map(|s| format!("{s:?}\n")).collect::<String>();
        crate::golden::check("bwrap-argv.txt", &lines(argv(false)));
        crate::golden::check("bwrap-argv-read-only.txt", &lines(argv(true)));
    }
}
