//! Limit backends: where a script's sandbox runs and what bounds it.
//!
//! - `systemd`: a transient scope `scriptgate-<id>.scope` in `scriptgate.slice`
//!   (MemoryMax, TasksMax, CPUQuotaPerSecUSec, RuntimeMaxUSec), created over D-Bus.
//! - `cgroup`: a leaf of the daemon's delegated cgroup v2 subtree (memory.max,
//!   pids.max, cpu.max; cgroup.kill).
//! - `rlimit`: rlimits (address space, processes) on the sandbox plus its PID
//!   namespace; memory is an address-space cap, so a script sees MemoryError
//!   rather than `oom`, and the process cap is shared by all scripts of one uid.
//!
//! `auto` takes the first that works, in that order, and says why the others did not.
//! With `systemd` and `cgroup` the sandbox does not exec until it is in its unit.

pub mod cgroup;
pub mod systemd;

use crate::config::BackendChoice;
use crate::policy::Limits;
use std::path::PathBuf;

/// What the rlimit backend cannot do, said wherever the backend is shown.
pub const RLIMIT_SHARED: &str = "rlimit: limits are per process and per uid, not per script: \
memory_max_bytes caps each process's address space, and tasks_max is shared by every \
script of one uid, so one script can take another's processes";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Systemd,
    Cgroup,
    Rlimit,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Systemd => "systemd",
            Kind::Cgroup => "cgroup",
            Kind::Rlimit => "rlimit",
        }
    }
}

/// Where the host's cgroup information is (tests pass a fake tree).
pub struct Host {
    pub cgroupfs: PathBuf,
    pub proc_self_cgroup: String,
}

impl Host {
    pub fn real() -> Host {
        Host {
            cgroupfs: "/sys/fs/cgroup".into(),
            proc_self_cgroup: std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default(),
        }
    }
}

/// The backend picked at start-up, and why the others were not.
#[derive(Clone)]
pub struct Backend {
    pub kind: Kind,
    pub notes: Vec<String>,
    systemd: Option<systemd::Manager>,
    tree: Option<cgroup::Tree>,
    cgroupfs: PathBuf,
    cpu_quota_percent: u32,
}

#[derive(Debug, thiserror::Error)]
#[error("sandbox.backend = {choice:?}: {why}")]
pub struct BackendError {
    pub choice: BackendChoice,
    pub why: String,
}

impl Backend {
    pub async fn pick(
        choice: BackendChoice,
        host: &Host,
        cpu_quota_percent: u32,
    ) -> Result<Backend, BackendError> {
        let mut b = Backend {
            kind: Kind::Rlimit,
            notes: vec![],
            systemd: None,
            tree: None,
            cgroupfs: host.cgroupfs.clone(),
            cpu_quota_percent,
        };
        let fail = |why: String| BackendError { choice, why };
        if matches!(choice, BackendChoice::Auto | BackendChoice::Systemd) {
            match systemd::Manager::connect().await {
                Ok(m) => {
                    b.kind = Kind::Systemd;
                    b.systemd = Some(m);
                    return Ok(b);
                }
                Err(why) if choice == BackendChoice::Systemd => return Err(fail(why)),
                Err(why) => b.notes.push(format!("systemd: {why}")),
            }
        }
        if matches!(choice, BackendChoice::Auto | BackendChoice::Cgroup) {
            let tree = cgroup::Tree::detect(&host.cgroupfs, &host.proc_self_cgroup).and_then(|t| {
                t.init(std::process::id())
                    .map(|()| t)
                    .map_err(|e| e.to_string())
            });
            match tree {
                Ok(t) => {
                    b.kind = Kind::Cgroup;
                    b.tree = Some(t);
                    return Ok(b);
                }
                Err(why) if choice == BackendChoice::Cgroup => return Err(fail(why)),
                Err(why) => b.notes.push(format!("cgroup: {why}")),
            }
        }
        b.notes.push(RLIMIT_SHARED.into());
        Ok(b)
    }

