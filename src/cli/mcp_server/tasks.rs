//! Long scripts as MCP tasks (the `io.modelcontextprotocol/tasks` extension,
//! SEP-2663): a `run_script` call whose request declares the extension and whose
//! script still runs after `--task-after` is answered with a task handle, and
//! `tasks/get` later answers exactly what the call would have.
//!
//! A task id is the script's id and workspace sealed (rmcp's request-state codec,
//! HMAC-SHA256) under a key kept in the user's state directory, bound to the
//! client it was given to: another client, or a made-up or altered id, finds no
//! task. It holds everything needed to find the script again, so tasks outlive
//! a reconnect and a restart of this process: the script's record answers then
//! (the embedded daemon's store, or the daemon over its socket).

use super::scripts::{Claim, Principal, Script, Scripts, Where};
use crate::cli::exit::Failure;
use crate::protocol::{ScriptResult, Status};
use rmcp::model::{
    CallToolResult, CreateTaskResult, DetailedTask, RequestStateCodec, Task, TaskPayload,
};
use rmcp::ErrorData as McpError;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// What a client is asked to wait between `tasks/get`.
pub(super) const POLL_MS: u64 = 1000;

/// The sealed content of a task id.
#[derive(serde::Serialize, serde::Deserialize)]
struct Handle {
    /// The script id.
    s: String,
    /// Its workspace.
    w: PathBuf,
    /// When the task was made (Unix ms).
    c: i64,
    /// The client it was given to.
    p: String,
}

pub(super) struct Tasks {
    codec: RequestStateCodec,
    /// The records' lifetime (`audit.retain_days`), as the tasks' `ttlMs`.
    ttl_ms: u64,
    /// The embedded daemon's audit store, where its records are.
    store: PathBuf,
}

/// The one answer for a task id that does not open for this client.
fn not_found() -> McpError {
    McpError::invalid_params("Failed to retrieve task: Task not found", None)
}

impl Tasks {
    /// The sealing key is `STATE/mcp-tasks.key`, made at first use.
    pub(super) fn open(state: &Path, store: PathBuf, retain_days: u64) -> Result<Tasks, Failure> {
        let key = super::secret::load_or_make(&state.join("mcp-tasks.key"), 32, |b| b.to_vec())?;
        Ok(Tasks {
            codec: RequestStateCodec::try_new(key)
                .map_err(|e| Failure::setup(format!("task key: {e}")))?,
            ttl_ms: retain_days.max(1) * 86_400_000,
            store,
        })
    }

    /// The handle a call answers with: the script as a task of `who`'s.
    pub(super) fn handle(&self, s: &Script, who: &Principal) -> CreateTaskResult {
        let now = crate::time::now_ms();
        let id = self
            .codec
            .seal_json(&Handle {
                s: s.id.clone(),
                w: s.workspace.clone(),
                c: now,
                p: who.as_str().to_string(),
            })
            .expect("a task handle serializes");
        CreateTaskResult::new(
            self.task(&id, now, now)
                .with_status_message(s.status_line()),
        )
    }

    fn task(&self, id: &str, created: i64, updated: i64) -> Task {
        Task::new(
            id,
            rmcp::model::TaskStatus::Working,
            iso(created),
            iso(updated),
        )
        .with_ttl_ms(self.ttl_ms)
        .with_poll_interval_ms(POLL_MS)
    }

    fn open_handle(&self, id: &str, who: &Principal) -> Result<Handle, McpError> {
        let h: Handle = self.codec.open_json(id).map_err(|_| not_found())?;
        if h.p != who.as_str() {
            return Err(not_found());
        }
        Ok(h)
    }

