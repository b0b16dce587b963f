//! Copying a frame out of shared memory while computing its checksum.
//!
//! The checksum (XXH3-64, seed 0, over the frame with its checksum field zeroed) must be computed on the
//! host's private copy. Copying first and hashing the copy afterwards reads every byte twice; on x86-64
//! with AVX2 [`copy_and_checksum`] instead hashes each 64-byte stripe from the very registers it stores
//! into the private buffer, so the checksum is still exactly that of the copy, at close to the cost of the
//! copy alone. Elsewhere, or for frames of 240 bytes or less (where XXH3 uses other algorithms), it copies
//! in cache-sized chunks and hashes each chunk of the copy with `twox-hash`.
//!
//! The fused kernel implements XXH3's long-input path (stripes, blocks, scrambles, merge) and is tested
//! against `twox-hash` on every length class; it exists only because no XXH3 crate can hash while copying.

use std::ops::Range;

use shm_format::{FrameHasher, CHECKSUM_OFFSET, HEADER_LEN};

use crate::segment::Segment;

/// Frames are copied in chunks of this many bytes (the last chunk may be up to [`CHUNK_SLACK`] longer), so a
/// consumer can scatter each chunk onward while it is still in cache.
pub const COPY_CHUNK: usize = 256 << 10;
/// How far ahead of the copy [`FrameCopier::prefetching`] asks for the source: measured with
/// `pdhost bench ingest` on the project machine (4 KiB: 0.86x memcpy at 2048 tokens, 8 KiB: 1.04x,
/// 16 KiB: 1.12-1.27x, 32 KiB: 1.08-1.13x).
pub const PREFETCH_AHEAD: usize = 16 << 10;
/// The last chunk absorbs a remainder shorter than this, so it always holds XXH3's final 64-byte stripe.
pub const CHUNK_SLACK: usize = 1024;

/// Copies a frame out of a segment chunk by chunk and computes the frame checksum of the copy.
///
/// The caller holds the frame's first 64 bytes privately already (it read and validated them); the first
/// chunk starts with those bytes, not with a second read of shared memory.
pub struct FrameCopier<'a, S: Segment> {
    data: &'a S,
    base: usize,
    header: [u8; HEADER_LEN],
    /// `header` with the checksum field zeroed: what the checksum sees.
    zeroed: [u8; HEADER_LEN],
    len: usize,
    pos: usize,
    hash: Hash,
    /// Prefetch distance of the fused kernel, 0 for none.
    prefetch: usize,
}

enum Hash {
    /// XXH3 accumulators of the fused AVX2 kernel.
    #[cfg(target_arch = "x86_64")]
    Fused([u64; 8], Option<u64>),
    /// Copy, then hash the copy.
    Plain(FrameHasher),
}

impl<S: Segment> std::fmt::Debug for FrameCopier<'_, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FrameCopier").field("base", &self.base).field("len", &self.len).field("pos", &self.pos).finish()
    }
}

impl<'a, S: Segment> FrameCopier<'a, S> {
    /// A copier for the `len`-byte frame at `base`, whose header the caller read into `header`.
    pub fn new(data: &'a S, base: usize, header: &[u8; HEADER_LEN], len: usize) -> Self {
        assert!(len >= HEADER_LEN);
        // Checked once here, so the kernel's raw reads below stay in bounds.
        let _ = data.range_ptr(base, len);
        let mut zeroed = *header;
        zeroed[CHECKSUM_OFFSET..CHECKSUM_OFFSET + 8].fill(0);
        #[cfg(target_arch = "x86_64")]
        let hash = if len > xxh3::MIDSIZE_MAX && std::arch::is_x86_feature_detected!("avx2") {
            Hash::Fused(xxh3::INITIAL_ACC, None)
        } else {
            Hash::Plain(FrameHasher::new(header))
        };
        #[cfg(not(target_arch = "x86_64"))]
        let hash = Hash::Plain(FrameHasher::new(header));
        FrameCopier { data, base, header: *header, zeroed, len, pos: 0, hash, prefetch: 0 }
    }

    /// Prefetches the source [`PREFETCH_AHEAD`] bytes ahead of the copy. This pays when the chunks land in
    /// cache (a sink scattering them onward): the loads then run well ahead of the arithmetic. Copying
    /// a whole frame to memory is bound by its stores, and prefetching only competes with them there.
    pub fn prefetching(mut self) -> Self {
        self.prefetch = PREFETCH_AHEAD;
        self
    }

