//! The bound on all scripts together (`scripts.total_*`): memory, tasks and
//! CPU of every running script at once, on `scriptgate.slice` (systemd
//! backend) or on the `scripts` node of the daemon's delegated subtree (cgroup
//! backend), neither of which holds the daemon itself. What a key left out
//! means is decided here, from the host (pure: the host's facts are passed in).

use crate::config::Scripts;
use crate::protocol::AllScripts;
use std::path::Path;

/// Memory of all scripts together when `total_memory_max_bytes` is left out:
/// this share of the host's `MemTotal`, so that the daemon, the system and the
/// page cache keep a quarter whatever `max_running` × `memory_max_bytes` is.
pub const MEMORY_SHARE_PERCENT: u64 = 75;
/// Tasks of all scripts together when `total_tasks_max` is left out: 16 scripts
/// at the default `tasks_max` of 256; far below the kernel's `pid_max`.
pub const TASKS_DEFAULT: u64 = 4096;
/// CPU of all scripts together when `total_cpu_quota_percent` is left out:
/// this share of every CPU of the host (2 CPUs: 150, in percent of one CPU).
pub const CPU_SHARE_PERCENT: u32 = 75;

/// What the defaults are derived from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Host {
    /// `MemTotal` of /proc/meminfo; None: unreadable.
    pub mem_total_bytes: Option<u64>,
    /// CPUs this process may run on.
    pub cpus: u32,
}

impl Host {
    pub fn read() -> Host {
        Host {
            mem_total_bytes: std::fs::read_to_string("/proc/meminfo")
                .ok()
                .and_then(|t| mem_total(&t)),
            cpus: std::thread::available_parallelism()
                .map(|n| n.get() as u32)
                .unwrap_or(1),
        }
    }
}

/// `MemTotal:  2030000 kB` of /proc/meminfo, in bytes.
pub fn mem_total(meminfo: &str) -> Option<u64> {
    meminfo.lines().find_map(|l| {
        let rest = l.strip_prefix("MemTotal:")?;
        let mut it = rest.split_whitespace();
        let n: u64 = it.next()?.parse().ok()?;
        match it.next() {
            Some("kB") => n.checked_mul(1024),
            None => Some(n),
            Some(_) => None,
        }
    })
}

/// The bound on all scripts together that `s` asks for on `host`: each key as
/// configured, or its default; 0 is no bound. `derived` says which defaults
/// were used and what from; `notes` what is odd about the result.
pub fn decide(s: &Scripts, host: &Host) -> AllScripts {
    let mut a = AllScripts::default();
    a.memory_max_bytes = match s.total_memory_max_bytes {
        Some(n) => n,
        None => match host.mem_total_bytes {
            Some(total) => {
                let n = (u128::from(total) * u128::from(MEMORY_SHARE_PERCENT) / 100) as u64;
                a.derived.push(format!(
                    "total_memory_max_bytes: {MEMORY_SHARE_PERCENT}% of the host's {} MiB",
                    total >> 20
                ));
                n - n % 4096
            }
            None => {
                a.notes.push(
                    "total_memory_max_bytes: no bound (left out, and /proc/meminfo has no MemTotal to derive it from)"
                        .into(),
                );
                0
            }
        },
    };
    a.tasks_max = match s.total_tasks_max {
        Some(n) => n,
        None => {
            a.derived
                .push(format!("total_tasks_max: the default {TASKS_DEFAULT}"));
            TASKS_DEFAULT
        }
    };
    a.cpu_quota_percent = match s.total_cpu_quota_percent {
        Some(n) => n,
        None => {
            let cpus = host.cpus.max(1);
            a.derived.push(format!(
                "total_cpu_quota_percent: {CPU_SHARE_PERCENT}% of the host's {cpus} CPU{}",
                if cpus == 1 { "" } else { "s" }
            ));
            CPU_SHARE_PERCENT.saturating_mul(cpus)
        }
    };
    // A configured total below one script's bound is refused by the
    // configuration's check; a derived one is said.
    for (total, key, one, one_key) in [
        (
            a.memory_max_bytes,
            "total_memory_max_bytes",
            s.memory_max_bytes,
            "memory_max_bytes",
        ),
        (a.tasks_max, "total_tasks_max", s.tasks_max, "tasks_max"),
        (
            u64::from(a.cpu_quota_percent),
            "total_cpu_quota_percent",
            u64::from(s.cpu_quota_percent),
            "cpu_quota_percent",
        ),
    ] {
        if total > 0 && one > 0 && total < one {
            a.notes.push(format!(
                "{key} = {total} (derived from this host) is below {one_key} = {one}: no script can reach its own bound; set {key} in scriptgate.toml, or lower {one_key}"
            ));
        }
    }
    a
}

