//! What a person sees (issue 32): text that a script, an engine or an upstream
//! server wrote never drives the terminal of the person who reads it, and an
//! approval shows the call that runs.
//!
//! `scriptgate run`'s approval and progress are tested on a real terminal:
//! tmux runs the real `scriptgate run --embedded` on a pseudo-terminal of its
//! own, against a real upstream MCP server (tests/fixtures/hostile_text_server.py:
//! `get_status`, read; `reboot_all`, a write); the screen is what tmux renders
//! (`capture-pane`), the bytes are what reached the terminal (`pipe-pane`), the
//! title is the one the pane has (`#{pane_title}`). The other commands are run
//! with their output in a pipe and their bytes checked: `tools`, `describe`,
//! errors, and the administrator's `ps`, `show`, `show --calls` and `audit` over
//! a root engine's script (the daemon rig of tests/common).
use crate::common::*;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const SERVER: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/hostile_text_server.py"
);

/// The fixture server's HOSTILE text (tests/fixtures/hostile_text_server.py).
const HOSTILE: &str =
    "\x1b]0;owned\x07\x1b[2J\x1b[H\x1b[2K\r\x1b[1A\u{202e}\u{200b}0000000000000000  fake row";

/// HOSTILE as a Python string literal (escapes only: the script's source has no
/// control character of its own).
const HOSTILE_PY: &str =
    r#""\x1b]0;owned\x07\x1b[2J\x1b[H\x1b[2K\r\x1b[1A\u202e\u200b0000000000000000  fake row""#;

/// HOSTILE as the CLI shows it.
const HOSTILE_SHOWN: &str =
    r"\x1b]0;owned\x07\x1b[2J\x1b[H\x1b[2K\x0d\x1b[1A\u202e\u200b0000000000000000  fake row";

/// A character that must not reach a terminal as it is: a control character
/// other than the newline, or one that reorders or hides text. Written out
/// here rather than taken from the code under test.
fn hidden(c: char) -> bool {
    (c.is_control() && c != '\n')
        || matches!(
            c,
            '\u{061c}'
                | '\u{200b}'..='\u{200f}'
                | '\u{2028}'
                | '\u{2029}'
                | '\u{202a}'..='\u{202e}'
                | '\u{2060}'..='\u{2064}'
                | '\u{2066}'..='\u{2069}'
                | '\u{feff}'
        )
}

/// `s` as the CLI shows it on one line (written out here, as `hidden` is).
fn shown(s: &str) -> String {
    s.chars()
        .map(|c| match c {
            c if !hidden(c) && c != '\n' => c.to_string(),
            c if (c as u32) < 0x100 => format!("\\x{:02x}", c as u32),
            c => format!("\\u{:04x}", c as u32),
        })
        .collect()
}

/// How many characters of `s` must not reach a terminal, and how many are ESC.
fn count_hidden(s: &str) -> (usize, usize) {
    (
        s.chars().filter(|&c| hidden(c)).count(),
        s.matches('\x1b').count(),
    )
}

