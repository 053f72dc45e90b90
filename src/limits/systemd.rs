//! The `systemd` backend: each script's sandbox runs in a transient scope
//! `scriptgate-<id>.scope` in `scriptgate.slice`, created over D-Bus with
//! `StartTransientUnit`, so sysadmins see and stop it with systemctl.
//!
//! How a scope ended is the unit's word, not a guess: on cgroup v2 the kernel's
//! OOM kill is in the scope's `memory.events`, which is read while a keeper
//! process still holds the scope. systemd 253 and later would stop a scope whose
//! process the OOM killer took (`OOMPolicy=stop`, the default), removing its
//! cgroup before it is read; the scope is started with `OOMPolicy=continue`
//! where systemd knows the property, and where systemd stopped the scope all
//! the same (an older policy, `systemctl stop`, `RuntimeMaxSec=`), its `Result`
//! says why (`oom-kill`, `timeout`). A failed scope stays loaded for that
//! (`CollectMode=inactive`) until [`Manager::ended`] resets it.

use crate::policy::Limits;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use zbus::zvariant::{OwnedObjectPath, OwnedValue, Value};

const DEST: &str = "org.freedesktop.systemd1";
const PATH: &str = "/org/freedesktop/systemd1";
const MANAGER: &str = "org.freedesktop.systemd1.Manager";
/// The slice every script's scope is in (systemd/scriptgate.slice).
pub const SLICE: &str = "scriptgate.slice";

/// Why the system manager cannot be used, or a scope did not start.
#[derive(Debug, thiserror::Error)]
pub enum SystemdError {
    /// Transient units of the system manager are root's.
    #[error("needs root (the system manager's transient units)")]
    NotRoot,
    /// Connecting to the system bus took longer than 3 s.
    #[error("the system bus did not answer")]
    BusTimeout,
    /// There is no system bus to connect to.
    #[error("no system bus: {0}")]
    NoBus(#[source] zbus::Error),
    /// The bus is there, but no systemd answers on it.
    #[error("no systemd manager on the system bus: {0}")]
    NoManager(#[source] zbus::Error),
    /// systemd refused to create the scope.
    #[error("StartTransientUnit {unit}: {source}")]
    StartTransientUnit {
        unit: String,
        #[source]
        source: zbus::Error,
    },
    /// The scope was created, and failed before it was active.
    #[error("{unit} failed to start")]
    Failed { unit: String },
    /// The scope was not active within 2 s; it was stopped.
    #[error("{unit} did not become active")]
    NotActive { unit: String },
    /// systemd refused the bound on all scripts together, or to start the
    /// slice that carries it.
    #[error("{method} scriptgate.slice: {source}")]
    Slice {
        method: &'static str,
        #[source]
        source: zbus::Error,
    },
}

#[derive(Clone)]
pub struct Manager {
    bus: zbus::Connection,
    /// Whether this systemd takes `OOMPolicy=` for scopes (253 and later); set
    /// false the first time it refuses the property.
    oom_policy: Arc<AtomicBool>,
}

/// Why a scope that is no longer active ended, from its `Result` property.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScopeEnd {
    /// Still active: the script's end was its own (or scriptgate's).
    Active,
    /// The OOM killer took a process and systemd stopped the scope (`oom-kill`).
    /// Defensive: with `OOMPolicy=continue` (systemd 253+) and before 253 systemd
    /// does not stop a scope on an OOM kill, but a drop-in or a later systemd may.
    OomKill,
    /// `RuntimeMaxSec=` of the scope passed (`timeout`).
    Timeout,
    /// Stopped by someone else (`systemctl stop`, `kill`), or gone.
    Stopped,
}

impl ScopeEnd {
    /// From `ActiveState` and `Result` (None: the unit is gone).
    pub fn from_unit(active_state: Option<&str>, result: Option<&str>) -> ScopeEnd {
        match (active_state, result) {
            (Some("active"), _) => ScopeEnd::Active,
            (_, Some("oom-kill")) => ScopeEnd::OomKill,
            (_, Some("timeout")) => ScopeEnd::Timeout,
            _ => ScopeEnd::Stopped,
        }
    }
}

/// How long one call to systemd may take before it fails (a busy PID 1
/// answers in milliseconds; a loaded one under emulation in seconds).
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a stopped scope's processes have after SIGTERM before SIGKILL.
pub const SCOPE_STOP_S: u64 = 5;

/// The units waiting pre-made sandboxes live in (`limits::member::new_id`).
pub const POOL_SCOPES: &str = "scriptgate-pool-*.scope";

pub fn unit_name(script_id: &str) -> String {
    format!("scriptgate-{script_id}.scope")
}

impl Manager {
    /// The system manager, if this process may create units in it.
    pub async fn connect() -> Result<Manager, SystemdError> {
        if !nix::unistd::Uid::effective().is_root() {
            return Err(SystemdError::NotRoot);
        }
        // Every call is bounded: a systemd that never answers fails the one
        // script (its placement), never holds it forever.
        let connect = async {
            zbus::connection::Builder::system()?
                .method_timeout(CALL_TIMEOUT)
                .build()
                .await
        };
        let bus = tokio::time::timeout(Duration::from_secs(3), connect)
            .await
            .map_err(|_| SystemdError::BusTimeout)?
            .map_err(SystemdError::NoBus)?;
        let m = Manager {
            bus,
            oom_policy: Arc::new(AtomicBool::new(true)),
        };
        let v = m
            .property(PATH, MANAGER, "Version")
            .await
            .map_err(SystemdError::NoManager)?;
        tracing::debug!("systemd {v:?}");
        Ok(m)
    }

