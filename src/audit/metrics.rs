//! `scriptgate metrics`: the Prometheus text format (0.0.4, which node_exporter's
//! textfile collector and OpenMetrics parsers read) from the audit store, which
//! holds the counters (they survive restarts and audit retention), and from
//! `daemon.json`, which the daemon writes to its state directory when it is
//! ready (backend, whether limits are enforced per script). Nothing goes over the
//! socket: scraping never activates or keeps alive a socket-activated daemon.

use super::duration_buckets;
use crate::protocol::{DaemonInfo, Status};
use serde_json::Value;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// The file the daemon describes itself in, under `state.dir`.
pub fn daemon_file(state_dir: &Path) -> PathBuf {
    state_dir.join("daemon.json")
}

/// Write `daemon.json`: what `daemon.info` says (less the running count, which
/// the audit store keeps), the pid and the start time. Atomic (tmp + rename).
pub fn write_daemon_file(state_dir: &Path, info: &DaemonInfo) -> std::io::Result<()> {
    let mut v = serde_json::to_value(info).map_err(std::io::Error::other)?;
    if let Value::Object(m) = &mut v {
        m.remove("running");
        m.insert("pid".into(), std::process::id().into());
        m.insert("started_at_ms".into(), crate::time::now_ms().into());
    }
    write_atomically(&daemon_file(state_dir), &(v.to_string() + "\n"), 0o644)
}

/// Write `text` to `path` through a temporary file in the same directory and a
/// rename, so a reader (node_exporter) sees the old file or the new, never half.
pub fn write_atomically(path: &Path, text: &str, mode: u32) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let name = path
        .file_name()
        .ok_or_else(|| std::io::Error::other(format!("{}: not a file name", path.display())))?;
    let tmp = path.with_file_name(format!(
        ".{}.{}.tmp",
        name.to_string_lossy(),
        std::process::id()
    ));
    let r = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&tmp)?;
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if r.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    r
}

/// What the metrics are made of.
#[derive(Debug, Default)]
pub struct Source {
    /// `(name, label, value)` rows of the audit store's `metrics` table.
    pub counters: Vec<(String, String, f64)>,
    /// Rows still `running`, and their calls and failures so far.
    pub running: crate::audit::RunningCounts,
    /// `daemon.json`, if the daemon has ever been ready.
    pub daemon: Option<Value>,
}

impl Source {
    fn get(&self, name: &str, label: &str) -> f64 {
        self.counters
            .iter()
            .find(|(n, l, _)| n == name && l == label)
            .map_or(0.0, |(_, _, v)| *v)
    }

    fn labelled<'a>(&'a self, name: &'a str) -> impl Iterator<Item = (&'a str, f64)> + 'a {
        self.counters
            .iter()
            .filter(move |(n, _, _)| n == name)
            .map(|(_, l, v)| (l.as_str(), *v))
    }
}

