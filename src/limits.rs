//! Limit backends. Each script's sandbox runs under one of them.
//!
//! `rlimit`: rlimits (address space, processes, core) on the bwrap child plus the
//! sandbox's own PID namespace, which ends the whole tree when its init dies.
//! Memory is an address-space cap (a script gets MemoryError, not `oom`).
//!
//! The `systemd` (transient scope) and `cgroup` (delegated v2 subtree) backends are
//! chosen by `sandbox.backend`; where they are not available `auto` falls back to
//! `rlimit` and says why.

use crate::config::BackendChoice;
use crate::policy::Limits;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Rlimit,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Rlimit => "rlimit",
        }
    }
}

/// The backend picked at start-up and why the others were not.
#[derive(Debug, Clone)]
pub struct Backend {
    pub kind: Kind,
    pub notes: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
#[error("sandbox.backend = {choice:?}: {why}")]
pub struct BackendError {
    pub choice: BackendChoice,
    pub why: String,
}

impl Backend {
    pub fn pick(choice: BackendChoice) -> Result<Backend, BackendError> {
        let unsupported = "not supported by this build of scriptgated".to_string();
        match choice {
            BackendChoice::Rlimit => Ok(Backend {
                kind: Kind::Rlimit,
                notes: vec![],
            }),
            BackendChoice::Auto => Ok(Backend {
                kind: Kind::Rlimit,
                notes: vec![
                    format!("systemd: {unsupported}"),
                    format!("cgroup: {unsupported}"),
                ],
            }),
            c @ (BackendChoice::Systemd | BackendChoice::Cgroup) => Err(BackendError {
                choice: c,
                why: unsupported,
            }),
        }
    }

    /// rlimits for the bwrap child.
    pub fn rlimits(&self, l: &Limits) -> Vec<(libc::__rlimit_resource_t, u64)> {
        vec![
            (libc::RLIMIT_AS, l.memory_max_bytes),
            (libc::RLIMIT_NPROC, l.tasks_max),
            (libc::RLIMIT_CORE, 0),
        ]
    }
}
