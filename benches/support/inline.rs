//! An engine for the bench that answers each `tool.call` inline, on the thread
//! that reads the socket, the way a fast real engine would (the tests' engine
//! spawns a thread per call, so a bench through it partly measures itself).
//! It records when each script's first call arrived: the start latency of the
//! scale runs.

use serde_json::{json, Value};
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

pub struct Inline {
    writer: Arc<Mutex<UnixStream>>,
    pending: Arc<Mutex<HashMap<u64, mpsc::Sender<Value>>>>,
    next: AtomicU64,
    /// script_id → when its first tool.call arrived.
    pub first_call: Arc<Mutex<HashMap<String, Instant>>>,
    pub calls: Arc<AtomicU64>,
}

/// The answer to one call, as the tests' fleet answers it.
fn answer(tool: &str, args: &Value) -> Value {
    match tool {
        "fleet__get_device_status" => {
            let sn = args["sn"].as_str().unwrap_or("");
            let n: u64 = sn.trim_start_matches("SN").parse().unwrap_or(0);
            json!({"text": format!("{sn} online"), "structured": {"sn": sn, "online": n % 10 != 0, "fw": "1.3"}, "is_error": false})
        }
        _ => {
            json!({"text": "3 devices", "structured": {"devices": ["SN1", "SN2", "SN3"]}, "is_error": false})
        }
    }
}

impl Inline {
    pub fn connect(socket: &Path) -> Inline {
        let stream = UnixStream::connect(socket).unwrap();
        let e = Inline {
            writer: Arc::new(Mutex::new(stream.try_clone().unwrap())),
            pending: Default::default(),
            next: AtomicU64::new(1),
            first_call: Default::default(),
            calls: Default::default(),
        };
        let (writer, pending, first, calls) = (
            e.writer.clone(),
            e.pending.clone(),
            e.first_call.clone(),
            e.calls.clone(),
        );
        std::thread::spawn(move || {
            let mut reader = BufReader::with_capacity(1 << 16, stream);
            let mut line = String::new();
            loop {
                line.clear();
                match reader.read_line(&mut line) {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {}
                }
                let Ok(msg) = serde_json::from_str::<Value>(&line) else {
                    continue;
                };
                let method = msg.get("method").and_then(Value::as_str);
                match (method, msg.get("id")) {
                    (Some("tool.call"), Some(id)) => {
                        let p = &msg["params"];
                        if let Some(sid) = p["script_id"].as_str() {
                            let mut f = first.lock().unwrap();
                            if !f.contains_key(sid) {
                                f.insert(sid.to_string(), Instant::now());
                            }
                        }
                        let r = answer(p["tool"].as_str().unwrap_or(""), &p["arguments"]);
                        let mut out = json!({"jsonrpc": "2.0", "id": id, "result": r}).to_string();
                        out.push('\n');
                        calls.fetch_add(1, Ordering::Relaxed);
                        let _ = writer.lock().unwrap().write_all(out.as_bytes());
                    }
                    (Some(_), Some(id)) => {
                        // approval.request: the bench runs in auto mode; refuse anything else.
                        let out =
                            json!({"jsonrpc": "2.0", "id": id, "result": {"decision": "deny"}});
                        let _ = writeln!(writer.lock().unwrap(), "{out}");
                    }
                    (None, Some(id)) => {
                        if let Some(tx) =
                            id.as_u64().and_then(|i| pending.lock().unwrap().remove(&i))
                        {
                            let _ = tx.send(msg);
                        }
                    }
                    _ => {} // notifications
                }
            }
        });
        e
    }

    pub fn request(&self, method: &str, params: Value) -> Value {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel();
        self.pending.lock().unwrap().insert(id, tx);
        let line = json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params});
        writeln!(self.writer.lock().unwrap(), "{line}").unwrap();
        let m = rx
            .recv_timeout(Duration::from_secs(600))
            .unwrap_or_else(|_| panic!("no answer to {method}"));
        if let Some(e) = m.get("error") {
            panic!("{method} failed: {e}");
        }
        m["result"].clone()
    }

    pub fn start(&self, token: &str, code: &str) -> String {
        let r = self.request(
            "script.start",
            json!({"token": token, "code": code, "tools": [], "description": "bench"}),
        );
        r["script_id"].as_str().unwrap().to_string()
    }

    pub fn wait(&self, script_id: &str) -> Value {
        self.request("script.wait", json!({"script_id": script_id}))
    }

    pub fn run(&self, token: &str, code: &str) -> Value {
        let id = self.start(token, code);
        self.wait(&id)
    }
}
