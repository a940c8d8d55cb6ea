//! GGUF reader on hand-built files: every value type, several tensor types,
//! and each way a file can be corrupt.

use braid_formats::gguf::{Gguf, Value};
use braid_formats::{Bytes, DType};

const NAME: &str = "handmade-test.gguf";

// ---------------------------------------------------------------- writer

/// A metadata entry: a typed value, or raw bytes after a raw type id (to
/// write things a well-formed value cannot express).
enum Kv {
    Val(String, Value),
    Raw(String, u32, Vec<u8>),
}

struct Tensor {
    name: String,
    /// GGUF order (innermost first).
    ne: Vec<u64>,
    type_id: u32,
    /// None: the next aligned position after the previous tensor.
    offset: Option<u64>,
    data: Vec<u8>,
}

struct Writer {
    version: u32,
    alignment: u64,
    kvs: Vec<Kv>,
    tensors: Vec<Tensor>,
    /// Overrides of the header counts.
    n_tensors: Option<u64>,
    n_kv: Option<u64>,
}

fn type_id(v: &Value) -> u32 {
    match v {
        Value::U8(_) => 0,
        Value::I8(_) => 1,
        Value::U16(_) => 2,
        Value::I16(_) => 3,
        Value::U32(_) => 4,
        Value::I32(_) => 5,
        Value::F32(_) => 6,
        Value::Bool(_) => 7,
        Value::String(_) => 8,
        Value::Array(_) => 9,
        Value::U64(_) => 10,
        Value::I64(_) => 11,
        Value::F64(_) => 12,
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.extend(x.to_le_bytes()),
        Value::I8(x) => out.extend(x.to_le_bytes()),
        Value::U16(x) => out.extend(x.to_le_bytes()),
        Value::I16(x) => out.extend(x.to_le_bytes()),
        Value::U32(x) => out.extend(x.to_le_bytes()),
        Value::I32(x) => out.extend(x.to_le_bytes()),
        Value::U64(x) => out.extend(x.to_le_bytes()),
        Value::I64(x) => out.extend(x.to_le_bytes()),
        Value::F32(x) => out.extend(x.to_le_bytes()),
        Value::F64(x) => out.extend(x.to_le_bytes()),
        Value::Bool(x) => out.push(*x as u8),
        Value::String(s) => put_str(out, s),
        Value::Array(a) => {
            // An empty array's element type is arbitrary; uint8 here.
            out.extend(a.first().map_or(0, type_id).to_le_bytes());
            out.extend((a.len() as u64).to_le_bytes());
            for e in a {
                put_value(out, e);
            }
        }
    }
}

fn align(n: u64, a: u64) -> u64 {
    n.div_ceil(a) * a
}

impl Writer {
    fn new() -> Writer {
        Writer { version: 3, alignment: 32, kvs: vec![], tensors: vec![], n_tensors: None, n_kv: None }
    }

    fn kv(mut self, key: &str, v: Value) -> Writer {
        if key == "general.alignment" {
            if let Some(a) = v.as_u64() {
                self.alignment = a;
            }
        }
        self.kvs.push(Kv::Val(key.into(), v));
        self
    }

    fn raw_kv(mut self, key: &str, ty: u32, bytes: Vec<u8>) -> Writer {
        self.kvs.push(Kv::Raw(key.into(), ty, bytes));
        self
    }

    fn tensor(mut self, name: &str, ne: &[u64], dtype: DType, data: Vec<u8>) -> Writer {
        self.tensors.push(Tensor { name: name.into(), ne: ne.to_vec(), type_id: dtype.ggml_id(), offset: None, data });
        self
    }

    fn raw_tensor(mut self, name: &str, ne: &[u64], type_id: u32, offset: Option<u64>, data: Vec<u8>) -> Writer {
        self.tensors.push(Tensor { name: name.into(), ne: ne.to_vec(), type_id, offset, data });
        self
    }

