//! `scriptgate run | tools | describe`: a small, complete engine over real MCP
//! servers. It builds the run's snapshot from the servers' tool lists, mints the
//! token, and serves the daemon's `tool.call` and `approval.request` by calling the
//! servers and asking on the terminal. The daemon is the system one (over its
//! socket) or, only when none is installed or when asked, an embedded one in
//! this process (`super::target`): same sandbox, policy, limits and artifacts.

use super::args::{ApprovalChoice, RunCmd};
use super::exit::Failure;
use crate::cli::mcp::{self, ServerSpec};
use crate::config::{BackendChoice, Config};
use crate::daemon::{Access, Daemon, PeerGroups};
use crate::policy::admit::LeftOut;
use crate::protocol::rpc::BoxFuture;
use crate::protocol::rpc::{self, Bounds, CallError};
use crate::protocol::snapshot::{PermissionMode, Snapshot, SnapshotLimits, ToolClass, ToolSpec};
use crate::protocol::{
    ApprovalAnswer, ApprovalRequest, DaemonRequest, Decision, Notification, RpcError, ScriptRef,
    ScriptResult, ScriptStatus, StartParams, Started, ToolCall, ToolResult,
};
use crate::script::engine::{EngineLink, LinkError};
use crate::text::{numbered_source, Untrusted};
use serde_json::Value;
use std::collections::HashMap;
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The tools of the started MCP servers.
pub struct Tools {
    servers: Vec<Arc<mcp::Server>>,
    overrides: Vec<(String, ToolClass)>,
    catalog: std::sync::RwLock<Catalog>,
    /// One refresh at a time, so that an older listing never replaces a newer one.
    refreshing: tokio::sync::Mutex<()>,
}

/// What the servers' tool lists say: each tool's spec, where to call it, and
/// the tools listed that are not offered, with why.
#[derive(Default)]
struct Catalog {
    route: HashMap<String, (Arc<mcp::Server>, String)>,
    specs: Vec<ToolSpec>,
    left_out: LeftOut,
}

impl Tools {
    pub async fn start(
        specs: &[ServerSpec],
        roots: Vec<String>,
        overrides: &[(String, ToolClass)],
        call_timeout: Duration,
    ) -> Result<Tools, Failure> {
        if specs.is_empty() {
            return Err(Failure::usage(
                "no MCP server: give at least one --mcp NAME=COMMAND",
            ));
        }
        let mut t = Tools {
            servers: vec![],
            overrides: overrides.to_vec(),
            catalog: Default::default(),
            refreshing: Default::default(),
        };
        for spec in specs {
            if t.servers.iter().any(|s| s.name == spec.name) {
                t.shutdown().await;
                return Err(Failure::usage(format!(
                    "--mcp {}: the name is used twice",
                    spec.name
                )));
            }
            match mcp::Server::start(spec, roots.clone(), call_timeout).await {
                Ok(s) => t.servers.push(Arc::new(s)),
                Err(e) => {
                    t.shutdown().await;
                    return Err(Failure::setup(e.to_string()));
                }
            }
        }
        if let Err(e) = t.refresh().await {
            t.shutdown().await;
            return Err(e);
        }
        for (n, _) in overrides {
            if t.catalog().route.contains_key(n) {
                continue;
            }
            let not_offered = t
                .catalog()
                .left_out
                .named
                .iter()
                .find(|(name, _)| name == n)
                .map(|(_, why)| format!("--class {n}: that tool is not offered: {why}"));
            t.shutdown().await;
            return Err(Failure::usage(
                not_offered.unwrap_or_else(|| format!("--class {n}: no such tool")),
            ));
        }
        Ok(t)
    }

    fn catalog(&self) -> std::sync::RwLockReadGuard<'_, Catalog> {
        self.catalog.read().unwrap_or_else(|p| p.into_inner())
    }

    /// List every server's tools again (at start, and when a server says its list
    /// changed). A tool a server lists that cannot be offered (`policy::admit`)
    /// is left out with a warning, and the others are offered; a list that
    /// cannot be read, is over its bounds, or that the daemon would refuse
    /// is not taken at all: the one before stays in force (`scriptgate mcp`
    /// goes on serving it), and the error says why.
    pub async fn refresh(&self) -> Result<(), Failure> {
        let _one = self.refreshing.lock().await;
        let mut c = Catalog::default();
        for server in &self.servers {
            let listing = server
                .list_tools()
                .await
                .map_err(|e| Failure::setup(e.to_string()))?;
            warn_left_out(&server.name, &listing.left_out);
            for tool in listing.tools {
                let Some(name) = tool.get("name").and_then(Value::as_str) else {
                    continue;
                };
                let full = format!("{}__{name}", server.name);
                let class = self
                    .overrides
                    .iter()
                    .find(|(n, _)| *n == full)
                    .map(|(_, c)| *c)
                    .unwrap_or_else(|| mcp::class_of(&tool));
                c.route
                    .insert(full.clone(), (server.clone(), name.to_string()));
                let (tool_spec, warning) = mcp::tool_spec(full, &tool, class);
                if let Some(w) = warning {
                    // It names the server's tool and quotes its schema.
                    eprintln!("scriptgate: warning: {}", Untrusted::line(&w));
                }
                c.specs.push(tool_spec);
            }
            c.left_out.append(listing.left_out);
        }
        // Checked as the daemon checks a token's snapshot: a list every run
        // would be refused with is not taken.
        check_as_a_snapshot(&c.specs).map_err(|e| {
            Failure::setup(format!(
                "the MCP servers' tools would make a snapshot the daemon refuses: {e}"
            ))
        })?;
        *self.catalog.write().unwrap_or_else(|p| p.into_inner()) = c;
        Ok(())
    }

    /// The `describe` text (scriptgate-protocol(7) §7) for the tools offered,
    /// naming those left out too.
    pub fn describe(
        &self,
        cfg: &Config,
        mode: PermissionMode,
        read_only: bool,
        never: crate::policy::describe::NeverCallable,
    ) -> Result<String, Failure> {
        let c = self.catalog();
        describe_listing(cfg, &c.specs, &c.left_out, mode, read_only, never)
    }

    /// The tools the servers listed that are not offered, and why.
    pub fn left_out(&self) -> LeftOut {
        self.catalog().left_out.clone()
    }

    /// Every tool, as a snapshot lists it.
    pub fn specs(&self) -> Vec<ToolSpec> {
        self.catalog().specs.clone()
    }

    /// The servers, to watch their tool lists (`mcp::Server::tools_changed`).
    pub fn servers(&self) -> &[Arc<mcp::Server>] {
        &self.servers
    }

    pub async fn call(&self, full: &str, args: Value) -> Result<ToolResult, LinkError> {
        let (server, name) = self
            .catalog()
            .route
            .get(full)
            .cloned()
            .ok_or_else(|| LinkError::Answered(format!("no tool {full}")))?;
        server.call(&name, args).await
    }

    pub async fn shutdown(&self) {
        for s in &self.servers {
            s.shutdown().await;
        }
    }
}

