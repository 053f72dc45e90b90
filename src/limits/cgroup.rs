//! cgroup v2: the `cgroup` backend (a leaf per script in the daemon's delegated
//! subtree) and reading a unit's counters (also for the `systemd` backend, on v2 or
//! on a hybrid v1/v2 host). Every path is passed in, so tests run against a fake
//! cgroupfs tree in a TempDir.

use std::io;
use std::path::{Path, PathBuf};

use crate::policy::Limits;

/// Why a cgroup cannot be used: the daemon's subtree at start-up, a script's
/// leaf, or the cgroup a placed script is in when its limits are read back.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// `/proc/self/cgroup` has no `0::` line: no cgroup v2 here.
    #[error("no cgroup v2 entry in /proc/self/cgroup")]
    NoV2Entry,
    /// The daemon's v2 path has no `cgroup.controllers`.
    #[error("{} is not a cgroup v2 directory", dir.display())]
    NotV2Dir { dir: PathBuf },
    /// A controller the backend needs is not available in the daemon's subtree.
    #[error("the {controller} controller is not delegated to {} (controllers: {controllers:?})", root.display())]
    NotDelegated {
        controller: &'static str,
        root: PathBuf,
        /// The subtree's `cgroup.controllers`, trimmed.
        controllers: String,
    },
    /// The subtree's `cgroup.subtree_control` cannot be written by the daemon.
    #[error("{}: {source} (not delegated to us)", probe.display())]
    NotWritable {
        probe: PathBuf,
        #[source]
        source: io::Error,
    },
    /// Moving the daemon into its own leaf, or enabling the controllers for
    /// leaves, failed.
    #[error(transparent)]
    Init(io::Error),
    /// A script's leaf could not be made, or its limits written.
    #[error(transparent)]
    Leaf(io::Error),
    /// A script's process could not be moved into its leaf.
    #[error(transparent)]
    Add(io::Error),
    /// The bound on all scripts together could not be written on the
    /// `scripts` node (the message names the file and the value).
    #[error(transparent)]
    Bound(io::Error),
    /// The process is in no cgroup of a hierarchy with the controller, nor in a v2
    /// one.
    #[error("the script is in no {controller} cgroup")]
    NoController { controller: String },
    /// The process is in a cgroup that is not its own (`own`).
    #[error("the script is in {controller} cgroup {path}, not in its own {own} (the controller is not writable, or not delegated)")]
    NotOwn {
        controller: String,
        path: String,
        own: String,
    },
    /// The process's own v2 cgroup does not have the controller enabled.
    #[error("the {controller} controller is not enabled for {} (its parent's cgroup.subtree_control lacks it)", dir.display())]
    NotEnabled { controller: String, dir: PathBuf },
}

/// What a script's cgroup says after its end.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// The kernel's OOM killer killed a process in it.
    pub oom_killed: bool,
    pub memory_peak_bytes: Option<u64>,
    pub cpu_usec: Option<u64>,
}

fn read(p: &Path) -> Option<String> {
    std::fs::read_to_string(p).ok()
}

/// The value of `key` in a flat-keyed cgroup file (`oom_kill 1`, `usage_usec 1500`).
fn key_value(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let mut it = l.split_whitespace();
        if it.next()? == key {
            it.next()?.parse().ok()
        } else {
            None
        }
    })
}

/// Counters of cgroup `cg` (a path like `/scriptgate.slice/scriptgate-x.scope`)
/// under `fs` (normally /sys/fs/cgroup): cgroup v2 files first (at `fs/cg`, or
/// `fs/unified/cg` on a hybrid host), then the v1 memory and cpuacct controllers.
pub fn stats(fs: &Path, cg: &str) -> Stats {
    let rel = cg.trim_start_matches('/');
    let mut s = Stats::default();
    for v2 in [fs.join(rel), fs.join("unified").join(rel)] {
        if let Some(ev) = read(&v2.join("memory.events")) {
            s.oom_killed |= key_value(&ev, "oom_kill").unwrap_or(0) > 0;
        }
        s.memory_peak_bytes = s
            .memory_peak_bytes
            .or_else(|| read(&v2.join("memory.peak"))?.trim().parse().ok());
        s.cpu_usec = s
            .cpu_usec
            .or_else(|| key_value(&read(&v2.join("cpu.stat"))?, "usage_usec"));
    }
    let v1 = fs.join("memory").join(rel);
    if let Some(oc) = read(&v1.join("memory.oom_control")) {
        s.oom_killed |= key_value(&oc, "oom_kill").unwrap_or(0) > 0;
    }
    s.memory_peak_bytes = s.memory_peak_bytes.or_else(|| {
        read(&v1.join("memory.max_usage_in_bytes"))?
            .trim()
            .parse()
            .ok()
    });
    for acct in ["cpuacct", "cpu,cpuacct"] {
        s.cpu_usec = s.cpu_usec.or_else(|| {
            read(&fs.join(acct).join(rel).join("cpuacct.usage"))?
                .trim()
                .parse::<u64>()
                .ok()
                .map(|ns| ns / 1000)
        });
    }
    s
}