    /// The file bytes. The last tensor's data ends the file exactly (no
    /// trailing padding), so any truncation cuts into something required.
    fn build(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend(b"GGUF");
        out.extend(self.version.to_le_bytes());
        out.extend(self.n_tensors.unwrap_or(self.tensors.len() as u64).to_le_bytes());
        out.extend(self.n_kv.unwrap_or(self.kvs.len() as u64).to_le_bytes());
        for kv in &self.kvs {
            match kv {
                Kv::Val(k, v) => {
                    put_str(&mut out, k);
                    out.extend(type_id(v).to_le_bytes());
                    put_value(&mut out, v);
                }
                Kv::Raw(k, ty, bytes) => {
                    put_str(&mut out, k);
                    out.extend(ty.to_le_bytes());
                    out.extend(bytes);
                }
            }
        }
        let mut offsets = Vec::new();
        let mut next = 0u64;
        for t in &self.tensors {
            let off = t.offset.unwrap_or(align(next, self.alignment));
            next = off + t.data.len() as u64;
            offsets.push(off);
            put_str(&mut out, &t.name);
            out.extend((t.ne.len() as u32).to_le_bytes());
            for d in &t.ne {
                out.extend(d.to_le_bytes());
            }
            out.extend(t.type_id.to_le_bytes());
            out.extend(off.to_le_bytes());
        }
        let data_start = align(out.len() as u64, self.alignment) as usize;
        if self.tensors.is_empty() {
            return out;
        }
        out.resize(data_start, 0);
        for (t, off) in self.tensors.iter().zip(offsets) {
            let at = data_start + off as usize;
            if out.len() < at + t.data.len() {
                out.resize(at + t.data.len(), 0);
            }
            out[at..at + t.data.len()].copy_from_slice(&t.data);
        }
        out
    }
}

fn parse(bytes: Vec<u8>) -> anyhow::Result<Gguf> {
    Gguf::from_bytes(NAME, Bytes::from_vec(bytes))
}

/// The error text of a parse that must fail, with its whole context chain.
fn err_of(bytes: Vec<u8>) -> String {
    match parse(bytes) {
        Ok(_) => panic!("parse succeeded but should have failed"),
        Err(e) => format!("{e:#}"),
    }
}

/// Asserts that parsing fails with a message naming the file and containing each of `parts`.
fn assert_err(bytes: Vec<u8>, parts: &[&str]) {
    let e = err_of(bytes);
    assert!(e.contains(NAME), "error does not name the file: {e}");
    for p in parts {
        assert!(e.contains(p), "error lacks {p:?}: {e}");
    }
}

/// Deterministic pseudo-random bytes.
fn noise(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (x >> 56) as u8
        })
        .collect()
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A small valid file with metadata and a few tensors, used as the base for corruptions.
fn base() -> Writer {
    Writer::new()
        .kv("general.architecture", Value::String("llama".into()))
        .kv("llama.block_count", Value::U32(2))
        .kv("tokenizer.ggml.tokens", Value::Array(vec![Value::String("a".into()), Value::String("b".into())]))
        .tensor("w", &[4, 2], DType::F32, f32_bytes(&[1., 2., 3., 4., 5., 6., 7., 8.]))
        .tensor("q", &[32, 1], DType::Q8_0, noise(34, 1))
}

// ---------------------------------------------------------------- valid files

fn every_value() -> Vec<(&'static str, Value)> {
    vec![
        ("t.u8", Value::U8(200)),
        ("t.i8", Value::I8(-100)),
        ("t.u16", Value::U16(60000)),
        ("t.i16", Value::I16(-30000)),
        ("t.u32", Value::U32(4_000_000_000)),
        ("t.i32", Value::I32(-2_000_000_000)),
        ("t.u64", Value::U64(u64::MAX - 5)),
        ("t.i64", Value::I64(i64::MIN + 7)),
        ("t.f32", Value::F32(1.5e-5)),
        ("t.f64", Value::F64(-2.25e100)),
        ("t.true", Value::Bool(true)),
        ("t.false", Value::Bool(false)),
        ("t.str", Value::String("héllo ✓".into())),
        ("t.empty_str", Value::String(String::new())),
        ("t.empty_arr", Value::Array(vec![])),
        ("t.arr_i32", Value::Array(vec![Value::I32(-1), Value::I32(2), Value::I32(3)])),
        ("t.arr_f32", Value::Array(vec![Value::F32(0.5), Value::F32(-1.25)])),
        ("t.arr_str", Value::Array(vec![Value::String("x".into()), Value::String("".into()), Value::String("yz".into())])),
        ("t.arr_bool", Value::Array(vec![Value::Bool(true), Value::Bool(false)])),
        ("t.nested", Value::Array(vec![Value::Array(vec![Value::U8(1), Value::U8(2)]), Value::Array(vec![Value::U8(3)])])),
        ("t.nested_str", Value::Array(vec![Value::Array(vec![Value::String("deep".into())])])),
    ]
}

