//! Values rendered in words for one-line error messages: bytes from a file or a peer, lists of layer ids,
//! head geometry, shapes, durations, and why postcard could not decode something.
//!
//! Every crate that names these things in an error uses these renderings, so that a message never shows a
//! Rust `Debug` structure or a decoder's internal wording, and the same thing reads the same everywhere.

use std::fmt::Write as _;
use std::time::Duration;

/// Most runs of consecutive layer ids [`layers`] lists before it counts the rest.
const MAX_RUNS: usize = 16;

/// Bytes from a file or a peer: `"# pd"` when every byte is printable ASCII, otherwise their hex, then the
/// printable ones as text with `.` for the others: `bytes 7f 45 4c 46 (".ELF")`. Empty: `no bytes`.
pub fn bytes(b: &[u8]) -> String {
    let printable = |c: u8| c.is_ascii_graphic() || c == b' ';
    if b.is_empty() {
        return "no bytes".to_string();
    }
    let text: String = b.iter().map(|&c| if printable(c) { char::from(c) } else { '.' }).collect();
    if b.iter().all(|&c| printable(c)) {
        // Only `"` and `\` are escaped: every other character is printable ASCII.
        return format!("{text:?}");
    }
    let mut out = String::from("bytes");
    for c in b {
        let _ = write!(out, " {c:02x}");
    }
    if b.iter().any(|&c| c.is_ascii_alphanumeric()) {
        let _ = write!(out, " ({text:?})");
    }
    out
}

/// Layer ids as runs of consecutive ids, in the order given: `0-4, 6-10, 12-16` or `5, 11, 17`. After
/// [`MAX_RUNS`] runs the rest is counted (`..., plus 40 more runs`); no ids: `none`.
pub fn layers(ids: &[u32]) -> String {
    let mut runs: Vec<(u32, u32)> = Vec::new();
    for &id in ids {
        match runs.last_mut() {
            Some((_, last)) if last.checked_add(1) == Some(id) => *last = id,
            _ => runs.push((id, id)),
        }
    }
    if runs.is_empty() {
        return "none".to_string();
    }
    let mut out = String::new();
    for (i, &(first, last)) in runs.iter().take(MAX_RUNS).enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        let _ = if first == last { write!(out, "{first}") } else { write!(out, "{first}-{last}") };
    }
    if runs.len() > MAX_RUNS {
        let _ = write!(out, ", plus {} more runs", runs.len() - MAX_RUNS);
    }
    out
}

/// The heads of an attention layer: `1 KV head of size 256`, `8 KV heads of size 64`.
pub fn kv_heads(kv_heads: u64, head_dim: u64) -> String {
    let s = if kv_heads == 1 { "" } else { "s" };
    format!("{kv_heads} KV head{s} of size {head_dim}")
}

/// A tensor shape, outermost dimension first: `[3 x 2 x 4]`. A hostile manifest's shape can have a
/// million dimensions: past [`crate::MAX_RANK`] the rest are counted, not written out
/// (`[1 x 1 x 1 x 1 x 1 x 1 x 1 x 1 x ... (1000000 dimensions)]`).
pub fn shape(dims: &[u64]) -> String {
    let shown: Vec<String> = dims.iter().take(crate::MAX_RANK).map(u64::to_string).collect();
    if dims.len() > crate::MAX_RANK {
        format!("[{} x ... ({} dimensions)]", shown.join(" x "), dims.len())
    } else {
        format!("[{}]", shown.join(" x "))
    }
}

/// A duration as a person would say it: `120 s`, `1.5 s`, `50 ms`, `20 µs`.
pub fn duration(d: Duration) -> String {
    if d >= Duration::from_secs(1) {
        let tenths = (d.as_millis() + 50) / 100;
        match tenths % 10 {
            0 => format!("{} s", tenths / 10),
            t => format!("{}.{t} s", tenths / 10),
        }
    } else if d >= Duration::from_millis(1) {
        format!("{} ms", (d.as_micros() + 500) / 1000)
    } else if d.is_zero() {
        "0 ms".to_string()
    } else {
        format!("{} µs", d.as_micros().max(1))
    }
}