/// The memory charged to cgroup `cg` now (v2 `memory.current`, at `fs/cg` or
/// `fs/unified/cg`; else v1 `memory.usage_in_bytes`).
pub fn memory_current(fs: &Path, cg: &str) -> Option<u64> {
    let rel = cg.trim_start_matches('/');
    [fs.join(rel), fs.join("unified").join(rel)]
        .iter()
        .map(|d| d.join("memory.current"))
        .chain([fs.join("memory").join(rel).join("memory.usage_in_bytes")])
        .find_map(|f| read(&f)?.trim().parse().ok())
}

/// Whether a script's limits are in force, as read back from the cgroup its
/// first process is actually in (not from what was asked for): `problems` are
/// memory or task limits not in force, `notes` a CPU quota not in force (the
/// daemon's own timeout bounds the time a script runs in any case).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Enforcement {
    pub problems: Vec<String>,
    pub notes: Vec<String>,
}

impl Enforcement {
    pub fn enforced(&self) -> bool {
        self.problems.is_empty()
    }

    /// Everything said, problems first, for a backend's notes.
    pub fn lines(&self) -> Vec<String> {
        self.problems.iter().chain(&self.notes).cloned().collect()
    }
}

/// One controller's cgroup directory for a process: on cgroup v1 the hierarchy
/// it is bound to (`fs/<controllers>/<path>`), else the v2 directory, if that
/// has the controller enabled. `Err` says where the process is and why that is
/// not its own cgroup with the controller.
fn controller_dir(
    fs: &Path,
    proc_cgroup: &str,
    controller: &str,
    own: &str,
) -> Result<PathBuf, CgroupError> {
    let mut v2 = None;
    for line in proc_cgroup.lines() {
        let mut it = line.splitn(3, ':');
        let (Some(_), Some(ctrls), Some(path)) = (it.next(), it.next(), it.next()) else {
            continue;
        };
        if ctrls.is_empty() {
            v2 = Some(path);
        } else if ctrls.split(',').any(|c| c == controller) {
            let dir = fs.join(ctrls).join(path.trim_start_matches('/'));
            return own_cgroup(path, own, controller).map(|()| dir);
        }
    }
    let path = v2.ok_or_else(|| CgroupError::NoController {
        controller: controller.into(),
    })?;
    own_cgroup(path, own, controller)?;
    let rel = path.trim_start_matches('/');
    let dir = if fs.join("cgroup.controllers").exists() {
        fs.join(rel)
    } else {
        fs.join("unified").join(rel)
    };
    let enabled = read(&dir.join("cgroup.controllers")).unwrap_or_default();
    if enabled.split_whitespace().any(|c| c == controller) {
        Ok(dir)
    } else {
        Err(CgroupError::NotEnabled {
            controller: controller.into(),
            dir,
        })
    }
}

fn own_cgroup(path: &str, own: &str, controller: &str) -> Result<(), CgroupError> {
    if path.rsplit('/').next() == Some(own) {
        Ok(())
    } else {
        Err(CgroupError::NotOwn {
            controller: controller.into(),
            path: path.into(),
            own: own.into(),
        })
    }
}

/// A limit file's value: a number, or None for `max` / v1's "unlimited".
fn limit_value(text: &str) -> Option<u64> {
    let v = text.split_whitespace().next()?;
    v.parse::<u64>().ok().filter(|&n| n < (1 << 62))
}