#[test]
fn every_value_type_round_trips_in_v2_and_v3() {
    for version in [2, 3] {
        let mut w = Writer::new();
        w.version = version;
        for (k, v) in every_value() {
            w = w.kv(k, v);
        }
        let g = parse(w.build()).unwrap();
        assert_eq!(g.version(), version);
        let want = every_value();
        // In file order, with exact values.
        assert_eq!(g.metadata().len(), want.len());
        for ((k, v), (wk, wv)) in g.metadata().iter().zip(&want) {
            assert_eq!(k, wk);
            assert_eq!(v, wv);
            assert_eq!(g.get(k), Some(wv));
        }
        assert_eq!(g.tensor_names().count(), 0);
    }
}

#[test]
fn typed_getters_widen_and_check() {
    let mut w = Writer::new();
    for (k, v) in every_value() {
        w = w.kv(k, v);
    }
    let g = parse(w.build()).unwrap();
    assert_eq!(g.get_u64("t.u8").unwrap(), 200);
    assert_eq!(g.get_u64("t.u16").unwrap(), 60000);
    assert_eq!(g.get_u64("t.u32").unwrap(), 4_000_000_000);
    assert_eq!(g.get_u64("t.u64").unwrap(), u64::MAX - 5);
    assert_eq!(g.get_u32("t.u16").unwrap(), 60000);
    assert_eq!(g.get_i64("t.i8").unwrap(), -100);
    assert_eq!(g.get_i64("t.i64").unwrap(), i64::MIN + 7);
    assert_eq!(g.get_f32("t.f32").unwrap(), 1.5e-5);
    assert_eq!(g.get_f32("t.u16").unwrap(), 60000.0);
    assert!((g.get("t.f64").unwrap().as_f64().unwrap() + 2.25e100).abs() < 1e85);
    assert!(g.get_bool("t.true").unwrap());
    assert!(!g.get_bool("t.false").unwrap());
    assert_eq!(g.get_str("t.str").unwrap(), "héllo ✓");
    assert_eq!(g.get_str_array("t.arr_str").unwrap(), vec!["x", "", "yz"]);
    assert_eq!(g.get_f32_array("t.arr_f32").unwrap(), vec![0.5, -1.25]);
    assert_eq!(g.get_i32_array("t.arr_i32").unwrap(), vec![-1, 2, 3]);
    assert!(g.get_str_array("t.empty_arr").unwrap().is_empty());
    assert_eq!(g.opt_u64("t.absent").unwrap(), None);
    assert_eq!(g.opt_u64("t.u8").unwrap(), Some(200));
    assert_eq!(g.opt_str("t.str").unwrap(), Some("héllo ✓"));

    // Negative numbers are not unsigned; u64 beyond i64 is not an i64.
    assert_eq!(Value::I8(-1).as_u64(), None);
    assert_eq!(Value::U64(u64::MAX).as_i64(), None);
    assert_eq!(Value::String("1".into()).as_u64(), None);

    let e = g.get_u64("t.missing").unwrap_err().to_string();
    assert!(e.contains(NAME) && e.contains("t.missing") && e.contains("missing"), "{e}");
    let e = g.get_u64("t.i8").unwrap_err().to_string();
    assert!(e.contains(NAME) && e.contains("t.i8") && e.contains("int8 -100"), "{e}");
    let e = g.get_str("t.u32").unwrap_err().to_string();
    assert!(e.contains("t.u32") && e.contains("uint32 4000000000") && e.contains("string"), "{e}");
    let e = g.get_u32("t.u64").unwrap_err().to_string();
    assert!(e.contains("t.u64"), "{e}");
    let e = g.get_str_array("t.arr_i32").unwrap_err().to_string();
    assert!(e.contains("t.arr_i32") && e.contains("element 0") && e.contains("int32"), "{e}");
    let e = g.get_i32_array("t.arr_str").unwrap_err().to_string();
    assert!(e.contains("t.arr_str") && e.contains("string"), "{e}");
    let e = g.get_bool("t.str").unwrap_err().to_string();
    assert!(e.contains("t.str") && e.contains("bool"), "{e}");
    assert!(g.opt_bool("t.str").is_err());
    let e = g.architecture().unwrap_err().to_string();
    assert!(e.contains("general.architecture"), "{e}");
}

