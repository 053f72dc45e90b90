//! Wire types of the engine protocol (scriptgate-protocol(7)): JSON-RPC 2.0, one
//! message per line. Only types and constructors live here; no I/O.

pub(crate) mod framing;
pub mod refusal;
pub(crate) mod rpc;
pub mod snapshot;
pub mod token;
pub(crate) mod trace;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

pub const PROTOCOL_VERSION: u32 = 1;

/// JSON-RPC error codes used by scriptgated.
pub mod code {
    pub const PARSE_ERROR: i64 = -32700;
    pub const INVALID_REQUEST: i64 = -32600;
    pub const METHOD_NOT_FOUND: i64 = -32601;
    pub const INVALID_PARAMS: i64 = -32602;
    pub const INTERNAL: i64 = -32603;
    /// The peer is neither uid 0 nor in `auth.allowed_groups`.
    pub const PEER_NOT_ALLOWED: i64 = -32001;
    /// Token refused; `data.reason` says why.
    pub const TOKEN: i64 = -32010;
    /// Snapshot refused; `data.reason` and `data.field`.
    pub const SNAPSHOT: i64 = -32011;
    /// A tool named in `script.start`'s `tools` is refused; `data.tool`, `data.reason`.
    pub const TOOLS: i64 = -32012;
    /// Approval denied or not answered in time.
    pub const APPROVAL: i64 = -32013;
    /// The daemon runs `max_running` scripts already.
    pub const BUSY: i64 = -32015;
    /// No such script, or not visible to this connection.
    pub const NOT_FOUND: i64 = -32016;
    /// `script.wait` timed out; the script still runs.
    pub const STILL_RUNNING: i64 = -32017;
    /// Admin method refused: the peer is not root nor in `auth.admin_groups`.
    pub const NOT_ADMIN: i64 = -32018;
}

/// A JSON-RPC error object.
///
/// ```json
/// {"code": -32010, "message": "run token expired", "data": {"reason": "expired"}}
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, thiserror::Error)]
#[error("{message} ({code})")]
pub struct RpcError {
    pub code: i64,
    pub message: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub data: Option<Value>,
}

impl RpcError {
    pub fn new(code: i64, message: impl Into<String>) -> Self {
        RpcError {
            code,
            message: message.into(),
            data: None,
        }
    }
    pub fn with_data(code: i64, message: impl Into<String>, data: Value) -> Self {
        RpcError {
            code,
            message: message.into(),
            data: Some(data),
        }
    }
    pub fn invalid_params(message: impl Into<String>) -> Self {
        Self::new(code::INVALID_PARAMS, message)
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(code::INTERNAL, message)
    }
    pub fn not_found(script_id: &str) -> Self {
        Self::with_data(
            code::NOT_FOUND,
            format!("no script {script_id} visible to this connection"),
            json!({"reason": "not_found", "script_id": script_id}),
        )
    }
    /// No such script, as administrators are told (they see every script).
    pub fn no_such_script(script_id: &str) -> Self {
        Self::with_data(
            code::NOT_FOUND,
            format!("no script {script_id} is running or recorded"),
            json!({"reason": "not_found", "script_id": script_id}),
        )
    }
    /// The `data.reason` of an answer, read as a client reads it. The daemon
    /// never reads its own refusals back: they are typed until they are sent
    /// ([`refusal::Refused`]).
    pub fn reason(&self) -> Option<&str> {
        self.data.as_ref()?.get("reason")?.as_str()
    }
    /// An admin method from a peer that is not an administrator.
    pub fn not_admin() -> Self {
        Self::with_data(
            code::NOT_ADMIN,
            "this method is for root and members of auth.admin_groups",
            json!({"reason": "not_admin"}),
        )
    }
}

/// One incoming line, classified.
#[derive(Debug)]
pub enum Incoming {
    /// `{"jsonrpc":"2.0","id":1,"method":"script.start","params":{…}}`
    Request {
        id: Value,
        method: String,
        params: Value,
    },
    /// `{"jsonrpc":"2.0","method":"x","params":{…}}` (no id)
    Notification { method: String, params: Value },
    /// `{"jsonrpc":"2.0","id":7,"result":{…}}` or `…"error":{…}}`: answers a request we sent.
    Response {
        id: Value,
        result: Result<Value, RpcError>,
    },
}

/// Parse one line. `Err` carries the error to send back (with the id when known).
pub fn parse_line(line: &[u8]) -> Result<Incoming, (Value, RpcError)> {
    let v: Value = serde_json::from_slice(line).map_err(|e| {
        (
            Value::Null,
            RpcError::new(code::PARSE_ERROR, format!("parse error: {e}")),
        )
    })?;
    let Value::Object(mut m) = v else {
        return Err((
            Value::Null,
            RpcError::new(code::INVALID_REQUEST, "a message must be a JSON object"),
        ));
    };
    let id = m.remove("id");
    // JSON-RPC 2.0: every message says so. A request without it is refused; an
    // answer without it fails the request it answers (so the failure is seen).
    let versioned = m.remove("jsonrpc").is_some_and(|v| v == "2.0");
    let unversioned = || RpcError::new(code::INVALID_REQUEST, "`jsonrpc` must be \"2.0\"");
    if !versioned {
        let answer =
            !m.contains_key("method") && (m.contains_key("result") || m.contains_key("error"));
        return match id {
            Some(id) if answer && !id.is_null() => Ok(Incoming::Response {
                id,
                result: Err(unversioned()),
            }),
            id => Err((id.unwrap_or(Value::Null), unversioned())),
        };
    }
    if let Some(method) = m.remove("method") {
        let Value::String(method) = method else {
            return Err((
                id.unwrap_or(Value::Null),
                RpcError::new(code::INVALID_REQUEST, "`method` must be a string"),
            ));
        };
        let params = m.remove("params").unwrap_or(Value::Null);
        return Ok(match id {
            Some(id) if !id.is_null() => Incoming::Request { id, method, params },
            _ => Incoming::Notification { method, params },
        });
    }
    let Some(id) = id else {
        return Err((
            Value::Null,
            RpcError::new(
                code::INVALID_REQUEST,
                "message has neither `method` nor `id`",
            ),
        ));
    };
    if let Some(err) = m.remove("error") {
        let err = serde_json::from_value(err)
            .unwrap_or_else(|_| RpcError::new(code::INTERNAL, "malformed error object"));
        return Ok(Incoming::Response {
            id,
            result: Err(err),
        });
    }
    match m.remove("result") {
        Some(result) => Ok(Incoming::Response {
            id,
            result: Ok(result),
        }),
        None => Err((
            id,
            RpcError::new(
                code::INVALID_REQUEST,
                "response has neither `result` nor `error`",
            ),
        )),
    }
}

/// A request we send: `{"jsonrpc": "2.0", "id": 7, "method": "tool.call", "params": {…}}`.
#[derive(Serialize)]
struct RequestEnvelope<'a, P: ?Sized> {
    jsonrpc: &'static str,
    id: u64,
    method: &'a str,
    params: &'a P,
}

/// A notification we send: `{"jsonrpc": "2.0", "method": "script.progress", "params": {…}}`.
#[derive(Serialize)]
struct NotificationEnvelope<'a, P: ?Sized> {
    jsonrpc: &'static str,
    method: &'a str,
    params: &'a P,
}

