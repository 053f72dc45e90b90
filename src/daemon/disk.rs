//! A start's disk bound (`scripts.disk_max_bytes`), the step between the slot and
//! the record. Where the workspace's filesystem enforces project quotas (ext4
//! with the `project` feature mounted `prjquota`, XFS mounted `prjquota`), the
//! workspace gets a project id of its own, kept in the audit store by its
//! (device, inode): its files are given the id once (and what is created below
//! inherits it), and the project's block limit is set to `disk_max_bytes` at
//! every start. A script then gets EDQUOT when the workspace holds that much,
//! whatever else fills the filesystem, and nothing of another workspace's counts.
//! The daemon's own writes there (the record) are not bounded by it. Elsewhere
//! the script runs as before, and its result says the bound is not in force.

use crate::audit::Store;
use crate::sys::quota::{self, ProjectQuotas};
use crate::sys::WorkspaceDir;
use std::os::fd::AsFd;
use std::path::Path;

/// The most files given a workspace's project id when it is first bounded; a
/// workspace holding more is not bounded (said in the result).
pub const MAX_TAGGED: usize = 100_000;

/// Bound `ws` to `max_bytes` (0: no bound). `None` when bounded (or no bound is
/// configured); else why not, for the result's `backend_notes`.
pub(super) async fn bound(store: &Store, ws: &WorkspaceDir, max_bytes: u64) -> Option<String> {
    if max_bytes == 0 {
        return None;
    }
    let why_not = |why: String| Some(format!("scripts.disk_max_bytes not in force: {why}"));
    if let Err(why) = may_bound(quota::project_quotas(ws.dir.as_fd()), &ws.path, true) {
        return why_not(why);
    }
    let st = match nix::sys::stat::fstat(&ws.dir) {
        Ok(st) => st,
        Err(e) => return why_not(format!("cannot read the workspace: {e}")),
    };
    let id = match store.project_for(st.st_dev, st.st_ino).await {
        Ok(id) => id,
        Err(e) => return why_not(format!("no project id: {e}")),
    };
    let dir = match ws.dir.try_clone() {
        Ok(d) => d,
        Err(e) => return why_not(format!("cannot hold the workspace: {e}")),
    };
    // Giving a workspace its id walks its files: off the runtime's threads.
    let r = tokio::task::spawn_blocking(move || -> Result<(), String> {
        let fd = dir.as_fd();
        match quota::project_of(fd) {
            Ok((cur, true)) if cur == id => {}
            Ok(_) => match quota::set_project_tree(fd, id, MAX_TAGGED) {
                Ok(Some(_)) => {}
                Ok(None) => {
                    return Err(format!(
                        "the workspace holds more than {MAX_TAGGED} files, too many to give its project id"
                    ))
                }
                Err(e) => return Err(format!("cannot give the workspace project id {id}: {e}")),
            },
            Err(e) => return Err(format!("cannot read the workspace's project id: {e}")),
        }
        quota::set_project_limit(fd, id, max_bytes)
            .map_err(|e| format!("cannot set project {id}'s limit: {e}"))
    })
    .await;
    match r {
        Ok(Ok(())) => None,
        Ok(Err(why)) => why_not(why),
        Err(e) => why_not(e.to_string()),
    }
}

/// Whether a bound can be set below `path`, whose filesystem does `q`.
fn may_bound(q: ProjectQuotas, path: &Path, caps: bool) -> Result<(), String> {
    if q != ProjectQuotas::Enforced {
        return Err(not_enforced(q, path));
    }
    if caps && !quota::may_set_limits() {
        return Err(
            "the daemon lacks CAP_SYS_ADMIN, which setting a project's limit takes (the unit drops it: add `CapabilityBoundingSet=CAP_SYS_ADMIN` in a drop-in, scriptgated(8) DISK; an embedded daemon cannot)"
                .into(),
        );
    }
    Ok(())
}

fn not_enforced(q: ProjectQuotas, path: &Path) -> String {
    match q {
        ProjectQuotas::AccountedOnly => format!(
            "the filesystem of {} accounts project quotas but does not enforce them (mount it with prjquota)",
            path.display()
        ),
        ProjectQuotas::Refused => format!(
            "this process may not ask the filesystem of {} about project quotas (quotactl_fd refused: a SystemCallFilter= without quotactl_fd?)",
            path.display()
        ),
        _ => format!(
            "the filesystem of {} has no project quotas (ext4 made with -O project,quota and mounted with prjquota, or XFS mounted with prjquota)",
            path.display()
        ),
    }
}

/// Whether `scripts.disk_max_bytes` can be in force below the workspace root
/// `root`: `Ok` when its filesystem enforces project quotas (and, with `caps`,
/// this process may set their limits), else why not.
fn root_bound(root: &Path, caps: bool) -> Result<(), String> {
    let dir = std::fs::File::open(root).map_err(|e| format!("{}: {e}", root.display()))?;
    may_bound(quota::project_quotas(dir.as_fd()), root, caps)
}

/// `daemon.info`'s `disk`: the bound, and whether each root can hold it (with
/// `caps`, as this process: the daemon's own answer; without, the filesystems
/// only: `--check-config`, which does not run with the unit's capabilities).
pub fn info(max_bytes: u64, roots: &[std::path::PathBuf], caps: bool) -> crate::protocol::DiskInfo {
    crate::protocol::DiskInfo {
        max_bytes,
        roots: roots
            .iter()
            .map(|r| {
                let b = root_bound(r, caps);
                crate::protocol::DiskRoot {
                    root: r.display().to_string(),
                    in_force: max_bytes > 0 && b.is_ok(),
                    why: match (max_bytes, b) {
                        (0, _) => Some("scripts.disk_max_bytes is 0".into()),
                        (_, Ok(())) => None,
                        (_, Err(why)) => Some(why),
                    },
                }
            })
            .collect(),
    }
}

/// One line on the disk bound, for `status` and `--check-config`.
pub fn summary(d: &crate::protocol::DiskInfo) -> String {
    if d.max_bytes == 0 {
        return "no bound per workspace (scripts.disk_max_bytes = 0); files are bounded by scripts.file_max_bytes".into();
    }
    let per_root: Vec<String> = d
        .roots
        .iter()
        .map(|r| match &r.why {
            None => format!("{}: in force", r.root),
            Some(why) => format!("{}: NOT in force, {why}", r.root),
        })
        .collect();
    format!(
        "at most {} MiB per workspace while its scripts run (project quotas); {}",
        d.max_bytes >> 20,
        per_root.join("; ")
    )
}
