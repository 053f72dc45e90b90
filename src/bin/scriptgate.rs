fn main() -> std::process::ExitCode {
    scriptgate::cli_main()
}
