//! The journal entries a sysadmin reads: one when a script starts, one when it
//! finishes and one per refused start, each with a fixed MESSAGE_ID explained by the message catalog
//! (systemd/scriptgate.catalog, `journalctl -x`). Through tracing-journald with no
//! field prefix, `scriptgate_run_id` arrives as `SCRIPTGATE_RUN_ID`; without a journal
//! the same fields go to stderr.
//!
//! Much of what an entry says was written by others: the script (its error),
//! the model (the tools a start names, in a refusal's message), the engine (its
//! runner, its workspace's path). Every such text goes through `field`: one
//! line, its unsafe characters escaped (`text::escape`: no newline to forge a
//! second entry or field on stderr or in syslog, no terminal escape for a
//! `journalctl` to replay, no bidirectional override), cut to a bound. The
//! entries are built by pure functions (`started_entry`, `finished_entry`,
//! `refused_entry`),
//! which the tests read.

use crate::protocol::framing::clip;
use crate::protocol::refusal::Refused;
use crate::protocol::{ScriptResult, Status};

/// Bytes of a script's error headline in an entry (`SCRIPTGATE_ERROR`), at
/// most; the whole error is in the audit row and the result.
pub const ERROR_MAX_BYTES: usize = 500;
/// Bytes of a refusal's message in an entry, at most (the audit row keeps it whole).
pub const REFUSAL_MAX_BYTES: usize = 1024;
/// Bytes of a name in an entry (run id, runner, unit, trace id), at most.
pub const NAME_MAX_BYTES: usize = 256;
/// Bytes of a path in an entry (`SCRIPTGATE_WORKSPACE`), at most.
pub const PATH_MAX_BYTES: usize = 4096;

/// Text others wrote, as an entry carries it: unsafe characters escaped
/// visibly (`\x1b`, `\x0a`, `\u202e`), then cut to `max` bytes at a
/// character boundary and marked `…`.
pub fn field(s: &str, max: usize) -> String {
    clip(&crate::text::escape(s), max)
}

/// MESSAGE_ID of "script finished" (fixed forever).
pub const SCRIPT_FINISHED: &str = "346f6012b1654d13bd185a7cfc0553cb";
/// MESSAGE_ID of "script started" (fixed forever): written once the script's
/// audit row exists, before its sandbox is spawned, so every script that has a
/// "finished" entry has had one; a start with no end in a fleet's merged journal
/// is a script still running, or lost with its node (`audit::trail`).
pub const SCRIPT_STARTED: &str = "2b0a0799d99540589c9c0d06c5c5dd49";
/// MESSAGE_ID of "script.start refused" (fixed forever).
pub const START_REFUSED: &str = "e1b3fc3a8d8142699a4d42cc4f6acfcb";

/// What the "script started" entry says about one script.
pub struct Starting<'a> {
    pub script_id: &'a str,
    pub run_id: &'a str,
    pub runner: Option<&'a str>,
    /// The engine's uid (the peer that asked for the start).
    pub engine_uid: u32,
    /// The uid the script runs as.
    pub uid: u32,
    pub unit: Option<&'a str>,
    pub workspace: &'a str,
    /// Its effective timeout: a start with no end past it (and the teardown's
    /// margin) is no longer running anywhere.
    pub timeout_s: u64,
    pub trace_id: Option<&'a str>,
}

/// The "script started" entry: its MESSAGE and fields, escaped and bounded as
/// `FinishedEntry`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StartedEntry {
    pub message: String,
    pub script_id: String,
    pub run_id: String,
    pub runner: String,
    pub engine_uid: u32,
    pub uid: u32,
    pub unit: String,
    pub workspace: String,
    pub timeout_s: u64,
    pub trace_id: String,
}

/// What `script_started` writes. Pure.
pub fn started_entry(s: &Starting) -> StartedEntry {
    let script_id = field(s.script_id, NAME_MAX_BYTES);
    let run_id = field(s.run_id, NAME_MAX_BYTES);
    let runner = field(s.runner.unwrap_or(""), NAME_MAX_BYTES);
    let by = if runner.is_empty() {
        format!("uid {}", s.engine_uid)
    } else {
        format!("{runner}, uid {}", s.engine_uid)
    };
    StartedEntry {
        message: format!(
            "script {script_id} of run {run_id} started (engine {by}; runs as uid {}, timeout {} s)",
            s.uid, s.timeout_s
        ),
        script_id,
        run_id,
        runner,
        engine_uid: s.engine_uid,
        uid: s.uid,
        unit: field(s.unit.unwrap_or(""), NAME_MAX_BYTES),
        workspace: field(s.workspace, PATH_MAX_BYTES),
        timeout_s: s.timeout_s,
        trace_id: field(s.trace_id.unwrap_or(""), NAME_MAX_BYTES),
    }
}

