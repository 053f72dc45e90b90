//! Running scripts' counters kept current in the audit store: every [`TICK`], the
//! calls and failures of the scripts whose counts moved since the last tick go out
//! in one batched write (not one per call), so a `kill -9` of the daemon leaves a
//! row with the counts of at most one tick ago instead of 0. Pure bookkeeping
//! here; the daemon runs the tick and the store writes.

use std::collections::HashMap;
use std::time::Duration;

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

#[cfg(test)]
mod tests {
    use super::*;

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