/// A warning on stderr for each tool a server's list left out, its name
/// escaped (the server wrote it), and one for those beyond the ones named.
fn warn_left_out(server: &str, left_out: &LeftOut) {
    for (name, why) in &left_out.named {
        eprintln!(
            "scriptgate: warning: MCP server {server}: tool \"{}\" is not offered: {why}",
            crate::text::escape(name)
        );
    }
    if left_out.more > 0 {
        eprintln!(
            "scriptgate: warning: MCP server {server}: {} more of its tools are not offered (the first {} are named)",
            left_out.more,
            crate::policy::admit::MAX_LEFT_OUT_NAMED
        );
    }
}

/// `Ok` when a snapshot of these tools is one the daemon takes, and why not
/// otherwise: `parse_snapshot`'s verdict (names, duplicates, a schema for
/// every tool a script can call), given the tools without what it does not
/// read of them (it does not compile schemas, the policy does: see
/// `mcp::tool_spec`), so that no copy of the schemas is made.
fn check_as_a_snapshot(specs: &[ToolSpec]) -> Result<(), String> {
    let tools: Vec<Value> = specs
        .iter()
        .map(|t| {
            let mut v = serde_json::json!({"name": t.name, "class": t.class, "enabled": t.enabled});
            if t.input_schema.is_some() {
                v["input_schema"] = serde_json::json!({});
            }
            v
        })
        .collect();
    let snap = serde_json::json!({"workspace": "/", "permission_mode": "auto", "tools": tools});
    crate::protocol::snapshot::parse_snapshot(snap)
        .map(drop)
        .map_err(|e| e.message().to_string())
}

/// How a run asks for its one approval and shows its progress: the terminal
/// (`scriptgate run`) or an MCP client (`scriptgate mcp`).
pub trait RunUi: Send + Sync {
    /// The approval for the declared write tools; `true` allows them once.
    fn approve(self: Arc<Self>, p: ApprovalRequest) -> BoxFuture<'static, bool>;
    /// A `script.progress` notification.
    fn progress(&self, p: &ScriptStatus);
}

/// The engine side of a run: tool calls (the MCP servers), approval and progress
/// (its `RunUi`).
pub struct CliEngine {
    pub tools: Arc<Tools>,
    pub ui: Arc<dyn RunUi>,
}

impl CliEngine {
    async fn tool_call(&self, params: &ToolCall) -> Result<ToolResult, LinkError> {
        self.tools
            .call(&params.tool, params.arguments.clone())
            .await
    }

    async fn approve_async(&self, p: ApprovalRequest) -> Result<bool, LinkError> {
        Ok(self.ui.clone().approve(p).await)
    }

    fn show_progress(&self, p: &ScriptStatus) {
        self.ui.progress(p)
    }
}

/// `scriptgate run`'s UI: it asks on the terminal (or answers as `--yes`/`--no`
/// say) and draws progress on stderr. Everything it shows that the script, the
/// engine or a server wrote (the description, the tools' names, the script,
/// the progress message) is escaped (`crate::text`): what the person approves
/// is what runs, and no text can move the cursor, clear a line or set a title.
struct Terminal {
    answer: ApprovalChoice,
    progress_tty: bool,
    progress_shown: Mutex<bool>,
}

impl RunUi for Terminal {
    fn approve(self: Arc<Self>, p: ApprovalRequest) -> BoxFuture<'static, bool> {
        // Asking on the terminal must not stall the runtime.
        Box::pin(async move {
            tokio::task::spawn_blocking(move || self.ask(&p))
                .await
                .unwrap_or(false)
        })
    }

    fn progress(&self, p: &ScriptStatus) {
        self.show(p)
    }
}

impl Terminal {
    fn ask(&self, p: &ApprovalRequest) -> bool {
        let tools = tool_list(p);
        match self.answer {
            ApprovalChoice::Yes => return true,
            ApprovalChoice::No => {
                eprintln!("scriptgate: approval denied (--no) for write tools {tools}");
                return false;
            }
            ApprovalChoice::Ask => {}
        }
        let tty = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/tty");
        let Ok(mut tty) = tty else {
            eprintln!("scriptgate: the script declares write tools ({}) and needs approval, but there is no terminal to ask on; denied. Pass --yes to allow them, or --no to deny without asking.", tools);
            return false;
        };
        self.clear_progress();
        let _ = write!(tty, "{}", approval_prompt(p));
        let _ = tty.flush();
        let mut line = String::new();
        let _ = std::io::BufRead::read_line(&mut std::io::BufReader::new(&mut tty), &mut line);
        let yes = matches!(line.trim().to_ascii_lowercase().as_str(), "y" | "yes");
        let _ = writeln!(tty, "{}", if yes { "allowed once" } else { "denied" });
        yes
    }

