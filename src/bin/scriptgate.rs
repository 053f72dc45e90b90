// The binaries are shims: every unsafe operation lives in the library's sys module (src/sys/).
#![forbid(unsafe_code)]

fn main() -> std::process::ExitCode {
    // The hidden sandbox-init mode comes first: bwrap runs this binary as PID 1.
    if let Some(status) = scriptgate::sandbox_init_main() {
        std::process::exit(status);
    }
    scriptgate::cli_main()
}
