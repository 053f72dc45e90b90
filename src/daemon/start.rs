//! `script.start`: the steps of a start in their order, read top to bottom
//! ([`Daemon::start_signed`]), and the audit of a refused one. Each step lives
//! in a file of its own: `admission`, `approval`, `record`, `supervise`.

use crate::audit::RefusalRow;
use crate::daemon::admission::Admission;
use crate::daemon::ratelimit::Verdict;
use crate::daemon::{Daemon, Live, Peer};
use crate::protocol::refusal::Refused;
use crate::protocol::token::{RunRef, Signed};
use crate::protocol::{RpcError, StartParams, Started};
use crate::script::engine::EngineLink;
use crate::time::now_ms;
use std::sync::Arc;

/// A fresh script id: 16 hex digits from the kernel's random source.
fn new_script_id() -> String {
    let mut b = [0u8; 8];
    getrandom::getrandom(&mut b).expect("getrandom");
    b.iter().map(|x| format!("{x:02x}")).collect()
}

impl Daemon {
    /// Step 1's checker, with what it reads of this daemon and of the
    /// configuration in force for this start.
    pub(crate) fn admission<'a>(&'a self, live: &'a Live) -> Admission<'a> {
        Admission {
            peers: &self.peers,
            revoked: &self.revoked,
            rules: &live.rules,
            stopping: &self.stopping,
        }
    }

    /// `script.start`. Refusals are audited (and logged at warning priority) under
    /// the run the token names once its signature holds, even when the token is
    /// then refused (expired, a bad snapshot). The start reads the
    /// configuration in force once: a reload meanwhile changes the next start,
    /// not this one.
    pub async fn start(
        self: &Arc<Self>,
        peer: Peer,
        engine: Arc<dyn EngineLink>,
        p: StartParams,
    ) -> Result<Started, RpcError> {
        let live = self.live();
        let (run, r) = match self.admission(&live).verify(peer, &p.token) {
            Ok(signed) => (
                signed.run(),
                self.start_signed(&live, peer, engine, p, signed).await,
            ),
            Err(e) => (None, Err(e)),
        };
        if let Err(e) = &r {
            self.record_refusal(e, run, peer).await;
        }
        r.map_err(RpcError::from)
    }

    /// The steps of a start whose token's signature holds. The order is the
    /// contract of scriptgate-protocol(7) and ARCHITECTURE.md: nothing is asked
    /// of the engine before the start is admitted, no slot is held while the
    /// engine decides, and nothing runs before it is recorded.
    async fn start_signed(
        self: &Arc<Self>,
        live: &Arc<Live>,
        peer: Peer,
        engine: Arc<dyn EngineLink>,
        p: StartParams,
        signed: Signed,
    ) -> Result<Started, Refused> {
        // 1. Admit: nothing runs unless the run is proven, not revoked, and its
        //    workspace, plan, identity and limits hold.
        let admitted = self.admission(live).admit(peer, &p, signed)?;
        let script_id = new_script_id();
        // 2. One approval for all declared write tools. A start waiting for it
        //    holds no max_running slot, so an engine that never answers blocks
        //    only its own starts.
        let approval = self
            .seek_approval(live, engine.as_ref(), &script_id, &admitted, &p)
            .await?;
        // 3. A max_running slot, held until the script's end is recorded. The
        //    approval may have taken long: a daemon that began to stop meanwhile
        //    starts nothing.
        self.admission(live).check_not_stopping()?;
        let slot = self.registry.reserve_slot()?;
        // 4. The record: first the workspace's disk bound, which its files are
        //    under too (their project's quota, `daemon::disk`); then the record
        //    directory and the audit row, before anything runs.
        let record = self
            .create_record(live, &script_id, peer, &p, &admitted, approval)
            .await?;
        // 5. Start it; answer once it runs.
        self.supervise(script_id, peer, engine, admitted, record, slot)
            .await
    }

    /// A refused start: a journal entry and an audit row, unless refusals come
    /// faster than the rate limit; then they are counted and summarised.
    async fn record_refusal(&self, e: &Refused, run: Option<RunRef>, peer: Peer) {
        let verdict = self.refusals.lock().unwrap().observe(now_ms(), e.reason());
        if verdict == Verdict::Count {
            return;
        }
        self.flush_refusals().await;
        let (run_id, runner) = match run {
            Some(RunRef { run_id, runner }) => (Some(run_id), runner),
            None => (None, None),
        };
        crate::audit::journal::start_refused(
            e,
            run_id.as_deref(),
            runner.as_deref(),
            peer.uid(),
            peer.pid(),
        );
        let _ = self
            .store
            .refusal(RefusalRow {
                run_id,
                runner,
                peer_uid: peer.uid(),
                peer_pid: peer.pid(),
                code: e.code(),
                reason: e.reason().wire().map(str::to_string),
                message: e.message().to_string(),
            })
            .await;
    }

    /// A connection of `uid` refused at the gate for `reason`: counted (a
    /// map update; written with the next [`Daemon::flush_refusals`]).
    pub fn count_refused_connection(&self, uid: u32, reason: &'static str) {
        self.refused_connections
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .count(now_ms(), uid, reason);
    }

    /// Write the refused connections counted, then the summary of refused
    /// starts that were only counted, if there are any.
    pub async fn flush_refusals(&self) {
        let counted = self
            .refused_connections
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Err(e) = self.store.refused_connections(counted).await {
            tracing::warn!("{e}");
        }
        let Some(s) = self.refusals.lock().unwrap().take() else {
            return;
        };
        let message = s.message(now_ms());
        crate::audit::journal::refusals_counted(s.count, &message);
        // Named as a refusal recorded alone is (`Store::refusal`): its wire
        // reason, or "other".
        let mut by_reason = std::collections::BTreeMap::<&str, u64>::new();
        for (r, n) in &s.by_reason {
            *by_reason.entry(r.wire().unwrap_or("other")).or_default() += n;
        }
        let by_reason = by_reason
            .into_iter()
            .map(|(r, n)| (r.to_string(), n))
            .collect();
        let _ = self
            .store
            .refusal_counted(
                RefusalRow {
                    run_id: None,
                    runner: None,
                    peer_uid: u32::MAX,
                    peer_pid: None,
                    code: 0,
                    reason: Some("rate_limited".into()),
                    message,
                },
                by_reason,
            )
            .await;
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn script_ids_are_sixteen_hex_digits_and_new_each_time() {
        let ids: std::collections::HashSet<String> =
            (0..64).map(|_| super::new_script_id()).collect();
        assert_eq!(ids.len(), 64);
        for id in &ids {
            assert_eq!(id.len(), 16);
            assert!(
                id.bytes()
                    .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()),
                "{id}"
            );
        }
    }
}