    /// `tasks/get`: the script's state, from this process or from its record.
    pub(super) async fn get(
        &self,
        scripts: &Arc<Scripts>,
        id: &str,
        who: &Principal,
    ) -> Result<DetailedTask, McpError> {
        let h = self.open_handle(id, who)?;
        let now = crate::time::now_ms();
        let task = self.task(id, h.c, now);
        if let Some(s) = scripts.get(&h.s) {
            return Ok(match s.finished() {
                None => DetailedTask::new(
                    task.with_status_message(s.status_line()),
                    TaskPayload::Working,
                ),
                Some(d) => {
                    if s.claim() == Claim::Task {
                        s.set_claim(Claim::Delivered);
                    }
                    finished(task, d.status, &d.answer)
                }
            });
        }
        match self.record(scripts, &h.s).await {
            Ok(None) => Ok(DetailedTask::new(
                task.with_status_message("running"),
                TaskPayload::Working,
            )),
            Ok(Some(res)) => {
                let answer = super::result::of_script(&res, &h.w, None);
                Ok(finished(task, Some(res.status), &answer))
            }
            Err(f) => Err(McpError::internal_error(
                format!("the script's record cannot be read: {}", f.message),
                None,
            )),
        }
    }

    /// `tasks/cancel`: the script ends `cancelled` (within a cancel's time; the
    /// acknowledgement comes once it has ended, or after 2 s).
    pub(super) async fn cancel(
        &self,
        scripts: &Arc<Scripts>,
        id: &str,
        who: &Principal,
    ) -> Result<(), McpError> {
        let h = self.open_handle(id, who)?;
        if let Some(s) = scripts.get(&h.s) {
            s.cancel();
            let _ = tokio::time::timeout(std::time::Duration::from_secs(2), s.wait()).await;
            return Ok(());
        }
        match scripts.runs_in() {
            // The embedded daemon runs in this process: a script not here has ended.
            Where::Embedded(_) => Ok(()),
            Where::Socket { path, system, cfg } => {
                crate::cli::run::socket_cancel(path, *system, cfg, &h.s)
                    .await
                    .map_err(|f| McpError::internal_error(f.message, None))
            }
        }
    }

    /// A script's record: its result, or `None` while it runs.
    async fn record(&self, scripts: &Scripts, id: &str) -> Result<Option<ScriptResult>, Failure> {
        match scripts.runs_in() {
            Where::Socket { path, system, cfg } => {
                crate::cli::run::socket_record(path, *system, cfg, id).await
            }
            Where::Embedded(_) => {
                let (store, id) = (self.store.clone(), id.to_string());
                tokio::task::spawn_blocking(move || read_record(&store, &id))
                    .await
                    .map_err(|e| Failure::setup(e.to_string()))?
            }
        }
    }

    /// Whether task id `id` is one of `who`'s.
    pub(super) fn opens(&self, id: &str, who: &Principal) -> bool {
        self.open_handle(id, who).is_ok()
    }

    /// The task of `id` as a `notifications/tasks` carries it, if `id` opens for
    /// `who` and names `script`.
    pub(super) fn names(&self, id: &str, who: &Principal, script: &str) -> bool {
        self.open_handle(id, who).is_ok_and(|h| h.s == script)
    }
}

/// A finished script's task: `cancelled`, or `completed` with the call's answer
/// (an interrupted or failed script included: its answer says so).
fn finished(task: Task, status: Option<Status>, answer: &CallToolResult) -> DetailedTask {
    if status == Some(Status::Cancelled) {
        return DetailedTask::new(
            task.with_status_message("cancelled"),
            TaskPayload::Cancelled,
        );
    }
    let result = match serde_json::to_value(answer) {
        Ok(Value::Object(m)) => m,
        _ => serde_json::Map::new(),
    };
    let message = status.map_or("interrupted", Status::as_str);
    DetailedTask::new(
        task.with_status_message(message),
        TaskPayload::Completed { result },
    )
}

/// The result of script `id` in the embedded daemon's store (this user's).
fn read_record(store: &Path, id: &str) -> Result<Option<ScriptResult>, Failure> {
    let r = crate::audit::Reader::open(store).map_err(|e| Failure::setup(e.to_string()))?;
    let row = r
        .script(id)
        .map_err(|e| Failure::setup(e.to_string()))?
        .ok_or_else(|| {
            Failure::setup(format!("no record of script {id} in {}", store.display()))
        })?;
    if row["status"] == json!("running") {
        return Ok(None);
    }
    serde_json::from_value(row["result"].clone())
        .map(Some)
        .map_err(|e| Failure::setup(format!("script {id}'s stored result: {e}")))
}

/// ISO 8601 for Unix milliseconds.
fn iso(ms: i64) -> String {
    crate::time::rfc3339(ms)
}
