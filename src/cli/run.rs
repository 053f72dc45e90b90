//! `scriptgate run | tools | describe`: a small, complete engine over real MCP
//! servers. It builds the run's snapshot from the servers' tool lists, mints the
//! token, and serves the daemon's `tool.call` and `approval.request` by calling the
//! servers and asking on the terminal. The daemon is the system one (over its
//! socket) or, when none answers, an embedded one in this process: same sandbox,
//! policy, limits and artifacts.

use crate::config::{BackendChoice, Config};
use crate::daemon::{Access, Daemon, Peer};
use crate::engine::{BoxFuture, EngineLink, LinkError};
use crate::mcp::{self, ServerSpec};
use crate::protocol::{self, RpcError, ScriptRef, ScriptResult, StartParams, Status, ToolResult};
use crate::token::{ToolClass, ToolSpec};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub const DEFAULT_SOCKET: &str = "/run/scriptgate/scriptgate.sock";

/// Exit statuses of `scriptgate run` (documented in scriptgate(1)).
pub mod exit {
    pub const OK: u8 = 0;
    pub const ERROR: u8 = 1;
    pub const USAGE: u8 = 2;
    pub const TIMEOUT: u8 = 3;
    pub const CANCELLED: u8 = 4;
    pub const OOM: u8 = 5;
    pub const LIMIT: u8 = 6;
    pub const INTERRUPTED: u8 = 7;
    pub const APPROVAL_DENIED: u8 = 8;
    pub const REFUSED: u8 = 9;
    pub const SETUP: u8 = 10;
    /// Admin commands: the daemon does not answer on its socket.
    pub const DAEMON_DOWN: u8 = 11;
    /// Admin commands: not root, not in auth.admin_groups (or not allowed to connect).
    pub const NOT_PERMITTED: u8 = 12;
    /// Admin commands: no such script.
    pub const NOT_FOUND: u8 = 13;
}

pub fn exit_for(status: Status) -> u8 {
    match status {
        Status::Ok => exit::OK,
        Status::Error | Status::Running => exit::ERROR,
        Status::Timeout => exit::TIMEOUT,
        Status::Cancelled => exit::CANCELLED,
        Status::Oom => exit::OOM,
        Status::Limit => exit::LIMIT,
        Status::Interrupted => exit::INTERRUPTED,
    }
}

/// A failure before or around the script, with the exit status it maps to.
#[derive(Debug)]
pub struct Failure {
    pub code: u8,
    pub message: String,
}

