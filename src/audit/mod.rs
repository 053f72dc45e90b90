//! The audit store: one SQLite row per script (written when it starts, completed
//! when it ends), refused starts, and revoked runs. WAL; one writer thread owns the
//! write connection; readers use their own connection.

pub(crate) mod checkpoint;
pub mod connections;
pub mod journal;
pub mod live;
pub(crate) mod metrics;
pub mod trail;

use crate::protocol::{ScriptResult, Status};
use crate::time::now_ms;
use rusqlite::{params, Connection, OpenFlags, OptionalExtension};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Mutex};

const SCHEMA_VERSION: i64 = MIGRATIONS.len() as i64;

/// Upper bounds of the script-duration histogram, in seconds.
const DURATION_BOUNDS_S: [f64; 11] = [
    0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 1800.0, 3600.0,
];

/// The histogram's buckets as `(le label, bound)`, `+Inf` last.
pub fn duration_buckets() -> Vec<(String, f64)> {
    DURATION_BOUNDS_S
        .iter()
        .map(|b| (format!("{b}"), *b))
        .chain(std::iter::once(("+Inf".to_string(), f64::INFINITY)))
        .collect()
}

/// A workspace the daemon recorded as retention's to remove (audit store).
#[derive(Debug, Clone, PartialEq)]
pub struct Vouched {
    pub path: PathBuf,
    pub dev: u64,
    pub ino: u64,
    /// The engine whose script the daemon recorded in it.
    pub peer_uid: u32,
    /// The last script start in it the daemon recorded: a workspace is old only
    /// when this and its file system times are (scripts can set those).
    pub last_at_ms: i64,
}

const MIGRATIONS: &[&str] = &[
    // v1
    "CREATE TABLE scripts (
        script_id TEXT PRIMARY KEY,
        run_id TEXT NOT NULL,
        runner TEXT,
        peer_uid INTEGER,
        peer_pid INTEGER,
        run_uid INTEGER,
        description TEXT NOT NULL DEFAULT '',
        code TEXT NOT NULL,
        tools TEXT NOT NULL DEFAULT '[]',
        approval TEXT NOT NULL,
        workspace TEXT NOT NULL,
        backend TEXT NOT NULL,
        unit TEXT,
        started_at INTEGER NOT NULL,
        ended_at INTEGER,
        status TEXT NOT NULL,
        exit_code INTEGER,
        calls INTEGER NOT NULL DEFAULT 0,
        failures INTEGER NOT NULL DEFAULT 0,
        tool_counts TEXT NOT NULL DEFAULT '{}',
        duration_ms INTEGER,
        details_dir TEXT NOT NULL,
        memory_peak_bytes INTEGER,
        cpu_usec INTEGER,
        result TEXT
     );
     CREATE INDEX scripts_run ON scripts(run_id);
     CREATE INDEX scripts_started ON scripts(started_at);
     CREATE INDEX scripts_status ON scripts(status);
     CREATE TABLE refusals (
        id INTEGER PRIMARY KEY,
        at INTEGER NOT NULL,
        run_id TEXT,
        runner TEXT,
        peer_uid INTEGER,
        peer_pid INTEGER,
        code INTEGER NOT NULL,
        reason TEXT,
        message TEXT NOT NULL
     );
     CREATE INDEX refusals_at ON refusals(at);
     CREATE TABLE revoked_runs (
        run_id TEXT PRIMARY KEY,
        at INTEGER NOT NULL
     );",
    // v2: counters for `scriptgate metrics`, kept apart from the rows so that they
    // survive audit retention and restarts (seeded from the rows by seed_metrics).
    "CREATE TABLE metrics (
        name TEXT NOT NULL,
        label TEXT NOT NULL DEFAULT '',
        value REAL NOT NULL DEFAULT 0,
        PRIMARY KEY (name, label)
     );",
    // v3 (run scopes, vouched workspaces): every script's run scope (the engine
    // entry, or the shared key and the peer's uid; crate::policy::runs::Scope) in a
    // column of its own beside the bare run id; revocations keyed by (scope, run
    // id), never one string an engine could spell (the old rows are converted by
    // migrate_v3_run_scopes); the workspaces retention may remove, recorded by the
    // daemon alone (crate::daemon::prune).
    "ALTER TABLE scripts ADD COLUMN scope TEXT;
     CREATE TABLE revocations (
        scope TEXT NOT NULL,
        run_id TEXT NOT NULL,
        at INTEGER NOT NULL,
        PRIMARY KEY (scope, run_id)
     );
     CREATE TABLE workspaces (
        path TEXT PRIMARY KEY,
        dev INTEGER NOT NULL,
        ino INTEGER NOT NULL,
        peer_uid INTEGER NOT NULL,
        first_at INTEGER NOT NULL,
        last_at INTEGER NOT NULL
     );",
    // v4: revocations bounded per scope (crate::policy::runs::REVOCATIONS_PER_SCOPE),
    // oldest first by rowid (insertion order); trim_revocations drops what a store
    // of before kept past the bound.
    "CREATE INDEX revocations_scope ON revocations(scope);",
    // v5: the W3C trace id of the engine's span that started the script
    // (`script.start`'s `traceparent`; crate::protocol::trace).
    "ALTER TABLE scripts ADD COLUMN trace_id TEXT;",
    // v6: when the daemon last saw a running script running (set at its start,
    // then every checkpoint tick), so that a row a dead daemon left `running`
    // becomes `interrupted` with the time the script ran, not the time until
    // the next start.
    "ALTER TABLE scripts ADD COLUMN seen_at INTEGER;",
    // v7: the project quota id of each workspace the daemon bounded
    // (`scripts.disk_max_bytes`, crate::daemon::disk), by the directory's
    // (device, inode): never two workspaces with one id.
    "CREATE TABLE projects (
        projid INTEGER PRIMARY KEY,
        dev INTEGER NOT NULL,
        ino INTEGER NOT NULL,
        at INTEGER NOT NULL,
        UNIQUE (dev, ino)
     );",
    // v8: refused connections, counted per minute, uid and reason (one row
    // each, however many; crate::audit::connections bounds the rows).
    "CREATE TABLE refused_connections (
        minute INTEGER NOT NULL,
        peer_uid INTEGER NOT NULL,
        reason TEXT NOT NULL,
        count INTEGER NOT NULL,
        PRIMARY KEY (minute, peer_uid, reason)
     );",
    // v9: how long the sandbox's teardown took after the script's end (bwrap's
    // exit, the namespaces', the unit's): written once it is done, after the
    // result (`Store::set_teardown`); NULL until then, or for ever when the
    // daemon went first.
    "ALTER TABLE scripts ADD COLUMN teardown_ms INTEGER;",
];

/// The first project quota id the daemon gives a workspace
/// (`Store::project_for`): `SG` in its high bytes, far from the small ids
/// administrators give by hand.
pub const FIRST_PROJECT: u32 = 0x5347_0000;

/// Keep at most `bound` revocations of each scope, the newest (insertion order,
/// rowid): what a store of before v4 held past the bound. Returns how many were
/// dropped.
fn trim_revocations(c: &Connection, bound: usize) -> rusqlite::Result<usize> {
    c.execute(
        "DELETE FROM revocations WHERE rowid IN (
           SELECT rid FROM (SELECT rowid AS rid,
             row_number() OVER (PARTITION BY scope ORDER BY rowid DESC) AS n FROM revocations)
           WHERE n > ?1)",
        [bound as i64],
    )
}

/// Add `counted` to `refused_connections` and the counters, keeping at most
/// `bound` rows (the newest minutes), in one transaction.
fn refused_connection_rows(
    c: &mut Connection,
    counted: &[connections::Counted],
    bound: usize,
) -> rusqlite::Result<()> {
    let tx = c.transaction()?;
    {
        let mut s = tx.prepare_cached(
            "INSERT INTO refused_connections (minute, peer_uid, reason, count) VALUES (?1, ?2, ?3, ?4)
             ON CONFLICT (minute, peer_uid, reason) DO UPDATE SET count = count + excluded.count",
        )?;
        for (minute, uid, reason, n) in counted {
            s.execute(params![minute, uid, reason, *n as i64])?;
        }
    }
    for (_, _, reason, n) in counted {
        bump(&tx, "connections_refused", reason, *n as f64)?;
    }
    tx.execute(
        "DELETE FROM refused_connections WHERE rowid IN (
           SELECT rowid FROM refused_connections ORDER BY minute DESC LIMIT -1 OFFSET ?1)",
        [bound as i64],
    )?;
    tx.commit()
}

/// Record a revocation of `(scope, run_id)` (again: it becomes the newest of its
/// scope), then drop the oldest of that scope past `bound`. Returns how many
/// were dropped.
fn revoke_row(
    c: &mut Connection,
    scope: &str,
    run_id: &str,
    bound: usize,
) -> rusqlite::Result<usize> {
    let tx = c.transaction()?;
    tx.execute(
        "DELETE FROM revocations WHERE scope = ?1 AND run_id = ?2",
        params![scope, run_id],
    )?;
    tx.execute(
        "INSERT INTO revocations (scope, run_id, at) VALUES (?1, ?2, ?3)",
        params![scope, run_id, now_ms()],
    )?;
    let dropped = tx.execute(
        "DELETE FROM revocations WHERE rowid IN (
           SELECT rowid FROM revocations WHERE scope = ?1 ORDER BY rowid DESC LIMIT -1 OFFSET ?2)",
        params![scope, bound as i64],
    )?;
    tx.commit()?;
    Ok(dropped)
}

/// Migration v3, its data: each v2 revocation (one string: `<entry label> <run
/// id>` or a bare run id) becomes a (scope, run id) row, read as the daemon that
/// wrote it meant it (`RunKey::from_legacy`), oldest first. Scripts rows of v2
/// keep no scope (NULL): their results are the administrators' (`scriptgate
/// audit`), no token shows them.
///
/// No file system access: the migration runs as root inside the start-up
/// transaction, and a workspace path of the history may lie on a file system
/// that hangs (NFS) or behind symlinks. `workspaces` starts empty; a workspace
/// of before the upgrade is recorded when a script next starts in it, and is not
/// pruned until then (a leak, never a loss; scriptgated(8), WORKSPACE RETENTION).
fn migrate_v3_run_scopes(c: &Connection) -> rusqlite::Result<()> {
    let old: Vec<(String, i64)> = {
        let mut s = c.prepare("SELECT run_id, at FROM revoked_runs ORDER BY at, rowid")?;
        let rows = s.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?;
        rows.collect::<rusqlite::Result<_>>()?
    };
    for (key, at) in old {
        let k = crate::policy::runs::RunKey::from_legacy(&key);
        c.execute(
            "INSERT OR IGNORE INTO revocations (scope, run_id, at) VALUES (?1, ?2, ?3)",
            params![k.scope.to_db(), k.run_id, at],
        )?;
    }
    c.execute_batch("DROP TABLE revoked_runs;")
}