    fn show(&self, p: &ScriptStatus) {
        let line = progress_text(p, self.progress_tty);
        let mut err = std::io::stderr().lock();
        if self.progress_tty {
            let _ = write!(err, "\r\x1b[K{line}");
            *self.progress_shown.lock().unwrap() = true;
        } else {
            let _ = writeln!(err, "{line}");
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

/// A `script.progress` as `scriptgate run` shows it on stderr, without a line
/// end: on a terminal a bar, otherwise a line (`progress: …`); the script's
/// message escaped on one line. The bar holds whatever counts the script gave
/// (any i64: its 30 cells are computed in i128).
fn progress_text(p: &ScriptStatus, tty: bool) -> String {
    let (calls, failures) = (p.calls, p.failures);
    let (done, total, msg) = match &p.progress {
        Some(pr) => (pr.done, pr.total, Untrusted::line(&pr.message)),
        None => (0, 0, Untrusted::line("")),
    };
    if tty {
        let bar = if total > 0 {
            let filled = (i128::from(done.clamp(0, total)) * 30 / i128::from(total)) as usize;
            format!(
                "[{}{}] {done}/{total} ",
                "#".repeat(filled),
                ".".repeat(30 - filled)
            )
        } else {
            String::new()
        };
        format!("{bar}{msg} ({calls} calls, {failures} failed)")
    } else if total > 0 {
        format!("progress: {done}/{total} {msg} ({calls} calls, {failures} failed)")
    } else {
        format!("progress: {calls} calls, {failures} failed")
    }
}

/// The declared write tools, `name (class), …`, as the daemon sent them, escaped.
fn tool_list(p: &ApprovalRequest) -> String {
    p.tools
        .iter()
        .map(|t| {
            format!(
                "{} ({})",
                Untrusted::line(&t.name),
                Untrusted::line(&t.class)
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// The approval prompt: the description and the tools' names on one line each,
/// the script with numbered lines (`text::numbered_source`), all escaped.
fn approval_prompt(p: &ApprovalRequest) -> String {
    format!(
        "\nscriptgate: this script asks to use write tools.\n  description: {}\n  write tools: {}\n--- script ---\n{}--------------\nAllow once? [y/N] ",
        Untrusted::line(&p.description),
        tool_list(p),
        numbered_source(&p.code)
    )
}

/// The embedded daemon's view of the CLI engine.
pub(super) struct Embedded(pub(super) Arc<CliEngine>);

impl EngineLink for Embedded {
    fn id(&self) -> u64 {
        1
    }
    fn tool_call(
        &self,
        params: ToolCall,
        _end: crate::script::engine::CallEnd,
    ) -> BoxFuture<'_, Result<crate::protocol::ToolAnswer, LinkError>> {
        Box::pin(async move {
            let result = self.0.tool_call(&params).await?;
            Ok(crate::protocol::ToolAnswer {
                result,
                ignored: vec![],
            })
        })
    }
    fn approval_request(
        &self,
        params: ApprovalRequest,
        _timeout: Duration,
    ) -> BoxFuture<'_, Result<bool, LinkError>> {
        Box::pin(self.0.approve_async(params))
    }
    fn send(&self, n: Notification) {
        if let Notification::ScriptProgress(p) = n {
            self.0.show_progress(&p);
        }
    }
}

/// The CLI engine as the system daemon sees it over its socket. The connection
/// comes first (the daemon makes the per-uid directory the workspace goes in),
/// the engine (its MCP servers) once the workspace exists.
struct SocketEngine {
    engine: Arc<std::sync::OnceLock<Arc<CliEngine>>>,
    /// The tool calls being served, by (script id, call id): a `tool.cancelled`
    /// aborts one, and its MCP server is told (`notifications/cancelled`).
    calls: Mutex<HashMap<(String, String), futures::future::AbortHandle>>,
}

/// A call's entry in `SocketEngine::calls`, removed however the call ends.
struct Serving<'a>(&'a SocketEngine, (String, String));

impl Drop for Serving<'_> {
    fn drop(&mut self) {
        self.0.calls.lock().unwrap().remove(&self.1);
    }
}

impl rpc::Handler for SocketEngine {
    fn request(
        self: Arc<Self>,
        method: String,
        params: Value,
    ) -> BoxFuture<'static, Result<Value, RpcError>> {
        Box::pin(async move {
            let Some(engine) = self.engine.get() else {
                return Err(RpcError::new(
                    -32000,
                    "the scriptgate CLI has started no script on this connection yet",
                ));
            };
            match DaemonRequest::parse(&method, params)? {
                DaemonRequest::ToolCall(c) => {
                    let key = (c.script_id.clone(), c.call_id.clone());
                    let (abort, reg) = futures::future::AbortHandle::new_pair();
                    // At most max_concurrency of a script are outstanding: bounded.
                    self.calls.lock().unwrap().insert(key.clone(), abort);
                    let _serving = Serving(&self, key);
                    let call = futures::future::Abortable::new(engine.tool_call(&c), reg);
                    match call.await {
                        Ok(Ok(r)) => to_value(r),
                        Ok(Err(err)) => Err(RpcError::new(-32000, err.to_string())),
                        Err(_) => Err(RpcError::new(
                            -32000,
                            "the call was cancelled (tool.cancelled)",
                        )),
                    }
                }
                DaemonRequest::ApprovalRequest(p) => {
                    let decision = match engine.approve_async(p).await {
                        Ok(true) => Decision::AllowOnce,
                        _ => Decision::Deny,
                    };
                    to_value(ApprovalAnswer { decision })
                }
            }
        })
    }
    fn notification(&self, method: &str, params: Value) {
        match (self.engine.get(), Notification::parse(method, params)) {
            (Some(engine), Ok(Notification::ScriptProgress(p))) => engine.show_progress(&p),
            (_, Ok(Notification::ToolCancelled(c))) => {
                if let Some(a) = self.calls.lock().unwrap().remove(&(c.script_id, c.call_id)) {
                    a.abort();
                }
            }
            _ => {}
        }
    }
}

fn to_value<T: serde::Serialize>(v: T) -> Result<Value, RpcError> {
    serde_json::to_value(v).map_err(|e| RpcError::internal(e.to_string()))
}

/// A user's state directory (`target::user_state_dir`: XDG_STATE_HOME, HOME,
/// or the passwd entry's home; private to the user, never a shared path),
/// made when `create`; refused with the reason when none is usable.
fn home_state(create: bool) -> Result<PathBuf, Failure> {
    super::target::user_state_dir(create).map_err(|e| {
        Failure::setup(format!(
            "no state directory for the embedded daemon's records: {e}"
        ))
    })
}

fn is_root() -> bool {
    nix::unistd::Uid::effective().is_root()
}

/// The embedded daemon's state directory (its audit store) and the root its
/// fresh workspaces go under, for the system configuration `system`: root's in
/// the system's `state.dir` (`cli` and `workspaces`: /var/lib/scriptgate/cli
/// and /var/lib/scriptgate/workspaces by default), a user's in
/// ~/.local/state/scriptgate (`home_state`, made when `create`). `scriptgate
/// prune` and the record commands (`audit`, `show`, `ps`, `cancel`) find them
/// here too.
pub(crate) fn embedded_dirs(system: &Config, create: bool) -> Result<(PathBuf, PathBuf), Failure> {
    if is_root() {
        let d = &system.state.dir;
        return Ok((d.join("cli"), d.join("workspaces")));
    }
    let state = home_state(create)?;
    let workspaces = state.join("workspaces");
    Ok((state, workspaces))
}

/// The config the embedded daemon uses: the system file if readable (for limits,
/// python, sandbox), with a state directory and workspace root of its own
/// (`embedded_dirs`; the one root is `workspace.roots`).
pub(super) fn embedded_config(path: Option<&Path>) -> Result<Config, Failure> {
    let mut cfg = match path {
        Some(p) => Config::load(p, true).map_err(|e| Failure::setup(e.to_string()))?,
        None => Config::load(Path::new(crate::config::DEFAULT_PATH), false).unwrap_or_default(),
    };
    // The embedded daemon signs its own tokens with a fresh key: no engine entries.
    cfg.auth.engines.clear();
    let (state, workspaces) = embedded_dirs(&cfg, true)?;
    cfg.state.dir = state;
    cfg.workspace.roots = vec![workspaces];
    if cfg.sandbox.backend != BackendChoice::Rlimit {
        cfg.sandbox.backend = BackendChoice::Auto;
    }
    Ok(cfg)
}

/// The uid a script of this user runs as, and its name.
pub(super) fn script_identity(cfg: &Config) -> Result<crate::sys::Identity, Failure> {
    let me = nix::unistd::getuid().as_raw();
    let gid = nix::unistd::getgid().as_raw();
    crate::sys::resolve_run_as(me, gid, &cfg.sandbox.run_as)
        .map_err(|e| Failure::setup(e.to_string()))
}

/// Where fresh workspaces go with the embedded daemon: the one root of its
/// config (`embedded_config`).
pub(super) fn embedded_workspaces(cfg: &Config) -> PathBuf {
    cfg.workspace.roots.first().cloned().unwrap_or_default()
}

/// Create a fresh workspace under `fresh_base`, or check the given one is usable
/// by the script's uid.
fn prepare_workspace(
    given: Option<&Path>,
    fresh_base: &Path,
    cfg: &Config,
    read_only: bool,
) -> Result<PathBuf, Failure> {
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
        None => fresh_workspace(fresh_base, &id)?,
    };
    check_workspace(&ws, &id, &who, read_only)?;
    Ok(ws)
}

/// A new directory `run-<time>-<random>` under `base`, owned by the script's uid.
pub(super) fn fresh_workspace(base: &Path, id: &crate::sys::Identity) -> Result<PathBuf, Failure> {
    let cannot = |e: std::io::Error| {
        Failure::setup(format!(
            "cannot create a workspace under {}: {e}; pass --workspace DIR (under the daemon's workspace.roots), or --embedded",
            base.display()
        ))
    };
    std::fs::create_dir_all(base).map_err(cannot)?;
    let stamp = crate::time::rfc3339_now().replace([':', '.'], "-");
    let mut r = [0u8; 3];
    let _ = getrandom::getrandom(&mut r);
    let ws = base.join(format!("run-{stamp}-{:02x}{:02x}{:02x}", r[0], r[1], r[2]));
    std::fs::create_dir(&ws).map_err(cannot)?;
    // Private: only the script's uid (the user, or sandbox.run_as for root) and
    // root may enter it.
    crate::sys::chmod(&ws, 0o700)
        .map_err(|e| Failure::setup(format!("chmod {}: {e}", ws.display())))?;
    // Ours to remove once unused for workspace.retain_days (crate::daemon::prune).
    crate::daemon::prune::mark_created(&ws, "scriptgate run").map_err(cannot)?;
    if is_root() {
        crate::sys::chown(&ws, Some(id.uid), Some(id.gid))
            .map_err(|e| Failure::setup(format!("chown {}: {e}", ws.display())))?;
    }
    eprintln!("scriptgate: workspace {}", ws.display());
    Ok(ws)
}

/// The workspace is a directory that `who` (the script's uid) can reach, and
/// write unless the run is read-only.
fn check_workspace(
    ws: &Path,
    id: &crate::sys::Identity,
    who: &str,
    read_only: bool,
) -> Result<(), Failure> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let meta = std::fs::metadata(ws)
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
    Ok(())
}

