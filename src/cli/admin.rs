//! The sysadmin commands: `status`, `ps`, `show`, `cancel`, `audit`. Live state comes
//! from the daemon over its socket (`daemon.info`, `admin.list`, `admin.cancel`);
//! records come from the audit store, read-only, so they work with the daemon down.

use super::run::exit;
use crate::audit::{Query, Reader};
use crate::config::{Config, DEFAULT_PATH};
use crate::protocol::code;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A failed admin command: one line and a distinct exit status.
pub struct AdminError {
    pub code: u8,
    pub message: String,
}

fn err(code: u8, message: impl Into<String>) -> AdminError {
    AdminError {
        code,
        message: message.into(),
    }
}

pub struct Ctx {
    pub socket: PathBuf,
    pub config: Config,
}

impl Ctx {
    pub fn load(socket: Option<PathBuf>, config: Option<PathBuf>) -> Result<Ctx, AdminError> {
        let (path, explicit) = match config {
            Some(p) => (p, true),
            None => (PathBuf::from(DEFAULT_PATH), false),
        };
        let config = Config::load(&path, explicit).map_err(|e| err(exit::SETUP, e.to_string()))?;
        Ok(Ctx {
            socket: socket.unwrap_or_else(|| super::run::DEFAULT_SOCKET.into()),
            config,
        })
    }

    /// One request to the daemon; notifications in between are skipped.
    fn call(&self, method: &str, params: Value) -> Result<Value, AdminError> {
        let mut s = UnixStream::connect(&self.socket).map_err(|e| match e.kind() {
            std::io::ErrorKind::PermissionDenied => err(
                exit::NOT_PERMITTED,
                format!(
                    "permission denied: {}: {e} (root and members of {:?} may connect)",
                    self.socket.display(),
                    self.config.auth.allowed_groups
                ),
            ),
            _ => err(
                exit::DAEMON_DOWN,
                format!("daemon not running: {}: {e}", self.socket.display()),
            ),
        })?;
        s.set_read_timeout(Some(Duration::from_secs(60))).ok();
        writeln!(
            s,
            "{}",
            json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params})
        )
        .map_err(|e| err(exit::DAEMON_DOWN, format!("{}: {e}", self.socket.display())))?;
        let mut r = BufReader::new(s);
        loop {
            let mut line = String::new();
            if r.read_line(&mut line).unwrap_or(0) == 0 {
                return Err(err(
                    exit::DAEMON_DOWN,
                    format!(
                        "{}: the daemon closed the connection",
                        self.socket.display()
                    ),
                ));
            }
            let Ok(msg) = serde_json::from_str::<Value>(&line) else {
                continue;
            };
            if msg.get("method").is_some() {
                continue;
            }
            if let Some(e) = msg.get("error") {
                let c = e["code"].as_i64().unwrap_or(0);
                let m = e["message"].as_str().unwrap_or("error").to_string();
                return Err(match c {
                    code::PEER_NOT_ALLOWED | code::NOT_ADMIN => {
                        err(exit::NOT_PERMITTED, format!("permission denied: {m}"))
                    }
                    code::NOT_FOUND => err(exit::NOT_FOUND, m),
                    _ => err(exit::ERROR, format!("{m} ({c})")),
                });
            }
            return Ok(msg.get("result").cloned().unwrap_or(Value::Null));
        }
    }

    /// The audit store, for root and members of `auth.admin_groups` only.
    fn reader(&self) -> Result<Reader, AdminError> {
        let (uid, gid) = (
            nix::unistd::getuid().as_raw(),
            nix::unistd::getgid().as_raw(),
        );
        if !crate::sys::peer_in_groups(uid, gid, &self.config.auth.admin_groups) {
            return Err(err(
                exit::NOT_PERMITTED,
                format!(
                    "permission denied: the audit store is for root and members of {:?}",
                    self.config.auth.admin_groups
                ),
            ));
        }
        let db = self.config.state.dir.join("scriptgate.db");
        Reader::open(&db).map_err(|e| err(exit::SETUP, e.to_string()))
    }
}

/// Columns aligned to their widest cell.
pub fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut w: Vec<usize> = headers.iter().map(|h| h.len()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            w[i] = w[i].max(c.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let mut s = String::new();
        for (i, c) in cells.iter().enumerate() {
            if i + 1 == cells.len() {
                s.push_str(c);
            } else {
                s.push_str(&format!("{c:<width$}  ", width = w[i]));
            }
        }
        s.trim_end().to_string() + "\n"
    };
    let mut out = line(headers.to_vec());
    for r in rows {
        out.push_str(&line(r.iter().map(String::as_str).collect()));
    }
    out
}

fn ms_human(ms: u64) -> String {
    match ms {
        0..=59_999 => format!("{:.1}s", ms as f64 / 1000.0),
        60_000..=3_599_999 => format!("{}m{:02}s", ms / 60_000, ms / 1000 % 60),
        _ => format!("{}h{:02}m", ms / 3_600_000, ms / 60_000 % 60),
    }
}

