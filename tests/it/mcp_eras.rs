//! `scriptgate run | tools | mcp` as MCP clients of servers of both eras, each a
//! real process over stdio and the CLI the real binary: a server that speaks
//! MCP 2026-07-28 only (tests/fixtures/mcp_2026_server.py, hand-written: no
//! initialize, `_meta` on every request, the Tasks extension), servers of the
//! initialize era only (server-everything, on the TypeScript SDK 1.32, which
//! answers `server/discover` with -32601; and one that never answers it), a
//! dual-era one on the official Python SDK `mcp` 2.3
//! (tests/fixtures/mcp_dual_server.py), tasks driven to their end or
//! cancelled, and servers that fail to start.
use crate::common::*;
use serde_json::Value;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// The 2026-07-28-only server, logging to `log`, with `mode` (`late`) if any.
fn modern(log: &Path, mode: &str) -> String {
    format!(
        "m=python3 {} {} {mode}",
        fixture("mcp_2026_server.py").display(),
        log.display()
    )
}

/// The venv of tools/install-deps, whose `mcp` (2.3, required by the pinned
/// mcp-server-time) serves both eras.
fn dual() -> String {
    let python = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/mcp/venv/bin/python");
    assert!(
        python.exists(),
        "{} is missing: run tools/install-deps (or .ci/run) first",
        python.display()
    );
    format!(
        "d={} {}",
        python.display(),
        fixture("mcp_dual_server.py").display()
    )
}

fn everything() -> String {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/mcp/node_modules/.bin/mcp-server-everything");
    assert!(
        p.exists(),
        "{} is missing: run tools/install-deps (or .ci/run) first",
        p.display()
    );
    format!("everything={}", p.display())
}

/// An MCP server of the initialize era that answers nothing it does not know,
/// `server/discover` included (JSON-RPC wants an answer; some servers give
/// none). It writes the method of each message it gets to the file named by
/// its argument, and its tool says which protocol version the call carried.
const SILENT_OLD: &str = r#"
import json, sys
log = open(sys.argv[1], "a", buffering=1)
for line in sys.stdin:
    msg = json.loads(line)
    m, i = msg.get("method"), msg.get("id")
    log.write("%s\n" % m)
    if i is None:
        continue
    if m == "initialize":
        res = {"protocolVersion": "2025-06-18", "capabilities": {"tools": {}},
               "serverInfo": {"name": "old", "version": "1"}}
    elif m == "tools/list":
        res = {"tools": [{"name": "hello", "inputSchema": {"type": "object"},
                          "annotations": {"readOnlyHint": True}}]}
    elif m == "tools/call":
        meta = msg["params"].get("_meta") or {}
        era = meta.get("io.modelcontextprotocol/protocolVersion", "the initialize era")
        res = {"content": [{"type": "text", "text": "hello from " + era}]}
    else:
        continue
    sys.stdout.write(json.dumps({"jsonrpc": "2.0", "id": i, "result": res}) + "\n")
    sys.stdout.flush()
"#;

struct Ran {
    code: Option<i32>,
    stderr: String,
    /// `run --json`'s result.
    result: Value,
    took: Duration,
}

impl Ran {
    fn output(&self) -> &str {
        self.result["output"].as_str().unwrap_or("")
    }
}

/// `scriptgate run --embedded --json` of `code` against the servers, with `extra` flags.
fn run(servers: &[String], code: &str, extra: &[&str]) -> Ran {
    let script = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(script.path(), code).unwrap();
    let mut c = cli_command(["run", "--embedded", "--json"]);
    for s in servers {
        c.arg("--mcp").arg(s);
    }
    c.args(extra).arg(script.path()).stdin(Stdio::null());
    let started = Instant::now();
    let o = c.output().unwrap();
    let took = started.elapsed();
    Ran {
        code: o.status.code(),
        stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
        result: serde_json::from_slice(&o.stdout).unwrap_or(Value::Null),
        took,
    }
}

fn log_of(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_default()
}