/// An answer we send: `{"jsonrpc": "2.0", "id": 1, "result": {…}}` or
/// `{"jsonrpc": "2.0", "id": 1, "error": {"code": -32601, "message": "…"}}`.
#[derive(Serialize)]
struct ResponseEnvelope<'a> {
    jsonrpc: &'static str,
    id: &'a Value,
    #[serde(skip_serializing_if = "Option::is_none")]
    result: Option<&'a Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<&'a RpcError>,
}

fn line<T: Serialize>(v: &T) -> String {
    // Serializing these types cannot fail: every map key is a string.
    serde_json::to_string(v).unwrap_or_default() + "\n"
}

pub fn request_line<P: Serialize + ?Sized>(id: u64, method: &str, params: &P) -> String {
    line(&RequestEnvelope {
        jsonrpc: "2.0",
        id,
        method,
        params,
    })
}

pub fn notification_line<P: Serialize + ?Sized>(method: &str, params: &P) -> String {
    line(&NotificationEnvelope {
        jsonrpc: "2.0",
        method,
        params,
    })
}

pub fn response_line(id: &Value, result: &Result<Value, RpcError>) -> String {
    line(&ResponseEnvelope {
        jsonrpc: "2.0",
        id,
        result: result.as_ref().ok(),
        error: result.as_ref().err(),
    })
}

/// `script.start` params.
///
/// ```json
/// {"token": "eyJ…", "code": "import agent_tools\n…", "tools": ["fleet__reboot_device"], "description": "reboot stale devices",
///  "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
/// ```
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StartParams {
    pub token: String,
    pub code: String,
    #[serde(default)]
    pub tools: Vec<String>,
    #[serde(default)]
    pub description: String,
    /// W3C trace context of the engine's span that starts the script (`trace`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tracestate: Option<String>,
}

/// Params of `script.wait`, `script.status`, `script.cancel`.
///
/// ```json
/// {"script_id": "4f1c…", "timeout_s": 30, "token": "eyJ…"}
/// ```
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScriptRef {
    pub script_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_s: Option<f64>,
    /// A valid token of the script's run grants access from any connection.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
}

/// Params of `run.revoke` and `run.describe`.
///
/// ```json
/// {"token": "eyJ…"}
/// ```
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenParam {
    pub token: String,
}

/// The methods an engine (or an administrator) calls on the daemon, by name.
/// Parsed first, so that an unknown method and a refused admin method are
/// answered before any params are looked at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    ScriptStart,
    ScriptWait,
    ScriptStatus,
    ScriptCancel,
    RunRevoke,
    RunDescribe,
    DaemonInfo,
    AdminList,
    AdminCancel,
    AdminCalls,
    AdminPrune,
}

impl Method {
    pub const ALL: [Method; 11] = [
        Method::ScriptStart,
        Method::ScriptWait,
        Method::ScriptStatus,
        Method::ScriptCancel,
        Method::RunRevoke,
        Method::RunDescribe,
        Method::DaemonInfo,
        Method::AdminList,
        Method::AdminCancel,
        Method::AdminCalls,
        Method::AdminPrune,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Method::ScriptStart => "script.start",
            Method::ScriptWait => "script.wait",
            Method::ScriptStatus => "script.status",
            Method::ScriptCancel => "script.cancel",
            Method::RunRevoke => "run.revoke",
            Method::RunDescribe => "run.describe",
            Method::DaemonInfo => "daemon.info",
            Method::AdminList => "admin.list",
            Method::AdminCancel => "admin.cancel",
            Method::AdminCalls => "admin.calls",
            Method::AdminPrune => "admin.prune",
        }
    }

    /// The method of this name, or -32601.
    pub fn from_name(name: &str) -> Result<Method, RpcError> {
        Method::ALL
            .into_iter()
            .find(|m| m.name() == name)
            .ok_or_else(|| {
                RpcError::new(code::METHOD_NOT_FOUND, format!("unknown method {name:?}"))
            })
    }

    /// For root and members of `auth.admin_groups` only.
    pub fn admin_only(self) -> bool {
        matches!(
            self,
            Method::AdminList | Method::AdminCancel | Method::AdminCalls | Method::AdminPrune
        )
    }
}

/// A request from the engine, with its params typed. Params that do not fit are
/// -32602 `invalid params: …` (unknown fields included); methods without params
/// ignore whatever is sent.
#[derive(Debug, Clone)]
pub enum EngineRequest {
    /// ```json
    /// {"jsonrpc": "2.0", "id": 1, "method": "script.start", "params": {"token": "eyJ…", "code": "…", "tools": [], "description": "…"}}
    /// ```
    /// Answer: `Started`.
    ScriptStart(StartParams),
    /// ```json
    /// {"jsonrpc": "2.0", "id": 2, "method": "script.wait", "params": {"script_id": "4f1c…", "timeout_s": 30}}
    /// ```
    /// Answer: the result object (`ScriptResult`), or -32017 after `timeout_s`.
    ScriptWait(ScriptRef),
    /// ```json
    /// {"jsonrpc": "2.0", "id": 3, "method": "script.status", "params": {"script_id": "4f1c…"}}
    /// ```
    /// Answer: `ScriptStatus`.
    ScriptStatus(ScriptRef),
    /// ```json
    /// {"jsonrpc": "2.0", "id": 4, "method": "script.cancel", "params": {"script_id": "4f1c…"}}
    /// ```
    /// Answer: `ScriptState`.
    ScriptCancel(ScriptRef),
    /// ```json
    /// {"jsonrpc": "2.0", "id": 5, "method": "run.revoke", "params": {"token": "eyJ…"}}
    /// ```
    /// Answer: `Revoked`.
    RunRevoke(TokenParam),
    /// ```json
    /// {"jsonrpc": "2.0", "id": 6, "method": "run.describe", "params": {"token": "eyJ…"}}
    /// ```
    /// Answer: `Described`.
    RunDescribe(TokenParam),
    /// ```json
    /// {"jsonrpc": "2.0", "id": 7, "method": "daemon.info"}
    /// ```
    /// Answer: `DaemonInfo`.
    DaemonInfo,
    /// Admin.
    /// ```json
    /// {"jsonrpc": "2.0", "id": 8, "method": "admin.list"}
    /// ```
    /// Answer: `AdminList`.
    AdminList,
    /// Admin.
    /// ```json
    /// {"jsonrpc": "2.0", "id": 9, "method": "admin.cancel", "params": {"script_id": "4f1c…"}}
    /// ```
    /// Answer: `ScriptState`.
    AdminCancel(ScriptRef),
    /// Admin.
    /// ```json
    /// {"jsonrpc": "2.0", "id": 10, "method": "admin.calls", "params": {"script_id": "4f1c…", "offset": 200, "limit": 100}}
    /// ```
    /// Answer: `CallsPage`.
    AdminCalls(CallsParams),
    /// Admin.
    /// ```json
    /// {"jsonrpc": "2.0", "id": 11, "method": "admin.prune", "params": {"dry_run": true}}
    /// ```
    /// Answer: `Pruned`.
    AdminPrune(PruneParams),
}

