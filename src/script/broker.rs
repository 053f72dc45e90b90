//! The broker: serves one script's `agent_tools` requests on fd 3/4. Every call is
//! checked (revocation, expiry, policy, schema, budget) before it can reach the
//! engine, and at most `max_concurrency` calls are outstanding at once. The
//! messages of fd 3/4 and of calls.jsonl are typed in `protocol::script`.
//!
//! Everything a script can grow here is bounded: the bytes of the requests being
//! served (reading fd 3 stops while they are used up), the replies queued for fd 4
//! (a script that never reads them stalls only itself), the names quoted back, the
//! bytes of each calls.jsonl line and its number of lines, and the tool counts.

use crate::policy::{Budget, CallRefusal, Policy};
use crate::protocol::framing::{read_line, skip_line, Line};
use crate::protocol::numbers::{self, Altered, Scan};
use crate::protocol::script::{
    CallLogFull, CallLogLine, CallResult, ErrorReply, Outcome, Reply, ToolErrorCode,
};
use crate::protocol::{ToolCall, ToolResult};
use crate::script::engine::{Abandoned, CallEnd, EngineLink, LinkError};
use crate::time::{Clock, SystemClock};
use serde_json::Value;
use std::collections::BTreeMap;
use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};
use tokio::io::{AsyncWriteExt, BufReader};
use tokio::sync::Semaphore;

// The fd-3/4 messages and their parsing live in `protocol::script`; these names
// stay here for the callers (and tests) that know them as the broker's.
use crate::protocol::framing::clip;
use crate::protocol::script::{parse_request, BadRequest, Request};
use crate::protocol::Progress;

/// Bytes of a refusal message sent back to the script.
pub const MAX_MESSAGE_BYTES: usize = 1024;
/// Bytes of a call's arguments kept in its calls.jsonl line (as much as the
/// scan of numbers keeps of the text of arguments that hold an altered one).
pub const MAX_LOGGED_ARGS_BYTES: usize = numbers::ARGS_TEXT_MAX_BYTES;
/// What one request costs against the request budget beyond its bytes: a
/// stream of tiny requests is bounded in number too.
const REQUEST_OVERHEAD: usize = 4096;
/// After a script exited by itself, how long calls already at the engine may take
/// to come back (so that they are logged with their answer). A script that was
/// cut short (cancel, timeout, revoke, OOM, shutdown) gets none: its calls are
/// abandoned at once.
const EOF_GRACE: Duration = Duration::from_secs(3);
/// How long the broker waits, after fd 3 closed, to learn how the script ended
/// (`Broker::end`); the supervisor says so once the sandbox is gone.
const END_WAIT: Duration = Duration::from_secs(30);
/// The tool_counts key of every name that is not in the snapshot.
pub const OTHER_TOOLS: &str = "(not in the snapshot)";

/// Counters of one running script, read by `script.status` and the progress ticker.
#[derive(Default)]
pub struct Live {
    pub calls: AtomicU64,
    pub failures: AtomicU64,
    pub progress: Mutex<Option<Progress>>,
    /// Set when progress or counters changed since the last `script.progress`.
    pub dirty: AtomicBool,
    /// Woken on every such change.
    pub changed: tokio::sync::Notify,
    /// The `ToolError` code of an uncaught exception the script reported.
    pub uncaught: Mutex<Option<String>>,
    /// Calls per tool; names outside the snapshot share the key `OTHER_TOOLS`.
    pub tool_counts: Mutex<BTreeMap<String, u64>>,
    /// Why calls.jsonl stopped short (a full filesystem), and the lines it lost;
    /// the counts above go on and reach the audit row.
    pub calls_log_error: Mutex<Option<(String, u64)>>,
    /// The sandbox's (bwrap's) pid while it runs, 0 before and after: where
    /// `admin.list` reads the script's resources from.
    pub sandbox_pid: std::sync::atomic::AtomicI32,
}

impl Live {
    /// The sandbox's pid once it exists; 0 once it has exited.
    pub fn set_sandbox_pid(&self, pid: i32) {
        self.sandbox_pid.store(pid, Ordering::Relaxed);
    }

