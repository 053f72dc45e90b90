//! `scriptgate`, the command-line tool: run scripts against real MCP servers (with
//! the system daemon or an embedded one), mint tokens, and administer the daemon.

pub mod admin;
pub mod completions;
pub mod exit;
pub mod run;
pub mod table;
pub mod target;

use crate::mcp::ServerSpec;
use crate::protocol::Status;
use crate::token::{PermissionMode, ToolClass};
use clap::builder::PossibleValue;
use clap::{Args, Parser, Subcommand, ValueEnum};
use exit::Failure;
use std::path::PathBuf;
use std::process::ExitCode;

const RUN_AFTER_HELP: &str = "\
Exit status: 0 ok; 1 the script failed (error); 2 usage; 3 timeout; 4 cancelled; 5 oom;
6 limit (call budget); 7 interrupted; 8 approval denied; 9 start refused (token,
snapshot, tools, busy); 10 set-up failed (MCP server, workspace, daemon).

Example:
  scriptgate run --mcp 'fs=npx -y @modelcontextprotocol/server-filesystem /srv/data' report.py";

#[derive(Parser, Debug)]
#[command(
    name = "scriptgate",
    version,
    about = "Run tool-calling Python scripts in a sandbox; inspect and control scriptgated"
)]
pub struct Cli {
    #[command(subcommand)]
    pub cmd: Cmd,
}

#[derive(Subcommand, Debug)]
pub enum Cmd {
    /// Run a script against real MCP servers (system daemon, or an embedded one).
    #[command(after_help = RUN_AFTER_HELP)]
    Run(RunCmd),
    /// List the tools of MCP servers: name, class, Python call signature.
    Tools(ToolsCmd),
    /// Print the run_script tool description a model would be given.
    Describe(DescribeCmd),
    /// Run tokens (the reference for engine authors).
    #[command(subcommand)]
    Token(TokenCmd),
    /// The daemon: version, backend, limits, running scripts.
    Status(AdminArgs),
    /// Running scripts (admin).
    Ps(AdminArgs),
    /// One script's whole record, artifact paths and result text (admin).
    Show {
        id: String,
        #[command(flatten)]
        a: AdminArgs,
    },
    /// Cancel a running script (admin).
    Cancel {
        id: String,
        #[command(flatten)]
        a: AdminArgs,
    },
    /// Query the audit store; works with the daemon down (admin).
    Audit(AuditCmd),
    /// Print a shell completion script (bash, zsh or fish) on stdout.
    Completions {
        #[arg(value_enum)]
        shell: completions::Shell,
    },
    /// Prometheus metrics from the audit store; works with the daemon down (admin).
    Metrics(MetricsCmd),
    /// Remove the workspaces scriptgate created and nothing used for
    /// workspace.retain_days (admin; the daemon also does it hourly).
    Prune(PruneCmd),
}

#[derive(Args, Debug)]
pub struct PruneCmd {
    /// Only show what would be removed.
    #[arg(long)]
    pub dry_run: bool,
    /// The daemon's configuration (workspace.roots, workspace.retain_days).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct MetricsCmd {
    /// Write them to this file (atomically: a temporary file, then a rename), for
    /// node_exporter's textfile collector, instead of standard output.
    #[arg(long, value_name = "PATH")]
    pub output: Option<PathBuf>,
    /// The daemon's configuration (state.dir, auth.admin_groups).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
}

/// Options of the admin commands.
#[derive(Args, Debug)]
#[command(after_help = ADMIN_AFTER_HELP)]
pub struct AdminArgs {
    /// The daemon's socket.
    #[arg(long, value_name = "PATH")]
    pub socket: Option<PathBuf>,
    /// The daemon's configuration (state.dir, auth.admin_groups).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// JSON for machines instead of a table for people.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct AuditCmd {
    /// Only scripts started since: a duration (30m, 2h, 7d) or a date (2026-11-30, 2026-11-30T07:00:00Z).
    #[arg(long, value_parser = crate::time::since_arg)]
    pub since: Option<i64>,
    /// Only this run.
    #[arg(long)]
    pub run: Option<String>,
    /// Only this status.
    #[arg(long, value_enum)]
    pub status: Option<Status>,
    #[arg(long, default_value_t = 50)]
    pub limit: usize,
    /// Refused starts instead of scripts.
    #[arg(long)]
    pub refusals: bool,
    #[command(flatten)]
    pub a: AdminArgs,
}

