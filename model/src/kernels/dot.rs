//! f32 dot products in one fixed order, many at a time.
//!
//! Every f32 dot product of the forward pass — each output of a linear layer, each attention score —
//! is the same sequence of operations, whichever kernel computes it and whatever else it computes
//! alongside:
//! 1. lane `l` (of 16) accumulates `a[k] * b[k]` for `k ≡ l (mod 16)`, in increasing `k`, with fused
//!    multiply-adds starting from 0 (two vectors of 8: two independent dependency chains per output, so
//!    even one output at a time is not bound by the multiply-add latency);
//! 2. lanes `l` and `l + 8` are added, then the 8 sums as `((s0 + s4) + (s2 + s6)) + ((s1 + s5) + (s3 + s7))`;
//! 3. the elements past the last multiple of 16 are added one by one, with fused multiply-adds.
//!
//! A tile of `R` activation rows by `C` weight rows loads each weight vector once for all `R` rows (and
//! each activation vector once for all `C` weights), but keeps one accumulator per output, so the tile
//! shape changes which loads are shared and never an output's bits. That is what makes a row's result
//! independent of the batch it is in, of the chunk a prompt is cut into and of the thread that runs it.
//! The AVX2/FMA kernel and the portable one give the same bits (tested): both fuse the same
//! multiply-adds, and IEEE addition is commutative.

/// Lanes of one accumulator vector.
const LANES: usize = 8;
/// Accumulator vectors per output.
const VECS: usize = 2;
/// Elements per step.
const STEP: usize = LANES * VECS;
/// Activation rows per tile.
pub(crate) const TILE_ROWS: usize = 4;
/// Weight rows per tile with many rows: 3 x 2 outputs of 2 accumulators, 2 weight vectors and one
/// activation vector fill 15 of the 16 AVX2 registers.
pub(crate) const TILE_COLS: usize = 2;
/// Activation rows per tile with many rows.
const WIDE_ROWS: usize = 3;

/// Step 2: the fixed sum of the lanes.
#[inline(always)]
pub(crate) fn reduce(a: [[f32; LANES]; VECS]) -> f32 {
    tree8(std::array::from_fn(|l| a[0][l] + a[1][l]))
}

/// The fixed sum of 8 lanes, `((s0 + s4) + (s2 + s6)) + ((s1 + s5) + (s3 + s7))`: what an AVX2 horizontal
/// sum (high half onto low, then pairs) computes.
#[inline(always)]
pub(crate) fn tree8(s: [f32; LANES]) -> f32 {
    let s4 = [s[0] + s[4], s[1] + s[5], s[2] + s[6], s[3] + s[7]];
    (s4[0] + s4[2]) + (s4[1] + s4[3])
}

/// The element type of the rows a kernel's second operand reads: f32, or a 16-bit type a KV cache may
/// hold, read in place and widened to f32 as each vector is loaded. Widening is exact, so a product over
/// bf16 or f16 rows has the bits of the same product over the rows widened to f32 beforehand.
pub trait Elem: Copy + Send + Sync + sealed::Sealed + 'static {
    /// Which of the three it is, for the loads.
    #[doc(hidden)]
    const KIND: ElemKind;
    /// The value as f32 (exact).
    fn widen(self) -> f32;
}

/// [`Elem::KIND`].
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ElemKind {
    /// f32.
    F32,
    /// bfloat16.
    Bf16,
    /// IEEE half.
    F16,
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
    impl Sealed for half::f16 {}
}

impl Elem for f32 {
    const KIND: ElemKind = ElemKind::F32;
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
}

impl Elem for half::bf16 {
    const KIND: ElemKind = ElemKind::Bf16;
    #[inline(always)]
    fn widen(self) -> f32 {
        self.to_f32()
    }
}

impl Elem for half::f16 {
    const KIND: ElemKind = ElemKind::F16;
    #[inline(always)]
    fn widen(self) -> f32 {
        self.to_f32()
    }
}

/// 8 elements from `p`, widened to f32.
///
/// # Safety
///
/// The CPU supports AVX2, FMA and F16C; `p` points to 8 readable elements.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn load8<E: Elem>(p: *const E) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    // SAFETY: 8 elements at `p` (the caller's contract); unaligned loads.
    unsafe {
        match E::KIND {
            ElemKind::F32 => _mm256_loadu_ps(p.cast()),
            ElemKind::Bf16 => {
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast()))))
            }
            ElemKind::F16 => _mm256_cvtph_ps(_mm_loadu_si128(p.cast())),
        }
    }
}

/// 16 elements from `p`, widened to f32.
///
/// # Safety
///
/// The CPU supports AVX-512F (and [`load8`]'s features); `p` points to 16 readable elements.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
#[inline]
unsafe fn load16<E: Elem>(p: *const E) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    // SAFETY: 16 elements at `p` (the caller's contract); unaligned loads.
    unsafe {
        match E::KIND {
            ElemKind::F32 => _mm512_loadu_ps(p.cast()),
            ElemKind::Bf16 => {
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast()))))
            }
            ElemKind::F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())),
        }
    }
}

