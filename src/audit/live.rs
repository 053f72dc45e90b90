//! Whether a row left `running` in a store is still a live script's: the store
//! of the CLI's embedded daemon (`scriptgate run`, `scriptgate mcp`) is shared
//! by every such process of one user, so one of them opening it must not take
//! another's running scripts for a dead daemon's, and `scriptgate ps` and
//! `cancel` must tell a running script from one whose process is gone. An
//! embedded daemon is its own engine: the row's `peer_pid` is the process that
//! holds the daemon, and that process holds the store open while it lives.
//! Read-only, from /proc (passed in).

use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// Descriptors of one process looked at, at most: an embedded daemon holds a
/// few dozen (its MCP servers' pipes, its scripts' pipes, its connections).
pub const MAX_FDS: usize = 65_536;

/// How far the kernel's start time of a process may lie after the row's
/// `started_at` and still be the process that recorded it: /proc gives the
/// boot time in whole seconds.
const START_SLACK_MS: i64 = 1_000;

/// The process `pid` holds the store `db` open now, and started before
/// `started_ms` (the row's start, so it is not a later process that reused the
/// pid). A process whose descriptors this user may not read (another user's)
/// counts as not holding it.
pub fn held_by(proc: &Path, pid: u32, db: &Path, started_ms: i64) -> bool {
    let Ok(store) = std::fs::metadata(db) else {
        return false;
    };
    match start_ms(proc, pid) {
        Some(t) if t <= started_ms.saturating_add(START_SLACK_MS) => {}
        _ => return false,
    }
    let Ok(fds) = std::fs::read_dir(proc.join(pid.to_string()).join("fd")) else {
        return false;
    };
    fds.flatten().take(MAX_FDS).any(|fd| {
        // The link's target, followed: the open file itself.
        std::fs::metadata(fd.path()).is_ok_and(|m| (m.dev(), m.ino()) == (store.dev(), store.ino()))
    })
}

/// When the process `pid` started, in ms since the epoch: the boot time
/// (`btime` of /proc/stat) plus its start in clock ticks (/proc/PID/stat's
/// 22nd field).
pub fn start_ms(proc: &Path, pid: u32) -> Option<i64> {
    let stat = std::fs::read_to_string(proc.join(pid.to_string()).join("stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: count after
    // its last ')'. Field 3 is the first after it; 22 is the 20th.
    let ticks: i64 = stat
        .rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(19)?
        .parse()
        .ok()?;
    let boot_s: i64 = std::fs::read_to_string(proc.join("stat"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("btime ")?.trim().parse().ok())?;
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .filter(|t| *t > 0)
        .unwrap_or(100);
    Some(boot_s * 1000 + ticks * 1000 / hz)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake /proc: the boot time, and process 42's start (at 150 ticks, 1.5 s
    /// after boot at USER_HZ 100) and descriptors.
    fn fake_proc(fds: &[&Path]) -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("stat"), "cpu 1 2 3\nbtime 1000\n").unwrap();
        let p = d.path().join("42");
        std::fs::create_dir_all(p.join("fd")).unwrap();
        // A command name with a space and a parenthesis, as a process may choose.
        let mut fields = vec!["S".to_string(), "1".into()];
        fields.extend((0..17).map(|i| i.to_string()));
        fields.push("150".into());
        fields.push("0".into());
        std::fs::write(
            p.join("stat"),
            format!("42 (scr ipt) x) {}\n", fields.join(" ")),
        )
        .unwrap();
        for (i, f) in fds.iter().enumerate() {
            std::os::unix::fs::symlink(f, p.join("fd").join(i.to_string())).unwrap();
        }
        d
    }

    #[test]
    fn a_store_is_held_by_a_process_that_has_it_open_and_started_before_the_row() {
        if nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK) != Ok(Some(100)) {
            return; // the fake's ticks assume USER_HZ 100, which Linux has on every arch
        }
        let d = tempfile::tempdir().unwrap();
        let (db, other) = (d.path().join("a.db"), d.path().join("b.db"));
        std::fs::write(&db, "").unwrap();
        std::fs::write(&other, "").unwrap();
        let started = 1_001_500;
        assert_eq!(start_ms(fake_proc(&[]).path(), 42), Some(started));
        let proc = fake_proc(&[&other, &db]);
        assert!(held_by(proc.path(), 42, &db, started));
        assert!(held_by(proc.path(), 42, &db, started - START_SLACK_MS));
        // A process that started after the row reused the pid: not the holder.
        assert!(!held_by(proc.path(), 42, &db, started - START_SLACK_MS - 1));
        // Another store open, or none; no such process.
        assert!(!held_by(fake_proc(&[&other]).path(), 42, &db, started));
        assert!(!held_by(proc.path(), 43, &db, started));
        assert!(!held_by(
            proc.path(),
            42,
            &d.path().join("none.db"),
            started
        ));
    }

    #[test]
    fn this_process_holds_what_it_has_open() {
        let d = tempfile::tempdir().unwrap();
        let db = d.path().join("a.db");
        let f = std::fs::File::create(&db).unwrap();
        let me = std::process::id();
        let now = crate::time::now_ms();
        assert!(held_by(Path::new("/proc"), me, &db, now));
        drop(f);
        assert!(!held_by(Path::new("/proc"), me, &db, now));
    }
}