/// Read back the limits in force for the process whose `/proc/PID/cgroup` is
/// `proc_cgroup`, whose own cgroup is named `own` (`scriptgate-<id>.scope`,
/// `script-<id>`), against the limits it was given. Paths under `fs` (normally
/// /sys/fs/cgroup), so tests use a fake tree.
pub fn read_back(
    fs: &Path,
    proc_cgroup: &str,
    own: &str,
    l: &Limits,
    cpu_quota_percent: u32,
    keeper_tasks: u64,
) -> Enforcement {
    let mut e = Enforcement::default();
    // (key, its value, the unit's own bound): a scope's pids.max also has room
    // for its keeper (`limits::SCOPE_KEEPER_TASKS`).
    for (key, set, want, controller, v1, v2) in [
        (
            "memory_max_bytes",
            l.memory_max_bytes,
            l.memory_max_bytes,
            "memory",
            "memory.limit_in_bytes",
            "memory.max",
        ),
        (
            "tasks_max",
            l.tasks_max,
            l.tasks_max.saturating_add(keeper_tasks),
            "pids",
            "pids.max",
            "pids.max",
        ),
    ] {
        let not = |why: String| format!("{key} = {set} is not in force: {why}");
        match controller_dir(fs, proc_cgroup, controller, own) {
            Err(why) => e.problems.push(not(why.to_string())),
            Ok(dir) => {
                let file = [dir.join(v1), dir.join(v2)]
                    .into_iter()
                    .find(|f| f.exists());
                let Some(file) = file else {
                    e.problems
                        .push(not(format!("{} has neither {v1} nor {v2}", dir.display())));
                    continue;
                };
                let text = read(&file).unwrap_or_default();
                match limit_value(&text) {
                    Some(n) if n <= want => {}
                    _ => e
                        .problems
                        .push(not(format!("{} says {:?}", file.display(), text.trim()))),
                }
            }
        }
    }
    if cpu_quota_percent > 0 {
        let not =
            |why: String| format!("cpu_quota_percent = {cpu_quota_percent} is not in force: {why}");
        match controller_dir(fs, proc_cgroup, "cpu", own) {
            Err(why) => e.notes.push(not(why.to_string())),
            Ok(dir) => {
                let v2 = read(&dir.join("cpu.max")).map(|t| {
                    let mut it = t.split_whitespace();
                    (
                        it.next().and_then(|q| q.parse::<u64>().ok()),
                        it.next().and_then(|p| p.parse::<u64>().ok()),
                        t.trim().to_string(),
                    )
                });
                let v1 = || {
                    let q = read(&dir.join("cpu.cfs_quota_us"))?;
                    let p = read(&dir.join("cpu.cfs_period_us"))?;
                    Some((
                        q.trim().parse::<u64>().ok(),
                        p.trim().parse::<u64>().ok(),
                        format!("cfs_quota_us {}", q.trim()),
                    ))
                };
                match v2.or_else(v1) {
                    Some((Some(q), Some(p), _))
                        if p > 0 && q * 100 <= p * u64::from(cpu_quota_percent) + p => {}
                    Some((_, _, said)) => e
                        .notes
                        .push(not(format!("{} says {said:?}", dir.display()))),
                    None => e
                        .notes
                        .push(not(format!("{} has no CPU quota file", dir.display()))),
                }
            }
        }
    }
    e
}

/// The daemon's delegated cgroup v2 subtree.
#[derive(Debug, Clone)]
pub struct Tree {
    /// The subtree's directory (the daemon's own cgroup when it started).
    pub root: PathBuf,
}

/// The cgroup v2 path of a process from its /proc/PID/cgroup text (`0::/path`).
pub fn own_v2_path(proc_cgroup: &str) -> Option<String> {
    proc_cgroup
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .map(str::to_string)
}

impl Tree {
    /// Find a usable delegated subtree: the daemon's v2 cgroup, with the memory and
    /// pids controllers available and writable by us.
    pub fn detect(fs: &Path, proc_cgroup: &str) -> Result<Tree, CgroupError> {
        let path = own_v2_path(proc_cgroup).ok_or(CgroupError::NoV2Entry)?;
        let root = fs.join(path.trim_start_matches('/'));
        let Some(controllers) = read(&root.join("cgroup.controllers")) else {
            return Err(CgroupError::NotV2Dir { dir: root });
        };
        for c in ["memory", "pids"] {
            if !controllers.split_whitespace().any(|x| x == c) {
                return Err(CgroupError::NotDelegated {
                    controller: c,
                    root,
                    controllers: controllers.trim().into(),
                });
            }
        }
        let probe = root.join("cgroup.subtree_control");
        if let Err(source) = std::fs::OpenOptions::new().append(true).open(&probe) {
            return Err(CgroupError::NotWritable { probe, source });
        }
        Ok(Tree { root })
    }