/// Which instructions run the f32 kernels: the bits are the same whichever does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Isa {
    Portable,
    /// AVX2 and FMA: an output's 16 lanes are two vectors.
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// AVX-512F: an output's 16 lanes are one vector, so a tile holds twice the outputs.
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Isa {
    /// The widest this CPU runs (`simd` false: the portable one). The CPU is checked here, whatever the
    /// caller passes, so no SIMD kernel is chosen where it cannot run.
    #[inline]
    pub(crate) fn best(simd: bool) -> Self {
        #[cfg(target_arch = "x86_64")]
        if simd && self::simd() {
            return if std::arch::is_x86_feature_detected!("avx512f") { Isa::Avx512 } else { Isa::Avx2 };
        }
        let _ = simd;
        Isa::Portable
    }

    /// Every one this CPU runs, for tests.
    #[cfg(test)]
    pub(crate) fn all() -> Vec<Self> {
        let mut all = vec![Isa::Portable];
        #[cfg(target_arch = "x86_64")]
        if simd() {
            all.push(Isa::Avx2);
            if Isa::best(true) == Isa::Avx512 {
                all.push(Isa::Avx512);
            }
        }
        all
    }
}

/// Whether the AVX2/FMA kernels can run here (with F16C, which every AVX2 CPU has, for 16-bit K/V rows).
#[inline]
pub(crate) fn simd() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `out[r][c] = x[r] . w[c]` over the first `n` elements, portably.
#[inline(always)]
#[allow(clippy::needless_range_loop)]
fn tile_portable<const R: usize, const C: usize, W: Elem>(x: [&[f32]; R], w: [&[W]; C], n: usize) -> [[f32; C]; R] {
    let mut acc = [[[[0f32; LANES]; VECS]; C]; R];
    let whole = n / STEP * STEP;
    for k in (0..whole).step_by(STEP) {
        for c in 0..C {
            for r in 0..R {
                for v in 0..VECS {
                    let (xv, wv) = (&x[r][k + v * LANES..][..LANES], &w[c][k + v * LANES..][..LANES]);
                    for l in 0..LANES {
                        acc[r][c][v][l] = xv[l].mul_add(wv[l].widen(), acc[r][c][v][l]);
                    }
                }
            }
        }
    }
    let mut out = [[0f32; C]; R];
    for r in 0..R {
        for c in 0..C {
            let mut s = reduce(acc[r][c]);
            for k in whole..n {
                s = x[r][k].mul_add(w[c][k].widen(), s);
            }
            out[r][c] = s;
        }
    }
    out
}

/// The same outputs as [`tile_portable`], with AVX2/FMA.
///
/// # Safety
///
/// The CPU supports AVX2 and FMA, and every slice holds at least `n` elements.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
// Index loops over the small constant-size arrays keep the two kernels visibly the same sequence.
#[allow(clippy::needless_range_loop)]
unsafe fn tile_avx2<const R: usize, const C: usize, W: Elem>(x: [&[f32]; R], w: [&[W]; C], n: usize) -> [[f32; C]; R] {
    use std::arch::x86_64::*;
    let mut acc = [[[_mm256_setzero_ps(); VECS]; C]; R];
    let whole = n / STEP * STEP;
    let mut k = 0;
    while k < whole {
        for v in 0..VECS {
            let mut wv = [_mm256_setzero_ps(); C];
            for c in 0..C {
                // SAFETY: k + 16 <= n <= w[c].len(); unaligned load.
                wv[c] = unsafe { load8(w[c].as_ptr().add(k + v * LANES)) };
            }
            for r in 0..R {
                // SAFETY: k + 16 <= n <= x[r].len(); unaligned load.
                let xv = unsafe { _mm256_loadu_ps(x[r].as_ptr().add(k + v * LANES)) };
                for c in 0..C {
                    acc[r][c][v] = _mm256_fmadd_ps(xv, wv[c], acc[r][c][v]);
                }
            }
        }
        k += STEP;
    }
    let mut out = [[0f32; C]; R];
    for r in 0..R {
        for c in 0..C {
            let mut lanes = [[0f32; LANES]; VECS];
            for v in 0..VECS {
                // SAFETY: 8 f32s; unaligned store.
                unsafe { _mm256_storeu_ps(lanes[v].as_mut_ptr(), acc[r][c][v]) };
            }
            let mut s = reduce(lanes);
            for k in whole..n {
                s = x[r][k].mul_add(w[c][k].widen(), s);
            }
            out[r][c] = s;
        }
    }
    out
}

/// The same outputs as [`tile_portable`], with AVX-512F: lane `l` of an output's one vector is lane
/// `l % 8` of its vector `l / 8` in [`tile_avx2`].
///
/// # Safety
///
/// The CPU supports AVX-512F, and every slice holds at least `n` elements.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
#[inline]
#[allow(clippy::needless_range_loop)]
unsafe fn tile_avx512<const R: usize, const C: usize, W: Elem>(
    x: [&[f32]; R],
    w: [&[W]; C],
    n: usize,
) -> [[f32; C]; R] {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); C]; R];
    let whole = n / STEP * STEP;
    let mut k = 0;
    while k < whole {
        let mut wv = [_mm512_setzero_ps(); C];
        for c in 0..C {
            // SAFETY: k + 16 <= n <= w[c].len(); unaligned load.
            wv[c] = unsafe { load16(w[c].as_ptr().add(k)) };
        }
        for r in 0..R {
            // SAFETY: k + 16 <= n <= x[r].len(); unaligned load.
            let xv = unsafe { _mm512_loadu_ps(x[r].as_ptr().add(k)) };
            for c in 0..C {
                acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
            }
        }
        k += STEP;
    }
    let mut out = [[0f32; C]; R];
    if R * C >= 4 {
        // Sixteen outputs' lane sums at once, the same additions as `reduce`.
        for first in (0..R * C).step_by(16) {
            let v = std::array::from_fn(|i| {
                let o = first + i;
                if o < R * C {
                    acc[o / C][o % C]
                } else {
                    _mm512_setzero_ps()
                }
            });
            // SAFETY: the CPU supports AVX-512F (this function's contract).
            let sums = unsafe { reduce16(v) };
            for (i, &s) in sums.iter().enumerate().take(R * C - first) {
                out[(first + i) / C][(first + i) % C] = s;
            }
        }
    } else {
        for r in 0..R {
            for c in 0..C {
                let mut lanes = [[0f32; LANES]; VECS];
                // SAFETY: 16 f32s, the two halves in order; unaligned store.
                unsafe { _mm512_storeu_ps(lanes.as_mut_ptr().cast(), acc[r][c]) };
                out[r][c] = reduce(lanes);
            }
        }
    }
    for r in 0..R {
        for c in 0..C {
            for k in whole..n {
                out[r][c] = x[r][k].mul_add(w[c][k].widen(), out[r][c]);
            }
        }
    }
    out
}