    /// calls.jsonl as the record's note gives it, if it lost lines.
    pub fn calls_log_incomplete(&self) -> Option<String> {
        let e = self.calls_log_error.lock().unwrap();
        e.as_ref()
            .map(|(why, lost)| format!("calls.jsonl: {why}; lines lost: {lost}"))
    }
}

pub type RevokedRuns = Arc<RwLock<crate::policy::runs::Revocations>>;

/// What one script's broker is made from: its run, its policy and limits, its
/// engine and its record. The counters it keeps start at zero (`Broker::new`).
pub struct BrokerSpec {
    pub script_id: String,
    pub run_id: String,
    /// The run as the revoked set knows it (scoped to its engine entry).
    pub run_key: crate::policy::runs::RunKey,
    pub token_exp: i64,
    pub policy: Policy,
    pub max_calls: u64,
    pub max_concurrency: usize,
    pub engine: Arc<dyn EngineLink>,
    pub live: Arc<Live>,
    pub calls_log: std::fs::File,
    pub revoked: RevokedRuns,
    /// The longest request line; also the bytes of requests served at once.
    pub max_line: usize,
    /// The script's trace, when it was started with one.
    pub trace: Option<crate::protocol::trace::TraceContext>,
}

pub struct Broker {
    pub script_id: String,
    run_id: String,
    run_key: crate::policy::runs::RunKey,
    token_exp: i64,
    policy: Policy,
    budget: Mutex<Budget>,
    slots: Semaphore,
    engine: Arc<dyn EngineLink>,
    pub live: Arc<Live>,
    calls_log: Mutex<std::fs::File>,
    revoked: RevokedRuns,
    max_line: usize,
    next_call: AtomicU64,
    /// calls.jsonl gets at most this many lines (max_calls + 1000): refused calls
    /// cost no budget, so a loop of them must not fill the disk.
    max_log_lines: u64,
    logged: AtomicU64,
    /// A malformed answer from the engine is logged once per script.
    malformed_logged: AtomicBool,
    /// Answers that carried MCP keys the daemon ignores (logged once, at debug).
    ignored_answers: AtomicU64,
    trace: Option<crate::protocol::trace::TraceContext>,
    /// How the script ended, once it has: the calls still at the engine are then
    /// abandoned with this reason (`end`).
    end: CallEnd,
    ended: tokio::sync::Notify,
    /// The answer to the script's `tools` request, made on the first.
    tools_json: std::sync::OnceLock<String>,
}

impl Broker {
    pub fn new(s: BrokerSpec) -> Broker {
        Broker {
            script_id: s.script_id,
            run_id: s.run_id,
            run_key: s.run_key,
            token_exp: s.token_exp,
            policy: s.policy,
            budget: Mutex::new(Budget::new(s.max_calls)),
            slots: Semaphore::new(s.max_concurrency),
            engine: s.engine,
            live: s.live,
            calls_log: Mutex::new(s.calls_log),
            revoked: s.revoked,
            max_line: s.max_line,
            next_call: AtomicU64::new(0),
            max_log_lines: s.max_calls.saturating_add(1000),
            logged: AtomicU64::new(0),
            malformed_logged: AtomicBool::new(false),
            ignored_answers: AtomicU64::new(0),
            trace: s.trace,
            end: CallEnd::default(),
            ended: tokio::sync::Notify::new(),
            tools_json: std::sync::OnceLock::new(),
        }
    }
}

fn refusal(r: CallRefusal) -> Outcome {
    Outcome::Error(ErrorReply {
        code: r.code,
        message: clip(&r.message, MAX_MESSAGE_BYTES),
    })
}

/// A call that has reached the engine. If the script's end cancels it before the
/// answer comes, dropping it still logs and counts the call.
struct AtEngine<'a> {
    broker: &'a Broker,
    clock: &'a dyn Clock,
    tool: &'a str,
    arguments: &'a Value,
    started: Instant,
    answered: bool,
    span_id: Option<String>,
}

