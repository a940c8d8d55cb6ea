//! Where weights come from: a GGUF file or an HF folder (safetensors +
//! config.json). Models ask for tensors by GGUF names; an HF folder maps
//! them to its own names, which differ by family (`hf_name`). A name the
//! map does not know is taken as it is, so a model may also ask an HF
//! folder for an HF name of a tensor GGUF does not have.

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

    pub fn is_gguf(&self) -> bool {
        matches!(self, Source::Gguf(_))
    }

    /// Expert `e` of `n`, by the GGUF name of the experts' stacked tensor
    /// (`blk.1.ffn_up_exps.weight`, `[n, rows, cols]`): a GGUF holds them
    /// stacked, an HF folder one tensor per expert.
    pub fn expert(&self, stacked: &str, e: usize, n: usize) -> Result<TensorView> {
        match self {
            Source::Gguf(g) => {
                let t = g.tensor(stacked)?;
                let &[experts, rows, _] = t.shape.as_slice() else {
                    bail!("{}: tensor `{stacked}` has shape {:?}, expected [experts, rows, cols]", g.path().display(), t.shape)
                };
                if experts != n || e >= n {
                    bail!("{}: tensor `{stacked}` holds {experts} experts, the model has {n}", g.path().display());
                }
                crate::moe::slice_rows(&t, e * rows, rows)
            }
            Source::Hf(h) => {
                let arch = model_type(h);
                match hf_expert_name(arch, stacked, e) {
                    Some(name) => h.tensor(&name),
                    None => bail!("{}: no per-expert name for `{stacked}` in a {arch} folder", h.dir().display()),
                }
            }
        }
    }

    pub fn has_tensor(&self, gguf_name: &str) -> bool {
        match self {
            Source::Gguf(g) => g.tensor_names().any(|n| n == gguf_name),
            Source::Hf(h) => h.has_tensor(&text_name(h, gguf_name)),
        }
    }
}

fn model_type(h: &HfFolder) -> &str {
    let c = h.config();
    let c = c.get("text_config").filter(|t| t.is_object()).unwrap_or(c);
    c.get("model_type").and_then(|v| v.as_str()).unwrap_or("")
}

/// GGUF → HF names of a family's whole-model tensors and of its per-block
/// tensors (`blk.{i}.` → `{block prefix}{i}.`), where the family's differ
/// from Llama's.
struct Names {
    block: &'static str,
    top: &'static [(&'static str, &'static str)],
    per_layer: &'static [(&'static str, &'static str)],
    /// A stacked expert tensor → the per-expert name `{prefix}{e}.{suffix}`.
    experts: &'static [(&'static str, &'static str, &'static str)],
}

const LLAMA: Names = Names {
    block: "model.layers.",
    top: &[("token_embd.weight", "model.embed_tokens.weight"), ("output_norm.weight", "model.norm.weight"), ("output.weight", "lm_head.weight")],
    per_layer: &[
        ("attn_norm.weight", "input_layernorm.weight"),
        ("attn_q.weight", "self_attn.q_proj.weight"),
        ("attn_k.weight", "self_attn.k_proj.weight"),
        ("attn_v.weight", "self_attn.v_proj.weight"),
        ("attn_q.bias", "self_attn.q_proj.bias"),
        ("attn_k.bias", "self_attn.k_proj.bias"),
        ("attn_v.bias", "self_attn.v_proj.bias"),
        ("attn_output.weight", "self_attn.o_proj.weight"),
        ("attn_output.bias", "self_attn.o_proj.bias"),
        ("attn_q_norm.weight", "self_attn.q_norm.weight"),
        ("attn_k_norm.weight", "self_attn.k_norm.weight"),
        ("ffn_norm.weight", "post_attention_layernorm.weight"),
        ("ffn_gate.weight", "mlp.gate_proj.weight"),
        ("ffn_up.weight", "mlp.up_proj.weight"),
        ("ffn_down.weight", "mlp.down_proj.weight"),
        ("ffn_gate.bias", "mlp.gate_proj.bias"),
        ("ffn_up.bias", "mlp.up_proj.bias"),
        ("ffn_down.bias", "mlp.down_proj.bias"),
        // MiniMax-M2's mixture.
        ("ffn_gate_inp.weight", "block_sparse_moe.gate.weight"),
        ("exp_probs_b.bias", "block_sparse_moe.e_score_correction_bias"),
    ],
    experts: &[
        ("ffn_gate_exps.weight", "block_sparse_moe.experts.", "w1.weight"),
        ("ffn_up_exps.weight", "block_sparse_moe.experts.", "w3.weight"),
        ("ffn_down_exps.weight", "block_sparse_moe.experts.", "w2.weight"),
    ],
};

