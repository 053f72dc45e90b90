fn main() -> std::process::ExitCode {
    scriptgate::service::main()
}