impl EngineRequest {
    /// The typed request for `method` and its params.
    pub fn parse(method: Method, params: Value) -> Result<EngineRequest, RpcError> {
        Ok(match method {
            Method::ScriptStart => EngineRequest::ScriptStart(typed_params(params)?),
            Method::ScriptWait => EngineRequest::ScriptWait(typed_params(params)?),
            Method::ScriptStatus => EngineRequest::ScriptStatus(typed_params(params)?),
            Method::ScriptCancel => EngineRequest::ScriptCancel(typed_params(params)?),
            Method::RunRevoke => EngineRequest::RunRevoke(typed_params(params)?),
            Method::RunDescribe => EngineRequest::RunDescribe(typed_params(params)?),
            Method::DaemonInfo => EngineRequest::DaemonInfo,
            Method::AdminList => EngineRequest::AdminList,
            Method::AdminCancel => EngineRequest::AdminCancel(typed_params(params)?),
            Method::AdminCalls => EngineRequest::AdminCalls(typed_params(params)?),
            Method::AdminPrune => EngineRequest::AdminPrune(typed_params(params)?),
        })
    }
}

/// Params as `T`; absent params (`null`) read as `{}`.
pub fn typed_params<T: serde::de::DeserializeOwned>(v: Value) -> Result<T, RpcError> {
    let v = if v.is_null() {
        Value::Object(Default::default())
    } else {
        v
    };
    serde_json::from_value(v).map_err(|e| RpcError::invalid_params(format!("invalid params: {e}")))
}

/// The answer to `script.start`.
///
/// ```json
/// {"script_id": "4f1c…", "state": "running"}
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Started {
    pub script_id: String,
    pub state: Status,
}

/// The answer to `script.cancel` and `admin.cancel`: the script's state after it.
/// `already_finished` (sent only when true) says the script had ended before
/// the cancel, with `state` its own status.
///
/// ```json
/// {"script_id": "4f1c…", "state": "cancelled"}
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScriptState {
    pub script_id: String,
    pub state: Status,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub already_finished: bool,
}

/// Progress a script reported (`agent_tools.progress`).
///
/// ```json
/// {"done": 120, "total": 500, "message": "devices"}
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Progress {
    pub done: i64,
    pub total: i64,
    pub message: String,
}

/// The answer to `script.status`, and the params of `script.progress`.
///
/// ```json
/// {"script_id": "4f1c…", "state": "running", "calls": 120, "failures": 0,
///  "elapsed_ms": 5300, "progress": {"done": 120, "total": 500, "message": "devices"}}
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScriptStatus {
    pub script_id: String,
    pub state: Status,
    pub calls: u64,
    pub failures: u64,
    pub elapsed_ms: u64,
    pub progress: Option<Progress>,
}

/// The answer to `run.revoke`.
///
/// ```json
/// {"run_id": "run-42", "cancelled": 2}
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Revoked {
    pub run_id: String,
    pub cancelled: usize,
}

/// The answer to `run.describe`: the run_script description for the token's snapshot.
///
/// ```json
/// {"text": "run_script: run one Python 3 script…",
///  "tool": {"name": "run_script", "description": "run_script: run one Python 3 script…",
///           "inputSchema": {"type": "object", "properties": {"code": {…}, "tools": {…}, "description": {…}},
///                           "required": ["code"]}}}
/// ```
///
/// `tool` is an MCP `Tool` definition an engine hands its model as it is; its
/// arguments are `script.start`'s `code`, `tools` and `description`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Described {
    pub text: String,
    pub tool: Value,
}

/// The answer to `daemon.info`.
///
/// ```json
/// {"version": "0.1.0", "protocol": 1, "backend": "cgroup", "backend_notes": [],
///  "limits_per_script": true, "limits_enforced": true, "running": 0,
///  "sandbox": {"state": "ok", "nested_userns": "disable-userns", "problem": null, "detail": null},
///  "limits": {"max_calls": 500, "max_concurrency": 4, "timeout_s": 600,
///             "memory_max_bytes": 1073741824, "tasks_max": 64, "output_max_bytes": 10485760,
///             "return_max_chars": 20000, "approval_timeout_s": 300, "max_running": 16}}
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DaemonInfo {
    pub version: String,
    pub protocol: u32,
    pub backend: String,
    pub backend_notes: Vec<String>,
    pub limits_per_script: bool,
    /// The start-up preflight read the limits back from a unit's cgroups and
    /// found memory_max_bytes and tasks_max in force (extension; `backend_notes`
    /// says what is not).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limits_enforced: Option<bool>,
    pub running: usize,
    pub limits: DaemonLimits,
    /// What the start-up preflight found of the sandbox (extension).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<SandboxInfo>,
    /// What scripts that run as one uid can do to each other, and what other
    /// processes of that uid can do to them: plain sentences (extension).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub same_uid: Vec<String>,
    /// `scripts.disk_max_bytes` and, for each workspace root, whether it can be
    /// in force there (extension).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk: Option<DiskInfo>,
    /// When this daemon started, ms since the epoch (extension).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_ms: Option<i64>,
    /// The configuration file and whether the daemon runs with it as it is on
    /// disk (extension; absent for an embedded daemon).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<ConfigState>,
    /// The bound on all scripts together (`scripts.total_*`), where it is
    /// written, whether it reads back in force, and what all scripts hold now
    /// (extension).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub all_scripts: Option<AllScripts>,
    /// The pre-made sandboxes (`sandbox.pool_size`): absent when the daemon
    /// keeps none (extension).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<PoolInfo>,
}

/// `daemon.info`'s `pool`: how many pre-made sandboxes each script uid gets,
/// how many are waiting now (all uids), and the most there may be.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PoolInfo {
    pub size: u64,
    pub waiting: usize,
    pub max_members: usize,
}

/// `daemon.info`'s `all_scripts`: memory, tasks and CPU of every script at
/// once (0: no bound), on `scriptgate.slice` or the cgroup backend's `scripts`
/// node.
///
/// ```json
/// {"memory_max_bytes": 1610612736, "tasks_max": 4096, "cpu_quota_percent": 150,
///  "derived": ["total_memory_max_bytes: 75% of the host's 2048 MiB"], "notes": [],
///  "cgroup": "/sys/fs/cgroup/scriptgate.slice", "in_force": true, "problem": null,
///  "memory_current_bytes": 10485760, "tasks_current": 7}
/// ```
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct AllScripts {
    pub memory_max_bytes: u64,
    pub tasks_max: u64,
    /// Percent of one CPU.
    pub cpu_quota_percent: u32,
    /// The keys left out of the file, each with what its value came from.
    #[serde(default)]
    pub derived: Vec<String>,
    /// What is odd about the values (a derived total below one script's).
    #[serde(default)]
    pub notes: Vec<String>,
    /// The cgroup directory that holds all scripts (null: none, rlimit).
    #[serde(default)]
    pub cgroup: Option<String>,
    /// Its limit files read back as asked.
    #[serde(default)]
    pub in_force: bool,
    /// Why not, or why they could not be set.
    #[serde(default)]
    pub problem: Option<String>,
    #[serde(default)]
    pub memory_current_bytes: Option<u64>,
    #[serde(default)]
    pub tasks_current: Option<u64>,
}