/// The run's authorization snapshot: every tool of the servers, the mode, and
/// the limits given on the command line.
fn snapshot(tools: &Tools, ws: &Path, o: &RunCmd) -> Snapshot {
    Snapshot {
        workspace: ws.to_path_buf(),
        read_only: o.read_only,
        permission_mode: o.mode,
        session_allowed: vec![],
        tools: tools.specs(),
        limits: SnapshotLimits {
            timeout_s: o.timeout,
            max_calls: o.max_calls,
            ..Default::default()
        },
    }
}

fn read_script(p: &Path) -> Result<String, Failure> {
    let r = if p.as_os_str() == "-" {
        std::io::read_to_string(std::io::stdin())
    } else {
        std::fs::read_to_string(p)
    };
    r.map_err(|e| Failure::usage(format!("script {}: {e}", p.display())))
}

/// The system daemon (or the one at `--socket`), connected and past its peer
/// check; the engine is bound once its MCP servers run.
pub(super) struct Connected {
    pub(super) path: PathBuf,
    pub(super) system: bool,
    peer: rpc::Endpoint,
    engine: Arc<std::sync::OnceLock<Arc<CliEngine>>>,
    reader: tokio::task::JoinHandle<()>,
    pub(super) info: crate::protocol::DaemonInfo,
}