fn s(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn pretty(v: &Value) -> String {
    serde_json::to_string_pretty(v).unwrap_or_default() + "\n"
}

pub fn status(ctx: &Ctx, json_out: bool) -> Result<String, AdminError> {
    let info = ctx.call("daemon.info", json!({}))?;
    if json_out {
        return Ok(pretty(&json!({"socket": ctx.socket, "daemon": info})));
    }
    let l = &info["limits"];
    let notes: Vec<String> = info["backend_notes"]
        .as_array()
        .into_iter()
        .flatten()
        .map(s)
        .collect();
    let rows = vec![
        vec!["daemon".into(), format!("running at {}", ctx.socket.display())],
        vec!["version".into(), format!("{} (protocol {})", s(&info["version"]), s(&info["protocol"]))],
        vec!["backend".into(), if notes.is_empty() { s(&info["backend"]) } else { format!("{} ({})", s(&info["backend"]), notes.join("; ")) }],
        vec!["running".into(), format!("{} of {}", s(&info["running"]), s(&l["max_running"]))],
        vec![
            "limits".into(),
            format!(
                "max_calls {}, max_concurrency {}, timeout_s {}, memory {} MiB, tasks {}, return_max_chars {}",
                s(&l["max_calls"]),
                s(&l["max_concurrency"]),
                s(&l["timeout_s"]),
                l["memory_max_bytes"].as_u64().unwrap_or(0) >> 20,
                s(&l["tasks_max"]),
                s(&l["return_max_chars"])
            ),
        ],
    ];
    Ok(table(&["", ""], &rows)
        .lines()
        .skip(1)
        .map(|l| l.to_string() + "\n")
        .collect())
}

pub fn ps(ctx: &Ctx, json_out: bool) -> Result<String, AdminError> {
    let r = ctx.call("admin.list", json!({}))?;
    if json_out {
        return Ok(pretty(&r));
    }
    let mut rows: Vec<Vec<String>> = r["scripts"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|x| {
            let p = &x["progress"];
            let progress = if p.is_null() {
                "-".into()
            } else {
                format!(
                    "{}/{} {}",
                    s(&p["done"]),
                    s(&p["total"]),
                    p["message"].as_str().unwrap_or("")
                )
            };
            vec![
                s(&x["script_id"]),
                s(&x["run_id"]),
                s(&x["uid"]),
                ms_human(x["age_ms"].as_u64().unwrap_or(0)),
                s(&x["calls"]),
                s(&x["failures"]),
                progress.trim_end().to_string(),
                s(&x["unit"]),
            ]
        })
        .collect();
    rows.sort();
    Ok(table(
        &[
            "ID", "RUN", "UID", "AGE", "CALLS", "FAILS", "PROGRESS", "UNIT",
        ],
        &rows,
    ))
}

pub fn cancel(ctx: &Ctx, id: &str, json_out: bool) -> Result<String, AdminError> {
    let r = ctx.call("admin.cancel", json!({"script_id": id}))?;
    Ok(if json_out {
        pretty(&r)
    } else {
        format!("{}: {}\n", s(&r["script_id"]), s(&r["state"]))
    })
}

pub fn show(ctx: &Ctx, id: &str, json_out: bool) -> Result<String, AdminError> {
    let reader = ctx.reader()?;
    let row = reader
        .script(id)
        .map_err(|e| err(exit::SETUP, e.to_string()))?
        .ok_or_else(|| {
            err(
                exit::NOT_FOUND,
                format!("no script {id} in the audit store"),
            )
        })?;
    let dir = Path::new(row["workspace"].as_str().unwrap_or("/"))
        .join(row["details_dir"].as_str().unwrap_or(""));
    let artifacts: Vec<String> = ["script.py", "calls.jsonl", "output.txt", "stderr.txt"]
        .iter()
        .map(|f| dir.join(f).display().to_string())
        .collect();
    if json_out {
        let mut v = row.clone();
        v["artifacts"] = json!(artifacts);
        return Ok(pretty(&v));
    }
    let mut rows = Vec::new();
    for k in [
        "script_id",
        "run_id",
        "runner",
        "status",
        "exit_code",
        "description",
        "peer_uid",
        "peer_pid",
        "run_uid",
        "approval",
        "tools",
        "workspace",
        "details_dir",
        "backend",
        "unit",
        "started_at",
        "ended_at",
        "duration_ms",
        "calls",
        "failures",
        "tool_counts",
        "memory_peak_bytes",
        "cpu_usec",
    ] {
        let v = &row[k];
        let shown = match k {
            "started_at" | "ended_at" if v.is_i64() => {
                crate::broker::rfc3339(v.as_i64().unwrap_or(0))
            }
            "tools" | "tool_counts" => v.to_string(),
            _ => s(v),
        };
        rows.push(vec![k.to_string(), shown]);
    }
    rows.push(vec![
        "artifacts".into(),
        artifacts.join("\n").replace('\n', &format!("\n{:19}", "")),
    ]);
    let mut out: String = table(&["", ""], &rows)
        .lines()
        .skip(1)
        .map(|l| l.to_string() + "\n")
        .collect();
    out.push_str("--- script ---\n");
    out.push_str(row["code"].as_str().unwrap_or(""));
    if !out.ends_with('\n') {
        out.push('\n');
    }
    out.push_str("--- result text ---\n");
    out.push_str(
        row["result"]["text"]
            .as_str()
            .unwrap_or("(still running)\n"),
    );
    Ok(out)
}

/// `--since`: a duration back from now (`90s`, `30m`, `2h`, `7d`, `2w`) or a UTC
/// date (`2026-11-30`) or date-time (`2026-11-30T07:00:00Z`).
pub fn parse_since(v: &str, now_ms: i64) -> Result<i64, String> {
    let bad = || {
        format!("--since {v:?}: give a duration (30m, 2h, 7d) or a date (2026-11-30, 2026-11-30T07:00:00Z)")
    };
    if let Some(unit) = v.chars().last().filter(|c| "smhdw".contains(*c)) {
        if let Ok(n) = v[..v.len() - 1].parse::<i64>() {
            let mult = match unit {
                's' => 1_000,
                'm' => 60_000,
                'h' => 3_600_000,
                'd' => 86_400_000,
                _ => 7 * 86_400_000,
            };
            return Ok(now_ms - n * mult);
        }
    }
    let (date, time) = v.split_once('T').unwrap_or((v, "00:00:00Z"));
    let d: Vec<i64> = date
        .split('-')
        .map(|p| p.parse().map_err(|_| bad()))
        .collect::<Result<_, _>>()?;
    let t: Vec<i64> = time
        .trim_end_matches('Z')
        .split(':')
        .map(|p| p.parse().map_err(|_| bad()))
        .collect::<Result<_, _>>()?;
    let (&[y, m, dd], &[hh, mm, ss]) = (d.as_slice(), t.as_slice()) else {
        return Err(bad());
    };
    if !(1..=12).contains(&m) || !(1..=31).contains(&dd) {
        return Err(bad());
    }
    // Days from civil (Howard Hinnant).
    let y2 = if m <= 2 { y - 1 } else { y };
    let era = y2.div_euclid(400);
    let yoe = y2 - era * 400;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + dd - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146097 + doe - 719468;
    Ok(((days * 86400) + hh * 3600 + mm * 60 + ss) * 1000)
}

/// Rows as pretty JSON, or as a table with one cell per column function.
fn rows_out(
    rows: &[Value],
    json_out: bool,
    headers: &[&str],
    row: impl Fn(&Value) -> Vec<String>,
) -> String {
    if json_out {
        return pretty(&json!(rows));
    }
    table(headers, &rows.iter().map(row).collect::<Vec<_>>())
}

pub fn audit(ctx: &Ctx, q: Query, refusals: bool, json_out: bool) -> Result<String, AdminError> {
    let reader = ctx.reader()?;
    let store = |e: rusqlite::Error| err(exit::SETUP, e.to_string());
    if refusals {
        let rows = reader.refusals(&q).map_err(store)?;
        return Ok(rows_out(
            &rows,
            json_out,
            &["AT", "RUN", "PEER_UID", "CODE", "REASON", "MESSAGE"],
            |r| {
                vec![
                    crate::broker::rfc3339(r["at"].as_i64().unwrap_or(0)),
                    s(&r["run_id"]),
                    s(&r["peer_uid"]),
                    s(&r["code"]),
                    s(&r["reason"]),
                    s(&r["message"]),
                ]
            },
        ));
    }
    let rows = reader.scripts(&q).map_err(store)?;
    Ok(rows_out(
        &rows,
        json_out,
        &[
            "STARTED",
            "SCRIPT",
            "RUN",
            "UID",
            "STATUS",
            "CALLS",
            "FAILS",
            "DURATION",
            "DESCRIPTION",
        ],
        |r| {
            vec![
                crate::broker::rfc3339(r["started_at"].as_i64().unwrap_or(0)),
                s(&r["script_id"]),
                s(&r["run_id"]),
                s(&r["run_uid"]),
                s(&r["status"]),
                s(&r["calls"]),
                s(&r["failures"]),
                r["duration_ms"]
                    .as_u64()
                    .map(ms_human)
                    .unwrap_or_else(|| "-".into()),
                r["description"]
                    .as_str()
                    .unwrap_or("")
                    .chars()
                    .take(40)
                    .collect(),
            ]
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn since_accepts_durations_and_dates() {
        let now = 1_796_000_000_000;
        assert_eq!(parse_since("2h", now).unwrap(), now - 7_200_000);
        assert_eq!(parse_since("7d", now).unwrap(), now - 7 * 86_400_000);
        assert_eq!(parse_since("1970-01-02", now).unwrap(), 86_400_000);
        assert_eq!(
            parse_since("2026-11-30T00:53:20Z", now).unwrap(),
            1_796_000_000_000
        );
        assert!(parse_since("yesterday", now).is_err());
        assert!(parse_since("2026-13-01", now).is_err());
    }

    #[test]
    fn tables_align() {
        let t = table(
            &["A", "LONGER"],
            &[
                vec!["xyz".into(), "1".into()],
                vec!["q".into(), "22".into()],
            ],
        );
        assert_eq!(t, "A    LONGER\nxyz  1\nq    22\n");
    }
}
