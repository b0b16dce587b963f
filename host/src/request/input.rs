//! The files and texts a request arrives in: prompt files, `--model` paths and `--backend-config`. Each is
//! bounded before it is read, and refused with what was found (a FIFO, a device, a directory without
//! `config.json`, a file that is not GGUF) rather than with a guess.

use std::io::Read;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};

use super::{shorten, Field, Invalid};

/// The largest prompt file: far more text than any supported context holds (about 4 bytes a token), small
/// enough to read and tokenize at once.
pub const MAX_PROMPT_BYTES: u64 = 8 << 20;

/// The largest `--backend-config`, in bytes.
pub const MAX_BACKEND_CONFIG_BYTES: usize = 64 << 10;

/// The deepest nesting of arrays and objects in `--backend-config`.
pub const MAX_BACKEND_CONFIG_DEPTH: usize = 16;

/// What a path is, in words, for messages.
pub fn describe(meta: &std::fs::Metadata) -> &'static str {
    let t = meta.file_type();
    if t.is_dir() {
        "a directory"
    } else if t.is_file() {
        "a regular file"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_char_device() || t.is_block_device() {
        "a device"
    } else {
        "neither a file nor a directory"
    }
}

/// A refusal of `field` naming why `path` cannot be read (missing, no permission, a symlink loop).
fn unreadable(field: Field, path: &Path, expected: &str, e: &std::io::Error) -> Invalid {
    let why = match e.kind() {
        std::io::ErrorKind::NotFound => "nothing there".to_string(),
        _ => e.to_string().to_lowercase(),
    };
    Invalid::new(field, expected, format_args!("{}: {why}", path.display()))
}

/// The metadata of `path`, following symlinks, or a refusal of `field` saying why it cannot be read.
fn metadata(field: Field, path: &Path, expected: &str) -> Result<std::fs::Metadata, Invalid> {
    std::fs::metadata(path).map_err(|e| unreadable(field, path, expected, &e))
}

/// Reads at most `max` bytes from `reader`; more is a refusal of `field`. The size is never taken from
/// the file system (`/proc` files report 0, devices report nothing useful).
fn read_bounded(field: Field, name: &str, mut reader: impl Read, max: u64) -> Result<Vec<u8>, Invalid> {
    let mut bytes = Vec::new();
    reader
        .by_ref()
        .take(max + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| Invalid::new(field, "a readable file", format_args!("{name}: {e}")))?;
    if bytes.len() as u64 > max {
        return Err(Invalid::new(field, format!("at most {} MiB of text", max >> 20), format_args!("{name}: more")));
    }
    Ok(bytes)
}

fn utf8(field: Field, name: &str, bytes: Vec<u8>) -> Result<String, Invalid> {
    String::from_utf8(bytes).map_err(|e| {
        Invalid::new(
            field,
            "UTF-8 text",
            format_args!("{name}: a byte that is not UTF-8 at offset {}", e.utf8_error().valid_up_to()),
        )
    })
}

/// The text of a prompt file: a regular file, or `-` for standard input; at most [`MAX_PROMPT_BYTES`],
/// UTF-8, and not empty.
pub fn read_prompt_file(path: &Path) -> Result<String, Invalid> {
    let field = Field::PromptFile;
    let (name, bytes) = if path.as_os_str() == "-" {
        (
            "standard input".to_string(),
            read_bounded(field, "standard input", std::io::stdin().lock(), MAX_PROMPT_BYTES)?,
        )
    } else {
        let name = path.display().to_string();
        // Check the type before opening: opening a FIFO blocks until a writer appears, and a device can
        // be read forever.
        let meta = metadata(field, path, "a readable regular file or - (standard input)")?;
        if !meta.is_file() {
            return Err(Invalid::new(
                field,
                "a regular file or - (standard input)",
                format_args!("{name}: {}", describe(&meta)),
            ));
        }
        let file = std::fs::File::open(path)
            .map_err(|e| Invalid::new(field, "a readable regular file", format_args!("{name}: {e}")))?;
        let bytes = read_bounded(field, &name, file, MAX_PROMPT_BYTES)?;
        (name, bytes)
    };
    let text = utf8(field, &name, bytes)?;
    check_prompt_text(field, &text)?;
    Ok(text)
}

/// A prompt text is not empty: an empty prompt would decode from BOS alone on a model that adds one and
/// be refused on one that does not; refusing it everywhere is the same answer for every model.
pub fn check_prompt_text(field: Field, text: &str) -> Result<(), Invalid> {
    if text.is_empty() {
        return Err(Invalid::new(field, "a non-empty prompt", "an empty one"));
    }
    Ok(())
}

/// Where a model comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelSource {
    /// A name from the registry (fetched on first use).
    Known(String),
    /// A GGUF file.
    Gguf(PathBuf),
    /// A Hugging Face checkpoint directory.
    HfDir(PathBuf),
}

