//! Hostile MCP servers against the CLI's MCP bridge (`scriptgate tools`): a
//! server is a program the user names, but what it sends must not hang the CLI
//! or grow it without bound. Each server here is a real process speaking MCP
//! over stdio; the CLI is the real binary.
use std::io::Write;
use std::process::Stdio;

/// A minimal MCP server in Python: answers `initialize`, then `tools/list` as
/// `MODE` says: `cursor` gives empty pages whose `nextCursor` never ends,
/// `circle` gives two pages that point at each other, `fat` endless pages of
/// one tool with an 8 MiB description, `huge` answers with one 60 MiB line of
/// `{}` objects, `flood` 1,000,000 `ping` requests, written by a thread, while it
/// reads nothing more and exits after 8 s. For `tools/call`: `stuck` floods pings
/// for ever and reads nothing more. For `initialize`: `bare` answers with no
/// `protocolVersion` or `serverInfo` and a `tools` capability that is a list,
/// `notools` with no capabilities, `future` with MCP 2026-07-28. `strid` answers
/// with string ids and lists a read-only tool that requires a task; `reqres`
/// lists it too, after a `ping` request that carries a result listing `fake`.
/// `inflate` gives 32 pages of one read-only tool each, whose `inputSchema`
/// carries a 1 MiB array of zeros, under a key that is no keyword (`x-pad`,
/// odd pages) or under `examples` (even pages): 32 MiB that would parse to
/// 16 times that. `wide` lists 10 tools whose schemas declare 9,000
/// properties each, within the bound of one tool but not of a list.
/// `preinit` sends answers to ids 1 to 3 before its answer to `initialize`;
/// `orphan` starts a child in its process group (`sleep 299.125`) and closes
/// its stdout instead of answering; `lastwords` closes its stdout, writes 20 MB
/// to stderr ending with a line that names what is wrong, and exits 3. A `tools/call` is answered with a result
/// and an error by `both`, with an error that is a string by `badsyntax`.
const SERVER: &str = r#"
import json, os, sys, threading, time
mode = sys.argv[1]
page = 0
for line in sys.stdin:
    msg = json.loads(line)
    if "id" not in msg:
        continue
    m, i = msg["method"], msg["id"]
    if m == "initialize" and mode == "orphan":
        import subprocess
        subprocess.Popen(["sleep", "299.125"], stdout=subprocess.DEVNULL)
        os.close(1)
        time.sleep(300)
    if m == "initialize" and mode == "lastwords":
        os.close(1)
        sys.stderr.write(("x" * 999 + "\n") * 20000)
        sys.stderr.write("evil: EVIL_TOKEN is not set\n")
        sys.stderr.flush()
        sys.exit(3)
    if m == "initialize" and mode == "preinit":
        for n in (1, 2, 3):
            sys.stdout.write(json.dumps({"jsonrpc": "2.0", "id": n, "result": {}}) + "\n")
    if m == "tools/list" and mode == "reqres":
        sys.stdout.write(json.dumps({"jsonrpc": "2.0", "id": i, "method": "ping",
                                     "result": {"tools": [{"name": "fake", "annotations": {"readOnlyHint": True}}]}}) + "\n")
    if m == "tools/call" and mode in ("both", "badsyntax"):
        err = {"code": -32000, "message": "boom"} if mode == "both" else "boom"
        sys.stdout.write(json.dumps({"jsonrpc": "2.0", "id": i, "result": {"content": []}, "error": err}) + "\n")
        sys.stdout.flush()
        continue
    if m == "initialize" and mode == "bare":
        res = {"capabilities": {"tools": []}}
    elif m == "initialize" and mode == "notools":
        res = {}
    elif m == "initialize":
        res = {"protocolVersion": "2026-07-28" if mode == "future" else "2025-06-18",
               "capabilities": {"tools": {}}, "serverInfo": {"name": "evil", "version": "1"}}
    elif m == "tools/list" and mode in ("strid", "stuck", "bare", "reqres", "preinit", "both", "badsyntax"):
        task = "required" if mode in ("strid", "reqres") else "forbidden"
        res = {"tools": [{"name": "job", "inputSchema": {"type": "object"},
                          "annotations": {"readOnlyHint": True},
                          "execution": {"taskSupport": task}}]}
        i = str(i) if mode == "strid" else i
    elif m == "tools/call" and mode == "stuck":
        while True:
            sys.stdout.write('{"jsonrpc":"2.0","id":"p","method":"ping"}\n' * 1000)
    elif m == "tools/list" and mode == "huge":
        sys.stdout.write('{"jsonrpc":"2.0","id":%d,"result":{"tools":[' % i)
        for _ in range(20):
            sys.stdout.write("{}," * (1 << 20))
        sys.stdout.write('{}]}}\n')
        sys.stdout.flush()
        continue
    elif m == "tools/list" and mode == "inflate":
        page += 1
        zeros = "[" + ",".join(["0"] * (512 * 1024)) + "]"
        key = "x-pad" if page % 2 else "examples"
        more = ',"nextCursor":"p%d"' % page if page < 32 else ""
        sys.stdout.write('{"jsonrpc":"2.0","id":%d,"result":{"tools":[{"name":"t%d",'
                         '"annotations":{"readOnlyHint":true},"inputSchema":{"type":"object","%s":%s}}]%s}}\n'
                         % (i, page, key, zeros, more))
        sys.stdout.flush()
        continue
    elif m == "tools/list" and mode == "wide":
        props = ",".join('"p%d":{"type":"integer"}' % n for n in range(9000))
        tools = ",".join('{"name":"w%d","annotations":{"readOnlyHint":true},'
                         '"inputSchema":{"type":"object","properties":{%s}}}' % (n, props) for n in range(10))
        sys.stdout.write('{"jsonrpc":"2.0","id":%d,"result":{"tools":[%s]}}\n' % (i, tools))
        sys.stdout.flush()
        continue
    elif m == "tools/list" and mode == "flood":
        def flood():
            for n in range(1000000):
                sys.stdout.write('{"jsonrpc":"2.0","id":"p%d","method":"ping"}\n' % n)
            sys.stdout.flush()
        threading.Thread(target=flood, daemon=True).start()
        time.sleep(8)
        os._exit(0)
    elif m == "tools/list" and mode == "fat":
        page += 1
        pad = "x" * (8 << 20)
        res = {"tools": [{"name": "t%d" % page, "description": pad, "inputSchema": {"type": "object"}}],
               "nextCursor": "page-%d" % page}
    elif m == "tools/list" and mode == "circle":
        page += 1
        res = {"tools": [], "nextCursor": "a" if page % 2 else "b"}
    elif m == "tools/list":
        page += 1
        res = {"tools": [], "nextCursor": "page-%d" % page}
    else:
        res = {}
    sys.stdout.write(json.dumps({"jsonrpc": "2.0", "id": i, "result": res}) + "\n")
    sys.stdout.flush()
