//! Choosing and configuring a producer from command-line flags (`generate`, `bench pd`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use pdhost::supervisor::{self, Producer, ProducerSpec, RestartPolicy};
use shm_format::{Dtype, KvGeometry};

/// The flags that pick and configure a producer.
#[derive(Debug)]
pub struct Choice<'a> {
    /// `local`, `rngd`, `gpu`, `faulty` or a library path.
    pub producer: &'a str,
    /// JSON merged into the backend's configuration.
    pub backend_config: &'a str,
    /// `exact` or `fast`.
    pub precision: &'a str,
    /// Forward-pass threads.
    pub threads: usize,
    /// Deadline for start-up and for each request, in seconds.
    pub timeout_s: f64,
}

impl Choice<'_> {
    /// The producer these flags name (not started yet), or `None` for `local`. Its spans carry `dtype`
    /// (the cache's, so remote prefill stays bit-identical to local) unless the backend config says
    /// otherwise, and hold up to `chunk_tokens` tokens.
    pub fn producer(
        &self,
        model_path: &Path,
        geometry: &KvGeometry,
        dtype: Dtype,
        chunk_tokens: usize,
    ) -> anyhow::Result<Option<Producer>> {
        let (name, backend) = match self.producer {
            "local" => return Ok(None),
            builtin @ ("rngd" | "gpu" | "faulty") => {
                (builtin.to_string(), supervisor::builtin_backend(builtin).map_err(anyhow::Error::msg)?)
            }
            path if path.ends_with(".so") || path.contains('/') => {
                let p = PathBuf::from(path);
                anyhow::ensure!(p.is_file(), "--producer {path}: expected a backend library file, found none");
                let name = p.file_stem().map_or_else(|| path.to_string(), |s| s.to_string_lossy().into_owned());
                (name, std::path::absolute(p)?)
            }
            other => anyhow::bail!("--producer: expected local, rngd, gpu, faulty or a PATH.so, found {other:?}"),
        };
        let mut config = serde_json::json!({
            "model": model_path,
            "dtype": dtype.name(),
            "precision": self.precision,
            "threads": self.threads,
        });
        let extra: serde_json::Value = serde_json::from_str(self.backend_config)
            .with_context(|| format!("--backend-config: expected a JSON object, found {:?}", self.backend_config))?;
        let serde_json::Value::Object(extra) = extra else {
            anyhow::bail!("--backend-config: expected a JSON object, found {}", self.backend_config);
        };
        config.as_object_mut().expect("an object").extend(extra);
        anyhow::ensure!(
            self.timeout_s.is_finite() && self.timeout_s > 0.0,
            "--producer-timeout: expected seconds above 0, found {}",
            self.timeout_s
        );
        let timeout = Duration::from_secs_f64(self.timeout_s);
        let spec = ProducerSpec {
            name,
            program: std::env::current_exe().context("locating the pdhost executable to run the producer")?,
            program_args: vec![crate::PRODUCER_ARG.into()],
            backend,
            config: config.to_string(),
            slots: 2,
            // The widest wire dtype: a backend may send f32 whatever the cache holds.
            slot_capacity: ProducerSpec::capacity_for(geometry, Dtype::F32, chunk_tokens as u64),
            start_timeout: timeout,
            request_timeout: timeout,
            restart: RestartPolicy::default(),
        };
        Ok(Some(Producer::new(spec, geometry.clone())))
    }
}
