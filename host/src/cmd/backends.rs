//! `pdhost backends list|fetch NAME`: the environments of backends that need more than pdhost itself. Today
//! that is `torch`: a Python virtual environment under `$PDHOST_HOME/backends/torch` with torch,
//! transformers, gguf and numpy pinned by hash (`plugins/torch/requirements.txt`), made once, the way
//! models are fetched once. `--producer torch` makes it on first use.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use anyhow::Context;
use serde_json::json;

use super::models::Bar;
use super::{errln, outln, set_up};
use crate::cli::{BackendsAction, BackendsArgs};

/// The torch backend's Python module, written into its environment (`plugins/torch/pdhost_torch.py`).
const TORCH_MODULE: &str = include_str!("../../../plugins/torch/pdhost_torch.py");
/// Every package of the environment with its version and hashes.
const TORCH_REQUIREMENTS: &str = include_str!("../../../plugins/torch/requirements.txt");
/// The installer, from the Python package registry: it installs the 3 GB of torch several times faster
/// than pip.
const UV: &str = "uv==0.13.9";
/// The Python the environment is made with: the embedded interpreter's (`plugins/python`).
const PYTHON: &str = "3.11";

/// The known backend environments.
const NAMES: &[(&str, &str)] =
    &[("torch", "torch 2.15.0 + transformers 5.24.0 on CPU (or CUDA), for --producer torch; about 5 GB")];

/// A ready torch environment.
#[derive(Debug)]
pub struct TorchEnv {
    /// The virtual environment.
    pub dir: PathBuf,
    /// Where `pdhost_torch` is.
    pub module_dir: PathBuf,
    /// The environment's packages.
    pub site_packages: PathBuf,
    /// Where the backend keeps GGUF checkpoints it dequantized (outside `dir`: a new environment keeps them).
    pub checkpoints: PathBuf,
}

fn torch_dir() -> PathBuf {
    model::registry::home().join("backends/torch")
}

/// What marks a complete environment: the digest of what was installed into it.
fn stamp() -> String {
    format!("{:016x}", twox_hash::XxHash3_64::oneshot(TORCH_REQUIREMENTS.as_bytes()))
}

fn is_ready(dir: &Path) -> bool {
    std::fs::read_to_string(dir.join("pdhost-env")).is_ok_and(|s| s.trim() == stamp())
}

/// The torch environment, made first if it is not there (a spinner on a terminal unless `quiet`).
/// Concurrent callers wait on a lock for the one that installs.
pub fn torch(quiet: bool) -> anyhow::Result<TorchEnv> {
    let dir = torch_dir();
    let env = TorchEnv {
        module_dir: dir.join("pdhost"),
        site_packages: dir.join(format!("lib/python{PYTHON}/site-packages")),
        checkpoints: model::registry::home().join("backends/torch-checkpoints"),
        dir,
    };
    if !is_ready(&env.dir) {
        let parent = env.dir.parent().expect("a parent");
        std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
        let lock = std::fs::File::create(parent.join(".torch.lock")).context("creating the install lock")?;
        rustix::fs::flock(&lock, rustix::fs::FlockOperation::LockExclusive).context("waiting for the install lock")?;
        if !is_ready(&env.dir) {
            install(&env.dir, quiet)?;
        }
    }
    write_if_changed(&env.module_dir.join("pdhost_torch.py"), TORCH_MODULE)?;
    Ok(env)
}

fn install(dir: &Path, quiet: bool) -> anyhow::Result<()> {
    let bar = Bar::new(quiet);
    let started = std::time::Instant::now();
    let found = set_up(Command::new("python3").args(["-c", "import sys; print('%d.%d' % sys.version_info[:2])"]))
        .context("the torch backend needs python3 (3.11, the interpreter pdhost embeds)")?;
    anyhow::ensure!(
        found.trim() == PYTHON,
        "the torch backend: expected python3 to be Python {PYTHON} (the interpreter pdhost embeds), found {}",
        found.trim()
    );
    if dir.exists() {
        std::fs::remove_dir_all(dir).with_context(|| format!("removing the incomplete {}", dir.display()))?;
    }
    bar.spin(&format!("torch backend: [1/3] creating a Python {PYTHON} environment in {}", dir.display()));
    set_up(Command::new("python3").args(["-m", "venv"]).arg(dir))?;
    let python = dir.join("bin/python");
    bar.spin(&format!("torch backend: [2/3] installing {UV}"));
    set_up(Command::new(&python).args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", UV]))?;
    let requirements = dir.join("requirements.txt");
    std::fs::write(&requirements, TORCH_REQUIREMENTS).context("writing requirements.txt")?;
    bar.spin("torch backend: [3/3] installing torch, transformers, gguf, numpy (about 3 GB to download, once)");
    set_up(
        Command::new(dir.join("bin/uv"))
            .args(["pip", "install", "--quiet", "--require-hashes", "--python"])
            .arg(&python)
            .arg("-r")
            .arg(&requirements),
    )?;
    std::fs::write(dir.join("pdhost-env"), stamp()).context("marking the environment complete")?;
    bar.finish();
    tracing::info!(dir = %dir.display(), seconds = started.elapsed().as_secs_f64(), "torch backend environment made");
    if !quiet {
        errln!("torch backend: environment made in {:.0} s: {}", started.elapsed().as_secs_f64(), dir.display());
    }
    Ok(())
}

/// Writes `text` to `path` unless it is already there (through a scratch file and a rename: a producer
/// reading the old module sees it whole).
fn write_if_changed(path: &Path, text: &str) -> anyhow::Result<()> {
    if std::fs::read_to_string(path).is_ok_and(|t| t == text) {
        return Ok(());
    }
    let dir = path.parent().expect("a parent");
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let scratch = dir.join(format!(".{}.{}", std::process::id(), path.file_name().expect("a name").to_string_lossy()));
    let mut f = std::fs::File::create(&scratch).with_context(|| format!("writing {}", scratch.display()))?;
    f.write_all(text.as_bytes()).with_context(|| format!("writing {}", scratch.display()))?;
    drop(f);
    std::fs::rename(&scratch, path).with_context(|| format!("writing {}", path.display()))
}

pub fn run(args: &BackendsArgs) -> anyhow::Result<ExitCode> {
    match &args.action {
        BackendsAction::List { json } => {
            let rows: Vec<_> = NAMES
                .iter()
                .map(|(name, what)| {
                    let dir = model::registry::home().join("backends").join(name);
                    (name, what, is_ready(&dir), dir)
                })
                .collect();
            if *json {
                let list: Vec<_> = rows
                    .iter()
                    .map(|(name, what, ready, dir)| {
                        json!({"name": name, "description": what, "ready": ready, "dir": dir.display().to_string()})
                    })
                    .collect();
                outln!("{}", json!({"backends": list}))?;
            } else {
                outln!("{:<8} {:<6} description", "name", "ready")?;
                for (name, what, ready, dir) in &rows {
                    outln!("{name:<8} {:<6} {what} ({})", if *ready { "yes" } else { "no" }, dir.display())?;
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        BackendsAction::Fetch { name, json } => {
            if name != "torch" {
                errln!("error: backend: expected torch (the one backend with an environment to fetch), found {name:?}");
                return Ok(ExitCode::from(2));
            }
            let env = torch(*json)?;
            if *json {
                outln!("{}", json!({"name": name, "dir": env.dir.display().to_string()}))?;
            } else {
                outln!("{}", env.dir.display())?;
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}