pub fn script_started(s: &Starting) {
    let e = started_entry(s);
    tracing::info!(
        message_id = SCRIPT_STARTED,
        scriptgate_script_id = e.script_id.as_str(),
        scriptgate_run_id = e.run_id.as_str(),
        scriptgate_runner = e.runner.as_str(),
        scriptgate_peer_uid = e.engine_uid,
        scriptgate_uid = e.uid,
        scriptgate_unit = e.unit.as_str(),
        scriptgate_workspace = e.workspace.as_str(),
        scriptgate_timeout_s = e.timeout_s,
        scriptgate_trace_id = e.trace_id.as_str(),
        "{}",
        e.message
    );
}

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

/// The "script finished" entry: its MESSAGE and fields, every text of
/// others escaped and bounded (`field`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FinishedEntry {
    pub level: tracing::Level,
    pub message: String,
    pub script_id: String,
    pub run_id: String,
    pub runner: String,
    pub uid: u32,
    pub status: &'static str,
    pub calls: u64,
    pub failures: u64,
    pub duration_ms: u64,
    pub workspace: String,
    pub details_dir: String,
    pub error: String,
    pub cause: &'static str,
    pub unit: String,
    pub trace_id: String,
}

/// What `script_finished` writes. Pure.
pub fn finished_entry(f: &Finished) -> FinishedEntry {
    let r = f.result;
    let error = field(headline(r.error.as_deref()), ERROR_MAX_BYTES);
    let sep = if error.is_empty() { "" } else { ": " };
    let script_id = field(&r.script_id, NAME_MAX_BYTES);
    let run_id = field(&r.run_id, NAME_MAX_BYTES);
    let message = format!(
        "script {script_id} of run {run_id} finished: {} ({} calls, {} failed, {} ms){sep}{error}",
        r.status.as_str(),
        r.calls,
        r.failures,
        r.duration_ms
    );
    FinishedEntry {
        level: priority(r.status, f.infrastructure),
        message,
        script_id,
        run_id,
        runner: field(f.runner.unwrap_or(""), NAME_MAX_BYTES),
        uid: f.uid,
        status: r.status.as_str(),
        calls: r.calls,
        failures: r.failures,
        duration_ms: r.duration_ms,
        workspace: field(f.workspace, PATH_MAX_BYTES),
        details_dir: field(&r.details_dir, PATH_MAX_BYTES),
        error,
        cause: if f.infrastructure {
            "infrastructure"
        } else {
            "script"
        },
        unit: field(f.unit.unwrap_or(""), NAME_MAX_BYTES),
        trace_id: field(f.trace_id.unwrap_or(""), NAME_MAX_BYTES),
    }
}

pub fn script_finished(f: &Finished) {
    let e = finished_entry(f);
    macro_rules! entry {
        ($level:ident) => {
            tracing::$level!(
                message_id = SCRIPT_FINISHED,
                scriptgate_script_id = e.script_id.as_str(),
                scriptgate_run_id = e.run_id.as_str(),
                scriptgate_runner = e.runner.as_str(),
                scriptgate_uid = e.uid,
                scriptgate_status = e.status,
                scriptgate_calls = e.calls,
                scriptgate_failures = e.failures,
                scriptgate_duration_ms = e.duration_ms,
                scriptgate_workspace = e.workspace.as_str(),
                scriptgate_details_dir = e.details_dir.as_str(),
                scriptgate_error = e.error.as_str(),
                scriptgate_cause = e.cause,
                scriptgate_unit = e.unit.as_str(),
                scriptgate_trace_id = e.trace_id.as_str(),
                "{}",
                e.message
            )
        };
    }
    if e.level == tracing::Level::ERROR {
        entry!(error)
    } else {
        entry!(info)
    }
}

/// The "script.start refused" entry: its MESSAGE and fields, escaped and
/// bounded as `FinishedEntry`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefusedEntry {
    pub message: String,
    pub run_id: String,
    pub runner: String,
    pub peer_uid: u32,
    pub peer_pid: i32,
    pub code: i64,
    pub reason: &'static str,
}