impl Failure {
    fn setup(m: impl Into<String>) -> Self {
        Failure {
            code: exit::SETUP,
            message: m.into(),
        }
    }
    fn refused(e: &RpcError) -> Self {
        let code = if e.code == protocol::code::APPROVAL {
            exit::APPROVAL_DENIED
        } else {
            exit::REFUSED
        };
        let detail = e.data.as_ref().map(|d| format!(" {d}")).unwrap_or_default();
        Failure {
            code,
            message: format!("script refused: {} ({}){detail}", e.message, e.code),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    Yes,
    No,
    Ask,
}

/// The tools of the started MCP servers.
pub struct Tools {
    servers: Vec<Arc<mcp::Server>>,
    route: HashMap<String, (Arc<mcp::Server>, String)>,
    pub specs: Vec<ToolSpec>,
}

impl Tools {
    pub async fn start(
        specs: &[ServerSpec],
        roots: Vec<String>,
        overrides: &[(String, ToolClass)],
        call_timeout: Duration,
    ) -> Result<Tools, Failure> {
        if specs.is_empty() {
            return Err(Failure {
                code: exit::USAGE,
                message: "no MCP server: give at least one --mcp NAME=COMMAND".into(),
            });
        }
        let mut t = Tools {
            servers: vec![],
            route: HashMap::new(),
            specs: vec![],
        };
        for spec in specs {
            if t.servers.iter().any(|s| s.name == spec.name) {
                t.shutdown().await;
                return Err(Failure {
                    code: exit::USAGE,
                    message: format!("--mcp {}: the name is used twice", spec.name),
                });
            }
            let server = match mcp::Server::start(spec, roots.clone(), call_timeout).await {
                Ok(s) => Arc::new(s),
                Err(e) => {
                    t.shutdown().await;
                    return Err(Failure::setup(e.to_string()));
                }
            };
            t.servers.push(server.clone());
            let listed = match server.list_tools().await {
                Ok(l) => l,
                Err(e) => {
                    t.shutdown().await;
                    return Err(Failure::setup(e.to_string()));
                }
            };
            for tool in listed {
                let Some(name) = tool.get("name").and_then(Value::as_str) else {
                    continue;
                };
                let full = format!("{}__{name}", spec.name);
                let class = overrides
                    .iter()
                    .find(|(n, _)| *n == full)
                    .map(|(_, c)| *c)
                    .unwrap_or_else(|| mcp::class_of(&tool));
                t.route
                    .insert(full.clone(), (server.clone(), name.to_string()));
                let (tool_spec, warning) = mcp::tool_spec(full, &tool, class);
                if let Some(w) = warning {
                    eprintln!("scriptgate: warning: {w}");
                }
                t.specs.push(tool_spec);
            }
        }
        for (n, _) in overrides {
            if !t.route.contains_key(n) {
                t.shutdown().await;
                return Err(Failure {
                    code: exit::USAGE,
                    message: format!("--class {n}: no such tool"),
                });
            }
        }
        Ok(t)
    }

    pub async fn call(&self, full: &str, args: Value) -> Result<ToolResult, LinkError> {
        let (server, name) = self
            .route
            .get(full)
            .ok_or_else(|| LinkError::Answered(format!("no tool {full}")))?;
        server.call(name, args).await
    }

    pub async fn shutdown(&self) {
        for s in &self.servers {
            s.shutdown().await;
        }
    }

    pub fn server_pids(&self) -> Vec<i32> {
        self.servers.iter().filter_map(|s| s.pid()).collect()
    }
}

/// The engine side of a run: tool calls, approval, progress display.
pub struct CliEngine {
    pub tools: Tools,
    answer: Answer,
    progress_tty: bool,
    progress_shown: Mutex<bool>,
}

impl CliEngine {
    async fn tool_call(&self, params: &Value) -> Result<ToolResult, LinkError> {
        let tool = params.get("tool").and_then(Value::as_str).unwrap_or("");
        self.tools
            .call(tool, params.get("arguments").cloned().unwrap_or(json!({})))
            .await
    }

    fn approve(&self, p: &Value) -> bool {
        let tools: Vec<String> = p["tools"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|t| {
                format!(
                    "{} ({})",
                    t["name"].as_str().unwrap_or(""),
                    t["class"].as_str().unwrap_or("")
                )
            })
            .collect();
        match self.answer {
            Answer::Yes => return true,
            Answer::No => {
                eprintln!(
                    "scriptgate: approval denied (--no) for write tools {}",
                    tools.join(", ")
                );
                return false;
            }
            Answer::Ask => {}
        }
        let tty = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/tty");
        let Ok(mut tty) = tty else {
            eprintln!("scriptgate: the script declares write tools ({}) and needs approval, but there is no terminal to ask on; denied. Pass --yes to allow them, or --no to deny without asking.", tools.join(", "));
            return false;
        };
        self.clear_progress();
        let code: String = p["code"]
            .as_str()
            .unwrap_or("")
            .lines()
            .enumerate()
            .map(|(i, l)| format!("{:4} | {l}\n", i + 1))
            .collect();
        let _ = write!(
            tty,
            "\nscriptgate: this script asks to use write tools.\n  description: {}\n  write tools: {}\n--- script ---\n{code}--------------\nAllow once? [y/N] ",
            p["description"].as_str().unwrap_or(""),
            tools.join(", ")
        );
        let _ = tty.flush();
        let mut line = String::new();
        let _ = std::io::BufRead::read_line(&mut std::io::BufReader::new(&mut tty), &mut line);
        let yes = matches!(line.trim().to_ascii_lowercase().as_str(), "y" | "yes");
        let _ = writeln!(tty, "{}", if yes { "allowed once" } else { "denied" });
        yes
    }

    fn show_progress(&self, p: &Value) {
        let calls = p["calls"].as_u64().unwrap_or(0);
        let failures = p["failures"].as_u64().unwrap_or(0);
        let (done, total, msg) = match p.get("progress").filter(|v| !v.is_null()) {
            Some(pr) => (
                pr["done"].as_i64().unwrap_or(0),
                pr["total"].as_i64().unwrap_or(0),
                pr["message"].as_str().unwrap_or("").to_string(),
            ),
            None => (0, 0, String::new()),
        };
        let mut err = std::io::stderr().lock();
        if self.progress_tty {
            let bar = if total > 0 {
                let filled = ((done.clamp(0, total) * 30) / total) as usize;
                format!(
                    "[{}{}] {done}/{total} ",
                    "#".repeat(filled),
                    ".".repeat(30 - filled)
                )
            } else {
                String::new()
            };
            let _ = write!(err, "\r\x1b[K{bar}{msg} ({calls} calls, {failures} failed)");
            *self.progress_shown.lock().unwrap() = true;
        } else if total > 0 {
            let _ = writeln!(
                err,
                "progress: {done}/{total} {msg} ({calls} calls, {failures} failed)"
            );
        } else {
            let _ = writeln!(err, "progress: {calls} calls, {failures} failed");
        }
    }

    fn clear_progress(&self) {
        let mut shown = self.progress_shown.lock().unwrap();
        if *shown {
            eprint!("\r\x1b[K");
            *shown = false;
        }
    }
}

/// The embedded daemon's view of the CLI engine.
struct Embedded(Arc<CliEngine>);

impl EngineLink for Embedded {
    fn id(&self) -> u64 {
        1
    }
    fn tool_call(&self, params: Value) -> BoxFuture<'_, Result<ToolResult, LinkError>> {
        Box::pin(async move { self.0.tool_call(&params).await })
    }
    fn approval(
        &self,
        params: Value,
        _timeout: Duration,
    ) -> BoxFuture<'_, Result<bool, LinkError>> {
        let e = self.0.clone();
        Box::pin(async move {
            tokio::task::spawn_blocking(move || e.approve(&params))
                .await
                .map_err(|_| LinkError::Disconnected)
        })
    }
    fn notify(&self, method: &str, params: Value) {
        if method == "script.progress" {
            self.0.show_progress(&params);
        }
    }
}

