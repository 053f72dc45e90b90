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

pub mod aggregate;
pub mod cgroup;
pub mod member;
pub mod systemd;
pub mod usage;

use crate::config::BackendChoice;
use crate::policy::Limits;
use std::path::PathBuf;

/// What the rlimit backend cannot do, said wherever the backend is shown.
pub const RLIMIT_SHARED: &str = "rlimit: limits are per process and per uid, not per script: \
memory_max_bytes caps each process's address space, and tasks_max is shared by every \
script of one uid, so one script can take another's processes";

/// The tasks of a scope that are not the sandbox's: the keeper that holds it
/// until its counters are read (`Backend::needs_keeper`). The scope's
/// `TasksMax=` is `tasks_max` plus these, so that `tasks_max` counts the same
/// tasks on the systemd and cgroup backends: bwrap's process outside the sandbox,
/// the sandbox's init, and every process and thread of the script
/// (scriptgate.toml(5)).
pub const SCOPE_KEEPER_TASKS: u64 = 1;

/// The limits a backend's unit is given for `l`: the systemd scope also holds
/// its keeper, which `tasks_max` does not count.
fn unit_limits(backend: &Backend, l: &Limits) -> Limits {
    let mut l = l.clone();
    if backend.needs_keeper() {
        l.tasks_max = l.tasks_max.saturating_add(SCOPE_KEEPER_TASKS);
    }
    l
}

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
pub struct CgroupView {
    pub cgroupfs: PathBuf,
    pub proc_self_cgroup: String,
    /// Where `PID/cgroup` is read to see which cgroups a placed script is in.
    pub proc: PathBuf,
}

impl CgroupView {
    pub fn real() -> CgroupView {
        CgroupView {
            cgroupfs: "/sys/fs/cgroup".into(),
            proc_self_cgroup: std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default(),
            proc: "/proc".into(),
        }
    }
}

pub use cgroup::Enforcement;

/// A limit backend: where a script's processes go and what bounds them. One
/// variant per backend, each with what only it needs (youki's `AnyCgroupManager`
/// is the model); `rlimit` needs nothing but the limits themselves.
#[derive(Clone)]
pub enum Backend {
    /// Transient scopes `scriptgate-<id>.scope`, created over D-Bus.
    Systemd(SystemdBackend),
    /// Leaves of the daemon's delegated cgroup v2 subtree.
    Cgroup(CgroupBackend),
    /// rlimits on the sandbox, plus its PID namespace.
    Rlimit,
}

#[derive(Clone)]
pub struct SystemdBackend {
    manager: systemd::Manager,
    /// Where a scope's counters are read (`memory.peak`, `memory.events`, …).
    cgroupfs: PathBuf,
    cpu_quota_percent: u32,
    proc: PathBuf,
}

#[derive(Clone)]
pub struct CgroupBackend {
    tree: cgroup::Tree,
    cpu_quota_percent: u32,
    cgroupfs: PathBuf,
    proc: PathBuf,
}

/// The backend picked at start-up, and why the others were not.
#[derive(Clone)]
pub struct Picked {
    /// `backend.kind()`, kept as a field for those who read it so.
    pub kind: Kind,
    pub notes: Vec<String>,
    pub backend: Backend,
}

impl Picked {
    fn new(backend: Backend, notes: Vec<String>) -> Picked {
        Picked {
            kind: backend.kind(),
            notes,
            backend,
        }
    }

    /// Are memory and tasks bounded for each script as a whole?
    pub fn limits_per_script(&self) -> bool {
        self.backend.limits_per_script()
    }
}

#[derive(Debug, thiserror::Error)]
#[error("sandbox.backend = {choice:?}: {why}")]
pub struct BackendError {
    pub choice: BackendChoice,
    pub why: LimitsError,
}

