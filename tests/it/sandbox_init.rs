//! The sandbox init (`scriptgated --sandbox-init`), run directly as PID 1 of a
//! fresh PID namespace (`unshare`), outside bwrap: its exit statuses, its report on
//! fd 7, the descriptors the program gets, and the end of leftovers. The sandbox
//! tests (tests/it/sandbox.rs, tests/it/hostile_sandbox.rs) cover it inside bwrap.
use crate::common::*;
use std::process::Command;
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_scriptgated");

/// Run `BIN --sandbox-init 7 program...` as PID 1 of a new PID namespace, with fd
/// 7 a file; (exit status, stderr, report).
fn init(program: &[&str]) -> (i32, String, String) {
    crate::common::shared();
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("report");
    // fd 9 is a stray descriptor the init inherits (not close-on-exec).
    let script = "exec 7>\"$1\" 9</dev/null; shift; exec \"$@\"";
    let out = Command::new("unshare")
        .args([
            "--pid",
            "--fork",
            "--kill-child",
            "/bin/sh",
            "-c",
            script,
            "sh",
        ])
        .arg(&report)
        .args([BIN, "--sandbox-init", "7"])
        .args(program)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
        std::fs::read_to_string(&report).unwrap_or_default(),
    )
}

fn rss_kib(report: &str) -> u64 {
    let v: serde_json::Value =
        serde_json::from_str(report).unwrap_or_else(|e| panic!("{e}: {report:?}"));
    v["max_rss_kib"].as_u64().unwrap()
}

#[test]
fn outside_a_pid_namespace_it_refuses_to_run() {
    crate::common::shared();
    let marker = std::env::temp_dir().join(format!("sg-init-refused-{}", std::process::id()));
    let out = Command::new(BIN)
        .args(["--sandbox-init", "2", "/bin/touch"])
        .arg(&marker)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(125));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not PID 1"), "{err}");
    assert!(!marker.exists(), "the program must not have run");
}

#[test]
#[ignore = "needs root (a PID namespace from unshare)"]
fn it_passes_the_status_on_and_reports_the_peak_memory() {
    require_root("unshare --pid");
    let (code, err, report) = init(&["/bin/sh", "-c", "exit 3"]);
    assert_eq!(code, 3, "{err}");
    assert!(rss_kib(&report) > 0, "{report}");
    let (code, err, report) = init(&["/bin/sh", "-c", "kill -TERM $$"]);
    assert_eq!(code, 128 + libc::SIGTERM, "{err}");
    assert!(rss_kib(&report) > 0, "{report}");
    // A program that cannot start: 127, a message naming it, and still a report.
    let (code, err, report) = init(&["/nonexistent/program"]);
    assert_eq!(code, 127);
    assert!(err.contains("cannot start /nonexistent/program"), "{err}");
    rss_kib(&report);
    let (code, err, _) = init(&[]);
    assert_eq!(code, 125, "{err}");
    assert!(err.contains("usage"), "{err}");
}

#[test]
#[ignore = "needs root (a PID namespace from unshare)"]
fn the_program_gets_neither_the_report_nor_stray_descriptors_and_leftovers_are_killed() {
    require_root("unshare --pid");
    // fd 7 (the report) and 9 (a stray one) stay with the init.
    let (code, err, _) = init(&[
        "/bin/sh",
        "-c",
        "test -e /proc/self/fd/7 && exit 7; test -e /proc/self/fd/9 && exit 9; exit 0",
    ]);
    assert_eq!(
        code, 0,
        "a descriptor of the init reached the program: {err}"
    );
    // The check itself sees descriptors: without the init, fd 9 would be there.
    let out = Command::new("/bin/sh")
        .args([
            "-c",
            "exec 9</dev/null; exec /bin/sh -c 'test -e /proc/self/fd/9 && exit 9; exit 0'",
        ])
        .status()
        .unwrap();
    assert_eq!(out.code(), Some(9));
    // A background child outlives the program; the init kills it rather than
    // wait for it.
    let t = Instant::now();
    let (code, err, _) = init(&["/bin/sh", "-c", "sleep 600 & exit 0"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        t.elapsed() < Duration::from_secs(300),
        "the init waited for the leftover sleep"
    );
}