"#;

/// Runs the command after the file name it is given, and writes its peak
/// resident set (KiB) to that file; exits as the command did. A process's peak
/// counts the memory of the process it was forked from, up to its exec, so the
/// CLI is forked by this small one, not by the test binary (whose own size,
/// with the suite's other tests in it, reached 137 MiB in CI).
const PEAK: &str = r#"
import os, sys
out, argv = sys.argv[1], sys.argv[2:]
pid = os.fork()
if pid == 0:
    os.execv(argv[0], argv)
_, status, usage = os.wait4(pid, 0)
with open(out, "w") as f:
    f.write(str(usage.ru_maxrss))
sys.exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)
"#;

struct Ran {
    ok: bool,
    stdout: String,
    stderr: String,
    /// The peak resident set of the CLI (and of the server it waited for), KiB.
    max_rss_kib: i64,
}

/// `scriptgate tools` listed `evil__job` as `long_task`.
fn assert_long_task_job(r: &Ran) {
    assert!(
        r.stdout
            .lines()
            .any(|l| l.contains("evil__job") && l.contains("long_task")),
        "{}",
        r.stdout
    );
}

fn tools(mode: &str) -> Ran {
    cli(mode, &["tools"])
}

fn cli(mode: &str, args: &[&str]) -> Ran {
    crate::common::shared();
    let mut f = tempfile::NamedTempFile::new().unwrap();
    f.write_all(SERVER.as_bytes()).unwrap();
    let server = format!("evil=python3 {} {mode}", f.path().display());
    let peak = tempfile::NamedTempFile::new().unwrap();
    let o = std::process::Command::new("python3")
        .args(["-c", PEAK])
        .arg(peak.path())
        .arg(crate::common::CLI)
        .args(args)
        .args(["--mcp", &server])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    Ran {
        ok: o.status.success(),
        stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
        max_rss_kib: std::fs::read_to_string(peak.path())
            .unwrap()
            .trim()
            .parse()
            .unwrap(),
    }
}

#[test]
fn an_endless_next_cursor_is_an_error_not_a_hang() {
    let r = tools("cursor");
    assert!(!r.ok, "scriptgate tools succeeded: {}", r.stderr);
    assert!(
        r.stderr
            .contains("nextCursor did not end within 1000 pages"),
        "{}",
        r.stderr
    );
}

