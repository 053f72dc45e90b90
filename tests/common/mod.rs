//! Test rig: a real `scriptgated` on a real socket with a fresh config, key, state
//! dir and workspace, and a test engine that speaks the protocol over the socket.
#![allow(dead_code)]

pub mod boot;

use serde_json::{json, Value};
use std::collections::HashMap;
use std::ffi::OsStr;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

pub const KEY: &[u8] = b"test-key-test-key-test-key-test-key!";
pub const NOBODY: u32 = 65534;

/// The gid of a group that the tests expect on the host (Debian's base groups).
pub fn gid_of(name: &str) -> u32 {
    nix::unistd::Group::from_name(name)
        .unwrap()
        .unwrap_or_else(|| panic!("group {name} is missing on this host"))
        .gid
        .as_raw()
}

pub fn is_root() -> bool {
    nix::unistd::Uid::effective().is_root()
}

/// First line of a test that needs root. Such tests are
/// `#[ignore = "needs root (…)"]`, so a plain `cargo test` reports them as
/// ignored, never as passed; `.ci/run` runs them as root with `--include-ignored`.
/// Run explicitly without root, the test fails with the reason instead of passing
/// without having checked anything.
pub fn require_root(why: &str) {
    assert!(is_root(), "this test needs root: {why}");
}

/// Turns on the machine. The tests of tests/it run in one process, two at a time
/// (libtest runs each test on a thread of its own, named after it). A test that
/// must have the machine alone (a systemd booted in a PID namespace, a timing- or
/// memory-bound measurement under attack) calls `alone()` first; every rig (and
/// the other heavy set-ups) takes `shared()`. Either holds until the test's
/// thread ends: it is kept in a thread-local, dropped with the thread, so a test
/// cannot give its turn back early by dropping a value. Threads that are not a
/// test's own (a test's helpers, unnamed) take no turn: their test holds it.
mod turns {
    use std::cell::RefCell;
    use std::sync::{Condvar, Mutex};

    #[derive(Default)]
    struct State {
        shared: usize,
        alone: bool,
        /// Tests waiting for `alone`: no test takes a new shared turn meanwhile,
        /// so that one cannot be starved by the stream of ordinary tests.
        waiting: usize,
    }

    static STATE: Mutex<State> = Mutex::new(State {
        shared: 0,
        alone: false,
        waiting: 0,
    });
    static CHANGED: Condvar = Condvar::new();

    #[derive(PartialEq)]
    enum Turn {
        Shared,
        Alone,
    }

    struct Held(Turn);

    impl Drop for Held {
        fn drop(&mut self) {
            let mut s = STATE.lock().unwrap_or_else(|p| p.into_inner());
            match self.0 {
                Turn::Shared => s.shared -= 1,
                Turn::Alone => s.alone = false,
            }
            CHANGED.notify_all();
        }
    }

    thread_local! {
        static HELD: RefCell<Option<Held>> = const { RefCell::new(None) };
    }

    fn is_a_tests_thread() -> bool {
        std::thread::current().name().is_some_and(|n| n != "main")
    }

    fn wait_until(mut ready: impl FnMut(&mut State) -> bool) {
        let mut s = STATE.lock().unwrap_or_else(|p| p.into_inner());
        while !ready(&mut s) {
            s = CHANGED.wait(s).unwrap_or_else(|p| p.into_inner());
        }
    }

    pub fn shared() {
        if !is_a_tests_thread() || HELD.with(|h| h.borrow().is_some()) {
            return;
        }
        wait_until(|s| {
            let free = !s.alone && s.waiting == 0;
            if free {
                s.shared += 1;
            }
            free
        });
        HELD.with(|h| *h.borrow_mut() = Some(Held(Turn::Shared)));
    }

