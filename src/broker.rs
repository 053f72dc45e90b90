//! The broker: serves one script's `agent_tools` requests on fd 3/4. Every call is
//! checked (revocation, expiry, policy, schema, budget) before it can reach the
//! engine, and at most `max_concurrency` calls are outstanding at once.
//!
//! Script → daemon (fd 3), one JSON object per line:
//!   {"id": 1, "op": "call", "tool": "t", "args": {…}}
//!   {"id": 2, "op": "call_many", "tool": "t", "args_list": [{…}, …]}
//!   {"op": "progress", "done": 1, "total": 9, "message": "…"}
//!   {"op": "uncaught", "code": "limit", "tool": "t"}
//! Daemon → script (fd 4):
//!   {"id": 1, "result": {"text", "structured", "is_error", "code"?}} | {"id": 1, "error": {"code", "message"}}
//!   {"id": 2, "results": [ {"result": …} | {"error": …}, … ]}

use crate::engine::{EngineLink, LinkError};
use crate::framing::{read_line, skip_line, Line};
use crate::policy::{Budget, Policy, Refusal};
use crate::protocol::ToolResult;
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashSet};
use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;
use tokio::io::{AsyncWriteExt, BufReader};
use tokio::sync::{mpsc, Semaphore};

#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Progress {
    pub done: i64,
    pub total: i64,
    pub message: String,
}

/// Counters of one running script, read by `script.status` and the progress ticker.
#[derive(Default)]
pub struct Live {
    pub calls: AtomicU64,
    pub failures: AtomicU64,
    pub progress: Mutex<Option<Progress>>,
    /// Set when progress or counters changed since the last `script.progress`.
    pub dirty: AtomicBool,
    /// The `ToolError` code of an uncaught exception the script reported.
    pub uncaught: Mutex<Option<String>>,
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
    pub max_line: usize,
    pub next_call: AtomicU64,
    /// calls.jsonl gets at most this many lines (max_calls + 1000): refused calls
    /// cost no budget, so a loop of them must not fill the disk.
    pub max_log_lines: u64,
    pub logged: AtomicU64,
}

fn refusal(r: Refusal) -> Value {
    json!({"error": {"code": r.code, "message": r.message}})
}

impl Broker {
    /// Serve requests until the script closes fd 3 (it exited) or the task is aborted.
    pub async fn serve(
        self: Arc<Self>,
        input: tokio::net::unix::pipe::Receiver,
        mut output: tokio::net::unix::pipe::Sender,
    ) {
        let (tx, mut rx) = mpsc::unbounded_channel::<String>();
        let writer = tokio::spawn(async move {
            while let Some(line) = rx.recv().await {
                if output.write_all(line.as_bytes()).await.is_err() {
                    break;
                }
            }
        });
        let mut reader = BufReader::new(input);
        let mut buf = Vec::new();
        let mut tasks = tokio::task::JoinSet::new();
        loop {
            match read_line(&mut reader, &mut buf, self.max_line).await {
                Ok(Line::Eof) | Err(_) => break,
                Ok(Line::TooLong) => {
                    let _ = tx.send(error_line(
                        &Value::Null,
                        "invalid_request",
                        &format!("request line longer than {} bytes", self.max_line),
                    ));
                    if skip_line(&mut reader).await.is_err() {
                        break;
                    }
                }
                Ok(Line::Data) => {
                    let req: Value = match serde_json::from_slice(&buf) {
                        Ok(v @ Value::Object(_)) => v,
                        _ => {
                            let _ = tx.send(error_line(
                                &Value::Null,
                                "invalid_request",
                                "not a JSON object",
                            ));
                            continue;
                        }
                    };
                    let this = self.clone();
                    let tx = tx.clone();
                    match req.get("op").and_then(Value::as_str) {
                        Some("progress") => self.progress(&req),
                        Some("uncaught") => {
                            let code = req
                                .get("code")
                                .and_then(Value::as_str)
                                .unwrap_or("")
                                .chars()
                                .take(32)
                                .collect();
                            *self.live.uncaught.lock().unwrap() = Some(code);
                        }
                        Some("call") => {
                            tasks.spawn(async move {
                                let (id, tool) = id_and_tool(&req);
                                let args = req.get("args").cloned().unwrap_or_else(|| json!({}));
                                let mut reply = this.call(&tool, &args).await;
                                reply["id"] = id;
                                let _ = tx.send(reply.to_string() + "\n");
                            });
                        }
                        Some("call_many") => {
                            tasks.spawn(async move {
                                let (id, tool) = id_and_tool(&req);
                                let list = match req.get("args_list") {
                                    Some(Value::Array(a)) => a.clone(),
                                    _ => {
                                        let _ = tx.send(error_line(
                                            &id,
                                            "invalid_arguments",
                                            "args_list must be a list of dicts",
                                        ));
                                        return;
                                    }
                                };
                                // All items start at once; the semaphore admits max_concurrency.
                                let futs = list.iter().map(|a| this.call(&tool, a));
                                let results = futures_join_all(futs).await;
                                let _ = tx
                                    .send(json!({"id": id, "results": results}).to_string() + "\n");
                            });
                        }
                        _ => {
                            let id = req.get("id").cloned().unwrap_or(Value::Null);
                            let _ = tx.send(error_line(
                                &id,
                                "invalid_request",
                                "unknown op; use agent_tools",
                            ));
                        }
                    }
                }
            }
            while tasks.try_join_next().is_some() {}
        }
        // fd 3 closed: the script is gone. Outstanding calls are dropped with it.
        tasks.abort_all();
        drop(tx);
        let _ = writer.await;
    }