/// `daemon.info`'s `config`: the file the daemon read, whether it still is as
/// read, and what a reload left for a restart (scriptgated(8) RELOAD).
///
/// ```json
/// {"path": "/etc/scriptgate/scriptgate.toml", "digest": "5f1c…", "loaded_ms": 1764780000000,
///  "on_disk": "changed", "modified_ms": 1764781000000,
///  "pending_restart": ["server.max_connections"],
///  "last_reload": {"at_ms": 1764780500000, "error": null}}
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ConfigState {
    pub path: String,
    /// SHA-256 of the file as read, hex; null: there was no file (defaults).
    pub digest: Option<String>,
    /// When the configuration in force was read: the start, or the last
    /// reload that checked.
    pub loaded_ms: i64,
    /// The file now: "same" (as read), "changed", "missing" or
    /// "unreadable: WHY".
    pub on_disk: String,
    /// The file's modification time now.
    pub modified_ms: Option<i64>,
    /// Keys whose value in the file differs from the running one and take
    /// effect at the next restart only.
    pub pending_restart: Vec<String>,
    /// The last reload: when, and why it was refused (null: it checked).
    pub last_reload: Option<LastReload>,
}

/// [`ConfigState`]'s `last_reload`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LastReload {
    pub at_ms: i64,
    pub error: Option<String>,
}

/// `daemon.info`'s `disk`: the bound on what a workspace holds while its scripts
/// run (project quotas), and where it is in force.
///
/// ```json
/// {"max_bytes": 1073741824,
///  "roots": [{"root": "/srv/ws", "in_force": true, "why": null}]}
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DiskInfo {
    /// 0: no bound.
    pub max_bytes: u64,
    pub roots: Vec<DiskRoot>,
}

/// One workspace root of [`DiskInfo`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DiskRoot {
    pub root: String,
    pub in_force: bool,
    /// Why not, when it is not.
    pub why: Option<String>,
}

/// `daemon.info`'s `sandbox`: can bwrap make a sandbox here, as the script uid.
///
/// ```json
/// {"state": "unavailable", "nested_userns": "disable-userns",
///  "problem": "sandbox unavailable: AppArmor denies the sandbox its user namespace (…); fix: …",
///  "detail": "bwrap: loopback: Failed RTM_NEWADDR: Operation not permitted"}
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SandboxInfo {
    /// `ok`, `unavailable` (scripts will fail; `problem` says why and the fix),
    /// or `unchecked` (the probe could not be run or did not end).
    pub state: String,
    /// What keeps a script from making user namespaces: `disable-userns` (bwrap's
    /// flag and the seccomp filter) or `seccomp` (the filter alone, where the flag
    /// cannot be used: a read-only /proc/sys, a bwrap before 0.8).
    pub nested_userns: String,
    /// The one-line diagnosis: cause and fix.
    pub problem: Option<String>,
    /// bwrap's own words.
    pub detail: Option<String>,
}

/// `daemon.info`'s `limits`: the configured limits of every script.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DaemonLimits {
    pub max_calls: u64,
    pub max_concurrency: usize,
    pub timeout_s: u64,
    pub memory_max_bytes: u64,
    pub tasks_max: u64,
    pub output_max_bytes: u64,
    pub return_max_chars: usize,
    pub approval_timeout_s: u64,
    pub max_running: usize,
}

/// The answer to `admin.list`.
///
/// ```json
/// {"scripts": [{"script_id": "4f1c…", "state": "running", "calls": 3, "failures": 0,
///   "elapsed_ms": 900, "progress": null, "run_id": "run-42", "peer_uid": 1000,
///   "uid": 1000, "unit": "scriptgate-4f1c….scope", "age_ms": 900}]}
/// ```
/// (The daemon may hand over its entries as JSON values: `AdminList<Value>`.)
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AdminList<S = ListedScript> {
    pub scripts: Vec<S>,
}

/// One running script in `admin.list`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ListedScript {
    #[serde(flatten)]
    pub status: ScriptStatus,
    pub run_id: String,
    pub peer_uid: u32,
    /// The uid the script runs as.
    pub uid: u32,
    pub unit: Option<String>,
    pub age_ms: u64,
    /// What the script holds now (extension); null until its sandbox exists.
    #[serde(default)]
    pub resources: Option<Resources>,
}

/// `admin.list`'s `resources` of one running script: read from its cgroup
/// (`source` "cgroup") or summed over its process tree from /proc ("proc", the
/// rlimit backend, where `memory_peak_bytes` is the largest VmHWM of one
/// process). Each is null where it cannot be read, never 0 for unknown.
///
/// ```json
/// {"source": "cgroup", "memory_bytes": 14680064, "memory_peak_bytes": 20971520,
///  "cpu_usec": 120000, "tasks": 3}
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Resources {
    pub source: String,
    pub memory_bytes: Option<u64>,
    pub memory_peak_bytes: Option<u64>,
    pub cpu_usec: Option<u64>,
    pub tasks: Option<u64>,
}

/// Lines of calls.jsonl in one `admin.calls` page, at most.
pub const CALLS_PAGE_MAX_LINES: usize = 200;
/// Bytes of line text in one `admin.calls` page, at most (a page holds at
/// least one line).
pub const CALLS_PAGE_MAX_BYTES: usize = 1 << 20;
/// A line of calls.jsonl longer than this is clipped in `admin.calls`.
pub const CALLS_LINE_MAX_BYTES: usize = 16 * 1024;
/// Bytes of calls.jsonl read for one `admin.calls` page, at most.
pub const CALLS_SCAN_MAX_BYTES: u64 = 64 << 20;

/// Params of `admin.calls`: a page of a script's calls.jsonl, from line
/// `offset` (0-based), at most `limit` lines (default and most
/// [`CALLS_PAGE_MAX_LINES`]; 0 is refused with -32602).
///
/// ```json
/// {"script_id": "4f1c9e0a2b3d5e6f", "offset": 200, "limit": 100}
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CallsParams {
    pub script_id: String,
    #[serde(default)]
    pub offset: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<usize>,
}

/// The answer to `admin.calls`: the lines as logged, and where the next page
/// starts (null at the end).
///
/// ```json
/// {"script_id": "4f1c9e0a2b3d5e6f", "offset": 0, "next_offset": null,
///  "lines": [{"n": 0, "text": "{\"tool\":\"t\",\"arguments\":{\"sn\":\"A1\"}}"}]}
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CallsPage {
    pub script_id: String,
    pub offset: u64,
    pub next_offset: Option<u64>,
    pub lines: Vec<CallLine>,
}

/// One line of calls.jsonl as logged, without its newline; a line over
/// [`CALLS_LINE_MAX_BYTES`] is clipped, and `clipped_bytes` is its length.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CallLine {
    pub n: u64,
    pub text: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clipped_bytes: Option<u64>,
}

/// Params of `admin.prune`.
///
/// ```json
/// {"dry_run": true}
/// ```
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PruneParams {
    #[serde(default)]
    pub dry_run: bool,
    /// Judge retention as of this moment (ms) instead of now: only with
    /// `dry_run` (extension; absent: now).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub as_of_ms: Option<i64>,
}

