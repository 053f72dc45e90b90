//! A script that fills the disk, through the real daemon, socket, bwrap and
//! Python (security issue 7). Each test puts the workspace (and, for the shared
//! case, the state directory too) on a small tmpfs of its own, which a guard
//! unmounts; the script fills it, and the tests assert what the daemon recorded,
//! what the next start gets, and that the daemon recovers once space returns.

use crate::common::*;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::Duration;

const MIB: u64 = 1 << 20;

/// Mounts made for one test, unmounted (lazily: the daemon may still hold
/// files there) in reverse order when dropped.
struct Mounts(Vec<PathBuf>);

impl Mounts {
    fn tmpfs(&mut self, at: &Path, size: &str, owner: u32) {
        let opts = format!("size={size},mode=0755,uid={owner},gid={owner}");
        nix::mount::mount(
            Some("tmpfs"),
            at,
            Some("tmpfs"),
            nix::mount::MsFlags::empty(),
            Some(opts.as_str()),
        )
        .unwrap_or_else(|e| panic!("mount tmpfs on {}: {e}", at.display()));
        self.0.push(at.to_path_buf());
    }

    fn bind(&mut self, from: &Path, to: &Path) {
        nix::mount::mount(
            Some(from),
            to,
            None::<&str>,
            nix::mount::MsFlags::MS_BIND,
            None::<&str>,
        )
        .unwrap_or_else(|e| panic!("bind {} on {}: {e}", from.display(), to.display()));
        self.0.push(to.to_path_buf());
    }
}

impl Drop for Mounts {
    fn drop(&mut self) {
        for at in self.0.iter().rev() {
            let _ = nix::mount::umount2(at, nix::mount::MntFlags::MNT_DETACH);
        }
    }
}

/// Fills the workspace's filesystem (until ENOSPC), then makes a tool call,
/// prints and writes to stderr: all of which the record should have kept.
const FILL: &str = r#"
import sys, agent_tools
n = 0
with open("fill.bin", "wb", buffering=0) as f:
    chunk = b"\0" * 65536
    try:
        while True:
            n += f.write(chunk)
    except OSError as e:
        print("full after", n, "bytes:", e.strerror, flush=True)
print(agent_tools.call("fleet__list_devices", {})["devices"])
for i in range(100):
    print("line", i, "of the output")
print("warning on stderr", file=sys.stderr)
"#;

fn db_row(rig: &Rig, script_id: &str) -> (String, Value) {
    let db = rusqlite::Connection::open_with_flags(
        rig.state.join("scriptgate.db"),
        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
    )
    .unwrap();
    db.query_row(
        "SELECT status, coalesce(result, 'null') FROM scripts WHERE script_id = ?1",
        [script_id],
        |r| {
            Ok((
                r.get::<_, String>(0)?,
                serde_json::from_str(&r.get::<_, String>(1)?).unwrap(),
            ))
        },
    )
    .unwrap()
}

/// The record directories in the workspace.
fn records(rig: &Rig) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(rig.workspace.join(".agent/scripts"))
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// The result of the script that filled the disk: its own status, its output
/// (the daemon's copy), and a record that says which files it could not write.
fn assert_marked_incomplete(r: &Value) {
    assert_eq!(r["status"], "ok", "{r}");
    let out = r["output"].as_str().unwrap();
    assert!(out.starts_with("full after "), "{out}");
    assert!(out.contains("['SN1', 'SN2', 'SN3']"), "{out}");
    let notes: Vec<&str> = r["record_incomplete"]
        .as_array()
        .unwrap_or_else(|| panic!("no record_incomplete in {r}"))
        .iter()
        .map(|n| n.as_str().unwrap())
        .collect();
    for file in ["output.txt", "stderr.txt", "calls.jsonl"] {
        assert!(
            notes
                .iter()
                .any(|n| n.starts_with(file) && n.contains("the filesystem is full")),
            "{file} not named in {notes:?}"
        );
    }
    let text = r["text"].as_str().unwrap();
    assert!(
        text.contains("[record incomplete: output.txt: the filesystem is full"),
        "the model is not told: {text}"
    );
}

