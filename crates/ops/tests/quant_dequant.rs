//! Dequantization against gguf-py (llama.cpp's Python reference): the
//! blocks and expected floats in tests/data were written by
//! scripts/make_quant_golden.py.

use braid_formats::DType;
use braid_ops::cpu::quant::{dequantize, f16_to_f32, f32_to_f16};

struct Golden {
    dtype: DType,
    raw: Vec<u8>,
    values: Vec<f32>,
}

fn load(name: &str) -> Golden {
    let path = format!("{}/tests/data/{name}.bin", env!("CARGO_MANIFEST_DIR"));
    let b = std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    assert_eq!(&b[0..4], b"BQG1", "{path}: bad magic");
    let u = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]) as usize;
    let (id, n, nbytes) = (u(4) as u32, u(8), u(12));
    let dtype = DType::from_ggml_id(id).unwrap_or_else(|| panic!("{path}: type {id}"));
    assert_eq!(dtype.name(), name);
    let raw = b[16..16 + nbytes].to_vec();
    let vals = &b[16 + nbytes..];
    assert_eq!(vals.len(), n * 4, "{path}: value count");
    let values = vals.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    Golden { dtype, raw, values }
}

const ALL: [&str; 13] = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"];

#[test]
fn every_type_matches_gguf_py_exactly() {
    for name in ALL {
        let g = load(name);
        let mut out = vec![f32::NAN; g.values.len()];
        dequantize(g.dtype, &g.raw, &mut out).unwrap();
        let mut nonzero = 0;
        for (i, (&got, &want)) in out.iter().zip(&g.values).enumerate() {
            // Same operations in the same order: bit-identical (NaN aside).
            let same = got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan());
            assert!(same, "{name} element {i}: got {got:e}, gguf-py says {want:e}");
            nonzero += (want != 0.0) as usize;
        }
        // Guards against a degenerate golden file that any code would pass.
        assert!(nonzero > g.values.len() / 2, "{name}: golden data mostly zero");
    }
}

#[test]
fn dequantizing_part_of_a_tensor_matches_the_whole() {
    for name in ["Q4_K", "Q8_0", "Q6_K"] {
        let g = load(name);
        let bs = g.dtype.block_size();
        let ts = g.dtype.type_size();
        let mut out = vec![0.0; bs * 2];
        dequantize(g.dtype, &g.raw[ts..3 * ts], &mut out).unwrap();
        assert_eq!(out, g.values[bs..3 * bs]);
    }
}

#[test]
fn size_mismatches_are_errors() {
    let mut out = vec![0.0; 64];
    // One byte short of two Q4_0 blocks.
    let e = dequantize(DType::Q4_0, &[0u8; 35], &mut out).unwrap_err().to_string();
    assert!(e.contains("36 bytes"), "{e}");
    // 48 elements are not whole 32-blocks.
    let e = dequantize(DType::Q8_0, &[0u8; 68], &mut out[..48]).unwrap_err().to_string();
    assert!(e.contains("48"), "{e}");
    // K-quants need multiples of 256.
    assert!(dequantize(DType::Q4K, &[0u8; 144], &mut out).is_err());
    assert!(dequantize(DType::F32, &[0u8; 255], &mut out).is_err());
}

#[test]
fn f16_conversion_is_exact_for_every_value() {
    for h in 0..=u16::MAX {
        let ours = f16_to_f32(h);
        let theirs = half::f16::from_bits(h).to_f32();
        assert!(ours.to_bits() == theirs.to_bits() || (ours.is_nan() && theirs.is_nan()), "{h:#06x}: {ours:e} vs {theirs:e}");
        if !ours.is_nan() {
            assert_eq!(f32_to_f16(ours), h, "round trip of {h:#06x}");
        }
    }
}