/// 256 MiB of pages of 8 MiB descriptions: what is read is bounded, and of
/// each description 16 KiB is kept (kept whole, they were all held until the
/// bound; 77 MiB now).
#[test]
fn pages_are_bounded_in_bytes_too() {
    let r = tools("fat");
    eprintln!("peak RSS {} MiB", r.max_rss_kib / 1024);
    assert!(!r.ok, "scriptgate tools succeeded: {}", r.stderr);
    assert!(
        r.stderr.contains("more than 256 MiB of pages"),
        "{}",
        r.stderr
    );
    assert!(
        r.max_rss_kib < 160 * 1024,
        "peak RSS {} MiB",
        r.max_rss_kib / 1024
    );
}

/// 32 MiB of pages whose schemas inflate 16 times once parsed (the CLI
/// reached 1,120 MiB before their cost once parsed was bounded): a key that
/// is no keyword is dropped from what is kept, so those tools are offered;
/// a schema over its bound leaves its tool out, named with why. The CLI holds
/// one page at a time, whatever the number of pages (97 MiB for 8, 32 or
/// 128).
#[test]
fn schemas_that_inflate_once_parsed_do_not_grow_the_cli() {
    let r = tools("inflate");
    eprintln!("peak RSS {} MiB", r.max_rss_kib / 1024);
    assert!(r.ok, "{}", r.stderr);
    let offered: Vec<&str> = r
        .stdout
        .lines()
        .skip(1)
        .take_while(|l| !l.is_empty())
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    let odd: Vec<String> = (1..=32).step_by(2).map(|n| format!("evil__t{n}")).collect();
    assert_eq!(offered, odd, "{}", r.stdout);
    for n in (2..=32).step_by(2) {
        let warning = format!(
            "scriptgate: warning: MCP server evil: tool \"evil__t{n}\" is not offered: \
             its input schema is 1024 KiB; at most 256 KiB is taken"
        );
        assert!(
            r.stderr.lines().any(|l| l == warning),
            "{warning}\n{}",
            r.stderr
        );
        let listed =
            format!("  evil__t{n}: its input schema is 1024 KiB; at most 256 KiB is taken");
        assert!(r.stdout.lines().any(|l| l == listed), "{}", r.stdout);
    }
    assert!(
        r.max_rss_kib < 160 * 1024,
        "peak RSS {} MiB",
        r.max_rss_kib / 1024
    );
}

/// A list whose tools are each within their bounds but together over the
/// list's, once parsed: the start fails and says why (a list of 2.3 MiB of
/// text whose schemas parse to some 75 MiB).
#[test]
fn a_list_over_its_total_once_parsed_fails_the_start() {
    let r = tools("wide");
    eprintln!("peak RSS {} MiB", r.max_rss_kib / 1024);
    assert!(!r.ok, "scriptgate tools succeeded: {}", r.stdout);
    assert!(
        r.stderr.contains(
            "MCP server evil: tools/list: the tools kept come to more than 8 MiB of text \
             or 32 MiB once parsed; scriptgate keeps at most that much of one server's list"
        ),
        "{}",
        r.stderr
    );
    assert!(
        r.max_rss_kib < 192 * 1024,
        "peak RSS {} MiB",
        r.max_rss_kib / 1024
    );
}

#[test]
fn pages_that_point_at_each_other_are_an_error() {
    let r = tools("circle");
    assert!(!r.ok, "scriptgate tools succeeded: {}", r.stderr);
    assert!(r.stderr.contains("go round in a circle"), "{}", r.stderr);
}

#[test]
fn a_line_of_tiny_objects_is_refused_before_it_is_parsed() {
    let r = tools("huge");
    eprintln!("peak RSS {} MiB", r.max_rss_kib / 1024);
    assert!(!r.ok, "scriptgate tools succeeded: {}", r.stderr);
    assert!(
        r.stderr.contains("message too large once parsed"),
        "{}",
        r.stderr
    );
    // The line is 60 MiB; parsed, it would be some 20 GiB of maps. What is
    // allowed is the line itself, twice over, and the server's own copy.
    assert!(
        r.max_rss_kib < 512 * 1024,
        "peak RSS {} MiB",
        r.max_rss_kib / 1024
    );
}

#[test]
fn a_server_that_floods_requests_and_reads_no_answer_does_not_grow_the_cli() {
    let r = tools("flood");
    eprintln!("peak RSS {} MiB", r.max_rss_kib / 1024);
    assert!(!r.ok, "scriptgate tools succeeded: {}", r.stderr);
    assert!(r.stderr.contains("MCP server evil exited"), "{}", r.stderr);
    // Requests read and not answered, and lines not written, are bounded
    // (`MAX_PENDING`): the server's stdout is not read meanwhile.
    assert!(
        r.max_rss_kib < 96 * 1024,
        "peak RSS {} MiB",
        r.max_rss_kib / 1024
    );
}

