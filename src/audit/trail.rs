//! A fleet's audit trail, read from its merged journal (`scriptgate audit
//! --journal`): each host writes a "script started" and a "script finished"
//! entry per script (`audit::journal`), and `systemd-journal-remote` (or an
//! OpenTelemetry collector) gathers them in one place. This pairs them by script
//! id and answers what the local store answers, across hosts: which scripts ran
//! where, by which engine, how they ended, and which started and never ended
//! here ("lost": no end received by their timeout and `GRACE_MS`; their node
//! died with them, or their end never reached this journal; a killed daemon
//! that comes back writes their end itself, as "interrupted").
//!
//! What it trusts: the entries of uid 0 (the CLI asks journalctl for `_UID=0`
//! only: any local user may write to the journal), each host for its own
//! scripts (they are keyed by host and script id, so no host's entries can
//! stand in for another's; a host's root can write anything about that host).
//!
//! Pure: it reads `journalctl -o json` lines, newest first, from any `BufRead`
//! (the command is the CLI's). What it holds is bounded: lines over
//! `MAX_LINE_BYTES` are skipped and counted, an entry whose script id is not
//! one scriptgate makes is skipped, every text is cut to `NAME_MAX_BYTES`, and
//! past `MAX_SCRIPTS` scripts (the newest) it takes in no new one, only the
//! other entry of those it holds, and says so (narrow with --since).

use crate::audit::journal::NAME_MAX_BYTES;
use crate::protocol::framing::clip;
use serde::Serialize;
use serde_json::Value;
use std::collections::{BTreeMap, HashMap};
use std::io::BufRead;

/// Past its timeout, how long a script's end may take to be written (the
/// sandbox killed and reaped, the result recorded) before a start with no end
/// counts as lost.
pub const GRACE_MS: i64 = 120_000;
/// Scripts held at most (the newest): about 1 KiB each at most.
pub const MAX_SCRIPTS: usize = 100_000;
/// A longer line is not one of scriptgate's entries (theirs are bounded,
/// `audit::journal`): skipped, counted.
pub const MAX_LINE_BYTES: usize = 64 * 1024;

/// The journal fields the trail reads (`journalctl --output-fields=`);
/// `__REALTIME_TIMESTAMP` comes with every entry.
pub const FIELDS: &[&str] = &[
    "MESSAGE_ID",
    "_HOSTNAME",
    "SCRIPTGATE_SCRIPT_ID",
    "SCRIPTGATE_RUN_ID",
    "SCRIPTGATE_RUNNER",
    "SCRIPTGATE_PEER_UID",
    "SCRIPTGATE_UID",
    "SCRIPTGATE_TIMEOUT_S",
    "SCRIPTGATE_STATUS",
    "SCRIPTGATE_DURATION_MS",
    "SCRIPTGATE_CALLS",
    "SCRIPTGATE_ERROR",
];

/// Where a script is, as far as the trail knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
pub enum State {
    /// Both entries: its status is the end's.
    Ended,
    /// Started, no end yet, within its timeout (and the grace).
    Running,
    /// Started, no end received by its timeout and the grace: its node died
    /// with it and never came back (a daemon that restarts ends it as
    /// interrupted), or its end never reached this journal.
    Lost,
    /// An end with no start: it started before the window read, or its start
    /// entry never reached this journal.
    NoStart,
}

impl State {
    pub fn as_str(self) -> &'static str {
        match self {
            State::Ended => "ended",
            State::Running => "running",
            State::Lost => "lost",
            State::NoStart => "no start entry",
        }
    }
}

/// One script, from its two entries.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct Script {
    pub script_id: String,
    pub host: String,
    pub run_id: String,
    pub runner: String,
    /// The engine's uid (the start entry's).
    pub engine_uid: Option<u32>,
    /// The uid it ran as.
    pub uid: Option<u32>,
    pub started_ms: Option<i64>,
    pub ended_ms: Option<i64>,
    pub timeout_s: Option<u64>,
    /// The end's status (`ok`, `error`, `interrupted`, ...).
    pub status: Option<String>,
    pub duration_ms: Option<u64>,
    pub calls: Option<u64>,
    pub error: String,
    #[serde(skip)]
    state: Option<State>,
}

