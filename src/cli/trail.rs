//! `scriptgate audit --journal`: the fleet's trail (`audit::trail`) from the
//! journal, read with `journalctl -o json`, newest first, the entries of uid 0
//! only (any local user may write to the journal): this host's journals and
//! every one merged into them (`--merge`, which takes in what
//! systemd-journal-remote received under /var/log/journal/remote), or the files
//! of `--directory`.

use crate::audit::journal::{SCRIPT_FINISHED, SCRIPT_STARTED};
use crate::audit::trail::{Filter, Report, State, Trail, FIELDS, GRACE_MS};
use crate::cli::exit::Failure;
use crate::cli::table::table;
use crate::time::{human_ms, rfc3339};
use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};

/// The trail's report as text (a table and a summary) or JSON.
pub fn audit_journal(
    directory: Option<&Path>,
    filter: &Filter,
    as_of_ms: i64,
    json_out: bool,
) -> Result<String, Failure> {
    let mut cmd = Command::new("journalctl");
    cmd.args(["--no-pager", "--reverse", "-o", "json"])
        .arg(format!("--output-fields={}", FIELDS.join(",")));
    match directory {
        Some(d) => cmd.arg("--directory").arg(d),
        None => cmd.arg("--merge"),
    };
    if let Some(t) = filter.since_ms {
        // The starts from then on (their ends come later still).
        cmd.arg(format!("--since=@{}", t.div_euclid(1000)));
    }
    cmd.arg(format!("MESSAGE_ID={SCRIPT_STARTED}"))
        .arg(format!("MESSAGE_ID={SCRIPT_FINISHED}"))
        .arg("_UID=0")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().map_err(|e| {
        Failure::setup(format!(
            "cannot run journalctl ({e}): --journal reads the journal with it (package systemd)"
        ))
    })?;
    // Its warnings are read beside its output (a pipe that fills would stop
    // it): the first 4 KiB kept, the rest read and dropped.
    let stderr = child.stderr.take().expect("piped");
    let warnings = std::thread::spawn(move || {
        let mut err = String::new();
        let mut stderr = stderr;
        let _ = stderr.by_ref().take(4096).read_to_string(&mut err);
        let _ = std::io::copy(&mut stderr, &mut std::io::sink());
        err
    });
    let mut trail = Trail::default();
    let stdout = child.stdout.take().expect("piped");
    let read = trail.read(std::io::BufReader::new(stdout));
    let err = warnings.join().unwrap_or_default();
    let status = child
        .wait()
        .map_err(|e| Failure::setup(format!("journalctl: {e}")))?;
    read.map_err(|e| Failure::setup(format!("reading journalctl's output: {e}")))?;
    if !status.success() {
        return Err(Failure::setup(format!(
            "journalctl failed ({status}): {}",
            err.trim()
        )));
    }
    let report = trail.report(filter, as_of_ms);
    if json_out {
        return Ok(serde_json::to_string_pretty(&report).expect("a report serializes") + "\n");
    }
    Ok(render(&report, !err.trim().is_empty(), &err))
}

fn render(r: &Report, warned: bool, err: &str) -> String {
    let rows: Vec<Vec<String>> = r
        .scripts
        .iter()
        .map(|s| {
            let sc = &s.script;
            let engine = match (sc.runner.as_str(), sc.engine_uid) {
                ("", Some(u)) => format!("uid {u}"),
                (n, Some(u)) => format!("{n} (uid {u})"),
                (n, None) => n.to_string(),
            };
            let status = match s.state {
                State::Ended | State::NoStart => sc.status.clone().unwrap_or_default(),
                State::Running => "running".into(),
                State::Lost => "LOST (no end)".into(),
            };
            vec![
                sc.started_ms.map(rfc3339).unwrap_or_else(|| "-".into()),
                sc.host.clone(),
                sc.script_id.clone(),
                sc.run_id.clone(),
                engine,
                status,
                sc.duration_ms.map(human_ms).unwrap_or_default(),
            ]
        })
        .collect();
    let mut out = String::new();
    if !rows.is_empty() {
        out += &table(
            &[
                "STARTED", "HOST", "SCRIPT", "RUN", "ENGINE", "STATUS", "DURATION",
            ],
            &rows,
        );
    }
    let n = |k: &str| r.states.get(k).copied().unwrap_or(0);
    let statuses: Vec<String> = r.statuses.iter().map(|(k, v)| format!("{k} {v}")).collect();
    out += &format!(
        "{} on {}{}: {} ended{}, {} running, {} lost (no end received {} s past their timeout, as of {}: their node died with them, or their end never reached this journal)",
        count(r.matched, "script", "scripts"),
        count(r.hosts.len(), "host", "hosts"),
        if r.matched > r.scripts.len() {
            format!(" (the latest {} shown)", r.scripts.len())
        } else {
            String::new()
        },
        n("ended"),
        if statuses.is_empty() {
            String::new()
        } else {
            format!(" ({})", statuses.join(", "))
        },
        n("running"),
        n("lost"),
        GRACE_MS / 1000,
        rfc3339(r.as_of_ms),
    );
    out.push('\n');
    if n("no start entry") > 0 {
        out += &format!(
            "{} ended with no start entry read (started before --since, or written before scriptgate wrote start entries)\n",
            n("no start entry")
        );
    }
    if r.duplicates > 0 {
        out += &format!(
            "{} entries were there twice (the same script's start or end): counted once\n",
            r.duplicates
        );
    }
    if r.truncated {
        out += &format!(
            "only the newest {} scripts were kept: narrow it with --since\n",
            crate::audit::trail::MAX_SCRIPTS
        );
    }
    if warned {
        out += &format!("journalctl said: {}\n", err.trim());
    }
    out
}

fn count(n: usize, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}
