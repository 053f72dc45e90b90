//! What the daemon keeps of a running script, and what it tells of one.

use crate::policy::runs::RunKey;
use crate::protocol::{ScriptResult, ScriptStatus, Status};
use crate::script::broker::Live;
use crate::script::Stop;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::watch;

/// What the daemon keeps of a running script.
pub(crate) struct Running {
    pub(crate) run_id: String,
    /// `Peers::run_key`: the run, scoped to the entry (or shared key and uid)
    /// that signed it.
    pub(crate) run_key: RunKey,
    pub(crate) runner: Option<String>,
    pub(crate) unit: Option<String>,
    /// The connection that started it.
    pub(crate) owner: u64,
    pub(crate) peer_uid: u32,
    pub(crate) run_uid: u32,
    pub(crate) started: Instant,
    pub(crate) details_dir: String,
    /// The workspace's absolute path (journal entries).
    pub(crate) workspace: PathBuf,
    /// The engine's trace id (`SCRIPTGATE_TRACE_ID`).
    pub(crate) trace_id: Option<String>,
    pub(crate) live: Arc<Live>,
    pub(crate) stop: watch::Sender<Option<Stop>>,
    pub(crate) result: watch::Receiver<Option<ScriptResult>>,
}

/// A running script's `script.status`.
pub(crate) fn status_of(script_id: &str, r: &Running) -> ScriptStatus {
    ScriptStatus {
        script_id: script_id.to_string(),
        state: Status::Running,
        calls: r.live.calls.load(Ordering::Relaxed),
        failures: r.live.failures.load(Ordering::Relaxed),
        elapsed_ms: r.started.elapsed().as_millis() as u64,
        progress: r.live.progress.lock().unwrap().clone(),
    }
}
