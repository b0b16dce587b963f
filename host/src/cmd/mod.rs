//! One module per command, and how every command writes its output.

pub mod backends;
pub mod bench;
pub mod check;
pub mod generate;
pub mod inspect;
pub mod kv_error;
pub mod models;
pub mod producer;
pub mod producer_node;
pub mod serve;

/// Runs a set-up step (a venv, a pip or uv install, a build) and returns its stdout; when it fails, the
/// error names the command, its status and its last line of stderr.
pub fn set_up(cmd: &mut std::process::Command) -> anyhow::Result<String> {
    use anyhow::Context as _;
    // The command as a shell would read it, not Rust's quoted debug form of each word.
    let what = std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|w| w.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ");
    let out = cmd.stdin(std::process::Stdio::null()).output().with_context(|| format!("running {what}"))?;
    anyhow::ensure!(
        out.status.success(),
        "{what} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr).lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("no output")
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

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
