//! Refused connections counted per uid, reason and minute (`scriptgate audit
//! --refusals --connections`, `scriptgate_connections_refused_total`). The gate
//! counts each refusal here, in memory, at the cost of a map update; the daemon
//! writes the counts every 10 s as one upsert per (minute, uid, reason), so a
//! flood from one uid updates one row a minute. Both the map and the table are
//! bounded. Pure bookkeeping here; the store writes.

use std::collections::HashMap;

/// Distinct (minute, uid, reason) keys held between two writes; past it, a new
/// uid is counted as [`OTHER_UIDS`] (a flood from many uids costs one key per
/// reason and minute more).
pub const MAX_KEYS: usize = 4096;

/// The uid that stands for the uids past [`MAX_KEYS`].
pub const OTHER_UIDS: u32 = u32::MAX;

/// Rows kept in the store's `refused_connections`, the newest minutes (one uid
/// refused all week long is 10080 rows).
pub const MAX_ROWS: usize = 20_000;

/// One row's worth: `(minute, uid, reason, count)`; `minute` is the Unix time
/// in ms of the minute's start.
pub type Counted = (i64, u32, &'static str, u64);

/// Refused connections not yet written.
#[derive(Debug, Default)]
pub struct Refused {
    counts: HashMap<(i64, u32, &'static str), u64>,
}

impl Refused {
    /// One connection of `uid` refused for `reason` at `now_ms`.
    pub fn count(&mut self, now_ms: i64, uid: u32, reason: &'static str) {
        let minute = now_ms - now_ms.rem_euclid(60_000);
        let key = (minute, uid, reason);
        let key = if self.counts.contains_key(&key) || self.counts.len() < MAX_KEYS {
            key
        } else {
            (minute, OTHER_UIDS, reason)
        };
        *self.counts.entry(key).or_default() += 1;
    }

    /// Everything counted since the last take, oldest minute first.
    pub fn take(&mut self) -> Vec<Counted> {
        let mut v: Vec<Counted> = self
            .counts
            .drain()
            .map(|((m, u, r), n)| (m, u, r, n))
            .collect();
        v.sort_unstable();
        v
    }

    /// Keys held now (for the bound's test).
    pub fn len(&self) -> usize {
        self.counts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.counts.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flood_of_one_uid_is_one_key_a_minute() {
        let mut r = Refused::default();
        for i in 0..100_000 {
            r.count(120_000 + i, 1000, "peer_not_allowed");
        }
        r.count(180_000, 1000, "peer_not_allowed");
        assert_eq!(
            r.take(),
            vec![
                (120_000, 1000, "peer_not_allowed", 60_000),
                (180_000, 1000, "peer_not_allowed", 40_001)
            ]
        );
        assert!(r.is_empty());
    }

    #[test]
    fn many_uids_are_bounded_and_none_is_lost() {
        let mut r = Refused::default();
        for uid in 0..(MAX_KEYS as u32 * 3) {
            r.count(0, uid, "too_many_connections");
            r.count(0, uid, "peer_not_allowed");
        }
        assert!(r.len() <= MAX_KEYS + 2, "{} keys", r.len());
        let all = r.take();
        let total: u64 = all.iter().map(|c| c.3).sum();
        assert_eq!(total, MAX_KEYS as u64 * 6, "every refusal counted");
        assert!(all.iter().any(|c| c.1 == OTHER_UIDS));
    }
}
