//! The connection an HTTP request came on, as the kernel sees it. The
//! transport learns that its client hung up only when it next reads or writes
//! there; a client that drops a call and re-issues it at once can be quicker
//! than that. Asking the kernel settles it: the hang-up arrived before the
//! re-issue did.

use std::os::fd::{AsFd, AsRawFd as _, OwnedFd};
use std::sync::Mutex;

/// A duplicate of a connection's socket, held while the connection is served.
pub(super) struct Line {
    fd: Mutex<Option<OwnedFd>>,
}

impl Line {
    /// The line of `socket`; `None` where its descriptor cannot be duplicated
    /// (the hang-up is then learnt the transport's way only).
    pub(super) fn of(socket: &impl AsFd) -> Option<Line> {
        let fd = socket.as_fd().try_clone_to_owned().ok()?;
        Some(Line {
            fd: Mutex::new(Some(fd)),
        })
    }

    /// The connection is no longer served: its duplicate goes, so that the
    /// socket closes with the transport's.
    pub(super) fn end(&self) {
        self.fd.lock().unwrap_or_else(|p| p.into_inner()).take();
    }

    /// The client hung up (closed or shut down its side, or reset the
    /// connection), or the connection is no longer served. Never blocks. A
    /// client that sent more before it hung up (a pipelined request) is taken
    /// as still there: its end is read first.
    pub(super) fn hung_up(&self) -> bool {
        use nix::sys::socket::{recv, MsgFlags};
        let fd = self.fd.lock().unwrap_or_else(|p| p.into_inner());
        let Some(fd) = fd.as_ref() else {
            return true;
        };
        let mut byte = [0u8; 1];
        match recv(
            fd.as_raw_fd(),
            &mut byte,
            MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT,
        ) {
            // The end of what it sends: it shut its side or closed.
            Ok(0) => true,
            // More to read, or nothing yet: it is there.
            Ok(_) | Err(nix::errno::Errno::EAGAIN) | Err(nix::errno::Errno::EINTR) => false,
            // Reset, or the socket failed: nobody reads an answer there.
            Err(_) => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{Shutdown, TcpListener, TcpStream};

    #[test]
    fn a_hang_up_is_seen_at_once_and_an_open_line_is_not_one() {
        for how in ["shutdown", "close", "unread close"] {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = listener.local_addr().unwrap();
            let client = TcpStream::connect(addr).unwrap();
            let (served, _) = listener.accept().unwrap();
            let line = Line::of(&served).unwrap();
            assert!(!line.hung_up(), "{how}: an open connection");
            if how == "shutdown" {
                use std::io::Write as _;
                (&client).write_all(b"more").unwrap();
                let mut buf = [0u8; 4];
                served.peek(&mut buf).unwrap();
                assert!(!line.hung_up(), "an open connection with more to read");
                use std::io::Read as _;
                (&served).read_exact(&mut buf).unwrap();
            }
            if how == "unread close" {
                // Unread data at close: the client resets the connection.
                use std::io::Write as _;
                (&served).write_all(b"unread").unwrap();
                let mut buf = [0u8; 1];
                client.peek(&mut buf).unwrap();
            }
            match how {
                "shutdown" => client.shutdown(Shutdown::Write).unwrap(),
                _ => drop(client),
            }
            // On loopback the hang-up is delivered before the call returns;
            // the next connection is made after it, like a client's re-issue.
            let _next = TcpStream::connect(addr).unwrap();
            assert!(line.hung_up(), "{how}: the hang-up is seen");
        }
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (served, _) = listener.accept().unwrap();
        let line = Line::of(&served).unwrap();
        line.end();
        assert!(line.hung_up(), "a line no longer served counts as hung up");
        drop(client);
    }
}
