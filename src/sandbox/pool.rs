//! The pool of pre-made sandboxes: members (`member`) made ahead of their runs,
//! one shelf per script identity, kept full by a keeper thread, each member
//! handed to one run and never reused.
//!
//! - **What a member is made with** is one `Profile`: everything of the cold
//!   path's sandbox but the workspace and the script, and the resource limits
//!   every process gets at its spawn. A run whose own would differ (a snapshot
//!   that tightened them) starts cold. A reload makes a new pool with the new
//!   profile; the old one ends with the last run that holds it (`Drop`).
//! - **Which shelves exist**: the identity of root peers' scripts
//!   (`sandbox.run_as`) has one from the start; any other identity's is made
//!   by its first run (which starts cold). A shelf no run took from for `idle`
//!   is emptied and goes.
//! - **Bounds**: `size` members per shelf, `max_members` in all (the memory
//!   bound divided by what a member costs, `MEMBER_BYTES`); a member that could
//!   not be made backs the keeper off (1 s, doubling to 60 s).
//! - **Upgrades**: a member never outlives its interpreter: `take` compares
//!   `scripts.python`'s file with the one the members were made with (`Stamp`),
//!   and a replaced one sends the run cold and every waiting member away. A
//!   replaced daemon binary stops the pool (the daemon restarts).
//! - **Ending**: a member whose daemon is gone ends by itself (its init's
//!   lifeline, `sandbox::init`); one the pool lets go is killed and reaped.
//!
//! The decision of what to do next (`plan`) is pure; the keeper thread carries
//! it out, making members outside the lock.

use crate::sandbox::member::Member;
use crate::sandbox::SandboxSpec;
use crate::sys::{Identity, Spawner};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// What one waiting member is counted as against `pool_memory_max_bytes`: a
/// waiting Python with `agent_tools` imported, its init, bwrap and the mount
/// helper, resident (measured: about 9 MiB RSS, 4.5 MiB PSS), with room.
pub const MEMBER_BYTES: u64 = 12 << 20;

/// Everything a member is made with.
#[derive(Debug, Clone)]
pub struct Profile {
    /// The cold path's sandbox for this daemon, its workspace and script unset.
    pub spec: SandboxSpec,
    pub bwrap: PathBuf,
    /// How each member's mount helper is started.
    pub mounter: crate::sandbox::mounter::Via,
    /// The resource limits of the member's processes, set at its spawn.
    pub rlimits: Vec<(libc::__rlimit_resource_t, u64)>,
    /// Where members wait, on a backend that places sandboxes in units.
    pub units: Option<Units>,
}

/// A unit per member from its birth (`limits::member`), for the systemd and
/// cgroup backends.
#[derive(Clone)]
pub struct Units {
    pub backend: crate::limits::Backend,
    /// The daemon's runtime: the keeper thread places members through it
    /// (systemd is asked over D-Bus).
    pub runtime: tokio::runtime::Handle,
    /// What a member may use while it waits (`limits::member::idle_limits`).
    pub idle: crate::policy::Limits,
}

impl std::fmt::Debug for Units {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Units")
            .field("backend", &self.backend.kind())
            .field("idle", &self.idle)
            .finish()
    }
}

/// Set once the daemon stops, before its runtime shuts down: a keeper then
/// asks the runtime nothing more (a call on a runtime being shut down panics
/// in its timers: seen as a keeper's panic at SIGTERM).
static STOPPING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The daemon is stopping: no pool places another member (`STOPPING`).
pub fn stopping() {
    STOPPING.store(true, std::sync::atomic::Ordering::SeqCst);
}

impl Units {
    /// Put a new member's gated process in a unit of its own.
    fn place(&self, pid: u32) -> std::io::Result<crate::limits::member::Waiting> {
        if STOPPING.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(std::io::Error::other("scriptgated is stopping"));
        }
        let id = crate::limits::member::new_id();
        self.runtime
            .block_on(self.backend.place_waiting(&id, &self.idle, pid))
            .map_err(std::io::Error::other)
    }
}

/// The pool's bounds (`[sandbox] pool_size`, `pool_memory_max_bytes`,
/// `pool_idle_s`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    pub size: usize,
    pub max_members: usize,
    pub idle: Duration,
}

impl Bounds {
    pub fn new(size: usize, memory_max_bytes: u64, idle_s: u64) -> Bounds {
        Bounds {
            size,
            max_members: (memory_max_bytes / MEMBER_BYTES) as usize,
            idle: Duration::from_secs(idle_s),
        }
    }
}