    async fn property(&self, path: &str, iface: &str, name: &str) -> zbus::Result<OwnedValue> {
        let reply = self
            .bus
            .call_method(
                Some(DEST),
                path,
                Some("org.freedesktop.DBus.Properties"),
                "Get",
                &(iface, name),
            )
            .await?;
        reply.body().deserialize::<OwnedValue>()
    }

    async fn unit_path(&self, unit: &str) -> zbus::Result<OwnedObjectPath> {
        let reply = self
            .bus
            .call_method(Some(DEST), PATH, Some(MANAGER), "GetUnit", &(unit,))
            .await?;
        reply.body().deserialize::<OwnedObjectPath>()
    }

    /// `ActiveState` of a unit; `None` when it is gone.
    pub async fn active_state(&self, unit: &str) -> Option<String> {
        self.string_property(unit, "org.freedesktop.systemd1.Unit", "ActiveState")
            .await
    }

    async fn string_property(&self, unit: &str, iface: &str, name: &str) -> Option<String> {
        let path = self.unit_path(unit).await.ok()?;
        let v = self.property(path.as_str(), iface, name).await.ok()?;
        String::try_from(v).ok()
    }

    /// How the scope ended, read while it is still loaded; then a failed scope is
    /// reset, so that systemd collects it.
    pub async fn ended(&self, unit: &str) -> ScopeEnd {
        let mut state = self.active_state(unit).await;
        if state.as_deref() == Some("active") {
            return ScopeEnd::Active;
        }
        // systemd is still stopping it (its RuntimeMaxSec=, a `systemctl stop`):
        // its Result is set, and the state it ends in decides whether it must be
        // reset. Up to 5 s, a unit's last processes being already dead.
        for _ in 0..50 {
            if !matches!(state.as_deref(), Some("deactivating" | "activating")) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            state = self.active_state(unit).await;
        }
        let result = self
            .string_property(unit, "org.freedesktop.systemd1.Scope", "Result")
            .await;
        if state.as_deref() == Some("failed") {
            self.reset_failed(unit).await;
        }
        ScopeEnd::from_unit(state.as_deref(), result.as_deref())
    }

