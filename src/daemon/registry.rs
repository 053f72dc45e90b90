//! Which scripts the daemon runs and ran, and the bounds on how many: the running
//! scripts by id, the connection that started each finished one, the
//! `max_running` slots, and the starts waiting for an approval. No I/O: the
//! daemon decides what a script is; this only keeps count and finds them.

use crate::protocol::refusal::{Reason, Refused};

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// How many finished scripts keep "visible to the connection that started them".
/// Past this many, results are reached with the run's token, as after a restart.
pub const FINISHED_OWNERS_MAX: usize = 100_000;

/// `R` is what the daemon keeps of a running script.
pub struct Registry<R> {
    max_running: usize,
    running: Mutex<HashMap<String, Arc<R>>>,
    /// Finished scripts started in this daemon's lifetime: script id → connection id.
    finished_owner: Mutex<HashMap<String, u64>>,
    /// Taken `max_running` slots. A slot is reserved before a script is registered
    /// and freed after it is deregistered, so this is at least `running.len()`.
    slots: AtomicUsize,
    /// Starts waiting for the engine's approval, per connection. They hold no
    /// `max_running` slot; a connection may have `max_running / 4` (at least 1)
    /// of them, and the daemon `max_running` in all.
    approvals: Mutex<HashMap<u64, usize>>,
}

impl<R> Registry<R> {
    pub fn new(max_running: usize) -> Arc<Registry<R>> {
        Arc::new(Registry {
            max_running,
            running: Mutex::new(HashMap::new()),
            finished_owner: Mutex::new(HashMap::new()),
            slots: AtomicUsize::new(0),
            approvals: Mutex::new(HashMap::new()),
        })
    }

    /// A `max_running` slot, held until the guard is dropped.
    pub fn reserve_slot(self: &Arc<Self>) -> Result<Slot<R>, Refused> {
        let max = self.max_running;
        self.slots
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < max).then_some(n + 1)
            })
            .map_err(|_| {
                Refused::new(
                    Reason::Busy,
                    format!("the daemon already runs max_running = {max} scripts"),
                )
            })?;
        Ok(Slot(self.clone()))
    }

    /// Count a start of connection `conn` as waiting for approval, within the
    /// per-connection and daemon-wide bounds, until the guard is dropped.
    pub fn await_approval(&self, conn: u64) -> Result<ApprovalWait<'_, R>, Refused> {
        let max = self.max_running;
        let per_conn = (max / 4).max(1);
        let mut waiting = self.approvals.lock().unwrap();
        let total: usize = waiting.values().sum();
        let mine = waiting.get(&conn).copied().unwrap_or(0);
        if mine >= per_conn || total >= max {
            return Err(Refused::new(
                Reason::ApprovalsPending,
                format!(
                    "too many starts wait for approval ({mine} on this connection, {total} in all; \
                     at most {per_conn} per connection and max_running = {max} in all): answer the pending approval.request first"
                ),
            ));
        }
        *waiting.entry(conn).or_default() += 1;
        Ok(ApprovalWait(self, conn))
    }

    /// How many starts of `conn` wait for approval.
    #[cfg(test)]
    pub fn approvals_pending(&self, conn: u64) -> usize {
        self.approvals
            .lock()
            .unwrap()
            .get(&conn)
            .copied()
            .unwrap_or(0)
    }

    pub fn insert(&self, script_id: &str, r: Arc<R>) {
        self.running
            .lock()
            .unwrap()
            .insert(script_id.to_string(), r);
    }

    /// The script has ended: it is no longer running, and stays visible to the
    /// connection that started it. (Its owner is recorded first, so that a lookup
    /// in between finds it one way or the other.)
    pub fn finish(&self, script_id: &str, owner: u64) {
        {
            let mut owners = self.finished_owner.lock().unwrap();
            if owners.len() >= FINISHED_OWNERS_MAX {
                owners.clear();
            }
            owners.insert(script_id.to_string(), owner);
        }
        self.running.lock().unwrap().remove(script_id);
    }

    pub fn running(&self, script_id: &str) -> Option<Arc<R>> {
        self.running.lock().unwrap().get(script_id).cloned()
    }

    /// The connection that started a finished script, while it is remembered.
    pub fn finished_owner(&self, script_id: &str) -> Option<u64> {
        self.finished_owner.lock().unwrap().get(script_id).copied()
    }

    pub fn running_count(&self) -> usize {
        self.running.lock().unwrap().len()
    }

    /// The running scripts for which `pick` holds.
    pub fn running_where(&self, pick: impl Fn(&R) -> bool) -> Vec<Arc<R>> {
        self.running
            .lock()
            .unwrap()
            .values()
            .filter(|r| pick(r))
            .cloned()
            .collect()
    }

    /// Every running script, with its id.
    pub fn all_running(&self) -> Vec<(String, Arc<R>)> {
        self.running
            .lock()
            .unwrap()
            .iter()
            .map(|(id, r)| (id.clone(), r.clone()))
            .collect()
    }
}