    fn progress(&self, req: &Value) {
        let p = Progress {
            done: req.get("done").and_then(Value::as_i64).unwrap_or(0),
            total: req.get("total").and_then(Value::as_i64).unwrap_or(0),
            message: req
                .get("message")
                .and_then(Value::as_str)
                .unwrap_or("")
                .chars()
                .take(500)
                .collect(),
        };
        *self.live.progress.lock().unwrap() = Some(p);
        self.live.dirty.store(true, Ordering::Relaxed);
    }

    /// One call from the script: `{"result": …}` or `{"error": …}`.
    async fn call(&self, tool: &str, args: &Value) -> Value {
        let started = Instant::now();
        let (reply, arguments) = match self.check(tool, args) {
            Err(r) => (refusal(r), args.clone()),
            Ok(merged) => {
                let _permit = self.slots.acquire().await.expect("semaphore never closed");
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
                (reply, merged)
            }
        };
        self.record(
            tool,
            &arguments,
            &reply,
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

    fn record(&self, tool: &str, arguments: &Value, reply: &Value, duration_ms: u64) {
        let (is_error, summary) = match (reply.get("result"), reply.get("error")) {
            (Some(r), _) => {
                let text = r.get("text").and_then(Value::as_str).unwrap_or("");
                (
                    r.get("is_error").and_then(Value::as_bool).unwrap_or(false),
                    summarize(text),
                )
            }
            (_, Some(e)) => (
                true,
                format!(
                    "refused ({}): {}",
                    e.get("code").and_then(Value::as_str).unwrap_or(""),
                    summarize(e.get("message").and_then(Value::as_str).unwrap_or(""))
                ),
            ),
            _ => (true, String::new()),
        };
        self.live.calls.fetch_add(1, Ordering::Relaxed);
        if is_error {
            self.live.failures.fetch_add(1, Ordering::Relaxed);
        }
        *self
            .live
            .tool_counts
            .lock()
            .unwrap()
            .entry(tool.chars().take(128).collect())
            .or_default() += 1;
        self.live.dirty.store(true, Ordering::Relaxed);
        let line = json!({
            "ts": rfc3339_now(), "tool": tool, "arguments": arguments, "duration_ms": duration_ms,
            "is_error": is_error, "summary": summary,
        });
        let n = self.logged.fetch_add(1, Ordering::Relaxed);
        let mut f = self.calls_log.lock().unwrap();
        if n < self.max_log_lines {
            let _ = writeln!(f, "{line}");
        } else if n == self.max_log_lines {
            let _ = writeln!(
                f,
                "{}",
                json!({"ts": rfc3339_now(), "summary": format!("calls.jsonl is full ({n} lines); later calls are counted but not logged")})
            );
        }
    }
}

/// A request's `id` (echoed in the reply) and `tool`.
fn id_and_tool(req: &Value) -> (Value, String) {
    let id = req.get("id").cloned().unwrap_or(Value::Null);
    let tool = req
        .get("tool")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    (id, tool)
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
