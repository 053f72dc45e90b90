//! `scriptgate completions bash|zsh|fish`: the shell completion script, generated
//! from the command-line definition by clap_complete. The packages install its
//! output into the shells' standard completion directories.

use super::args::{Cli, Shell};
use clap::CommandFactory;
use std::io::Write;
use std::process::ExitCode;

/// The completion script for `shell`.
pub fn script(shell: Shell) -> Vec<u8> {
    let shell = match shell {
        Shell::Bash => clap_complete::Shell::Bash,
        Shell::Zsh => clap_complete::Shell::Zsh,
        Shell::Fish => clap_complete::Shell::Fish,
    };
    let mut cmd = Cli::command();
    let mut out = Vec::new();
    clap_complete::generate(shell, &mut cmd, "scriptgate", &mut out);
    out
}

pub fn print(shell: Shell) -> ExitCode {
    let mut stdout = std::io::stdout().lock();
    match stdout
        .write_all(&script(shell))
        .and_then(|()| stdout.flush())
    {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("scriptgate completions: cannot write to stdout: {e}");
            ExitCode::from(super::exit::ERROR)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each script is the shell's own syntax and completes the real subcommands.
    #[test]
    fn each_shell_completes_the_subcommands() {
        let bash = String::from_utf8(script(Shell::Bash)).unwrap();
        assert!(bash.contains("complete -F _scriptgate"), "{bash}");
        let zsh = String::from_utf8(script(Shell::Zsh)).unwrap();
        assert!(zsh.starts_with("#compdef scriptgate"), "{zsh}");
        let fish = String::from_utf8(script(Shell::Fish)).unwrap();
        assert!(fish.contains("complete -c scriptgate"), "{fish}");
        for s in [&bash, &zsh, &fish] {
            for sub in ["run", "audit", "status", "completions"] {
                assert!(s.contains(sub), "{sub} missing");
            }
        }
    }
}