/// [`reduce`] of sixteen vectors at once (lane `l` of an output's vector is lane `l % 8` of its vector
/// `l / 8` there): the same additions of the same pairs, four levels of them, each level adding two
/// shuffles of its vectors so that every addition serves several outputs. 45 vector instructions for
/// sixteen sums where the lane-by-lane sum takes about 30 scalar ones for each.
///
/// # Safety
///
/// The CPU supports AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,avx512f")]
#[inline]
pub(crate) unsafe fn reduce16(v: [std::arch::x86_64::__m512; 16]) -> [f32; 16] {
    use std::arch::x86_64::*;
    // 1: `s[l] = a[l] + a[l + 8]`; two outputs per vector, [s of 2i | s of 2i + 1].
    let s: [__m512; 8] = std::array::from_fn(|i| {
        let (a, b) = (v[2 * i], v[2 * i + 1]);
        _mm512_add_ps(_mm512_shuffle_f32x4::<0x44>(a, b), _mm512_shuffle_f32x4::<0xEE>(a, b))
    });
    // 2: `t[j] = s[j] + s[j + 4]`; four outputs per vector, one per 128-bit block.
    let t: [__m512; 4] = std::array::from_fn(|i| {
        let (a, b) = (s[2 * i], s[2 * i + 1]);
        _mm512_add_ps(_mm512_shuffle_f32x4::<0x88>(a, b), _mm512_shuffle_f32x4::<0xDD>(a, b))
    });
    // 3: `u = [t[0] + t[2], t[1] + t[3]]`; block `b` holds outputs `b` and `4 + b` (or `8 + b` and
    // `12 + b`), two lanes each.
    let u: [__m512; 2] = std::array::from_fn(|i| {
        let (a, b) = (t[2 * i], t[2 * i + 1]);
        _mm512_add_ps(_mm512_shuffle_ps::<0x44>(a, b), _mm512_shuffle_ps::<0xEE>(a, b))
    });
    // 4: `u[0] + u[1]`; lane `4b + j` holds output `4j + b`.
    let r = _mm512_add_ps(_mm512_shuffle_ps::<0x88>(u[0], u[1]), _mm512_shuffle_ps::<0xDD>(u[0], u[1]));
    let mut lanes = [0f32; 16];
    // SAFETY: 16 f32s; unaligned store.
    unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), r) };
    std::array::from_fn(|o| lanes[4 * (o % 4) + o / 4])
}

#[inline(always)]
fn tile<const R: usize, const C: usize, W: Elem>(isa: Isa, x: [&[f32]; R], w: [&[W]; C], n: usize) -> [[f32; C]; R] {
    assert!(x.iter().all(|x| x.len() >= n) && w.iter().all(|w| w.len() >= n), "dot product operands");
    match isa {
        Isa::Portable => tile_portable(x, w, n),
        // SAFETY: `Isa::best` gives it only where AVX2 and FMA are present; lengths asserted above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { tile_avx2(x, w, n) },
        // SAFETY: `Isa::best` gives it only where AVX-512F is present; lengths asserted above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { tile_avx512(x, w, n) },
    }
}

/// One dot product in the fixed order.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    Dot::new().of(a, b)
}

/// [`dot`] with the CPU's features looked up once, for loops of many short products (attention).
#[derive(Clone, Copy, Debug)]
pub struct Dot {
    isa: Isa,
}

impl Default for Dot {
    fn default() -> Self {
        Dot::new()
    }
}

impl Dot {
    /// Looks up the CPU's features.
    pub fn new() -> Self {
        Dot { isa: Isa::best(simd()) }
    }

