//! The descriptor ABI between the daemon's spawn, bwrap and the sandbox init:
//! which fixed number carries what. Shared by `sandbox` (bwrap's argv), `init`
//! and the runner (`script`), and below all of them.

/// The fixed descriptors the sandbox child gets. 3 and 4 are the tool channel
/// (protocol §8) and reach the script; 5, 8, 9, 10 and 11 are read by bwrap itself
/// (9 and 11 are the workspace and `.agent`, opened once by the daemon and bound
/// by descriptor, never by path; 10 is the script, which bwrap copies in; bwrap
/// closes them); 6 is the placement
/// gate, closed before bwrap runs; 7 is the init's usage report, which the init
/// keeps from the script. FD_AGENT is the highest; `sys` places fixed descriptors
/// at most at `sys::HIGHEST_FIXED_FD`, which the assertion below holds to it.
pub const FD_REQUESTS: i32 = 3;
pub const FD_REPLIES: i32 = 4;
pub const FD_INFO: i32 = 5;
pub const FD_GATE: i32 = 6;
pub const FD_USAGE: i32 = 7;
pub const FD_SECCOMP: i32 = 8;
pub const FD_WORKSPACE: i32 = 9;
pub const FD_SCRIPT: i32 = 10;
pub const FD_AGENT: i32 = 11;

// The spawn (`sys`) raises every source descriptor above its highest fixed
// number: this ABI must stay within it.
const _: () = assert!(FD_AGENT == crate::sys::HIGHEST_FIXED_FD);