    /// Move the daemon into a leaf of its own (cgroup v2 has no processes in inner
    /// nodes that have controllers enabled), then enable the controllers for its
    /// children: the `daemon` leaf and the `scripts` node, which holds every
    /// script's leaf (and the bound on all of them together, `bound_all`), and
    /// has the controllers enabled for them in turn. The order matters: the
    /// subtree_control write fails while we sit in the root. The daemon is not
    /// under `scripts`: all scripts together cannot take its memory or tasks.
    pub fn init(&self, own_pid: u32) -> io::Result<()> {
        let leaf = self.root.join("daemon");
        mkdir(&leaf)?;
        // Every process of the subtree's root goes: the daemon, and what it
        // started before (its mount server, `sandbox::mounter`). A process
        // left there would keep the controllers from being enabled (EBUSY).
        let others = read(&self.root.join("cgroup.procs")).unwrap_or_default();
        // (One that exited meanwhile is not there to move: its error is moot.)
        for pid in others
            .split_whitespace()
            .filter(|p| *p != own_pid.to_string())
        {
            let _ = write(&leaf.join("cgroup.procs"), pid);
        }
        write(&leaf.join("cgroup.procs"), &own_pid.to_string())?;
        let controllers = read(&self.root.join("cgroup.controllers")).unwrap_or_default();
        let enable: Vec<String> = ["memory", "pids", "cpu"]
            .iter()
            .filter(|c| controllers.split_whitespace().any(|x| x == **c))
            .map(|c| format!("+{c}"))
            .collect();
        write(&self.root.join("cgroup.subtree_control"), &enable.join(" "))?;
        mkdir(&self.scripts())?;
        // Leaves an earlier daemon left go once empty; a busy one stays. Its
        // waiting pre-made sandboxes' leaves (`script-pool-*`) are killed
        // first: their members ended with it, all but one whose bwrap was
        // killed between its clone and releasing its child, which would wait
        // forever. (A script's leaf a daemon killed outright left is not
        // killed: `scriptgate ps` and the recovery at start say what it was.)
        let leaves: Vec<PathBuf> = std::fs::read_dir(self.scripts())
            .map(|d| d.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        let name = |p: &PathBuf| {
            p.file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned()
        };
        for leaf in leaves
            .iter()
            .filter(|p| name(p).starts_with("script-pool-"))
        {
            let kill = leaf.join("cgroup.kill"); // Linux 5.14+
            if kill.exists() {
                let _ = write(&kill, "1");
            }
        }
        for leaf in leaves.iter().filter(|p| name(p).starts_with("script-")) {
            let pool = name(leaf).starts_with("script-pool-");
            // A killed leaf is busy until its processes have exited.
            for _ in 0..if pool { 40 } else { 1 } {
                match std::fs::remove_dir(leaf) {
                    Err(e) if e.raw_os_error() == Some(libc::EBUSY) && pool => {
                        std::thread::sleep(std::time::Duration::from_millis(25))
                    }
                    _ => break,
                }
            }
        }
        write(
            &self.scripts().join("cgroup.subtree_control"),
            &enable.join(" "),
        )
    }

    /// The node that holds every script's leaf.
    pub fn scripts(&self) -> PathBuf {
        self.root.join("scripts")
    }

    /// Write the bound on all scripts together (`memory.max`, `pids.max`,
    /// `cpu.max` of the `scripts` node; 0 is `max`, no bound). A running
    /// script is held to a lowered bound at once: memory is reclaimed, or the
    /// OOM killer takes a process; tasks over it make no new ones.
    pub fn bound_all(&self, a: &crate::protocol::AllScripts) -> Result<(), CgroupError> {
        let or_max = |n: u64| {
            if n == 0 {
                "max".to_string()
            } else {
                n.to_string()
            }
        };
        let dir = self.scripts();
        let cpu = match a.cpu_quota_percent {
            0 => "max 100000".to_string(),
            p => format!("{} 100000", u64::from(p) * 1000),
        };
        for (file, v) in [
            ("memory.max", or_max(a.memory_max_bytes)),
            ("pids.max", or_max(a.tasks_max)),
            ("cpu.max", cpu),
        ] {
            // The cpu controller may not be delegated: then no CPU bound,
            // which the read-back says.
            if file == "cpu.max" && !dir.join(file).exists() && a.cpu_quota_percent == 0 {
                continue;
            }
            write(&dir.join(file), &v).map_err(CgroupError::Bound)?;
        }
        Ok(())
    }

    /// A leaf for one script, with its limits written.
    pub fn leaf(&self, script_id: &str, l: &Limits, cpu_quota_percent: u32) -> io::Result<Leaf> {
        let dir = self.scripts().join(leaf_name(script_id));
        mkdir(&dir)?;
        let leaf = Leaf { dir };
        write(
            &leaf.dir.join("memory.max"),
            &l.memory_max_bytes.to_string(),
        )?;
        write(&leaf.dir.join("pids.max"), &l.tasks_max.to_string())?;
        let _ = write(&leaf.dir.join("memory.swap.max"), "0");
        if cpu_quota_percent > 0 {
            let _ = write(
                &leaf.dir.join("cpu.max"),
                &format!("{} 100000", u64::from(cpu_quota_percent) * 1000),
            );
        }
        Ok(leaf)
    }
}

/// The name of a script's leaf.
pub fn leaf_name(script_id: &str) -> String {
    format!("script-{script_id}")
}

/// One script's cgroup.
#[derive(Debug)]
pub struct Leaf {
    pub dir: PathBuf,
}

impl Leaf {
    pub fn add(&self, pid: u32) -> io::Result<()> {
        write(&self.dir.join("cgroup.procs"), &pid.to_string())
    }

    /// Kill every process in it at once (cgroup.kill, Linux 5.14+).
    pub fn kill(&self) -> io::Result<()> {
        write(&self.dir.join("cgroup.kill"), "1")
    }

