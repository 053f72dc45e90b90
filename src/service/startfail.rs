//! A daemon that cannot start (a broken config or key, an unusable state
//! directory) answers the connections that activated it before it exits, instead
//! of leaving them queued. A connection still queued on the socket makes systemd
//! start the service again at once; five such starts in 10 s hit the start limit,
//! and then scriptgate.socket fails too (`service-start-limit-hit`), so that fixing
//! the file is no longer enough. Answered and closed, each engine connection costs
//! one start, and is told why: the error names the file, the line and the fix.

use crate::protocol::refusal::{Reason, Refused};
use crate::protocol::{response_line, RpcError};
use serde_json::Value;
use std::io::Write;
use std::os::fd::{BorrowedFd, OwnedFd};

/// At most this many queued connections are answered (the socket's backlog is
/// bounded anyway; this bounds the work of a daemon on its way out).
const MAX_ANSWERED: usize = 256;

/// The error every queued connection gets.
pub fn error(why: &dyn std::fmt::Display) -> RpcError {
    Refused::new(
        Reason::DaemonCannotStart,
        format!(
            "scriptgated cannot start: {why}; fix it, then run \"systemctl restart scriptgate\" (or just connect again)"
        ),
    )
    .into()
}

/// Answer every connection queued on the activated sockets with `why`, then
/// close it. Never blocks: the sockets are switched to non-blocking first.
/// The socket is 0666 and the configuration (its groups) is what failed: only root
/// is told why; anyone else learns that the daemon cannot start, and where to look.
pub fn answer_pending(sockets: &[OwnedFd], why: &dyn std::fmt::Display) {
    let line = response_line(&Value::Null, &Err(error(why)));
    let generic = response_line(
        &Value::Null,
        &Err(error(
            &"see journalctl -u scriptgate (the reason is shown to root only)",
        )),
    );
    for fd in sockets {
        answer_on(std::os::fd::AsFd::as_fd(fd), &line, &generic);
    }
}

fn answer_on(fd: BorrowedFd, line: &str, generic: &str) {
    let Ok(owned) = fd.try_clone_to_owned() else {
        return;
    };
    let listener = std::os::unix::net::UnixListener::from(owned);
    if listener.set_nonblocking(true).is_err() {
        return;
    }
    for _ in 0..MAX_ANSWERED {
        match listener.accept() {
            Ok((mut conn, _)) => {
                let _ = conn.set_nonblocking(true);
                let root =
                    nix::sys::socket::getsockopt(&conn, nix::sys::socket::sockopt::PeerCredentials)
                        .is_ok_and(|c| c.uid() == 0);
                let line = if root { line } else { generic };
                // A new socket's send buffer is empty: one line fits without waiting.
                let _ = conn.write_all(line.as_bytes());
            }
            Err(_) => break, // EAGAIN: nothing more queued (or not a listener)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::os::unix::net::{UnixListener, UnixStream};

    #[test]
    fn queued_connections_are_told_why_and_closed() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("sock");
        let listener = UnixListener::bind(&path).unwrap();
        let mut clients: Vec<UnixStream> = (0..3)
            .map(|_| UnixStream::connect(&path).unwrap())
            .collect();
        let fd: OwnedFd = listener.into();
        answer_pending(
            &[fd],
            &"/etc/scriptgate/scriptgate.toml: line 8: unknown field `bogus`",
        );
        for c in &mut clients {
            let mut text = String::new();
            c.read_to_string(&mut text).unwrap();
            let v: Value = serde_json::from_str(text.trim()).unwrap();
            assert_eq!(v["error"]["code"], -32603, "{v}");
            assert_eq!(v["error"]["data"]["reason"], "daemon_cannot_start");
            let m = v["error"]["message"].as_str().unwrap();
            assert!(
                m.starts_with("scriptgated cannot start: /etc/scriptgate/scriptgate.toml: line 8"),
                "{m}"
            );
        }
    }
}
