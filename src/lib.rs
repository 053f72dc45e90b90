//! scriptgate: run model-written Python scripts in a bubblewrap sandbox and broker
//! their tool calls back to the engine under a signed authorization snapshot.

pub mod audit;
pub mod broker;
pub mod cli;
pub mod config;
pub mod daemon;
pub mod describe;
pub mod engine;
pub mod framing;
pub mod journal;
pub mod limits;
pub mod mcp;
pub mod policy;
pub mod protocol;
pub mod ratelimit;
pub mod rpc;
pub mod runner;
pub mod sandbox;
pub mod seccomp;
pub mod server;
pub mod service;
pub mod sys;
pub mod time;
pub mod token;