/// A limit file's value: a number, or None for `max`.
fn limit(text: &str) -> Option<u64> {
    text.split_whitespace().next()?.parse().ok()
}

/// Where the cgroup holding all scripts is: `fs` (normally /sys/fs/cgroup)
/// and its path below it. On cgroup v2 its files are in `fs/rel`; on a hybrid
/// host (v1 memory, pids and cpu controllers beside an empty v2 tree) systemd
/// puts the slice's bound in the v1 hierarchies, where it is read back.
#[derive(Debug, Clone)]
pub struct Place {
    pub fs: std::path::PathBuf,
    pub rel: String,
}

impl Place {
    pub fn dir(&self) -> std::path::PathBuf {
        match self.rel.as_str() {
            "" => self.fs.clone(),
            rel => self.fs.join(rel),
        }
    }
}

/// The file that holds `controller`'s bound for `place`, and what it is: the
/// v2 file where the v2 directory has the controller enabled, else the v1
/// hierarchy's, else why there is none.
fn bound_file(
    place: &Place,
    controllers: &str,
    controller: &str,
) -> Result<(std::path::PathBuf, bool), String> {
    let dir = place.dir();
    if controllers.split_whitespace().any(|x| x == controller) {
        let f = match controller {
            "memory" => "memory.max",
            "pids" => "pids.max",
            _ => "cpu.max",
        };
        return Ok((dir.join(f), true));
    }
    let v1 = match controller {
        "memory" => vec![("memory", "memory.limit_in_bytes")],
        "pids" => vec![("pids", "pids.max")],
        _ => vec![
            ("cpu,cpuacct", "cpu.cfs_quota_us"),
            ("cpu", "cpu.cfs_quota_us"),
        ],
    };
    for (h, f) in v1 {
        let p = place.fs.join(h).join(&place.rel).join(f);
        if p.exists() {
            return Ok((p, false));
        }
    }
    Err(format!(
        "the {controller} controller is not enabled for {} (its cgroup.controllers: {:?}), nor is there a v1 {controller} cgroup for it",
        dir.display(),
        controllers.trim()
    ))
}

