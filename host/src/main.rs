//! The `pdhost` binary.

mod cli;
mod cmd;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = cli::Cli::parse();
    let result = match cli.command {
        cli::Command::InspectSpan(args) => cmd::inspect::run(&args),
        cli::Command::Bench(args) => cmd::bench::run(&args),
        cli::Command::Models(args) => cmd::models::run(&args),
        cli::Command::Generate(args) => cmd::generate::run(&args),
    };
    match result {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}
