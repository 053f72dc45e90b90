//! scriptgate: run model-written Python scripts in a bubblewrap sandbox and broker
//! their tool calls back to the engine under a signed authorization snapshot.

pub mod config;
pub mod policy;
pub mod protocol;
pub mod token;
