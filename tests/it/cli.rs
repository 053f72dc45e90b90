//! `scriptgate run | tools | describe` against real MCP servers: server-everything
//! and server-filesystem (npm) and mcp-server-time (PyPI), installed by
//! tools/install-deps (run by .ci/run), never vendored.
// The test rig forks and execs children (pre_exec, prctl, rusage): each block
// says why it is sound.
#![allow(unsafe_code)]
use crate::common::*;
use serde_json::Value;
use std::ffi::OsStr;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

fn mcp_bin(name: &str) -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/mcp");
    let p = if name == "mcp-server-time" {
        root.join("venv/bin").join(name)
    } else {
        root.join("node_modules/.bin").join(name)
    };
    assert!(
        p.exists(),
        "{} is missing: run tools/install-deps (or .ci/run) first",
        p.display()
    );
    p.display().to_string()
}

struct Cli {
    dir: tempfile::TempDir,
    data: PathBuf,
    workspace: PathBuf,
}

impl Cli {
    fn new() -> Cli {
        shared();
        let dir = tempfile::Builder::new()
            .prefix("sg-cli-")
            .tempdir()
            .unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let data = dir.path().join("data");
        std::fs::create_dir(&data).unwrap();
        std::fs::write(data.join("a.txt"), "alpha\nbeta\n").unwrap();
        std::fs::write(data.join("b.txt"), "gamma\n").unwrap();
        let workspace = dir.path().join("ws");
        std::fs::create_dir(&workspace).unwrap();
        chown_to_script_uid(&workspace);
        Cli {
            dir,
            data,
            workspace,
        }
    }

    fn servers(&self) -> Vec<String> {
        vec![
            "--mcp".into(),
            format!(
                "fs={} {}",
                mcp_bin("mcp-server-filesystem"),
                self.data.display()
            ),
            "--mcp".into(),
            format!("time={}", mcp_bin("mcp-server-time")),
            "--mcp".into(),
            format!("everything={}", mcp_bin("mcp-server-everything")),
        ]
    }

    fn script(&self, code: &str) -> PathBuf {
        let p = self.dir.path().join(format!("s{}.py", rand_suffix()));
        std::fs::write(&p, code).unwrap();
        p
    }

    /// `scriptgate run <servers> ARGS <script>`, with no controlling terminal
    /// (setsid) and stdin closed.
    fn command(&self, code: &str, args: &[&OsStr]) -> Command {
        let mut c = cli_command(["run"]);
        c.args(self.servers())
            .args(args)
            .arg(self.script(code))
            .stdin(Stdio::null());
        no_tty(&mut c);
        c
    }

    /// `scriptgate run` in this test's workspace.
    fn run(&self, code: &str, extra: &[&str]) -> Output {
        let mut args: Vec<&OsStr> = vec!["--workspace".as_ref(), self.workspace.as_os_str()];
        args.extend(extra.iter().map(OsStr::new));
        self.command(code, &args).output().unwrap()
    }
}