    /// `a . b` in the fixed order.
    #[inline]
    pub fn of(self, a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len(), "dot product of unequal lengths");
        tile::<1, 1, f32>(self.isa, [a], [b], a.len())[0][0]
    }

    /// `out[i] = fma(w[k], rows[k][at + i], out[i])` for `k = 0, 1, ...` in order (one fused multiply-add
    /// per element and row, in every kernel), with each element kept in a register across a few rows at
    /// a time (attention's weighted sum of values: one pass over `out` per few keys, not per key).
    pub fn add_scaled_rows<E: Elem>(self, out: &mut [f32], w: &[f32], rows: &[&[E]], at: usize) {
        let n = out.len();
        assert!(w.len() == rows.len() && rows.iter().all(|r| r.len() >= at + n), "scaled add rows");
        match self.isa {
            // SAFETY: `Isa::best` gives it only where AVX2 and FMA are present; lengths asserted above.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => return unsafe { add_scaled_rows_avx2(out, w, rows, at) },
            // SAFETY: `Isa::best` gives it only where AVX-512F is present; lengths asserted above.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => return unsafe { add_scaled_rows_avx512(out, w, rows, at) },
            Isa::Portable => {}
        }
        for (&w, r) in w.iter().zip(rows) {
            for (o, &x) in out.iter_mut().zip(&r[at..at + n]) {
                *o = w.mul_add(x.widen(), *o);
            }
        }
    }

    /// `out[i * rows.len() + j] = queries[i] . rows[j][at..]` for every query and row, each with the bits
    /// of [`Dot::of`]: several queries against the same keys (attention's heads that share a K/V head,
    /// at consecutive positions), by tiles, so each key is loaded once for up to four queries.
    pub fn of_rows_multi<E: Elem>(self, queries: &[&[f32]], rows: &[&[E]], at: usize, out: &mut [f32]) {
        let n = queries.first().map_or(0, |q| q.len());
        assert!(
            queries.iter().all(|q| q.len() == n)
                && rows.iter().all(|r| r.len() >= at + n)
                && out.len() == queries.len() * rows.len(),
            "dot product rows"
        );
        tiles(self.isa, Stream::Keys, queries.len(), rows.len(), n, |i| queries[i], |j| &rows[j][at..], out);
    }

    /// [`Dot::add_scaled_rows`] for several outputs over the same rows, each with its own weights:
    /// `outs[q][i] += ws[q][k] * rows[k][at + i]` for `k = 0, 1, ...`, the same bits as one call per
    /// output, with each row loaded once for up to four outputs.
    pub fn add_scaled_rows_multi<E: Elem>(self, outs: &mut [&mut [f32]], ws: &[&[f32]], rows: &[&[E]], at: usize) {
        let n = outs.first().map_or(0, |o| o.len());
        assert!(
            outs.iter().all(|o| o.len() == n)
                && ws.len() == outs.len()
                && ws.iter().all(|w| w.len() == rows.len())
                && rows.iter().all(|r| r.len() >= at + n),
            "scaled add rows"
        );
        // Rows per pass: 64 rows of up to 1 KiB stay in L2 while each four outputs pass over them.
        const ROW_BLOCK: usize = 64;
        for k0 in (0..rows.len()).step_by(ROW_BLOCK) {
            let ks = k0..(k0 + ROW_BLOCK).min(rows.len());
            for (outs, ws) in outs.chunks_mut(4).zip(ws.chunks(4)) {
                let ws: Vec<&[f32]> = ws.iter().map(|w| &w[ks.clone()]).collect();
                // The kernels read the block's rows and ask for the rows after it ahead of time.
                let (ahead, count) = (&rows[ks.start..], ks.len());
                // The kernel for this many outputs.
                #[cfg(target_arch = "x86_64")]
                macro_rules! by_count {
                    ($kernel:ident) => {
                        match outs.len() {
                            4 => $kernel::<E, 4>(outs, &ws, ahead, count, at),
                            3 => $kernel::<E, 3>(outs, &ws, ahead, count, at),
                            2 => $kernel::<E, 2>(outs, &ws, ahead, count, at),
                            _ => $kernel::<E, 1>(outs, &ws, ahead, count, at),
                        }
                    };
                }
                match self.isa {
                    // SAFETY: `Isa::best` gives it only where AVX2 and FMA are present; lengths asserted
                    // above.
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx2 => unsafe { by_count!(add_scaled_rows_multi_avx2) },
                    // SAFETY: `Isa::best` gives it only where AVX-512F is present; lengths asserted above.
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx512 => unsafe { by_count!(add_scaled_rows_multi_avx512) },
                    Isa::Portable => {
                        for (o, w) in outs.iter_mut().zip(&ws) {
                            self.add_scaled_rows(o, w, &rows[ks.clone()], at);
                        }
                    }
                }
            }
        }
    }
}

/// Rows per pass of the scaled-add kernels: their vectors stay in L1 while `out` passes once.
const ADD_ROWS: usize = 8;