#[test]
#[ignore = "needs root: mounts a tmpfs for the workspace"]
fn a_full_workspace_is_marked_incomplete_and_a_start_it_refuses_leaves_nothing() {
    require_root("mounts a tmpfs for the workspace");
    let rig = Rig::new();
    let mut mounts = Mounts(vec![]);
    mounts.tmpfs(&rig.workspace, "4m", NOBODY);
    let e = rig.engine();
    let token = rig.token(&rig.snapshot("auto"));

    let r = e.run(&token, FILL, &[]);
    assert_marked_incomplete(&r);
    let first = r["script_id"].as_str().unwrap().to_string();
    let (status, row) = db_row(&rig, &first);
    assert_eq!(status, "ok");
    assert_eq!(row["record_incomplete"], r["record_incomplete"]);
    assert!(
        rig.log_text()
            .contains("record in its workspace is incomplete"),
        "not logged: {}",
        rig.log_text()
    );

    // The workspace is still full: the start is refused, naming the cause, and
    // leaves no script.py behind that no audit row names.
    let err = e.start(&token, "print('hi')", &[]).unwrap_err();
    assert_eq!(code_reason(&err).1, "no_space", "{err}");
    let msg = err["message"].as_str().unwrap();
    assert!(
        msg.contains("is full") && msg.contains(&rig.workspace.display().to_string()),
        "{msg}"
    );
    assert_eq!(records(&rig), vec![first.clone()], "an orphan record");

    // Space returns: the next script runs, and its record is whole.
    std::fs::remove_file(rig.workspace.join("fill.bin")).unwrap();
    let r = e.run(&token, "print('back')", &[]);
    assert_eq!(r["status"], "ok", "{r}");
    assert!(r.get("record_incomplete").is_none(), "{r}");
    let out = std::fs::read_to_string(
        rig.details(r["script_id"].as_str().unwrap())
            .join("output.txt"),
    );
    assert_eq!(out.unwrap(), "back\n");
}

#[test]
#[ignore = "needs root: mounts a tmpfs for the workspace and the state dir"]
fn a_script_that_fills_the_disk_it_shares_with_the_state_dir_still_gets_its_audit_row() {
    require_root("mounts a tmpfs for the workspace and the state dir");
    let mut rig = Rig::new();
    rig.stop(nix::sys::signal::Signal::SIGTERM);
    let mut mounts = Mounts(vec![]);
    let disk = rig.dir.path().join("disk");
    std::fs::create_dir(&disk).unwrap();
    mounts.tmpfs(&disk, "24m", 0);
    let (ws, state) = (disk.join("ws"), disk.join("state"));
    std::fs::create_dir(&ws).unwrap();
    std::fs::create_dir(&state).unwrap();
    chown_to_script_uid(&ws);
    mounts.bind(&ws, &rig.workspace);
    std::fs::create_dir_all(&rig.state).unwrap();
    mounts.bind(&state, &rig.state);
    rig.start();
    let e = rig.engine();
    let token = rig.token(&rig.snapshot("auto"));
    let reserve = rig.state.join("scriptgate.db.reserve");

    let r = e.run(&token, FILL, &[]);
    let first = r["script_id"].as_str().unwrap().to_string();
    let (status, row) = db_row(&rig, &first);
    assert_eq!(status, "ok", "the audit row stayed {status}");
    assert_marked_incomplete(&r);
    assert_eq!(
        row["output"], r["output"],
        "the row keeps the daemon's copy"
    );
    assert!(
        rig.log_text().contains("released the reserve"),
        "the finish row did not need the reserve: {}",
        rig.log_text()
    );

    // Still full: a clear refusal (the reserve cannot be set aside again, or
    // the record cannot be written), and nothing left behind.
    let err = e.start(&token, "print('hi')", &[]).unwrap_err();
    assert_eq!(code_reason(&err).1, "no_space", "{err}");
    assert!(
        err["message"].as_str().unwrap().contains("is full"),
        "{err}"
    );
    assert_eq!(records(&rig), vec![first], "an orphan record");

    // Space returns: the daemon runs scripts again and keeps its reserve.
    std::fs::remove_file(rig.workspace.join("fill.bin")).unwrap();
    let r = e.run(&token, "print('back')", &[]);
    assert_eq!(r["status"], "ok", "{r}");
    assert!(r.get("record_incomplete").is_none(), "{r}");
    assert_eq!(db_row(&rig, r["script_id"].as_str().unwrap()).0, "ok");
    eventually(
        "the reserve set aside again",
        Duration::from_secs(10),
        || std::fs::metadata(&reserve).is_ok_and(|m| m.len() == 8 * MIB),
    );
    drop(e);
    rig.stop(nix::sys::signal::Signal::SIGTERM);
}