const ADMIN_AFTER_HELP: &str = "\
For root and members of auth.admin_groups. Exit status: 0 ok; 2 usage; 10 set-up
failed (config, audit store); 11 the daemon does not answer; 12 permission denied;
13 no such script.";

#[derive(Args, Debug)]
pub struct ServersArgs {
    /// An MCP server over stdio, NAME=COMMAND (COMMAND is split like a shell would); repeatable.
    #[arg(long = "mcp", value_name = "NAME=COMMAND", required = true)]
    pub mcp: Vec<ServerSpec>,
    /// Override a tool's class: NAME__tool=read|write|destructive|long_task; repeatable.
    #[arg(long = "class", value_name = "NAME__tool=CLASS", value_parser = parse_class)]
    pub class: Vec<(String, ToolClass)>,
}

#[derive(Args, Debug)]
pub struct RunCmd {
    /// The Python script (- for stdin).
    pub script: PathBuf,
    #[command(flatten)]
    pub servers: ServersArgs,
    /// Write tools the script will call (NAME__tool), comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub tools: Vec<String>,
    /// Permission mode: approval (ask once for the write tools) or auto.
    #[arg(long, value_enum, default_value = "approval")]
    pub mode: PermissionMode,
    /// Mount the workspace read-only and provide no write tools.
    #[arg(long)]
    pub read_only: bool,
    /// The script's working directory (default: a fresh one, printed on stderr).
    #[arg(long)]
    pub workspace: Option<PathBuf>,
    /// Answer the approval with yes, without asking.
    #[arg(long, conflicts_with = "no")]
    pub yes: bool,
    /// Answer the approval with no, without asking.
    #[arg(long)]
    pub no: bool,
    /// Use the daemon at this socket.
    #[arg(long, conflicts_with = "embedded")]
    pub socket: Option<PathBuf>,
    /// Run the daemon in this process even if a system daemon answers.
    #[arg(long)]
    pub embedded: bool,
    /// Wall-clock limit in seconds.
    #[arg(long)]
    pub timeout: Option<u64>,
    /// Tool-call budget.
    #[arg(long)]
    pub max_calls: Option<u64>,
    /// What the script is for (shown in the approval prompt and audited).
    #[arg(long)]
    pub description: Option<String>,
    /// Print the result object as JSON instead of its text.
    #[arg(long)]
    pub json: bool,
    /// Configuration file (limits, python, sandbox; the key when using a socket).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Seconds an MCP server may take for one call before it counts as failed (engine).
    #[arg(long, default_value_t = 120)]
    pub call_timeout: u64,
}

#[derive(Args, Debug)]
pub struct ToolsCmd {
    #[command(flatten)]
    pub servers: ServersArgs,
    /// JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct DescribeCmd {
    #[command(flatten)]
    pub servers: ServersArgs,
    #[arg(long, value_enum, default_value = "approval")]
    pub mode: PermissionMode,
    #[arg(long)]
    pub read_only: bool,
    #[arg(long)]
    pub config: Option<PathBuf>,
}

#[derive(Subcommand, Debug)]
pub enum TokenCmd {
    /// Print an HS256 run token for a snapshot.
    Mint {
        /// Key file (the daemon's auth.token_key_file).
        #[arg(long)]
        key: PathBuf,
        #[arg(long)]
        run_id: String,
        /// JSON file with the authorization snapshot (- for stdin).
        #[arg(long)]
        snapshot: PathBuf,
        /// Lifetime in seconds.
        #[arg(long, default_value_t = 3600)]
        ttl: i64,
        /// Identity of the agent runner (audited).
        #[arg(long)]
        runner: Option<String>,
    },
}

