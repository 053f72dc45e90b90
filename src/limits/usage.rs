//! What a running script holds now, for `admin.list` (`scriptgate ps`): read
//! from its cgroup on the systemd and cgroup backends, summed over its process
//! tree from /proc on the rlimit backend. Read-only: nothing here writes a
//! cgroup or signals a process. Every path is passed in, so tests read fake
//! trees in a TempDir.

use crate::protocol::Resources;
use std::collections::{HashMap, HashSet};
use std::path::Path;

/// Processes of one script's tree read from /proc, at most: a script's tasks
/// are bounded (tasks_max), and a pass over more is no longer one script's.
pub const MAX_TREE: usize = 4096;

fn read(p: &Path) -> Option<String> {
    std::fs::read_to_string(p).ok()
}

fn number(p: &Path) -> Option<u64> {
    read(p)?.trim().parse().ok()
}

/// The value of `key` in a flat-keyed file (`usage_usec 1500`).
fn key_value(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let mut it = l.split_whitespace();
        (it.next()? == key).then(|| it.next()?.parse().ok())?
    })
}

/// The cgroups of a process, from `/proc/PID/cgroup`: the v2 path (`0::PATH`)
/// and the v1 hierarchies as (controllers, path).
fn cgroups(text: &str) -> (Option<&str>, Vec<(&str, &str)>) {
    let (mut v2, mut v1) = (None, Vec::new());
    for l in text.lines() {
        let mut it = l.splitn(3, ':');
        let (Some(id), Some(ctl), Some(path)) = (it.next(), it.next(), it.next()) else {
            continue;
        };
        if id == "0" && ctl.is_empty() {
            v2 = Some(path);
        } else if !ctl.is_empty() {
            v1.push((ctl, path));
        }
    }
    (v2, v1)
}

/// A script's resources from the cgroups its process `pid` is in, under `fs`
/// (normally /sys/fs/cgroup): the cgroup v2 files first (at `fs/PATH`, or
/// `fs/unified/PATH` on a hybrid host), then the v1 memory, pids and cpuacct
/// controllers. What neither has is None.
pub fn from_cgroup(fs: &Path, proc: &Path, pid: u32) -> Resources {
    let mut r = Resources {
        source: "cgroup".into(),
        ..Resources::default()
    };
    let Some(text) = read(&proc.join(pid.to_string()).join("cgroup")) else {
        return r;
    };
    let (v2, v1) = cgroups(&text);
    if let Some(path) = v2 {
        let rel = path.trim_start_matches('/');
        for dir in [fs.join(rel), fs.join("unified").join(rel)] {
            r.memory_bytes = r
                .memory_bytes
                .or_else(|| number(&dir.join("memory.current")));
            r.memory_peak_bytes = r
                .memory_peak_bytes
                .or_else(|| number(&dir.join("memory.peak")));
            r.cpu_usec = r
                .cpu_usec
                .or_else(|| key_value(&read(&dir.join("cpu.stat"))?, "usage_usec"));
            r.tasks = r.tasks.or_else(|| number(&dir.join("pids.current")));
        }
    }
    for (ctl, path) in v1 {
        let dir = fs.join(ctl).join(path.trim_start_matches('/'));
        let has = |c: &str| ctl.split(',').any(|x| x == c);
        if has("memory") {
            r.memory_bytes = r
                .memory_bytes
                .or_else(|| number(&dir.join("memory.usage_in_bytes")));
            r.memory_peak_bytes = r
                .memory_peak_bytes
                .or_else(|| number(&dir.join("memory.max_usage_in_bytes")));
        }
        if has("pids") {
            r.tasks = r.tasks.or_else(|| number(&dir.join("pids.current")));
        }
        if has("cpuacct") {
            r.cpu_usec = r
                .cpu_usec
                .or_else(|| number(&dir.join("cpuacct.usage")).map(|ns| ns / 1000));
        }
    }
    r
}

/// One process as /proc shows it.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Proc {
    ppid: u32,
    /// utime + stime + cutime + cstime, in clock ticks: its own time and that
    /// of the children it reaped (gone from the tree, so counted once).
    ticks: u64,
}