/// The answer to `admin.prune` (and what `scriptgate prune` prints from):
/// one workspace retention pass.
///
/// ```json
/// {"dry_run": true, "retain_days": 30, "roots": ["/var/lib/scriptgate/workspaces"],
///  "expired": [{"path": "/var/lib/scriptgate/workspaces/1000/run-x",
///               "last_used_ms": 1764000000000, "error": null}],
///  "unknown": [], "kept": 8, "more": false}
/// ```
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Pruned {
    pub dry_run: bool,
    pub retain_days: u64,
    pub roots: Vec<std::path::PathBuf>,
    /// Unused for longer than the retention, oldest first: removed (or, in a
    /// dry run, to be), `error` set where the removal failed.
    pub expired: Vec<PrunedWorkspace>,
    /// Recorded workspaces that could not be looked at now: kept.
    pub unknown: Vec<PruneUnknown>,
    /// Recent or in use.
    pub kept: usize,
    /// A bound of the pass was reached: more may be due at the next.
    pub more: bool,
    /// The moment the pass judged at, when it was not now (`as_of_ms`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub as_of_ms: Option<i64>,
    /// A dry run's every recorded workspace it could look at, oldest use first,
    /// with what will happen to it (at most `daemon::prune::MAX_LISTED`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub workspaces: Vec<PlannedWorkspace>,
    /// More workspaces than listed.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub workspaces_more: bool,
}

/// One workspace of a dry run's listing (`Pruned::workspaces`).
///
/// ```json
/// {"path": "/var/lib/scriptgate/workspaces/1000/run-x", "engine_uid": 1000,
///  "owner_uid": 1000, "last_used_ms": 1764000000000, "age_ms": 2764800000,
///  "size_bytes": 40960, "size_partial": false, "action": "remove",
///  "due_ms": 1766592000000}
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlannedWorkspace {
    pub path: std::path::PathBuf,
    /// The uid of the engine whose script the daemon recorded in it.
    pub engine_uid: Option<u32>,
    /// The directory's owner (the uid its scripts ran as).
    pub owner_uid: Option<u32>,
    pub last_used_ms: i64,
    /// Since its last use, at the moment judged.
    pub age_ms: i64,
    /// Bytes its files hold (allocated), or at least this many when
    /// `size_partial` (a bound of the walk met, or a directory not readable).
    pub size_bytes: Option<u64>,
    pub size_partial: bool,
    /// `remove` (this pass), `remove_next_pass` (due, past the per-owner bound
    /// of one pass), `keep` (until `due_ms`), `keep_in_use` (a script runs in it).
    pub action: String,
    /// When it is due: its last use plus `retain_days`.
    pub due_ms: i64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PrunedWorkspace {
    pub path: std::path::PathBuf,
    pub last_used_ms: i64,
    pub error: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PruneUnknown {
    pub path: std::path::PathBuf,
    pub error: String,
}

/// `tool.call` (daemon → engine, request): one tool call of a script; `arguments`
/// already include the frozen ones. Answered with a `ToolResult` or an MCP
/// `CallToolResult` (`ToolResult::from_answer`).
///
/// ```json
/// {"jsonrpc": "2.0", "id": 3, "method": "tool.call", "params": {"script_id": "4f1c…",
///  "run_id": "run-42", "call_id": "17", "tool": "fleet__reboot_device",
///  "arguments": {"sn": "A1", "tenant": "acme"}}}
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    pub script_id: String,
    pub run_id: String,
    pub call_id: String,
    pub tool: String,
    pub arguments: Value,
    /// The script's trace (`trace`), when it was started with one: the parent is
    /// the engine's span that started the script.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tracestate: Option<String>,
    /// This call's own span id, which its calls.jsonl line carries too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub span_id: Option<String>,
}

/// `approval.request` (daemon → engine, request): one approval for all the write
/// tools a script declares. Answered with `ApprovalAnswer`.
///
/// ```json
/// {"jsonrpc": "2.0", "id": 1, "method": "approval.request", "params": {"script_id": "4f1c…",
///  "run_id": "run-42", "description": "reboot stale devices", "code": "import agent_tools…",
///  "tools": [{"name": "fleet__reboot_device", "class": "write"}]}}
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ApprovalRequest {
    pub script_id: String,
    pub run_id: String,
    pub description: String,
    pub code: String,
    pub tools: Vec<ApprovalTool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tracestate: Option<String>,
}

/// A tool in `approval.request`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ApprovalTool {
    pub name: String,
    pub class: String,
}

/// The requests the daemon sends to an engine, typed; what an engine dispatches on.
#[derive(Debug, Clone, PartialEq)]
pub enum DaemonRequest {
    ToolCall(ToolCall),
    ApprovalRequest(ApprovalRequest),
}

impl DaemonRequest {
    pub const TOOL_CALL: &'static str = "tool.call";
    pub const APPROVAL_REQUEST: &'static str = "approval.request";

    /// The typed request, -32601 for a method the daemon does not send, -32602
    /// for params that do not fit.
    pub fn parse(method: &str, params: Value) -> Result<DaemonRequest, RpcError> {
        match method {
            Self::TOOL_CALL => Ok(DaemonRequest::ToolCall(typed_params(params)?)),
            Self::APPROVAL_REQUEST => Ok(DaemonRequest::ApprovalRequest(typed_params(params)?)),
            _ => Err(RpcError::new(
                code::METHOD_NOT_FOUND,
                "not an engine method",
            )),
        }
    }
}

/// The notifications the daemon sends to the engine that started a script.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "method", content = "params")]
pub enum Notification {
    /// At most one per second per script, and the last state before `script.finished`.
    ///
    /// ```json
    /// {"jsonrpc": "2.0", "method": "script.progress", "params": {"script_id": "4f1c…",
    ///  "state": "running", "calls": 120, "failures": 0, "elapsed_ms": 5300, "progress": null}}
    /// ```
    #[serde(rename = "script.progress")]
    ScriptProgress(ScriptStatus),
    /// The result object, once the script has finished.
    ///
    /// ```json
    /// {"jsonrpc": "2.0", "method": "script.finished", "params": {"script_id": "4f1c…", "status": "ok", …}}
    /// ```
    #[serde(rename = "script.finished")]
    ScriptFinished(Box<ScriptResult>),
    /// A `tool.call` that had no answer when its script ended: the engine may stop
    /// the work; an answer sent after it is ignored.
    ///
    /// ```json
    /// {"jsonrpc": "2.0", "method": "tool.cancelled", "params": {"id": 7, "script_id": "4f1c…",
    ///  "call_id": "17", "reason": "cancelled", "message": "cancelled by the engine"}}
    /// ```
    #[serde(rename = "tool.cancelled")]
    ToolCancelled(ToolCancelled),
}

/// `tool.cancelled` params; `id` is the JSON-RPC id of the abandoned `tool.call`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolCancelled {
    pub id: u64,
    pub script_id: String,
    pub call_id: String,
    /// `cancelled`, `timeout`, `oom`, `interrupted` or `exited`.
    pub reason: String,
    pub message: String,
}

