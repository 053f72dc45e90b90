//! `scriptgated --check-config [--config FILE]`: validate the configuration and the
//! token key, and print what the daemon would run with, the way `nginx -t` and
//! `sshd -t` do. Exit 0 when the daemon would start and run scripts, 1 otherwise.
//! The packages run it before restarting the daemon: a bad file is reported and
//! the running daemon is left alone.
//!
//! Nothing is changed: no socket, no state directory, no cgroup. The backend is
//! predicted with the daemon's own order (systemd, cgroup, rlimit) using only the
//! read-only probes (a D-Bus connection, the cgroup delegation check); the daemon
//! then moves itself into its cgroup leaf, which this check does not do.

use crate::config::{BackendChoice, Config, DEFAULT_PATH};
use crate::limits::{cgroup, systemd, CgroupView, Kind, RLIMIT_SHARED};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// What was found; `report` turns it into text and a verdict (pure, tested).
#[derive(Debug, Clone)]
pub struct Findings {
    pub path: PathBuf,
    /// The file did not exist at the default path: every default applies.
    pub defaults_only: bool,
    /// The parsed config, or why it was refused.
    pub config: Result<Config, String>,
    /// Bytes of the key, or why it was refused.
    pub key: Option<Result<usize, String>>,
    /// `[[auth.engine]]` entries that load (each with its key), or why not.
    pub engines: Option<Result<usize, String>>,
    /// The backend the daemon would pick and the notes it would give.
    pub backend: Option<Result<(Kind, Vec<String>), String>>,
    /// Executables and users the scripts need, each with what is wrong.
    pub problems: Vec<String>,
    /// bwrap's own `--version` line, if it ran.
    pub bwrap_version: Option<String>,
    /// What the bound on all scripts together is derived from.
    pub host: crate::limits::aggregate::Host,
}

/// The report's text and whether the configuration passes.
pub fn report(f: &Findings) -> (String, bool) {
    let mut out = String::new();
    let mut ok = true;
    let file = if f.defaults_only {
        format!("{} (absent: all defaults)", f.path.display())
    } else {
        f.path.display().to_string()
    };
    out.push_str(&format!("configuration  {file}\n"));
    let cfg = match &f.config {
        Ok(c) => c,
        Err(e) => {
            out.push_str(&format!("error: {e}\n"));
            out.push_str("scriptgated: configuration test failed\n");
            return (out, false);
        }
    };
    ok &= credentials(&mut out, f, cfg);
    ok &= backend(&mut out, f, cfg);
    settings(&mut out, f, cfg);
    for p in &f.problems {
        ok = false;
        out.push_str(&format!("error: {p}\n"));
    }
    out.push_str(if ok {
        "scriptgated: the configuration is ok\n"
    } else {
        "scriptgated: configuration test failed\n"
    });
    (out, ok)
}

/// The token key and the `[[auth.engine]]` entries; false when one is refused.
fn credentials(out: &mut String, f: &Findings, cfg: &Config) -> bool {
    let mut ok = true;
    match &f.key {
        Some(Ok(n)) => out.push_str(&format!(
            "token key      {}: {n} bytes\n",
            cfg.auth.token_key_file.display()
        )),
        Some(Err(e)) => {
            ok = false;
            out.push_str(&format!("error: {e}\n"));
        }
        None => {}
    }
    match &f.engines {
        Some(Ok(0)) | None => {}
        Some(Ok(n)) => out.push_str(&format!(
            "engines        {n} [[auth.engine]] entr{} (own keys and workspaces)\n",
            if *n == 1 { "y" } else { "ies" }
        )),
        Some(Err(e)) => {
            ok = false;
            out.push_str(&format!("error: {e}\n"));
        }
    }
    ok
}

/// The backend the daemon would pick, and its notes; false when none would do.
fn backend(out: &mut String, f: &Findings, cfg: &Config) -> bool {
    let mut ok = true;
    let choice = match cfg.sandbox.backend {
        BackendChoice::Auto => "auto",
        BackendChoice::Systemd => "systemd",
        BackendChoice::Cgroup => "cgroup",
        BackendChoice::Rlimit => "rlimit",
    };
    match &f.backend {
        Some(Ok((kind, notes))) => {
            out.push_str(&format!(
                "backend        {} (sandbox.backend = {choice})\n",
                kind.as_str()
            ));
            for n in notes {
                out.push_str(&format!("               note: {n}\n"));
            }
        }
        Some(Err(e)) => {
            ok = false;
            out.push_str(&format!("error: {e}\n"));
        }
        None => {}
    }
    ok
}