pub struct RunOptions {
    pub script: PathBuf,
    pub mcp: Vec<ServerSpec>,
    pub tools: Vec<String>,
    pub mode: String,
    pub read_only: bool,
    pub workspace: Option<PathBuf>,
    pub class: Vec<(String, ToolClass)>,
    pub answer: Answer,
    pub socket: Option<PathBuf>,
    pub embedded: bool,
    pub timeout: Option<u64>,
    pub max_calls: Option<u64>,
    pub description: Option<String>,
    pub json: bool,
    pub config: Option<PathBuf>,
    pub call_timeout: u64,
}

fn home_state() -> PathBuf {
    if let Some(x) = std::env::var_os("XDG_STATE_HOME").filter(|v| !v.is_empty()) {
        return PathBuf::from(x).join("scriptgate");
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| "/tmp".into());
    home.join(".local/state/scriptgate")
}

fn is_root() -> bool {
    nix::unistd::Uid::effective().is_root()
}

/// The config the embedded daemon uses: the system file if readable (for limits,
/// python, sandbox), with state and workspace roots of its own.
fn embedded_config(path: Option<&Path>) -> Result<Config, Failure> {
    let mut cfg = match path {
        Some(p) => Config::load(p, true).map_err(|e| Failure::setup(e.to_string()))?,
        None => Config::load(Path::new(crate::config::DEFAULT_PATH), false).unwrap_or_default(),
    };
    cfg.state.dir = if is_root() {
        PathBuf::from("/var/lib/scriptgate/cli")
    } else {
        home_state()
    };
    if cfg.sandbox.backend != BackendChoice::Rlimit {
        cfg.sandbox.backend = BackendChoice::Auto;
    }
    Ok(cfg)
}