/// A label value, escaped as the text format wants.
fn esc(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn num(v: f64) -> String {
    if v.is_infinite() {
        "+Inf".into()
    } else {
        format!("{v}")
    }
}

fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

/// A family of one sample, without labels.
fn single(out: &mut String, name: &str, kind: &str, help: &str, value: impl std::fmt::Display) {
    family(out, name, kind, help);
    let _ = writeln!(out, "{name} {value}");
}

/// A family of one sample per value of one label.
fn by_label<'a>(
    out: &mut String,
    (name, kind, help): (&str, &str, &str),
    label: &str,
    samples: impl IntoIterator<Item = (&'a str, f64)>,
) {
    family(out, name, kind, help);
    for (value, v) in samples {
        let _ = writeln!(out, "{name}{{{label}=\"{}\"}} {}", esc(value), num(v));
    }
}

/// The metrics text. Pure: the same source gives the same text.
pub fn render(s: &Source) -> String {
    let mut o = String::new();
    scripts_and_calls(&mut o, s);
    durations(&mut o, s);
    if let Some(d) = &s.daemon {
        daemon(&mut o, d);
    }
    o
}

/// Scripts started, finished by status, running; tool calls and failures;
/// refused starts by reason.
fn scripts_and_calls(o: &mut String, s: &Source) {
    single(
        o,
        "scriptgate_scripts_started_total",
        "counter",
        "Scripts started.",
        num(s.get("started", "")),
    );
    by_label(
        o,
        (
            "scriptgate_scripts_finished_total",
            "counter",
            "Scripts finished, by status.",
        ),
        "status",
        Status::FINAL
            .iter()
            .map(|st| (st.as_str(), s.get("finished", st.as_str()))),
    );
    by_label(
        o,
        (
            "scriptgate_sandbox_starts_total",
            "counter",
            "Finished scripts whose daemon kept pre-made sandboxes (sandbox.pool_size), by how each one's sandbox started: pre_made, or cold (none was waiting for its uid, its limits differed, the interpreter was replaced, or the mount failed).",
        ),
        "start",
        ["pre_made", "cold"]
            .into_iter()
            .map(|k| (k, s.get("sandbox_starts", k))),
    );
    single(
        o,
        "scriptgate_scripts_running",
        "gauge",
        "Scripts running now (audit rows still running).",
        s.running.scripts,
    );
    // A script's counts move from its running row to the counters in the one
    // transaction that finishes it, and its row's counts only grow: the sums
    // never go down.
    single(
        o,
        "scriptgate_tool_calls_total",
        "counter",
        "Tool calls (of running scripts: as of their last checkpoint, every 2 s).",
        num(s.get("calls", "") + s.running.calls as f64),
    );
    single(
        o,
        "scriptgate_tool_call_failures_total",
        "counter",
        "Tool calls that failed (of running scripts: as of their last checkpoint).",
        num(s.get("failures", "") + s.running.failures as f64),
    );
    by_label(
        o,
        (
            "scriptgate_start_refusals_total",
            "counter",
            "Refused script.start requests, by reason.",
        ),
        "reason",
        s.labelled("refusals"),
    );
    by_label(
        o,
        (
            "scriptgate_connections_refused_total",
            "counter",
            "Connections refused at the socket, by reason (written every 10 s).",
        ),
        "reason",
        s.labelled("connections_refused"),
    );
}

/// The script-duration histogram.
fn durations(o: &mut String, s: &Source) {
    let name = "scriptgate_script_duration_seconds";
    family(
        o,
        name,
        "histogram",
        "Wall-clock duration of finished scripts.",
    );
    for (le, _) in duration_buckets() {
        let _ = writeln!(
            o,
            "{name}_bucket{{le=\"{le}\"}} {}",
            num(s.get("duration_bucket", &le))
        );
    }
    let _ = writeln!(o, "{name}_sum {}", num(s.get("duration_sum", "")));
    let _ = writeln!(o, "{name}_count {}", num(s.get("duration_count", "")));
}

/// What the daemon last started with (`daemon.json`): version and backend,
/// whether limits are its own and in force, the sandbox, the start time.
fn daemon(o: &mut String, d: &Value) {
    let text = |k: &str| d[k].as_str().unwrap_or("").to_string();
    family(
        o,
        "scriptgate_daemon_info",
        "gauge",
        "The daemon last started: version and limit backend (value 1).",
    );
    let _ = writeln!(
        o,
        "scriptgate_daemon_info{{version=\"{}\",backend=\"{}\"}} 1",
        esc(&text("version")),
        esc(&text("backend"))
    );
    single(o, "scriptgate_limits_enforced_per_script", "gauge", "1 when each script has limits of its own (systemd or cgroup backend), 0 when scripts of one uid share them (rlimit).", u8::from(d["limits_per_script"].as_bool().unwrap_or(false)));
    if let Some(enforced) = d["limits_enforced"].as_bool() {
        single(o, "scriptgate_limits_enforced", "gauge", "1 when the start-up read-back found the configured limits in force, 0 when it did not (scriptgate status says which).", u8::from(enforced));
    }
    if let Some(state) = d["sandbox"]["state"].as_str() {
        single(o, "scriptgate_sandbox_available", "gauge", "1 when the start-up preflight made a sandbox as the script uid, 0 when it could not (or did not check).", u8::from(state == "ok"));
    }
    if let Some(ms) = d["started_at_ms"].as_i64() {
        single(
            o,
            "scriptgate_daemon_start_time_seconds",
            "gauge",
            "When the daemon last became ready, in seconds since the epoch.",
            ms as f64 / 1000.0,
        );
    }
}

/// Read the source: the audit store (read-only) and `daemon.json`.
/// No audit store yet (no script ever ran): every counter at 0, and what the
/// daemon last started with, if it ever became ready.
impl Source {
    pub fn fresh(state_dir: &Path) -> Source {
        Source {
            counters: vec![],
            running: Default::default(),
            daemon: std::fs::read_to_string(daemon_file(state_dir))
                .ok()
                .and_then(|t| serde_json::from_str(&t).ok()),
        }
    }
}

/// Why the source could not be read.
#[derive(Debug, thiserror::Error)]
pub enum CollectError {
    /// The audit store's counters or its running rows could not be read.
    #[error("audit store: {0}")]
    AuditStore(#[from] rusqlite::Error),
}

pub fn collect(reader: &crate::audit::Reader, state_dir: &Path) -> Result<Source, CollectError> {
    let counters = reader.metrics()?;
    let running = reader.running_counts()?;
    let daemon = std::fs::read_to_string(daemon_file(state_dir))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok());
    Ok(Source {
        counters,
        running,
        daemon,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_ordered_and_end_with_inf() {
        let b = duration_buckets();
        assert!(b.windows(2).all(|w| w[0].1 < w[1].1));
        assert_eq!(b.last().unwrap().0, "+Inf");
        assert_eq!(b[0].0, "0.1");
    }

    #[test]
    fn render_lists_every_status_escapes_labels_and_omits_an_unknown_daemon() {
        let s = Source {
            counters: vec![
                ("finished".into(), "ok".into(), 2.0),
                ("sandbox_starts".into(), "pre_made".into(), 3.0),
                ("refusals".into(), "we\"ird\n".into(), 1.0),
                ("calls".into(), "".into(), 10.0),
            ],
            running: crate::audit::RunningCounts {
                scripts: 1,
                calls: 4,
                failures: 2,
            },
            daemon: None,
        };
        let t = render(&s);
        assert!(
            t.contains("scriptgate_scripts_finished_total{status=\"ok\"} 2\n"),
            "{t}"
        );
        assert!(
            t.contains("scriptgate_scripts_finished_total{status=\"oom\"} 0\n"),
            "{t}"
        );
        assert!(
            t.contains("scriptgate_start_refusals_total{reason=\"we\\\"ird\\n\"} 1\n"),
            "{t}"
        );
        assert!(t.contains("scriptgate_scripts_running 1\n"), "{t}");
        assert!(
            t.contains("scriptgate_sandbox_starts_total{start=\"pre_made\"} 3\n")
                && t.contains("scriptgate_sandbox_starts_total{start=\"cold\"} 0\n"),
            "{t}"
        );
        // Finished scripts' calls and the running ones' so far.
        assert!(t.contains("scriptgate_tool_calls_total 14\n"), "{t}");
        assert!(t.contains("scriptgate_tool_call_failures_total 2\n"), "{t}");
        assert!(!t.contains("scriptgate_daemon_info"), "{t}");
        for line in t.lines().filter(|l| !l.starts_with('#')) {
            assert!(line.starts_with("scriptgate_"), "{line}");
        }
    }

    /// The exposition format is what node_exporter and dashboards read: any
    /// change to it is reviewed as a diff of `tests/fixtures/metrics.prom`.
    #[test]
    fn the_exposition_matches_the_golden_file() {
        let s = Source {
            counters: vec![
                ("started".into(), "".into(), 7.0),
                ("finished".into(), "ok".into(), 5.0),
                ("finished".into(), "timeout".into(), 1.0),
                ("calls".into(), "".into(), 120.0),
                ("failures".into(), "".into(), 3.0),
                ("refusals".into(), "signature".into(), 2.0),
                (
                    "connections_refused".into(),
                    "peer_not_allowed".into(),
                    3001.0,
                ),
                ("duration_bucket".into(), "0.5".into(), 4.0),
                ("duration_bucket".into(), "+Inf".into(), 6.0),
                ("duration_sum".into(), "".into(), 12.5),
                ("duration_count".into(), "".into(), 6.0),
            ],
            running: crate::audit::RunningCounts {
                scripts: 1,
                calls: 0,
                failures: 0,
            },
            daemon: Some(serde_json::json!({
                "version": "0.1.0", "backend": "systemd", "limits_per_script": true,
                "limits_enforced": true, "sandbox": {"state": "ok"},
                "started_at_ms": 1_796_000_000_123_i64})),
        };
        crate::golden::check("metrics.prom", &render(&s));
    }

    #[test]
    fn write_atomically_replaces_the_file() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("m.prom");
        write_atomically(&p, "a 1\n", 0o644).unwrap();
        write_atomically(&p, "a 2\n", 0o644).unwrap();
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "a 2\n");
        assert_eq!(
            std::fs::read_dir(d.path()).unwrap().count(),
            1,
            "no temporary file left"
        );
    }
}