/// `/proc/PID/stat`: the fields after the command's closing parenthesis (the
/// command may hold spaces and parentheses itself).
fn parse_stat(text: &str) -> Option<Proc> {
    let rest = &text[text.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // rest[0] is field 3 (state): ppid is field 4, utime..cstime 14..17.
    let num = |i: usize| f.get(i - 3)?.parse::<u64>().ok();
    Some(Proc {
        ppid: num(4)? as u32,
        ticks: num(14)? + num(15)? + num(16)? + num(17)?,
    })
}

/// `/proc/PID/status`: VmRSS and VmHWM in bytes, and Threads.
fn parse_status(text: &str) -> (Option<u64>, Option<u64>, Option<u64>) {
    let kib = |key: &str| {
        text.lines().find_map(|l| {
            let v = l.strip_prefix(key)?.trim().strip_suffix("kB")?;
            v.trim().parse::<u64>().ok().map(|k| k * 1024)
        })
    };
    let threads = text
        .lines()
        .find_map(|l| l.strip_prefix("Threads:")?.trim().parse().ok());
    (kib("VmRSS:"), kib("VmHWM:"), threads)
}

/// The children of `pid`, from `/proc/PID/task/*/children`; None where the
/// kernel has no such file (CONFIG_PROC_CHILDREN).
fn children(proc: &Path, pid: u32) -> Option<Vec<u32>> {
    let tasks = std::fs::read_dir(proc.join(pid.to_string()).join("task")).ok()?;
    let mut out = Vec::new();
    let mut any = false;
    for t in tasks.flatten().take(MAX_TREE) {
        if let Some(text) = read(&t.path().join("children")) {
            any = true;
            out.extend(
                text.split_whitespace()
                    .filter_map(|p| p.parse::<u32>().ok()),
            );
        }
    }
    any.then_some(out)
}

/// Every process's parent, by a pass over /proc (where there are no
/// `children` files).
fn parents(proc: &Path) -> HashMap<u32, Vec<u32>> {
    let mut by_parent: HashMap<u32, Vec<u32>> = HashMap::new();
    let Ok(dir) = std::fs::read_dir(proc) else {
        return by_parent;
    };
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        if let Some(p) = read(&e.path().join("stat")).as_deref().and_then(parse_stat) {
            by_parent.entry(p.ppid).or_default().push(pid);
        }
    }
    by_parent
}

/// The processes of the tree under `root` (itself included), at most [`MAX_TREE`].
fn tree(proc: &Path, root: u32) -> Vec<u32> {
    let mut scan: Option<HashMap<u32, Vec<u32>>> = None;
    let (mut seen, mut todo, mut out) = (HashSet::new(), vec![root], Vec::new());
    while let Some(pid) = todo.pop() {
        if out.len() >= MAX_TREE || !seen.insert(pid) {
            continue;
        }
        if !proc.join(pid.to_string()).is_dir() {
            continue;
        }
        out.push(pid);
        let kids = match children(proc, pid) {
            Some(k) => k,
            None => scan
                .get_or_insert_with(|| parents(proc))
                .get(&pid)
                .cloned()
                .unwrap_or_default(),
        };
        todo.extend(kids);
    }
    out
}

/// A script's resources summed over the process tree under `pid` (its
/// sandbox): resident memory, CPU time (`ticks_per_s`, the kernel's USER_HZ)
/// and threads; the peak is the largest VmHWM of one process (the tree's own
/// peak is not kept anywhere), None when no process says it.
pub fn from_proc(proc: &Path, pid: u32, ticks_per_s: u64) -> Resources {
    let mut r = Resources {
        source: "proc".into(),
        ..Resources::default()
    };
    for p in tree(proc, pid) {
        let dir = proc.join(p.to_string());
        let (Some(stat), Some(status)) = (read(&dir.join("stat")), read(&dir.join("status")))
        else {
            continue; // gone meanwhile
        };
        if let Some(s) = parse_stat(&stat) {
            let usec = s.ticks.saturating_mul(1_000_000) / ticks_per_s.max(1);
            r.cpu_usec = Some(r.cpu_usec.unwrap_or(0) + usec);
        }
        let (rss, hwm, threads) = parse_status(&status);
        if let Some(rss) = rss {
            r.memory_bytes = Some(r.memory_bytes.unwrap_or(0) + rss);
        }
        if let Some(h) = hwm {
            r.memory_peak_bytes = Some(r.memory_peak_bytes.unwrap_or(0).max(h));
        }
        if let Some(t) = threads {
            r.tasks = Some(r.tasks.unwrap_or(0) + t);
        }
    }
    r
}

