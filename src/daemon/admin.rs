//! The administrator's surface and the daemon's own view of itself:
//! `daemon.info`, `admin.list` (with what each script holds), `admin.calls`,
//! `admin.prune`, and the audit store's checkpoint at a stop.

use crate::daemon::running::status_of;
use crate::daemon::{calls, disk, prune, Daemon, Usage, USAGE_FRESH, VERSION};
use crate::protocol::{DaemonInfo, DaemonLimits, ListedScript, RpcError};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

impl Daemon {
    /// `daemon.info`: what this daemon is and what bounds its scripts.
    pub fn info(&self) -> DaemonInfo {
        let live = self.live();
        let s = &live.cfg.scripts;
        DaemonInfo {
            version: VERSION.into(),
            protocol: crate::protocol::PROTOCOL_VERSION,
            backend: self.backend.kind.as_str().into(),
            backend_notes: self.backend_notes(),
            limits_per_script: self.backend.limits_per_script(),
            limits_enforced: Some(self.preflight.limits.enforced()),
            sandbox: Some(self.preflight.sandbox.info.clone()),
            same_uid: same_uid(
                nix::unistd::geteuid().is_root(),
                &live.cfg.sandbox.run_as,
                self.backend.kind.as_str(),
            ),
            running: self.running_count(),
            disk: Some(disk::info(
                s.disk_max_bytes,
                &live.cfg.workspace.roots,
                true,
            )),
            limits: DaemonLimits {
                max_calls: s.max_calls,
                max_concurrency: s.max_concurrency,
                timeout_s: s.timeout_s,
                memory_max_bytes: s.memory_max_bytes,
                tasks_max: s.tasks_max,
                output_max_bytes: s.output_max_bytes,
                return_max_chars: s.return_max_chars,
                approval_timeout_s: s.approval_timeout_s,
                max_running: live.cfg.server.max_running,
            },
            started_ms: Some(self.started_ms),
            config: self.config_state(),
            all_scripts: Some(self.all_scripts_info()),
            pool: live.settings.pool_info(),
        }
    }

    /// The backend's notes, then what the preflight found not in force.
    pub fn backend_notes(&self) -> Vec<String> {
        let mut v = self.backend.notes.clone();
        v.extend(self.preflight.limits.lines());
        v
    }

    pub fn sandbox_check(&self) -> &crate::sandbox::preflight::SandboxCheck {
        &self.preflight.sandbox
    }

    /// Running scripts with what each holds now, for `admin.list`: the
    /// resources are read (blocking file reads, on the blocking pool) at most
    /// once per [`USAGE_FRESH`] for all callers.
    pub async fn list_with_usage(self: &Arc<Self>) -> Vec<ListedScript> {
        let usage = {
            let mut last = self.usage.lock().await;
            match &*last {
                Some((at, u)) if at.elapsed() < USAGE_FRESH => u.clone(),
                _ => {
                    let d = self.clone();
                    let u = tokio::task::spawn_blocking(move || d.read_usage())
                        .await
                        .unwrap_or_default();
                    let u = Arc::new(u);
                    *last = Some((Instant::now(), u.clone()));
                    u
                }
            }
        };
        self.list_running(&usage)
    }

    /// What each running script whose sandbox exists holds now.
    fn read_usage(&self) -> Usage {
        self.registry
            .all_running()
            .into_iter()
            .filter_map(|(id, r)| {
                let pid = r.live.sandbox_pid.load(Ordering::Relaxed);
                (pid > 0).then(|| (id, self.backend.backend.usage(pid as u32)))
            })
            .collect()
    }

    /// Running scripts, for `scriptgate ps` (admin), with the resources of
    /// `usage` (`list_with_usage`).
    pub fn list_running(&self, usage: &Usage) -> Vec<ListedScript> {
        let now = Instant::now();
        self.registry
            .all_running()
            .into_iter()
            .map(|(id, r)| {
                let pid = r.live.sandbox_pid.load(Ordering::Relaxed);
                ListedScript {
                    status: status_of(&id, &r),
                    run_id: r.run_id.clone(),
                    peer_uid: r.peer_uid,
                    uid: r.run_uid,
                    unit: r.unit.clone(),
                    age_ms: now.duration_since(r.started).as_millis() as u64,
                    resources: (pid > 0).then(|| usage.get(&id).cloned()).flatten(),
                }
            })
            .collect()
    }