fn no_tty(c: &mut Command) {
    // SAFETY: setsid is async-signal-safe; it detaches from the controlling terminal.
    unsafe {
        c.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
}

fn rand_suffix() -> u64 {
    let mut b = [0u8; 8];
    getrandom::getrandom(&mut b).unwrap();
    u64::from_le_bytes(b)
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}
fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn tools_have_the_class_their_annotations_give() {
    let c = Cli::new();
    let out = cli(["tools".into()]
        .into_iter()
        .chain(c.servers())
        .chain(["--json".into()]));
    assert!(out.status.success(), "{}", stderr(&out));
    let tools: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
    let class = |n: &str| {
        tools
            .iter()
            .find(|t| t["name"] == n)
            .unwrap_or_else(|| panic!("no {n}"))["class"]
            .as_str()
            .unwrap()
            .to_string()
    };
    assert_eq!(class("fs__read_text_file"), "read");
    assert_eq!(class("fs__write_file"), "destructive");
    assert_eq!(class("fs__move_file"), "destructive");
    assert_eq!(class("fs__create_directory"), "write");
    assert_eq!(class("time__get_current_time"), "read");
    assert_eq!(class("everything__echo"), "read");
    assert_eq!(class("everything__toggle-simulated-logging"), "write");
    assert_eq!(class("everything__simulate-research-query"), "long_task");
    // --class overrides; the table form shows class and signature.
    let out = cli(["tools".into()]
        .into_iter()
        .chain(c.servers())
        .chain(["--class".into(), "fs__create_directory=destructive".into()]));
    let table = stdout(&out);
    assert!(table.starts_with("NAME"), "{table}");
    let line = table
        .lines()
        .find(|l| l.starts_with("fs__create_directory "))
        .unwrap();
    assert!(
        line.contains("destructive") && line.contains("fs__create_directory(path: str)"),
        "{line}"
    );
    assert!(
        table.contains("time__convert_time(source_timezone: str, target_timezone: str, time: str)"),
        "{table}"
    );
}

#[test]
fn read_calls_give_text_and_structured_content() {
    let c = Cli::new();
    let code = r#"
import agent_tools as t, json
print(t.call("fs__read_text_file", {"path": DATA + "/a.txt"})["content"].split())
print(t.call("time__get_current_time", {"timezone": "UTC"})["timezone"])
print(json.dumps(t.call("everything__get-structured-content", {"location": "New York"}), sort_keys=True))
raw = t.call_raw("everything__get-tiny-image", {})
print(raw["is_error"], [l for l in raw["text"].splitlines() if l.startswith("[image/png")])
print(t.call("everything__get-sum", {"a": 2, "b": 40}))
try:
    t.call("time__get_current_time", {"timezone": "UTC", "tz": "CET"})
except t.ToolError as e:
    print(e.code, e.message)
"#
    .replace("DATA", &format!("{:?}", c.data.display().to_string()));
    let o = c.run(&code, &["--json"]);
    assert_eq!(o.status.code(), Some(0), "{}{}", stdout(&o), stderr(&o));
    let r: Value = serde_json::from_slice(&o.stdout).unwrap();
    let lines: Vec<&str> = r["output"].as_str().unwrap().lines().collect();
    assert_eq!(lines[0], "['alpha', 'beta']");
    assert_eq!(lines[1], "UTC");
    let structured: Value = serde_json::from_str(lines[2]).unwrap();
    assert!(structured.get("temperature").is_some(), "{structured}");
    assert!(
        lines[3].starts_with("False ['[image/png, ") && lines[3].ends_with(" bytes]']"),
        "{}",
        lines[3]
    );
    assert!(lines[4].contains("42"), "{}", lines[4]);
    // The server's schema is open (no additionalProperties); the daemon closes it,
    // so the undeclared key is refused before the server is asked.
    assert_eq!(
        lines[5],
        "invalid_arguments time__get_current_time: argument `tz` is not declared in the tool's schema (its arguments are: timezone)"
    );
    assert_eq!(
        (r["calls"].as_u64(), r["failures"].as_u64()),
        (Some(6), Some(1))
    );
}

#[test]
fn declared_write_with_yes_runs_and_with_no_is_refused() {
    let c = Cli::new();
    let code = format!("import agent_tools as t\nt.call('fs__create_directory', {{'path': {:?}}})\nprint('made')\n", c.data.join("made-by-script").display().to_string());
    let o = c.run(&code, &["--tools", "fs__create_directory", "--yes"]);
    assert_eq!(o.status.code(), Some(0), "{}{}", stdout(&o), stderr(&o));
    assert!(c.data.join("made-by-script").is_dir());
    let code2 = code.replace("made-by-script", "not-made");
    let o = c.run(&code2, &["--tools", "fs__create_directory", "--no"]);
    assert_eq!(o.status.code(), Some(8), "approval denied: {}", stderr(&o));
    assert!(stderr(&o).contains("approval denied"), "{}", stderr(&o));
    assert!(!c.data.join("not-made").exists());
    // No terminal and no --yes: denied, with a message saying so.
    let o = c.run(&code2, &["--tools", "fs__create_directory"]);
    assert_eq!(o.status.code(), Some(8));
    assert!(
        stderr(&o).contains("no terminal to ask on"),
        "{}",
        stderr(&o)
    );
    assert!(!c.data.join("not-made").exists());
}

#[test]
fn destructive_tools_are_refused_at_start_and_in_the_script() {
    let c = Cli::new();
    let target = c.data.join("overwritten.txt");
    let code = format!(
        "import agent_tools as t\ntry:\n    t.call('fs__write_file', {{'path': {:?}, 'content': 'x'}})\nexcept t.ToolError as e:\n    print(e.code, e.message)\n",
        target.display().to_string()
    );
    let o = c.run(&code, &[]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("denied tool fs__write_file is destructive"),
        "{}",
        stdout(&o)
    );
    assert!(!target.exists());
    let o = c.run(&code, &["--tools", "fs__write_file", "--yes"]);
    assert_eq!(o.status.code(), Some(9), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("\"reason\":\"destructive\""),
        "{}",
        stderr(&o)
    );
}

#[test]
fn read_only_runs_provide_no_write_tools_and_no_writable_workspace() {
    let c = Cli::new();
    let code = "import agent_tools as t\ntry:\n    t.call('fs__create_directory', {'path': '/nope'})\nexcept t.ToolError as e:\n    print(e.code)\ntry:\n    open('out.txt', 'w')\nexcept OSError as e:\n    print(type(e).__name__)\n";
    let o = c.run(code, &["--read-only"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stdout(&o).ends_with("denied\nOSError\n"), "{}", stdout(&o));
    let o = c.run(code, &["--read-only", "--tools", "fs__create_directory"]);
    assert_eq!(
        o.status.code(),
        Some(9),
        "declaring a write tool in a read-only run is refused: {}",
        stderr(&o)
    );
}

#[test]
fn server_side_errors_are_tool_errors() {
    let c = Cli::new();
    let code = format!(
        "import agent_tools as t\ntry:\n    t.call('fs__read_text_file', {{'path': {:?}}})\nexcept t.ToolError as e:\n    print(e.code)\n",
        c.data.join("missing.txt").display().to_string()
    );
    let o = c.run(&code, &[]);
    assert_eq!(
        stdout(&o).lines().last(),
        Some("tool_error"),
        "{}{}",
        stdout(&o),
        stderr(&o)
    );
}

#[test]
fn a_server_killed_mid_script_gives_engine_errors_and_the_script_goes_on() {
    let c = Cli::new();
    let code = r#"
import agent_tools as t, time
print(t.call("time__get_current_time", {"timezone": "UTC"})["timezone"], flush=True)
open("long-call-next", "w").close()
try:
    t.call("everything__trigger-long-running-operation", {"duration": 30, "steps": 30})
except t.ToolError as e:
    print("long:", e.code, flush=True)
try:
    t.call("everything__echo", {"message": "hi"})
except t.ToolError as e:
    print("after:", e.code)
print("time still works:", t.call("time__get_current_time", {"timezone": "UTC"})["timezone"])
"#;
    let mut cmd = c.command(
        code,
        &[
            "--workspace".as_ref(),
            c.workspace.as_os_str(),
            "--json".as_ref(),
        ],
    );
    let child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let cli_pid = child.id() as i32;
    // The everything server is a child of the CLI; kill it once the long call is in flight.
    let everything = || -> Vec<i32> {
        processes_with("mcp-server-everything")
            .into_iter()
            .filter(|&p| ppid(p) == Some(cli_pid))
            .collect()
    };
    eventually("the everything server", Duration::from_secs(30), || {
        !everything().is_empty()
    });
    // The script marks the moment it makes the long call: kill the server then.
    // (The call is in flight or about to be; either way the server dies under it,
    // and the script sees the same engine error.)
    let marker = c.workspace.join("long-call-next");
    eventually(
        "the script to reach the long call",
        Duration::from_secs(30),
        || marker.exists(),
    );
    for p in everything() {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(p),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let r: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        r["output"], "UTC\nlong: engine\nafter: engine\ntime still works: UTC\n",
        "{r}"
    );
}

fn ppid(pid: i32) -> Option<i32> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    s.rsplit(')')
        .next()?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

#[test]
fn approval_prompt_on_a_terminal() {
    let c = Cli::new();
    for (answer, code, made) in [("y", 0, true), ("n", 8, false)] {
        let dir = c.data.join(format!("tty-{answer}"));
        let script = c.script(&format!("import agent_tools as t\nt.call('fs__create_directory', {{'path': {:?}}})\nprint('done')\n", dir.display().to_string()));
        let mut argv = vec![CLI.to_string(), "run".into()];
        argv.extend(c.servers());
        argv.extend([
            "--workspace".into(),
            c.workspace.display().to_string(),
            "--tools".into(),
            "fs__create_directory".into(),
        ]);
        argv.extend([
            "--description".into(),
            "make a directory".into(),
            script.display().to_string(),
        ]);
        // A pseudo-terminal: wait for the prompt, answer, collect the rest.
        let driver = r#"
import os, pty, sys, json, time
argv, answer = json.loads(sys.argv[1]), sys.argv[2]
pid, fd = pty.fork()
if pid == 0:
    os.execv(argv[0], argv)
buf = b""
deadline = time.time() + 60
while b"Allow once? [y/N]" not in buf and time.time() < deadline:
    try:
        buf += os.read(fd, 4096)
    except OSError:
        break
os.write(fd, (answer + "\n").encode())
while True:
    try:
        chunk = os.read(fd, 4096)
    except OSError:
        break
    if not chunk:
        break
    buf += chunk
_, st = os.waitpid(pid, 0)
sys.stdout.write(buf.decode(errors="replace"))
sys.exit(os.waitstatus_to_exitcode(st))
"#;
        let o = Command::new("python3")
            .arg("-c")
            .arg(driver)
            .arg(serde_json::to_string(&argv).unwrap())
            .arg(answer)
            .output()
            .unwrap();
        let screen = stdout(&o);
        assert_eq!(o.status.code(), Some(code), "{screen}");
        assert!(screen.contains("description: make a directory"), "{screen}");
        assert!(
            screen.contains("write tools: fs__create_directory (write)"),
            "{screen}"
        );
        assert!(
            screen.contains("   2 | t.call('fs__create_directory'"),
            "the script is shown: {screen}"
        );
        assert_eq!(dir.is_dir(), made, "{screen}");
    }
}

#[test]
fn exit_statuses_are_distinct() {
    let c = Cli::new();
    assert_eq!(c.run("print('fine')", &[]).status.code(), Some(0));
    let o = c.run("raise ValueError('boom')", &[]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stdout(&o).contains("ValueError: boom"),
        "the error tail is in the text: {}",
        stdout(&o)
    );
    assert_eq!(
        c.run("import time\ntime.sleep(30)", &["--timeout", "1"])
            .status
            .code(),
        Some(3)
    );
    let budget = "import agent_tools as t\nfor i in range(5):\n    t.call('time__get_current_time', {'timezone': 'UTC'})\n";
    assert_eq!(c.run(budget, &["--max-calls", "2"]).status.code(), Some(6));
    assert_eq!(
        c.run("print(1)", &["--tools", "fs__nope"]).status.code(),
        Some(9)
    );
    let mut bad = cli_command(["run", "--mcp", "x=/nonexistent/server", "--workspace"]);
    bad.arg(&c.workspace).arg(c.script("print(1)"));
    let o = bad.output().unwrap();
    assert_eq!(o.status.code(), Some(10), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("MCP server x: cannot start"),
        "{}",
        stderr(&o)
    );
    let o = cli(["run", "--bogus"]);
    assert_eq!(o.status.code(), Some(2));
}

#[test]
fn describe_gives_the_run_script_description() {
    let c = Cli::new();
    let o = cli(["describe".into()].into_iter().chain(c.servers()));
    assert!(o.status.success(), "{}", stderr(&o));
    let d = stdout(&o);
    assert!(
        d.contains("agent_tools.call_many(tool, args_list, return_errors=False)"),
        "{d}"
    );
    assert!(
        d.contains("at most 2000 tool calls per script (4 at a time)"),
        "{d}"
    );
    assert!(
        d.contains("    tools.time.get_current_time(timezone: str)  # time__get_current_time\n"),
        "{d}"
    );
    assert!(d.contains("Write tools: the script may call these only if you name them in run_script's `tools` argument"), "{d}");
    assert!(
        d.contains("    tools.fs.create_directory(path: str)  # fs__create_directory\n"),
        "{d}"
    );
    assert!(
        d.contains("    fs__write_file (destructive, confirmed one call at a time)"),
        "{d}"
    );
    assert!(
        d.contains("    everything__simulate-research-query (runs as a long task)"),
        "{d}"
    );
}

#[test]
fn embedded_default_without_a_daemon_and_a_fresh_workspace() {
    assert!(
        !Path::new("/run/scriptgate/scriptgate.sock").exists(),
        "this test expects no system daemon"
    );
    let c = Cli::new();
    let o = c
        .command(
            "import os\nopen('here.txt','w').write('x')\nprint(os.getcwd())\n",
            &[],
        )
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let err = stderr(&o);
    let ws = err
        .lines()
        .find_map(|l| l.strip_prefix("scriptgate: workspace "))
        .unwrap_or_else(|| panic!("{err}"));
    assert!(
        stdout(&o).ends_with(&format!("{ws}\n")),
        "the script ran in the printed workspace"
    );
    assert!(Path::new(ws).join("here.txt").exists());
    let _ = std::fs::remove_dir_all(ws);
}

#[test]
#[ignore = "needs root (cargo test -- --include-ignored, as root)"]
fn an_unusable_workspace_gets_a_clear_message() {
    require_root("scripts of root run as nobody");
    let c = Cli::new();
    let root_owned = c.dir.path().join("root-owned");
    std::fs::create_dir(&root_owned).unwrap();
    let o = c
        .command(
            "print(1)",
            &["--workspace".as_ref(), root_owned.as_os_str()],
        )
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(10));
    assert!(
        stderr(&o).contains("not writable by uid 65534 (nobody"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn run_through_a_daemon_socket() {
    let rig = Rig::new();
    let c = Cli::new();
    let code = format!(
        "import agent_tools as t\nt.call('fs__create_directory', {{'path': {:?}}})\nprint(t.call('time__get_current_time', {{'timezone': 'UTC'}})['timezone'])\n",
        c.data.join("via-socket").display().to_string()
    );
    let args: [&OsStr; 10] = [
        "--socket".as_ref(),
        rig.socket.as_os_str(),
        "--config".as_ref(),
        rig.config.as_os_str(),
        "--workspace".as_ref(),
        rig.workspace.as_os_str(),
        "--json".as_ref(),
        "--tools".as_ref(),
        "fs__create_directory".as_ref(),
        "--yes".as_ref(),
    ];
    let o = c.command(&code, &args).output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}{}", stdout(&o), stderr(&o));
    let r: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        (r["output"].as_str(), r["calls"].as_u64()),
        (Some("UTC\n"), Some(2))
    );
    assert!(c.data.join("via-socket").is_dir());
    assert!(
        rig.details(r["script_id"].as_str().unwrap())
            .join("calls.jsonl")
            .exists(),
        "the daemon kept the record in its workspace"
    );
}

#[test]
fn progress_goes_to_stderr_as_lines_and_servers_are_shut_down() {
    let c = Cli::new();
    let o = c.run(
        "import agent_tools as t, time\nt.progress(3, 10, 'warming up')\nprint('ok')\n",
        &[],
    );
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(
        stdout(&o).lines().last(),
        Some("ok"),
        "stdout gets the result text only"
    );
    assert!(
        stderr(&o).contains("progress: 3/10 warming up (0 calls, 0 failed)\n"),
        "{}",
        stderr(&o)
    );
    // The filesystem server's command line names this test's data directory.
    let marker = c.data.display().to_string();
    eventually("the MCP servers to be gone", Duration::from_secs(5), || {
        processes_with(&marker).is_empty()
    });
}

#[test]
fn through_a_socket_without_workspace_a_fresh_one_is_made_under_the_daemon_root() {
    let rig = Rig::new();
    let c = Cli::new();
    let args: [&OsStr; 4] = [
        "--socket".as_ref(),
        rig.socket.as_os_str(),
        "--config".as_ref(),
        rig.config.as_os_str(),
    ];
    let o = c
        .command("import os\nprint(os.getcwd())\n", &args)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}{}", stdout(&o), stderr(&o));
    let err = stderr(&o);
    let ws = err
        .lines()
        .find_map(|l| l.strip_prefix("scriptgate: workspace "))
        .unwrap_or_else(|| panic!("{err}"));
    assert!(
        Path::new(ws).starts_with(&rig.root),
        "{ws} is under the daemon's root {}",
        rig.root.display()
    );
    assert!(stdout(&o).ends_with(&format!("{ws}\n")));
}

/// An MCP server (Python, stdio) with one read tool, `slow`, that never answers:
/// it writes each `notifications/cancelled` it gets, and the id of each
/// `tools/call`, to the file named by its argument.
const SLOW_SERVER: &str = include_str!("../fixtures/slow_mcp_server.py");

/// A script cut short by its timeout, in the embedded daemon and through a
/// daemon's socket: the MCP server is told to cancel the call it was making
/// (MCP's `notifications/cancelled`, with that call's request id).
#[test]
fn a_script_cut_short_cancels_its_mcp_call_at_the_server() {
    let c = Cli::new();
    let server = c.dir.path().join("slow.py");
    std::fs::write(&server, SLOW_SERVER).unwrap();
    let rig = Rig::new();
    let socket: [&OsStr; 4] = [
        "--socket".as_ref(),
        rig.socket.as_os_str(),
        "--config".as_ref(),
        rig.config.as_os_str(),
    ];
    for (how, extra) in [
        ("embedded", &["--embedded".as_ref()][..]),
        ("socket", &socket[..]),
    ] {
        let seen = c.dir.path().join(format!("seen-{how}"));
        let mut cmd = cli_command(["run"]);
        cmd.arg("--mcp")
            .arg(format!(
                "slow=python3 {} {}",
                server.display(),
                seen.display()
            ))
            .args(["--timeout", "2"])
            .args(extra)
            .arg(c.script("import agent_tools as t\nt.call('slow__slow', {})\n"))
            .stdin(Stdio::null());
        no_tty(&mut cmd);
        let o = cmd.output().unwrap();
        assert_eq!(o.status.code(), Some(3), "{how}: {}", stderr(&o));
        let text = std::fs::read_to_string(&seen).unwrap_or_default();
        let id = text
            .lines()
            .find_map(|l| l.strip_prefix("call "))
            .unwrap_or_else(|| panic!("{how}: no call reached the server: {text:?}"));
        assert!(
            text.lines().any(|l| l == format!("cancelled {id}")),
            "{how}: the server was not told: {text:?}"
        );
    }
}

/// Lines from a child's stdout, as they come.
fn lines_of(out: std::process::ChildStdout) -> std::sync::mpsc::Receiver<String> {
    use std::io::BufRead;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// `scriptgate mcp --print-config`: the entry for the README's fleet server, with
/// this binary's and the server script's absolute paths, starts from a working
/// directory that is not the checkout (here `/`, as a client's may be): it
/// answers `initialize` and lists `run_script`, whose description names the
/// fleet's tools.
#[test]
fn print_config_gives_an_entry_that_starts_from_elsewhere() {
    use std::io::Write;
    let repo = std::fs::canonicalize(env!("CARGO_MANIFEST_DIR")).unwrap();
    let o = cli_with(
        [
            "mcp",
            "--print-config",
            "--embedded",
            "--mcp",
            "fleet=python3 examples/fleet/fleet_server.py",
        ],
        |c| {
            c.current_dir(&repo);
        },
    );
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v: Value = serde_json::from_str(&stdout(&o)).unwrap();
    let entry = &v["mcpServers"]["fleet"];
    let exe = std::fs::canonicalize(CLI).unwrap();
    assert_eq!(entry["command"], exe.to_str().unwrap(), "{v}");
    let server = repo.join("examples/fleet/fleet_server.py");
    let want = serde_json::json!([
        "mcp",
        "--mcp",
        format!("fleet=python3 {}", server.display()),
        "--embedded"
    ]);
    assert_eq!(entry["args"], want, "{v}");

    let args: Vec<String> = entry["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_string())
        .collect();
    let mut child = Command::new(entry["command"].as_str().unwrap())
        .args(&args)
        .current_dir("/")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let lines = lines_of(child.stdout.take().unwrap());
    let mut send = |m: Value| writeln!(&mut stdin, "{m}").unwrap();
    let answer = |id: u64| loop {
        let line = lines
            .recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|e| panic!("no answer to request {id}: {e}"));
        let m: Value = serde_json::from_str(&line).unwrap();
        if m["id"] == id {
            break m;
        }
    };
    send(
        serde_json::json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {},
        "clientInfo": {"name": "print-config-test", "version": "1"}}}),
    );
    let init = answer(1);
    assert!(init["result"]["serverInfo"].is_object(), "{init}");
    send(serde_json::json!({"jsonrpc": "2.0", "method": "notifications/initialized"}));
    send(serde_json::json!({"jsonrpc": "2.0", "id": 2, "method": "tools/list"}));
    let list = answer(2);
    let tools = list["result"]["tools"]
        .as_array()
        .unwrap_or_else(|| panic!("{list}"));
    let run_script = tools
        .iter()
        .find(|t| t["name"] == "run_script")
        .unwrap_or_else(|| panic!("{list}"));
    assert!(
        run_script["description"]
            .as_str()
            .unwrap()
            .contains("get_device_status"),
        "{run_script}"
    );
    let _ = child.kill();
    let _ = child.wait();
}

