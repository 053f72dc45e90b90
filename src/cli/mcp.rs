//! A small MCP client over stdio (JSON-RPC lines): initialize, tools/list (all
//! pages), tools/call. It keeps tools as raw JSON so that every annotation the
//! server publishes (readOnlyHint, destructiveHint, execution.taskSupport) is seen.

use crate::protocol::rpc::BoxFuture;
use crate::protocol::rpc::{self, Bounds, CallError};
use crate::protocol::snapshot::{ToolClass, ToolSpec};
use crate::protocol::{RpcError, ToolResult};
use crate::script::engine::LinkError;
use serde::Serialize;
use serde_json::{json, Value};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::AsyncReadExt;

pub const PROTOCOL_VERSION: &str = "2025-06-18";

#[derive(Debug, thiserror::Error)]
pub enum McpError {
    #[error("MCP server {name}: {message}")]
    Server { name: String, message: String },
    #[error("--mcp {0:?}: expected NAME=COMMAND (NAME: letters, digits, _ and -)")]
    Spec(String),
}

/// A `--mcp NAME=COMMAND` argument.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerSpec {
    pub name: String,
    pub argv: Vec<String>,
}

impl std::str::FromStr for ServerSpec {
    type Err = McpError;
    fn from_str(s: &str) -> Result<Self, McpError> {
        let (name, cmd) = s.split_once('=').ok_or_else(|| McpError::Spec(s.into()))?;
        let ok_name = !name.is_empty()
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
            && !name.contains("__");
        let argv = shlex::split(cmd)
            .filter(|a| !a.is_empty())
            .ok_or_else(|| McpError::Spec(s.into()))?;
        if !ok_name {
            return Err(McpError::Spec(s.into()));
        }
        Ok(ServerSpec {
            name: name.into(),
            argv,
        })
    }
}

/// The class of a tool from its MCP annotations, with the MCP spec's defaults:
/// `execution.taskSupport: "required"` → long_task; `readOnlyHint: true` → read;
/// otherwise `destructiveHint` (default true) → destructive; otherwise write.
pub fn class_of(tool: &Value) -> ToolClass {
    if tool
        .pointer("/execution/taskSupport")
        .and_then(Value::as_str)
        == Some("required")
    {
        return ToolClass::LongTask;
    }
    let hint = |k: &str| {
        tool.get("annotations")
            .and_then(|a| a.get(k))
            .and_then(Value::as_bool)
    };
    if hint("readOnlyHint") == Some(true) {
        ToolClass::Read
    } else if hint("destructiveHint").unwrap_or(true) {
        ToolClass::Destructive
    } else {
        ToolClass::Write
    }
}

/// The snapshot entry for one listed MCP tool, and a warning for the user when the
/// tool's schema had to be replaced.
///
/// The daemon checks a script's arguments against the schema as a closed one (a key
/// the schema does not declare is refused; see `policy::closed_schema`), so the
/// server's `inputSchema` is passed on as it is. Two cases need a decision:
/// - no `inputSchema` (the MCP spec requires one): the tool declares no arguments, so
///   it gets `{"type": "object", "properties": {}}` and scripts may call it with `{}`
///   only;
/// - an `inputSchema` that does not compile as JSON Schema 2020-12: the arguments
///   cannot be checked, so a `read` or `write` tool is switched off for scripts
///   (`enabled: false`); a `destructive` or `long_task` tool, never called from a
///   script anyway, just goes without a schema.
pub fn tool_spec(full: String, tool: &Value, class: ToolClass) -> (ToolSpec, Option<String>) {
    let callable = matches!(class, ToolClass::Read | ToolClass::Write);
    let (input_schema, enabled, warning) = match tool.get("inputSchema").filter(|s| !s.is_null())
    {
        None => (
            Some(json!({"type": "object", "properties": {}})),
            true,
            callable.then(|| {
                format!("{full}: the server gives no input schema; scripts may call it with no arguments only")
            }),
        ),
        Some(s) => match jsonschema::draft202012::new(s) {
            Ok(_) => (Some(s.clone()), true, None),
            Err(e) if callable => (
                None,
                false,
                Some(format!(
                    "{full}: its input schema does not compile ({e}); its arguments cannot be checked, so scripts cannot call it"
                )),
            ),
            Err(_) => (None, true, None),
        },
    };
    let spec = ToolSpec {
        name: full,
        class,
        enabled,
        input_schema,
        frozen: Default::default(),
        description: tool
            .get("description")
            .and_then(Value::as_str)
            .map(str::to_string),
    };
    (spec, warning)
}