/// A reserved `max_running` slot; freed when dropped.
pub struct Slot<R>(Arc<Registry<R>>);

impl<R> Drop for Slot<R> {
    fn drop(&mut self) {
        self.0.slots.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A start waiting for approval; no longer counted when dropped.
pub struct ApprovalWait<'a, R>(&'a Registry<R>, u64);

impl<R> Drop for ApprovalWait<'_, R> {
    fn drop(&mut self) {
        let mut waiting = self.0.approvals.lock().unwrap();
        if let Some(n) = waiting.get_mut(&self.1) {
            *n -= 1;
            if *n == 0 {
                waiting.remove(&self.1);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{code, RpcError};

    #[derive(Debug, PartialEq)]
    struct Script {
        run: &'static str,
        owner: u64,
    }

    fn script(run: &'static str, owner: u64) -> Arc<Script> {
        Arc::new(Script { run, owner })
    }

    #[test]
    fn slots_are_bounded_and_freed_on_drop() {
        let reg = Registry::<Script>::new(2);
        let a = reg.reserve_slot().unwrap();
        let _b = reg.reserve_slot().unwrap();
        let e = reg.reserve_slot().map_err(RpcError::from).err().unwrap();
        assert_eq!(e.code, code::BUSY);
        assert_eq!(e.reason(), Some("busy"));
        assert_eq!(e.message, "the daemon already runs max_running = 2 scripts");
        drop(a);
        assert!(reg.reserve_slot().is_ok());
    }

    #[test]
    fn approvals_are_bounded_per_connection_and_in_all() {
        // max_running 8: two per connection, eight in all.
        let reg = Registry::<Script>::new(8);
        let w1 = reg.await_approval(1).unwrap();
        let _w2 = reg.await_approval(1).unwrap();
        let e = reg.await_approval(1).map_err(RpcError::from).err().unwrap();
        assert_eq!(
            (e.code, e.reason()),
            (code::BUSY, Some("approvals_pending"))
        );
        assert_eq!(
            e.message,
            "too many starts wait for approval (2 on this connection, 2 in all; at most 2 per connection \
             and max_running = 8 in all): answer the pending approval.request first"
        );
        assert_eq!(reg.approvals_pending(1), 2);
        drop(w1);
        assert_eq!(reg.approvals_pending(1), 1);
        let _w3 = reg.await_approval(1).unwrap();
        let others: Vec<_> = (2..=7).map(|c| reg.await_approval(c).unwrap()).collect();
        let e = reg.await_approval(9).map_err(RpcError::from).err().unwrap();
        assert!(
            e.message.contains("(0 on this connection, 8 in all;"),
            "{}",
            e.message
        );
        drop(others);
        assert_eq!(reg.approvals_pending(2), 0);
        assert!(reg.await_approval(9).is_ok());
        // At least one per connection, however small max_running is.
        let small = Registry::<Script>::new(1);
        let _w = small.await_approval(1).unwrap();
        assert!(small.await_approval(1).is_err());
    }

    #[test]
    fn scripts_are_found_while_running_and_their_owner_after() {
        let reg = Registry::new(4);
        reg.insert("s1", script("run-1", 10));
        reg.insert("s2", script("run-1", 11));
        reg.insert("s3", script("run-2", 10));
        assert_eq!(reg.running_count(), 3);
        assert_eq!(reg.running("s2").unwrap().owner, 11);
        assert!(reg.running("nope").is_none());
        let mut of_run: Vec<u64> = reg
            .running_where(|s| s.run == "run-1")
            .iter()
            .map(|s| s.owner)
            .collect();
        of_run.sort();
        assert_eq!(of_run, [10, 11]);
        assert_eq!(reg.running_where(|s| s.owner == 10).len(), 2);
        let mut ids: Vec<String> = reg.all_running().into_iter().map(|(id, _)| id).collect();
        ids.sort();
        assert_eq!(ids, ["s1", "s2", "s3"]);
        assert_eq!(reg.finished_owner("s1"), None);
        reg.finish("s1", 10);
        assert!(reg.running("s1").is_none());
        assert_eq!(reg.finished_owner("s1"), Some(10));
        assert_eq!(reg.running_count(), 2);
    }

    #[test]
    fn finished_owners_are_bounded() {
        let reg = Registry::<Script>::new(1);
        for i in 0..FINISHED_OWNERS_MAX {
            reg.finish(&format!("s{i}"), 1);
        }
        assert_eq!(reg.finished_owner("s0"), Some(1));
        reg.finish("last", 2);
        assert_eq!(reg.finished_owner("s0"), None, "forgotten past the bound");
        assert_eq!(reg.finished_owner("last"), Some(2));
    }
}
