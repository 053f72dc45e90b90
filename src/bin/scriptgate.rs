// The binaries are shims: every unsafe operation lives in the library's sys module (src/sys/).
#![forbid(unsafe_code)]

fn main() -> std::process::ExitCode {
    // The sandbox's hidden helper modes come first: bwrap runs this binary as
    // PID 1 (the init), and the pool's mount helper is this binary too.
    if let Some(status) = scriptgate::sandbox_helper_main() {
        std::process::exit(status);
    }
    scriptgate::cli_main()
}