/// `scriptgate tools --json`: each tool's class, by name.
fn classes(server: &str) -> Vec<(String, String)> {
    let o = cli(["tools", "--json", "--mcp", server]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let tools: Vec<Value> = serde_json::from_slice(&o.stdout).unwrap();
    tools
        .iter()
        .map(|t| {
            (
                t["name"].as_str().unwrap().to_string(),
                t["class"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

#[test]
fn a_2026_only_server_is_reached_without_initialize() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("log");
    let r = run(
        &[modern(&log, "")],
        "import agent_tools as t, json\nprint(json.dumps(t.call('m__echo', {'text': 'hi'}), sort_keys=True))\n",
        &[],
    );
    assert_eq!(r.code, Some(0), "{}\n{}", r.stderr, r.result);
    // Every request carried 2026-07-28 in its `_meta` (the server refuses any
    // other), the call declared the tasks extension, and no initialize was sent.
    assert_eq!(
        r.output().trim(),
        r#"{"protocolVersion": "2026-07-28", "tasks": true, "text": "hi"}"#
    );
    assert!(!log_of(&log).contains("initialize"), "{}", log_of(&log));
    // Classes still come from the annotations.
    let c = classes(&modern(&log, ""));
    for (tool, class) in [
        ("m__echo", "read"),
        ("m__wipe", "destructive"),
        ("m__job", "read"),
    ] {
        assert!(
            c.iter().any(|(n, k)| n == tool && k == class),
            "{tool}: {c:?}"
        );
    }
}

#[test]
fn servers_of_the_initialize_era_are_reached_through_initialize() {
    // server-everything answers the probe with -32601 at once.
    let r = run(
        &[everything()],
        "import agent_tools as t\nprint(t.call('everything__get-sum', {'a': 2, 'b': 40}))\nprint(t.call('everything__echo', {'message': 'old'}))\n",
        &[],
    );
    assert_eq!(r.code, Some(0), "{}\n{}", r.stderr, r.result);
    assert!(r.output().contains("42"), "{}", r.output());
    assert!(r.output().contains("old"), "{}", r.output());
    eprintln!("server-everything: run in {:?}", r.took);
    // Its 2025-11-25 long task is still one.
    assert!(classes(&everything())
        .iter()
        .any(|(n, k)| n == "everything__simulate-research-query" && k == "long_task"));

    // One that never answers the probe: it is given up, and initialize follows.
    let dir = tempfile::tempdir().unwrap();
    let server = dir.path().join("old.py");
    std::fs::write(&server, SILENT_OLD).unwrap();
    let log = dir.path().join("log");
    let r = run(
        &[format!(
            "old=python3 {} {}",
            server.display(),
            log.display()
        )],
        "import agent_tools as t\nprint(t.call('old__hello', {}))\n",
        &[],
    );
    assert_eq!(r.code, Some(0), "{}\n{}", r.stderr, r.result);
    assert_eq!(r.output().trim(), "hello from the initialize era");
    let methods: Vec<String> = log_of(&log).lines().map(str::to_string).collect();
    assert_eq!(
        methods[..5],
        [
            "server/discover",
            "initialize",
            "notifications/initialized",
            "tools/list",
            "tools/call"
        ],
        "{methods:?}"
    );
    eprintln!(
        "a server that never answers server/discover: run in {:?}",
        r.took
    );
}

#[test]
fn a_dual_era_server_is_spoken_to_in_2026_07_28() {
    let r = run(
        &[dual()],
        "import agent_tools as t\nprint(t.call('d__era', {})['result'])\nprint(t.call('d__add', {'a': 2, 'b': 40})['result'])\n",
        &[],
    );
    assert_eq!(r.code, Some(0), "{}\n{}", r.stderr, r.result);
    assert_eq!(r.output(), "era 2026-07-28\n42\n");
    let c = classes(&dual());
    assert!(c.contains(&("d__add".into(), "read".into())), "{c:?}");
    assert!(c.contains(&("d__note".into(), "write".into())), "{c:?}");
}

/// A modern server slow to start answers the probe after the client gave up
/// on it and sent initialize, which it refuses: it is started again in its era.
#[test]
fn a_probe_answered_late_starts_the_handshake_again_in_2026_07_28() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("log");
    let r = run(
        &[modern(&log, "late")],
        "import agent_tools as t\nprint(t.call('m__echo', {'text': 'late'})['protocolVersion'])\n",
        &[],
    );
    assert_eq!(r.code, Some(0), "{}\n{}", r.stderr, r.result);
    assert_eq!(r.output().trim(), "2026-07-28");
    assert!(
        log_of(&log).contains("initialize refused"),
        "{}",
        log_of(&log)
    );
}

/// The id of the first task the server created for `tool`.
fn task_of(log: &str, tool: &str) -> String {
    log.lines()
        .find_map(|l| {
            l.strip_prefix("task ")
                .and_then(|t| t.strip_suffix(&format!(" {tool}")))
        })
        .unwrap_or_else(|| panic!("no task for {tool}: {log}"))
        .to_string()
}

#[test]
fn a_call_answered_with_a_task_is_driven_to_its_end() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("log");
    let code = r#"
import agent_tools as t
r = t.call_raw("m__job", {"polls": 3})
print(r["text"], r["structured"], r["is_error"])
for tool in ("m__broken", "m__asks"):
    try:
        t.call(tool, {})
    except t.ToolError as e:
        print(tool, e.code, e.message)
"#;
    let r = run(&[modern(&log, "")], code, &[]);
    assert_eq!(r.code, Some(0), "{}\n{}", r.stderr, r.result);
    let out: Vec<&str> = r.output().lines().collect();
    // Completed at the third tasks/get: its result is the call's.
    assert_eq!(out[0], "job done after 3 polls {'polls': 3} False");
    // A task that failed with a JSON-RPC error fails the call as an error
    // answer does.
    assert!(
        out[1].starts_with("m__broken engine ")
            && out[1].ends_with("the task failed: disk on fire (-32603)"),
        "{}",
        out[1]
    );
    // One that asks for input scriptgate cannot give is cancelled.
    assert!(
        out[2].starts_with("m__asks engine ")
            && out[2].ends_with(
                "the task asks for input scriptgate cannot give (elicitation/create); cancelled"
            ),
        "{}",
        out[2]
    );
    let text = log_of(&log);
    let asks = task_of(&text, "asks");
    assert!(
        text.lines().any(|l| l == format!("tasks/cancel {asks}")),
        "{text}"
    );
    let job = task_of(&text, "job");
    assert!(!text.contains(&format!("tasks/cancel {job}")), "{text}");
}

#[test]
fn a_task_past_its_call_timeout_is_cancelled() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("log");
    let r = run(
        &[modern(&log, "")],
        "import agent_tools as t\ntry:\n    t.call('m__stuck', {})\nexcept t.ToolError as e:\n    print(e.code, e.message)\n",
        &["--call-timeout", "2"],
    );
    assert_eq!(r.code, Some(0), "{}\n{}", r.stderr, r.result);
    assert!(
        r.output()
            .trim()
            .ends_with("the task did not finish within 2 s; cancelled"),
        "{}",
        r.output()
    );
    let text = log_of(&log);
    let stuck = task_of(&text, "stuck");
    assert!(
        text.lines().any(|l| l == format!("tasks/cancel {stuck}")),
        "{text}"
    );
}

/// The script ends (here at its timeout) while its call waits on a task: the
/// call is dropped, and the task cancelled at the server.
#[test]
fn a_script_cut_short_cancels_its_task() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("log");
    let r = run(
        &[modern(&log, "")],
        "import agent_tools as t\nt.call('m__stuck', {})\n",
        &["--timeout", "2"],
    );
    assert_eq!(r.code, Some(3), "{}\n{}", r.stderr, r.result);
    let text = log_of(&log);
    let stuck = task_of(&text, "stuck");
    assert!(
        text.lines().any(|l| l == format!("tasks/cancel {stuck}")),
        "{text}"
    );
}

/// `scriptgate mcp --passthrough` over a 2026-07-28 server: a tool list change
/// reaches it on its `subscriptions/listen` stream, and its own client is told.
#[test]
fn a_2026_tool_list_change_reaches_scriptgate_mcp() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("log");
    let mut child = cli_command(["mcp", "--embedded", "--passthrough", "--mcp"])
        .arg(modern(&log, ""))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<Value>();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Ok(v) = serde_json::from_str(&line) {
                if tx.send(v).is_err() {
                    return;
                }
            }
        }
    });
    let mut send = move |v: Value| {
        writeln!(stdin, "{v}").unwrap();
        stdin.flush().unwrap();
    };
    // Each message until `until` says so, waiting at most a minute for each.
    let wait_for = |until: &dyn Fn(&Value) -> bool| -> Value {
        loop {
            let v = rx
                .recv_timeout(Duration::from_secs(60))
                .expect("scriptgate mcp said nothing more");
            if until(&v) {
                return v;
            }
        }
    };
    send(
        serde_json::json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {},
        "clientInfo": {"name": "test", "version": "1"}}}),
    );
    wait_for(&|v| v["id"] == 1);
    send(serde_json::json!({"jsonrpc": "2.0", "method": "notifications/initialized"}));
    let names = |v: &Value| -> Vec<String> {
        v["result"]["tools"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|t| t["name"].as_str().map(str::to_string))
            .collect()
    };
    send(serde_json::json!({"jsonrpc": "2.0", "id": 2, "method": "tools/list"}));
    let before = names(&wait_for(&|v| v["id"] == 2));
    assert!(
        before.contains(&"m__grow".into()) && !before.contains(&"m__extra".into()),
        "{before:?}"
    );
    send(
        serde_json::json!({"jsonrpc": "2.0", "id": 3, "method": "tools/call",
                            "params": {"name": "m__grow", "arguments": {}}}),
    );
    wait_for(&|v| v["method"] == "notifications/tools/list_changed");
    send(serde_json::json!({"jsonrpc": "2.0", "id": 4, "method": "tools/list"}));
    let after = names(&wait_for(&|v| v["id"] == 4));
    assert!(after.contains(&"m__extra".into()), "{after:?}");
    // Its stdin closed, it ends.
    drop(send);
    assert!(child.wait().unwrap().success());
}

