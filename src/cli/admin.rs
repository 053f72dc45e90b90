//! The sysadmin commands: `status`, `ps`, `show`, `cancel`, `audit`, `prune`. Live
//! state comes from the daemon over its socket (`daemon.info`, `admin.list`,
//! `admin.cancel`), and so does what only root can read: a script's calls
//! (`admin.calls`) and the engines' private workspaces (`admin.prune`); records
//! come from the audit store, read-only, so they work with the daemon down.
//!
//! `audit`, `show`, `ps` and `cancel` read a user's own records instead (an
//! embedded daemon's store: `scriptgate run` and `scriptgate mcp` with the
//! daemon in their own process) with `--embedded`, or by default for a user
//! other than root where no system daemon is installed (`target::choose_records`).
//! Such a daemon answers no one but its own process: `ps` lists the rows that
//! say `running` and looks at their processes in /proc, `show --calls` reads
//! calls.jsonl itself, and `cancel` kills the script's sandbox (`cancel_embedded`).

use super::args::AdminArgs;
use super::exit::{self, Failure};
use super::table::{pairs, table};
use crate::audit::{Query, Reader};
use crate::config::{Config, DEFAULT_PATH};
use crate::protocol::rpc::BoxFuture;
use crate::protocol::rpc::{self, Bounds, CallError};
use crate::protocol::{
    AdminList, CallsPage, CallsParams, DaemonInfo, ListedScript, Method, PruneParams, Pruned,
    Resources, RpcError, ScriptRef, ScriptState,
};
use crate::time::{human_ms, rfc3339};
use serde::Serialize;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// How long the daemon may take to answer an admin request.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(60);

pub struct Ctx {
    pub socket: PathBuf,
    pub config: Config,
    /// The embedded daemon's state directory whose store `audit`, `show`,
    /// `ps` and `cancel` read (`Ctx::records`); None: the system daemon's.
    pub embedded: Option<PathBuf>,
    /// A record command of a user other than root on the system's records: a
    /// refusal says how to read their own (`OWN_RECORDS_HINT`).
    hint_own: bool,
}

/// The admin client asks; the daemon has nothing to ask of it.
struct AsksNothing;

impl rpc::Handler for AsksNothing {
    fn request(
        self: Arc<Self>,
        _method: String,
        _params: Value,
    ) -> BoxFuture<'static, Result<Value, RpcError>> {
        Box::pin(std::future::ready(Err(RpcError::new(
            crate::protocol::code::METHOD_NOT_FOUND,
            "the admin client serves no methods",
        ))))
    }
}

impl Ctx {
    pub fn load(socket: Option<PathBuf>, config: Option<PathBuf>) -> Result<Ctx, Failure> {
        let (path, explicit) = match config {
            Some(p) => (p, true),
            None => (PathBuf::from(DEFAULT_PATH), false),
        };
        let config = Config::load(&path, explicit).map_err(|e| Failure::setup(e.to_string()))?;
        Ok(Ctx {
            socket: socket.unwrap_or_else(super::target::system_socket),
            config,
            embedded: None,
            hint_own: false,
        })
    }

    /// The context of a record command (`audit`, `show`, `ps`, `cancel`): the
    /// system daemon's store, or the caller's embedded one
    /// (`target::choose_records`), which one line on stderr names.
    pub fn records(a: &AdminArgs) -> Result<Ctx, Failure> {
        use super::target::{choose_records, Facts, Records};
        let mut ctx = Ctx::load(a.socket.clone(), a.config.clone())?;
        let named = a.socket.is_some() || a.config.is_some();
        let root = nix::unistd::Uid::effective().is_root();
        match choose_records(a.embedded, named, root, &Facts::gather()) {
            Records::Embedded(why) => {
                let (dir, _) = super::run::embedded_dirs(&ctx.config, false)?;
                eprintln!(
                    "scriptgate: records: the embedded daemon's store of uid {}, {} ({why})",
                    nix::unistd::Uid::effective(),
                    dir.join("scriptgate.db").display()
                );
                ctx.embedded = Some(dir);
            }
            Records::System => ctx.hint_own = !root,
        }
        Ok(ctx)
    }

    /// A refusal of the system's records, with the way to one's own where it helps.
    fn refused(&self, mut f: Failure) -> Failure {
        if self.hint_own && f.code == exit::NOT_PERMITTED {
            f.message.push_str(OWN_RECORDS_HINT);
        }
        f
    }

    /// One request to the daemon; notifications in between are ignored.
    fn call<P: Serialize>(&self, method: Method, params: &P) -> Result<Value, Failure> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| Failure::setup(format!("tokio runtime: {e}")))?;
        rt.block_on(self.call_async(method, params))
            .map_err(|f| self.refused(f))
    }

    async fn call_async<P: Serialize>(&self, method: Method, params: &P) -> Result<Value, Failure> {
        let stream = rpc::connect_unix(&self.socket)
            .await
            .map_err(|e| self.connect_failed(e))?;
        self.request_on(stream, method, params, Some(ANSWER_TIMEOUT))
            .await
    }

    /// One request, when the daemon can be connected to: `Ok(None)` when it
    /// cannot (not running), with no bound on the answer's time (a prune pass
    /// is bounded by its own bounds).
    fn call_if_running<P: Serialize>(
        &self,
        method: Method,
        params: &P,
    ) -> Result<Option<Value>, Failure> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| Failure::setup(format!("tokio runtime: {e}")))?;
        rt.block_on(async {
            let stream = match rpc::connect_unix(&self.socket).await {
                Ok(s) => s,
                Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
                    return Err(self.connect_failed(e))
                }
                Err(_) => return Ok(None),
            };
            self.request_on(stream, method, params, None)
                .await
                .map(Some)
        })
    }

    async fn request_on<P: Serialize>(
        &self,
        stream: tokio::net::UnixStream,
        method: Method,
        params: &P,
        timeout: Option<Duration>,
    ) -> Result<Value, Failure> {
        let (read, write) = stream.into_split();
        let (peer, _writer) = rpc::Endpoint::new(write);
        let reader = {
            let (peer, bounds) = (
                peer.clone(),
                Bounds::client(self.config.server.max_message_bytes),
            );
            tokio::spawn(async move { peer.serve(read, &bounds, Arc::new(AsksNothing)).await })
        };
        let r = peer.request(method.name(), params, timeout).await;
        reader.abort();
        r.map_err(|e| match e {
            CallError::Answered(e) | CallError::Closed(e) => Failure::admin(&e),
            CallError::Disconnected | CallError::Timeout { .. } => Failure::new(
                exit::DAEMON_DOWN,
                format!(
                    "{}: the daemon closed the connection",
                    self.socket.display()
                ),
            ),
        })
    }

    fn connect_failed(&self, e: std::io::Error) -> Failure {
        match e.kind() {
            std::io::ErrorKind::PermissionDenied => Failure::new(
                exit::NOT_PERMITTED,
                format!(
                    "permission denied: {}: {e} (root and members of {:?} or {:?} may connect; is the socket unit's SocketMode=0666?)",
                    self.socket.display(),
                    self.config.auth.allowed_groups,
                    self.config.auth.admin_groups
                ),
            ),
            _ => Failure::new(
                exit::DAEMON_DOWN,
                format!("daemon not running: {}: {e}", self.socket.display()),
            ),
        }
    }

    /// The audit store, for root and members of `auth.admin_groups` only; or
    /// the caller's embedded one (`Ctx::records`), which is theirs.
    pub(crate) fn reader(&self) -> Result<Reader, Failure> {
        if let Some(dir) = &self.embedded {
            let db = dir.join("scriptgate.db");
            if !db.exists() {
                return Err(Failure::setup(format!(
                    "uid {} has no embedded records: {} has no audit store yet (scriptgate run and \
                     scriptgate mcp make it when they run a script with the daemon in their own \
                     process: with --embedded, or where no system daemon is installed)",
                    nix::unistd::Uid::effective(),
                    dir.display()
                )));
            }
            return Reader::open(&db).map_err(|e| Failure::setup(e.to_string()));
        }
        self.reader_allowed().map_err(|f| self.refused(f))?;
        let db = self.config.state.dir.join("scriptgate.db");
        Reader::open(&db).map_err(|e| Failure::setup(e.to_string()))
    }

    /// The caller may read the audit store (root or an admin group).
    pub(crate) fn reader_allowed(&self) -> Result<(), Failure> {
        let (uid, gid) = (
            nix::unistd::getuid().as_raw(),
            nix::unistd::getgid().as_raw(),
        );
        if !crate::sys::peer_in_groups(uid, gid, &self.config.auth.admin_groups) {
            return Err(Failure::new(
                exit::NOT_PERMITTED,
                format!(
                    "permission denied: the audit store is for root and members of {:?}",
                    self.config.auth.admin_groups
                ),
            ));
        }
        Ok(())
    }
}

