//! The broker: serves one script's `agent_tools` requests on fd 3/4. Every call is
//! checked (revocation, expiry, policy, schema, budget) before it can reach the
//! engine, and at most `max_concurrency` calls are outstanding at once.
//!
//! Script → daemon (fd 3), one JSON object per line:
//!   {"id": 1, "op": "call", "tool": "t", "args": {…}}
//!   {"id": 2, "op": "call_many", "tool": "t", "args_list": [{…}, …]}   (at most 50)
//!   {"op": "progress", "done": 1, "total": 9, "message": "…"}
//!   {"op": "uncaught", "code": "limit", "tool": "t"}
//! Daemon → script (fd 4):
//!   {"id": 1, "result": {"text", "structured", "is_error", "code"?}} | {"id": 1, "error": {"code", "message"}}
//!   {"id": 2, "results": [ {"result": …} | {"error": …}, … ]}
//!
//! Everything a script can grow here is bounded: the bytes of the requests being
//! served (reading fd 3 stops while they are used up), the replies queued for fd 4
//! (a script that never reads them stalls only itself), the names quoted back, the
//! bytes of each calls.jsonl line and its number of lines, and the tool counts.

use crate::engine::{EngineLink, LinkError};
use crate::framing::{read_line, skip_line, Line};
use crate::policy::{Budget, Policy, Refusal};
use crate::protocol::ToolResult;
use serde_json::{json, Map, Value};
use std::collections::{BTreeMap, HashSet};
use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};
use tokio::io::{AsyncWriteExt, BufReader};
use tokio::sync::{mpsc, Semaphore};

/// Items in one `call_many` request: what `agent_tools` sends (protocol §8).
pub const MAX_BATCH: usize = 50;
/// Bytes of a name the script sent that are quoted back (tool names in the
/// snapshot are at most 128 bytes, so a longer name can match nothing).
pub const MAX_NAME_BYTES: usize = 128;
/// Bytes of a refusal message sent back to the script.
pub const MAX_MESSAGE_BYTES: usize = 1024;
/// Bytes of a call's arguments kept in its calls.jsonl line.
pub const MAX_LOGGED_ARGS_BYTES: usize = 4096;
/// Replies waiting for the script to read fd 4.
const REPLY_QUEUE: usize = 64;
/// What one request costs against the request budget beyond its bytes: a
/// stream of tiny requests is bounded in number too.
const REQUEST_OVERHEAD: usize = 4096;
/// After the script closed fd 3, how long calls already at the engine may take
/// to come back (so that they are logged with their answer).
const EOF_GRACE: Duration = Duration::from_secs(3);
/// The tool_counts key of every name that is not in the snapshot.
pub const OTHER_TOOLS: &str = "(not in the snapshot)";

/// Cut `s` to at most `max` bytes at a character boundary, marking the cut.
pub fn clip(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Progress {
    pub done: i64,
    pub total: i64,
    pub message: String,
}

/// One request from the script on fd 3, parsed and bounded.
#[derive(Debug, Clone, PartialEq)]
pub enum Request {
    Call {
        id: Value,
        tool: String,
        args: Value,
    },
    CallMany {
        id: Value,
        tool: String,
        args_list: Vec<Value>,
    },
    Progress(Progress),
    /// The script is ending on an uncaught `ToolError` with this code.
    Uncaught {
        code: String,
    },
}

/// A request line that cannot be served; answered as `{"id", "error"}`.
#[derive(Debug, Clone, PartialEq)]
pub struct BadRequest {
    pub id: Value,
    pub code: &'static str,
    pub message: String,
}

/// Parse one fd-3 line. Pure and total: any bytes give a request or a
/// `BadRequest`. Names are clipped to `MAX_NAME_BYTES` (plus a marker, so a
/// clipped name matches no tool) and `call_many` takes at most `MAX_BATCH` items.
pub fn parse_request(line: &[u8]) -> Result<Request, BadRequest> {
    let bad = |id: Value, code, message: &str| BadRequest {
        id,
        code,
        message: message.to_string(),
    };
    let Ok(Value::Object(mut req)) = serde_json::from_slice::<Value>(line) else {
        return Err(bad(Value::Null, "invalid_request", "not a JSON object"));
    };
    let id = req.remove("id").unwrap_or(Value::Null);
    let tool = || match req.get("tool") {
        Some(Value::String(t)) => clip(t, MAX_NAME_BYTES),
        _ => String::new(),
    };
    let text = |key: &str, max: usize| match req.get(key) {
        Some(Value::String(s)) => clip(s, max),
        _ => String::new(),
    };
    let int = |key: &str| req.get(key).and_then(Value::as_i64).unwrap_or(0);
    match req.get("op").and_then(Value::as_str) {
        Some("call") => {
            let tool = tool();
            let args = req.remove("args").unwrap_or_else(|| json!({}));
            Ok(Request::Call { id, tool, args })
        }
        Some("call_many") => {
            let tool = tool();
            match req.remove("args_list") {
                Some(Value::Array(a)) if a.len() <= MAX_BATCH => Ok(Request::CallMany {
                    id,
                    tool,
                    args_list: a,
                }),
                Some(Value::Array(a)) => Err(BadRequest {
                    id,
                    code: "invalid_arguments",
                    message: format!(
                        "call_many sends at most {MAX_BATCH} items per request, not {}; agent_tools.call_many batches them",
                        a.len()
                    ),
                }),
                _ => Err(bad(
                    id,
                    "invalid_arguments",
                    "args_list must be a list of dicts",
                )),
            }
        }
        Some("progress") => Ok(Request::Progress(Progress {
            done: int("done"),
            total: int("total"),
            message: text("message", 500),
        })),
        Some("uncaught") => Ok(Request::Uncaught {
            code: text("code", 32),
        }),
        _ => Err(bad(id, "invalid_request", "unknown op; use agent_tools")),
    }
}

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
}