    /// End every waiting member's scope (`scriptgate-pool-*.scope`) that an
    /// earlier daemon left. Its members ended with it (their inits' lifeline),
    /// all but one whose bwrap was killed between its clone and releasing its
    /// child: that child waits forever, in a scope that would stay for a year.
    /// Its processes get SIGKILL (`KillUnit`), and systemd collects the emptied
    /// scope. Not `StopUnit`: that child is the init of a pid namespace, which
    /// ignores SIGTERM, so the stop job would wait out TimeoutStopSec= (90 s),
    /// and until then the start job of scriptgate.slice, which every new
    /// scope pulls in, waits behind it: no script could be placed (seen in the
    /// Debian 13 guest). The scopes killed, by name.
    pub async fn kill_pool_scopes(&self) -> Vec<String> {
        type Row = (
            String,
            String,
            String,
            String,
            String,
            String,
            OwnedObjectPath,
            u32,
            String,
            OwnedObjectPath,
        );
        let listed = self
            .bus
            .call_method(
                Some(DEST),
                PATH,
                Some(MANAGER),
                "ListUnitsByPatterns",
                &(
                    vec!["active", "activating", "deactivating"],
                    vec![POOL_SCOPES],
                ),
            )
            .await
            .and_then(|reply| reply.body().deserialize::<Vec<Row>>());
        let units: Vec<String> = match listed {
            Ok(rows) => rows.into_iter().map(|r| r.0).collect(),
            Err(e) => {
                tracing::debug!("cannot list {POOL_SCOPES}: {e}");
                return vec![];
            }
        };
        for unit in &units {
            self.kill_all(unit).await;
        }
        units
    }

    /// End the scopes of scripts an earlier daemon left running (its store's
    /// rows it never finished: `audit::Recovered`). Each sandbox ends with its
    /// daemon (its init's lifeline), except where the daemon died between a
    /// bwrap's clone and its release of the child: that child waits forever,
    /// and its scope would stay until its `RuntimeMaxSec=` (the script's
    /// timeout). SIGKILL, as for the pool's scopes. The scopes killed.
    pub async fn kill_scopes_of(&self, script_ids: &[String]) -> Vec<String> {
        let mut killed = vec![];
        for id in script_ids {
            let unit = unit_name(id);
            let state = self.active_state(&unit).await;
            if matches!(
                state.as_deref(),
                Some("active" | "activating" | "deactivating")
            ) && self.kill_all(&unit).await
            {
                killed.push(unit);
            }
        }
        killed
    }

    /// SIGKILL to every process of `unit` (`KillUnit`); whether systemd took it.
    pub async fn kill_all(&self, unit: &str) -> bool {
        self.bus
            .call_method(
                Some(DEST),
                PATH,
                Some(MANAGER),
                "KillUnit",
                &(unit, "all", libc::SIGKILL),
            )
            .await
            .is_ok()
    }

    async fn reset_failed(&self, unit: &str) {
        let _ = self
            .bus
            .call_method(Some(DEST), PATH, Some(MANAGER), "ResetFailedUnit", &(unit,))
            .await;
    }

    pub async fn control_group(&self, unit: &str) -> Option<String> {
        let path = self.unit_path(unit).await.ok()?;
        let v = self
            .property(
                path.as_str(),
                "org.freedesktop.systemd1.Scope",
                "ControlGroup",
            )
            .await
            .ok()?;
        String::try_from(v).ok().filter(|s| !s.is_empty())
    }