    pub fn alone() {
        if !is_a_tests_thread() {
            return;
        }
        let held = HELD.with(|h| h.borrow().as_ref().map(|t| t.0 == Turn::Alone));
        match held {
            Some(true) => return,
            Some(false) => {
                panic!("alone() must come before the test's rig (it took a shared turn)")
            }
            None => {}
        }
        STATE.lock().unwrap_or_else(|p| p.into_inner()).waiting += 1;
        wait_until(|s| {
            let free = !s.alone && s.shared == 0;
            if free {
                s.waiting -= 1;
                s.alone = true;
            }
            free
        });
        HELD.with(|h| *h.borrow_mut() = Some(Held(Turn::Alone)));
    }
}

/// This test has the machine alone, from now until it ends (see `turns`): no other
/// test of this process runs beside it. First line of such a test.
pub fn alone() {
    turns::alone()
}

/// This test runs beside others but never beside an `alone()` one, from now
/// until it ends (see `turns`). Every rig takes it.
pub fn shared() {
    turns::shared()
}

/// The sandbox backend every rig pins: `auto` would pick `cgroup` or `systemd`
/// on some machines and `rlimit` on others, and the tests assert what they get.
pub const RIG_BACKEND: &str = "rlimit";

/// `SCRIPTGATE_TEST_POOL=N`: every rig whose test does not set
/// `sandbox.pool_size` itself keeps N pre-made sandboxes per uid instead of the
/// default (2, where the daemon is root), so that the sandbox suites run once
/// pooled and once cold (`.ci/run`: `SCRIPTGATE_TEST_POOL=0`).
fn pool_pin(extra: &str) -> String {
    match std::env::var("SCRIPTGATE_TEST_POOL") {
        Ok(n) if !extra.contains("pool_size") => format!("pool_size = {n}\n"),
        _ => String::new(),
    }
}

/// Pin `sandbox.backend` in a rig's config text, inside the `[sandbox]` table the
/// test's own `extra` may already have (TOML allows a table header only once).
fn pin_backend(extra: &str) -> String {
    let pool = pool_pin(extra);
    if extra.lines().any(|l| l.trim_start().starts_with("backend")) {
        return match extra.find("[sandbox]\n") {
            Some(at) => {
                let at = at + "[sandbox]\n".len();
                format!("{}{pool}{}", &extra[..at], &extra[at..])
            }
            None if pool.is_empty() => extra.to_string(),
            None => format!("{extra}\n[sandbox]\n{pool}"),
        };
    }
    let pin = format!("backend = {RIG_BACKEND:?}\n{pool}");
    if let Some(at) = extra.find("[sandbox]\n") {
        let at = at + "[sandbox]\n".len();
        format!("{}{pin}{}", &extra[..at], &extra[at..])
    } else {
        format!("{extra}\n[sandbox]\n{pin}")
    }
}

pub struct Rig {
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
    pub config: PathBuf,
    pub key_file: PathBuf,
    pub root: PathBuf,
    pub workspace: PathBuf,
    pub state: PathBuf,
    pub daemon: Option<Child>,
    pub log: PathBuf,
}

/// The uid scripts run as in these tests (the daemon maps root peers to nobody).
pub fn script_uid() -> u32 {
    if is_root() {
        NOBODY
    } else {
        nix::unistd::Uid::effective().as_raw()
    }
}

impl Rig {
    pub fn new() -> Rig {
        Rig::with_config("")
    }

    /// `extra` is TOML appended to the generated config (its own sections).
    pub fn with_config(extra: &str) -> Rig {
        shared();
        let dir = tempfile::Builder::new()
            .prefix("sg-test-")
            .tempdir()
            .unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let root = dir.path().join("roots");
        let workspace = root.join("ws");
        std::fs::create_dir_all(&workspace).unwrap();
        chown_to_script_uid(&workspace);
        let key_file = dir.path().join("token.key");
        std::fs::write(&key_file, KEY).unwrap();
        std::fs::set_permissions(&key_file, std::fs::Permissions::from_mode(0o600)).unwrap();
        let state = dir.path().join("state");
        let config = dir.path().join("scriptgate.toml");
        let mut text = format!(
            "[auth]\ntoken_key_file = {:?}\n[workspace]\nroots = [{:?}]\n[state]\ndir = {:?}\n",
            key_file, root, state
        );
        text.push_str(&pin_backend(extra));
        std::fs::write(&config, text).unwrap();
        let mut rig = Rig {
            socket: dir.path().join("sock"),
            log: dir.path().join("daemon.log"),
            dir,
            config,
            key_file,
            root,
            workspace,
            state,
            daemon: None,
        };
        rig.start();
        rig
    }