/// Why a run starts cold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cold {
    /// No member was waiting for this identity (its first run, or a burst
    /// larger than the shelf).
    Empty,
    /// The run's limits differ from the pool's profile.
    Limits,
    /// The workspace's path is not UTF-8 (a member reads it as JSON).
    Path,
    /// The member could not take the run's workspace (said in the log).
    Mount,
    /// The interpreter (`scripts.python`) was replaced since the waiting
    /// members were made (a package upgrade): they go, and new ones are made
    /// with the new one.
    Python,
}

impl Cold {
    pub fn as_str(&self) -> &'static str {
        match self {
            Cold::Empty => "no member waiting",
            Cold::Limits => "limits differ from the pool's",
            Cold::Path => "workspace path not UTF-8",
            Cold::Mount => "mount failed",
            Cold::Python => "the interpreter was replaced",
        }
    }
}

/// One identity's waiting members.
struct Shelf {
    waiting: Vec<Member>,
    last_take: Instant,
}

struct State {
    shelves: HashMap<Option<Identity>, Shelf>,
    /// Members being made now (not on a shelf yet), counted against the bound.
    making: usize,
    /// The keeper does nothing before this (after a failure).
    backoff_until: Option<Instant>,
    backoff: Duration,
    stopped: bool,
    /// The interpreter the waiting members were made with.
    python: Option<Stamp>,
    /// A run found the interpreter replaced: the keeper lets every waiting
    /// member go before it makes another.
    python_replaced: bool,
}

/// What tells one interpreter file from another (`scripts.python`, its links
/// followed): an upgrade puts a new file in place (a new inode), an edit in
/// place changes its size or time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    dev: u64,
    ino: u64,
    size: u64,
    mtime: (i64, i64),
}

fn stamp(path: &std::path::Path) -> Option<Stamp> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).ok()?;
    Some(Stamp {
        dev: m.dev(),
        ino: m.ino(),
        size: m.size(),
        mtime: (m.mtime(), m.mtime_nsec()),
    })
}

struct Inner {
    state: Mutex<State>,
    wake: Condvar,
    profile: Profile,
    bounds: Bounds,
}

/// The pool: `take` a member for a run. Dropping the last handle stops the
/// keeper and lets every waiting member go.
pub struct Pool {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("bounds", &self.inner.bounds)
            .finish()
    }
}

/// What the keeper does next (`plan`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    /// Make one member for this identity.
    Make(Option<Identity>),
    /// Let these idle shelves go.
    Retire(Vec<Option<Identity>>),
    /// Nothing until woken or this long has passed.
    Wait(Duration),
}

/// The keeper's next step, from the shelves' fill (`(identity, waiting, last
/// take)`), the members being made, and the bounds. Pure.
pub fn plan(
    shelves: &[(Option<Identity>, usize, Instant)],
    making: usize,
    bounds: Bounds,
    backoff_until: Option<Instant>,
    now: Instant,
) -> Next {
    let idle: Vec<_> = shelves
        .iter()
        .filter(|(_, _, last)| now.saturating_duration_since(*last) >= bounds.idle)
        .map(|(id, _, _)| *id)
        .collect();
    if !idle.is_empty() {
        return Next::Retire(idle);
    }
    let oldest = shelves
        .iter()
        .map(|(_, _, last)| {
            bounds
                .idle
                .saturating_sub(now.saturating_duration_since(*last))
        })
        .min()
        .unwrap_or(bounds.idle);
    if let Some(until) = backoff_until {
        if until > now {
            return Next::Wait(until - now);
        }
    }
    let total: usize = shelves.iter().map(|(_, n, _)| n).sum::<usize>() + making;
    if total >= bounds.max_members || making > 0 {
        return Next::Wait(oldest);
    }
    // The emptiest shelf first, so that every identity gets one before any
    // gets its second.
    match shelves
        .iter()
        .filter(|(_, n, _)| *n < bounds.size)
        .min_by_key(|(_, n, _)| *n)
    {
        Some((id, _, _)) => Next::Make(*id),
        None => Next::Wait(oldest),
    }
}