#[test]
fn float_tensors_decode_with_pytorch_shape() {
    let vals: Vec<f32> = (0..6).map(|i| i as f32 * 0.5 - 1.0).collect();
    let f16: Vec<u8> = vals.iter().flat_map(|&v| half::f16::from_f32(v).to_le_bytes()).collect();
    let bf16: Vec<u8> = vals.iter().flat_map(|&v| half::bf16::from_f32(v).to_le_bytes()).collect();
    let g = parse(
        Writer::new()
            .kv("general.architecture", Value::String("test".into()))
            .tensor("a.f32", &[3, 2], DType::F32, f32_bytes(&vals))
            .tensor("b.f16", &[2, 3], DType::F16, f16)
            .tensor("c.bf16", &[6], DType::BF16, bf16)
            .tensor("d.4d", &[1, 2, 1, 3], DType::F32, f32_bytes(&vals))
            .build(),
    )
    .unwrap();
    assert_eq!(g.architecture().unwrap(), "test");
    assert_eq!(g.tensor_names().collect::<Vec<_>>(), vec!["a.f32", "b.f16", "c.bf16", "d.4d"]);

    let a = g.tensor("a.f32").unwrap();
    assert_eq!((a.dtype, a.shape.clone()), (DType::F32, vec![2, 3]));
    assert_eq!((a.rows(), a.cols(), a.elements()), (2, 3, 6));
    assert_eq!(a.to_f32().unwrap(), vals);

    let b = g.tensor("b.f16").unwrap();
    assert_eq!((b.dtype, b.shape.clone()), (DType::F16, vec![3, 2]));
    assert_eq!(b.to_f32().unwrap(), vals); // these values are exact in f16

    let c = g.tensor("c.bf16").unwrap();
    assert_eq!((c.dtype, c.shape.clone(), c.rows(), c.cols()), (DType::BF16, vec![6], 1, 6));
    assert_eq!(c.to_f32().unwrap(), vals);

    let d = g.tensor("d.4d").unwrap();
    assert_eq!(d.shape, vec![3, 1, 2, 1]);
    assert_eq!((d.rows(), d.cols()), (6, 1));

    // Tensor data starts aligned.
    for t in g.tensor_infos() {
        assert_eq!(t.offset % 32, 0, "{}", t.name);
        assert_eq!(t.offset % g.alignment(), 0);
    }
    assert_eq!(g.data_offset() % 32, 0);

    let e = g.tensor("nope").unwrap_err().to_string();
    assert!(e.contains(NAME) && e.contains("nope"), "{e}");
}

#[test]
fn every_quantized_type_is_viewed_as_its_blocks() {
    let all =
        [DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q5_1, DType::Q8_0, DType::Q8_1, DType::Q2K, DType::Q3K, DType::Q4K, DType::Q5K, DType::Q6K, DType::Q8K];
    let mut w = Writer::new();
    let mut want = Vec::new();
    for (i, &dt) in all.iter().enumerate() {
        // Two rows of two blocks each.
        let cols = 2 * dt.block_size() as u64;
        let data = noise(4 * dt.type_size(), i as u64);
        w = w.tensor(&format!("t.{}", dt.name()), &[cols, 2], dt, data.clone());
        want.push((dt, cols as usize, data));
    }
    let g = parse(w.build()).unwrap();
    for (dt, cols, data) in want {
        let t = g.tensor(&format!("t.{}", dt.name())).unwrap();
        assert_eq!(t.dtype, dt);
        assert_eq!(t.shape, vec![2, cols]);
        assert_eq!(&t.data[..], &data[..], "{dt}");
        let e = t.to_f32().unwrap_err().to_string();
        assert!(e.contains(dt.name()) && e.contains(&t.name), "{e}");
    }
}