macro_rules! add_scaled_rows_kernel {
    (
        $name:ident,
        $features:literal,
        $lanes:literal,
        $set1:ident,
        $load:ident,
        $row:ident,
        $store:ident,
        $fmadd:ident
    ) => {
        /// [`Dot::add_scaled_rows`] with these vectors.
        ///
        /// # Safety
        ///
        /// The CPU has the target features; `w` has one weight per row and every row holds
        /// `at + out.len()` values.
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        unsafe fn $name<E: Elem>(out: &mut [f32], w: &[f32], rows: &[&[E]], at: usize) {
            use std::arch::x86_64::*;
            let n = out.len();
            let whole = n / $lanes * $lanes;
            // Four vectors of `out` at a time: four independent chains of additions.
            let quads = n / (4 * $lanes) * (4 * $lanes);
            for (c, (ws, rs)) in w.chunks(ADD_ROWS).zip(rows.chunks(ADD_ROWS)).enumerate() {
                for r in rows.iter().skip(c * ADD_ROWS + ROWS_AHEAD).take(ADD_ROWS) {
                    prefetch_kv_row(&r[at..]);
                }
                let ptrs: [*const E; ADD_ROWS] =
                    std::array::from_fn(|k| rs.get(k).map_or(std::ptr::null(), |r| r[at..].as_ptr()));
                for i in (0..quads).step_by(4 * $lanes) {
                    // SAFETY: i + 4 lanes <= n = out.len(); unaligned loads.
                    let mut acc: [_; 4] = std::array::from_fn(|v| unsafe { $load(out.as_ptr().add(i + v * $lanes)) });
                    for (&wk, &r) in ws.iter().zip(&ptrs) {
                        let wk = $set1(wk);
                        for (v, acc) in acc.iter_mut().enumerate() {
                            // SAFETY: at + i + 4 lanes <= at + n <= the row's length (the caller's contract).
                            let x = unsafe { $row(r.add(i + v * $lanes)) };
                            *acc = $fmadd(wk, x, *acc);
                        }
                    }
                    for (v, acc) in acc.into_iter().enumerate() {
                        // SAFETY: as the loads above; unaligned store.
                        unsafe { $store(out.as_mut_ptr().add(i + v * $lanes), acc) };
                    }
                }
                for i in (quads..whole).step_by($lanes) {
                    // SAFETY: i + lanes <= n = out.len(); unaligned load.
                    let mut acc = unsafe { $load(out.as_ptr().add(i)) };
                    for (&wk, &r) in ws.iter().zip(&ptrs) {
                        // SAFETY: at + i + lanes <= at + n <= the row's length (the caller's contract).
                        let x = unsafe { $row(r.add(i)) };
                        acc = $fmadd($set1(wk), x, acc);
                    }
                    // SAFETY: as the load above; unaligned store.
                    unsafe { $store(out.as_mut_ptr().add(i), acc) };
                }
                for (&wk, r) in ws.iter().zip(rs) {
                    for (o, &x) in out[whole..].iter_mut().zip(&r[at + whole..at + n]) {
                        *o = wk.mul_add(x.widen(), *o);
                    }
                }
            }
        }
    };
}

macro_rules! add_scaled_rows_multi_kernel {
    (
        $name:ident,
        $features:literal,
        $lanes:literal,
        $set1:ident,
        $load:ident,
        $row:ident,
        $store:ident,
        $fmadd:ident
    ) => {
        /// [`Dot::add_scaled_rows_multi`] with these vectors, for up to four outputs, over the first
        /// `count` of `rows` (the rest are only asked for ahead of time): each element's multiplies and
        /// adds in row order, as [`Dot::add_scaled_rows`] does them.
        ///
        /// # Safety
        ///
        /// The CPU has the target features; `Q` outputs, all of one length `n`; each output has `count`
        /// weights, `count <= rows.len()`, and every row holds `at + n` values.
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        #[allow(clippy::needless_range_loop)]
        unsafe fn $name<E: Elem, const Q: usize>(
            outs: &mut [&mut [f32]],
            ws: &[&[f32]],
            rows: &[&[E]],
            count: usize,
            at: usize,
        ) {
            use std::arch::x86_64::*;
            debug_assert!(outs.len() == Q && ws.len() == Q && ws.iter().all(|w| w.len() == count));
            let n = outs[0].len();
            let whole = n / $lanes * $lanes;
            let ptrs: [*mut f32; Q] = std::array::from_fn(|q| outs[q].as_mut_ptr());
            let wps: [*const f32; Q] = std::array::from_fn(|q| ws[q].as_ptr());
            // Two vectors of each output at a time: 2Q independent chains of additions.
            let pairs = n / (2 * $lanes) * (2 * $lanes);
            for (b, rs) in rows[..count].chunks(ADD_ROWS).enumerate() {
                let k0 = b * ADD_ROWS;
                for r in rows.iter().skip(k0 + ROWS_AHEAD).take(ADD_ROWS) {
                    prefetch_kv_row(&r[at..]);
                }
                for i in (0..pairs).step_by(2 * $lanes) {
                    // SAFETY: i + 2 lanes <= n = each output's length and at + i + 2 lanes <= at + n <=
                    // each row's length (unaligned loads and stores); k0 + k < rows.len() = each output's
                    // weight count. Only `ptrs` touch the outputs.
                    unsafe {
                        let mut acc: [[_; 2]; Q] =
                            std::array::from_fn(|q| std::array::from_fn(|v| $load(ptrs[q].add(i + v * $lanes))));
                        for (k, r) in rs.iter().enumerate() {
                            let x: [_; 2] = std::array::from_fn(|v| $row(r.as_ptr().add(at + i + v * $lanes)));
                            for q in 0..Q {
                                let w = $set1(*wps[q].add(k0 + k));
                                for v in 0..2 {
                                    acc[q][v] = $fmadd(w, x[v], acc[q][v]);
                                }
                            }
                        }
                        for q in 0..Q {
                            for v in 0..2 {
                                $store(ptrs[q].add(i + v * $lanes), acc[q][v]);
                            }
                        }
                    }
                }
                for i in (pairs..whole).step_by($lanes) {
                    // SAFETY: as above, one vector.
                    unsafe {
                        let mut acc: [_; Q] = std::array::from_fn(|q| $load(ptrs[q].add(i)));
                        for (k, r) in rs.iter().enumerate() {
                            let x = $row(r.as_ptr().add(at + i));
                            for q in 0..Q {
                                acc[q] = $fmadd($set1(*wps[q].add(k0 + k)), x, acc[q]);
                            }
                        }
                        for q in 0..Q {
                            $store(ptrs[q].add(i), acc[q]);
                        }
                    }
                }
                for (k, r) in rs.iter().enumerate() {
                    for q in 0..Q {
                        for (e, &x) in (whole..n).zip(&r[at + whole..at + n]) {
                            // SAFETY: e < n = each output's length, k0 + k < its weight count.
                            unsafe { *ptrs[q].add(e) = (*wps[q].add(k0 + k)).mul_add(x.widen(), *ptrs[q].add(e)) };
                        }
                    }
                }
            }
        }
    };
}

