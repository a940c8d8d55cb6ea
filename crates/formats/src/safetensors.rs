//! A Hugging Face model folder: `config.json`, the weights as one
//! `model.safetensors` or as shards listed by `model.safetensors.index.json`,
//! and the tokenizer files when present.
//!
//! A safetensors file is an 8-byte little-endian header length, a JSON header
//! (`{"name": {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {..}}`,
//! offsets relative to the end of the header), then the data. Files are mapped;
//! tensors are zero-copy views into the mapping.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value as Json;

use crate::{Bytes, DType, TensorView};

/// Headers larger than this are surely corrupt (the safetensors format itself
/// caps them at 100 MB); the cap keeps a bad length from driving a huge parse.
const MAX_HEADER: u64 = 100 << 20;

/// One tensor entry of a safetensors header.
#[derive(Clone, Debug)]
struct Entry {
    /// The dtype string as stored ("F32", "I64", ...).
    dtype: String,
    shape: Vec<usize>,
    /// Index into `HfFolder::files`.
    file: usize,
    /// Range inside that file's data section.
    begin: usize,
    end: usize,
}

/// An opened Hugging Face model folder.
pub struct HfFolder {
    dir: PathBuf,
    config: Json,
    tokenizer_json: Option<PathBuf>,
    tokenizer_config: Option<Json>,
    generation_config: Option<Json>,
    /// Per weight file: its path and its data section (after the header).
    files: Vec<(PathBuf, Bytes)>,
    /// Tensor names in a stable order (sorted).
    names: Vec<String>,
    tensors: HashMap<String, Entry>,
}

impl std::fmt::Debug for HfFolder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfFolder").field("dir", &self.dir).field("files", &self.files.len()).field("tensors", &self.names.len()).finish()
    }
}