/// `--print-config` makes absolute what names a file or directory here (quoted
/// where it must be), leaves options, bare program names and words that name
/// nothing as they are, and passes the other options on.
#[test]
fn print_config_makes_paths_absolute_and_keeps_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let d = std::fs::canonicalize(dir.path()).unwrap();
    std::fs::write(d.join("my server.py"), "").unwrap();
    std::fs::write(d.join("tool.sh"), "").unwrap();
    std::fs::create_dir(d.join("data")).unwrap();
    let o = cli_with(
        [
            "mcp",
            "--print-config",
            "--mcp",
            "a=python3 'my server.py' --root data missing -v",
            "--mcp",
            "b=./tool.sh .",
            "--mode",
            "auto",
            "--passthrough",
            "--config",
            "cfg.toml",
            "--call-timeout",
            "30",
        ],
        |c| {
            c.current_dir(&d);
        },
    );
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v: Value = serde_json::from_str(&stdout(&o)).unwrap();
    let args = v["mcpServers"]["scriptgate"]["args"]
        .as_array()
        .unwrap_or_else(|| panic!("{v}"));
    let at = |s: &str| d.join(s).display().to_string();
    let words = |a: &Value| -> Vec<String> {
        let (_, cmd) = a.as_str().unwrap().split_once('=').unwrap();
        shlex::split(cmd).unwrap()
    };
    assert_eq!(args[0], "mcp");
    assert_eq!(
        words(&args[2]),
        [
            "python3",
            &at("my server.py"),
            "--root",
            &at("data"),
            "missing",
            "-v"
        ],
        "{v}"
    );
    assert_eq!(
        words(&args[4]),
        [at("tool.sh"), d.display().to_string()],
        "{v}"
    );
    let rest: Vec<&str> = args[5..].iter().map(|a| a.as_str().unwrap()).collect();
    let cfg = at("cfg.toml");
    assert_eq!(
        rest,
        [
            "--mode",
            "auto",
            "--passthrough",
            "--config",
            &cfg,
            "--call-timeout",
            "30"
        ],
        "{v}"
    );
    let o = cli([
        "mcp",
        "--print-config",
        "--http",
        "127.0.0.1:0",
        "--mcp",
        "a=x",
    ]);
    assert_eq!(o.status.code(), Some(2), "--http has no mcpServers entry");
}