impl Pool {
    /// A pool with its keeper thread, which makes members with `spawner`,
    /// first for the identities of `warm` (the scripts of root peers run as
    /// `sandbox.run_as`: known before any script).
    pub fn start(
        profile: Profile,
        bounds: Bounds,
        spawner: Spawner,
        warm: &[Option<Identity>],
    ) -> Pool {
        let now = Instant::now();
        let shelves = warm
            .iter()
            .map(|id| {
                let shelf = Shelf {
                    waiting: Vec::new(),
                    last_take: now,
                };
                (*id, shelf)
            })
            .collect();
        let inner = Arc::new(Inner {
            state: Mutex::new(State {
                shelves,
                making: 0,
                backoff_until: None,
                backoff: Duration::from_secs(1),
                stopped: false,
                python: stamp(profile.spec.python()),
                python_replaced: false,
            }),
            wake: Condvar::new(),
            profile,
            bounds,
        });
        let keeper = inner.clone();
        std::thread::Builder::new()
            .name("scriptgate-pool".into())
            .spawn(move || keep(&keeper, &spawner))
            .expect("spawn the pool's keeper thread");
        Pool { inner }
    }

    pub fn profile(&self) -> &Profile {
        &self.inner.profile
    }

    pub fn bounds(&self) -> Bounds {
        self.inner.bounds
    }

    /// A waiting member for `identity`, or why there is none. Either way the
    /// identity's shelf is (re)filled in the background. No member made with
    /// an interpreter that has since been replaced is handed out (one `stat`).
    pub fn take(&self, identity: Option<Identity>) -> Result<Member, Cold> {
        let python = stamp(self.inner.profile.spec.python());
        let mut st = self.inner.state.lock().unwrap();
        if python != st.python {
            st.python_replaced = true;
            drop(st);
            self.inner.wake.notify_all();
            return Err(Cold::Python);
        }
        let shelf = st.shelves.entry(identity).or_insert_with(|| Shelf {
            waiting: Vec::new(),
            last_take: Instant::now(),
        });
        shelf.last_take = Instant::now();
        let member = shelf.waiting.pop();
        drop(st);
        self.inner.wake.notify_all();
        member.ok_or(Cold::Empty)
    }

    /// Members waiting now, in all.
    pub fn waiting(&self) -> usize {
        let st = self.inner.state.lock().unwrap();
        st.shelves.values().map(|s| s.waiting.len()).sum()
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.inner.state.lock().unwrap().stopped = true;
        self.inner.wake.notify_all();
    }
}

/// The keeper thread: carry out `plan` until the pool is dropped, then let
/// every member go.
fn keep(inner: &Inner, spawner: &Spawner) {
    let spawn = |cmd: std::process::Command| spawner.spawn_blocking(cmd);
    let mut exec_only = ExecOnlyFor::new(&inner.profile.spec);
    let mut st = inner.state.lock().unwrap();
    loop {
        if st.python_replaced {
            // Every waiting member goes; the next are made with the interpreter
            // now in place, from fresh execute-only copies of it.
            st.python_replaced = false;
            st.python = stamp(inner.profile.spec.python());
            let gone: Vec<Member> = st
                .shelves
                .values_mut()
                .flat_map(|s| std::mem::take(&mut s.waiting))
                .collect();
            drop(st);
            tracing::info!(
                "{} was replaced: {} waiting pre-made sandbox(es) made with the old one go",
                inner.profile.spec.python().display(),
                gone.len()
            );
            gone.into_iter().for_each(Member::discard);
            exec_only = ExecOnlyFor::new(&inner.profile.spec);
            st = inner.state.lock().unwrap();
            continue;
        }
        if st.stopped || STOPPING.load(std::sync::atomic::Ordering::SeqCst) {
            let shelves = std::mem::take(&mut st.shelves);
            drop(st);
            for (_, shelf) in shelves {
                shelf.waiting.into_iter().for_each(Member::discard);
            }
            return;
        }
        let fill: Vec<_> = st
            .shelves
            .iter()
            .map(|(id, s)| (*id, s.waiting.len(), s.last_take))
            .collect();
        match plan(
            &fill,
            st.making,
            inner.bounds,
            st.backoff_until,
            Instant::now(),
        ) {
            Next::Retire(ids) => {
                let gone: Vec<Shelf> = ids.iter().filter_map(|id| st.shelves.remove(id)).collect();
                drop(st);
                for shelf in gone {
                    shelf.waiting.into_iter().for_each(Member::discard);
                }
                st = inner.state.lock().unwrap();
            }
            Next::Wait(d) => {
                st = inner.wake.wait_timeout(st, d).unwrap().0;
            }
            Next::Make(_) if binary_replaced() => {
                // An upgrade replaced the binary the mount helper is: no member
                // outlives the binary it was made with (the daemon restarts).
                tracing::warn!("scriptgated's binary was replaced: no more pre-made sandboxes until it restarts");
                st.stopped = true;
            }
            Next::Make(id) => {
                st.making += 1;
                drop(st);
                let p = &inner.profile;
                let spec = exec_only.spec(&p.spec, id);
                let place = p.units.as_ref().map(|u| move |pid| u.place(pid));
                let made = Member::make(
                    &spec,
                    &p.bwrap,
                    &p.mounter,
                    id,
                    p.rlimits.clone(),
                    &spawn,
                    place
                        .as_ref()
                        .map(|f| f as &dyn Fn(u32) -> std::io::Result<_>),
                );
                st = inner.state.lock().unwrap();
                st.making -= 1;
                match made {
                    Ok(m) => {
                        st.backoff = Duration::from_secs(1);
                        st.backoff_until = None;
                        let stopped = st.stopped;
                        match st.shelves.get_mut(&id) {
                            Some(shelf) if !stopped => shelf.waiting.push(m),
                            _ => {
                                drop(st);
                                m.discard();
                                st = inner.state.lock().unwrap();
                            }
                        }
                    }
                    Err(e) => {
                        tracing::warn!(
                            "cannot make a pre-made sandbox (trying again in {} s): {e}",
                            st.backoff.as_secs()
                        );
                        st.backoff_until = Some(Instant::now() + st.backoff);
                        st.backoff = (st.backoff * 2).min(Duration::from_secs(60));
                    }
                }
            }
        }
    }
}

