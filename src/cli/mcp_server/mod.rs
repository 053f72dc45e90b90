//! `scriptgate mcp`: code mode for any MCP client. An MCP server over stdio (the
//! official Rust SDK, `rmcp`) whose tool `run_script` runs one Python script
//! against the upstream MCP servers given with `--mcp`, as `scriptgate run` does:
//! through the system daemon when one is installed, else in an embedded daemon.
//! Both protocol eras are served (`server`): the one approval for declared
//! write tools goes to the user through MCP elicitation (`elicitation/create`,
//! or 2026-07-28's `InputRequiredResult`: `approval`); long scripts become MCP
//! tasks (`tasks`); `agent_tools.progress` and the call counts become
//! `notifications/progress`; a cancelled call, a closed stdin or a signal
//! cancels the scripts, each recorded `cancelled` before the process exits.

use super::args::McpCmd;
use super::exit::Failure;
use super::run::{EmbeddedDaemon, Tools};
use crate::config::Config;
use crate::protocol::snapshot::PermissionMode;
use rmcp::ServiceExt;
use std::sync::Arc;
use std::time::Duration;

mod approval;
mod http;
mod line;
mod peer;
mod result;
mod scripts;
mod secret;
mod server;
mod stdio;
mod tasks;
mod ui;

use http::serve_http;
use scripts::{Scripts, Where};
use server::CodeMode;

/// `run::connect`, tried again every half second for up to `wait_s` while the
/// socket is missing or nobody listens on it (said once on stderr); any other
/// failure, or the last, is the answer.
async fn connect_waiting(
    path: &std::path::Path,
    system: bool,
    cfg: &Config,
    wait_s: u64,
) -> Result<super::run::Connected, Failure> {
    use std::io::ErrorKind::{ConnectionRefused, NotFound};
    let until = std::time::Instant::now() + std::time::Duration::from_secs(wait_s);
    let mut said = false;
    loop {
        let failed = match super::run::connect(path, system, cfg).await {
            Ok(c) => return Ok(c),
            Err(e) => e,
        };
        // Asked only after a failure: whether it was for want of a daemon.
        let absent = matches!(
            std::os::unix::net::UnixStream::connect(path).map_err(|e| e.kind()),
            Err(NotFound | ConnectionRefused)
        );
        if !absent || std::time::Instant::now() >= until {
            return Err(failed);
        }
        if !said {
            eprintln!(
                "scriptgate mcp: waiting up to {wait_s} s for a daemon at {}",
                path.display()
            );
            said = true;
        }
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
}

/// Where scripts run (an embedded daemon, or a daemon's socket, said on
/// stderr), the configuration, the directory fresh workspaces go under, and
/// this user's state directory.
async fn runs_in(
    o: &McpCmd,
) -> Result<(Where, Config, std::path::PathBuf, std::path::PathBuf), Failure> {
    use super::target::{choose, Facts, Target};
    let target = choose(o.embedded, o.socket.as_deref(), &Facts::gather());
    Ok(match &target {
        Target::Embedded(why) => {
            let cfg = super::run::embedded_config(o.config.as_deref())?;
            let base = super::run::embedded_workspaces(&cfg);
            std::fs::create_dir_all(&base)
                .map_err(|e| Failure::setup(format!("cannot create {}: {e}", base.display())))?;
            eprintln!(
                "scriptgate mcp: mode: embedded daemon in this process ({why}); records in {}",
                cfg.state.dir.display()
            );
            let state = cfg.state.dir.clone();
            (
                Where::Embedded(EmbeddedDaemon::start(cfg.clone()).await?),
                cfg,
                base,
                state,
            )
        }
        Target::Socket { path, system } => {
            let cfg = super::run::socket_config(o.config.as_deref())?;
            // Connected once now: a refusal or a dead daemon is said at start.
            let c = connect_waiting(path, *system, &cfg, o.wait).await?;
            eprintln!(
                "scriptgate mcp: mode: {} at {} (scriptgated {}, {} backend)",
                if c.system { "system daemon" } else { "daemon" },
                c.path.display(),
                c.info.version,
                c.info.backend
            );
            let base = super::run::socket_fresh_base(&cfg, path)?;
            drop(c);
            let w = Where::Socket {
                path: path.clone(),
                system: *system,
                cfg: Box::new(cfg.clone()),
            };
            let state = super::run::embedded_dirs(&cfg, true)?.0;
            (w, cfg, base, state)
        }
    })
}

pub async fn serve(o: McpCmd) -> Result<(), Failure> {
    let (runs_in, cfg, base, state) = runs_in(&o).await?;
    let tasks = tasks::Tasks::open(
        &state,
        cfg.state.dir.join("scriptgate.db"),
        cfg.audit.retain_days,
    )?;
    let grants = approval::Grants::new().map_err(|e| Failure::setup(e.to_string()))?;
    let identity = super::run::script_identity(&cfg)?;
    let tools = Tools::start(
        &o.servers.mcp,
        vec![base.display().to_string()],
        &o.servers.class,
        Duration::from_secs(o.call_timeout),
    )
    .await?;
    let describe = describe_text(&cfg, &tools.specs(), o.mode, false);
    let describe = match describe {
        Ok(d) => d,
        Err(e) => {
            tools.shutdown().await;
            return Err(e);
        }
    };
    let tools = Arc::new(tools);
    let scripts = Arc::new(Scripts::new(runs_in));
    let server = CodeMode {
        tools: tools.clone(),
        scripts: scripts.clone(),
        grants: Arc::new(grants),
        tasks: Arc::new(tasks),
        base,
        identity,
        mode: o.mode,
        passthrough: o.passthrough,
        task_after: Duration::from_secs(o.task_after),
        describe: Arc::new(std::sync::RwLock::new(describe)),
        clients: Arc::default(),
        tools_changed: Arc::new(tokio::sync::watch::channel(0).0),
    };
    for upstream in tools.servers() {
        tokio::spawn(follow_tool_list(
            upstream.tools_changed.clone(),
            server.clone(),
            cfg.clone(),
        ));
    }
    // `--http`'s bearer token: the same across restarts (tasks are bound to
    // the principal it names, and outlive a restart).
    let token_file = o
        .token_file
        .clone()
        .unwrap_or_else(|| state.join("mcp-http.token"));
    let served = async {
        match o.http {
            None => serve_stdio(server).await,
            Some(addr) => serve_http(server, addr, &token_file).await,
        }
    };
    let r = tokio::select! {
        r = served => r,
        sig = stop_signal() => {
            eprintln!("scriptgate mcp: {sig}: cancelling the running scripts");
            Ok(())
        }
    };
    // The client is gone (stdin closed), or a signal came: every script still
    // running is cancelled and waited for, so that each is recorded `cancelled`
    // before this process exits (a stdio client sends SIGTERM 2 s after it
    // closes stdin). A cancel takes at most 30 s (scriptgated(8)).
    let left = scripts.cancel_all(DRAIN).await;
    if left > 0 {
        eprintln!("scriptgate mcp: {left} scripts still running after {DRAIN:?}; leaving them");
    }
    tools.shutdown().await;
    r
}

/// The first SIGTERM or SIGINT.
async fn stop_signal() -> &'static str {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    }
}