/// Said to a user other than root whom the system daemon's records are refused.
const OWN_RECORDS_HINT: &str = "; your own records, of scriptgate run and scriptgate mcp \
    with the daemon in their own process, are read with --embedded";

/// An answer of the daemon as its type.
fn typed<T: serde::de::DeserializeOwned>(method: Method, v: Value) -> Result<T, Failure> {
    serde_json::from_value(v).map_err(|e| {
        Failure::new(
            exit::ERROR,
            format!("unexpected answer to {}: {e}", method.name()),
        )
    })
}

/// No params.
#[derive(Serialize)]
struct NoParams {}

fn s(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn pretty<T: Serialize + ?Sized>(v: &T) -> String {
    serde_json::to_string_pretty(v).unwrap_or_default() + "\n"
}

/// What `scriptgate status` says of the daemon, in the manner of
/// `systemctl is-system-running`: its word and exit status, and what makes it so
/// (each cause once, named by the row that says it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct State {
    pub word: &'static str,
    pub code: u8,
    pub why: Vec<&'static str>,
}

/// Pure: the state of a daemon that reports `info`, whose limits must be in
/// force when `limits_required` (`sandbox.require_enforced_limits`).
pub fn state_of(info: &DaemonInfo, limits_required: bool) -> State {
    let sandbox = info.sandbox.as_ref().map(|s| s.state.as_str());
    let unavailable = |why| State {
        word: "unavailable",
        code: exit::UNAVAILABLE,
        why: vec![why],
    };
    if sandbox == Some("unavailable") {
        return unavailable("no script can run: the sandbox cannot be made (see sandbox)");
    }
    if limits_required && info.limits_enforced == Some(false) {
        return unavailable(
            "no script can run: the limits sandbox.require_enforced_limits requires are not in force (see backend)",
        );
    }
    let mut why = vec![];
    if sandbox.is_some_and(|s| s != "ok") {
        why.push("the sandbox was not checked at start (see sandbox)");
    }
    if info.limits_enforced == Some(false) {
        why.push("limits are not in force (see backend)");
    }
    if info.backend != "rlimit" && info.all_scripts.as_ref().is_some_and(|a| !a.in_force) {
        why.push("the bound on all scripts together is not in force (see total)");
    }
    if info.backend == "rlimit" {
        why.push("the scripts of one uid share their limits (backend rlimit)");
    } else if !info.backend_notes.is_empty() && info.limits_enforced != Some(false) {
        why.push("the backend is not as configured (see backend)");
    }
    match why.is_empty() {
        true => State {
            word: "ok",
            code: exit::OK,
            why,
        },
        false => State {
            word: "degraded",
            code: exit::DEGRADED,
            why,
        },
    }
}

/// `scriptgate status`: the text, and the exit status of the daemon's state.
pub fn status(ctx: &Ctx, json_out: bool) -> Result<(String, u8), Failure> {
    let raw = ctx.call(Method::DaemonInfo, &NoParams {})?;
    let required = ctx.config.sandbox.require_enforced_limits;
    if json_out {
        // The daemon's answer as it came, even one this CLI cannot type.
        let state = serde_json::from_value::<DaemonInfo>(raw.clone())
            .map(|i| state_of(&i, required))
            .unwrap_or(State {
                word: "unknown",
                code: exit::OK,
                why: vec!["this daemon's daemon.info is not one this scriptgate reads"],
            });
        #[derive(Serialize)]
        struct Out<'a> {
            socket: &'a Path,
            state: &'a str,
            why: &'a [&'a str],
            daemon: &'a Value,
            store: &'a Value,
            restart: &'a Value,
        }
        let (_, extras) = status_extras(ctx);
        let out = pretty(&Out {
            socket: &ctx.socket,
            state: state.word,
            why: &state.why,
            daemon: &raw,
            store: &extras["store"],
            restart: &extras["restart"],
        });
        return Ok((out, state.code));
    }
    let info: DaemonInfo = typed(Method::DaemonInfo, raw)?;
    let state = state_of(&info, required);
    let l = &info.limits;
    let backend = if info.backend_notes.is_empty() {
        info.backend.clone()
    } else {
        format!("{} ({})", info.backend, info.backend_notes.join("; "))
    };
    // The preflight's word: limits not in force, and the sandbox, loudly.
    let backend = match info.limits_enforced {
        Some(false) => format!("{backend}; LIMITS NOT ENFORCED"),
        _ => backend,
    };
    // The diagnosis says "sandbox unavailable: …" itself: it is the row's value.
    let sandbox = match &info.sandbox {
        None => "not reported by this daemon".to_string(),
        Some(s) => match (&s.problem, &s.detail) {
            (Some(p), Some(d)) => format!("{p} (bwrap said: {})", d.replace('\n', " / ")),
            (Some(p), None) => p.clone(),
            _ => format!(
                "{} (nested user namespaces refused by: {})",
                s.state, s.nested_userns
            ),
        },
    };
    let state_row = match state.why.as_slice() {
        [] => state.word.to_string(),
        why => format!("{}: {}", state.word, why.join("; ")),
    };
    let since = info.started_ms.map_or(String::new(), |t| {
        let up = crate::time::now_ms().saturating_sub(t).max(0) as u64;
        format!(" since {} (up {})", rfc3339(t), human_ms(up))
    });
    let rows = vec![
        vec![
            "daemon".into(),
            format!("running at {}{since}", ctx.socket.display()),
        ],
        vec!["state".into(), state_row],
        vec!["version".into(), format!("{} (protocol {})", info.version, info.protocol)],
        vec!["backend".into(), backend],
        vec!["sandbox".into(), sandbox],
        vec!["running".into(), format!("{} of {}", info.running, l.max_running)],
        vec![
            "limits".into(),
            format!(
                "max_calls {}, max_concurrency {}, timeout_s {}, memory {} MiB, tasks {}, return_max_chars {}",
                l.max_calls,
                l.max_concurrency,
                l.timeout_s,
                l.memory_max_bytes >> 20,
                l.tasks_max,
                l.return_max_chars
            ),
        ],
    ];
    let mut rows = rows;
    if let Some(d) = &info.disk {
        rows.push(vec!["disk".into(), crate::daemon::disk::summary(d)]);
    }
    if let Some(a) = &info.all_scripts {
        rows.push(vec!["total".into(), crate::limits::aggregate::summary(a)]);
    }
    if let Some(p) = &info.pool {
        rows.push(vec![
            "pool".into(),
            format!(
                "{} pre-made sandboxes waiting ({} per script uid, at most {} in all)",
                p.waiting, p.size, p.max_members
            ),
        ]);
    }
    if let Some(c) = &info.config {
        rows.extend(config_rows(c));
    }
    rows.extend(status_extras(ctx).0);
    Ok((pairs(&rows), state.code))
}

pub fn ps(ctx: &Ctx, json_out: bool) -> Result<String, Failure> {
    if let Some(dir) = &ctx.embedded {
        return ps_embedded(ctx, dir, json_out);
    }
    let raw = ctx.call(Method::AdminList, &NoParams {})?;
    if json_out {
        return Ok(pretty(&raw));
    }
    let list: AdminList = typed(Method::AdminList, raw)?;
    let mut rows: Vec<Vec<String>> = list
        .scripts
        .iter()
        .map(|x| {
            let progress = match &x.status.progress {
                None => "-".into(),
                Some(p) => format!("{}/{} {}", p.done, p.total, p.message),
            };
            let r = x.resources.clone().unwrap_or_default();
            vec![
                x.status.script_id.clone(),
                x.run_id.clone(),
                uid_name(&Value::from(x.uid)),
                human_ms(x.age_ms),
                x.status.calls.to_string(),
                x.status.failures.to_string(),
                bytes(r.memory_bytes),
                bytes(r.memory_peak_bytes),
                r.cpu_usec
                    .map(|u| format!("{:.2}s", u as f64 / 1e6))
                    .unwrap_or_else(|| "-".into()),
                r.tasks.map(|t| t.to_string()).unwrap_or_else(|| "-".into()),
                progress.trim_end().to_string(),
                x.unit.clone().unwrap_or_else(|| "-".into()),
            ]
        })
        .collect();
    rows.sort();
    Ok(table(
        &[
            "ID", "RUN", "UID", "AGE", "CALLS", "FAILS", "MEM", "PEAK", "CPU", "TASKS", "PROGRESS",
            "UNIT",
        ],
        &rows,
    ))
}

