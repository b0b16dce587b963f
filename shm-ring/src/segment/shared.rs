//! Volatile reads of memory another process may write at any moment.
//!
//! The host reads a producer's frames while the producer may still be writing them (a broken or hostile
//! one may rewrite a committed frame at any time). Plain loads of such bytes would be a data race in
//! Rust's memory model, and the compiler would be free to read a byte twice and see two values. A
//! volatile access to memory outside any Rust allocation, such as a memfd mapping, is instead one machine
//! load of the width asked for: it returns whatever the memory held at that moment, and nothing else in
//! the program depends on it being stable. Torn or changing bytes land only in the host's private copy,
//! which is then checksummed and validated; no Rust reference is ever formed over the shared bytes.
//!
//! The loads are unaligned (a frame may start anywhere a slot does) and 32 bytes wide, in [`copy`] (a
//! `[u64; 4]`, the tail byte by byte) and in the fused copy-and-checksum kernel ([`read`] of an `__m256i`). `pdhost bench ring` and
//! `pdhost bench ingest` put the result beside a plain memcpy of the same bytes.

/// `T` at any address: a volatile read of it needs no alignment.
#[repr(C, packed)]
#[derive(Clone, Copy)]
struct Unaligned<T: Copy>(T);

/// Reads the `T` at `src` as one volatile access.
///
/// # Safety
///
/// `size_of::<T>()` bytes at `src` are mapped and readable, and every bit pattern is a valid `T`.
#[inline(always)]
pub(crate) unsafe fn read<T: Copy>(src: *const u8) -> T {
    // SAFETY: readable by the caller's promise; `Unaligned<T>` has alignment 1, so any address is aligned
    // for it; the field is copied out by value, never borrowed.
    unsafe { std::ptr::read_volatile(src.cast::<Unaligned<T>>()).0 }
}

/// Copies `dst.len()` bytes at `src` into `dst` with volatile loads, 32 bytes per round.
///
/// # Safety
///
/// `dst.len()` bytes at `src` are mapped and readable, and do not overlap `dst`.
pub(crate) unsafe fn copy(src: *const u8, dst: &mut [u8]) {
    let mut chunks = dst.chunks_exact_mut(32);
    let mut at = 0;
    for chunk in &mut chunks {
        // SAFETY: `at + 32 <= dst.len()` bytes at `src` are readable (the caller's promise).
        let words: [u64; 4] = unsafe { read(src.add(at)) };
        for (out, word) in chunk.chunks_exact_mut(8).zip(words) {
            out.copy_from_slice(&word.to_ne_bytes());
        }
        at += 32;
    }
    for (i, out) in chunks.into_remainder().iter_mut().enumerate() {
        // SAFETY: `at + i < dst.len()`, as above.
        *out = unsafe { read(src.add(at + i)) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_every_length_at_every_offset() {
        let source: Vec<u8> = (0..200u32).map(|i| (i * 7 + 3) as u8).collect();
        for offset in 0..9 {
            for len in 0..=(source.len() - offset) {
                let mut dst = vec![0u8; len];
                // SAFETY: `offset + len <= source.len()` bytes are readable, and `dst` is another buffer.
                unsafe { copy(source.as_ptr().add(offset), &mut dst) };
                assert_eq!(dst, source[offset..offset + len], "offset {offset}, len {len}");
            }
        }
    }
}