impl RunCmd {
    /// How the approval is answered: `--yes`, `--no`, or asked on the terminal.
    pub fn answer(&self) -> run::Answer {
        if self.yes {
            run::Answer::Yes
        } else if self.no {
            run::Answer::No
        } else {
            run::Answer::Ask
        }
    }
}

impl ValueEnum for PermissionMode {
    fn value_variants<'a>() -> &'a [Self] {
        &[PermissionMode::Approval, PermissionMode::Auto]
    }
    fn to_possible_value(&self) -> Option<PossibleValue> {
        Some(match self {
            PermissionMode::Approval => PossibleValue::new("approval"),
            PermissionMode::Auto => PossibleValue::new("auto"),
        })
    }
}

impl ValueEnum for Status {
    fn value_variants<'a>() -> &'a [Self] {
        const ALL: [Status; 8] = {
            let f = Status::FINAL;
            [f[0], f[1], f[2], f[3], f[4], f[5], f[6], Status::Running]
        };
        &ALL
    }
    fn to_possible_value(&self) -> Option<PossibleValue> {
        Some(PossibleValue::new(self.as_str()))
    }
}

fn parse_class(s: &str) -> Result<(String, ToolClass), String> {
    let (name, class) = s.split_once('=').ok_or("expected NAME__tool=CLASS")?;
    let class: ToolClass = serde_json::from_value(serde_json::Value::String(class.into()))
        .map_err(|_| format!("unknown class {class:?}: read, write, destructive or long_task"))?;
    Ok((name.to_string(), class))
}

fn read_input(p: &std::path::Path) -> std::io::Result<String> {
    if p.as_os_str() == "-" {
        std::io::read_to_string(std::io::stdin())
    } else {
        std::fs::read_to_string(p)
    }
}

fn admin_cmd(
    name: &str,
    a: &AdminArgs,
    f: impl FnOnce(&admin::Ctx) -> Result<String, Failure>,
) -> ExitCode {
    done(
        name,
        admin::Ctx::load(a.socket.clone(), a.config.clone()).and_then(|ctx| f(&ctx)),
    )
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// Print the output, or the failure and its exit status.
fn done(cmd: &str, r: Result<String, Failure>) -> ExitCode {
    match r {
        Ok(out) => {
            print!("{out}");
            ExitCode::SUCCESS
        }
        Err(f) => {
            eprintln!("scriptgate {cmd}: {}", f.message);
            ExitCode::from(f.code)
        }
    }
}

/// `scriptgate run`: the result's text (or JSON), and its status as the exit status.
fn run_cmd(c: RunCmd) -> ExitCode {
    let json = c.json;
    let rt = runtime();
    let r = rt.block_on(run::run(c));
    rt.shutdown_timeout(std::time::Duration::from_secs(1));
    match r {
        Ok(result) => {
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&result).unwrap_or_default()
                );
            } else {
                print!("{}", result.text);
            }
            ExitCode::from(exit::for_status(result.status))
        }
        Err(f) => done("run", Err(f)),
    }
}

fn audit_cmd(c: AuditCmd) -> ExitCode {
    let q = crate::audit::Query {
        since_ms: c.since,
        run_id: c.run.clone(),
        status: c.status.map(|s| s.as_str().to_string()),
        limit: c.limit,
    };
    admin_cmd("audit", &c.a, |ctx| {
        admin::audit(ctx, q, c.refusals, c.a.json)
    })
}

