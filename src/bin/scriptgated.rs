// The binaries are shims: every unsafe operation lives in the library's sys.rs.
#![forbid(unsafe_code)]

fn main() -> std::process::ExitCode {
    scriptgate::daemon_main()
}
