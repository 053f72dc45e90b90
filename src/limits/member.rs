//! A pre-made sandbox's own unit (`sandbox::pool`): the scope or leaf a pool
//! member waits in from its first instruction, under small idle limits, named
//! `pool-<16 hex digits>` where a script's is named by its id.
//!
//! At assignment its processes move, all of them, into the run's own unit
//! (`Backend::place` with the script's id and limits, as on the cold path), so
//! that a pre-made script's unit name, limits, counters and audit row are a
//! cold one's. A waiting member runs nothing that forks (its Python blocks
//! on its stdin), so the list of its processes holds while they move. The
//! memory its Python touched while it waited stays charged to the member's
//! cgroup (cgroup v2 does not move charges): the run's unit counts from the
//! move, and the run adds what the member held then to the peak it reports.

use crate::limits::{Backend, LimitsError, Placement};
use crate::policy::Limits;
use std::io;
use std::path::PathBuf;
use std::time::Duration;

/// What a waiting member may use: its Python with `agent_tools` imported
/// (about 10 MiB resident), its init and bwrap, with room; never more than a
/// script may.
pub fn idle_limits(run: &Limits) -> Limits {
    Limits {
        memory_max_bytes: run.memory_max_bytes.min(64 << 20),
        tasks_max: run.tasks_max.min(8),
        // A member waits until it is taken or retired (`pool_idle_s`), not
        // for a script's timeout: the scope's RuntimeMaxSec= backstop is a year.
        timeout_s: 365 * 24 * 3600,
        ..run.clone()
    }
}

/// A fresh member unit's id.
pub fn new_id() -> String {
    let mut b = [0u8; 8];
    getrandom::getrandom(&mut b).expect("getrandom");
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!("pool-{hex}")
}

/// A member's unit while it waits.
pub struct Waiting {
    pub id: String,
    placement: Placement,
    /// The member's first process (its gated bwrap), whose cgroup is the unit's.
    pid: u32,
    cgroupfs: PathBuf,
}

impl Backend {
    /// Put a new member's gated process `pid` in a unit of its own, `id`, under
    /// `idle` limits. Only on a backend that gates (`needs_gate`).
    pub async fn place_waiting(
        &self,
        id: &str,
        idle: &Limits,
        pid: u32,
    ) -> Result<Waiting, LimitsError> {
        let placement = self.place(id, idle, &[pid]).await?;
        let cgroupfs = match self {
            Backend::Systemd(s) => s.cgroupfs.clone(),
            Backend::Cgroup(c) => c.cgroupfs.clone(),
            Backend::Rlimit => PathBuf::new(),
        };
        Ok(Waiting {
            id: id.to_string(),
            placement,
            pid,
            cgroupfs,
        })
    }

    /// At a daemon's start, before its pool: what the scopes an earlier
    /// daemon's waiting members were left in still hold is killed
    /// (`SystemdBackend`; the cgroup
    /// backend's leaves go in `cgroup::Tree::init`, the rlimit backend has
    /// none). A daemon on the systemd backend is root and owns scriptgate.slice
    /// (it sets the slice's bound too): whatever pool scopes are there are an
    /// earlier daemon's.
    pub async fn clear_stale_members(&self) {
        if let Backend::Systemd(s) = self {
            let killed = s.manager.kill_pool_scopes().await;
            if !killed.is_empty() {
                tracing::info!(
                    "killed what {} unit(s) of an earlier daemon's pre-made sandboxes held: {}",
                    killed.len(),
                    killed.join(" ")
                );
            }
        }
    }
}

impl Waiting {
    /// Every process in the member's unit now: its cgroup v2 directory's
    /// `cgroup.procs` (a leaf's own; a scope's, found from its first
    /// process's `0::` line, under `unified/` on a hybrid host).
    pub fn pids(&self) -> io::Result<Vec<u32>> {
        let dir = match &self.placement {
            Placement::Leaf(leaf) => leaf.dir.clone(),
            _ => self.scope_dir()?,
        };
        let file = dir.join("cgroup.procs");
        let text = std::fs::read_to_string(&file)
            .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", file.display())))?;
        Ok(text.lines().filter_map(|l| l.trim().parse().ok()).collect())
    }

    fn scope_dir(&self) -> io::Result<PathBuf> {
        let rel = self.cgroup()?;
        [
            self.cgroupfs.join("unified").join(&rel),
            self.cgroupfs.join(&rel),
        ]
        .into_iter()
        .find(|d| d.join("cgroup.procs").exists())
        .ok_or_else(|| io::Error::other(format!("no cgroup v2 directory for {rel}")))
    }

    /// The unit's cgroup, as its first process's `0::` line names it.
    fn cgroup(&self) -> io::Result<String> {
        let file = format!("/proc/{}/cgroup", self.pid);
        let text = std::fs::read_to_string(&file)
            .map_err(|e| io::Error::new(e.kind(), format!("{file}: {e}")))?;
        text.lines()
            .find_map(|l| l.strip_prefix("0::"))
            .map(|p| p.trim_start_matches('/').to_string())
            .ok_or_else(|| io::Error::other(format!("{file} has no cgroup v2 line")))
    }

    /// What the member's processes hold now, charged to its unit: it stays
    /// charged there when they move (cgroup v2 moves no charges), so the run
    /// adds it to the peak its own unit reports.
    pub fn memory_current(&self) -> u64 {
        self.cgroup()
            .ok()
            .and_then(|cg| crate::limits::cgroup::memory_current(&self.cgroupfs, &cg))
            .unwrap_or(0)
    }

    /// Let the unit go once its processes have left it (moved, or killed and
    /// reaped): a leaf is removed (tried for up to a second, as an emptied
    /// cgroup may be busy for a moment); a scope that has no process left is
    /// collected by systemd. Blocking.
    pub fn release(self) {
        if let Placement::Leaf(leaf) = self.placement {
            let _ = leaf.kill();
            for _ in 0..40 {
                match std::fs::remove_dir(&leaf.dir) {
                    Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                        std::thread::sleep(Duration::from_millis(25))
                    }
                    _ => return,
                }
            }
            tracing::debug!(
                "a pre-made sandbox's cgroup {} stays busy",
                leaf.dir.display()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_member_waits_under_idle_limits_never_above_a_scripts() {
        let run = Limits {
            max_calls: 10,
            max_concurrency: 2,
            timeout_s: 60,
            memory_max_bytes: 1 << 30,
            tasks_max: 64,
        };
        let idle = idle_limits(&run);
        assert_eq!((idle.memory_max_bytes, idle.tasks_max), (64 << 20, 8));
        assert!(idle.timeout_s > 300 * 24 * 3600);
        let small = Limits {
            memory_max_bytes: 32 << 20,
            tasks_max: 4,
            ..run
        };
        let idle = idle_limits(&small);
        assert_eq!((idle.memory_max_bytes, idle.tasks_max), (32 << 20, 4));
        let id = new_id();
        assert!(id.starts_with("pool-") && id.len() == 21, "{id}");
        assert_ne!(new_id(), id);
    }
}