    pub fn start(&mut self) {
        self.start_with(|_| {});
    }

    /// Start the daemon with `adjust` applied to its command first.
    pub fn start_with(&mut self, adjust: impl FnOnce(&mut Command)) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_scriptgated"));
        cmd.arg("--listen")
            .arg(&self.socket)
            .arg("--config")
            .arg(&self.config)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        adjust(&mut cmd);
        let child = cmd.spawn().unwrap();
        self.daemon = Some(child);
        let t0 = Instant::now();
        while UnixStream::connect(&self.socket).is_err() {
            if let Some(st) = self.daemon.as_mut().unwrap().try_wait().unwrap() {
                panic!("daemon exited {st}: {}", self.log_text());
            }
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "daemon did not listen: {}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        self.wait_for_the_pool();
    }

    /// With pre-made sandboxes (a root daemon's default, or
    /// `SCRIPTGATE_TEST_POOL`), the shelf of `run_as` is full before the test
    /// goes on, so that its scripts take pre-made ones and the daemon holds
    /// what it holds at rest: each member's mount helper (`scriptgated
    /// --sandbox-mounter`, below the daemon) starts once the member is ready. Watched in /proc, not asked of the daemon: a
    /// connection would count against the connection tests' bounds.
    fn wait_for_the_pool(&mut self) {
        let config = std::fs::read_to_string(&self.config).unwrap_or_default();
        let size = config.lines().find_map(|l| {
            l.trim()
                .strip_prefix("pool_size = ")
                .and_then(|n| n.trim().parse::<u64>().ok())
        });
        let size = size.unwrap_or(scriptgate::config::POOL_SIZE_DEFAULT) as usize;
        if size == 0 || !nix::unistd::geteuid().is_root() {
            return;
        }
        let daemon = self.daemon.as_ref().unwrap().id();
        // A daemon that is not root keeps none.
        let status = std::fs::read_to_string(format!("/proc/{daemon}/status")).unwrap_or_default();
        let euid = status
            .lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|ids| ids.split_whitespace().nth(1).map(str::to_string));
        if euid.as_deref() != Some("0") {
            return;
        }
        // One helper per waiting member: the shelf of `run_as` is full.
        let helpers = || descendants_running(daemon, b"--sandbox-mounter").len();
        // No pool, or one that cannot make its members (a bwrap that fails).
        let no_pool = |log: &str| {
            (log.contains("pool_size") && log.contains("is not used"))
                || log.contains("cannot make a pre-made sandbox")
        };
        eventually("the pre-made sandboxes", Duration::from_secs(30), || {
            helpers() >= size || no_pool(&self.log_text())
        });
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn stop(&mut self, signal: nix::sys::signal::Signal) {
        if let Some(mut c) = self.daemon.take() {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(c.id() as i32), signal);
            let _ = c.wait();
        }
    }

    pub fn token(&self, snapshot: &Value) -> String {
        self.token_for("run-1", snapshot, 600)
    }

    pub fn token_for(&self, run_id: &str, snapshot: &Value, ttl: i64) -> String {
        scriptgate::protocol::token::mint(KEY, run_id, Some("test-runner"), snapshot, ttl).unwrap()
    }

    /// The standard fleet snapshot over this rig's workspace.
    pub fn snapshot(&self, mode: &str) -> Value {
        fleet_snapshot(&self.workspace, mode)
    }

    pub fn engine(&self) -> Engine {
        Engine::connect(&self.socket)
    }

    pub fn details(&self, script_id: &str) -> PathBuf {
        self.workspace.join(".agent/scripts").join(script_id)
    }
}