/// A byte count as people read it (`14.0M`), or `-` when unknown.
fn bytes(b: Option<u64>) -> String {
    let Some(b) = b else { return "-".into() };
    match b {
        b if b >= 1 << 30 => format!("{:.1}G", b as f64 / (1u64 << 30) as f64),
        b if b >= 1 << 20 => format!("{:.1}M", b as f64 / (1u64 << 20) as f64),
        b if b >= 1 << 10 => format!("{:.1}K", b as f64 / 1024.0),
        b => format!("{b}B"),
    }
}

pub fn cancel(ctx: &Ctx, id: &str, json_out: bool) -> Result<String, Failure> {
    if let Some(dir) = &ctx.embedded {
        return cancel_embedded(ctx, dir, id, json_out);
    }
    let r = ScriptRef {
        script_id: id.to_string(),
        timeout_s: None,
        token: None,
    };
    let raw = ctx.call(Method::AdminCancel, &r)?;
    if json_out {
        if raw["already_finished"] == Value::Bool(true) {
            // The JSON on stdout, the exit status as without --json.
            print!("{}", pretty(&raw));
            return cancel_outcome(&typed(Method::AdminCancel, raw)?);
        }
        return Ok(pretty(&raw));
    }
    let st: ScriptState = typed(Method::AdminCancel, raw)?;
    cancel_outcome(&st)
}

/// What `scriptgate cancel` says: a script that had already ended is not
/// reported as cancelled (exit 13, like a script that is not there to cancel).
fn cancel_outcome(st: &ScriptState) -> Result<String, Failure> {
    if st.already_finished {
        return Err(Failure::new(
            exit::NOT_FOUND,
            format!(
                "script {} had already finished ({}); nothing to cancel",
                st.script_id,
                st.state.as_str()
            ),
        ));
    }
    Ok(match st.state {
        crate::protocol::Status::Cancelled => format!("{}: cancelled\n", st.script_id),
        other => format!(
            "{}: finished ({}) before the cancel took effect\n",
            st.script_id,
            other.as_str()
        ),
    })
}

/// Where the record commands look at an embedded daemon's processes.
const PROC: &str = "/proc";

/// Rows that say `running` that `ps` lists from an embedded store, at most.
const PS_MAX_ROWS: usize = 1000;

/// The process that holds a running row's embedded daemon (`scriptgate run`
/// or `scriptgate mcp`: the row's `peer_pid`), as /proc shows it now.
#[derive(Debug, Clone, Serialize)]
struct DaemonProcess {
    pid: u32,
    /// It lives, holds the store open and started before the script
    /// (`audit::live::held_by`); otherwise the script is not running, whatever
    /// its row says.
    alive: bool,
    /// `scriptgate run` or `scriptgate mcp`, when alive and one of them.
    command: Option<&'static str>,
}

impl DaemonProcess {
    fn of(row: &Value, db: &Path) -> Option<DaemonProcess> {
        let pid = row["peer_pid"]
            .as_u64()
            .and_then(|p| u32::try_from(p).ok())
            .filter(|p| *p > 0)?;
        let started = row["started_at"].as_i64().unwrap_or(0);
        // This process holds the store open too (to read it): a row naming its
        // pid is an older process's.
        let alive = pid != std::process::id()
            && crate::audit::live::held_by(Path::new(PROC), pid, db, started);
        let command = alive.then(|| subcommand(pid)).flatten();
        Some(DaemonProcess {
            pid,
            alive,
            command,
        })
    }

    fn named(&self) -> String {
        match self.command {
            Some(c) => format!("{c} (pid {})", self.pid),
            None => format!("pid {}", self.pid),
        }
    }
}

/// The subcommand a scriptgate process runs, from its command line (only
/// those that hold an embedded daemon; nothing of it is printed as it is).
fn subcommand(pid: u32) -> Option<&'static str> {
    let argv = std::fs::read(format!("{PROC}/{pid}/cmdline")).ok()?;
    match argv.split(|b| *b == 0).nth(1)? {
        b"run" => Some("scriptgate run"),
        b"mcp" => Some("scriptgate mcp"),
        _ => None,
    }
}