/// `scriptgate prune [--dry-run]`: one retention pass, each workspace on a line.
fn prune_cmd(c: PruneCmd) -> ExitCode {
    let r = admin::Ctx::load(None, c.config.clone()).and_then(|ctx| {
        let ws = &ctx.config.workspace;
        if ws.retain_days == 0 {
            return Ok("workspace.retain_days = 0: workspaces are kept\n".to_string());
        }
        let reader = ctx.reader()?;
        let busy = reader
            .running_workspaces()
            .map_err(|e| Failure::setup(e.to_string()))?;
        // Only what the daemon recorded as scriptgate's own (crate::prune).
        let vouched = reader
            .vouched_workspaces()
            .map_err(|e| Failure::setup(e.to_string()))?;
        // A script running in the workspace or in a directory below it.
        let in_use =
            |p: &std::path::Path| busy.iter().any(|b| std::path::Path::new(b).starts_with(p));
        let (plan, failed) = if c.dry_run {
            let now = crate::audit::now_ms();
            (
                crate::prune::plan(&ws.roots, &vouched, ws.retain_days, now, &in_use),
                vec![],
            )
        } else {
            crate::prune::run_pass(&ws.roots, &vouched, ws.retain_days, &in_use)
        };
        Ok(crate::prune::report(
            &plan,
            &failed,
            ws.retain_days,
            c.dry_run,
        ))
    });
    done("prune", r)
}

/// `scriptgate metrics`: the text on stdout, or written to `--output`.
fn metrics_cmd(c: MetricsCmd) -> ExitCode {
    let r = admin::Ctx::load(None, c.config.clone()).and_then(|ctx| {
        // Before the first script there is no audit store yet: every counter is 0
        // (a scrape must not fail on a fresh installation).
        let source = if ctx.config.state.dir.join("scriptgate.db").exists() {
            let reader = ctx.reader()?;
            crate::metrics::collect(&reader, &ctx.config.state.dir).map_err(Failure::setup)?
        } else {
            ctx.reader_allowed()?;
            crate::metrics::Source::fresh(&ctx.config.state.dir)
        };
        let text = crate::metrics::render(&source);
        match &c.output {
            None => Ok(text),
            Some(p) => crate::metrics::write_atomically(p, &text, 0o644)
                .map(|()| String::new())
                .map_err(|e| Failure::setup(format!("{}: {e}", p.display()))),
        }
    });
    done("metrics", r)
}

/// `scriptgate token mint`: the token on stdout.
fn mint_cmd(
    key: PathBuf,
    run_id: String,
    snapshot: PathBuf,
    ttl: i64,
    runner: Option<String>,
) -> ExitCode {
    let r = (|| -> Result<String, String> {
        let key = crate::config::read_key_file(&key).map_err(|e| e.to_string())?;
        let text = read_input(&snapshot).map_err(|e| format!("{}: {e}", snapshot.display()))?;
        let snap: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| format!("{}: {e}", snapshot.display()))?;
        crate::token::mint(&key, &run_id, runner.as_deref(), &snap, ttl).map_err(|e| e.message)
    })();
    done("token mint", r.map(|t| t + "\n").map_err(Failure::usage))
}

pub fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Run(c) => run_cmd(c),
        Cmd::Tools(c) => done(
            "tools",
            runtime().block_on(run::list_tools(&c.servers.mcp, &c.servers.class, c.json)),
        ),
        Cmd::Describe(c) => done(
            "describe",
            runtime().block_on(run::describe(
                &c.servers.mcp,
                &c.servers.class,
                c.mode,
                c.read_only,
                c.config.as_deref(),
            )),
        ),
        Cmd::Status(a) => admin_cmd("status", &a, |ctx| admin::status(ctx, a.json)),
        Cmd::Ps(a) => admin_cmd("ps", &a, |ctx| admin::ps(ctx, a.json)),
        Cmd::Show { id, a } => admin_cmd("show", &a, |ctx| admin::show(ctx, &id, a.json)),
        Cmd::Cancel { id, a } => admin_cmd("cancel", &a, |ctx| admin::cancel(ctx, &id, a.json)),
        Cmd::Audit(c) => audit_cmd(c),
        Cmd::Metrics(c) => metrics_cmd(c),
        Cmd::Prune(c) => prune_cmd(c),
        Cmd::Completions { shell } => completions::print(shell),
        Cmd::Token(TokenCmd::Mint {
            key,
            run_id,
            snapshot,
            ttl,
            runner,
        }) => mint_cmd(key, run_id, snapshot, ttl, runner),
    }
}
