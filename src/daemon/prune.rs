//! Workspace retention (`[workspace] retain_days`, `scriptgate prune`). Only the
//! workspaces scriptgate itself created are ever removed, and only the daemon's
//! own state vouches for one: the audit store's `workspaces` table, to which only
//! the daemon adds (`scriptgate prune` only forgets there what it removed or
//! found gone, [`to_forget`]). The daemon records a workspace there when a script starts in it
//! and the workspace carries the marker `.agent/workspace.json` (written when
//! `scriptgate run` made it, without `--workspace`), the marker is the engine's
//! own (or root's), and the directory belongs to the uid the scripts run as
//! ([`vouches`]): a workspace its engine could have removed itself. A marker alone
//! vouches for nothing: a directory no script of its owner ran in, or one whose
//! marker another uid wrote, is never touched. The row keeps the directory's
//! (dev, inode): a directory put in its place later is not the one recorded.
//!
//! A pass looks only at recorded workspaces (no walk of the roots: no directory
//! tree, however large, delays anyone's retention), and removes at most
//! [`MAX_PER_OWNER`] workspaces of each owner (`<root>/<entry>`, the per-uid
//! directory or the workspace itself) per pass: one engine's backlog does not
//! hold back another's. Every directory is opened relative to its parent with
//! `O_NOFOLLOW`, from the root down, and removal unlinks entries relative to
//! their opened parent: a symlink is removed as a link, never followed out of the
//! root.

use crate::audit::Vouched;
use nix::fcntl::{openat, AtFlags, OFlag};
use nix::sys::stat::{fstat, fstatat, FileStat, Mode};
use nix::unistd::{unlinkat, UnlinkatFlags};
use std::collections::HashMap;
use std::ffi::OsString;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

/// The marker, below the workspace.
pub const MARKER_DIR: &str = ".agent";
pub const MARKER: &str = "workspace.json";
/// Workspaces of one owner (`<root>/<entry>`) removed in one pass at most; the
/// next pass goes on.
pub const MAX_PER_OWNER: usize = 100;
/// Directory depth removal goes to at most.
const MAX_DEPTH: usize = 128;

/// Mark `ws`, just created by `by` (e.g. "scriptgate run"), as scriptgate's to
/// prune once unused for `workspace.retain_days` (once the daemon has vouched
/// for it: a script of its engine ran in it).
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
        "created_at_ms": crate::time::now_ms(),
        "uid": nix::unistd::getuid().as_raw(),
    });
    writeln!(f, "{text}")
}

/// May retention remove this workspace once unused? Only when the marker is
/// there and is the engine's own (or root's), and the directory belongs to the
/// uid its scripts run as, which for a non-root engine is the engine's uid: a
/// workspace the engine could have removed itself. `marker_uid`: the owner of
/// `.agent/workspace.json` when it is a regular file.
pub fn vouches(peer_uid: u32, run_uid: u32, ws_uid: u32, marker_uid: Option<u32>) -> bool {
    marker_uid.is_some_and(|m| m == peer_uid || m == 0)
        && ws_uid == run_uid
        && (peer_uid == 0 || run_uid == peer_uid)
}

/// The owner of the marker in the opened workspace, if it is a regular file.
fn marker_uid(ws: &OwnedFd) -> Option<u32> {
    let agent = open_dir(ws, MARKER_DIR.as_ref()).ok()?;
    let m = fstatat(&agent, MARKER, AtFlags::AT_SYMLINK_NOFOLLOW).ok()?;
    (m.st_mode & libc::S_IFMT == libc::S_IFREG).then_some(m.st_uid)
}

/// The opened workspace's (dev, inode), when [`vouches`] holds for it.
pub fn vouch(ws: &OwnedFd, peer_uid: u32, run_uid: u32) -> Option<(u64, u64)> {
    let st = fstat(ws).ok()?;
    vouches(peer_uid, run_uid, st.st_uid, marker_uid(ws)).then_some(ident(&st))
}

// dev_t and ino_t are not u64 on every target.
#[allow(clippy::unnecessary_cast)]
fn ident(st: &FileStat) -> (u64, u64) {
    (st.st_dev as u64, st.st_ino as u64)
}

/// A workspace scriptgate created, as a pass found it.
#[derive(Debug, Clone, PartialEq)]
pub struct Created {
    pub path: PathBuf,
    /// Last use: the newest of the modification times of the workspace, its
    /// `.agent/scripts` (a new script record) and the marker, and of the last
    /// script start the daemon recorded ([`Vouched::last_at_ms`]).
    pub last_used_ms: i64,
    /// The directory recorded (dev, inode).
    pub ident: (u64, u64),
    /// Whose it is: `<root>/<entry>`, the unit [`MAX_PER_OWNER`] bounds.
    pub owner: PathBuf,
    /// A running script uses it, or a directory below it.
    pub in_use: bool,
}

