//! The sandbox's seccomp filter, in the spirit of Flatpak's. Pure: it returns the
//! compiled BPF program as the bytes bwrap's `--seccomp FD` reads. Three parts,
//! run in this order:
//!
//! 1. x32 guard (x86_64 only): a system call number with bit 0x40000000 set is the
//!    x32 ABI, which shares x86_64's audit arch, so the arch check below cannot see
//!    it and the denylist's numbers would not match it. Such a call kills the
//!    process, like a call of a foreign arch does.
//! 2. Denylist: system calls a script has no use for and that widen the kernel's
//!    attack surface (key rings, mounts and namespaces, kernel modules, BPF,
//!    io_uring, perf, userfaultfd, ptrace, NUMA policy, terminal injection) fail
//!    with EPERM; so do memory outside every limit the rlimit backend has
//!    (`memfd_create`, `memfd_secret`, SysV shared memory, message queues and
//!    semaphores). A call of another architecture (i386 on x86_64) kills the
//!    process, so the denylist cannot be walked around.
//!    `clone` with any `CLONE_NEW*` flag fails with EPERM too, as `unshare` and
//!    `setns` do: no namespace of any kind is made inside the sandbox.
//! 3. Socket families: `socket` and `socketpair` work for AF_UNIX, AF_INET and
//!    AF_INET6 only (the network namespace is empty); every other family fails with
//!    EAFNOSUPPORT. Families that a network namespace does not isolate (AF_VSOCK
//!    reaches the hypervisor's ports) or that are kernel attack surface (AF_ALG,
//!    AF_NETLINK, AF_PACKET, ...) are unreachable.
//!    Set-user-ID and set-group-ID bits fail with EPERM in every call that sets a
//!    file's mode (chmod, creating opens, mknod): the workspace is a host directory
//!    (systemd's `RestrictSUIDSGID=`, which the unit cannot use, see `setid_rules`).
//! 4. `clone3` and `openat2` fail with ENOSYS. Their flags (and openat2's mode) are
//!    in memory, where seccomp cannot look, so they cannot be refused for some
//!    flags only; ENOSYS makes glibc (and Python) fall back to `clone` and
//!    `openat`, which part 2 checks (Flatpak does the same for clone3).
//!
//! 5. `fallocate` with `FALLOC_FL_KEEP_SIZE` (alone, or with the modes that need
//!    it) fails with EOPNOTSUPP, as on a filesystem without it: it allocates
//!    blocks past the end of the file, which `RLIMIT_FSIZE`
//!    (`scripts.file_max_bytes`) does not count, so a file of size 0 could hold
//!    any amount of disk. Plain `fallocate` (mode 0, `posix_fallocate`) grows the
//!    file and is bounded like a write.
//!
//! Parts 2 and 4 are what keep a script from making a user namespace where bwrap's
//! `--disable-userns` cannot be used (a read-only `/proc/sys`, see `preflight`).
//!
//! seccompiler compiles parts 2 to 5 (one match action per filter, so one filter
//! each); `then` joins them and the guard is prepended. Classic BPF jumps are
//! relative to the next instruction and only go forward, and seccompiler's
//! programs end every path with a return, so a program can be prefixed, and its
//! `RET ALLOW`s replaced by a jump of the same size, without moving any target.

use seccompiler::{
    sock_filter, BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition,
    SeccompFilter, SeccompRule, TargetArch,
};
use std::collections::BTreeMap;

