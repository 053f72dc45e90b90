//! Newline-delimited framing with a hard bound on line length, and, for the
//! engine socket, bounds on the time and the shared memory a partial line takes.

use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncBufRead, AsyncBufReadExt};
use tokio::sync::Semaphore;

#[derive(Debug, PartialEq, Eq)]
pub enum Line {
    /// A complete line, without its `\n`.
    Data,
    /// The line exceeded the bound; `buf` holds a prefix and the rest is unread.
    TooLong,
    /// A line was started and not finished in time (`read_line_limited`).
    TimedOut,
    Eof,
}

/// Read one line into `buf` (cleared first), never holding more than `max` bytes.
pub async fn read_line<R: AsyncBufRead + Unpin>(
    r: &mut R,
    buf: &mut Vec<u8>,
    max: usize,
) -> std::io::Result<Line> {
    buf.clear();
    resume_line(r, buf, max).await
}

/// `read_line` without the clear: go on with the line whose start `buf` holds.
/// Cancel-safe: bytes move from the reader's buffer to `buf` with no await in
/// between, so a read dropped mid-line loses nothing, and the next call goes on
/// where it stopped (rmcp drops the MCP client's `receive` between two reads).
pub async fn resume_line<R: AsyncBufRead + Unpin>(
    r: &mut R,
    buf: &mut Vec<u8>,
    max: usize,
) -> std::io::Result<Line> {
    loop {
        let chunk = r.fill_buf().await?;
        if chunk.is_empty() {
            return Ok(if buf.is_empty() {
                Line::Eof
            } else {
                Line::Data
            });
        }
        let (take, done) = match chunk.iter().position(|&b| b == b'\n') {
            Some(i) => (i + 1, true),
            None => (chunk.len(), false),
        };
        let body = &chunk[..take - usize::from(done)];
        if buf.len() + body.len() > max {
            let room = max - buf.len();
            buf.extend_from_slice(&body[..room]);
            r.consume(room);
            return Ok(Line::TooLong);
        }
        buf.extend_from_slice(body);
        r.consume(take);
        if done {
            return Ok(Line::Data);
        }
    }
}

/// Bytes of one line that need no share of the common budget.
pub const FREE_LINE_BYTES: usize = 64 * 1024;

/// The bounds of `read_line_limited`.
pub struct LineLimits<'a> {
    /// The longest line.
    pub max: usize,
    /// Bytes of partial lines, shared by every connection: past `FREE_LINE_BYTES`
    /// a line draws on it, and waits while it is used up.
    pub budget: &'a Arc<Semaphore>,
    /// Once a line has started, it must end within this time.
    pub timeout: Duration,
}

/// `read_line` for a peer that may be hostile: besides its length, a line is
/// bounded in time once its first byte has come, and beyond `FREE_LINE_BYTES`
/// in the memory it may hold from the shared budget (released when it returns),
/// so many connections that each send a large line without its newline cannot
/// make the daemon hold more than the budget.
pub async fn read_line_limited<R: AsyncBufRead + Unpin>(
    r: &mut R,
    buf: &mut Vec<u8>,
    lim: &LineLimits<'_>,
) -> std::io::Result<Line> {
    buf.clear();
    let mut deadline = None;
    let mut held: Option<tokio::sync::OwnedSemaphorePermit> = None;
    loop {
        let chunk = match deadline {
            None => r.fill_buf().await?,
            Some(d) => match tokio::time::timeout_at(d, r.fill_buf()).await {
                Ok(c) => c?,
                Err(_) => return Ok(Line::TimedOut),
            },
        };
        if chunk.is_empty() {
            return Ok(if buf.is_empty() {
                Line::Eof
            } else {
                Line::Data
            });
        }
        let d = *deadline.get_or_insert_with(|| tokio::time::Instant::now() + lim.timeout);
        let (take, done) = match chunk.iter().position(|&b| b == b'\n') {
            Some(i) => (i + 1, true),
            None => (chunk.len(), false),
        };
        let body_len = if done { take - 1 } else { take };
        if buf.len() + body_len > lim.max {
            let room = lim.max - buf.len();
            buf.extend_from_slice(&chunk[..room]);
            r.consume(room);
            return Ok(Line::TooLong);
        }
        let have = held.as_ref().map_or(0, |p| p.num_permits());
        let need = (buf.len() + body_len).saturating_sub(FREE_LINE_BYTES);
        if need > have {
            let more = u32::try_from(need - have).unwrap_or(u32::MAX);
            let p = match tokio::time::timeout_at(d, lim.budget.clone().acquire_many_owned(more))
                .await
            {
                Ok(Ok(p)) => p,
                Ok(Err(_)) | Err(_) => return Ok(Line::TimedOut),
            };
            match &mut held {
                Some(h) => h.merge(p),
                None => held = Some(p),
            }
            // The chunk may have changed while we waited; read it again.
            continue;
        }
        let chunk = r.fill_buf().await?;
        buf.extend_from_slice(&chunk[..body_len]);
        r.consume(take);
        if done {
            return Ok(Line::Data);
        }
    }
}