impl Drop for AtEngine<'_> {
    fn drop(&mut self) {
        if !self.answered {
            self.broker.record(
                self.clock,
                self.tool,
                Logged::Value(self.arguments),
                None,
                self.started.elapsed().as_millis() as u64,
                self.span_id.take(),
            );
        }
    }
}

/// The request lines being read from fd 3 and the replies going to fd 4.
struct Channel {
    reader: BufReader<crate::script::pipe::Pipe>,
    buf: Vec<u8>,
    replies: Replies,
    /// The bytes of the requests being served. While they are used up, fd 3 is
    /// not read: a script that floods requests (or never reads its replies)
    /// waits on its own pipe, and the daemon's memory stays bounded.
    budget: Arc<Semaphore>,
    tasks: tokio::task::JoinSet<()>,
}

impl Broker {
    /// Serve requests until the script closes fd 3 (it exited) or the task is
    /// aborted, with the system clock for token expiry.
    pub async fn serve(
        self: Arc<Self>,
        input: crate::script::pipe::Pipe,
        output: tokio::net::unix::pipe::Sender,
    ) {
        self.serve_with_clock(Arc::new(SystemClock), input, output)
            .await
    }

    /// `serve`, with the clock that token expiry and calls.jsonl timestamps read.
    pub async fn serve_with_clock(
        self: Arc<Self>,
        clock: Arc<dyn Clock>,
        input: crate::script::pipe::Pipe,
        output: tokio::net::unix::pipe::Sender,
    ) {
        let replies = Replies::new(output);
        let mut ch = Channel {
            reader: BufReader::with_capacity(64 * 1024, input),
            buf: Vec::new(),
            replies,
            budget: Arc::new(Semaphore::new(self.max_line + REQUEST_OVERHEAD)),
            tasks: tokio::task::JoinSet::new(),
        };
        while self.serve_one(&mut ch, &clock).await {}
        // fd 3 closed: the script is gone. Once the supervisor says how it ended,
        // the calls already at the engine get a short grace to come back and be
        // logged with their answer if it exited by itself, none if it was cut
        // short; the rest are abandoned (the engine is told: `tool.cancelled`),
        // and each is still logged and counted (`AtEngine`).
        let Channel {
            replies, mut tasks, ..
        } = ch;
        drop(replies);
        let ended = async {
            loop {
                let wake = self.ended.notified();
                tokio::pin!(wake);
                wake.as_mut().enable();
                if let Some(a) = self.end.get() {
                    return a.clone();
                }
                wake.await;
            }
        };
        let drain = async { while tasks.join_next().await.is_some() {} };
        let grace = tokio::select! {
            // Every call answered before the end was known: nothing to abandon.
            () = drain => None,
            a = tokio::time::timeout(END_WAIT, ended) => Some(match a {
                Ok(a) if a.cut_short() => Duration::ZERO,
                Ok(_) => EOF_GRACE,
                Err(_) => {
                    self.end(Abandoned::exited());
                    Duration::ZERO
                }
            }),
        };
        if let Some(grace) = grace {
            let drained =
                tokio::time::timeout(grace, async { while tasks.join_next().await.is_some() {} })
                    .await;
            if drained.is_err() {
                tasks.abort_all();
                while tasks.join_next().await.is_some() {}
            }
        }
        let ignored = self.ignored_answers.load(Ordering::Relaxed);
        if ignored > 1 {
            tracing::debug!(
                script_id = %self.script_id,
                "{ignored} of this script's answers carried CallToolResult keys scriptgate ignores"
            );
        }
    }

    /// How the script ended: the calls still at the engine are abandoned with
    /// this reason (at once, or after a grace for a script that exited by itself).
    pub fn end(&self, why: Abandoned) {
        let _ = self.end.set(why);
        self.ended.notify_waiters();
    }