fn read_json(path: &Path) -> Result<Json> {
    let text = std::fs::read_to_string(path).with_context(|| format!("{}: cannot read", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{}: invalid JSON", path.display()))
}

fn read_json_opt(path: &Path) -> Result<Option<Json>> {
    if path.is_file() {
        read_json(path).map(Some)
    } else {
        Ok(None)
    }
}

fn map_file(path: &Path) -> Result<Bytes> {
    let file = File::open(path).with_context(|| format!("{}: cannot open", path.display()))?;
    let len = file.metadata().with_context(|| format!("{}: cannot stat", path.display()))?.len();
    if len == 0 {
        return Ok(Bytes::from_vec(Vec::new()));
    }
    // SAFETY: read-only mapping; as with every mmap loader we rely on the
    // weight files not being truncated or rewritten while they are open.
    let map = unsafe { memmap2::Mmap::map(&file) }.with_context(|| format!("{}: cannot mmap", path.display()))?;
    Ok(Bytes::from_mmap(Arc::new(map)))
}

/// Bytes per element of a safetensors dtype string, for checking sizes even
/// of tensors whose type we do not decode. None for a dtype we do not know
/// (or one of sub-byte width), whose size is then not checked.
fn st_elem_size(dtype: &str) -> Option<usize> {
    Some(match dtype {
        "BOOL" | "U8" | "I8" | "F8_E5M2" | "F8_E4M3" | "F8_E8M0" => 1,
        "U16" | "I16" | "F16" | "BF16" => 2,
        "U32" | "I32" | "F32" => 4,
        "U64" | "I64" | "F64" => 8,
        _ => return None,
    })
}

fn st_dtype(dtype: &str) -> Option<DType> {
    match dtype {
        "F32" => Some(DType::F32),
        "F16" => Some(DType::F16),
        "BF16" => Some(DType::BF16),
        _ => None,
    }
}

/// Parses one safetensors file's header. Returns the data section and its
/// entries (name, entry with `file` = `file_idx`).
/// The entries a safetensors file's header holds (for fuzzing the parser).
pub(crate) fn header_entries(path: &Path, bytes: &Bytes) -> Result<usize> {
    parse_safetensors(path, bytes, 0).map(|(_, e)| e.len())
}

fn parse_safetensors(path: &Path, bytes: &Bytes, file_idx: usize) -> Result<(Bytes, Vec<(String, Entry)>)> {
    let f = path.display();
    if bytes.len() < 8 {
        bail!("{f}: file is truncated: {} bytes, too short for a safetensors header length", bytes.len());
    }
    let mut n = [0u8; 8];
    n.copy_from_slice(&bytes[..8]);
    let hlen = u64::from_le_bytes(n);
    let avail = (bytes.len() - 8) as u64;
    if hlen > avail {
        bail!("{f}: safetensors header length {hlen} exceeds the {avail} bytes after it");
    }
    if hlen > MAX_HEADER {
        bail!("{f}: safetensors header length {hlen} is larger than the {MAX_HEADER}-byte limit");
    }
    let hlen = hlen as usize;
    let header: Json = serde_json::from_slice(&bytes[8..8 + hlen]).with_context(|| format!("{f}: safetensors header is not valid JSON"))?;
    let obj = header.as_object().ok_or_else(|| anyhow!("{f}: safetensors header is not a JSON object"))?;
    let data = bytes.slice(8 + hlen, bytes.len() - 8 - hlen).ok_or_else(|| anyhow!("{f}: data section lies outside the file"))?;

    let mut out = Vec::with_capacity(obj.len());
    for (name, v) in obj {
        if name == "__metadata__" {
            continue;
        }
        let bad = |why: &str| anyhow!("{f}: tensor `{name}`: {why}");
        let e = v.as_object().ok_or_else(|| bad("header entry is not an object"))?;
        let dtype = e.get("dtype").and_then(Json::as_str).ok_or_else(|| bad("missing or non-string \"dtype\""))?.to_string();
        let shape = e
            .get("shape")
            .and_then(Json::as_array)
            .ok_or_else(|| bad("missing or non-array \"shape\""))?
            .iter()
            .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
            .collect::<Option<Vec<usize>>>()
            .ok_or_else(|| bad("\"shape\" holds something other than non-negative integers"))?;
        let offs = e
            .get("data_offsets")
            .and_then(Json::as_array)
            .filter(|a| a.len() == 2)
            .and_then(|a| Some((a[0].as_u64()?, a[1].as_u64()?)))
            .ok_or_else(|| bad("\"data_offsets\" is not a pair of non-negative integers"))?;
        let (begin, end) = offs;
        if begin > end {
            bail!("{f}: tensor `{name}`: data_offsets [{begin}, {end}] run backwards");
        }
        if end > data.len() as u64 {
            bail!("{f}: tensor `{name}`: data [{begin}, {end}] runs past the end of the data section ({} bytes)", data.len());
        }
        let elements = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).ok_or_else(|| bad(&format!("shape {shape:?} overflows an element count")))?;
        if let Some(es) = st_elem_size(&dtype) {
            let want = elements.checked_mul(es);
            if want != Some((end - begin) as usize) {
                bail!(
                    "{f}: tensor `{name}`: {dtype} shape {shape:?} needs {} bytes, but data_offsets [{begin}, {end}] hold {}",
                    want.map_or("more than 2^64".to_string(), |w| w.to_string()),
                    end - begin
                );
            }
        }
        out.push((name.clone(), Entry { dtype, shape, file: file_idx, begin: begin as usize, end: end as usize }));
    }

    // No two tensors may share bytes.
    let mut sorted: Vec<&(String, Entry)> = out.iter().filter(|(_, e)| e.end > e.begin).collect();
    sorted.sort_by_key(|(_, e)| e.begin);
    for w in sorted.windows(2) {
        if w[1].1.begin < w[0].1.end {
            bail!("{f}: tensors `{}` and `{}` overlap", w[0].0, w[1].0);
        }
    }
    Ok((data, out))
}

impl HfFolder {
    /// Opens a model folder: `config.json` (required), then `model.safetensors`
    /// or `model.safetensors.index.json` with its shards.
    pub fn open(dir: &Path) -> Result<HfFolder> {
        let d = dir.display();
        if !dir.is_dir() {
            bail!("{d}: not a directory");
        }
        let config_path = dir.join("config.json");
        if !config_path.is_file() {
            bail!("{d}: no config.json in the model folder");
        }
        let config = read_json(&config_path)?;
        if !config.is_object() {
            bail!("{}: not a JSON object", config_path.display());
        }
        let tokenizer_json = Some(dir.join("tokenizer.json")).filter(|p| p.is_file());
        let tokenizer_config = read_json_opt(&dir.join("tokenizer_config.json"))?;
        let generation_config = read_json_opt(&dir.join("generation_config.json"))?;

        let single = dir.join("model.safetensors");
        let index = dir.join("model.safetensors.index.json");
        let mut files = Vec::new();
        let mut tensors: HashMap<String, Entry> = HashMap::new();
        let mut add = |path: PathBuf, files: &mut Vec<(PathBuf, Bytes)>| -> Result<()> {
            let bytes = map_file(&path)?;
            let (data, entries) = parse_safetensors(&path, &bytes, files.len())?;
            for (name, e) in entries {
                if let Some(prev) = tensors.insert(name.clone(), e) {
                    bail!("{d}: tensor `{name}` is in both {} and {}", files[prev.file].0.display(), path.display());
                }
            }
            files.push((path, data));
            Ok(())
        };

        if single.is_file() {
            add(single, &mut files)?;
        } else if index.is_file() {
            let ip = index.display();
            let idx = read_json(&index)?;
            let map = idx.get("weight_map").and_then(Json::as_object).ok_or_else(|| anyhow!("{ip}: no \"weight_map\" object"))?;
            // Shards in the order they are first named; each opened once.
            let mut shards: Vec<&str> = Vec::new();
            for (name, shard) in map {
                let shard = shard.as_str().ok_or_else(|| anyhow!("{ip}: weight_map entry `{name}` is not a file name"))?;
                // Shards live in the folder itself; refuse paths that leave it.
                if shard.is_empty() || shard.contains(['/', '\\']) || shard == ".." || shard == "." {
                    bail!("{ip}: weight_map entry `{name}` names `{shard}`, not a plain file name");
                }
                if !shards.contains(&shard) {
                    shards.push(shard);
                }
            }
            for shard in &shards {
                let p = dir.join(shard);
                if !p.is_file() {
                    bail!("{ip}: shard {shard} is missing from the folder");
                }
                add(p, &mut files)?;
            }
            for (name, shard) in map {
                let shard = shard.as_str().unwrap_or_default();
                match tensors.get(name) {
                    Some(e) if files[e.file].0.file_name().and_then(|s| s.to_str()) == Some(shard) => {}
                    Some(e) => bail!("{ip}: tensor `{name}` is listed in {shard} but found in {}", files[e.file].0.display()),
                    None => {
                        bail!("{ip}: tensor `{name}` is listed in {shard} but that shard lacks it")
                    }
                }
            }
        } else {
            bail!("{d}: no model.safetensors or model.safetensors.index.json in the model folder");
        }

        let mut names: Vec<String> = tensors.keys().cloned().collect();
        names.sort();
        Ok(HfFolder { dir: dir.to_path_buf(), config, tokenizer_json, tokenizer_config, generation_config, files, names, tensors })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The parsed `config.json` (always a JSON object).
    pub fn config(&self) -> &Json {
        &self.config
    }

    /// Tensor names, sorted.
    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.names.iter().map(String::as_str)
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// A zero-copy view of one tensor. Only F32, F16 and BF16 tensors can be
    /// viewed; other dtypes are an error naming the tensor and its dtype.
    pub fn tensor(&self, name: &str) -> Result<TensorView> {
        let e = self
            .tensors
            .get(name)
            .ok_or_else(|| anyhow!("{}: no tensor named `{name}` in the model's safetensors ({} tensors)", self.dir.display(), self.names.len()))?;
        let (path, data) = &self.files[e.file];
        let dtype = st_dtype(&e.dtype)
            .ok_or_else(|| anyhow!("{}: tensor `{name}` has dtype {}, which is not supported (only F32, F16, BF16)", path.display(), e.dtype))?;
        let bytes = data.slice(e.begin, e.end - e.begin).ok_or_else(|| anyhow!("{}: tensor `{name}` data lies outside the file", path.display()))?;
        Ok(TensorView { name: name.to_string(), dtype, shape: e.shape.clone(), data: bytes })
    }

    /// The stored dtype string of a tensor ("BF16", "I64", ...), if it exists.
    pub fn tensor_dtype(&self, name: &str) -> Option<&str> {
        self.tensors.get(name).map(|e| e.dtype.as_str())
    }

    /// The weight files, in the order they were opened.
    pub fn weight_files(&self) -> impl Iterator<Item = &Path> {
        self.files.iter().map(|(p, _)| p.as_path())
    }

    /// Path of `tokenizer.json`, when the folder has one.
    pub fn tokenizer_json(&self) -> Option<PathBuf> {
        self.tokenizer_json.clone()
    }

    /// Parsed `tokenizer_config.json`, when the folder has one.
    pub fn tokenizer_config(&self) -> Option<Json> {
        self.tokenizer_config.clone()
    }

    /// Parsed `generation_config.json`, when the folder has one.
    pub fn generation_config(&self) -> Option<Json> {
        self.generation_config.clone()
    }
}
