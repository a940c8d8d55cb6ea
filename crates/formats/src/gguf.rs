//! GGUF reader (versions 2 and 3), memory-mapped and zero-copy.
//!
//! Layout: magic `GGUF`, version u32, tensor count u64, metadata count u64,
//! the metadata key/values, the tensor infos (name, dims, type, offset), then
//! padding to the alignment and the tensor data. All little-endian.
//!
//! Every count and length read from the file is checked against the bytes that
//! remain before anything is allocated for it, so a corrupt file gives an error
//! that names the file and the problem, never a panic or a huge allocation.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{anyhow, bail, Context, Result};

use crate::{Bytes, DType, TensorView};

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml tensors have at most 4 dimensions.
const MAX_DIMS: u32 = 4;
/// Arrays nested deeper than this are surely corrupt; the cap keeps the
/// recursive reader off the end of the stack.
const MAX_ARRAY_DEPTH: usize = 16;
/// Most entries reserved ahead from a count read in the file. Counts are
/// already bounded by the bytes left, but an in-memory `Value` is larger than
/// its encoding; beyond this, memory grows only with what is actually parsed.
const MAX_RESERVE: usize = 1 << 16;

fn reserve(n: u64) -> usize {
    n.min(MAX_RESERVE as u64) as usize
}

// Metadata value type ids.
const T_U8: u32 = 0;
const T_I8: u32 = 1;
const T_U16: u32 = 2;
const T_I16: u32 = 3;
const T_U32: u32 = 4;
const T_I32: u32 = 5;
const T_F32: u32 = 6;
const T_BOOL: u32 = 7;
const T_STRING: u32 = 8;
const T_ARRAY: u32 = 9;
const T_U64: u32 = 10;
const T_I64: u32 = 11;
const T_F64: u32 = 12;

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
}

impl Value {
    /// Any integer that is not negative.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// Any integer that fits in an i64.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => i64::try_from(v).ok(),
            Value::I8(v) => Some(v.into()),
            Value::I16(v) => Some(v.into()),
            Value::I32(v) => Some(v.into()),
            Value::I64(v) => Some(v),
            _ => None,
        }
    }

    /// Any number (integers widen; a u64/i64 beyond 2^53 rounds).
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            Value::U64(v) => Some(v as f64),
            Value::I64(v) => Some(v as f64),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }

    /// The GGUF name of this value's type, for messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::U8(_) => "uint8",
            Value::I8(_) => "int8",
            Value::U16(_) => "uint16",
            Value::I16(_) => "int16",
            Value::U32(_) => "uint32",
            Value::I32(_) => "int32",
            Value::U64(_) => "uint64",
            Value::I64(_) => "int64",
            Value::F32(_) => "float32",
            Value::F64(_) => "float64",
            Value::Bool(_) => "bool",
            Value::String(_) => "string",
            Value::Array(_) => "array",
        }
    }

    /// A short description for error messages: the type and, briefly, the value.
    pub fn describe(&self) -> String {
        match self {
            Value::String(s) if s.chars().count() > 40 => {
                format!("string {:?}...", s.chars().take(40).collect::<String>())
            }
            Value::String(s) => format!("string {s:?}"),
            Value::Array(a) => match a.first() {
                Some(v) => format!("array of {} {}", a.len(), v.type_name()),
                None => "empty array".to_string(),
            },
            Value::U8(v) => format!("uint8 {v}"),
            Value::I8(v) => format!("int8 {v}"),
            Value::U16(v) => format!("uint16 {v}"),
            Value::I16(v) => format!("int16 {v}"),
            Value::U32(v) => format!("uint32 {v}"),
            Value::I32(v) => format!("int32 {v}"),
            Value::U64(v) => format!("uint64 {v}"),
            Value::I64(v) => format!("int64 {v}"),
            Value::F32(v) => format!("float32 {v}"),
            Value::F64(v) => format!("float64 {v}"),
            Value::Bool(v) => format!("bool {v}"),
        }
    }
}

/// Where one tensor lies in the file. Checked at open: type known, shape
/// sane, data whole blocks and inside the file, no overlap with another tensor.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: DType,
    /// PyTorch order (GGUF's `ne` reversed).
    pub shape: Vec<usize>,
    /// Absolute byte offset of the data in the file.
    pub offset: usize,
    /// Bytes of data.
    pub size: usize,
}

