//! Which daemon `scriptgate run` uses. Never a silent fallback: where a system
//! daemon is installed, its socket is used, and if it refuses or fails the run
//! fails with the reason; the embedded daemon is used only when asked for
//! (`--embedded`) or when no system daemon is installed at all. Also which
//! audit store the record commands read (`choose_records`), and where a user's
//! embedded daemon keeps its records (`user_state_dir`): a directory of the
//! user's own, never a shared one.

use std::ffi::OsStr;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// The system daemon's socket (scriptgate.socket's `ListenStream=`).
pub const DEFAULT_SOCKET: &str = "/run/scriptgate/scriptgate.sock";

/// Environment variable naming the system daemon's socket instead.
pub const SOCKET_ENV: &str = "SCRIPTGATE_SOCKET";

/// Where systemd looks for units: `scriptgate.socket` in one of them means the
/// system daemon is installed (whether or not it runs now).
pub const UNIT_DIRS: [&str; 4] = [
    "/etc/systemd/system",
    "/run/systemd/system",
    "/usr/lib/systemd/system",
    "/lib/systemd/system",
];

/// The daemon a run goes to, and why (for the one line on stderr).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// In this process: no system audit row, no journal entry.
    Embedded(&'static str),
    /// The daemon at this socket; `system` when it is the system daemon's.
    Socket { path: PathBuf, system: bool },
}

/// What the choice depends on, gathered by `Facts::gather`.
#[derive(Debug, Clone)]
pub struct Facts {
    /// `SCRIPTGATE_SOCKET` or the default path.
    pub system_socket: PathBuf,
    /// Something is at that path (a socket, live or dead).
    pub socket_exists: bool,
    /// `scriptgate.socket` is installed.
    pub unit_installed: bool,
}

/// The system daemon's socket: `SCRIPTGATE_SOCKET`, or the default.
pub fn system_socket() -> PathBuf {
    std::env::var_os(SOCKET_ENV)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| DEFAULT_SOCKET.into())
}

impl Facts {
    pub fn gather() -> Facts {
        let system_socket = system_socket();
        Facts {
            socket_exists: std::fs::symlink_metadata(&system_socket).is_ok(),
            unit_installed: UNIT_DIRS
                .iter()
                .any(|d| Path::new(d).join("scriptgate.socket").exists()),
            system_socket,
        }
    }
}

/// The choice (pure).
pub fn choose(embedded: bool, socket: Option<&Path>, f: &Facts) -> Target {
    if embedded {
        return Target::Embedded("asked for with --embedded");
    }
    if let Some(p) = socket {
        return Target::Socket {
            path: p.to_path_buf(),
            system: false,
        };
    }
    if f.socket_exists || f.unit_installed {
        return Target::Socket {
            path: f.system_socket.clone(),
            system: true,
        };
    }
    Target::Embedded("no system daemon is installed")
}

/// The audit store `scriptgate audit`, `show`, `ps` and `cancel` read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Records {
    /// The system daemon's (`state.dir`, for root and the admin groups).
    System,
    /// The caller's embedded daemon's (`scriptgate run` and `scriptgate mcp` in
    /// their own process), and why.
    Embedded(&'static str),
}

/// The choice (pure): the store of the daemon `scriptgate run` would use
/// (`choose`), except that root reads the system's unless it asks, and a
/// daemon named by `--socket` or `--config` (`named`) is the system's.
pub fn choose_records(embedded: bool, named: bool, root: bool, f: &Facts) -> Records {
    if embedded {
        return Records::Embedded("asked for with --embedded");
    }
    if root || named || f.socket_exists || f.unit_installed {
        return Records::System;
    }
    Records::Embedded("no system daemon is installed")
}

/// What names a user's state directory, in this order (pure).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StateBase {
    /// `$XDG_STATE_HOME/scriptgate`: set and absolute (a relative one is
    /// ignored, as the XDG Base Directory specification says).
    Xdg(PathBuf),
    /// `$HOME/.local/state/scriptgate`: set, not empty, absolute.
    Home(PathBuf),
    /// Neither: the home directory of the user's passwd entry.
    Passwd,
}

pub fn state_base(xdg: Option<&OsStr>, home: Option<&OsStr>) -> StateBase {
    if let Some(x) = absolute(xdg) {
        return StateBase::Xdg(x.join("scriptgate"));
    }
    if let Some(h) = absolute(home) {
        return StateBase::Home(h.join(".local/state/scriptgate"));
    }
    StateBase::Passwd
}

