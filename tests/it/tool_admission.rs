//! Tools an MCP server lists that scriptgate cannot offer, beside good ones: a
//! name with white space (`bad name`), with a right-to-left override
//! (`x\u202ey`) or a zero-width space (`a\u200bb`). Each is left out with a
//! warning naming it and its server, and listed as not offered with why
//! (`scriptgate tools`, the `describe` text), escaped; every other tool works,
//! in `scriptgate run`, `describe` and `mcp`; and a changed list that cannot
//! be read leaves the one before in force in `scriptgate mcp`. The servers are
//! real Python processes (tests/fixtures/odd_tools_server.py), the CLI the
//! real binary.
use crate::common::*;
use serde_json::Value;
use std::io::{BufRead, BufReader, Write};
use std::process::Stdio;
use std::sync::mpsc;
use std::time::Duration;

fn server(mode: &str) -> String {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/odd_tools_server.py");
    format!("odd=python3 {} {mode}", path.display())
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Nothing that hides or reorders text reached a terminal.
fn no_hidden_characters(s: &str) {
    assert!(
        !s.contains(['\u{202e}', '\u{200b}']),
        "a hidden character is shown as it is: {s}"
    );
}

/// The lines `scriptgate` wrote for the three odd tools.
const LEFT_OUT: [(&str, &str); 3] = [
    ("odd__bad name", "its name has white space in it"),
    (
        "odd__x\\u202ey",
        "its name has a control, invisible or reordering character (\\u202e)",
    ),
    (
        "odd__a\\u200bb",
        "its name has a control, invisible or reordering character (\\u200b)",
    ),
];

#[test]
fn odd_tools_are_left_out_with_a_warning_and_listed_as_not_offered() {
    let o = cli(["tools", "--mcp", &server("")]);
    let (out, err) = (text(&o.stdout), text(&o.stderr));
    assert_eq!(o.status.code(), Some(0), "{err}");
    let offered: Vec<&str> = out
        .lines()
        .skip(1)
        .take_while(|l| !l.is_empty())
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert_eq!(offered, ["odd__ok", "odd__flip"], "{out}");
    let not_offered: String = LEFT_OUT
        .iter()
        .map(|(name, why)| format!("  {name}: {why}\n"))
        .collect();
    assert!(
        out.ends_with(&format!(
            "\nNot offered (what the server lists of them cannot be used):\n{not_offered}"
        )),
        "{out}"
    );
    for (name, why) in LEFT_OUT {
        let warning =
            format!("scriptgate: warning: MCP server odd: tool \"{name}\" is not offered: {why}");
        assert!(err.lines().any(|l| l == warning), "{warning}\n{err}");
    }
    no_hidden_characters(&out);
    no_hidden_characters(&err);
    // --json: the names exact, as the server wrote them.
    let o = cli(["tools", "--json", "--mcp", &server("")]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    let v: Vec<Value> = serde_json::from_slice(&o.stdout).unwrap();
    let names: Vec<(&str, Option<&str>)> = v
        .iter()
        .map(|t| (t["name"].as_str().unwrap(), t["not_offered"].as_str()))
        .collect();
    assert_eq!(
        names,
        [
            ("odd__ok", None),
            ("odd__flip", None),
            ("odd__bad name", Some(LEFT_OUT[0].1)),
            (
                "odd__x\u{202e}y",
                Some("its name has a control, invisible or reordering character (\\u202e)")
            ),
            (
                "odd__a\u{200b}b",
                Some("its name has a control, invisible or reordering character (\\u200b)")
            ),
        ]
    );
}

/// `--class` for a tool left out says so, and why.
#[test]
fn a_class_for_a_tool_left_out_says_why_it_is_not_there() {
    let o = cli([
        "tools",
        "--class",
        "odd__bad name=write",
        "--mcp",
        &server(""),
    ]);
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains(
            "--class odd__bad name: that tool is not offered: its name has white space in it"
        ),
        "{err}"
    );
}

/// A server that lists many odd tools: the first 32 are named, the others
/// counted, in the warnings and in `scriptgate tools`.
#[test]
fn tools_left_out_are_named_up_to_a_bound() {
    let o = cli(["tools", "--mcp", &server("many")]);
    let (out, err) = (text(&o.stdout), text(&o.stderr));
    assert_eq!(o.status.code(), Some(0), "{err}");
    let warnings = err.lines().filter(|l| l.contains("is not offered")).count();
    assert_eq!(warnings, 32, "{err}");
    assert!(
        err.contains("scriptgate: warning: MCP server odd: 71 more of its tools are not offered (the first 32 are named)"),
        "{err}"
    );
    let named = out.lines().filter(|l| l.starts_with("  odd__")).count();
    assert_eq!(named, 32, "{out}");
    assert!(out.ends_with("  and 71 more\n"), "{out}");
}

#[test]
fn describe_offers_the_other_tools_and_names_the_odd_ones() {
    let o = cli(["describe", "--mcp", &server("")]);
    let (out, err) = (text(&o.stdout), text(&o.stderr));
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert!(
        out.contains("    tools.odd.ok(q: str = None)  # odd__ok\n        Tool ok.\n"),
        "{out}"
    );
    let not_offered: String = LEFT_OUT
        .iter()
        .map(|(name, why)| format!("    {name} ({why})\n"))
        .collect();
    assert!(
        out.ends_with(&format!(
            "\nNot offered at all, and not callable from a script (what their server lists of them cannot be used):\n{not_offered}"
        )),
        "{out}"
    );
    no_hidden_characters(&out);
    no_hidden_characters(&err);
}

#[test]
fn the_other_tools_work_in_scriptgate_run() {
    let script = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(
        script.path(),
        "from agent_tools import tools\nprint(tools.odd.ok(q='1'))\nprint(sorted(dir(tools.odd)))\n",
    )
    .unwrap();
    let o = cli([
        "run",
        "--embedded",
        "--json",
        "--mcp",
        &server(""),
        script.path().to_str().unwrap(),
    ]);
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(0), "{err}");
    let r: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(r["status"], "ok", "{r}");
    assert_eq!(r["output"], "ok got 1\n['flip', 'ok']\n", "{r}");
    assert!(
        err.contains("scriptgate: warning: MCP server odd: tool \"odd__x\\u202ey\" is not offered"),
        "{err}"
    );
    no_hidden_characters(&err);
}