    /// Read and start serving one request line. `false` once fd 3 is done.
    async fn serve_one(self: &Arc<Self>, ch: &mut Channel, clock: &Arc<dyn Clock>) -> bool {
        while ch.tasks.try_join_next().is_some() {}
        match read_line(&mut ch.reader, &mut ch.buf, self.max_line).await {
            Ok(Line::Eof | Line::TimedOut) | Err(_) => false,
            Ok(Line::TooLong) => {
                let reply = bad_request_reply(BadRequest {
                    id: Value::Null,
                    code: ToolErrorCode::InvalidRequest,
                    message: format!("request line longer than {} bytes", self.max_line),
                });
                ch.replies.send(reply.line()).await && skip_line(&mut ch.reader).await.is_ok()
            }
            Ok(Line::Data) => {
                // The numbers as the script wrote them, before serde_json reads
                // (and rounds) them: the calls that hold one it would alter are
                // refused (`protocol::numbers`).
                let scan = numbers::scan(&ch.buf);
                if scan.too_deep {
                    let reply = bad_request_reply(BadRequest {
                        id: crate::protocol::script::request_id(&ch.buf),
                        code: ToolErrorCode::InvalidRequest,
                        message: format!(
                            "request nested deeper than {} levels",
                            numbers::MAX_DEPTH
                        ),
                    });
                    return ch.replies.send(reply.line()).await;
                }
                // What the request will hold once parsed, not only its bytes: the
                // budget bounds the daemon's memory, and a request that alone
                // would exceed it is refused unparsed. What the scan keeps of
                // arguments is held as long and counts too.
                let cost = crate::protocol::framing::parse_cost(&ch.buf)
                    + REQUEST_OVERHEAD
                    + scan.held_bytes();
                if cost > self.max_line + REQUEST_OVERHEAD {
                    let reply = bad_request_reply(BadRequest {
                        id: crate::protocol::script::request_id(&ch.buf),
                        code: ToolErrorCode::InvalidRequest,
                        message: format!(
                            "request too large once parsed (about {cost} bytes for a {}-byte line; the limit is {}): send fewer or larger values per call",
                            ch.buf.len(),
                            self.max_line
                        ),
                    });
                    return ch.replies.send(reply.line()).await;
                }
                let Ok(permit) = ch.budget.clone().acquire_many_owned(cost as u32).await else {
                    return false;
                };
                if scan.not_json {
                    // NaN, Infinity, 1e400: `0` in their place, so that the rest of
                    // the line is served; the calls that held them are refused.
                    numbers::patch(&mut ch.buf);
                }
                let req = match parse_request(&ch.buf) {
                    Ok(r) => r,
                    Err(b) => return ch.replies.send(bad_request_reply(b).line()).await,
                };
                // The line buffer may have grown to max_line; keep it small.
                if ch.buf.capacity() > 64 * 1024 {
                    ch.buf = Vec::new();
                }
                if let Request::Tools { id } = &req {
                    // Written here, not from a task: a script that asks again
                    // and again gets one answer at a time, as fast as it reads
                    // them (the list is made once), and nothing else is read
                    // from fd 3 meanwhile.
                    let tools = self.tools_json.get_or_init(|| {
                        crate::policy::describe::script_tools(self.policy.callable_specs())
                            .to_string()
                    });
                    let line = crate::protocol::script::tools_reply_line(id, tools);
                    return ch.replies.send(line).await;
                }
                self.start(req, scan, permit, ch, clock);
                true
            }
        }
    }

    /// Act on one parsed request: calls run as tasks (their reply frees `permit`).
    fn start(
        self: &Arc<Self>,
        req: Request,
        scan: Scan,
        permit: tokio::sync::OwnedSemaphorePermit,
        ch: &mut Channel,
        clock: &Arc<dyn Clock>,
    ) {
        let (this, tx, clock) = (self.clone(), ch.replies.clone(), clock.clone());
        match req {
            Request::Progress(p) => self.progress(p),
            Request::Uncaught { code } => *self.live.uncaught.lock().unwrap() = Some(code),
            // Answered in serve_one.
            Request::Tools { .. } => {}
            Request::Call { id, tool, args } => {
                let altered = scan.args;
                ch.tasks.spawn(async move {
                    let outcome = this.call(&*clock, &tool, &args, altered.as_ref()).await;
                    tx.send(Reply::One { id, outcome }.line()).await;
                    drop(permit);
                });
            }
            Request::CallMany {
                id,
                tool,
                args_list,
            } => {
                let mut altered: Vec<Option<Altered>> = vec![None; args_list.len()];
                for (i, a) in scan.items {
                    if let Some(slot) = altered.get_mut(i) {
                        *slot = Some(a);
                    }
                }
                ch.tasks.spawn(async move {
                    // All items start at once; the semaphore admits max_concurrency.
                    let calls = args_list
                        .iter()
                        .zip(&altered)
                        .map(|(a, n)| this.call(&*clock, &tool, a, n.as_ref()));
                    let results = futures::future::join_all(calls).await;
                    tx.send(Reply::Many { id, results }.line()).await;
                    drop(permit);
                });
            }
        }
    }

