//! `pdhost models list|verify [NAME]|fetch NAME`.

use std::process::ExitCode;

use indicatif::{ProgressBar, ProgressStyle};
use model::registry::{self, Cached, ModelSpec, OnCorrupt, Progress};
use serde_json::json;

use super::{errln, outln};
use crate::cli::{ModelsAction, ModelsArgs};

pub fn run(args: &ModelsArgs) -> anyhow::Result<ExitCode> {
    match &args.action {
        ModelsAction::List { json } => list(*json),
        ModelsAction::Verify { name, json } => verify(name.as_deref(), *json),
        ModelsAction::Fetch { name, json } => {
            if let Err(e) = registry::spec(name) {
                errln!("error: {e}");
                return Ok(ExitCode::from(2));
            }
            let mut bar = Bar::new(*json);
            // A corrupt cached file is what `models fetch` is for: fetch it again.
            let path = registry::fetch_with(name, OnCorrupt::Replace, &mut bar)?;
            bar.finish();
            if *json {
                outln!("{}", json!({"name": name, "path": path.display().to_string()}))?;
            } else {
                outln!("{}", path.display())?;
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// Every known model and what the cache holds for it (verified).
fn list(json: bool) -> anyhow::Result<ExitCode> {
    registry::remove_stale();
    let rows: Vec<_> = registry::MODELS.iter().map(|m| (m, registry::state(m))).collect();
    if json {
        let models: Vec<_> = rows
            .iter()
            .map(|(m, state)| {
                json!({"name": m.name, "description": m.description, "file": m.file, "sha256": m.sha256,
                       "bytes": m.size, "state": state.label(),
                       "cached": state.intact().map(|p| p.display().to_string())})
            })
            .collect();
        outln!("{}", json!({"cache": registry::models_dir().display().to_string(), "models": models}))?;
    } else {
        outln!("{:<14} {:>8}  {:<8} description", "name", "MiB", "cached")?;
        for (m, state) in &rows {
            let cached = match state {
                Cached::Intact(_) => "yes",
                Cached::Missing => "no",
                Cached::Corrupt(_) => "corrupt",
            };
            outln!("{:<14} {:>8.1}  {cached:<8} {}", m.name, m.size as f64 / (1 << 20) as f64, m.description)?;
        }
        outln!("cache: {}", registry::models_dir().display())?;
    }
    Ok(ExitCode::SUCCESS)
}

/// Verifies every known model's cached file, or `name`'s: exit status 0 when none is corrupt, 1 when one
/// is, 2 for an unknown name.
fn verify(name: Option<&str>, json: bool) -> anyhow::Result<ExitCode> {
    let specs: Vec<&ModelSpec> = match name {
        Some(name) => match registry::spec(name) {
            Ok(spec) => vec![spec],
            Err(e) => {
                errln!("error: {e}");
                return Ok(ExitCode::from(2));
            }
        },
        None => registry::MODELS.iter().collect(),
    };
    registry::remove_stale();
    let dir = registry::models_dir();
    let rows: Vec<_> = specs.iter().map(|m| (m, registry::state(m))).collect();
    let corrupt = rows.iter().filter(|(_, state)| matches!(state, Cached::Corrupt(_))).count();
    if json {
        let models: Vec<_> = rows
            .iter()
            .map(|(m, state)| {
                let mut row = json!({"name": m.name, "state": state.label(),
                                     "path": dir.join(m.file).display().to_string()});
                if let Cached::Corrupt(c) = state {
                    row["expected"] = json!(c.expected);
                    row["found"] = json!(c.found);
                    row["error"] = json!(c.to_string());
                }
                row
            })
            .collect();
        outln!("{}", json!({"cache": dir.display().to_string(), "corrupt": corrupt, "models": models}))?;
    } else {
        outln!("{:<14} {:<8} path", "name", "state")?;
        for (m, state) in &rows {
            outln!("{:<14} {:<8} {}", m.name, state.label(), dir.join(m.file).display())?;
        }
        for (_, state) in &rows {
            if let Cached::Corrupt(c) = state {
                errln!("error: {c}");
            }
        }
    }
    Ok(if corrupt == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// Progress on stderr when it is a terminal.
pub struct Bar(ProgressBar);

impl Bar {
    /// A bar on a terminal, hidden otherwise (or with `--json`).
    pub fn new(json: bool) -> Self {
        if json || !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
            return Bar(ProgressBar::hidden());
        }
        Bar(ProgressBar::new_spinner())
    }

    /// Shows a spinner with `message` until [`Bar::finish`].
    pub fn spin(&self, message: &str) {
        self.0.set_style(ProgressStyle::with_template("{spinner} {msg} {elapsed}").expect("template"));
        self.0.enable_steady_tick(std::time::Duration::from_millis(120));
        self.0.set_message(message.to_string());
    }

    /// Removes the bar.
    pub fn finish(&self) {
        self.0.finish_and_clear();
    }
}

impl Progress for Bar {
    fn step(&mut self, message: &str, len: Option<u64>) {
        match len {
            Some(n) => {
                self.0.set_style(
                    ProgressStyle::with_template("{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec}")
                        .expect("template")
                        .progress_chars("=> "),
                );
                self.0.set_length(n);
                self.0.set_position(0);
            }
            None => self.spin(message),
        }
        self.0.set_message(message.to_string());
    }

    fn advance(&mut self, n: u64) {
        self.0.inc(n);
    }
}