impl Notification {
    pub fn method(&self) -> &'static str {
        match self {
            Notification::ScriptProgress(_) => "script.progress",
            Notification::ScriptFinished(_) => "script.finished",
            Notification::ToolCancelled(_) => "tool.cancelled",
        }
    }

    /// The typed notification of this method and params.
    pub fn parse(method: &str, params: Value) -> Result<Notification, String> {
        serde_json::from_value(serde_json::json!({"method": method, "params": params}))
            .map_err(|e| format!("{method}: {e}"))
    }

    /// Its params, as they go on the wire.
    pub fn params(&self) -> Value {
        match self {
            Notification::ScriptProgress(s) => serde_json::to_value(s),
            Notification::ScriptFinished(r) => serde_json::to_value(r),
            Notification::ToolCancelled(c) => serde_json::to_value(c),
        }
        .unwrap_or_default()
    }
}

/// What a tool call returns, from the engine to the daemon and on to the script.
///
/// ```json
/// {"text": "online", "structured": {"sn": "A1", "online": true}, "is_error": false}
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolResult {
    pub text: String,
    pub structured: Option<Value>,
    pub is_error: bool,
}

/// An answer to `tool.call`: the result, and the keys of an MCP `CallToolResult`
/// that the daemon ignored (at most `MAX_IGNORED_KEYS`, each clipped).
#[derive(Debug, Clone, PartialEq)]
pub struct ToolAnswer {
    pub result: ToolResult,
    pub ignored: Vec<String>,
}

/// The most ignored keys of one answer that are named.
pub const MAX_IGNORED_KEYS: usize = 8;

impl ToolResult {
    /// The engine's answer to `tool.call`, in exactly one of its two shapes (§5):
    ///
    /// ```json
    /// {"text": "SN1 online", "structured": {"online": true}, "is_error": false}
    /// {"content": [{"type": "text", "text": "boom"}], "isError": true}
    /// ```
    ///
    /// The first needs `text` and `is_error` (`structured` may be left out: null)
    /// and nothing else. The second is an MCP `CallToolResult`, taken by the MCP
    /// schema: `content` an array of content blocks, `isError` a boolean,
    /// `structuredContent` and `_meta` objects (null: absent); a `Result` may carry
    /// other keys, and new spec versions add them (`resultType`), so any other key
    /// is ignored and named in `ignored`. It is converted as `scriptgate run`
    /// converts MCP results. Anything else (a wrong type, neither `text` nor
    /// `content`, an unknown key in the first shape) is an error naming the
    /// problem: a failed call, never an empty success.
    pub fn from_answer(v: &Value) -> Result<ToolAnswer, String> {
        let Value::Object(m) = v else {
            return Err("the answer must be a JSON object".into());
        };
        if m.contains_key("content") {
            let Some(items) = m["content"].as_array() else {
                return Err("`content` must be an array of content blocks".into());
            };
            if let Some(i) = items
                .iter()
                .position(|c| !c.get("type").is_some_and(Value::is_string))
            {
                return Err(format!("content[{i}] has no string `type`"));
            }
            let present = |k: &str| m.get(k).filter(|x| !x.is_null());
            if present("isError").is_some_and(|e| !e.is_boolean()) {
                return Err("`isError` must be a boolean".into());
            }
            for k in ["structuredContent", "_meta"] {
                if present(k).is_some_and(|x| !x.is_object()) {
                    return Err(format!("`{k}` must be an object"));
                }
            }
            // The other shape's keys are a mix-up, not an extension: an answer
            // meant as an error must not pass as an empty success.
            if let Some(k) = ["text", "structured", "is_error"]
                .into_iter()
                .find(|k| m.contains_key(*k))
            {
                return Err(format!(
                    "`{k}` belongs to the {{text, structured, is_error}} answer, not to an MCP CallToolResult (which says `isError`, `structuredContent`)"
                ));
            }
            let known = ["content", "isError", "structuredContent", "_meta"];
            let ignored = m
                .keys()
                .filter(|k| !known.contains(&k.as_str()))
                .take(MAX_IGNORED_KEYS)
                .map(|k| framing::clip(k, 64))
                .collect();
            return Ok(ToolAnswer {
                result: ToolResult::from_mcp(v),
                ignored,
            });
        }
        if !m.contains_key("text") {
            return Err(
                "neither `text` ({text, structured, is_error}) nor `content` (an MCP CallToolResult)"
                    .into(),
            );
        }
        if let Some(k) = m
            .keys()
            .find(|k| !["text", "structured", "is_error"].contains(&k.as_str()))
        {
            return Err(format!(
                "unknown field `{}` in a {{text, structured, is_error}} answer",
                framing::clip(k, 64)
            ));
        }
        let Some(text) = m["text"].as_str() else {
            return Err("`text` must be a string".into());
        };
        let Some(is_error) = m.get("is_error").and_then(Value::as_bool) else {
            return Err("`is_error` must be present and a boolean".into());
        };
        Ok(ToolAnswer {
            result: ToolResult {
                text: text.to_string(),
                structured: m.get("structured").cloned().filter(|s| !s.is_null()),
                is_error,
            },
            ignored: vec![],
        })
    }

    /// An MCP `tools/call` result as `{text, structured, is_error}`: text contents
    /// joined, other content kinds named with their type and size.
    pub fn from_mcp(r: &Value) -> ToolResult {
        use base64::Engine as _;
        let mut parts = Vec::new();
        for c in r
            .get("content")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let kind = c.get("type").and_then(Value::as_str).unwrap_or("?");
            let mime = c.get("mimeType").and_then(Value::as_str).unwrap_or(kind);
            let size = |b64: Option<&Value>| {
                b64.and_then(Value::as_str)
                    .and_then(|d| base64::engine::general_purpose::STANDARD.decode(d).ok())
                    .map_or(0, |d| d.len())
            };
            let text = |v: &Value| v.get("text").and_then(Value::as_str).map(str::to_string);
            parts.push(match kind {
                "text" => text(c).unwrap_or_default(),
                "image" | "audio" => format!("[{mime}, {} bytes]", size(c.get("data"))),
                "resource_link" => format!(
                    "[resource link {}]",
                    c.get("uri").and_then(Value::as_str).unwrap_or("")
                ),
                "resource" => {
                    let res = c.get("resource").cloned().unwrap_or(Value::Null);
                    text(&res).unwrap_or_else(|| {
                        let mime = res
                            .get("mimeType")
                            .and_then(Value::as_str)
                            .unwrap_or("resource");
                        format!(
                            "[{mime}, {} bytes, {}]",
                            size(res.get("blob")),
                            res.get("uri").and_then(Value::as_str).unwrap_or("")
                        )
                    })
                }
                other => format!("[{other} content]"),
            });
        }
        ToolResult {
            text: parts.join("\n"),
            structured: r.get("structuredContent").cloned().filter(|v| !v.is_null()),
            is_error: r.get("isError").and_then(Value::as_bool).unwrap_or(false),
        }
    }
}

/// The engine's answer to `approval.request`.
///
/// ```json
/// {"decision": "allow_once"}
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApprovalAnswer {
    pub decision: Decision,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Decision {
    AllowOnce,
    Deny,
}

/// Why a script ended (§6 `status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Running,
    Ok,
    Error,
    Timeout,
    Cancelled,
    Oom,
    Limit,
    Interrupted,
}

