//! `scriptgate mcp`'s stdio transport: JSON-RPC lines on stdin and stdout, in
//! place of rmcp's own (`AsyncRwTransport`) for what that one does not do:
//! - when stdin closes, the client's scripts are cancelled at once (`Origin`'s
//!   token): rmcp waits up to 5 s for in-flight calls before it cancels them,
//!   and a stdio client sends SIGTERM 2 s after it closes stdin;
//! - a `subscriptions/listen` request's `taskIds` (the tasks extension), which
//!   rmcp's `SubscriptionFilter` drops, reach the handler (`ListenTaskIds`) and
//!   the acknowledgement, which lists those accepted;
//! - stdin and stdout are read and written through rmcp's non-blocking pipe
//!   handles, so that no blocking read of stdin holds the process at exit.
//!
//! As rmcp's: a line longer than `MAX_LINE` is dropped, a line that is not JSON
//! is ignored, and JSON that is not a message gets "Invalid request".

use super::scripts::Principal;
use super::server::{ListenTaskIds, Origin};
use super::tasks::Tasks;
use crate::protocol::framing::{resume_line, Line};
use rmcp::model::{
    ClientJsonRpcMessage, ErrorData, GetExtensions, JsonRpcMessage, RequestId,
    ServerJsonRpcMessage, ServerNotification,
};
use rmcp::service::{RoleServer, TxJsonRpcMessage};
use rmcp::transport::io::{StdioReader, StdioWriter};
use rmcp::transport::Transport;
use serde_json::Value;
use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use tokio::io::{AsyncWriteExt, BufReader, BufWriter};
use tokio_util::sync::CancellationToken;

/// The longest message read, as rmcp's transport.
const MAX_LINE: usize = rmcp::transport::async_rw::DEFAULT_MAX_LINE_LENGTH;
/// The task ids one `subscriptions/listen` may name.
pub(super) const MAX_LISTEN_TASKS: usize = 256;
/// Acknowledgements waiting for their task ids: at most this many listen
/// requests at once (rmcp acknowledges each before the next is read).
const MAX_ACKS: usize = 64;

pub(super) struct Stdio {
    read: BufReader<StdioReader>,
    buf: Vec<u8>,
    write: Arc<tokio::sync::Mutex<BufWriter<StdioWriter>>>,
    origin: Origin,
    /// Listen requests' accepted task ids, by request id, until acknowledged.
    acks: Arc<Mutex<HashMap<String, Vec<String>>>>,
    tasks: Arc<Tasks>,
    /// Owed an "Invalid request" answer.
    invalid: bool,
}

impl Stdio {
    /// The transport, and the token cancelled when stdin closes.
    pub(super) fn new(tasks: Arc<Tasks>) -> (Stdio, CancellationToken) {
        let (r, w) = rmcp::transport::io::stdio_pipes();
        let gone = CancellationToken::new();
        let t = Stdio {
            read: BufReader::new(r),
            buf: Vec::new(),
            write: Arc::new(tokio::sync::Mutex::new(BufWriter::new(w))),
            origin: Origin {
                who: Principal::local(),
                gone: gone.clone(),
                line: None,
            },
            acks: Arc::default(),
            tasks,
            invalid: false,
        };
        (t, gone)
    }

    async fn write_line(&self, line: Vec<u8>) -> std::io::Result<()> {
        let mut w = self.write.lock().await;
        w.write_all(&line).await?;
        w.flush().await
    }
}

/// A `subscriptions/listen` request's `taskIds`, bounded: at most
/// `MAX_LISTEN_TASKS`, strings only.
pub(super) fn listen_task_ids(v: &Value) -> Vec<String> {
    v.pointer("/params/notifications/taskIds")
        .and_then(Value::as_array)
        .map(|ids| {
            ids.iter()
                .filter_map(Value::as_str)
                .take(MAX_LISTEN_TASKS)
                .map(String::from)
                .collect()
        })
        .unwrap_or_default()
}

/// The error answering a `subscriptions/listen` that names task ids while its
/// `_meta` does not declare the tasks extension, which the extension requires
/// of every request that uses it (-32021, MissingRequiredClientCapability);
/// `None` when it may be served.
pub(super) fn listen_refusal(v: &Value, ids: &[String]) -> Option<Value> {
    let declared = v
        .pointer("/params/_meta/io.modelcontextprotocol~1clientCapabilities/extensions")
        .and_then(Value::as_object)
        .is_some_and(|e| e.contains_key(rmcp::model::TASKS_EXTENSION_ID));
    if ids.is_empty() || declared {
        return None;
    }
    Some(serde_json::json!({
        "jsonrpc": "2.0",
        "id": v.get("id").cloned().unwrap_or(Value::Null),
        "error": {
            "code": -32021,
            "message": "Missing required client capability: taskIds need the tasks extension (io.modelcontextprotocol/tasks) declared in this request's clientCapabilities",
            "data": {"requiredCapabilities": {"extensions": {rmcp::model::TASKS_EXTENSION_ID: {}}}},
        },
    }))
}

/// A request id as the acknowledgement's `_meta` spells it.
fn key(id: &RequestId) -> String {
    serde_json::to_value(id)
        .map(|v| v.to_string())
        .unwrap_or_default()
}

/// The acknowledgement of a listen request with its accepted task ids added.
pub(super) fn with_task_ids(mut v: Value, ids: &[String]) -> Value {
    if let Some(n) = v.pointer_mut("/params/notifications") {
        n["taskIds"] = Value::from(ids.to_vec());
    }
    v
}

impl Transport<RoleServer> for Stdio {
    type Error = std::io::Error;

