//! Workspace retention (`[workspace] retain_days`, `scriptgate prune`). Only the
//! workspaces scriptgate itself created are ever removed: those carry a marker,
//! `.agent/workspace.json`, written when they were made (`scriptgate run` without
//! `--workspace`). A workspace an engine passed in has no marker and is never
//! touched. The marker lies under `.agent`, which every sandbox gets read-only,
//! so a script cannot plant one in its engine's workspace.
//!
//! A pass looks at most two levels below each root (`<root>/<ws>` and
//! `<root>/<uid>/<ws>`), at no more than [`MAX_SCANNED`] entries, and removes no
//! more than [`MAX_PER_PASS`] workspaces. Every directory is opened relative to
//! its parent with `O_NOFOLLOW`, from the root down, and removal unlinks entries
//! relative to their opened parent: a symlink is removed as a link, never
//! followed out of the root.

use nix::fcntl::{openat, AtFlags, OFlag};
use nix::sys::stat::{fstatat, Mode};
use nix::unistd::{unlinkat, UnlinkatFlags};
use std::ffi::OsString;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

/// The marker, below the workspace.
pub const MARKER_DIR: &str = ".agent";
pub const MARKER: &str = "workspace.json";
/// Workspaces removed in one pass at most; the next pass goes on.
pub const MAX_PER_PASS: usize = 100;
/// Directory entries looked at in one pass at most.
pub const MAX_SCANNED: usize = 20_000;
/// Directory depth removal goes to at most.
const MAX_DEPTH: usize = 128;

/// Mark `ws`, just created by `by` (e.g. "scriptgate run"), as scriptgate's to
/// prune once unused for `workspace.retain_days`.
pub fn mark_created(ws: &Path, by: &str) -> io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    let agent = ws.join(MARKER_DIR);
    std::fs::DirBuilder::new().mode(0o700).create(&agent)?;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(agent.join(MARKER))?;
    let text = serde_json::json!({
        "created_by": by,
        "created_at_ms": crate::audit::now_ms(),
        "uid": nix::unistd::getuid().as_raw(),
    });
    writeln!(f, "{text}")
}

/// A workspace scriptgate created.
#[derive(Debug, Clone, PartialEq)]
pub struct Created {
    pub path: PathBuf,
    /// Last use: the newest modification time of the workspace, its
    /// `.agent/scripts` (a new script record) and the marker.
    pub last_used_ms: i64,
}

/// What a pass found.
#[derive(Debug, Default)]
pub struct Plan {
    /// Unused for longer than the retention, oldest first, at most MAX_PER_PASS.
    pub expired: Vec<Created>,
    /// Created by scriptgate, but recent or in use.
    pub kept: usize,
    /// A bound was reached: more may be due at the next pass.
    pub more: bool,
}

fn dir_flags() -> OFlag {
    OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC | OFlag::O_RDONLY
}

fn open_dir(parent: impl AsFd, name: &std::ffi::OsStr) -> io::Result<OwnedFd> {
    openat(parent, name, dir_flags(), Mode::empty()).map_err(io::Error::from)
}

fn mtime_ms(st: &nix::sys::stat::FileStat) -> i64 {
    st.st_mtime * 1000 + st.st_mtime_nsec / 1_000_000
}

/// The names in an opened directory (read through the descriptor, not the path).
fn names(dir: &OwnedFd, budget: &mut usize) -> io::Result<Vec<OsString>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(format!("/proc/self/fd/{}", dir.as_raw_fd()))? {
        if *budget == 0 {
            break;
        }
        *budget -= 1;
        out.push(e?.file_name());
    }
    Ok(out)
}

/// If the opened directory is a workspace scriptgate created, its last use.
fn created(dir: &OwnedFd) -> Option<i64> {
    let agent = open_dir(dir, MARKER_DIR.as_ref()).ok()?;
    let marker = fstatat(&agent, MARKER, AtFlags::AT_SYMLINK_NOFOLLOW).ok()?;
    if marker.st_mode & libc::S_IFMT != libc::S_IFREG {
        return None;
    }
    let own = fstatat(dir, ".", AtFlags::AT_SYMLINK_NOFOLLOW).ok()?;
    let scripts = fstatat(&agent, "scripts", AtFlags::AT_SYMLINK_NOFOLLOW)
        .ok()
        .filter(|s| s.st_mode & libc::S_IFMT == libc::S_IFDIR);
    Some(
        [Some(own), Some(marker), scripts]
            .iter()
            .flatten()
            .map(mtime_ms)
            .max()
            .unwrap_or(0),
    )
}