/// The refused system calls, refused whatever their arguments.
pub fn denied_syscalls() -> Vec<(&'static str, i64)> {
    let mut v: Vec<(&'static str, i64)> = vec![
        // Kernel key rings are shared across the whole uid.
        ("add_key", libc::SYS_add_key),
        ("keyctl", libc::SYS_keyctl),
        ("request_key", libc::SYS_request_key),
        // Mounts and namespaces: the sandbox's shape is bwrap's to set, not the script's.
        ("mount", libc::SYS_mount),
        ("umount2", libc::SYS_umount2),
        ("pivot_root", libc::SYS_pivot_root),
        ("chroot", libc::SYS_chroot),
        ("unshare", libc::SYS_unshare),
        ("setns", libc::SYS_setns),
        ("open_tree", libc::SYS_open_tree),
        ("move_mount", libc::SYS_move_mount),
        ("fsopen", libc::SYS_fsopen),
        ("fsconfig", libc::SYS_fsconfig),
        ("fsmount", libc::SYS_fsmount),
        ("fspick", libc::SYS_fspick),
        ("mount_setattr", libc::SYS_mount_setattr),
        // The kernel itself.
        ("init_module", libc::SYS_init_module),
        ("finit_module", libc::SYS_finit_module),
        ("delete_module", libc::SYS_delete_module),
        ("kexec_load", libc::SYS_kexec_load),
        ("kexec_file_load", libc::SYS_kexec_file_load),
        ("bpf", libc::SYS_bpf),
        ("perf_event_open", libc::SYS_perf_event_open),
        ("userfaultfd", libc::SYS_userfaultfd),
        ("io_uring_setup", libc::SYS_io_uring_setup),
        ("io_uring_enter", libc::SYS_io_uring_enter),
        ("io_uring_register", libc::SYS_io_uring_register),
        ("syslog", libc::SYS_syslog),
        ("acct", libc::SYS_acct),
        ("quotactl", libc::SYS_quotactl),
        ("swapon", libc::SYS_swapon),
        ("swapoff", libc::SYS_swapoff),
        ("reboot", libc::SYS_reboot),
        ("settimeofday", libc::SYS_settimeofday),
        ("clock_settime", libc::SYS_clock_settime),
        ("clock_adjtime", libc::SYS_clock_adjtime),
        ("adjtimex", libc::SYS_adjtimex),
        ("vhangup", libc::SYS_vhangup),
        ("fanotify_init", libc::SYS_fanotify_init),
        ("open_by_handle_at", libc::SYS_open_by_handle_at),
        ("name_to_handle_at", libc::SYS_name_to_handle_at),
        ("lookup_dcookie", libc::SYS_lookup_dcookie),
        // Other processes' memory and NUMA placement.
        ("ptrace", libc::SYS_ptrace),
        ("process_vm_readv", libc::SYS_process_vm_readv),
        ("process_vm_writev", libc::SYS_process_vm_writev),
        ("move_pages", libc::SYS_move_pages),
        ("mbind", libc::SYS_mbind),
        ("get_mempolicy", libc::SYS_get_mempolicy),
        ("set_mempolicy", libc::SYS_set_mempolicy),
        ("migrate_pages", libc::SYS_migrate_pages),
        ("personality", libc::SYS_personality),
        // Memory that no limit of the rlimit backend sees: a memfd filled with
        // write(2) and never mapped is not in the address space (RLIMIT_AS), nor
        // in any process's resident set; SysV shared memory outlives each
        // attachment (a script held 6x its memory_max_bytes, attaching segments
        // one at a time); SysV message queues hold kernel memory until read.
        // memfd_secret's pages are unswappable and uncounted as well. Python's
        // own shared memory (multiprocessing.shared_memory, its semaphores) is
        // POSIX: files in /dev/shm, which is /tmp, bounded by tmp_size_bytes.
        ("memfd_create", libc::SYS_memfd_create),
        ("memfd_secret", libc::SYS_memfd_secret),
        ("shmget", libc::SYS_shmget),
        ("shmat", libc::SYS_shmat),
        ("shmdt", libc::SYS_shmdt),
        ("shmctl", libc::SYS_shmctl),
        ("msgget", libc::SYS_msgget),
        ("msgsnd", libc::SYS_msgsnd),
        ("msgrcv", libc::SYS_msgrcv),
        ("msgctl", libc::SYS_msgctl),
        ("semget", libc::SYS_semget),
        ("semop", libc::SYS_semop),
        ("semtimedop", libc::SYS_semtimedop),
        ("semctl", libc::SYS_semctl),
    ];
    #[cfg(target_arch = "x86_64")]
    v.extend([
        ("uselib", libc::SYS_uselib),
        ("modify_ldt", libc::SYS_modify_ldt),
        ("iopl", libc::SYS_iopl),
        ("ioperm", libc::SYS_ioperm),
        ("_sysctl", libc::SYS__sysctl),
    ]);
    v
}