/// How long scripts cancelled at exit may take to end.
const DRAIN: Duration = Duration::from_secs(45);

/// The `describe` text for `scriptgate mcp`, which offers no never-callable tool.
fn describe_text(
    cfg: &Config,
    specs: &[crate::protocol::snapshot::ToolSpec],
    mode: PermissionMode,
    read_only: bool,
) -> Result<String, Failure> {
    super::run::describe_text(
        cfg,
        specs,
        mode,
        read_only,
        crate::policy::describe::NeverCallable::NotOffered,
    )
}

/// Each `notifications/tools/list_changed` of an upstream server: list the tools
/// again, make the description again, and tell the clients with the same
/// notification. Ends with the process. A new list that is not taken
/// (`Tools::refresh`: it cannot be read, is over its bounds) leaves the one
/// before in force, with its description. The description made here also
/// names the tools the servers' lists leave out (`Tools::describe`), which the
/// first one, made from the specs alone, does not: it is made again when this
/// is called, before anything is served, and the loop then runs in the
/// future returned.
fn follow_tool_list(
    changed: Arc<tokio::sync::Notify>,
    server: CodeMode,
    cfg: Config,
) -> impl std::future::Future<Output = ()> {
    fn describe(server: &CodeMode, cfg: &Config) {
        let never = crate::policy::describe::NeverCallable::NotOffered;
        match server.tools.describe(cfg, server.mode, false, never) {
            Ok(d) => *server.describe.write().unwrap_or_else(|p| p.into_inner()) = d,
            Err(e) => eprintln!(
                "scriptgate mcp: the new tool list: {}",
                crate::text::Untrusted::line(&e.message)
            ),
        }
    }
    describe(&server, &cfg);
    async move {
        loop {
            changed.notified().await;
            if let Err(e) = server.tools.refresh().await {
                eprintln!(
                    "scriptgate mcp: the tool list changed and the new one is not taken: {}; the one before stays in force",
                    crate::text::Untrusted::line(&e.message)
                );
                continue;
            }
            describe(&server, &cfg);
            // Subscribers of 2026-07-28 (subscriptions/listen), then the clients
            // of the handshake era.
            server.tools_changed.send_modify(|n| *n += 1);
            let clients = server
                .clients
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone();
            for c in clients {
                let _ = c.notify_tool_list_changed().await;
            }
        }
    }
}

async fn serve_stdio(server: CodeMode) -> Result<(), Failure> {
    let (transport, _stdin_closed) = stdio::Stdio::new(server.tasks.clone());
    let running = match server.serve(transport).await {
        Ok(r) => r,
        // The client hung up before a session began: a 2026-07-28 client
        // that only asked server/discover (a probe), or one that sent nothing.
        Err(rmcp::service::ServerInitializeError::ConnectionClosed(_)) => return Ok(()),
        Err(e) => return Err(Failure::setup(format!("MCP client: {e}"))),
    };
    running
        .waiting()
        .await
        .map_err(|e| Failure::setup(format!("MCP server: {e}")))?;
    Ok(())
}
