//! `scriptgate`'s command line: the subcommands and their arguments (clap), and
//! how the approval flags answer.

use crate::cli::mcp::ServerSpec;
use crate::protocol::snapshot::{PermissionMode, ToolClass};
use crate::protocol::Status;
use clap::builder::PossibleValue;
use clap::{Args, Parser, Subcommand, ValueEnum};
use std::path::PathBuf;

/// The shells whose completion directories the packages fill.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Shell {
    Bash,
    Zsh,
    Fish,
}

/// How `scriptgate run` answers an approval: `--yes`, `--no`, or asked on the
/// terminal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApprovalChoice {
    Yes,
    No,
    Ask,
}

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
    /// Serve code mode to an MCP client: an MCP server (stdio) whose run_script tool runs scripts against these MCP servers.
    Mcp(McpCmd),
    /// Run tokens (the reference for engine authors).
    #[command(subcommand)]
    Token(TokenCmd),
    /// The daemon: its state, version, backend, sandbox, limits, running scripts.
    #[command(after_help = STATUS_AFTER_HELP)]
    Status(StatusArgs),
    /// Running scripts (admin; your own with --embedded).
    Ps(AdminArgs),
    /// One script's whole record, artifact paths and result text (admin; your
    /// own with --embedded); with --calls, its tool calls and their arguments.
    Show {
        id: String,
        /// The script's calls as logged in calls.jsonl (read by the daemon).
        #[arg(long)]
        calls: bool,
        /// With --calls: from this call (0-based; the next page's is printed).
        #[arg(long, value_name = "N", requires = "calls", default_value_t = 0)]
        offset: u64,
        /// With --calls: at most this many calls (at most 200, the default).
        #[arg(long, value_name = "N", requires = "calls")]
        limit: Option<usize>,
        #[command(flatten)]
        a: AdminArgs,
    },
    /// Cancel a running script (admin; your own with --embedded).
    Cancel {
        id: String,
        #[command(flatten)]
        a: AdminArgs,
    },
    /// Query the audit store; works with the daemon down (admin; your own with --embedded).
    Audit(AuditCmd),
    /// Print a shell completion script (bash, zsh or fish) on stdout.
    Completions {
        #[arg(value_enum)]
        shell: Shell,
    },
    /// Prometheus metrics from the audit store; works with the daemon down (admin).
    Metrics(MetricsCmd),
    /// Remove the workspaces scriptgate created and nothing used for
    /// workspace.retain_days (admin; the daemon also does it hourly).
    Prune(PruneCmd),
}

#[derive(Args, Debug)]
pub struct PruneCmd {
    /// Only show what would be removed: every recorded workspace with its
    /// engine, owner, last use, age, size and what will happen to it and when.
    #[arg(long)]
    pub dry_run: bool,
    /// With --dry-run: judge retention as of DATE (2027-01-31,
    /// 2027-01-31T07:00:00Z) or a duration ahead (+40d) instead of now.
    #[arg(long, value_name = "DATE", requires = "dry_run", value_parser = crate::time::as_of_arg)]
    pub as_of: Option<i64>,
    /// The answers as JSON (exact): [{"part": "system" | "embedded", "pruned": …}].
    #[arg(long)]
    pub json: bool,
    /// The daemon's socket (an administrator who is not root prunes through it).
    #[arg(long, value_name = "PATH")]
    pub socket: Option<PathBuf>,
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

/// Options of `scriptgate status`.
#[derive(Args, Debug)]
pub struct StatusArgs {
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

/// Options of the record commands (`ps`, `show`, `cancel`, `audit`).
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
    /// Your own records: those of `scriptgate run` and `scriptgate mcp` with the
    /// daemon in their own process (~/.local/state/scriptgate; root's in
    /// STATE/cli). The default for a user other than root where no system
    /// daemon is installed.
    #[arg(long, conflicts_with = "socket")]
    pub embedded: bool,
}

#[derive(Args, Debug)]
#[command(args_conflicts_with_subcommands = true)]
pub struct AuditCmd {
    #[command(subcommand)]
    pub action: Option<AuditAction>,
    /// Only scripts started since: a duration (30m, 2h, 7d) or a date (2026-11-30, 2026-11-30T07:00:00Z).
    #[arg(long, value_parser = crate::time::since_arg)]
    pub since: Option<i64>,
    /// Only this run.
    #[arg(long)]
    pub run: Option<String>,
    /// Only this status.
    #[arg(long, value_enum)]
    pub status: Option<Status>,
    /// Only scripts an engine of this uid started, or that ran as it.
    #[arg(long, value_name = "UID", conflicts_with = "user")]
    pub uid: Option<u32>,
    /// As --uid, by the user's name.
    #[arg(long, value_name = "NAME")]
    pub user: Option<String>,
    /// Only scripts the engine of this user (a name or a uid) started, and its
    /// refused starts.
    #[arg(long, value_name = "USER")]
    pub engine: Option<String>,
    #[arg(long, default_value_t = 50)]
    pub limit: usize,
    /// Refused starts instead of scripts.
    #[arg(long)]
    pub refusals: bool,
    /// With --refusals: the connections refused at the socket instead, counted
    /// per minute, uid and reason.
    #[arg(long, requires = "refusals")]
    pub connections: bool,
    /// The audit store's size (its files' bytes, rows, oldest record) and its
    /// growth (scripts a day over the last 7 days) instead.
    #[arg(long, conflicts_with = "refusals")]
    pub stats: bool,
    /// The fleet's trail instead, from the journal: each script's "started" and
    /// "finished" entries (uid 0's) paired, on every host whose journal is
    /// merged here (journalctl --merge, or --directory), those started with no
    /// end received past their timeout listed as lost. No daemon, no store.
    #[arg(long, conflicts_with_all = ["refusals", "stats", "embedded", "socket", "config"])]
    pub journal: bool,
    /// With --journal: read the journal files in DIR (systemd-journal-remote's
    /// output directory, say) instead of this host's.
    #[arg(long, value_name = "DIR", requires = "journal")]
    pub directory: Option<PathBuf>,
    /// With --journal: only the scripts of this host (the entries' _HOSTNAME).
    #[arg(long, value_name = "HOST", requires = "journal")]
    pub host: Option<String>,
    /// With --journal: only the scripts lost (started, no end received by their
    /// timeout and two minutes).
    #[arg(long, requires = "journal")]
    pub lost: bool,
    /// With --journal: the trail as of DATE or +DURATION (default: now): what
    /// started or ended later is left out, and running or lost is judged then.
    #[arg(long, value_name = "DATE", requires = "journal", value_parser = crate::time::as_of_arg)]
    pub as_of: Option<i64>,
    #[command(flatten)]
    pub a: AdminArgs,
}

#[derive(Subcommand, Debug)]
pub enum AuditAction {
    /// Copy the audit store to FILE: consistent while the daemon runs (SQLite's
    /// online backup), one self-contained file, 0600, never over a file that
    /// exists. To restore, see scriptgated(8), BACKUP.
    Backup {
        /// Where the copy goes (a new file).
        file: PathBuf,
        /// The daemon's configuration (state.dir, auth.admin_groups).
        #[arg(long, value_name = "FILE")]
        config: Option<PathBuf>,
    },
}

const STATUS_AFTER_HELP: &str = "\
Exit status, as the state row says (like systemctl is-system-running): 0 ok;
14 degraded (scripts run, but their limits are not in force, the scripts of one uid
share them (backend rlimit), the sandbox was not checked, or the backend is not as
configured); 15 unavailable (no script can run: the sandbox cannot be made, or
sandbox.require_enforced_limits is on and the limits are not in force). Else as the other admin commands: 10 set-up failed, 11 the daemon
does not answer, 12 permission denied.";

const ADMIN_AFTER_HELP: &str = "\
For root and members of auth.admin_groups; with --embedded (the default for a user
other than root where no system daemon is installed), each user's own records of
scriptgate run and scriptgate mcp in their own process. Exit status: 0 ok; 2 usage;
10 set-up failed (config, audit store); 11 the daemon does not answer; 12 permission
denied; 13 no such script.";

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

