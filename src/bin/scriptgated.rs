fn main() -> std::process::ExitCode {
    scriptgate::daemon_main()
}
