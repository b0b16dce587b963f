//! The standalone producer executable. `pdhost` runs the same code as a subcommand of itself, so a host
//! and its producers always come from one build; this binary is for backend authors who want to run a
//! producer under a debugger or strace (see `docs/plugin-abi.md`).

fn main() -> std::process::ExitCode {
    pdhost_producer::main(std::env::args_os().skip(1).collect())
}
