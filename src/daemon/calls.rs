//! `admin.calls`: one bounded page of a script's calls.jsonl, read by the
//! daemon for an administrator. The record lies in the engine's workspace, a
//! tree the engine may change: the file is opened from `/` down, every
//! directory relative to its parent with `O_NOFOLLOW`, and read only if it is a
//! regular file; nothing is resolved by name twice. Every size is bounded:
//! lines per page, bytes per page, bytes per line, and bytes read for a page
//! (`protocol::CALLS_*`).

use crate::protocol::{
    CallLine, CallsPage, RpcError, CALLS_LINE_MAX_BYTES, CALLS_PAGE_MAX_BYTES,
    CALLS_PAGE_MAX_LINES, CALLS_SCAN_MAX_BYTES,
};
use nix::fcntl::{openat, AtFlags, OFlag};
use nix::sys::stat::{fstat, fstatat, FileStat, Mode};
use std::fs::File;
use std::io::{self, BufRead, BufReader};
use std::os::fd::OwnedFd;
use std::path::{Component, Path};

/// Open `path` (absolute) without following a symbolic link anywhere in it:
/// each directory from `/` relative to its parent, the file itself only when
/// it is a regular file (no FIFO, device or link is opened) of `owner` (the
/// uid the script ran as, who made it) with one link: a hard link the engine
/// made to a file it may not read is not read for it.
pub fn open_no_links(path: &Path, owner: u32) -> io::Result<File> {
    let (file, dirs) = split_plain(path)?;
    let dir_flags = OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC | OFlag::O_RDONLY;
    let mut dir: OwnedFd = File::open("/")?.into();
    for d in dirs {
        dir = openat(&dir, d, dir_flags, Mode::empty()).map_err(|e| match e {
            nix::Error::ELOOP | nix::Error::ENOTDIR => io::Error::other(format!(
                "{}: {} is not a directory (a symbolic link is not followed)",
                path.display(),
                d.to_string_lossy()
            )),
            e => io::Error::from(e),
        })?;
    }
    let st = fstatat(&dir, file, AtFlags::AT_SYMLINK_NOFOLLOW).map_err(io::Error::from)?;
    if st.st_mode & libc::S_IFMT != libc::S_IFREG {
        return Err(io::Error::other(format!(
            "{} is not a regular file",
            path.display()
        )));
    }
    let fd = openat(
        &dir,
        file,
        OFlag::O_RDONLY
            | OFlag::O_NOFOLLOW
            | OFlag::O_CLOEXEC
            | OFlag::O_NONBLOCK
            | OFlag::O_NOCTTY,
        Mode::empty(),
    )
    .map_err(io::Error::from)?;
    check_opened(path, &fd, &st, owner)?;
    Ok(File::from(fd))
}

/// An absolute path's file name and the directories to it, or why it is not
/// a plain absolute path (`..`, `.`).
fn split_plain(path: &Path) -> io::Result<(&std::ffi::OsStr, Vec<&std::ffi::OsStr>)> {
    let mut comps: Vec<&std::ffi::OsStr> = Vec::new();
    for c in path.components() {
        match c {
            Component::RootDir => {}
            Component::Normal(n) => comps.push(n),
            _ => {
                return Err(io::Error::other(format!(
                    "{}: not a plain absolute path",
                    path.display()
                )))
            }
        }
    }
    let Some((file, dirs)) = comps.split_last() else {
        return Err(io::Error::other("no file named"));
    };
    if !path.is_absolute() {
        return Err(io::Error::other(format!(
            "{}: not absolute",
            path.display()
        )));
    }
    Ok((file, dirs.to_vec()))
}

/// The file opened is the one looked at (`st`), still a regular file, of
/// `owner`, with one link.
fn check_opened(path: &Path, fd: &OwnedFd, st: &FileStat, owner: u32) -> io::Result<()> {
    let now = fstat(fd).map_err(io::Error::from)?;
    if now.st_mode & libc::S_IFMT != libc::S_IFREG
        || (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino)
    {
        return Err(io::Error::other(format!(
            "{} was replaced while it was opened",
            path.display()
        )));
    }
    if now.st_uid != owner || now.st_nlink != 1 {
        return Err(io::Error::other(format!(
            "{} is not the record's own file (owner uid {}, {} links; the script ran as uid {owner})",
            path.display(),
            now.st_uid,
            now.st_nlink
        )));
    }
    Ok(())
}