/// `scriptgate mcp`'s default `--call-timeout` (seconds).
pub const MCP_CALL_TIMEOUT_S: u64 = 120;

/// `scriptgate mcp`'s arguments.
#[derive(Args, Debug)]
pub struct McpCmd {
    #[command(flatten)]
    pub servers: ServersArgs,
    /// Declared write tools: approval (ask the user once per script, through MCP
    /// elicitation; denied when the client cannot be asked) or auto (allowed).
    #[arg(long, value_enum, default_value = "approval")]
    pub mode: PermissionMode,
    /// Also offer the upstream tools directly (NAME__tool), so that this server can
    /// replace the upstream ones in the client's config.
    #[arg(long)]
    pub passthrough: bool,
    /// Use the daemon at this socket.
    #[arg(long, conflicts_with = "embedded")]
    pub socket: Option<PathBuf>,
    /// Run scripts in an embedded daemon in this process even if a system daemon answers.
    #[arg(long)]
    pub embedded: bool,
    /// At start, wait up to SECONDS for the daemon's socket to exist and answer
    /// (a gateway started before its node's daemon); 0, the default, fails at once.
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 0,
        conflicts_with = "embedded"
    )]
    pub wait: u64,
    /// Configuration file (limits, python, sandbox; the key when using a socket).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Seconds an MCP server may take for one call before it counts as failed.
    #[arg(long, default_value_t = MCP_CALL_TIMEOUT_S)]
    pub call_timeout: u64,
    /// Seconds a call waits for its script before answering with an MCP task,
    /// where the request declares the tasks extension (2026-07-28); 0: at once.
    #[arg(long, value_name = "SECONDS", default_value_t = 10)]
    pub task_after: u64,
    /// Speak MCP's Streamable HTTP at http://ADDR/mcp instead of stdio; loopback
    /// addresses only (127.0.0.1:PORT, [::1]:PORT; port 0 picks one, printed on stderr).
    /// Every request needs the bearer token printed at start.
    #[arg(long, value_name = "ADDR")]
    pub http: Option<std::net::SocketAddr>,
    /// Print the mcpServers entry that starts this server with these options, with
    /// absolute paths (this binary; files named in the --mcp commands, --config,
    /// --socket), for an MCP client's configuration; start nothing.
    #[arg(long, conflicts_with = "http")]
    pub print_config: bool,
    /// --http's bearer token is in this file (made, mode 0600, if missing)
    /// instead of mcp-http.token in the state directory.
    #[arg(long, value_name = "PATH", requires = "http")]
    pub token_file: Option<PathBuf>,
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
    pub fn answer(&self) -> ApprovalChoice {
        if self.yes {
            ApprovalChoice::Yes
        } else if self.no {
            ApprovalChoice::No
        } else {
            ApprovalChoice::Ask
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

pub(crate) fn parse_class(s: &str) -> Result<(String, ToolClass), String> {
    let (name, class) = s.split_once('=').ok_or("expected NAME__tool=CLASS")?;
    let class: ToolClass = serde_json::from_value(serde_json::Value::String(class.into()))
        .map_err(|_| format!("unknown class {class:?}: read, write, destructive or long_task"))?;
    Ok((name.to_string(), class))
}
