//! How many refusals are recorded one by one: the one limiter of refused starts
//! (journal entries and audit rows) and of refused connections (the gate's
//! journal lines). A peer that floods forged tokens, or loops on connect, must
//! not write a row or a line for each: past a rate (a token bucket), refusals
//! are only counted, by reason, and the counts are recorded as one summary.
//! Pure: callers pass the time in.

use std::collections::BTreeMap;

/// How many refusals are recorded one by one: sustained, and in a burst.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rate {
    pub per_s: f64,
    pub burst: f64,
    /// What is refused, for the summary ("refused starts").
    pub what: &'static str,
    /// The rate in words, for the summary ("10/s").
    pub words: &'static str,
}

/// Refused starts: each is a journal entry and an audit row.
pub const STARTS: Rate = Rate {
    per_s: 10.0,
    burst: 100.0,
    what: "refused starts",
    words: "10/s",
};

/// Refused connections at the gate: each is a journal line.
pub const CONNECTIONS: Rate = Rate {
    per_s: 20.0 / 60.0,
    burst: 20.0,
    what: "refused connections",
    words: "20 a minute",
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Record,
    Count,
}

/// Refusals that were counted and not recorded, since `since_ms`, by key. The
/// keys are a closed set (a [`Reason`](crate::protocol::refusal::Reason), or the
/// gate's static names), so the map is bounded by its key type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Suppressed<K> {
    pub count: u64,
    pub since_ms: i64,
    pub by_reason: BTreeMap<K, u64>,
    rate: &'static str,
    what: &'static str,
}

impl<K: std::fmt::Display> Suppressed<K> {
    /// One line for the journal and the audit store.
    pub fn message(&self, now_ms: i64) -> String {
        let reasons: Vec<String> = self
            .by_reason
            .iter()
            .map(|(r, n)| format!("{r} ×{n}"))
            .collect();
        format!(
            "{} {} in the last {:.1} s were counted, not recorded one by one (more than {}): {}",
            self.count,
            self.what,
            (now_ms - self.since_ms).max(0) as f64 / 1000.0,
            self.rate,
            reasons.join(", ")
        )
    }
}

/// A token bucket of `rate`, and the refusals it only counted.
#[derive(Debug)]
pub struct RefusalLimiter<K> {
    rate: Rate,
    tokens: f64,
    last_ms: Option<i64>,
    pending: Option<Suppressed<K>>,
}

impl<K: Ord + Copy> RefusalLimiter<K> {
    pub const fn new(rate: Rate) -> Self {
        RefusalLimiter {
            rate,
            tokens: rate.burst,
            last_ms: None,
            pending: None,
        }
    }

    /// Record this refusal, or only count it under `reason`.
    pub fn observe(&mut self, now_ms: i64, reason: K) -> Verdict {
        let elapsed = self.last_ms.map_or(0, |l| (now_ms - l).max(0));
        self.last_ms = Some(now_ms);
        self.tokens =
            (self.tokens + elapsed as f64 * self.rate.per_s / 1000.0).min(self.rate.burst);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            return Verdict::Record;
        }
        let s = self.pending.get_or_insert_with(|| Suppressed {
            count: 0,
            since_ms: now_ms,
            by_reason: BTreeMap::new(),
            rate: self.rate.words,
            what: self.rate.what,
        });
        s.count += 1;
        *s.by_reason.entry(reason).or_default() += 1;
        Verdict::Count
    }

    /// The refusals counted since the last call, if any.
    pub fn take(&mut self) -> Option<Suppressed<K>> {
        self.pending.take()
    }

    /// As `take`, once the first of them is at least `age_ms` old: a summary
    /// at most that often.
    pub fn take_after(&mut self, now_ms: i64, age_ms: i64) -> Option<Suppressed<K>> {
        match &self.pending {
            Some(s) if now_ms - s.since_ms >= age_ms => self.pending.take(),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::refusal::Reason;

    #[test]
    fn a_burst_is_recorded_then_counted_then_the_rate_refills() {
        let mut l = RefusalLimiter::new(STARTS);
        let burst = STARTS.burst as usize;
        for _ in 0..burst {
            assert_eq!(l.observe(1000, Reason::Signature), Verdict::Record);
        }
        assert_eq!(l.take(), None, "nothing counted yet");
        for _ in 0..5000 {
            assert_eq!(l.observe(1000, Reason::Signature), Verdict::Count);
        }
        assert_eq!(l.observe(1000, Reason::Expired), Verdict::Count);
        let s = l.take().unwrap();
        assert_eq!(s.count, 5001);
        assert_eq!(s.by_reason[&Reason::Signature], 5000);
        assert_eq!(s.by_reason[&Reason::Expired], 1);
        assert!(s
            .message(3000)
            .starts_with("5001 refused starts in the last 2.0 s"));
        assert_eq!(l.take(), None, "taken once");
        // One second later, REFUSALS_PER_S more are recorded.
        let per_s = STARTS.per_s as usize;
        let recorded = (0..per_s * 3)
            .filter(|_| l.observe(2000, Reason::Signature) == Verdict::Record)
            .count();
        assert_eq!(recorded, per_s);
    }

    #[test]
    fn a_slow_rate_refills_by_the_minute() {
        let mut l = RefusalLimiter::new(CONNECTIONS);
        let minute = 60_000;
        let logged = (0..1000)
            .filter(|i| {
                let r = if i % 2 == 0 {
                    "peer_not_allowed"
                } else {
                    "too_many_connections"
                };
                l.observe(5 * minute, r) == Verdict::Record
            })
            .count();
        assert_eq!(logged, CONNECTIONS.burst as usize);
        let s = l.take().unwrap();
        assert_eq!(s.count, 980);
        assert_eq!(s.by_reason["peer_not_allowed"], 490);
        assert_eq!(
            s.message(6 * minute),
            "980 refused connections in the last 60.0 s were counted, not recorded one by one \
             (more than 20 a minute): peer_not_allowed ×490, too_many_connections ×490"
        );
        assert_eq!(
            l.observe(6 * minute, "x"),
            Verdict::Record,
            "a minute refills it"
        );
        // Past the burst, one line each 3 s; their summary at most once a minute.
        let mut l = RefusalLimiter::new(CONNECTIONS);
        for _ in 0..40 {
            l.observe(0, "x");
        }
        assert_eq!(l.take_after(30_000, 60_000), None, "not yet a minute");
        assert_eq!(l.take_after(60_000, 60_000).map(|s| s.count), Some(20));
        assert_eq!(l.take_after(120_000, 60_000), None, "taken");
    }
}