/// The `scriptgate` binary that cargo built for these tests.
pub const CLI: &str = env!("CARGO_BIN_EXE_scriptgate");

/// `scriptgate ARGS`, not yet run: for a test that spawns it (stdio of its own,
/// a wait of its own) or adjusts it.
pub fn cli_command<S: AsRef<OsStr>>(args: impl IntoIterator<Item = S>) -> Command {
    // A child of the test process: never beside an `alone()` test.
    shared();
    let mut c = Command::new(CLI);
    c.args(args);
    c
}

/// `scriptgate ARGS`, run to the end: its status, stdout and stderr (stdin is
/// closed, as `Command::output` makes it). For the commands that need no daemon
/// (completions, tools, describe, token) or are given their own flags.
pub fn cli<S: AsRef<OsStr>>(args: impl IntoIterator<Item = S>) -> Output {
    cli_command(args).output().unwrap()
}

/// `cli` with `adjust` applied to the command first (a uid, the environment).
pub fn cli_with<S: AsRef<OsStr>>(
    args: impl IntoIterator<Item = S>,
    adjust: impl FnOnce(&mut Command),
) -> Output {
    let mut c = cli_command(args);
    adjust(&mut c);
    c.output().unwrap()
}

impl Rig {
    /// `scriptgate ARGS` against this rig, not yet run. The rig's flags go after
    /// ARGS where the subcommand (ARGS' first word) takes them: `--socket` and
    /// `--config` for the admin commands, `prune` and `run` (a run through this
    /// rig's daemon), `--config` for `metrics`, none for the others.
    pub fn cli_command<S: AsRef<OsStr>>(&self, args: impl IntoIterator<Item = S>) -> Command {
        let args: Vec<S> = args.into_iter().collect();
        let sub = args
            .first()
            .map(|a| a.as_ref().to_string_lossy().into_owned());
        let (socket, config) = match sub.as_deref() {
            Some("status" | "ps" | "show" | "cancel" | "audit" | "run" | "prune") => (true, true),
            Some("metrics") => (false, true),
            _ => (false, false),
        };
        let mut c = cli_command(args);
        if socket {
            c.arg("--socket").arg(&self.socket);
        }
        if config {
            c.arg("--config").arg(&self.config);
        }
        c
    }

    /// `scriptgate ARGS` against this rig (see `cli_command`), run to the end.
    pub fn cli<S: AsRef<OsStr>>(&self, args: impl IntoIterator<Item = S>) -> Output {
        self.cli_command(args).output().unwrap()
    }

    /// `Rig::cli` with `adjust` applied to the command first (a uid, the environment).
    pub fn cli_with<S: AsRef<OsStr>>(
        &self,
        args: impl IntoIterator<Item = S>,
        adjust: impl FnOnce(&mut Command),
    ) -> Output {
        let mut c = self.cli_command(args);
        adjust(&mut c);
        c.output().unwrap()
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        self.stop(nix::sys::signal::Signal::SIGKILL);
    }
}

pub fn chown_to_script_uid(p: &Path) {
    if is_root() {
        nix::unistd::chown(
            p,
            Some(nix::unistd::Uid::from_raw(NOBODY)),
            Some(nix::unistd::Gid::from_raw(NOBODY)),
        )
        .unwrap();
    }
}