    /// A copier that never uses the fused kernel, to test the portable path.
    #[cfg(test)]
    fn new_plain(data: &'a S, base: usize, header: &[u8; HEADER_LEN], len: usize) -> Self {
        let mut c = Self::new(data, base, header, len);
        c.hash = Hash::Plain(FrameHasher::new(header));
        c
    }

    /// The length of the next chunk, 0 when the frame is done.
    pub fn next_len(&self) -> usize {
        let left = self.len - self.pos;
        if left < COPY_CHUNK + CHUNK_SLACK {
            left
        } else {
            COPY_CHUNK
        }
    }

    /// Copies the next chunk into `dst` (exactly [`Self::next_len`] bytes) and returns its range in the frame.
    pub fn copy_next(&mut self, dst: &mut [u8]) -> Range<usize> {
        let n = self.next_len();
        assert!(n > 0 && dst.len() == n, "copy_next needs a {n}-byte buffer, got {}", dst.len());
        let start = self.pos;
        let last = start + n == self.len;
        // Bytes of this chunk that come from the header the caller holds, and from shared memory.
        let from_header = HEADER_LEN.saturating_sub(start).min(n);
        if from_header > 0 {
            dst[..from_header].copy_from_slice(&self.header[start..start + from_header]);
        }
        match &mut self.hash {
            #[cfg(target_arch = "x86_64")]
            Hash::Fused(acc, result) => {
                let src = self.data.range_ptr(self.base, self.len);
                // SAFETY: AVX2 was detected in `new`; `src..src + len` is inside the mapping (checked by
                // `range_ptr`); `dst` is `n` private bytes for frame positions `start..start + n`; the
                // chunk schedule makes every chunk but the last a multiple of 1024 bytes and the last one
                // at least 1024 bytes (or the whole frame), as the kernel requires.
                unsafe {
                    if last {
                        *result = Some(xxh3::last_chunk(acc, src, dst.as_mut_ptr(), start, self.len, &self.zeroed));
                    } else {
                        xxh3::blocks(acc, src, dst.as_mut_ptr(), start, n, &self.zeroed, self.prefetch);
                    }
                }
            }
            Hash::Plain(hasher) => {
                self.data.copy_out(self.base + start + from_header, &mut dst[from_header..]);
                // The hasher was seeded with the header; feed it everything after.
                hasher.update(&dst[from_header..]);
            }
        }
        self.pos += n;
        start..start + n
    }

    /// The checksum of everything copied; call after the last chunk.
    pub fn finish(self) -> u64 {
        assert_eq!(self.pos, self.len, "frame not fully copied");
        match self.hash {
            #[cfg(target_arch = "x86_64")]
            Hash::Fused(_, result) => result.expect("last chunk hashed"),
            Hash::Plain(hasher) => hasher.finish(),
        }
    }
}

/// Copies the whole frame at `base` into `dst` (exactly the frame's length) and returns the checksum of
/// the copy.
pub fn copy_and_checksum<S: Segment>(data: &S, base: usize, header: &[u8; HEADER_LEN], dst: &mut [u8]) -> u64 {
    let mut copier = FrameCopier::new(data, base, header, dst.len());
    while copier.next_len() > 0 {
        let n = copier.next_len();
        let at = copier.pos;
        copier.copy_next(&mut dst[at..at + n]);
    }
    copier.finish()
}

#[cfg(target_arch = "x86_64")]
mod xxh3 {
    use std::arch::x86_64::*;

    use crate::segment::shared;

    /// Inputs up to this length use XXH3's short and mid-size algorithms, not the striped one.
    pub const MIDSIZE_MAX: usize = 240;
    const STRIPE: usize = 64;
    const SECRET_LEN: usize = 192;
    const STRIPES_PER_BLOCK: usize = (SECRET_LEN - STRIPE) / 8;
    const BLOCK: usize = STRIPE * STRIPES_PER_BLOCK;

    const PRIME32_1: u64 = 0x9E37_79B1;
    const PRIME32_2: u64 = 0x85EB_CA77;
    const PRIME32_3: u64 = 0xC2B2_AE3D;
    const PRIME64_1: u64 = 0x9E37_79B1_85EB_CA87;
    const PRIME64_2: u64 = 0xC2B2_AE3D_27D4_EB4F;
    const PRIME64_3: u64 = 0x1656_67B1_9E37_79F9;
    const PRIME64_4: u64 = 0x85EB_CA77_C2B2_AE63;
    const PRIME64_5: u64 = 0x27D4_EB2F_1656_67C5;
    const PRIME_MX1: u64 = 0x1656_6791_9E37_79F9;

