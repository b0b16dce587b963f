//! `pdhost inspect-span FILE [--json]`.

use std::io::Read;
use std::process::ExitCode;

use anyhow::Context;
use serde_json::{json, Value};
use shm_format::{decode_frame, parse_header_prefix, Layout, SpanError, SpanView, HEADER_LEN};

use super::{errln, outln, StdoutError};
use crate::cli::InspectArgs;

/// Exit status of a rejected span.
const REJECTED: u8 = 1;
/// Exit status of a usage error (clap uses the same).
const USAGE: u8 = 2;

pub fn run(args: &InspectArgs) -> anyhow::Result<ExitCode> {
    let bytes = match read_span_file(args) {
        Ok(Ok(bytes)) => bytes,
        Ok(Err(rejection)) => return report(args, Err(rejection)),
        Err(usage) => {
            errln!("error: {usage:#}");
            return Ok(ExitCode::from(USAGE));
        }
    };
    report(args, decode_frame(&bytes))
}

/// Reads the file, bounded: the header is parsed first, and no more than the frame length it declares
/// (itself bounded by the format's limits) is read. The outer error is a usage error (the file cannot be
/// read); the inner one a rejection of its bytes.
fn read_span_file(args: &InspectArgs) -> anyhow::Result<Result<Vec<u8>, SpanError>> {
    let path = &args.file;
    // Check the type before opening: opening a FIFO would block until a writer appears.
    let meta = std::fs::metadata(path).with_context(|| format!("cannot read span file {}", path.display()))?;
    if !meta.is_file() {
        anyhow::bail!("{}: expected a regular file, found {}", path.display(), pdhost::request::input::describe(&meta));
    }
    let mut file = std::fs::File::open(path).with_context(|| format!("cannot open span file {}", path.display()))?;
    // The size the file system reports is not trusted (`/proc` files say 0): read what is there, never
    // more than the header, then never more than the frame it declares plus one byte.
    let read = |file: &mut std::fs::File, limit: u64, into: &mut Vec<u8>| {
        file.take(limit).read_to_end(into).with_context(|| format!("cannot read {}", path.display()))
    };
    let mut bytes = Vec::new();
    read(&mut file, HEADER_LEN as u64, &mut bytes)?;
    let header = match parse_header_prefix(&bytes) {
        Ok(h) => h,
        Err(e) => return Ok(Err(e)),
    };
    read(&mut file, header.frame_len - HEADER_LEN as u64 + 1, &mut bytes)?;
    let size = bytes.len() as u64;
    if size < header.frame_len {
        return Ok(Err(SpanError::Truncated { expected: header.frame_len, found: size }));
    }
    if size > header.frame_len {
        // At least one byte more than the frame; say how many the file holds when it can tell.
        let found = meta.len().max(size);
        return Ok(Err(SpanError::TrailingBytes { expected: header.frame_len, found }));
    }
    Ok(Ok(bytes))
}

fn report(args: &InspectArgs, verdict: Result<SpanView<'_>, SpanError>) -> anyhow::Result<ExitCode> {
    let name = args.file.display();
    match (&verdict, args.json) {
        (Ok(span), true) => {
            outln!("{}", json!({"file": name.to_string(), "verdict": "valid", "span": span_json(span)}))?
        }
        (Ok(span), false) => print_span(&name.to_string(), span)?,
        (Err(e), true) => outln!(
            "{}",
            json!({"file": name.to_string(), "verdict": "rejected", "error": {"kind": e.kind(), "message": e.to_string()}})
        )?,
        (Err(e), false) => outln!("{name}: rejected ({}): {e}", e.kind())?,
    }
    Ok(match verdict {
        Ok(_) => ExitCode::SUCCESS,
        Err(_) => ExitCode::from(REJECTED),
    })
}