impl Script {
    pub fn state(&self) -> State {
        self.state.unwrap_or(State::NoStart)
    }
    /// When it started, or ended for one whose start is not in the journal.
    pub fn at_ms(&self) -> i64 {
        self.started_ms.or(self.ended_ms).unwrap_or(0)
    }
}

/// The entries read so far.
#[derive(Debug, Default)]
pub struct Trail {
    /// By host and script id.
    scripts: HashMap<(String, String), Script>,
    /// A second start or end of a script already seen (an upload sent twice).
    pub duplicates: u64,
    /// Lines that are not an entry of ours: too long, not JSON, no script id.
    pub skipped: u64,
    /// `MAX_SCRIPTS` was reached: older scripts were left out.
    pub truncated: bool,
}

/// What to show of a trail.
#[derive(Debug, Default, Clone)]
pub struct Filter {
    pub host: Option<String>,
    pub since_ms: Option<i64>,
    pub run_id: Option<String>,
    /// An end's status, or `running`, `lost`.
    pub status: Option<String>,
    pub engine_uid: Option<u32>,
    /// Started by an engine of this uid, or ran as it.
    pub uid: Option<u32>,
    pub lost_only: bool,
    pub limit: usize,
}

/// The answer: the scripts shown (latest `limit`, oldest first) and the counts
/// over every script that matched.
#[derive(Debug, Serialize)]
pub struct Report {
    pub as_of_ms: i64,
    pub scripts: Vec<ScriptOut>,
    /// Matched in all (before `limit`).
    pub matched: usize,
    /// Scripts per host.
    pub hosts: BTreeMap<String, usize>,
    /// Per state: ended, running, lost, no start entry.
    pub states: BTreeMap<&'static str, usize>,
    /// Ended ones per status.
    pub statuses: BTreeMap<String, usize>,
    pub duplicates: u64,
    pub skipped: u64,
    pub truncated: bool,
}

#[derive(Debug, Serialize)]
pub struct ScriptOut {
    #[serde(flatten)]
    pub script: Script,
    pub state: State,
}

fn text(v: &Value) -> Option<&str> {
    v.as_str()
}

fn num<T: std::str::FromStr>(v: &Value) -> Option<T> {
    v.as_str().and_then(|s| s.parse().ok())
}

impl Trail {
    /// Read `journalctl -o json` output to its end (or to `MAX_SCRIPTS`).
    pub fn read(&mut self, mut r: impl BufRead) -> std::io::Result<()> {
        let mut line = Vec::new();
        loop {
            match read_bounded_line(&mut r, &mut line, MAX_LINE_BYTES)? {
                Line::End => return Ok(()),
                Line::TooLong => self.skipped += 1,
                Line::Full => self.add(&line),
            }
        }
    }

