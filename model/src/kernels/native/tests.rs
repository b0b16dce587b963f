use super::*;
use crate::quant::dequantize_blocks;

const TYPES: [GgmlType; 8] = [
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
];

/// Every kernel this CPU runs.
fn kernels() -> Vec<Kernel> {
    let mut all = vec![Kernel::Portable];
    #[cfg(target_arch = "x86_64")]
    if avx2::available() {
        all.push(Kernel::Avx2);
        if avx2::vnni() {
            all.push(Kernel::Vnni);
        }
        if avx2::vnni_vl() {
            all.push(Kernel::VnniVl);
        }
        if avx512::available() {
            all.push(Kernel::Avx512);
        }
    }
    all
}

/// Every chunk is the block's dequantized values, up to the rounding of `d * isc * v + m`.
#[test]
fn chunks_are_the_dequantized_weights() {
    for (i, ty) in TYPES.into_iter().enumerate() {
        let bytes = super::super::tests::random_blocks(ty, 4 * ty.block_elems(), i as u32);
        let mut want = vec![0f32; 4 * ty.block_elems()];
        dequantize_blocks(ty, &bytes, &mut want);
        for (bi, b) in bytes.chunks_exact(ty.block_bytes()).enumerate() {
            for c in 0..ty.block_elems() / QK {
                let ch = chunk(ty, b, c);
                for k in 0..QK {
                    let got = ch.d * f32::from(ch.isc[k / 16]) * f32::from(ch.v[k]) + ch.m;
                    let want = want[bi * ty.block_elems() + c * QK + k];
                    assert!((got - want).abs() <= 1e-5 * want.abs().max(1.0), "{} chunk {c} value {k}", ty.name());
                }
            }
        }
    }
}

/// Every SIMD kernel gives the portable kernel's bits for every block type, batch and weight row
/// (the tiled AVX-512 kernel from [`TILED_FROM`] rows on, the tiled 256-bit one from
/// [`TILED_FROM_256`] with whole and partial groups of rows, with partial tiles of pairs and of weight
/// rows; a decode step's few rows against many weight rows), and the products are the dequantized weights' within the activations' quantization.
#[test]
fn simd_equals_portable_on_every_block_type_in_any_batch() {
    let (n, rows, t) = (512, 37, 39);
    let x: Vec<f32> = (0..t * n).map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0).collect();
    let xq = Q8::new(&x, t, n).unwrap();
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    for (i, ty) in TYPES.into_iter().enumerate() {
        let w = super::super::tests::random_blocks(ty, rows * n, 7 + i as u32);
        let mut f = vec![0f32; rows * n];
        dequantize_blocks(ty, &w, &mut f);
        let mut portable = vec![0f32; t * rows];
        dots(&Acts::new(&xq, false), ty, &w, 0..rows, &mut portable);
        for r in 0..t {
            for j in 0..rows {
                let exact: f32 = (0..n).map(|k| x[r * n + k] * f[j * n + k]).sum();
                let scale: f32 = (0..n).map(|k| (x[r * n + k] * f[j * n + k]).abs()).sum();
                let got = portable[r * rows + j];
                assert!((got - exact).abs() <= 0.02 * scale + 1e-4, "{}: {got} vs {exact}", ty.name());
            }
        }
        for kernel in kernels() {
            let mut all = vec![0f32; t * rows];
            dots(&Acts::with(kernel, &xq), ty, &w, 0..rows, &mut all);
            assert_eq!(bits(&all), bits(&portable), "{} {kernel:?}, every row", ty.name());
            let lens = [(0, 1), (3, 1), (1, 2), (2, 3), (0, 4), (1, 6), (0, 7), (3, 16), (1, 17), (6, 33)];
            // Every width of the 256-bit tiled kernel's last group (8 + 2 ..= 8 + 6).
            let groups = [(2, 10), (1, 11), (0, 12), (0, 13), (4, 14)];
            for (from, len) in lens.into_iter().chain(groups) {
                let xs = Q8::new(&x[from * n..(from + len) * n], len, n).unwrap();
                // Three weight rows: a pair of them side by side, then one alone.
                let mut got = vec![0f32; len * 3];
                dots(&Acts::with(kernel, &xs), ty, &w, 3..6, &mut got);
                let want: Vec<f32> =
                    (from..from + len).flat_map(|r| portable[r * rows + 3..r * rows + 6].to_vec()).collect();
                assert_eq!(bits(&got), bits(&want), "{} {kernel:?} rows {from}+{len}", ty.name());
            }
            // A decode step's rows against many weight rows.
            for (from, len) in [(0, 1), (5, 2), (2, 3), (9, 4)] {
                let xs = Q8::new(&x[from * n..(from + len) * n], len, n).unwrap();
                for js in [0..rows, 2..rows, 4..12] {
                    let mut got = vec![0f32; len * js.len()];
                    dots(&Acts::with(kernel, &xs), ty, &w, js.clone(), &mut got);
                    let want: Vec<f32> = (from..from + len)
                        .flat_map(|r| portable[r * rows + js.start..r * rows + js.end].to_vec())
                        .collect();
                    assert_eq!(bits(&got), bits(&want), "{} {kernel:?} rows {from}+{len}, {js:?}", ty.name());
                }
            }
        }
    }
}