/// `what` has no character that must not reach a terminal.
fn assert_clean(what: &str, s: &str) {
    let (n, esc) = count_hidden(s);
    assert_eq!(
        n, 0,
        "{what}: {n} raw control or reordering characters ({esc} ESC) reach the terminal:\n{s:?}"
    );
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// A directory of this test's own: the workspace (the script's uid's), the
/// scripts, the server's call log, and a configuration whose state directory
/// keeps the embedded daemon's records here.
struct Run {
    dir: tempfile::TempDir,
    workspace: PathBuf,
    config: PathBuf,
    log: PathBuf,
}

impl Run {
    fn new() -> Run {
        shared();
        let dir = tempfile::Builder::new()
            .prefix("sg-term-")
            .tempdir()
            .unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let workspace = dir.path().join("ws");
        std::fs::create_dir(&workspace).unwrap();
        chown_to_script_uid(&workspace);
        let config = dir.path().join("scriptgate.toml");
        std::fs::write(
            &config,
            format!(
                "[state]\ndir = {:?}\n[sandbox]\nbackend = {RIG_BACKEND:?}\n",
                dir.path().join("state")
            ),
        )
        .unwrap();
        let log = dir.path().join("calls.log");
        Run {
            dir,
            workspace,
            config,
            log,
        }
    }

    fn server(&self, flags: &str) -> String {
        format!(
            "srv=python3 {SERVER} {}{}{flags}",
            self.log.display(),
            if flags.is_empty() { "" } else { " " }
        )
    }

    /// `scriptgate run --embedded` of `code` against the fixture server, as argv.
    fn argv(&self, code: &str, flags: &str, extra: &[&str]) -> Vec<String> {
        let script = self.dir.path().join("script.py");
        std::fs::write(&script, code).unwrap();
        let mut argv: Vec<String> = vec![CLI.into(), "run".into(), "--embedded".into()];
        argv.extend(["--config".into(), self.config.display().to_string()]);
        argv.extend(["--workspace".into(), self.workspace.display().to_string()]);
        argv.extend(["--mcp".into(), self.server(flags)]);
        argv.extend(extra.iter().map(|s| s.to_string()));
        argv.push(script.display().to_string());
        argv
    }

    /// What the upstream server was asked to do.
    fn calls(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// A tmux server of this test's own with one pane, 200 columns by 80 rows,
/// that runs `argv` on its pseudo-terminal: stdin, stdout, stderr and the
/// controlling terminal (/dev/tty, where `scriptgate run` asks) are the pane.
/// Every byte written to the terminal is also kept (`pipe-pane`).
struct Pane {
    socket: String,
    raw: PathBuf,
    status: PathBuf,
}

impl Pane {
    fn start(dir: &Path, argv: &[String]) -> Pane {
        let have = Command::new("tmux").arg("-V").output();
        assert!(
            have.is_ok_and(|o| o.status.success()),
            "tmux is missing: run tools/install-deps (or apt install tmux)"
        );
        let mut r = [0u8; 6];
        getrandom::getrandom(&mut r).unwrap();
        let socket = format!(
            "sg-term-{}",
            r.iter().map(|b| format!("{b:02x}")).collect::<String>()
        );
        // The pane's shell waits for a line before it runs the command, so
        // that the pipe is in place before the first byte; then it writes the
        // command's exit status to a file (tmux's #{pane_dead_status} is not
        // always set when a pane's terminal closes before its process is
        // reaped). The pane stays on screen after (remain-on-exit).
        let run = dir.join("pane.sh");
        let status = dir.join("status");
        let cmd: Vec<String> = argv.iter().map(|a| shell_quote(a)).collect();
        std::fs::write(
            &run,
            format!(
                "read go\n{cmd}\necho $? > {st}.new && mv {st}.new {st}\n",
                cmd = cmd.join(" "),
                st = shell_quote(&status.display().to_string())
            ),
        )
        .unwrap();
        let raw = dir.join("terminal.bin");
        let pane = Pane {
            socket,
            raw,
            status,
        };
        pane.tmux(&[
            "-f",
            "/dev/null",
            "new-session",
            "-d",
            "-s",
            "t",
            "-x",
            "200",
            "-y",
            "80",
            "sh",
            &run.display().to_string(),
        ]);
        pane.tmux(&["set-option", "-w", "-t", "t", "remain-on-exit", "on"]);
        pane.tmux(&[
            "pipe-pane",
            "-O",
            "-t",
            "t",
            &format!("cat > {}", shell_quote(&pane.raw.display().to_string())),
        ]);
        pane.tmux(&["send-keys", "-t", "t", "Enter"]);
        pane
    }

    fn tmux(&self, args: &[&str]) -> String {
        let o = Command::new("tmux")
            .arg("-L")
            .arg(&self.socket)
            .args(args)
            .env_remove("TMUX")
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert!(o.status.success(), "tmux {args:?}: {}", text(&o.stderr));
        text(&o.stdout)
    }

    /// The screen as the terminal shows it (what has scrolled off it left
    /// out: the pane has room for all these tests write), wrapped lines
    /// joined, without trailing blanks.
    fn screen(&self) -> String {
        let s = self.tmux(&["capture-pane", "-p", "-J", "-t", "t"]);
        s.lines()
            .map(str::trim_end)
            .collect::<Vec<_>>()
            .join("\n")
            .trim_end()
            .to_string()
    }

    /// The screen once it shows `what` (polled, for at most 60 s).
    fn wait_for(&self, what: &str) -> String {
        let t0 = Instant::now();
        loop {
            let s = self.screen();
            if s.contains(what) {
                return s;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "the screen never showed {what:?}:\n{s}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The command's exit status, once it has exited (polled, at most 60 s).
    fn wait_exit(&self) -> i32 {
        let t0 = Instant::now();
        loop {
            if let Ok(st) = std::fs::read_to_string(&self.status) {
                return st.trim().parse().unwrap();
            }
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "the command did not end:\n{}",
                self.screen()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn title(&self) -> String {
        self.tmux(&["display-message", "-p", "-t", "t", "#{pane_title}"])
            .trim_end()
            .to_string()
    }

    /// Every byte written to the terminal, once `last` is among them (the pipe
    /// may lag behind the screen; polled, at most 60 s).
    fn bytes_until(&self, last: &str) -> String {
        let t0 = Instant::now();
        loop {
            let b = text(&std::fs::read(&self.raw).unwrap_or_default());
            if b.contains(last) {
                return b;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "{last:?} never reached the terminal: {b:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Pane {
    fn drop(&mut self) {
        let _ = Command::new("tmux")
            .arg("-L")
            .arg(&self.socket)
            .arg("kill-server")
            .env_remove("TMUX")
            .output();
    }
}

/// The bytes a terminal was sent, without what scriptgate and the terminal
/// write themselves: the terminal's `\r\n` for each newline, and the progress
/// line's `\r` + erase-line (`\x1b[K`).
fn others(bytes: &str) -> String {
    bytes.replace("\r\x1b[K", "").replace("\r\n", "\n")
}

/// Each way of hiding a call on the approval's screen, from the script's
/// second line on: what the script would seem to do is
/// `print(tools.srv.get_status())`; it calls `reboot_all` (on its line 2).
/// Each is valid Python that calls it.
const DISGUISES: &[(&str, &str)] = &[
    (
        "line erase and column 1",
        "tools.srv.reboot_all()  # \x1b[2K\x1b[1G   2 | print(tools.srv.get_status())",
    ),
    (
        // A lone \r ends a line for Python: the string starts on line 2 and
        // ends on line 3.
        "carriage return",
        "tools.srv.reboot_all(); _ = \"\"\"\r   2 | print(tools.srv.get_status())\"\"\"",
    ),
    (
        "cursor back, erase to the end of the line",
        "tools.srv.reboot_all()  # \x1b[100D   2 | print(tools.srv.get_status())\x1b[K",
    ),
    (
        // The next line's comment goes back up and writes over this one.
        "cursor up",
        "tools.srv.reboot_all()\n# \x1b[1A\x1b[2K\x1b[100D   2 | print(tools.srv.get_status())",
    ),
    (
        // A clear screen, and a whole prompt drawn with cursor moves instead
        // of newlines (which would end the comment).
        "screen clear and a fake prompt",
        "tools.srv.reboot_all()  # \x1b[2J\x1b[Hscriptgate: this script asks to use write tools.\
         \x1b[1E  description: status\x1b[1E  write tools: srv__get_status (read)\
         \x1b[1E--- script ---\x1b[1E   1 | from agent_tools import tools\
         \x1b[1E   2 | print(tools.srv.get_status())",
    ),
    (
        "window title",
        "tools.srv.reboot_all()  # \x1b]0;owned\x07\x1b]2;owned\x1b\\",
    ),
    (
        "bidi override",
        "tools.srv.reboot_all()  # \u{202e} ))(sutats_teg.vrs.sloot(tnirp \u{202c}\u{2066}",
    ),
];

/// `scriptgate run`'s approval on a real terminal: for each disguise, the
/// rendered screen shows the script's second line as the call it makes
/// (`reboot_all`, its disguise escaped), the header names the write tool, the
/// title stays the pane's, and no byte of the script reaches the terminal as a
/// control or reordering character. The person answers `y`; the upstream gets
/// `reboot_all`: what was shown is what ran.
#[test]
fn the_approval_shows_the_call_that_runs() {
    // What went wrong with each disguise, all of them said at the end.
    let mut wrong: Vec<String> = vec![];
    for (name, line) in DISGUISES {
        let r = Run::new();
        let code = format!("from agent_tools import tools\n{line}\n");
        let argv = r.argv(&code, "", &["--tools", "srv__reboot_all"]);
        let pane = Pane::start(r.dir.path(), &argv);
        let title = pane.title();
        let screen = pane.wait_for("Allow once? [y/N]");
        let mut bad = |what: &str| wrong.push(format!("{name}: {what}:\n{screen}\n"));
        if !screen.contains("\n  write tools: srv__reboot_all (write)\n") {
            bad("the header does not name the write tool");
        }
        let second = screen.lines().find(|l| l.starts_with("   2 | "));
        if !second.is_some_and(|l| l.starts_with("   2 | tools.srv.reboot_all()")) {
            bad("line 2 does not show the call");
        }
        if screen
            .lines()
            .any(|l| l.starts_with("   2 | print(") || l.starts_with("   1 | print("))
        {
            bad("a faked line passes for a numbered one");
        }
        if pane.title() != title {
            bad(&format!("the script set the title to {:?}", pane.title()));
        }
        // The person answers as they would: yes.
        pane.tmux(&["send-keys", "-t", "t", "y", "Enter"]);
        assert_eq!(pane.wait_exit(), 0, "{name}:\n{}", pane.screen());
        assert!(
            r.calls().starts_with("call reboot_all "),
            "{name}: {}",
            r.calls()
        );
        let sent = others(&pane.bytes_until("run_script ok"));
        let (n, esc) = count_hidden(&sent);
        if n > 0 {
            wrong.push(format!(
                "{name}: {n} raw control or reordering characters ({esc} ESC) reached the terminal"
            ));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// The prompt's description (HOSTILE) shows escaped on its one line, and the
/// script's lines are numbered as Python reads them: the call after a lone
/// carriage return (which ends a line for Python) is on a line of its own.
/// The person answers `n`: nothing reaches the server, exit 8.
#[test]
fn the_approval_numbers_the_lines_python_runs() {
    let r = Run::new();
    let code = "from agent_tools import tools\nx = 1  # note\rtools.srv.reboot_all()\n";
    let mut argv = r.argv(code, "", &["--tools", "srv__reboot_all"]);
    let at = argv.len() - 1;
    argv.splice(
        at..at,
        ["--description".to_string(), format!("status{HOSTILE}")],
    );
    let pane = Pane::start(r.dir.path(), &argv);
    let screen = pane.wait_for("Allow once? [y/N]");
    assert!(
        screen.contains(&format!("  description: status{HOSTILE_SHOWN}\n")),
        "{screen}"
    );
    assert!(
        screen.contains("   2 | x = 1  # note\\x0d\n   3 | tools.srv.reboot_all()\n"),
        "{screen}"
    );
    pane.tmux(&["send-keys", "-t", "t", "n", "Enter"]);
    assert_eq!(pane.wait_exit(), 8, "denied:\n{}", pane.screen());
    assert_eq!(r.calls(), "", "nothing ran");
    assert_clean("the prompt", &others(&pane.bytes_until("denied")));
}

/// `scriptgate run` on a terminal: the progress line and the result text that
/// the script wrote show escaped. While the script waits in a call (the server
/// holds it until the test opens its gate), the progress line is on the
/// screen; then the result. The screen is never cleared (the mode line stays),
/// the title stays, and no byte the script wrote reaches the terminal raw.
#[test]
fn progress_and_result_text_show_escaped_on_a_terminal() {
    let r = Run::new();
    let gate = Gate::new(r.dir.path());
    let code = format!(
        "import agent_tools\nfrom agent_tools import tools\nS = {HOSTILE_PY}\n\
         agent_tools.progress(1, 2, S)\ntools.srv.get_status()\nprint(S)\n"
    );
    let argv = r.argv(&code, &format!("--gate {}", gate.0.display()), &[]);
    let pane = Pane::start(r.dir.path(), &argv);
    let title = pane.title();
    let screen = pane.wait_for("] 1/2 ");
    let progress = screen
        .lines()
        .find(|l| l.contains("] 1/2 "))
        .unwrap()
        .to_string();
    assert!(
        progress.ends_with(&format!("] 1/2 {HOSTILE_SHOWN} (0 calls, 0 failed)")),
        "{screen}"
    );
    let mode_line = |screen: &str| {
        screen
            .lines()
            .any(|l| l.starts_with("scriptgate: mode: embedded daemon"))
    };
    assert!(mode_line(&screen), "the screen was cleared:\n{screen}");
    assert_eq!(pane.title(), title, "the progress message set the title");
    gate.open();
    assert_eq!(pane.wait_exit(), 0, "{}", pane.screen());
    let screen = pane.screen();
    assert!(mode_line(&screen), "the screen was cleared:\n{screen}");
    let result = screen
        .lines()
        .skip_while(|l| !l.starts_with("run_script ok:"))
        .collect::<Vec<_>>();
    assert_eq!(result.get(1), Some(&HOSTILE_SHOWN), "{screen}");
    assert_eq!(pane.title(), title, "the output set the title");
    assert_clean(
        "progress and result",
        &others(&pane.bytes_until("fake row\r\n")),
    );
}

/// A FIFO that the fixture server's `get_status` reads to its end before it
/// answers (`--gate`): the call waits until the test opens it.
struct Gate(PathBuf);

impl Gate {
    fn new(dir: &Path) -> Gate {
        let p = dir.join("gate");
        nix::unistd::mkfifo(&p, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        Gate(p)
    }

    /// Let the call answer: opened for writing (which waits for the server to
    /// open it for reading) and closed, the server reads its end.
    fn open(&self) {
        drop(
            std::fs::OpenOptions::new()
                .write(true)
                .open(&self.0)
                .unwrap(),
        );
    }
}

impl Drop for Gate {
    /// A test that failed before opening the gate leaves no server waiting on
    /// it: opened without waiting (it fails when no one reads).
    fn drop(&mut self) {
        use std::os::unix::fs::OpenOptionsExt;
        let _ = std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&self.0);
    }
}

/// `scriptgate ARGS` with stdout and stderr in pipes and no terminal.
fn piped(args: &[String]) -> Output {
    cli_with(args, |c| {
        c.stdin(Stdio::null());
    })
}

fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

/// `scriptgate run` with stdout in a pipe: the result text is the run's
/// product, exact (a program reads it); the progress lines on stderr show the
/// script's message escaped (the daemon sends the last progress before the
/// end, however soon the script ends). With `--json`, the result is exact too.
#[test]
fn run_keeps_a_piped_result_exact_and_escapes_its_progress() {
    let r = Run::new();
    let code =
        format!("import agent_tools\nS = {HOSTILE_PY}\nagent_tools.progress(1, 2, S)\nprint(S)\n");
    let argv = r.argv(&code, "", &[]);
    let o = piped(&argv[1..]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    let out = text(&o.stdout);
    assert!(out.ends_with(&format!("\n{HOSTILE}\n")), "exact: {out:?}");
    let err = text(&o.stderr);
    assert!(
        err.contains(&format!("progress: 1/2 {HOSTILE_SHOWN} (")),
        "{err}"
    );
    assert_clean("run's stderr", &err);
    let mut argv = argv;
    argv.insert(argv.len() - 1, "--json".into());
    let o = piped(&argv[1..]);
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(
        v["text"]
            .as_str()
            .unwrap()
            .ends_with(&format!("\n{HOSTILE}\n")),
        "{v}"
    );
}

/// `scriptgate tools` and `describe`: the server's tool names, parameters and
/// descriptions show escaped, no row can be faked; `tools --json` is exact.
#[test]
fn tools_and_describe_show_a_servers_text_escaped() {
    let r = Run::new();
    let server = r.server("--hostile");
    let o = piped(&args(&["tools", "--mcp", &server]));
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    let out = text(&o.stdout);
    assert_clean("tools", &out);
    // A header, the two tools offered, then the one whose name hides characters,
    // not offered and said why.
    assert_eq!(
        out.lines().count(),
        6,
        "two tools and one not offered: {out}"
    );
    assert!(
        out.contains(&format!(
            "srv__get_status(verbose{HOSTILE_SHOWN}: bool = None)"
        )),
        "{out}"
    );
    assert!(
        out.contains("\n  srv__peek\\u202e\\u200bkeep: its name has a control, invisible or reordering character (\\u202e)\n"),
        "{out}"
    );
    let o = piped(&args(&["tools", "--json", "--mcp", &server]));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v[2]["name"], "srv__peek\u{202e}\u{200b}keep", "exact: {v}");
    let o = piped(&args(&["describe", "--mcp", &server]));
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    let out = text(&o.stdout);
    assert_clean("describe", &out);
    assert!(
        out.contains("    srv__peek\\u202e\\u200bkeep (its name has"),
        "{out}"
    );
}

/// Errors and warnings quote a server: shown escaped on stderr. A server that
/// fails at start with HOSTILE on its stderr (`tools`, `run`: exit 10), and one
/// whose list names a tool with reordering characters, twice (`describe`,
/// `run`: the tool left out with a warning, the rest offered).
#[test]
fn errors_show_a_servers_text_escaped() {
    let r = Run::new();
    let failing = r.server("--fail-start");
    let twice = r.server("--hostile --dup");
    let script = r.dir.path().join("s.py");
    std::fs::write(&script, "print(1)\n").unwrap();
    let config = r.config.display().to_string();
    let ws = r.workspace.display().to_string();
    let script = script.display().to_string();
    let run = |server: &str| {
        args(&[
            "run",
            "--embedded",
            "--config",
            &config,
            "--workspace",
            &ws,
            "--mcp",
            server,
            &script,
        ])
    };
    let left_out = r#"tool "srv__peek\u202e\u200bkeep" is not offered: its name has a control, invisible or reordering character (\u202e)"#;
    for (argv, code, says) in [
        (args(&["tools", "--mcp", &failing]), 10, "cannot start: "),
        (run(&failing), 10, "cannot start: "),
        (args(&["describe", "--mcp", &twice]), 0, left_out),
        (run(&twice), 0, left_out),
    ] {
        let o = piped(&argv);
        assert_eq!(o.status.code(), Some(code), "{argv:?}: {}", text(&o.stderr));
        let err = text(&o.stderr);
        assert!(err.contains(says), "{argv:?}: {err}");
        assert_clean(&format!("{argv:?}'s stderr"), &err);
        let out = text(&o.stdout);
        assert_clean(&format!("{argv:?}'s stdout"), &out);
        assert_eq!(code == 10, out.is_empty(), "{argv:?}: {out}");
    }
}

// ---------------------------------------------------------------------------
// The administrator's commands over a root engine's script.

/// For one line of a table: HOSTILE with a newline and a row after it.
const ROW_FAKER: &str =
    "\x1b]0;owned\x07\x1b[2J\x1b[H\x1b[2K\r\u{202e}\u{200b}status\n0000000000000000  fake row";
const ROW_FAKER_PY: &str =
    r#""\x1b]0;owned\x07\x1b[2J\x1b[H\x1b[2K\r\u202e\u200bstatus\n0000000000000000  fake row""#;
const ROW_FAKER_SHOWN: &str =
    r"\x1b]0;owned\x07\x1b[2J\x1b[H\x1b[2K\x0d\u202e\u200bstatus\x0a0000000000000000  fake row";

/// A root engine's script whose description, progress message, output and a
/// call's answer carry ROW_FAKER: `ps` while it runs (its progress), then
/// `show`, `show --calls` and `audit` once it has ended. No control or
/// reordering character reaches stdout, no fake row starts a line, the text is
/// there escaped; `--json` stays exact.
#[test]
#[ignore = "needs root: the audit store and admin.list are root's (cargo test --test it terminal:: -- --include-ignored)"]
fn admin_commands_show_a_scripts_text_escaped() {
    require_root("the audit store and admin.list are root's");
    let rig = Rig::new();
    let e = rig.engine();
    // The script's second call waits in the engine until `ps` has looked.
    let (held_tx, held_rx) = std::sync::mpsc::channel::<()>();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let (held_tx, go_rx) = (std::sync::Mutex::new(held_tx), std::sync::Mutex::new(go_rx));
    let fleet = fleet_handler();
    e.set_handler(std::sync::Arc::new(move |tool, args| {
        if tool == "fleet__list_devices" {
            let _ = held_tx.lock().unwrap().send(());
            let _ = go_rx.lock().unwrap().recv_timeout(Duration::from_secs(120));
        }
        fleet(tool, args)
    }));
    let code = format!(
        "import agent_tools\nS = {ROW_FAKER_PY}\n\
         agent_tools.progress(1, 2, S)\nprint(S)\n\
         agent_tools.call('fleet__get_device_status', {{'sn': S}})\n\
         agent_tools.call('fleet__list_devices', {{}})\n"
    );
    let started = e
        .request(
            "script.start",
            json!({"token": rig.token(&rig.snapshot("auto")), "code": code, "tools": [],
                   "description": ROW_FAKER}),
        )
        .unwrap();
    let id = started["script_id"].as_str().unwrap().to_string();
    held_rx
        .recv_timeout(Duration::from_secs(60))
        .expect("the script's second call");
    let mut figures = vec![];
    let mut check = |name: &str, o: &Output| {
        assert_eq!(o.status.code(), Some(0), "{name}: {}", text(&o.stderr));
        let out = text(&o.stdout);
        figures.push(format!("{name}: {:?}", count_hidden(&out)));
        out
    };
    let ps = check("ps", &rig.cli(["ps"]));
    let ps_json = rig.cli(["ps", "--json"]);
    go_tx.send(()).unwrap();
    let r = e.wait(&id);
    assert_eq!(r["status"], "ok", "{r}");
    let show = check("show", &rig.cli(["show", id.as_str()]));
    let calls = check("show --calls", &rig.cli(["show", id.as_str(), "--calls"]));
    let audit = check("audit", &rig.cli(["audit"]));
    let show_json = rig.cli(["show", id.as_str(), "--json"]);
    // Every figure first, then what each shows.
    // The output in `show` keeps its lines (the script printed a newline);
    // every other text is one line.
    let (fields, _) = show.split_once("--- script ---").unwrap_or((&show, ""));
    for (name, out, rows) in [
        ("ps", &ps, ps.as_str()),
        ("show", &show, fields),
        ("show --calls", &calls, calls.as_str()),
        ("audit", &audit, audit.as_str()),
    ] {
        assert!(
            rows.lines().all(|l| !l.starts_with("0000000000000000")),
            "{name}: a fake row ({figures:?}):\n{out}"
        );
        assert_clean(&format!("{name} ({figures:?})"), out);
    }
    let row = ps.lines().find(|l| l.starts_with(id.as_str())).unwrap();
    assert!(
        row.contains(&format!(" 1/2 {ROW_FAKER_SHOWN} ")),
        "ps: {ps}"
    );
    assert!(
        show.contains(&format!("\ndescription        {ROW_FAKER_SHOWN}\n")),
        "show: {show}"
    );
    // The output keeps its lines; the rest is escaped.
    let output_shown = ROW_FAKER_SHOWN.replace(r"\x0a", "\n");
    assert!(
        show.contains(&format!("\n{output_shown}\n")),
        "show: {show}"
    );
    assert!(
        show.contains("--- script ---\n   1 | import agent_tools\n"),
        "show: {show}"
    );
    assert!(calls.contains(&ROW_FAKER_SHOWN[..40]), "{calls}");
    // The description column: its first 40 characters, escaped.
    let described: String = ROW_FAKER.chars().take(40).collect();
    assert!(
        audit.contains(&format!("  {}\n", shown(&described))),
        "audit: {audit}"
    );
    // --json is exact.
    let v: Value = serde_json::from_slice(&show_json.stdout).unwrap();
    assert_eq!(v["description"], ROW_FAKER);
    let v: Value = serde_json::from_slice(&ps_json.stdout).unwrap();
    let listed = v["scripts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["script_id"] == id.as_str())
        .unwrap_or_else(|| panic!("{v}"))
        .clone();
    assert_eq!(listed["progress"]["message"], ROW_FAKER, "{listed}");
}
