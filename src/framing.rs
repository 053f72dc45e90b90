//! Newline-delimited framing with a hard bound on line length.

use tokio::io::{AsyncBufRead, AsyncBufReadExt};

#[derive(Debug, PartialEq, Eq)]
pub enum Line {
    /// A complete line, without its `\n`.
    Data,
    /// The line exceeded the bound; `buf` holds a prefix and the rest is unread.
    TooLong,
    Eof,
}

/// Read one line into `buf` (cleared first), never holding more than `max` bytes.
pub async fn read_line<R: AsyncBufRead + Unpin>(
    r: &mut R,
    buf: &mut Vec<u8>,
    max: usize,
) -> std::io::Result<Line> {
    buf.clear();
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
        let body = if done {
            &chunk[..take - 1]
        } else {
            &chunk[..take]
        };
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

#[cfg(test)]
mod tests {
    use super::*;
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