/// Has this process's binary been replaced on disk (a package upgrade)?
fn binary_replaced() -> bool {
    std::fs::read_link("/proc/self/exe").is_ok_and(|p| p.to_string_lossy().ends_with(" (deleted)"))
}

/// The execute-only copies of the interpreter and the init, as the cold path
/// binds them (`script::with_exec_only`): for a script of another uid than a
/// root daemon's. Made once by the keeper; without them (no room), members are
/// made without, as cold sandboxes are.
struct ExecOnlyFor(Option<crate::sandbox::ExecOnly>);

impl ExecOnlyFor {
    fn new(spec: &SandboxSpec) -> ExecOnlyFor {
        if !nix::unistd::geteuid().is_root() {
            return ExecOnlyFor(None);
        }
        let dir = spec.runtime_dir().with_file_name("exec");
        ExecOnlyFor(crate::sandbox::exec_only(spec.python(), spec.init(), &dir).ok())
    }

    fn spec(&self, base: &SandboxSpec, id: Option<Identity>) -> SandboxSpec {
        let mut spec = base.clone();
        if let (Some(x), true) = (&self.0, id.is_some_and(|id| id.uid != 0)) {
            spec.set_exec_only(x.clone());
        }
        spec
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: Option<Identity> = Some(Identity { uid: 1, gid: 1 });
    const B: Option<Identity> = Some(Identity { uid: 2, gid: 2 });

    fn bounds() -> Bounds {
        Bounds {
            size: 2,
            max_members: 3,
            idle: Duration::from_secs(600),
        }
    }

    #[test]
    fn the_emptiest_shelf_is_filled_first_up_to_its_size() {
        let now = Instant::now();
        assert_eq!(
            plan(&[(A, 1, now), (B, 0, now)], 0, bounds(), None, now),
            Next::Make(B)
        );
        assert_eq!(
            plan(&[(A, 2, now)], 0, bounds(), None, now),
            Next::Wait(Duration::from_secs(600))
        );
    }

    #[test]
    fn one_member_is_made_at_a_time_and_the_total_is_bounded() {
        let now = Instant::now();
        assert!(matches!(
            plan(&[(A, 0, now)], 1, bounds(), None, now),
            Next::Wait(_)
        ));
        assert!(matches!(
            plan(&[(A, 2, now), (B, 1, now)], 0, bounds(), None, now),
            Next::Wait(_)
        ));
    }

    #[test]
    fn idle_shelves_go_and_a_failure_backs_off() {
        let now = Instant::now();
        let old = now - Duration::from_secs(601);
        assert_eq!(
            plan(&[(A, 2, old), (B, 0, now)], 0, bounds(), None, now),
            Next::Retire(vec![A])
        );
        let later = now + Duration::from_secs(4);
        assert_eq!(
            plan(&[(B, 0, now)], 0, bounds(), Some(later), now),
            Next::Wait(Duration::from_secs(4))
        );
    }

    #[test]
    fn no_bound_means_no_member() {
        let now = Instant::now();
        let none = Bounds::new(2, 0, 600);
        assert!(matches!(
            plan(&[(A, 0, now)], 0, none, None, now),
            Next::Wait(_)
        ));
    }
}
