//! Running scripts' counters kept current in the audit store: every [`TICK`], the
//! calls and failures of the scripts whose counts moved since the last tick go out
//! in one batched write (not one per call), so a `kill -9` of the daemon leaves a
//! row with the counts of at most one tick ago instead of 0. Pure bookkeeping
//! here; the daemon runs the tick and the store writes.

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// How often running scripts' counts are written.
pub const TICK: Duration = Duration::from_secs(2);

/// `(script_id, calls, failures)`.
pub type Counts = (String, u64, u64);

/// The counts last written, per running script.
#[derive(Debug, Default)]
pub struct Checkpoint {
    written: HashMap<String, (u64, u64)>,
}

impl Checkpoint {
    /// Of the running scripts' counts now, those that differ from what was last
    /// written. Scripts no longer running are forgotten, so the map holds at most
    /// as many entries as scripts run (`server.max_running`). Call `written` once
    /// the store has them: a failed write is tried again at the next tick.
    pub fn changed(&mut self, now: Vec<Counts>) -> Vec<Counts> {
        self.written
            .retain(|id, _| now.iter().any(|(running, _, _)| running == id));
        now.into_iter()
            .filter(|(id, calls, failures)| self.written.get(id) != Some(&(*calls, *failures)))
            .collect()
    }

    /// The store holds these counts now.
    pub fn written(&mut self, counts: &[Counts]) {
        for (id, calls, failures) in counts {
            self.written.insert(id.clone(), (*calls, *failures));
        }
    }
}

/// How often a checkpoint that keeps failing is said again (a full state
/// filesystem fails every [`TICK`]).
pub const SAY_AGAIN: Duration = Duration::from_secs(60);

/// What to log of a checkpoint's outcome.
#[derive(Debug, Clone, PartialEq)]
pub enum Say {
    /// A failure, said at warning (the first, then at most once a [`SAY_AGAIN`]).
    Warn(String),
    /// A failure within [`SAY_AGAIN`] of the last one said: debug only.
    Quiet(String),
    /// The first write that succeeded after failures.
    Recovered(String),
}

/// A failing checkpoint said once, then at most once a [`SAY_AGAIN`] with how
/// many were not said, and its recovery said once. Pure: the caller gives the
/// time and logs what it is told.
#[derive(Debug, Default)]
pub struct Failing {
    /// When the first failure of this spell was, and how many there were.
    since: Option<(Instant, u64)>,
    /// When a failure was last said, and how many were not said since.
    said: Option<(Instant, u64)>,
}

impl Failing {
    /// A write failed with `error`.
    pub fn failed(&mut self, now: Instant, error: &str) -> Say {
        let (since, n) = self.since.get_or_insert((now, 0));
        *n += 1;
        let (since, n) = (*since, *n);
        match &mut self.said {
            None => {
                self.said = Some((now, 0));
                Say::Warn(format!(
                    "{error} (said again at most once a minute while it lasts)"
                ))
            }
            Some((at, quiet)) if now.duration_since(*at) < SAY_AGAIN => {
                *quiet += 1;
                Say::Quiet(format!("{error} ({quiet} not said since the last warning)"))
            }
            Some((_, quiet)) => {
                let line = format!(
                    "{error} (still failing: {n} failed writes in {}s, {quiet} not said since the last warning)",
                    now.duration_since(since).as_secs()
                );
                self.said = Some((now, 0));
                Say::Warn(line)
            }
        }
    }

    /// A write succeeded: after failures, the one line that says so.
    pub fn succeeded(&mut self, now: Instant) -> Option<Say> {
        let (since, n) = self.since.take()?;
        self.said = None;
        Some(Say::Recovered(format!(
            "checkpoint running scripts' counts: written again, after {n} failed writes in {}s",
            now.duration_since(since).as_secs()
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failing_checkpoint_is_said_once_a_minute_and_its_recovery_once() {
        let mut f = Failing::default();
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        assert_eq!(f.succeeded(at(0)), None, "nothing failed: nothing to say");
        let full = "database or disk is full";
        assert!(matches!(f.failed(at(0), full), Say::Warn(l) if l.starts_with(full)));
        for s in (2..60).step_by(2) {
            assert!(matches!(f.failed(at(s), full), Say::Quiet(_)), "at {s}s");
        }
        // 29 not said (2..58 s); the one at 60 s is said, with the counts.
        assert_eq!(
            f.failed(at(60), full),
            Say::Warn(format!(
                "{full} (still failing: 31 failed writes in 60s, 29 not said since the last warning)"
            ))
        );
        assert!(matches!(f.failed(at(62), full), Say::Quiet(l) if l.contains("(1 not said")));
        assert_eq!(
            f.succeeded(at(64)),
            Some(Say::Recovered(
                "checkpoint running scripts' counts: written again, after 32 failed writes in 64s"
                    .into()
            ))
        );
        assert_eq!(f.succeeded(at(66)), None, "recovery is said once");
        // A new spell starts over: said at once.
        assert!(matches!(f.failed(at(70), full), Say::Warn(_)));
    }

    #[test]
    fn only_moved_counts_are_written_and_finished_scripts_are_forgotten() {
        let mut c = Checkpoint::default();
        let row = |id: &str, calls, failures| (id.to_string(), calls, failures);
        let tick = |c: &mut Checkpoint, now| {
            let w = c.changed(now);
            c.written(&w);
            w
        };
        // 0 calls is a change from "never written": the row was inserted with 0
        // anyway, but writing it once is harmless and keeps the rule simple.
        assert_eq!(
            tick(&mut c, vec![row("a", 0, 0), row("b", 3, 1)]),
            vec![row("a", 0, 0), row("b", 3, 1)]
        );
        assert_eq!(tick(&mut c, vec![row("a", 0, 0), row("b", 3, 1)]), vec![]);
        // A write that failed (not marked written) is tried again.
        assert_eq!(
            c.changed(vec![row("a", 4, 0), row("b", 3, 1)]),
            vec![row("a", 4, 0)]
        );
        assert_eq!(
            tick(&mut c, vec![row("a", 5, 0), row("b", 3, 1)]),
            vec![row("a", 5, 0)]
        );
        assert_eq!(tick(&mut c, vec![row("a", 5, 2)]), vec![row("a", 5, 2)]);
        assert_eq!(c.written.len(), 1, "b finished: forgotten");
    }
}