/// Why the filter could not be built. seccompiler's errors are its own words.
#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    /// No filter is written for the architecture this was built for.
    #[error("no seccomp filter for this architecture")]
    Arch,
    /// seccompiler refused one argument comparison.
    #[error("{0}")]
    Condition(#[source] seccompiler::BackendError),
    /// seccompiler refused one rule (a set of comparisons).
    #[error("{0}")]
    Rule(#[source] seccompiler::BackendError),
    /// seccompiler refused a filter (its rules and actions).
    #[error("{0}")]
    Filter(#[source] seccompiler::BackendError),
    /// seccompiler could not compile a filter to BPF.
    #[error("{0}")]
    Compile(#[source] seccompiler::BackendError),
    /// The joined program is longer than the kernel takes.
    #[error("seccomp program of {len} instructions; the kernel takes at most {}", MAX_INSTRUCTIONS - 1)]
    TooLong { len: usize },
}

/// The kernel's bound on a program (`BPF_MAXINSNS`), not reached.
const MAX_INSTRUCTIONS: usize = 4096;

fn arch() -> Result<TargetArch, SeccompError> {
    if cfg!(target_arch = "x86_64") {
        Ok(TargetArch::x86_64)
    } else if cfg!(target_arch = "aarch64") {
        Ok(TargetArch::aarch64)
    } else if cfg!(target_arch = "riscv64") {
        Ok(TargetArch::riscv64)
    } else {
        Err(SeccompError::Arch)
    }
}

/// The `clone` flags that make a namespace; `clone` with any of them is refused.
/// (`CLONE_NEWTIME` is `unshare`/`clone3` only: in `clone`'s flags 0x80 is part of
/// the exit signal.)
pub const NAMESPACE_FLAGS: &[(&str, i32)] = &[
    ("CLONE_NEWNS", libc::CLONE_NEWNS),
    ("CLONE_NEWCGROUP", libc::CLONE_NEWCGROUP),
    ("CLONE_NEWUTS", libc::CLONE_NEWUTS),
    ("CLONE_NEWIPC", libc::CLONE_NEWIPC),
    ("CLONE_NEWUSER", libc::CLONE_NEWUSER),
    ("CLONE_NEWPID", libc::CLONE_NEWPID),
    ("CLONE_NEWNET", libc::CLONE_NEWNET),
];

/// The address families `socket` and `socketpair` may create.
pub const ALLOWED_FAMILIES: &[(&str, i32)] = &[
    ("AF_UNIX", libc::AF_UNIX),
    ("AF_INET", libc::AF_INET),
    ("AF_INET6", libc::AF_INET6),
];

/// The read end of a pipe that already holds the program, for bwrap's
/// `--seccomp FD` (a few KiB: it fits the pipe, so the write never waits).
pub fn in_a_pipe() -> std::io::Result<std::os::fd::OwnedFd> {
    let (read, write) = crate::sys::channel_pipe()?;
    let program = cached().map_err(std::io::Error::other)?;
    std::io::Write::write_all(&mut std::fs::File::from(write), program)?;
    Ok(read)
}

/// The program, compiled once per process (and so is its failure).
pub fn cached() -> Result<&'static [u8], &'static SeccompError> {
    static PROGRAM: std::sync::OnceLock<Result<Vec<u8>, SeccompError>> = std::sync::OnceLock::new();
    PROGRAM.get_or_init(program).as_deref()
}

// Classic BPF, as in <linux/filter.h> and <linux/seccomp.h>.
const LD_W_ABS: u16 = 0x20; // BPF_LD (0) | BPF_W (0) | BPF_ABS
const JMP_JA: u16 = 0x05; // BPF_JMP | BPF_JA
const JMP_JEQ_K: u16 = 0x05 | 0x10; // BPF_JMP | BPF_JEQ | BPF_K
const JMP_JGE_K: u16 = 0x05 | 0x30; // BPF_JMP | BPF_JGE | BPF_K
const RET_K: u16 = 0x06; // BPF_RET | BPF_K
/// Offsets in `struct seccomp_data`.
const DATA_NR: u32 = 0;
const DATA_ARCH: u32 = 4;
const AUDIT_ARCH_X86_64: u32 = 0xC000_003E;
const X32_SYSCALL_BIT: u32 = 0x4000_0000;

fn ins(code: u16, jt: u8, jf: u8, k: u32) -> sock_filter {
    sock_filter { code, jt, jf, k }
}

/// x86_64: kill a call of the x32 ABI before anything else looks at its number.
/// Elsewhere empty (aarch64 and riscv64 have no such alias ABI; their compat
/// ABIs have an audit arch of their own, which the arch check kills).
fn x32_guard() -> Vec<sock_filter> {
    if !cfg!(target_arch = "x86_64") {
        return vec![];
    }
    vec![
        ins(LD_W_ABS, 0, 0, DATA_ARCH),
        // Not x86_64: leave it to the arch check that starts the next part.
        ins(JMP_JEQ_K, 0, 3, AUDIT_ARCH_X86_64),
        ins(LD_W_ABS, 0, 0, DATA_NR),
        ins(JMP_JGE_K, 0, 1, X32_SYSCALL_BIT),
        ins(RET_K, 0, 0, libc::SECCOMP_RET_KILL_PROCESS),
    ]
}

/// `first`, then `second` for what `first` allows: every `RET ALLOW` of `first`
/// becomes a jump to the start of `second` (same size, so `first`'s own jumps keep
/// their targets).
fn then(mut first: BpfProgram, second: BpfProgram) -> BpfProgram {
    let n = first.len();
    for (i, f) in first.iter_mut().enumerate() {
        if f.code == RET_K && f.k == libc::SECCOMP_RET_ALLOW {
            *f = ins(JMP_JA, 0, 0, (n - i - 1) as u32);
        }
    }
    first.extend(second);
    first
}

fn compile(
    rules: BTreeMap<i64, Vec<SeccompRule>>,
    on_match: SeccompAction,
) -> Result<BpfProgram, SeccompError> {
    let filter = SeccompFilter::new(rules, SeccompAction::Allow, on_match, arch()?)
        .map_err(SeccompError::Filter)?;
    filter.try_into().map_err(SeccompError::Compile)
}

/// Part 2: the denylist and the terminal-injection ioctls, EPERM.
fn denylist() -> Result<BpfProgram, SeccompError> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = denied_syscalls()
        .into_iter()
        .map(|(_, nr)| (nr, vec![]))
        .collect();
    // ioctl: TIOCSTI and TIOCLINUX push input into a terminal.
    let ioctl = [libc::TIOCSTI, libc::TIOCLINUX]
        .into_iter()
        .map(|req| {
            // libc's ioctl request type is u64 on some targets and i32 on others.
            #[allow(clippy::unnecessary_cast)]
            let c = SeccompCondition::new(1, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, req as u64)
                .map_err(SeccompError::Condition)?;
            SeccompRule::new(vec![c]).map_err(SeccompError::Rule)
        })
        .collect::<Result<Vec<_>, SeccompError>>()?;
    rules.insert(libc::SYS_ioctl, ioctl);
    // clone: flags are argument 0 on every architecture here, and the kernel reads
    // only their low 32 bits (`Dword`). One rule per flag: rules are alternatives.
    let clone = NAMESPACE_FLAGS
        .iter()
        .map(|&(_, flag)| {
            let c = SeccompCondition::new(
                0,
                SeccompCmpArgLen::Dword,
                SeccompCmpOp::MaskedEq(flag as u64),
                flag as u64,
            )
            .map_err(SeccompError::Condition)?;
            SeccompRule::new(vec![c]).map_err(SeccompError::Rule)
        })
        .collect::<Result<Vec<_>, SeccompError>>()?;
    rules.insert(libc::SYS_clone, clone);
    rules.extend(setid_rules()?);
    compile(rules, SeccompAction::Errno(libc::EPERM as u32))
}

/// No set-user-ID or set-group-ID file: a script's workspace is a host directory,
/// where such a bit would outlive the sandbox (its bind is nosuid only inside).
/// This is systemd's `RestrictSUIDSGID=`, which scriptgate.service cannot use (its
/// filter refuses `openat2` with ENOSYS, and bubblewrap 0.12 needs it): the bits
/// are refused in `chmod`, `fchmod`, `fchmodat`, `fchmodat2`, `mknod`, `mknodat`,
/// and in `creat`, `open` and `openat` that create (O_CREAT, O_TMPFILE). `openat2`,
/// whose mode is in memory, is part 4's.
fn setid_rules() -> Result<Vec<(i64, Vec<SeccompRule>)>, SeccompError> {
    let bit = |arg: u8, b: u32| {
        SeccompCondition::new(
            arg,
            SeccompCmpArgLen::Dword,
            SeccompCmpOp::MaskedEq(b as u64),
            b as u64,
        )
        .map_err(SeccompError::Condition)
    };
    let bits = [libc::S_ISUID, libc::S_ISGID];
    // (syscall, the mode's argument, the flags' argument when it only counts on
    // creation)
    let mut calls: Vec<(i64, u8, Option<u8>)> = vec![
        (libc::SYS_fchmod, 1, None),
        (libc::SYS_fchmodat, 2, None),
        (libc::SYS_fchmodat2, 2, None),
        (libc::SYS_mknodat, 2, None),
        (libc::SYS_openat, 3, Some(2)),
    ];
    #[cfg(target_arch = "x86_64")]
    calls.extend([
        (libc::SYS_chmod, 1, None),
        (libc::SYS_mknod, 1, None),
        (libc::SYS_creat, 1, None),
        (libc::SYS_open, 2, Some(1)),
    ]);
    let creating = [libc::O_CREAT as u32, libc::O_TMPFILE as u32];
    calls
        .into_iter()
        .map(|(nr, mode, flags)| {
            let mut rules = vec![];
            for b in bits {
                match flags {
                    None => rules.push(SeccompRule::new(vec![bit(mode, b)?])),
                    Some(f) => {
                        for c in creating {
                            rules.push(SeccompRule::new(vec![bit(f, c)?, bit(mode, b)?]));
                        }
                    }
                }
            }
            let rules = rules
                .into_iter()
                .collect::<Result<Vec<_>, _>>()
                .map_err(SeccompError::Rule)?;
            Ok((nr, rules))
        })
        .collect()
}

/// Part 4: `clone3` and `openat2`, ENOSYS (see the module comment).
fn no_clone3() -> Result<BpfProgram, SeccompError> {
    let rules = BTreeMap::from([(libc::SYS_clone3, vec![]), (libc::SYS_openat2, vec![])]);
    compile(rules, SeccompAction::Errno(libc::ENOSYS as u32))
}

/// Part 5: `fallocate` that allocates past the end of the file, EOPNOTSUPP (see
/// the module comment). The mode is argument 1; the kernel reads an int.
fn no_keep_size() -> Result<BpfProgram, SeccompError> {
    let keep = libc::FALLOC_FL_KEEP_SIZE as u64;
    let c = SeccompCondition::new(
        1,
        SeccompCmpArgLen::Dword,
        SeccompCmpOp::MaskedEq(keep),
        keep,
    )
    .map_err(SeccompError::Condition)?;
    let rule = SeccompRule::new(vec![c]).map_err(SeccompError::Rule)?;
    compile(
        BTreeMap::from([(libc::SYS_fallocate, vec![rule])]),
        SeccompAction::Errno(libc::EOPNOTSUPP as u32),
    )
}

/// Part 3: `socket`/`socketpair` of a family not in ALLOWED_FAMILIES, EAFNOSUPPORT.
/// The kernel reads the family as an `int`, so only the low 32 bits of the
/// argument are compared (`Dword`): high bits can neither smuggle a family in nor
/// get an allowed one refused.
fn families() -> Result<BpfProgram, SeccompError> {
    let not_allowed = ALLOWED_FAMILIES
        .iter()
        .map(|&(_, fam)| {
            SeccompCondition::new(0, SeccompCmpArgLen::Dword, SeccompCmpOp::Ne, fam as u64)
                .map_err(SeccompError::Condition)
        })
        .collect::<Result<Vec<_>, SeccompError>>()?;
    let rule = SeccompRule::new(not_allowed).map_err(SeccompError::Rule)?;
    let rules = [libc::SYS_socket, libc::SYS_socketpair]
        .into_iter()
        .map(|nr| (nr, vec![rule.clone()]))
        .collect();
    compile(rules, SeccompAction::Errno(libc::EAFNOSUPPORT as u32))
}

/// The whole filter as instructions.
fn instructions() -> Result<BpfProgram, SeccompError> {
    let mut prog = x32_guard();
    prog.extend(then(
        then(then(denylist()?, families()?), no_clone3()?),
        no_keep_size()?,
    ));
    within_bound(prog)
}

/// `prog`, if the kernel takes one of its length.
fn within_bound(prog: BpfProgram) -> Result<BpfProgram, SeccompError> {
    if prog.len() >= MAX_INSTRUCTIONS {
        return Err(SeccompError::TooLong { len: prog.len() });
    }
    Ok(prog)
}

/// The compiled program, as bwrap reads it: `struct sock_filter` records.
pub fn program() -> Result<Vec<u8>, SeccompError> {
    let prog = instructions()?;
    let mut bytes = Vec::with_capacity(prog.len() * 8);
    for ins in prog {
        bytes.extend_from_slice(&ins.code.to_ne_bytes());
        bytes.push(ins.jt);
        bytes.push(ins.jf);
        bytes.extend_from_slice(&ins.k.to_ne_bytes());
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the kernel would do with one system call: a classic-BPF interpreter for
    /// the instructions these programs use (anything else fails the test).
    fn run(prog: &[sock_filter], arch: u32, nr: u32, args: [u64; 6]) -> u32 {
        let mut data = Vec::with_capacity(64);
        data.extend_from_slice(&nr.to_ne_bytes());
        data.extend_from_slice(&arch.to_ne_bytes());
        data.extend_from_slice(&0u64.to_ne_bytes()); // instruction pointer
        for a in args {
            data.extend_from_slice(&a.to_ne_bytes());
        }
        let (mut pc, mut acc) = (0usize, 0u32);
        loop {
            let i = &prog[pc];
            let jump = |cond: bool| pc + 1 + if cond { i.jt } else { i.jf } as usize;
            pc = match i.code {
                LD_W_ABS => {
                    let at = i.k as usize;
                    acc = u32::from_ne_bytes(data[at..at + 4].try_into().unwrap());
                    pc + 1
                }
                0x54 => {
                    acc &= i.k; // BPF_ALU | BPF_AND | BPF_K
                    pc + 1
                }
                JMP_JA => pc + 1 + i.k as usize,
                JMP_JEQ_K => jump(acc == i.k),
                JMP_JGE_K => jump(acc >= i.k),
                0x25 => jump(acc > i.k),      // BPF_JGT
                0x45 => jump(acc & i.k != 0), // BPF_JSET
                RET_K => return i.k,
                c => panic!("unexpected BPF instruction {c:#x} at {pc}"),
            };
            assert!(pc < prog.len(), "ran off the end of the program");
        }
    }

    const ALLOW: u32 = libc::SECCOMP_RET_ALLOW;
    const KILL: u32 = libc::SECCOMP_RET_KILL_PROCESS;
    fn errno(e: i32) -> u32 {
        libc::SECCOMP_RET_ERRNO | e as u32
    }
    fn native() -> u32 {
        if cfg!(target_arch = "x86_64") {
            AUDIT_ARCH_X86_64
        } else if cfg!(target_arch = "aarch64") {
            0xC000_00B7
        } else {
            0xC000_00F3 // riscv64
        }
    }
    fn call(nr: i64, args: [u64; 6]) -> u32 {
        run(&instructions().unwrap(), native(), nr as u32, args)
    }

    #[test]
    fn a_program_too_long_for_the_kernel_is_refused() {
        let ret = ins(RET_K, 0, 0, libc::SECCOMP_RET_ALLOW);
        assert_eq!(within_bound(vec![ret.clone(); 4095]).unwrap().len(), 4095);
        let e = within_bound(vec![ret; 4096]).unwrap_err();
        assert!(matches!(e, SeccompError::TooLong { len: 4096 }), "{e:?}");
        assert_eq!(
            e.to_string(),
            "seccomp program of 4096 instructions; the kernel takes at most 4095"
        );
        assert_eq!(
            SeccompError::Arch.to_string(),
            "no seccomp filter for this architecture"
        );
        assert!(arch().is_ok() && cached().is_ok());
    }

    #[test]
    fn compiles_to_whole_instructions() {
        let p = super::program().unwrap();
        assert!(!p.is_empty());
        assert_eq!(p.len() % 8, 0);
        assert!(
            p.len() / 8 < 4096,
            "BPF programs are limited to 4096 instructions"
        );
    }

    #[test]
    fn ordinary_calls_pass_and_denied_ones_get_eperm() {
        for nr in [
            libc::SYS_getpid,
            libc::SYS_read,
            libc::SYS_clone,
            libc::SYS_openat,
        ] {
            assert_eq!(call(nr, [0; 6]), ALLOW, "{nr}");
        }
        assert_eq!(call(libc::SYS_clone3, [0; 6]), errno(libc::ENOSYS));
        for (name, nr) in denied_syscalls() {
            assert_eq!(call(nr, [0; 6]), errno(libc::EPERM), "{name}");
        }
        // libc's ioctl request type is u64 on some targets and i32 on others.
        #[allow(clippy::unnecessary_cast)]
        let tiocsti = libc::TIOCSTI as u64;
        assert_eq!(
            call(libc::SYS_ioctl, [0, tiocsti, 0, 0, 0, 0]),
            errno(libc::EPERM)
        );
        assert_eq!(call(libc::SYS_ioctl, [0, 0x5401, 0, 0, 0, 0]), ALLOW); // TCGETS
    }

    #[test]
    fn no_setuid_or_setgid_bit_is_set() {
        let eperm = errno(libc::EPERM);
        let creat = libc::O_CREAT as u64 | libc::O_WRONLY as u64;
        for bit in [libc::S_ISUID as u64, libc::S_ISGID as u64] {
            let m = 0o755 | bit;
            assert_eq!(call(libc::SYS_fchmod, [3, m, 0, 0, 0, 0]), eperm);
            assert_eq!(call(libc::SYS_fchmodat, [3, 0, m, 0, 0, 0]), eperm);
            assert_eq!(call(libc::SYS_fchmodat2, [3, 0, m, 0, 0, 0]), eperm);
            assert_eq!(call(libc::SYS_mknodat, [3, 0, m, 0, 0, 0]), eperm);
            assert_eq!(call(libc::SYS_openat, [3, 0, creat, m, 0, 0]), eperm);
            let tmpfile = libc::O_TMPFILE as u64 | libc::O_RDWR as u64;
            assert_eq!(call(libc::SYS_openat, [3, 0, tmpfile, m, 0, 0]), eperm);
            // Without O_CREAT the mode is not used, whatever the register holds.
            assert_eq!(call(libc::SYS_openat, [3, 0, 0, m, 0, 0]), ALLOW);
            #[cfg(target_arch = "x86_64")]
            {
                assert_eq!(call(libc::SYS_chmod, [0, m, 0, 0, 0, 0]), eperm);
                assert_eq!(call(libc::SYS_creat, [0, m, 0, 0, 0, 0]), eperm);
                assert_eq!(call(libc::SYS_open, [0, creat, m, 0, 0, 0]), eperm);
                assert_eq!(call(libc::SYS_mknod, [0, m, 0, 0, 0, 0]), eperm);
            }
        }
        // Ordinary modes pass; the sticky bit is no privilege.
        for m in [0o755u64, 0o600, 0o1777] {
            assert_eq!(call(libc::SYS_fchmod, [3, m, 0, 0, 0, 0]), ALLOW);
            assert_eq!(call(libc::SYS_openat, [3, 0, creat, m, 0, 0]), ALLOW);
        }
        assert_eq!(
            call(libc::SYS_openat2, [3, 0, 0, 24, 0, 0]),
            errno(libc::ENOSYS)
        );
    }

    #[test]
    fn clone_makes_threads_and_processes_but_no_namespace() {
        // What glibc's fork and pthread_create pass.
        let fork = (libc::CLONE_CHILD_SETTID | libc::CLONE_CHILD_CLEARTID | libc::SIGCHLD) as u64;
        let thread = (libc::CLONE_VM
            | libc::CLONE_FS
            | libc::CLONE_FILES
            | libc::CLONE_SIGHAND
            | libc::CLONE_THREAD
            | libc::CLONE_SYSVSEM
            | libc::CLONE_SETTLS
            | libc::CLONE_PARENT_SETTID
            | libc::CLONE_CHILD_CLEARTID) as u64;
        for flags in [fork, thread, libc::SIGCHLD as u64] {
            assert_eq!(call(libc::SYS_clone, [flags, 0, 0, 0, 0, 0]), ALLOW);
        }
        for (name, flag) in NAMESPACE_FLAGS {
            for with in [0, fork, thread] {
                let flags = with | *flag as u32 as u64;
                assert_eq!(
                    call(libc::SYS_clone, [flags, 0, 0, 0, 0, 0]),
                    errno(libc::EPERM),
                    "{name} with {with:#x}"
                );
                // High bits do not hide the flag (the kernel ignores them for clone).
                assert_eq!(
                    call(libc::SYS_clone, [flags | 1 << 40, 0, 0, 0, 0, 0]),
                    errno(libc::EPERM),
                    "{name} with high bits"
                );
            }
        }
        // unshare and setns are refused whatever their flags; clone3 cannot be
        // inspected, so glibc is sent back to clone.
        for nr in [libc::SYS_unshare, libc::SYS_setns] {
            let all = NAMESPACE_FLAGS
                .iter()
                .fold(0u64, |a, f| a | f.1 as u32 as u64);
            assert_eq!(call(nr, [all, 0, 0, 0, 0, 0]), errno(libc::EPERM));
        }
        assert_eq!(
            call(libc::SYS_clone3, [0, 88, 0, 0, 0, 0]),
            errno(libc::ENOSYS)
        );
    }

    #[test]
    fn only_allowed_socket_families() {
        for nr in [libc::SYS_socket, libc::SYS_socketpair] {
            for (name, fam) in ALLOWED_FAMILIES {
                assert_eq!(call(nr, [*fam as u64, 1, 0, 0, 0, 0]), ALLOW, "{name}");
                // High bits are ignored by the kernel and by the filter alike.
                let high = (1u64 << 32) | *fam as u64;
                assert_eq!(call(nr, [high, 1, 0, 0, 0, 0]), ALLOW, "{name} | 1<<32");
            }
            for fam in [
                libc::AF_UNSPEC,
                libc::AF_VSOCK,
                libc::AF_NETLINK,
                libc::AF_PACKET,
                libc::AF_ALG,
                libc::AF_BLUETOOTH,
                libc::AF_XDP,
                1000,
            ] {
                assert_eq!(
                    call(nr, [fam as u64, 1, 0, 0, 0, 0]),
                    errno(libc::EAFNOSUPPORT),
                    "family {fam}"
                );
                let high = (7u64 << 32) | fam as u64;
                assert_eq!(
                    call(nr, [high, 1, 0, 0, 0, 0]),
                    errno(libc::EAFNOSUPPORT),
                    "family {fam} with high bits"
                );
            }
        }
    }

    #[test]
    fn foreign_arches_and_x32_are_killed() {
        let prog = instructions().unwrap();
        assert_eq!(
            run(&prog, 0x4000_0003, libc::SYS_getpid as u32, [0; 6]),
            KILL,
            "i386"
        );
        if cfg!(target_arch = "x86_64") {
            for nr in [libc::SYS_getpid, libc::SYS_keyctl, libc::SYS_socket] {
                let x32 = nr as u32 | X32_SYSCALL_BIT;
                assert_eq!(run(&prog, native(), x32, [40, 1, 0, 0, 0, 0]), KILL, "{nr}");
            }
            assert_eq!(run(&prog, native(), u32::MAX, [0; 6]), KILL, "nr -1");
        }
    }

    #[test]
    fn then_keeps_the_first_programs_jumps() {
        // Every RET ALLOW of the denylist became a forward jump to the families part.
        let first = denylist().unwrap();
        let joined = then(first.clone(), families().unwrap());
        let joined = then(joined, no_clone3().unwrap());
        for (i, (a, b)) in first.iter().zip(&joined).enumerate() {
            if a.code == RET_K && a.k == ALLOW {
                assert_eq!(b.code, JMP_JA);
                assert_eq!(i + 1 + b.k as usize, first.len());
            } else {
                assert_eq!((a.code, a.jt, a.jf, a.k), (b.code, b.jt, b.jf, b.k));
            }
        }
    }
}