    pub fn stats(&self) -> Stats {
        let mut s = Stats::default();
        if let Some(ev) = read(&self.dir.join("memory.events")) {
            s.oom_killed = key_value(&ev, "oom_kill").unwrap_or(0) > 0;
        }
        s.memory_peak_bytes =
            read(&self.dir.join("memory.peak")).and_then(|v| v.trim().parse().ok());
        s.cpu_usec = read(&self.dir.join("cpu.stat")).and_then(|v| key_value(&v, "usage_usec"));
        s
    }

    /// Remove the leaf once it is empty. After `kill` the processes take a
    /// moment to exit (more than half a second on a loaded or emulated host),
    /// and the leaf is busy until then: it is tried for up to 5 s, and one that
    /// is still busy is logged, as it stays until the service stops.
    pub async fn remove(self) {
        for _ in 0..200 {
            match std::fs::remove_dir(&self.dir) {
                Ok(()) => return,
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                    tokio::time::sleep(std::time::Duration::from_millis(25)).await
                }
                Err(e) => {
                    tracing::debug!("rmdir {}: {e}", self.dir.display());
                    return;
                }
            }
        }
        tracing::warn!(
            "the script's cgroup {} is still busy 5 s after its kill; it stays until scriptgated stops",
            self.dir.display()
        );
    }
}

fn mkdir(p: &Path) -> io::Result<()> {
    match std::fs::create_dir(p) {
        Err(e) if e.kind() != io::ErrorKind::AlreadyExists => Err(io::Error::new(
            e.kind(),
            format!("mkdir {}: {e}", p.display()),
        )),
        _ => Ok(()),
    }
}

