//! The `turnwise` binary: parse, run, map errors to an exit code (see `cli`).

mod cli;

fn main() -> std::process::ExitCode {
    cli::main()
}
