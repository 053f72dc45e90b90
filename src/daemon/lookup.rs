//! Finding a script for whoever asks (`script.wait`, `script.status`,
//! `script.cancel`, and the `admin.*` forms), and what a token does to its run:
//! `run.revoke`, `run.describe`.

use crate::daemon::running::{status_of, Running};
use crate::daemon::{Access, Daemon, Peer};
use crate::policy::auth::EngineId;
use crate::policy::runs::RunKey;
use crate::policy::Limits;
use crate::protocol::token;
use crate::protocol::{
    code, Described, Revoked, RpcError, ScriptRef, ScriptResult, ScriptState, ScriptStatus, Status,
};
use crate::script::Stop;
use std::sync::Arc;
use std::time::Duration;

enum Lookup {
    Running(Arc<Running>),
    Done(Box<ScriptResult>),
}

impl Daemon {
    /// `run.describe`: the run_script description for the token's snapshot.
    pub fn describe(
        &self,
        engine: Option<EngineId>,
        token_str: &str,
    ) -> Result<Described, RpcError> {
        let claims = token::verify(token_str, self.peers.key_for(engine), true)?;
        let live = self.live();
        let limits = Limits::effective(&live.cfg.scripts, &claims.snapshot.limits);
        let text = crate::policy::describe::describe(
            &claims.snapshot,
            &limits,
            live.cfg.scripts.return_max_chars,
        );
        Ok(Described {
            tool: crate::policy::describe::run_script_tool(&text),
            text,
        })
    }

    /// May this connection see the script? Its starter, or a holder of a valid token
    /// of the script's run (protocol §4). Administrators use the `admin.*` methods.
    /// `run`: the script's run as stored with it (None: a row of before run
    /// scopes, which only its connection and administrators see).
    fn visible(
        &self,
        who: Access,
        owner: Option<u64>,
        run: Option<&RunKey>,
        token: Option<&str>,
    ) -> bool {
        let (conn, engine, uid) = match who {
            Access::Admin => return true,
            Access::Conn(c, engine, uid) => (c, engine, uid),
        };
        if owner == Some(conn) {
            return true;
        }
        let Some(run) = run else { return false };
        token
            .and_then(|t| token::verify(t, self.peers.key_for(engine), false).ok())
            .is_some_and(|c| self.peers.run_key(engine, uid, &c.run_id) == *run)
    }

    fn lookup(&self, who: Access, r: &ScriptRef) -> Result<Lookup, RpcError> {
        let not_found = || match who {
            Access::Admin => RpcError::no_such_script(&r.script_id),
            Access::Conn(..) => RpcError::not_found(&r.script_id),
        };
        if let Some(run) = self.registry.running(&r.script_id) {
            if self.visible(who, Some(run.owner), Some(&run.run_key), r.token.as_deref()) {
                return Ok(Lookup::Running(run));
            }
            return Err(not_found());
        }
        let owner = self.registry.finished_owner(&r.script_id);
        match self.store.run_of(&r.script_id) {
            // The row keeps the run's scope beside its id: a token shows the
            // result only when it names that run in that scope.
            Ok(Some((res, scope))) => {
                let run = scope.map(|s| RunKey::new(s, &res.run_id));
                if self.visible(who, owner, run.as_ref(), r.token.as_deref()) {
                    Ok(Lookup::Done(Box::new(res)))
                } else {
                    Err(not_found())
                }
            }
            Ok(None) => Err(not_found()),
            Err(e) => Err(RpcError::internal(e.to_string())),
        }
    }

    pub async fn wait(&self, who: Access, r: ScriptRef) -> Result<ScriptResult, RpcError> {
        self.wait_turn(who, r, async {}).await
    }