/// A variable's value as a path, when it is an absolute one.
fn absolute(v: Option<&OsStr>) -> Option<&Path> {
    v.map(Path::new).filter(|p| p.is_absolute())
}

/// The state directory of this user's embedded daemon (its audit store, its
/// workspaces): `$XDG_STATE_HOME/scriptgate`, `$HOME/.local/state/scriptgate`,
/// or, with neither, under the home directory of the user's passwd entry,
/// which must be a directory of the user's; never a shared path such as /tmp.
/// Checked by `private_dir` (and made when `create`); an error says why none
/// is usable.
pub fn user_state_dir(create: bool) -> Result<PathBuf, String> {
    let uid = nix::unistd::Uid::effective().as_raw();
    let dir = match state_base(
        std::env::var_os("XDG_STATE_HOME").as_deref(),
        std::env::var_os("HOME").as_deref(),
    ) {
        StateBase::Xdg(d) | StateBase::Home(d) => d,
        StateBase::Passwd => passwd_home(uid)?.join(".local/state/scriptgate"),
    };
    private_dir(&dir, uid, create)
}

/// The home directory in `uid`'s passwd entry, when it is a directory `uid` owns.
fn passwd_home(uid: u32) -> Result<PathBuf, String> {
    let why = "neither HOME nor XDG_STATE_HOME (an absolute path) is set, and";
    let user = nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid))
        .map_err(|e| format!("{why} the passwd entry of uid {uid} cannot be read: {e}"))?
        .ok_or_else(|| {
            format!("{why} uid {uid} has no passwd entry to take a home directory from")
        })?;
    let home = user.dir;
    let whose = format!(
        "the home directory of {} (uid {uid}) in its passwd entry",
        user.name
    );
    if !home.is_absolute() {
        return Err(format!("{why} {whose}, {home:?}, is not an absolute path"));
    }
    let m = std::fs::metadata(&home)
        .map_err(|e| format!("{why} {whose}, {}, cannot be used: {e}", home.display()))?;
    if !m.is_dir() {
        return Err(format!(
            "{why} {whose}, {}, is not a directory",
            home.display()
        ));
    }
    if m.uid() != uid {
        return Err(format!(
            "{why} {whose}, {}, is owned by uid {}, not by uid {uid}",
            home.display(),
            m.uid()
        ));
    }
    Ok(home)
}

/// Why `m`, a directory above the state directory, would let someone other
/// than root and `uid` replace what lies below it: owned by another user, or
/// writable by group or others without the sticky bit (/tmp's entries cannot be
/// moved by others).
fn unsafe_above(m: &std::fs::Metadata, uid: u32) -> Option<String> {
    let mode = m.permissions().mode();
    if !m.is_dir() {
        return Some("is not a directory".into());
    }
    if m.uid() != 0 && m.uid() != uid {
        return Some(format!(
            "is owned by uid {}, neither root nor uid {uid}",
            m.uid()
        ));
    }
    if mode & 0o022 != 0 && mode & 0o1000 == 0 {
        return Some(format!(
            "is writable by group or others (mode {:o}) without the sticky bit",
            mode & 0o7777
        ));
    }
    None
}

/// Why `m`, the state directory itself, is not `uid`'s private directory.
fn unsafe_own(m: &std::fs::Metadata, uid: u32) -> Option<String> {
    let mode = m.permissions().mode();
    if !m.is_dir() {
        return Some("is not a directory".into());
    }
    if m.uid() != uid {
        return Some(format!(
            "is owned by uid {}, not by uid {uid}: it was not made for you, and its records are not yours",
            m.uid()
        ));
    }
    if mode & 0o022 != 0 {
        return Some(format!(
            "is writable by group or others (mode {:o}): anyone who can write it can replace your records (chmod go-w it)",
            mode & 0o7777
        ));
    }
    None
}

