//! Choosing and configuring a producer from command-line flags (`generate`, `bench pd`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use model::identity::ModelIdentity;
use pdhost::request::{Field, Invalid};
use pdhost::supervisor::{self, Producer, ProducerSpec, RestartPolicy};
use shm_format::Dtype;

use crate::cli::PrecisionArg;

/// The least time the `torch` backend gets to start.
const TORCH_START_TIMEOUT: Duration = Duration::from_secs(600);

/// The flags that pick and configure a producer.
#[derive(Debug, Clone)]
pub struct Choice<'a> {
    /// `local`, `rngd`, `gpu`, `faulty`, `torch`, `py:MODULE:CLASS` or a library path.
    pub producer: &'a str,
    /// What named it, for errors: `--producer`, or check-backend's `BACKEND`.
    pub field: Field,
    /// Merged into the backend's configuration (checked by `request::input::check_backend_config`).
    pub backend_config: serde_json::Map<String, serde_json::Value>,
    /// Arithmetic.
    pub precision: PrecisionArg,
    /// Forward-pass threads (checked).
    pub threads: usize,
    /// Deadline for start-up and for each request (checked).
    pub timeout: Duration,
    /// The producer's seccomp filters.
    pub sandbox: bool,
    /// Its memory cap in bytes ([`memory_limit`]).
    pub memory_limit: u64,
    /// How often a failed producer is restarted.
    pub restart: RestartPolicy,
}

/// `--producer-memory` in bytes: at least 64 MiB and at most this machine's memory; by default half of it.
pub fn memory_limit(mib: Option<u64>) -> Result<u64, Invalid> {
    let total = rustix::system::sysinfo();
    let total_mib = (total.totalram as u64 * u64::from(total.mem_unit)) >> 20;
    let mib = match mib {
        None => total_mib / 2,
        Some(m) => {
            let max = total_mib.max(64);
            pdhost::request::check_count(Field::ProducerMemory, m, 64, max)
                .map_err(|e| Invalid { expected: format!("64 to {max} MiB (this machine's memory)"), ..e })?
        }
    };
    Ok(mib << 20)
}

/// `py:MODULE:CLASS` split into a dotted module path and a class name, both Python identifiers.
fn python_class(producer: &str, field: Field) -> Result<(String, String), Invalid> {
    let identifier = |s: &str| {
        s.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
    };
    let rest = producer.strip_prefix("py:").unwrap_or(producer);
    match rest.split_once(':') {
        Some((module, class)) if module.split('.').all(identifier) && identifier(class) => {
            Ok((module.to_string(), class.to_string()))
        }
        _ => Err(Invalid::new(
            field,
            "py:MODULE:CLASS (a Python module path and a class in it)",
            format_args!("{producer:?}"),
        )),
    }
}

/// A backend library named by path, for `field`: its name (the file stem) and its absolute path; refused
/// unless it is an ELF file, with what is there instead (the host never loads it: its producer does, and
/// a file that is no library would only fail there, as a producer fault).
pub fn library(path: &str, field: Field) -> anyhow::Result<(String, PathBuf)> {
    let p = PathBuf::from(path);
    if !p.is_file() {
        let found = match std::fs::metadata(&p) {
            Ok(meta) => format!("{path}: {}", pdhost::request::input::describe(&meta)),
            Err(_) => format!("{path}: nothing there"),
        };
        return Err(Invalid::new(field, "a backend library file", found).into());
    }
    let mut magic = [0u8; 4];
    match pdhost::request::input::read_start(&p, &mut magic) {
        Ok(4) if &magic == b"\x7fELF" => {}
        Ok(n) => {
            let found = match n {
                0 => format!("{path}: an empty file"),
                n => format!("{path}: a file starting with {}", shm_format::words::bytes(&magic[..n])),
            };
            return Err(Invalid::new(field, "a backend library (an ELF shared object)", found).into());
        }
        Err(e) => return Err(Invalid::new(field, "a readable backend library", format_args!("{path}: {e}")).into()),
    }
    let name = p.file_stem().map_or_else(|| path.to_string(), |s| s.to_string_lossy().into_owned());
    Ok((name, std::path::absolute(p)?))
}

/// What a producer's ring holds: `slots` spans of up to `span_tokens` tokens each.
#[derive(Debug, Clone, Copy)]
pub struct Ring {
    pub span_tokens: usize,
    pub slots: u32,
}

impl Ring {
    /// Two slots of `span_tokens`: the backend writes a span while the host takes the one before.
    pub fn double(span_tokens: usize) -> Self {
        Ring { span_tokens, slots: 2 }
    }
}

/// The backend a [`Choice`] names, found before the model is opened, so that a misspelled name, a missing
/// library or a build without NIXL is refused before anything slow runs: how its producer is run.
#[derive(Debug, Clone)]
pub struct Backend {
    /// The producer's name (logs, metrics, a response's `pdhost.producer`).
    name: String,
    /// The library its producer loads.
    library: PathBuf,
    /// What the pdhost executable is run with to be that producer (or its relay).
    program_args: Vec<std::ffi::OsString>,
    /// A Python backend's module, class and paths, for its config.
    python_keys: serde_json::Map<String, serde_json::Value>,
}

