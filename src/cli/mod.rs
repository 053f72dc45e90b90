//! `scriptgate`, the command-line tool: run scripts against real MCP servers (with
//! the system daemon or an embedded one), mint tokens, and administer the daemon.

pub mod admin;
pub mod args;
pub mod completions;
pub mod exit;
pub mod mcp;
pub mod mcp_config;
pub mod mcp_server;
pub mod run;
pub mod table;
pub mod target;

use args::*;
use clap::Parser;
use exit::Failure;
use std::path::PathBuf;
use std::process::ExitCode;

fn read_input(p: &std::path::Path) -> std::io::Result<String> {
    if p.as_os_str() == "-" {
        std::io::read_to_string(std::io::stdin())
    } else {
        std::fs::read_to_string(p)
    }
}

fn admin_cmd(
    name: &str,
    a: &AdminArgs,
    f: impl FnOnce(&admin::Ctx) -> Result<String, Failure>,
) -> ExitCode {
    done(name, admin::Ctx::records(a).and_then(|ctx| f(&ctx)))
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// Print the output, or the failure and its exit status.
fn done(cmd: &str, r: Result<String, Failure>) -> ExitCode {
    match r {
        Ok(out) => {
            print!("{out}");
            ExitCode::SUCCESS
        }
        Err(f) => {
            eprintln!("scriptgate {cmd}: {}", f.message);
            ExitCode::from(f.code)
        }
    }
}

/// `scriptgate run`: the result's text (or JSON), and its status as the exit status.
fn run_cmd(c: RunCmd) -> ExitCode {
    let json = c.json;
    let rt = runtime();
    let r = rt.block_on(run::run(c));
    rt.shutdown_timeout(std::time::Duration::from_secs(1));
    match r {
        Ok(result) => {
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&result).unwrap_or_default()
                );
            } else {
                print!("{}", result.text);
            }
            ExitCode::from(exit::for_status(result.status))
        }
        Err(f) => done("run", Err(f)),
    }
}

fn audit_cmd(c: AuditCmd) -> ExitCode {
    if let Some(crate::cli::args::AuditAction::Backup { file, config }) = &c.action {
        let r = admin::Ctx::load(None, config.clone()).and_then(|ctx| admin::backup(&ctx, file));
        return done("audit backup", r);
    }
    admin_cmd("audit", &c.a, |ctx| {
        let uid = match (&c.uid, &c.user) {
            (Some(u), _) => Some(*u),
            (None, Some(name)) => Some(admin::uid_of(name)?),
            (None, None) => None,
        };
        let q = crate::audit::Query {
            since_ms: c.since,
            run_id: c.run.clone(),
            status: c.status.map(|s| s.as_str().to_string()),
            uid,
            engine_uid: c.engine.as_deref().map(admin::uid_of).transpose()?,
            limit: c.limit,
        };
        admin::audit(ctx, q, c.refusals, c.a.json)
    })
}

/// `scriptgate prune [--dry-run]`: one retention pass, each workspace on a line
/// (`admin::prune`).
fn prune_cmd(c: PruneCmd) -> ExitCode {
    let r = admin::Ctx::load(c.socket.clone(), c.config.clone())
        .and_then(|ctx| admin::prune(&ctx, c.dry_run));
    match r {
        Ok((out, code)) => {
            print!("{out}");
            ExitCode::from(code)
        }
        Err(f) => done("prune", Err(f)),
    }
}

/// `scriptgate metrics`: the text on stdout, or written to `--output`.
fn metrics_cmd(c: MetricsCmd) -> ExitCode {
    let r = admin::Ctx::load(None, c.config.clone()).and_then(|ctx| {
        // Before the first script there is no audit store yet: every counter is 0
        // (a scrape must not fail on a fresh installation).
        let source = if ctx.config.state.dir.join("scriptgate.db").exists() {
            let reader = ctx.reader()?;
            crate::audit::metrics::collect(&reader, &ctx.config.state.dir)
                .map_err(|e| Failure::setup(e.to_string()))?
        } else {
            ctx.reader_allowed()?;
            crate::audit::metrics::Source::fresh(&ctx.config.state.dir)
        };
        let text = crate::audit::metrics::render(&source);
        match &c.output {
            None => Ok(text),
            Some(p) => crate::audit::metrics::write_atomically(p, &text, 0o644)
                .map(|()| String::new())
                .map_err(|e| Failure::setup(format!("{}: {e}", p.display()))),
        }
    });
    done("metrics", r)
}

/// `scriptgate token mint`: the token on stdout.
fn mint_cmd(
    key: PathBuf,
    run_id: String,
    snapshot: PathBuf,
    ttl: i64,
    runner: Option<String>,
) -> ExitCode {
    let r = (|| -> Result<String, String> {
        let key = crate::config::read_key_file(&key).map_err(|e| e.to_string())?;
        let text = read_input(&snapshot).map_err(|e| format!("{}: {e}", snapshot.display()))?;
        let snap: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| format!("{}: {e}", snapshot.display()))?;
        crate::protocol::token::mint(&key, &run_id, runner.as_deref(), &snap, ttl)
            .map_err(|e| e.message)
    })();
    done("token mint", r.map(|t| t + "\n").map_err(Failure::usage))
}

pub fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Run(c) => run_cmd(c),
        Cmd::Tools(c) => done(
            "tools",
            runtime().block_on(run::list_tools(&c.servers.mcp, &c.servers.class, c.json)),
        ),
        Cmd::Describe(c) => done(
            "describe",
            runtime().block_on(run::describe(
                &c.servers.mcp,
                &c.servers.class,
                c.mode,
                c.read_only,
                c.config.as_deref(),
            )),
        ),
        Cmd::Mcp(c) if c.print_config => done("mcp", mcp_config::print(&c)),
        Cmd::Mcp(c) => {
            let rt = runtime();
            let r = rt.block_on(mcp_server::serve(c));
            // Its scripts are recorded and its servers shut down: a read of a
            // stdin that is not a pipe may still be blocked, and is left.
            rt.shutdown_background();
            match r {
                Ok(()) => ExitCode::SUCCESS,
                Err(f) => done("mcp", Err(f)),
            }
        }
        Cmd::Status(a) => {
            let r = admin::Ctx::load(a.socket.clone(), a.config.clone())
                .and_then(|ctx| admin::status(&ctx, a.json));
            match r {
                Ok((out, code)) => {
                    print!("{out}");
                    ExitCode::from(code)
                }
                Err(f) => done("status", Err(f)),
            }
        }
        Cmd::Ps(a) => admin_cmd("ps", &a, |ctx| admin::ps(ctx, a.json)),
        Cmd::Show {
            id,
            calls,
            offset,
            limit,
            a,
        } => admin_cmd("show", &a, |ctx| match calls {
            true => admin::show_calls(ctx, &id, offset, limit, a.json),
            false => admin::show(ctx, &id, a.json),
        }),
        Cmd::Cancel { id, a } => admin_cmd("cancel", &a, |ctx| admin::cancel(ctx, &id, a.json)),
        Cmd::Audit(c) => audit_cmd(c),
        Cmd::Metrics(c) => metrics_cmd(c),
        Cmd::Prune(c) => prune_cmd(c),
        Cmd::Completions { shell } => completions::print(shell),
        Cmd::Token(TokenCmd::Mint {
            key,
            run_id,
            snapshot,
            ttl,
            runner,
        }) => mint_cmd(key, run_id, snapshot, ttl, runner),
    }
}
