//! The producer, as a binary of this package so the tests can find it (`CARGO_BIN_EXE_test-producer`).
//! It is exactly `pdhost_producer::main`, which `pdhost __producer` also runs.

fn main() -> std::process::ExitCode {
    pdhost_producer::main(std::env::args_os().skip(1).collect())
}