const LFM2: Names = Names {
    block: "model.layers.",
    top: &[("token_embd.weight", "model.embed_tokens.weight"), ("token_embd_norm.weight", "model.embedding_norm.weight"), ("output.weight", "lm_head.weight")],
    per_layer: &[
        ("attn_norm.weight", "operator_norm.weight"),
        ("shortconv.in_proj.weight", "conv.in_proj.weight"),
        ("shortconv.in_proj.bias", "conv.in_proj.bias"),
        ("shortconv.out_proj.bias", "conv.out_proj.bias"),
        ("shortconv.conv.weight", "conv.conv.weight"),
        ("shortconv.conv.bias", "conv.conv.bias"),
        ("shortconv.out_proj.weight", "conv.out_proj.weight"),
        ("attn_q.weight", "self_attn.q_proj.weight"),
        ("attn_k.weight", "self_attn.k_proj.weight"),
        ("attn_v.weight", "self_attn.v_proj.weight"),
        ("attn_output.weight", "self_attn.out_proj.weight"),
        ("attn_q_norm.weight", "self_attn.q_layernorm.weight"),
        ("attn_k_norm.weight", "self_attn.k_layernorm.weight"),
        ("ffn_norm.weight", "ffn_norm.weight"),
        ("ffn_gate.weight", "feed_forward.w1.weight"),
        ("ffn_up.weight", "feed_forward.w3.weight"),
        ("ffn_down.weight", "feed_forward.w2.weight"),
        ("ffn_gate_inp.weight", "feed_forward.gate.weight"),
        ("exp_probs_b.bias", "feed_forward.expert_bias"),
    ],
    experts: &[
        ("ffn_gate_exps.weight", "feed_forward.experts.", "w1.weight"),
        ("ffn_up_exps.weight", "feed_forward.experts.", "w3.weight"),
        ("ffn_down_exps.weight", "feed_forward.experts.", "w2.weight"),
    ],
};

const NEMOTRON_H: Names = Names {
    block: "backbone.layers.",
    top: &[("token_embd.weight", "backbone.embeddings.weight"), ("output_norm.weight", "backbone.norm_f.weight"), ("output.weight", "lm_head.weight")],
    per_layer: &[
        ("attn_norm.weight", "norm.weight"),
        ("ssm_in.weight", "mixer.in_proj.weight"),
        ("ssm_conv1d.weight", "mixer.conv1d.weight"),
        ("ssm_conv1d.bias", "mixer.conv1d.bias"),
        ("ssm_dt.bias", "mixer.dt_bias"),
        ("ssm_d", "mixer.D"),
        ("ssm_norm.weight", "mixer.norm.weight"),
        ("ssm_out.weight", "mixer.out_proj.weight"),
        ("attn_q.weight", "mixer.q_proj.weight"),
        ("attn_k.weight", "mixer.k_proj.weight"),
        ("attn_v.weight", "mixer.v_proj.weight"),
        ("attn_output.weight", "mixer.o_proj.weight"),
        ("ffn_up.weight", "mixer.up_proj.weight"),
        ("ffn_down.weight", "mixer.down_proj.weight"),
        ("ffn_gate_inp.weight", "mixer.gate.weight"),
        ("exp_probs_b.bias", "mixer.gate.e_score_correction_bias"),
        ("ffn_up_shexp.weight", "mixer.shared_experts.up_proj.weight"),
        ("ffn_down_shexp.weight", "mixer.shared_experts.down_proj.weight"),
    ],
    experts: &[("ffn_up_exps.weight", "mixer.experts.", "up_proj.weight"), ("ffn_down_exps.weight", "mixer.experts.", "down_proj.weight")],
};

const GRANITE_HYBRID: Names = Names {
    block: "model.layers.",
    top: LLAMA.top,
    per_layer: &[
        ("attn_norm.weight", "input_layernorm.weight"),
        ("ffn_norm.weight", "post_attention_layernorm.weight"),
        ("attn_q.weight", "self_attn.q_proj.weight"),
        ("attn_k.weight", "self_attn.k_proj.weight"),
        ("attn_v.weight", "self_attn.v_proj.weight"),
        ("attn_output.weight", "self_attn.o_proj.weight"),
        ("ssm_in.weight", "mamba.in_proj.weight"),
        ("ssm_conv1d.weight", "mamba.conv1d.weight"),
        ("ssm_conv1d.bias", "mamba.conv1d.bias"),
        ("ssm_dt.bias", "mamba.dt_bias"),
        ("ssm_d", "mamba.D"),
        ("ssm_norm.weight", "mamba.norm.weight"),
        ("ssm_out.weight", "mamba.out_proj.weight"),
        ("ffn_gate_inp.weight", "block_sparse_moe.router.layer.weight"),
    ],
    experts: &[],
};

