//! The integration tests, one binary: a module per area (they were one binary
//! each, and each recompiled tests/common). The test rig is tests/common (the
//! benches include it too). Run one area with `cargo test --test it audit::`.
//!
//! The tests of every module run in this one process, two at a time: a test that
//! must have the machine alone (a systemd boot, a measurement under attack) says
//! so with `common::alone()`, and every rig takes `common::shared()` (see
//! common::turns).

#[path = "../common/mod.rs"]
mod common;

mod admin;
mod audit;
mod broker;
mod check_config;
mod cli;
mod distro;
mod engine;
mod engine_cancel;
mod hostile;
mod hostile_conns;
mod hostile_disk;
mod hostile_mcp;
mod hostile_runs;
mod hostile_sandbox;
mod lifecycle;
mod man_examples;
mod mcp_eras;
mod numbers;
mod parsers;
mod policy;
mod pool;
mod reload;
mod sandbox;
mod sandbox_init;
mod systemd;
mod systemd_limits;
mod terminal;
mod tool_admission;
mod transport;
mod typed_api;
mod users;