/// What a pass found.
#[derive(Debug, Default)]
pub struct Plan {
    /// Unused for longer than the retention, oldest first, at most
    /// MAX_PER_OWNER of each owner.
    pub expired: Vec<Created>,
    /// Recorded, but recent or in use.
    pub kept: usize,
    /// Those kept, oldest first.
    pub held: Vec<Created>,
    /// Due, but past [`MAX_PER_OWNER`] of their owner: the next pass's.
    pub deferred: Vec<Created>,
    /// A bound was reached: more may be due at the next pass.
    pub more: bool,
    /// Recorded workspaces that are certainly gone (ENOENT in their opened
    /// parent), no longer the recorded directory, or without their marker: to
    /// forget.
    pub gone: Vec<PathBuf>,
    /// Recorded workspaces the pass could not look at (a transient error, a
    /// directory above them missing): neither removed nor forgotten.
    pub unknown: Vec<(PathBuf, io::Error)>,
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

/// Errors that say for certain an entry is not there as a directory (as opposed
/// to EACCES, EMFILE, EIO...: what a pass cannot tell).
fn absent(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::ENOENT | libc::ENOTDIR | libc::ELOOP)
    )
}

/// If the opened directory still carries the marker, its last use by the file
/// system's times; `Ok(None)`: it certainly does not; `Err`: cannot tell now.
fn created(dir: &OwnedFd) -> io::Result<Option<i64>> {
    let agent = match open_dir(dir, MARKER_DIR.as_ref()) {
        Ok(a) => a,
        Err(e) if absent(&e) => return Ok(None),
        Err(e) => return Err(e),
    };
    let marker = match fstatat(&agent, MARKER, AtFlags::AT_SYMLINK_NOFOLLOW) {
        Ok(m) => m,
        Err(nix::errno::Errno::ENOENT) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    if marker.st_mode & libc::S_IFMT != libc::S_IFREG {
        return Ok(None);
    }
    let own = fstat(dir)?;
    let scripts = fstatat(&agent, "scripts", AtFlags::AT_SYMLINK_NOFOLLOW)
        .ok()
        .filter(|s| s.st_mode & libc::S_IFMT == libc::S_IFDIR);
    Ok(Some(
        [Some(own), Some(marker), scripts]
            .iter()
            .flatten()
            .map(mtime_ms)
            .max()
            .unwrap_or(0),
    ))
}

/// The root `ws` lies strictly below, and the plain components from it.
fn below_root<'a>(
    ws: &'a Path,
    roots: &'a [PathBuf],
) -> io::Result<(&'a PathBuf, Vec<&'a std::ffi::OsStr>)> {
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
    if comps.is_empty() {
        return Err(io::Error::other(format!(
            "{} is a root itself",
            ws.display()
        )));
    }
    Ok((root, comps))
}

/// Why [`open_below`] could not open a workspace.
enum NotOpened {
    /// The root or a directory above the workspace: nothing is known of it.
    Above(io::Error),
    /// The workspace itself, in its opened parent.
    Last(io::Error, OwnedFd),
}

impl From<NotOpened> for io::Error {
    fn from(n: NotOpened) -> io::Error {
        match n {
            NotOpened::Above(e) | NotOpened::Last(e, _) => e,
        }
    }
}

/// Open `ws` from its root down, never following a symlink: (its parent, it).
fn open_below(ws: &Path, roots: &[PathBuf]) -> Result<(OwnedFd, OwnedFd, PathBuf), NotOpened> {
    let (root, comps) = below_root(ws, roots).map_err(NotOpened::Above)?;
    let (last, parents) = comps.split_last().expect("not empty");
    let mut dir: OwnedFd = File::open(root).map_err(NotOpened::Above)?.into();
    for c in parents {
        dir = open_dir(&dir, c).map_err(NotOpened::Above)?;
    }
    match open_dir(&dir, last) {
        Ok(fd) => Ok((dir, fd, root.join(comps[0]))),
        Err(e) => Err(NotOpened::Last(e, dir)),
    }
}

/// What a pass knows of a recorded workspace.
enum Look {
    /// The recorded directory, with its marker: last used (file system times).
    Found(i64, PathBuf),
    /// Certainly not the recorded workspace any more: removed (ENOENT in its
    /// opened parent), another entry in its place, or its marker gone.
    Gone,
    /// Cannot tell now (EACCES, EMFILE, EIO, a directory above it missing, a
    /// file system not mounted yet...): kept, looked at again next pass.
    Unknown(io::Error),
}

fn look(v: &Vouched, roots: &[PathBuf]) -> Look {
    let (fd, owner) = match open_below(&v.path, roots) {
        Ok((_, fd, owner)) => (fd, owner),
        Err(NotOpened::Above(e)) => return Look::Unknown(e),
        Err(NotOpened::Last(e, parent)) => {
            if e.raw_os_error() == Some(libc::ENOENT) {
                return Look::Gone;
            }
            // Something that is no directory (a symlink, a file) in its place:
            // not the recorded one, whatever its inode number (a freed one is
            // reused). Anything else: cannot tell.
            let last = v.path.file_name().expect("below a root");
            return match fstatat(&parent, last, AtFlags::AT_SYMLINK_NOFOLLOW) {
                Ok(st) if st.st_mode & libc::S_IFMT != libc::S_IFDIR => Look::Gone,
                Ok(st) if ident(&st) != (v.dev, v.ino) => Look::Gone,
                Err(nix::errno::Errno::ENOENT) => Look::Gone,
                _ => Look::Unknown(e),
            };
        }
    };
    match fstat(&fd) {
        Ok(st) if ident(&st) != (v.dev, v.ino) => return Look::Gone,
        Ok(_) => {}
        Err(e) => return Look::Unknown(e.into()),
    }
    match created(&fd) {
        Ok(Some(t)) => Look::Found(t, owner),
        Ok(None) => Look::Gone,
        Err(e) => Look::Unknown(e),
    }
}