/// Classifies `--model`: a known name, a GGUF file (checked by its magic), or a checkpoint directory with
/// a `config.json`. Anything else is refused saying what it is.
pub fn model_source(arg: &str) -> Result<ModelSource, Invalid> {
    let field = Field::Model;
    let known = || model::registry::MODELS.iter().map(|m| m.name).collect::<Vec<_>>().join(", ");
    let expected = || format!("a known model ({}), a .gguf file or a checkpoint directory", known());
    if arg.is_empty() {
        return Err(Invalid::new(field, expected(), "an empty name"));
    }
    let path = Path::new(arg);
    let looks_like_path = arg.contains('/') || arg.ends_with(".gguf") || arg == "." || arg == "..";
    let meta = match std::fs::metadata(path) {
        Ok(meta) => meta,
        Err(_) if !looks_like_path && model::registry::spec(arg).is_ok() => {
            return Ok(ModelSource::Known(arg.to_string()))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && !looks_like_path => {
            return Err(Invalid::new(
                field,
                expected(),
                format_args!("{arg:?}, which is neither a known name nor a file"),
            ))
        }
        Err(e) => return Err(unreadable(field, path, &expected(), &e)),
    };
    if meta.is_dir() {
        let config = path.join("config.json");
        if !config.is_file() {
            return Err(Invalid::new(
                field,
                "a checkpoint directory with a config.json",
                format_args!("{}: a directory without config.json", path.display()),
            ));
        }
        return Ok(ModelSource::HfDir(path.to_path_buf()));
    }
    if !meta.is_file() {
        return Err(Invalid::new(
            field,
            "a .gguf file or a checkpoint directory",
            format_args!("{}: {}", path.display(), describe(&meta)),
        ));
    }
    let mut magic = [0u8; 4];
    match read_start(path, &mut magic) {
        Ok(4) if &magic == b"GGUF" => Ok(ModelSource::Gguf(path.to_path_buf())),
        Ok(0) => Err(Invalid::new(
            field,
            "a GGUF file or a checkpoint directory",
            format_args!("{}: an empty file", path.display()),
        )),
        Ok(n) => Err(Invalid::new(
            field,
            "a GGUF file (starting with \"GGUF\") or a checkpoint directory",
            format_args!("{}: a file starting with {}", path.display(), shm_format::words::bytes(&magic[..n])),
        )),
        Err(e) => Err(Invalid::new(field, "a readable model file", format_args!("{}: {e}", path.display()))),
    }
}

/// Reads the first `start.len()` bytes of the file at `path` (fewer if it is shorter): how many.
pub fn read_start(path: &Path, start: &mut [u8]) -> std::io::Result<usize> {
    let mut f = std::fs::File::open(path)?;
    let mut n = 0;
    while n < start.len() {
        match f.read(&mut start[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

/// `--backend-config`: a JSON object of at most [`MAX_BACKEND_CONFIG_BYTES`] nested at most
/// [`MAX_BACKEND_CONFIG_DEPTH`] deep. The keys the host itself gives every backend, where it overrides
/// them, hold what the host would (`threads` a valid thread count, `precision` and `dtype` one of their
/// names): a backend would refuse them at its start, which is a producer fault. It is never echoed back
/// whole. `local` prefill has no backend, so any config there is refused rather than ignored.
pub fn check_backend_config(
    text: Option<&str>,
    producer: &str,
) -> Result<serde_json::Map<String, serde_json::Value>, Invalid> {
    let field = Field::BackendConfig;
    let Some(text) = text else { return Ok(serde_json::Map::new()) };
    if producer == "local" {
        return Err(Invalid::new(
            field,
            "no backend config with the local producer (the host has no backend)",
            shorten(text),
        ));
    }
    if text.len() > MAX_BACKEND_CONFIG_BYTES {
        return Err(Invalid::new(
            field,
            format!("at most {} KiB of JSON", MAX_BACKEND_CONFIG_BYTES >> 10),
            format_args!("{} bytes", text.len()),
        ));
    }
    let depth = json_depth(text);
    if depth > MAX_BACKEND_CONFIG_DEPTH {
        return Err(Invalid::new(
            field,
            format!("JSON nested at most {MAX_BACKEND_CONFIG_DEPTH} deep"),
            format_args!("nesting {depth} deep"),
        ));
    }
    let value: serde_json::Value = serde_json::from_str(text)
        .map_err(|e| Invalid::new(field, "a JSON object", format_args!("invalid JSON ({e}): {}", shorten(text))))?;
    let serde_json::Value::Object(map) = value else {
        let kind = match value {
            serde_json::Value::Null => "null",
            serde_json::Value::Bool(_) => "a boolean",
            serde_json::Value::Number(_) => "a number",
            serde_json::Value::String(_) => "a string",
            serde_json::Value::Array(_) => "an array",
            serde_json::Value::Object(_) => unreachable!("matched above"),
        };
        return Err(Invalid::new(field, "a JSON object", kind));
    };
    if let Some(threads) = map.get("threads") {
        let max = model::kernels::max_threads();
        if !threads.as_u64().is_some_and(|t| (1..=max as u64).contains(&t)) {
            return Err(Invalid::new(
                field,
                format!("\"threads\" from 1 to {max} (4 per core)"),
                format_args!("\"threads\": {threads}"),
            ));
        }
    }
    for (key, names) in [("precision", &["exact", "fast"][..]), ("dtype", &["f32", "bf16", "f16"][..])] {
        if let Some(value) = map.get(key).filter(|v| !v.as_str().is_some_and(|v| names.contains(&v))) {
            return Err(Invalid::new(
                field,
                format!("{key:?} one of {}", names.join(", ")),
                format_args!("{key:?}: {}", shorten(&value.to_string())),
            ));
        }
    }
    Ok(map)
}

/// The deepest nesting of `[` and `{` outside strings (a scan that cannot recurse, so it bounds the
/// input before a recursive parser sees it).
fn json_depth(text: &str) -> usize {
    let (mut depth, mut max, mut in_string, mut escaped) = (0usize, 0usize, false, false);
    for b in text.bytes() {
        if in_string {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                max = max.max(depth);
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    max
}