/// Read one line (to `\n` or the end), keeping at most `keep` bytes of it in
/// `buf`: its whole length (newline excluded), None at the end. `scanned`
/// counts every byte read.
fn next_line(
    r: &mut impl BufRead,
    keep: usize,
    buf: &mut Vec<u8>,
    scanned: &mut u64,
    cap: u64,
) -> io::Result<Option<u64>> {
    buf.clear();
    let mut len = 0u64;
    let mut any = false;
    loop {
        if *scanned >= cap {
            // Read to the bound: the line ends here for this page.
            return Ok(any.then_some(len));
        }
        let chunk = r.fill_buf()?;
        if chunk.is_empty() {
            return Ok(any.then_some(len));
        }
        any = true;
        let chunk = &chunk[..chunk.len().min((cap - *scanned) as usize)];
        let (take, end) = match chunk.iter().position(|b| *b == b'\n') {
            Some(i) => (i, true),
            None => (chunk.len(), false),
        };
        let room = keep.saturating_sub(buf.len()).min(take);
        buf.extend_from_slice(&chunk[..room]);
        len += take as u64;
        let used = take + usize::from(end);
        *scanned += used as u64;
        r.consume(used);
        if end {
            return Ok(Some(len));
        }
    }
}

/// The kept bytes as text: clipped at a character boundary, invalid UTF-8
/// replaced.
fn text_of(bytes: &[u8], clipped: bool) -> String {
    match std::str::from_utf8(bytes) {
        Ok(t) => t.to_string(),
        // A character cut by the clip: up to it.
        Err(e) if clipped && e.error_len().is_none() => {
            String::from_utf8_lossy(&bytes[..e.valid_up_to()]).into_owned()
        }
        Err(_) => String::from_utf8_lossy(bytes).into_owned(),
    }
}

/// One page of `r` (a calls.jsonl): from line `offset`, at most `limit` lines
/// (at most [`CALLS_PAGE_MAX_LINES`]; 0 is refused, -32602) and [`CALLS_PAGE_MAX_BYTES`] of text
/// (at least one line), each clipped to [`CALLS_LINE_MAX_BYTES`]; at most
/// [`CALLS_SCAN_MAX_BYTES`] read.
pub fn page(
    script_id: &str,
    r: impl io::Read,
    offset: u64,
    limit: Option<usize>,
) -> Result<CallsPage, RpcError> {
    page_within(script_id, r, offset, limit, CALLS_SCAN_MAX_BYTES)
}

/// [`page`], reading at most `cap` bytes.
fn page_within(
    script_id: &str,
    r: impl io::Read,
    offset: u64,
    limit: Option<usize>,
    cap: u64,
) -> Result<CallsPage, RpcError> {
    let io_err = |e: io::Error| RpcError::internal(format!("calls.jsonl of {script_id}: {e}"));
    let limit = page_limit(limit)?;
    let mut r = BufReader::with_capacity(64 * 1024, r);
    let mut at = At {
        buf: Vec::new(),
        scanned: 0,
        n: 0,
        cap,
    };
    let beyond = || {
        RpcError::invalid_params(format!(
            "offset {offset}: calls.jsonl of {script_id} holds more than {} MiB before that line, \
             more than one page reads",
            cap >> 20
        ))
    };
    while at.n < offset {
        if at.scanned >= cap {
            return Err(beyond());
        }
        if at.next(&mut r, 0).map_err(io_err)?.is_none() {
            return Ok(CallsPage {
                script_id: script_id.to_string(),
                offset,
                next_offset: None,
                lines: vec![],
            });
        }
        at.n += 1;
    }
    if at.scanned >= cap {
        // The line before `offset` ran to the bound: this page would be empty
        // and name itself as the next.
        return Err(beyond());
    }
    let (lines, next_offset) = read_page(&mut r, &mut at, limit).map_err(io_err)?;
    Ok(CallsPage {
        script_id: script_id.to_string(),
        offset,
        next_offset,
        lines,
    })
}

