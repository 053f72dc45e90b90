//! The sandbox's seccomp filter, in the spirit of Flatpak's: a denylist of system
//! calls a script has no use for and that widen the kernel's attack surface (key
//! rings, mounts and namespaces, kernel modules, BPF, io_uring, perf, userfaultfd,
//! ptrace, NUMA policy, terminal injection). They fail with EPERM; everything else
//! is allowed. A syscall of another architecture (i386 on x86_64) kills the
//! process, so the denylist cannot be walked around. Pure: it returns the compiled
//! BPF program as the bytes bwrap's `--seccomp FD` reads.

use seccompiler::{
    SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter, SeccompRule,
    TargetArch,
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

fn arch() -> Result<TargetArch, String> {
    if cfg!(target_arch = "x86_64") {
        Ok(TargetArch::x86_64)
    } else if cfg!(target_arch = "aarch64") {
        Ok(TargetArch::aarch64)
    } else if cfg!(target_arch = "riscv64") {
        Ok(TargetArch::riscv64)
    } else {
        Err("no seccomp filter for this architecture".into())
    }
}

/// The program, compiled once per process.
pub fn cached() -> Result<&'static [u8], String> {
    static PROGRAM: std::sync::OnceLock<Result<Vec<u8>, String>> = std::sync::OnceLock::new();
    PROGRAM
        .get_or_init(program)
        .as_deref()
        .map_err(Clone::clone)
}

/// The compiled program, as bwrap reads it: `struct sock_filter` records.
pub fn program() -> Result<Vec<u8>, String> {
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
                .map_err(|e| e.to_string())?;
            SeccompRule::new(vec![c]).map_err(|e| e.to_string())
        })
        .collect::<Result<Vec<_>, String>>()?;
    rules.insert(libc::SYS_ioctl, ioctl);
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EPERM as u32),
        arch()?,
    )
    .map_err(|e| e.to_string())?;
    let prog: seccompiler::BpfProgram = filter
        .try_into()
        .map_err(|e: seccompiler::BackendError| e.to_string())?;
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
}