impl Status {
    /// Every status a finished script can have (`running` is not one).
    pub const FINAL: [Status; 7] = [
        Status::Ok,
        Status::Error,
        Status::Timeout,
        Status::Cancelled,
        Status::Oom,
        Status::Limit,
        Status::Interrupted,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Status::Running => "running",
            Status::Ok => "ok",
            Status::Error => "error",
            Status::Timeout => "timeout",
            Status::Cancelled => "cancelled",
            Status::Oom => "oom",
            Status::Limit => "limit",
            Status::Interrupted => "interrupted",
        }
    }
    pub fn parse(s: &str) -> Option<Status> {
        serde_json::from_value(Value::String(s.to_string())).ok()
    }
}

/// The result object (§6).
///
/// ```json
/// {"script_id": "…", "run_id": "run-42", "status": "ok", "exit_code": 0, "calls": 500,
///  "failures": 0, "duration_ms": 3120, "details_dir": ".agent/scripts/…", "output": "…",
///  "output_truncated": false, "error": null, "text": "run_script ok: 500 calls, …"}
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScriptResult {
    pub script_id: String,
    pub run_id: String,
    pub status: Status,
    pub exit_code: Option<i32>,
    pub calls: u64,
    pub failures: u64,
    pub duration_ms: u64,
    pub details_dir: String,
    pub output: String,
    pub output_truncated: bool,
    pub error: Option<String>,
    pub text: String,
    /// Peak memory of the script's unit/cgroup, when the backend knows it (extension).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_peak_bytes: Option<u64>,
    /// CPU time of the script's unit/cgroup, when the backend knows it (extension).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_usec: Option<u64>,
    /// Limits of this script that were not in force, read back from its cgroups
    /// (extension).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub backend_notes: Vec<String>,
    /// Parts of the script's record (`output.txt`, `stderr.txt`, `calls.jsonl`)
    /// the daemon could not write, each with why (a full filesystem); `text` says
    /// so too (extension).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub record_incomplete: Vec<String>,
    /// Whether the script ran in a pre-made sandbox (`true`) or started cold;
    /// absent when the daemon keeps no pool (extension).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pre_made: Option<bool>,
}

impl ScriptResult {
    /// Fill `text` exactly as §6 says: one summary line, then the output, then
    /// (when not `ok`) the error tail. `truncated_note` follows a truncated output.
    pub fn with_text(mut self, truncated_note: Option<&str>) -> ScriptResult {
        let mut t = format!(
            "run_script {}: {} calls, {} failed, {:.1} s, details in {}\n",
            self.status.as_str(),
            self.calls,
            self.failures,
            self.duration_ms as f64 / 1000.0,
            self.details_dir
        );
        let add_line = |t: &mut String, s: &str| {
            if !t.ends_with('\n') {
                t.push('\n');
            }
            t.push_str(s);
            if !t.ends_with('\n') {
                t.push('\n');
            }
        };
        t.push_str(&self.output);
        if let Some(note) = truncated_note {
            add_line(&mut t, note);
        }
        if self.status != Status::Ok {
            if let Some(err) = self.error.as_deref().filter(|e| !e.is_empty()) {
                add_line(&mut t, &format!("error: {err}"));
            }
        }
        self.text = t;
        self
    }
}

// The script channel on fd 3/4, in its own file.
pub mod script;

// The numbers of a script's request as it wrote them: which would be altered.
pub mod numbers;

