//! Hostile MCP servers against the CLI's MCP bridge (`scriptgate tools`): a
//! server is a program the user names, but what it sends must not hang the CLI
//! or grow it without bound. Each server here is a real process speaking MCP
//! over stdio; the CLI is the real binary.
// The test rig forks and execs children (pre_exec, prctl, rusage): each block
// says why it is sound.
#![allow(unsafe_code)]
use crate::common::cli_command;
use std::io::Write;
use std::process::Stdio;

/// A minimal MCP server in Python: answers `initialize`, then `tools/list` as
/// `MODE` says: `cursor` gives empty pages whose `nextCursor` never ends,
/// `circle` gives two pages that point at each other, `fat` endless pages of
/// one tool with an 8 MiB description, `huge` answers with one 60 MiB line of
/// `{}` objects, `flood` 1,000,000 `ping` requests, written by a thread, while it
/// reads nothing more and exits after 8 s.
const SERVER: &str = r#"
import json, os, sys, threading, time
mode = sys.argv[1]
page = 0
for line in sys.stdin:
    msg = json.loads(line)
    if "id" not in msg:
        continue
    m, i = msg["method"], msg["id"]
    if m == "initialize":
        res = {"protocolVersion": "2025-06-18", "capabilities": {"tools": {}},
               "serverInfo": {"name": "evil", "version": "1"}}
    elif m == "tools/list" and mode == "huge":
        sys.stdout.write('{"jsonrpc":"2.0","id":%d,"result":{"tools":[' % i)
        for _ in range(20):
            sys.stdout.write("{}," * (1 << 20))
        sys.stdout.write('{}]}}\n')
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

struct Ran {
    ok: bool,
    stderr: String,
    /// The peak resident set of the CLI (and the server it waited for), KiB.
    max_rss_kib: i64,
}

// The child is reaped by wait4 (for its rusage), which clippy cannot see.
#[allow(clippy::zombie_processes)]
fn tools(mode: &str) -> Ran {
    crate::common::shared();
    let mut f = tempfile::NamedTempFile::new().unwrap();
    f.write_all(SERVER.as_bytes()).unwrap();
    let server = format!("evil=python3 {} {mode}", f.path().display());
    let child = cli_command(["tools", "--mcp", &server])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id() as i32;
    let stderr = std::thread::spawn({
        let mut e = child.stderr.unwrap();
        move || {
            let mut s = String::new();
            std::io::Read::read_to_string(&mut e, &mut s).unwrap();
            s
        }
    });
    let mut status = 0;
    // SAFETY: an all-zero rusage is a valid value for the kernel to fill in.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `pid` is our own child, not waited for yet (std's Child is not
    // used for the wait); `status` and `usage` are valid for writes.
    let r = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    assert_eq!(r, pid, "wait4: {}", std::io::Error::last_os_error());
    Ran {
        ok: libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        stderr: stderr.join().unwrap(),
        max_rss_kib: usage.ru_maxrss,
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
        r.max_rss_kib < 1024 * 1024,
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
    // Answers not taken are bounded (`MAX_UNSENT`): the server's stdout is not
    // read meanwhile.
    assert!(
        r.max_rss_kib < 96 * 1024,
        "peak RSS {} MiB",
        r.max_rss_kib / 1024
    );
}
