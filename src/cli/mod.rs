//! `scriptgate`, the command-line tool.

use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser, Debug)]
#[command(
    name = "scriptgate",
    version,
    about = "Run tool-calling Python scripts through scriptgated; inspect and control the daemon"
)]
pub struct Cli {
    #[command(subcommand)]
    pub cmd: Cmd,
}

#[derive(Subcommand, Debug)]
pub enum Cmd {
    /// Run tokens (the reference for engine authors).
    #[command(subcommand)]
    Token(TokenCmd),
}

#[derive(Subcommand, Debug)]
pub enum TokenCmd {
    /// Print an HS256 run token for a snapshot.
    Mint {
        /// Key file (the daemon's auth.token_key_file).
        #[arg(long)]
        key: PathBuf,
        #[arg(long)]
        run_id: String,
        /// JSON file with the authorization snapshot (- for stdin).
        #[arg(long)]
        snapshot: PathBuf,
        /// Lifetime in seconds.
        #[arg(long, default_value_t = 3600)]
        ttl: i64,
        /// Identity of the agent runner (audited).
        #[arg(long)]
        runner: Option<String>,
    },
}

/// Exit status of a refused or failed command.
pub const EXIT_USAGE: u8 = 2;

fn read_input(p: &std::path::Path) -> std::io::Result<String> {
    if p.as_os_str() == "-" {
        std::io::read_to_string(std::io::stdin())
    } else {
        std::fs::read_to_string(p)
    }
}

pub fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Token(TokenCmd::Mint {
            key,
            run_id,
            snapshot,
            ttl,
            runner,
        }) => {
            let r = (|| -> Result<String, String> {
                let key = crate::config::read_key_file(&key).map_err(|e| e.to_string())?;
                let text =
                    read_input(&snapshot).map_err(|e| format!("{}: {e}", snapshot.display()))?;
                let snap: serde_json::Value = serde_json::from_str(&text)
                    .map_err(|e| format!("{}: {e}", snapshot.display()))?;
                crate::token::mint(&key, &run_id, runner.as_deref(), &snap, ttl)
                    .map_err(|e| e.message)
            })();
            match r {
                Ok(t) => {
                    println!("{t}");
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("scriptgate token mint: {e}");
                    ExitCode::from(EXIT_USAGE)
                }
            }
        }
    }
}