/// What `start_refused` writes. Pure.
pub fn refused_entry(
    e: &Refused,
    run_id: Option<&str>,
    runner: Option<&str>,
    peer_uid: u32,
    peer_pid: Option<i32>,
) -> RefusedEntry {
    let run_id = field(run_id.unwrap_or(""), NAME_MAX_BYTES);
    let message = format!(
        "script.start refused for run {}: {} ({})",
        if run_id.is_empty() { "?" } else { &run_id },
        field(e.message(), REFUSAL_MAX_BYTES),
        e.code()
    );
    RefusedEntry {
        message,
        run_id,
        runner: field(runner.unwrap_or(""), NAME_MAX_BYTES),
        peer_uid,
        peer_pid: peer_pid.unwrap_or(0),
        code: e.code(),
        reason: e.reason().wire().unwrap_or(""),
    }
}

pub fn start_refused(
    e: &Refused,
    run_id: Option<&str>,
    runner: Option<&str>,
    peer_uid: u32,
    peer_pid: Option<i32>,
) {
    let e = refused_entry(e, run_id, runner, peer_uid, peer_pid);
    tracing::warn!(
        message_id = START_REFUSED,
        scriptgate_run_id = e.run_id.as_str(),
        scriptgate_runner = e.runner.as_str(),
        scriptgate_peer_uid = e.peer_uid,
        scriptgate_peer_pid = e.peer_pid,
        scriptgate_code = e.code,
        scriptgate_reason = e.reason,
        "{}",
        e.message
    );
}