    /// rlimits for the sandbox. Under a unit, the unit bounds memory and tasks.
    pub fn rlimits(&self, l: &Limits) -> Vec<(libc::__rlimit_resource_t, u64)> {
        match self.kind {
            Kind::Rlimit => vec![
                (libc::RLIMIT_AS, l.memory_max_bytes),
                (libc::RLIMIT_NPROC, l.tasks_max),
                (libc::RLIMIT_CORE, 0),
            ],
            _ => vec![(libc::RLIMIT_CORE, 0)],
        }
    }

    /// Are memory and tasks bounded for each script as a whole?
    pub fn limits_per_script(&self) -> bool {
        self.kind != Kind::Rlimit
    }

    /// The sandbox waits at a gate until it is placed in its unit.
    pub fn needs_gate(&self) -> bool {
        self.kind != Kind::Rlimit
    }

    /// A scope is collected by systemd when its last process exits, counters and
    /// all; a keeper process holds it until they are read.
    pub fn needs_keeper(&self) -> bool {
        self.kind == Kind::Systemd
    }

    /// The unit a script will run in, known before it starts.
    pub fn unit_for(&self, script_id: &str) -> Option<String> {
        (self.kind == Kind::Systemd).then(|| systemd::unit_name(script_id))
    }

    /// Put the (gated) processes of a script in their unit.
    pub async fn place(
        &self,
        script_id: &str,
        l: &Limits,
        pids: &[u32],
    ) -> Result<Placement, String> {
        match (&self.systemd, &self.tree) {
            (Some(m), _) => {
                let unit = m
                    .start_scope(script_id, pids, l, self.cpu_quota_percent)
                    .await?;
                Ok(Placement::Scope {
                    unit,
                    manager: m.clone(),
                    cgroupfs: self.cgroupfs.clone(),
                })
            }
            (None, Some(t)) => {
                let leaf = t
                    .leaf(script_id, l, self.cpu_quota_percent)
                    .map_err(|e| e.to_string())?;
                for p in pids {
                    leaf.add(*p).map_err(|e| e.to_string())?;
                }
                Ok(Placement::Leaf(leaf))
            }
            (None, None) => Ok(Placement::None),
        }
    }
}

/// Where one script runs.
pub enum Placement {
    None,
    Scope {
        unit: String,
        manager: systemd::Manager,
        cgroupfs: PathBuf,
    },
    Leaf(cgroup::Leaf),
}

/// What the unit says at the script's end.
#[derive(Debug, Clone, Copy, Default)]
pub struct Outcome {
    pub stats: cgroup::Stats,
    /// The unit was stopped by someone else (`systemctl stop`).
    pub stopped_externally: bool,
}

impl Placement {
    /// End every process of the script (after the PID-namespace kill, for stragglers).
    pub fn kill(&self) {
        if let Placement::Leaf(l) = self {
            let _ = l.kill();
        }
    }

    /// Read the counters and let the unit go. Call after the sandbox exited and
    /// before the keeper is killed: with the keeper alive, a scope that is no longer
    /// active was stopped from outside.
    pub async fn finish(self) -> Outcome {
        match self {
            Placement::None => Outcome::default(),
            Placement::Scope {
                unit,
                manager,
                cgroupfs,
            } => {
                let state = manager.active_state(&unit).await;
                let stats = match manager.control_group(&unit).await {
                    Some(cg) => cgroup::stats(&cgroupfs, &cg),
                    None => cgroup::Stats::default(),
                };
                Outcome {
                    stats,
                    stopped_externally: state.as_deref() != Some("active"),
                }
            }
            Placement::Leaf(leaf) => {
                let stats = leaf.stats();
                let _ = leaf.kill();
                leaf.remove().await;
                Outcome {
                    stats,
                    stopped_externally: false,
                }
            }
        }
    }
}