/// The uid a script of this user runs as, and its name.
fn script_identity(cfg: &Config) -> Result<crate::sys::Identity, Failure> {
    let me = nix::unistd::getuid().as_raw();
    let gid = nix::unistd::getgid().as_raw();
    crate::sys::resolve_run_as(me, gid, &cfg.sandbox.run_as)
        .map_err(|e| Failure::setup(e.to_string()))
}

/// Where fresh workspaces go with the embedded daemon.
fn embedded_workspaces() -> PathBuf {
    if is_root() {
        PathBuf::from("/var/lib/scriptgate/workspaces")
    } else {
        home_state().join("workspaces")
    }
}

/// Create a fresh workspace under `fresh_base`, or check the given one is usable
/// by the script's uid.
fn prepare_workspace(
    given: Option<&Path>,
    fresh_base: &Path,
    cfg: &Config,
    read_only: bool,
) -> Result<PathBuf, Failure> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let id = script_identity(cfg)?;
    let who = format!(
        "uid {}{}",
        id.uid,
        if is_root() {
            format!(
                " ({}; scripts of root run as sandbox.run_as)",
                cfg.sandbox.run_as
            )
        } else {
            String::new()
        }
    );
    let ws = match given {
        Some(p) => std::fs::canonicalize(p)
            .map_err(|e| Failure::setup(format!("workspace {}: {e}", p.display())))?,
        None => {
            let base = fresh_base;
            let cannot = |e: std::io::Error| {
                Failure::setup(format!(
                    "cannot create a workspace under {}: {e}; pass --workspace DIR (under the daemon's workspace.roots), or --embedded",
                    base.display()
                ))
            };
            std::fs::create_dir_all(base).map_err(cannot)?;
            let stamp = crate::broker::rfc3339_now().replace([':', '.'], "-");
            let mut r = [0u8; 3];
            let _ = getrandom::getrandom(&mut r);
            let ws = base.join(format!("run-{stamp}-{:02x}{:02x}{:02x}", r[0], r[1], r[2]));
            std::fs::create_dir(&ws).map_err(cannot)?;
            if is_root() {
                let _ = std::fs::set_permissions(base, std::fs::Permissions::from_mode(0o755));
                nix::unistd::chown(
                    &ws,
                    Some(nix::unistd::Uid::from_raw(id.uid)),
                    Some(nix::unistd::Gid::from_raw(id.gid)),
                )
                .map_err(|e| Failure::setup(format!("chown {}: {e}", ws.display())))?;
            }
            eprintln!("scriptgate: workspace {}", ws.display());
            ws
        }
    };
    let meta = std::fs::metadata(&ws)
        .map_err(|e| Failure::setup(format!("workspace {}: {e}", ws.display())))?;
    if !meta.is_dir() {
        return Err(Failure::setup(format!(
            "workspace {} is not a directory",
            ws.display()
        )));
    }
    // Every ancestor must let the script's uid through; the workspace must be its to write.
    for dir in ws.ancestors() {
        let Ok(m) = std::fs::metadata(dir) else {
            continue;
        };
        let mode = m.permissions().mode();
        let through = if m.uid() == id.uid {
            mode & 0o100 != 0
        } else if m.gid() == id.gid {
            mode & 0o010 != 0
        } else {
            mode & 0o001 != 0
        };
        if !through {
            return Err(Failure::setup(format!(
                "workspace {} is unusable: {} cannot enter {} (mode {:o}); pick a --workspace that {who} can reach",
                ws.display(), who, dir.display(), mode & 0o7777
            )));
        }
    }
    let writable = meta.uid() == id.uid || meta.permissions().mode() & 0o002 != 0;
    if !read_only && !writable {
        return Err(Failure::setup(format!(
            "workspace {} is owned by uid {} and not writable by {who}; chown it, or use --read-only, or leave out --workspace for a fresh one",
            ws.display(),
            meta.uid()
        )));
    }
    Ok(ws)
}