/// Find the workspaces scriptgate created under `roots` and unused for more than
/// `retain_days`; `in_use` says whether a running script has a workspace at or
/// below a path (running workspaces are canonical paths, and so are the roots here).
pub fn plan(
    roots: &[PathBuf],
    retain_days: u64,
    now_ms: i64,
    in_use: &dyn Fn(&Path) -> bool,
) -> Plan {
    let cutoff = now_ms - (retain_days as i64).saturating_mul(86_400_000);
    let mut plan = Plan::default();
    let mut budget = MAX_SCANNED;
    let mut expired = Vec::new();
    for root in roots {
        let Ok(root) = std::fs::canonicalize(root) else {
            continue;
        };
        let Ok(root_fd) = File::open(&root).map(OwnedFd::from) else {
            continue;
        };
        // (opened directory, its path, depth below the root)
        let mut stack = vec![(root_fd, root.clone(), 0usize)];
        while let Some((dir, path, depth)) = stack.pop() {
            let Ok(list) = names(&dir, &mut budget) else {
                continue;
            };
            for name in list {
                let Ok(fd) = open_dir(&dir, &name) else {
                    continue; // not a directory, or a symlink: never followed
                };
                let p = path.join(&name);
                match created(&fd) {
                    Some(last) if last < cutoff && !in_use(&p) => expired.push(Created {
                        path: p,
                        last_used_ms: last,
                    }),
                    Some(_) => plan.kept += 1,
                    // One level down (per-uid directories), but never into a
                    // workspace scripts ran in: a script cannot make its own
                    // workspace's subdirectories look like scriptgate's.
                    None if depth == 0 && open_dir(&fd, MARKER_DIR.as_ref()).is_err() => {
                        stack.push((fd, p, 1))
                    }
                    None => {}
                }
            }
            if budget == 0 {
                plan.more = true;
                break;
            }
        }
    }
    expired.sort_by_key(|c| c.last_used_ms);
    if expired.len() > MAX_PER_PASS {
        plan.more = true;
        expired.truncate(MAX_PER_PASS);
    }
    plan.expired = expired;
    plan
}

/// Remove a workspace `plan` found: opened again from its root down without
/// following symlinks, then emptied and removed relative to its opened parent.
pub fn remove(ws: &Path, roots: &[PathBuf]) -> io::Result<()> {
    let (root, rest) = roots
        .iter()
        .find_map(|r| ws.strip_prefix(r).ok().map(|rest| (r, rest)))
        .ok_or_else(|| {
            io::Error::other(format!("{} is not under workspace.roots", ws.display()))
        })?;
    let comps: Vec<&std::ffi::OsStr> = rest
        .components()
        .map(|c| match c {
            std::path::Component::Normal(n) => Ok(n),
            _ => Err(io::Error::other(format!(
                "{}: not a plain path",
                ws.display()
            ))),
        })
        .collect::<io::Result<_>>()?;
    let Some((last, parents)) = comps.split_last() else {
        return Err(io::Error::other(format!(
            "{} is a root itself",
            ws.display()
        )));
    };
    let mut dir: OwnedFd = File::open(root)?.into();
    for c in parents {
        dir = open_dir(&dir, c)?;
    }
    // Still the workspace we planned on: a scriptgate marker inside.
    let fd = open_dir(&dir, last)?;
    if created(&fd).is_none() {
        return Err(io::Error::other(format!(
            "{} no longer carries the scriptgate marker; left alone",
            ws.display()
        )));
    }
    drop(fd);
    remove_tree_at(&dir, last, 0)
}

/// Remove `name` in the opened `parent`: a directory with everything in it, or
/// anything else (a symlink included) as one entry.
fn remove_tree_at(parent: &OwnedFd, name: &std::ffi::OsStr, depth: usize) -> io::Result<()> {
    if depth > MAX_DEPTH {
        return Err(io::Error::other("directory tree deeper than 128 levels"));
    }
    match open_dir(parent, name) {
        Ok(dir) => {
            let mut unbounded = usize::MAX;
            for child in names(&dir, &mut unbounded)? {
                remove_tree_at(&dir, &child, depth + 1)?;
            }
            unlinkat(parent, name, UnlinkatFlags::RemoveDir).map_err(io::Error::from)
        }
        // Not a directory (ENOTDIR), or a symlink (ELOOP / ENOTDIR with O_NOFOLLOW).
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOTDIR | libc::ELOOP)) => {
            unlinkat(parent, name, UnlinkatFlags::NoRemoveDir).map_err(io::Error::from)
        }
        Err(e) => Err(e),
    }
}

/// One retention pass: plan, then remove. Returns the plan and the errors (path,
/// error) of removals that failed.
pub fn run_pass(
    roots: &[PathBuf],
    retain_days: u64,
    in_use: &dyn Fn(&Path) -> bool,
) -> (Plan, Vec<(PathBuf, io::Error)>) {
    let plan = plan(roots, retain_days, crate::audit::now_ms(), in_use);
    let failed = plan
        .expired
        .iter()
        .filter_map(|c| remove(&c.path, roots).err().map(|e| (c.path.clone(), e)))
        .collect();
    (plan, failed)
}