/// The longest line an MCP server may send (a `tools/list` page of a large
/// server fits many times over); a longer one ends the connection.
pub const MAX_LINE_BYTES: usize = 64 << 20;

fn cursor_hash(c: &Value) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    c.to_string().hash(&mut h);
    h.finish()
}

/// The most `tools/list` pages read from one server.
pub const MAX_TOOL_PAGES: usize = 1000;
/// The most tools taken from one server.
pub const MAX_TOOLS: usize = 100_000;
/// The most bytes of `tools/list` pages taken from one server (as re-serialised).
pub const MAX_TOOLS_BYTES: usize = 256 << 20;

/// The `initialize` params: protocol version and client info; no `roots`
/// capability (see `Server::start`).
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Initialize {
    protocol_version: &'static str,
    capabilities: Empty,
    client_info: ClientInfo,
}

#[derive(Serialize)]
struct ClientInfo {
    name: &'static str,
    version: &'static str,
}

#[derive(Serialize, Default)]
struct Empty {}

/// `tools/list` params: the page after `cursor`.
#[derive(Serialize)]
struct ListTools<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    cursor: Option<&'a Value>,
}

/// `tools/call` params.
#[derive(Serialize)]
struct CallTool<'a> {
    name: &'a str,
    arguments: Value,
}

/// `notifications/cancelled` params.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Cancelled {
    request_id: u64,
    reason: &'static str,
}

/// The answer to `roots/list`.
#[derive(Serialize)]
struct Roots {
    roots: Vec<Root>,
}

#[derive(Serialize)]
struct Root {
    uri: String,
    name: String,
}

/// What scriptgate serves of a server's requests (`ping` and `roots/list`) and
/// notifications (`notifications/tools/list_changed`).
struct Client {
    roots: Vec<String>,
    tools_changed: Arc<tokio::sync::Notify>,
}

impl rpc::Handler for Client {
    fn request(
        self: Arc<Self>,
        method: String,
        _params: Value,
    ) -> BoxFuture<'static, Result<Value, RpcError>> {
        let answer = match method.as_str() {
            "ping" => serde_json::to_value(Empty {}),
            "roots/list" => serde_json::to_value(Roots {
                roots: self
                    .roots
                    .iter()
                    .map(|r| Root {
                        uri: format!("file://{r}"),
                        name: r.clone(),
                    })
                    .collect(),
            }),
            _ => {
                return Box::pin(std::future::ready(Err(RpcError::new(
                    -32601,
                    "not supported by scriptgate",
                ))))
            }
        };
        Box::pin(std::future::ready(
            answer.map_err(|e| RpcError::internal(e.to_string())),
        ))
    }
    /// A changed tool list wakes whoever watches `Server::tools_changed`; other
    /// notifications (logging, progress) are not used.
    fn notification(&self, method: &str, _params: Value) {
        if method == "notifications/tools/list_changed" {
            self.tools_changed.notify_one();
        }
    }
}

/// One running MCP server.
pub struct Server {
    pub name: String,
    peer: rpc::Endpoint,
    child: tokio::sync::Mutex<tokio::process::Child>,
    pgid: Option<i32>,
    stderr_tail: Arc<Mutex<Vec<u8>>>,
    pub call_timeout: Duration,
    /// Woken when the server says its tool list changed.
    pub tools_changed: Arc<tokio::sync::Notify>,
}

/// Keep the last 4 KiB of what the server writes on stderr (for error messages).
fn keep_stderr_tail(mut stderr: tokio::process::ChildStderr) -> Arc<Mutex<Vec<u8>>> {
    let stderr_tail = Arc::new(Mutex::new(Vec::new()));
    let tail = stderr_tail.clone();
    tokio::spawn(async move {
        let mut buf = [0u8; 4096];
        while let Ok(n) = stderr.read(&mut buf).await {
            if n == 0 {
                break;
            }
            let mut t = tail.lock().unwrap();
            t.extend_from_slice(&buf[..n]);
            let excess = t.len().saturating_sub(4096);
            t.drain(..excess);
        }
    });
    stderr_tail
}