#[test]
#[ignore = "needs root: the rig's scripts run as nobody"]
fn a_write_past_file_max_bytes_fails_with_efbig_and_kills_nothing() {
    require_root("the rig's scripts run as nobody");
    let rig = Rig::with_config(
        "[server]\nmax_message_bytes = 1048576\n[scripts]\nfile_max_bytes = 1048576\n",
    );
    let code = r#"
import errno, os, resource
print("limit", resource.getrlimit(resource.RLIMIT_FSIZE))
try:
    with open("big.bin", "wb") as f:
        f.write(b"\0" * (2 << 20))
    print("wrote it all")
except OSError as e:
    print("write:", errno.errorcode[e.errno])
print("size", os.path.getsize("big.bin"))
# A child that does not ignore SIGXFSZ itself: ignored all the same.
status = os.system("exec 2>/dev/null; head -c 2000000 /dev/zero > big2.bin")
print("child", os.waitstatus_to_exitcode(status))
# Blocks past the end of a file, which the size limit does not count: refused.
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]
fd = os.open("kept.bin", os.O_CREAT | os.O_WRONLY, 0o600)
for mode, name in ((1, "keep_size"), (3, "punch_hole")):
    rc = libc.fallocate(fd, mode, 0, 200 << 20)
    print(name, rc, errno.errorcode.get(ctypes.get_errno()), os.fstat(fd).st_blocks * 512)
# Plain fallocate grows the file, bounded as a write is.
try:
    os.posix_fallocate(fd, 0, 2 << 20)
    print("posix_fallocate grew it")
except OSError as e:
    print("posix_fallocate:", errno.errorcode[e.errno])
print("kept size", os.fstat(fd).st_size, "blocks", os.fstat(fd).st_blocks * 512)
"#;
    let e = rig.engine();
    let r = e.run(&rig.token(&rig.snapshot("auto")), code, &[]);
    assert_eq!(r["status"], "ok", "{r}");
    let out = r["output"].as_str().unwrap();
    assert!(out.contains("limit (1048576, 1048576)"), "{out}");
    assert!(out.contains("write: EFBIG"), "{out}");
    assert!(out.contains("size 1048576"), "{out}");
    assert!(
        !out.contains("child -25"),
        "the shell's child was killed by SIGXFSZ: {out}"
    );
    // 200 MiB held by a file of size 0 (KEEP_SIZE) was possible before.
    // (Python names errno 95 ENOTSUP, which is EOPNOTSUPP on Linux.)
    assert!(out.contains("keep_size -1 ENOTSUP 0"), "{out}");
    assert!(out.contains("punch_hole -1 ENOTSUP 0"), "{out}");
    assert!(out.contains("posix_fallocate: EFBIG"), "{out}");
    let blocks: u64 = out
        .lines()
        .find_map(|l| l.strip_prefix("kept size "))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|b| b.parse().ok())
        .unwrap_or(u64::MAX);
    assert!(blocks <= 1 << 20, "the file holds {blocks} bytes: {out}");
}