/// Rows interleaved, for every type that has the layout: every kernel gives the portable kernel's bits for
/// any number of activation rows (whole passes of four and a rest) and any range of whole groups, each
/// row's bits the same whatever the batch; the products are the dequantized weights' within the
/// activations' quantization, and the interleaved rows dequantize to the blocks' values.
#[test]
fn interleaved_simd_equals_portable_in_any_batch() {
    use super::super::weight::{BlockBytes, Interleaved, Weight, GROUP};
    let (n, rows, t) = (512, 3 * GROUP, 9);
    let x: Vec<f32> = (0..t * n).map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0).collect();
    let xq = Q8::new(&x, t, n).unwrap();
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    for (s, ty) in TYPES.into_iter().filter(|&ty| ty != GgmlType::Q5K).enumerate() {
        let blocks = super::super::tests::random_blocks(ty, rows * n, 5 + s as u32);
        let w = Weight::from_blocks(ty, BlockBytes::Owned(blocks.clone()), n);
        let m = Interleaved::of(&w).expect("whole groups of rows");
        let f = w.to_f32().into_owned();
        assert_eq!(bits(&Weight::Interleaved(m.clone()).to_f32()), bits(&f), "{} values", ty.name());
        let mut portable = vec![0f32; t * rows];
        interleaved_dots(&Acts::new(&xq, false), &m, 0..rows, &mut portable);
        // The same integer sums and scales as the row-major blocks' kernels, in another order of float
        // additions: equal but for a few roundings.
        let mut blocked = vec![0f32; t * rows];
        dots(&Acts::new(&xq, false), ty, &blocks, 0..rows, &mut blocked);
        for r in 0..t {
            for j in 0..rows {
                let exact: f32 = (0..n).map(|k| x[r * n + k] * f[j * n + k]).sum();
                let scale: f32 = (0..n).map(|k| (x[r * n + k] * f[j * n + k]).abs()).sum();
                let (got, row_major) = (portable[r * rows + j], blocked[r * rows + j]);
                assert!((got - exact).abs() <= 0.02 * scale + 1e-4, "{} row {r}, {j}: {got} vs {exact}", ty.name());
                assert!((got - row_major).abs() <= 1e-5 * scale, "{} row {r}, {j}: {got} vs {row_major}", ty.name());
            }
        }
        for kernel in kernels() {
            for (from, len) in [(0, 9), (0, 1), (3, 1), (1, 2), (2, 3), (0, 4), (4, 5)] {
                let xs = Q8::new(&x[from * n..(from + len) * n], len, n).unwrap();
                for js in [0..rows, GROUP..rows, GROUP..2 * GROUP] {
                    let mut got = vec![0f32; len * js.len()];
                    interleaved_dots(&Acts::with(kernel, &xs), &m, js.clone(), &mut got);
                    let want: Vec<f32> = (from..from + len)
                        .flat_map(|r| portable[r * rows + js.start..r * rows + js.end].to_vec())
                        .collect();
                    assert_eq!(bits(&got), bits(&want), "{} {kernel:?} rows {from}+{len}, {js:?}", ty.name());
                }
            }
        }
        // Not whole groups of rows: no interleaved form.
        let short = Weight::from_blocks(ty, BlockBytes::Owned(blocks[..blocks.len() / rows].to_vec()), n);
        assert!(Interleaved::of(&short).is_none());
    }
    let k = super::super::tests::random_blocks(GgmlType::Q5K, 16 * 256, 6);
    assert!(Interleaved::of(&Weight::from_blocks(GgmlType::Q5K, BlockBytes::Owned(k), 256)).is_none());
}