    fn progress(&self, p: Progress) {
        *self.live.progress.lock().unwrap() = Some(p);
        self.live.dirty.store(true, Ordering::Relaxed);
        self.live.changed.notify_one();
    }

    /// One call from the script: checked, then (if allowed) sent to the engine.
    /// `altered`: a number in `args` that serde_json did not read as the
    /// script wrote it (`protocol::numbers`), which refuses the call.
    async fn call(
        &self,
        clock: &dyn Clock,
        tool: &str,
        args: &Value,
        altered: Option<&Altered>,
    ) -> Outcome {
        let started = Instant::now();
        let merged = match self.check(clock, tool, args, altered) {
            Ok(m) => m,
            Err(r) => {
                let reply = refusal(r);
                let ms = started.elapsed().as_millis() as u64;
                // Arguments that hold an altered number are logged as the
                // script sent them: their parsed value holds it rounded.
                let logged = match altered {
                    Some(a) => Logged::Text {
                        text: &a.text,
                        bytes: a.bytes,
                    },
                    None => Logged::Value(args),
                };
                self.record(clock, tool, logged, Some(&reply), ms, None);
                return reply;
            }
        };
        let _permit = self.slots.acquire().await.expect("semaphore never closed");
        let call_id = self.next_call.fetch_add(1, Ordering::Relaxed) + 1;
        let span_id = self.trace.as_ref().map(|_| {
            let mut b = [0u8; 8];
            getrandom::getrandom(&mut b).expect("getrandom");
            crate::protocol::trace::span_id(b)
        });
        let mut at_engine = AtEngine {
            broker: self,
            clock,
            tool,
            arguments: &merged,
            started,
            answered: false,
            span_id: span_id.clone(),
        };
        let params = ToolCall {
            script_id: self.script_id.clone(),
            run_id: self.run_id.clone(),
            call_id: call_id.to_string(),
            tool: tool.to_string(),
            arguments: merged.clone(),
            traceparent: self.trace.as_ref().map(|t| t.child_traceparent()),
            tracestate: self.trace.as_ref().and_then(|t| t.state.clone()),
            span_id,
        };
        let reply = match self.engine.tool_call(params, self.end.clone()).await {
            Ok(a) => {
                if !a.ignored.is_empty() {
                    self.ignored_keys(tool, &a.ignored);
                }
                let code = a.result.is_error.then_some(ToolErrorCode::ToolError);
                result_outcome(a.result, code)
            }
            Err(e) => self.engine_failed(tool, e),
        };
        at_engine.answered = true;
        let ms = started.elapsed().as_millis() as u64;
        self.record(
            clock,
            tool,
            Logged::Value(&merged),
            Some(&reply),
            ms,
            at_engine.span_id.take(),
        );
        reply
    }

    /// An MCP answer carried keys the daemon ignores (MCP lets a `Result` carry
    /// more, e.g. `resultType`): counted, and logged once per script at debug.
    fn ignored_keys(&self, tool: &str, keys: &[String]) {
        if self.ignored_answers.fetch_add(1, Ordering::Relaxed) == 0 {
            // The keys are the engine's (an MCP server's): escaped and bounded
            // as the journal's entries are.
            tracing::debug!(
                script_id = %self.script_id,
                "{tool}: the engine's CallToolResult carried keys scriptgate ignores: {} (logged once per script)",
                crate::audit::journal::field(&keys.join(", "), MAX_MESSAGE_BYTES)
            );
        }
    }