    /// XXH3's default secret (the xxHash specification's `kSecret`).
    static SECRET: [u8; SECRET_LEN] = [
        0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c, 0xde, 0xd4,
        0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f, 0xcb, 0x79, 0xe6, 0x4e,
        0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21, 0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43,
        0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c, 0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb,
        0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3, 0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19,
        0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8, 0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7,
        0xc7, 0x0b, 0x4f, 0x1d, 0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78,
        0x73, 0x64, 0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
        0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e, 0x2b, 0x16,
        0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce, 0x45, 0xcb, 0x3a, 0x8f,
        0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
    ];

    /// The initial accumulators of XXH3.
    pub const INITIAL_ACC: [u64; 8] =
        [PRIME32_3, PRIME64_1, PRIME64_2, PRIME64_3, PRIME64_4, PRIME32_2, PRIME64_5, PRIME32_1];

    /// Hashes and copies `n` bytes (whole 1024-byte blocks, none of them the frame's last block) at frame
    /// positions `start..start + n` into `dst`, which holds those positions. With `prefetch` nonzero it asks
    /// for the source that many bytes ahead as it goes.
    ///
    /// # Safety
    ///
    /// AVX2; `src` readable for the whole frame; `dst` writable for `n` bytes, not overlapping `src`;
    /// `start` and `n` multiples of 1024.
    #[target_feature(enable = "avx2")]
    pub unsafe fn blocks(
        acc: &mut [u64; 8],
        src: *const u8,
        dst: *mut u8,
        start: usize,
        n: usize,
        header: &[u8; 64],
        prefetch: usize,
    ) {
        let mut a = load(acc);
        for b in (start..start + n).step_by(BLOCK) {
            for s in 0..STRIPES_PER_BLOCK {
                if prefetch != 0 {
                    // A hint for the stripe `prefetch` bytes ahead: it never faults and reads nothing.
                    _mm_prefetch::<_MM_HINT_T0>(src.wrapping_add(b + s * STRIPE + prefetch).cast());
                }
                // SAFETY: s * 8 + 64 <= 192; the stripe lies inside this chunk (caller's contract).
                unsafe {
                    stripe(&mut a, b + s * STRIPE, SECRET.as_ptr().add(s * 8), src, dst.wrapping_sub(start), header)
                };
            }
            // SAFETY: 128 + 64 <= 192.
            unsafe { scramble(&mut a, SECRET.as_ptr().add(SECRET_LEN - STRIPE)) };
        }
        store(&a, acc);
    }

    /// Hashes and copies the frame's last chunk (from `start` to the frame's end `len`) and returns the
    /// frame's XXH3-64.
    ///
    /// # Safety
    ///
    /// As [`blocks`], except that the chunk runs to the end of the frame, is at least 1024 bytes long or
    /// starts at 0, and `len > 240`.
    #[target_feature(enable = "avx2")]
    pub unsafe fn last_chunk(
        acc: &mut [u64; 8],
        src: *const u8,
        dst: *mut u8,
        start: usize,
        len: usize,
        header: &[u8; 64],
    ) -> u64 {
        let secret = SECRET.as_ptr();
        // `dst` addresses frame position `start`; `base` addresses position 0 (never dereferenced below
        // `start`).
        let base = dst.wrapping_sub(start);
        let mut a = load(acc);
        let blocks = (len - 1) / BLOCK;
        for b in (start / BLOCK)..blocks {
            for s in 0..STRIPES_PER_BLOCK {
                // SAFETY: in bounds as in `blocks`: these stripes end before the frame's last byte.
                unsafe { stripe(&mut a, b * BLOCK + s * STRIPE, secret.add(s * 8), src, base, header) };
            }
            // SAFETY: 128 + 64 <= 192.
            unsafe { scramble(&mut a, secret.add(SECRET_LEN - STRIPE)) };
        }
        let stripes = ((len - 1) - BLOCK * blocks) / STRIPE;
        for s in 0..stripes {
            // SAFETY: s < 16, so s * 8 + 64 <= 192; the stripe ends at or before the last byte.
            unsafe { stripe(&mut a, blocks * BLOCK + s * STRIPE, secret.add(s * 8), src, base, header) };
        }
        // The bytes after the last whole stripe, then XXH3's final stripe: the last 64 bytes of the input,
        // read back from the private copy. The chunk holds them: it is at least 1024 bytes or the whole
        // frame, and `covered >= 192 > 64`, so none of them is header.
        let covered = blocks * BLOCK + stripes * STRIPE;
        // SAFETY: start <= covered < len, and start <= len - 64 (the chunk holds the last stripe); both
        // ranges are in bounds and do not overlap. Offsets go from `dst`, never from `base` (which may lie
        // outside the chunk's allocation, so only `wrapping_add` may start from it). The final stripe is
        // read back from the private copy, which holds it now.
        unsafe {
            let copy = std::slice::from_raw_parts_mut(dst.add(covered - start), len - covered);
            shared::copy(src.add(covered), copy);
            accumulate(&mut a, private(dst.add(len - STRIPE - start)), secret.add(SECRET_LEN - STRIPE - 7));
        }
        store(&a, acc);
        merge(acc, &SECRET[11..], (len as u64).wrapping_mul(PRIME64_1))
    }