/// Find the recorded workspaces under `roots` unused for more than `retain_days`;
/// `in_use` says whether a running script has a workspace at or below a path
/// (running workspaces are canonical paths, and so are the roots here).
pub fn plan(
    roots: &[PathBuf],
    vouched: &[Vouched],
    retain_days: u64,
    now_ms: i64,
    in_use: &dyn Fn(&Path) -> bool,
) -> Plan {
    let roots: Vec<PathBuf> = roots
        .iter()
        .filter_map(|r| std::fs::canonicalize(r).ok())
        .collect();
    let (mut found, mut gone, mut unknown) = (Vec::new(), Vec::new(), Vec::new());
    for v in vouched {
        // Outside the roots as configured now: neither removed nor forgotten (a
        // root left out of the configuration for a while comes back as it was).
        if below_root(&v.path, &roots).is_err() {
            continue;
        }
        match look(v, &roots) {
            // Old only when both the file system's times (which scripts can set
            // in their own workspace) and the daemon's last recorded start are.
            Look::Found(fs_last, owner) => found.push(Created {
                path: v.path.clone(),
                last_used_ms: fs_last.max(v.last_at_ms),
                ident: (v.dev, v.ino),
                owner,
                in_use: in_use(&v.path),
            }),
            Look::Gone => gone.push(v.path.clone()),
            Look::Unknown(e) => unknown.push((v.path.clone(), e)),
        }
    }
    let cutoff = now_ms - (retain_days as i64).saturating_mul(86_400_000);
    let mut plan = decide(found, cutoff);
    plan.gone = gone;
    plan.unknown = unknown;
    plan
}

/// The policy of a pass, on what it found: unused since before `cutoff` and not
/// in use goes, oldest first, at most [`MAX_PER_OWNER`] of each owner.
pub fn decide(mut found: Vec<Created>, cutoff: i64) -> Plan {
    found.sort_by(|a, b| (a.last_used_ms, &a.path).cmp(&(b.last_used_ms, &b.path)));
    let mut plan = Plan::default();
    let mut per_owner: HashMap<PathBuf, usize> = HashMap::new();
    for c in found {
        if c.last_used_ms >= cutoff || c.in_use {
            plan.kept += 1;
            plan.held.push(c);
            continue;
        }
        let n = per_owner.entry(c.owner.clone()).or_default();
        if *n >= MAX_PER_OWNER {
            plan.more = true;
            plan.deferred.push(c);
            continue;
        }
        *n += 1;
        plan.expired.push(c);
    }
    plan
}

/// Remove a workspace `plan` found: opened again from its root down without
/// following symlinks, still the recorded directory with its marker, then emptied
/// through that descriptor (never by its name again), and its now empty
/// directory unlinked from its opened parent only if the name is still that
/// directory.
pub fn remove(c: &Created, roots: &[PathBuf]) -> io::Result<()> {
    remove_checked(c, roots, &mut || {})
}

/// [`remove`], with `between` run once the directory is checked (a test's swap).
fn remove_checked(c: &Created, roots: &[PathBuf], between: &mut dyn FnMut()) -> io::Result<()> {
    let ws = &c.path;
    let (parent, fd, _) = open_below(ws, roots)?;
    let st = fstat(&fd).map_err(io::Error::from)?;
    if ident(&st) != c.ident {
        return Err(io::Error::other(format!(
            "{} is no longer the directory the daemon recorded; left alone",
            ws.display()
        )));
    }
    if created(&fd)?.is_none() {
        return Err(io::Error::other(format!(
            "{} no longer carries the scriptgate marker; left alone",
            ws.display()
        )));
    }
    between();
    empty_dir(&fd, 0)?;
    drop(fd);
    // The name may have been given to another directory meanwhile (its parent
    // may be the engine's to write): unlink it only if it is still the one
    // emptied. (Between this check and the unlink only an empty directory can
    // be removed, in a parent whose writer could have removed it too.)
    let last = ws.file_name().expect("below a root");
    match fstatat(&parent, last, AtFlags::AT_SYMLINK_NOFOLLOW) {
        Ok(now) if ident(&now) == c.ident => {
            unlinkat(&parent, last, UnlinkatFlags::RemoveDir).map_err(io::Error::from)
        }
        _ => Err(io::Error::other(format!(
            "{} was moved or replaced while it was removed: its contents are removed, \
             what has the name now is left alone",
            ws.display()
        ))),
    }
}