impl Server {
    /// Start the server and run the MCP handshake. No `roots` capability is
    /// advertised (a server such as server-filesystem would then trade the directories
    /// on its command line for ours); `roots` only answers a server that asks anyway.
    pub async fn start(
        spec: &ServerSpec,
        roots: Vec<String>,
        call_timeout: Duration,
    ) -> Result<Server, McpError> {
        let err = |message: String| McpError::Server {
            name: spec.name.clone(),
            message,
        };
        let mut cmd = tokio::process::Command::new(&spec.argv[0]);
        cmd.args(&spec.argv[1..])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        // Its own process group, so that shutdown also reaches what it spawned (npx → node).
        cmd.process_group(0);
        let mut child = cmd
            .spawn()
            .map_err(|e| err(format!("cannot start {:?}: {e}", spec.argv[0])))?;
        let pgid = child.id().map(|p| p as i32);
        let stdin = child.stdin.take().expect("piped");
        let stdout = child.stdout.take().expect("piped");
        let stderr_tail = keep_stderr_tail(child.stderr.take().expect("piped"));
        let (peer, _writer) = rpc::Endpoint::new(stdin);
        let tools_changed = Arc::new(tokio::sync::Notify::new());
        {
            // Reads until the server's stdout closes (it exited or crashed); what
            // is still waiting then fails.
            let handler = Arc::new(Client {
                roots,
                tools_changed: tools_changed.clone(),
            });
            let peer = peer.clone();
            tokio::spawn(async move {
                peer.serve(stdout, &Bounds::client(MAX_LINE_BYTES), handler)
                    .await
            });
        }
        let server = Server {
            name: spec.name.clone(),
            peer,
            child: tokio::sync::Mutex::new(child),
            pgid,
            stderr_tail,
            call_timeout,
            tools_changed,
        };
        let init = Initialize {
            protocol_version: PROTOCOL_VERSION,
            capabilities: Empty {},
            client_info: ClientInfo {
                name: "scriptgate",
                version: env!("CARGO_PKG_VERSION"),
            },
        };
        let init = server
            .request("initialize", &init, Duration::from_secs(60))
            .await
            .map_err(|e| err(format!("initialize failed: {e}{}", server.stderr_note())))?;
        if init
            .get("capabilities")
            .and_then(|c| c.get("tools"))
            .is_none()
        {
            return Err(err("the server offers no tools".into()));
        }
        server.peer.notify("notifications/initialized", &Empty {});
        Ok(server)
    }

    fn stderr_note(&self) -> String {
        let t = self.stderr_tail.lock().unwrap();
        let s = String::from_utf8_lossy(&t);
        let s = s.trim();
        if s.is_empty() {
            String::new()
        } else {
            format!(
                "; its stderr ends with: {}",
                s.lines()
                    .rev()
                    .take(5)
                    .collect::<Vec<_>>()
                    .into_iter()
                    .rev()
                    .collect::<Vec<_>>()
                    .join(" | ")
            )
        }
    }

    async fn request<P: Serialize>(
        &self,
        method: &str,
        params: &P,
        timeout: Duration,
    ) -> Result<Value, LinkError> {
        let name = &self.name;
        // A call dropped unanswered (its script ended) is cancelled at the server
        // too, as MCP's cancellation says.
        let peer = self.peer.clone();
        let abandoned = move |id| {
            let cancel = Cancelled {
                request_id: id,
                reason: "the script that made the call ended",
            };
            peer.notify("notifications/cancelled", &cancel);
        };
        match self
            .peer
            .request_abandonable(method, params, Some(timeout), abandoned)
            .await
        {
            Ok(v) => Ok(v),
            Err(CallError::Answered(e)) => Err(LinkError::Answered(format!(
                "MCP server {name}: {}",
                e.message
            ))),
            Err(CallError::Closed(e)) => Err(LinkError::Answered(format!(
                "MCP server {name}: {}",
                e.message
            ))),
            Err(CallError::Disconnected) => Err(LinkError::Answered(format!(
                "MCP server {name} exited{}",
                self.stderr_note()
            ))),
            Err(CallError::Timeout { id }) => {
                let cancel = Cancelled {
                    request_id: id,
                    reason: "timeout",
                };
                self.peer.notify("notifications/cancelled", &cancel);
                Err(LinkError::Answered(format!(
                    "MCP server {name} did not answer within {} s",
                    timeout.as_secs()
                )))
            }
        }
    }