/// What the daemon would run with: sandbox, interpreter, users, directories,
/// limits, enforcement, the drain.
fn settings(out: &mut String, f: &Findings, cfg: &Config) {
    let bwrap = match &f.bwrap_version {
        Some(v) => format!("{} ({v})", cfg.sandbox.bwrap.display()),
        None => cfg.sandbox.bwrap.display().to_string(),
    };
    out.push_str(&format!("sandbox        {bwrap}\n"));
    out.push_str(&format!(
        "python         {}\n",
        cfg.scripts.python.display()
    ));
    out.push_str(&format!(
        "run_as         {} (scripts of root engines)\n",
        cfg.sandbox.run_as
    ));
    let roots: Vec<String> = cfg
        .workspace
        .roots
        .iter()
        .map(|r| r.display().to_string())
        .collect();
    out.push_str(&format!("workspaces     {}\n", roots.join(", ")));
    out.push_str(&format!("state          {}\n", cfg.state.dir.display()));
    let s = &cfg.scripts;
    out.push_str(&format!(
        "limits         timeout {} s, memory {} bytes, {} tasks, {} calls, {} running at once\n",
        s.timeout_s, s.memory_max_bytes, s.tasks_max, s.max_calls, cfg.server.max_running
    ));
    let all = crate::limits::aggregate::decide(s, &f.host);
    out.push_str(&format!(
        "total          {}\n",
        crate::limits::aggregate::summary(&all)
    ));
    out.push_str(&format!(
        "enforcement    {} (sandbox.require_enforced_limits); the daemon reads the limits back at start\n",
        if cfg.sandbox.require_enforced_limits {
            "scripts are refused when the limits are not in force"
        } else {
            "scripts run even when the limits are not in force (said loudly)"
        }
    ));
    out.push_str(&format!(
        "disk           {}\n",
        crate::daemon::disk::summary(&crate::daemon::disk::info(
            s.disk_max_bytes,
            &cfg.workspace.roots,
            false
        )) + if s.disk_max_bytes > 0 {
            " (the service needs CAP_SYS_ADMIN for it: scriptgated(8), DISK)"
        } else {
            ""
        }
    ));
    out.push_str(&format!(
        "stopping       running scripts may finish for {} s (server.drain_s)\n",
        cfg.server.drain_s
    ));
}

/// Gather the facts for `path` (`explicit`: named with --config).
pub fn gather(path: &Path, explicit: bool) -> Findings {
    let defaults_only = !explicit && !path.exists();
    let mut f = Findings {
        path: path.to_path_buf(),
        defaults_only,
        config: Config::load(path, explicit).map_err(|e| e.to_string()),
        key: None,
        engines: None,
        backend: None,
        problems: vec![],
        bwrap_version: None,
        host: crate::limits::aggregate::Host::read(),
    };
    let Ok(cfg) = &f.config else { return f };
    let key = cfg.read_key();
    f.engines = Some(
        crate::policy::auth::Engines::load(&cfg.auth, key.as_deref().ok(), path)
            .map(|e| e.len())
            .map_err(|e| e.to_string()),
    );
    f.key = Some(key.map(|k| k.len()).map_err(|e| e.to_string()));
    f.backend = Some(predict_backend(cfg.sandbox.backend, &CgroupView::real()));
    let sb = &cfg.sandbox;
    match std::process::Command::new(&sb.bwrap)
        .arg("--version")
        .stdin(std::process::Stdio::null())
        .output()
    {
        Ok(o) if o.status.success() => {
            f.bwrap_version = Some(String::from_utf8_lossy(&o.stdout).trim().to_string())
        }
        Ok(o) => f.problems.push(format!(
            "sandbox.bwrap {}: `--version` failed ({}); install bubblewrap or fix sandbox.bwrap",
            sb.bwrap.display(),
            o.status
        )),
        Err(e) => f.problems.push(format!(
            "sandbox.bwrap {}: {e}; install bubblewrap or fix sandbox.bwrap",
            sb.bwrap.display()
        )),
    }
    if !is_executable(&cfg.scripts.python) {
        f.problems.push(format!(
            "scripts.python {}: not an executable file; install python3 or fix scripts.python",
            cfg.scripts.python.display()
        ));
    }
    if nix::unistd::User::from_name(&sb.run_as)
        .ok()
        .flatten()
        .is_none()
    {
        f.problems.push(format!(
            "sandbox.run_as user {:?} does not exist; create it or name another user",
            sb.run_as
        ));
    }
    f
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// The daemon's choice (`limits::Backend::pick`), from read-only probes.
fn predict_backend(
    choice: BackendChoice,
    host: &CgroupView,
) -> Result<(Kind, Vec<String>), String> {
    let mut notes = vec![];
    let name = |c: BackendChoice| format!("sandbox.backend = {c:?}").to_lowercase();
    if matches!(choice, BackendChoice::Auto | BackendChoice::Systemd) {
        let connected = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(rt) => rt
                .block_on(systemd::Manager::connect())
                .map(|_| ())
                .map_err(|e| e.to_string()),
            Err(e) => Err(format!("cannot start a runtime: {e}")),
        };
        match connected {
            Ok(()) => return Ok((Kind::Systemd, notes)),
            Err(why) if choice == BackendChoice::Systemd => {
                return Err(format!("{}: {why}", name(choice)))
            }
            Err(why) => notes.push(format!("systemd: {why}")),
        }
    }
    if matches!(choice, BackendChoice::Auto | BackendChoice::Cgroup) {
        match cgroup::Tree::detect(&host.cgroupfs, &host.proc_self_cgroup) {
            Ok(_) => return Ok((Kind::Cgroup, notes)),
            Err(why) if choice == BackendChoice::Cgroup => {
                return Err(format!(
                    "{}: {why} (checked from this process's cgroup; the service runs in its own, delegated one)",
                    name(choice)
                ))
            }
            Err(why) => notes.push(format!("cgroup: {why}")),
        }
    }
    notes.push(RLIMIT_SHARED.into());
    Ok((Kind::Rlimit, notes))
}