/// What `scriptgate prune` prints: one line per workspace, then a summary.
pub fn report(
    plan: &Plan,
    failed: &[(PathBuf, io::Error)],
    retain_days: u64,
    dry_run: bool,
) -> String {
    let mut out = String::new();
    for c in &plan.expired {
        let when = crate::time::rfc3339(c.last_used_ms);
        match failed.iter().find(|(p, _)| *p == c.path) {
            Some((_, e)) => out.push_str(&format!("cannot remove {}: {e}\n", c.path.display())),
            None if dry_run => out.push_str(&format!(
                "would remove {} (last used {when})\n",
                c.path.display()
            )),
            None => out.push_str(&format!(
                "removed {} (last used {when})\n",
                c.path.display()
            )),
        }
    }
    let n = plan.expired.len() - failed.len();
    let ws = |n: usize| if n == 1 { "workspace" } else { "workspaces" };
    out.push_str(&format!(
        "{n} {} {} (unused for more than {retain_days} days); {} kept (recent or in use){}\n",
        ws(n),
        if dry_run {
            "would be removed"
        } else {
            "removed"
        },
        plan.kept,
        if plan.more {
            "; more remain for the next pass"
        } else {
            ""
        }
    ));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn age(p: &Path, days: i64) {
        let t =
            std::time::SystemTime::now() - std::time::Duration::from_secs((days * 86_400) as u64);
        let f = File::open(p).unwrap();
        f.set_modified(t).unwrap();
    }

    fn age_ws(ws: &Path, days: i64) {
        for p in [
            ws.join(".agent/scripts"),
            ws.join(".agent/workspace.json"),
            ws.to_path_buf(),
        ] {
            if p.exists() {
                age(&p, days);
            }
        }
    }

    #[test]
    fn only_old_marked_unused_workspaces_go_and_symlinks_are_not_followed() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("root");
        let outside = d.path().join("outside");
        std::fs::create_dir_all(&outside).unwrap();
        std::fs::write(outside.join("precious"), "x").unwrap();
        // Created by scriptgate, old: goes; with a symlink out of the root inside.
        let old = root.join("run-old");
        std::fs::create_dir_all(&old).unwrap();
        mark_created(&old, "test").unwrap();
        std::fs::create_dir_all(old.join(".agent/scripts/s1")).unwrap();
        std::fs::write(old.join("data.txt"), "d").unwrap();
        std::os::unix::fs::symlink(&outside, old.join("link")).unwrap();
        age_ws(&old, 40);
        // Per-uid level, created and old: goes.
        let nested = root.join("1001/run-x");
        std::fs::create_dir_all(&nested).unwrap();
        mark_created(&nested, "test").unwrap();
        age_ws(&nested, 40);
        // Created, recent: kept. Created, old, in use: kept.
        let recent = root.join("run-new");
        std::fs::create_dir_all(&recent).unwrap();
        mark_created(&recent, "test").unwrap();
        let busy = root.join("run-busy");
        std::fs::create_dir_all(&busy).unwrap();
        mark_created(&busy, "test").unwrap();
        age_ws(&busy, 40);
        // An engine's own, old, no marker: never touched; nor a subdirectory a
        // script of it dressed up with a marker.
        let engines = root.join("engine-ws");
        std::fs::create_dir_all(engines.join(".agent/scripts")).unwrap();
        let planted = engines.join("data");
        std::fs::create_dir_all(&planted).unwrap();
        mark_created(&planted, "a script").unwrap();
        age_ws(&planted, 400);
        age_ws(&engines, 400);
        // A marker that is a symlink does not count.
        let forged = root.join("forged");
        std::fs::create_dir_all(forged.join(".agent")).unwrap();
        std::os::unix::fs::symlink(
            old.join(".agent/workspace.json"),
            forged.join(".agent/workspace.json"),
        )
        .unwrap();
        age_ws(&forged, 400);
        // A symlinked directory in the root pointing at a marked workspace elsewhere.
        let elsewhere = d.path().join("elsewhere");
        std::fs::create_dir_all(&elsewhere).unwrap();
        mark_created(&elsewhere, "test").unwrap();
        age_ws(&elsewhere, 40);
        std::os::unix::fs::symlink(&elsewhere, root.join("run-link")).unwrap();

        let roots = vec![root.clone()];
        let in_use = |p: &Path| p == busy;
        let plan = plan(&roots, 30, crate::audit::now_ms(), &in_use);
        let mut paths: Vec<&Path> = plan.expired.iter().map(|c| c.path.as_path()).collect();
        paths.sort();
        assert_eq!(paths, vec![nested.as_path(), old.as_path()]);
        assert_eq!(plan.kept, 2, "recent and busy");
        assert!(!plan.more);

        let (plan, failed) = run_pass(&roots, 30, &in_use);
        assert_eq!(plan.expired.len(), 2);
        assert!(failed.is_empty(), "{failed:?}");
        assert!(!old.exists() && !nested.exists());
        assert!(root.join("1001").exists(), "the per-uid directory stays");
        for kept in [&recent, &busy, &engines, &planted, &forged, &elsewhere] {
            assert!(kept.exists(), "{}", kept.display());
        }
        assert_eq!(
            std::fs::read_to_string(outside.join("precious")).unwrap(),
            "x"
        );
        // Removing a path without the marker is refused.
        let e = remove(&engines, &roots).unwrap_err();
        assert!(e.to_string().contains("marker"), "{e}");
        // retain_days = 30 and nothing older: nothing more to do.
        assert!(run_pass(&roots, 30, &in_use).0.expired.is_empty());
    }
}
