//! The TOML configuration file (scriptgate.toml(5)). Every key is optional; an
//! unknown key or a wrong type is an error naming the file, line and key.

use serde::{Deserialize, Serialize};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

pub const DEFAULT_PATH: &str = "/etc/scriptgate/scriptgate.toml";
pub const MIN_KEY_BYTES: usize = 32;

/// `scriptgate.toml` (scriptgate.toml(5)), one struct per table: every key has
/// a default, and an unknown key is refused, not ignored. Read and checked once
/// at start-up (the daemon's, an embedded daemon's, `--check-config`); the
/// daemon keeps it unchanged for its life (`Daemon::cfg`).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub server: Server,
    pub auth: Auth,
    pub workspace: Workspace,
    pub scripts: Scripts,
    pub sandbox: Sandbox,
    pub state: State,
    pub audit: Audit,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Server {
    pub max_message_bytes: usize,
    pub max_running: usize,
    pub idle_exit_s: u64,
    /// Engine connections served at once; one more is refused (-32015).
    pub max_connections: usize,
    /// Connections one peer uid may hold at once (root too), within the caps
    /// of its pool; one more is refused (-32015).
    pub max_connections_per_uid: usize,
    /// Connections of admin-only peers (`auth.admin_groups`, not engines) at
    /// once: a pool of their own, apart from `max_connections`.
    pub max_admin_connections: usize,
    /// A line from an engine must end within this many seconds of its first byte.
    pub line_timeout_s: u64,
    /// Bytes of partly received lines held for all connections together, beyond
    /// the first 64 KiB of each line.
    pub max_buffered_bytes: usize,
    /// On SIGTERM, running scripts may finish for this many seconds before they
    /// are interrupted; no new script starts meanwhile.
    pub drain_s: u64,
}
impl Default for Server {
    fn default() -> Self {
        Server {
            max_message_bytes: 16 << 20,
            max_running: 64,
            idle_exit_s: 300,
            max_connections: 256,
            max_connections_per_uid: 64,
            max_admin_connections: 16,
            line_timeout_s: 30,
            max_buffered_bytes: 32 << 20,
            drain_s: 30,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Auth {
    pub token_key_file: PathBuf,
    pub allowed_groups: Vec<String>,
    pub admin_groups: Vec<String>,
    /// `[[auth.engine]]`: engines bound to their own key and workspaces
    /// (scriptgate.toml(5)); resolved and checked by `crate::policy::auth`.
    #[serde(rename = "engine", skip_serializing_if = "Vec::is_empty")]
    pub engines: Vec<EngineAuth>,
}
impl Default for Auth {
    fn default() -> Self {
        Auth {
            token_key_file: "/etc/scriptgate/token.key".into(),
            allowed_groups: vec!["scriptgate".into()],
            admin_groups: vec!["scriptgate-admin".into()],
            engines: vec![],
        }
    }
}

/// One `[[auth.engine]]` entry: the peers it matches (one `user` or one
/// `group`, by name or number), the key their tokens must be signed with, and
/// the directories their workspaces must lie under (default: their per-uid
/// directories `<root>/<uid>` of `workspace.roots`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineAuth {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    pub token_key_file: PathBuf,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub workspace_roots: Vec<PathBuf>,
}

impl EngineAuth {
    /// `user gateway` or `group gw-engines`, as messages name the entry.
    pub fn label(&self) -> String {
        match (&self.user, &self.group) {
            (Some(u), _) => format!("[[auth.engine]] user = {u:?}"),
            (None, Some(g)) => format!("[[auth.engine]] group = {g:?}"),
            (None, None) => "[[auth.engine]]".into(),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Workspace {
    pub roots: Vec<PathBuf>,
    /// Workspaces scriptgate created (`scriptgate run` without `--workspace`) are
    /// removed once unused for this many days; 0 keeps them. Engines' own
    /// workspaces are never removed.
    pub retain_days: u64,
}
impl Default for Workspace {
    fn default() -> Self {
        Workspace {
            roots: vec!["/var/lib/scriptgate/workspaces".into()],
            retain_days: 30,
        }
    }
}

/// Per-script limits. The snapshot's `limits` can only tighten them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Scripts {
    pub max_calls: u64,
    pub max_concurrency: usize,
    pub timeout_s: u64,
    pub memory_max_bytes: u64,
    pub tasks_max: u64,
    pub output_max_bytes: u64,
    pub return_max_chars: usize,
    pub approval_timeout_s: u64,
    pub python: PathBuf,
    /// CPU time per wall-clock second, in percent of one CPU (0: no quota);
    /// systemd and cgroup backends (extension).
    pub cpu_quota_percent: u32,
    /// The largest file a script's process may write (RLIMIT_FSIZE, every
    /// backend; past it a write fails with EFBIG; 0: no bound). Bounds each
    /// file, not the total (extension).
    pub file_max_bytes: u64,
    /// The most a workspace may hold while its scripts run, where its
    /// filesystem enforces project quotas (0: no bound; extension,
    /// crate::daemon::disk).
    pub disk_max_bytes: u64,
    /// RLIMIT_NOFILE of every process of a script, on every backend (the unit
    /// raises the daemon's own to 65536, which scripts would otherwise inherit).
    pub nofile_max: u64,
    /// Memory of all scripts together (extension; `scriptgate.slice`'s
    /// `MemoryMax=`, or `memory.max` of the cgroup backend's `scripts` node).
    /// None (the key absent): derived from the host
    /// (`crate::limits::aggregate`); 0: no bound.
    pub total_memory_max_bytes: Option<u64>,
    /// Tasks of all scripts together (`TasksMax=`, `pids.max`). None: the
    /// stated default (`crate::limits::aggregate`); 0: no bound.
    pub total_tasks_max: Option<u64>,
    /// CPU of all scripts together, in percent of one CPU (`CPUQuota=`,
    /// `cpu.max`). None: derived from the host's CPUs; 0: no quota.
    pub total_cpu_quota_percent: Option<u32>,
}
impl Default for Scripts {
    fn default() -> Self {
        Scripts {
            max_calls: 2000,
            max_concurrency: 4,
            timeout_s: 1800,
            memory_max_bytes: 1 << 30,
            tasks_max: 256,
            output_max_bytes: 16 << 20,
            return_max_chars: 20000,
            approval_timeout_s: 600,
            python: "/usr/bin/python3".into(),
            cpu_quota_percent: 100,
            file_max_bytes: 1 << 30,
            disk_max_bytes: 0,
            nofile_max: 1024,
            total_memory_max_bytes: None,
            total_tasks_max: None,
            total_cpu_quota_percent: None,
        }
    }
}

/// The bounds of `scripts.nofile_max`: Python with a few pipes needs some tens
/// of descriptors; above the kernel's `fs.nr_open` default setrlimit fails.
pub const NOFILE_MIN: u64 = 64;
pub const NOFILE_MAX: u64 = 1 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendChoice {
    Auto,
    Systemd,
    Cgroup,
    Rlimit,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Sandbox {
    pub backend: BackendChoice,
    pub run_as: String,
    /// bwrap binary (extension; default looked up as /usr/bin/bwrap).
    pub bwrap: PathBuf,
    /// Size of the script's private /tmp (extension).
    pub tmp_size_bytes: u64,
    /// Refuse to run scripts whose memory and task limits are not in force, as
    /// read back from their cgroup (extension; the package turns it on).
    pub require_enforced_limits: bool,
    /// Pre-made sandboxes kept waiting for each script uid (extension; 0:
    /// none, every script starts cold; a daemon that is not root keeps none).
    pub pool_size: u64,
    /// What all waiting members together may hold, at 12 MiB each
    /// (extension).
    pub pool_memory_max_bytes: u64,
    /// A uid's members go after this long without a script of it (extension).
    pub pool_idle_s: u64,
}
impl Default for Sandbox {
    fn default() -> Self {
        Sandbox {
            backend: BackendChoice::Auto,
            run_as: "nobody".into(),
            bwrap: "/usr/bin/bwrap".into(),
            tmp_size_bytes: 64 << 20,
            require_enforced_limits: false,
            pool_size: POOL_SIZE_DEFAULT,
            pool_memory_max_bytes: 256 << 20,
            pool_idle_s: 600,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct State {
    pub dir: PathBuf,
    /// Bytes kept free in `dir` (a preallocated file) for the audit rows of
    /// scripts that end on a full filesystem; 0: none (extension).
    pub reserve_bytes: u64,
}
impl Default for State {
    fn default() -> Self {
        State {
            dir: "/var/lib/scriptgate".into(),
            reserve_bytes: 8 << 20,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Audit {
    pub retain_days: u64,
}
impl Default for Audit {
    fn default() -> Self {
        Audit { retain_days: 90 }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{path}: cannot read: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("{path}: {message}")]
    Invalid { path: PathBuf, message: String },
    #[error("token key {path}: {message}")]
    Key { path: PathBuf, message: String },
}

impl Config {
    /// Parse a config file's text. `path` is only used in error messages.
    pub fn parse(text: &str, path: &Path) -> Result<Config, ConfigError> {
        let cfg: Config = toml::from_str(text).map_err(|e| {
            let mut message = e.message().to_string();
            if let Some(span) = e.span() {
                let line = text[..span.start.min(text.len())].matches('\n').count() + 1;
                message = format!("line {line}: {message}");
            }
            ConfigError::Parse {
                path: path.to_path_buf(),
                message,
            }
        })?;
        cfg.validate(path)?;
        Ok(cfg)
    }

    /// Load from a file. A missing file at the default path means all defaults; a
    /// missing file that was named explicitly is an error.
    pub fn load(path: &Path, explicit: bool) -> Result<Config, ConfigError> {
        match std::fs::read_to_string(path) {
            Ok(text) => Config::parse(&text, path),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !explicit => {
                Ok(Config::default())
            }
            Err(source) => Err(ConfigError::Read {
                path: path.to_path_buf(),
                source,
            }),
        }
    }

    fn validate(&self, path: &Path) -> Result<(), ConfigError> {
        let bad = |message: String| {
            Err(ConfigError::Invalid {
                path: path.to_path_buf(),
                message,
            })
        };
        let s = &self.scripts;
        if s.max_concurrency == 0 {
            return bad("scripts.max_concurrency must be at least 1".into());
        }
        if s.timeout_s == 0 || s.max_calls == 0 || s.tasks_max == 0 || s.memory_max_bytes == 0 {
            return bad(
                "scripts.timeout_s, max_calls, tasks_max and memory_max_bytes must be > 0".into(),
            );
        }
        if !(NOFILE_MIN..=NOFILE_MAX).contains(&s.nofile_max) {
            return bad(format!(
                "scripts.nofile_max must be between {NOFILE_MIN} and {NOFILE_MAX}, not {}",
                s.nofile_max
            ));
        }
        // All scripts together below one script's own bound: that one could
        // never reach its own limit, the total would be the real one.
        for (total, key, one, one_key) in [
            (
                s.total_memory_max_bytes,
                "total_memory_max_bytes",
                s.memory_max_bytes,
                "memory_max_bytes",
            ),
            (
                s.total_tasks_max,
                "total_tasks_max",
                s.tasks_max,
                "tasks_max",
            ),
            (
                s.total_cpu_quota_percent.map(u64::from),
                "total_cpu_quota_percent",
                u64::from(s.cpu_quota_percent),
                "cpu_quota_percent",
            ),
        ] {
            if let Some(t) = total.filter(|&t| t > 0 && one > 0 && t < one) {
                return bad(format!(
                    "scripts.{key} = {t} is below scripts.{one_key} = {one}: all scripts together \
                     would get less than one script may have; raise {key}, lower {one_key}, \
                     or set {key} = 0 (no bound on all scripts together)"
                ));
            }
        }
        // bwrap, under the same RLIMIT_FSIZE, copies the script into the sandbox.
        let code_max = self.server.max_message_bytes as u64;
        if s.file_max_bytes != 0 && s.file_max_bytes < code_max {
            return bad(format!(
                "scripts.file_max_bytes must be 0 (no bound) or at least server.max_message_bytes = {code_max} \
                 (the script itself is written into the sandbox under that bound), not {}",
                s.file_max_bytes
            ));
        }
        if !s.python.is_absolute() {
            return bad(format!(
                "scripts.python must be an absolute path, not {:?}",
                s.python
            ));
        }
        let sb = &self.sandbox;
        if sb.pool_size > POOL_SIZE_MAX || sb.pool_idle_s == 0 {
            return bad(format!(
                "sandbox.pool_size must be at most {POOL_SIZE_MAX} and sandbox.pool_idle_s more than 0, not {} and {}",
                sb.pool_size, sb.pool_idle_s
            ));
        }
        let sv = &self.server;
        if sv.max_message_bytes < 1024 {
            return bad("server.max_message_bytes must be at least 1024".into());
        }
        if sv.max_buffered_bytes < sv.max_message_bytes {
            return bad(format!(
                "server.max_buffered_bytes ({}) must be at least server.max_message_bytes ({}), or no message of the largest size could ever be read",
                sv.max_buffered_bytes, sv.max_message_bytes
            ));
        }
        if sv.max_connections == 0
            || sv.max_connections_per_uid == 0
            || sv.max_admin_connections == 0
            || sv.line_timeout_s == 0
            || sv.max_running == 0
        {
            return bad(
                "server.max_connections, max_connections_per_uid, max_admin_connections, line_timeout_s and max_running must be > 0".into(),
            );
        }
        for r in &self.workspace.roots {
            if !r.is_absolute() {
                return bad(format!("workspace.roots: {r:?} is not an absolute path"));
            }
        }
        for (i, e) in self.auth.engines.iter().enumerate() {
            let label = e.label();
            if e.user.is_some() == e.group.is_some() {
                return bad(format!(
                    "{label}: an engine entry names exactly one of `user` or `group`"
                ));
            }
            if !e.token_key_file.is_absolute() {
                return bad(format!(
                    "{label}: token_key_file {:?} is not an absolute path",
                    e.token_key_file
                ));
            }
            for r in &e.workspace_roots {
                if !r.is_absolute() {
                    return bad(format!(
                        "{label}: workspace_roots: {r:?} is not an absolute path"
                    ));
                }
            }
            if let Some(prev) = self.auth.engines[..i].iter().find(|p| {
                (p.user.is_some() && p.user == e.user) || (p.group.is_some() && p.group == e.group)
            }) {
                return bad(format!(
                    "{label} appears twice; merge the two entries (the second would never be used: {})",
                    prev.label()
                ));
            }
        }
        Ok(())
    }

    /// Read the HS256 key: the file's exact bytes, at least 32 of them. The file must
    /// be a regular file, not a symlink, and not readable or writable by others.
    pub fn read_key(&self) -> Result<Vec<u8>, ConfigError> {
        read_key_file(&self.auth.token_key_file)
    }
}

/// The most pre-made sandboxes per script uid (`sandbox.pool_size`).
pub const POOL_SIZE_MAX: u64 = 64;

/// Pre-made sandboxes per script uid unless configured: two cover a model's
/// scripts one after another and a pair at once, for about 20 MiB.
pub const POOL_SIZE_DEFAULT: u64 = 2;

/// The keys a reload applies (`systemctl reload scriptgate`, SIGHUP;
/// scriptgated(8) RELOAD): each is read anew by every script that starts after
/// it, and by the daemon's hourly passes; a running script keeps what it started
/// with. Every other key is read at start only: a changed value is named
/// "pending restart" and the running value kept until a restart.
pub const LIVE_KEYS: &[&str] = &[
    "server.drain_s",
    "scripts.max_calls",
    "scripts.max_concurrency",
    "scripts.timeout_s",
    "scripts.memory_max_bytes",
    "scripts.tasks_max",
    "scripts.output_max_bytes",
    "scripts.return_max_chars",
    "scripts.approval_timeout_s",
    "scripts.file_max_bytes",
    "scripts.nofile_max",
    "scripts.total_memory_max_bytes",
    "scripts.total_tasks_max",
    "scripts.total_cpu_quota_percent",
    "sandbox.tmp_size_bytes",
    "sandbox.pool_memory_max_bytes",
    "sandbox.pool_idle_s",
    "state.reserve_bytes",
    "workspace.retain_days",
    "audit.retain_days",
];

/// What a reload makes of the running configuration and the file's.
#[derive(Debug)]
pub struct Reloaded {
    /// The running configuration with the file's live keys (`LIVE_KEYS`).
    pub cfg: Config,
    /// The live keys whose value changed, `table.key`.
    pub applied: Vec<String>,
    /// The other keys whose value in the file differs from the running one.
    pub pending: Vec<String>,
}

impl Config {
    /// The running configuration (`self`) with the live keys of `file` (a
    /// checked configuration); the keys that differ and need a restart are
    /// named, and keep their running value. The result is checked again (a
    /// live key may be bound by a pending one: `scripts.file_max_bytes` by
    /// `server.max_message_bytes`).
    pub fn reloaded(&self, file: &Config, path: &Path) -> Result<Reloaded, ConfigError> {
        let invalid = |message: String| ConfigError::Invalid {
            path: path.to_path_buf(),
            message,
        };
        let as_value = |c: &Config| serde_json::to_value(c).map_err(|e| invalid(e.to_string()));
        let (mut merged, new) = (as_value(self)?, as_value(file)?);
        let (mut applied, mut pending) = (Vec::new(), Vec::new());
        let tables: std::collections::BTreeSet<&String> = merged
            .as_object()
            .into_iter()
            .chain(new.as_object())
            .flat_map(|o| o.keys())
            .collect();
        let tables: Vec<String> = tables.into_iter().cloned().collect();
        for table in tables {
            let old_t = merged.get(&table).cloned().unwrap_or_default();
            let new_t = new.get(&table).cloned().unwrap_or_default();
            let keys: std::collections::BTreeSet<&String> = old_t
                .as_object()
                .into_iter()
                .chain(new_t.as_object())
                .flat_map(|o| o.keys())
                .collect();
            for key in keys {
                let (was, now) = (old_t.get(key), new_t.get(key));
                if was == now {
                    continue;
                }
                let name = format!("{table}.{key}");
                match (LIVE_KEYS.contains(&name.as_str()), now) {
                    (true, Some(v)) => {
                        merged[&table][key] = v.clone();
                        applied.push(name);
                    }
                    _ => pending.push(name),
                }
            }
        }
        let cfg: Config = serde_json::from_value(merged).map_err(|e| invalid(e.to_string()))?;
        cfg.validate(path).map_err(|e| match e {
            ConfigError::Invalid { path, message } => ConfigError::Invalid {
                path,
                message: format!(
                    "{message} (with the running values of the settings that need a restart: {})",
                    pending.join(", ")
                ),
            },
            e => e,
        })?;
        Ok(Reloaded {
            cfg,
            applied,
            pending,
        })
    }
}

/// The configuration file as the daemon read it: what `scriptgate status`
/// compares with the file on disk now.
#[derive(Debug, Clone, PartialEq)]
pub struct Source {
    pub path: PathBuf,
    /// Whether `--config` named it (a missing default file means defaults).
    pub explicit: bool,
    /// SHA-256 of its bytes, hex; None: no file (the defaults).
    pub digest: Option<String>,
}

/// The most of a configuration file read to compare it with the loaded one.
pub const SOURCE_MAX_BYTES: u64 = 4 << 20;

impl Source {
    /// The file at `path` now: its digest (None: no such file), or why it
    /// cannot be read. Reads at most [`SOURCE_MAX_BYTES`].
    pub fn digest_now(path: &Path) -> Result<Option<String>, String> {
        use sha2::{Digest as _, Sha256};
        use std::io::Read;
        let file = match std::fs::File::open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e.to_string()),
        };
        let mut bytes = Vec::new();
        file.take(SOURCE_MAX_BYTES)
            .read_to_end(&mut bytes)
            .map_err(|e| e.to_string())?;
        let d: [u8; 32] = Sha256::digest(&bytes).into();
        Ok(Some(d.iter().map(|b| format!("{b:02x}")).collect()))
    }
}

impl Config {
    /// [`Config::load`], and the file's digest as it was parsed.
    pub fn load_with_source(path: &Path, explicit: bool) -> Result<(Config, Source), ConfigError> {
        let read = |source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        };
        let text = match std::fs::read(path) {
            Ok(b) => Some(b),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !explicit => None,
            Err(e) => return Err(read(e)),
        };
        let cfg = match &text {
            Some(b) => {
                let t = std::str::from_utf8(b).map_err(|e| ConfigError::Parse {
                    path: path.to_path_buf(),
                    message: format!("not UTF-8: {e}"),
                })?;
                Config::parse(t, path)?
            }
            None => Config::default(),
        };
        let digest = text.map(|b| {
            use sha2::{Digest as _, Sha256};
            let d: [u8; 32] = Sha256::digest(&b).into();
            d.iter().map(|b| format!("{b:02x}")).collect()
        });
        Ok((
            cfg,
            Source {
                path: path.to_path_buf(),
                explicit,
                digest,
            },
        ))
    }
}

/// Read the key the way sudo-rs reads its policy (`secure_open`): open first, then
/// judge the open file, so that nothing can be swapped in between the check and
/// the read. `O_NOFOLLOW` refuses a symlink in the last component, `O_NONBLOCK`
/// keeps a planted FIFO from hanging the open; the descriptor's own metadata
/// (fstat) must then show a regular file owned by root or by us, with no
/// permissions for others.
pub fn read_key_file(path: &Path) -> Result<Vec<u8>, ConfigError> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let err = |message: String| ConfigError::Key {
        path: path.to_path_buf(),
        message,
    };
    let not_regular = || err("not a regular file (symlinks are refused)".into());
    let mut file = match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
    {
        Ok(f) => f,
        // O_NOFOLLOW on a symlink: ELOOP.
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => return Err(not_regular()),
        Err(e) => return Err(err(format!("cannot read: {e}"))),
    };
    let meta = file
        .metadata()
        .map_err(|e| err(format!("cannot read: {e}")))?;
    if !meta.file_type().is_file() {
        return Err(not_regular());
    }
    let me = nix::unistd::geteuid().as_raw();
    if meta.uid() != 0 && meta.uid() != me {
        return Err(err(format!(
            "owned by uid {}, who could change the key; chown it to root (or to uid {me}, who reads it)",
            meta.uid()
        )));
    }
    if meta.mode() & 0o007 != 0 {
        return Err(err(format!(
            "mode {:04o} lets other users read or change the key; chmod 0640 (or 0600) it",
            meta.mode() & 0o7777
        )));
    }
    let mut key = Vec::new();
    file.read_to_end(&mut key)
        .map_err(|e| err(format!("cannot read: {e}")))?;
    if key.len() < MIN_KEY_BYTES {
        return Err(err(format!(
            "{} bytes; a key needs at least {MIN_KEY_BYTES} random bytes (head -c 32 /dev/urandom > FILE)",
            key.len()
        )));
    }
    Ok(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shipped `packaging/scriptgate.toml` shows defaults ("every key is
    /// optional"): read with it or with an empty file, the daemon is configured the
    /// same, but for its two deliberate choices: `require_enforced_limits = true`
    /// and `run_as` a user of its own (scriptgate-script, made by sysusers.d).
    /// The numbers are compared with the code's, not copied from it.
    #[test]
    fn the_shipped_config_shows_the_defaults() {
        let shipped = include_str!("../packaging/scriptgate.toml");
        let mut c = Config::parse(shipped, Path::new("packaging/scriptgate.toml")).unwrap();
        assert!(
            c.sandbox.require_enforced_limits,
            "the package refuses unbounded scripts"
        );
        c.sandbox.require_enforced_limits = false;
        assert_eq!(c.sandbox.run_as, "scriptgate-script");
        c.sandbox.run_as = Sandbox::default().run_as;
        let empty = Config::parse("", Path::new("x.toml")).unwrap();
        assert_eq!(format!("{c:?}"), format!("{empty:?}"));
        assert_eq!(
            format!("{:?}", empty.scripts),
            format!("{:?}", Scripts::default())
        );
    }

    /// scriptgate.toml(5) shows every key with its default in one `.nf` block:
    /// that block is a config file, and it configures exactly what an empty one
    /// does, so the page cannot drift from the code.
    #[test]
    fn the_man_page_shows_the_defaults() {
        let page = include_str!("../man/scriptgate.toml.5");
        let block = page
            .split(".nf\n")
            .nth(1)
            .and_then(|b| b.split("\n.fi").next())
            .expect("the .nf block of scriptgate.toml(5)");
        let documented = Config::parse(block, Path::new("scriptgate.toml.5")).unwrap();
        let empty = Config::parse("", Path::new("x.toml")).unwrap();
        assert_eq!(format!("{documented:?}"), format!("{empty:?}"));
    }

    /// A reload takes the file's live keys, keeps the running value of every
    /// other key and names it pending; a merge that does not check is refused.
    #[test]
    fn a_reload_applies_the_live_keys_and_names_the_rest_pending() {
        let p = Path::new("c");
        let running = Config::parse("[server]\nmax_connections = 10\n", p).unwrap();
        let file = Config::parse(
            "[server]\nmax_connections = 20\ndrain_s = 5\n[scripts]\nmemory_max_bytes = 1000000\n\
             [sandbox]\nrun_as = \"daemon\"\n[[auth.engine]]\nuser = \"gw\"\ntoken_key_file = \"/k\"\n",
            p,
        )
        .unwrap();
        let r = running.reloaded(&file, p).unwrap();
        assert_eq!(r.applied, ["scripts.memory_max_bytes", "server.drain_s"]);
        assert_eq!(
            r.pending,
            ["auth.engine", "sandbox.run_as", "server.max_connections"]
        );
        assert_eq!(r.cfg.scripts.memory_max_bytes, 1000000);
        assert_eq!(r.cfg.server.drain_s, 5);
        assert_eq!(r.cfg.server.max_connections, 10);
        assert_eq!(r.cfg.sandbox.run_as, "nobody");
        assert!(r.cfg.auth.engines.is_empty());
        // The same file again: nothing applied, the same keys still pending.
        let again = r.cfg.reloaded(&file, p).unwrap();
        assert!(again.applied.is_empty());
        assert_eq!(again.pending, r.pending);
        // Every live key names a key of the configuration.
        let keys = serde_json::to_value(Config::default()).unwrap();
        for k in LIVE_KEYS {
            let (t, key) = k.split_once('.').unwrap();
            assert!(keys[t].get(key).is_some(), "{k}");
        }
        // file_max_bytes (live) below the running max_message_bytes (pending): refused.
        let file = Config::parse(
            "[server]\nmax_message_bytes = 2048\n[scripts]\nfile_max_bytes = 4096\n",
            p,
        )
        .unwrap();
        let e = running.reloaded(&file, p).unwrap_err().to_string();
        assert!(
            e.contains("scripts.file_max_bytes")
                && e.contains("settings that need a restart: server.max_connections, server.max_message_bytes"),
            "{e}"
        );
    }

    #[test]
    fn unknown_key_names_file_line_and_key() {
        let e = Config::parse(
            "[server]\nmax_running = 3\nbogus = 1\n",
            Path::new("/etc/s.toml"),
        )
        .unwrap_err();
        let m = e.to_string();
        assert!(m.starts_with("/etc/s.toml: line 3:"), "{m}");
        assert!(m.contains("bogus"), "{m}");
    }

    #[test]
    fn file_max_bytes_holds_the_script_itself() {
        for ok in ["0", "16777216", "1073741824"] {
            let text = format!("[scripts]\nfile_max_bytes = {ok}\n");
            Config::parse(&text, Path::new("c")).unwrap();
        }
        let e = Config::parse("[scripts]\nfile_max_bytes = 4096\n", Path::new("c")).unwrap_err();
        assert!(e.to_string().contains("server.max_message_bytes"), "{e}");
    }

    /// The totals of all scripts: absent is None (derived), 0 is no bound,
    /// below one script's own limit is refused, naming both keys.
    #[test]
    fn totals_are_optional_and_not_below_one_script() {
        let c = Config::parse("", Path::new("c")).unwrap();
        assert_eq!(
            (
                c.scripts.total_memory_max_bytes,
                c.scripts.total_tasks_max,
                c.scripts.total_cpu_quota_percent
            ),
            (None, None, None)
        );
        let c = Config::parse(
            "[scripts]\ntotal_memory_max_bytes = 0\ntotal_tasks_max = 256\ntotal_cpu_quota_percent = 150\n",
            Path::new("c"),
        )
        .unwrap();
        assert_eq!(
            (
                c.scripts.total_memory_max_bytes,
                c.scripts.total_tasks_max,
                c.scripts.total_cpu_quota_percent
            ),
            (Some(0), Some(256), Some(150))
        );
        for (text, said) in [
            (
                "total_memory_max_bytes = 1048576",
                "scripts.total_memory_max_bytes = 1048576 is below scripts.memory_max_bytes = 1073741824",
            ),
            (
                "total_tasks_max = 255",
                "scripts.total_tasks_max = 255 is below scripts.tasks_max = 256",
            ),
            (
                "total_cpu_quota_percent = 50",
                "scripts.total_cpu_quota_percent = 50 is below scripts.cpu_quota_percent = 100",
            ),
        ] {
            let e = Config::parse(&format!("[scripts]\n{text}\n"), Path::new("c"))
                .unwrap_err()
                .to_string();
            assert!(e.contains(said), "{e}");
            assert!(e.contains("= 0 (no bound on all scripts together)"), "{e}");
        }
        // No quota per script: any total CPU is fine.
        Config::parse(
            "[scripts]\ncpu_quota_percent = 0\ntotal_cpu_quota_percent = 10\n",
            Path::new("c"),
        )
        .unwrap();
        // A total put back to absent by a reload is applied (derived again), not pending.
        let p = Path::new("c");
        let running = Config::parse("[scripts]\ntotal_tasks_max = 300\n", p).unwrap();
        let r = running.reloaded(&Config::default(), p).unwrap();
        assert_eq!(r.applied, ["scripts.total_tasks_max"]);
        assert!(r.pending.is_empty(), "{:?}", r.pending);
        assert_eq!(r.cfg.scripts.total_tasks_max, None);
    }

    #[test]
    fn nofile_max_is_bounded() {
        let c = Config::parse("[scripts]\nnofile_max = 300\n", Path::new("c")).unwrap();
        assert_eq!(c.scripts.nofile_max, 300);
        assert_eq!(Scripts::default().nofile_max, 1024);
        for bad in [0, 10, NOFILE_MAX + 1] {
            let text = format!("[scripts]\nnofile_max = {bad}\n");
            let e = Config::parse(&text, Path::new("c")).unwrap_err();
            assert!(e.to_string().contains("scripts.nofile_max"), "{e}");
        }
    }

    #[test]
    fn wrong_type_is_an_error() {
        let e = Config::parse("[scripts]\nmax_calls = \"many\"\n", Path::new("c")).unwrap_err();
        assert!(e.to_string().contains("line 2"), "{e}");
    }

    #[test]
    fn key_file_checks() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("k");
        std::fs::write(&p, b"short").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(read_key_file(&p)
            .unwrap_err()
            .to_string()
            .contains("at least 32"));
        std::fs::write(&p, [7u8; 32]).unwrap();
        assert_eq!(read_key_file(&p).unwrap().len(), 32);
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(read_key_file(&p).unwrap_err().to_string().contains("chmod"));
        assert!(read_key_file(&d.path().join("missing")).is_err());
    }

    /// The key swapped for a symlink (to a file that would pass every check
    /// itself) is refused: the open does not follow it.
    #[test]
    fn key_file_symlink_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let real = d.path().join("real");
        std::fs::write(&real, [7u8; 32]).unwrap();
        std::fs::set_permissions(&real, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(read_key_file(&real).unwrap().len(), 32);
        let link = d.path().join("k");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        let e = read_key_file(&link).unwrap_err().to_string();
        assert!(e.contains("symlinks are refused"), "{e}");
        // Not a regular file at all: a FIFO does not hang the open.
        let fifo = d.path().join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let e = read_key_file(&fifo).unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{e}");
        // Owned by someone else (who could rewrite it): refused when we are root.
        if nix::unistd::geteuid().is_root() {
            std::os::unix::fs::chown(&real, Some(65534), None).unwrap();
            let e = read_key_file(&real).unwrap_err().to_string();
            assert!(e.contains("owned by uid 65534"), "{e}");
        }
    }
}