/// An opened GGUF file.
pub struct Gguf {
    path: PathBuf,
    version: u32,
    metadata: Vec<(String, Value)>,
    meta_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    alignment: usize,
    data_offset: usize,
    data: Bytes,
}

impl std::fmt::Debug for Gguf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gguf")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl Gguf {
    /// Maps the file and parses its header. Tensor data is not read.
    pub fn open(path: &Path) -> Result<Gguf> {
        let file = File::open(path).with_context(|| format!("{}: cannot open", path.display()))?;
        let len = file.metadata().with_context(|| format!("{}: cannot stat", path.display()))?.len();
        let bytes = if len == 0 {
            Bytes::from_vec(Vec::new())
        } else {
            // SAFETY: the mapping is read-only; like every mmap-based loader we
            // rely on nobody truncating or rewriting the model file while it is
            // open (doing so is outside what a reader can guard against).
            let map = unsafe { memmap2::Mmap::map(&file) }.with_context(|| format!("{}: cannot mmap", path.display()))?;
            Bytes::from_mmap(Arc::new(map))
        };
        Self::parse(path.to_path_buf(), bytes)
    }

    /// Parses GGUF bytes already in memory; `name` stands for the file in messages.
    pub fn from_bytes(name: &str, bytes: Bytes) -> Result<Gguf> {
        Self::parse(PathBuf::from(name), bytes)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn version(&self) -> u32 {
        self.version
    }

    /// Alignment of tensor data (`general.alignment`, default 32).
    pub fn alignment(&self) -> usize {
        self.alignment
    }

    /// Absolute byte offset of the tensor data section.
    pub fn data_offset(&self) -> usize {
        self.data_offset
    }

    /// All metadata, in file order.
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.metadata
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.meta_index.get(key).map(|&i| &self.metadata[i].1)
    }

    fn require(&self, key: &str) -> Result<&Value> {
        self.get(key).ok_or_else(|| anyhow!("{}: metadata key `{key}` is missing", self.path.display()))
    }

    fn wrong(&self, key: &str, v: &Value, want: &str) -> anyhow::Error {
        anyhow!("{}: metadata key `{key}` is {}, expected {want}", self.path.display(), v.describe())
    }

    pub fn get_u64(&self, key: &str) -> Result<u64> {
        let v = self.require(key)?;
        v.as_u64().ok_or_else(|| self.wrong(key, v, "a non-negative integer"))
    }

    pub fn get_u32(&self, key: &str) -> Result<u32> {
        let v = self.require(key)?;
        v.as_u64().and_then(|x| u32::try_from(x).ok()).ok_or_else(|| self.wrong(key, v, "an integer in 0..2^32"))
    }

    pub fn get_usize(&self, key: &str) -> Result<usize> {
        let v = self.require(key)?;
        v.as_u64().and_then(|x| usize::try_from(x).ok()).ok_or_else(|| self.wrong(key, v, "a non-negative integer"))
    }

    pub fn get_i64(&self, key: &str) -> Result<i64> {
        let v = self.require(key)?;
        v.as_i64().ok_or_else(|| self.wrong(key, v, "an integer"))
    }

    /// Any number, narrowed to f32.
    pub fn get_f32(&self, key: &str) -> Result<f32> {
        let v = self.require(key)?;
        v.as_f64().map(|x| x as f32).ok_or_else(|| self.wrong(key, v, "a number"))
    }

    pub fn get_str(&self, key: &str) -> Result<&str> {
        let v = self.require(key)?;
        v.as_str().ok_or_else(|| self.wrong(key, v, "a string"))
    }

    pub fn get_bool(&self, key: &str) -> Result<bool> {
        let v = self.require(key)?;
        v.as_bool().ok_or_else(|| self.wrong(key, v, "a bool"))
    }

    fn get_array(&self, key: &str, want: &str) -> Result<&[Value]> {
        let v = self.require(key)?;
        v.as_array().ok_or_else(|| self.wrong(key, v, want))
    }

    fn wrong_elem(&self, key: &str, i: usize, v: &Value, want: &str) -> anyhow::Error {
        anyhow!("{}: metadata key `{key}`, element {i} is {}, expected {want}", self.path.display(), v.describe())
    }

    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>> {
        let a = self.get_array(key, "an array of strings")?;
        a.iter().enumerate().map(|(i, v)| v.as_str().ok_or_else(|| self.wrong_elem(key, i, v, "a string"))).collect()
    }

    pub fn get_f32_array(&self, key: &str) -> Result<Vec<f32>> {
        let a = self.get_array(key, "an array of numbers")?;
        a.iter().enumerate().map(|(i, v)| v.as_f64().map(|x| x as f32).ok_or_else(|| self.wrong_elem(key, i, v, "a number"))).collect()
    }

    pub fn get_i32_array(&self, key: &str) -> Result<Vec<i32>> {
        let a = self.get_array(key, "an array of integers")?;
        a.iter().enumerate().map(|(i, v)| v.as_i64().and_then(|x| i32::try_from(x).ok()).ok_or_else(|| self.wrong_elem(key, i, v, "an int32"))).collect()
    }

    pub fn get_u64_array(&self, key: &str) -> Result<Vec<u64>> {
        let a = self.get_array(key, "an array of integers")?;
        a.iter().enumerate().map(|(i, v)| v.as_u64().ok_or_else(|| self.wrong_elem(key, i, v, "a non-negative integer"))).collect()
    }

    /// `Ok(None)` when the key is absent; an error when present with the wrong type.
    pub fn opt_u64(&self, key: &str) -> Result<Option<u64>> {
        self.get(key).map(|_| self.get_u64(key)).transpose()
    }

    pub fn opt_f32(&self, key: &str) -> Result<Option<f32>> {
        self.get(key).map(|_| self.get_f32(key)).transpose()
    }

    pub fn opt_str(&self, key: &str) -> Result<Option<&str>> {
        self.get(key).map(|_| self.get_str(key)).transpose()
    }

    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        self.get(key).map(|_| self.get_bool(key)).transpose()
    }

    /// `general.architecture`, e.g. "llama", "gemma3".
    pub fn architecture(&self) -> Result<&str> {
        self.get_str("general.architecture")
    }

    /// Tensor names in file order.
    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.tensors.iter().map(|t| t.name.as_str())
    }

    /// All tensor infos, in file order.
    pub fn tensor_infos(&self) -> &[TensorInfo] {
        &self.tensors
    }

    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.tensor_index.contains_key(name)
    }

    /// A zero-copy view of one tensor's data.
    pub fn tensor(&self, name: &str) -> Result<TensorView> {
        let t =
            self.tensor_info(name).ok_or_else(|| anyhow!("{}: no tensor named `{name}` (the file has {} tensors)", self.path.display(), self.tensors.len()))?;
        // Bounds were checked at open; a failure here would be a reader bug,
        // but it is still reported rather than panicking.
        let data = self.data.slice(t.offset, t.size).ok_or_else(|| anyhow!("{}: tensor `{name}` data lies outside the file", self.path.display()))?;
        Ok(TensorView { name: t.name.clone(), dtype: t.dtype, shape: t.shape.clone(), data })
    }

    fn parse(path: PathBuf, data: Bytes) -> Result<Gguf> {
        let file = path.display().to_string();
        let mut r = Reader { buf: &data, pos: 0, file: &file };

        let magic = r.take(4, "the magic")?;
        if magic != MAGIC {
            bail!("{file}: not a GGUF file (magic bytes are {magic:02x?}, expected \"GGUF\")");
        }
        let version = r.u32("the version")?;
        match version {
            2 | 3 => {}
            1 => bail!("{file}: GGUF version 1 is not supported (only versions 2 and 3)"),
            v if (1..=3).contains(&v.swap_bytes()) => {
                bail!("{file}: big-endian GGUF is not supported (version field reads {v:#x})")
            }
            v => bail!("{file}: unknown GGUF version {v} (only versions 2 and 3 are supported)"),
        }
        let n_tensors = r.u64("the tensor count")?;
        let n_kv = r.u64("the metadata count")?;
        // Smallest possible record: a key/value is a string length (8), a type
        // (4) and a value of at least one byte; a tensor info is a name length
        // (8), n_dims (4), a type (4) and an offset (8).
        r.check_count(n_kv, 8 + 4 + 1, "metadata count")?;
        r.check_count(n_tensors, 8 + 4 + 4 + 8, "tensor count")?;

        let mut metadata = Vec::with_capacity(reserve(n_kv));
        let mut meta_index = HashMap::with_capacity(reserve(n_kv));
        for i in 0..n_kv {
            let key = r.string(&format!("metadata key #{i}"))?;
            let ty = r.u32(&format!("the type of metadata key `{key}`"))?;
            let value = r.value(ty, &key, 0)?;
            if meta_index.insert(key.clone(), metadata.len()).is_some() {
                bail!("{file}: metadata key `{key}` appears twice");
            }
            metadata.push((key, value));
        }

        let alignment = match meta_index.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(&i) => {
                let v = &metadata[i].1;
                match v.as_u64() {
                    Some(a) if a.is_power_of_two() => a,
                    _ => bail!("{file}: general.alignment is {}, expected a power of two", v.describe()),
                }
            }
        };

        // Re-check: the metadata used up some of the bytes the count was checked against.
        r.check_count(n_tensors, 8 + 4 + 4 + 8, "tensor count")?;
        struct Raw {
            name: String,
            dtype: DType,
            shape: Vec<usize>,
            rel_offset: u64,
            size: usize,
        }
        let mut raws = Vec::with_capacity(reserve(n_tensors));
        let mut tensor_index = HashMap::with_capacity(reserve(n_tensors));
        for i in 0..n_tensors {
            let name = r.string(&format!("the name of tensor #{i}"))?;
            let what = format!("tensor `{name}`");
            let n_dims = r.u32(&format!("the dimension count of {what}"))?;
            if n_dims > MAX_DIMS {
                bail!("{file}: {what} has {n_dims} dimensions (at most {MAX_DIMS} are allowed)");
            }
            let mut ne = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                let d = r.u64(&format!("a dimension of {what}"))?;
                // ggml stores dimensions as int64.
                if d > i64::MAX as u64 {
                    bail!("{file}: {what} has a negative dimension ({})", d as i64);
                }
                let d = usize::try_from(d).map_err(|_| anyhow!("{file}: {what} has dimension {d}, too large"))?;
                ne.push(d);
            }
            let type_id = r.u32(&format!("the type of {what}"))?;
            let dtype = DType::from_ggml_id(type_id).ok_or_else(|| anyhow!("{file}: {what} has unknown tensor type id {type_id}"))?;
            let rel_offset = r.u64(&format!("the data offset of {what}"))?;

            let elements =
                ne.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d)).ok_or_else(|| anyhow!("{file}: {what} shape {ne:?} overflows an element count"))?;
            // Quantized blocks run along the row (ne[0]), so every row must be
            // whole blocks, not just the total.
            let row = ne.first().copied().unwrap_or(1);
            if row % dtype.block_size() != 0 {
                bail!("{file}: {what} has rows of {row} elements, not a multiple of the {dtype} block size {}", dtype.block_size());
            }
            let size = dtype.bytes_for(elements).ok_or_else(|| anyhow!("{file}: {what} of {elements} {dtype} elements overflows a byte size"))?;
            if rel_offset % alignment != 0 {
                bail!("{file}: {what} data offset {rel_offset} is not a multiple of the alignment {alignment}");
            }
            if tensor_index.insert(name.clone(), raws.len()).is_some() {
                bail!("{file}: tensor `{name}` appears twice");
            }
            ne.reverse();
            raws.push(Raw { name, dtype, shape: ne, rel_offset, size });
        }

        let len = data.len();
        let data_offset = (r.pos as u64).checked_next_multiple_of(alignment).ok_or_else(|| anyhow!("{file}: data offset overflows"))?;
        let mut tensors = Vec::with_capacity(raws.len());
        for t in raws {
            let end = data_offset.checked_add(t.rel_offset).and_then(|s| s.checked_add(t.size as u64).map(|e| (s, e)));
            match end {
                Some((start, end)) if end <= len as u64 => {
                    tensors.push(TensorInfo { name: t.name, dtype: t.dtype, shape: t.shape, offset: start as usize, size: t.size })
                }
                _ => bail!(
                    "{file}: tensor `{}` data (offset {} + {} bytes after the data start {data_offset}) runs past the end of the file ({len} bytes)",
                    t.name,
                    t.rel_offset,
                    t.size
                ),
            }
        }

        // No two tensors may share bytes.
        let mut order: Vec<usize> = (0..tensors.len()).filter(|&i| tensors[i].size > 0).collect();
        order.sort_by_key(|&i| tensors[i].offset);
        for w in order.windows(2) {
            let (a, b) = (&tensors[w[0]], &tensors[w[1]]);
            if b.offset < a.offset + a.size {
                bail!(
                    "{file}: tensors `{}` (bytes {}..{}) and `{}` (bytes {}..{}) overlap",
                    a.name,
                    a.offset,
                    a.offset + a.size,
                    b.name,
                    b.offset,
                    b.offset + b.size
                );
            }
        }

        Ok(Gguf { path, version, metadata, meta_index, tensors, tensor_index, alignment: alignment as usize, data_offset: data_offset as usize, data })
    }
}