    /// The engine did not answer properly: a failed call with code `engine`.
    fn engine_failed(&self, tool: &str, e: LinkError) -> Outcome {
        if matches!(e, LinkError::Malformed(_))
            && !self.malformed_logged.swap(true, Ordering::Relaxed)
        {
            tracing::warn!(
                script_id = %self.script_id,
                "{tool}: {} (the call failed with ToolError `engine`; logged once per script)",
                crate::audit::journal::field(&e.to_string(), MAX_MESSAGE_BYTES)
            );
        }
        let text = match e {
            LinkError::Answered(m) => m,
            other => other.to_string(),
        };
        let r = ToolResult {
            text,
            structured: None,
            is_error: true,
        };
        result_outcome(r, Some(ToolErrorCode::Engine))
    }

    /// Revocation, expiry (by `clock`), policy, numbers, budget: the merged
    /// arguments, or why the call is refused. A number that would be altered
    /// is named rather than a schema's verdict on its rounded value; a call
    /// the table denies stays denied.
    fn check(
        &self,
        clock: &dyn Clock,
        tool: &str,
        args: &Value,
        altered: Option<&Altered>,
    ) -> Result<Value, CallRefusal> {
        if self.revoked.read().unwrap().contains(&self.run_key) {
            return Err(CallRefusal::new(
                ToolErrorCode::Revoked,
                format!("run {} was revoked; no further tool calls", self.run_id),
            ));
        }
        if clock.now_unix() >= self.token_exp {
            return Err(CallRefusal::new(
                ToolErrorCode::Expired,
                format!("the run token of run {} expired", self.run_id),
            ));
        }
        let checked = self.policy.check_call(tool, args);
        if let Some(a) = altered {
            if !matches!(&checked, Err(r) if r.code != ToolErrorCode::InvalidArguments) {
                return Err(CallRefusal::new(
                    ToolErrorCode::InvalidArguments,
                    numbers::refusal_message(tool, a),
                ));
            }
        }
        let merged = checked?;
        self.budget.lock().unwrap().take(tool)?;
        Ok(merged)
    }

    /// Count the call and log it as one calls.jsonl line of bounded size;
    /// `outcome` is `None` for a call the script's end cut off.
    fn record(
        &self,
        clock: &dyn Clock,
        tool: &str,
        arguments: Logged<'_>,
        outcome: Option<&Outcome>,
        duration_ms: u64,
        span_id: Option<String>,
    ) {
        let (is_error, summary) = match outcome {
            None => (
                None,
                "no answer: the script ended before the engine answered".to_string(),
            ),
            Some(Outcome::Result(r)) => (Some(r.is_error), summarize(&r.text)),
            Some(Outcome::Error(e)) => (
                Some(true),
                format!("refused ({}): {}", e.code, summarize(&e.message)),
            ),
        };
        self.count(tool, is_error == Some(true));
        let n = self.logged.fetch_add(1, Ordering::Relaxed);
        let ts = crate::time::rfc3339(clock.now_ms());
        let text = if n < self.max_log_lines {
            let (arguments, arguments_bytes) = match arguments {
                Logged::Value(v) => {
                    let args = v.to_string();
                    if args.len() > MAX_LOGGED_ARGS_BYTES {
                        let clipped = clip(&args, MAX_LOGGED_ARGS_BYTES);
                        (Value::String(clipped), Some(args.len()))
                    } else {
                        (v.clone(), None)
                    }
                }
                Logged::Text { text, bytes } => (Value::String(text.to_string()), Some(bytes)),
            };
            let line = CallLogLine {
                ts,
                tool: tool.to_string(),
                arguments,
                arguments_bytes,
                duration_ms,
                is_error,
                summary,
                span_id,
            };
            serde_json::to_string(&line)
        } else if n == self.max_log_lines {
            serde_json::to_string(&CallLogFull {
                ts,
                summary: format!(
                    "calls.jsonl is full ({n} lines); later calls are counted but not logged"
                ),
            })
        } else {
            return;
        };
        // One write per line, not one per token.
        let mut text = text.unwrap_or_default();
        text.push('\n');
        self.write_log_line(&text);
    }