/// Every read and write tool has an `input_schema` (the daemon refuses a snapshot
/// without); the destructive, long-task and disabled ones go without, as they may.
/// `fleet__get_device_status` and `fleet__reboot_device` say
/// `additionalProperties: false` like the protocol's example; the others leave it
/// out, as MCP servers usually do, and are closed by the daemon all the same.
pub fn fleet_snapshot(ws: &Path, mode: &str) -> Value {
    json!({
        "workspace": ws, "read_only": false, "permission_mode": mode,
        "session_allowed": ["fleet__tag_device"],
        "tools": [
            {"name": "fleet__get_device_status", "class": "read", "enabled": true,
             "input_schema": {"type": "object", "properties": {"sn": {"type": "string"}},
                              "required": ["sn"], "additionalProperties": false}},
            {"name": "fleet__list_devices", "class": "read",
             "input_schema": {"type": "object", "properties": {"site": {"type": "string"}}}},
            {"name": "fleet__fail", "class": "read",
             "input_schema": {"type": "object", "properties": {}}},
            {"name": "fleet__reboot_device", "class": "write", "enabled": true,
             "input_schema": {"type": "object", "properties": {"sn": {"type": "string"}, "tenant": {"type": "string"}},
                              "additionalProperties": false},
             "frozen": {"tenant": "acme"}},
            {"name": "fleet__tag_device", "class": "write",
             "input_schema": {"type": "object", "properties": {"sn": {"type": "string"}, "tag": {"type": "string"}}}},
            {"name": "fleet__wipe_device", "class": "destructive"},
            {"name": "fleet__export_all", "class": "long_task"},
            {"name": "fleet__retired", "class": "read", "enabled": false}
        ]
    })
}

/// What the test engine answers to a `tool.call`: Ok(result) or Err(json-rpc error message).
pub type Handler = Arc<dyn Fn(&str, &Value) -> Result<Value, String> + Send + Sync>;

/// The default fleet: get_device_status answers structured data; fail is a tool error.
pub fn fleet_handler() -> Handler {
    Arc::new(|tool, args| match tool {
        "fleet__get_device_status" => {
            let sn = args["sn"].as_str().unwrap_or("");
            let n: u64 = sn.trim_start_matches("SN").parse().unwrap_or(0);
            let online = n % 10 != 0;
            Ok(
                json!({"text": format!("{sn} {}", if online {"online"} else {"offline"}),
                      "structured": {"sn": sn, "online": online, "fw": if n % 3 == 0 {"1.2"} else {"1.3"}}, "is_error": false}),
            )
        }
        "fleet__list_devices" => Ok(
            json!({"text": "3 devices", "structured": {"devices": ["SN1", "SN2", "SN3"]}, "is_error": false}),
        ),
        "fleet__fail" => {
            Ok(json!({"text": "device unreachable", "structured": null, "is_error": true}))
        }
        "fleet__reboot_device" | "fleet__tag_device" => {
            Ok(json!({"text": format!("done {args}"), "structured": null, "is_error": false}))
        }
        _ => Err(format!("test engine has no tool {tool}")),
    })
}

pub struct Seen {
    pub calls: Vec<(String, Value)>,
    pub approvals: Vec<Value>,
    pub notifications: Vec<(String, Value, Instant)>,
    pub in_flight: i64,
    pub max_in_flight: i64,
}

pub struct Engine {
    stream: UnixStream,
    writer: Arc<Mutex<UnixStream>>,
    pending: Arc<Mutex<HashMap<u64, mpsc::Sender<Value>>>>,
    next: AtomicU64,
    pub seen: Arc<Mutex<Seen>>,
    pub handler: Arc<Mutex<Handler>>,
    /// "allow_once", "deny", or "silent" (never answer).
    pub approval: Arc<Mutex<String>>,
    pub call_delay_ms: Arc<AtomicI64>,
    pub raw_lines: Arc<Mutex<Vec<Value>>>,
}

impl Engine {
    pub fn connect(socket: &Path) -> Engine {
        let stream = UnixStream::connect(socket).unwrap();
        let e = Engine {
            writer: Arc::new(Mutex::new(stream.try_clone().unwrap())),
            stream,
            pending: Default::default(),
            next: AtomicU64::new(1),
            seen: Arc::new(Mutex::new(Seen {
                calls: vec![],
                approvals: vec![],
                notifications: vec![],
                in_flight: 0,
                max_in_flight: 0,
            })),
            handler: Arc::new(Mutex::new(fleet_handler())),
            approval: Arc::new(Mutex::new("allow_once".into())),
            call_delay_ms: Arc::new(AtomicI64::new(0)),
            raw_lines: Default::default(),
        };
        e.spawn_reader();
        e
    }

