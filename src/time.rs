//! Dates, durations and clocks, in one place: RFC 3339 timestamps for calls.jsonl
//! and the admin tables, `--since` parsing, and the `Clock` that the broker is
//! given (so that token expiry can be tested without sleeping).

use jiff::civil::{Date, DateTime};
use jiff::{SignedDuration, Span, SpanRelativeTo, Timestamp};
#[cfg(test)]
use std::sync::atomic::{AtomicI64, Ordering};

/// Milliseconds since the Unix epoch, by the system clock.
pub fn now_ms() -> i64 {
    SystemClock.now_ms()
}

/// Seconds since the Unix epoch, by the system clock (JWT `iat` and `exp`).
pub fn now_unix() -> i64 {
    SystemClock.now_unix()
}

/// Where "now" comes from. The daemon uses `SystemClock`; tests use `FakeClock`.
pub trait Clock: Send + Sync {
    /// Milliseconds since the Unix epoch.
    fn now_ms(&self) -> i64;
    /// Seconds since the Unix epoch (JWT `exp` is in these).
    fn now_unix(&self) -> i64 {
        self.now_ms().div_euclid(1000)
    }
}

/// The system's wall clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> i64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as i64)
            .unwrap_or(0)
    }
}

/// A clock that stands still until told to move.
#[cfg(test)]
#[derive(Debug, Default)]
pub struct FakeClock(AtomicI64);

#[cfg(test)]
impl FakeClock {
    pub fn at_ms(ms: i64) -> FakeClock {
        FakeClock(AtomicI64::new(ms))
    }
    pub fn advance_ms(&self, ms: i64) {
        self.0.fetch_add(ms, Ordering::SeqCst);
    }
}

#[cfg(test)]
impl Clock for FakeClock {
    fn now_ms(&self) -> i64 {
        self.0.load(Ordering::SeqCst)
    }
}

/// RFC 3339 UTC timestamp with milliseconds: `2026-11-30T00:53:20.123Z`.
pub fn rfc3339(ms: i64) -> String {
    match Timestamp::from_millisecond(ms) {
        Ok(t) => t.strftime("%Y-%m-%dT%H:%M:%S%.3fZ").to_string(),
        // Outside jiff's range (years -9999..=9999): not a time any record holds.
        Err(_) => format!("@{ms}ms"),
    }
}

/// `rfc3339` of the system clock's now.
pub fn rfc3339_now() -> String {
    rfc3339(SystemClock.now_ms())
}

/// A duration for people: `4.2s`, `3m07s`, `2h05m`.
pub fn human_ms(ms: u64) -> String {
    match ms {
        0..=59_999 => format!("{:.1}s", ms as f64 / 1000.0),
        60_000..=3_599_999 => format!("{}m{:02}s", ms / 60_000, ms / 1000 % 60),
        _ => format!("{}h{:02}m", ms / 3_600_000, ms / 60_000 % 60),
    }
}

/// `--since`: a duration back from now (`90s`, `30m`, `2h`, `7d`, `2w`, or
/// combined: `1h30m`) or a UTC date (`2026-11-30`) or date-time
/// (`2026-11-30T07:00:00Z`; without an offset it is read as UTC). Impossible dates
/// (`2026-02-31`, hour 99) and negative durations (`-5d`, which would lie in the
/// future) are refused. Days and weeks count as 24 hours and 7 days.
pub fn parse_since(v: &str, now_ms: i64) -> Result<i64, String> {
    let bad = |why: String| {
        format!("--since {v:?}: {why}; give a duration (30m, 2h, 7d) or a date (2026-11-30, 2026-11-30T07:00:00Z)")
    };
    if let Ok(span) = v.parse::<Span>() {
        let d = span
            .to_duration(SpanRelativeTo::days_are_24_hours())
            .map_err(|e| bad(e.to_string()))?;
        if d.is_negative() {
            return Err(bad("a duration back from now cannot be negative".into()));
        }
        return Ok(now_ms.saturating_sub(duration_ms(d)));
    }
    if v.contains('T') {
        if let Ok(t) = v.parse::<Timestamp>() {
            return Ok(t.as_millisecond());
        }
        let dt: DateTime = v.parse().map_err(|e: jiff::Error| bad(e.to_string()))?;
        return utc_ms(dt).map_err(bad);
    }
    let d: Date = v.parse().map_err(|e: jiff::Error| bad(e.to_string()))?;
    utc_ms(d.to_datetime(jiff::civil::Time::midnight())).map_err(bad)
}