#[cfg(test)]
mod vectors;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classifies_requests_notifications_and_responses() {
        assert!(matches!(
            parse_line(br#"{"jsonrpc":"2.0","id":1,"method":"daemon.info"}"#),
            Ok(Incoming::Request { method, .. }) if method == "daemon.info"
        ));
        assert!(matches!(
            parse_line(br#"{"jsonrpc":"2.0","method":"x","params":{}}"#),
            Ok(Incoming::Notification { .. })
        ));
        assert!(matches!(
            parse_line(br#"{"jsonrpc":"2.0","id":"a","result":{"decision":"deny"}}"#),
            Ok(Incoming::Response { result: Ok(_), .. })
        ));
        assert!(matches!(
            parse_line(br#"{"jsonrpc":"2.0","id":3,"error":{"code":-1,"message":"no"}}"#),
            Ok(Incoming::Response { result: Err(e), .. }) if e.message == "no"
        ));
        let (_, e) = parse_line(b"{not json").unwrap_err();
        assert_eq!(e.code, code::PARSE_ERROR);
        let (_, e) = parse_line(b"[1,2]").unwrap_err();
        assert_eq!(e.code, code::INVALID_REQUEST);
    }

    #[test]
    fn methods_parse_by_name_and_params_by_type() {
        for m in Method::ALL {
            assert_eq!(Method::from_name(m.name()), Ok(m));
        }
        let e = Method::from_name("script.nope").unwrap_err();
        assert_eq!(
            (e.code, e.message.as_str()),
            (code::METHOD_NOT_FOUND, "unknown method \"script.nope\"")
        );
        assert!(Method::AdminCancel.admin_only() && !Method::ScriptCancel.admin_only());
        let e = EngineRequest::parse(
            Method::ScriptWait,
            json!({"script_id": "x", "colour": "red"}),
        )
        .unwrap_err();
        assert_eq!(e.code, code::INVALID_PARAMS);
        assert!(
            e.message
                .starts_with("invalid params: unknown field `colour`"),
            "{}",
            e.message
        );
        let e = EngineRequest::parse(Method::RunRevoke, Value::Null).unwrap_err();
        assert_eq!(e.message, "invalid params: missing field `token`");
        assert!(matches!(
            EngineRequest::parse(Method::DaemonInfo, json!([1, 2])),
            Ok(EngineRequest::DaemonInfo)
        ));
    }

    #[test]
    fn lines_are_json_rpc_2() {
        let l: Value =
            serde_json::from_str(&request_line(3, "tool.call", &json!({"a": 1}))).unwrap();
        assert_eq!(
            l,
            json!({"jsonrpc": "2.0", "id": 3, "method": "tool.call", "params": {"a": 1}})
        );
        let l: Value = serde_json::from_str(&response_line(&json!("x"), &Ok(Value::Null))).unwrap();
        assert_eq!(l, json!({"jsonrpc": "2.0", "id": "x", "result": null}));
        let e = RpcError::not_admin();
        let l: Value = serde_json::from_str(&response_line(&Value::Null, &Err(e))).unwrap();
        assert_eq!(
            l,
            json!({"jsonrpc": "2.0", "id": null, "error": {"code": -32018,
                "message": "this method is for root and members of auth.admin_groups",
                "data": {"reason": "not_admin"}}})
        );
        assert!(notification_line("m", &json!({})).ends_with("}\n"));
    }

    #[test]
    fn notifications_and_daemon_requests_are_typed() {
        let status = json!({"script_id": "s", "state": "running", "calls": 1, "failures": 0,
                            "elapsed_ms": 5, "progress": {"done": 1, "total": 4, "message": "m"}});
        let n = Notification::parse("script.progress", status.clone()).unwrap();
        assert_eq!((n.method(), n.params()), ("script.progress", status));
        assert!(Notification::parse("script.nope", json!({})).is_err());
        let call =
            json!({"script_id": "s", "run_id": "r", "call_id": "1", "tool": "t", "arguments": {}});
        assert!(matches!(
            DaemonRequest::parse("tool.call", call),
            Ok(DaemonRequest::ToolCall(c)) if c.tool == "t"
        ));
        let e = DaemonRequest::parse("script.start", json!({})).unwrap_err();
        assert_eq!(e.code, code::METHOD_NOT_FOUND);
        let listed = json!({"scripts": [{"script_id": "s", "state": "running", "calls": 3,
            "failures": 0, "elapsed_ms": 900, "progress": null, "run_id": "r", "peer_uid": 1000,
            "uid": 1000, "unit": null, "age_ms": 900, "resources": {"source": "proc",
            "memory_bytes": 1, "memory_peak_bytes": null, "cpu_usec": 2, "tasks": 1}}]});
        let l: AdminList = serde_json::from_value(listed.clone()).unwrap();
        assert_eq!(serde_json::to_value(&l).unwrap(), listed);
    }

    #[test]
    fn script_requests_are_bounded_and_lenient() {
        use script::*;
        assert_eq!(
            parse_request(br#"{"id": 1, "op": "call", "tool": "t"}"#),
            Ok(Request::Call {
                id: 1.into(),
                tool: "t".into(),
                args: json!({})
            })
        );
        assert_eq!(
            parse_request(br#"{"id": 1, "op": "call", "tool": 5, "args": null}"#),
            Ok(Request::Call {
                id: 1.into(),
                tool: String::new(),
                args: Value::Null
            })
        );
        let long = "x".repeat(MAX_NAME_BYTES + 10);
        let line = serde_json::to_vec(&json!({"op": "call", "tool": long})).unwrap();
        let Ok(Request::Call { tool, .. }) = parse_request(&line) else {
            panic!()
        };
        assert_eq!(tool, format!("{} …", &long[..MAX_NAME_BYTES]));
        let many = json!({"id": 2, "op": "call_many", "tool": "t", "args_list": vec![json!({}); MAX_BATCH + 1]});
        let e = parse_request(&serde_json::to_vec(&many).unwrap()).unwrap_err();
        assert_eq!(
            (e.id, e.code),
            (2.into(), script::ToolErrorCode::InvalidArguments)
        );
        assert_eq!(
            parse_request(br#"{"op": "progress", "done": "x", "total": 9}"#),
            Ok(Request::Progress(Progress {
                done: 0,
                total: 9,
                message: String::new()
            }))
        );
        assert_eq!(
            parse_request(br#"{"id": 7, "op": "fly"}"#).unwrap_err(),
            BadRequest {
                id: 7.into(),
                code: script::ToolErrorCode::InvalidRequest,
                message: "unknown op; use agent_tools".into()
            }
        );
        assert_eq!(
            parse_request(b"[]").unwrap_err().message,
            "not a JSON object"
        );
        assert_eq!(framing::clip("éé", 3), "é…");
    }

    /// Every doc example of a wire type that is complete JSON (no `…` outside
    /// strings) is parsed back into the type it documents: the examples cannot
    /// drift from the types.
    #[test]
    fn doc_examples_parse_as_their_types() {
        fn check<T: serde::de::DeserializeOwned>(json: &str) -> Result<(), String> {
            serde_json::from_str::<T>(json)
                .map(|_| ())
                .map_err(|e| e.to_string())
        }
        type Check = fn(&str) -> Result<(), String>;
        let checks: &[(&str, Check)] = &[
            ("RpcError", check::<RpcError>),
            ("StartParams", check::<StartParams>),
            ("ScriptRef", check::<ScriptRef>),
            ("TokenParam", check::<TokenParam>),
            ("Started", check::<Started>),
            ("Progress", check::<Progress>),
            ("ScriptStatus", check::<ScriptStatus>),
            ("Revoked", check::<Revoked>),
            ("Described", check::<Described>),
            ("DaemonInfo", check::<DaemonInfo>),
            ("AdminList", check::<AdminList>),
            ("Resources", check::<Resources>),
            ("CallsParams", check::<CallsParams>),
            ("CallsPage", check::<CallsPage>),
            ("PruneParams", check::<PruneParams>),
            ("Pruned", check::<Pruned>),
            ("ToolResult", check::<ToolResult>),
            ("ApprovalAnswer", check::<ApprovalAnswer>),
            ("ScriptResult", check::<ScriptResult>),
        ];
        let src = include_str!("mod.rs");
        let mut checked = Vec::new();
        let mut lines = src.lines().map(str::trim);
        let mut example: Option<String> = None;
        while let Some(l) = lines.next() {
            if l == "/// ```json" {
                let mut text = String::new();
                for l in lines.by_ref() {
                    if l == "/// ```" {
                        break;
                    }
                    text.push_str(l.trim_start_matches("///"));
                    text.push('\n');
                }
                example = Some(text);
            } else if let Some(rest) = l.strip_prefix("pub struct ") {
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                let (Some(text), Some((_, f))) =
                    (example.take(), checks.iter().find(|(n, _)| *n == name))
                else {
                    continue;
                };
                if serde_json::from_str::<Value>(&text).is_err() {
                    continue; // an abridged example
                }
                f(&text).unwrap_or_else(|e| panic!("{name}: {e}\n{text}"));
                checked.push(name);
            } else if !l.starts_with("///") && !l.starts_with("#[") {
                example = None;
            }
        }
        for must in [
            "StartParams",
            "Started",
            "ScriptStatus",
            "DaemonInfo",
            "AdminList",
            "CallsPage",
            "Pruned",
        ] {
            assert!(checked.iter().any(|c| c == must), "{must}: {checked:?}");
        }
    }

    fn result(status: Status, output: &str, error: Option<&str>) -> ScriptResult {
        ScriptResult {
            script_id: "x".into(),
            run_id: "r".into(),
            status,
            exit_code: None,
            calls: 500,
            failures: 1,
            duration_ms: 3120,
            details_dir: ".agent/scripts/x".into(),
            output: output.into(),
            output_truncated: false,
            error: error.map(str::to_string),
            text: String::new(),
            memory_peak_bytes: None,
            cpu_usec: None,
            backend_notes: vec![],
            record_incomplete: vec![],
            pre_made: None,
        }
    }

    #[test]
    fn result_text_has_summary_output_and_error_tail() {
        let t = result(Status::Ok, "hello\n", None).with_text(None).text;
        assert_eq!(
            t,
            "run_script ok: 500 calls, 1 failed, 3.1 s, details in .agent/scripts/x\nhello\n"
        );
        let t = result(Status::Error, "partial", Some("Traceback…\nValueError: x"))
            .with_text(None)
            .text;
        assert_eq!(
            t,
            "run_script error: 500 calls, 1 failed, 3.1 s, details in .agent/scripts/x\npartial\nerror: Traceback…\nValueError: x\n"
        );
        let t = result(Status::Ok, "abc", None)
            .with_text(Some("[cut]"))
            .text;
        assert!(t.ends_with("\nabc\n[cut]\n"), "{t}");
    }
}