    fn send(
        &mut self,
        item: ServerJsonRpcMessage,
    ) -> impl Future<Output = Result<(), std::io::Error>> + Send + 'static {
        let is_ack = matches!(
            &item,
            JsonRpcMessage::Notification(n)
                if matches!(n.notification, ServerNotification::SubscriptionsAcknowledgedNotification(_))
        );
        let line = serde_json::to_value(&item).map(|v| {
            // rmcp puts the subscription id in `_meta` as it serializes.
            let ids = is_ack
                .then(|| v.pointer("/params/_meta/io.modelcontextprotocol~1subscriptionId"))
                .flatten()
                .and_then(|id| {
                    self.acks
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .remove(&id.to_string())
                });
            let v = match &ids {
                Some(ids) => with_task_ids(v, ids),
                None => v,
            };
            let mut l = v.to_string().into_bytes();
            l.push(b'\n');
            l
        });
        let write = self.write.clone();
        async move {
            let line = line?;
            let mut w = write.lock().await;
            w.write_all(&line).await?;
            w.flush().await
        }
    }

    async fn receive(&mut self) -> Option<ClientJsonRpcMessage> {
        loop {
            if std::mem::take(&mut self.invalid) {
                let e: TxJsonRpcMessage<RoleServer> = JsonRpcMessage::error(
                    ErrorData::invalid_request("Invalid request", None),
                    None,
                );
                let mut l = serde_json::to_vec(&e).ok()?;
                l.push(b'\n');
                self.write_line(l).await.ok()?;
            }
            match resume_line(&mut self.read, &mut self.buf, MAX_LINE).await {
                Ok(Line::Data) => {}
                Ok(Line::TooLong) => {
                    eprintln!(
                        "scriptgate mcp: a message longer than {} MiB was dropped",
                        MAX_LINE >> 20
                    );
                    self.buf.clear();
                    continue;
                }
                Ok(Line::Eof | Line::TimedOut) | Err(_) => {
                    self.origin.gone.cancel();
                    return None;
                }
            }
            let line = std::mem::take(&mut self.buf);
            let text = line.strip_suffix(b"\n").unwrap_or(&line);
            let text = text.strip_suffix(b"\r").unwrap_or(text);
            let text = text
                .strip_prefix(b"\xef\xbb\xbf".as_slice())
                .unwrap_or(text);
            if text.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            let Ok(v) = serde_json::from_slice::<Value>(text) else {
                // Not JSON: no id to answer, as rmcp (and the other SDKs) do.
                continue;
            };
            let task_ids =
                if v.get("method").and_then(Value::as_str) == Some("subscriptions/listen") {
                    listen_task_ids(&v)
                } else {
                    vec![]
                };
            if let Some(e) = listen_refusal(&v, &task_ids) {
                let mut l = e.to_string().into_bytes();
                l.push(b'\n');
                self.write_line(l).await.ok()?;
                continue;
            }
            let is_notification = v.get("id").is_none()
                && v.get("method")
                    .and_then(Value::as_str)
                    .is_some_and(|m| m.starts_with("notifications/"));
            let mut msg = match serde_json::from_value::<ClientJsonRpcMessage>(v) {
                Ok(m) => m,
                // A notification rmcp does not know is ignored, as rmcp does.
                Err(_) if is_notification => continue,
                Err(_) => {
                    self.invalid = true;
                    continue;
                }
            };
            match &mut msg {
                JsonRpcMessage::Request(r) => {
                    if !task_ids.is_empty() {
                        let accepted: Vec<String> = task_ids
                            .iter()
                            .filter(|id| self.tasks.opens(id, &self.origin.who))
                            .cloned()
                            .collect();
                        let mut acks = self.acks.lock().unwrap_or_else(|p| p.into_inner());
                        if acks.len() >= MAX_ACKS {
                            acks.clear();
                        }
                        acks.insert(key(&r.id), accepted);
                    }
                    let ext = r.request.extensions_mut();
                    ext.insert(self.origin.clone());
                    ext.insert(ListenTaskIds(task_ids));
                }
                JsonRpcMessage::Notification(n) => {
                    n.notification.extensions_mut().insert(self.origin.clone());
                }
                _ => {}
            }
            return Some(msg);
        }
    }

    async fn close(&mut self) -> Result<(), std::io::Error> {
        self.write.lock().await.flush().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn task_ids_without_the_tasks_extension_are_refused() {
        let listen = |caps: Value| {
            serde_json::json!({"jsonrpc": "2.0", "id": 7, "method": "subscriptions/listen", "params": {
                "notifications": {"taskIds": ["t1", 5, "t2"]},
                "_meta": {"io.modelcontextprotocol/clientCapabilities": caps}}})
        };
        let undeclared = listen(serde_json::json!({}));
        let ids = listen_task_ids(&undeclared);
        assert_eq!(ids, ["t1", "t2"]);
        let e = listen_refusal(&undeclared, &ids).expect("refused");
        assert_eq!(
            (e["id"].clone(), e["error"]["code"].clone()),
            (7.into(), (-32021).into())
        );
        assert!(e["error"]["data"]["requiredCapabilities"]["extensions"]
            .get(rmcp::model::TASKS_EXTENSION_ID)
            .is_some());
        let declared =
            listen(serde_json::json!({"extensions": {rmcp::model::TASKS_EXTENSION_ID: {}}}));
        assert_eq!(listen_refusal(&declared, &ids), None);
        // No task ids: nothing of the extension is used.
        assert_eq!(listen_refusal(&undeclared, &[]), None);
    }
}