/// `--mcp "fleet=python3 relative/path.py"` started from another directory:
/// the error names the command, the directory it was started in, and what the
/// server said last, for `scriptgate tools`, `run` and `mcp` alike.
#[test]
fn a_server_that_fails_to_start_names_its_command_and_directory() {
    let dir = tempfile::tempdir().unwrap();
    let at = |args: &[&str]| -> Output {
        let mut c: Command = cli_command(args);
        c.current_dir(dir.path()).stdin(Stdio::null());
        c.output().unwrap()
    };
    let named = format!(
        "MCP server fleet: started as `python3 relative/path.py` in {}; ",
        dir.path().display()
    );
    for args in [
        &["tools", "--mcp", "fleet=python3 relative/path.py"][..],
        &[
            "run",
            "--embedded",
            "--mcp",
            "fleet=python3 relative/path.py",
            "/dev/null",
        ][..],
        &[
            "mcp",
            "--embedded",
            "--mcp",
            "fleet=python3 relative/path.py",
        ][..],
    ] {
        let o = at(args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(10), "{args:?}: {err}");
        let line = err
            .lines()
            .find(|l| l.contains(&named))
            .unwrap_or_else(|| panic!("{args:?}: {err}"));
        assert!(
            line.contains("; its stderr ends with: ")
                && line.contains("can't open file")
                && line.contains(&dir.path().join("relative/path.py").display().to_string()),
            "{args:?}: {line}"
        );
    }
    // A command that cannot be run at all.
    let o = at(&["tools", "--mcp", "fleet=./serve.py --fast"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains(&format!(
            "MCP server fleet: cannot start `./serve.py --fast` in {}: No such file or directory",
            dir.path().display()
        )),
        "{err}"
    );
}