    #[target_feature(enable = "avx2")]
    fn load(acc: &[u64; 8]) -> [__m256i; 2] {
        // SAFETY: `acc` is 64 readable bytes.
        unsafe { [_mm256_loadu_si256(acc.as_ptr().cast()), _mm256_loadu_si256(acc.as_ptr().add(4).cast())] }
    }

    #[target_feature(enable = "avx2")]
    fn store(a: &[__m256i; 2], acc: &mut [u64; 8]) {
        // SAFETY: `acc` is 64 writable bytes.
        unsafe {
            _mm256_storeu_si256(acc.as_mut_ptr().cast(), a[0]);
            _mm256_storeu_si256(acc.as_mut_ptr().add(4).cast(), a[1]);
        }
    }

    /// Stripe `p` of the frame: from the private header for `p == 0`, else read from shared memory at
    /// `src + p` (volatile loads, each byte once) and stored to `dst + p` on the way (`dst` addresses frame
    /// position 0). The stripe is hashed from the registers that were stored, so the checksum is that of
    /// the copy whatever the producer writes meanwhile.
    ///
    /// # Safety
    ///
    /// AVX2; 64 readable bytes at `key`; for `p > 0`, 64 readable bytes at `src + p` and writable at `dst + p`.
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn stripe(
        acc: &mut [__m256i; 2],
        p: usize,
        key: *const u8,
        src: *const u8,
        dst: *mut u8,
        header: &[u8; 64],
    ) {
        // SAFETY: forwarded from the caller.
        unsafe {
            let data = if p == 0 {
                private(header.as_ptr())
            } else {
                let data: [__m256i; 2] = [shared::read(src.add(p)), shared::read(src.add(p + 32))];
                _mm256_storeu_si256(dst.wrapping_add(p).cast(), data[0]);
                _mm256_storeu_si256(dst.wrapping_add(p + 32).cast(), data[1]);
                data
            };
            accumulate(acc, data, key)
        }
    }

    /// The 64 bytes at `input`, in private memory.
    ///
    /// # Safety
    ///
    /// AVX2; 64 readable bytes at `input`.
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn private(input: *const u8) -> [__m256i; 2] {
        // SAFETY: the caller's promise.
        unsafe { [_mm256_loadu_si256(input.cast()), _mm256_loadu_si256(input.add(32).cast())] }
    }

    /// One stripe: `acc[i ^ 1] += data[i]; acc[i] += lo32(data[i] ^ key[i]) * hi32(data[i] ^ key[i])`.
    ///
    /// # Safety
    ///
    /// AVX2; 64 readable bytes at `key`.
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn accumulate(acc: &mut [__m256i; 2], data: [__m256i; 2], key: *const u8) {
        for (j, (a, data)) in acc.iter_mut().zip(data).enumerate() {
            // SAFETY: the caller guarantees 64 readable bytes at `key`.
            unsafe {
                let data_key = _mm256_xor_si256(data, _mm256_loadu_si256(key.add(32 * j).cast()));
                let data_key_hi = _mm256_shuffle_epi32::<0x31>(data_key);
                let product = _mm256_mul_epu32(data_key, data_key_hi);
                let swapped = _mm256_shuffle_epi32::<0x4E>(data);
                *a = _mm256_add_epi64(product, _mm256_add_epi64(*a, swapped));
            }
        }
    }

