//! The daemon's connections and its life: the connections being served (the
//! barrier of a stop), a lost engine's scripts, a graceful stop, and what the
//! service waits on (idle tracking, the drain).

use crate::daemon::Daemon;
use crate::script::Stop;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::Duration;

impl Daemon {
    /// `(script_id, calls, failures)` of every running script.
    pub(crate) fn live_counts(&self) -> Vec<crate::audit::checkpoint::Counts> {
        self.registry
            .all_running()
            .into_iter()
            .map(|(id, r)| {
                let l = &r.live;
                let calls = l.calls.load(Ordering::Relaxed);
                (id, calls, l.failures.load(Ordering::Relaxed))
            })
            .collect()
    }

    /// The workspaces of running scripts (retention leaves them alone).
    pub fn running_workspaces(&self) -> Vec<PathBuf> {
        self.registry
            .all_running()
            .into_iter()
            .map(|(_, r)| r.workspace.clone())
            .collect()
    }

    pub fn running_count(&self) -> usize {
        self.registry.running_count()
    }

    /// Graceful stop, first step: refuse new starts from now on.
    pub fn stop_starting(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        self.changed.notify_waiters();
    }

    /// Wait until no script runs.
    pub async fn all_finished(&self) {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if self.running_count() == 0 {
                return;
            }
            changed.await;
        }
    }

    /// Wakes when a script starts or ends (idle tracking, STATUS=).
    pub async fn changed(&self) {
        self.changed.notified().await
    }

    /// A connection is served: its answers count in [`Daemon::answers_written`]
    /// until [`Daemon::served`].
    pub fn serving(&self, conn: u64, endpoint: crate::protocol::rpc::Endpoint) {
        self.answering.lock().unwrap().insert(conn, endpoint);
    }

    /// The connection is done: its last answers were written, or given up.
    pub fn served(&self, conn: u64) {
        self.answering.lock().unwrap().remove(&conn);
    }

    /// Until every connection's answers to the requests taken so far are
    /// written (`rpc::Endpoint::answers_written`): the barrier between the
    /// last script's end and the exit of a stopping daemon, so that the
    /// `script.wait`s that end woke are answered. The caller bounds it.
    pub async fn answers_written(&self) {
        let all: Vec<crate::protocol::rpc::Endpoint> =
            self.answering.lock().unwrap().values().cloned().collect();
        for e in all {
            e.answers_written().await;
        }
    }

    /// A connection closed: its scripts lose their engine and are cancelled.
    pub fn disconnected(&self, conn: u64) {
        for r in self.registry.running_where(|r| r.owner == conn) {
            let _ = r.stop.send(Some(Stop::EngineLost));
        }
    }

    /// Until the sandboxes of ended scripts are torn down and their teardown
    /// times recorded, for at most `bound`: before a daemon's process exits
    /// (a one-shot `scriptgate run`'s, a stopping service's), so that no
    /// cgroup leaf is left behind and every row has its `teardown_ms`.
    pub async fn settled(&self, bound: Duration) {
        self.teardowns.close();
        let _ = tokio::time::timeout(bound, self.teardowns.wait()).await;
        self.teardowns.reopen();
    }

    /// Shutdown: stop every script as `interrupted` and wait (bounded) for records.
    pub async fn interrupt_all(&self, grace: Duration) {
        let all = self.registry.running_where(|_| true);
        for r in &all {
            let _ = r.stop.send(Some(Stop::Interrupt));
        }
        let deadline = tokio::time::Instant::now() + grace;
        for r in &all {
            let mut rx = r.result.clone();
            let _ = tokio::time::timeout_at(deadline, rx.wait_for(Option::is_some)).await;
        }
    }
}
