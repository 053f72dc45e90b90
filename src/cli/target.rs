//! Which daemon `scriptgate run` uses. Never a silent fallback: where a system
//! daemon is installed, its socket is used, and if it refuses or fails the run
//! fails with the reason; the embedded daemon is used only when asked for
//! (`--embedded`) or when no system daemon is installed at all.

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
}
