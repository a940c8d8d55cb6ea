//! GGUF reader on the real models in the model cache (skipped when absent).
//!
//! Expected facts come from the models' published configs (SmolLM2-135M:
//! hidden 576, 30 layers, 9 heads / 3 KV heads of 64, FFN 1536, vocab 49152;
//! Gemma 3 270M: hidden 640, 18 layers, 4 heads / 1 KV head of 256, FFN 2048,
//! vocab 262144) and from llama.cpp's tokenization in testdata/golden (copies of ../shared/golden).

use std::path::PathBuf;

use braid_formats::gguf::Gguf;
use braid_formats::DType;

fn model(file: &str) -> Option<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(d) = std::env::var_os("BRAID_MODELS") {
        dirs.push(PathBuf::from(d));
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        dirs.push(PathBuf::from(d).join("braid"));
    }
    if let Some(d) = std::env::var_os("HOME") {
        dirs.push(PathBuf::from(d).join(".cache/braid"));
    }
    let found = dirs.into_iter().map(|d| d.join(file)).find(|p| p.is_file());
    if found.is_none() {
        eprintln!("SKIPPED: {file} not found in $BRAID_MODELS, $XDG_CACHE_HOME/braid or ~/.cache/braid");
    }
    found
}

/// The architecture, the hyperparameters under its prefix
/// (`<arch>.<key>`), and the tokenizer model a file declares.
fn check_header(g: &Gguf, arch: &str, counts: &[(&str, u64)], tokenizer: &str) {
    assert_eq!(g.architecture().unwrap(), arch);
    for &(key, want) in counts {
        assert_eq!(g.get_u64(&format!("{arch}.{key}")).unwrap(), want, "{arch}.{key}");
    }
    assert_eq!(g.get_str("tokenizer.ggml.model").unwrap(), tokenizer);
}

/// Checks that hold for any well-formed model file.
fn check_layout(g: &Gguf) {
    let len = std::fs::metadata(g.path()).unwrap().len() as usize;
    let mut total = 0;
    for t in g.tensor_infos() {
        assert_eq!(t.offset % g.alignment(), 0, "{}", t.name);
        assert!(t.offset + t.size <= len, "{}", t.name);
        let v = g.tensor(&t.name).unwrap();
        assert_eq!(v.data.len(), t.size);
        assert_eq!(v.dtype.bytes_for(v.elements()), Some(t.size), "{}", t.name);
        total += t.size;
    }
    // The tensors fill the data section (up to alignment padding between them).
    let section = len - g.data_offset();
    assert!(total <= section && section - total < 32 * g.tensor_infos().len() + 32, "{total} of {section}");
}

#[test]
fn smollm2_135m_q4_1() {
    let Some(path) = model("SmolLM2-135M-Instruct.Q4_1.gguf") else {
        return;
    };
    let g = Gguf::open(&path).unwrap();
    assert!(matches!(g.version(), 2 | 3));
    check_header(
        &g,
        "llama",
        &[("block_count", 30), ("embedding_length", 576), ("feed_forward_length", 1536), ("attention.head_count", 9), ("attention.head_count_kv", 3)],
        "gpt2",
    );

    let tokens = g.get_str_array("tokenizer.ggml.tokens").unwrap();
    assert_eq!(tokens.len(), 49152);
    // llama.cpp tokenizes "Hello world" as [19556, 905] (golden/smollm2-public.json).
    assert_eq!(tokens[19556], "Hello");
    assert_eq!(tokens[905], "Ġworld");

    // 30 blocks of 9 tensors, plus token_embd and output_norm (the output
    // head is tied to the embedding).
    assert_eq!(g.tensor_names().count(), 30 * 9 + 2);
    let emb = g.tensor("token_embd.weight").unwrap();
    assert_eq!(emb.shape, vec![49152, 576]);
    assert!(emb.dtype.is_quantized());
    assert_eq!(g.tensor("blk.0.attn_q.weight").unwrap().shape, vec![576, 576]);
    assert_eq!(g.tensor("blk.0.attn_k.weight").unwrap().shape, vec![192, 576]);
    assert_eq!(g.tensor("blk.29.ffn_gate.weight").unwrap().shape, vec![1536, 576]);
    assert_eq!(g.tensor("blk.29.ffn_down.weight").unwrap().shape, vec![576, 1536]);
    let q = g.tensor("blk.0.attn_q.weight").unwrap();
    assert_eq!(q.dtype, DType::Q4_1);

    let norm = g.tensor("output_norm.weight").unwrap();
    assert_eq!((norm.dtype, norm.shape.clone()), (DType::F32, vec![576]));
    let w = norm.to_f32().unwrap();
    assert!(w.iter().all(|x| x.is_finite()) && w.iter().any(|&x| x != 0.0));

    let e = g.tensor("blk.30.attn_q.weight").unwrap_err().to_string();
    assert!(e.contains("SmolLM2-135M-Instruct.Q4_1.gguf") && e.contains("blk.30.attn_q.weight"), "{e}");
    check_layout(&g);
}

#[test]
fn gemma3_270m_q4_k_m() {
    let Some(path) = model("gemma-3-270m-q4_k_m.gguf") else {
        return;
    };
    let g = Gguf::open(&path).unwrap();
    check_header(
        &g,
        "gemma3",
        &[
            ("block_count", 18),
            ("embedding_length", 640),
            ("feed_forward_length", 2048),
            ("attention.head_count", 4),
            ("attention.head_count_kv", 1),
            ("attention.key_length", 256),
        ],
        "llama",
    );

    let tokens = g.get_str_array("tokenizer.ggml.tokens").unwrap();
    let scores = g.get_f32_array("tokenizer.ggml.scores").unwrap();
    let types = g.get_i32_array("tokenizer.ggml.token_type").unwrap();
    assert_eq!(tokens.len(), 262144);
    assert_eq!(scores.len(), tokens.len());
    assert_eq!(types.len(), tokens.len());

    let emb = g.tensor("token_embd.weight").unwrap();
    assert_eq!(emb.shape, vec![262144, 640]);
    assert_eq!(g.tensor("blk.0.attn_q.weight").unwrap().shape, vec![1024, 640]);
    assert_eq!(g.tensor("blk.0.attn_k.weight").unwrap().shape, vec![256, 640]);
    assert_eq!(g.tensor("blk.17.ffn_down.weight").unwrap().shape, vec![640, 2048]);
    // Gemma 3 normalizes q and k per head.
    assert_eq!(g.tensor("blk.0.attn_q_norm.weight").unwrap().shape, vec![256]);
    let k_m: Vec<DType> = g.tensor_infos().iter().map(|t| t.dtype).collect();
    assert!(k_m.iter().any(|d| matches!(d, DType::Q4K | DType::Q5K | DType::Q6K)));
    check_layout(&g);
}