/// What the cgroup at `place` holding all scripts says of `a` (its
/// `in_force`, `problem`, and what all scripts hold now). `place` None: the
/// backend has no such cgroup (rlimit).
pub fn read_back(a: &mut AllScripts, place: Option<&Place>) {
    let Some(place) = place else {
        a.in_force = false;
        a.problem = Some(
            "the rlimit backend has no cgroup for all scripts: nothing bounds them together".into(),
        );
        return;
    };
    let dir = place.dir();
    a.cgroup = Some(dir.display().to_string());
    let read = |p: &Path| std::fs::read_to_string(p);
    // A file that says the bound is no bound where its controller is not
    // enabled (a v2 directory whose parent did not enable it, a tmpfs posing as
    // cgroupfs) says nothing: the controller must be in the directory's own list.
    let controllers = read(&dir.join("cgroup.controllers")).unwrap_or_default();
    let mut problems = vec![];
    for (key, want, controller) in [
        ("total_memory_max_bytes", a.memory_max_bytes, "memory"),
        ("total_tasks_max", a.tasks_max, "pids"),
        (
            "total_cpu_quota_percent",
            u64::from(a.cpu_quota_percent),
            "cpu",
        ),
    ] {
        if want == 0 {
            continue;
        }
        let (file, v2) = match bound_file(place, &controllers, controller) {
            Ok(f) => f,
            Err(why) => {
                problems.push(format!("{key} = {want} is not in force: {why}"));
                continue;
            }
        };
        let text = match read(&file) {
            Ok(t) => t,
            Err(e) => {
                problems.push(format!(
                    "{key} = {want} cannot be read back: {}: {e}",
                    file.display()
                ));
                continue;
            }
        };
        let held = match (controller, v2) {
            ("cpu", true) => {
                let mut it = text.split_whitespace();
                let q = it.next().and_then(|q| q.parse::<u64>().ok());
                let p = it.next().and_then(|p| p.parse::<u64>().ok());
                matches!((q, p), (Some(q), Some(p)) if p > 0 && q * 100 <= p * want + p)
            }
            ("cpu", false) => {
                let q = text.trim().parse::<i64>().ok();
                let p = read(&file.with_file_name("cpu.cfs_period_us"))
                    .ok()
                    .and_then(|t| t.trim().parse::<u64>().ok());
                matches!((q, p), (Some(q), Some(p)) if q > 0 && p > 0 && (q as u64) * 100 <= p * want + p)
            }
            _ => limit(&text).is_some_and(|n| n <= want),
        };
        if !held {
            problems.push(format!(
                "{key} = {want} is not in force: {} says {:?}",
                file.display(),
                text.trim()
            ));
        }
    }
    let number = |f: &str| read(&dir.join(f)).ok().and_then(|t| limit(&t));
    a.memory_current_bytes = number("memory.current").or_else(|| {
        read(
            &place
                .fs
                .join("memory")
                .join(&place.rel)
                .join("memory.usage_in_bytes"),
        )
        .ok()
        .and_then(|t| limit(&t))
    });
    a.tasks_current = number("pids.current").or_else(|| {
        read(&place.fs.join("pids").join(&place.rel).join("pids.current"))
            .ok()
            .and_then(|t| limit(&t))
    });
    a.in_force = problems.is_empty();
    a.problem = (!problems.is_empty()).then(|| problems.join("; "));
}

