//! Exit statuses of `scriptgate` (documented in scriptgate(1)) and `Failure`, the
//! one error type of every subcommand: a message for stderr and the status it
//! exits with.

use crate::protocol::{code, RpcError, Status};

pub const OK: u8 = 0;
pub const ERROR: u8 = 1;
pub const USAGE: u8 = 2;
pub const TIMEOUT: u8 = 3;
pub const CANCELLED: u8 = 4;
pub const OOM: u8 = 5;
pub const LIMIT: u8 = 6;
pub const INTERRUPTED: u8 = 7;
pub const APPROVAL_DENIED: u8 = 8;
pub const REFUSED: u8 = 9;
pub const SETUP: u8 = 10;
/// Admin commands: the daemon does not answer on its socket.
pub const DAEMON_DOWN: u8 = 11;
/// Admin commands: not root, not in auth.admin_groups (or not allowed to connect).
pub const NOT_PERMITTED: u8 = 12;
/// Admin commands: no such script.
pub const NOT_FOUND: u8 = 13;
/// `scriptgate status`: scripts run, but not as configured (limits not in
/// force, or shared by the scripts of one uid).
pub const DEGRADED: u8 = 14;
/// `scriptgate status`: no script can run (the sandbox cannot be made, or
/// limits that `sandbox.require_enforced_limits` requires are not in force).
pub const UNAVAILABLE: u8 = 15;

/// The exit status of `scriptgate run` for a script that ended this way.
pub fn for_status(status: Status) -> u8 {
    match status {
        Status::Ok => OK,
        Status::Error | Status::Running => ERROR,
        Status::Timeout => TIMEOUT,
        Status::Cancelled => CANCELLED,
        Status::Oom => OOM,
        Status::Limit => LIMIT,
        Status::Interrupted => INTERRUPTED,
    }
}

/// A command that failed: one line for stderr and a distinct exit status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub code: u8,
    pub message: String,
}

impl Failure {
    pub fn new(code: u8, message: impl Into<String>) -> Self {
        Failure {
            code,
            message: message.into(),
        }
    }
    pub fn usage(m: impl Into<String>) -> Self {
        Self::new(USAGE, m)
    }
    pub fn setup(m: impl Into<String>) -> Self {
        Self::new(SETUP, m)
    }
    /// `script.start` refused: approval denied (8) or anything else (9).
    pub fn refused(e: &RpcError) -> Self {
        let status = if e.code == code::APPROVAL {
            APPROVAL_DENIED
        } else {
            REFUSED
        };
        let detail = e.data.as_ref().map(|d| format!(" {d}")).unwrap_or_default();
        Self::new(
            status,
            format!("script refused: {} ({}){detail}", e.message, e.code),
        )
    }
    /// An admin method's error from the daemon.
    pub fn admin(e: &RpcError) -> Self {
        match e.code {
            code::PEER_NOT_ALLOWED | code::NOT_ADMIN => {
                Self::new(NOT_PERMITTED, format!("permission denied: {}", e.message))
            }
            code::NOT_FOUND => Self::new(NOT_FOUND, e.message.clone()),
            c => Self::new(ERROR, format!("{} ({c})", e.message)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_map_to_distinct_exits() {
        let all = Status::FINAL;
        let codes: std::collections::HashSet<u8> = all.into_iter().map(for_status).collect();
        assert_eq!(codes.len(), all.len());
        assert_eq!(for_status(Status::Running), ERROR);
    }

    #[test]
    fn refusals_and_admin_errors() {
        let e = RpcError::new(code::APPROVAL, "denied");
        assert_eq!(Failure::refused(&e).code, APPROVAL_DENIED);
        let e = RpcError::new(code::BUSY, "busy");
        assert_eq!(Failure::refused(&e).code, REFUSED);
        assert_eq!(Failure::admin(&RpcError::not_admin()).code, NOT_PERMITTED);
        assert_eq!(Failure::admin(&RpcError::not_found("x")).code, NOT_FOUND);
        assert_eq!(
            Failure::admin(&RpcError::internal("boom")).message,
            "boom (-32603)"
        );
    }
}