fn snapshot(tools: &Tools, ws: &Path, o: &RunOptions) -> Value {
    let mut limits = serde_json::Map::new();
    if let Some(t) = o.timeout {
        limits.insert("timeout_s".into(), json!(t));
    }
    if let Some(m) = o.max_calls {
        limits.insert("max_calls".into(), json!(m));
    }
    json!({
        "workspace": ws, "read_only": o.read_only, "permission_mode": o.mode,
        "session_allowed": [], "tools": tools.specs, "limits": limits,
    })
}

fn read_script(p: &Path) -> Result<String, Failure> {
    let r = if p.as_os_str() == "-" {
        std::io::read_to_string(std::io::stdin())
    } else {
        std::fs::read_to_string(p)
    };
    r.map_err(|e| Failure {
        code: exit::USAGE,
        message: format!("script {}: {e}", p.display()),
    })
}

enum Target {
    Embedded,
    Socket(PathBuf),
}

fn pick_target(o: &RunOptions) -> Target {
    if o.embedded {
        return Target::Embedded;
    }
    if let Some(s) = &o.socket {
        return Target::Socket(s.clone());
    }
    if std::os::unix::net::UnixStream::connect(DEFAULT_SOCKET).is_ok() {
        return Target::Socket(DEFAULT_SOCKET.into());
    }
    Target::Embedded
}

pub async fn run(o: RunOptions) -> Result<ScriptResult, Failure> {
    let code = read_script(&o.script)?;
    let target = pick_target(&o);
    let cfg = match &target {
        Target::Embedded => embedded_config(o.config.as_deref())?,
        Target::Socket(_) => Config::load(
            o.config
                .as_deref()
                .unwrap_or(Path::new(crate::config::DEFAULT_PATH)),
            o.config.is_some(),
        )
        .map_err(|e| Failure::setup(e.to_string()))?,
    };
    // A fresh workspace goes under the daemon's first root (socket), or ours.
    let fresh_base = match &target {
        Target::Embedded => embedded_workspaces(),
        Target::Socket(s) => cfg.workspace.roots.first().cloned().ok_or_else(|| {
            Failure::setup(format!(
                "the daemon at {} has no workspace.roots",
                s.display()
            ))
        })?,
    };
    let ws = prepare_workspace(o.workspace.as_deref(), &fresh_base, &cfg, o.read_only)?;
    let tools = Tools::start(
        &o.mcp,
        vec![ws.display().to_string()],
        &o.class,
        Duration::from_secs(o.call_timeout),
    )
    .await?;
    let engine = Arc::new(CliEngine {
        tools,
        answer: o.answer,
        progress_tty: std::io::stderr().is_terminal(),
        progress_shown: Mutex::new(false),
    });
    let snap = snapshot(&engine.tools, &ws, &o);
    let params = StartParams {
        token: String::new(),
        code,
        tools: o.tools.clone(),
        description: o
            .description
            .clone()
            .unwrap_or_else(|| format!("scriptgate run {}", o.script.display())),
    };
    let result = match target {
        Target::Embedded => run_embedded(cfg, snap, params, &o, engine.clone()).await,
        Target::Socket(path) => run_socket(&path, &cfg, snap, params, engine.clone()).await,
    };
    engine.clear_progress();
    engine.tools.shutdown().await;
    result
}

