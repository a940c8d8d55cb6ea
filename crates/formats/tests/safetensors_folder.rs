//! HF model folders with hand-written safetensors files: single file,
//! sharded index form, and corrupt headers.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use braid_formats::safetensors::HfFolder;
use braid_formats::DType;
use serde_json::json;

/// A fresh, empty folder under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let p = std::env::temp_dir().join(format!("braid-st-{}-{tag}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
    fn path(&self) -> &Path {
        &self.0
    }
    fn write(&self, name: &str, bytes: impl AsRef<[u8]>) {
        std::fs::write(self.0.join(name), bytes).unwrap();
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A tensor to write: name, dtype string, shape, raw little-endian data.
struct T<'a>(&'a str, &'a str, Vec<usize>, Vec<u8>);

/// safetensors bytes by hand: u64 LE header length, JSON header, data.
fn safetensors(tensors: &[T]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), json!({"format": "pt"}));
    let mut data = Vec::new();
    for T(name, dtype, shape, bytes) in tensors {
        let begin = data.len();
        data.extend(bytes);
        header.insert(name.to_string(), json!({"dtype": dtype, "shape": shape, "data_offsets": [begin, data.len()]}));
    }
    raw_file(&serde_json::to_string(&header).unwrap(), &data)
}

fn raw_file(header: &str, data: &[u8]) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend(header.as_bytes());
    out.extend(data);
    out
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}
fn f16s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|&x| half::f16::from_f32(x).to_le_bytes()).collect()
}
fn bf16s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|&x| half::bf16::from_f32(x).to_le_bytes()).collect()
}

const CONFIG: &str = r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 4, "num_hidden_layers": 1}"#;

fn err(dir: &Path) -> String {
    match HfFolder::open(dir) {
        Ok(_) => panic!("{} opened but should not have", dir.display()),
        Err(e) => format!("{e:#}"),
    }
}