/// Record (or refresh) a workspace retention may remove once unused.
fn vouch_workspace(
    c: &Connection,
    path: &str,
    dev: u64,
    ino: u64,
    peer_uid: u32,
    at: i64,
) -> rusqlite::Result<()> {
    c.execute(
        "INSERT INTO workspaces (path, dev, ino, peer_uid, first_at, last_at) VALUES (?1, ?2, ?3, ?4, ?5, ?5)
         ON CONFLICT (path) DO UPDATE SET dev = excluded.dev, ino = excluded.ino,
           peer_uid = excluded.peer_uid, last_at = max(last_at, excluded.last_at)",
        params![path, dev as i64, ino as i64, peer_uid, at],
    )
    .map(|_| ())
}

fn vouched_rows(c: &Connection) -> rusqlite::Result<Vec<Vouched>> {
    let mut s =
        c.prepare("SELECT path, dev, ino, last_at, peer_uid FROM workspaces ORDER BY path")?;
    let rows = s.query_map([], |r| {
        Ok(Vouched {
            path: PathBuf::from(r.get::<_, String>(0)?),
            dev: r.get::<_, i64>(1)? as u64,
            ino: r.get::<_, i64>(2)? as u64,
            peer_uid: r.get::<_, i64>(4)? as u32,
            last_at_ms: r.get(3)?,
        })
    })?;
    rows.collect()
}

/// Add `by` to one counter of the `metrics` table.
fn bump(c: &Connection, name: &str, label: &str, by: f64) -> rusqlite::Result<()> {
    c.execute(
        "INSERT INTO metrics (name, label, value) VALUES (?1, ?2, ?3)
         ON CONFLICT (name, label) DO UPDATE SET value = value + excluded.value",
        params![name, label, by],
    )
    .map(|_| ())
}

/// The counters of one finished script: by status, its calls and failures, and
/// its duration in the histogram.
fn count_finished(
    c: &Connection,
    status: &str,
    calls: u64,
    failures: u64,
    duration_ms: u64,
) -> rusqlite::Result<()> {
    bump(c, "finished", status, 1.0)?;
    bump(c, "calls", "", calls as f64)?;
    bump(c, "failures", "", failures as f64)?;
    let secs = duration_ms as f64 / 1000.0;
    for (le, bound) in duration_buckets() {
        if secs <= bound {
            bump(c, "duration_bucket", &le, 1.0)?;
        }
    }
    bump(c, "duration_sum", "", secs)?;
    bump(c, "duration_count", "", 1.0)
}

/// A store older than v2 has rows but no counters: count what the rows hold.
fn seed_metrics(c: &Connection) -> rusqlite::Result<()> {
    let started: i64 = c.query_row("SELECT count(*) FROM scripts", [], |r| r.get(0))?;
    bump(c, "started", "", started as f64)?;
    let mut s = c.prepare(
        "SELECT status, calls, failures, coalesce(duration_ms, 0) FROM scripts WHERE status != 'running'",
    )?;
    let rows = s.query_map([], |r| {
        Ok((
            r.get::<_, String>(0)?,
            r.get::<_, i64>(1)?,
            r.get::<_, i64>(2)?,
            r.get::<_, i64>(3)?,
        ))
    })?;
    for row in rows {
        let (status, calls, failures, ms) = row?;
        count_finished(c, &status, calls as u64, failures as u64, ms.max(0) as u64)?;
    }
    let mut s = c.prepare(
        "SELECT coalesce(reason, 'other'), count(*) FROM refusals WHERE code != 0 GROUP BY 1",
    )?;
    let rows = s.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?)))?;
    for row in rows {
        let (reason, n) = row?;
        bump(c, "refusals", &reason, n as f64)?;
    }
    Ok(())
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("audit store {path}: {op}: {source}")]
    Sql {
        path: PathBuf,
        op: &'static str,
        source: rusqlite::Error,
    },
    #[error("audit store {path}: schema version {found} is newer than this scriptgate ({SCHEMA_VERSION})")]
    TooNew { path: PathBuf, found: i64 },
    #[error("audit store writer thread is gone")]
    Gone,
    #[error("audit store {path}: its write-ahead log {path}-wal holds rows this user cannot read (it may not open {path}-shm); run this as root, or after scriptgated stopped cleanly")]
    WalUnreadable { path: PathBuf },
    #[error("{path} exists; a backup is never written over a file: remove it or name another")]
    Exists { path: PathBuf },
    #[error("backup {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// What `wal_checkpoint(TRUNCATE)` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WalCheckpoint {
    /// A reader held the log: it was not (all) folded in.
    pub busy: bool,
    /// Frames in the log, and those folded into the database file.
    pub frames: i64,
    pub folded: i64,
}

/// What a backup copied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backup {
    pub scripts: i64,
    pub refusals: i64,
    pub bytes: u64,
}

impl StoreError {
    /// SQLite found the store's filesystem full (SQLITE_FULL).
    pub fn is_full(&self) -> bool {
        matches!(self, StoreError::Sql { source, .. } if is_full(source))
    }
}

fn is_full(e: &rusqlite::Error) -> bool {
    matches!(e, rusqlite::Error::SqliteFailure(f, _) if f.code == rusqlite::ErrorCode::DiskFull)
}

/// Space kept in the state directory for the rows of scripts that end while its
/// filesystem is full (a script filled it): a preallocated file next to the
/// store. A finish row that meets SQLITE_FULL removes it (logged at err) and is
/// written again; the daemon sets it aside again once there is space
/// ([`Store::keep_reserve`]), and refuses to start scripts until it can.
struct Reserve {
    path: PathBuf,
    /// Released and not yet made again.
    released: std::sync::atomic::AtomicBool,
    /// One maker at a time (starts and ends may try together).
    making: Mutex<()>,
}

impl Reserve {
    /// Remove the file to free its space; false when there was none.
    fn release(&self, why: &str) -> bool {
        match std::fs::remove_file(&self.path) {
            Ok(()) => {
                self.released
                    .store(true, std::sync::atomic::Ordering::SeqCst);
                tracing::error!(
                    "the filesystem of the audit store is full: released the reserve {} to {why}; \
                     free space there (a script may have filled it: put workspace roots on a \
                     filesystem apart from state.dir, or give them a quota)",
                    self.path.display()
                );
                true
            }
            Err(_) => false,
        }
    }

    /// Make the file `bytes` long, blocks allocated, unless it already is.
    fn keep(&self, bytes: u64) -> std::io::Result<()> {
        use std::sync::atomic::Ordering;
        if bytes == 0 {
            return Ok(());
        }
        let _one = self.making.lock().unwrap_or_else(|p| p.into_inner());
        if std::fs::metadata(&self.path).is_ok_and(|m| m.len() >= bytes) {
            return Ok(());
        }
        let tmp = self.path.with_extension("reserve.new");
        let made = (|| {
            let f = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .open(&tmp)?;
            nix::fcntl::posix_fallocate(&f, 0, bytes as i64).map_err(std::io::Error::from)?;
            std::fs::rename(&tmp, &self.path)
        })();
        if made.is_err() {
            let _ = std::fs::remove_file(&tmp);
        } else if self.released.swap(false, Ordering::SeqCst) {
            tracing::info!(
                "the audit store's reserve {} is set aside again ({bytes} bytes)",
                self.path.display()
            );
        }
        made
    }
}

/// The row written when a script starts.
#[derive(Debug, Clone)]
pub struct StartRow {
    pub script_id: String,
    pub run_id: String,
    pub runner: Option<String>,
    pub peer_uid: u32,
    pub peer_pid: Option<i32>,
    pub run_uid: u32,
    pub description: String,
    pub code: String,
    pub tools: Vec<String>,
    /// `not_needed`, `allow_once`, `session_allowed`, `auto`.
    pub approval: String,
    pub workspace: String,
    pub backend: String,
    pub unit: Option<String>,
    pub started_at_ms: i64,
    pub details_dir: String,
    /// The run's scope (`Scope::to_db`): who may see the script by token.
    pub scope: String,
    /// The workspace's (dev, ino) when retention may remove it once unused
    /// (crate::daemon::prune::vouch); None: never.
    pub vouched: Option<(u64, u64)>,
    /// The engine's trace id, when it started the script with a `traceparent`.
    pub trace_id: Option<String>,
}

/// A refused `script.start`.
#[derive(Debug, Clone)]
pub struct RefusalRow {
    pub run_id: Option<String>,
    pub runner: Option<String>,
    pub peer_uid: u32,
    pub peer_pid: Option<i32>,
    pub code: i64,
    pub reason: Option<String>,
    pub message: String,
}

type Job = Box<dyn FnOnce(&mut Connection) + Send>;

/// The daemon's audit store, `scriptgate.db` in the state directory (SQLite,
/// write-ahead log): one row per script (written before it runs, finished when
/// it ends, its counts checkpointed while it runs), the refusals, the revoked
/// runs, the workspaces retention may remove and their project ids, and the
/// metrics' counters. Every write goes through one writer thread, in the order
/// it was queued (`write`); reads use a connection of their own. A reserve file
/// beside it keeps room to record scripts' ends on a full filesystem.
/// Opened by [`Store::open`], which migrates the schema and marks what a dead
/// daemon left running `interrupted`.
pub struct Store {
    path: PathBuf,
    tx: mpsc::Sender<Job>,
    reader: Mutex<Connection>,
    reserve: std::sync::Arc<Reserve>,
}

/// A failed SQLite operation `op` on the store at `path`.
fn sql_error(path: &Path, op: &'static str) -> impl FnOnce(rusqlite::Error) -> StoreError {
    let path = path.to_path_buf();
    move |source| StoreError::Sql { path, op, source }
}