/// `scriptgated --check-config`: the report on stdout, errors included; 0 or 1.
/// `--check-config` (`host` false) and `--check` (`host` true: the sandbox
/// too, probed as the daemon probes it at start).
pub fn main(config: Option<PathBuf>, host: bool) -> ExitCode {
    let (path, explicit) = match config {
        Some(p) => (p, true),
        None => (PathBuf::from(DEFAULT_PATH), false),
    };
    let found = gather(&path, explicit);
    let (text, mut ok) = report(&found);
    print!("{text}");
    if let (true, true, Ok(cfg)) = (host, ok, &found.config) {
        let (text, runs) = host_report(&probe_sandbox(cfg));
        print!("{text}");
        ok = runs;
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

/// The sandbox, probed with the real bwrap as the `sandbox.run_as` uid.
fn probe_sandbox(cfg: &Config) -> crate::sandbox::preflight::SandboxCheck {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let spawner = crate::sys::Spawner::start();
    rt.block_on(crate::sandbox::preflight::Preflight::sandbox_only(
        &spawner, cfg,
    ))
}

/// What `--check` adds: the sandbox, whether scripts can run, and what it cannot
/// see (pure).
pub fn host_report(s: &crate::sandbox::preflight::SandboxCheck) -> (String, bool) {
    let runs = s.info.state != "unavailable";
    let verdict = if runs {
        "scriptgated: the host can make the sandbox"
    } else {
        "scriptgated: no script can run on this host until the sandbox is fixed"
    };
    let text = format!(
        "preflight      {}\n\
         note           probed from this process, not from scriptgate.service: the unit's own options \
         (ProtectHostname=, RestrictNamespaces=, its AppArmor profile) are not seen here; \
         `scriptgate status` (daemon.info) shows the sandbox as the running unit makes it, \
         and `systemd-run --wait --pipe -p ProtectHostname=yes scriptgated --check` tries one option as a unit\n\
         {verdict}\n",
        s.summary()
    );
    (text, runs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts() -> Findings {
        Findings {
            path: "/etc/scriptgate/scriptgate.toml".into(),
            defaults_only: false,
            config: Ok(Config::default()),
            key: Some(Ok(32)),
            engines: Some(Ok(0)),
            backend: Some(Ok((Kind::Cgroup, vec!["systemd: no bus".into()]))),
            problems: vec![],
            bwrap_version: Some("bubblewrap 0.8.0".into()),
            host: crate::limits::aggregate::Host {
                mem_total_bytes: Some(2 << 30),
                cpus: 2,
            },
        }
    }

    #[test]
    fn a_good_config_passes_and_says_what_it_runs_with() {
        let (text, ok) = report(&facts());
        assert!(ok, "{text}");
        assert!(text.contains("backend        cgroup (sandbox.backend = auto)"));
        assert!(text.contains("note: systemd: no bus"));
        assert!(text.contains("/usr/bin/bwrap (bubblewrap 0.8.0)"));
        assert!(
            text.contains("total          memory 1536 MiB, 4096 tasks, CPU 150% together (derived: total_memory_max_bytes: 75% of the host's 2048 MiB, "),
            "{text}"
        );
        assert!(text.ends_with("the configuration is ok\n"), "{text}");
    }

    #[test]
    fn any_problem_fails_with_its_reason() {
        let mut f = facts();
        f.key = Some(Err("token key /k: too short".into()));
        let (text, ok) = report(&f);
        assert!(!ok);
        assert!(text.contains("error: token key /k: too short"));
        assert!(text.ends_with("configuration test failed\n"));

        let mut f = facts();
        f.backend = Some(Err("sandbox.backend = cgroup: not delegated".into()));
        assert!(!report(&f).1);

        let mut f = facts();
        f.problems
            .push("scripts.python /nope: not an executable file".into());
        assert!(!report(&f).1);

        let mut f = facts();
        f.config = Err("/x.toml: line 3: unknown field `bogus`".into());
        let (text, ok) = report(&f);
        assert!(!ok);
        assert!(text.contains("unknown field `bogus`"));
        assert!(
            !text.contains("backend"),
            "no report past a bad file: {text}"
        );
    }
}