    /// `wait`, with `turn` awaited once the result is there and before it is
    /// copied out: many waits of one script that ends together copy its result
    /// one at a time, as their connection takes their answers.
    pub async fn wait_turn(
        &self,
        who: Access,
        r: ScriptRef,
        turn: impl std::future::Future<Output = ()>,
    ) -> Result<ScriptResult, RpcError> {
        let still_running = || {
            RpcError::with_data(
                code::STILL_RUNNING,
                format!("script {} is still running", r.script_id),
                serde_json::json!({"reason": "still_running"}),
            )
        };
        let run = match self.lookup(who, &r)? {
            Lookup::Done(res) => {
                drop(res);
                turn.await;
                return match self.lookup(who, &r)? {
                    Lookup::Done(res) => Ok(*res),
                    Lookup::Running(_) => Err(still_running()),
                };
            }
            Lookup::Running(run) => run,
        };
        let mut rx = run.result.clone();
        let done = async {
            loop {
                if rx.borrow_and_update().is_some() {
                    return true;
                }
                if rx.changed().await.is_err() {
                    return rx.borrow().is_some();
                }
            }
        };
        let done = match r.timeout_s {
            Some(t) if t >= 0.0 => tokio::time::timeout(Duration::from_secs_f64(t.min(1e7)), done)
                .await
                .unwrap_or(false),
            _ => done.await,
        };
        if !done {
            return Err(still_running());
        }
        turn.await;
        let res = rx.borrow().clone();
        res.ok_or_else(still_running)
    }

    pub fn status(&self, who: Access, r: ScriptRef) -> Result<ScriptStatus, RpcError> {
        Ok(match self.lookup(who, &r)? {
            Lookup::Running(run) => status_of(&r.script_id, &run),
            Lookup::Done(res) => ScriptStatus {
                script_id: res.script_id,
                state: res.status,
                calls: res.calls,
                failures: res.failures,
                elapsed_ms: res.duration_ms,
                progress: None,
            },
        })
    }

    pub async fn cancel(
        &self,
        who: Access,
        r: ScriptRef,
        why: &str,
    ) -> Result<ScriptState, RpcError> {
        let run = match self.lookup(who, &r)? {
            Lookup::Done(res) => {
                return Ok(ScriptState {
                    script_id: res.script_id,
                    state: res.status,
                    already_finished: true,
                })
            }
            Lookup::Running(run) => run,
        };
        let _ = run.stop.send(Some(Stop::Cancel(why.into())));
        let state = self
            .wait(
                who,
                ScriptRef {
                    timeout_s: Some(30.0),
                    ..r.clone()
                },
            )
            .await
            .map(|res| res.status);
        Ok(ScriptState {
            script_id: r.script_id,
            state: state.unwrap_or(Status::Cancelled),
            already_finished: false,
        })
    }

    /// `run.revoke`: refuse further starts and calls of the run, cancel its scripts.
    pub async fn revoke(&self, peer: Peer, token_str: &str) -> Result<Revoked, RpcError> {
        let claims = token::verify(token_str, self.peers.key_for(peer.engine()), false)?;
        let run_key = self
            .peers
            .run_key(peer.engine(), peer.uid(), &claims.run_id);
        // At most REVOCATIONS_PER_SCOPE of a scope, in memory and in the store:
        // past it the scope's oldest is dropped (scriptgate-protocol(7), run.revoke).
        // The store's write is queued under the set's lock: both see the
        // revocations in one order and drop the same oldest.
        let (dropped, stored) = {
            let mut set = self.revoked.write().unwrap();
            (set.insert(run_key.clone()), self.store.revoke(&run_key))
        };
        if let Some(d) = dropped {
            warn_dropped(&d);
        }
        stored
            .await
            .map_err(|e| RpcError::internal(e.to_string()))?;
        let targets = self.registry.running_where(|r| r.run_key == run_key);
        for r in &targets {
            let _ = r.stop.send(Some(Stop::Cancel(format!(
                "run {} was revoked",
                claims.run_id
            ))));
        }
        for r in &targets {
            let mut rx = r.result.clone();
            let _ =
                tokio::time::timeout(Duration::from_secs(30), rx.wait_for(Option::is_some)).await;
        }
        Ok(Revoked {
            run_id: claims.run_id,
            cancelled: targets.len(),
        })
    }
}

/// A revocation dropped past a scope's bound: the first of a scope, then one
/// line per 1,000, so that a flooding engine does not flood the journal too.
fn warn_dropped(d: &crate::policy::runs::Dropped) {
    if d.count == 1 || d.count % 1000 == 0 {
        tracing::warn!(
            "run.revoke: {} keeps at most {} run revocations; dropped the oldest \
             (run {:?}; {} dropped so far): its run may start again",
            d.run.scope,
            crate::policy::runs::REVOCATIONS_PER_SCOPE,
            d.run.run_id,
            d.count
        );
    }
}