fn duration_ms(d: SignedDuration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

fn utc_ms(dt: DateTime) -> Result<i64, String> {
    dt.to_zoned(jiff::tz::TimeZone::UTC)
        .map(|z| z.timestamp().as_millisecond())
        .map_err(|e| e.to_string())
}

/// `--as-of`: a moment to judge retention at, as a UTC date or date-time
/// (as `--since` reads them), or a duration ahead of now with a `+` (`+40d`).
/// A bare duration is refused: back or ahead would be a guess.
pub fn parse_as_of(v: &str, now_ms: i64) -> Result<i64, String> {
    if let Some(ahead) = v.strip_prefix('+') {
        let back = parse_since(ahead, now_ms)
            .map_err(|e| format!("--as-of {v:?}: {}", e.replace("--since ", "")))?;
        return Ok(now_ms.saturating_add(now_ms.saturating_sub(back)));
    }
    if v.parse::<Span>().is_ok() {
        return Err(format!(
            "--as-of {v:?}: a duration needs a sign: +{v} (ahead of now); or give a date (2027-01-31, 2027-01-31T07:00:00Z)"
        ));
    }
    parse_since(v, now_ms).map_err(|e| e.replacen("--since", "--as-of", 1))
}

/// `--as-of` as a clap `value_parser`: the moment in ms since the epoch.
pub fn as_of_arg(v: &str) -> Result<i64, String> {
    parse_as_of(v, SystemClock.now_ms())
}

/// `--since` as a clap `value_parser`: the bound in ms since the epoch, from now.
pub fn since_arg(v: &str) -> Result<i64, String> {
    parse_since(v, SystemClock.now_ms())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_dates() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(1_796_000_000_123), "2026-11-30T00:53:20.123Z");
        assert_eq!(rfc3339(951_782_400_000), "2000-02-29T00:00:00.000Z");
        assert_eq!(rfc3339(-1), "1969-12-31T23:59:59.999Z");
    }

    #[test]
    fn as_of_is_a_date_or_a_signed_duration_ahead() {
        let now = 1_796_000_000_000;
        assert_eq!(parse_as_of("+40d", now).unwrap(), now + 40 * 86_400_000);
        assert_eq!(parse_as_of("1970-01-02", now).unwrap(), 86_400_000);
        assert_eq!(
            parse_as_of("2027-01-31T07:00:00Z", now).unwrap(),
            1_801_378_800_000
        );
        let e = parse_as_of("40d", now).unwrap_err();
        assert!(e.contains("+40d"), "{e}");
        assert!(parse_as_of("+-5d", now).is_err());
        assert!(parse_as_of("2026-02-31", now)
            .unwrap_err()
            .starts_with("--as-of"));
    }

    #[test]
    fn since_accepts_durations_and_dates() {
        let now = 1_796_000_000_000;
        assert_eq!(parse_since("90s", now).unwrap(), now - 90_000);
        assert_eq!(parse_since("30m", now).unwrap(), now - 1_800_000);
        assert_eq!(parse_since("2h", now).unwrap(), now - 7_200_000);
        assert_eq!(parse_since("7d", now).unwrap(), now - 7 * 86_400_000);
        assert_eq!(parse_since("2w", now).unwrap(), now - 14 * 86_400_000);
        assert_eq!(parse_since("1h30m", now).unwrap(), now - 5_400_000);
        assert_eq!(parse_since("1970-01-02", now).unwrap(), 86_400_000);
        assert_eq!(parse_since("2026-11-30T00:53:20Z", now).unwrap(), now);
        assert_eq!(parse_since("2026-11-30T00:53:20", now).unwrap(), now);
        assert_eq!(
            parse_since("2026-11-30T01:53:20+01:00", now).unwrap(),
            now,
            "an explicit offset is honoured"
        );
    }

    #[test]
    fn since_refuses_impossible_dates_and_the_future() {
        let now = 1_796_000_000_000;
        for v in [
            "yesterday",
            "2026-13-01",
            "2026-02-31",
            "2026-02-29",
            "2026-11-30T99:00:00Z",
            "2026-11-30T07:61:00Z",
            "-5d",
            "-2h",
            "5",
            "",
        ] {
            assert!(parse_since(v, now).is_err(), "{v:?} was accepted");
        }
        assert!(parse_since("2024-02-29", now).is_ok(), "a leap day");
    }

    #[test]
    fn durations_for_people() {
        assert_eq!(human_ms(4_200), "4.2s");
        assert_eq!(human_ms(187_000), "3m07s");
        assert_eq!(human_ms(7_500_000), "2h05m");
    }

    #[test]
    fn fake_clock_moves_only_when_told() {
        let c = FakeClock::at_ms(10_500);
        assert_eq!((c.now_ms(), c.now_unix()), (10_500, 10));
        c.advance_ms(600);
        assert_eq!(c.now_unix(), 11);
    }
}
