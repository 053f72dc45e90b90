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
pub mod trail;

use crate::text::Untrusted;
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
    done(
        name,
        Form::json(a.json),
        admin::Ctx::records(a).and_then(|ctx| f(&ctx)),
    )
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// What a command prints on stdout, and so how: text for a person, or a
/// machine format that a program reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Form {
    /// Escaped where it is printed (`text::Untrusted::lines`: its newlines
    /// kept): whatever a script, an engine or a server wrote reaches the
    /// terminal escaped, whichever path it took into the text. Tables have
    /// escaped their cells already (`table::table`), and escaping is
    /// idempotent (a backslash is left as it is).
    Text,
    /// Exact: `--json`, a token, metrics, an MCP client's configuration.
    Exact,
}

impl Form {
    fn json(json: bool) -> Form {
        match json {
            true => Form::Exact,
            false => Form::Text,
        }
    }
}

/// Print a command's output on stdout in its form (the one place where the
/// CLI's stdout is written, but for `scriptgate run`'s result text, which
/// `run_cmd` prints, and `completions`).
fn print_out(form: Form, out: &str) {
    match form {
        Form::Text => print!("{}", Untrusted::lines(out)),
        Form::Exact => print!("{out}"),
    }
}

/// A failure on stderr, its text escaped (it may quote a server, an engine or
/// the daemon), and its exit status.
fn fail(cmd: &str, f: Failure) -> ExitCode {
    eprintln!("scriptgate {cmd}: {}", Untrusted::lines(&f.message));
    ExitCode::from(f.code)
}

/// Print the output, or the failure and its exit status.
fn done(cmd: &str, form: Form, r: Result<String, Failure>) -> ExitCode {
    match r {
        Ok(out) => {
            print_out(form, &out);
            ExitCode::SUCCESS
        }
        Err(f) => fail(cmd, f),
    }
}

/// `scriptgate run`: the result's text (or JSON), and its status as the exit
/// status. The result text (the summary line and what the script printed) is
/// the run's product: exact when stdout is a file or a pipe, escaped as lines
/// when it is a terminal (the script wrote it, and a person reads it there).
fn run_cmd(c: RunCmd) -> ExitCode {
    use std::io::IsTerminal;
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
            } else if std::io::stdout().is_terminal() {
                print_out(Form::Text, &result.text);
            } else {
                print_out(Form::Exact, &result.text);
            }
            ExitCode::from(exit::for_status(result.status))
        }
        Err(f) => fail("run", f),
    }
}

fn audit_cmd(c: AuditCmd) -> ExitCode {
    if let Some(crate::cli::args::AuditAction::Backup { file, config }) = &c.action {
        let r = admin::Ctx::load(None, config.clone()).and_then(|ctx| admin::backup(&ctx, file));
        return done("audit backup", Form::Text, r);
    }
    if c.journal {
        return audit_journal_cmd(&c);
    }
    admin_cmd("audit", &c.a, |ctx| {
        let uid = audit_uid(&c)?;
        let q = crate::audit::Query {
            since_ms: c.since,
            run_id: c.run.clone(),
            status: c.status.map(|s| s.as_str().to_string()),
            uid,
            engine_uid: c.engine.as_deref().map(admin::uid_of).transpose()?,
            limit: c.limit,
        };
        if c.stats {
            return admin::store_stats(ctx, c.a.json);
        }
        if c.connections {
            return admin::refused_connections(ctx, q, c.a.json);
        }
        admin::audit(ctx, q, c.refusals, c.a.json)
    })
}

/// `audit --uid UID` or `--user NAME`: the uid either names.
fn audit_uid(c: &AuditCmd) -> Result<Option<u32>, Failure> {
    Ok(match (&c.uid, &c.user) {
        (Some(u), _) => Some(*u),
        (None, Some(name)) => Some(admin::uid_of(name)?),
        (None, None) => None,
    })
}

/// `scriptgate audit --journal`: the fleet's trail, from the journal alone (no
/// daemon, no audit store).
fn audit_journal_cmd(c: &AuditCmd) -> ExitCode {
    let r = (|| {
        let uid = audit_uid(c)?;
        let filter = crate::audit::trail::Filter {
            host: c.host.clone(),
            since_ms: c.since,
            run_id: c.run.clone(),
            status: c.status.map(|s| s.as_str().to_string()),
            engine_uid: c.engine.as_deref().map(admin::uid_of).transpose()?,
            uid,
            lost_only: c.lost,
            limit: c.limit,
        };
        let as_of = c.as_of.unwrap_or_else(crate::time::now_ms);
        trail::audit_journal(c.directory.as_deref(), &filter, as_of, c.a.json)
    })();
    done("audit", Form::json(c.a.json), r)
}

/// `scriptgate prune [--dry-run]`: one retention pass, each workspace on a line
/// (`admin::prune`).
fn prune_cmd(c: PruneCmd) -> ExitCode {
    let r = admin::Ctx::load(c.socket.clone(), c.config.clone())
        .and_then(|ctx| admin::prune(&ctx, c.dry_run, c.as_of, c.json));
    let form = if c.json { Form::Exact } else { Form::Text };
    match r {
        Ok((out, code)) => {
            print_out(form, &out);
            ExitCode::from(code)
        }
        Err(f) => fail("prune", f),
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
    // The text format, for a scraper (its label values are escaped as the
    // format wants, and are statuses and reasons).
    done("metrics", Form::Exact, r)
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
    done(
        "token mint",
        Form::Exact,
        r.map(|t| t + "\n").map_err(Failure::usage),
    )
}

pub fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Run(c) => run_cmd(c),
        Cmd::Tools(c) => done(
            "tools",
            Form::json(c.json),
            runtime().block_on(run::list_tools(&c.servers.mcp, &c.servers.class, c.json)),
        ),
        Cmd::Describe(c) => done(
            "describe",
            Form::Text,
            runtime().block_on(run::describe(
                &c.servers.mcp,
                &c.servers.class,
                c.mode,
                c.read_only,
                c.config.as_deref(),
            )),
        ),
        Cmd::Mcp(c) if c.print_config => done("mcp", Form::Exact, mcp_config::print(&c)),
        Cmd::Mcp(c) => {
            let rt = runtime();
            let r = rt.block_on(mcp_server::serve(c));
            // Its scripts are recorded and its servers shut down: a read of a
            // stdin that is not a pipe may still be blocked, and is left.
            rt.shutdown_background();
            match r {
                Ok(()) => ExitCode::SUCCESS,
                Err(f) => fail("mcp", f),
            }
        }
        Cmd::Status(a) => {
            let r = admin::Ctx::load(a.socket.clone(), a.config.clone())
                .and_then(|ctx| admin::status(&ctx, a.json));
            match r {
                Ok((out, code)) => {
                    print_out(Form::json(a.json), &out);
                    ExitCode::from(code)
                }
                Err(f) => fail("status", f),
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
