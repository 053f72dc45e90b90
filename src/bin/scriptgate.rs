fn main() -> std::process::ExitCode {
    scriptgate::cli::main()
}