    fn spawn_reader(&self) {
        let reader = BufReader::new(self.stream.try_clone().unwrap());
        let (pending, seen, handler, approval, delay, writer, raw) = (
            self.pending.clone(),
            self.seen.clone(),
            self.handler.clone(),
            self.approval.clone(),
            self.call_delay_ms.clone(),
            self.writer.clone(),
            self.raw_lines.clone(),
        );
        std::thread::spawn(move || {
            for line in reader.lines() {
                let Ok(line) = line else { break };
                let Ok(msg) = serde_json::from_str::<Value>(&line) else {
                    continue;
                };
                raw.lock().unwrap().push(msg.clone());
                let method = msg
                    .get("method")
                    .and_then(Value::as_str)
                    .map(str::to_string);
                match (method, msg.get("id").cloned()) {
                    (Some(m), Some(id)) if m == "tool.call" => {
                        let p = msg["params"].clone();
                        let tool = p["tool"].as_str().unwrap_or("").to_string();
                        {
                            let mut s = seen.lock().unwrap();
                            s.calls.push((tool.clone(), p["arguments"].clone()));
                            s.in_flight += 1;
                            s.max_in_flight = s.max_in_flight.max(s.in_flight);
                        }
                        let (seen, handler, delay, writer) = (
                            seen.clone(),
                            handler.lock().unwrap().clone(),
                            delay.clone(),
                            writer.clone(),
                        );
                        std::thread::spawn(move || {
                            let d = delay.load(Ordering::Relaxed);
                            if d > 0 {
                                std::thread::sleep(Duration::from_millis(d as u64));
                            }
                            let answer = match handler(&tool, &p["arguments"]) {
                                Ok(r) => json!({"jsonrpc": "2.0", "id": id, "result": r}),
                                Err(m) => {
                                    json!({"jsonrpc": "2.0", "id": id, "error": {"code": -32000, "message": m}})
                                }
                            };
                            seen.lock().unwrap().in_flight -= 1;
                            let _ = writeln!(writer.lock().unwrap(), "{answer}");
                        });
                    }
                    (Some(m), Some(id)) if m == "approval.request" => {
                        seen.lock().unwrap().approvals.push(msg["params"].clone());
                        let decision = approval.lock().unwrap().clone();
                        if decision != "silent" {
                            let answer = json!({"jsonrpc": "2.0", "id": id, "result": {"decision": decision}});
                            let _ = writeln!(writer.lock().unwrap(), "{answer}");
                        }
                    }
                    (Some(m), None) => seen.lock().unwrap().notifications.push((
                        m,
                        msg["params"].clone(),
                        Instant::now(),
                    )),
                    (None, Some(id)) => {
                        if let Some(tx) =
                            id.as_u64().and_then(|i| pending.lock().unwrap().remove(&i))
                        {
                            let _ = tx.send(msg);
                        } else if id.is_null() {
                            // Connection-level errors (id null) are kept in raw_lines.
                        }
                    }
                    _ => {}
                }
            }
        });
    }

    pub fn set_handler(&self, h: Handler) {
        *self.handler.lock().unwrap() = h;
    }

    pub fn send_raw(&self, bytes: &[u8]) {
        let mut w = self.writer.lock().unwrap();
        w.write_all(bytes).unwrap();
    }

    /// Send a request and wait for its answer (the whole message).
    pub fn request_msg(&self, method: &str, params: Value, timeout: Duration) -> Value {
        self.send_request(method, params)
            .recv_timeout(timeout)
            .unwrap_or_else(|_| panic!("no answer to {method} within {timeout:?}"))
    }