    /// `admin.calls`: a page of the script's calls.jsonl, found from its audit
    /// row (or, running, from what the daemon keeps of it) and opened without
    /// following a link (`calls`).
    pub async fn calls_page(
        self: &Arc<Self>,
        p: crate::protocol::CallsParams,
    ) -> Result<crate::protocol::CallsPage, RpcError> {
        let d = self.clone();
        tokio::task::spawn_blocking(move || {
            let (workspace, details_dir, run_uid) = match d.registry.running(&p.script_id) {
                Some(r) => (r.workspace.clone(), r.details_dir.clone(), r.run_uid),
                None => {
                    let db = d.live().cfg.state.dir.join("scriptgate.db");
                    let row = crate::audit::Reader::open(&db)
                        .map_err(|e| RpcError::internal(e.to_string()))?
                        .script(&p.script_id)
                        .map_err(|e| RpcError::internal(e.to_string()))?
                        .ok_or_else(|| RpcError::no_such_script(&p.script_id))?;
                    let text = |k: &str| row[k].as_str().unwrap_or_default().to_string();
                    let run_uid = row["run_uid"]
                        .as_u64()
                        .and_then(|u| u32::try_from(u).ok())
                        .ok_or_else(|| {
                            RpcError::internal(format!(
                                "script {}: no run_uid recorded",
                                p.script_id
                            ))
                        })?;
                    (
                        PathBuf::from(text("workspace")),
                        text("details_dir"),
                        run_uid,
                    )
                }
            };
            let path = workspace.join(details_dir).join("calls.jsonl");
            let f = calls::open_no_links(&path, run_uid)
                .map_err(|e| RpcError::internal(format!("cannot open {}: {e}", path.display())))?;
            calls::page(&p.script_id, f, p.offset, p.limit)
        })
        .await
        .map_err(|e| RpcError::internal(e.to_string()))?
    }

    /// One workspace retention pass (`workspace.retain_days`): the hourly one,
    /// and `admin.prune`'s. One at a time; a dry run only plans. Removed and
    /// gone workspaces are forgotten by the store.
    pub async fn prune_workspaces(
        &self,
        dry_run: bool,
        as_of_ms: Option<i64>,
    ) -> Result<crate::protocol::Pruned, RpcError> {
        if as_of_ms.is_some() && !dry_run {
            return Err(RpcError::invalid_params(
                "as_of_ms is for a dry run only: a pass removes as of now",
            ));
        }
        let _one = self.prune_pass.lock().await;
        let live = self.live();
        let ws = &live.cfg.workspace;
        let (days, roots) = (ws.retain_days, ws.roots.clone());
        if days == 0 {
            return Ok(crate::protocol::Pruned {
                dry_run,
                roots,
                as_of_ms,
                ..Default::default()
            });
        }
        let busy = self.running_workspaces();
        // Only the workspaces the daemon recorded as scriptgate's own (prune).
        let vouched = self
            .store
            .vouched_workspaces()
            .map_err(|e| RpcError::internal(e.to_string()))?;
        let r = roots.clone();
        let (pruned, forget) = tokio::task::spawn_blocking(move || {
            let in_use = |p: &Path| busy.iter().any(|b| b.starts_with(p));
            prune::pass_or_look(&r, &vouched, days, dry_run, as_of_ms, &in_use)
        })
        .await
        .map_err(|e| RpcError::internal(e.to_string()))?;
        if !dry_run {
            if let Err(e) = self.store.forget_workspaces(forget).await {
                tracing::warn!("workspace retention: {e}");
            }
        }
        Ok(pruned)
    }

    /// At a clean stop or idle exit, after the last row: fold the audit store's
    /// write-ahead log into `scriptgate.db` and empty it.
    pub async fn checkpoint_store(&self) {
        match self.store.checkpoint_wal().await {
            Ok(c) if c.busy => tracing::warn!(
                "the audit store's write-ahead log could not all be folded in at stop ({} of {} frames; a reader held it): \
                 scriptgate.db-wal stays beside scriptgate.db, so copy both, or back up with `scriptgate audit backup FILE`",
                c.folded,
                c.frames
            ),
            Ok(c) => tracing::debug!(frames = c.frames, "audit store checkpointed"),
            Err(e) => tracing::warn!("cannot checkpoint the audit store at stop: {e}"),
        }
    }
}

/// `daemon.info`'s `same_uid`: what sharing a uid means for scripts. Root
/// engines' scripts share `run_as`; a non-root engine's scripts share its uid.
fn same_uid(root_daemon: bool, run_as: &str, backend: &str) -> Vec<String> {
    let mut v = vec![
        format!(
            "scripts of root engines all run as sandbox.run_as = {run_as:?}; a non-root engine's scripts run as its own uid"
        ),
        "scripts of one uid share that uid's kernel quotas with each other and with every other process of that uid: \
         inotify instances and watches, pipe buffer pages (and, on the rlimit backend, RLIMIT_NPROC); \
         one script can use them up for the others"
            .to_string(),
        "any process of that uid may send signals to a script's processes".to_string(),
        "script ids are in no command line, environment or mount table; \
         an id alone shows nothing: a lookup needs the starting connection or a token of the script's own run"
            .to_string(),
    ];
    if backend != "rlimit" {
        v.push("unit and cgroup names carry the script id, and every user can read them".into());
    }
    v.push(if root_daemon {
        "the interpreter and the sandbox init run from execute-only copies (unless a warning in the journal \
         says they could not be made for a script), so other processes of the uid \
         cannot read a script's memory, environment, descriptors or files through /proc/PID; \
         a program the script runs that its uid may read (e.g. /bin/sh) has no such protection while it runs"
            .into()
    } else {
        "the daemon is not root: scripts run as its own uid, and every process of that uid may read them through /proc/PID"
            .into()
    });
    v
}
