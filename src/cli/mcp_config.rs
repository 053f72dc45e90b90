//! `scriptgate mcp --print-config`: the `mcpServers` entry that starts this
//! `scriptgate mcp` from an MCP client's configuration, ready to paste.
//!
//! A client starts its servers from a working directory of its own, so a path
//! that is relative here names nothing there. The entry's `command` is the
//! running binary's own path; in each `--mcp` command, each argument that names
//! an existing file or directory relative to the current directory is made
//! absolute (the program itself only when it has a `/`: a bare name is looked up
//! in PATH), and so are `--config` and `--socket`. The other options given are
//! passed on as they are.

use crate::cli::args::{McpCmd, MCP_CALL_TIMEOUT_S};
use crate::cli::exit::Failure;
use crate::protocol::snapshot::PermissionMode;
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};

/// `{"mcpServers": {NAME: {"command": EXE, "args": [...]}}}` (a struct, so that
/// `command` comes before `args`, as people write it).
#[derive(Debug, Serialize)]
pub struct Config {
    #[serde(rename = "mcpServers")]
    pub mcp_servers: BTreeMap<String, Entry>,
}

/// One server of a client's `mcpServers`.
#[derive(Debug, Serialize)]
pub struct Entry {
    pub command: String,
    pub args: Vec<String>,
}

/// The snippet for this process: its binary, its current directory.
pub fn print(c: &McpCmd) -> Result<String, Failure> {
    let exe = std::env::current_exe()
        .map_err(|e| Failure::setup(format!("the path of this scriptgate binary: {e}")))?;
    let cwd = std::env::current_dir()
        .map_err(|e| Failure::setup(format!("the current directory: {e}")))?;
    let v = config(&exe, &cwd, c)?;
    Ok(serde_json::to_string_pretty(&v).expect("strings only") + "\n")
}

/// The entry, named after the one `--mcp` server, or `scriptgate` when there
/// are several.
pub fn config(exe: &Path, cwd: &Path, c: &McpCmd) -> Result<Config, Failure> {
    let mut args: Vec<String> = vec!["mcp".into()];
    for s in &c.servers.mcp {
        let argv: Vec<String> = s
            .argv
            .iter()
            .enumerate()
            .map(|(i, a)| absolute_arg(cwd, a, i == 0))
            .collect();
        let command = shlex::try_join(argv.iter().map(String::as_str))
            .map_err(|e| Failure::usage(format!("--mcp {}: {e}", s.name)))?;
        args.extend(["--mcp".into(), format!("{}={command}", s.name)]);
    }
    for (tool, class) in &c.servers.class {
        args.extend(["--class".into(), format!("{tool}={}", class.as_str())]);
    }
    if c.mode == PermissionMode::Auto {
        args.extend(["--mode".into(), "auto".into()]);
    }
    if c.passthrough {
        args.push("--passthrough".into());
    }
    if let Some(p) = &c.socket {
        args.extend(["--socket".into(), absolute(cwd, p).display().to_string()]);
    }
    if c.embedded {
        args.push("--embedded".into());
    }
    if let Some(p) = &c.config {
        args.extend(["--config".into(), absolute(cwd, p).display().to_string()]);
    }
    if c.call_timeout != MCP_CALL_TIMEOUT_S {
        args.extend(["--call-timeout".into(), c.call_timeout.to_string()]);
    }
    let name = match c.servers.mcp.as_slice() {
        [one] => one.name.clone(),
        _ => "scriptgate".into(),
    };
    let entry = Entry {
        command: exe.to_string_lossy().into_owned(),
        args,
    };
    Ok(Config {
        mcp_servers: BTreeMap::from([(name, entry)]),
    })
}

/// One word of a `--mcp` command: absolute when it is a relative path to
/// something that exists here; options (`-…`) and other words as they are.
fn absolute_arg(cwd: &Path, arg: &str, program: bool) -> String {
    let p = Path::new(arg);
    let pathlike = !arg.is_empty() && !arg.starts_with('-') && p.is_relative();
    if !pathlike || (program && !arg.contains('/')) || !cwd.join(p).exists() {
        return arg.to_string();
    }
    absolute(cwd, p).display().to_string()
}

/// `p` under `cwd` when relative, without its `.` components.
fn absolute(cwd: &Path, p: &Path) -> PathBuf {
    if p.is_absolute() {
        return p.to_path_buf();
    }
    cwd.join(p)
        .components()
        .filter(|c| *c != Component::CurDir)
        .collect()
}
