//! The journal entries a sysadmin reads: one per finished script and one per
//! refused start, each with a fixed MESSAGE_ID explained by the message catalog
//! (systemd/scriptgate.catalog, `journalctl -x`). Through tracing-journald with no
//! field prefix, `scriptgate_run_id` arrives as `SCRIPTGATE_RUN_ID`; without a journal
//! the same fields go to stderr.

use crate::protocol::refusal::Refused;
use crate::protocol::{ScriptResult, Status};

/// MESSAGE_ID of "script finished" (fixed forever).
pub const SCRIPT_FINISHED: &str = "346f6012b1654d13bd185a7cfc0553cb";
/// MESSAGE_ID of "script.start refused" (fixed forever).
pub const START_REFUSED: &str = "e1b3fc3a8d8142699a4d42cc4f6acfcb";

/// What the "script finished" entry says about one script.
pub struct Finished<'a> {
    pub result: &'a ScriptResult,
    pub runner: Option<&'a str>,
    pub uid: u32,
    pub unit: Option<&'a str>,
    /// The workspace's absolute path (`SCRIPTGATE_WORKSPACE`).
    pub workspace: &'a str,
    /// Not the script's doing: the sandbox or its limits could not be set up, the
    /// engine was lost, or the daemon stopped under it.
    pub infrastructure: bool,
    /// The engine's W3C trace id (`SCRIPTGATE_TRACE_ID`), when it gave one.
    pub trace_id: Option<&'a str>,
}

/// The journal priority of a finished script, by cause: what went wrong around
/// the script is `err` (3); the script's own end (ok, its error, timeout, oom,
/// call limit, a cancel) is `notice` (5, tracing's INFO through tracing-journald).
pub fn priority(status: Status, infrastructure: bool) -> tracing::Level {
    if infrastructure || status == Status::Interrupted {
        tracing::Level::ERROR
    } else {
        tracing::Level::INFO
    }
}

/// The line that says what went wrong, for the entry's message and
/// `SCRIPTGATE_ERROR` (the whole text is in the audit row and the result). For a
/// Python failure that is the exception (`ZeroDivisionError: division by
/// zero`), not the `Traceback (most recent call last):` that opens its tail:
/// the first unindented line after the last traceback's frames (or, for a
/// SyntaxError, after its `File` line). Anything else is said by its first line.
pub fn headline(error: Option<&str>) -> &str {
    const TRACEBACK: &str = "Traceback (most recent call last):";
    let Some(e) = error.map(str::trim_start) else {
        return "";
    };
    let lines: Vec<&str> = e.lines().collect();
    // A SyntaxError has no traceback: its report starts at the `File "…"` line.
    let report = lines.iter().rposition(|l| *l == TRACEBACK).or_else(|| {
        lines
            .first()
            .filter(|l| l.starts_with("File \""))
            .map(|_| 0)
    });
    let exception = report.and_then(|t| {
        lines[t + 1..]
            .iter()
            .find(|l| !l.is_empty() && !l.starts_with([' ', '\t']))
    });
    exception.or(lines.first()).copied().unwrap_or("")
}

pub fn script_finished(f: &Finished) {
    let r = f.result;
    let error = headline(r.error.as_deref());
    let sep = if error.is_empty() { "" } else { ": " };
    macro_rules! entry {
        ($level:ident) => {
            tracing::$level!(
                message_id = SCRIPT_FINISHED,
                scriptgate_script_id = %r.script_id,
                scriptgate_run_id = %r.run_id,
                scriptgate_runner = f.runner.unwrap_or(""),
                scriptgate_uid = f.uid,
                scriptgate_status = r.status.as_str(),
                scriptgate_calls = r.calls,
                scriptgate_failures = r.failures,
                scriptgate_duration_ms = r.duration_ms,
                scriptgate_workspace = f.workspace,
                scriptgate_details_dir = %r.details_dir,
                scriptgate_error = error,
                scriptgate_cause = if f.infrastructure { "infrastructure" } else { "script" },
                scriptgate_unit = f.unit.unwrap_or(""),
                scriptgate_trace_id = f.trace_id.unwrap_or(""),
                "script {} of run {} finished: {} ({} calls, {} failed, {} ms){sep}{error}",
                r.script_id, r.run_id, r.status.as_str(), r.calls, r.failures, r.duration_ms
            )
        };
    }
    if priority(r.status, f.infrastructure) == tracing::Level::ERROR {
        entry!(error)
    } else {
        entry!(info)
    }
}

pub fn start_refused(
    e: &Refused,
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
        scriptgate_code = e.code(),
        scriptgate_reason = e.reason().wire().unwrap_or(""),
        "script.start refused for run {}: {} ({})",
        run_id.unwrap_or("?"),
        e.message(),
        e.code()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn priority_is_by_cause() {
        use tracing::Level;
        for st in [
            Status::Ok,
            Status::Error,
            Status::Timeout,
            Status::Oom,
            Status::Limit,
            Status::Cancelled,
        ] {
            assert_eq!(
                priority(st, false),
                Level::INFO,
                "{st:?}: the script's own end is notice"
            );
            assert_eq!(
                priority(st, true),
                Level::ERROR,
                "{st:?}: infrastructure is err"
            );
        }
        assert_eq!(priority(Status::Interrupted, false), Level::ERROR);
    }

    #[test]
    fn the_headline_of_an_error_is_its_exception() {
        assert_eq!(headline(None), "");
        assert_eq!(headline(Some("exit code 3")), "exit code 3");
        let zero = "Traceback (most recent call last):\n  File \"/run/script.py\", line 2, in <module>\n    print(1/0)\n          ~^~\nZeroDivisionError: division by zero\n";
        assert_eq!(headline(Some(zero)), "ZeroDivisionError: division by zero");
        // What the script printed to stderr first does not hide it.
        let noisy = format!("warming up\n{zero}");
        assert_eq!(
            headline(Some(&noisy)),
            "ZeroDivisionError: division by zero"
        );
        // Chained: the last exception is the one that ended the script.
        let chained = "Traceback (most recent call last):\n  File \"s.py\", line 2, in <module>\nKeyError: 'sn'\n\nDuring handling of the above exception, another exception occurred:\n\nTraceback (most recent call last):\n  File \"s.py\", line 4, in <module>\nagent_tools.ToolError: [denied] tool x is not callable\n";
        assert_eq!(
            headline(Some(chained)),
            "agent_tools.ToolError: [denied] tool x is not callable"
        );
        // A SyntaxError's caret lines are indented too.
        let syntax = "  File \"/run/script.py\", line 1\n    print(\n         ^\nSyntaxError: '(' was never closed\n";
        assert_eq!(headline(Some(syntax)), "SyntaxError: '(' was never closed");
        // A tail cut before the exception line says the traceback's first line.
        assert_eq!(
            headline(Some("Traceback (most recent call last):\n  File x")),
            "Traceback (most recent call last):"
        );
    }
}
