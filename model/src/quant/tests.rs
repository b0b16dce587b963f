use super::*;

fn reference() -> serde_json::Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures/reference/dequant_vectors.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

fn floats(v: &serde_json::Value) -> Vec<f32> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
}

/// Every quantized tensor in the reference file: its first blocks dequantize to exactly the reference.
#[test]
fn first_blocks_match_the_gguf_reference_dequantizer() {
    let reference = reference();
    let mut types = std::collections::BTreeSet::new();
    for (name, v) in reference.as_object().unwrap() {
        let Some(id) = v.get("type_id") else { continue };
        let ty = GgmlType::from_id(id.as_u64().unwrap() as u32).unwrap();
        assert_eq!(ty.name(), v["ggml_type"].as_str().unwrap());
        assert_eq!(ty.block_bytes() as u64, v["block_bytes"].as_u64().unwrap());
        assert_eq!(ty.block_elems() as u64, v["block_elems"].as_u64().unwrap());
        let src = hex(v["first_blocks_hex"].as_str().unwrap());
        let want = floats(&v["first_blocks_dequant"]);
        let mut got = vec![0f32; want.len()];
        dequantize(ty, &src, &mut got);
        assert_eq!(got, want, "{name}");
        types.insert(ty.name());
    }
    assert_eq!(types.into_iter().collect::<Vec<_>>(), ["F32", "Q4_1", "Q4_K", "Q5_0", "Q6_K", "Q8_0"]);
}

#[test]
fn f16_and_bf16_match_the_reference() {
    let reference = reference();
    for (key, ty) in [("synthetic::F16", GgmlType::F16), ("synthetic::BF16", GgmlType::Bf16)] {
        let v = &reference[key];
        let src = hex(v["hex"].as_str().unwrap());
        let want = floats(&v["values"]);
        let mut got = vec![0f32; want.len()];
        dequantize(ty, &src, &mut got);
        assert_eq!(got, want, "{key}");
    }
}

/// The AVX2 dequantizer gives every value of the portable one, bit for bit, on random blocks of every
/// block type (scales random too: negative, tiny, large; never NaN or infinite).
#[test]
fn the_avx2_dequantizer_equals_the_portable_one_on_every_block_type() {
    let mut next = crate::testing::xorshift32(0x2545_F491);
    let types = [
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
        GgmlType::F16,
        GgmlType::Bf16,
    ];
    for ty in types {
        let blocks = 64;
        let mut src: Vec<u8> = (0..blocks * ty.block_bytes()).map(|_| next() as u8).collect();
        // Finite f16 scales wherever the type keeps them.
        let fields: &[usize] = match ty {
            GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q5_0 => &[0],
            GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
            GgmlType::Q6K => &[208],
            _ => &[],
        };
        for b in src.chunks_exact_mut(ty.block_bytes()) {
            for &at in fields {
                let v = f16::from_bits(next() as u16);
                let v = if v.is_finite() { v } else { f16::from_f32(-0.75) };
                b[at..at + 2].copy_from_slice(&v.to_bits().to_le_bytes());
            }
        }
        if ty == GgmlType::F16 || ty == GgmlType::Bf16 {
            for b in src.chunks_exact_mut(2) {
                b[1] &= 0x3F; // small exponents: finite
            }
        }
        let n = blocks * ty.block_elems();
        let (mut portable, mut dispatched) = (vec![0f32; n], vec![0f32; n]);
        dequantize_blocks(ty, &src, &mut portable);
        dequantize(ty, &src, &mut dispatched);
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&dispatched), bits(&portable), "{}", ty.name());
        #[cfg(target_arch = "x86_64")]
        if avx2::supports(ty) && avx2::available() {
            dot_rows_agree(ty, &src, &portable);
        }
    }
}