/// `scripts.disk_max_bytes` where the workspace's filesystem has no project
/// quotas (this host's kernel has none: the bound itself is tested in the
/// booted guests, tests/vm): the script runs, and its result says why the
/// bound is not in force.
#[test]
#[ignore = "needs root: the rig's scripts run as nobody"]
fn a_disk_bound_that_cannot_be_in_force_says_why() {
    require_root("the rig's scripts run as nobody");
    let rig = Rig::with_config("[scripts]\ndisk_max_bytes = 67108864\n");
    let e = rig.engine();
    let r = e.run(&rig.token(&rig.snapshot("auto")), "print('ran')", &[]);
    assert_eq!(r["status"], "ok", "{r}");
    let notes = r["backend_notes"].to_string();
    assert!(
        notes.contains("scripts.disk_max_bytes not in force") && notes.contains("project quotas"),
        "{r}"
    );
}

/// Fills the workspace's filesystem, then runs on while `fill.bin` is there,
/// and until `stop` is: the daemon checkpoints its counts on a full disk, then
/// on a disk with room again.
const FILL_AND_WAIT: &str = r#"
import os, time
with open("fill.bin", "wb", buffering=0) as f:
    try:
        while True:
            f.write(b"\0" * 65536)
    except OSError as e:
        print("full:", e.strerror, flush=True)
while os.path.exists("fill.bin") or not os.path.exists("stop"):
    time.sleep(0.05)
print("stopped")
"#;

/// Lines of the daemon's log with all of `words`.
fn log_lines(rig: &Rig, words: &[&str]) -> usize {
    rig.log_text()
        .lines()
        .filter(|l| words.iter().all(|w| l.contains(w)))
        .count()
}

#[test]
#[ignore = "needs root: mounts a tmpfs for the workspace and the state dir"]
fn a_full_state_dir_is_warned_of_once_not_at_every_checkpoint_and_its_recovery_is_said() {
    require_root("mounts a tmpfs for the workspace and the state dir");
    let mut rig = Rig::new();
    rig.stop(nix::sys::signal::Signal::SIGTERM);
    let mut mounts = Mounts(vec![]);
    let disk = rig.dir.path().join("disk");
    std::fs::create_dir(&disk).unwrap();
    mounts.tmpfs(&disk, "24m", 0);
    let (ws, state) = (disk.join("ws"), disk.join("state"));
    std::fs::create_dir(&ws).unwrap();
    std::fs::create_dir(&state).unwrap();
    chown_to_script_uid(&ws);
    mounts.bind(&ws, &rig.workspace);
    std::fs::create_dir_all(&rig.state).unwrap();
    mounts.bind(&state, &rig.state);
    // The failures not said at warning are said at debug: the test counts them.
    rig.start_with(|c| {
        c.env("SCRIPTGATE_LOG", "info,scriptgate=debug");
    });
    let e = rig.engine();
    let token = rig.token(&rig.snapshot("auto"));
    let id = e.start(&token, FILL_AND_WAIT, &[]).unwrap();

    let full = "checkpoint running scripts' counts: database or disk is full";
    // Four failed checkpoints (one said, three not): each a tick (2 s) apart.
    eventually(
        "three failed checkpoints not said at warning",
        Duration::from_secs(60),
        || log_lines(&rig, &[full, "DEBUG", "not said since the last warning"]) >= 3,
    );
    assert_eq!(
        log_lines(&rig, &[full, "WARN"]),
        1,
        "a warning per checkpoint: {}",
        rig.log_text()
    );
    assert!(
        log_lines(&rig, &[full, "WARN", "at most once a minute"]) == 1,
        "{}",
        rig.log_text()
    );

    std::fs::remove_file(rig.workspace.join("fill.bin")).unwrap();
    eventually(
        "the checkpoint's recovery said",
        Duration::from_secs(30),
        || {
            log_lines(
                &rig,
                &[
                    "INFO",
                    "checkpoint running scripts' counts: written again, after",
                ],
            ) == 1
        },
    );
    std::fs::write(rig.workspace.join("stop"), "").unwrap();
    let r = e.wait(&id);
    assert_eq!(r["status"], "ok", "{r}");
    assert!(r["output"].as_str().unwrap().contains("stopped"), "{r}");
    assert_eq!(log_lines(&rig, &[full, "WARN"]), 1, "{}", rig.log_text());
    assert_eq!(db_row(&rig, &id).0, "ok");
    drop(e);
    rig.stop(nix::sys::signal::Signal::SIGTERM);
}