    /// All tools, following `nextCursor` for at most `MAX_TOOL_PAGES` pages,
    /// `MAX_TOOLS` tools and `MAX_TOOLS_BYTES`: a server whose cursor never ends, or comes back to a
    /// page already read, gets an error, not a CLI that hangs or grows.
    pub async fn list_tools(&self) -> Result<Vec<Value>, McpError> {
        let err = |message: String| McpError::Server {
            name: self.name.clone(),
            message,
        };
        let mut out = Vec::new();
        let mut bytes = 0usize;
        let mut seen = std::collections::HashSet::new();
        let mut cursor: Option<Value> = None;
        for _ in 0..MAX_TOOL_PAGES {
            let params = ListTools {
                cursor: cursor.as_ref(),
            };
            let r = self
                .request("tools/list", &params, Duration::from_secs(60))
                .await
                .map_err(|e| err(format!("tools/list: {e}")))?;
            bytes += r.to_string().len();
            if bytes > MAX_TOOLS_BYTES {
                return Err(err(format!(
                    "tools/list: more than {} MiB of pages; scriptgate takes at most that much from one server",
                    MAX_TOOLS_BYTES >> 20
                )));
            }
            out.extend(
                r.get("tools")
                    .and_then(Value::as_array)
                    .cloned()
                    .unwrap_or_default(),
            );
            if out.len() > MAX_TOOLS {
                return Err(err(format!(
                    "tools/list: more than {MAX_TOOLS} tools; scriptgate takes at most that many from one server"
                )));
            }
            cursor = r.get("nextCursor").filter(|c| !c.is_null()).cloned();
            match &cursor {
                None => return Ok(out),
                // Kept as hashes: a server's cursors may be long.
                Some(c) if !seen.insert(cursor_hash(c)) => {
                    return Err(err(format!(
                        "tools/list: nextCursor {c} came back after {} pages; the server's pages go round in a circle",
                        seen.len()
                    )))
                }
                Some(_) => {}
            }
        }
        Err(err(format!(
            "tools/list: nextCursor did not end within {MAX_TOOL_PAGES} pages ({} tools so far); scriptgate reads at most that many pages",
            out.len()
        )))
    }

    pub async fn call(&self, tool: &str, arguments: Value) -> Result<ToolResult, LinkError> {
        let r = self
            .request(
                "tools/call",
                &CallTool {
                    name: tool,
                    arguments,
                },
                self.call_timeout,
            )
            .await?;
        Ok(ToolResult::from_mcp(&r))
    }