    /// Append one line to calls.jsonl. After a failed write (a full filesystem)
    /// no more are tried, so that the file never holds a torn line followed by
    /// whole ones; the lines lost are counted for the record's note.
    fn write_log_line(&self, text: &str) {
        let mut err = self.live.calls_log_error.lock().unwrap();
        if let Some((_, lost)) = err.as_mut() {
            *lost += 1;
            return;
        }
        if let Err(e) = self.calls_log.lock().unwrap().write_all(text.as_bytes()) {
            *err = Some((describe_write_error(&e), 1));
        }
    }

    /// The counters of one call: calls, failures, calls per tool.
    fn count(&self, tool: &str, failed: bool) {
        self.live.calls.fetch_add(1, Ordering::Relaxed);
        if failed {
            self.live.failures.fetch_add(1, Ordering::Relaxed);
        }
        let key = if self.policy.knows(tool) {
            tool
        } else {
            OTHER_TOOLS
        };
        let mut counts = self.live.tool_counts.lock().unwrap();
        match counts.get_mut(key) {
            Some(n) => *n += 1,
            None => {
                counts.insert(key.to_string(), 1);
            }
        }
        drop(counts);
        self.live.dirty.store(true, Ordering::Relaxed);
        self.live.changed.notify_one();
    }
}

