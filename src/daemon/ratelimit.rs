//! How many refused starts are recorded one by one. A peer that floods forged or
//! expired tokens must not write a row and a journal entry for each: past a rate
//! (a token bucket), refusals are only counted, by reason, and the counts are
//! recorded as one summary. Pure: callers pass the time in.

use std::collections::BTreeMap;

/// Refusals recorded one by one per second, sustained.
pub const REFUSALS_PER_S: f64 = 10.0;
/// Refusals recorded one by one in a burst.
pub const REFUSAL_BURST: f64 = 100.0;
/// Distinct reasons counted apart in a summary; the rest count as "other".
const MAX_REASONS: usize = 32;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Record,
    Count,
}

/// Refusals that were counted and not recorded, since `since_ms`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Suppressed {
    pub count: u64,
    pub since_ms: i64,
    pub by_reason: BTreeMap<String, u64>,
}

impl Suppressed {
    /// One line for the journal and the audit store.
    pub fn message(&self, now_ms: i64) -> String {
        let reasons: Vec<String> = self
            .by_reason
            .iter()
            .map(|(r, n)| format!("{r} ×{n}"))
            .collect();
        format!(
            "{} refused starts in the last {:.1} s were counted, not recorded one by one (more than {REFUSALS_PER_S}/s): {}",
            self.count,
            (now_ms - self.since_ms).max(0) as f64 / 1000.0,
            reasons.join(", ")
        )
    }
}

#[derive(Debug)]
pub struct RefusalLimiter {
    tokens: f64,
    last_ms: Option<i64>,
    pending: Option<Suppressed>,
}

impl Default for RefusalLimiter {
    fn default() -> Self {
        RefusalLimiter {
            tokens: REFUSAL_BURST,
            last_ms: None,
            pending: None,
        }
    }
}

impl RefusalLimiter {
    /// Record this refusal, or only count it under `reason`.
    pub fn admit(&mut self, now_ms: i64, reason: &str) -> Verdict {
        let elapsed = self.last_ms.map_or(0, |l| (now_ms - l).max(0));
        self.last_ms = Some(now_ms);
        self.tokens = (self.tokens + elapsed as f64 * REFUSALS_PER_S / 1000.0).min(REFUSAL_BURST);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            return Verdict::Record;
        }
        let s = self.pending.get_or_insert_with(|| Suppressed {
            count: 0,
            since_ms: now_ms,
            by_reason: BTreeMap::new(),
        });
        s.count += 1;
        let key = if s.by_reason.contains_key(reason) || s.by_reason.len() < MAX_REASONS {
            reason
        } else {
            "other"
        };
        *s.by_reason.entry(key.to_string()).or_default() += 1;
        Verdict::Count
    }

    /// The refusals counted since the last call, if any.
    pub fn take(&mut self) -> Option<Suppressed> {
        self.pending.take()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_is_recorded_then_counted_then_the_rate_refills() {
        let mut l = RefusalLimiter::default();
        let burst = REFUSAL_BURST as usize;
        for _ in 0..burst {
            assert_eq!(l.admit(1000, "signature"), Verdict::Record);
        }
        assert_eq!(l.take(), None, "nothing counted yet");
        for _ in 0..5000 {
            assert_eq!(l.admit(1000, "signature"), Verdict::Count);
        }
        assert_eq!(l.admit(1000, "expired"), Verdict::Count);
        let s = l.take().unwrap();
        assert_eq!(s.count, 5001);
        assert_eq!(s.by_reason["signature"], 5000);
        assert_eq!(s.by_reason["expired"], 1);
        assert!(s
            .message(3000)
            .starts_with("5001 refused starts in the last 2.0 s"));
        assert_eq!(l.take(), None, "taken once");
        // One second later, REFUSALS_PER_S more are recorded.
        let per_s = REFUSALS_PER_S as usize;
        let recorded = (0..per_s * 3)
            .filter(|_| l.admit(2000, "signature") == Verdict::Record)
            .count();
        assert_eq!(recorded, per_s);
    }

    #[test]
    fn the_reasons_map_is_bounded() {
        let mut l = RefusalLimiter::default();
        for _ in 0..REFUSAL_BURST as usize {
            l.admit(0, "x");
        }
        for i in 0..10_000 {
            l.admit(0, &format!("reason-{i}"));
        }
        let s = l.take().unwrap();
        assert_eq!(s.count, 10_000);
        assert_eq!(s.by_reason.len(), MAX_REASONS + 1);
        assert_eq!(s.by_reason["other"], 10_000 - MAX_REASONS as u64);
    }
}