/// The kernel's clock ticks per second (USER_HZ) for /proc's times.
pub fn ticks_per_s() -> u64 {
    nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .filter(|t| *t > 0)
        .map(|t| t as u64)
        .unwrap_or(100)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(p: &Path, text: &str) {
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }

    #[test]
    fn a_v2_cgroup_gives_all_four_and_a_missing_peak_is_none() {
        let d = tempfile::tempdir().unwrap();
        let (fs, proc) = (d.path().join("cg"), d.path().join("proc"));
        write(
            &proc.join("42/cgroup"),
            "0::/scriptgate.slice/scriptgate-ab.scope\n",
        );
        let cg = fs.join("scriptgate.slice/scriptgate-ab.scope");
        write(&cg.join("memory.current"), "14680064\n");
        write(&cg.join("memory.peak"), "20971520\n");
        write(
            &cg.join("cpu.stat"),
            "usage_usec 120000\nuser_usec 100000\nsystem_usec 20000\n",
        );
        write(&cg.join("pids.current"), "3\n");
        assert_eq!(
            from_cgroup(&fs, &proc, 42),
            Resources {
                source: "cgroup".into(),
                memory_bytes: Some(14680064),
                memory_peak_bytes: Some(20971520),
                cpu_usec: Some(120000),
                tasks: Some(3),
            }
        );
        // An older kernel: no memory.peak. Unknown, not 0.
        std::fs::remove_file(cg.join("memory.peak")).unwrap();
        let r = from_cgroup(&fs, &proc, 42);
        assert_eq!(
            (r.memory_peak_bytes, r.memory_bytes),
            (None, Some(14680064))
        );
        // No such process: all unknown.
        let r = from_cgroup(&fs, &proc, 43);
        assert_eq!(
            (r.memory_bytes, r.cpu_usec, r.tasks, r.source.as_str()),
            (None, None, None, "cgroup")
        );
    }

    #[test]
    fn a_hybrid_host_reads_the_v1_controllers() {
        let d = tempfile::tempdir().unwrap();
        let (fs, proc) = (d.path().join("cg"), d.path().join("proc"));
        write(
            &proc.join("7/cgroup"),
            "12:pids:/scriptgate.slice/s.scope\n4:memory:/scriptgate.slice/s.scope\n\
             2:cpu,cpuacct:/scriptgate.slice/s.scope\n1:name=systemd:/scriptgate.slice/s.scope\n\
             0::/scriptgate.slice/s.scope\n",
        );
        // The v2 tree has the cgroup but no controllers' files.
        std::fs::create_dir_all(fs.join("unified/scriptgate.slice/s.scope")).unwrap();
        write(
            &fs.join("memory/scriptgate.slice/s.scope/memory.usage_in_bytes"),
            "4096\n",
        );
        write(
            &fs.join("memory/scriptgate.slice/s.scope/memory.max_usage_in_bytes"),
            "8192\n",
        );
        write(
            &fs.join("pids/scriptgate.slice/s.scope/pids.current"),
            "5\n",
        );
        write(
            &fs.join("cpu,cpuacct/scriptgate.slice/s.scope/cpuacct.usage"),
            "2500000\n",
        );
        assert_eq!(
            from_cgroup(&fs, &proc, 7),
            Resources {
                source: "cgroup".into(),
                memory_bytes: Some(4096),
                memory_peak_bytes: Some(8192),
                cpu_usec: Some(2500),
                tasks: Some(5),
            }
        );
    }

    fn stat(pid: u32, comm: &str, ppid: u32, ticks: [u64; 4]) -> String {
        let [u, s, cu, cs] = ticks;
        format!("{pid} ({comm}) S {ppid} 1 1 0 -1 4194560 100 0 0 0 {u} {s} {cu} {cs} 20 0 1 0 100 1000 200\n")
    }

    fn status(rss_kb: u64, hwm_kb: u64, threads: u64) -> String {
        format!(
            "Name:\tpython3\nVmHWM:\t  {hwm_kb} kB\nVmRSS:\t  {rss_kb} kB\nThreads:\t{threads}\n"
        )
    }

    #[test]
    fn the_rlimit_backend_sums_the_process_tree() {
        let d = tempfile::tempdir().unwrap();
        let proc = d.path();
        // 10 (bwrap) -> 11 (init) -> 12 (python, 2 threads) ; 20 elsewhere.
        let procs = [
            (10, "bwrap", 1, [1, 1, 0, 0], (1000, 1000, 1)),
            (11, "scriptgated init", 10, [0, 1, 0, 0], (500, 600, 1)),
            (12, "python3 (x) y", 11, [50, 10, 30, 9], (9000, 12000, 2)),
            (20, "other", 1, [999, 999, 0, 0], (99999, 99999, 9)),
        ];
        for (pid, comm, ppid, ticks, (rss, hwm, th)) in procs {
            write(
                &proc.join(format!("{pid}/stat")),
                &stat(pid, comm, ppid, ticks),
            );
            write(&proc.join(format!("{pid}/status")), &status(rss, hwm, th));
        }
        // No `children` files: the parents are found by a pass over /proc.
        let want = Resources {
            source: "proc".into(),
            memory_bytes: Some((1000 + 500 + 9000) * 1024),
            memory_peak_bytes: Some(12000 * 1024),
            cpu_usec: Some((2 + 1 + 99) * 10_000),
            tasks: Some(4),
        };
        assert_eq!(from_proc(proc, 10, 100), want);
        // With them, the same (and 20 is no child of 10 either way).
        write(&proc.join("10/task/10/children"), "11 ");
        write(&proc.join("11/task/11/children"), "12 ");
        write(&proc.join("12/task/12/children"), "");
        write(&proc.join("12/task/13/children"), "");
        assert_eq!(from_proc(proc, 10, 100), want);
        // Gone: nothing known.
        let gone = from_proc(proc, 99, 100);
        assert_eq!((gone.memory_bytes, gone.tasks), (None, None));
        assert_eq!(
            parse_stat("5 (a) b) R 4 0 0 0 0 0 0 0 0 0 1 2 3 4 0").map(|p| p.ppid),
            Some(4)
        );
    }
}
