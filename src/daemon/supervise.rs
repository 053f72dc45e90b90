//! Step 5 of a start, supervision: the script's broker and launch, its
//! registration as running, and its supervisor, which runs it
//! (`script::run`), records its result, frees its slot and tells the engine.

use crate::daemon::admission::Admitted;
use crate::daemon::record::Record;
use crate::daemon::registry::Slot;
use crate::daemon::running::{status_of, Running};
use crate::daemon::{Daemon, Peer};
use crate::protocol::refusal::{Reason, Refused};
use crate::protocol::{Notification, ScriptResult, Started, Status};
use crate::script::broker::{Broker, BrokerSpec, Live};
use crate::script::engine::EngineLink;
use crate::script::{Ended, Launch, Run, RunRecord, RunWorkspace, SpawnError, Stop};
use serde_json::json;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// A started script, handed to its supervisor.
struct Job {
    script_id: String,
    engine: Arc<dyn EngineLink>,
    running: Arc<Running>,
    launch: Launch,
    broker: Arc<Broker>,
    stop: watch::Receiver<Option<Stop>>,
    /// Answered once the sandbox exists, or could not be spawned.
    started: tokio::sync::oneshot::Sender<Result<(), SpawnError>>,
    result: watch::Sender<Option<ScriptResult>>,
    /// Freed once the result is recorded and the script deregistered.
    slot: Slot<Running>,
    /// The configuration in force when it started, kept to its end.
    live: Arc<crate::daemon::Live>,
}

impl Daemon {
    /// Step 5: the broker and the launch, the script registered as running, and its
    /// supervisor started. Answers once the sandbox exists (or could not start).
    pub(crate) async fn supervise(
        self: &Arc<Self>,
        script_id: String,
        peer: Peer,
        engine: Arc<dyn EngineLink>,
        a: Admitted,
        rec: Record,
        slot: Slot<Running>,
    ) -> Result<Started, Refused> {
        let (stop_tx, stop) = watch::channel(None);
        let (result, result_rx) = watch::channel(None);
        let running = Arc::new(Running {
            run_id: a.claims.run_id.clone(),
            run_key: a.run_key.clone(),
            runner: a.claims.runner.clone(),
            unit: self.backend.backend.unit_for(&script_id),
            owner: engine.id(),
            peer_uid: peer.uid(),
            run_uid: a.identity.uid,
            started: Instant::now(),
            details_dir: rec.details_dir.clone(),
            workspace: a.workspace.path.clone(),
            trace_id: a.trace.as_ref().map(|t| t.trace_id.clone()),
            live: Arc::new(Live::default()),
            stop: stop_tx,
            result: result_rx,
        });
        let live = rec.live.clone();
        // Its audit row exists: the journal says it started before anything runs
        // (a fleet's merged journal pairs it with its "finished" entry).
        crate::audit::journal::script_started(&crate::audit::journal::Starting {
            script_id: &script_id,
            run_id: &running.run_id,
            runner: running.runner.as_deref(),
            engine_uid: peer.uid(),
            uid: running.run_uid,
            unit: running.unit.as_deref(),
            workspace: &running.workspace.display().to_string(),
            timeout_s: a.limits.timeout_s,
            trace_id: running.trace_id.as_deref(),
        });
        let (broker, launch) = self.broker_and_launch(&script_id, &engine, &running, a, rec);
        self.register(&script_id, &running);
        let (started, started_rx) = tokio::sync::oneshot::channel();
        let job = Job {
            script_id: script_id.clone(),
            engine,
            running,
            launch,
            broker: Arc::new(broker),
            stop,
            started,
            result,
            slot,
            live,
        };
        tokio::spawn(self.clone().run_to_end(job));
        match started_rx.await {
            Ok(Ok(())) => Ok(Started {
                script_id,
                state: Status::Running,
            }),
            Ok(Err(e)) => Err(Refused::new(
                Reason::Spawn,
                format!("the sandbox could not start: {e}"),
            )
            .script(script_id)),
            Err(_) => Err(Refused::internal(
                "the script supervisor ended before the script started",
            )),
        }
    }

