//! The `pdhost` binary.

mod cli;
mod cmd;

use std::process::ExitCode;

use clap::Parser;

/// The hidden first argument that makes this binary a producer (see `pdhost_producer`): a host always
/// starts producers from its own executable, so both sides of the control protocol come from one build.
pub const PRODUCER_ARG: &str = "__producer";

fn main() -> ExitCode {
    let mut args = std::env::args_os();
    if args.nth(1).is_some_and(|a| a == PRODUCER_ARG) {
        return pdhost_producer::main(args.collect());
    }
    pdhost_producer::keep_freed_memory();
    pdhost::supervisor::harden_host();
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
            eprintln!("error: {}", one_line(&err));
            ExitCode::FAILURE
        }
    }
}

/// The error and its causes on one line, skipping a cause whose text the line already holds (library
/// errors often show their source in their own message too).
fn one_line(err: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in err.chain() {
        let text = cause.to_string();
        if !line.contains(&text) {
            if !line.is_empty() {
                line.push_str(": ");
            }
            line.push_str(&text);
        }
    }
    line.replace('\n', " ")
}
