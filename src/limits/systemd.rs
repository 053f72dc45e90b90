//! The `systemd` backend: each script's sandbox runs in a transient scope
//! `scriptgate-<id>.scope` in `scriptgate.slice`, created over D-Bus with
//! `StartTransientUnit`, so sysadmins see and stop it with systemctl.

use crate::policy::Limits;
use std::time::Duration;
use zbus::zvariant::{OwnedObjectPath, OwnedValue, Value};

const DEST: &str = "org.freedesktop.systemd1";
const PATH: &str = "/org/freedesktop/systemd1";
const MANAGER: &str = "org.freedesktop.systemd1.Manager";

#[derive(Clone)]
pub struct Manager {
    bus: zbus::Connection,
}

pub fn unit_name(script_id: &str) -> String {
    format!("scriptgate-{script_id}.scope")
}

impl Manager {
    /// The system manager, if this process may create units in it.
    pub async fn connect() -> Result<Manager, String> {
        if !nix::unistd::Uid::effective().is_root() {
            return Err("needs root (the system manager's transient units)".into());
        }
        let bus = tokio::time::timeout(Duration::from_secs(3), zbus::Connection::system())
            .await
            .map_err(|_| "the system bus did not answer".to_string())?
            .map_err(|e| format!("no system bus: {e}"))?;
        let m = Manager { bus };
        let v = m
            .property(PATH, MANAGER, "Version")
            .await
            .map_err(|e| format!("no systemd manager on the system bus: {e}"))?;
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
        let path = self.unit_path(unit).await.ok()?;
        let v = self
            .property(
                path.as_str(),
                "org.freedesktop.systemd1.Unit",
                "ActiveState",
            )
            .await
            .ok()?;
        String::try_from(v).ok()
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
    ) -> Result<String, String> {
        let unit = unit_name(script_id);
        let mut props: Vec<(&str, Value)> = vec![
            (
                "Description",
                Value::from(format!("scriptgate script {script_id}")),
            ),
            ("Slice", Value::from("scriptgate.slice")),
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
            ("CollectMode", Value::from("inactive-or-failed")),
        ];
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
            .map_err(|e| format!("StartTransientUnit {unit}: {e}"))?;
        for _ in 0..200 {
            match self.active_state(&unit).await.as_deref() {
                Some("active") => return Ok(unit),
                Some("failed") => return Err(format!("{unit} failed to start")),
                _ => tokio::time::sleep(Duration::from_millis(10)).await,
            }
        }
        Err(format!("{unit} did not become active"))
    }
}
