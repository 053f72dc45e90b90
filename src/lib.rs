//! scriptgate: run model-written Python scripts in a bubblewrap sandbox and broker
//! their tool calls back to the engine under a signed authorization snapshot.
//!
//! Every `unsafe` block is in `sys`, the privileged seam.
#![deny(unsafe_code)]

pub mod audit;
pub(crate) mod cli;
pub mod config;
pub mod daemon;
pub(crate) mod limits;
pub(crate) mod policy;
pub mod protocol;
pub(crate) mod sandbox;
pub(crate) mod script;
pub(crate) mod service;
#[allow(unsafe_code)]
pub(crate) mod sys;
pub(crate) mod text;
pub mod time;

/// `scriptgate`'s entry point (`src/bin/scriptgate.rs` is a one-line shim).
pub use cli::main as cli_main;
/// Both binaries' first check: `Some(status)` when started as one of the
/// sandbox's helpers (`BIN --sandbox-init ...`, the init, `sandbox::init`; `BIN
/// --sandbox-mounter`, the pool's mount helper, `sandbox::mounter`), which then
/// exits with it.
pub use sandbox::helper_dispatch as sandbox_helper_main;
/// A pool member's parts (`sandbox::member`), for the integration tests
/// (tests/it/pool.rs) that make and assign members directly.
#[doc(hidden)]
pub mod pool_parts {
    pub use crate::limits::member::Waiting;
    pub use crate::sandbox::member::Member;
    pub use crate::sandbox::mounter::Via;
    pub use crate::sandbox::{SandboxBase, SandboxSpec};
    pub use crate::sys::Identity;

    /// A state directory's runtime directory, with `agent_tools.py` and
    /// `member.py` written as the daemon writes them.
    pub fn runtime_dir(state: &std::path::Path) -> std::path::PathBuf {
        crate::daemon::write_runtime_module(state).expect("the runtime directory")
    }
}

/// `scriptgated`'s entry point (`src/bin/scriptgated.rs` is a one-line shim).
pub use service::main as daemon_main;

/// Golden files: output that is a contract (the run_script description, bwrap's
/// argv) compared with a reviewed copy under `tests/fixtures/`.
#[cfg(test)]
pub(crate) mod golden {
    /// Compare `actual` with `tests/fixtures/<name>`. With
    /// `SCRIPTGATE_UPDATE_GOLDEN=1`, write it instead (then review the diff).
    pub fn check(name: &str, actual: &str) {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures")
            .join(name);
        if std::env::var_os("SCRIPTGATE_UPDATE_GOLDEN").is_some() {
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, actual).unwrap();
            return;
        }
        let expected = std::fs::read_to_string(&path).unwrap_or_else(|e| {
            panic!(
                "{}: {e} (SCRIPTGATE_UPDATE_GOLDEN=1 cargo test --lib writes it)",
                path.display()
            )
        });
        assert!(
            actual == expected,
            "{} differs from the output; if the change is meant, rewrite it with \
             SCRIPTGATE_UPDATE_GOLDEN=1 cargo test --lib and review the diff.\n--- expected\n{expected}\n--- actual\n{actual}",
            path.display()
        );
    }
}