    /// One entry (a line of `journalctl -o json`).
    pub fn add(&mut self, line: &[u8]) {
        let Ok(Value::Object(e)) = serde_json::from_slice::<Value>(line) else {
            self.skipped += 1;
            return;
        };
        let field = |k: &str| e.get(k).unwrap_or(&Value::Null);
        let started = match text(field("MESSAGE_ID")) {
            Some(crate::audit::journal::SCRIPT_STARTED) => true,
            Some(crate::audit::journal::SCRIPT_FINISHED) => false,
            _ => {
                self.skipped += 1;
                return;
            }
        };
        // 16 hex digits, as the daemon makes them (daemon::start).
        let Some(id) = text(field("SCRIPTGATE_SCRIPT_ID"))
            .filter(|s| s.len() == 16 && s.bytes().all(|b| b.is_ascii_hexdigit()))
        else {
            self.skipped += 1;
            return;
        };
        let host = clip(text(field("_HOSTNAME")).unwrap_or(""), NAME_MAX_BYTES);
        // Microseconds since the epoch, as journald stamps it.
        let at_ms = num::<i64>(field("__REALTIME_TIMESTAMP")).map(|us| us / 1000);
        let key = (host, id.to_string());
        if !self.scripts.contains_key(&key) && self.scripts.len() >= MAX_SCRIPTS {
            // Read newest first: what is left out is older than all it holds.
            self.truncated = true;
            return;
        }
        let s = self
            .scripts
            .entry(key)
            .or_insert_with_key(|(host, id)| Script {
                script_id: id.clone(),
                host: host.clone(),
                ..Script::default()
            });
        let seen = if started {
            s.started_ms.is_some()
        } else {
            s.ended_ms.is_some()
        };
        if seen {
            self.duplicates += 1;
            return;
        }
        let fill = |slot: &mut String, k: &str| {
            if slot.is_empty() {
                if let Some(v) = text(field(k)) {
                    *slot = clip(v, NAME_MAX_BYTES);
                }
            }
        };
        fill(&mut s.run_id, "SCRIPTGATE_RUN_ID");
        fill(&mut s.runner, "SCRIPTGATE_RUNNER");
        s.uid = s.uid.or(num(field("SCRIPTGATE_UID")));
        if started {
            s.started_ms = Some(at_ms.unwrap_or(0));
            s.engine_uid = num(field("SCRIPTGATE_PEER_UID"));
            s.timeout_s = num(field("SCRIPTGATE_TIMEOUT_S"));
        } else {
            s.ended_ms = Some(at_ms.unwrap_or(0));
            s.status = text(field("SCRIPTGATE_STATUS")).map(|v| clip(v, NAME_MAX_BYTES));
            s.duration_ms = num(field("SCRIPTGATE_DURATION_MS"));
            s.calls = num(field("SCRIPTGATE_CALLS"));
            fill(&mut s.error, "SCRIPTGATE_ERROR");
        }
    }

    /// The scripts that match `f`, each in its state as of `as_of_ms`.
    pub fn report(self, f: &Filter, as_of_ms: i64) -> Report {
        let mut all: Vec<Script> = self
            .scripts
            .into_values()
            // As of then: what started later is not there yet, an end written
            // later not yet written.
            .filter(|s| s.started_ms.is_none_or(|t| t <= as_of_ms))
            .filter_map(|mut s| {
                if s.ended_ms.is_some_and(|t| t > as_of_ms) {
                    // An end with no start, later than then: nothing of it yet.
                    s.started_ms?;
                    (s.ended_ms, s.status, s.duration_ms, s.calls) = (None, None, None, None);
                    s.error.clear();
                }
                s.state = Some(state_of(&s, as_of_ms));
                Some(s)
            })
            .filter(|s| matches(s, f))
            .collect();
        all.sort_by(|a, b| (a.at_ms(), &a.script_id).cmp(&(b.at_ms(), &b.script_id)));
        let mut hosts = BTreeMap::new();
        let mut states = BTreeMap::new();
        let mut statuses = BTreeMap::new();
        for s in &all {
            *hosts.entry(s.host.clone()).or_insert(0) += 1;
            *states.entry(s.state().as_str()).or_insert(0) += 1;
            if let (State::Ended, Some(st)) = (s.state(), &s.status) {
                *statuses.entry(st.clone()).or_insert(0) += 1;
            }
        }
        let matched = all.len();
        let shown = all.split_off(matched.saturating_sub(f.limit.max(1)));
        Report {
            as_of_ms,
            scripts: shown
                .into_iter()
                .map(|s| ScriptOut {
                    state: s.state(),
                    script: s,
                })
                .collect(),
            matched,
            hosts,
            states,
            statuses,
            duplicates: self.duplicates,
            skipped: self.skipped,
            truncated: self.truncated,
        }
    }
}

/// Ended when its end is in; else lost once past its timeout and the grace.
fn state_of(s: &Script, as_of_ms: i64) -> State {
    match (s.started_ms, s.ended_ms) {
        (_, Some(_)) if s.started_ms.is_none() => State::NoStart,
        (_, Some(_)) => State::Ended,
        (Some(t0), None) => {
            let bound = s.timeout_s.map_or(i64::MAX, |t| {
                let t = i64::try_from(t).unwrap_or(i64::MAX);
                t0.saturating_add(t.saturating_mul(1000))
                    .saturating_add(GRACE_MS)
            });
            if as_of_ms > bound {
                State::Lost
            } else {
                State::Running
            }
        }
        (None, None) => State::NoStart,
    }
}

