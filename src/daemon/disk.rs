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
use std::io;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

/// The most files given a workspace's project id when it is first bounded; a
/// workspace holding more is not bounded (said in the result).
pub const MAX_TAGGED: usize = 100_000;

/// Why `scripts.disk_max_bytes` is not in force for a workspace or below a
/// root: said in a result's `backend_notes`, `daemon.info` and check-config.
#[derive(Debug, thiserror::Error)]
pub enum Unbound {
    #[error("the filesystem of {} accounts project quotas but does not enforce them (mount it with prjquota)", .0.display())]
    AccountedOnly(PathBuf),
    #[error("the filesystem of {} has no project quotas (ext4 made with -O project,quota and mounted with prjquota, or XFS mounted with prjquota)", .0.display())]
    NoProjectQuotas(PathBuf),
    #[error("this process may not ask the filesystem of {} about project quotas (quotactl_fd refused: a SystemCallFilter= without quotactl_fd?)", .0.display())]
    QuotactlRefused(PathBuf),
    #[error("the daemon lacks CAP_SYS_ADMIN, which setting a project's limit takes (the unit drops it: add `CapabilityBoundingSet=CAP_SYS_ADMIN` in a drop-in, scriptgated(8) DISK; an embedded daemon cannot)")]
    NoCapability,
    #[error("{}: {source}", path.display())]
    Open { path: PathBuf, source: io::Error },
    #[error("cannot read the workspace: {0}")]
    Stat(nix::Error),
    #[error("no project id: {0}")]
    NoProjectId(crate::audit::StoreError),
    #[error("cannot hold the workspace: {0}")]
    Hold(io::Error),
    #[error("the workspace holds more than {MAX_TAGGED} files, too many to give its project id")]
    TooManyFiles,
    #[error("cannot give the workspace project id {id}: {source}")]
    Tag { id: u32, source: io::Error },
    #[error("cannot read the workspace's project id: {0}")]
    ReadId(io::Error),
    #[error("cannot set project {id}'s limit: {source}")]
    SetLimit { id: u32, source: io::Error },
    #[error("{0}")]
    Task(tokio::task::JoinError),
}

/// Bound `ws` to `max_bytes` (0: no bound). `None` when bounded (or no bound is
/// configured); else why not, for the result's `backend_notes`.
pub(super) async fn bound(store: &Store, ws: &WorkspaceDir, max_bytes: u64) -> Option<String> {
    if max_bytes == 0 {
        return None;
    }
    try_bound(store, ws, max_bytes)
        .await
        .err()
        .map(|why| format!("scripts.disk_max_bytes not in force: {why}"))
}

async fn try_bound(store: &Store, ws: &WorkspaceDir, max_bytes: u64) -> Result<(), Unbound> {
    may_bound(quota::project_quotas(ws.dir.as_fd()), &ws.path, true)?;
    let st = nix::sys::stat::fstat(&ws.dir).map_err(Unbound::Stat)?;
    let id = store
        .project_for(st.st_dev, st.st_ino)
        .await
        .map_err(Unbound::NoProjectId)?;
    let dir = ws.dir.try_clone().map_err(Unbound::Hold)?;
    // Giving a workspace its id walks its files: off the runtime's threads.
    tokio::task::spawn_blocking(move || set_bound(dir.as_fd(), id, max_bytes))
        .await
        .map_err(Unbound::Task)?
}

/// The workspace's files given project `id` (unless they have it), and the
/// project's limit set to `max_bytes`.
fn set_bound(fd: std::os::fd::BorrowedFd, id: u32, max_bytes: u64) -> Result<(), Unbound> {
    match quota::project_of(fd).map_err(Unbound::ReadId)? {
        (cur, true) if cur == id => {}
        _ => match quota::set_project_tree(fd, id, MAX_TAGGED) {
            Ok(Some(_)) => {}
            Ok(None) => return Err(Unbound::TooManyFiles),
            Err(source) => return Err(Unbound::Tag { id, source }),
        },
    }
    quota::set_project_limit(fd, id, max_bytes).map_err(|source| Unbound::SetLimit { id, source })
}

/// Whether a bound can be set below `path`, whose filesystem does `q`.
fn may_bound(q: ProjectQuotas, path: &Path, caps: bool) -> Result<(), Unbound> {
    match q {
        ProjectQuotas::Enforced => {}
        ProjectQuotas::AccountedOnly => return Err(Unbound::AccountedOnly(path.to_path_buf())),
        ProjectQuotas::Refused => return Err(Unbound::QuotactlRefused(path.to_path_buf())),
        ProjectQuotas::Off => return Err(Unbound::NoProjectQuotas(path.to_path_buf())),
    }
    if caps && !quota::may_set_limits() {
        return Err(Unbound::NoCapability);
    }
    Ok(())
}

/// Whether `scripts.disk_max_bytes` can be in force below the workspace root
/// `root`: `Ok` when its filesystem enforces project quotas (and, with `caps`,
/// this process may set their limits), else why not.
fn root_bound(root: &Path, caps: bool) -> Result<(), Unbound> {
    let dir = std::fs::File::open(root).map_err(|source| Unbound::Open {
        path: root.to_path_buf(),
        source,
    })?;
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
                        (_, Err(why)) => Some(why.to_string()),
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