impl Drop for Connected {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

/// Connect and ask `daemon.info`: a refusal (the peer check), a dead socket or
/// a daemon that does not answer fail here, before anything is started, with
/// what to do. The answer also means the daemon has made this uid's directory.
pub(super) async fn connect(path: &Path, system: bool, cfg: &Config) -> Result<Connected, Failure> {
    let whose = if system {
        format!("the system daemon at {}", path.display())
    } else {
        format!("the daemon at {}", path.display())
    };
    let advice = if system {
        "; the script was not run. Check `systemctl status scriptgate.socket scriptgate.service`, or pass --embedded to run it in this process (no system audit, no journal entry)"
    } else {
        "; the script was not run"
    };
    let fail = |what: String| Failure::setup(format!("{whose} {what}{advice}"));
    let stream = rpc::connect_unix(path)
        .await
        .map_err(|e| fail(format!("cannot be reached: {e}")))?;
    let (read, write) = stream.into_split();
    let (peer, _writer) = rpc::Endpoint::new(write);
    let engine: Arc<std::sync::OnceLock<Arc<CliEngine>>> = Default::default();
    let reader = {
        let (peer, bounds) = (peer.clone(), Bounds::client(cfg.server.max_message_bytes));
        let handler = Arc::new(SocketEngine {
            engine: engine.clone(),
            calls: Mutex::default(),
        });
        tokio::spawn(async move { peer.serve(read, &bounds, handler).await })
    };
    let info = peer
        .request(
            crate::protocol::Method::DaemonInfo.name(),
            &serde_json::json!({}),
            Some(Duration::from_secs(60)),
        )
        .await
        .map_err(|e| match e {
            CallError::Answered(e) | CallError::Closed(e) => {
                fail(format!("refused this client: {}", e.message))
            }
            CallError::Disconnected => fail("closed the connection without an answer".into()),
            CallError::Timeout { .. } => fail("did not answer daemon.info within 60 s".into()),
        })?;
    let info = serde_json::from_value(info).map_err(|e| {
        fail(format!(
            "answered daemon.info with something unexpected: {e}"
        ))
    })?;
    Ok(Connected {
        path: path.to_path_buf(),
        system,
        peer,
        engine,
        reader,
        info,
    })
}

/// The config the client reads for a daemon over a socket (its key, roots and
/// limits): `--config`, or the system file.
pub(super) fn socket_config(config: Option<&Path>) -> Result<Config, Failure> {
    Config::load(
        config.unwrap_or(Path::new(crate::config::DEFAULT_PATH)),
        config.is_some(),
    )
    .map_err(|e| Failure::setup(e.to_string()))
}

/// This user's `[[auth.engine]]` entry in the daemon's config, if any.
fn my_entry(cfg: &Config) -> Result<Option<crate::config::EngineAuth>, Failure> {
    let (uid, gid) = (
        nix::unistd::getuid().as_raw(),
        nix::unistd::getgid().as_raw(),
    );
    crate::policy::auth::entry_for(
        &cfg.auth,
        uid,
        &crate::sys::peer_gids(uid, gid),
        Path::new("auth.engine"),
    )
    .map(|e| e.cloned())
    .map_err(|e| Failure::setup(e.to_string()))
}

/// Where a fresh workspace goes with a daemon over a socket: root's under the
/// first workspace root; another user's in its engine entry's first
/// `workspace_roots`, or in its per-uid directory `<root>/<uid>`, which the
/// daemon made when this client connected.
pub(super) fn socket_fresh_base(cfg: &Config, path: &Path) -> Result<PathBuf, Failure> {
    let uid = nix::unistd::getuid().as_raw();
    let roots = if is_root() {
        cfg.workspace.roots.clone()
    } else {
        let entry = my_entry(cfg)?;
        crate::policy::auth::peer_roots(
            &cfg.workspace.roots,
            entry.as_ref().map(|e| e.workspace_roots.as_slice()),
            uid,
        )
    };
    roots.into_iter().next().ok_or_else(|| {
        Failure::setup(format!(
            "the daemon at {} has no workspace.roots",
            path.display()
        ))
    })
}

pub async fn run(o: RunCmd) -> Result<ScriptResult, Failure> {
    use super::target::{choose, Facts, Target};
    let code = read_script(&o.script)?;
    let target = choose(o.embedded, o.socket.as_deref(), &Facts::gather());
    let (cfg, conn) = match &target {
        Target::Embedded(_) => (embedded_config(o.config.as_deref())?, None),
        Target::Socket { path, system } => {
            let cfg = socket_config(o.config.as_deref())?;
            let conn = connect(path, *system, &cfg).await?;
            (cfg, Some(conn))
        }
    };
    // One line on stderr naming the mode.
    match &conn {
        None => eprintln!(
            "scriptgate: mode: embedded daemon in this process ({}); records in {}",
            match &target {
                Target::Embedded(why) => why,
                Target::Socket { .. } => "",
            },
            cfg.state.dir.display()
        ),
        Some(c) => eprintln!(
            "scriptgate: mode: {} at {} (scriptgated {}, {} backend)",
            if c.system { "system daemon" } else { "daemon" },
            c.path.display(),
            Untrusted::line(&c.info.version),
            Untrusted::line(&c.info.backend)
        ),
    }
    // A fresh workspace goes under the daemon's roots (socket), or ours.
    let fresh_base = match &conn {
        None => embedded_workspaces(&cfg),
        Some(c) => socket_fresh_base(&cfg, &c.path)?,
    };
    let ws = prepare_workspace(o.workspace.as_deref(), &fresh_base, &cfg, o.read_only)?;
    let tools = Tools::start(
        &o.servers.mcp,
        vec![ws.display().to_string()],
        &o.servers.class,
        Duration::from_secs(o.call_timeout),
    )
    .await?;
    let terminal = Arc::new(Terminal {
        answer: o.answer(),
        progress_tty: std::io::stderr().is_terminal(),
        progress_shown: Mutex::new(false),
    });
    let engine = Arc::new(CliEngine {
        tools: Arc::new(tools),
        ui: terminal.clone(),
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
        traceparent: None,
        tracestate: None,
    };
    let never = std::future::pending();
    let result = match conn {
        None => run_embedded(cfg, snap, params, &o, engine.clone()).await,
        Some(c) => run_socket(c, &cfg, snap, params, engine.clone(), never).await,
    };
    terminal.clear_progress();
    engine.tools.shutdown().await;
    result
}

fn mint(key: &[u8], snap: &Snapshot) -> Result<String, Failure> {
    let mut r = [0u8; 6];
    let _ = getrandom::getrandom(&mut r);
    let run_id = format!(
        "cli-{}",
        r.iter().map(|b| format!("{b:02x}")).collect::<String>()
    );
    let runner = format!("scriptgate-cli uid {}", nix::unistd::getuid());
    let snap = serde_json::to_value(snap).map_err(|e| Failure::setup(e.to_string()))?;
    crate::protocol::token::mint(key, &run_id, Some(&runner), &snap, 24 * 3600)
        .map_err(|e| Failure::setup(e.message))
}

async fn run_embedded(
    mut cfg: Config,
    snap: Snapshot,
    params: StartParams,
    o: &RunCmd,
    engine: Arc<CliEngine>,
) -> Result<ScriptResult, Failure> {
    // The embedded daemon's one root is the workspace's parent: a workspace lies
    // below its root, never is one (the path is canonical, so no symlink is in it).
    let ws = &snap.workspace;
    cfg.workspace.roots = vec![ws.parent().unwrap_or(ws).to_path_buf()];
    // The user at the terminal is the sysadmin of an embedded daemon: their limits stand.
    if let Some(t) = o.timeout {
        cfg.scripts.timeout_s = t;
    }
    if let Some(m) = o.max_calls {
        cfg.scripts.max_calls = m;
    }
    // One script per process: a pre-made sandbox would never serve it, and
    // making one would take CPU from the script's own start.
    cfg.sandbox.pool_size = 0;
    let daemon = EmbeddedDaemon::start(cfg).await?;
    let result = daemon
        .run(snap, params, engine, std::future::pending())
        .await;
    daemon.settled().await;
    result
}

/// A daemon in this process: it signs its own tokens with a fresh key, and this
/// process is its one engine (`scriptgate run --embedded`, `scriptgate mcp`).
pub(super) struct EmbeddedDaemon {
    daemon: Arc<Daemon>,
    me: crate::daemon::Peer,
    key: Vec<u8>,
}

impl EmbeddedDaemon {
    pub(super) async fn start(cfg: Config) -> Result<EmbeddedDaemon, Failure> {
        let mut key = vec![0u8; 32];
        getrandom::getrandom(&mut key).map_err(|e| Failure::setup(format!("random key: {e}")))?;
        // Pre-made sandboxes (`sandbox::pool`) take a mount server holding the
        // capabilities to enter them: a root process starts its own here;
        // anyone else's scripts all start cold (`script::Settings`).
        if cfg.sandbox.pool_size > 0 && is_root() {
            crate::sandbox::mounter::start_server(&crate::sandbox::init::exe());
        }
        let (daemon, _) = Daemon::new(cfg, key.clone(), crate::daemon::Hosting::Embedded)
            .await
            .map_err(|e| Failure::setup(format!("embedded daemon: {e}")))?;
        // The user at the terminal is the embedded daemon's one engine; who that
        // is is decided where every peer's is.
        let engine_groups = PeerGroups {
            in_allowed: true,
            in_admin: false,
            gids: &[],
        };
        let (_, me) = daemon
            .identify(
                nix::unistd::getuid().as_raw(),
                nix::unistd::getgid().as_raw(),
                Some(std::process::id() as i32),
                Some(engine_groups),
            )
            .map_err(|e| Failure::setup(format!("embedded daemon: {e}")))?;
        Ok(EmbeddedDaemon { daemon, me, key })
    }

    /// Until the ended scripts' sandboxes are torn down (bounded): before
    /// this process exits (`Daemon::settled`).
    pub(super) async fn settled(&self) {
        self.daemon.settled(Duration::from_secs(10)).await
    }

    /// Start one script and wait for its result; `cancelled` resolving cancels it
    /// (the result is then `cancelled`).
    pub(super) async fn run(
        &self,
        snap: Snapshot,
        params: StartParams,
        engine: Arc<CliEngine>,
        cancelled: impl std::future::Future<Output = ()>,
    ) -> Result<ScriptResult, Failure> {
        let script_id = self.start_script(snap, params, engine).await?;
        self.wait_script(script_id, cancelled).await
    }

    /// Start one script: answers with its id once it is recorded and running
    /// (its approval, if it needs one, was asked on the way).
    pub(super) async fn start_script(
        &self,
        snap: Snapshot,
        mut params: StartParams,
        engine: Arc<CliEngine>,
    ) -> Result<String, Failure> {
        params.token = mint(&self.key, &snap)?;
        let link: Arc<dyn EngineLink> = Arc::new(Embedded(engine));
        let started = self
            .daemon
            .start(self.me, link, params)
            .await
            .map_err(|e| Failure::refused(&e))?;
        Ok(started.script_id)
    }

    /// The result of a script this daemon started; `cancelled` resolving first
    /// cancels it (the result is then `cancelled`).
    pub(super) async fn wait_script(
        &self,
        script_id: String,
        cancelled: impl std::future::Future<Output = ()>,
    ) -> Result<ScriptResult, Failure> {
        let who = Access::Conn(1, None, self.me.uid());
        let script = script_ref(script_id);
        let wait = self.daemon.wait(who, script.clone());
        let result = tokio::select! {
            r = wait => r,
            () = cancelled => {
                let _ = self
                    .daemon
                    .cancel(who, script.clone(), "cancelled by the MCP client")
                    .await;
                self.daemon.wait(who, script).await
            }
        };
        result.map_err(|e| Failure::setup(e.message))
    }
}

fn script_ref(script_id: String) -> ScriptRef {
    ScriptRef {
        script_id,
        timeout_s: None,
        token: None,
    }
}

/// Act as an engine over the daemon's socket: start the script, serve its tool
/// calls and approval while waiting for its result. A daemon that goes away
/// after the start leaves the script's end unknown: that is `interrupted` (7).
pub(super) async fn run_socket(
    c: Connected,
    cfg: &Config,
    snap: Snapshot,
    params: StartParams,
    engine: Arc<CliEngine>,
    cancelled: impl std::future::Future<Output = ()>,
) -> Result<ScriptResult, Failure> {
    start_socket(c, cfg, snap, params, engine)
        .await?
        .wait(cancelled)
        .await
}

/// A script started over a daemon's socket: the connection serves its tool calls
/// until its result is read.
pub(super) struct SocketScript {
    c: Connected,
    pub(super) script_id: String,
}

/// Start one script over the daemon's socket, as its engine: answers once the
/// daemon has started it (its approval, if it needs one, was asked on the way).
pub(super) async fn start_socket(
    c: Connected,
    cfg: &Config,
    snap: Snapshot,
    mut params: StartParams,
    engine: Arc<CliEngine>,
) -> Result<SocketScript, Failure> {
    // Root is never bound to an entry (the daemon checks its tokens against
    // auth.token_key_file).
    let entry = if is_root() { None } else { my_entry(cfg)? };
    let key_file = match entry {
        Some(e) => e.token_key_file,
        None => cfg.auth.token_key_file.clone(),
    };
    let key = crate::config::read_key_file(&key_file).map_err(|e| {
        Failure::setup(format!("the daemon at {} needs tokens signed with its key, and {e}; run as root or a member of the key's group, or pass --embedded", c.path.display()))
    })?;
    params.token = mint(&key, &snap)?;
    let _ = c.engine.set(engine);
    let started = c
        .peer
        .request(crate::protocol::Method::ScriptStart.name(), &params, None)
        .await
        .map_err(|e| match e {
            CallError::Answered(e) => Failure::refused(&e),
            CallError::Closed(e) => {
                Failure::setup(format!("the daemon closed the connection: {}", e.message))
            }
            CallError::Disconnected | CallError::Timeout { .. } => {
                Failure::setup("the daemon closed the connection before the script started")
            }
        })?;
    let started: Started =
        serde_json::from_value(started).map_err(|e| Failure::setup(format!("start: {e}")))?;
    Ok(SocketScript {
        c,
        script_id: started.script_id,
    })
}

impl SocketScript {
    /// Serve the script's calls until its result; `cancelled` resolving first
    /// cancels it (the result is then `cancelled`).
    pub(super) async fn wait(
        self,
        cancelled: impl std::future::Future<Output = ()>,
    ) -> Result<ScriptResult, Failure> {
        let SocketScript { c, script_id: sid } = self;
        let lost = |why: String| {
            Failure::new(
                super::exit::INTERRUPTED,
                format!(
                    "the daemon at {} went away while script {sid} was running ({why}); the script was interrupted. See `journalctl -u scriptgate` and `scriptgate show {sid}`",
                    c.path.display()
                ),
            )
        };
        let script = script_ref(sid.clone());
        let wait = c
            .peer
            .request(crate::protocol::Method::ScriptWait.name(), &script, None);
        let r = tokio::select! {
            r = wait => r,
            () = cancelled => {
                // The wait below then answers with the cancelled result.
                let _ = c
                    .peer
                    .request(crate::protocol::Method::ScriptCancel.name(), &script, None)
                    .await;
                c.peer
                    .request(crate::protocol::Method::ScriptWait.name(), &script, None)
                    .await
            }
        };
        let r = r.map_err(|e| match e {
            CallError::Answered(e) => Failure::setup(e.message),
            CallError::Closed(e) => lost(e.message),
            CallError::Disconnected => lost("the connection closed".into()),
            CallError::Timeout { .. } => lost("no answer".into()),
        })?;
        serde_json::from_value(r).map_err(|e| Failure::setup(format!("result: {e}")))
    }
}

/// A script this user started over the daemon's socket, read from the daemon:
/// its result once finished, `None` while it runs (its record, for a process
/// that did not start it or has restarted since).
pub(super) async fn socket_record(
    path: &Path,
    system: bool,
    cfg: &Config,
    script_id: &str,
) -> Result<Option<ScriptResult>, Failure> {
    let c = connect(path, system, cfg).await?;
    let script = script_ref(script_id.to_string());
    let asked = |e: CallError| match e {
        CallError::Answered(e) | CallError::Closed(e) => Failure::setup(e.message),
        CallError::Disconnected | CallError::Timeout { .. } => {
            Failure::setup(format!("the daemon at {} did not answer", path.display()))
        }
    };
    let status = c
        .peer
        .request(
            crate::protocol::Method::ScriptStatus.name(),
            &script,
            Some(Duration::from_secs(30)),
        )
        .await
        .map_err(asked)?;
    let status: ScriptStatus =
        serde_json::from_value(status).map_err(|e| Failure::setup(format!("status: {e}")))?;
    if status.state == crate::protocol::Status::Running {
        return Ok(None);
    }
    let r = c
        .peer
        .request(
            crate::protocol::Method::ScriptWait.name(),
            &script,
            Some(Duration::from_secs(30)),
        )
        .await
        .map_err(asked)?;
    serde_json::from_value(r)
        .map(Some)
        .map_err(|e| Failure::setup(format!("result: {e}")))
}

/// Cancel a script this user started over the daemon's socket, from a process
/// that does not hold its connection; answers once it has ended.
pub(super) async fn socket_cancel(
    path: &Path,
    system: bool,
    cfg: &Config,
    script_id: &str,
) -> Result<(), Failure> {
    let c = connect(path, system, cfg).await?;
    c.peer
        .request(
            crate::protocol::Method::ScriptCancel.name(),
            &script_ref(script_id.to_string()),
            Some(Duration::from_secs(60)),
        )
        .await
        .map(|_| ())
        .map_err(|e| match e {
            CallError::Answered(e) | CallError::Closed(e) => Failure::setup(e.message),
            CallError::Disconnected | CallError::Timeout { .. } => {
                Failure::setup(format!("the daemon at {} did not answer", path.display()))
            }
        })
}

/// One tool in `scriptgate tools --json`.
#[derive(serde::Serialize)]
struct ToolLine<'a> {
    name: &'a str,
    class: ToolClass,
    signature: String,
    input_schema: &'a Option<Value>,
}

/// One tool not offered in `scriptgate tools --json`: its name, exact, and why.
#[derive(serde::Serialize)]
struct LeftOutLine<'a> {
    name: &'a str,
    not_offered: &'a str,
}