/// The lines a page may hold. A page of no lines would name itself as the
/// next (a pager that follows `next_offset` would ask for it forever):
/// refused, as a page that holds more than asked would break "at most `limit`".
fn page_limit(limit: Option<usize>) -> Result<usize, RpcError> {
    match limit {
        Some(0) => Err(RpcError::invalid_params(format!(
            "limit 0: a page of calls.jsonl holds 1 to {CALLS_PAGE_MAX_LINES} lines \
             (leave limit out for {CALLS_PAGE_MAX_LINES})"
        ))),
        Some(n) => Ok(n.min(CALLS_PAGE_MAX_LINES)),
        None => Ok(CALLS_PAGE_MAX_LINES),
    }
}

/// Where a read of calls.jsonl is: the line last read (kept bytes), the bytes
/// read so far and their bound, the number of the next line.
struct At {
    buf: Vec<u8>,
    scanned: u64,
    n: u64,
    cap: u64,
}

impl At {
    /// The next line, `keep` bytes of it kept (`next_line`).
    fn next(&mut self, r: &mut impl BufRead, keep: usize) -> io::Result<Option<u64>> {
        next_line(r, keep, &mut self.buf, &mut self.scanned, self.cap)
    }
}

/// The page's lines from `at`, at most `limit` and [`CALLS_PAGE_MAX_BYTES`]
/// of text (at least one line), and the next page's first line, if any.
fn read_page(
    r: &mut impl BufRead,
    at: &mut At,
    limit: usize,
) -> io::Result<(Vec<CallLine>, Option<u64>)> {
    let (mut lines, mut bytes) = (Vec::new(), 0usize);
    loop {
        if lines.len() >= limit || at.scanned >= at.cap {
            let at_end = r.fill_buf()?.is_empty();
            return Ok((lines, (!at_end).then_some(at.n)));
        }
        let Some(len) = at.next(r, CALLS_LINE_MAX_BYTES)? else {
            return Ok((lines, None));
        };
        let clipped = len > at.buf.len() as u64;
        let text = text_of(&at.buf, clipped);
        if !lines.is_empty() && bytes + text.len() > CALLS_PAGE_MAX_BYTES {
            return Ok((lines, Some(at.n))); // this line starts the next page
        }
        bytes += text.len();
        lines.push(CallLine {
            n: at.n,
            text,
            clipped_bytes: clipped.then_some(len),
        });
        at.n += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    fn lines_of(p: &CallsPage) -> Vec<(u64, &str)> {
        p.lines.iter().map(|l| (l.n, l.text.as_str())).collect()
    }

    #[test]
    fn pages_follow_each_other_to_the_end() {
        let text = "a\nb\nc\nd\ne";
        let p = page("s", text.as_bytes(), 0, Some(2)).unwrap();
        assert_eq!(
            (lines_of(&p), p.next_offset),
            (vec![(0, "a"), (1, "b")], Some(2))
        );
        let p = page("s", text.as_bytes(), 2, Some(2)).unwrap();
        assert_eq!(
            (lines_of(&p), p.next_offset),
            (vec![(2, "c"), (3, "d")], Some(4))
        );
        let p = page("s", text.as_bytes(), 4, Some(2)).unwrap();
        assert_eq!(
            (lines_of(&p), p.next_offset),
            (vec![(4, "e")], None),
            "a torn last line too"
        );
        let p = page("s", "a\nb\n".as_bytes(), 0, Some(2)).unwrap();
        assert_eq!(p.next_offset, None, "exactly at the end");
        let p = page("s", text.as_bytes(), 99, None).unwrap();
        assert!(p.lines.is_empty() && p.next_offset.is_none());
        let e = page("s", text.as_bytes(), 0, Some(0)).unwrap_err();
        assert_eq!(e.code, crate::protocol::code::INVALID_PARAMS, "{e}");
        assert!(e.message.starts_with("limit 0: "), "{e}");
        let p = page("s", text.as_bytes(), 0, Some(1)).unwrap();
        assert_eq!((lines_of(&p), p.next_offset), (vec![(0, "a")], Some(1)));
    }

    #[test]
    fn every_bound_holds() {
        // Lines: at most CALLS_PAGE_MAX_LINES whatever is asked.
        let many = "{}\n".repeat(CALLS_PAGE_MAX_LINES * 2);
        let p = page("s", many.as_bytes(), 0, Some(usize::MAX)).unwrap();
        assert_eq!(p.lines.len(), CALLS_PAGE_MAX_LINES);
        assert_eq!(p.next_offset, Some(CALLS_PAGE_MAX_LINES as u64));
        // A line: clipped, at a character boundary, its length said.
        let long = format!(
            "{}é{}\nnext\n",
            "x".repeat(CALLS_LINE_MAX_BYTES - 1),
            "y".repeat(100)
        );
        let p = page("s", long.as_bytes(), 0, None).unwrap();
        assert_eq!(p.lines[0].text, "x".repeat(CALLS_LINE_MAX_BYTES - 1));
        assert_eq!(
            p.lines[0].clipped_bytes,
            Some((CALLS_LINE_MAX_BYTES + 101) as u64)
        );
        assert_eq!(lines_of(&p)[1], (1, "next"));
        // Bytes per page: lines of 15 KiB, about 68 to a MiB.
        let line = "z".repeat(15 * 1024) + "\n";
        let big = line.repeat(CALLS_PAGE_MAX_LINES);
        let p = page("s", big.as_bytes(), 0, None).unwrap();
        let bytes: usize = p.lines.iter().map(|l| l.text.len()).sum();
        assert!(bytes <= CALLS_PAGE_MAX_BYTES, "{bytes}");
        assert_eq!(p.lines.len(), CALLS_PAGE_MAX_BYTES / (15 * 1024));
        assert_eq!(p.next_offset, Some(p.lines.len() as u64));
        // Bytes read (a bound of 1 MiB here, 64 MiB in the daemon): an offset
        // past that many bytes of lines is refused.
        let cap = 1 << 20;
        let huge = std::io::repeat(b'\n').take(cap + 10);
        let e = page_within("s", huge, cap + 5, None, cap).unwrap_err();
        assert_eq!(e.code, crate::protocol::code::INVALID_PARAMS, "{e}");
        // One endless line is read to the bound only.
        let endless = std::io::repeat(b'q');
        let p = page_within("s", endless, 0, None, cap).unwrap();
        assert_eq!(p.lines.len(), 1);
        assert_eq!(p.lines[0].text.len(), CALLS_LINE_MAX_BYTES);
        assert_eq!(p.next_offset, Some(1));
        // Its next page is refused, not an empty page naming itself as the next.
        let e = page_within("s", std::io::repeat(b'q'), 1, None, cap).unwrap_err();
        assert_eq!(e.code, crate::protocol::code::INVALID_PARAMS, "{e}");
    }

    #[test]
    fn links_fifos_and_devices_are_not_opened() {
        let d = tempfile::tempdir().unwrap();
        let real = d.path().join("real");
        std::fs::create_dir(&real).unwrap();
        std::fs::write(real.join("calls.jsonl"), "{}\n").unwrap();
        let me = nix::unistd::geteuid().as_raw();
        assert!(open_no_links(&real.join("calls.jsonl"), me).is_ok());
        let e = open_no_links(&real.join("calls.jsonl"), me + 1).unwrap_err();
        assert!(e.to_string().contains("not the record's own file"), "{e}");
        std::fs::hard_link(real.join("calls.jsonl"), real.join("second")).unwrap();
        let e = open_no_links(&real.join("calls.jsonl"), me).unwrap_err();
        assert!(e.to_string().contains("2 links"), "{e}");
        std::fs::remove_file(real.join("second")).unwrap();
        std::os::unix::fs::symlink(&real, d.path().join("link")).unwrap();
        let e = open_no_links(&d.path().join("link/calls.jsonl"), me).unwrap_err();
        assert!(e.to_string().contains("symbolic link"), "{e}");
        std::os::unix::fs::symlink("/etc/passwd", real.join("passwd")).unwrap();
        assert!(open_no_links(&real.join("passwd"), 0).is_err());
        nix::unistd::mkfifo(&real.join("fifo"), Mode::from_bits_truncate(0o600)).unwrap();
        assert!(
            open_no_links(&real.join("fifo"), me).is_err(),
            "a FIFO would block"
        );
        assert!(open_no_links(Path::new("/dev/null"), 0).is_err());
        assert!(open_no_links(Path::new("relative/x"), me).is_err());
    }
}