/// Why postcard could not decode bytes, in words that do not depend on its version.
pub fn postcard_failure(e: &postcard::Error) -> &'static str {
    use postcard::Error as E;
    match e {
        E::DeserializeUnexpectedEnd => "they end inside a value",
        E::DeserializeBadVarint => "an integer longer than its type",
        E::DeserializeBadBool => "a bool other than 0 or 1",
        E::DeserializeBadChar => "an invalid char",
        E::DeserializeBadUtf8 => "a string that is not UTF-8",
        E::DeserializeBadOption => "an option tag other than 0 or 1",
        E::DeserializeBadEnum => "an unknown variant",
        E::DeserializeBadEncoding => "a value of the wrong encoding",
        E::DeserializeBadCrc => "a wrong CRC",
        // serde's own checks: an unknown variant index, a value out of range.
        E::SerdeDeCustom => "a value the message type does not allow",
        _ => "a value postcard cannot decode",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_read_as_text_when_printable_and_as_hex_otherwise() {
        assert_eq!(bytes(b"# pd"), "\"# pd\"");
        assert_eq!(bytes(b"PDKVSPAN"), "\"PDKVSPAN\"");
        assert_eq!(bytes(b"a\"b"), "\"a\\\"b\"");
        assert_eq!(bytes(b"\x7fELF"), "bytes 7f 45 4c 46 (\".ELF\")");
        assert_eq!(bytes(&[0, 0, 0xff]), "bytes 00 00 ff");
        assert_eq!(bytes(&[]), "no bytes");
    }

    #[test]
    fn layers_collapse_into_runs_and_long_lists_are_counted() {
        assert_eq!(layers(&[0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16]), "0-4, 6-10, 12-16");
        assert_eq!(layers(&[5, 11, 17]), "5, 11, 17");
        assert_eq!(layers(&[3, 2, 1]), "3, 2, 1");
        assert_eq!(layers(&[u32::MAX, 0]), format!("{}, 0", u32::MAX));
        assert_eq!(layers(&[]), "none");
        let every_other: Vec<u32> = (0..40).map(|i| 2 * i).collect();
        assert!(layers(&every_other).ends_with(", 30, plus 24 more runs"), "{}", layers(&every_other));
    }

    #[test]
    fn heads_shapes_and_durations_in_words() {
        assert_eq!(kv_heads(1, 256), "1 KV head of size 256");
        assert_eq!(kv_heads(8, 64), "8 KV heads of size 64");
        assert_eq!(shape(&[3, 2, 4]), "[3 x 2 x 4]");
        assert_eq!(shape(&[]), "[]");
        assert_eq!(shape(&[1; 1_000_000]), "[1 x 1 x 1 x 1 x 1 x 1 x 1 x 1 x ... (1000000 dimensions)]");
        assert_eq!(duration(Duration::from_secs(120)), "120 s");
        assert_eq!(duration(Duration::from_millis(1500)), "1.5 s");
        assert_eq!(duration(Duration::from_micros(1_000_213)), "1 s");
        assert_eq!(duration(Duration::from_millis(1999)), "2 s");
        assert_eq!(duration(Duration::from_millis(50)), "50 ms");
        assert_eq!(duration(Duration::from_micros(20)), "20 µs");
        assert_eq!(duration(Duration::ZERO), "0 ms");
    }

    #[test]
    fn postcard_failures_in_words() {
        let e = postcard::from_bytes::<u32>(&[0xff, 0xff]).unwrap_err();
        assert_eq!(postcard_failure(&e), "they end inside a value");
        let e = postcard::from_bytes::<bool>(&[7]).unwrap_err();
        assert_eq!(postcard_failure(&e), "a bool other than 0 or 1");
    }
}