fn mint(key: &[u8], snap: &Value) -> Result<String, Failure> {
    let mut r = [0u8; 6];
    let _ = getrandom::getrandom(&mut r);
    let run_id = format!(
        "cli-{}",
        r.iter().map(|b| format!("{b:02x}")).collect::<String>()
    );
    let runner = format!("scriptgate-cli uid {}", nix::unistd::getuid());
    crate::token::mint(key, &run_id, Some(&runner), snap, 24 * 3600)
        .map_err(|e| Failure::setup(e.message))
}

async fn run_embedded(
    mut cfg: Config,
    snap: Value,
    mut params: StartParams,
    o: &RunOptions,
    engine: Arc<CliEngine>,
) -> Result<ScriptResult, Failure> {
    // The embedded daemon's one root is the workspace's parent: a workspace lies
    // below its root, never is one (the path is canonical, so no symlink is in it).
    let ws = PathBuf::from(snap["workspace"].as_str().unwrap_or("/"));
    cfg.workspace.roots = vec![ws.parent().unwrap_or(&ws).to_path_buf()];
    // The user at the terminal is the sysadmin of an embedded daemon: their limits stand.
    if let Some(t) = o.timeout {
        cfg.scripts.timeout_s = t;
    }
    if let Some(m) = o.max_calls {
        cfg.scripts.max_calls = m;
    }
    let mut key = vec![0u8; 32];
    getrandom::getrandom(&mut key).map_err(|e| Failure::setup(format!("random key: {e}")))?;
    params.token = mint(&key, &snap)?;
    let (daemon, _) = Daemon::new(cfg, key)
        .await
        .map_err(|e| Failure::setup(format!("embedded daemon: {e}")))?;
    let me = Peer {
        uid: nix::unistd::getuid().as_raw(),
        gid: nix::unistd::getgid().as_raw(),
        pid: Some(std::process::id() as i32),
        admin: false,
    };
    let link: Arc<dyn EngineLink> = Arc::new(Embedded(engine));
    let started = daemon
        .start(me, link, params)
        .await
        .map_err(|e| Failure::refused(&e))?;
    let script_id = started["script_id"].as_str().unwrap_or("").to_string();
    let r = daemon
        .wait(
            Access::Conn(1),
            ScriptRef {
                script_id,
                timeout_s: None,
                token: None,
            },
        )
        .await
        .map_err(|e| Failure::setup(e.message))?;
    serde_json::from_value(r).map_err(|e| Failure::setup(format!("result: {e}")))
}