/// A `scriptgate mcp --embedded --passthrough` over one server, driven over
/// its stdio as an MCP client of the handshake era (initialized), its stdout
/// and stderr read by threads of their own.
struct Session {
    child: std::process::Child,
    stdin: Option<std::process::ChildStdin>,
    out: mpsc::Receiver<String>,
    err: mpsc::Receiver<String>,
    id: u64,
}

fn lines_of(r: impl std::io::Read + Send + 'static) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in BufReader::new(r).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    rx
}

impl Session {
    fn start(server: String) -> Session {
        let mut child = cli_command(["mcp", "--embedded", "--passthrough", "--mcp"])
            .arg(server)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut s = Session {
            stdin: child.stdin.take(),
            out: lines_of(child.stdout.take().unwrap()),
            err: lines_of(child.stderr.take().unwrap()),
            child,
            id: 0,
        };
        s.request(
            "initialize",
            serde_json::json!({"protocolVersion": "2025-06-18", "capabilities": {},
                               "clientInfo": {"name": "test", "version": "1"}}),
        );
        s.send(serde_json::json!({"jsonrpc": "2.0", "method": "notifications/initialized"}));
        s
    }

    fn send(&mut self, v: Value) {
        let stdin = self.stdin.as_mut().unwrap();
        writeln!(stdin, "{v}").unwrap();
        stdin.flush().unwrap();
    }

    /// Each message until `until` says so, waiting at most a minute for each.
    fn wait_for(&self, until: impl Fn(&Value) -> bool) -> Value {
        loop {
            let line = self
                .out
                .recv_timeout(Duration::from_secs(60))
                .expect("scriptgate mcp said nothing more");
            if let Ok(v) = serde_json::from_str::<Value>(&line) {
                if until(&v) {
                    return v;
                }
            }
        }
    }

    /// The first line on stderr, from now, that has `what` in it.
    fn stderr_with(&self, what: &str) -> String {
        loop {
            let line = self
                .err
                .recv_timeout(Duration::from_secs(60))
                .unwrap_or_else(|e| panic!("scriptgate mcp wrote no line with {what:?}: {e}"));
            if line.contains(what) {
                return line;
            }
        }
    }

    /// A request's result (an error fails the test).
    fn request(&mut self, method: &str, params: Value) -> Value {
        self.id += 1;
        let n = self.id;
        self.send(
            serde_json::json!({"jsonrpc": "2.0", "id": n, "method": method, "params": params}),
        );
        let v = self.wait_for(|v| v["id"] == n);
        assert!(v.get("error").is_none(), "{method}: {v}");
        v["result"].clone()
    }

