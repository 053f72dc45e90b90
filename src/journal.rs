//! The journal entries a sysadmin reads: one per finished script and one per
//! refused start, each with a fixed MESSAGE_ID explained by the message catalog
//! (systemd/scriptgate.catalog, `journalctl -x`). Through tracing-journald with no
//! field prefix, `scriptgate_run_id` arrives as `SCRIPTGATE_RUN_ID`; without a journal
//! the same fields go to stderr.

use crate::protocol::{RpcError, ScriptResult, Status};

/// MESSAGE_ID of "script finished" (fixed forever).
pub const SCRIPT_FINISHED: &str = "346f6012b1654d13bd185a7cfc0553cb";
/// MESSAGE_ID of "script.start refused" (fixed forever).
pub const START_REFUSED: &str = "e1b3fc3a8d8142699a4d42cc4f6acfcb";

pub fn script_finished(r: &ScriptResult, runner: Option<&str>, uid: u32, unit: Option<&str>) {
    macro_rules! entry {
        ($level:ident) => {
            tracing::$level!(
                message_id = SCRIPT_FINISHED,
                scriptgate_script_id = %r.script_id,
                scriptgate_run_id = %r.run_id,
                scriptgate_runner = runner.unwrap_or(""),
                scriptgate_uid = uid,
                scriptgate_status = r.status.as_str(),
                scriptgate_calls = r.calls,
                scriptgate_failures = r.failures,
                scriptgate_duration_ms = r.duration_ms,
                scriptgate_details_dir = %r.details_dir,
                scriptgate_unit = unit.unwrap_or(""),
                "script {} of run {} finished: {} ({} calls, {} failed, {} ms)",
                r.script_id, r.run_id, r.status.as_str(), r.calls, r.failures, r.duration_ms
            )
        };
    }
    match r.status {
        Status::Ok | Status::Cancelled => entry!(info),
        _ => entry!(warn),
    }
}

pub fn start_refused(
    e: &RpcError,
    run_id: Option<&str>,
    runner: Option<&str>,
    peer_uid: u32,
    peer_pid: Option<i32>,
) {
    tracing::warn!(
        message_id = START_REFUSED,
        scriptgate_run_id = run_id.unwrap_or(""),
        scriptgate_runner = runner.unwrap_or(""),
        scriptgate_peer_uid = peer_uid,
        scriptgate_peer_pid = peer_pid.unwrap_or(0),
        scriptgate_code = e.code,
        scriptgate_reason = e.reason().unwrap_or(""),
        "script.start refused for run {}: {} ({})",
        run_id.unwrap_or("?"),
        e.message,
        e.code
    );
}

/// Refused starts that came faster than the rate limit, counted and summarised
/// (under the same MESSAGE_ID as one refusal, with their number).
pub fn refusals_counted(count: u64, message: &str) {
    tracing::warn!(
        message_id = START_REFUSED,
        scriptgate_suppressed = count,
        "{message}"
    );
}