    /// Send a request now; its answer (the whole message) comes on the
    /// receiver. Requests sent one after another from one thread reach the
    /// daemon in that order.
    pub fn send_request(&self, method: &str, params: Value) -> mpsc::Receiver<Value> {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel();
        self.pending.lock().unwrap().insert(id, tx);
        let line = json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params});
        writeln!(self.writer.lock().unwrap(), "{line}").unwrap();
        rx
    }

    /// `Ok(result)` or `Err(error object)`.
    pub fn request(&self, method: &str, params: Value) -> Result<Value, Value> {
        let m = self.request_msg(method, params, Duration::from_secs(120));
        match m.get("error") {
            Some(e) => Err(e.clone()),
            None => Ok(m["result"].clone()),
        }
    }

    pub fn start(&self, token: &str, code: &str, tools: &[&str]) -> Result<String, Value> {
        self.request(
            "script.start",
            json!({"token": token, "code": code, "tools": tools, "description": "test script"}),
        )
        .map(|r| {
            assert_eq!(r["state"], "running");
            r["script_id"].as_str().unwrap().to_string()
        })
    }

    pub fn wait(&self, script_id: &str) -> Value {
        self.request("script.wait", json!({"script_id": script_id}))
            .expect("script.wait")
    }

    /// Start and wait; panics on a refused start.
    pub fn run(&self, token: &str, code: &str, tools: &[&str]) -> Value {
        let id = self
            .start(token, code, tools)
            .unwrap_or_else(|e| panic!("start refused: {e}"));
        self.wait(&id)
    }

    pub fn calls_seen(&self) -> Vec<(String, Value)> {
        self.seen.lock().unwrap().calls.clone()
    }

    pub fn notifications(&self, method: &str) -> Vec<(Value, Instant)> {
        self.seen
            .lock()
            .unwrap()
            .notifications
            .iter()
            .filter(|n| n.0 == method)
            .map(|n| (n.1.clone(), n.2))
            .collect()
    }

    pub fn close(self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }
}

/// Error code and data.reason of an error object.
pub fn code_reason(e: &Value) -> (i64, String) {
    (
        e["code"].as_i64().unwrap(),
        e["data"]["reason"].as_str().unwrap_or("").to_string(),
    )
}

/// Processes whose command line contains `marker` (the sandboxed ones included:
/// they are visible from the host PID namespace).
pub fn processes_with(marker: &str) -> Vec<i32> {
    let mut out = vec![];
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        if pid as u32 == std::process::id() {
            continue;
        }
        if let Ok(c) = std::fs::read(e.path().join("cmdline")) {
            if String::from_utf8_lossy(&c).contains(marker) {
                out.push(pid);
            }
        }
    }
    out
}

/// The daemon's peak resident set so far (VmHWM), in bytes.
pub fn peak_rss(pid: u32) -> u64 {
    proc_status_kib(pid, "VmHWM:") * 1024
}

/// The daemon's resident set now (VmRSS), in bytes.
pub fn rss(pid: u32) -> u64 {
    proc_status_kib(pid, "VmRSS:") * 1024
}

/// The anonymous part of the daemon's resident set now (RssAnon: heap, stacks; not
/// the binary's code pages, which grow with the code paths run), in bytes.
pub fn rss_anon(pid: u32) -> u64 {
    proc_status_kib(pid, "RssAnon:") * 1024
}

fn proc_status_kib(pid: u32, field: &str) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
}

pub fn eventually(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < timeout, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// The descendants of `pid` whose command line holds `word` (an argument, or
/// part of one).
pub fn descendants_running(pid: u32, word: &[u8]) -> Vec<u32> {
    descendants(pid)
        .into_iter()
        .filter(|p| {
            std::fs::read(format!("/proc/{p}/cmdline"))
                .is_ok_and(|c| c.windows(word.len()).any(|w| w == word))
        })
        .collect()
}

/// The pids of every process descending from `pid`.
pub fn descendants(pid: u32) -> Vec<u32> {
    let mut parent = std::collections::HashMap::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(p) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
            continue;
        };
        if let Some(pp) = stat
            .rsplit_once(") ")
            .and_then(|(_, rest)| rest.split(' ').nth(1))
            .and_then(|s| s.parse::<u32>().ok())
        {
            parent.insert(p, pp);
        }
    }
    parent
        .keys()
        .copied()
        .filter(|&p| {
            let mut q = p;
            while let Some(&pp) = parent.get(&q) {
                if pp == pid {
                    return true;
                }
                q = pp;
            }
            false
        })
        .collect()
}