    /// The tools offered, by name, and `run_script`'s description.
    fn tools(&mut self) -> (Vec<String>, String) {
        let r = self.request("tools/list", serde_json::json!({}));
        let tools = r["tools"].as_array().unwrap();
        let names = tools
            .iter()
            .filter_map(|t| t["name"].as_str().map(str::to_string))
            .collect();
        let describe = tools
            .iter()
            .find(|t| t["name"] == "run_script")
            .and_then(|t| t["description"].as_str())
            .unwrap()
            .to_string();
        (names, describe)
    }

    /// `run_script` of `code`, which must end `ok`: its output.
    fn script(&mut self, code: &str) -> String {
        let r = self.request(
            "tools/call",
            serde_json::json!({"name": "run_script", "arguments": {"code": code}}),
        );
        assert_eq!(r["structuredContent"]["status"], "ok", "{r}");
        r["structuredContent"]["output"]
            .as_str()
            .unwrap()
            .to_string()
    }

    /// A direct call of an upstream tool: its text.
    fn call(&mut self, tool: &str, q: &str) -> String {
        let r = self.request(
            "tools/call",
            serde_json::json!({"name": tool, "arguments": {"q": q}}),
        );
        r["content"][0]["text"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    }

    /// Its stdin closed, it ends, and well.
    fn close(mut self) {
        self.stdin.take();
        assert!(self.child.wait().unwrap().success());
    }
}

/// `scriptgate mcp` over a server that lists odd tools from the start: the
/// other tools are offered, and `run_script`'s first description names the
/// odd ones as not offered, escaped.
#[test]
fn scriptgate_mcp_names_the_odd_tools_from_its_first_description() {
    let mut s = Session::start(server(""));
    let (names, describe) = s.tools();
    assert_eq!(names, ["run_script", "odd__ok", "odd__flip"]);
    let not_offered: String = LEFT_OUT
        .iter()
        .map(|(name, why)| format!("    {name} ({why})\n"))
        .collect();
    assert!(describe.ends_with(&not_offered), "{describe}");
    no_hidden_characters(&describe);
    assert_eq!(
        s.script("from agent_tools import tools\nprint(tools.odd.ok(q='a'))\n"),
        "ok got a\n"
    );
    s.close();
}

/// `scriptgate mcp` over the odd server, whose first list is good. It
/// changes (a call of `odd__flip`) to one with a new good tool and the odd
/// ones: the good ones are offered and work, in `run_script` too, and the odd
/// ones are named as not offered. Then it changes to a list that cannot be
/// read: the one before stays in force, and scripts go on calling its tools.
#[test]
fn a_changed_list_keeps_the_good_tools_and_one_not_taken_keeps_the_old() {
    let mut s = Session::start(server("later"));
    let (names, describe) = s.tools();
    assert_eq!(names, ["run_script", "odd__ok", "odd__flip"]);
    assert!(!describe.contains("Not offered"), "{describe}");
    assert_eq!(
        s.script("from agent_tools import tools\nprint(tools.odd.ok(q='a'))\n"),
        "ok got a\n"
    );

    // A new list with a new good tool and the odd ones.
    assert_eq!(s.call("odd__flip", "1"), "flip got 1");
    s.wait_for(|v| v["method"] == "notifications/tools/list_changed");
    let (names, describe) = s.tools();
    assert_eq!(names, ["run_script", "odd__ok", "odd__flip", "odd__new"]);
    let not_offered: String = [("odd__bad name 2", LEFT_OUT[0].1)]
        .iter()
        .chain(&LEFT_OUT)
        .map(|(name, why)| format!("    {name} ({why})\n"))
        .collect();
    assert!(describe.ends_with(&not_offered), "{describe}");
    no_hidden_characters(&describe);
    assert_eq!(
        s.script(
            "from agent_tools import tools\nprint(tools.odd.ok(q='b'), tools.odd.new(q='c'))\n"
        ),
        "ok got b new got c\n"
    );

    // A list that cannot be read: not taken.
    assert_eq!(s.call("odd__flip", "2"), "flip got 2");
    let said = s.stderr_with("the tool list changed");
    assert!(
        said.contains("go round in a circle") && said.ends_with("; the one before stays in force"),
        "{said}"
    );
    assert_eq!(s.tools(), (names, describe));
    assert_eq!(
        s.script("from agent_tools import tools\nprint(tools.odd.new(q='d'))\n"),
        "new got d\n"
    );
    assert_eq!(s.call("odd__ok", "e"), "ok got e");
    s.close();
}