/// A process's parent, from /proc/PID/stat (the field after the state).
fn parent(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("{PROC}/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// The children of `pid`, by a pass over /proc.
fn children(pid: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir(PROC) else {
        return vec![];
    };
    dir.flatten()
        .filter_map(|e| {
            let child: u32 = e.file_name().to_str()?.parse().ok()?;
            (parent(child)? == pid).then_some(child)
        })
        .collect()
}

/// `pid` is a bwrap that runs the sandbox init with `--chdir WORKSPACE`.
fn runs_sandbox_in(pid: u32, workspace: &str) -> bool {
    let Ok(argv) = std::fs::read(format!("{PROC}/{pid}/cmdline")) else {
        return false;
    };
    let args: Vec<&[u8]> = argv.split(|b| *b == 0).collect();
    args.windows(2)
        .any(|w| w[0] == b"--chdir" && w[1] == workspace.as_bytes())
        && args.contains(&b"--sandbox-init".as_slice())
}

/// The sandbox of the script running in `workspace` under the embedded daemon
/// in `host`: the bwrap `host` started for it (its child that runs the sandbox
/// init there), and bwrap's child, the sandbox's PID 1, once there is one.
/// None while there is no such bwrap (the script is starting or ending). One
/// workspace has one script of a process at a time (`scriptgate mcp` makes a
/// fresh one for each); two are refused rather than guessed between.
fn sandbox_of(host: u32, workspace: &str) -> Result<Option<(u32, Option<u32>)>, Failure> {
    let found: Vec<u32> = children(host)
        .into_iter()
        .filter(|&c| runs_sandbox_in(c, workspace))
        .collect();
    match found.as_slice() {
        [] => Ok(None),
        [bwrap] => Ok(Some((*bwrap, children(*bwrap).first().copied()))),
        more => Err(Failure::new(
            exit::ERROR,
            format!(
                "{} sandboxes of pid {host} run in {workspace} (pids {more:?}); none was touched",
                more.len()
            ),
        )),
    }
}

/// What a running embedded script holds now, as the daemon's `admin.list`
/// reads it for its backend: from its cgroup under a unit, else summed over
/// its sandbox's process tree.
fn usage_of(row: &Value, bwrap: u32) -> Resources {
    use crate::limits::usage;
    match row["backend"].as_str() {
        Some("rlimit") | None => usage::from_proc(Path::new(PROC), bwrap, usage::ticks_per_s()),
        Some(_) => usage::from_cgroup(Path::new("/sys/fs/cgroup"), Path::new(PROC), bwrap),
    }
}

fn store_err(e: rusqlite::Error) -> Failure {
    Failure::setup(e.to_string())
}

/// A row of `scriptgate ps` of an embedded store.
#[derive(Serialize)]
struct Listed<'a> {
    script_id: &'a Value,
    run_id: &'a Value,
    uid: &'a Value,
    started_at: &'a Value,
    age_ms: u64,
    calls: &'a Value,
    failures: &'a Value,
    backend: &'a Value,
    unit: &'a Value,
    process: Option<DaemonProcess>,
    resources: Option<Resources>,
}

/// The table rows of `ps_embedded`, and how many of them are not running (their
/// process is gone).
fn ps_rows(listed: &[Listed]) -> (Vec<Vec<String>>, usize) {
    let mut gone = 0;
    let rows = listed
        .iter()
        .map(|x| {
            let r = x.resources.clone().unwrap_or_default();
            let process = match &x.process {
                Some(h) if h.alive => h.named(),
                Some(h) => {
                    gone += 1;
                    format!("pid {} gone", h.pid)
                }
                None => "-".into(),
            };
            vec![
                s(x.script_id),
                s(x.run_id),
                uid_name(x.uid),
                human_ms(x.age_ms),
                s(x.calls),
                s(x.failures),
                bytes(r.memory_bytes),
                bytes(r.memory_peak_bytes),
                r.cpu_usec
                    .map(|u| format!("{:.2}s", u as f64 / 1e6))
                    .unwrap_or_else(|| "-".into()),
                r.tasks.map(|t| t.to_string()).unwrap_or_else(|| "-".into()),
                s(x.unit),
                process,
            ]
        })
        .collect();
    (rows, gone)
}

/// `scriptgate ps` of an embedded store: the rows that say `running` (their
/// calls and failures as of the daemon's last checkpoint, at most 2 s old),
/// each with the process that holds its daemon and, while that lives, what
/// its sandbox holds now. A row whose process is gone is not running: it is
/// listed as such (the next embedded daemon to open the store records it
/// `interrupted`).
fn ps_embedded(ctx: &Ctx, dir: &Path, json_out: bool) -> Result<String, Failure> {
    let reader = ctx.reader()?;
    let q = Query {
        status: Some("running".into()),
        limit: PS_MAX_ROWS,
        ..Default::default()
    };
    let rows = reader.scripts(&q).map_err(store_err)?;
    let db = dir.join("scriptgate.db");
    let now = crate::time::now_ms();
    let mut listed = Vec::with_capacity(rows.len());
    for r in &rows {
        let process = DaemonProcess::of(r, &db);
        let resources = match &process {
            Some(h) if h.alive => sandbox_of(h.pid, r["workspace"].as_str().unwrap_or(""))
                .ok()
                .flatten()
                .map(|(bwrap, _)| usage_of(r, bwrap)),
            _ => None,
        };
        listed.push(Listed {
            script_id: &r["script_id"],
            run_id: &r["run_id"],
            uid: &r["run_uid"],
            started_at: &r["started_at"],
            age_ms: (now - r["started_at"].as_i64().unwrap_or(now)).max(0) as u64,
            calls: &r["calls"],
            failures: &r["failures"],
            backend: &r["backend"],
            unit: &r["unit"],
            process,
            resources,
        });
    }
    if json_out {
        return Ok(pretty(
            &serde_json::json!({ "store": db, "scripts": listed }),
        ));
    }
    let (mut table_rows, gone) = ps_rows(&listed);
    table_rows.sort();
    let mut out = table(
        &[
            "ID", "RUN", "UID", "AGE", "CALLS", "FAILS", "MEM", "PEAK", "CPU", "TASKS", "UNIT",
            "PROCESS",
        ],
        &table_rows,
    );
    if gone > 0 {
        out.push_str(&format!(
            "{gone} of these {} not running: the process that ran {} is gone; the next \
             scriptgate run or scriptgate mcp in its own process records {} as interrupted\n",
            if gone == 1 { "is" } else { "are" },
            if gone == 1 { "it" } else { "them" },
            if gone == 1 { "it" } else { "them" },
        ));
    }
    if rows.len() == PS_MAX_ROWS {
        out.push_str(&format!(
            "(the first {PS_MAX_ROWS} rows that say running)\n"
        ));
    }
    Ok(out)
}

/// `scriptgate cancel` of an embedded store's script. Its daemon lives in
/// another process (`scriptgate run`, `scriptgate mcp`) and takes no requests
/// from others, so the script is ended the one way open to its user: its
/// sandbox is killed (SIGKILL to the sandbox's PID 1, which ends every process
/// in it, as the daemon's own cancel does; to bwrap itself before there is
/// one), held by pidfd once found as that process's child. The daemon there
/// then records the end as it sees it (an error: the sandbox was killed), not
/// as `cancelled`; the output says so. Exit 13 when there is nothing to cancel
/// (no such script, already finished, or its process gone).
fn cancel_embedded(ctx: &Ctx, dir: &Path, id: &str, json_out: bool) -> Result<String, Failure> {
    let db = dir.join("scriptgate.db");
    let row = ctx
        .reader()?
        .script(id)
        .map_err(store_err)?
        .ok_or_else(|| {
            Failure::new(
                exit::NOT_FOUND,
                format!("no script {id} in the audit store {}", db.display()),
            )
        })?;
    let status = row["status"].as_str().unwrap_or("-");
    if status != "running" {
        return Err(Failure::new(
            exit::NOT_FOUND,
            format!("script {id} had already finished ({status}); nothing to cancel"),
        ));
    }
    let host = DaemonProcess::of(&row, &db);
    let Some(host) = host.filter(|h| h.alive) else {
        return Err(Failure::new(
            exit::NOT_FOUND,
            format!(
                "script {id} is not running: the process that ran it (pid {}) is gone; its record \
                 says running until the next scriptgate run or scriptgate mcp in its own process \
                 records it as interrupted; nothing to cancel",
                row["peer_pid"]
            ),
        ));
    };
    let workspace = row["workspace"].as_str().unwrap_or("");
    let none_found = || {
        Failure::new(
            exit::ERROR,
            format!(
                "script {id} has no sandbox under {} now (it is starting or ending); nothing was killed",
                host.named()
            ),
        )
    };
    let (bwrap, init) = sandbox_of(host.pid, workspace)?.ok_or_else(none_found)?;
    let (target, parent_pid) = match init {
        Some(init) => (init, bwrap),
        None => (bwrap, host.pid),
    };
    let pidfd = crate::sys::PidFd::open(target as i32).map_err(|_| none_found())?;
    // Held now: if it is still the child it was found as, the pidfd is that
    // process (not a later one that took its pid).
    if parent(target) != Some(parent_pid) {
        return Err(none_found());
    }
    pidfd.kill().map_err(|e| {
        Failure::new(
            exit::ERROR,
            format!("script {id}: cannot kill its sandbox (pid {target}): {e}"),
        )
    })?;
    if json_out {
        return Ok(pretty(&serde_json::json!({
            "script_id": id,
            "killed": true,
            "signal": "SIGKILL",
            "pid": target,
            "process": host,
        })));
    }
    Ok(format!(
        "{id}: killed (SIGKILL to its sandbox, pid {target}, under {})\n\
         that process records how it ended as it sees it (an error: its sandbox was killed), not as \
         cancelled: an embedded daemon takes no request from another process; see scriptgate show --embedded {id}\n",
        host.named()
    ))
}

/// One page of an embedded script's calls.jsonl, read here (it is the
/// user's own, or, for root's embedded store, root may read it) as the daemon
/// reads it for `admin.calls`: opened without following a link, bounded.
fn calls_here(
    ctx: &Ctx,
    id: &str,
    offset: u64,
    limit: Option<usize>,
) -> Result<CallsPage, Failure> {
    let row = ctx
        .reader()?
        .script(id)
        .map_err(store_err)?
        .ok_or_else(|| {
            Failure::new(
                exit::NOT_FOUND,
                format!("no script {id} in the audit store"),
            )
        })?;
    let run_uid = row["run_uid"]
        .as_u64()
        .and_then(|u| u32::try_from(u).ok())
        .ok_or_else(|| Failure::setup(format!("script {id}: no run_uid recorded")))?;
    let path = Path::new(row["workspace"].as_str().unwrap_or_default())
        .join(row["details_dir"].as_str().unwrap_or_default())
        .join("calls.jsonl");
    let f = crate::daemon::calls::open_no_links(&path, run_uid)
        .map_err(|e| Failure::setup(format!("cannot open {}: {e}", path.display())))?;
    crate::daemon::calls::page(id, f, offset, limit).map_err(|e| Failure::admin(&e))
}

/// `scriptgate show ID --calls`: one page of the script's calls, through the
/// daemon (calls.jsonl is private to the engine's uid).
pub fn show_calls(
    ctx: &Ctx,
    id: &str,
    offset: u64,
    limit: Option<usize>,
    json_out: bool,
) -> Result<String, Failure> {
    let page: CallsPage = match &ctx.embedded {
        Some(_) => {
            let page = calls_here(ctx, id, offset, limit)?;
            if json_out {
                return Ok(pretty(&page));
            }
            page
        }
        None => {
            let p = CallsParams {
                script_id: id.to_string(),
                offset,
                limit,
            };
            let raw = ctx.call(Method::AdminCalls, &p)?;
            if json_out {
                return Ok(pretty(&raw));
            }
            typed(Method::AdminCalls, raw)?
        }
    };
    let mut out = String::new();
    for l in &page.lines {
        out.push_str(&format!("#{} {}", l.n, call_line(&l.text)));
        if let Some(n) = l.clipped_bytes {
            out.push_str(&format!(" [line clipped: {n} bytes in all]"));
        }
        out.push('\n');
    }
    match page.next_offset {
        Some(n) => out.push_str(&format!(
            "-- more: scriptgate show {id} --calls --offset {n}\n"
        )),
        None if page.lines.is_empty() => out.push_str(&format!(
            "-- no calls from #{offset} (calls.jsonl has fewer lines)\n"
        )),
        None => {}
    }
    Ok(out)
}

/// One logged call for a terminal, on one line. What the engine, the tools
/// and the script wrote is printed escaped (`text::Untrusted::line`: `\x1b`,
/// newlines included), so that no line of it can drive the admin's terminal
/// or pass for another call.
fn call_line(text: &str) -> String {
    crate::text::Untrusted::line(&call_line_raw(text)).to_string()
}

/// One calls.jsonl line for people: when, tool, arguments, outcome, summary;
/// a line that is not one the daemon writes, as it is.
fn call_line_raw(text: &str) -> String {
    let Ok(v) = serde_json::from_str::<Value>(text) else {
        return format!("(not JSON) {text}");
    };
    if v.get("tool").is_none() {
        return format!("{} {}", s(&v["ts"]), s(&v["summary"]));
    }
    let outcome = match v["is_error"].as_bool() {
        Some(false) => "ok",
        Some(true) => "error",
        None => "no answer",
    };
    let args = match &v["arguments"] {
        Value::String(clipped) => format!(
            "{clipped} [arguments clipped: {} bytes]",
            s(&v["arguments_bytes"])
        ),
        a => a.to_string(),
    };
    format!(
        "{} {} {} -> {} {} ms: {}",
        s(&v["ts"]),
        s(&v["tool"]),
        args,
        outcome,
        s(&v["duration_ms"]),
        s(&v["summary"])
    )
}

pub fn show(ctx: &Ctx, id: &str, json_out: bool) -> Result<String, Failure> {
    let reader = ctx.reader()?;
    let row = reader
        .script(id)
        .map_err(|e| Failure::setup(e.to_string()))?
        .ok_or_else(|| {
            Failure::new(
                exit::NOT_FOUND,
                format!("no script {id} in the audit store"),
            )
        })?;
    let dir = Path::new(row["workspace"].as_str().unwrap_or("/"))
        .join(row["details_dir"].as_str().unwrap_or(""));
    let artifacts: Vec<String> = ["script.py", "calls.jsonl", "output.txt", "stderr.txt"]
        .iter()
        .map(|f| dir.join(f).display().to_string())
        .collect();
    if json_out {
        let mut v = row.clone();
        v["artifacts"] = Value::from(artifacts.clone());
        return Ok(pretty(&v));
    }
    let mut rows = Vec::new();
    for k in [
        "script_id",
        "run_id",
        "runner",
        "status",
        "exit_code",
        "description",
        "peer_uid",
        "peer_pid",
        "run_uid",
        "approval",
        "tools",
        "workspace",
        "details_dir",
        "backend",
        "unit",
        "started_at",
        "ended_at",
        "duration_ms",
        "teardown_ms",
        "calls",
        "failures",
        "tool_counts",
        "memory_peak_bytes",
        "cpu_usec",
    ] {
        let v = &row[k];
        let shown = match k {
            "started_at" | "ended_at" if v.is_i64() => rfc3339(v.as_i64().unwrap_or(0)),
            "tools" | "tool_counts" => v.to_string(),
            "peer_uid" | "run_uid" => uid_name(v),
            _ => s(v),
        };
        rows.push(vec![k.to_string(), shown]);
    }
    // One path a line, under the first (each row's cell is one line).
    for (i, a) in artifacts.iter().enumerate() {
        let name = if i == 0 { "artifacts" } else { "" };
        rows.push(vec![name.into(), a.clone()]);
    }
    // Every value is a cell, shown as one line escaped (`table::pairs`); the
    // script is shown as its approval showed it, its lines numbered as Python
    // reads them (`text::numbered_source`); the result text is lines, escaped
    // but for its newlines.
    let mut out = pairs(&rows);
    out.push_str("--- script ---\n");
    out.push_str(&crate::text::numbered_source(
        row["code"].as_str().unwrap_or(""),
    ));
    out.push_str("--- result text ---\n");
    let text = row["result"]["text"]
        .as_str()
        .unwrap_or("(still running)\n");
    out.push_str(&crate::text::Untrusted::lines(text).to_string());
    Ok(out)
}

/// Rows as pretty JSON, or as a table with one cell per column function.
fn rows_out(
    rows: &[Value],
    json_out: bool,
    headers: &[&str],
    row: impl Fn(&Value) -> Vec<String>,
) -> String {
    if json_out {
        return pretty(rows);
    }
    table(headers, &rows.iter().map(row).collect::<Vec<_>>())
}

/// `scriptgate prune [--dry-run]`: the system's workspaces for root and the
/// administrators (through the daemon, which sees the engines' private
/// directories; root reads them directly when it is down), then this user's
/// own embedded workspaces (root's too: the embedded daemon prunes none).
/// Each part names its roots.
/// The text, and the exit status: 1 when a workspace could not be removed, 11
/// when an administrator who is not root could not have the daemon do it.
pub fn prune(
    ctx: &Ctx,
    dry_run: bool,
    as_of_ms: Option<i64>,
    json_out: bool,
) -> Result<(String, u8), Failure> {
    let mut parts = Vec::new();
    let (text, code) = prune_parts(ctx, dry_run, as_of_ms, &mut parts)?;
    if json_out {
        return Ok((pretty(&parts), code));
    }
    Ok((text, code))
}

/// [`prune`]'s parts: the text, the exit status, and each part's answer as
/// JSON in `parts` (`{"part": "system" | "embedded", "pruned": …}`).
fn prune_parts(
    ctx: &Ctx,
    dry_run: bool,
    as_of_ms: Option<i64>,
    parts: &mut Vec<Value>,
) -> Result<(String, u8), Failure> {
    let (uid, gid) = (
        nix::unistd::getuid().as_raw(),
        nix::unistd::getgid().as_raw(),
    );
    let root = uid == 0;
    let admin = crate::sys::peer_in_groups(uid, gid, &ctx.config.auth.admin_groups);
    let (mut out, mut code) = (String::new(), exit::OK);
    let mut worst = |c: u8| code = if code == exit::OK { c } else { code };
    if admin {
        let (text, c) = prune_system(ctx, (dry_run, as_of_ms), root, parts)?;
        out.push_str(&text);
        worst(c);
    }
    // A user with no usable state directory has no embedded workspaces; an
    // administrator's part above stands, and the reason is said.
    let dirs = match super::run::embedded_dirs(&ctx.config, false) {
        Ok(dirs) => Some(dirs),
        Err(f) if admin => {
            out.push_str(&format!(
                "no embedded workspaces of uid {uid}: {}\n",
                f.message
            ));
            None
        }
        Err(f) => return Err(f),
    };
    let Some((state, workspaces)) = dirs else {
        return Ok((out, code));
    };
    match prune_embedded(ctx, (dry_run, as_of_ms), &state, workspaces, parts)? {
        Some((text, c)) => {
            out.push_str(&text);
            worst(c);
        }
        None if admin => out.push_str(&format!(
            "no embedded workspaces of uid {uid}: {} has no audit store\n",
            state.display()
        )),
        None => {
            return Err(Failure::new(
                exit::NOT_PERMITTED,
                format!(
                    "permission denied: the daemon's workspaces are pruned by root and members of {:?}, \
                     and uid {uid} has no embedded workspaces ({} has no audit store)",
                    ctx.config.auth.admin_groups,
                    state.display()
                ),
            ))
        }
    }
    Ok((out, code))
}

/// A part of `scriptgate prune`: a dry run's listing (a table, escaped), then
/// what the pass did or would do.
fn prune_text(p: &Pruned) -> String {
    let listing = if p.workspaces.is_empty() {
        String::new()
    } else {
        let rows: Vec<Vec<String>> = p.workspaces.iter().map(planned_row).collect();
        let more = if p.workspaces_more {
            format!(
                "(the {} least recently used listed; more are recorded)\n",
                p.workspaces.len()
            )
        } else {
            String::new()
        };
        table(
            &[
                "WORKSPACE",
                "ENGINE",
                "OWNER",
                "LAST_USED",
                "AGE",
                "SIZE",
                "WHAT",
            ],
            &rows,
        ) + &more
    };
    let as_of = p
        .as_of_ms
        .map(|t| format!("as of {} (--as-of; nothing is removed):\n", rfc3339(t)))
        .unwrap_or_default();
    as_of + &listing + &crate::daemon::prune::report(p)
}

/// An age as people read a workspace's: days past one day (`40d 3h`).
fn age_text(ms: i64) -> String {
    const DAY: i64 = 86_400_000;
    match ms.max(0) {
        ms if ms >= DAY => format!("{}d {}h", ms / DAY, ms % DAY / 3_600_000),
        ms => human_ms(ms as u64),
    }
}

/// One workspace of a dry run's listing, as a row.
fn planned_row(w: &crate::protocol::PlannedWorkspace) -> Vec<String> {
    let due = rfc3339(w.due_ms);
    let what = match w.action.as_str() {
        "remove" => format!("removed at this pass (due since {due})"),
        "remove_next_pass" => format!(
            "removed at a later pass ({} of an owner a pass; due since {due})",
            crate::daemon::prune::MAX_PER_OWNER
        ),
        "keep_in_use" => format!("kept: a script runs in it (due {due})"),
        "keep" => format!("kept until {due}"),
        other => other.to_string(),
    };
    let size = match (w.size_bytes, w.size_partial) {
        (Some(b), false) => bytes(Some(b)),
        (Some(b), true) => format!(">={}", bytes(Some(b))),
        (None, _) => "-".into(),
    };
    let uid = |u: Option<u32>| u.map_or("-".into(), |u| uid_name(&Value::from(u)));
    vec![
        w.path.display().to_string(),
        uid(w.engine_uid),
        uid(w.owner_uid),
        rfc3339(w.last_used_ms),
        age_text(w.age_ms),
        size,
        what,
    ]
}

/// Exit 1 when a workspace could not be removed.
fn pruned_code(p: &Pruned) -> u8 {
    if p.expired.iter().any(|c| c.error.is_some()) {
        exit::ERROR
    } else {
        exit::OK
    }
}

fn roots_text(roots: &[PathBuf]) -> String {
    roots
        .iter()
        .map(|r| r.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// The daemon's workspaces (`workspace.roots`): by the daemon (`admin.prune`);
/// when it does not answer, read here: all of them by root, and by an
/// administrator only as far as they can see, which is said.
fn prune_system(
    ctx: &Ctx,
    (dry_run, as_of_ms): (bool, Option<i64>),
    root: bool,
    parts: &mut Vec<Value>,
) -> Result<(String, u8), Failure> {
    // Read here only when the daemon is not running; a daemon that fails or
    // goes away mid-pass is an error (a second pass beside its own would race it).
    let params = PruneParams { dry_run, as_of_ms };
    if let Some(raw) = ctx.call_if_running(Method::AdminPrune, &params)? {
        let p: Pruned = typed(Method::AdminPrune, raw)?;
        parts.push(serde_json::json!({"part": "system", "pruned": &p}));
        let head = format!(
            "workspaces under {} (workspace.roots), by the daemon at {}:\n",
            roots_text(&p.roots),
            ctx.socket.display()
        );
        return Ok((head + &prune_text(&p), pruned_code(&p)));
    }
    let ws = &ctx.config.workspace;
    let head = format!(
        "workspaces under {} (workspace.roots), read by uid {} (the daemon at {} does not answer):\n",
        roots_text(&ws.roots),
        nix::unistd::getuid(),
        ctx.socket.display()
    );
    if ws.retain_days == 0 {
        return Ok((
            head + "workspace.retain_days = 0: workspaces are kept\n",
            exit::OK,
        ));
    }
    // An administrator who is not root removes nothing: the workspaces are
    // their engines' (the daemon removes them, or root).
    let look_only = dry_run || !root;
    let db = ctx.config.state.dir.join("scriptgate.db");
    let (p, recorded, warning) = pass_here(
        &ctx.reader()?,
        &db,
        &ws.roots,
        ws.retain_days,
        (look_only, as_of_ms),
    )?;
    parts.push(serde_json::json!({"part": "system", "pruned": &p}));
    let mut out = head + &prune_text(&p) + &warning;
    if root {
        return Ok((out, pruned_code(&p)));
    }
    // Said plainly: what this uid could not see, and that nothing was removed.
    let blind: Vec<&crate::protocol::PruneUnknown> = p
        .unknown
        .iter()
        .filter(|u| u.error.contains("Permission denied"))
        .collect();
    if !blind.is_empty() {
        out.push_str(&format!(
            "uid {} could not see {} of the {} recorded workspaces: their directories are private to their engines ({}); \
             the counts above leave them out. Start the daemon (any connection to its socket does) or run this as root.\n",
            nix::unistd::getuid(),
            blind.len(),
            recorded,
            blind
                .iter()
                .map(|u| u.path.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    if !dry_run {
        out.push_str(
            "nothing was removed: the daemon removes its engines' workspaces (or root does)\n",
        );
    }
    let code = if blind.is_empty() && dry_run {
        exit::OK
    } else {
        exit::DAEMON_DOWN
    };
    Ok((out, code))
}

/// This user's embedded workspaces (`scriptgate run` and `scriptgate mcp` with
/// no system daemon) under `workspaces`, recorded in the embedded daemon's own
/// store in `state` (crate::cli::run::embedded_dirs: root's in
/// /var/lib/scriptgate/cli, a user's in ~/.local/state/scriptgate), with the
/// configuration's `workspace.retain_days`. None when there is no such store.
fn prune_embedded(
    ctx: &Ctx,
    (dry_run, as_of_ms): (bool, Option<i64>),
    state: &Path,
    workspaces: PathBuf,
    parts: &mut Vec<Value>,
) -> Result<Option<(String, u8)>, Failure> {
    let db = state.join("scriptgate.db");
    if !db.exists() {
        return Ok(None);
    }
    let roots = vec![workspaces];
    let head = format!(
        "embedded workspaces of uid {} under {} (scriptgate run without a system daemon; recorded in {}):\n",
        nix::unistd::getuid(),
        roots_text(&roots),
        state.display()
    );
    let days = ctx.config.workspace.retain_days;
    if days == 0 {
        return Ok(Some((
            head + "workspace.retain_days = 0: workspaces are kept\n",
            exit::OK,
        )));
    }
    let reader = Reader::open(&db).map_err(|e| Failure::setup(e.to_string()))?;
    let (p, _, warning) = pass_here(&reader, &db, &roots, days, (dry_run, as_of_ms))?;
    parts.push(serde_json::json!({"part": "embedded", "pruned": &p}));
    Ok(Some((head + &prune_text(&p) + &warning, pruned_code(&p))))
}

/// A pass of this process over the workspaces under `roots` recorded in
/// `reader`'s store `db` (only what the daemon recorded as scriptgate's own,
/// crate::daemon::prune): looked at when `look_only`, else removed, and then
/// forgotten in that store as the daemon's own pass forgets them
/// (crate::daemon::prune::to_forget); else they stay recorded and come back as
/// gone at every pass. The pass, how many workspaces were recorded, and a
/// warning line when the forget failed (the exit status stays the pass's).
fn pass_here(
    reader: &Reader,
    db: &Path,
    roots: &[PathBuf],
    days: u64,
    (look_only, as_of_ms): (bool, Option<i64>),
) -> Result<(Pruned, usize, String), Failure> {
    use crate::daemon::prune;
    let store = |e: rusqlite::Error| Failure::setup(e.to_string());
    let busy = reader.running_workspaces().map_err(store)?;
    let vouched = reader.vouched_workspaces().map_err(store)?;
    let in_use = |p: &Path| busy.iter().any(|b| Path::new(b).starts_with(p));
    let (p, paths) = prune::pass_or_look(roots, &vouched, days, look_only, as_of_ms, &in_use);
    if look_only {
        return Ok((p, vouched.len(), String::new()));
    }
    let warning = match crate::audit::forget_workspaces_at(db, &paths) {
        Ok(()) => String::new(),
        Err(e) => format!(
            "warning: could not forget {} removed or gone {} in the audit store: {e}; \
             they stay recorded (a later pass tries again)\n",
            paths.len(),
            if paths.len() == 1 {
                "workspace"
            } else {
                "workspaces"
            }
        ),
    };
    Ok((p, vouched.len(), warning))
}

/// `scriptgate audit backup FILE`.
pub fn backup(ctx: &Ctx, file: &Path) -> Result<String, Failure> {
    let b = ctx
        .reader()?
        .backup(file)
        .map_err(|e| Failure::setup(e.to_string()))?;
    Ok(format!(
        "backed up the audit store to {}: {} scripts, {} refusals, {} bytes\n",
        file.display(),
        b.scripts,
        b.refusals,
        b.bytes
    ))
}

/// A user named by name or uid.
pub fn uid_of(user: &str) -> Result<u32, Failure> {
    if let Ok(n) = user.parse() {
        return Ok(n);
    }
    match nix::unistd::User::from_name(user) {
        Ok(Some(u)) => Ok(u.uid.as_raw()),
        _ => Err(Failure::new(
            exit::USAGE,
            format!(
                "no user {user:?} on this host (getent passwd {user}); give the uid as a number"
            ),
        )),
    }
}

/// A uid as people read it: `1000 (tester)`, or the number alone.
fn uid_name(v: &Value) -> String {
    let Some(uid) = v.as_u64().and_then(|u| u32::try_from(u).ok()) else {
        return s(v);
    };
    match nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid)) {
        Ok(Some(u)) => format!("{uid} ({})", u.name),
        _ => uid.to_string(),
    }
}

/// `scriptgate audit --stats`: the audit store's size and growth.
pub fn store_stats(ctx: &Ctx, json_out: bool) -> Result<String, Failure> {
    let st = ctx
        .reader()?
        .stats(crate::time::now_ms())
        .map_err(|e| Failure::setup(e.to_string()))?;
    if json_out {
        return Ok(pretty(&st));
    }
    let days: Vec<String> = st
        .per_day
        .iter()
        .map(|(day, n)| format!("{} {n}", &rfc3339(*day)[..10]))
        .collect();
    Ok(pairs(&[
        vec!["store".into(), st.path.display().to_string()],
        vec!["size".into(), store_size(&st)],
        vec![
            "rows".into(),
            format!(
                "{} scripts, {} refusals, {} refused-connection rows",
                st.scripts, st.refusals, st.refused_connection_rows
            ),
        ],
        vec!["oldest".into(), st.oldest_ms.map_or("-".into(), rfc3339)],
        vec!["scripts a day".into(), days.join(", ")],
        vec![
            "growth".into(),
            format!(
                "{:.1} scripts a day (mean of the last {} whole days)",
                st.mean_per_day(),
                st.per_day.len().saturating_sub(1)
            ),
        ],
    ]))
}

/// A store's size in a few words: its files' bytes and rows, since when.
fn store_size(st: &crate::audit::StoreStats) -> String {
    format!(
        "{} ({} bytes: the database, its write-ahead log and index)",
        bytes(Some(st.file_bytes)),
        st.file_bytes
    )
}

/// The running scripts a restart now would interrupt: those already older
/// than `server.drain_s` (a restart gives each `drain_s` more to end), oldest
/// first.
fn cut_by_restart(scripts: &[ListedScript], drain_s: u64) -> Vec<&ListedScript> {
    let mut cut: Vec<&ListedScript> = scripts
        .iter()
        .filter(|s| s.age_ms > drain_s.saturating_mul(1000))
        .collect();
    cut.sort_by_key(|s| std::cmp::Reverse(s.age_ms));
    cut
}

/// `status`'s rows of the configuration: whether the daemon runs with the file
/// as it is on disk, what waits for a restart, and the last reload (pure).
pub(crate) fn config_rows(c: &crate::protocol::ConfigState) -> Vec<Vec<String>> {
    let read = rfc3339(c.loaded_ms);
    let changed = c.modified_ms.map_or("?".into(), rfc3339);
    let config = match (c.on_disk.as_str(), &c.digest) {
        ("same", None) => format!("defaults: no {} (as on disk, read {read})", c.path),
        ("same", Some(_)) => format!("as on disk: {} (read {read})", c.path),
        ("changed", _) => format!(
            "changed on disk since {changed}, not reloaded: {} (read {read}; systemctl reload scriptgate)",
            c.path
        ),
        ("missing", _) => format!(
            "{} is missing on disk; the daemon runs with what it read {read}",
            c.path
        ),
        (other, _) => format!("{}: {other}; the daemon runs with what it read {read}", c.path),
    };
    let mut rows = vec![vec!["config".into(), config]];
    if !c.pending_restart.is_empty() {
        rows.push(vec![
            "pending".into(),
            format!(
                "pending restart: {} (changed in the file, in force after systemctl restart scriptgate)",
                c.pending_restart.join(", ")
            ),
        ]);
    }
    if let Some(r) = &c.last_reload {
        let text = match &r.error {
            None => format!("{}: reloaded", rfc3339(r.at_ms)),
            Some(e) => format!(
                "{}: refused, the running configuration kept: {e}",
                rfc3339(r.at_ms)
            ),
        };
        rows.push(vec!["reload".into(), text]);
    }
    rows
}

/// `status`'s rows of the audit store and of a restart, and the same as JSON.
fn status_extras(ctx: &Ctx) -> (Vec<Vec<String>>, Value) {
    let drain_s = ctx.config.server.drain_s;
    let listed = ctx
        .call(Method::AdminList, &NoParams {})
        .and_then(|raw| typed::<AdminList>(Method::AdminList, raw));
    let (restart, restart_json) = match &listed {
        Ok(list) => {
            let cut = cut_by_restart(&list.scripts, drain_s);
            let ids: Vec<String> = cut
                .iter()
                .map(|s| format!("{} (running {})", s.status.script_id, human_ms(s.age_ms)))
                .collect();
            let text = if ids.is_empty() {
                format!("would interrupt none (no running script is older than server.drain_s, {drain_s} s)")
            } else {
                format!(
                    "would interrupt {} running for more than server.drain_s ({drain_s} s): {}",
                    ids.len(),
                    ids.join(", ")
                )
            };
            let json = serde_json::json!({"drain_s": drain_s,
                "would_interrupt": cut.iter().map(|s| &s.status.script_id).collect::<Vec<_>>()});
            (text, json)
        }
        Err(e) => (
            format!("cannot list running scripts: {}", e.message),
            Value::Null,
        ),
    };
    let (store, store_json) = match ctx.reader().and_then(|r| {
        r.stats(crate::time::now_ms())
            .map_err(|e| Failure::setup(e.to_string()))
    }) {
        Ok(st) => (
            format!(
                "{}, {} scripts since {}, {:.1} a day over the last {} days (scriptgate audit --stats)",
                bytes(Some(st.file_bytes)),
                st.scripts,
                st.oldest_ms.map_or("-".into(), rfc3339),
                st.mean_per_day(),
                st.per_day.len().saturating_sub(1)
            ),
            serde_json::to_value(&st).unwrap_or(Value::Null),
        ),
        Err(e) => (format!("cannot read: {}", e.message), Value::Null),
    };
    let rows = vec![vec!["store".into(), store], vec!["restart".into(), restart]];
    (
        rows,
        serde_json::json!({"store": store_json, "restart": restart_json}),
    )
}

/// `scriptgate audit --refusals --connections`: connections refused at the
/// socket, a row per minute, uid and reason, newest first.
pub fn refused_connections(ctx: &Ctx, q: Query, json_out: bool) -> Result<String, Failure> {
    let rows = ctx
        .reader()?
        .refused_connections(&q)
        .map_err(|e| Failure::setup(e.to_string()))?;
    Ok(rows_out(
        &rows,
        json_out,
        &["MINUTE", "PEER_UID", "REASON", "COUNT"],
        |r| {
            vec![
                rfc3339(r["minute"].as_i64().unwrap_or(0)),
                uid_name(&r["peer_uid"]),
                s(&r["reason"]),
                s(&r["count"]),
            ]
        },
    ))
}

pub fn audit(ctx: &Ctx, q: Query, refusals: bool, json_out: bool) -> Result<String, Failure> {
    let reader = ctx.reader()?;
    let store = |e: rusqlite::Error| Failure::setup(e.to_string());
    if refusals {
        let rows = reader.refusals(&q).map_err(store)?;
        return Ok(rows_out(
            &rows,
            json_out,
            &["AT", "RUN", "PEER_UID", "CODE", "REASON", "MESSAGE"],
            |r| {
                vec![
                    rfc3339(r["at"].as_i64().unwrap_or(0)),
                    s(&r["run_id"]),
                    uid_name(&r["peer_uid"]),
                    s(&r["code"]),
                    s(&r["reason"]),
                    s(&r["message"]),
                ]
            },
        ));
    }
    let rows = reader.scripts(&q).map_err(store)?;
    Ok(rows_out(
        &rows,
        json_out,
        &[
            "STARTED",
            "SCRIPT",
            "RUN",
            "ENGINE",
            "UID",
            "STATUS",
            "CALLS",
            "FAILS",
            "DURATION",
            "DESCRIPTION",
        ],
        |r| {
            vec![
                rfc3339(r["started_at"].as_i64().unwrap_or(0)),
                s(&r["script_id"]),
                s(&r["run_id"]),
                uid_name(&r["peer_uid"]),
                uid_name(&r["run_uid"]),
                s(&r["status"]),
                s(&r["calls"]),
                s(&r["failures"]),
                r["duration_ms"]
                    .as_u64()
                    .map(human_ms)
                    .unwrap_or_else(|| "-".into()),
                r["description"]
                    .as_str()
                    .unwrap_or("")
                    .chars()
                    .take(40)
                    .collect(),
            ]
        },
    ))
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_workspace_age_is_in_days_past_one_day() {
        assert_eq!(age_text(40 * 86_400_000 + 3 * 3_600_000 + 5), "40d 3h");
        assert_eq!(age_text(-5), human_ms(0));
        assert_eq!(age_text(90_000), human_ms(90_000));
    }

    #[test]
    fn a_restart_would_interrupt_the_scripts_older_than_drain_s_oldest_first() {
        let listed = |id: &str, age_ms: u64| -> ListedScript {
            serde_json::from_value(serde_json::json!({
                "script_id": id, "state": "running", "calls": 0, "failures": 0,
                "elapsed_ms": age_ms, "progress": null, "run_id": "r", "peer_uid": 0,
                "uid": 65534, "unit": null, "age_ms": age_ms}))
            .unwrap()
        };
        let running = [
            listed("young", 30_000),
            listed("old", 31_000),
            listed("older", 900_000),
        ];
        let ids = |cut: Vec<&ListedScript>| -> Vec<String> {
            cut.iter().map(|s| s.status.script_id.clone()).collect()
        };
        assert_eq!(ids(cut_by_restart(&running, 30)), ["older", "old"]);
        assert!(cut_by_restart(&running, 900).is_empty());
        assert_eq!(ids(cut_by_restart(&running, 0)).len(), 3);
    }

    #[test]
    fn a_logged_call_cannot_drive_the_terminal() {
        let line = call_line(
            r#"{"ts":"t","tool":"a__b","arguments":{"x":"\u001b[2J"},"is_error":false,"duration_ms":1,"summary":"\u001b]0;owned\u0007\n#2 fake\u202e"}"#,
        );
        assert!(!line.chars().any(crate::text::is_unsafe), "{line:?}");
        assert!(
            line.ends_with(": \\x1b]0;owned\\x07\\x0a#2 fake\\u202e"),
            "{line:?}"
        );
        assert_eq!(call_line("plain\u{1b}"), "(not JSON) plain\\x1b");
    }

    use super::*;

    fn info(backend: &str, enforced: Option<bool>, notes: &[&str], sandbox: &str) -> DaemonInfo {
        serde_json::from_value(serde_json::json!({
            "version": "0", "protocol": 1, "backend": backend, "backend_notes": notes,
            "limits_per_script": backend != "rlimit", "limits_enforced": enforced, "running": 0,
            "limits": {"max_calls": 1, "max_concurrency": 1, "timeout_s": 1, "memory_max_bytes": 1,
                       "tasks_max": 1, "output_max_bytes": 1, "return_max_chars": 1,
                       "approval_timeout_s": 1, "max_running": 1},
            "sandbox": {"state": sandbox, "nested_userns": "disable-userns",
                        "problem": null, "detail": null}
        }))
        .unwrap()
    }

    /// `status` says whether the daemon runs with the file on disk, names the
    /// keys pending a restart, and the last reload with its refusal.
    #[test]
    fn the_config_rows_say_on_disk_pending_and_the_last_reload() {
        let mut c = crate::protocol::ConfigState {
            path: "/etc/s.toml".into(),
            digest: Some("ab".into()),
            loaded_ms: 0,
            on_disk: "same".into(),
            modified_ms: Some(86_400_000),
            pending_restart: vec![],
            last_reload: None,
        };
        let text = |c: &crate::protocol::ConfigState| pairs(&config_rows(c));
        assert_eq!(
            text(&c),
            "config  as on disk: /etc/s.toml (read 1970-01-01T00:00:00.000Z)\n"
        );
        c.on_disk = "changed".into();
        c.pending_restart = vec!["server.max_connections".into(), "auth.engine".into()];
        c.last_reload = Some(crate::protocol::LastReload {
            at_ms: 0,
            error: Some("line 2: bad\u{1b}[2J".into()),
        });
        let t = text(&c);
        assert!(
            t.contains("config   changed on disk since 1970-01-02T00:00:00.000Z, not reloaded: /etc/s.toml"),
            "{t}"
        );
        assert!(
            t.contains("pending  pending restart: server.max_connections, auth.engine ("),
            "{t}"
        );
        assert!(
            t.contains("refused, the running configuration kept: line 2: bad\\x1b[2J"),
            "{t}"
        );
    }

    #[test]
    fn the_state_is_ok_degraded_or_unavailable_with_each_cause_once() {
        let s = state_of(&info("systemd", Some(true), &[], "ok"), false);
        assert_eq!((s.word, s.code, s.why.len()), ("ok", exit::OK, 0));
        let s = state_of(
            &info(
                "systemd",
                Some(false),
                &["memory_max_bytes = 1 is not in force"],
                "ok",
            ),
            false,
        );
        assert_eq!((s.word, s.code), ("degraded", exit::DEGRADED));
        assert_eq!(s.why, ["limits are not in force (see backend)"]);
        let s = state_of(
            &info("rlimit", None, &["scripts of one uid share"], "ok"),
            false,
        );
        assert_eq!(
            (s.word, s.why.as_slice()),
            (
                "degraded",
                ["the scripts of one uid share their limits (backend rlimit)"].as_slice()
            )
        );
        let s = state_of(&info("systemd", Some(true), &[], "unchecked"), false);
        assert_eq!((s.word, s.code), ("degraded", exit::DEGRADED));
        // No script can run: that alone is said, whatever else holds.
        let s = state_of(&info("rlimit", Some(false), &[], "unavailable"), false);
        assert_eq!(
            (s.word, s.code, s.why.len()),
            ("unavailable", exit::UNAVAILABLE, 1)
        );
    }

    /// The bound on all scripts together not in force degrades the state,
    /// on the backends that have one; rlimit has none, said by its own cause.
    #[test]
    fn a_total_not_in_force_is_degraded() {
        let mut i = info("cgroup", Some(true), &[], "ok");
        i.all_scripts = Some(crate::protocol::AllScripts {
            in_force: true,
            cgroup: Some("/sys/fs/cgroup/x/scripts".into()),
            ..Default::default()
        });
        assert_eq!(state_of(&i, true).word, "ok");
        i.all_scripts.as_mut().unwrap().in_force = false;
        let s = state_of(&i, true);
        assert_eq!((s.word, s.code), ("degraded", exit::DEGRADED));
        assert_eq!(
            s.why,
            ["the bound on all scripts together is not in force (see total)"]
        );
        let mut r = info("rlimit", None, &["x"], "ok");
        r.all_scripts = Some(crate::protocol::AllScripts::default());
        assert_eq!(
            state_of(&r, false).why,
            ["the scripts of one uid share their limits (backend rlimit)"]
        );
    }
}