/// What parsing `line` into a `serde_json::Value` may allocate, at most about:
/// its bytes, plus a map or vector per object and array and a `Value` slot per
/// element, counted outside strings. Small objects cost a parser some 100
/// bytes per input byte (`{"":0}` is one 632-byte map node), so a bound on a
/// line's bytes alone does not bound its parsed size; this does. Pure, O(n).
pub fn parse_cost(line: &[u8]) -> usize {
    const CONTAINER: usize = 640;
    const ELEMENT: usize = 48;
    let (mut containers, mut elements) = (0usize, 0usize);
    let (mut in_string, mut escaped) = (false, false);
    for &b in line {
        if in_string {
            match (escaped, b) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'{' | b'[' => containers += 1,
            b',' | b':' => elements += 1,
            _ => {}
        }
    }
    line.len() + containers * CONTAINER + (elements + containers) * ELEMENT
}

/// After `Line::TooLong`: drop the rest of that line.
pub async fn skip_line<R: AsyncBufRead + Unpin>(r: &mut R) -> std::io::Result<()> {
    loop {
        let chunk = r.fill_buf().await?;
        if chunk.is_empty() {
            return Ok(());
        }
        if let Some(i) = chunk.iter().position(|&b| b == b'\n') {
            r.consume(i + 1);
            return Ok(());
        }
        let n = chunk.len();
        r.consume(n);
    }
}

/// Cut `s` to at most `max` bytes at a character boundary, marking the cut.
pub fn clip(s: &str, max: usize) -> String {
    clip_marked(s, max, "…")
}

pub fn clip_marked(s: &str, max: usize, mark: &str) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{mark}", &s[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_cost_counts_containers_outside_strings() {
        assert_eq!(parse_cost(b"\"{[{[\""), 6, "brackets in a string are text");
        assert_eq!(
            parse_cost(br#""a\"{""#),
            6,
            "an escaped quote does not end the string"
        );
        let small = parse_cost(br#"{"":0}"#);
        assert!(small >= 632, "one map node: {small}");
        let many = format!("[{}]", vec![r#"{"":0}"#; 10_000].join(","));
        assert!(parse_cost(many.as_bytes()) > 10_000 * 632);
        let text = format!(r#"{{"s": "{}"}}"#, "x".repeat(1 << 20));
        assert!(
            parse_cost(text.as_bytes()) < (1 << 20) + 2048,
            "a long string costs its bytes"
        );
    }
    use tokio::io::BufReader;

    #[tokio::test]
    async fn bounded_lines() {
        let data: &[u8] = b"short\nthis line is far too long\nok\nlast";
        let mut r = BufReader::with_capacity(4, data);
        let mut b = Vec::new();
        assert_eq!(read_line(&mut r, &mut b, 10).await.unwrap(), Line::Data);
        assert_eq!(b, b"short");
        assert_eq!(read_line(&mut r, &mut b, 10).await.unwrap(), Line::TooLong);
        assert_eq!(b.len(), 10);
        skip_line(&mut r).await.unwrap();
        assert_eq!(read_line(&mut r, &mut b, 10).await.unwrap(), Line::Data);
        assert_eq!(b, b"ok");
        assert_eq!(read_line(&mut r, &mut b, 10).await.unwrap(), Line::Data);
        assert_eq!(b, b"last");
        assert_eq!(read_line(&mut r, &mut b, 10).await.unwrap(), Line::Eof);
    }
}