    /// Close stdin, give the server a moment, then end its process group.
    pub async fn shutdown(&self) {
        self.peer.close();
        let mut child = self.child.lock().await;
        if tokio::time::timeout(Duration::from_millis(500), child.wait())
            .await
            .is_err()
        {
            if let Some(pg) = self.pgid {
                let _ = crate::sys::signal_group(pg, crate::sys::GroupSignal::Terminate);
            }
            if tokio::time::timeout(Duration::from_secs(2), child.wait())
                .await
                .is_err()
            {
                let _ = child.start_kill();
                let _ = child.wait().await;
            }
        }
        if let Some(pg) = self.pgid {
            let _ = crate::sys::signal_group(pg, crate::sys::GroupSignal::Kill);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The one table of MCP tools and their snapshot entries that both clients
    /// (`Tool.from_mcp`, `toolFromMcp`) are tested on too.
    #[test]
    fn the_shared_table_of_mcp_tools_maps_as_the_clients_do() {
        let table: Value =
            serde_json::from_str(include_str!("../../tests/fixtures/mcp-tools.json")).unwrap();
        let cases = table["cases"].as_array().unwrap();
        assert!(cases.len() >= 10);
        for c in cases {
            let what = c["what"].as_str().unwrap();
            let server = c["server"].as_str().unwrap();
            let spec = format!("{server}=cmd").parse::<ServerSpec>();
            if c["error"] == true {
                assert!(spec.is_err(), "{what}");
                continue;
            }
            let spec = spec.unwrap_or_else(|e| panic!("{what}: {e}"));
            let tool = &c["tool"];
            let full = format!("{}__{}", spec.name, tool["name"].as_str().unwrap());
            let (entry, _) = tool_spec(full, tool, class_of(tool));
            let got = json!({
                "name": entry.name,
                "class": entry.class.as_str(),
                "enabled": entry.enabled,
                "input_schema": entry.input_schema,
                "description": entry.description,
            });
            assert_eq!(got, c["expect"], "{what}");
        }
    }

    #[test]
    fn classes_follow_annotations_and_spec_defaults() {
        assert_eq!(
            class_of(&json!({"annotations": {"readOnlyHint": true}})),
            ToolClass::Read
        );
        assert_eq!(
            class_of(&json!({"annotations": {"readOnlyHint": false, "destructiveHint": false}})),
            ToolClass::Write
        );
        assert_eq!(
            class_of(&json!({"annotations": {"readOnlyHint": false}})),
            ToolClass::Destructive
        );
        assert_eq!(
            class_of(&json!({})),
            ToolClass::Destructive,
            "no annotations: the spec's defaults"
        );
        assert_eq!(
            class_of(
                &json!({"annotations": {"readOnlyHint": true}, "execution": {"taskSupport": "required"}})
            ),
            ToolClass::LongTask
        );
        assert_eq!(
            class_of(
                &json!({"annotations": {"readOnlyHint": true}, "execution": {"taskSupport": "optional"}})
            ),
            ToolClass::Read
        );
    }

    #[test]
    fn tool_specs_keep_the_schema_and_decide_when_there_is_none() {
        let schema = json!({"type": "object", "properties": {"tz": {"type": "string"}}});
        let (s, w) = tool_spec(
            "t__now".into(),
            &json!({"name": "now", "inputSchema": schema}),
            ToolClass::Read,
        );
        assert_eq!((s.input_schema, s.enabled, w), (Some(schema), true, None));
        // No inputSchema: no arguments.
        let (s, w) = tool_spec("t__ping".into(), &json!({"name": "ping"}), ToolClass::Read);
        assert_eq!(
            s.input_schema,
            Some(json!({"type": "object", "properties": {}}))
        );
        assert!(s.enabled);
        assert!(w.unwrap().contains("no arguments only"));
        let (_, w) = tool_spec(
            "t__rm".into(),
            &json!({"name": "rm"}),
            ToolClass::Destructive,
        );
        assert_eq!(w, None, "never called from a script: nothing to warn about");
        // A schema that does not compile: not callable from scripts.
        let bad = json!({"name": "x", "inputSchema": {"type": 12}});
        let (s, w) = tool_spec("t__x".into(), &bad, ToolClass::Write);
        assert_eq!((s.input_schema, s.enabled), (None, false));
        assert!(w.unwrap().contains("scripts cannot call it"));
        let (s, w) = tool_spec("t__x".into(), &bad, ToolClass::LongTask);
        assert_eq!((s.input_schema, s.enabled, w), (None, true, None));
        // Whatever the case, the snapshot built from them is accepted.
        let tools: Vec<ToolSpec> = [
            tool_spec("a__1".into(), &json!({}), ToolClass::Read).0,
            tool_spec("a__2".into(), &bad, ToolClass::Read).0,
            tool_spec("a__3".into(), &bad, ToolClass::Destructive).0,
        ]
        .into();
        let snap = crate::protocol::snapshot::parse_snapshot(
            json!({"workspace": "/w", "permission_mode": "auto", "tools": tools}),
        )
        .unwrap();
        assert!(crate::policy::Policy::plan(&snap, &[]).is_ok());
    }

    #[test]
    fn results_join_text_and_name_other_content() {
        let r = ToolResult::from_mcp(&json!({"content": [
            {"type": "text", "text": "hello"},
            {"type": "image", "mimeType": "image/png", "data": "AAECAw=="},
            {"type": "resource_link", "uri": "file:///x"},
            {"type": "resource", "resource": {"uri": "mem://a", "mimeType": "application/gzip", "blob": "AAAA"}},
            {"type": "resource", "resource": {"uri": "mem://b", "text": "inline"}}
        ], "structuredContent": {"a": 1}, "isError": true}));
        assert_eq!(r.text, "hello\n[image/png, 4 bytes]\n[resource link file:///x]\n[application/gzip, 3 bytes, mem://a]\ninline");
        assert_eq!(r.structured, Some(json!({"a": 1})));
        assert!(r.is_error);
    }

    #[test]
    fn server_specs_split_like_a_shell() {
        let s: ServerSpec = "fs=npx -y '@modelcontextprotocol/server-filesystem' \"/srv/my dir\""
            .parse()
            .unwrap();
        assert_eq!(s.name, "fs");
        assert_eq!(
            s.argv,
            [
                "npx",
                "-y",
                "@modelcontextprotocol/server-filesystem",
                "/srv/my dir"
            ]
        );
        assert!("noequals".parse::<ServerSpec>().is_err());
        assert!(
            "a__b=cmd".parse::<ServerSpec>().is_err(),
            "__ separates server and tool names"
        );
        assert!("x=".parse::<ServerSpec>().is_err());
    }
}