/// The writer's connection: WAL, `synchronous = NORMAL`, a busy timeout.
fn open_writer(path: &Path) -> Result<Connection, StoreError> {
    let sql = |op| sql_error(path, op);
    let w = Connection::open(path).map_err(sql("open"))?;
    w.busy_timeout(std::time::Duration::from_secs(5))
        .map_err(sql("busy_timeout"))?;
    // Switching a fresh store to WAL needs a lock that another process
    // opening it at the same moment may hold, and SQLite answers BUSY there
    // without waiting (no busy handler: it could deadlock): try again, for
    // as long as the busy timeout.
    let t0 = std::time::Instant::now();
    loop {
        match w.pragma_update(None, "journal_mode", "WAL") {
            Err(rusqlite::Error::SqliteFailure(e, _))
                if e.code == rusqlite::ErrorCode::DatabaseBusy
                    && t0.elapsed() < std::time::Duration::from_secs(5) =>
            {
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            r => break r.map_err(sql("enable WAL"))?,
        }
    }
    w.pragma_update(None, "synchronous", "NORMAL")
        .map_err(sql("set synchronous"))?;
    Ok(w)
}

/// Bring the schema to [`SCHEMA_VERSION`]. Each step in an IMMEDIATE
/// transaction that reads the version itself: two processes opening a fresh
/// store together (the CLI's embedded daemons) take the steps one after the
/// other, never both the same one.
fn migrate(w: &mut Connection, path: &Path) -> Result<(), StoreError> {
    let sql = |op| sql_error(path, op);
    loop {
        let tx = w
            .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
            .map_err(sql("begin migration"))?;
        let version: i64 = tx
            .pragma_query_value(None, "user_version", |r| r.get(0))
            .map_err(sql("read user_version"))?;
        if version > SCHEMA_VERSION {
            return Err(StoreError::TooNew {
                path: path.to_path_buf(),
                found: version,
            });
        }
        let i = version as usize;
        let Some(m) = MIGRATIONS.get(i) else {
            return Ok(());
        };
        tx.execute_batch(m).map_err(sql("migrate"))?;
        migrated_data(&tx, i + 1, path)?;
        tx.pragma_update(None, "user_version", (i + 1) as i64)
            .map_err(sql("set user_version"))?;
        tx.commit().map_err(sql("commit migration"))?;
    }
}

/// What a migration to `version` does to the rows, beyond its SQL.
fn migrated_data(tx: &Connection, version: usize, path: &Path) -> Result<(), StoreError> {
    let sql = |op| sql_error(path, op);
    match version {
        2 => seed_metrics(tx).map_err(sql("count the existing rows for metrics")),
        3 => migrate_v3_run_scopes(tx).map_err(sql("scope the stored runs (v3)")),
        4 => {
            let n = trim_revocations(tx, crate::policy::runs::REVOCATIONS_PER_SCOPE)
                .map_err(sql("bound the revocations per scope (v4)"))?;
            if n > 0 {
                tracing::warn!(
                    "audit store: dropped the {n} oldest run revocations past {} per scope",
                    crate::policy::runs::REVOCATIONS_PER_SCOPE
                );
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

impl Store {
    /// Open (creating and migrating) the store. Rows left `running` by a daemon that
    /// died are turned `interrupted`; their results are returned so the caller can
    /// log them.
    pub fn open(
        path: &Path,
        reader_gid: Option<u32>,
    ) -> Result<(Store, Vec<Recovered>), StoreError> {
        let sql = |op| sql_error(path, op);
        let mut w = open_writer(path)?;
        migrate(&mut w, path)?;
        let reserve = std::sync::Arc::new(Reserve {
            path: PathBuf::from(format!("{}.reserve", path.display())),
            released: Default::default(),
            making: Mutex::new(()),
        });
        // A daemon that died on a full filesystem: its scripts' ends are written
        // with the space its reserve kept.
        let interrupted = match recover_interrupted(&mut w, path) {
            Err(e) if is_full(&e) && reserve.release("record interrupted scripts") => {
                recover_interrupted(&mut w, path)
            }
            r => r,
        }
        .map_err(sql("recover interrupted scripts"))?;
        restrict_access(path, reader_gid);
        let reader = Connection::open_with_flags(
            path,
            OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .map_err(sql("open reader"))?;
        reader
            .busy_timeout(std::time::Duration::from_secs(5))
            .map_err(sql("busy_timeout"))?;
        let (tx, rx) = mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name("scriptgate-audit".into())
            .spawn(move || {
                for job in rx {
                    job(&mut w);
                }
            })
            .expect("spawn audit writer");
        Ok((
            Store {
                path: path.to_path_buf(),
                tx,
                reader: Mutex::new(reader),
                reserve,
            },
            interrupted,
        ))
    }

    /// Run a write on the writer thread and wait for it.
    async fn write<T: Send + 'static>(
        &self,
        op: &'static str,
        f: impl FnOnce(&mut Connection) -> rusqlite::Result<T> + Send + 'static,
    ) -> Result<T, StoreError> {
        self.submit(op, f).await
    }

    /// Queue a write on the writer thread now (writes run in the order they
    /// are queued); the future waits for it.
    fn submit<T: Send + 'static>(
        &self,
        op: &'static str,
        f: impl FnOnce(&mut Connection) -> rusqlite::Result<T> + Send + 'static,
    ) -> impl std::future::Future<Output = Result<T, StoreError>> + Send + 'static {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let sent = self
            .tx
            .send(Box::new(move |c| {
                let _ = tx.send(f(c));
            }))
            .map_err(|_| StoreError::Gone);
        let path = self.path.clone();
        async move {
            sent?;
            rx.await
                .map_err(|_| StoreError::Gone)?
                .map_err(|source| StoreError::Sql { path, op, source })
        }
    }

    pub async fn insert_started(&self, r: StartRow) -> Result<(), StoreError> {
        self.write("insert started script", move |c| {
            let tx = c.transaction()?;
            tx.execute(
                "INSERT INTO scripts (script_id, run_id, runner, peer_uid, peer_pid, run_uid, description, code, tools,
                   approval, workspace, backend, unit, started_at, status, details_dir)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, 'running', ?15)",
                params![
                    r.script_id, r.run_id, r.runner, r.peer_uid, r.peer_pid, r.run_uid, r.description, r.code,
                    serde_json::to_string(&r.tools).unwrap_or_default(), r.approval, r.workspace, r.backend, r.unit,
                    r.started_at_ms, r.details_dir
                ],
            )?;
            bump(&tx, "started", "", 1.0)?;
            tx.execute(
                "UPDATE scripts SET scope = ?2, trace_id = ?3, seen_at = ?4 WHERE script_id = ?1",
                params![r.script_id, r.scope, r.trace_id, r.started_at_ms],
            )?;
            match r.vouched {
                Some((dev, ino)) => {
                    vouch_workspace(&tx, &r.workspace, dev, ino, r.peer_uid, r.started_at_ms)?
                }
                None => {
                    tx.execute(
                        "UPDATE workspaces SET last_at = max(last_at, ?2) WHERE path = ?1",
                        params![r.workspace, r.started_at_ms],
                    )?;
                }
            }
            tx.commit()
        })
        .await
    }

    /// Complete a script's row. On a full filesystem (SQLITE_FULL) the reserve is
    /// released and the row written again: the row must not stay `running`.
    pub async fn finish(
        &self,
        result: &ScriptResult,
        tool_counts: Value,
    ) -> Result<(), StoreError> {
        let r = result.clone();
        let reserve = self.reserve.clone();
        self.write("record finished script", move |c| {
            let why = format!("record the end of script {}", r.script_id);
            match finish_row(c, &r, &tool_counts) {
                Err(e) if is_full(&e) && reserve.release(&why) => finish_row(c, &r, &tool_counts),
                done => done,
            }
        })
        .await
    }

    /// How long the sandbox of a finished script took to go after its end
    /// (`teardown_ms`; written after the result, which does not wait for it).
    pub async fn set_teardown(&self, script_id: &str, teardown_ms: u64) -> Result<(), StoreError> {
        let id = script_id.to_string();
        self.write("record a sandbox's teardown time", move |c| {
            c.execute(
                "UPDATE scripts SET teardown_ms = ?2 WHERE script_id = ?1",
                params![id, teardown_ms as i64],
            )
            .map(|_| ())
        })
        .await
    }

    /// Set the reserve aside (`state.reserve_bytes`; 0: none) if it is not:
    /// at each start, and after a script's end used it. ENOSPC while the
    /// filesystem stays full.
    pub fn keep_reserve(&self, bytes: u64) -> std::io::Result<()> {
        self.reserve.keep(bytes)
    }

    /// Keep running scripts' counters current (one transaction for all of them),
    /// so that a daemon killed mid-script leaves the counts it had, not 0, and
    /// mark every script of `alive` seen running now (`seen_at`: a killed
    /// daemon's rows then say how long they ran). Only rows still `running` are
    /// touched: a finished row keeps its final counts.
    pub async fn checkpoint_counts(
        &self,
        rows: Vec<(String, u64, u64)>,
        alive: Vec<String>,
    ) -> Result<(), StoreError> {
        if rows.is_empty() && alive.is_empty() {
            return Ok(());
        }
        let now = now_ms();
        self.write("checkpoint running scripts' counts", move |c| {
            let tx = c.transaction()?;
            {
                let mut s = tx.prepare_cached(
                    "UPDATE scripts SET calls = ?2, failures = ?3 WHERE script_id = ?1 AND status = 'running'",
                )?;
                for (id, calls, failures) in &rows {
                    s.execute(params![id, *calls as i64, *failures as i64])?;
                }
                let mut s = tx.prepare_cached(
                    "UPDATE scripts SET seen_at = ?2 WHERE script_id = ?1 AND status = 'running'",
                )?;
                for id in &alive {
                    s.execute(params![id, now])?;
                }
            }
            tx.commit()
        })
        .await
    }

    /// Fold the write-ahead log into the database file and empty it
    /// (`wal_checkpoint(TRUNCATE)`), so that after a clean stop `scriptgate.db`
    /// alone is the whole store: a copy of it is a backup, and a reader who
    /// cannot open `-shm` reads every row. A reader holding a snapshot makes it
    /// partial (`busy`).
    pub async fn checkpoint_wal(&self) -> Result<WalCheckpoint, StoreError> {
        self.write("checkpoint the write-ahead log", |c| {
            c.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |r| {
                Ok(WalCheckpoint {
                    busy: r.get::<_, i64>(0)? != 0,
                    frames: r.get(1)?,
                    folded: r.get(2)?,
                })
            })
        })
        .await
    }

    pub async fn refusal(&self, r: RefusalRow) -> Result<(), StoreError> {
        let reason = r.reason.clone().unwrap_or_else(|| "other".into());
        self.refusal_counted(r, vec![(reason, 1)]).await
    }

    /// A refusal row, and the refusals it stands for counted by reason (one
    /// refusal, or a summary of those that came faster than the rate limit).
    pub async fn refusal_counted(
        &self,
        r: RefusalRow,
        by_reason: Vec<(String, u64)>,
    ) -> Result<(), StoreError> {
        self.write("record refusal", move |c| {
            let tx = c.transaction()?;
            tx.execute(
                "INSERT INTO refusals (at, run_id, runner, peer_uid, peer_pid, code, reason, message)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
                params![now_ms(), r.run_id, r.runner, r.peer_uid, r.peer_pid, r.code, r.reason, r.message],
            )?;
            for (reason, n) in &by_reason {
                bump(&tx, "refusals", reason, *n as f64)?;
            }
            tx.commit()
        })
        .await
    }

    /// Refused connections counted since the last write: each (minute, uid,
    /// reason) one row, its count added to; the connections-refused counters
    /// by reason; then the oldest minutes past
    /// [`connections::MAX_ROWS`] dropped.
    pub async fn refused_connections(
        &self,
        counted: Vec<connections::Counted>,
    ) -> Result<(), StoreError> {
        if counted.is_empty() {
            return Ok(());
        }
        self.write("count refused connections", move |c| {
            refused_connection_rows(c, &counted, connections::MAX_ROWS)
        })
        .await
    }

    /// Record a revocation; past `policy::runs::REVOCATIONS_PER_SCOPE` of
    /// its scope, the oldest of that scope is deleted. The write is queued at
    /// once (the caller queues it under the lock of its in-memory set, so that
    /// both drop the same oldest); the future returns how many were deleted.
    pub fn revoke(
        &self,
        run: &crate::policy::runs::RunKey,
    ) -> impl std::future::Future<Output = Result<usize, StoreError>> + Send + 'static {
        self.revoke_bounded(run, crate::policy::runs::REVOCATIONS_PER_SCOPE)
    }

    fn revoke_bounded(
        &self,
        run: &crate::policy::runs::RunKey,
        bound: usize,
    ) -> impl std::future::Future<Output = Result<usize, StoreError>> + Send + 'static {
        let (scope, run_id) = (run.scope.to_db(), run.run_id.clone());
        self.submit("record revocation", move |c| {
            revoke_row(c, &scope, &run_id, bound)
        })
    }

    /// The workspaces retention may remove (recorded by this daemon).
    pub fn vouched_workspaces(&self) -> Result<Vec<Vouched>, StoreError> {
        self.read("list vouched workspaces", vouched_rows)
    }

    /// Retention removed these workspaces, or they are no longer the directory
    /// that was recorded: forget them.
    pub async fn forget_workspaces(&self, paths: Vec<PathBuf>) -> Result<(), StoreError> {
        if paths.is_empty() {
            return Ok(());
        }
        self.write("forget workspaces", move |c| forget_rows(c, &paths))
            .await
    }

    /// The project quota id of the workspace directory `(dev, ino)`: the one it
    /// was given before, or the next free one.
    pub async fn project_for(&self, dev: u64, ino: u64) -> Result<u32, StoreError> {
        self.write("give a workspace its project id", move |c| {
            let tx = c.transaction()?;
            let known: Option<i64> = tx
                .query_row(
                    "SELECT projid FROM projects WHERE dev = ?1 AND ino = ?2",
                    params![dev as i64, ino as i64],
                    |r| r.get(0),
                )
                .optional()?;
            let id = match known {
                Some(id) => id,
                None => {
                    let next: i64 = tx.query_row(
                        "SELECT COALESCE(MAX(projid) + 1, ?1) FROM projects",
                        [FIRST_PROJECT as i64],
                        |r| r.get(0),
                    )?;
                    tx.execute(
                        "INSERT INTO projects (projid, dev, ino, at) VALUES (?1, ?2, ?3, ?4)",
                        params![next, dev as i64, ino as i64, now_ms()],
                    )?;
                    next
                }
            };
            tx.commit()?;
            Ok(id as u32)
        })
        .await
    }

    fn read<T>(
        &self,
        op: &'static str,
        f: impl FnOnce(&Connection) -> rusqlite::Result<T>,
    ) -> Result<T, StoreError> {
        let c = self.reader.lock().unwrap_or_else(|p| p.into_inner());
        f(&c).map_err(|source| StoreError::Sql {
            path: self.path.clone(),
            op,
            source,
        })
    }

    /// Delete finished scripts and refusals older than `retain_days`. Running
    /// scripts are never touched. Returns (scripts, refusals) deleted.
    pub async fn prune(&self, retain_days: u64) -> Result<(usize, usize), StoreError> {
        let cutoff = now_ms() - (retain_days as i64).saturating_mul(86_400_000);
        self.write("prune", move |c| {
            let s = c.execute("DELETE FROM scripts WHERE status != 'running' AND ended_at IS NOT NULL AND ended_at < ?1", [cutoff])?;
            let r = c.execute("DELETE FROM refusals WHERE at < ?1", [cutoff])?;
            c.execute("DELETE FROM refused_connections WHERE minute < ?1", [cutoff])?;
            Ok((s, r))
        })
        .await
    }

    pub fn revoked_runs(&self) -> Result<Vec<crate::policy::runs::RunKey>, StoreError> {
        self.read("list revoked runs", |c| {
            // Oldest first: past the bound, crate::policy::runs::Revocations drops those.
            let mut s = c.prepare("SELECT scope, run_id FROM revocations ORDER BY rowid")?;
            let rows = s.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)))?;
            let mut out = Vec::new();
            for row in rows {
                let (scope, run_id) = row?;
                match crate::policy::runs::Scope::from_db(&scope) {
                    Some(scope) => out.push(crate::policy::runs::RunKey { scope, run_id }),
                    None => tracing::warn!("audit store: revocation of run {run_id:?} has an unknown scope {scope:?}; ignored"),
                }
            }
            Ok(out)
        })
    }

    /// A finished script's stored result and the scope of its run (None: a row
    /// of before v3, or one whose scope this daemon does not know).
    pub fn run_of(
        &self,
        script_id: &str,
    ) -> Result<Option<(ScriptResult, Option<crate::policy::runs::Scope>)>, StoreError> {
        self.read("read result and scope", |c| {
            c.query_row(
                "SELECT result, scope FROM scripts WHERE script_id = ?1 AND result IS NOT NULL",
                [script_id],
                |r| Ok((r.get::<_, String>(0)?, r.get::<_, Option<String>>(1)?)),
            )
            .optional()
        })
        .map(|o| {
            o.and_then(|(res, scope)| {
                let res = serde_json::from_str(&res).ok()?;
                Some((
                    res,
                    scope
                        .as_deref()
                        .and_then(crate::policy::runs::Scope::from_db),
                ))
            })
        })
    }
}