/// Act as an engine over the system daemon's socket.
async fn run_socket(
    path: &Path,
    cfg: &Config,
    snap: Value,
    mut params: StartParams,
    engine: Arc<CliEngine>,
) -> Result<ScriptResult, Failure> {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
    let key = cfg.read_key().map_err(|e| {
        Failure::setup(format!("the daemon at {} needs tokens signed with its key, and {e}; run as root or a member of the key's group, or pass --embedded", path.display()))
    })?;
    params.token = mint(&key, &snap)?;
    let stream = tokio::net::UnixStream::connect(path)
        .await
        .map_err(|e| Failure::setup(format!("{}: {e}", path.display())))?;
    let (read, mut write) = stream.into_split();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    tokio::spawn(async move {
        while let Some(l) = rx.recv().await {
            if write.write_all(l.as_bytes()).await.is_err() {
                break;
            }
        }
    });
    type Waiters = Arc<Mutex<HashMap<u64, tokio::sync::oneshot::Sender<Result<Value, RpcError>>>>>;
    let waiters: Waiters = Default::default();
    let (w2, tx2, e2) = (waiters.clone(), tx.clone(), engine.clone());
    let reader = tokio::spawn(async move {
        let mut lines = tokio::io::BufReader::new(read).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            match protocol::parse_line(line.as_bytes()) {
                Ok(protocol::Incoming::Response { id, result }) => {
                    if let Some(s) = id.as_u64().and_then(|i| w2.lock().unwrap().remove(&i)) {
                        let _ = s.send(result);
                    }
                }
                Ok(protocol::Incoming::Request { id, method, params }) => {
                    let (e, tx) = (e2.clone(), tx2.clone());
                    tokio::spawn(async move {
                        let r = match method.as_str() {
                            "tool.call" => e
                                .tool_call(&params)
                                .await
                                .map(|r| json!(r))
                                .map_err(|err| RpcError::new(-32000, err.to_string())),
                            "approval.request" => {
                                let e = e.clone();
                                let ok = tokio::task::spawn_blocking(move || e.approve(&params))
                                    .await
                                    .unwrap_or(false);
                                Ok(json!({"decision": if ok { "allow_once" } else { "deny" }}))
                            }
                            _ => Err(RpcError::new(
                                protocol::code::METHOD_NOT_FOUND,
                                "not an engine method",
                            )),
                        };
                        let _ = tx.send(protocol::response_line(&id, &r));
                    });
                }
                Ok(protocol::Incoming::Notification { method, params })
                    if method == "script.progress" =>
                {
                    e2.show_progress(&params)
                }
                _ => {}
            }
        }
        w2.lock().unwrap().clear();
    });
    let call = |id: u64, method: &str, p: Value| {
        let (stx, srx) = tokio::sync::oneshot::channel();
        waiters.lock().unwrap().insert(id, stx);
        let _ = tx.send(protocol::request_line(id, method, &p));
        srx
    };
    let started = call(1, "script.start", json!({"token": params.token, "code": params.code, "tools": params.tools, "description": params.description}))
        .await
        .map_err(|_| Failure::setup("the daemon closed the connection"))?
        .map_err(|e| Failure::refused(&e))?;
    let r = call(2, "script.wait", json!({"script_id": started["script_id"]}))
        .await
        .map_err(|_| Failure::setup("the daemon closed the connection"))?
        .map_err(|e| Failure::setup(e.message))?;
    reader.abort();
    serde_json::from_value(r).map_err(|e| Failure::setup(format!("result: {e}")))
}

/// `scriptgate tools`: NAME, CLASS, Python signature.
pub async fn list_tools(
    mcp: &[ServerSpec],
    class: &[(String, ToolClass)],
    json_out: bool,
) -> Result<String, Failure> {
    let tools = Tools::start(mcp, vec![], class, Duration::from_secs(60)).await?;
    let out = if json_out {
        let v: Vec<Value> = tools.specs.iter().map(|t| json!({"name": t.name, "class": t.class, "signature": crate::describe::signature(t), "input_schema": t.input_schema})).collect();
        serde_json::to_string_pretty(&v).unwrap_or_default() + "\n"
    } else {
        let w = tools
            .specs
            .iter()
            .map(|t| t.name.len())
            .max()
            .unwrap_or(4)
            .max(4);
        let mut s = format!("{:w$}  {:11}  SIGNATURE\n", "NAME", "CLASS");
        for t in &tools.specs {
            s.push_str(&format!(
                "{:w$}  {:11}  {}\n",
                t.name,
                t.class.as_str(),
                crate::describe::signature(t)
            ));
        }
        s
    };
    tools.shutdown().await;
    Ok(out)
}

/// `scriptgate describe`: the run_script description for these servers.
pub async fn describe(
    mcp: &[ServerSpec],
    class: &[(String, ToolClass)],
    mode: &str,
    read_only: bool,
    config: Option<&Path>,
) -> Result<String, Failure> {
    let cfg = embedded_config(config)?;
    let tools = Tools::start(mcp, vec![], class, Duration::from_secs(60)).await?;
    let snap = json!({"workspace": "/", "read_only": read_only, "permission_mode": mode, "tools": tools.specs});
    tools.shutdown().await;
    let snap = crate::token::parse_snapshot(snap).map_err(|e| Failure::setup(e.message))?;
    let limits = crate::policy::Limits::effective(&cfg.scripts, &snap.limits);
    Ok(crate::describe::describe(
        &snap,
        &limits,
        cfg.scripts.return_max_chars,
    ))
}