/// A server that stops reading in the middle of a call and floods: the call
/// fails at its timeout, and the CLI ends (the cancel it owes the server is
/// never written, and nobody waits for it).
/// `scriptgate run` of a script that calls `evil__job` once and prints what
/// failed.
fn run_one_call(mode: &str, call_timeout: &str) -> Ran {
    let script = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(
        script.path(),
        "import agent_tools as t\ntry:\n    t.call('evil__job', {})\nexcept t.ToolError as e:\n    print('failed:', e)\n",
    )
    .unwrap();
    let path = script.path().to_str().unwrap();
    cli(
        mode,
        &["run", "--embedded", "--call-timeout", call_timeout, path],
    )
}

#[test]
fn a_call_to_a_server_that_stops_reading_fails_at_its_timeout() {
    let r = run_one_call("stuck", "2");
    assert!(r.ok, "{}{}", r.stdout, r.stderr);
    assert!(
        r.stdout
            .contains("MCP server evil did not answer within 2 s"),
        "{}{}",
        r.stdout,
        r.stderr
    );
}

/// rmcp matches the id "1" to the request 1; the raw page is kept all the
/// same, with the `execution` rmcp's model has no field for.
#[test]
fn string_ids_keep_the_tools_class() {
    let r = tools("strid");
    assert!(r.ok, "{}", r.stderr);
    assert_long_task_job(&r);
}

/// What the client before rmcp took, it still takes; what it refused, it
/// refuses by name; the error is short whatever the server sent.
#[test]
fn initialize_answers_are_read_as_before() {
    let r = tools("bare");
    assert!(r.ok, "{}", r.stderr);
    assert!(r.stdout.contains("evil__job"), "{}", r.stdout);
    let r = tools("notools");
    assert!(!r.ok);
    assert!(
        r.stderr.contains("the server offers no tools"),
        "{}",
        r.stderr
    );
    let r = tools("future");
    assert!(!r.ok);
    assert!(
        r.stderr
            .contains("MCP version 2026-07-28, which scriptgate does not speak"),
        "{}",
        r.stderr
    );
}

/// A malformed answer fails its call at once (the call timeout here is far
/// longer than the test), and an error wins over a result.
#[test]
fn malformed_answers_fail_their_call_at_once() {
    let r = run_one_call("both", "600");
    assert!(r.ok, "{}{}", r.stdout, r.stderr);
    assert!(r.stdout.contains("MCP server evil: boom"), "{}", r.stdout);
    let r = run_one_call("badsyntax", "600");
    assert!(r.ok, "{}{}", r.stdout, r.stderr);
    assert!(
        r.stdout.contains("MCP server evil: a malformed answer"),
        "{}",
        r.stdout
    );
}

/// A request of the server's is no answer of ours, even with a result in it;
/// answers before the handshake's are dropped, as they were before rmcp.
#[test]
fn requests_are_not_answers_and_early_answers_are_dropped() {
    let r = tools("reqres");
    assert!(r.ok, "{}", r.stderr);
    assert!(!r.stdout.contains("fake"), "{}", r.stdout);
    assert_long_task_job(&r);
    let r = tools("preinit");
    assert!(r.ok, "{}", r.stderr);
    assert!(r.stdout.contains("evil__job"), "{}", r.stdout);
}

/// A server that never finishes its handshake leaves nothing running: its
/// process group is killed, not only the server.
#[test]
fn a_failed_handshake_kills_the_servers_process_group() {
    let r = tools("orphan");
    assert!(!r.ok);
    assert!(
        r.stderr
            .contains("initialize failed: the server exited (or closed its stdout)"),
        "{}",
        r.stderr
    );
    // Killed: gone, or a zombie waiting for its reaper.
    let running: Vec<String> = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|e| {
            let cmd = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
            let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
            let state = stat.rsplit(") ").next().and_then(|t| t.chars().next());
            cmd == b"sleep\x00299.125\x00" && !matches!(state, None | Some('Z') | Some('X'))
        })
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        running.is_empty(),
        "the server's child still runs: {running:?}"
    );
}

/// A server that fails to start has its last words in the error, even when it
/// closed its stdout first and still had 20 MB to write to its stderr.
#[test]
fn a_failed_start_ends_with_what_the_server_printed_last() {
    let r = tools("lastwords");
    assert!(!r.ok);
    let line = r.stderr.lines().find(|l| l.contains("initialize failed"));
    assert!(
        line.is_some_and(|l| l
            .contains("the server exited (or closed its stdout); its stderr ends with: ")
            && l.ends_with("evil: EVIL_TOKEN is not set")),
        "{}",
        r.stderr
    );
}