    /// The broker of one script (its policy, budget, concurrency and call log),
    /// and what the runner needs to start its sandbox.
    fn broker_and_launch(
        &self,
        script_id: &str,
        engine: &Arc<dyn EngineLink>,
        running: &Running,
        a: Admitted,
        rec: Record,
    ) -> (Broker, Launch) {
        let broker = Broker::new(BrokerSpec {
            script_id: script_id.to_string(),
            run_id: a.claims.run_id.clone(),
            run_key: a.run_key.clone(),
            token_exp: a.claims.exp,
            policy: a.policy,
            max_calls: a.limits.max_calls,
            max_concurrency: a.limits.max_concurrency,
            engine: engine.clone(),
            live: running.live.clone(),
            calls_log: rec.calls_log,
            revoked: self.revoked.clone(),
            max_line: rec.live.cfg.server.max_message_bytes,
            trace: a.trace.clone(),
        });
        let workspace = RunWorkspace::new(
            a.workspace.path.clone(),
            a.workspace.dir,
            a.claims.snapshot.read_only,
        );
        let record = RunRecord::new(
            rec.art.path.join("script.py"),
            rec.art.agent,
            rec.stdout_file,
            rec.stderr_file,
            rec.script_code,
        );
        // No identity to switch to when it is the daemon's own.
        let identity =
            (nix::unistd::Uid::effective().as_raw() != a.identity.uid).then_some(a.identity);
        let notes = rec.disk_note.into_iter().collect();
        let run = Run::new(workspace, record, identity, a.limits, notes);
        (broker, Launch::new(&rec.live.settings, run))
    }

    /// Register a script as running. `run.revoke` adds the run before it scans the
    /// running scripts; checking again after registering means one of the two
    /// always sees the other.
    fn register(&self, script_id: &str, running: &Arc<Running>) {
        self.registry.insert(script_id, running.clone());
        if self.revoked.read().unwrap().contains(&running.run_key) {
            let _ = running.stop.send(Some(Stop::Cancel(format!(
                "run {} was revoked",
                running.run_id
            ))));
        }
        self.changed.notify_waiters();
    }

    /// The supervisor of one script: runs it, then records, deregisters and tells.
    async fn run_to_end(self: Arc<Self>, job: Job) {
        let Job {
            script_id: sid,
            engine,
            running,
            launch,
            broker,
            stop,
            started,
            result: result_tx,
            slot,
            live: config,
        } = job;
        let ticker = tokio::spawn(progress_ticker(
            sid.clone(),
            engine.clone(),
            running.clone(),
        ));
        let mut outcome = crate::script::run(&self.spawner, launch, broker, stop, started).await;
        ticker.abort();
        let teardown = outcome.as_mut().ok().and_then(|e| e.teardown.take());
        // The last state always goes out before script.finished, so that a
        // progress bar reaches its end.
        if running.live.dirty.swap(false, Ordering::Relaxed) {
            engine.send(Notification::ScriptProgress(status_of(&sid, &running)));
        }
        // Not the script's doing: no sandbox, no limits, or no engine any more.
        let infrastructure = match &outcome {
            Err(_) => true,
            Ok(e) => e.setup_failed,
        } || matches!(&*running.stop.borrow(), Some(Stop::EngineLost));
        let result =
            self.build_result(&sid, &running, outcome, config.cfg.scripts.return_max_chars);
        self.record_result(&sid, &running, &result, config.cfg.state.reserve_bytes)
            .await;
        if let Some(t) = teardown {
            self.teardowns.spawn(self.clone().tear_down(sid.clone(), t));
        }
        // Recorded first, then deregistered and the slot freed, and only then
        // told: whoever hears of the end can start the next script at once.
        self.registry.finish(&sid, running.owner);
        drop(slot);
        crate::audit::journal::script_finished(&crate::audit::journal::Finished {
            result: &result,
            runner: running.runner.as_deref(),
            uid: running.run_uid,
            unit: running.unit.as_deref(),
            workspace: &running.workspace.display().to_string(),
            infrastructure,
            trace_id: running.trace_id.as_deref(),
        });
        engine.send(Notification::ScriptFinished(Box::new(result.clone())));
        let _ = result_tx.send(Some(result));
        self.changed.notify_waiters();
    }

    /// What is left of an ended script's sandbox goes, after its result; how
    /// long that took goes into its audit row.
    async fn tear_down(self: Arc<Self>, sid: String, teardown: crate::script::Teardown) {
        let took = teardown.run().await;
        if let Err(e) = self.store.set_teardown(&sid, took.as_millis() as u64).await {
            tracing::debug!(script_id = %sid, "cannot record the sandbox's teardown time: {e}");
        }
    }