/// The AVX2 and AVX-512 row kernels give the f32 kernel's sums over the dequantized values: per lane,
/// fused multiply-adds in increasing position, then the lanes in its fixed order.
#[cfg(target_arch = "x86_64")]
fn dot_rows_agree(ty: GgmlType, src: &[u8], values: &[f32]) {
    // Two weight rows of half the blocks each, repeated into six (a group of four, then two alone),
    // against three activation rows.
    let n = values.len() / 2;
    let order = [0, 1, 1, 0, 1, 0];
    let row_bytes = src.len() / 2;
    let ws: Vec<u8> = order.iter().flat_map(|&j| &src[j * row_bytes..(j + 1) * row_bytes]).copied().collect();
    let x: Vec<Vec<f32>> =
        (0..3).map(|r| (0..n).map(|i| ((i * 37 + r * 11) % 101) as f32 / 50.0 - 1.0).collect()).collect();
    let xs: [&[f32]; 3] = std::array::from_fn(|r| &x[r][..]);
    let want: Vec<[u32; 3]> = order
        .iter()
        .map(|&j| {
            std::array::from_fn(|r| {
                let mut lanes = [[0f32; 8]; 2];
                for k in 0..n {
                    let l = &mut lanes[(k % 16) / 8][k % 8];
                    *l = xs[r][k].mul_add(values[j * n + k], *l);
                }
                crate::kernels::dot::reduce(lanes).to_bits()
            })
        })
        .collect();
    let bits = |v: &[[f32; 3]]| v.iter().map(|s| s.map(f32::to_bits)).collect::<Vec<_>>();
    let mut got = [[0f32; 3]; 6];
    // SAFETY: AVX2, FMA and F16C (checked by the caller), a supported type, six rows of whole blocks.
    unsafe { avx2::dot_rows::<3, 1>(ty, xs, &ws, n, &mut got) };
    assert_eq!(bits(&got), want, "{} AVX2 rows one at a time", ty.name());
    let mut got = [[0f32; 3]; 6];
    // SAFETY: as above.
    unsafe { avx2::dot_rows::<3, 4>(ty, xs, &ws, n, &mut got) };
    assert_eq!(bits(&got), want, "{} AVX2 rows four side by side", ty.name());
    // One activation row, weight rows two side by side (what Q4_1 runs at one row).
    let mut one = [[0f32; 1]; 6];
    // SAFETY: as above.
    unsafe { avx2::dot_rows::<1, 2>(ty, [xs[0]], &ws, n, &mut one) };
    let first: Vec<u32> = want.iter().map(|w| w[0]).collect();
    assert_eq!(one.iter().map(|s| s[0].to_bits()).collect::<Vec<_>>(), first, "{} AVX2 one row", ty.name());
    if avx512::available() {
        let mut got = [[0f32; 3]; 6];
        // SAFETY: as above, and AVX-512F (checked).
        unsafe { avx512::dot_rows::<3>(ty, xs, &ws, n, &mut got) };
        assert_eq!(bits(&got), want, "{} AVX-512 rows", ty.name());
    }
}

/// Types the reference file has no tensor of, checked against hand-computed blocks.
#[test]
fn q4_0_q5_1_and_q5_k_decode_hand_made_blocks() {
    // Q4_0: d = 0.5, nibbles j (low) and 15 - j (high).
    let mut b = f16::from_f32(0.5).to_bits().to_le_bytes().to_vec();
    b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
    let mut y = [0f32; 32];
    dequantize(GgmlType::Q4_0, &b, &mut y);
    for j in 0..16 {
        assert_eq!(y[j], 0.5 * (j as f32 - 8.0));
        assert_eq!(y[j + 16], 0.5 * (7.0 - j as f32));
    }
    // Q5_1: d = 2, m = -1, fifth bit set for weights 0 and 16 only.
    let mut b = f16::from_f32(2.0).to_bits().to_le_bytes().to_vec();
    b.extend(f16::from_f32(-1.0).to_bits().to_le_bytes());
    b.extend((1u32 | (1 << 16)).to_le_bytes());
    b.extend([0x21u8; 16]);
    let mut y = [0f32; 32];
    dequantize(GgmlType::Q5_1, &b, &mut y);
    assert_eq!((y[0], y[1], y[16], y[17]), (2.0 * 17.0 - 1.0, 2.0 - 1.0, 2.0 * 18.0 - 1.0, 4.0 - 1.0));
    // Q5_K: d = 1, dmin = 0, scales 1 for sub-blocks 0 and 1, high bits set for sub-block 0.
    let mut b = f16::from_f32(1.0).to_bits().to_le_bytes().to_vec();
    b.extend(f16::from_f32(0.0).to_bits().to_le_bytes());
    let mut scales = [0u8; 12];
    scales[0] = 1;
    scales[1] = 1;
    b.extend(scales);
    b.extend([1u8; 32]); // qh: bit 0 set -> +16 in sub-block 0
    b.extend([0x53u8; 128]); // low nibble 3, high nibble 5
    let mut y = [0f32; 256];
    dequantize(GgmlType::Q5K, &b, &mut y);
    assert_eq!((y[0], y[31], y[32], y[63], y[64]), (19.0, 19.0, 5.0, 5.0, 0.0));
}