/// Qwen3-Next: the GGUF names of the tensors both files hold alike (the
/// DeltaNet's fused projections differ in layout and are read by their own
/// names, see `qwen3_next.rs`).
const QWEN3_NEXT: Names = Names {
    block: "model.layers.",
    top: LLAMA.top,
    per_layer: &[
        ("attn_norm.weight", "input_layernorm.weight"),
        ("post_attention_norm.weight", "post_attention_layernorm.weight"),
        ("attn_q.weight", "self_attn.q_proj.weight"),
        ("attn_k.weight", "self_attn.k_proj.weight"),
        ("attn_v.weight", "self_attn.v_proj.weight"),
        ("attn_output.weight", "self_attn.o_proj.weight"),
        ("attn_q_norm.weight", "self_attn.q_norm.weight"),
        ("attn_k_norm.weight", "self_attn.k_norm.weight"),
        ("ssm_ba.weight", "linear_attn.in_proj_ba.weight"),
        ("ssm_conv1d.weight", "linear_attn.conv1d.weight"),
        ("ssm_dt.bias", "linear_attn.dt_bias"),
        ("ssm_norm.weight", "linear_attn.norm.weight"),
        ("ssm_out.weight", "linear_attn.out_proj.weight"),
        ("ffn_gate_inp.weight", "mlp.gate.weight"),
        ("ffn_gate_shexp.weight", "mlp.shared_expert.gate_proj.weight"),
        ("ffn_up_shexp.weight", "mlp.shared_expert.up_proj.weight"),
        ("ffn_down_shexp.weight", "mlp.shared_expert.down_proj.weight"),
        ("ffn_gate_inp_shexp.weight", "mlp.shared_expert_gate.weight"),
        ("ffn_gate.weight", "mlp.gate_proj.weight"),
        ("ffn_up.weight", "mlp.up_proj.weight"),
        ("ffn_down.weight", "mlp.down_proj.weight"),
    ],
    experts: &[
        ("ffn_gate_exps.weight", "mlp.experts.", "gate_proj.weight"),
        ("ffn_up_exps.weight", "mlp.experts.", "up_proj.weight"),
        ("ffn_down_exps.weight", "mlp.experts.", "down_proj.weight"),
    ],
};

fn names(arch: &str) -> &'static Names {
    match arch {
        "granitemoehybrid" => &GRANITE_HYBRID,
        "lfm2" | "lfm2_moe" => &LFM2,
        "nemotron_h" => &NEMOTRON_H,
        "qwen3_next" => &QWEN3_NEXT,
        _ => &LLAMA,
    }
}

/// The HF name of a text model's tensor: a multimodal checkpoint
/// (`Gemma3ForConditionalGeneration`) keeps its text model under
/// `language_model.`.
fn text_name(h: &HfFolder, gguf: &str) -> String {
    let n = hf_name(model_type(h), gguf);
    let nested = format!("language_model.{n}");
    if !h.has_tensor(&n) && h.has_tensor(&nested) {
        return nested;
    }
    n
}

/// Map a GGUF tensor name to the HF (transformers) name in a folder of
/// `model_type` `arch`; a name not in the family's map is returned as it is.
pub fn hf_name(arch: &str, gguf: &str) -> String {
    let n = names(arch);
    if let Some((_, h)) = n.top.iter().find(|(g, _)| *g == gguf) {
        return h.to_string();
    }
    if let Some((layer, name)) = gguf.strip_prefix("blk.").and_then(|rest| rest.split_once('.')) {
        if let Some((_, h)) = n.per_layer.iter().find(|(g, _)| *g == name) {
            return format!("{}{layer}.{h}", n.block);
        }
    }
    gguf.to_string()
}

/// The HF name of expert `e` of a stacked GGUF expert tensor.
fn hf_expert_name(arch: &str, stacked: &str, e: usize) -> Option<String> {
    let n = names(arch);
    let (layer, name) = stacked.strip_prefix("blk.")?.split_once('.')?;
    let (_, prefix, suffix) = n.experts.iter().find(|(g, _, _)| *g == name)?;
    Some(format!("{}{layer}.{prefix}{e}.{suffix}", n.block))
}