/// `scriptgate mcp --socket PATH --wait SECONDS`, started while its daemon is
/// down (a gateway pod before its node's agent): it says it waits, and serves
/// once the daemon is back; without `--wait` it fails at once, naming the
/// socket.
#[test]
fn mcp_waits_for_a_daemon_that_comes_later() {
    use std::io::{BufRead, Write};
    let mut rig = Rig::new();
    let mut daemon = rig.daemon.take().unwrap();
    daemon.kill().unwrap();
    daemon.wait().unwrap();
    let fleet = "fleet=python3 examples/fleet/fleet_server.py";
    let args = |wait: &str| -> Vec<String> {
        let mut a: Vec<String> = ["mcp", "--socket"].map(String::from).to_vec();
        a.push(rig.socket.display().to_string());
        a.extend(["--config".into(), rig.config.display().to_string()]);
        a.extend(["--wait".into(), wait.into(), "--mcp".into(), fleet.into()]);
        a
    };
    let o = cli_with(args("0"), |c| {
        c.current_dir(env!("CARGO_MANIFEST_DIR"));
    });
    assert_ne!(o.status.code(), Some(0));
    assert!(stderr(&o).contains("cannot be reached"), "{}", stderr(&o));
    let mut child = cli_command(args("120"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, said) = std::sync::mpsc::channel::<String>();
    let err = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(err).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let wait_for = |what: &str| loop {
        let line = said
            .recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|_| panic!("no line with {what:?} on stderr"));
        if line.contains(what) {
            return line;
        }
    };
    wait_for("waiting up to 120 s for a daemon at");
    rig.start();
    wait_for("mode: daemon at");
    let mut stdin = child.stdin.take().unwrap();
    let lines = lines_of(child.stdout.take().unwrap());
    writeln!(
        stdin,
        "{}",
        serde_json::json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {},
            "clientInfo": {"name": "test", "version": "1"}}})
    )
    .unwrap();
    let answer: Value =
        serde_json::from_str(&lines.recv_timeout(Duration::from_secs(60)).unwrap()).unwrap();
    assert_eq!(answer["id"], 1, "{answer}");
    drop(stdin);
    assert!(child.wait().unwrap().success());
}
