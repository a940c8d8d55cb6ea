//! Where weights come from: a GGUF file or an HF folder (safetensors +
//! config.json). Models ask for tensors by GGUF names; an HF folder maps
//! them to its own names.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use braid_formats::gguf::Gguf;
use braid_formats::safetensors::HfFolder;
use braid_formats::TensorView;

pub enum Source {
    Gguf(Gguf),
    Hf(HfFolder),
}

impl Source {
    /// Open a `.gguf` file or an HF model folder.
    pub fn open(path: &Path) -> Result<Source> {
        if path.is_dir() {
            Ok(Source::Hf(HfFolder::open(path)?))
        } else if path.exists() {
            Ok(Source::Gguf(Gguf::open(path)?))
        } else {
            bail!("model not found: {}", path.display())
        }
    }

    pub fn path(&self) -> PathBuf {
        match self {
            Source::Gguf(g) => g.path().to_path_buf(),
            Source::Hf(h) => h.dir().to_path_buf(),
        }
    }

    /// The architecture name (GGUF's `general.architecture`, or the HF
    /// `model_type`).
    pub fn architecture(&self) -> Result<String> {
        match self {
            Source::Gguf(g) => Ok(g.architecture()?.to_string()),
            Source::Hf(h) => h
                .config()
                .get("model_type")
                .and_then(|v| v.as_str())
                .map(str::to_string)
                .with_context(|| format!("{}: config.json has no model_type", h.dir().display())),
        }
    }

    /// A tensor by its GGUF name (`blk.3.attn_q.weight`).
    pub fn tensor(&self, gguf_name: &str) -> Result<TensorView> {
        match self {
            Source::Gguf(g) => g.tensor(gguf_name),
            Source::Hf(h) => h.tensor(&text_name(h, gguf_name)),
        }
    }

    pub fn has_tensor(&self, gguf_name: &str) -> bool {
        match self {
            Source::Gguf(g) => g.tensor_names().any(|n| n == gguf_name),
            Source::Hf(h) => h.has_tensor(&text_name(h, gguf_name)),
        }
    }
}

/// The HF name of a text model's tensor: a multimodal checkpoint
/// (`Gemma3ForConditionalGeneration`) keeps its text model under
/// `language_model.`.
fn text_name(h: &HfFolder, gguf: &str) -> String {
    let n = hf_name(gguf);
    let nested = format!("language_model.{n}");
    if !h.has_tensor(&n) && h.has_tensor(&nested) {
        return nested;
    }
    n
}

/// Map a GGUF tensor name to the HF (transformers) name.
pub fn hf_name(gguf: &str) -> String {
    let top = [("token_embd.weight", "model.embed_tokens.weight"), ("output_norm.weight", "model.norm.weight"), ("output.weight", "lm_head.weight")];
    if let Some((_, h)) = top.iter().find(|(g, _)| *g == gguf) {
        return h.to_string();
    }
    if let Some(rest) = gguf.strip_prefix("blk.") {
        if let Some((layer, name)) = rest.split_once('.') {
            let per_layer = [
                ("attn_norm.weight", "input_layernorm.weight"),
                ("attn_q.weight", "self_attn.q_proj.weight"),
                ("attn_k.weight", "self_attn.k_proj.weight"),
                ("attn_v.weight", "self_attn.v_proj.weight"),
                ("attn_q.bias", "self_attn.q_proj.bias"),
                ("attn_k.bias", "self_attn.k_proj.bias"),
                ("attn_v.bias", "self_attn.v_proj.bias"),
                ("attn_output.weight", "self_attn.o_proj.weight"),
                ("attn_q_norm.weight", "self_attn.q_norm.weight"),
                ("attn_k_norm.weight", "self_attn.k_norm.weight"),
                ("ffn_norm.weight", "post_attention_layernorm.weight"),
                ("ffn_gate.weight", "mlp.gate_proj.weight"),
                ("ffn_up.weight", "mlp.up_proj.weight"),
                ("ffn_down.weight", "mlp.down_proj.weight"),
            ];
            if let Some((_, h)) = per_layer.iter().find(|(g, _)| *g == name) {
                return format!("model.layers.{layer}.{h}");
            }
        }
    }
    gguf.to_string()
}
