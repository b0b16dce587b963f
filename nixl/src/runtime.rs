//! NIXL's runtime: the `nixl-cu12` wheel, fetched with pip, verified by sha256, unpacked once.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

/// The wheel that carries the runtime, as pip is asked for it.
pub const REQUIREMENT: &str = "nixl-cu12==1.5.1";
/// The sha256 of that wheel for CPython 3.11 on manylinux 2.28, x86-64 (the one pip is asked for,
/// whatever Python runs pip): 68,631,568 bytes.
pub const WHEEL_SHA256: &str = "341d0dfa499f941c054614252f1d8047d1380e33f29c87707372ff5ec7d3779a";
/// The directories of the wheel that are kept, in the wheel's own layout, so that the libraries'
/// RPATHs (`$ORIGIN/../nixl_cu12.libs`) and NIXL's default plugin directory (beside `libnixl.so`)
/// resolve: NIXL with its plugins, and the UCX and other libraries they link.
const KEPT: [&str; 2] = [".nixl_cu12.mesonpy.libs/", "nixl_cu12.libs/"];
/// Where the C API lies in the unpacked runtime.
const CAPI: &str = ".nixl_cu12.mesonpy.libs/libnixl_capi.so";
/// Written last into a complete runtime directory: the sha256 of the wheel it came from.
const VERIFIED: &str = ".verified-sha256";

/// Why the runtime could not be had.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// pip did not run or failed.
    #[error("`pip download {REQUIREMENT}` failed (is the Python package registry reachable?): {0}")]
    Pip(String),
    /// The wheel is not the pinned one.
    #[error("{wheel}: expected sha256 {WHEEL_SHA256}, found {found}")]
    Checksum {
        /// The wheel's file name.
        wheel: String,
        /// Its sha256.
        found: String,
    },
    /// The wheel could not be read as a zip archive, or lacks the C API.
    #[error("{wheel}: expected a wheel holding {CAPI}, found {found}")]
    Wheel {
        /// The wheel's file name.
        wheel: String,
        /// What was wrong.
        found: String,
    },
    /// A file operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// Why it failed.
        #[source]
        source: std::io::Error,
    },
    /// The dynamic loader refused the C API.
    #[error("loading {path}: {reason}")]
    Load {
        /// The library.
        path: String,
        /// `dlerror`'s words.
        reason: String,
    },
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> RuntimeError {
    let what = what.into();
    move |source| RuntimeError::Io { what, source }
}

/// An unpacked, verified NIXL runtime.
#[derive(Debug, Clone)]
pub struct Runtime {
    dir: PathBuf,
}