/// What failed in one backend: when it was picked ([`BackendError`]) or when a
/// script was placed in its unit ([`Backend::place`]).
#[derive(Debug, thiserror::Error)]
pub enum LimitsError {
    /// The system manager, or a scope of it.
    #[error(transparent)]
    Systemd(#[from] systemd::SystemdError),
    /// The daemon's delegated subtree, or a script's leaf in it.
    #[error(transparent)]
    Cgroup(#[from] cgroup::CgroupError),
}

impl Backend {
    /// `choice`, or with `auto` the first backend that works (systemd, cgroup,
    /// rlimit), with a note for each one passed over and for rlimit's limits.
    pub async fn pick(
        choice: BackendChoice,
        host: &CgroupView,
        cpu_quota_percent: u32,
    ) -> Result<Picked, BackendError> {
        let mut notes = vec![];
        let fail = |why: LimitsError| BackendError { choice, why };
        if matches!(choice, BackendChoice::Auto | BackendChoice::Systemd) {
            match systemd::Manager::connect().await {
                Ok(manager) => {
                    let b = Backend::Systemd(SystemdBackend {
                        manager,
                        cgroupfs: host.cgroupfs.clone(),
                        cpu_quota_percent,
                        proc: host.proc.clone(),
                    });
                    return Ok(Picked::new(b, notes));
                }
                Err(why) if choice == BackendChoice::Systemd => return Err(fail(why.into())),
                Err(why) => notes.push(format!("systemd: {why}")),
            }
        }
        if matches!(choice, BackendChoice::Auto | BackendChoice::Cgroup) {
            let tree = cgroup::Tree::detect(&host.cgroupfs, &host.proc_self_cgroup).and_then(|t| {
                t.init(std::process::id())
                    .map(|()| t)
                    .map_err(cgroup::CgroupError::Init)
            });
            match tree {
                Ok(tree) => {
                    let b = Backend::Cgroup(CgroupBackend {
                        tree,
                        cpu_quota_percent,
                        cgroupfs: host.cgroupfs.clone(),
                        proc: host.proc.clone(),
                    });
                    return Ok(Picked::new(b, notes));
                }
                Err(why) if choice == BackendChoice::Cgroup => return Err(fail(why.into())),
                Err(why) => notes.push(format!("cgroup: {why}")),
            }
        }
        notes.push(RLIMIT_SHARED.into());
        Ok(Picked::new(Backend::Rlimit, notes))
    }

    pub fn kind(&self) -> Kind {
        match self {
            Backend::Systemd(_) => Kind::Systemd,
            Backend::Cgroup(_) => Kind::Cgroup,
            Backend::Rlimit => Kind::Rlimit,
        }
    }

    /// rlimits for the sandbox. Under a unit, the unit bounds memory and tasks.
    /// Every backend bounds descriptors per process (`scripts.nofile_max`): no
    /// cgroup controller counts them, and the daemon's own bound (the unit's
    /// LimitNOFILE=65536) is no script's business (40 processes of one script
    /// held 800,000 eventfds, +1.1 GB of kernel slab).
    pub fn rlimits(&self, l: &Limits, nofile_max: u64) -> Vec<(libc::__rlimit_resource_t, u64)> {
        let mut v = match self {
            Backend::Rlimit => vec![
                (libc::RLIMIT_AS, l.memory_max_bytes),
                (libc::RLIMIT_NPROC, l.tasks_max),
            ],
            Backend::Systemd(_) | Backend::Cgroup(_) => vec![],
        };
        v.extend([(libc::RLIMIT_CORE, 0), (libc::RLIMIT_NOFILE, nofile_max)]);
        v
    }

    /// Are memory and tasks bounded for each script as a whole?
    pub fn limits_per_script(&self) -> bool {
        !matches!(self, Backend::Rlimit)
    }

    /// The sandbox waits at a gate until it is placed in its unit.
    pub fn needs_gate(&self) -> bool {
        !matches!(self, Backend::Rlimit)
    }

    /// A scope is collected by systemd when its last process exits, counters and
    /// all; a keeper process holds it until they are read.
    pub fn needs_keeper(&self) -> bool {
        matches!(self, Backend::Systemd(_))
    }

    /// The unit a script will run in, known before it starts.
    pub fn unit_for(&self, script_id: &str) -> Option<String> {
        matches!(self, Backend::Systemd(_)).then(|| systemd::unit_name(script_id))
    }

    /// Put the (gated) processes of a script in their unit.
    pub async fn place(
        &self,
        script_id: &str,
        l: &Limits,
        pids: &[u32],
    ) -> Result<Placement, LimitsError> {
        match self {
            Backend::Systemd(s) => {
                let l = unit_limits(self, l);
                let unit = s
                    .manager
                    .start_scope(script_id, pids, &l, s.cpu_quota_percent)
                    .await?;
                Ok(Placement::Scope {
                    unit,
                    manager: s.manager.clone(),
                    cgroupfs: s.cgroupfs.clone(),
                })
            }
            Backend::Cgroup(c) => {
                let leaf = c
                    .tree
                    .leaf(script_id, l, c.cpu_quota_percent)
                    .map_err(cgroup::CgroupError::Leaf)?;
                for p in pids {
                    leaf.add(*p).map_err(cgroup::CgroupError::Add)?;
                }
                Ok(Placement::Leaf(leaf))
            }
            Backend::Rlimit => Ok(Placement::None),
        }
    }
}

impl Backend {
    /// Are the limits of a placed script in force? Read back from the cgroups its
    /// process `pid` is actually in (`place` succeeding is not enough: systemd
    /// starts a scope even where it cannot write a controller, e.g. read-only
    /// cgroup v1 controllers in a container). rlimit: the rlimits are set before
    /// the exec, or the spawn fails; what they bound is in `RLIMIT_SHARED`.
    pub fn verify(&self, script_id: &str, pid: u32, l: &Limits) -> Enforcement {
        let (fs, proc, own, cpu) = match self {
            Backend::Rlimit => return Enforcement::default(),
            Backend::Systemd(s) => (
                &s.cgroupfs,
                &s.proc,
                systemd::unit_name(script_id),
                s.cpu_quota_percent,
            ),
            Backend::Cgroup(c) => (
                &c.cgroupfs,
                &c.proc,
                cgroup::leaf_name(script_id),
                c.cpu_quota_percent,
            ),
        };
        let file = proc.join(pid.to_string()).join("cgroup");
        match std::fs::read_to_string(&file) {
            Ok(text) => {
                let keeper = if self.needs_keeper() {
                    SCOPE_KEEPER_TASKS
                } else {
                    0
                };
                cgroup::read_back(fs, &text, &own, l, cpu, keeper)
            }
            Err(e) => Enforcement {
                problems: vec![format!("limits cannot be checked: {}: {e}", file.display())],
                notes: vec![],
            },
        }
    }
}

impl Backend {
    /// Bound all scripts together (`aggregate::decide`): `scriptgate.slice`'s
    /// `MemoryMax=`, `TasksMax=` and `CPUQuotaPerSecUSec=` (runtime properties,
    /// over D-Bus; the slice started so that its cgroup exists), or the cgroup
    /// backend's `scripts` node. The rlimit backend has nothing to write.
    pub async fn bound_all(&self, a: &crate::protocol::AllScripts) -> Result<(), LimitsError> {
        match self {
            Backend::Systemd(s) => Ok(s.manager.bound_slice(a).await?),
            Backend::Cgroup(c) => Ok(c.tree.bound_all(a)?),
            Backend::Rlimit => Ok(()),
        }
    }

    /// At a daemon's start: what the scopes of the scripts an earlier daemon
    /// left running (`script_ids`) still hold is killed
    /// (`Manager::kill_scopes_of`). The cgroup backend removes such a leaf once
    /// it is empty, without a kill (`cgroup::Tree::init`); the rlimit backend
    /// has no unit.
    pub async fn end_units_of(&self, script_ids: &[String]) {
        if let (Backend::Systemd(s), false) = (self, script_ids.is_empty()) {
            let killed = s.manager.kill_scopes_of(script_ids).await;
            if !killed.is_empty() {
                tracing::info!(
                    "killed what {} unit(s) of an earlier daemon's scripts still held: {}",
                    killed.len(),
                    killed.join(" ")
                );
            }
        }
    }

    /// The cgroup that holds every script, where the bound on all of them is
    /// read back (None: rlimit).
    pub fn all_scripts_place(&self) -> Option<aggregate::Place> {
        match self {
            Backend::Systemd(s) => Some(aggregate::Place {
                fs: s.cgroupfs.clone(),
                rel: systemd::SLICE.into(),
            }),
            Backend::Cgroup(c) => {
                let dir = c.tree.scripts();
                Some(match dir.strip_prefix(&c.cgroupfs) {
                    Ok(rel) => aggregate::Place {
                        fs: c.cgroupfs.clone(),
                        rel: rel.display().to_string(),
                    },
                    Err(_) => aggregate::Place {
                        fs: dir,
                        rel: String::new(),
                    },
                })
            }
            Backend::Rlimit => None,
        }
    }
}

impl Backend {
    /// What the script whose sandbox is `pid` holds now (`admin.list`): its
    /// cgroup's counters under a unit, its process tree's sums on rlimit.
    pub fn usage(&self, pid: u32) -> crate::protocol::Resources {
        match self {
            Backend::Systemd(SystemdBackend { cgroupfs, proc, .. })
            | Backend::Cgroup(CgroupBackend { cgroupfs, proc, .. }) => {
                usage::from_cgroup(cgroupfs, proc, pid)
            }
            Backend::Rlimit => {
                usage::from_proc(std::path::Path::new("/proc"), pid, usage::ticks_per_s())
            }
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
pub struct UnitEnd {
    pub stats: cgroup::Stats,
    /// The unit was stopped by someone else (`systemctl stop`).
    pub stopped_externally: bool,
    /// systemd ended the scope at its `RuntimeMaxSec=` (the backstop behind the
    /// daemon's own timeout).
    pub unit_timeout: bool,
}

impl Placement {
    /// End every process of the script (after the PID-namespace kill, for stragglers).
    pub fn kill(&self) {
        if let Placement::Leaf(l) = self {
            let _ = l.kill();
        }
    }

    /// Read the counters and let the unit go (`read_end`, then `release`).
    pub async fn finish(self) -> UnitEnd {
        let end = self.read_end().await;
        self.release().await;
        end
    }

    /// The unit's counters and how it ended. Call once every process of the
    /// script is reaped (the init's report, or the sandbox's exit) and before
    /// the keeper is killed: with the keeper alive, a scope that is no longer
    /// active was stopped from outside.
    pub async fn read_end(&self) -> UnitEnd {
        match self {
            Placement::None => UnitEnd::default(),
            Placement::Scope {
                unit,
                manager,
                cgroupfs,
            } => {
                let mut stats = match manager.control_group(unit).await {
                    Some(cg) => cgroup::stats(cgroupfs, &cg),
                    None => cgroup::Stats::default(),
                };
                let end = manager.ended(unit).await;
                stats.oom_killed |= end == systemd::ScopeEnd::OomKill;
                UnitEnd {
                    stats,
                    stopped_externally: end == systemd::ScopeEnd::Stopped,
                    unit_timeout: end == systemd::ScopeEnd::Timeout,
                }
            }
            Placement::Leaf(leaf) => UnitEnd {
                stats: leaf.stats(),
                ..UnitEnd::default()
            },
        }
    }

    /// Let the unit go: what is left in it is killed (the script's processes
    /// are all reaped by now) and a cgroup leaf removed; a scope then goes by
    /// itself. A scope's keeper is killed with the rest, and so is what no
    /// kill of the sandbox reaches: a child bwrap cloned and never released
    /// (its bwrap killed first, as a stop before the sandbox's init was known
    /// does) waits forever, and would hold the scope until its
    /// `RuntimeMaxSec=`.
    pub async fn release(self) {
        match self {
            Placement::None => {}
            Placement::Scope { unit, manager, .. } => {
                manager.kill_all(&unit).await;
            }
            Placement::Leaf(leaf) => {
                let _ = leaf.kill();
                leaf.remove().await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Scripts;

    fn limits() -> Limits {
        Limits::effective(&Scripts::default(), &Default::default())
    }

    #[tokio::test]
    async fn rlimit_bounds_each_process_and_needs_no_unit() {
        let host = CgroupView {
            cgroupfs: "/nonexistent".into(),
            proc_self_cgroup: String::new(),
            proc: "/nonexistent".into(),
        };
        let p = Backend::pick(BackendChoice::Rlimit, &host, 100)
            .await
            .unwrap();
        assert_eq!((p.kind, p.kind.as_str()), (Kind::Rlimit, "rlimit"));
        assert_eq!(p.notes, [RLIMIT_SHARED]);
        let b = &p.backend;
        assert!(!p.limits_per_script() && !b.needs_gate() && !b.needs_keeper());
        assert_eq!(b.unit_for("ab"), None);
        let l = limits();
        assert_eq!(
            b.rlimits(&l, 1024),
            [
                (libc::RLIMIT_AS, l.memory_max_bytes),
                (libc::RLIMIT_NPROC, l.tasks_max),
                (libc::RLIMIT_CORE, 0),
                (libc::RLIMIT_NOFILE, 1024)
            ]
        );
        assert!(matches!(
            b.place("ab", &l, &[1]).await.unwrap(),
            Placement::None
        ));
    }

    #[tokio::test]
    async fn cgroup_places_in_a_leaf_behind_the_gate() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("system.slice/scriptgate.service");
        std::fs::create_dir_all(&root).unwrap();
        std::fs::write(root.join("cgroup.controllers"), "cpu memory pids\n").unwrap();
        std::fs::write(root.join("cgroup.subtree_control"), "").unwrap();
        std::fs::write(root.join("cgroup.procs"), "").unwrap();
        let host = CgroupView {
            cgroupfs: d.path().to_path_buf(),
            proc_self_cgroup: "0::/system.slice/scriptgate.service\n".into(),
            proc: d.path().join("proc"),
        };
        let p = Backend::pick(BackendChoice::Cgroup, &host, 100)
            .await
            .unwrap();
        assert_eq!(p.kind, Kind::Cgroup);
        assert!(p.notes.is_empty());
        let b = &p.backend;
        assert!(p.limits_per_script() && b.needs_gate() && !b.needs_keeper());
        assert_eq!(b.unit_for("ab"), None);
        assert_eq!(
            b.rlimits(&limits(), 300),
            [(libc::RLIMIT_CORE, 0), (libc::RLIMIT_NOFILE, 300)]
        );
        let placed = b.place("ab", &limits(), &[4242]).await.unwrap();
        assert!(matches!(placed, Placement::Leaf(_)));
        // The read-back: 4242 is in the leaf, whose parent (on this fake tree) did
        // not enable memory for it; `place` succeeded all the same.
        std::fs::create_dir_all(d.path().join("proc/4242")).unwrap();
        std::fs::write(
            d.path().join("proc/4242/cgroup"),
            "0::/system.slice/scriptgate.service/scripts/script-ab\n",
        )
        .unwrap();
        std::fs::write(d.path().join("cgroup.controllers"), "cpu memory pids\n").unwrap();
        std::fs::write(
            root.join("scripts/script-ab/cgroup.controllers"),
            "cpu pids\n",
        )
        .unwrap();
        let e = b.verify("ab", 4242, &limits());
        assert!(!e.enforced());
        assert_eq!(e.problems.len(), 1, "{e:?}");
        assert!(
            e.problems[0].contains("the memory controller is not enabled for"),
            "{e:?}"
        );
        std::fs::write(
            root.join("scripts/script-ab/cgroup.controllers"),
            "cpu memory pids\n",
        )
        .unwrap();
        assert!(b.verify("ab", 4242, &limits()).enforced());
        let gone = b.verify("ab", 4343, &limits());
        assert!(
            gone.problems[0].starts_with("limits cannot be checked: "),
            "{gone:?}"
        );
        // rlimit has nothing to read back: its limits are set before the exec.
        assert!(Backend::Rlimit.verify("ab", 4242, &limits()).enforced());
        // A host without the subtree: `cgroup` asked for fails, `auto` notes why.
        let bare = CgroupView {
            cgroupfs: d.path().join("nothing"),
            proc_self_cgroup: "0::/x\n".into(),
            proc: d.path().join("proc"),
        };
        let e = Backend::pick(BackendChoice::Cgroup, &bare, 100)
            .await
            .err()
            .unwrap();
        assert_eq!(e.choice, BackendChoice::Cgroup);
        let dir = d.path().join("nothing/x");
        assert!(
            matches!(&e.why, LimitsError::Cgroup(cgroup::CgroupError::NotV2Dir { dir: x }) if *x == dir),
            "{e:?}"
        );
        assert_eq!(
            e.to_string(),
            format!(
                "sandbox.backend = Cgroup: {} is not a cgroup v2 directory",
                dir.display()
            )
        );
    }
}