/// Every value at its largest magnitude and every activation at its largest, of one sign and of the
/// other: the AVX2 kernel's 16-bit sums of several `maddubs` (`Form::run`) stay below `i16::MAX`, so
/// every kernel still gives the portable kernel's bits.
#[test]
fn interleaved_simd_equals_portable_at_the_largest_values() {
    use super::super::weight::{BlockBytes, Interleaved, Weight, GROUP};
    let (n, t) = (512, 3);
    let x: Vec<f32> = (0..t * n).map(|i| [1.0, -1.0, if i % 2 == 0 { 1.0 } else { -0.5 }][i / n]).collect();
    let xq = Q8::new(&x, t, n).unwrap();
    for (s, ty) in TYPES.into_iter().filter(|&ty| ty != GgmlType::Q5K).enumerate() {
        let mut blocks = super::super::tests::random_blocks(ty, GROUP * n, 40 + s as u32);
        // The bytes of the values (not the scales): all bits set, or Q8_0's -128.
        let (values, fill) = match ty {
            GgmlType::Q8_0 => (2..34, 0x80),
            GgmlType::Q4_0 => (2..18, 0xFF),
            GgmlType::Q4_1 => (4..20, 0xFF),
            GgmlType::Q5_0 => (2..22, 0xFF),
            GgmlType::Q5_1 => (4..24, 0xFF),
            GgmlType::Q4K => (16..144, 0xFF),
            _ => (0..192, 0xFF),
        };
        for b in blocks.chunks_exact_mut(ty.block_bytes()) {
            b[values.clone()].fill(fill);
        }
        let m = Interleaved::of(&Weight::from_blocks(ty, BlockBytes::Owned(blocks), n)).expect("whole groups");
        let mut want = vec![0f32; t * GROUP];
        interleaved_dots(&Acts::new(&xq, false), &m, 0..GROUP, &mut want);
        for kernel in kernels() {
            let mut got = vec![0f32; t * GROUP];
            interleaved_dots(&Acts::with(kernel, &xq), &m, 0..GROUP, &mut got);
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "{} {kernel:?}", ty.name());
        }
    }
}

/// Every product, row-major or interleaved, is the dequantized weights' with the quantized activations
/// (`d * q`), up to the float additions' roundings: the offsets' terms (Q4_1, Q5_1, the K-quants'
/// minimums) take the sum of the quantized values, not of the values before quantization, which added
/// `m` times every activation's rounding error. The activations here sit away from zero, where that error
/// was largest.
#[test]
fn products_are_the_weights_with_the_quantized_activations() {
    use super::super::weight::{BlockBytes, Interleaved, Weight, GROUP};
    let (n, rows, t) = (512, 2 * GROUP, 3);
    let x: Vec<f32> = (0..t * n).map(|i| 0.6 + ((i * 37 % 101) as f32 - 50.0) / 97.0).collect();
    let xq = Q8::new(&x, t, n).unwrap();
    // The activations as the products see them.
    let seen: Vec<f64> = (0..t)
        .flat_map(|r| {
            let a = xq.act(r);
            (0..n).map(move |k| f64::from(a.d[k / QK]) * f64::from(a.q[k]))
        })
        .collect();
    for (i, ty) in TYPES.into_iter().enumerate() {
        let blocks = super::super::tests::random_blocks(ty, rows * n, 11 + i as u32);
        let w = Weight::from_blocks(ty, BlockBytes::Owned(blocks.clone()), n);
        let f = w.to_f32().into_owned();
        let mut row_major = vec![0f32; t * rows];
        dots(&Acts::new(&xq, false), ty, &blocks, 0..rows, &mut row_major);
        let mut interleaved = None;
        if let Some(m) = Interleaved::of(&w) {
            let mut out = vec![0f32; t * rows];
            interleaved_dots(&Acts::new(&xq, false), &m, 0..rows, &mut out);
            interleaved = Some(out);
        }
        for r in 0..t {
            for j in 0..rows {
                let terms = (0..n).map(|k| seen[r * n + k] * f64::from(f[j * n + k]));
                let (want, scale) = terms.fold((0f64, 0f64), |(s, a), v| (s + v, a + v.abs()));
                let tol = 1e-5 * scale;
                let got = row_major[r * rows + j];
                assert!((f64::from(got) - want).abs() <= tol, "{} row-major {r}, {j}: {got} vs {want}", ty.name());
                if let Some(out) = &interleaved {
                    let got = out[r * rows + j];
                    assert!(
                        (f64::from(got) - want).abs() <= tol,
                        "{} interleaved {r}, {j}: {got} vs {want}",
                        ty.name()
                    );
                }
            }
        }
    }
}