#[test]
fn general_alignment_sets_data_alignment() {
    for a in [1u32, 8, 64, 256] {
        let g = parse(
            Writer::new()
                .kv("general.alignment", Value::U32(a))
                .tensor("x", &[3], DType::F32, f32_bytes(&[1., 2., 3.]))
                .tensor("y", &[5], DType::F32, f32_bytes(&[4., 5., 6., 7., 8.]))
                .build(),
        )
        .unwrap();
        assert_eq!(g.alignment(), a as usize);
        assert_eq!(g.data_offset() % a as usize, 0);
        assert_eq!(g.tensor("y").unwrap().to_f32().unwrap(), vec![4., 5., 6., 7., 8.]);
    }
}

#[test]
fn open_maps_a_real_file_and_names_it_in_errors() {
    let dir = std::env::temp_dir().join(format!("braid-gguf-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let good = dir.join("good.gguf");
    std::fs::write(&good, base().build()).unwrap();
    let g = Gguf::open(&good).unwrap();
    assert_eq!(g.path(), good.as_path());
    assert_eq!(g.get_u64("llama.block_count").unwrap(), 2);
    assert_eq!(g.tensor("w").unwrap().to_f32().unwrap(), vec![1., 2., 3., 4., 5., 6., 7., 8.]);

    let mut bytes = base().build();
    bytes.truncate(bytes.len() - 1);
    let bad = dir.join("cut-short.gguf");
    std::fs::write(&bad, bytes).unwrap();
    let e = format!("{:#}", Gguf::open(&bad).unwrap_err());
    assert!(e.contains("cut-short.gguf") && e.contains("past the end"), "{e}");

    let empty = dir.join("empty.gguf");
    std::fs::write(&empty, b"").unwrap();
    let e = format!("{:#}", Gguf::open(&empty).unwrap_err());
    assert!(e.contains("empty.gguf") && e.contains("truncated"), "{e}");

    let missing = dir.join("missing.gguf");
    let e = format!("{:#}", Gguf::open(&missing).unwrap_err());
    assert!(e.contains("missing.gguf"), "{e}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn handles_are_shareable_across_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Gguf>();
    send_sync::<braid_formats::TensorView>();
}

// ---------------------------------------------------------------- corruptions

#[test]
fn base_file_is_valid() {
    // The corruption tests below mean something only if the base parses.
    let g = parse(base().build()).unwrap();
    assert_eq!(g.tensor_names().count(), 2);
    assert_eq!(g.get_str_array("tokenizer.ggml.tokens").unwrap(), vec!["a", "b"]);
}

#[test]
fn bad_magic_and_versions() {
    let mut b = base().build();
    b[0..4].copy_from_slice(b"GGML");
    assert_err(b, &["not a GGUF file"]);

    let mut w = base();
    w.version = 1;
    assert_err(w.build(), &["version 1", "not supported"]);
    w.version = 4;
    assert_err(w.build(), &["version 4"]);
    w.version = 0;
    assert_err(w.build(), &["unknown GGUF version 0"]);
    w.version = 3u32.swap_bytes();
    assert_err(w.build(), &["big-endian"]);
}

#[test]
fn absurd_string_lengths() {
    // A value string claiming 2^60 bytes.
    let mut raw = (1u64 << 60).to_le_bytes().to_vec();
    raw.extend(b"abc");
    assert_err(base().raw_kv("k.str", 8, raw).build(), &["k.str", "string length 1152921504606846976"]);

    // A key whose length is 2^60: the key itself is the corrupt string.
    let mut b = Writer::new().kv("x", Value::U8(1)).build();
    b[24..32].copy_from_slice(&(1u64 << 60).to_le_bytes());
    assert_err(b, &["metadata key #0", "string length 1152921504606846976"]);

    // A tensor name claiming u64::MAX bytes.
    let mut b = Writer::new().tensor("t", &[1], DType::F32, f32_bytes(&[1.])).build();
    b[24..32].copy_from_slice(&u64::MAX.to_le_bytes());
    assert_err(b, &["name of tensor #0", "string length"]);
}

#[test]
fn absurd_counts() {
    let mut w = base();
    w.n_tensors = Some(1 << 40);
    assert_err(w.build(), &["tensor count 1099511627776", "impossible"]);
    let mut w = base();
    w.n_tensors = Some(u64::MAX);
    assert_err(w.build(), &["tensor count", "impossible"]);
    let mut w = base();
    w.n_kv = Some(1 << 50);
    assert_err(w.build(), &["metadata count", "impossible"]);
    // One more tensor than the file holds: the count passes the size bound,
    // so the reader takes the data for a third tensor info, which is garbage.
    let mut w = base();
    w.n_tensors = Some(3);
    assert!(err_of(w.build()).contains(NAME));

    // An array of 2^40 uint32 elements.
    let mut raw = 4u32.to_le_bytes().to_vec();
    raw.extend((1u64 << 40).to_le_bytes());
    raw.extend([0u8; 16]);
    assert_err(base().raw_kv("k.arr", 9, raw).build(), &["k.arr", "array length 1099511627776", "impossible"]);

    // An array of 2^40 empty strings: each still needs its 8-byte length.
    let mut raw = 8u32.to_le_bytes().to_vec();
    raw.extend((1u64 << 40).to_le_bytes());
    assert_err(base().raw_kv("k.strs", 9, raw).build(), &["k.strs", "impossible"]);
}

#[test]
fn unknown_types() {
    assert_err(base().raw_kv("k.weird", 13, vec![0; 8]).build(), &["k.weird", "unknown value type 13"]);
    let mut raw = 99u32.to_le_bytes().to_vec();
    raw.extend(1u64.to_le_bytes());
    assert_err(base().raw_kv("k.arr", 9, raw).build(), &["k.arr", "unknown value type 99"]);
    // Type ids 4 and 5 were removed from ggml (Q4_2, Q4_3).
    for id in [4u32, 5, 16, 1000] {
        let b = base().raw_tensor("odd", &[32], id, None, vec![0; 64]).build();
        assert_err(b, &["odd", &format!("unknown tensor type id {id}")]);
    }
}

#[test]
fn bad_metadata_values() {
    assert_err(base().raw_kv("k.bool", 7, vec![2]).build(), &["k.bool", "bool byte 2"]);
    let mut raw = 3u64.to_le_bytes().to_vec();
    raw.extend([0xff, 0xfe, 0x41]);
    assert_err(base().raw_kv("k.utf8", 8, raw).build(), &["k.utf8", "UTF-8"]);
    let dup = base().kv("llama.block_count", Value::U32(3)).build();
    assert_err(dup, &["llama.block_count", "appears twice"]);

    // Arrays nested far too deep.
    let mut v = Value::U8(0);
    for _ in 0..40 {
        v = Value::Array(vec![v]);
    }
    assert_err(base().kv("k.deep", v).build(), &["k.deep", "deeper"]);

    for bad in [Value::U32(0), Value::U32(48), Value::String("32".into()), Value::I32(-32)] {
        let mut w = base();
        w.kvs.push(Kv::Val("general.alignment".into(), bad));
        assert_err(w.build(), &["general.alignment", "power of two"]);
    }
}

#[test]
fn bad_shapes() {
    let b = base().raw_tensor("five", &[1, 1, 1, 1, 1], 0, None, vec![0; 4]).build();
    assert_err(b, &["five", "5 dimensions"]);
    let b = base().raw_tensor("huge", &[1 << 32, 1 << 32, 1 << 32], 0, None, vec![0; 4]).build();
    assert_err(b, &["huge", "overflows"]);
    // Elements fit, bytes do not: 2^62 F32 elements.
    let b = base().raw_tensor("fat", &[1 << 31, 1 << 31], 0, None, vec![0; 4]).build();
    let e = err_of(b);
    assert!(e.contains("fat") && (e.contains("overflows") || e.contains("past the end")), "{e}");
    let b = base().raw_tensor("neg", &[u64::MAX, 1], 0, None, vec![0; 4]).build();
    assert_err(b, &["neg", "negative dimension"]);
    // 48 Q4_0 elements: one and a half blocks.
    let b = base().raw_tensor("half", &[48], DType::Q4_0.ggml_id(), None, vec![0; 36]).build();
    assert_err(b, &["half", "not a multiple of the Q4_0 block size 32"]);
    // 64 elements in total, but rows of 16: blocks would straddle rows.
    let b = base().raw_tensor("rows", &[16, 4], DType::Q8_0.ggml_id(), None, vec![0; 68]).build();
    assert_err(b, &["rows", "not a multiple"]);
    let b = base().raw_tensor("k", &[128, 2], DType::Q4K.ggml_id(), None, vec![0; 144]).build();
    assert_err(b, &["`k`", "Q4_K block size 256"]);
    let b = base().raw_tensor("dup", &[1], 0, None, vec![0; 4]).raw_tensor("dup", &[1], 0, None, vec![0; 4]).build();
    assert_err(b, &["dup", "appears twice"]);
}

#[test]
fn bad_data_offsets() {
    // Data past the end of the file.
    let b = base().raw_tensor("far", &[8], 0, Some(1 << 20), vec![]).build();
    assert_err(b, &["far", "past the end of the file"]);
    let b = base().raw_tensor("wrap", &[8], 0, Some(u64::MAX - 31), vec![]).build();
    assert_err(b, &["wrap", "past the end of the file"]);
    // Unaligned.
    let b = base().raw_tensor("odd", &[1], 0, Some(100), vec![0; 4]).build();
    assert_err(b, &["odd", "offset 100", "alignment 32"]);
    // Overlapping: `late` starts inside `first`.
    let b = Writer::new().raw_tensor("first", &[16], 0, Some(0), vec![0; 64]).raw_tensor("late", &[16], 0, Some(32), vec![0; 64]).build();
    assert_err(b, &["first", "late", "overlap"]);
    // Two tensors at the same offset.
    let b = Writer::new().raw_tensor("a", &[8], 0, Some(0), vec![0; 32]).raw_tensor("b", &[8], 0, Some(0), vec![0; 32]).build();
    assert_err(b, &["overlap"]);
    // Truncated data of the last tensor.
    let mut b = base().build();
    b.truncate(b.len() - 10);
    assert_err(b, &["`q`", "past the end of the file"]);
}

#[test]
fn every_truncation_fails_cleanly() {
    let mut v = Value::String("nested".into());
    v = Value::Array(vec![Value::Array(vec![v]), Value::Array(vec![])]);
    let full =
        base().kv("x.f64", Value::F64(1.0)).kv("x.nested", v).kv("general.alignment", Value::U64(16)).tensor("z", &[256], DType::Q6K, noise(210, 9)).build();
    parse(full.clone()).unwrap();
    for n in 0..full.len() {
        let e = match parse(full[..n].to_vec()) {
            Ok(_) => panic!("truncation to {n} of {} bytes parsed", full.len()),
            Err(e) => e.to_string(),
        };
        assert!(e.contains(NAME), "truncation to {n}: {e}");
        let says_short = ["truncated", "past the end", "impossible", "bytes are left"];
        assert!(says_short.iter().any(|s| e.contains(s)), "truncation to {n}: {e}");
    }
}

#[test]
fn random_corruption_never_panics() {
    // Overwrite bytes of a valid file at every position with a few values:
    // the result may parse or not, but must never panic, and any tensor the
    // parse admits must lie inside the buffer.
    let full = base().kv("x.arr", Value::Array(vec![Value::U16(7); 5])).build();
    for pos in 0..full.len() {
        for val in [0x00, 0x01, 0x7f, 0x80, 0xff] {
            let mut b = full.clone();
            b[pos] = val;
            if let Ok(g) = parse(b.clone()) {
                for name in g.tensor_names().map(String::from).collect::<Vec<_>>() {
                    let t = g.tensor(&name).unwrap();
                    assert!(t.data.len() <= b.len());
                    let _ = t.to_f32();
                }
            }
        }
    }
}