#[test]
fn single_file_folder() {
    let d = TempDir::new("single");
    d.write("config.json", CONFIG);
    d.write(
        "model.safetensors",
        safetensors(&[
            T("model.embed_tokens.weight", "F32", vec![3, 2], f32s(&[1., 2., 3., 4., 5., 6.])),
            T("model.norm.weight", "BF16", vec![4], bf16s(&[1., -0.5, 0.25, 8.])),
            T("lm_head.weight", "F16", vec![2, 2], f16s(&[0.5, 1.5, -2., 3.])),
            T("model.pos_ids", "I64", vec![2], [7i64, 9].iter().flat_map(|x| x.to_le_bytes()).collect()),
            T("model.empty", "F32", vec![0, 4], vec![]),
        ]),
    );
    d.write("tokenizer.json", "{}");
    d.write("tokenizer_config.json", r#"{"bos_token": "<s>", "chat_template": "{{ x }}"}"#);

    let f = HfFolder::open(d.path()).unwrap();
    assert_eq!(f.config()["hidden_size"], 4);
    assert_eq!(f.config()["architectures"][0], "LlamaForCausalLM");
    assert_eq!(f.tokenizer_json(), Some(d.path().join("tokenizer.json")));
    assert_eq!(f.tokenizer_config().unwrap()["bos_token"], "<s>");
    assert!(f.generation_config().is_none());

    let mut names: Vec<&str> = f.tensor_names().collect();
    names.sort();
    assert_eq!(names, vec!["lm_head.weight", "model.embed_tokens.weight", "model.empty", "model.norm.weight", "model.pos_ids"]);

    let e = f.tensor("model.embed_tokens.weight").unwrap();
    assert_eq!((e.dtype, e.shape.clone(), e.rows(), e.cols()), (DType::F32, vec![3, 2], 3, 2));
    assert_eq!(e.to_f32().unwrap(), vec![1., 2., 3., 4., 5., 6.]);
    let n = f.tensor("model.norm.weight").unwrap();
    assert_eq!((n.dtype, n.to_f32().unwrap()), (DType::BF16, vec![1., -0.5, 0.25, 8.]));
    let h = f.tensor("lm_head.weight").unwrap();
    assert_eq!((h.dtype, h.to_f32().unwrap()), (DType::F16, vec![0.5, 1.5, -2., 3.]));
    assert_eq!(f.tensor("model.empty").unwrap().elements(), 0);

    // A dtype we do not decode: a clear error naming the tensor and dtype.
    assert_eq!(f.tensor_dtype("model.pos_ids"), Some("I64"));
    let msg = f.tensor("model.pos_ids").unwrap_err().to_string();
    assert!(msg.contains("model.pos_ids") && msg.contains("I64") && msg.contains("model.safetensors"), "{msg}");
    let msg = f.tensor("missing.weight").unwrap_err().to_string();
    assert!(msg.contains("missing.weight") && msg.contains(&d.path().display().to_string()), "{msg}");
}

#[test]
fn sharded_folder() {
    let d = TempDir::new("sharded");
    d.write("config.json", CONFIG);
    d.write("model-00001-of-00002.safetensors", safetensors(&[T("a.weight", "F32", vec![2], f32s(&[1., 2.])), T("b.weight", "F32", vec![1], f32s(&[3.]))]));
    d.write("model-00002-of-00002.safetensors", safetensors(&[T("c.weight", "BF16", vec![2, 1], bf16s(&[4., 5.]))]));
    let index = json!({
        "metadata": {"total_size": 20},
        "weight_map": {
            "a.weight": "model-00001-of-00002.safetensors",
            "c.weight": "model-00002-of-00002.safetensors",
            "b.weight": "model-00001-of-00002.safetensors"
        }
    });
    d.write("model.safetensors.index.json", index.to_string());
    let f = HfFolder::open(d.path()).unwrap();
    assert_eq!(f.weight_files().count(), 2);
    assert_eq!(f.tensor_names().count(), 3);
    assert_eq!(f.tensor("a.weight").unwrap().to_f32().unwrap(), vec![1., 2.]);
    assert_eq!(f.tensor("b.weight").unwrap().to_f32().unwrap(), vec![3.]);
    let c = f.tensor("c.weight").unwrap();
    assert_eq!((c.shape.clone(), c.to_f32().unwrap()), (vec![2, 1], vec![4., 5.]));
    assert!(f.tokenizer_json().is_none() && f.tokenizer_config().is_none());

    // The index with `tensor` mapped to `shard`: the folder's error.
    let with_entry = |tensor: &str, shard: &str| {
        let mut bad = index.clone();
        bad["weight_map"][tensor] = json!(shard);
        d.write("model.safetensors.index.json", bad.to_string());
        err(d.path())
    };

    // The index names a tensor its shard lacks.
    let e = with_entry("ghost.weight", "model-00002-of-00002.safetensors");
    assert!(e.contains("ghost.weight") && e.contains("model.safetensors.index.json"), "{e}");

    // The index puts a tensor in the wrong shard.
    let e = with_entry("a.weight", "model-00002-of-00002.safetensors");
    assert!(e.contains("a.weight") && e.contains("model-00001-of-00002.safetensors"), "{e}");

    // A shard file that is not there.
    let e = with_entry("a.weight", "model-00003-of-00002.safetensors");
    assert!(e.contains("model-00003-of-00002.safetensors") && e.contains("missing"), "{e}");

    // A shard path that leaves the folder.
    let e = with_entry("a.weight", "../elsewhere.safetensors");
    assert!(e.contains("../elsewhere.safetensors") && e.contains("plain file name"), "{e}");

    // The same tensor in two shards.
    d.write(
        "model-00002-of-00002.safetensors",
        safetensors(&[T("c.weight", "BF16", vec![2, 1], bf16s(&[4., 5.])), T("a.weight", "F32", vec![1], f32s(&[0.]))]),
    );
    d.write("model.safetensors.index.json", index.to_string());
    let e = err(d.path());
    assert!(e.contains("a.weight") && e.contains("both"), "{e}");

    d.write("model.safetensors.index.json", r#"{"metadata": {}}"#);
    let e = err(d.path());
    assert!(e.contains("weight_map"), "{e}");
}

#[test]
fn folder_is_shareable_across_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<HfFolder>();
}

#[test]
fn missing_files() {
    let d = TempDir::new("missing");
    let e = err(d.path());
    assert!(e.contains("config.json"), "{e}");
    d.write("config.json", CONFIG);
    let e = err(d.path());
    assert!(e.contains("model.safetensors"), "{e}");
    d.write("config.json", "{not json");
    let e = err(d.path());
    assert!(e.contains("config.json") && e.contains("invalid JSON"), "{e}");
    d.write("config.json", CONFIG);
    d.write("model.safetensors", safetensors(&[]));
    d.write("tokenizer_config.json", "[1, 2");
    let e = err(d.path());
    assert!(e.contains("tokenizer_config.json") && e.contains("invalid JSON"), "{e}");
    std::fs::remove_file(d.path().join("tokenizer_config.json")).unwrap();
    assert_eq!(HfFolder::open(d.path()).unwrap().tensor_names().count(), 0);
    let e = err(&d.path().join("nowhere"));
    assert!(e.contains("nowhere") && e.contains("not a directory"), "{e}");
}

/// Writes `bytes` as the folder's only weight file and returns the open error.
fn corrupt(d: &TempDir, bytes: Vec<u8>) -> String {
    d.write("model.safetensors", bytes);
    let e = err(d.path());
    assert!(e.contains("model.safetensors"), "error does not name the file: {e}");
    e
}

#[test]
fn corrupt_headers() {
    let d = TempDir::new("corrupt");
    d.write("config.json", CONFIG);
    let t = |off: [u64; 2], shape: Vec<usize>| json!({"w": {"dtype": "F32", "shape": shape, "data_offsets": off}}).to_string();

    assert!(corrupt(&d, vec![1, 2, 3]).contains("truncated"));
    let mut b = (1u64 << 60).to_le_bytes().to_vec();
    b.extend(b"{}");
    assert!(corrupt(&d, b).contains("header length 1152921504606846976"));
    assert!(corrupt(&d, raw_file("{\"w\": {", &[])).contains("not valid JSON"));
    assert!(corrupt(&d, raw_file("[1, 2]", &[])).contains("not a JSON object"));
    let e = corrupt(&d, raw_file(&t([0, 16], vec![2, 2]), &[0; 8]));
    assert!(e.contains("`w`") && e.contains("runs past the end"), "{e}");
    let e = corrupt(&d, raw_file(&t([0, 12], vec![2, 2]), &[0; 16]));
    assert!(e.contains("`w`") && e.contains("needs 16 bytes") && e.contains("hold 12"), "{e}");
    let e = corrupt(&d, raw_file(&t([8, 4], vec![1]), &[0; 16]));
    assert!(e.contains("`w`") && e.contains("backwards"), "{e}");
    let e = corrupt(&d, raw_file(&t([0, 4], vec![1 << 40, 1 << 40]), &[0; 16]));
    assert!(e.contains("`w`") && e.contains("overflows"), "{e}");
    let h = json!({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}).to_string();
    assert!(corrupt(&d, raw_file(&h, &[0; 4])).contains("shape"));
    let h = json!({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0]}}).to_string();
    assert!(corrupt(&d, raw_file(&h, &[0; 4])).contains("data_offsets"));
    let h = json!({"w": {"shape": [1], "data_offsets": [0, 4]}}).to_string();
    assert!(corrupt(&d, raw_file(&h, &[0; 4])).contains("dtype"));
    let h = json!({"w": 5}).to_string();
    assert!(corrupt(&d, raw_file(&h, &[0; 4])).contains("not an object"));
    let h = json!({
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}
    })
    .to_string();
    assert!(corrupt(&d, raw_file(&h, &[0; 12])).contains("overlap"));
}

#[test]
fn every_truncation_fails_cleanly() {
    let d = TempDir::new("trunc");
    d.write("config.json", CONFIG);
    let full = safetensors(&[T("x", "F32", vec![2, 2], f32s(&[1., 2., 3., 4.])), T("y", "BF16", vec![3], bf16s(&[1., 2., 3.]))]);
    d.write("model.safetensors", &full);
    HfFolder::open(d.path()).unwrap();
    for n in 0..full.len() {
        corrupt(&d, full[..n].to_vec());
    }
}