/// Delete the `workspaces` rows of `paths`, in one transaction (IMMEDIATE: the
/// write lock is taken, or waited for, before anything is read).
fn forget_rows(c: &mut Connection, paths: &[PathBuf]) -> rusqlite::Result<()> {
    let tx = c.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
    for p in paths {
        tx.execute(
            "DELETE FROM workspaces WHERE path = ?1",
            [p.display().to_string()],
        )?;
    }
    tx.commit()
}

/// [`Store::forget_workspaces`] for the CLI (`scriptgate prune`), on the store
/// at `path` that it read them from, without a [`Store`] (which would migrate
/// it and recover its interrupted scripts): one short write transaction on a
/// connection of its own, the store as it is (never created, its journal mode
/// left alone), waiting up to 5 s for a daemon writing to it at the same time.
pub fn forget_workspaces_at(path: &Path, paths: &[PathBuf]) -> Result<(), StoreError> {
    if paths.is_empty() {
        return Ok(());
    }
    let sql = |op| {
        move |source| StoreError::Sql {
            path: path.to_path_buf(),
            op,
            source,
        }
    };
    let mut c = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(sql("open to forget workspaces"))?;
    c.busy_timeout(std::time::Duration::from_secs(5))
        .map_err(sql("busy_timeout"))?;
    forget_rows(&mut c, paths).map_err(sql("forget workspaces"))
}

/// The store holds every script's code: readable by its owner and `reader_gid`
/// (the admin group, for `scriptgate audit` while the daemon is down), nobody else.
fn restrict_access(path: &Path, reader_gid: Option<u32>) {
    for suffix in ["", "-wal", "-shm"] {
        let p = PathBuf::from(format!("{}{suffix}", path.display()));
        let _ = crate::sys::chmod(&p, 0o640);
        if let Some(g) = reader_gid {
            let _ = crate::sys::chown(&p, None, Some(g));
        }
    }
}

/// Filters of `scriptgate audit`.
#[derive(Debug, Clone, Default)]
pub struct Query {
    pub since_ms: Option<i64>,
    pub run_id: Option<String>,
    pub status: Option<String>,
    /// Scripts started by this engine uid, or run as it (`--uid`, `--user`).
    pub uid: Option<u32>,
    /// Scripts started by the engine of this uid (`--engine`); refusals of it.
    pub engine_uid: Option<u32>,
    pub limit: usize,
}

const ROW_COLUMNS: &str = "script_id, run_id, runner, peer_uid, peer_pid, run_uid, description, code, tools, approval,
    workspace, backend, unit, started_at, ended_at, status, exit_code, calls, failures, tool_counts, duration_ms,
    details_dir, memory_peak_bytes, cpu_usec, result, scope";

/// Read-only access for the CLI, also while the daemon is down (its one write,
/// `scriptgate prune`'s, is [`forget_workspaces_at`]).
pub struct Reader {
    c: Connection,
    /// The columns added after v1 that a row shows (`trace_id`, v5;
    /// `teardown_ms`, v9), each `NULL AS` it in a store of before its version
    /// (the daemon not restarted since the upgrade).
    late_columns: String,
    path: PathBuf,
    /// Opened `immutable=1` (this user may not open `-shm`): the log's rows
    /// are not seen.
    immutable: bool,
}