    /// Create the scope with `pids` in it and wait until it is active: only then
    /// may the sandbox exec, so that nothing of the script runs outside its limits.
    pub async fn start_scope(
        &self,
        script_id: &str,
        pids: &[u32],
        l: &Limits,
        cpu_quota_percent: u32,
    ) -> Result<String, SystemdError> {
        let unit = unit_name(script_id);
        let with_policy = self.oom_policy.load(Ordering::Relaxed);
        match self
            .start_transient(script_id, pids, l, cpu_quota_percent, with_policy)
            .await
        {
            // systemd before 253: "Cannot set property OOMPolicy, or unknown
            // property." Such a systemd does not stop a scope on an OOM kill.
            Err(e) if with_policy && e.to_string().contains("OOMPolicy") => {
                tracing::debug!("systemd takes no OOMPolicy= for scopes: {e}");
                self.oom_policy.store(false, Ordering::Relaxed);
                self.start_transient(script_id, pids, l, cpu_quota_percent, false)
                    .await
            }
            r => r,
        }
        .map_err(|source| SystemdError::StartTransientUnit {
            unit: unit.clone(),
            source,
        })?;
        for _ in 0..200 {
            match self.active_state(&unit).await.as_deref() {
                Some("active") => return Ok(unit),
                Some("failed") => {
                    self.reset_failed(&unit).await;
                    return Err(SystemdError::Failed { unit });
                }
                _ => tokio::time::sleep(Duration::from_millis(10)).await,
            }
        }
        // Let it go: a scope that never came up must not stay loaded (failed)
        // once it does. "replace": its start job may still be queued, and a
        // stop in "fail" mode would be refused for it.
        let _ = self
            .bus
            .call_method(
                Some(DEST),
                PATH,
                Some(MANAGER),
                "StopUnit",
                &(unit.as_str(), "replace"),
            )
            .await;
        self.reset_failed(&unit).await;
        Err(SystemdError::NotActive { unit })
    }

    /// The bound on all scripts together, on `scriptgate.slice`: runtime
    /// properties (`SetUnitProperties`, kept in /run until a reboot or the
    /// next start or reload sets them again), 0 as infinity; then the slice is
    /// started, so that its cgroup, and the bound in it, exist before the
    /// first script.
    pub async fn bound_slice(&self, a: &crate::protocol::AllScripts) -> Result<(), SystemdError> {
        let props = slice_properties(a);
        self.bus
            .call_method(
                Some(DEST),
                PATH,
                Some(MANAGER),
                "SetUnitProperties",
                &(SLICE, true, props),
            )
            .await
            .map_err(|source| SystemdError::Slice {
                method: "SetUnitProperties",
                source,
            })?;
        self.bus
            .call_method(
                Some(DEST),
                PATH,
                Some(MANAGER),
                "StartUnit",
                &(SLICE, "replace"),
            )
            .await
            .map_err(|source| SystemdError::Slice {
                method: "StartUnit",
                source,
            })?;
        Ok(())
    }