pub type RevokedRuns = Arc<RwLock<HashSet<String>>>;

pub struct Broker {
    pub script_id: String,
    pub run_id: String,
    pub token_exp: i64,
    pub policy: Policy,
    pub budget: Mutex<Budget>,
    pub slots: Semaphore,
    pub engine: Arc<dyn EngineLink>,
    pub live: Arc<Live>,
    pub calls_log: Mutex<std::fs::File>,
    pub revoked: RevokedRuns,
    /// The longest request line; also the bytes of requests served at once.
    pub max_line: usize,
    pub next_call: AtomicU64,
    /// calls.jsonl gets at most this many lines (max_calls + 1000): refused calls
    /// cost no budget, so a loop of them must not fill the disk.
    pub max_log_lines: u64,
    pub logged: AtomicU64,
    /// A malformed answer from the engine is logged once per script.
    pub malformed_logged: AtomicBool,
}

fn refusal(r: Refusal) -> Value {
    json!({"error": {"code": r.code, "message": clip(&r.message, MAX_MESSAGE_BYTES)}})
}

/// A call that has reached the engine. If the script's end cancels it before the
/// answer comes, dropping it still logs and counts the call.
struct AtEngine<'a> {
    broker: &'a Broker,
    tool: &'a str,
    arguments: &'a Value,
    started: Instant,
    answered: bool,
}

impl Drop for AtEngine<'_> {
    fn drop(&mut self) {
        if !self.answered {
            self.broker.record(
                self.tool,
                self.arguments,
                &Outcome::Unanswered,
                self.started.elapsed().as_millis() as u64,
            );
        }
    }
}

/// How a call ended, for calls.jsonl and the counters.
enum Outcome<'a> {
    Reply(&'a Value),
    Unanswered,
}