    /// The result and the tools' counts into the audit row; then the state
    /// directory's reserve set aside again if it was used (and space has come
    /// back); otherwise the next start tries.
    async fn record_result(
        &self,
        sid: &str,
        running: &Running,
        result: &ScriptResult,
        reserve_bytes: u64,
    ) {
        let counts = json!(*running.live.tool_counts.lock().unwrap());
        if let Err(e) = self.store.finish(result, counts).await {
            tracing::error!(script_id = %sid, "cannot record the result: {e}");
        }
        let _ = self.store.keep_reserve(reserve_bytes);
    }

    /// The result object of a script that ended (or never started).
    fn build_result(
        &self,
        sid: &str,
        running: &Running,
        outcome: Result<Ended, SpawnError>,
        return_max_chars: usize,
    ) -> ScriptResult {
        let live = &running.live;
        let e = outcome.unwrap_or_else(|e| Ended::not_started(&e));
        let mut record_incomplete = e.record_incomplete;
        record_incomplete.extend(live.calls_log_incomplete());
        if !record_incomplete.is_empty() {
            tracing::error!(script_id = %sid, "the script's record in its workspace is incomplete: {}", record_incomplete.join("; "));
        }
        let note = result_note(
            e.output_truncated,
            &record_incomplete,
            return_max_chars,
            &running.details_dir,
        );
        ScriptResult {
            script_id: sid.into(),
            run_id: running.run_id.clone(),
            status: e.status,
            exit_code: e.exit_code,
            calls: live.calls.load(Ordering::Relaxed),
            failures: live.failures.load(Ordering::Relaxed),
            duration_ms: e.duration_ms,
            details_dir: running.details_dir.clone(),
            output: e.output,
            output_truncated: e.output_truncated,
            error: if e.status == Status::Ok {
                None
            } else {
                e.error
            },
            text: String::new(),
            memory_peak_bytes: e.memory_peak_bytes,
            cpu_usec: e.cpu_usec,
            backend_notes: e.backend_notes,
            record_incomplete,
            pre_made: e.pre_made,
        }
        .with_text(note.as_deref())
    }
}

/// The daemon's note under a result's output: where the rest of a truncated
/// output is, and which record files are incomplete.
fn result_note(
    output_truncated: bool,
    record_incomplete: &[String],
    return_max_chars: usize,
    details_dir: &str,
) -> Option<String> {
    let mut notes = vec![];
    if output_truncated {
        notes.push(format!(
            "[output truncated to return_max_chars = {return_max_chars} characters; {}]",
            if record_incomplete
                .iter()
                .any(|r| r.starts_with("output.txt"))
            {
                "output.txt is incomplete, see below".to_string()
            } else {
                format!("all of it is in {details_dir}/output.txt")
            }
        ));
    }
    if !record_incomplete.is_empty() {
        notes.push(format!(
            "[record incomplete: {}. The output above, the counts and the error are the daemon's own copy (its audit row); free space on the workspace's filesystem]",
            record_incomplete.join("; ")
        ));
    }
    (!notes.is_empty()).then(|| notes.join("\n"))
}

/// `script.progress`: the first as soon as something changed, then at most one per
/// second, each only when something changed since the last.
async fn progress_ticker(script_id: String, engine: Arc<dyn EngineLink>, run: Arc<Running>) {
    let mut last: Option<tokio::time::Instant> = None;
    loop {
        run.live.changed.notified().await;
        if let Some(t) = last {
            tokio::time::sleep_until(t + Duration::from_secs(1)).await;
        }
        if run.live.dirty.swap(false, Ordering::Relaxed) {
            engine.send(Notification::ScriptProgress(status_of(&script_id, &run)));
            last = Some(tokio::time::Instant::now());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::result_note;

    #[test]
    fn a_result_says_where_its_truncated_output_is_and_which_record_files_are_short() {
        assert_eq!(result_note(false, &[], 20_000, ".agent/scripts/x"), None);
        assert_eq!(
            result_note(true, &[], 20_000, ".agent/scripts/x").as_deref(),
            Some("[output truncated to return_max_chars = 20000 characters; all of it is in .agent/scripts/x/output.txt]")
        );
        let short = ["output.txt: No space left on device; 1 of 9 bytes written".to_string()];
        let note = result_note(true, &short, 5, ".agent/scripts/x").unwrap();
        let lines: Vec<&str> = note.lines().collect();
        assert_eq!(
            lines[0],
            "[output truncated to return_max_chars = 5 characters; output.txt is incomplete, see below]"
        );
        assert!(
            lines[1].starts_with(
                "[record incomplete: output.txt: No space left on device; 1 of 9 bytes written. "
            ),
            "{note}"
        );
        assert_eq!(lines.len(), 2);
    }
}
