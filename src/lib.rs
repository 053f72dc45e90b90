//! scriptgate: run model-written Python scripts in a bubblewrap sandbox and broker
//! their tool calls back to the engine under a signed authorization snapshot.

pub mod config;
pub mod policy;
pub mod protocol;
pub mod token;
pub mod sandbox;
pub mod sys;
pub mod audit;
pub mod broker;
pub mod engine;
pub mod framing;
pub mod limits;
pub mod runner;
pub mod daemon;
pub mod server;
pub mod service;
pub mod cli;
