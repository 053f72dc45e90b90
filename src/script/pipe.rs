//! The read ends of a sandbox's pipes (the script's stdout, stderr and fd 3),
//! which end where the script ends, not where the last holder of their write
//! ends goes.
//!
//! The outer bwrap holds every descriptor it passed into the sandbox until it
//! exits, and it exits only once its child, the sandbox's init, has exited,
//! which takes the namespaces' teardown (several milliseconds: an empty
//! script's whole run, pre-made). Once the init has reported, every process of
//! the script has been killed and reaped, and nothing left writes to these
//! pipes: what is in them is all there will be. `End::now` then makes each one
//! read as ended once it is empty, and the result need not wait for the
//! teardown.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use tokio::io::{AsyncRead, ReadBuf};
use tokio::net::unix::pipe::Receiver;

/// Says that the script's writers are gone (`now`), to every `Pipe` made with
/// it: one waker slot each, so that nothing grows however often they wait.
#[derive(Default)]
pub struct End {
    ended: AtomicBool,
    slots: Mutex<Vec<Arc<Mutex<Option<Waker>>>>>,
}

impl End {
    pub fn new() -> Arc<End> {
        Arc::new(End::default())
    }

    /// Every writer inside the sandbox is gone: each pipe reads what it holds,
    /// then ends.
    pub fn now(&self) {
        self.ended.store(true, Ordering::Release);
        for slot in self.slots.lock().unwrap().iter() {
            if let Some(w) = slot.lock().unwrap().take() {
                w.wake();
            }
        }
    }

    fn has_come(&self) -> bool {
        self.ended.load(Ordering::Acquire)
    }
}

/// A pipe's read end that ends at its end of file, or once `End::now` was said
/// and it is empty.
pub struct Pipe {
    inner: Receiver,
    end: Arc<End>,
    waker: Arc<Mutex<Option<Waker>>>,
}

impl Pipe {
    pub fn new(fd: OwnedFd, end: &Arc<End>) -> io::Result<Pipe> {
        let waker = Arc::new(Mutex::new(None));
        end.slots.lock().unwrap().push(waker.clone());
        Ok(Pipe {
            inner: Receiver::from_owned_fd(fd)?,
            end: end.clone(),
            waker,
        })
    }

    /// What the pipe holds now, read without waiting (its descriptor is
    /// non-blocking); nothing: its end.
    fn read_now(&self, buf: &mut ReadBuf<'_>) -> io::Result<()> {
        loop {
            match nix::unistd::read(self.inner.as_fd(), buf.initialize_unfilled()) {
                Ok(n) => {
                    buf.advance(n);
                    return Ok(());
                }
                Err(nix::errno::Errno::EAGAIN) => return Ok(()),
                Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => return Err(e.into()),
            }
        }
    }
}

impl AsyncRead for Pipe {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.end.has_come() {
            return Poll::Ready(this.read_now(buf));
        }
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Pending => {
                *this.waker.lock().unwrap() = Some(cx.waker().clone());
                // Said between the read and the waker's registration: not missed.
                if this.end.has_come() {
                    return Poll::Ready(this.read_now(buf));
                }
                Poll::Pending
            }
            ready => ready,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    #[tokio::test]
    async fn a_pipe_reads_what_it_holds_then_ends_once_the_end_is_said() {
        let (r, w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).unwrap();
        let end = End::new();
        let mut pipe = Pipe::new(r, &end).unwrap();
        nix::unistd::write(&w, b"before").unwrap();
        let mut buf = [0u8; 64];
        let n = pipe.read(&mut buf).await.unwrap();
        assert_eq!(&buf[..n], b"before");
        // A reader waiting on an empty pipe whose writer is still open...
        let reader = tokio::spawn(async move {
            let mut all = Vec::new();
            pipe.read_to_end(&mut all).await.unwrap();
            all
        });
        nix::unistd::write(&w, b" and after").unwrap();
        tokio::task::yield_now().await;
        // ...ends once the end is said, with everything written before it.
        end.now();
        let all = tokio::time::timeout(std::time::Duration::from_secs(10), reader)
            .await
            .expect("the pipe ended")
            .unwrap();
        assert_eq!(all, b" and after");
        drop(w);
    }
}