/// One line on the bound, for `status` and `--check-config`.
pub fn summary(a: &AllScripts) -> String {
    if let (None, Some(p)) = (&a.cgroup, &a.problem) {
        return format!("none: {p}");
    }
    let part = |n: u64, what: &str| {
        if n == 0 {
            format!("no {what} bound")
        } else {
            match what {
                "memory" => format!("memory {} MiB", n >> 20),
                "tasks" => format!("{n} tasks"),
                _ => format!("CPU {n}%"),
            }
        }
    };
    let mut s = format!(
        "{}, {}, {} together",
        part(a.memory_max_bytes, "memory"),
        part(a.tasks_max, "tasks"),
        part(u64::from(a.cpu_quota_percent), "CPU")
    );
    if !a.derived.is_empty() {
        s.push_str(&format!(" (derived: {})", a.derived.join(", ")));
    }
    if let Some(cg) = &a.cgroup {
        s.push_str(&format!(" in {cg}"));
    }
    match (&a.problem, a.cgroup.is_some()) {
        (Some(p), _) => s.push_str(&format!(": NOT in force, {p}")),
        (None, true) => {
            s.push_str(": in force");
            let now: Vec<String> = [
                a.memory_current_bytes.map(|m| format!("{} MiB", m >> 20)),
                a.tasks_current.map(|t| format!("{t} tasks")),
            ]
            .into_iter()
            .flatten()
            .collect();
            if !now.is_empty() {
                s.push_str(&format!("; now {}", now.join(", ")));
            }
        }
        (None, false) => {}
    }
    for n in &a.notes {
        s.push_str(&format!("; note: {n}"));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn host(mem: Option<u64>, cpus: u32) -> Host {
        Host {
            mem_total_bytes: mem,
            cpus,
        }
    }

    #[test]
    fn mem_total_is_read_in_bytes() {
        let t = "MemTotal:        2030112 kB\nMemFree:          100 kB\n";
        assert_eq!(mem_total(t), Some(2030112 * 1024));
        assert_eq!(mem_total("MemFree: 1 kB\n"), None);
        assert_eq!(mem_total("MemTotal: x kB\n"), None);
        assert_eq!(mem_total("MemTotal: 5 MB\n"), None);
    }

    /// The host: 3 GiB, 64 × 1 GiB allowed one by one; all together
    /// get three quarters of it, and of its CPUs, and 4096 tasks.
    #[test]
    fn left_out_keys_are_derived_from_the_host() {
        let a = decide(&Scripts::default(), &host(Some(3 * GIB), 2));
        assert_eq!(a.memory_max_bytes, 2304 << 20);
        assert!(a.memory_max_bytes > 2 * GIB && a.memory_max_bytes < 3 * GIB);
        assert_eq!(a.tasks_max, 4096);
        assert_eq!(a.cpu_quota_percent, 150);
        assert_eq!(
            a.derived,
            [
                "total_memory_max_bytes: 75% of the host's 3072 MiB",
                "total_tasks_max: the default 4096",
                "total_cpu_quota_percent: 75% of the host's 2 CPUs"
            ]
        );
        assert!(a.notes.is_empty(), "{:?}", a.notes);
    }

    #[test]
    fn configured_keys_win_and_zero_is_no_bound() {
        let s = Scripts {
            total_memory_max_bytes: Some(0),
            total_tasks_max: Some(300),
            total_cpu_quota_percent: Some(0),
            ..Scripts::default()
        };
        let a = decide(&s, &host(None, 8));
        assert_eq!(
            (a.memory_max_bytes, a.tasks_max, a.cpu_quota_percent),
            (0, 300, 0)
        );
        assert!(a.derived.is_empty() && a.notes.is_empty(), "{a:?}");
        assert_eq!(
            summary(&a),
            "no memory bound, 300 tasks, no CPU bound together"
        );
    }

    /// A small host: the derived totals are below one script's bound, and
    /// said; no MemTotal: no memory bound, said.
    #[test]
    fn a_derived_total_below_one_script_is_said() {
        let a = decide(&Scripts::default(), &host(Some(GIB), 1));
        assert_eq!(a.cpu_quota_percent, 75);
        assert_eq!(a.notes.len(), 2, "{:?}", a.notes);
        assert!(a.notes[0].starts_with("total_memory_max_bytes = "));
        assert!(a.notes[0].contains("is below memory_max_bytes = 1073741824"));
        assert!(a.notes[1]
            .starts_with("total_cpu_quota_percent = 75 (derived from this host) is below cpu_quota_percent = 100"));
        let a = decide(&Scripts::default(), &host(None, 4));
        assert_eq!(a.memory_max_bytes, 0);
        assert!(a.notes[0].contains("no MemTotal"), "{:?}", a.notes);
    }

    /// A hybrid host: systemd puts the slice's bound in the v1 hierarchies.
    #[test]
    fn read_back_on_a_hybrid_host_reads_the_v1_hierarchies() {
        let d = tempfile::tempdir().unwrap();
        let put = |dir: &str, f: &str, v: &str| {
            let p = d.path().join(dir).join("scriptgate.slice");
            std::fs::create_dir_all(&p).unwrap();
            std::fs::write(p.join(f), v).unwrap();
        };
        put("unified", "cgroup.controllers", "");
        put("memory", "memory.limit_in_bytes", "536870912\n");
        put("memory", "memory.usage_in_bytes", "4096\n");
        put("pids", "pids.max", "24\n");
        put("pids", "pids.current", "3\n");
        put("cpu,cpuacct", "cpu.cfs_quota_us", "150000\n");
        put("cpu,cpuacct", "cpu.cfs_period_us", "100000\n");
        let place = Place {
            fs: d.path().to_path_buf(),
            rel: "scriptgate.slice".into(),
        };
        let mut a = AllScripts {
            memory_max_bytes: 512 << 20,
            tasks_max: 24,
            cpu_quota_percent: 150,
            ..AllScripts::default()
        };
        read_back(&mut a, Some(&place));
        assert!(a.in_force, "{a:?}");
        assert_eq!(
            (a.memory_current_bytes, a.tasks_current),
            (Some(4096), Some(3))
        );
        put("cpu,cpuacct", "cpu.cfs_quota_us", "-1\n");
        read_back(&mut a, Some(&place));
        assert!(!a.in_force);
        assert!(
            a.problem.unwrap().ends_with("cpu.cfs_quota_us says \"-1\""),
            "v1's no quota"
        );
    }

    #[test]
    fn read_back_says_what_is_in_force_and_what_all_scripts_hold() {
        let d = tempfile::tempdir().unwrap();
        let w = |f: &str, v: &str| std::fs::write(d.path().join(f), v).unwrap();
        w("cgroup.controllers", "cpu memory pids\n");
        w("memory.max", "536870912\n");
        w("pids.max", "24\n");
        w("cpu.max", "150000 100000\n");
        w("memory.current", "10485760\n");
        w("pids.current", "7\n");
        let mut a = AllScripts {
            memory_max_bytes: 512 << 20,
            tasks_max: 24,
            cpu_quota_percent: 150,
            ..AllScripts::default()
        };
        let place = Place {
            fs: d.path().to_path_buf(),
            rel: String::new(),
        };
        read_back(&mut a, Some(&place));
        assert!(a.in_force, "{a:?}");
        assert_eq!(
            (a.memory_current_bytes, a.tasks_current),
            (Some(10 << 20), Some(7))
        );
        assert_eq!(
            summary(&a),
            format!(
                "memory 512 MiB, 24 tasks, CPU 150% together in {}: in force; now 10 MiB, 7 tasks",
                d.path().display()
            )
        );
        // Looser than asked, or "max" where a bound is asked: not in force.
        w("pids.max", "max\n");
        w("cpu.max", "max 100000\n");
        read_back(&mut a, Some(&place));
        assert!(!a.in_force);
        let p = a.problem.clone().unwrap();
        assert!(
            p.starts_with("total_tasks_max = 24 is not in force: "),
            "{p}"
        );
        assert!(p.contains("pids.max says \"max\""), "{p}");
        assert!(
            p.contains("total_cpu_quota_percent = 150 is not in force"),
            "{p}"
        );
        assert!(
            summary(&a).contains(": NOT in force, total_tasks_max"),
            "{}",
            summary(&a)
        );
        // A controller not enabled there: its files say nothing.
        w("pids.max", "24\n");
        w("cpu.max", "150000 100000\n");
        w("cgroup.controllers", "memory\n");
        read_back(&mut a, Some(&place));
        assert_eq!(
            a.problem.clone().unwrap(),
            format!(
                "total_tasks_max = 24 is not in force: the pids controller is not enabled for {0} \
                 (its cgroup.controllers: \"memory\"), nor is there a v1 pids cgroup for it; \
                 total_cpu_quota_percent = 150 is not in force: the cpu controller is not enabled \
                 for {0} (its cgroup.controllers: \"memory\"), nor is there a v1 cpu cgroup for it",
                d.path().display()
            )
        );
        w("cgroup.controllers", "cpu memory pids\n");
        // No bound asked: "max" is right.
        let mut none = AllScripts {
            memory_max_bytes: 0,
            tasks_max: 0,
            cpu_quota_percent: 0,
            ..AllScripts::default()
        };
        w("memory.max", "max\n");
        read_back(&mut none, Some(&place));
        assert!(none.in_force && none.problem.is_none(), "{none:?}");
        // No cgroup at all: rlimit.
        read_back(&mut none, None);
        assert!(!none.in_force);
        assert!(none
            .problem
            .unwrap()
            .contains("nothing bounds them together"));
        // A missing file names itself.
        let mut gone = a.clone();
        let nope = Place {
            fs: d.path().to_path_buf(),
            rel: "nope".into(),
        };
        read_back(&mut gone, Some(&nope));
        assert!(
            gone.problem
                .unwrap()
                .contains("nor is there a v1 memory cgroup for it"),
            "gone"
        );
    }
}