/// A line of `scriptgate tools --json`: the tools offered, then those not.
#[derive(serde::Serialize)]
#[serde(untagged)]
enum JsonLine<'a> {
    Offered(ToolLine<'a>),
    NotOffered(LeftOutLine<'a>),
}

/// `scriptgate tools`: NAME, CLASS, Python signature; then the tools not
/// offered, with why. Names and signatures are shown escaped (a server wrote
/// them); `--json` gives them exact.
pub async fn list_tools(
    mcp: &[ServerSpec],
    class: &[(String, ToolClass)],
    json_out: bool,
) -> Result<String, Failure> {
    let tools = Tools::start(mcp, vec![], class, Duration::from_secs(60)).await?;
    let specs = tools.specs();
    let left_out = tools.left_out();
    tools.shutdown().await;
    let out = if json_out {
        let offered = specs.iter().map(|t| {
            JsonLine::Offered(ToolLine {
                name: &t.name,
                class: t.class,
                signature: crate::policy::describe::signature(t),
                input_schema: &t.input_schema,
            })
        });
        let not_offered = left_out.named.iter().map(|(name, why)| {
            JsonLine::NotOffered(LeftOutLine {
                name,
                not_offered: why,
            })
        });
        let v: Vec<JsonLine> = offered.chain(not_offered).collect();
        serde_json::to_string_pretty(&v).unwrap_or_default() + "\n"
    } else {
        let rows: Vec<Vec<String>> = specs
            .iter()
            .map(|t| {
                vec![
                    crate::text::escape(&t.name).into_owned(),
                    t.class.as_str().to_string(),
                    crate::text::escape(&crate::policy::describe::signature(t)).into_owned(),
                ]
            })
            .collect();
        let mut out = super::table::table(&["NAME", "CLASS", "SIGNATURE"], &rows);
        if !left_out.is_empty() {
            out.push_str("\nNot offered (what the server lists of them cannot be used):\n");
            for (name, why) in &left_out.named {
                out.push_str(&format!("  {}: {why}\n", crate::text::escape(name)));
            }
            if left_out.more > 0 {
                out.push_str(&format!("  and {} more\n", left_out.more));
            }
        }
        out
    };
    Ok(out)
}

/// `scriptgate describe`: the run_script description for these servers.
pub async fn describe(
    mcp: &[ServerSpec],
    class: &[(String, ToolClass)],
    mode: PermissionMode,
    read_only: bool,
    config: Option<&Path>,
) -> Result<String, Failure> {
    let cfg = embedded_config(config)?;
    let tools = Tools::start(mcp, vec![], class, Duration::from_secs(60)).await?;
    tools.shutdown().await;
    tools.describe(
        &cfg,
        mode,
        read_only,
        crate::policy::describe::NeverCallable::OfferedDirectly,
    )
}

/// The `describe` text (scriptgate-protocol(7) §7) for these tools, under `cfg`'s limits.
pub(super) fn describe_text(
    cfg: &Config,
    specs: &[ToolSpec],
    mode: PermissionMode,
    read_only: bool,
    never: crate::policy::describe::NeverCallable,
) -> Result<String, Failure> {
    describe_listing(cfg, specs, &LeftOut::default(), mode, read_only, never)
}

/// `describe_text`, naming the tools left out of the servers' lists too.
fn describe_listing(
    cfg: &Config,
    specs: &[ToolSpec],
    left_out: &LeftOut,
    mode: PermissionMode,
    read_only: bool,
    never: crate::policy::describe::NeverCallable,
) -> Result<String, Failure> {
    let snap = Snapshot {
        workspace: "/".into(),
        read_only,
        permission_mode: mode,
        session_allowed: vec![],
        tools: specs.to_vec(),
        limits: SnapshotLimits::default(),
    };
    // Checked as the daemon checks a token's snapshot.
    check_as_a_snapshot(specs).map_err(Failure::setup)?;
    let limits = crate::policy::Limits::effective(&cfg.scripts, &snap.limits);
    Ok(crate::policy::describe::describe_for(
        &snap,
        &limits,
        cfg.scripts.return_max_chars,
        never,
        left_out,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, class: ToolClass, schema: Option<Value>) -> ToolSpec {
        ToolSpec {
            name: name.into(),
            class,
            enabled: true,
            input_schema: schema,
            frozen: Default::default(),
            description: None,
        }
    }

    /// The last guard of `Tools::refresh`: a list the daemon would refuse is
    /// not taken (each tool was admitted on its own already).
    #[test]
    fn a_list_the_daemon_would_refuse_is_refused_here() {
        let schema = || Some(serde_json::json!({"type": "object", "x": [0, 0]}));
        let good = [
            spec("a__r", ToolClass::Read, schema()),
            spec("a__d", ToolClass::Destructive, None),
        ];
        assert_eq!(check_as_a_snapshot(&good), Ok(()));
        let twice = [
            spec("a__r", ToolClass::Read, schema()),
            spec("a__r", ToolClass::Read, schema()),
        ];
        assert!(check_as_a_snapshot(&twice)
            .unwrap_err()
            .contains("listed twice"));
        let spaced = [spec("a__r x", ToolClass::Read, schema())];
        assert!(check_as_a_snapshot(&spaced)
            .unwrap_err()
            .contains("1..128 visible characters"));
        let bare = [spec("a__r", ToolClass::Read, None)];
        assert!(check_as_a_snapshot(&bare)
            .unwrap_err()
            .contains("has no input_schema"));
    }

    const HOSTILE: &str = "\x1b]0;owned\x07\x1b[2J\r\n\u{202e}row";

    fn unsafe_in(s: &str) -> usize {
        s.chars()
            .filter(|&c| crate::text::is_unsafe(c) && c != '\n')
            .count()
    }

    #[test]
    fn the_prompt_shows_what_runs() {
        let p: ApprovalRequest = serde_json::from_value(serde_json::json!({
            "script_id": "s", "run_id": "r", "description": format!("status{HOSTILE}"),
            "code": "from agent_tools import tools\ntools.srv.reboot_all()  # \x1b[2K\x1b[1G   2 | print(1)\n",
            "tools": [{"name": format!("srv__reboot_all{HOSTILE}"), "class": "write"}]
        }))
        .unwrap();
        let shown = approval_prompt(&p);
        assert_eq!(unsafe_in(&shown), 0, "{shown}");
        assert!(
            shown.contains("  description: status\\x1b]0;owned\\x07\\x1b[2J\\x0d\\x0a\\u202erow\n"),
            "{shown}"
        );
        assert!(
            shown.contains("  write tools: srv__reboot_all\\x1b]0;owned"),
            "{shown}"
        );
        assert!(
            shown.contains("\n   2 | tools.srv.reboot_all()  # \\x1b[2K\\x1b[1G   2 | print(1)\n"),
            "{shown}"
        );
    }

    #[test]
    fn progress_shows_the_message_escaped_and_any_counts() {
        let status = |done, total| ScriptStatus {
            script_id: "s".into(),
            state: crate::protocol::Status::Running,
            calls: 3,
            failures: 1,
            elapsed_ms: 0,
            progress: Some(crate::protocol::Progress {
                done,
                total,
                message: HOSTILE.into(),
            }),
        };
        let shown = "\\x1b]0;owned\\x07\\x1b[2J\\x0d\\x0a\\u202erow";
        assert_eq!(
            progress_text(&status(1, 2), true),
            format!("[###############...............] 1/2 {shown} (3 calls, 1 failed)")
        );
        assert_eq!(
            progress_text(&status(1, 2), false),
            format!("progress: 1/2 {shown} (3 calls, 1 failed)")
        );
        // A script gives any i64: the bar stays 30 cells.
        for (done, total) in [(i64::MAX, i64::MAX), (i64::MAX / 2, i64::MAX), (-5, 7)] {
            let bar = progress_text(&status(done, total), true);
            assert_eq!(bar.find(']'), Some(31), "{bar}");
        }
    }
}