/// `dir` as `uid`'s private directory: it is `uid`'s and not writable by group
/// or others, and every directory above it is root's or `uid`'s and not
/// writable by others (unless sticky), so that no one else can have made it or
/// replace it. Symbolic links in the part that exists are resolved first, and
/// the real directories are checked. With `create`, the missing directories
/// are made, mode 0700, and checked once made; without, a `dir` that does not
/// exist yet is returned as it would be. Returns the path, links resolved.
pub fn private_dir(dir: &Path, uid: u32, create: bool) -> Result<PathBuf, String> {
    if !dir.is_absolute() {
        return Err(format!("{} is not an absolute path", dir.display()));
    }
    // Said of the state directory itself, or of one above it.
    let refuse = |p: &Path, own: bool, why: String| {
        if own {
            format!("{} {why}", p.display())
        } else {
            format!("{}, above {}, {why}", p.display(), dir.display())
        }
    };
    // The deepest part that exists, links resolved, and what is missing below it.
    let existing = dir
        .ancestors()
        .find(|a| std::fs::metadata(a).is_ok())
        .unwrap_or(Path::new("/"));
    let real = std::fs::canonicalize(existing)
        .map_err(|e| refuse(existing, existing == dir, e.to_string()))?;
    let missing: Vec<&OsStr> = dir
        .strip_prefix(existing)
        .map_err(|e| e.to_string())?
        .iter()
        .collect();
    for (i, a) in real.ancestors().enumerate() {
        let own = i == 0 && missing.is_empty();
        let m = std::fs::metadata(a).map_err(|e| refuse(a, own, e.to_string()))?;
        let why = match own {
            true => unsafe_own(&m, uid),
            false => unsafe_above(&m, uid),
        };
        if let Some(why) = why {
            return Err(refuse(a, own, why));
        }
    }
    let mut path = real;
    for (i, name) in missing.iter().enumerate() {
        path.push(name);
        if !create {
            continue;
        }
        let own = i + 1 == missing.len();
        match std::fs::DirBuilder::new().mode(0o700).create(&path) {
            Ok(()) => {
                // Exactly 0700, whatever the umask.
                crate::sys::chmod(&path, 0o700).map_err(|e| refuse(&path, own, e.to_string()))?;
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(refuse(&path, own, format!("cannot be made: {e}"))),
        }
        // What is there now (made here, or by the user meanwhile), never followed.
        let m = std::fs::symlink_metadata(&path).map_err(|e| refuse(&path, own, e.to_string()))?;
        let why = match own {
            true => unsafe_own(&m, uid),
            false => unsafe_above(&m, uid),
        };
        if let Some(why) = why {
            return Err(refuse(&path, own, why));
        }
    }
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(socket_exists: bool, unit_installed: bool) -> Facts {
        Facts {
            system_socket: DEFAULT_SOCKET.into(),
            socket_exists,
            unit_installed,
        }
    }

    #[test]
    fn the_system_daemon_is_used_whenever_it_is_installed() {
        let sys = Target::Socket {
            path: DEFAULT_SOCKET.into(),
            system: true,
        };
        // Running, or stopped (RemoveOnStop= removed the socket) but installed.
        assert_eq!(choose(false, None, &facts(true, true)), sys);
        assert_eq!(choose(false, None, &facts(false, true)), sys);
        // A socket without the unit (a daemon started by hand): used too.
        assert_eq!(choose(false, None, &facts(true, false)), sys);
        assert_eq!(
            choose(false, None, &facts(false, false)),
            Target::Embedded("no system daemon is installed")
        );
        assert_eq!(
            choose(true, None, &facts(true, true)),
            Target::Embedded("asked for with --embedded")
        );
        assert_eq!(
            choose(false, Some(Path::new("/x")), &facts(false, true)),
            Target::Socket {
                path: "/x".into(),
                system: false
            }
        );
    }

    #[test]
    fn the_record_commands_read_the_store_run_would_use_but_root_reads_the_systems() {
        let e = |why| Records::Embedded(why);
        let none = facts(false, false);
        assert_eq!(
            choose_records(false, false, false, &none),
            e("no system daemon is installed")
        );
        for installed in [facts(true, false), facts(false, true)] {
            assert_eq!(
                choose_records(false, false, false, &installed),
                Records::System
            );
        }
        assert_eq!(choose_records(false, false, true, &none), Records::System);
        assert_eq!(choose_records(false, true, false, &none), Records::System);
        for (named, root) in [(false, false), (true, true)] {
            assert_eq!(
                choose_records(true, named, root, &facts(true, true)),
                e("asked for with --embedded")
            );
        }
    }

    #[test]
    fn the_state_directory_is_named_by_xdg_state_home_then_home_then_the_passwd_entry() {
        let s = |x: Option<&str>, h: Option<&str>| state_base(x.map(OsStr::new), h.map(OsStr::new));
        assert_eq!(
            s(Some("/x/state"), Some("/home/ann")),
            StateBase::Xdg("/x/state/scriptgate".into())
        );
        // A relative XDG_STATE_HOME is ignored; so are an empty or relative HOME.
        assert_eq!(
            s(Some("state"), Some("/home/ann")),
            StateBase::Home("/home/ann/.local/state/scriptgate".into())
        );
        assert_eq!(s(Some(""), Some("/home/ann")), s(None, Some("/home/ann")));
        for home in [None, Some(""), Some("ann")] {
            assert_eq!(s(None, home), StateBase::Passwd, "{home:?}");
            assert_eq!(s(Some("rel"), home), StateBase::Passwd, "{home:?}");
        }
    }

    fn mode(p: &Path) -> u32 {
        std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777
    }

    fn chmod(p: &Path, m: u32) {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap();
    }

    /// Made 0700 with what is missing above it, checked without being made,
    /// and refused (with the reason) when it or a directory above it can be
    /// written by others, or a link leads to such a one. Owners other than this
    /// process's are tried in tests/it (admin.rs), as root.
    #[test]
    fn a_private_directory_is_made_0700_and_one_others_can_write_is_refused() {
        let me = nix::unistd::Uid::effective().as_raw();
        let t = tempfile::tempdir().unwrap();
        chmod(t.path(), 0o755);
        let home = t.path().join("home");
        std::fs::create_dir(&home).unwrap();
        let dir = home.join(".local/state/scriptgate");
        assert_eq!(private_dir(&dir, me, false), Ok(dir.clone()));
        assert!(!home.join(".local").exists(), "nothing made without create");
        assert_eq!(private_dir(&dir, me, true), Ok(dir.clone()));
        for d in [&dir, &home.join(".local"), &home.join(".local/state")] {
            assert_eq!(mode(d), 0o700, "{}", d.display());
        }
        // Again: it is there, and it is ours.
        assert_eq!(private_dir(&dir, me, true), Ok(dir.clone()));
        chmod(&dir, 0o755);
        assert_eq!(
            private_dir(&dir, me, false),
            Ok(dir.clone()),
            "readable is the owner's choice"
        );

        chmod(&dir, 0o777);
        let e = private_dir(&dir, me, true).unwrap_err();
        assert!(
            e.starts_with(&format!(
                "{} is writable by group or others (mode 777)",
                dir.display()
            )),
            "{e}"
        );
        chmod(&dir, 0o700);
        chmod(&home, 0o775);
        let e = private_dir(&dir, me, false).unwrap_err();
        assert_eq!(
            e,
            format!(
                "{}, above {}, is writable by group or others (mode 775) without the sticky bit",
                home.display(),
                dir.display()
            )
        );
        // Sticky (as /tmp is): others cannot move what is ours in it.
        chmod(&home, 0o1777);
        assert_eq!(private_dir(&dir, me, false), Ok(dir.clone()));
        chmod(&home, 0o755);

        // A link is followed, and where it leads is checked.
        let shared = t.path().join("shared");
        std::fs::create_dir(&shared).unwrap();
        chmod(&shared, 0o777);
        let linked = t.path().join("linked");
        std::os::unix::fs::symlink(&shared, &linked).unwrap();
        let e = private_dir(&linked.join("scriptgate"), me, true).unwrap_err();
        assert!(
            e.starts_with(&format!("{}, above ", shared.display())),
            "{e}"
        );
        assert!(!shared.join("scriptgate").exists());
        // A file or a dangling link where the directory goes.
        let f = t.path().join("file");
        std::fs::write(&f, "").unwrap();
        let e = private_dir(&f, me, true).unwrap_err();
        assert_eq!(e, format!("{} is not a directory", f.display()));
        let dangling = home.join("dangling");
        std::os::unix::fs::symlink(t.path().join("nowhere"), &dangling).unwrap();
        let e = private_dir(&dangling, me, true).unwrap_err();
        assert_eq!(e, format!("{} is not a directory", dangling.display()));
        assert!(private_dir(Path::new("rel/dir"), me, true).is_err());
    }
}