/// Empty the opened directory `dir`: each entry removed relative to it, a
/// directory with everything in it, anything else (a symlink included) as one
/// entry.
fn empty_dir(dir: &OwnedFd, depth: usize) -> io::Result<()> {
    if depth > MAX_DEPTH {
        return Err(io::Error::other("directory tree deeper than 128 levels"));
    }
    let mut unbounded = usize::MAX;
    for name in names(dir, &mut unbounded)? {
        match open_dir(dir, &name) {
            Ok(sub) => {
                empty_dir(&sub, depth + 1)?;
                drop(sub);
                unlinkat(dir, name.as_os_str(), UnlinkatFlags::RemoveDir)
                    .map_err(io::Error::from)?
            }
            // Not a directory (ENOTDIR), or a symlink (ELOOP / ENOTDIR with O_NOFOLLOW).
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOTDIR | libc::ELOOP)) => {
                unlinkat(dir, name.as_os_str(), UnlinkatFlags::NoRemoveDir)
                    .map_err(io::Error::from)?
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// One retention pass over the recorded workspaces: plan, then remove. Returns
/// the plan and the errors (path, error) of removals that failed.
pub fn run_pass(
    roots: &[PathBuf],
    vouched: &[Vouched],
    retain_days: u64,
    in_use: &dyn Fn(&Path) -> bool,
) -> (Plan, Vec<(PathBuf, io::Error)>) {
    let plan = plan(roots, vouched, retain_days, crate::time::now_ms(), in_use);
    let roots: Vec<PathBuf> = roots
        .iter()
        .filter_map(|r| std::fs::canonicalize(r).ok())
        .collect();
    let failed = plan
        .expired
        .iter()
        .filter_map(|c| remove(c, &roots).err().map(|e| (c.path.clone(), e)))
        .collect();
    (plan, failed)
}

/// A pass (`dry_run` false: removes, as of now) or a look (a dry run, as of
/// `as_of_ms` or now, with the listing of every workspace): what
/// `admin.prune` answers, and what the store is to forget after a pass.
pub fn pass_or_look(
    roots: &[PathBuf],
    vouched: &[Vouched],
    retain_days: u64,
    dry_run: bool,
    as_of_ms: Option<i64>,
    in_use: &dyn Fn(&Path) -> bool,
) -> (crate::protocol::Pruned, Vec<PathBuf>) {
    if !dry_run {
        let (plan, failed) = run_pass(roots, vouched, retain_days, in_use);
        let forget = to_forget(&plan, &failed);
        return (pruned(&plan, &failed, retain_days, false, roots), forget);
    }
    let now = as_of_ms.unwrap_or_else(crate::time::now_ms);
    let plan = plan(roots, vouched, retain_days, now, in_use);
    let mut p = pruned(&plan, &[], retain_days, true, roots);
    (p.workspaces, p.workspaces_more) = listing(&plan, vouched, roots, retain_days, now);
    p.as_of_ms = as_of_ms;
    (p, vec![])
}

/// What the store forgets after a pass that removed (not a dry run): the expired
/// workspaces removed without error, and those certainly gone. The daemon's pass
/// and `scriptgate prune`'s both forget these; a workspace that could not be
/// removed, or looked at, stays recorded.
pub fn to_forget(plan: &Plan, failed: &[(PathBuf, io::Error)]) -> Vec<PathBuf> {
    plan.expired
        .iter()
        .filter(|c| !failed.iter().any(|(p, _)| *p == c.path))
        .map(|c| c.path.clone())
        .chain(plan.gone.iter().cloned())
        .collect()
}

/// A pass as `admin.prune` answers it (and `scriptgate prune` prints it).
pub fn pruned(
    plan: &Plan,
    failed: &[(PathBuf, io::Error)],
    retain_days: u64,
    dry_run: bool,
    roots: &[PathBuf],
) -> crate::protocol::Pruned {
    use crate::protocol::{PruneUnknown, Pruned, PrunedWorkspace};
    Pruned {
        dry_run,
        retain_days,
        roots: roots.to_vec(),
        expired: plan
            .expired
            .iter()
            .map(|c| PrunedWorkspace {
                path: c.path.clone(),
                last_used_ms: c.last_used_ms,
                error: failed
                    .iter()
                    .find(|(p, _)| *p == c.path)
                    .map(|(_, e)| e.to_string()),
            })
            .collect(),
        unknown: plan
            .unknown
            .iter()
            .map(|(p, e)| PruneUnknown {
                path: p.clone(),
                error: e.to_string(),
            })
            .collect(),
        kept: plan.kept,
        more: plan.more,
        ..Default::default()
    }
}

/// Workspaces a dry run lists at most (`Pruned::workspaces`), oldest use first.
pub const MAX_LISTED: usize = 1000;
/// Directory entries a dry run's sizes look at in all; past it, sizes are
/// partial (at least).
pub const MAX_SIZE_ENTRIES: usize = 1_000_000;

/// A dry run's listing: every workspace the pass could look at, oldest use
/// first, with its engine, owner, last use, age and size as of `now_ms`, and
/// what will happen to it and when. Sizes are measured here (opened from the
/// root down, symlinks not followed). The listing, and whether more were left
/// out.
pub fn listing(
    plan: &Plan,
    vouched: &[Vouched],
    roots: &[PathBuf],
    retain_days: u64,
    now_ms: i64,
) -> (Vec<crate::protocol::PlannedWorkspace>, bool) {
    let roots: Vec<PathBuf> = roots
        .iter()
        .filter_map(|r| std::fs::canonicalize(r).ok())
        .collect();
    let mut all: Vec<(&Created, &str)> = plan
        .expired
        .iter()
        .map(|c| (c, "remove"))
        .chain(plan.deferred.iter().map(|c| (c, "remove_next_pass")))
        .chain(
            plan.held
                .iter()
                .map(|c| (c, if c.in_use { "keep_in_use" } else { "keep" })),
        )
        .collect();
    all.sort_by(|a, b| (a.0.last_used_ms, &a.0.path).cmp(&(b.0.last_used_ms, &b.0.path)));
    let more = all.len() > MAX_LISTED;
    let mut budget = MAX_SIZE_ENTRIES;
    let listed = all
        .into_iter()
        .take(MAX_LISTED)
        .map(|(c, action)| {
            let opened = open_below(&c.path, &roots).ok().map(|(_, fd, _)| fd);
            let owner_uid = opened
                .as_ref()
                .and_then(|fd| fstat(fd).ok())
                .map(|s| s.st_uid);
            let (size, partial) = match &opened {
                Some(fd) => size_of(fd, &mut budget),
                None => (None, true),
            };
            crate::protocol::PlannedWorkspace {
                path: c.path.clone(),
                engine_uid: vouched
                    .iter()
                    .find(|v| v.path == c.path)
                    .map(|v| v.peer_uid),
                owner_uid,
                last_used_ms: c.last_used_ms,
                age_ms: now_ms.saturating_sub(c.last_used_ms),
                size_bytes: size,
                size_partial: partial,
                action: action.to_string(),
                due_ms: c
                    .last_used_ms
                    .saturating_add((retain_days as i64).saturating_mul(86_400_000)),
            }
        })
        .collect();
    (listed, more)
}

/// The bytes the files below the opened directory hold (allocated blocks),
/// looking at most at `budget` entries (taken from it) and [`MAX_DEPTH`]
/// levels; partial when a bound was met or a directory could not be read.
fn size_of(dir: &OwnedFd, budget: &mut usize) -> (Option<u64>, bool) {
    fn walk(dir: &OwnedFd, depth: usize, budget: &mut usize, total: &mut u64) -> bool {
        let Ok(names) = names(dir, budget) else {
            return false;
        };
        let mut complete = *budget > 0 && depth <= MAX_DEPTH;
        for name in names {
            let Ok(st) = fstatat(dir, name.as_os_str(), AtFlags::AT_SYMLINK_NOFOLLOW) else {
                complete = false;
                continue;
            };
            *total += (st.st_blocks as u64).saturating_mul(512);
            if st.st_mode & libc::S_IFMT == libc::S_IFDIR {
                match open_dir(dir, &name) {
                    Ok(sub) if depth < MAX_DEPTH => {
                        complete &= walk(&sub, depth + 1, budget, total)
                    }
                    _ => complete = false,
                }
            }
        }
        complete
    }
    let mut total = 0;
    let complete = walk(dir, 0, budget, &mut total);
    (Some(total), !complete)
}

/// What `scriptgate prune` prints: one line per workspace, then a summary.
pub fn report(p: &crate::protocol::Pruned) -> String {
    let mut out = String::new();
    if p.retain_days == 0 {
        return "workspace.retain_days = 0: workspaces are kept\n".to_string();
    }
    for c in &p.expired {
        let when = crate::time::rfc3339(c.last_used_ms);
        match &c.error {
            Some(e) => out.push_str(&format!("cannot remove {}: {e}\n", c.path.display())),
            None if p.dry_run => out.push_str(&format!(
                "would remove {} (last used {when})\n",
                c.path.display()
            )),
            None => out.push_str(&format!(
                "removed {} (last used {when})\n",
                c.path.display()
            )),
        }
    }
    for u in &p.unknown {
        out.push_str(&format!(
            "cannot look at {}: {} (kept; looked at again next pass)\n",
            u.path.display(),
            u.error
        ));
    }
    let n = p.expired.iter().filter(|c| c.error.is_none()).count();
    let ws = |n: usize| if n == 1 { "workspace" } else { "workspaces" };
    out.push_str(&format!(
        "{n} {} {} (unused for more than {} days); {} kept (recent or in use){}\n",
        ws(n),
        if p.dry_run {
            "would be removed"
        } else {
            "removed"
        },
        p.retain_days,
        p.kept,
        if p.more {
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

    /// What the daemon records for a workspace a script started in `days` ago.
    fn recorded(ws: &Path, days: i64) -> Vouched {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::symlink_metadata(ws).unwrap();
        Vouched {
            path: ws.to_path_buf(),
            dev: m.dev(),
            ino: m.ino(),
            peer_uid: m.uid(),
            last_at_ms: crate::time::now_ms() - days * 86_400_000,
        }
    }

    #[test]
    fn only_a_marker_the_engine_owns_in_a_directory_of_the_script_uid_vouches() {
        // (peer, run_uid, ws owner, marker owner)
        assert!(vouches(1000, 1000, 1000, Some(1000)));
        assert!(vouches(0, 65534, 65534, Some(0)), "root's scriptgate run");
        assert!(vouches(1000, 1000, 1000, Some(0)));
        assert!(!vouches(1000, 1000, 1000, None), "no marker");
        assert!(!vouches(1006, 1006, 0, Some(1006)), "root's directory");
        assert!(
            !vouches(1006, 1006, 1007, Some(1006)),
            "another's directory"
        );
        assert!(!vouches(1000, 1000, 1000, Some(1006)), "another's marker");
        assert!(
            !vouches(1000, 65534, 65534, Some(1000)),
            "not the engine's uid"
        );
    }

    #[test]
    fn the_policy_bounds_each_owner_not_the_pass() {
        let c = |owner: &str, i: i64, in_use| Created {
            path: PathBuf::from(format!("{owner}/w{i}")),
            last_used_ms: i,
            ident: (1, i as u64),
            owner: PathBuf::from(owner),
            in_use,
        };
        let mut found: Vec<Created> = (0..(MAX_PER_OWNER as i64 + 50))
            .map(|i| c("/r/1006", i, false))
            .collect();
        found.push(c("/r/1007", 1_000, false));
        found.push(c("/r/1007", 5, true));
        found.push(c("/r/new", 10_000, false));
        let plan = decide(found, 5_000);
        let of = |o: &str| {
            plan.expired
                .iter()
                .filter(|c| c.owner == Path::new(o))
                .count()
        };
        assert_eq!(of("/r/1006"), MAX_PER_OWNER);
        assert_eq!(of("/r/1007"), 1, "another owner is not held back");
        assert!(plan.more);
        assert_eq!(plan.kept, 2, "in use, recent");
        assert_eq!(plan.expired[0].last_used_ms, 0, "oldest first");
    }

    #[test]
    fn what_is_forgotten_is_what_was_removed_and_what_is_gone() {
        let c = |p: &str| Created {
            path: PathBuf::from(p),
            last_used_ms: 0,
            ident: (1, 1),
            owner: PathBuf::from("/r/1006"),
            in_use: false,
        };
        let plan = Plan {
            expired: vec![c("/r/1006/a"), c("/r/1006/b"), c("/r/1006/c")],
            kept: 4,
            more: false,
            gone: vec![PathBuf::from("/r/1006/gone")],
            unknown: vec![(PathBuf::from("/r/1006/dark"), io::Error::other("EIO"))],
            ..Default::default()
        };
        let failed = vec![(PathBuf::from("/r/1006/b"), io::Error::other("busy"))];
        assert_eq!(
            to_forget(&plan, &failed),
            ["/r/1006/a", "/r/1006/c", "/r/1006/gone"].map(PathBuf::from),
            "not one that could not be removed, nor one that could not be looked at"
        );
        assert_eq!(to_forget(&Plan::default(), &[]), Vec::<PathBuf>::new());
    }

    #[test]
    fn only_recorded_old_unused_workspaces_go_and_symlinks_are_not_followed() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("root");
        let outside = d.path().join("outside");
        std::fs::create_dir_all(&outside).unwrap();
        std::fs::write(outside.join("precious"), "x").unwrap();
        // Recorded, old: goes; with a symlink out of the root inside.
        let old = root.join("run-old");
        std::fs::create_dir_all(&old).unwrap();
        mark_created(&old, "test").unwrap();
        std::fs::create_dir_all(old.join(".agent/scripts/s1")).unwrap();
        std::fs::write(old.join("data.txt"), "d").unwrap();
        std::os::unix::fs::symlink(&outside, old.join("link")).unwrap();
        age_ws(&old, 40);
        // Per-uid level, recorded and old: goes.
        let nested = root.join("1001/run-x");
        std::fs::create_dir_all(&nested).unwrap();
        mark_created(&nested, "test").unwrap();
        age_ws(&nested, 40);
        // Recorded, recent start: kept. Recorded, old, in use: kept.
        let recent = root.join("run-new");
        std::fs::create_dir_all(&recent).unwrap();
        mark_created(&recent, "test").unwrap();
        let busy = root.join("run-busy");
        std::fs::create_dir_all(&busy).unwrap();
        mark_created(&busy, "test").unwrap();
        age_ws(&busy, 40);
        // Marked and old but never recorded (a marker anyone could write): kept.
        let planted = root.join("planted");
        std::fs::create_dir_all(&planted).unwrap();
        mark_created(&planted, "a script").unwrap();
        age_ws(&planted, 400);
        // Recorded, then replaced by another directory: not the one recorded.
        let replaced = root.join("replaced");
        std::fs::create_dir_all(&replaced).unwrap();
        let was = recorded(&replaced, 400);
        // The new one is made while the old one exists, so that its inode
        // cannot be the old one's, freed and reused.
        let new = root.join("replaced.new");
        std::fs::create_dir_all(&new).unwrap();
        std::fs::remove_dir(&replaced).unwrap();
        std::fs::rename(&new, &replaced).unwrap();
        mark_created(&replaced, "another").unwrap();
        age_ws(&replaced, 400);
        // Recorded, its marker gone: kept.
        let unmarked = root.join("unmarked");
        std::fs::create_dir_all(unmarked.join(".agent/scripts")).unwrap();
        age_ws(&unmarked, 400);
        // A symlinked directory in the root pointing at a marked workspace elsewhere.
        let elsewhere = d.path().join("elsewhere");
        std::fs::create_dir_all(&elsewhere).unwrap();
        mark_created(&elsewhere, "test").unwrap();
        age_ws(&elsewhere, 40);
        std::os::unix::fs::symlink(&elsewhere, root.join("run-link")).unwrap();
        let mut link = recorded(&elsewhere, 40);
        link.path = root.join("run-link");

        let vouched = vec![
            recorded(&old, 40),
            recorded(&nested, 40),
            recorded(&recent, 1),
            recorded(&busy, 40),
            was,
            recorded(&unmarked, 400),
            link,
            recorded(&elsewhere, 40),
        ];
        let roots = vec![root.clone()];
        let in_use = |p: &Path| p == busy;
        let plan = plan(&roots, &vouched, 30, crate::time::now_ms(), &in_use);
        let mut paths: Vec<&Path> = plan.expired.iter().map(|c| c.path.as_path()).collect();
        paths.sort();
        assert_eq!(paths, vec![nested.as_path(), old.as_path()]);
        assert_eq!(plan.kept, 2, "recent and busy");
        assert!(!plan.more);
        let mut gone = plan.gone.clone();
        gone.sort();
        assert_eq!(
            gone,
            vec![replaced.clone(), root.join("run-link"), unmarked.clone()],
            "not what lies outside the roots"
        );

        let (plan, failed) = run_pass(&roots, &vouched, 30, &in_use);
        assert_eq!(plan.expired.len(), 2);
        assert!(failed.is_empty(), "{failed:?}");
        assert!(!old.exists() && !nested.exists());
        assert!(root.join("1001").exists(), "the per-uid directory stays");
        for kept in [&recent, &busy, &planted, &replaced, &unmarked, &elsewhere] {
            assert!(kept.exists(), "{}", kept.display());
        }
        assert_eq!(
            std::fs::read_to_string(outside.join("precious")).unwrap(),
            "x"
        );
        // Removing a directory that is not the recorded one is refused.
        let e = remove(
            &Created {
                path: recent.clone(),
                last_used_ms: 0,
                ident: (0, 0),
                owner: recent.clone(),
                in_use: false,
            },
            &roots,
        )
        .unwrap_err();
        assert!(e.to_string().contains("no longer the directory"), "{e}");
    }

    /// A pass that cannot look at a workspace (a directory above it missing or
    /// replaced, as when a file system is mounted late) keeps its row; only a
    /// workspace removed from its opened parent, or replaced, is forgotten.
    #[test]
    fn a_workspace_that_cannot_be_looked_at_is_not_forgotten() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("root");
        let mk = |rel: &str| {
            let ws = root.join(rel);
            std::fs::create_dir_all(&ws).unwrap();
            mark_created(&ws, "test").unwrap();
            age_ws(&ws, 40);
            recorded(&ws, 40)
        };
        let unmounted = mk("1001/ws");
        let relinked = mk("1002/ws");
        let removed = mk("1003/ws");
        let swapped = mk("1004/ws");
        let kept = mk("1005/ws");
        // A directory above it gone (an unmounted file system), or now a symlink.
        std::fs::rename(root.join("1001"), d.path().join("1001.away")).unwrap();
        std::fs::rename(root.join("1002"), d.path().join("1002.away")).unwrap();
        std::os::unix::fs::symlink(d.path().join("1002.away"), root.join("1002")).unwrap();
        // Truly removed; a symlink in the workspace's own place.
        std::fs::remove_dir_all(removed.path.clone()).unwrap();
        std::fs::remove_dir_all(swapped.path.clone()).unwrap();
        std::os::unix::fs::symlink(d.path(), &swapped.path).unwrap();
        let vouched = vec![
            unmounted.clone(),
            relinked.clone(),
            removed.clone(),
            swapped.clone(),
            kept.clone(),
        ];
        let plan = plan(
            std::slice::from_ref(&root),
            &vouched,
            30,
            crate::time::now_ms(),
            &|_| false,
        );
        let mut gone = plan.gone.clone();
        gone.sort();
        assert_eq!(gone, vec![removed.path.clone(), swapped.path.clone()]);
        let mut unknown: Vec<&Path> = plan.unknown.iter().map(|(p, _)| p.as_path()).collect();
        unknown.sort();
        assert_eq!(
            unknown,
            vec![unmounted.path.as_path(), relinked.path.as_path()]
        );
        assert_eq!(
            plan.expired.iter().map(|c| &c.path).collect::<Vec<_>>(),
            vec![&kept.path]
        );
        // Mounted again: the pass finds it as it was.
        std::fs::rename(d.path().join("1001.away"), root.join("1001")).unwrap();
        let plan = super::plan(
            &[root],
            std::slice::from_ref(&unmounted),
            30,
            crate::time::now_ms(),
            &|_| false,
        );
        assert_eq!(plan.expired.len(), 1);
        assert!(plan.gone.is_empty() && plan.unknown.is_empty());
    }

    /// A script can set its workspace's times back (utimensat): a workspace is
    /// old only when the daemon's last recorded start in it is old too.
    #[test]
    fn a_workspace_is_old_only_when_its_last_recorded_start_is() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("root");
        let ws = root.join("run-x");
        std::fs::create_dir_all(&ws).unwrap();
        mark_created(&ws, "test").unwrap();
        age_ws(&ws, 400);
        let roots = vec![root.clone()];
        let now = crate::time::now_ms();
        let plan = plan(&roots, &[recorded(&ws, 1)], 30, now, &|_| false);
        assert!(plan.expired.is_empty(), "started a day ago: kept");
        assert_eq!(plan.kept, 1);
        let p = super::plan(&roots, &[recorded(&ws, 40)], 30, now, &|_| false);
        assert_eq!(p.expired.len(), 1);
        // Its file system times recent, the last start old: kept as well.
        let fresh = root.join("run-y");
        std::fs::create_dir_all(&fresh).unwrap();
        mark_created(&fresh, "test").unwrap();
        let p = super::plan(&roots, &[recorded(&fresh, 40)], 30, now, &|_| false);
        assert!(p.expired.is_empty());
    }

    /// A dry run lists every workspace with its owner, size and what will
    /// happen and when; as of a later moment, a recent one is due; nothing is
    /// removed; a symlink in a workspace is sized as a link, not followed.
    #[test]
    fn a_dry_run_lists_each_workspace_with_its_fate_and_as_of_a_later_day() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("root");
        let (old, new, busy) = (root.join("old"), root.join("new"), root.join("busy"));
        for ws in [&old, &new, &busy] {
            std::fs::create_dir_all(ws).unwrap();
            mark_created(ws, "test").unwrap();
        }
        std::fs::write(old.join("data"), vec![1u8; 64 * 1024]).unwrap();
        std::os::unix::fs::symlink("/usr", new.join("usr")).unwrap();
        age_ws(&old, 40);
        let roots = vec![root.clone()];
        let vouched = [recorded(&old, 40), recorded(&new, 0), recorded(&busy, 0)];
        let now = crate::time::now_ms();
        let in_use = |p: &Path| p.ends_with("busy");
        let (p, forget) = pass_or_look(&roots, &vouched, 30, true, None, &in_use);
        assert!(
            forget.is_empty() && old.exists(),
            "a dry run removes nothing"
        );
        let fate: Vec<(&str, &str)> = p
            .workspaces
            .iter()
            .map(|w| {
                (
                    w.path.file_name().unwrap().to_str().unwrap(),
                    w.action.as_str(),
                )
            })
            .collect();
        assert_eq!(fate[0], ("old", "remove"), "oldest first: {fate:?}");
        assert!(fate.contains(&("new", "keep")) && fate.contains(&("busy", "keep_in_use")));
        let w = &p.workspaces[0];
        let me = nix::unistd::getuid().as_raw();
        assert_eq!((w.engine_uid, w.owner_uid), (Some(me), Some(me)));
        assert!(
            !w.size_partial && w.size_bytes.unwrap() >= 64 * 1024,
            "{w:?}"
        );
        assert!(w.age_ms >= 39 * 86_400_000 && w.due_ms == w.last_used_ms + 30 * 86_400_000);
        let n = p.workspaces.iter().find(|w| w.path == new).unwrap();
        assert!(
            n.size_bytes.unwrap() < 64 * 1024,
            "the symlink is not followed: {n:?}"
        );
        // As of 31 days on, the recent one is due too; the busy one stays.
        let later = now + 31 * 86_400_000;
        let (p, _) = pass_or_look(&roots, &vouched, 30, true, Some(later), &in_use);
        assert_eq!(p.as_of_ms, Some(later));
        let due: Vec<&str> = p
            .workspaces
            .iter()
            .filter(|w| w.action == "remove")
            .map(|w| w.path.file_name().unwrap().to_str().unwrap())
            .collect();
        assert_eq!(due, ["old", "new"]);
        assert!(new.exists());
    }

    /// The listing's bounds: at most MAX_LISTED workspaces (the least recently
    /// used), said when more are recorded; a size walk past its budget of
    /// entries is a lower bound, said as partial.
    #[test]
    fn the_listing_and_its_sizes_are_bounded() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("root");
        let mut vouched = vec![];
        for i in 0..=MAX_LISTED {
            let ws = root.join(format!("w{i:04}"));
            std::fs::create_dir_all(&ws).unwrap();
            mark_created(&ws, "test").unwrap();
            vouched.push(recorded(&ws, 0));
        }
        let (p, _) = pass_or_look(
            std::slice::from_ref(&root),
            &vouched,
            30,
            true,
            None,
            &|_| false,
        );
        assert_eq!(p.workspaces.len(), MAX_LISTED);
        assert!(p.workspaces_more && p.kept == MAX_LISTED + 1);
        let ws: OwnedFd = File::open(root.join("w0000")).unwrap().into();
        std::fs::write(root.join("w0000/a"), b"x").unwrap();
        let mut budget = 1;
        let (size, partial) = size_of(&ws, &mut budget);
        assert!(
            partial && size.is_some(),
            "one entry of .agent and a: partial"
        );
        let mut budget = 100;
        assert!(!size_of(&ws, &mut budget).1);
        assert!(budget < 100, "the budget is spent");
    }

    /// The directory is swapped for another after its check (an engine that can
    /// write the parent renames it away and puts another in its place): removal
    /// empties only the checked directory, through its descriptor, and leaves
    /// what now has the name alone.
    #[test]
    fn removal_does_not_follow_a_name_swapped_after_the_check() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("root");
        let ws = root.join("1001/run-x");
        std::fs::create_dir_all(ws.join("sub")).unwrap();
        mark_created(&ws, "test").unwrap();
        std::fs::write(ws.join("sub/f"), "old").unwrap();
        let v = recorded(&ws, 40);
        let c = Created {
            path: ws.clone(),
            last_used_ms: 0,
            ident: (v.dev, v.ino),
            owner: root.join("1001"),
            in_use: false,
        };
        let moved = root.join("1001/moved");
        let e = remove_checked(&c, std::slice::from_ref(&root), &mut || {
            std::fs::rename(&ws, &moved).unwrap();
            std::fs::create_dir(&ws).unwrap();
            std::fs::write(ws.join("precious"), "x").unwrap();
        })
        .unwrap_err();
        assert!(e.to_string().contains("moved or replaced"), "{e}");
        assert_eq!(std::fs::read_to_string(ws.join("precious")).unwrap(), "x");
        assert_eq!(
            std::fs::read_dir(&moved).unwrap().count(),
            0,
            "the checked directory was emptied"
        );
        // Unswapped, the workspace goes, its name with it.
        std::fs::remove_dir(&moved).unwrap();
        std::fs::remove_file(ws.join("precious")).unwrap();
        mark_created(&ws, "test").unwrap();
        let v = recorded(&ws, 40);
        remove(
            &Created {
                ident: (v.dev, v.ino),
                ..c
            },
            std::slice::from_ref(&root),
        )
        .unwrap();
        assert!(!ws.exists() && root.join("1001").exists());
    }
}