impl Runtime {
    /// The runtime under `home` (`$PDHOST_HOME`): fetched, verified and unpacked first if it is not
    /// there whole. Stopped half-way, a fetch leaves only a scratch directory that the next one removes.
    pub fn fetch(home: &Path) -> Result<Runtime, RuntimeError> {
        // One fetch at a time in this process; another process's is told apart by its scratch name.
        static FETCHING: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _one = FETCHING.lock().unwrap_or_else(|e| e.into_inner());
        let root = home.join("nixl");
        let dir = root.join("nixl-cu12-1.5.1");
        if std::fs::read_to_string(dir.join(VERIFIED)).is_ok_and(|s| s.trim() == WHEEL_SHA256) {
            return Ok(Runtime { dir });
        }
        std::fs::create_dir_all(&root).map_err(io(format!("creating {}", root.display())))?;
        // Scratch directories of fetches that were stopped: their process is gone.
        for entry in std::fs::read_dir(&root).map_err(io(format!("reading {}", root.display())))?.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.strip_prefix(".fetch-").is_some_and(|pid| !Path::new("/proc").join(pid).exists()) {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
        let scratch = root.join(format!(".fetch-{}", std::process::id()));
        let result = fetch_into(&scratch).and_then(|unpacked| {
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::rename(&unpacked, &dir).map_err(io(format!("moving the runtime to {}", dir.display())))
        });
        let _ = std::fs::remove_dir_all(&scratch);
        result.map(|()| Runtime { dir })
    }

    /// The unpacked runtime's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Loads NIXL's C API into this process, once, so that nixl-sys (built as a stub that opens
    /// `libnixl_capi.so` by name at its first call) finds it already loaded, whatever
    /// `LD_LIBRARY_PATH` says. Only the processes that run transfers call this.
    pub fn load(&self) -> Result<(), RuntimeError> {
        let path = self.dir.join(CAPI);
        let c_path = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).map_err(|_| RuntimeError::Load {
            path: path.display().to_string(),
            reason: "a path with a NUL byte".into(),
        })?;
        // SAFETY: dlopen with a valid C string; the handle is kept for the life of the process (never
        // closed), so no code from it is unmapped while in use. Its initialisers are NIXL's own.
        let handle = unsafe { libc::dlopen(c_path.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        if handle.is_null() {
            // SAFETY: dlerror returns null or a C string valid until the next dl call on this thread.
            let reason = unsafe {
                let e = libc::dlerror();
                if e.is_null() {
                    "no reason given".to_string()
                } else {
                    std::ffi::CStr::from_ptr(e).to_string_lossy().into_owned()
                }
            };
            return Err(RuntimeError::Load { path: path.display().to_string(), reason });
        }
        Ok(())
    }
}

/// Downloads the pinned wheel into `scratch`, verifies it and unpacks the kept directories; returns the
/// unpacked directory, marked verified.
fn fetch_into(scratch: &Path) -> Result<PathBuf, RuntimeError> {
    let wheels = scratch.join("wheel");
    // The platform and interpreter are given, so the same wheel (and sha256) comes whatever Python runs
    // pip: only its libraries are used, never its Python modules.
    let out = Command::new("python3")
        .args(["-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "--quiet"])
        .args(["--only-binary=:all:", "--platform", "manylinux_2_28_x86_64", "--python-version", "3.11"])
        .args(["--implementation", "cp", "--abi", "cp311", "--dest"])
        .arg(&wheels)
        .arg(REQUIREMENT)
        .output()
        .map_err(|e| RuntimeError::Pip(format!("python3: {e}")))?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        return Err(RuntimeError::Pip(stderr.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("").into()));
    }
    let wheel = std::fs::read_dir(&wheels)
        .map_err(io(format!("reading {}", wheels.display())))?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| RuntimeError::Pip("no wheel downloaded".into()))?;
    let name = wheel.file_name().unwrap_or_default().to_string_lossy().into_owned();
    let mut file = std::fs::File::open(&wheel).map_err(io(format!("opening {name}")))?;
    let mut sha = Sha256::new();
    std::io::copy(&mut file, &mut sha).map_err(io(format!("reading {name}")))?;
    let found: String = sha.finalize().iter().map(|b| format!("{b:02x}")).collect();
    if found != WHEEL_SHA256 {
        return Err(RuntimeError::Checksum { wheel: name, found });
    }
    let unpacked = scratch.join("runtime");
    let bad = |found: String| RuntimeError::Wheel { wheel: name.clone(), found };
    let file = std::fs::File::open(&wheel).map_err(io(format!("opening {name}")))?;
    let mut archive = zip::ZipArchive::new(file).map_err(|e| bad(e.to_string()))?;
    for i in 0..archive.len() {
        let mut entry = archive.by_index(i).map_err(|e| bad(e.to_string()))?;
        // `enclosed_name` refuses absolute paths and `..`: nothing lands outside the runtime directory.
        let Some(relative) = entry.enclosed_name() else { return Err(bad(format!("the entry {:?}", entry.name()))) };
        let kept = KEPT.iter().any(|k| relative.to_string_lossy().starts_with(k));
        if !kept || entry.is_dir() {
            continue;
        }
        let target = unpacked.join(&relative);
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent).map_err(io(format!("creating {}", parent.display())))?;
        }
        let mut out = std::fs::File::create(&target).map_err(io(format!("creating {}", target.display())))?;
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = entry.read(&mut buf).map_err(io(format!("unpacking {}", relative.display())))?;
            if n == 0 {
                break;
            }
            out.write_all(&buf[..n]).map_err(io(format!("writing {}", target.display())))?;
        }
    }
    if !unpacked.join(CAPI).is_file() {
        return Err(bad("no such file".into()));
    }
    std::fs::write(unpacked.join(VERIFIED), WHEEL_SHA256).map_err(io("marking the runtime verified"))?;
    Ok(unpacked)
}