fn write(p: &Path, v: &str) -> io::Result<()> {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(p)
        .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", p.display())))?;
    f.write_all(v.as_bytes())
        .map_err(|e| io::Error::new(e.kind(), format!("write {v:?} to {}: {e}", p.display())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Scripts;

    fn fake_tree() -> (tempfile::TempDir, PathBuf) {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("system.slice/scriptgate.service");
        std::fs::create_dir_all(&root).unwrap();
        std::fs::write(
            root.join("cgroup.controllers"),
            "cpuset cpu io memory pids\n",
        )
        .unwrap();
        std::fs::write(root.join("cgroup.subtree_control"), "").unwrap();
        std::fs::write(root.join("cgroup.procs"), "").unwrap();
        (d, root)
    }

    #[test]
    fn detects_the_delegated_subtree_from_proc_self_cgroup() {
        let (d, root) = fake_tree();
        let t = Tree::detect(d.path(), "0::/system.slice/scriptgate.service\n").unwrap();
        assert_eq!(t.root, root);
        let hybrid = "12:memory:/system.slice\n0::/system.slice/scriptgate.service\n";
        assert!(Tree::detect(d.path(), hybrid).is_ok());
    }

    /// Which of the subtree's failures, and its message.
    #[test]
    fn a_subtree_that_cannot_be_used_says_why() {
        let (d, root) = fake_tree();
        let own = "0::/system.slice/scriptgate.service";
        let e = Tree::detect(d.path(), "4:memory:/x\n").unwrap_err();
        assert!(matches!(e, CgroupError::NoV2Entry), "{e:?}");
        assert_eq!(e.to_string(), "no cgroup v2 entry in /proc/self/cgroup");

        let e = Tree::detect(d.path(), "0::/elsewhere").unwrap_err();
        let dir = d.path().join("elsewhere");
        assert!(
            matches!(&e, CgroupError::NotV2Dir { dir: x } if *x == dir),
            "{e:?}"
        );
        assert_eq!(
            e.to_string(),
            format!("{} is not a cgroup v2 directory", dir.display())
        );

        std::fs::write(root.join("cgroup.controllers"), "cpu io memory\n").unwrap();
        let e = Tree::detect(d.path(), own).unwrap_err();
        assert!(
            matches!(&e, CgroupError::NotDelegated { controller: "pids", controllers, .. } if controllers == "cpu io memory"),
            "{e:?}"
        );
        assert_eq!(
            e.to_string(),
            format!(
                "the pids controller is not delegated to {} (controllers: \"cpu io memory\")",
                root.display()
            )
        );

        std::fs::write(root.join("cgroup.controllers"), "memory pids\n").unwrap();
        std::fs::remove_file(root.join("cgroup.subtree_control")).unwrap();
        let e = Tree::detect(d.path(), own).unwrap_err();
        let probe = root.join("cgroup.subtree_control");
        assert!(
            matches!(&e, CgroupError::NotWritable { probe: p, source } if *p == probe && source.kind() == io::ErrorKind::NotFound),
            "{e:?}"
        );
        assert!(
            e.to_string().starts_with(&format!("{}: ", probe.display())),
            "{e}"
        );
        assert!(e.to_string().ends_with(" (not delegated to us)"), "{e}");
    }

    /// Which of a placed script's cgroup failures, and its message.
    #[test]
    fn a_controller_not_in_force_says_which_failure() {
        let d = tempfile::tempdir().unwrap();
        put(d.path(), &[("cgroup.controllers", "cpu memory pids\n")]);
        let leaf = d.path().join("svc/script-ab");
        put(&leaf, &[("cgroup.controllers", "cpu\n")]);

        let e =
            controller_dir(d.path(), "4:memory:/svc/script-ab\n", "pids", "script-ab").unwrap_err();
        assert!(
            matches!(&e, CgroupError::NoController { controller } if controller == "pids"),
            "{e:?}"
        );
        assert_eq!(e.to_string(), "the script is in no pids cgroup");

        let e =
            controller_dir(d.path(), "4:memory:/machine/c1\n", "memory", "script-ab").unwrap_err();
        assert!(
            matches!(&e, CgroupError::NotOwn { controller, path, own }
                if controller == "memory" && path == "/machine/c1" && own == "script-ab"),
            "{e:?}"
        );
        assert_eq!(e.to_string(), "the script is in memory cgroup /machine/c1, not in its own script-ab (the controller is not writable, or not delegated)");

        let e = controller_dir(d.path(), "0::/svc\n", "memory", "script-ab").unwrap_err();
        assert!(matches!(e, CgroupError::NotOwn { .. }), "{e:?}");

        let e = controller_dir(d.path(), "0::/svc/script-ab\n", "memory", "script-ab").unwrap_err();
        assert!(
            matches!(&e, CgroupError::NotEnabled { controller, dir } if controller == "memory" && *dir == leaf),
            "{e:?}"
        );
        assert_eq!(
            e.to_string(),
            format!(
                "the memory controller is not enabled for {} (its parent's cgroup.subtree_control lacks it)",
                leaf.display()
            )
        );
        assert_eq!(
            controller_dir(d.path(), "0::/svc/script-ab\n", "cpu", "script-ab").unwrap(),
            leaf
        );
    }

    #[test]
    fn init_moves_the_daemon_out_then_enables_controllers() {
        let (d, root) = fake_tree();
        let t = Tree::detect(d.path(), "0::/system.slice/scriptgate.service").unwrap();
        // An earlier daemon's: an empty leaf of a pre-made sandbox, and one
        // still busy (here: not empty).
        std::fs::create_dir_all(root.join("scripts/script-pool-00aa")).unwrap();
        std::fs::create_dir_all(root.join("scripts/script-bb")).unwrap();
        std::fs::write(root.join("scripts/script-bb/cgroup.procs"), "7\n").unwrap();
        t.init(4242).unwrap();
        assert!(!root.join("scripts/script-pool-00aa").exists());
        assert!(root.join("scripts/script-bb").exists());
        assert_eq!(
            std::fs::read_to_string(root.join("daemon/cgroup.procs")).unwrap(),
            "4242"
        );
        assert_eq!(
            std::fs::read_to_string(root.join("cgroup.subtree_control")).unwrap(),
            "+memory +pids +cpu"
        );
        // The scripts' leaves are one level down, in a node of their own that
        // the daemon is not in: it carries the bound on all of them. An empty
        // leaf an earlier daemon left there is removed.
        assert_eq!(t.scripts(), root.join("scripts"));
        assert_eq!(
            std::fs::read_to_string(root.join("scripts/cgroup.subtree_control")).unwrap(),
            "+memory +pids +cpu"
        );
    }

    #[test]
    fn the_bound_on_all_scripts_is_written_on_their_node() {
        let (d, root) = fake_tree();
        let t = Tree::detect(d.path(), "0::/system.slice/scriptgate.service").unwrap();
        t.init(4242).unwrap();
        let read = |f: &str| std::fs::read_to_string(root.join("scripts").join(f)).unwrap();
        let a = crate::protocol::AllScripts {
            memory_max_bytes: 512 << 20,
            tasks_max: 24,
            cpu_quota_percent: 150,
            ..Default::default()
        };
        t.bound_all(&a).unwrap();
        assert_eq!(
            (read("memory.max"), read("pids.max"), read("cpu.max")),
            ("536870912".into(), "24".into(), "150000 100000".into())
        );
        // 0: no bound ("max"), as a reload that lifts it writes.
        t.bound_all(&crate::protocol::AllScripts::default())
            .unwrap();
        assert_eq!(
            (read("memory.max"), read("pids.max"), read("cpu.max")),
            ("max".into(), "max".into(), "max 100000".into())
        );
        // The daemon's own leaf is not under it.
        assert!(!root.join("scripts/daemon").exists());
        // A node that cannot be written names the file and the value.
        std::fs::remove_dir_all(root.join("scripts")).unwrap();
        let e = t.bound_all(&a).unwrap_err();
        assert!(matches!(e, CgroupError::Bound(_)), "{e:?}");
        assert!(
            e.to_string()
                .contains(&format!("{}", root.join("scripts/memory.max").display())),
            "{e}"
        );
    }

    #[test]
    fn a_leaf_gets_limits_processes_kill_and_counters() {
        let (d, root) = fake_tree();
        let t = Tree::detect(d.path(), "0::/system.slice/scriptgate.service").unwrap();
        t.init(4242).unwrap();
        let l = Limits::effective(&Scripts::default(), &Default::default());
        let leaf = t
            .leaf(
                "abc",
                &Limits {
                    memory_max_bytes: 1 << 20,
                    tasks_max: 32,
                    ..l
                },
                50,
            )
            .unwrap();
        let dir = root.join("scripts/script-abc");
        assert_eq!(leaf.dir, dir);
        assert_eq!(
            std::fs::read_to_string(dir.join("memory.max")).unwrap(),
            "1048576"
        );
        assert_eq!(std::fs::read_to_string(dir.join("pids.max")).unwrap(), "32");
        assert_eq!(
            std::fs::read_to_string(dir.join("cpu.max")).unwrap(),
            "50000 100000"
        );
        leaf.add(77).unwrap();
        assert_eq!(
            std::fs::read_to_string(dir.join("cgroup.procs")).unwrap(),
            "77"
        );
        leaf.kill().unwrap();
        assert_eq!(
            std::fs::read_to_string(dir.join("cgroup.kill")).unwrap(),
            "1"
        );
        std::fs::write(
            dir.join("memory.events"),
            "low 0\nhigh 0\nmax 12\noom 1\noom_kill 1\noom_group_kill 0\n",
        )
        .unwrap();
        std::fs::write(dir.join("memory.peak"), "268435456\n").unwrap();
        std::fs::write(
            dir.join("cpu.stat"),
            "usage_usec 1500\nuser_usec 1000\nsystem_usec 500\n",
        )
        .unwrap();
        assert_eq!(
            leaf.stats(),
            Stats {
                oom_killed: true,
                memory_peak_bytes: Some(268435456),
                cpu_usec: Some(1500)
            }
        );
    }

    fn limits(mem: u64, tasks: u64) -> Limits {
        Limits {
            memory_max_bytes: mem,
            tasks_max: tasks,
            ..Limits::effective(&Scripts::default(), &Default::default())
        }
    }

    fn put(dir: &Path, files: &[(&str, &str)]) {
        std::fs::create_dir_all(dir).unwrap();
        for (f, v) in files {
            std::fs::write(dir.join(f), v).unwrap();
        }
    }

    #[test]
    fn read_back_of_a_v2_leaf() {
        let d = tempfile::tempdir().unwrap();
        put(d.path(), &[("cgroup.controllers", "cpu memory pids\n")]);
        let leaf = d.path().join("svc/script-ab");
        put(
            &leaf,
            &[
                ("cgroup.controllers", "cpu memory pids\n"),
                ("memory.max", "1048576\n"),
                ("pids.max", "32\n"),
                ("cpu.max", "50000 100000\n"),
            ],
        );
        let proc = "0::/svc/script-ab\n";
        let e = read_back(d.path(), proc, "script-ab", &limits(1 << 20, 32), 50, 0);
        assert_eq!(e, Enforcement::default());
        assert!(e.enforced());
        // Stricter than asked is in force; looser, or "max", is not.
        std::fs::write(leaf.join("pids.max"), "max\n").unwrap();
        std::fs::write(leaf.join("cpu.max"), "max 100000\n").unwrap();
        let e = read_back(d.path(), proc, "script-ab", &limits(2 << 20, 32), 50, 0);
        assert_eq!(e.problems.len(), 1, "{e:?}");
        assert!(
            e.problems[0].starts_with("tasks_max = 32 is not in force: "),
            "{e:?}"
        );
        assert!(e.problems[0].ends_with("pids.max says \"max\""), "{e:?}");
        // A scope's bound has room for its keeper, and says tasks_max all the same.
        std::fs::write(leaf.join("pids.max"), "33\n").unwrap();
        let scope = |keeper| {
            read_back(
                d.path(),
                proc,
                "script-ab",
                &limits(2 << 20, 32),
                50,
                keeper,
            )
        };
        assert!(scope(1).problems.is_empty(), "{:?}", scope(1));
        let e = scope(0);
        assert_eq!(
            e.problems,
            [format!(
                "tasks_max = 32 is not in force: {} says \"33\"",
                leaf.join("pids.max").display()
            )]
        );
        assert_eq!(
            e.notes.len(),
            1,
            "a CPU quota not in force is a note: {e:?}"
        );
        assert!(e.notes[0].starts_with("cpu_quota_percent = 50 is not in force"));
        assert_eq!(e.lines().len(), 2);
    }

    /// The parent did not enable memory and pids for its children: the leaf's
    /// cgroup.controllers lacks them, whatever files a write may have left.
    #[test]
    fn read_back_when_the_parent_has_not_enabled_a_controller() {
        let d = tempfile::tempdir().unwrap();
        put(d.path(), &[("cgroup.controllers", "cpu memory pids\n")]);
        let leaf = d.path().join("svc/script-ab");
        put(
            &leaf,
            &[
                ("cgroup.controllers", "cpu\n"),
                ("memory.max", "1048576"),
                ("pids.max", "32"),
            ],
        );
        let e = read_back(
            d.path(),
            "0::/svc/script-ab\n",
            "script-ab",
            &limits(1 << 20, 32),
            0,
            0,
        );
        assert_eq!(e.problems.len(), 2, "{e:?}");
        assert!(
            e.problems[0].contains("the memory controller is not enabled for"),
            "{e:?}"
        );
        assert!(
            e.problems[1].contains("the pids controller is not enabled for"),
            "{e:?}"
        );
    }

    /// The container: systemd started the scope, but the read-only v1
    /// memory controller left the script in the container's own memory cgroup.
    #[test]
    fn read_back_on_a_hybrid_host_with_a_controller_systemd_could_not_write() {
        let d = tempfile::tempdir().unwrap();
        put(
            &d.path().join("memory/machine/c1"),
            &[("memory.limit_in_bytes", "9223372036854771712\n")],
        );
        put(
            &d.path().join("pids/scriptgate.slice/scriptgate-ab.scope"),
            &[("pids.max", "64\n")],
        );
        let cpu = d
            .path()
            .join("cpu,cpuacct/scriptgate.slice/scriptgate-ab.scope");
        put(
            &cpu,
            &[
                ("cpu.cfs_quota_us", "100000\n"),
                ("cpu.cfs_period_us", "100000\n"),
            ],
        );
        let proc = "12:pids:/scriptgate.slice/scriptgate-ab.scope\n4:memory:/machine/c1\n3:cpu,cpuacct:/scriptgate.slice/scriptgate-ab.scope\n0::/scriptgate.slice/scriptgate-ab.scope\n";
        let e = read_back(
            d.path(),
            proc,
            "scriptgate-ab.scope",
            &limits(200 << 20, 64),
            100,
            1,
        );
        assert_eq!(e.problems, ["memory_max_bytes = 209715200 is not in force: the script is in memory cgroup /machine/c1, not in its own scriptgate-ab.scope (the controller is not writable, or not delegated)"]);
        assert!(e.notes.is_empty(), "{e:?}");
        // In its own scope, v1's "unlimited" is not in force either.
        let mem = d.path().join("memory/scriptgate.slice/scriptgate-ab.scope");
        put(&mem, &[("memory.limit_in_bytes", "9223372036854771712\n")]);
        let proc = proc.replace(
            "4:memory:/machine/c1",
            "4:memory:/scriptgate.slice/scriptgate-ab.scope",
        );
        let e = read_back(
            d.path(),
            &proc,
            "scriptgate-ab.scope",
            &limits(200 << 20, 64),
            100,
            1,
        );
        assert!(
            e.problems[0].contains("memory.limit_in_bytes says \"9223372036854771712\""),
            "{e:?}"
        );
        std::fs::write(mem.join("memory.limit_in_bytes"), "209715200\n").unwrap();
        assert!(read_back(
            d.path(),
            &proc,
            "scriptgate-ab.scope",
            &limits(200 << 20, 64),
            100,
            1
        )
        .enforced());
    }

    #[test]
    fn unit_counters_on_v2_and_on_a_hybrid_host() {
        let d = tempfile::tempdir().unwrap();
        let cg = "/scriptgate.slice/scriptgate-x.scope";
        let v2 = d.path().join("scriptgate.slice/scriptgate-x.scope");
        std::fs::create_dir_all(&v2).unwrap();
        std::fs::write(v2.join("memory.events"), "oom 0\noom_kill 0\n").unwrap();
        std::fs::write(v2.join("memory.peak"), "100\n").unwrap();
        assert_eq!(
            stats(d.path(), cg),
            Stats {
                oom_killed: false,
                memory_peak_bytes: Some(100),
                cpu_usec: None
            }
        );
        // Hybrid: memory in v1, cpuacct in v1.
        let h = tempfile::tempdir().unwrap();
        let mem = h.path().join("memory/scriptgate.slice/scriptgate-x.scope");
        std::fs::create_dir_all(&mem).unwrap();
        std::fs::write(
            mem.join("memory.oom_control"),
            "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n",
        )
        .unwrap();
        std::fs::write(mem.join("memory.max_usage_in_bytes"), "4096\n").unwrap();
        let acct = h
            .path()
            .join("cpu,cpuacct/scriptgate.slice/scriptgate-x.scope");
        std::fs::create_dir_all(&acct).unwrap();
        std::fs::write(acct.join("cpuacct.usage"), "7000000\n").unwrap();
        assert_eq!(
            stats(h.path(), cg),
            Stats {
                oom_killed: true,
                memory_peak_bytes: Some(4096),
                cpu_usec: Some(7000)
            }
        );
    }
}
