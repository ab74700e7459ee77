//! The `cp-hicache` binary: parse, run, map the outcome to an exit status
//! (0 success, 1 failure, 2 usage or input error).

use clap::Parser;
use std::io::IsTerminal;
use std::process::ExitCode;

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let cli = cp_hicache::cli::Cli::parse();
    match cp_hicache::cli::run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e}");
            if e.is_usage() {
                ExitCode::from(2)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}