/// A call's arguments as its calls.jsonl line keeps them: the value (its JSON
/// text when longer than `MAX_LOGGED_ARGS_BYTES`), or, for arguments that
/// hold a number no parsed value keeps, the text the script sent.
enum Logged<'a> {
    Value(&'a Value),
    Text { text: &'a str, bytes: usize },
}

/// A write error as the record's note says it; a full filesystem or quota is
/// named as such.
pub fn describe_write_error(e: &std::io::Error) -> String {
    match e.raw_os_error() {
        Some(libc::ENOSPC) => format!("the filesystem is full ({e})"),
        Some(libc::EDQUOT) => format!("the disk quota is used up ({e})"),
        _ => e.to_string(),
    }
}

/// The writer of fd 4, shared by the tasks that answer requests: each writes its
/// reply itself (no writer task to wake per call). A script that never reads
/// its replies stalls only its own calls: their tasks wait here holding their
/// share of the request budget, so fd 3 is not read until replies are.
#[derive(Clone)]
struct Replies(Arc<tokio::sync::Mutex<Option<tokio::net::unix::pipe::Sender>>>);

impl Replies {
    fn new(output: tokio::net::unix::pipe::Sender) -> Replies {
        Replies(Arc::new(tokio::sync::Mutex::new(Some(output))))
    }

    /// Write one reply line; `false` once fd 4 is closed (the script is gone).
    async fn send(&self, line: String) -> bool {
        let mut out = self.0.lock().await;
        let Some(w) = out.as_mut() else {
            return false;
        };
        if w.write_all(line.as_bytes()).await.is_err() {
            *out = None;
            return false;
        }
        true
    }
}

fn result_outcome(r: ToolResult, code: Option<ToolErrorCode>) -> Outcome {
    Outcome::Result(CallResult {
        text: r.text,
        structured: r.structured,
        is_error: r.is_error,
        code,
    })
}

fn bad_request_reply(b: BadRequest) -> Reply {
    Reply::One {
        id: b.id,
        outcome: Outcome::Error(ErrorReply {
            code: b.code,
            message: b.message,
        }),
    }
}

fn summarize(text: &str) -> String {
    const MAX: usize = 200;
    let one_line: String = text
        .chars()
        .map(|c| if c == '\n' { ' ' } else { c })
        .take(MAX + 1)
        .collect();
    if one_line.chars().count() > MAX {
        one_line.chars().take(MAX).collect::<String>() + "…"
    } else {
        one_line
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::rpc::BoxFuture;
    use crate::protocol::{ApprovalRequest, Notification};
    use crate::time::FakeClock;

    /// An engine that answers every call with "ok".
    struct Ok1;
    impl EngineLink for Ok1 {
        fn id(&self) -> u64 {
            1
        }
        fn tool_call(
            &self,
            p: ToolCall,
            _: CallEnd,
        ) -> BoxFuture<'_, Result<crate::protocol::ToolAnswer, LinkError>> {
            Box::pin(async move {
                Ok(crate::protocol::ToolAnswer {
                    result: ToolResult {
                        text: format!("ok {}", p.call_id),
                        structured: None,
                        is_error: false,
                    },
                    ignored: vec![],
                })
            })
        }
        fn approval_request(
            &self,
            _: ApprovalRequest,
            _: Duration,
        ) -> BoxFuture<'_, Result<bool, LinkError>> {
            Box::pin(async { Ok(false) })
        }
        fn send(&self, _: Notification) {}
    }

    fn broker(token_exp: i64, log: std::fs::File) -> Broker {
        let snap = crate::protocol::snapshot::parse_snapshot(serde_json::json!({
            "workspace": "/w", "permission_mode": "auto",
            "tools": [{"name": "t", "class": "read", "input_schema": {"type": "object"}}]
        }))
        .unwrap();
        let (policy, _) = Policy::plan(&snap, &[]).unwrap();
        Broker::new(BrokerSpec {
            script_id: "s".into(),
            run_id: "r".into(),
            run_key: crate::policy::runs::RunKey::new(crate::policy::runs::Scope::Shared(0), "r"),
            token_exp,
            policy,
            max_calls: 10,
            max_concurrency: 4,
            engine: Arc::new(Ok1),
            live: Default::default(),
            calls_log: log,
            revoked: Default::default(),
            max_line: 1 << 16,
            trace: None,
        })
    }

    #[tokio::test]
    async fn calls_are_refused_once_the_token_expires_by_the_clock() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("calls.jsonl");
        let b = broker(1_000, std::fs::File::create(&log).unwrap());
        let clock = FakeClock::at_ms(999_000);
        let args = serde_json::json!({});
        let Outcome::Result(r) = b.call(&clock, "t", &args, None).await else {
            panic!("refused before expiry")
        };
        assert_eq!((r.text.as_str(), r.is_error, r.code), ("ok 1", false, None));
        clock.advance_ms(1_000);
        let Outcome::Error(e) = b.call(&clock, "t", &args, None).await else {
            panic!("served after expiry")
        };
        assert_eq!(e.code, ToolErrorCode::Expired);
        assert_eq!(e.message, "the run token of run r expired");
        // Both are logged, stamped by the same clock.
        let lines: Vec<serde_json::Value> = std::fs::read_to_string(&log)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0]["ts"], "1970-01-01T00:16:39.000Z");
        assert_eq!(lines[1]["is_error"], true);
        assert_eq!(
            (
                b.live.calls.load(Ordering::Relaxed),
                b.live.failures.load(Ordering::Relaxed)
            ),
            (2, 1)
        );
    }

    #[test]
    fn replies_keep_their_wire_shape() {
        let one = Reply::One {
            id: 1.into(),
            outcome: result_outcome(
                ToolResult {
                    text: "x".into(),
                    structured: None,
                    is_error: true,
                },
                Some(ToolErrorCode::ToolError),
            ),
        };
        let v: serde_json::Value = serde_json::from_str(&one.line()).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"id": 1, "result": {"text": "x", "structured": null, "is_error": true, "code": "tool_error"}})
        );
        let bad = bad_request_reply(BadRequest {
            id: serde_json::Value::Null,
            code: ToolErrorCode::InvalidRequest,
            message: "m".into(),
        });
        let v: serde_json::Value = serde_json::from_str(&bad.line()).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"id": null, "error": {"code": "invalid_request", "message": "m"}})
        );
        let many = Reply::Many {
            id: "a".into(),
            results: vec![refusal(CallRefusal::new(
                ToolErrorCode::Denied,
                "no".into(),
            ))],
        };
        let v: serde_json::Value = serde_json::from_str(&many.line()).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"id": "a", "results": [{"error": {"code": "denied", "message": "no"}}]})
        );
    }
}
