//! The configuration in force, as every start reads it, and the file it came
//! from (`reload` swaps the one and updates the other).

use crate::config::{Config, Source};
use crate::daemon::admission::Rules;
use crate::protocol::LastReload;

/// What every start reads of the configuration, swapped whole by a reload:
/// the configuration in force and what is derived from it.
pub struct Live {
    /// The configuration in force: as loaded at start, with the live keys of
    /// the last reload that checked.
    pub cfg: Config,
    /// What admission decides with (`cfg` and the preflight).
    pub(crate) rules: Rules,
    /// What every script's launch takes from the daemon.
    pub(crate) settings: crate::script::Settings,
}

/// The file the configuration came from, and what the reloads made of it.
#[derive(Debug, Clone)]
pub(crate) struct Loaded {
    pub(crate) source: Source,
    /// When the configuration in force was read (the start or the last reload
    /// that checked).
    pub(crate) loaded_ms: i64,
    /// Keys whose value in the file differs from the running one and need a
    /// restart, as of the last read.
    pub(crate) pending: Vec<String>,
    pub(crate) last: Option<LastReload>,
}