add_scaled_rows_multi_kernel!(
    add_scaled_rows_multi_avx2,
    "avx2,fma,f16c",
    8,
    _mm256_set1_ps,
    _mm256_loadu_ps,
    load8,
    _mm256_storeu_ps,
    _mm256_fmadd_ps
);
add_scaled_rows_multi_kernel!(
    add_scaled_rows_multi_avx512,
    "avx2,fma,f16c,avx512f",
    16,
    _mm512_set1_ps,
    _mm512_loadu_ps,
    load16,
    _mm512_storeu_ps,
    _mm512_fmadd_ps
);

add_scaled_rows_kernel!(
    add_scaled_rows_avx2,
    "avx2,fma,f16c",
    8,
    _mm256_set1_ps,
    _mm256_loadu_ps,
    load8,
    _mm256_storeu_ps,
    _mm256_fmadd_ps
);
add_scaled_rows_kernel!(
    add_scaled_rows_avx512,
    "avx2,fma,f16c,avx512f",
    16,
    _mm512_set1_ps,
    _mm512_loadu_ps,
    load16,
    _mm512_storeu_ps,
    _mm512_fmadd_ps
);

/// `out[i][j] = x[i] . w[j]` for `t` rows of `x` (`t x n`, row-major) and every row of `w` (`cols x n`),
/// into `out` (`t x cols`). `simd` selects the widest kernel this CPU runs; the bits are the same either
/// way.
pub(crate) fn dots(simd: bool, x: &[f32], t: usize, w: &[f32], n: usize, out: &mut [f32]) {
    dots_with(Isa::best(simd), x, t, w, n, out)
}

/// [`dots`] with the given instructions.
pub(crate) fn dots_with(isa: Isa, x: &[f32], t: usize, w: &[f32], n: usize, out: &mut [f32]) {
    let cols = w.len() / n.max(1);
    assert!(x.len() == t * n && w.len() == cols * n && out.len() == t * cols, "dots shapes");
    tiles(isa, Stream::Weights, t, cols, n, |i| &x[i * n..(i + 1) * n], |j| &w[j * n..(j + 1) * n], out);
}

/// How many rows ahead attention's kernels ask for the K or V rows they will read ([`tiles`] with few
/// rows, the scaled-add kernels): one head's slice of each position's row, an order the hardware
/// prefetcher does not follow. 8 rows ahead left SmolLM2's decode after a 744-token prompt waiting on
/// memory (83 tokens/s, with attention half of each step); 32 gave 96 (one thread, `fast`, Zen 5), 64 no
/// more. They ask from the head's slice to the end of the row: the first K/V head's pass brings whole
/// rows in order, and the later heads' slices are then in L2 (a layer's K and V for a few thousand
/// positions fit), where each head asking for its own slice alone read every row in three strided
/// passes (another 79-86 -> 91-94 tokens/s). They ask for L2 ([`crate::quant::Toward::L2`]): 32 rows
/// of Gemma 3's 1 KiB are L1 whole.
const ROWS_AHEAD: usize = 32;

/// Asks for a K/V row (from the head's slice to the row's end) as attention's kernels do, [`ROWS_AHEAD`]
/// rows before they read it: into L2.
#[inline(always)]
fn prefetch_kv_row<E: Elem>(row: &[E]) {
    crate::quant::prefetch_lines(row.as_ptr().cast(), size_of_val(row), crate::quant::Toward::L2);
}

/// What [`tiles`]' second operand is, where there are few first rows.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Stream {
    /// A layer's weight rows, read once from memory: one at a time streams fastest.
    Weights,
    /// Attention's keys (a head's slice of each position's row, cached): four at a time, so that each
    /// reduction of the lanes serves up to sixteen outputs ([`reduce16`]), where one key at a time
    /// summed a decode step's three or four scores lane by lane.
    Keys,
}