impl Broker {
    /// Serve requests until the script closes fd 3 (it exited) or the task is aborted.
    pub async fn serve(
        self: Arc<Self>,
        input: tokio::net::unix::pipe::Receiver,
        mut output: tokio::net::unix::pipe::Sender,
    ) {
        let (tx, mut rx) = mpsc::channel::<String>(REPLY_QUEUE);
        let writer = tokio::spawn(async move {
            while let Some(line) = rx.recv().await {
                if output.write_all(line.as_bytes()).await.is_err() {
                    break;
                }
            }
        });
        // The bytes of the requests being served. While they are used up, fd 3 is
        // not read: a script that floods requests (or never reads its replies)
        // waits on its own pipe, and the daemon's memory stays bounded.
        let budget = Arc::new(Semaphore::new(self.max_line + REQUEST_OVERHEAD));
        let mut reader = BufReader::new(input);
        let mut buf = Vec::new();
        let mut tasks = tokio::task::JoinSet::new();
        loop {
            while tasks.try_join_next().is_some() {}
            match read_line(&mut reader, &mut buf, self.max_line).await {
                Ok(Line::Eof | Line::TimedOut) | Err(_) => break,
                Ok(Line::TooLong) => {
                    let line = error_line(
                        &Value::Null,
                        "invalid_request",
                        &format!("request line longer than {} bytes", self.max_line),
                    );
                    if tx.send(line).await.is_err() || skip_line(&mut reader).await.is_err() {
                        break;
                    }
                }
                Ok(Line::Data) => {
                    let cost = (buf.len() + REQUEST_OVERHEAD).min(self.max_line + REQUEST_OVERHEAD);
                    let Ok(permit) = budget.clone().acquire_many_owned(cost as u32).await else {
                        break;
                    };
                    let req = match parse_request(&buf) {
                        Ok(r) => r,
                        Err(b) => {
                            if tx
                                .send(error_line(&b.id, b.code, &b.message))
                                .await
                                .is_err()
                            {
                                break;
                            }
                            continue;
                        }
                    };
                    // The line buffer may have grown to max_line; keep it small.
                    if buf.capacity() > 64 * 1024 {
                        buf = Vec::new();
                    }
                    let (this, tx) = (self.clone(), tx.clone());
                    match req {
                        Request::Progress(p) => self.progress(p),
                        Request::Uncaught { code } => {
                            *self.live.uncaught.lock().unwrap() = Some(code)
                        }
                        Request::Call { id, tool, args } => {
                            tasks.spawn(async move {
                                let mut reply = this.call(&tool, &args).await;
                                reply["id"] = id;
                                let _ = tx.send(reply.to_string() + "\n").await;
                                drop(permit);
                            });
                        }
                        Request::CallMany {
                            id,
                            tool,
                            args_list,
                        } => {
                            tasks.spawn(async move {
                                // All items start at once; the semaphore admits max_concurrency.
                                let futs = args_list.iter().map(|a| this.call(&tool, a));
                                let results = futures_join_all(futs).await;
                                let line = json!({"id": id, "results": results}).to_string() + "\n";
                                let _ = tx.send(line).await;
                                drop(permit);
                            });
                        }
                    }
                }
            }
        }
        // fd 3 closed: the script is gone. Calls already at the engine get a short
        // grace to come back and be logged with their answer; the rest are
        // cancelled, and each is still logged and counted (`AtEngine`).
        drop(tx);
        let drained = tokio::time::timeout(EOF_GRACE, async {
            while tasks.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            tasks.abort_all();
            while tasks.join_next().await.is_some() {}
        }
        let _ = writer.await;
    }

    fn progress(&self, p: Progress) {
        *self.live.progress.lock().unwrap() = Some(p);
        self.live.dirty.store(true, Ordering::Relaxed);
        self.live.changed.notify_one();
    }

    /// One call from the script: `{"result": …}` or `{"error": …}`.
    async fn call(&self, tool: &str, args: &Value) -> Value {
        let started = Instant::now();
        let merged = match self.check(tool, args) {
            Ok(m) => m,
            Err(r) => {
                let reply = refusal(r);
                self.record(
                    tool,
                    args,
                    &Outcome::Reply(&reply),
                    started.elapsed().as_millis() as u64,
                );
                return reply;
            }
        };
        let _permit = self.slots.acquire().await.expect("semaphore never closed");
        let mut at_engine = AtEngine {
            broker: self,
            tool,
            arguments: &merged,
            started,
            answered: false,
        };
        let call_id = self.next_call.fetch_add(1, Ordering::Relaxed) + 1;
        let params = json!({
            "script_id": self.script_id, "run_id": self.run_id, "call_id": call_id.to_string(),
            "tool": tool, "arguments": merged,
        });
        let reply = match self.engine.tool_call(params).await {
            Ok(r) => {
                let code = if r.is_error { Some("tool_error") } else { None };
                result_value(r, code)
            }
            Err(e) => {
                if matches!(e, LinkError::Malformed(_))
                    && !self.malformed_logged.swap(true, Ordering::Relaxed)
                {
                    tracing::warn!(
                        script_id = %self.script_id,
                        "{tool}: {e} (the call failed with ToolError `engine`; logged once per script)"
                    );
                }
                let text = match e {
                    LinkError::Answered(m) => m,
                    other => other.to_string(),
                };
                result_value(
                    ToolResult {
                        text,
                        structured: None,
                        is_error: true,
                    },
                    Some("engine"),
                )
            }
        };
        at_engine.answered = true;
        self.record(
            tool,
            &merged,
            &Outcome::Reply(&reply),
            started.elapsed().as_millis() as u64,
        );
        reply
    }

    fn check(&self, tool: &str, args: &Value) -> Result<Value, Refusal> {
        if self.revoked.read().unwrap().contains(&self.run_id) {
            return Err(Refusal {
                code: "revoked",
                message: format!("run {} was revoked; no further tool calls", self.run_id),
            });
        }
        if crate::token::now_unix() >= self.token_exp {
            return Err(Refusal {
                code: "revoked",
                message: format!("the run token of run {} expired", self.run_id),
            });
        }
        let merged = self.policy.check_call(tool, args)?;
        self.budget.lock().unwrap().take(tool)?;
        Ok(merged)
    }

    /// Count the call and log it as one calls.jsonl line of bounded size.
    fn record(&self, tool: &str, arguments: &Value, outcome: &Outcome, duration_ms: u64) {
        let (is_error, summary) = match outcome {
            Outcome::Unanswered => (
                Value::Null,
                "no answer: the script ended before the engine answered".to_string(),
            ),
            Outcome::Reply(reply) => match (reply.get("result"), reply.get("error")) {
                (Some(r), _) => (
                    json!(r.get("is_error").and_then(Value::as_bool).unwrap_or(false)),
                    summarize(r.get("text").and_then(Value::as_str).unwrap_or("")),
                ),
                (_, Some(e)) => (
                    json!(true),
                    format!(
                        "refused ({}): {}",
                        e.get("code").and_then(Value::as_str).unwrap_or(""),
                        summarize(e.get("message").and_then(Value::as_str).unwrap_or(""))
                    ),
                ),
                _ => (json!(true), String::new()),
            },
        };
        self.live.calls.fetch_add(1, Ordering::Relaxed);
        if is_error == json!(true) {
            self.live.failures.fetch_add(1, Ordering::Relaxed);
        }
        let key = if self.policy.knows(tool) {
            tool
        } else {
            OTHER_TOOLS
        };
        *self
            .live
            .tool_counts
            .lock()
            .unwrap()
            .entry(key.to_string())
            .or_default() += 1;
        self.live.dirty.store(true, Ordering::Relaxed);
        self.live.changed.notify_one();
        let n = self.logged.fetch_add(1, Ordering::Relaxed);
        let line = if n < self.max_log_lines {
            let mut line = Map::new();
            line.insert("ts".into(), json!(rfc3339_now()));
            line.insert("tool".into(), json!(tool));
            let args = arguments.to_string();
            if args.len() > MAX_LOGGED_ARGS_BYTES {
                line.insert(
                    "arguments".into(),
                    json!(clip(&args, MAX_LOGGED_ARGS_BYTES)),
                );
                line.insert("arguments_bytes".into(), json!(args.len()));
            } else {
                line.insert("arguments".into(), arguments.clone());
            }
            line.insert("duration_ms".into(), json!(duration_ms));
            line.insert("is_error".into(), is_error);
            line.insert("summary".into(), json!(summary));
            Value::Object(line)
        } else if n == self.max_log_lines {
            json!({"ts": rfc3339_now(), "summary": format!("calls.jsonl is full ({n} lines); later calls are counted but not logged")})
        } else {
            return;
        };
        // One write per line, not one per token.
        let mut text = line.to_string();
        text.push('\n');
        let _ = self.calls_log.lock().unwrap().write_all(text.as_bytes());
    }
}

fn result_value(r: ToolResult, code: Option<&str>) -> Value {
    let mut v = json!({"text": r.text, "structured": r.structured, "is_error": r.is_error});
    if let Some(c) = code {
        v["code"] = json!(c);
    }
    json!({"result": v})
}

fn error_line(id: &Value, code: &str, message: &str) -> String {
    json!({"id": id, "error": {"code": code, "message": message}}).to_string() + "\n"
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

/// Await futures concurrently, results in input order.
async fn futures_join_all<F: std::future::Future<Output = Value>>(
    futs: impl Iterator<Item = F>,
) -> Vec<Value> {
    let futs: Vec<_> = futs.map(Box::pin).collect();
    let mut out: Vec<Option<Value>> = vec![None; futs.len()];
    let mut pending: Vec<_> = futs.into_iter().enumerate().collect();
    std::future::poll_fn(|cx| {
        pending.retain_mut(|(i, f)| match f.as_mut().poll(cx) {
            std::task::Poll::Ready(v) => {
                out[*i] = Some(v);
                false
            }
            std::task::Poll::Pending => true,
        });
        if pending.is_empty() {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    })
    .await;
    out.into_iter().map(|v| v.unwrap_or(Value::Null)).collect()
}

/// RFC 3339 UTC timestamp with milliseconds, from the system clock.
pub fn rfc3339_now() -> String {
    rfc3339(crate::audit::now_ms())
}

pub fn rfc3339(ms: i64) -> String {
    let secs = ms.div_euclid(1000);
    let (days, rem) = (secs.div_euclid(86400), secs.rem_euclid(86400));
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719468;
    let era = z.div_euclid(146097);
    let doe = z - era * 146097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + if m <= 2 { 1 } else { 0 };
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        ms.rem_euclid(1000)
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn rfc3339_dates() {
        assert_eq!(super::rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(
            super::rfc3339(1_796_000_000_123),
            "2026-11-30T00:53:20.123Z"
        );
        assert_eq!(super::rfc3339(951_782_400_000), "2000-02-29T00:00:00.000Z");
    }
}