impl Reader {
    pub fn open(path: &Path) -> Result<Reader, StoreError> {
        let sql = |op| {
            move |source| StoreError::Sql {
                path: path.to_path_buf(),
                op,
                source,
            }
        };
        if !path.exists() {
            return Err(StoreError::Sql {
                path: path.to_path_buf(),
                op: "open",
                source: rusqlite::Error::SqliteFailure(
                    rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_CANTOPEN),
                    Some("no audit store here yet".into()),
                ),
            });
        }
        let flags = OpenFlags::SQLITE_OPEN_READ_ONLY
            | OpenFlags::SQLITE_OPEN_NO_MUTEX
            | OpenFlags::SQLITE_OPEN_URI;
        let c = Connection::open_with_flags(path, flags).map_err(sql("open read-only"))?;
        // A WAL store read by a user who cannot create its -shm file (the daemon is
        // down and the directory is not theirs): read the file as it stands.
        let (c, immutable) = match c.query_row("SELECT count(*) FROM sqlite_master", [], |r| {
            r.get::<_, i64>(0)
        }) {
            Ok(_) => (c, false),
            Err(_) => (
                Connection::open_with_flags(format!("file:{}?immutable=1", path.display()), flags)
                    .map_err(sql("open immutable"))?,
                true,
            ),
        };
        // A store of before v5 (the daemon not restarted since the upgrade) has
        // no trace ids, one of before v9 no teardown times: they read as null.
        let late_columns = ["trace_id", "teardown_ms"]
            .map(
                |col| match c.prepare(&format!("SELECT {col} FROM scripts LIMIT 0")) {
                    Ok(_) => col.to_string(),
                    Err(_) => format!("NULL AS {col}"),
                },
            )
            .join(", ");
        Ok(Reader {
            c,
            late_columns,
            path: path.to_path_buf(),
            immutable,
        })
    }

    /// Copy the store to `dest` with SQLite's online backup API: a consistent
    /// copy while the daemon writes, as one self-contained file (a rollback
    /// journal, not a log beside it), created 0600 and never over a file that
    /// exists. The copy is checked (`quick_check`) before it is reported.
    pub fn backup(&self, dest: &Path) -> Result<Backup, StoreError> {
        use std::os::unix::fs::OpenOptionsExt;
        let wal = PathBuf::from(format!("{}-wal", self.path.display()));
        if self.immutable && std::fs::metadata(&wal).is_ok_and(|m| m.len() > 0) {
            return Err(StoreError::WalUnreadable {
                path: self.path.clone(),
            });
        }
        let io = |source| StoreError::Io {
            path: dest.to_path_buf(),
            source,
        };
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(dest)
        {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                return Err(StoreError::Exists {
                    path: dest.to_path_buf(),
                })
            }
            Err(e) => return Err(io(e)),
        }
        let sql = |op| {
            move |source| StoreError::Sql {
                path: dest.to_path_buf(),
                op,
                source,
            }
        };
        let copied = (|| {
            let mut dst = Connection::open(dest).map_err(sql("open the copy"))?;
            // All pages in one step, from one read snapshot: a step of a few
            // pages restarts whenever the daemon writes (every 2 s while
            // scripts run), so on a large store it might never end. A WAL
            // reader's snapshot does not hold the writer up. Busy or locked (a
            // checkpoint with TRUNCATE in its way): tried again, a bounded
            // number of times.
            let b = rusqlite::backup::Backup::new(&self.c, &mut dst).map_err(sql("copy"))?;
            let mut tries = 0;
            loop {
                use rusqlite::backup::StepResult;
                match b.step(-1).map_err(sql("copy"))? {
                    StepResult::Done => break,
                    StepResult::More => {}
                    StepResult::Busy | StepResult::Locked if tries < 100 => {
                        tries += 1;
                        std::thread::sleep(std::time::Duration::from_millis(50));
                    }
                    _ => {
                        return Err(StoreError::Sql {
                            path: dest.to_path_buf(),
                            op: "copy (the store stayed busy for 5 s)",
                            source: rusqlite::Error::InvalidQuery,
                        })
                    }
                }
            }
            drop(b);
            let mode: String = dst
                .query_row("PRAGMA journal_mode = DELETE", [], |r| r.get(0))
                .map_err(sql("leave WAL"))?;
            let check: String = dst
                .query_row("PRAGMA quick_check", [], |r| r.get(0))
                .map_err(sql("quick_check"))?;
            if check != "ok" || mode != "delete" {
                return Err(StoreError::Sql {
                    path: dest.to_path_buf(),
                    op: "check the copy",
                    source: rusqlite::Error::InvalidQuery,
                });
            }
            let count = |t: &str| {
                dst.query_row(&format!("SELECT count(*) FROM {t}"), [], |r| r.get(0))
                    .map_err(sql("count"))
            };
            Ok(Backup {
                scripts: count("scripts")?,
                refusals: count("refusals")?,
                bytes: 0,
            })
        })();
        match copied {
            Ok(b) => Ok(Backup {
                bytes: std::fs::metadata(dest).map_err(io)?.len(),
                ..b
            }),
            Err(e) => {
                let _ = std::fs::remove_file(dest);
                Err(e)
            }
        }
    }

    pub fn scripts(&self, q: &Query) -> rusqlite::Result<Vec<Value>> {
        let mut sql = format!(
            "SELECT {ROW_COLUMNS}, {} FROM scripts WHERE 1=1",
            self.late_columns
        );
        let mut args: Vec<rusqlite::types::Value> = vec![];
        if let Some(s) = q.since_ms {
            sql.push_str(" AND started_at >= ?");
            args.push(s.into());
        }
        if let Some(r) = &q.run_id {
            sql.push_str(" AND run_id = ?");
            args.push(r.clone().into());
        }
        if let Some(st) = &q.status {
            sql.push_str(" AND status = ?");
            args.push(st.clone().into());
        }
        if let Some(u) = q.uid {
            sql.push_str(" AND (peer_uid = ? OR run_uid = ?)");
            args.push(i64::from(u).into());
            args.push(i64::from(u).into());
        }
        if let Some(u) = q.engine_uid {
            sql.push_str(" AND peer_uid = ?");
            args.push(i64::from(u).into());
        }
        sql.push_str(" ORDER BY started_at DESC, script_id LIMIT ?");
        args.push((q.limit.max(1) as i64).into());
        let mut s = self.c.prepare(&sql)?;
        let rows = s.query_map(rusqlite::params_from_iter(args), row_json)?;
        rows.collect()
    }

    pub fn script(&self, id: &str) -> rusqlite::Result<Option<Value>> {
        self.c
            .query_row(
                &format!(
                    "SELECT {ROW_COLUMNS}, {} FROM scripts WHERE script_id = ?1",
                    self.late_columns
                ),
                [id],
                row_json,
            )
            .optional()
    }

    /// Every counter of the `metrics` table: `(name, label, value)`.
    pub fn metrics(&self) -> rusqlite::Result<Vec<(String, String, f64)>> {
        let mut s = self
            .c
            .prepare("SELECT name, label, value FROM metrics ORDER BY name, label")?;
        let rows = s.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
        rows.collect()
    }

    /// The workspaces retention may remove (recorded by the daemon).
    pub fn vouched_workspaces(&self) -> rusqlite::Result<Vec<Vouched>> {
        vouched_rows(&self.c)
    }

    /// The workspaces of rows that say `running`.
    pub fn running_workspaces(&self) -> rusqlite::Result<Vec<String>> {
        let mut s = self
            .c
            .prepare("SELECT DISTINCT workspace FROM scripts WHERE status = 'running'")?;
        let rows = s.query_map([], |r| r.get(0))?;
        rows.collect()
    }

    /// Scripts whose row says `running`.
    pub fn running(&self) -> rusqlite::Result<u64> {
        Ok(self.running_counts()?.scripts)
    }

    /// Rows that say `running`, and the calls and failures they hold (kept
    /// current by the daemon's checkpoint, `checkpoint::TICK`).
    pub fn running_counts(&self) -> rusqlite::Result<RunningCounts> {
        self.c.query_row(
            "SELECT count(*), coalesce(sum(calls), 0), coalesce(sum(failures), 0) FROM scripts WHERE status = 'running'",
            [],
            |r| {
                let n = |i| r.get::<_, i64>(i).map(|n| n.max(0) as u64);
                Ok(RunningCounts {
                    scripts: n(0)?,
                    calls: n(1)?,
                    failures: n(2)?,
                })
            },
        )
    }

    pub fn refusals(&self, q: &Query) -> rusqlite::Result<Vec<Value>> {
        let mut s = self.c.prepare(
            "SELECT at, run_id, runner, peer_uid, peer_pid, code, reason, message FROM refusals
             WHERE at >= ?1 AND (?2 IS NULL OR run_id = ?2) AND (?4 IS NULL OR peer_uid = ?4)
             ORDER BY at DESC LIMIT ?3",
        )?;
        let peer = q.engine_uid.or(q.uid).map(i64::from);
        let rows = s.query_map(rusqlite::params![q.since_ms.unwrap_or(0), q.run_id, q.limit.max(1) as i64, peer], |r| {
            Ok(serde_json::json!({
                "at": r.get::<_, i64>(0)?, "run_id": r.get::<_, Option<String>>(1)?, "runner": r.get::<_, Option<String>>(2)?,
                "peer_uid": r.get::<_, Option<i64>>(3)?, "peer_pid": r.get::<_, Option<i64>>(4)?, "code": r.get::<_, i64>(5)?,
                "reason": r.get::<_, Option<String>>(6)?, "message": r.get::<_, String>(7)?,
            }))
        })?;
        rows.collect()
    }
}

/// How big the audit store is and how fast it grows (`scriptgate audit
/// --stats`, `scriptgate status`).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct StoreStats {
    pub path: PathBuf,
    /// The database file, its write-ahead log and its shared-memory index.
    pub file_bytes: u64,
    pub scripts: u64,
    pub refusals: u64,
    pub refused_connection_rows: u64,
    /// The oldest script or refusal kept (ms), if any.
    pub oldest_ms: Option<i64>,
    /// Scripts started on each of the last [`STATS_DAYS`] days (UTC), oldest
    /// first: `(the day's start in ms, scripts)`; today is the last, so far.
    pub per_day: Vec<(i64, u64)>,
}

/// How many days `StoreStats::per_day` covers.
pub const STATS_DAYS: i64 = 7;

impl StoreStats {
    /// Scripts a day over the whole days of `per_day` (today left out).
    pub fn mean_per_day(&self) -> f64 {
        let whole = &self.per_day[..self.per_day.len().saturating_sub(1)];
        if whole.is_empty() {
            return 0.0;
        }
        whole.iter().map(|(_, n)| *n as f64).sum::<f64>() / whole.len() as f64
    }
}

