//! `pdhost models list|fetch NAME`.

use std::process::ExitCode;

use indicatif::{ProgressBar, ProgressStyle};
use model::registry::{self, Progress};
use serde_json::json;

use crate::cli::{ModelsAction, ModelsArgs};

pub fn run(args: &ModelsArgs) -> anyhow::Result<ExitCode> {
    match &args.action {
        ModelsAction::List { json } => list(*json),
        ModelsAction::Fetch { name, json } => {
            if let Err(e) = registry::spec(name) {
                eprintln!("error: {e}");
                return Ok(ExitCode::from(2));
            }
            let mut bar = Bar::new(*json);
            let path = registry::fetch(name, &mut bar)?;
            bar.finish();
            if *json {
                println!("{}", json!({"name": name, "path": path.display().to_string()}));
            } else {
                println!("{}", path.display());
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn list(json: bool) -> anyhow::Result<ExitCode> {
    let rows: Vec<_> = registry::MODELS.iter().map(|m| (m, registry::cached(m))).collect();
    if json {
        let models: Vec<_> = rows
            .iter()
            .map(|(m, path)| {
                json!({"name": m.name, "description": m.description, "file": m.file, "sha256": m.sha256,
                       "bytes": m.size, "cached": path.as_ref().map(|p| p.display().to_string())})
            })
            .collect();
        println!("{}", json!({"cache": registry::models_dir().display().to_string(), "models": models}));
    } else {
        println!("{:<14} {:>8}  {:<8} description", "name", "MiB", "cached");
        for (m, path) in &rows {
            let cached = if path.is_some() { "yes" } else { "no" };
            println!("{:<14} {:>8.1}  {cached:<8} {}", m.name, m.size as f64 / (1 << 20) as f64, m.description);
        }
        println!("cache: {}", registry::models_dir().display());
    }
    Ok(ExitCode::SUCCESS)
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