fn matches(s: &Script, f: &Filter) -> bool {
    let state = s.state();
    f.host.as_ref().is_none_or(|h| &s.host == h)
        && f.since_ms.is_none_or(|t| s.at_ms() >= t)
        && f.run_id.as_ref().is_none_or(|r| &s.run_id == r)
        && f.engine_uid.is_none_or(|u| s.engine_uid == Some(u))
        && f.uid
            .is_none_or(|u| s.engine_uid == Some(u) || s.uid == Some(u))
        && f.status
            .as_ref()
            .is_none_or(|st| s.status.as_ref() == Some(st) || state.as_str() == st.as_str())
        && (!f.lost_only || state == State::Lost)
}

enum Line {
    Full,
    TooLong,
    End,
}

/// The next line into `buf` (without its newline), if it has at most `max`
/// bytes; a longer one is read past without being kept.
fn read_bounded_line(r: &mut impl BufRead, buf: &mut Vec<u8>, max: usize) -> std::io::Result<Line> {
    buf.clear();
    let mut too_long = false;
    let mut any = false;
    loop {
        let chunk = r.fill_buf()?;
        if chunk.is_empty() {
            return Ok(match (any, too_long) {
                (false, _) => Line::End,
                (true, true) => Line::TooLong,
                (true, false) => Line::Full,
            });
        }
        any = true;
        let (part, done) = match chunk.iter().position(|&b| b == b'\n') {
            Some(i) => (&chunk[..i], Some(i + 1)),
            None => (chunk, None),
        };
        if !too_long && buf.len() + part.len() <= max {
            buf.extend_from_slice(part);
        } else {
            too_long = true;
            buf.clear();
        }
        let used = done.unwrap_or(chunk.len());
        r.consume(used);
        if done.is_some() {
            return Ok(if too_long { Line::TooLong } else { Line::Full });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::audit::journal::{SCRIPT_FINISHED, SCRIPT_STARTED};
    use serde_json::json;

    /// A script id as the daemon makes them, from a short name.
    fn id(name: &str) -> String {
        format!(
            "{:0>16}",
            name.bytes()
                .map(|b| format!("{:x}", b % 16))
                .collect::<String>()
        )
    }

    fn start(host: &str, name: &str, at_s: i64, timeout_s: u64) -> String {
        json!({"MESSAGE_ID": SCRIPT_STARTED, "_HOSTNAME": host, "SCRIPTGATE_SCRIPT_ID": id(name),
            "SCRIPTGATE_RUN_ID": "run-1", "SCRIPTGATE_RUNNER": "gw", "SCRIPTGATE_PEER_UID": "1000",
            "SCRIPTGATE_UID": "65534", "SCRIPTGATE_TIMEOUT_S": timeout_s.to_string(),
            "__REALTIME_TIMESTAMP": (at_s * 1_000_000).to_string()})
        .to_string()
    }

    fn end(host: &str, name: &str, at_s: i64, status: &str) -> String {
        json!({"MESSAGE_ID": SCRIPT_FINISHED, "_HOSTNAME": host, "SCRIPTGATE_SCRIPT_ID": id(name),
            "SCRIPTGATE_RUN_ID": "run-1", "SCRIPTGATE_STATUS": status, "SCRIPTGATE_DURATION_MS": "1500",
            "SCRIPTGATE_UID": "65534", "__REALTIME_TIMESTAMP": (at_s * 1_000_000).to_string()})
        .to_string()
    }

    fn all() -> Filter {
        Filter {
            limit: 1000,
            ..Filter::default()
        }
    }

    fn read(lines: &[String]) -> Trail {
        let mut t = Trail::default();
        t.read(lines.join("\n").as_bytes()).unwrap();
        t
    }

    fn copy(t: &Trail) -> Trail {
        Trail {
            scripts: t.scripts.clone(),
            ..Trail::default()
        }
    }

    #[test]
    fn starts_and_ends_pair_across_hosts_and_a_start_with_no_end_is_lost_past_its_timeout() {
        // Newest first, as journalctl -r gives them.
        let lines = [
            start("node-3", "c2", 400, 60),
            // An upload sent twice: counted, not a second script.
            end("node-2", "b1", 104, "interrupted"),
            end("node-2", "b1", 104, "interrupted"),
            start("node-3", "c1", 103, 60),
            end("node-1", "a1", 102, "ok"),
            start("node-2", "b1", 101, 60),
            start("node-1", "a1", 100, 60),
            start("node-1", "a1", 100, 60),
            // Its start was before the window read.
            end("node-2", "z9", 90, "ok"),
            // The same id on another host is another script: no host stands
            // in for another.
            end("node-3", "a1", 95, "error"),
            "not json".into(),
            json!({"MESSAGE_ID": "other", "SCRIPTGATE_SCRIPT_ID": id("x")}).to_string(),
            json!({"MESSAGE_ID": SCRIPT_STARTED, "SCRIPTGATE_SCRIPT_ID": "../../not-an-id"})
                .to_string(),
        ];
        let t = read(&lines);
        assert_eq!((t.duplicates, t.skipped, t.truncated), (2, 3, false));
        // As of 300 s: c1 started at 103 with 60 s, so lost after 283 s; c2 has not started.
        let r = copy(&t).report(&all(), 300_000);
        let got: Vec<(String, &str, State)> = r
            .scripts
            .iter()
            .map(|s| (s.script.script_id.clone(), s.script.host.as_str(), s.state))
            .collect();
        assert_eq!(
            got,
            [
                (id("z9"), "node-2", State::NoStart),
                (id("a1"), "node-3", State::NoStart),
                (id("a1"), "node-1", State::Ended),
                (id("b1"), "node-2", State::Ended),
                (id("c1"), "node-3", State::Lost),
            ]
        );
        assert_eq!(r.hosts["node-3"], 2);
        assert_eq!((r.states["ended"], r.states["lost"]), (2, 1));
        // Statuses count the ended ones only.
        assert_eq!(
            r.statuses,
            BTreeMap::from([("interrupted".into(), 1), ("ok".into(), 1)])
        );
        let a1 = &r.scripts[2].script;
        assert_eq!(
            (a1.engine_uid, a1.uid, a1.status.as_deref()),
            (Some(1000), Some(65534), Some("ok"))
        );
        assert_eq!(
            (a1.started_ms, a1.ended_ms, a1.duration_ms),
            (Some(100_000), Some(102_000), Some(1500))
        );
        // Later, c2 runs; earlier, b1 had not ended yet and c1 not started.
        let r = copy(&t).report(&all(), 410_000);
        assert_eq!(r.states["running"], 1);
        let r = copy(&t).report(&all(), 102_500);
        assert_eq!(
            (r.states["ended"], r.states["running"]),
            (1, 1),
            "{:?}",
            r.states
        );
    }

    #[test]
    fn the_boundary_of_lost_is_the_timeout_plus_the_grace_and_a_huge_timeout_never_wraps() {
        let mut t = Trail::default();
        t.add(start("h", "a", 0, 10).as_bytes());
        let at = |ms| copy(&t).report(&all(), ms).scripts[0].state;
        assert_eq!(at(10_000 + GRACE_MS), State::Running);
        assert_eq!(at(10_000 + GRACE_MS + 1), State::Lost);
        for huge in [u64::MAX, 1 << 63, (i64::MAX as u64) / 1000 + 1] {
            let mut t = Trail::default();
            t.add(start("h", "a", 1, huge).as_bytes());
            assert_eq!(
                t.report(&all(), i64::MAX).scripts[0].state,
                State::Running,
                "{huge}"
            );
        }
    }

    #[test]
    fn filters_and_the_limit_keep_the_latest() {
        let mut t = Trail::default();
        for i in 0..10 {
            let host = if i % 2 == 0 { "even" } else { "odd" };
            t.add(start(host, &format!("s{i}"), i, 600).as_bytes());
        }
        t.add(end("even", "s0", 20, "error").as_bytes());
        let f = Filter {
            host: Some("even".into()),
            limit: 2,
            ..Filter::default()
        };
        let r = copy(&t).report(&f, 100_000);
        assert_eq!(r.matched, 5);
        let ids: Vec<String> = r
            .scripts
            .iter()
            .map(|s| s.script.script_id.clone())
            .collect();
        assert_eq!(ids, [id("s6"), id("s8")]);
        let f = Filter {
            status: Some("error".into()),
            ..all()
        };
        assert_eq!(copy(&t).report(&f, 100_000).matched, 1);
        let f = Filter {
            status: Some("running".into()),
            since_ms: Some(5_000),
            ..all()
        };
        assert_eq!(copy(&t).report(&f, 100_000).matched, 5);
        let f = Filter {
            lost_only: true,
            ..all()
        };
        assert_eq!(t.report(&f, 100_000_000).matched, 9);
    }

    /// A hostile journal cannot grow what the trail holds: a line over the
    /// bound is skipped whole, a text is cut, and the script count stops at
    /// its bound, keeping the newest, whose other entries are still read.
    #[test]
    fn a_long_line_is_skipped_texts_are_cut_and_the_script_map_is_bounded() {
        let huge = format!(
            "{{\"MESSAGE_ID\":\"{SCRIPT_STARTED}\",\"SCRIPTGATE_SCRIPT_ID\":\"{}\",\"x\":\"{}\"}}",
            id("h"),
            "x".repeat(MAX_LINE_BYTES)
        );
        let input = format!("{huge}\n{}\n", start("h", "ok", 1, 1));
        let mut t = Trail::default();
        t.read(std::io::BufReader::with_capacity(100, input.as_bytes()))
            .unwrap();
        assert_eq!((t.skipped, t.scripts.len()), (1, 1));
        assert!(t.scripts.contains_key(&("h".to_string(), id("ok"))));

        let long = json!({"MESSAGE_ID": SCRIPT_STARTED, "SCRIPTGATE_SCRIPT_ID": id("l"),
            "_HOSTNAME": "h".repeat(4000), "SCRIPTGATE_RUN_ID": "r".repeat(4000),
            "SCRIPTGATE_RUNNER": "n".repeat(4000)});
        let mut t = Trail::default();
        t.add(long.to_string().as_bytes());
        let s = t.scripts.values().next().unwrap();
        for f in [&s.host, &s.run_id, &s.runner] {
            assert!(f.len() <= NAME_MAX_BYTES + 3, "{}", f.len());
        }

        // Newest first: every script's end, then (older) its start.
        let mut many = String::new();
        let n = MAX_SCRIPTS + 10;
        for i in (0..n).rev() {
            let sid = format!("{i:016x}");
            many.push_str(&format!("{{\"MESSAGE_ID\":\"{SCRIPT_FINISHED}\",\"SCRIPTGATE_SCRIPT_ID\":\"{sid}\",\"SCRIPTGATE_STATUS\":\"ok\",\"__REALTIME_TIMESTAMP\":\"{}\"}}\n", (i as i64 + 1) * 1_000_000));
        }
        for i in (0..n).rev() {
            let sid = format!("{i:016x}");
            many.push_str(&format!("{{\"MESSAGE_ID\":\"{SCRIPT_STARTED}\",\"SCRIPTGATE_SCRIPT_ID\":\"{sid}\",\"SCRIPTGATE_TIMEOUT_S\":\"1\",\"__REALTIME_TIMESTAMP\":\"{}\"}}\n", i as i64 * 1_000_000));
        }
        let mut t = Trail::default();
        t.read(many.as_bytes()).unwrap();
        assert_eq!(t.scripts.len(), MAX_SCRIPTS);
        assert!(t.truncated);
        let r = t.report(
            &Filter {
                limit: 1,
                ..Filter::default()
            },
            i64::MAX,
        );
        assert_eq!(
            r.states,
            BTreeMap::from([("ended", MAX_SCRIPTS)]),
            "no held script is lost"
        );
        assert_eq!(
            r.scripts[0].script.script_id,
            format!("{:016x}", n - 1),
            "the newest kept"
        );
    }
}