/// Refused starts that came faster than the rate limit, counted and summarised
/// (under the same MESSAGE_ID as one refusal, with their number).
pub fn refusals_counted(count: u64, message: &str) {
    let message = field(message, REFUSAL_MAX_BYTES);
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

    /// The fields of every event emitted while `f` runs, as tracing-journald
    /// reads them (a `&str` as it is, anything else by `Debug`, the message
    /// as its formatted text): what it writes to the journal's socket, one
    /// `NAME=value` each.
    fn captured(f: impl FnOnce()) -> Vec<std::collections::BTreeMap<String, String>> {
        use std::sync::{Arc, Mutex};
        use tracing_subscriber::layer::{Context, SubscriberExt};
        type Events = Arc<Mutex<Vec<std::collections::BTreeMap<String, String>>>>;
        struct Capture(Events);
        struct Fields(std::collections::BTreeMap<String, String>);
        impl tracing::field::Visit for Fields {
            fn record_str(&mut self, f: &tracing::field::Field, v: &str) {
                self.0.insert(f.name().to_string(), v.to_string());
            }
            fn record_debug(&mut self, f: &tracing::field::Field, v: &dyn std::fmt::Debug) {
                self.0.insert(f.name().to_string(), format!("{v:?}"));
            }
        }
        impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Capture {
            fn on_event(&self, ev: &tracing::Event<'_>, _: Context<'_, S>) {
                let mut v = Fields(Default::default());
                ev.record(&mut v);
                self.0.lock().unwrap().push(v.0);
            }
        }
        let events: Events = Default::default();
        let sub = tracing_subscriber::registry().with(Capture(events.clone()));
        tracing::subscriber::with_default(sub, f);
        let out = events.lock().unwrap().clone();
        out
    }

    const HOSTILE: &str = "boom\x1b[2J\x1b[1;1H\rFAKE: ok\u{202e}dlrow\u{9b}31m\0";

    fn hostile_result() -> ScriptResult {
        ScriptResult {
            script_id: "4f1c9e0a2b3d5e6f".into(),
            run_id: "run-\u{202e}42".into(),
            status: Status::Error,
            exit_code: Some(1),
            calls: 3,
            failures: 1,
            duration_ms: 120,
            details_dir: ".agent/scripts/4f1c9e0a2b3d5e6f".into(),
            output: String::new(),
            output_truncated: false,
            error: Some(format!(
                "Traceback (most recent call last):\n  File \"s.py\", line 1\nValueError: {HOSTILE}{}\nMESSAGE_ID=forged\n",
                "x".repeat(10_000)
            )),
            text: String::new(),
            memory_peak_bytes: None,
            cpu_usec: None,
            backend_notes: vec![],
            record_incomplete: vec![],
            pre_made: None,
        }
    }

    /// A script's error, an engine's runner and workspace, a model's tool
    /// names: in every field and in MESSAGE, one line, escaped, bounded.
    #[test]
    fn entries_carry_others_text_escaped_and_bounded() {
        let r = hostile_result();
        let runner = format!("gw\nSCRIPTGATE_STATUS=ok{}", "r".repeat(1000));
        let f = Finished {
            result: &r,
            runner: Some(&runner),
            uid: 65534,
            unit: None,
            workspace: "/srv/ws/\x1b]0;owned\x07",
            infrastructure: false,
            trace_id: None,
        };
        let e = finished_entry(&f);
        assert!(
            e.error.starts_with(
                "ValueError: boom\\x1b[2J\\x1b[1;1H\\x0dFAKE: ok\\u202edlrow\\x9b31m\\x00xxx"
            ),
            "{}",
            e.error
        );
        assert!(e.error.ends_with('…') && e.error.len() <= ERROR_MAX_BYTES + 3);
        assert_eq!(e.run_id, "run-\\u202e42");
        assert!(
            e.runner.starts_with("gw\\x0aSCRIPTGATE_STATUS=ok")
                && e.runner.len() <= NAME_MAX_BYTES + 3
        );
        assert_eq!(e.workspace, "/srv/ws/\\x1b]0;owned\\x07");
        assert!(e.message.ends_with(&e.error) && e.message.contains("run run-\\u202e42 finished"));

        let refusal = Refused::new(
            crate::protocol::refusal::Reason::Unknown,
            format!(
                "tool fleet__x\x1b[8m{} is not in this run's snapshot",
                "\u{2028}".repeat(2000)
            ),
        );
        let rf = refused_entry(&refusal, Some("run\u{200b}1"), Some("r\n"), 1000, None);
        assert!(
            rf.message.starts_with(
                "script.start refused for run run\\u200b1: tool fleet__x\\x1b[8m\\u2028"
            ),
            "{}",
            rf.message
        );
        assert!(rf.message.len() <= REFUSAL_MAX_BYTES + 200);
        assert_eq!((rf.runner.as_str(), rf.peer_pid), ("r\\x0a", 0));

        let st = Starting {
            script_id: &r.script_id,
            run_id: &r.run_id,
            runner: Some(&runner),
            engine_uid: 1000,
            uid: 65534,
            unit: Some("scriptgate-4f1c9e0a2b3d5e6f.scope"),
            workspace: "/srv/ws/\x1b]0;owned\x07",
            timeout_s: 1800,
            trace_id: Some("\u{202e}t"),
        };
        let se = started_entry(&st);
        assert!(
            se.message.starts_with("script 4f1c9e0a2b3d5e6f of run run-\\u202e42 started (engine gw\\x0aSCRIPTGATE_STATUS=ok"),
            "{}",
            se.message
        );
        assert!(se
            .message
            .ends_with(", uid 1000; runs as uid 65534, timeout 1800 s)"));
        assert_eq!(se.runner, e.runner);
        assert_eq!(se.workspace, e.workspace);
        assert_eq!(se.trace_id, "\\u202et");

        // What reaches tracing-journald: the same, in every field.
        let events = captured(|| {
            script_started(&st);
            script_finished(&f);
            start_refused(&refusal, Some("run\u{200b}1"), None, 1000, Some(7));
            refusals_counted(5, "5 refusals\nMESSAGE_ID=forged");
        });
        assert_eq!(events.len(), 4);
        assert_eq!(events[0]["message_id"], SCRIPT_STARTED);
        assert_eq!(events[0]["message"], se.message);
        assert_eq!(events[0]["scriptgate_timeout_s"], "1800");
        assert_eq!(events[0]["scriptgate_peer_uid"], "1000");
        let all = events.clone();
        let events = &events[1..];
        assert_eq!(events[0]["message"], e.message);
        assert_eq!(events[0]["scriptgate_error"], e.error);
        assert_eq!(events[0]["scriptgate_runner"], e.runner);
        assert_eq!(events[0]["scriptgate_workspace"], e.workspace);
        assert_eq!(events[0]["message_id"], SCRIPT_FINISHED);
        assert_eq!(events[1]["message"], rf.message);
        assert_eq!(events[2]["message"], "5 refusals\\x0aMESSAGE_ID=forged");
        for ev in &all {
            for (k, v) in ev {
                assert!(
                    !v.chars().any(crate::text::is_unsafe),
                    "{k} holds a control or reordering character: {v:?}"
                );
                assert!(v.len() <= PATH_MAX_BYTES + 1024, "{k}: {} bytes", v.len());
            }
        }
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