    /// The end-of-block scramble: `acc = (acc ^ (acc >> 47) ^ key) * PRIME32_1`.
    ///
    /// # Safety
    ///
    /// AVX2; 64 readable bytes at `key`.
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn scramble(acc: &mut [__m256i; 2], key: *const u8) {
        let prime = _mm256_set1_epi32(PRIME32_1 as i32);
        for (j, a) in acc.iter_mut().enumerate() {
            // SAFETY: the caller guarantees 64 readable bytes at `key`.
            let k = unsafe { _mm256_loadu_si256(key.add(32 * j).cast()) };
            let mixed = _mm256_xor_si256(_mm256_xor_si256(*a, _mm256_srli_epi64::<47>(*a)), k);
            let hi = _mm256_shuffle_epi32::<0x31>(mixed);
            let lo_product = _mm256_mul_epu32(mixed, prime);
            let hi_product = _mm256_mul_epu32(hi, prime);
            *a = _mm256_add_epi64(lo_product, _mm256_slli_epi64::<32>(hi_product));
        }
    }

    fn read64(b: &[u8], at: usize) -> u64 {
        u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
    }

    fn merge(acc: &[u64; 8], secret: &[u8], start: u64) -> u64 {
        let mut result = start;
        for i in 0..4 {
            let a = acc[2 * i] ^ read64(secret, 16 * i);
            let b = acc[2 * i + 1] ^ read64(secret, 16 * i + 8);
            let product = u128::from(a) * u128::from(b);
            result = result.wrapping_add((product as u64) ^ ((product >> 64) as u64));
        }
        result ^= result >> 37;
        result = result.wrapping_mul(PRIME_MX1);
        result ^ (result >> 32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::segment::heap::HeapSegment;

    /// The fused and the plain paths both give the checksum of the copy, as `twox-hash` computes it, and
    /// both copy every byte, for lengths across XXH3's size classes and block boundaries.
    #[test]
    fn copy_and_checksum_matches_twox_hash_at_every_length_class() {
        let seg = HeapSegment::new(3 << 20);
        let mut bytes: Vec<u8> =
            (0..seg.len()).map(|i| (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15).to_le_bytes()[5]).collect();
        // A nonzero checksum field, which the checksum must treat as zero.
        bytes[CHECKSUM_OFFSET..CHECKSUM_OFFSET + 8].fill(0xCC);
        seg.copy_in(0, &bytes);
        let header: [u8; 64] = bytes[..64].try_into().unwrap();
        let mut lengths: Vec<usize> = (64..1300).collect();
        lengths.extend([
            2047,
            2048,
            2049,
            4095,
            4096,
            65_537,
            COPY_CHUNK - 1,
            COPY_CHUNK + 65,
            COPY_CHUNK + CHUNK_SLACK - 1,
        ]);
        lengths.extend([COPY_CHUNK + CHUNK_SLACK, 2 * COPY_CHUNK + 1023, 2 * COPY_CHUNK + 1024, (3 << 20) - 1]);
        for len in lengths {
            let mut expected_input = bytes[..len].to_vec();
            expected_input[CHECKSUM_OFFSET..CHECKSUM_OFFSET + 8].fill(0);
            let expected = twox_hash::XxHash3_64::oneshot(&expected_input);
            let mut dst = vec![0u8; len];
            assert_eq!(copy_and_checksum(&seg, 0, &header, &mut dst), expected, "fused, len {len}");
            assert!(dst == bytes[..len], "fused copy, len {len}");
            let mut ahead = FrameCopier::new(&seg, 0, &header, len).prefetching();
            let mut dst = vec![0u8; len];
            while ahead.next_len() > 0 {
                let at = ahead.pos;
                let n = ahead.next_len();
                ahead.copy_next(&mut dst[at..at + n]);
            }
            assert_eq!(ahead.finish(), expected, "prefetching, len {len}");
            assert!(dst == bytes[..len], "prefetching copy, len {len}");
            let mut plain = FrameCopier::new_plain(&seg, 0, &header, len);
            let mut dst = vec![0u8; len];
            while plain.next_len() > 0 {
                let mut chunk = vec![0u8; plain.next_len()];
                let range = plain.copy_next(&mut chunk);
                dst[range].copy_from_slice(&chunk);
            }
            assert_eq!(plain.finish(), expected, "plain, len {len}");
            assert!(dst == bytes[..len], "plain copy, len {len}");
        }
    }
}
