//! `pdhost producer-node`: the prefill side of a producer on another machine (`pdhost::remote`).

use std::process::ExitCode;

use pdhost::request::{self, input, Field, Invalid};

use crate::cli::ProducerNodeArgs;

pub fn run(args: &ProducerNodeArgs) -> anyhow::Result<ExitCode> {
    let timeout = request::check_timeout(Field::ProducerTimeout, args.producer_timeout)?;
    let backend_config = input::check_backend_config(args.backend_config.as_deref(), &args.backend)?;
    let memory_limit = super::producer::memory_limit(args.producer_memory)?;
    let (name, backend) = match args.backend.as_str() {
        builtin @ ("rngd" | "gpu" | "faulty") => (builtin.to_string(), pdhost::supervisor::builtin_backend(builtin)?),
        path if path.ends_with(".so") || path.contains('/') => super::producer::library(path, Field::Backend)?,
        other => {
            return Err(Invalid::new(Field::Backend, "rngd, gpu, faulty or a PATH.so", format_args!("{other:?}")).into())
        }
    };
    serve(args, name, backend, backend_config, memory_limit, timeout)
}

#[cfg(feature = "nixl")]
fn serve(
    args: &ProducerNodeArgs,
    name: String,
    backend: std::path::PathBuf,
    backend_config: serde_json::Map<String, serde_json::Value>,
    memory_limit: u64,
    timeout: std::time::Duration,
) -> anyhow::Result<ExitCode> {
    use anyhow::Context;
    // First, while this is the only thread: UCX reads these variables when it loads.
    let protocols = pdhost_nixl::ProtoLog::capture().context("capturing UCX's protocol report")?;
    // The runtime before the first relay arrives: a first fetch takes a while, and a failed one is
    // better said now.
    pdhost_nixl::Runtime::fetch(&model::registry::home()).context("fetching NIXL's runtime")?;
    let listener = std::net::TcpListener::bind(&args.listen).map_err(|e| {
        Invalid::new(Field::Listen, "an address this machine can listen on", format_args!("{}: {e}", args.listen))
    })?;
    let addr = listener.local_addr()?;
    let config = pdhost::remote::node::NodeConfig {
        name: name.clone(),
        backend,
        backend_config,
        program: std::env::current_exe().context("locating the pdhost executable to run producers")?,
        program_args: vec![crate::PRODUCER_ARG.into()],
        sandbox: args.sandbox == crate::cli::Switch::On,
        memory_limit: Some(memory_limit),
        timeout,
        fault: args.fault,
        protocols: protocols.map(std::sync::Arc::new),
    };
    super::outln!("listening on {addr} (backend {name}; hosts use --producer nixl://{addr}/{name})")?;
    use std::io::Write;
    std::io::stdout().flush()?;
    pdhost::remote::node::serve(listener, config)?;
    Ok(ExitCode::SUCCESS)
}

#[cfg(not(feature = "nixl"))]
fn serve(
    _: &ProducerNodeArgs,
    _: String,
    _: std::path::PathBuf,
    _: serde_json::Map<String, serde_json::Value>,
    _: u64,
    _: std::time::Duration,
) -> anyhow::Result<ExitCode> {
    Err(super::producer::without_nixl(Field::Backend).into())
}