    async fn start_transient(
        &self,
        script_id: &str,
        pids: &[u32],
        l: &Limits,
        cpu_quota_percent: u32,
        oom_policy: bool,
    ) -> zbus::Result<zbus::Message> {
        let unit = unit_name(script_id);
        let mut props: Vec<(&str, Value)> = vec![
            (
                "Description",
                Value::from(format!("scriptgate script {script_id}")),
            ),
            ("Slice", Value::from(SLICE)),
            ("PIDs", Value::from(pids.to_vec())),
            ("MemoryAccounting", Value::from(true)),
            ("TasksAccounting", Value::from(true)),
            ("CPUAccounting", Value::from(true)),
            ("MemoryMax", Value::from(l.memory_max_bytes)),
            ("MemorySwapMax", Value::from(0u64)),
            ("TasksMax", Value::from(l.tasks_max)),
            // A backstop behind the daemon's own timeout, which fires first.
            (
                "RuntimeMaxUSec",
                Value::from((l.timeout_s + 30) * 1_000_000),
            ),
            // A failed scope (oom-kill, timeout) stays loaded until `ended` has
            // read its Result and reset it.
            ("CollectMode", Value::from("inactive")),
            // A stop (`systemctl stop`, RuntimeMaxSec=, a pool member's scope
            // at shutdown) sends SIGTERM, which the sandbox's init, PID 1 of its
            // namespace, ignores: SIGKILL follows after SCOPE_STOP_S, not
            // systemd's default 90 s, during which scriptgate.slice's next
            // start job, and so every new scope, would wait.
            ("TimeoutStopUSec", Value::from(SCOPE_STOP_S * 1_000_000)),
        ];
        if oom_policy {
            props.push(("OOMPolicy", Value::from("continue")));
        }
        if cpu_quota_percent > 0 {
            props.push((
                "CPUQuotaPerSecUSec",
                Value::from(u64::from(cpu_quota_percent) * 10_000),
            ));
        }
        let aux: Vec<(&str, Vec<(&str, Value)>)> = vec![];
        self.bus
            .call_method(
                Some(DEST),
                PATH,
                Some(MANAGER),
                "StartTransientUnit",
                &(unit.as_str(), "fail", props, aux),
            )
            .await
    }
}

/// The slice's properties for `a`: systemd's "infinity" (u64::MAX) for 0.
fn slice_properties(a: &crate::protocol::AllScripts) -> Vec<(&'static str, Value<'static>)> {
    let or_infinity = |n: u64| if n == 0 { u64::MAX } else { n };
    vec![
        ("MemoryAccounting", Value::from(true)),
        ("TasksAccounting", Value::from(true)),
        ("CPUAccounting", Value::from(true)),
        ("MemoryMax", Value::from(or_infinity(a.memory_max_bytes))),
        ("TasksMax", Value::from(or_infinity(a.tasks_max))),
        (
            "CPUQuotaPerSecUSec",
            Value::from(match a.cpu_quota_percent {
                0 => u64::MAX,
                p => u64::from(p) * 10_000,
            }),
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::{slice_properties, ScopeEnd, SystemdError};
    use zbus::zvariant::Value;

    /// The slice's bound: bytes, tasks and CPU time per second as systemd
    /// takes them; no bound is systemd's infinity.
    #[test]
    fn the_slice_gets_the_bound_and_infinity_for_none() {
        let a = crate::protocol::AllScripts {
            memory_max_bytes: 512 << 20,
            tasks_max: 24,
            cpu_quota_percent: 150,
            ..Default::default()
        };
        let p = slice_properties(&a);
        fn get<'a>(p: &[(&str, Value<'a>)], k: &str) -> Value<'a> {
            p.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.clone())
                .unwrap()
        }
        assert_eq!(get(&p, "MemoryMax"), Value::from(512u64 << 20));
        assert_eq!(get(&p, "TasksMax"), Value::from(24u64));
        assert_eq!(get(&p, "CPUQuotaPerSecUSec"), Value::from(1_500_000u64));
        let none = slice_properties(&crate::protocol::AllScripts::default());
        for k in ["MemoryMax", "TasksMax", "CPUQuotaPerSecUSec"] {
            assert_eq!(get(&none, k), Value::from(u64::MAX), "{k}");
        }
    }

    /// The words `sandbox.backend`, check-config and a refused start show.
    #[test]
    fn systemd_errors_keep_their_words() {
        let unit = || "scriptgate-ab.scope".to_string();
        for (e, said) in [
            (
                SystemdError::NotRoot,
                "needs root (the system manager's transient units)",
            ),
            (SystemdError::BusTimeout, "the system bus did not answer"),
            (
                SystemdError::Failed { unit: unit() },
                "scriptgate-ab.scope failed to start",
            ),
            (
                SystemdError::NotActive { unit: unit() },
                "scriptgate-ab.scope did not become active",
            ),
        ] {
            assert_eq!(e.to_string(), said);
        }
        let e = SystemdError::StartTransientUnit {
            unit: unit(),
            source: zbus::Error::Failure("refused".into()),
        };
        assert_eq!(
            e.to_string(),
            format!(
                "StartTransientUnit scriptgate-ab.scope: {}",
                zbus::Error::Failure("refused".into())
            )
        );
    }

    #[test]
    fn a_scope_ends_as_its_result_says() {
        let table = [
            (Some("active"), Some("oom-kill"), ScopeEnd::Active),
            (Some("failed"), Some("oom-kill"), ScopeEnd::OomKill),
            (Some("inactive"), Some("oom-kill"), ScopeEnd::OomKill),
            (Some("failed"), Some("timeout"), ScopeEnd::Timeout),
            (Some("inactive"), Some("success"), ScopeEnd::Stopped),
            (Some("failed"), Some("signal"), ScopeEnd::Stopped),
            (None, None, ScopeEnd::Stopped),
        ];
        for (state, result, end) in table {
            assert_eq!(
                ScopeEnd::from_unit(state, result),
                end,
                "{state:?} {result:?}"
            );
        }
    }
}