impl Reader {
    /// The store's size and growth, as of `now_ms`.
    pub fn stats(&self, now_ms: i64) -> rusqlite::Result<StoreStats> {
        let count = |table: &str| -> u64 {
            self.c
                .query_row(&format!("SELECT count(*) FROM {table}"), [], |r| {
                    r.get::<_, i64>(0)
                })
                .map_or(0, |n| n as u64)
        };
        let oldest = self.c.query_row(
            "SELECT min(t) FROM (SELECT min(started_at) AS t FROM scripts
                                 UNION ALL SELECT min(at) FROM refusals)",
            [],
            |r| r.get::<_, Option<i64>>(0),
        )?;
        let today = now_ms - now_ms.rem_euclid(86_400_000);
        let first = today - (STATS_DAYS - 1) * 86_400_000;
        let mut s = self.c.prepare(
            "SELECT (started_at - ?1) / 86400000, count(*) FROM scripts
             WHERE started_at >= ?1 GROUP BY 1",
        )?;
        let mut per_day: Vec<(i64, u64)> = (0..STATS_DAYS)
            .map(|d| (first + d * 86_400_000, 0))
            .collect();
        let rows = s.query_map([first], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, i64>(1)?)))?;
        for row in rows {
            let (day, n) = row?;
            if let Some(slot) = usize::try_from(day).ok().and_then(|d| per_day.get_mut(d)) {
                slot.1 += n as u64;
            }
        }
        let file_bytes = ["", "-wal", "-shm"]
            .iter()
            .filter_map(|suffix| {
                let mut p = self.path.clone().into_os_string();
                p.push(suffix);
                std::fs::metadata(p).ok().map(|m| m.len())
            })
            .sum();
        Ok(StoreStats {
            path: self.path.clone(),
            file_bytes,
            scripts: count("scripts"),
            refusals: count("refusals"),
            refused_connection_rows: count("refused_connections"),
            oldest_ms: oldest,
            per_day,
        })
    }

    /// Refused connections per minute, uid and reason, newest first: `minute`
    /// (ms), `peer_uid`, `reason`, `count`. A store of before v8 (the daemon
    /// not restarted since the upgrade) has none.
    pub fn refused_connections(&self, q: &Query) -> rusqlite::Result<Vec<Value>> {
        let Ok(mut s) = self.c.prepare(
            "SELECT minute, peer_uid, reason, count FROM refused_connections
             WHERE minute >= ?1 - 59999 AND (?3 IS NULL OR peer_uid = ?3)
             ORDER BY minute DESC, peer_uid, reason LIMIT ?2",
        ) else {
            return Ok(vec![]);
        };
        let peer = q.engine_uid.or(q.uid).map(i64::from);
        let since = q.since_ms.unwrap_or(0);
        let rows = s.query_map(params![since, q.limit.max(1) as i64, peer], |r| {
            Ok(serde_json::json!({
                "minute": r.get::<_, i64>(0)?, "peer_uid": r.get::<_, i64>(1)?,
                "reason": r.get::<_, String>(2)?, "count": r.get::<_, i64>(3)?,
            }))
        })?;
        rows.collect()
    }
}

/// One `scripts` row as JSON; JSON-valued columns are parsed.
fn row_json(r: &rusqlite::Row) -> rusqlite::Result<Value> {
    let mut m = serde_json::Map::new();
    let names: Vec<String> = r
        .as_ref()
        .column_names()
        .into_iter()
        .map(str::to_string)
        .collect();
    for (i, name) in names.iter().map(String::as_str).enumerate() {
        let v = match r.get_ref(i)? {
            rusqlite::types::ValueRef::Null => Value::Null,
            rusqlite::types::ValueRef::Integer(n) => Value::from(n),
            rusqlite::types::ValueRef::Real(f) => Value::from(f),
            rusqlite::types::ValueRef::Text(t) => {
                let t = String::from_utf8_lossy(t).into_owned();
                match name {
                    "tools" | "tool_counts" | "result" => {
                        serde_json::from_str(&t).unwrap_or(Value::String(t))
                    }
                    _ => Value::String(t),
                }
            }
            rusqlite::types::ValueRef::Blob(_) => Value::Null,
        };
        m.insert(name.to_string(), v);
    }
    Ok(Value::Object(m))
}

/// A script a dead daemon left `running`, now recorded as `interrupted`.
#[derive(Debug, Clone)]
pub struct Recovered {
    pub result: ScriptResult,
    /// The workspace's absolute path, as recorded at the start.
    pub workspace: String,
    pub runner: Option<String>,
    pub run_uid: u32,
}

/// What the rows of running scripts hold.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RunningCounts {
    pub scripts: u64,
    pub calls: u64,
    pub failures: u64,
}

/// The UPDATE that completes a script's row, and its counters.
fn finish_row(c: &mut Connection, r: &ScriptResult, tool_counts: &Value) -> rusqlite::Result<()> {
    let tx = c.transaction()?;
    let n = tx.execute(
        "UPDATE scripts SET ended_at = ?2, status = ?3, exit_code = ?4, calls = ?5, failures = ?6,
           tool_counts = ?7, duration_ms = ?8, memory_peak_bytes = ?9, cpu_usec = ?10, result = ?11
         WHERE script_id = ?1",
        params![
            r.script_id,
            now_ms(),
            r.status.as_str(),
            r.exit_code,
            r.calls as i64,
            r.failures as i64,
            tool_counts.to_string(),
            r.duration_ms as i64,
            r.memory_peak_bytes.map(|v| v as i64),
            r.cpu_usec.map(|v| v as i64),
            serde_json::to_string(r).unwrap_or_default()
        ],
    )?;
    if n > 0 {
        count_finished(&tx, r.status.as_str(), r.calls, r.failures, r.duration_ms)?;
        // Where a pool exists: how the script's sandbox started.
        if let Some(pre_made) = r.pre_made {
            bump(
                &tx,
                "sandbox_starts",
                if pre_made { "pre_made" } else { "cold" },
                1.0,
            )?;
        }
    }
    tx.commit()
}

