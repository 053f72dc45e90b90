//! What the bench's figures are divided by, measured in the same run: a bare
//! Python start, a bare bwrap sandbox around the same Python, and one raw
//! JSON-line round trip over a pipe between two Pythons.

use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

pub const PYTHON: &str = "/usr/bin/python3";

/// `python3 -c 'print(1)'`, start to exit.
pub fn bare_python() -> Duration {
    let t = Instant::now();
    let out = Command::new(PYTHON)
        .args(["-c", "print(1)"])
        .stderr(Stdio::inherit())
        .output()
        .unwrap();
    let d = t.elapsed();
    assert_eq!(out.stdout, b"1\n");
    d
}

/// The same in a plain bwrap sandbox (its own init, the system dirs read-only,
/// /proc, /dev, a /tmp), as the scripts' uid, start to exit.
pub fn bare_bwrap(uid: u32) -> Duration {
    let mut c = Command::new("/usr/bin/bwrap");
    c.args([
        "--unshare-all",
        "--unshare-user",
        "--die-with-parent",
        "--new-session",
    ]);
    c.args(["--cap-drop", "ALL"]);
    for dir in [
        "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
    ] {
        match std::fs::symlink_metadata(dir) {
            Ok(m) if m.file_type().is_symlink() => {
                let t = std::fs::read_link(dir).unwrap();
                c.arg("--symlink").arg(t).arg(dir);
            }
            Ok(_) => {
                c.args(["--ro-bind", dir, dir]);
            }
            Err(_) => {}
        }
    }
    c.args([
        "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--chdir", "/tmp",
    ]);
    c.args([PYTHON, "-c", "print(1)"]);
    if nix::unistd::Uid::effective().is_root() {
        c.uid(uid).gid(uid);
    }
    let t = Instant::now();
    let out = c.stderr(Stdio::inherit()).output().unwrap();
    let d = t.elapsed();
    assert_eq!(out.stdout, b"1\n", "bare bwrap failed");
    d
}

/// One JSON-line request and its answer between two Pythons over a pair of
/// pipes, shaped like an agent_tools call and an engine's answer. Prints the
/// per-round-trip p50 and p99 in µs.
const HOP: &str = r#"
import json, subprocess, sys, time
ECHO = r'''
import json, sys
r, w = sys.stdin, sys.stdout
while True:
    line = r.readline()
    if not line:
        break
    o = json.loads(line)
    w.write(json.dumps({"id": o["id"], "result": {"text": "3 devices", "structured": {"devices": ["SN1", "SN2", "SN3"]}, "is_error": False}}, separators=(",", ":")) + "\n")
    w.flush()
'''
p = subprocess.Popen([sys.executable, "-c", ECHO], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
n = int(sys.argv[1])
ts = []
for i in range(n + 200):
    t = time.perf_counter()
    p.stdin.write(json.dumps({"op": "call", "tool": "fleet__list_devices", "args": {}, "id": i}, separators=(",", ":")) + "\n")
    p.stdin.flush()
    json.loads(p.stdout.readline())
    ts.append(time.perf_counter() - t)
ts = sorted(ts[200:])
print(ts[len(ts) // 2] * 1e6, ts[len(ts) * 99 // 100] * 1e6)
p.stdin.close()
p.wait()
"#;

/// (p50, p99) of the raw hop, µs.
pub fn raw_hop(n: usize) -> (f64, f64) {
    let out = Command::new(PYTHON)
        .args(["-c", HOP, &n.to_string()])
        .stderr(Stdio::inherit())
        .output()
        .unwrap();
    let s = String::from_utf8(out.stdout).unwrap();
    let v: Vec<f64> = s.split_whitespace().map(|x| x.parse().unwrap()).collect();
    (v[0], v[1])
}
