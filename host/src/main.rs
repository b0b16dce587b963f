//! The `pdhost` binary.

mod cli;
mod cmd;

use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches};

/// The hidden first argument that makes this binary a producer (see `pdhost_producer`): a host always
/// starts producers from its own executable, so both sides of the control protocol come from one build.
pub const PRODUCER_ARG: &str = "__producer";
/// The hidden first argument that makes this binary the relay of a producer on another machine
/// (`pdhost::remote::relay`), which the supervisor starts in a local producer's place.
pub const RELAY_ARG: &str = "__relay";

fn main() -> ExitCode {
    let mut args = std::env::args_os();
    match args.nth(1) {
        Some(a) if a == PRODUCER_ARG => return pdhost_producer::main(args.collect()),
        #[cfg(feature = "nixl")]
        Some(a) if a == RELAY_ARG => return pdhost::remote::relay::main(args.collect()),
        _ => {}
    }
    pdhost_producer::keep_freed_memory();
    if let Err(e) = pdhost::supervisor::harden_host() {
        cmd::errln!("error: making the host non-dumpable (prctl PR_SET_DUMPABLE 0): {e}");
        return ExitCode::FAILURE;
    }
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if let Err(refusal) = cli::free_text_values(&args) {
        cmd::errln!("error: {refusal} (see --help)");
        return ExitCode::from(2);
    }
    let parsed = cli::Cli::command()
        .try_get_matches_from(args)
        .and_then(|matches| cli::Cli::from_arg_matches(&matches).map(|cli| (cli, matches)));
    let cli = match parsed {
        Ok((cli, matches)) => match cli::unused_without_producer(&cli, &matches)
            .map_err(|invalid| invalid.to_string())
            .and_then(|()| cli::needed_flags(&matches))
            .and_then(|()| cli::distinct_cases(&matches))
        {
            Ok(()) => cli,
            Err(refusal) => {
                cmd::errln!("error: {refusal}");
                return ExitCode::from(2);
            }
        },
        // `pdhost` or `pdhost models` alone: the help, as clap shows it, is the useful answer.
        Err(e) if e.kind() == clap::error::ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            let _ = e.print();
            return ExitCode::from(2);
        }
        Err(e) if !e.use_stderr() => {
            // --help and --version: clap prints them; a closed stdout is not worth a panic.
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            // One line, like every other refusal: clap's first line names the flag, the value and why;
            // its tips (a similar flag, `--` before a value that starts with `-`) join it.
            let text = e.render().to_string();
            let line: Vec<String> = text
                .lines()
                .map(str::trim)
                .take_while(|l| !l.starts_with("Usage:") && !l.starts_with("For more information"))
                .filter(|l| !l.is_empty())
                .map(|l| if l.starts_with("tip:") { format!("({l})") } else { l.to_string() })
                .collect();
            cmd::errln!("{} (see --help)", line.join(" "));
            return ExitCode::from(2);
        }
    };
    // Logs go to stderr: a server's request lines, and for every command its producers' output and
    // warnings. `RUST_LOG` overrides the level.
    // A server's lines carry the time; a one-shot command's do not.
    let serving = matches!(cli.command, cli::Command::Serve(_) | cli::Command::ProducerNode(_));
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| if serving { "info" } else { "warn" }.into());
    let logs = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(filter)
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    if serving {
        logs.init();
    } else {
        logs.without_time().init();
    }
    let result = match cli.command {
        cli::Command::InspectSpan(args) => cmd::inspect::run(&args),
        cli::Command::Bench(args) => cmd::bench::run(&args),
        cli::Command::Models(args) => cmd::models::run(&args),
        cli::Command::Backends(args) => cmd::backends::run(&args),
        cli::Command::Generate(args) => cmd::generate::run(&args),
        cli::Command::CheckBackend(args) => cmd::check::run(&args),
        cli::Command::Serve(args) => cmd::serve::run(&args),
        cli::Command::ProducerNode(args) => cmd::producer_node::run(&args),
    };
    match result {
        Ok(code) => code,
        // The reader of our output went away (`| head`): nothing is wrong, and nothing is left to say.
        Err(err) if err.downcast_ref::<cmd::StdoutError>().is_some_and(cmd::StdoutError::is_closed) => {
            ExitCode::SUCCESS
        }
        // A parameter out of bounds is a usage error, as clap's own are.
        Err(err) if err.downcast_ref::<pdhost::request::Invalid>().is_some() => {
            cmd::errln!("error: {}", one_line(&err));
            ExitCode::from(2)
        }
        Err(err) => {
            cmd::errln!("error: {}", one_line(&err));
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