/// A cursor over the header bytes whose errors name the file and the offset.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    file: &'a str,
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            bail!("{}: file is truncated: {what} at byte {} needs {n} bytes, only {} left", self.file, self.pos, self.remaining());
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// Errors when `count` records of at least `min_size` bytes each cannot
    /// fit in what is left of the file; this bounds every allocation by a count.
    fn check_count(&self, count: u64, min_size: u64, what: &str) -> Result<()> {
        let need = count.checked_mul(min_size);
        if need.is_none_or(|n| n > self.remaining() as u64) {
            bail!(
                "{}: {what} {count} at byte {} is impossible: that many would need at least {} bytes, only {} are left",
                self.file,
                self.pos,
                need.map_or("2^64+".to_string(), |n| n.to_string()),
                self.remaining()
            );
        }
        Ok(())
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let at = self.pos;
        let len = self.u64(&format!("the length of {what}"))?;
        if len > self.remaining() as u64 {
            bail!("{}: {what} at byte {at} has string length {len}, but only {} bytes are left in the file", self.file, self.remaining());
        }
        let s = self.take(len as usize, what)?;
        String::from_utf8(s.to_vec()).map_err(|e| anyhow!("{}: {what} at byte {at} is not valid UTF-8 ({e})", self.file))
    }

    /// Smallest encoding of a value of type `ty`; None for an unknown type.
    fn min_size(ty: u32) -> Option<u64> {
        Some(match ty {
            T_U8 | T_I8 | T_BOOL => 1,
            T_U16 | T_I16 => 2,
            T_U32 | T_I32 | T_F32 => 4,
            T_U64 | T_I64 | T_F64 | T_STRING => 8,
            T_ARRAY => 12,
            _ => return None,
        })
    }

    fn value(&mut self, ty: u32, key: &str, depth: usize) -> Result<Value> {
        let what = || format!("the value of metadata key `{key}`");
        Ok(match ty {
            T_U8 => Value::U8(u8::from_le_bytes(self.array(&what())?)),
            T_I8 => Value::I8(i8::from_le_bytes(self.array(&what())?)),
            T_U16 => Value::U16(u16::from_le_bytes(self.array(&what())?)),
            T_I16 => Value::I16(i16::from_le_bytes(self.array(&what())?)),
            T_U32 => Value::U32(u32::from_le_bytes(self.array(&what())?)),
            T_I32 => Value::I32(i32::from_le_bytes(self.array(&what())?)),
            T_U64 => Value::U64(u64::from_le_bytes(self.array(&what())?)),
            T_I64 => Value::I64(i64::from_le_bytes(self.array(&what())?)),
            T_F32 => Value::F32(f32::from_le_bytes(self.array(&what())?)),
            T_F64 => Value::F64(f64::from_le_bytes(self.array(&what())?)),
            T_BOOL => {
                let at = self.pos;
                match self.array::<1>(&what())?[0] {
                    0 => Value::Bool(false),
                    1 => Value::Bool(true),
                    b => bail!("{}: metadata key `{key}` at byte {at} has bool byte {b}, expected 0 or 1", self.file),
                }
            }
            T_STRING => Value::String(self.string(&what())?),
            T_ARRAY => {
                if depth >= MAX_ARRAY_DEPTH {
                    bail!("{}: metadata key `{key}` nests arrays deeper than {MAX_ARRAY_DEPTH} levels", self.file);
                }
                let at = self.pos;
                let elem = self.u32(&format!("the array type of metadata key `{key}`"))?;
                let min =
                    Self::min_size(elem).ok_or_else(|| anyhow!("{}: metadata key `{key}` at byte {at} is an array of unknown value type {elem}", self.file))?;
                let n = self.u64(&format!("the array length of metadata key `{key}`"))?;
                self.check_count(n, min, &format!("metadata key `{key}`: array length"))?;
                let mut v = Vec::with_capacity(reserve(n));
                for _ in 0..n {
                    v.push(self.value(elem, key, depth + 1)?);
                }
                Value::Array(v)
            }
            t => bail!("{}: metadata key `{key}` at byte {} has unknown value type {t}", self.file, self.pos.saturating_sub(4)),
        })
    }
}