fn span_json(span: &SpanView<'_>) -> Value {
    let h = &span.header;
    let m = &span.manifest;
    let layout = match &m.layout {
        Layout::Dense { num_layers, kv_heads, head_dim } => {
            json!({"kind": "dense", "num_layers": num_layers, "kv_heads": kv_heads, "head_dim": head_dim})
        }
        Layout::Grouped { groups } => json!({
            "kind": "grouped",
            "groups": groups.iter().map(|g| {
                let (kind, window) = match g.kind {
                    shm_format::GroupKind::Full => ("full", None),
                    shm_format::GroupKind::Sliding { window } => ("sliding", Some(window)),
                    shm_format::GroupKind::Recurrent => ("recurrent", None),
                };
                json!({"id": g.id, "kind": kind, "window": window, "layers": g.layers})
            }).collect::<Vec<_>>(),
        }),
    };
    json!({
        "header": {
            "version": format!("{}.{}", shm_format::FORMAT_MAJOR, h.version_minor),
            "header_len": h.header_len,
            "manifest_len": h.manifest_len,
            "payload_offset": h.payload_offset,
            "payload_len": h.payload_len,
            "frame_len": h.frame_len,
            "checksum": format!("{:#018x}", h.checksum),
            "producer_epoch": h.producer_epoch,
            "slot_generation": h.slot_generation,
            "sequence": h.sequence,
        },
        "manifest": {
            "fingerprint": m.fingerprint.to_string(),
            "request_id": m.request_id,
            "token_start": m.token_start,
            "token_end": m.token_end,
            "dtype": m.dtype.name(),
            "layout": layout,
            "entries": m.entries.iter().map(|e| json!({
                "layer": e.layer, "kind": e.kind.name(), "shape": e.shape, "offset": e.offset, "len": e.len,
            })).collect::<Vec<_>>(),
        },
    })
}

fn print_span(name: &str, span: &SpanView<'_>) -> Result<(), StdoutError> {
    let h = &span.header;
    let m = &span.manifest;
    outln!("{name}: valid span, {} bytes", h.frame_len)?;
    outln!(
        "  format       v{}.{}, header {} B, manifest {} B, payload {} B at offset {}, checksum {:#018x}",
        shm_format::FORMAT_MAJOR,
        h.version_minor,
        h.header_len,
        h.manifest_len,
        h.payload_len,
        h.payload_offset,
        h.checksum
    )?;
    outln!(
        "  ring         epoch {}, slot generation {}, sequence {}",
        h.producer_epoch,
        h.slot_generation,
        h.sequence
    )?;
    outln!(
        "  request      {}, tokens [{}, {}) ({} tokens), dtype {}",
        m.request_id,
        m.token_start,
        m.token_end,
        m.tokens(),
        m.dtype.name()
    )?;
    outln!("  fingerprint  {}", m.fingerprint)?;
    match &m.layout {
        Layout::Dense { num_layers, kv_heads, head_dim } => {
            outln!("  layout       dense: {num_layers} layers x {kv_heads} kv heads x {head_dim} head dim")?
        }
        Layout::Grouped { groups } => {
            outln!("  layout       grouped: {} groups", groups.len())?;
            for g in groups {
                let kind = match g.kind {
                    shm_format::GroupKind::Full => "full attention".to_string(),
                    shm_format::GroupKind::Sliding { window } => format!("sliding window {window}"),
                    shm_format::GroupKind::Recurrent => "recurrent".to_string(),
                };
                let layers = g.layers.iter().map(u32::to_string).collect::<Vec<_>>().join(", ");
                outln!("    group {:<3} {kind:<20} layers {layers}", g.id)?;
            }
        }
    }
    outln!("  entries      {}", m.entries.len())?;
    for e in &m.entries {
        outln!(
            "    layer {:>4} {:<5} shape {:<18} offset {:>12} len {:>12}",
            e.layer,
            e.kind.name(),
            e.shape.iter().map(u64::to_string).collect::<Vec<_>>().join(" x "),
            e.offset,
            e.len
        )?;
    }
    Ok(())
}