impl Choice<'_> {
    /// The backend these flags name, or `None` for `local`; refused (naming [`Choice::field`]) unless it is
    /// one: a built-in, `py:MODULE:CLASS`, an ELF library, or `nixl://` in a build with NIXL. `torch`'s
    /// Python environment is made here on first use, and NIXL's runtime fetched.
    pub fn backend(&self) -> anyhow::Result<Option<Backend>> {
        let mut python_keys = serde_json::Map::new();
        let mut program_args = vec![crate::PRODUCER_ARG.into()];
        let (name, library) = match self.producer {
            "local" => return Ok(None),
            url if url.starts_with("nixl://") => {
                let node = pdhost::remote::NodeUrl::parse(url).ok_or_else(|| {
                    Invalid::new(self.field, pdhost::remote::NodeUrl::EXPECTED, format_args!("{url:?}"))
                })?;
                relay(&node, self.field)?;
                program_args = vec![crate::RELAY_ARG.into(), "--node".into(), node.addr.clone().into()];
                (format!("{}@{}", node.backend, node.addr), PathBuf::from(&node.backend))
            }
            builtin @ ("rngd" | "gpu" | "faulty") => (builtin.to_string(), supervisor::builtin_backend(builtin)?),
            "torch" => {
                // A Python class too, in an environment of its own, made on first use.
                let env = super::backends::torch(false)?;
                python_keys.insert("python_module".into(), "pdhost_torch".into());
                python_keys.insert("python_class".into(), "TorchBackend".into());
                let path = [&env.module_dir, &env.site_packages].map(|p| p.display().to_string());
                python_keys.insert("python_path".into(), path.to_vec().into());
                python_keys.insert("cache_dir".into(), env.checkpoints.display().to_string().into());
                ("torch".to_string(), supervisor::builtin_backend("python")?)
            }
            python if python.starts_with("py:") => {
                let (module, class) = python_class(python, self.field)?;
                python_keys.insert("python_module".into(), module.into());
                python_keys.insert("python_class".into(), class.into());
                (python.to_string(), supervisor::builtin_backend("python")?)
            }
            path if path.ends_with(".so") || path.contains('/') => library(path, self.field)?,
            other => {
                return Err(Invalid::new(
                    self.field,
                    "local, rngd, gpu, faulty, torch, py:MODULE:CLASS, a PATH.so or nixl://HOST:PORT/NAME",
                    format_args!("{other:?}"),
                )
                .into())
            }
        };
        Ok(Some(Backend { name, library, program_args, python_keys }))
    }

    /// The producer (not started yet) of `backend` ([`Choice::backend`]) for the model at `model_path`
    /// with configuration `model`. Its spans carry `dtype` (the cache's, so remote prefill stays
    /// bit-identical to local) unless the backend config says otherwise, and its ring holds `ring`. A
    /// backend that reports another model identity than `identity` is refused at its handshake.
    pub fn producer(
        &self,
        backend: &Backend,
        model_path: &Path,
        model: &model::arch::Config,
        identity: &ModelIdentity,
        dtype: Dtype,
        ring: Ring,
    ) -> anyhow::Result<Producer> {
        let geometry = &model.kv_geometry();
        let mut config = serde_json::json!({
            "model": model_path,
            // Which head dimensions rope rotates together, so which order K's head dims are in.
            "rope_pairs": if model.rope_adjacent { "adjacent" } else { "halves" },
            "dtype": dtype.name(),
            "precision": match self.precision {
                PrecisionArg::Exact => "exact",
                PrecisionArg::Fast => "fast",
            },
            "threads": self.threads,
        });
        config.as_object_mut().expect("an object").extend(backend.python_keys.clone());
        config.as_object_mut().expect("an object").extend(self.backend_config.clone());
        let timeout = self.timeout;
        let spec = ProducerSpec {
            name: backend.name.clone(),
            program: std::env::current_exe().context("locating the pdhost executable to run the producer")?,
            program_args: backend.program_args.clone(),
            backend: backend.library.clone(),
            config: config.to_string(),
            slots: ring.slots,
            // The widest wire dtype: a backend may send f32 whatever the cache holds.
            slot_capacity: ProducerSpec::capacity_for(geometry, Dtype::F32, ring.span_tokens as u64),
            // torch's first start on a GGUF dequantizes it (50 s for Gemma 3 270M here, minutes on a busy
            // machine); it still has a deadline.
            start_timeout: if self.producer == "torch" { timeout.max(TORCH_START_TIMEOUT) } else { timeout },
            request_timeout: timeout,
            restart: self.restart,
            sandbox: self.sandbox,
            memory_limit: Some(self.memory_limit),
            identity: Some(identity.to_string()),
        };
        Ok(Producer::new(spec, geometry.clone()))
    }
}

/// A producer on another machine needs this build to run its relay: NIXL's runtime, fetched now (as a
/// model is) so that the relay's start does not wait for it.
#[cfg(feature = "nixl")]
fn relay(_: &pdhost::remote::NodeUrl, _: Field) -> anyhow::Result<()> {
    pdhost_nixl::Runtime::fetch(&model::registry::home()).context("fetching NIXL's runtime for the relay")?;
    Ok(())
}

#[cfg(not(feature = "nixl"))]
fn relay(_: &pdhost::remote::NodeUrl, field: Field) -> anyhow::Result<()> {
    Err(without_nixl(field).into())
}

/// What a build without the `nixl` feature says to a flag that needs it.
#[cfg(not(feature = "nixl"))]
pub fn without_nixl(field: Field) -> Invalid {
    Invalid::new(
        field,
        "a pdhost built with the nixl feature for producers on other machines (cargo build --release --features nixl)",
        "a build without it",
    )
}