/// Rows still `running` belong to a daemon that died: they become `interrupted`.
/// Except those of an embedded daemon that lives in another process and holds
/// this store `path` open (`live::held_by`): the CLI's embedded daemons of one
/// user share one store, and a `scriptgate run` opening it while `scriptgate
/// mcp` runs a script must leave that script's row alone.
fn recover_interrupted(c: &mut Connection, path: &Path) -> rusqlite::Result<Vec<Recovered>> {
    let tx = c.transaction()?;
    let mut out = Vec::new();
    {
        let mut s = tx.prepare(
            "SELECT script_id, run_id, started_at, details_dir, calls, failures, runner, run_uid, workspace, peer_pid, seen_at FROM scripts WHERE status = 'running'",
        )?;
        let rows = s.query_map([], |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, i64>(2)?,
                r.get::<_, String>(3)?,
                r.get::<_, i64>(4)?,
                r.get::<_, i64>(5)?,
                (r.get::<_, Option<String>>(6)?, r.get::<_, Option<i64>>(7)?),
                r.get::<_, String>(8)?,
                (r.get::<_, Option<i64>>(9)?, r.get::<_, Option<i64>>(10)?),
            ))
        })?;
        let me = std::process::id();
        for row in rows {
            let (
                script_id,
                run_id,
                started,
                details_dir,
                calls,
                failures,
                (runner, run_uid),
                workspace,
                (peer_pid, seen_at),
            ) = row?;
            // This process has recorded nothing yet: a row naming its pid is an
            // older process's.
            let holder = peer_pid
                .and_then(|p| u32::try_from(p).ok())
                .filter(|&p| p != me && p > 0);
            if holder.is_some_and(|p| live::held_by(Path::new("/proc"), p, path, started)) {
                continue;
            }
            // It ran until the daemon last saw it running (within a checkpoint
            // tick); a store of before v6 knows only its start.
            let duration_ms = (seen_at.unwrap_or(started) - started).max(0) as u64;
            let error = "the daemon stopped while the script ran".to_string();
            out.push(Recovered {
                workspace,
                runner,
                run_uid: run_uid.unwrap_or(0) as u32,
                result: ScriptResult {
                    script_id,
                    run_id,
                    status: Status::Interrupted,
                    exit_code: None,
                    calls: calls as u64,
                    failures: failures as u64,
                    duration_ms,
                    details_dir,
                    output: String::new(),
                    output_truncated: false,
                    error: Some(error),
                    text: String::new(),
                    memory_peak_bytes: None,
                    cpu_usec: None,
                    backend_notes: vec![],
                    record_incomplete: vec![],
                    pre_made: None,
                }
                .with_text(None),
            });
        }
    }
    for r in out.iter().map(|r| &r.result) {
        count_finished(&tx, r.status.as_str(), r.calls, r.failures, r.duration_ms)?;
        tx.execute(
            "UPDATE scripts SET status = 'interrupted', ended_at = started_at + ?2, duration_ms = ?2, result = ?3 WHERE script_id = ?1",
            params![r.script_id, r.duration_ms as i64, serde_json::to_string(r).unwrap_or_default()],
        )?;
    }
    tx.commit()?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(id: &str) -> StartRow {
        StartRow {
            script_id: id.into(),
            run_id: "run-1".into(),
            runner: Some("r".into()),
            peer_uid: 0,
            peer_pid: Some(1),
            run_uid: 65534,
            description: "d".into(),
            code: "print(1)".into(),
            tools: vec![],
            approval: "not_needed".into(),
            workspace: "/w".into(),
            backend: "rlimit".into(),
            unit: None,
            started_at_ms: now_ms(),
            details_dir: format!(".agent/scripts/{id}"),
            scope: "uid:0".into(),
            vouched: None,
            trace_id: None,
        }
    }

    /// The CLI's embedded daemons, started together on a fresh state directory,
    /// open one store at once: each migration step is taken once (it failed
    /// in CI with "table scripts already exists").
    #[test]
    fn a_fresh_store_opened_by_several_at_once_is_migrated_once() {
        for _ in 0..5 {
            let d = tempfile::tempdir().unwrap();
            let p = d.path().join("a.db");
            let gate = std::sync::Barrier::new(4);
            std::thread::scope(|s| {
                let opened: Vec<_> = (0..4)
                    .map(|_| {
                        s.spawn(|| {
                            gate.wait();
                            Store::open(&p, None).map(|_| ()).map_err(|e| e.to_string())
                        })
                    })
                    .collect();
                for o in opened {
                    assert_eq!(o.join().unwrap(), Ok(()));
                }
            });
        }
    }

    #[tokio::test]
    async fn running_rows_become_interrupted_on_reopen() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("a.db");
        {
            let (s, rec) = Store::open(&p, None).unwrap();
            assert!(rec.is_empty());
            s.insert_started(row("s1")).await.unwrap();
            s.revoke(&crate::policy::runs::RunKey::new(
                crate::policy::runs::Scope::Shared(7),
                "run-9",
            ))
            .await
            .unwrap();
            assert!(
                s.run_of("s1").unwrap().map(|(r, _)| r).is_none(),
                "no result while running"
            );
        }
        let (s, rec) = Store::open(&p, None).unwrap();
        assert_eq!(rec.len(), 1);
        assert_eq!(rec[0].result.status, Status::Interrupted);
        assert_eq!(
            (rec[0].runner.as_deref(), rec[0].run_uid),
            (Some("r"), 65534)
        );
        let r = s.run_of("s1").unwrap().map(|(r, _)| r).unwrap();
        assert_eq!(r.status, Status::Interrupted);
        assert!(r.text.starts_with("run_script interrupted: 0 calls"));
        assert_eq!(
            s.revoked_runs().unwrap(),
            vec![crate::policy::runs::RunKey::new(
                crate::policy::runs::Scope::Shared(7),
                "run-9"
            )]
        );
        let v: i64 = s
            .reader
            .lock()
            .unwrap()
            .pragma_query_value(None, "user_version", |r| r.get(0))
            .unwrap();
        assert_eq!(v, SCHEMA_VERSION);
    }

    /// A row a dead daemon left `running` is `interrupted` with the time the
    /// script was last seen running (its start, then each checkpoint), not the
    /// time until the store is opened again.
    #[tokio::test]
    async fn an_interrupted_row_lasts_until_it_was_last_seen_running() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("a.db");
        {
            let (s, _) = Store::open(&p, None).unwrap();
            let (mut a, mut b) = (row("a"), row("b"));
            a.started_at_ms = now_ms() - 60_000;
            b.started_at_ms = now_ms() - 60_000;
            s.insert_started(a).await.unwrap();
            s.insert_started(b).await.unwrap();
            s.checkpoint_counts(vec![], vec!["a".into()]).await.unwrap();
            // A minute later, "a" was still seen; "b" never after its start.
        }
        let (s, rec) = Store::open(&p, None).unwrap();
        assert_eq!(rec.len(), 2);
        let dur = |id: &str| s.run_of(id).unwrap().unwrap().0.duration_ms;
        assert!((59_000..61_000).contains(&dur("a")), "{}", dur("a"));
        assert_eq!(dur("b"), 0, "seen only at its start");
        let ended: i64 = s
            .reader
            .lock()
            .unwrap()
            .query_row(
                "SELECT ended_at - started_at FROM scripts WHERE script_id = 'a'",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(ended as u64, dur("a"));
    }

    /// A sandbox's teardown time comes after its row (`set_teardown`); the
    /// CLI reads a store of before v9 (the daemon not restarted since the
    /// upgrade) with none.
    #[tokio::test]
    async fn the_teardown_time_is_recorded_after_the_row_and_absent_before_v9() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("a.db");
        let (s, _) = Store::open(&p, None).unwrap();
        s.insert_started(row("a")).await.unwrap();
        let teardown =
            || Reader::open(&p).unwrap().script("a").unwrap().unwrap()["teardown_ms"].clone();
        assert_eq!(teardown(), Value::Null);
        s.set_teardown("a", 12).await.unwrap();
        assert_eq!(teardown(), 12);
        s.write("back to v8", |c| {
            c.execute_batch("ALTER TABLE scripts DROP COLUMN teardown_ms; PRAGMA user_version = 8;")
        })
        .await
        .unwrap();
        assert_eq!(teardown(), Value::Null);
        let all = Query {
            limit: 10,
            ..Default::default()
        };
        assert_eq!(Reader::open(&p).unwrap().scripts(&all).unwrap().len(), 1);
    }

    #[tokio::test]
    async fn each_workspace_keeps_its_own_project_id() {
        let d = tempfile::tempdir().unwrap();
        let (s, _) = Store::open(&d.path().join("a.db"), None).unwrap();
        let a = s.project_for(1, 10).await.unwrap();
        let b = s.project_for(1, 11).await.unwrap();
        let c = s.project_for(2, 10).await.unwrap();
        assert_eq!(a, FIRST_PROJECT);
        assert_eq!((b, c), (FIRST_PROJECT + 1, FIRST_PROJECT + 2));
        assert_eq!(s.project_for(1, 10).await.unwrap(), a, "again: the same");
    }

    /// Two embedded daemons of one user share a store: the second to open it
    /// leaves the first's running row alone while the first (here a child that
    /// holds the store open, as the row's peer) lives, and recovers it once
    /// that process is gone.
    #[tokio::test]
    async fn a_running_row_of_a_live_process_holding_the_store_is_left_running() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("a.db");
        let (s, _) = Store::open(&p, None).unwrap();
        let mut holder = std::process::Command::new("sleep")
            .arg("600")
            .stdin(std::fs::File::open(&p).unwrap())
            .spawn()
            .unwrap();
        let mut r = row("live");
        r.peer_pid = Some(holder.id() as i32);
        r.started_at_ms = now_ms();
        s.insert_started(r).await.unwrap();
        s.insert_started(row("dead")).await.unwrap();
        drop(s);
        let (_, rec) = Store::open(&p, None).unwrap();
        let ids: Vec<&str> = rec.iter().map(|r| r.result.script_id.as_str()).collect();
        assert_eq!(ids, ["dead"], "pid 1 holds no store");
        let status =
            |id: &str| Reader::open(&p).unwrap().script(id).unwrap().unwrap()["status"].clone();
        assert_eq!(status("live"), "running");
        holder.kill().unwrap();
        holder.wait().unwrap();
        let (_, rec) = Store::open(&p, None).unwrap();
        assert_eq!(rec.len(), 1);
        assert_eq!(status("live"), "interrupted");
    }

    #[tokio::test]
    async fn prune_keeps_running_and_recent_rows() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("a.db");
        let (s, _) = Store::open(&p, None).unwrap();
        for id in ["old", "new", "running"] {
            s.insert_started(row(id)).await.unwrap();
        }
        for id in ["old", "new"] {
            s.finish(&interrupted_result(id), serde_json::json!({}))
                .await
                .unwrap();
        }
        s.write("age rows", |c| {
            c.execute("UPDATE scripts SET ended_at = 0, started_at = 0 WHERE script_id IN ('old', 'running')", [])
        })
        .await
        .unwrap();
        s.refusal(RefusalRow {
            run_id: None,
            runner: None,
            peer_uid: 1,
            peer_pid: None,
            code: -32010,
            reason: None,
            message: "m".into(),
        })
        .await
        .unwrap();
        assert_eq!(s.prune(90).await.unwrap(), (1, 0));
        let reader = Reader::open(&p).unwrap();
        let all = Query {
            limit: 10,
            ..Default::default()
        };
        let ids: Vec<String> = reader
            .scripts(&all)
            .unwrap()
            .iter()
            .map(|r| r["script_id"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(ids.len(), 2);
        assert!(
            ids.contains(&"new".to_string()) && ids.contains(&"running".to_string()),
            "{ids:?}"
        );
        assert_eq!(reader.refusals(&all).unwrap().len(), 1);
        let r = reader.script("new").unwrap().unwrap();
        assert_eq!(r["status"], "interrupted");
        assert_eq!(r["result"]["status"], "interrupted");
        assert_eq!(r["tools"], serde_json::json!([]));
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            std::fs::metadata(&p).unwrap().permissions().mode() & 0o777,
            0o640,
            "the store holds code: not world-readable"
        );
    }

    /// A v1 store (rows, no counters) upgraded to v2 counts what its rows hold.
    #[tokio::test]
    async fn upgrading_a_v1_store_seeds_the_metrics_from_its_rows() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("a.db");
        {
            let (s, _) = Store::open(&p, None).unwrap();
            for id in ["a", "b", "c"] {
                s.insert_started(row(id)).await.unwrap();
            }
            let mut r = interrupted_result("a");
            (r.status, r.calls, r.failures, r.duration_ms) = (Status::Ok, 5, 2, 2000);
            s.finish(&r, serde_json::json!({})).await.unwrap();
            s.refusal(RefusalRow {
                run_id: None,
                runner: None,
                peer_uid: 1,
                peer_pid: None,
                code: -32010,
                reason: Some("expired".into()),
                message: "m".into(),
            })
            .await
            .unwrap();
            s.write("back to v1", |c| {
                c.execute_batch(
                    "DROP TABLE metrics; DROP TABLE revocations; DROP TABLE workspaces;
                     ALTER TABLE scripts DROP COLUMN scope;
                     ALTER TABLE scripts DROP COLUMN trace_id;
                     ALTER TABLE scripts DROP COLUMN seen_at;
                     ALTER TABLE scripts DROP COLUMN teardown_ms;
                     DROP TABLE projects; DROP TABLE refused_connections;
                     CREATE TABLE revoked_runs (run_id TEXT PRIMARY KEY, at INTEGER NOT NULL);
                     PRAGMA user_version = 1;",
                )
            })
            .await
            .unwrap();
        }
        let (_s, recovered) = Store::open(&p, None).unwrap();
        assert_eq!(recovered.len(), 2, "b and c were left running");
        let m: std::collections::HashMap<(String, String), f64> = Reader::open(&p)
            .unwrap()
            .metrics()
            .unwrap()
            .into_iter()
            .map(|(n, l, v)| ((n, l), v))
            .collect();
        let get = |n: &str, l: &str| m.get(&(n.to_string(), l.to_string())).copied();
        assert_eq!(get("started", ""), Some(3.0));
        assert_eq!(get("finished", "ok"), Some(1.0));
        assert_eq!(get("finished", "interrupted"), Some(2.0));
        assert_eq!(
            (get("calls", ""), get("failures", "")),
            (Some(5.0), Some(2.0))
        );
        assert_eq!(get("refusals", "expired"), Some(1.0));
        assert_eq!(
            get("duration_bucket", "1"),
            Some(2.0),
            "the two interrupted took ~0 s"
        );
        assert_eq!(get("duration_bucket", "5"), Some(3.0));
    }

    /// A v2 store (one-string revocations, no scopes, no workspaces) upgraded to
    /// v3: revocations read as they were meant, old rows keep no scope, and no
    /// workspace is recorded until a script starts in it again.
    #[tokio::test]
    async fn upgrading_a_v2_store_scopes_its_revocations_and_records_no_workspace() {
        use crate::policy::runs::{RunKey, Scope};
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("a.db");
        let me = nix::unistd::getuid().as_raw();
        let marked = d.path().join("marked");
        std::fs::create_dir(&marked).unwrap();
        crate::daemon::prune::mark_created(&marked, "test").unwrap();
        let plain = d.path().join("plain");
        std::fs::create_dir(&plain).unwrap();
        {
            let c = Connection::open(&p).unwrap();
            c.execute_batch(MIGRATIONS[0]).unwrap();
            c.execute_batch(MIGRATIONS[1]).unwrap();
            c.pragma_update(None, "user_version", 2).unwrap();
            for k in ["run-7", r#"[[auth.engine]] group = "games" run-9"#] {
                c.execute("INSERT INTO revoked_runs (run_id, at) VALUES (?1, 5)", [k])
                    .unwrap();
            }
            for (id, ws) in [("a", &marked), ("b", &plain)] {
                c.execute(
                    "INSERT INTO scripts (script_id, run_id, peer_uid, run_uid, code, approval, workspace, backend,
                       started_at, ended_at, status, details_dir, result)
                     VALUES (?1, 'run-1', ?2, ?2, '', 'not_needed', ?3, 'rlimit', 1, 2, 'ok', 'd', ?4)",
                    params![id, me, ws.display().to_string(), serde_json::to_string(&interrupted_result(id)).unwrap()],
                )
                .unwrap();
            }
        }
        let (s, _) = Store::open(&p, None).unwrap();
        let mut revoked = s.revoked_runs().unwrap();
        revoked.sort_by(|a, b| a.run_id.cmp(&b.run_id));
        assert_eq!(
            revoked,
            vec![
                RunKey::new(Scope::AnyShared, "run-7"),
                RunKey::new(
                    Scope::Entry(r#"[[auth.engine]] group = "games""#.into()),
                    "run-9"
                ),
            ]
        );
        let (res, scope) = s.run_of("a").unwrap().unwrap();
        assert_eq!((res.script_id.as_str(), scope), ("a", None));
        // The migration touched no file system: nothing is recorded, not even the
        // marked workspace a script of its engine ran in...
        assert_eq!(s.vouched_workspaces().unwrap(), vec![]);
        // ...until a script starts there again, and the daemon vouches for it.
        let mut r = row("c");
        (r.workspace, r.peer_uid, r.run_uid) = (marked.display().to_string(), me, me);
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(&marked).unwrap();
        r.vouched = Some((m.dev(), m.ino()));
        s.insert_started(r).await.unwrap();
        let v = s.vouched_workspaces().unwrap();
        assert_eq!(
            v.iter().map(|v| v.path.clone()).collect::<Vec<_>>(),
            vec![marked.clone()]
        );
        assert_eq!((v[0].dev, v[0].ino), (m.dev(), m.ino()));
    }

    /// `scriptgate prune` forgets workspaces in a store a daemon has open and
    /// is writing to (it waits for the daemon's transaction), and never creates
    /// a store.
    #[tokio::test]
    async fn the_cli_forgets_workspaces_beside_a_running_daemon() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("a.db");
        let (s, _) = Store::open(&p, None).unwrap();
        for (i, w) in ["/r/a", "/r/b", "/r/c"].iter().enumerate() {
            let mut r = row(&format!("s{i}"));
            r.workspace = w.to_string();
            r.vouched = Some((1, i as u64));
            s.insert_started(r).await.unwrap();
        }
        let (held, release) = (
            std::sync::Arc::new(std::sync::Barrier::new(2)),
            std::time::Duration::from_millis(300),
        );
        let h = held.clone();
        let daemon = s.write("hold the write lock", move |c| {
            let tx = c.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
            h.wait();
            std::thread::sleep(release);
            tx.commit()
        });
        let t = tokio::task::spawn_blocking({
            let p = p.clone();
            move || {
                held.wait();
                forget_workspaces_at(&p, &["/r/a".into(), "/r/c".into(), "/r/none".into()])
            }
        });
        daemon.await.unwrap();
        t.await.unwrap().unwrap();
        let left: Vec<PathBuf> = s
            .vouched_workspaces()
            .unwrap()
            .into_iter()
            .map(|v| v.path)
            .collect();
        assert_eq!(left, vec![PathBuf::from("/r/b")]);
        let none = d.path().join("none.db");
        assert!(forget_workspaces_at(&none, &["/r/b".into()]).is_err());
        assert!(!none.exists(), "no store is created");
        forget_workspaces_at(&none, &[]).unwrap();
    }

    /// The store's size and growth: its rows, the oldest, scripts per day of
    /// the last seven (a script of eight days ago is not in them), the files'
    /// bytes.
    #[tokio::test]
    async fn stats_say_the_size_and_the_scripts_per_day() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("a.db");
        let (s, _) = Store::open(&p, None).unwrap();
        let day = 86_400_000_i64;
        let now = 100 * day + 3_600_000; // 01:00 of day 100
        let started = [now - 8 * day, now - 6 * day, now - 6 * day, now - day, now];
        s.write("rows", move |c| {
            for (i, at) in started.iter().enumerate() {
                c.execute(
                    "INSERT INTO scripts (script_id, run_id, code, approval, workspace, backend,
                       started_at, status, details_dir) VALUES (?1, 'r', '', 'auto', '/w', 'rlimit', ?2, 'ok', '/d')",
                    params![format!("s{i}"), at],
                )?;
            }
            c.execute(
                "INSERT INTO refusals (at, code, message) VALUES (?1, -32001, 'no')",
                [now - 9 * day],
            )
        })
        .await
        .unwrap();
        let st = Reader::open(&p).unwrap().stats(now).unwrap();
        assert_eq!(
            (st.scripts, st.refusals, st.refused_connection_rows),
            (5, 1, 0)
        );
        assert_eq!(
            st.oldest_ms,
            Some(now - 9 * day),
            "the refusal is the oldest"
        );
        assert_eq!(
            st.per_day,
            vec![
                (94 * day, 2),
                (95 * day, 0),
                (96 * day, 0),
                (97 * day, 0),
                (98 * day, 0),
                (99 * day, 1),
                (100 * day, 1)
            ]
        );
        assert_eq!(st.mean_per_day(), 0.5, "3 scripts in the 6 whole days");
        let on_disk = std::fs::metadata(&p).unwrap().len();
        assert!(st.file_bytes >= on_disk && on_disk > 0, "{st:?}");
    }

    /// A flood of refused connections is one row per minute, uid and reason,
    /// its count added to; the table keeps the newest minutes within its
    /// bound; the counters add up; the reader shows them newest first.
    #[tokio::test]
    async fn refused_connections_are_one_row_a_minute_and_the_table_is_bounded() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("a.db");
        let (s, _) = Store::open(&p, None).unwrap();
        for _ in 0..50 {
            s.refused_connections(vec![(60_000, 40001, "peer_not_allowed", 100)])
                .await
                .unwrap();
        }
        let rows = |s: &Store| {
            s.read("count", |c| {
                c.query_row(
                    "SELECT count(*), sum(count) FROM refused_connections",
                    [],
                    |r| Ok((r.get::<_, i64>(0)?, r.get::<_, i64>(1)?)),
                )
            })
            .unwrap()
        };
        assert_eq!(rows(&s), (1, 5000));
        // Past the bound: the oldest minutes go.
        s.write("past the bound", |c| {
            let counted: Vec<_> = (0..30)
                .map(|m| (120_000 + m * 60_000, 7, "too_many_connections", 1))
                .collect();
            refused_connection_rows(c, &counted, 10)
        })
        .await
        .unwrap();
        let (n, _) = rows(&s);
        assert_eq!(n, 10);
        let r = Reader::open(&p).unwrap();
        let q = Query {
            limit: 100,
            ..Default::default()
        };
        let got = r.refused_connections(&q).unwrap();
        assert_eq!(got.len(), 10);
        assert_eq!(got[0]["minute"], 120_000 + 29 * 60_000, "newest first");
        assert_eq!(got[9]["minute"], 120_000 + 20 * 60_000, "the oldest kept");
        let metric: f64 = s
            .read("metric", |c| {
                c.query_row(
                    "SELECT value FROM metrics WHERE name = 'connections_refused' AND label = 'peer_not_allowed'",
                    [],
                    |r| r.get(0),
                )
            })
            .unwrap();
        assert_eq!(metric, 5000.0, "the counter is not bounded with the rows");
    }

    /// Revocations keep at most the bound of each scope, the newest; another
    /// scope's are untouched; a store of before v4 is trimmed when it migrates.
    #[tokio::test]
    async fn revocations_are_bounded_per_scope_in_the_store() {
        use crate::policy::runs::{RunKey, Scope};
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("a.db");
        let (s, _) = Store::open(&p, None).unwrap();
        let other = RunKey::new(Scope::Shared(7), "theirs");
        s.revoke(&other).await.unwrap();
        let a = |i: usize| RunKey::new(Scope::Shared(8), &format!("r{i}"));
        let mut dropped = 0;
        for i in 0..25 {
            dropped += s.revoke_bounded(&a(i), 10).await.unwrap();
        }
        assert_eq!(dropped, 15);
        // Revoked again: the newest, so r15 goes next, not r16.
        s.revoke_bounded(&a(16), 10).await.unwrap();
        s.revoke_bounded(&a(99), 10).await.unwrap();
        let kept = s.revoked_runs().unwrap();
        let ids: Vec<&str> = kept
            .iter()
            .filter(|k| k.scope == Scope::Shared(8))
            .map(|k| k.run_id.as_str())
            .collect();
        assert_eq!(
            ids,
            ["r17", "r18", "r19", "r20", "r21", "r22", "r23", "r24", "r16", "r99"],
            "the newest ten, oldest first"
        );
        assert!(kept.contains(&other));
        // A v3 store holding more than the bound.
        s.write("a v3 store past the bound", |c| {
            let tx = c.transaction()?;
            for i in 0..(crate::policy::runs::REVOCATIONS_PER_SCOPE + 3) {
                tx.execute(
                    "INSERT INTO revocations (scope, run_id, at) VALUES ('uid:9', ?1, 1)",
                    [format!("v{i}")],
                )?;
            }
            tx.execute_batch(
                "DROP INDEX revocations_scope; ALTER TABLE scripts DROP COLUMN trace_id;
                 ALTER TABLE scripts DROP COLUMN seen_at;
                 ALTER TABLE scripts DROP COLUMN teardown_ms;
                 DROP TABLE projects; DROP TABLE refused_connections;
                 PRAGMA user_version = 3;",
            )?;
            tx.commit()
        })
        .await
        .unwrap();
        drop(s);
        let (s, _) = Store::open(&p, None).unwrap();
        let kept = s.revoked_runs().unwrap();
        let of9: Vec<&RunKey> = kept
            .iter()
            .filter(|k| k.scope == Scope::Shared(9))
            .collect();
        assert_eq!(of9.len(), crate::policy::runs::REVOCATIONS_PER_SCOPE);
        assert_eq!(of9[0].run_id, "v3", "the oldest three went");
        assert_eq!(kept.len(), crate::policy::runs::REVOCATIONS_PER_SCOPE + 11);
    }

    fn interrupted_result(id: &str) -> ScriptResult {
        ScriptResult {
            script_id: id.into(),
            run_id: "run-1".into(),
            status: Status::Interrupted,
            exit_code: None,
            calls: 0,
            failures: 0,
            duration_ms: 1,
            details_dir: "d".into(),
            output: String::new(),
            output_truncated: false,
            error: None,
            text: String::new(),
            memory_peak_bytes: None,
            cpu_usec: None,
            backend_notes: vec![],
            record_incomplete: vec![],
            pre_made: None,
        }
    }
}
