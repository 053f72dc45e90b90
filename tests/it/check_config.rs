//! `scriptgated --check-config` and `scriptgate completions`, run as the packages
//! run them: the real binaries, real files.
use crate::common::cli;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Output};

fn check(config: &Path) -> Output {
    crate::common::shared();
    Command::new(env!("CARGO_BIN_EXE_scriptgated"))
        .arg("--check-config")
        .arg("--config")
        .arg(config)
        .output()
        .unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// A config in a private directory with a 32-byte key of mode 0600.
fn setup(extra: &str) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("token.key");
    std::fs::write(&key, [7u8; 32]).unwrap();
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
    let cfg = dir.path().join("scriptgate.toml");
    std::fs::write(
        &cfg,
        format!(
            "[auth]\ntoken_key_file = {:?}\n[state]\ndir = {:?}\n{extra}",
            key,
            dir.path().join("state")
        ),
    )
    .unwrap();
    (dir, cfg)
}

#[test]
fn a_good_config_exits_0_and_says_what_it_would_run_with() {
    let (dir, cfg) = setup("[sandbox]\nbackend = \"rlimit\"\n[scripts]\ntimeout_s = 77\n");
    let o = check(&cfg);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(0), "{t}");
    assert!(
        t.contains("backend        rlimit (sandbox.backend = rlimit)"),
        "{t}"
    );
    assert!(t.contains("token key"), "{t}");
    assert!(t.contains(": 32 bytes"), "{t}");
    assert!(t.contains("bubblewrap "), "bwrap's version: {t}");
    assert!(t.contains("timeout 77 s"), "{t}");
    assert!(t.ends_with("scriptgated: the configuration is ok\n"), "{t}");
    // Nothing was created: no state directory, no socket.
    assert!(!dir.path().join("state").exists());
}

#[test]
fn a_bad_file_exits_1_naming_the_line_and_key() {
    let (_dir, cfg) = setup("[scripts]\ntimeout_seconds = 5\n");
    let o = check(&cfg);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(1), "{t}");
    assert!(t.contains("timeout_seconds"), "{t}");
    assert!(t.contains("line "), "{t}");
    assert!(t.ends_with("configuration test failed\n"), "{t}");
}

#[test]
fn a_bad_key_or_a_missing_python_exits_1() {
    let (dir, cfg) = setup("");
    std::fs::write(dir.path().join("token.key"), b"short").unwrap();
    let o = check(&cfg);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(1), "{t}");
    assert!(t.contains("error: token key"), "{t}");

    let (_dir, cfg) = setup("[scripts]\npython = \"/nonexistent/python3\"\n");
    let o = check(&cfg);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(1), "{t}");
    assert!(t.contains("scripts.python /nonexistent/python3"), "{t}");
}

#[test]
fn a_missing_explicit_file_exits_1() {
    let o = check(Path::new("/nonexistent/scriptgate.toml"));
    let t = text(&o);
    assert_eq!(o.status.code(), Some(1), "{t}");
    assert!(
        t.contains("/nonexistent/scriptgate.toml: cannot read"),
        "{t}"
    );
}

#[test]
fn completions_are_printed_for_each_shell() {
    for (shell, marker) in [
        ("bash", "complete -F _scriptgate"),
        ("zsh", "#compdef scriptgate"),
        ("fish", "complete -c scriptgate"),
    ] {
        let o = cli(["completions", shell]);
        assert!(o.status.success(), "{shell}: {}", text(&o));
        assert!(
            String::from_utf8_lossy(&o.stdout).contains(marker),
            "{shell}"
        );
    }
    let o = cli(["completions", "tcsh"]);
    assert_eq!(o.status.code(), Some(2));
}

/// `[[auth.engine]]` entries are loaded as the daemon loads them: a good one is
/// counted, one naming a user that does not exist fails the check with its name.
#[test]
fn engine_entries_are_checked_as_the_daemon_checks_them() {
    let (dir, cfg) = setup("");
    let key = dir.path().join("nobody.key");
    std::fs::write(&key, [9u8; 32]).unwrap();
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
    let base = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(
        &cfg,
        format!("{base}[[auth.engine]]\nuser = \"nobody\"\ntoken_key_file = {key:?}\n"),
    )
    .unwrap();
    let o = check(&cfg);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(0), "{t}");
    assert!(t.contains("engines        1 [[auth.engine]] entry"), "{t}");

    std::fs::write(
        &cfg,
        format!(
            "{base}[[auth.engine]]\nuser = \"no-such-engine-user\"\ntoken_key_file = {key:?}\n"
        ),
    )
    .unwrap();
    let o = check(&cfg);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(1), "{t}");
    assert!(t.contains("no-such-engine-user"), "{t}");
    assert!(t.ends_with("configuration test failed\n"), "{t}");
}

/// `--check` is `--check-config` and the host: the sandbox made with the real
/// bwrap as the `sandbox.run_as` uid, as the daemon makes it at start. On
/// Debian 13 `--check-config` said "the configuration is ok" while every
/// script failed; `--check` says no script can run, and why.
#[test]
fn check_probes_the_sandbox_and_says_when_no_script_can_run() {
    let host_check = |config: &Path| {
        crate::common::shared();
        Command::new(env!("CARGO_BIN_EXE_scriptgated"))
            .arg("--check")
            .arg("--config")
            .arg(config)
            .output()
            .unwrap()
    };
    let (_dir, cfg) = setup("");
    let o = host_check(&cfg);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(0), "{t}");
    assert!(t.contains("scriptgated: the configuration is ok\n"), "{t}");
    assert!(t.contains("\npreflight      sandbox ok ("), "{t}");
    assert!(t.contains("are not seen here"), "what it cannot see: {t}");
    assert!(
        t.ends_with("scriptgated: the host can make the sandbox\n"),
        "{t}"
    );
    // A bwrap that fails as Ubuntu's AppArmor makes it fail (tests/it/distro.rs).
    let (dir, _) = setup("");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let fake = dir.path().join("bwrap-ubuntu");
    std::fs::write(
        &fake,
        "#!/bin/sh\n\
         [ \"$1\" = --version ] && { echo 'bubblewrap 0.9.0'; exit 0; }\n\
         { printf '{\\n    \"child-pid\": %d\\n}\\n' $$ >&5; } 2>/dev/null\n\
         echo 'bwrap: loopback: Failed RTM_NEWADDR: Operation not permitted' >&2\n\
         exit 1\n",
    )
    .unwrap();
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
    let (_dir2, cfg) = setup(&format!("[sandbox]\nbwrap = {fake:?}\n"));
    let o = host_check(&cfg);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(1), "{t}");
    assert!(t.contains("scriptgated: the configuration is ok\n"), "{t}");
    assert!(
        t.contains(
            "\npreflight      sandbox unavailable: AppArmor denies the sandbox its user namespace"
        ),
        "{t}"
    );
    assert!(
        t.ends_with("scriptgated: no script can run on this host until the sandbox is fixed\n"),
        "{t}"
    );
    // --check-config alone checks the file, not the host.
    let o = check(&cfg);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(!text(&o).contains("preflight"), "{}", text(&o));
}
