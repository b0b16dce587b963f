//! One module per command, and how every command writes its output.

pub mod backends;
pub mod bench;
pub mod check;
pub mod generate;
pub mod inspect;
pub mod kv_error;
pub mod models;
pub mod producer;
pub mod serve;

/// A failed write to standard output. `main` turns a closed stdout (`pdhost ... | head`) into a quiet exit
/// instead of an error, and never confuses it with a broken pipe elsewhere (a producer's socket).
#[derive(Debug, thiserror::Error)]
#[error("writing standard output: {0}")]
pub struct StdoutError(#[from] pub std::io::Error);

impl StdoutError {
    /// Whether the reader went away, which is not the user's problem to hear about.
    pub fn is_closed(&self) -> bool {
        self.0.kind() == std::io::ErrorKind::BrokenPipe
    }
}

/// `println!` that returns `Result<(), StdoutError>` instead of panicking on a closed stdout.
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        writeln!(std::io::stdout().lock(), $($arg)*).map_err($crate::cmd::StdoutError::from)
    }};
}
pub(crate) use outln;

/// `eprintln!` that ignores a closed stderr (there is nowhere left to say anything).
macro_rules! errln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr().lock(), $($arg)*);
    }};
}
pub(crate) use errln;