/// `out[i * cols + j] = row(i) . wrow(j)` over the first `n` elements, by tiles: [`dots_with`] over rows
/// given one by one. Every slice holds at least `n` elements.
#[allow(clippy::too_many_arguments)]
fn tiles<'a, 'b, W: Elem>(
    isa: Isa,
    stream: Stream,
    t: usize,
    cols: usize,
    n: usize,
    row: impl Fn(usize) -> &'a [f32],
    wrow: impl Fn(usize) -> &'b [W],
    out: &mut [f32],
) {
    assert_eq!(out.len(), t * cols, "dots shapes");
    // Activation rows per pass over this task's weights: 64 rows of up to 8 KiB stay in L2 while the
    // weight tiles stream past them.
    const ROW_BLOCK: usize = 64;
    for rb in (0..t).step_by(ROW_BLOCK) {
        let rend = (rb + ROW_BLOCK).min(t);
        // With few rows the weights' memory traffic bounds the time, and one weight row at a time
        // streams fastest; with many rows the multiply-adds do, and wider tiles share more loads:
        // 4 x 4 outputs of one vector each, 4 weight vectors and an activation vector in AVX-512's 32
        // registers.
        let few = rend - rb <= TILE_ROWS;
        let (tile_rows, tile_cols) = match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 if few && stream == Stream::Keys => (TILE_ROWS, 4),
            _ if few => (TILE_ROWS, 1),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => (4, 4),
            _ => (WIDE_ROWS, TILE_COLS),
        };
        for c0 in (0..cols).step_by(tile_cols) {
            let nc = tile_cols.min(cols - c0);
            // Few rows: ask for the tile's rows `ROWS_AHEAD` ahead, from the slice to the end of the row
            // (attention's keys are one head's slice of each token's row, an order the hardware
            // prefetcher does not follow well).
            if few {
                for c in (c0 + ROWS_AHEAD..c0 + ROWS_AHEAD + nc).take_while(|&c| c < cols) {
                    match stream {
                        Stream::Keys => prefetch_kv_row(wrow(c)),
                        // As the row kernels stream theirs, to L1.
                        Stream::Weights => crate::quant::prefetch_lines(
                            wrow(c).as_ptr().cast(),
                            size_of_val(wrow(c)),
                            crate::quant::Toward::L1,
                        ),
                    }
                }
            }
            for r0 in (rb..rend).step_by(tile_rows) {
                let nr = tile_rows.min(rend - r0);
                macro_rules! run {
                    ($r:literal, $c:literal) => {{
                        let res = tile::<$r, $c, W>(
                            isa,
                            std::array::from_fn(|i| row(r0 + i)),
                            std::array::from_fn(|j| wrow(c0 + j)),
                            n,
                        );
                        for (i, res) in res.iter().enumerate() {
                            out[(r0 + i) * cols + c0..][..$c].copy_from_slice(res);
                        }
                    }};
                }
                match (nr, nc) {
                    (4, 4) => run!(4, 4),
                    (4, 3) => run!(4, 3),
                    (4, 2) => run!(4, 2),
                    (4, _) => run!(4, 1),
                    (3, 4) => run!(3, 4),
                    (3, 3) => run!(3, 3),
                    (3, 2) => run!(3, 2),
                    (3, _) => run!(3, 1),
                    (2, 4) => run!(2, 4),
                    (2, 3) => run!(2, 3),
                    (2, 2) => run!(2, 2),
                    (2, _) => run!(2, 1),
                    (_, 4) => run!(1, 4),
                    (_, 3) => run!(1, 3),
                    (_, 2) => run!(1, 2),
                    _ => run!(1, 1),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(len: usize, seed: usize) -> Vec<f32> {
        (0..len).map(|i| (((i * 37 + seed * 11) % 101) as f32 - 50.0) * 0.013 + (i % 7) as f32 * 1e-4).collect()
    }

    #[test]
    fn several_queries_and_outputs_at_once_give_each_the_bits_of_one_at_a_time() {
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        // Head sizes with and without a tail past the vectors; 1 to 9 queries; row counts that cross the
        // kernels' blocks of 8 and 64 rows.
        for (n, at) in [(64, 0), (37, 5), (256, 256), (8, 3)] {
            for queries in [1, 3, 4, 5, 9] {
                for rows in [1, 7, 8, 70, 130] {
                    let q = data(queries * n, 3);
                    let kv = data(rows * (at + n), 4);
                    let qs: Vec<&[f32]> = q.chunks_exact(n).collect();
                    let rs: Vec<&[f32]> = kv.chunks_exact(at + n).collect();
                    let w = data(queries * rows, 5);
                    let ws: Vec<&[f32]> = w.chunks_exact(rows).collect();
                    for isa in Isa::all() {
                        let dot = Dot { isa };
                        let mut scores = vec![0f32; queries * rows];
                        dot.of_rows_multi(&qs, &rs, at, &mut scores);
                        let mut alone = vec![0f32; queries * rows];
                        for (i, qv) in qs.iter().enumerate() {
                            for (j, r) in rs.iter().enumerate() {
                                alone[i * rows + j] = Dot { isa: Isa::Portable }.of(qv, &r[at..at + n]);
                            }
                        }
                        assert_eq!(bits(&scores), bits(&alone), "scores: n {n}, {queries} x {rows}, {isa:?}");

                        let start = data(queries * n, 6);
                        let mut many = start.clone();
                        let mut outs: Vec<&mut [f32]> = many.chunks_exact_mut(n).collect();
                        dot.add_scaled_rows_multi(&mut outs, &ws, &rs, at);
                        let mut one = start.clone();
                        for (o, w) in one.chunks_exact_mut(n).zip(&ws) {
                            Dot { isa: Isa::Portable }.add_scaled_rows(o, w, &rs, at);
                        }
                        assert_eq!(bits(&many), bits(&one), "sums: n {n}, {queries} x {rows}, {isa:?}");
                    }
                }
            }
        }
    }

    /// The attention kernels over bf16 or f16 rows, widened as they load, against the same kernels over
    /// the rows widened beforehand.
    fn sixteen_bit_rows_are_read_as_their_f32_values<E: Elem>(narrow: impl Fn(f32) -> E) {
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        // Subnormal in f16, signed zeros, values that round differently in each type.
        let special = [1e-6, -0.0, 0.0, -3.0e4, 65504.0, 1.0 / 3.0, -7.5e-8];
        for (n, at) in [(64, 0), (37, 5), (256, 256), (8, 3)] {
            for (queries, rows) in [(1, 1), (3, 70), (4, 9), (9, 130)] {
                let mut kv = data(rows * (at + n), 4);
                for (x, &v) in kv.iter_mut().step_by(13).zip(special.iter().cycle()) {
                    *x = v;
                }
                let narrow: Vec<E> = kv.iter().map(|&x| narrow(x)).collect();
                let wide: Vec<f32> = narrow.iter().map(|x| x.widen()).collect();
                let (rs, ws16): (Vec<&[f32]>, Vec<&[E]>) =
                    (wide.chunks_exact(at + n).collect(), narrow.chunks_exact(at + n).collect());
                let q = data(queries * n, 3);
                let qs: Vec<&[f32]> = q.chunks_exact(n).collect();
                let w = data(queries * rows, 5);
                let ws: Vec<&[f32]> = w.chunks_exact(rows).collect();
                for isa in Isa::all() {
                    let dot = Dot { isa };
                    let (mut want, mut got) = (vec![0f32; queries * rows], vec![0f32; queries * rows]);
                    dot.of_rows_multi(&qs, &rs, at, &mut want);
                    dot.of_rows_multi(&qs, &ws16, at, &mut got);
                    assert_eq!(bits(&got), bits(&want), "scores: n {n}, {queries} x {rows}, {isa:?}");

                    let (mut want, mut got) = (data(queries * n, 6), data(queries * n, 6));
                    let mut outs: Vec<&mut [f32]> = want.chunks_exact_mut(n).collect();
                    dot.add_scaled_rows_multi(&mut outs, &ws, &rs, at);
                    let mut outs: Vec<&mut [f32]> = got.chunks_exact_mut(n).collect();
                    dot.add_scaled_rows_multi(&mut outs, &ws, &ws16, at);
                    assert_eq!(bits(&got), bits(&want), "sums: n {n}, {queries} x {rows}, {isa:?}");

                    let (mut want, mut got) = (data(n, 7), data(n, 7));
                    dot.add_scaled_rows(&mut want, ws[0], &rs, at);
                    dot.add_scaled_rows(&mut got, ws[0], &ws16, at);
                    assert_eq!(bits(&got), bits(&want), "one output: n {n}, {rows} rows, {isa:?}");
                }
            }
        }
    }

    #[test]
    fn bf16_rows_are_read_as_their_f32_values() {
        sixteen_bit_rows_are_read_as_their_f32_values(half::bf16::from_f32);
    }

    #[test]
    fn f16_rows_are_read_as_their_f32_values() {
        sixteen_bit_rows_are_read_as_their_f32_values(half::f16::from_f32);
    }

    #[test]
    fn every_tile_and_both_kernels_give_each_output_the_same_bits() {
        // 37 elements: four whole groups of lanes and a tail.
        for n in [37, 64, 5, 100] {
            let (t, cols) = (7, 11);
            let (x, w) = (data(t * n, 1), data(cols * n, 2));
            let mut alone = vec![0f32; t * cols];
            for i in 0..t {
                for j in 0..cols {
                    alone[i * cols + j] = tile_portable::<1, 1, f32>([&x[i * n..]], [&w[j * n..]], n)[0][0];
                }
            }
            for isa in Isa::all() {
                let mut out = vec![0f32; t * cols];
                dots_with(isa, &x, t, &w, n, &mut out);
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&out), bits(&alone), "n {n}, {isa:?}");
                // Any subset of rows computes the same rows.
                for (from, len) in [(3, 2), (0, 5), (2, 4), (6, 1)] {
                    let mut some = vec![0f32; len * cols];
                    dots_with(isa, &x[from * n..(from + len) * n], len, &w, n, &mut some);
                    assert_eq!(bits(&some), bits(&alone[from * cols..(from + len) * cols]), "{isa:?} {from}+{len}");
                }
            }
        }
    }

    #[test]
    fn the_fixed_order_is_a_dot_product() {
        let (a, b) = (data(100, 3), data(100, 4));
        let naive: f64 = a.iter().zip(&b).map(|(&x, &y)| f64::from(x) * f64::from(y)).sum();
        assert!((f64::from(dot(&a, &b)) - naive).abs() < 1e-4);
    }

    #[test]
    fn many_keys_and_scaled_adds_give_the_bits_of_one_at_a_time() {
        let q = data(37, 5);
        let keys: Vec<Vec<f32>> = (0..19).map(|i| data(37 + 11, 6 + i)).collect();
        let rows: Vec<&[f32]> = keys.iter().map(|k| &k[..]).collect();
        for isa in Isa::all() {
            let dot = Dot { isa };
            let mut got = vec![0f32; rows.len()];
            dot.of_rows_multi(&[&q], &rows, 11, &mut got);
            for (g, k) in got.iter().zip(&rows) {
                assert_eq!(g.to_bits(), Dot { isa: Isa::Portable }.of(&q, &k[11..]).to_bits(), "{isa:?}");
            }
            // Many rows in one call: the bits of one call per row, for widths with and without whole
            // groups of four vectors.
            let ws: Vec<f32> = (0..rows.len()).map(|i| 0.1 + i as f32 * 0.13).collect();
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            for n in [37, 150] {
                let wide: Vec<Vec<f32>> = (0..rows.len()).map(|i| data(n + 11, 30 + i)).collect();
                let wide: Vec<&[f32]> = wide.iter().map(|k| &k[..]).collect();
                let mut many = data(n, 8);
                let mut one_by_one = many.clone();
                dot.add_scaled_rows(&mut many, &ws, &wide, 11);
                for (&w, r) in ws.iter().zip(&wide) {
                    for (o, &x) in one_by_one.iter_mut().zip(&r[11..11 + n]) {
                        *o = w.mul_add(x, *o);
                    }
                }
                assert_eq!(bits(&many), bits(&one_by_one), "{isa:?} rows of {n}");
            }
        }
    }
}
