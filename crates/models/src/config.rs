//! Reading HF `config.json` values in both forms they come in: as on the
//! Hub (`rope_theta`, `rope_local_base_freq`, `global_head_dim`, ...) and as
//! transformers 5.x writes them (`rope_parameters`, per-layer-type RoPE,
//! `per_layer_config`, `{"__float__": "Infinity"}`).
//!
//! Missing and `null` read the same: absent. A value of the wrong type is an
//! error naming the file and the key, never a silent default.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde_json::Value;

pub struct HfConfig<'a> {
    v: &'a Value,
    path: PathBuf,
}

/// The RoPE settings of one layer type.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeParams {
    pub theta: f32,
    /// `default`, `linear`, `proportional`, `llama3`, `yarn`, ...
    pub rope_type: String,
    /// Fraction of the head dimension that rotates (1 when absent).
    pub partial_rotary_factor: f32,
    /// `factor` of scaled variants (1 when absent).
    pub factor: f32,
}

/// A number that may be written as `{"__float__": "Infinity"}` (transformers 5.x).
fn as_f64(v: &Value) -> Option<f64> {
    if let Some(x) = v.as_f64() {
        return Some(x);
    }
    match v.get("__float__")?.as_str()? {
        "Infinity" | "inf" => Some(f64::INFINITY),
        "-Infinity" | "-inf" => Some(f64::NEG_INFINITY),
        "NaN" | "nan" => Some(f64::NAN),
        s => s.parse().ok(),
    }
}

/// [`as_f64`] narrowed to f32, for numbers inside lists (`time_step_limit`).
pub fn json_f32(v: &Value) -> Option<f32> {
    as_f64(v).map(|x| x as f32)
}

impl<'a> HfConfig<'a> {
    /// The config `v` read from `dir/config.json`; a multimodal config's
    /// `text_config` is used when present.
    pub fn new(v: &'a Value, dir: &Path) -> HfConfig<'a> {
        let v = v.get("text_config").filter(|t| t.is_object()).unwrap_or(v);
        HfConfig { v, path: dir.join("config.json") }
    }

    /// The config `v` as it is (a sub-config of `dir/config.json`, or its
    /// top level), without looking into `text_config`.
    pub fn top(v: &'a Value, dir: &Path) -> HfConfig<'a> {
        HfConfig { v, path: dir.join("config.json") }
    }

    pub fn raw(&self) -> &'a Value {
        self.v
    }

    /// The value at `key`; None when missing or null.
    pub fn get(&self, key: &str) -> Option<&'a Value> {
        self.v.get(key).filter(|v| !v.is_null())
    }

    fn bad<T>(&self, key: &str, want: &str) -> Result<T> {
        bail!("{}: `{key}` is {}, expected {want}", self.path.display(), self.v[key])
    }

    /// The value at `key` read by `read`; None when missing or null, an
    /// error naming `want` when `read` does not take it.
    fn opt<T>(&self, key: &str, read: impl Fn(&'a Value) -> Option<T>, want: &str) -> Result<Option<T>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => match read(v) {
                Some(x) => Ok(Some(x)),
                None => self.bad(key, want),
            },
        }
    }

    pub fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        self.opt(key, |v| v.as_u64().map(|x| x as usize), "a non-negative integer")
    }

    pub fn usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?.with_context(|| format!("{}: `{key}` is missing", self.path.display()))
    }

    pub fn opt_f32(&self, key: &str) -> Result<Option<f32>> {
        self.opt(key, |v| as_f64(v).map(|x| x as f32), "a number")
    }

    pub fn f32(&self, key: &str) -> Result<f32> {
        self.opt_f32(key)?.with_context(|| format!("{}: `{key}` is missing", self.path.display()))
    }

    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        self.opt(key, Value::as_bool, "true or false")
    }

    pub fn opt_str(&self, key: &str) -> Result<Option<&'a str>> {
        self.opt(key, Value::as_str, "a string")
    }

    /// `layer_types` (or `None` when the config has none), checked to name
    /// `layers` layers.
    pub fn layer_types(&self, layers: usize) -> Result<Option<Vec<String>>> {
        let Some(v) = self.get("layer_types") else { return Ok(None) };
        let Some(a) = v.as_array() else { return self.bad("layer_types", "a list of strings") };
        let t: Option<Vec<String>> = a.iter().map(|x| x.as_str().map(str::to_string)).collect();
        let Some(t) = t else { return self.bad("layer_types", "a list of strings") };
        if t.len() != layers {
            bail!("{}: `layer_types` names {} layers, the model has {layers}", self.path.display(), t.len());
        }
        Ok(Some(t))
    }

    /// A per-layer override from transformers 5.x's `per_layer_config`
    /// (`{"3": {"head_dim": 32}}`; past 9 layers the keys are zero-padded,
    /// `{"04": ...}`, so they are matched as numbers).
    pub fn per_layer_usize(&self, layer: usize, key: &str) -> Result<Option<usize>> {
        let entry = self.get("per_layer_config").and_then(|p| p.as_object()).and_then(|p| p.iter().find(|(k, _)| k.parse::<usize>().ok() == Some(layer)));
        let Some(v) = entry.and_then(|(_, l)| l.get(key)) else { return Ok(None) };
        match v.as_u64() {
            Some(x) => Ok(Some(x as usize)),
            None => bail!("{}: per_layer_config.{layer}.{key} is {v}, expected a non-negative integer", self.path.display()),
        }
    }

    /// RoPE settings for a layer type (`"full_attention"`, `"sliding_attention"`;
    /// None for a model with one kind). Looks in `rope_parameters[layer_type]`,
    /// then `rope_parameters`, then the Hub keys (`rope_theta`, `rope_scaling`,
    /// `partial_rotary_factor`, and `rope_local_base_freq` for sliding layers).
    /// `default_theta` is used when no theta is given anywhere.
    pub fn rope(&self, layer_type: Option<&str>, default_theta: f32) -> Result<RopeParams> {
        let params = self.get("rope_parameters");
        let typed = params.and_then(|p| layer_type.and_then(|t| p.get(t))).filter(|v| v.is_object());
        // transformers 5.x nests per layer type; otherwise the object itself holds the keys.
        let p = typed.or(params.filter(|p| p.get("rope_theta").is_some() || p.get("rope_type").is_some()));
        let scaling = self.get("rope_scaling").filter(|v| v.is_object());
        let num = |v: Option<&Value>, what: &str| -> Result<Option<f32>> {
            match v.filter(|v| !v.is_null()) {
                None => Ok(None),
                Some(v) => match as_f64(v) {
                    Some(x) => Ok(Some(x as f32)),
                    None => bail!("{}: RoPE `{what}` is {v}, expected a number", self.path.display()),
                },
            }
        };
        let local = layer_type == Some("sliding_attention");
        let theta = match num(p.and_then(|p| p.get("rope_theta")), "rope_theta")? {
            Some(t) => t,
            None => {
                let hub_local = if local { self.opt_f32("rope_local_base_freq")? } else { None };
                match hub_local {
                    Some(t) => t,
                    None => self.opt_f32("rope_theta")?.unwrap_or(default_theta),
                }
            }
        };
        let from = |key: &str| -> Result<Option<f32>> {
            match num(p.and_then(|p| p.get(key)), key)? {
                Some(x) => Ok(Some(x)),
                // Hub configs scale only the global layers (Gemma 3's rope_scaling).
                None if !local => num(scaling.and_then(|s| s.get(key)), key),
                None => Ok(None),
            }
        };
        let rope_type = p
            .and_then(|p| p.get("rope_type"))
            .or_else(|| if local { None } else { scaling.and_then(|s| s.get("rope_type").or_else(|| s.get("type"))) })
            .and_then(Value::as_str)
            .unwrap_or("default")
            .to_string();
        let partial = match from("partial_rotary_factor")? {
            Some(f) => f,
            None => self.opt_f32("partial_rotary_factor")?.unwrap_or(1.0),
        };
        Ok(RopeParams { theta, rope_type, partial_rotary_factor: partial, factor: from("factor")?.unwrap_or(1.0) })
    }
}

/// Hyperparameter checks at load, so that a model file that would divide
/// by zero or index out of bounds on its first forward is refused with the
/// field named. Each field is named as GGUF keys (after the architecture
/// prefix) and config.json keys call it.
pub struct Checks {
    file: PathBuf,
    errors: Vec<String>,
}

impl Checks {
    pub fn new(src: &crate::source::Source) -> Checks {
        Checks { file: src.path(), errors: Vec::new() }
    }

    fn fail(&mut self, msg: String) -> &mut Self {
        self.errors.push(msg);
        self
    }

    /// A count that must be at least 1.
    pub fn count(&mut self, field: &str, v: usize) -> &mut Self {
        if v == 0 {
            return self.fail(format!("{field} is 0; it must be at least 1"));
        }
        self
    }

    /// A norm epsilon: finite, above 0 and below 1.
    pub fn eps(&mut self, field: &str, v: f32) -> &mut Self {
        if !(v.is_finite() && v > 0.0 && v < 1.0) {
            return self.fail(format!("{field} is {v}; it must be above 0 and below 1"));
        }
        self
    }

    /// A finite number above 0 (a scale, a frequency base).
    pub fn positive(&mut self, field: &str, v: f32) -> &mut Self {
        if !(v.is_finite() && v > 0.0) {
            return self.fail(format!("{field} is {v}; it must be a finite number above 0"));
        }
        self
    }

    /// `part` must divide `whole` (query heads per KV head, say).
    pub fn divides(&mut self, part_field: &str, part: usize, whole_field: &str, whole: usize) -> &mut Self {
        if part == 0 || !whole.is_multiple_of(part) {
            return self.fail(format!("{part_field} is {part}, which does not divide {whole_field} ({whole})"));
        }
        self
    }

    /// Top-k of a mixture: between 1 and the experts.
    pub fn top_k(&mut self, experts: usize, top_k: usize) -> &mut Self {
        if experts == 0 || top_k == 0 || top_k > experts {
            return self.fail(format!("expert_used_count (num_experts_per_tok) is {top_k} for {experts} experts; it must be between 1 and the experts"));
        }
        self
    }

    /// A per-layer list's length.
    pub fn per_layer(&mut self, field: &str, len: usize, layers: usize) -> &mut Self {
        if len != layers {
            return self.fail(format!("{field} names {len} layers; the model has {layers}"));
        }
        self
    }

    /// RoPE over a head of `head_dim`: an even number of rotated
    /// dimensions, no more than the head, a finite positive base and scale.
    pub fn rope(&mut self, rope: &braid_ops::Rope, head_dim: usize) -> &mut Self {
        if rope.dims == 0 || !rope.dims.is_multiple_of(2) || rope.dims > head_dim {
            self.fail(format!(
                "rope.dimension_count (partial_rotary_factor × head_dim) is {}; it must be even, at least 2 and at most the head dimension {head_dim}",
                rope.dims
            ));
        }
        self.positive("rope.freq_base (rope_theta)", rope.theta);
        self.positive("rope.scaling.factor (rope_scaling.factor)", rope.scale)
    }

    /// The attention shape every attention family shares.
    pub fn attention(&mut self, heads: usize, kv_heads: usize, head_dim: usize) -> &mut Self {
        self.count("attention.head_count (num_attention_heads)", heads);
        self.count("attention.head_count_kv (num_key_value_heads)", kv_heads);
        self.count("attention.key_length (head_dim)", head_dim);
        if kv_heads > 0 && heads > 0 {
            self.divides("attention.head_count_kv (num_key_value_heads)", kv_heads, "attention.head_count (num_attention_heads)", heads);
        }
        if !head_dim.is_multiple_of(2) {
            self.fail(format!("attention.key_length (head_dim) is {head_dim}; it must be even"));
        }
        self
    }

    /// What every family has: widths, depth, vocabulary, norm epsilon, context.
    pub fn common(&mut self, hidden: usize, layers: usize, vocab: usize, eps: f32, context: usize) -> &mut Self {
        self.count("embedding_length (hidden_size)", hidden);
        self.count("block_count (num_hidden_layers)", layers);
        self.count("the vocabulary (token_embd rows, vocab_size)", vocab);
        self.eps("attention.layer_norm_rms_epsilon (rms_norm_eps)", eps);
        self.count("context_length (max_position_embeddings)", context)
    }

    /// The verdict: every failed check, naming the file.
    pub fn done(&mut self) -> Result<()> {
        if self.errors.is_empty() {
            return Ok(());
        }
        bail!("{}: the model's hyperparameters are invalid: {}", self.file.display(), self.errors.join("; "))
    }
}

/// No tensor of the file has a zero dimension (the kernels would divide by it).
pub fn check_tensors(src: &crate::source::Source) -> Result<()> {
    use crate::source::Source;
    let (names, path): (Vec<String>, PathBuf) = match src {
        Source::Gguf(g) => (g.tensor_names().map(str::to_string).collect(), src.path()),
        Source::Hf(h) => (h.tensor_names().map(str::to_string).collect(), src.path()),
    };
    for n in names {
        let shape = match src {
            Source::Gguf(g) => g.tensor(&n)?.shape,
            Source::Hf(h) => h.tensor(&n)?.shape,
        };
        if shape.contains(&0) {
            bail!("{}: tensor `{n}` has shape {shape:?}, with a zero dimension", path.display());
        }
    }
    Ok(())
}

pub fn check_llama(c: &crate::llama::LlamaConfig, src: &crate::source::Source) -> Result<()> {
    Checks::new(src)
        .common(c.hidden, c.layers, c.vocab, c.eps, c.context)
        .attention(c.heads, c.kv_heads, c.head_dim)
        .count("feed_forward_length (intermediate_size)", c.ffn)
        .rope(&c.rope, c.head_dim)
        .done()
}

pub fn check_gemma3(c: &crate::gemma3::Gemma3Config, src: &crate::source::Source) -> Result<()> {
    let mut k = Checks::new(src);
    k.common(c.hidden, c.layers, c.vocab, c.eps, c.context).attention(c.heads, c.kv_heads, c.head_dim);
    k.count("feed_forward_length (intermediate_size)", c.ffn).count("attention.sliding_window (sliding_window)", c.window);
    k.per_layer("the layer types (sliding_window_pattern, layer_types)", c.global.len(), c.layers);
    k.rope(&c.rope_global, c.head_dim).rope(&c.rope_local, c.head_dim).positive("the attention scale (query_pre_attn_scalar)", c.attn_scale);
    for cap in [c.attn_softcap, c.final_softcap].into_iter().flatten() {
        k.positive("a softcap (attn_logit_softcapping, final_logit_softcapping)", cap);
    }
    k.done()
}

pub fn check_gemma4(c: &crate::gemma4::Gemma4Config, src: &crate::source::Source) -> Result<()> {
    let mut k = Checks::new(src);
    k.common(c.hidden, c.layers.len(), c.vocab, c.eps, c.context).count("attention.head_count (num_attention_heads)", c.heads);
    k.count("attention.sliding_window (sliding_window)", c.window);
    for l in &c.layers {
        k.attention(c.heads, l.kv_heads, l.head_dim);
        if l.kv_layer >= c.layers.len() {
            k.fail(format!("a layer shares the KV of layer {}, past the last one", l.kv_layer));
        }
    }
    if let Some((experts, top_k)) = c.moe {
        k.top_k(experts, top_k);
    }
    k.done()
}

pub fn check_lfm2(c: &crate::lfm2::Lfm2Config, src: &crate::source::Source) -> Result<()> {
    let mut k = Checks::new(src);
    k.common(c.hidden, c.layers, c.vocab, c.eps, c.context).attention(c.heads, c.kv_heads, c.head_dim);
    k.per_layer("the layer types (layer_types, full_attn_idxs)", c.attention.len(), c.layers);
    k.count("shortconv.l_cache (conv_L_cache)", c.kernel).rope(&c.rope, c.head_dim);
    if let Some(m) = &c.moe {
        k.top_k(m.experts, m.top_k);
    }
    k.done()
}

pub fn check_minimax(c: &crate::minimax::MiniMaxConfig, src: &crate::source::Source) -> Result<()> {
    let mut k = Checks::new(src);
    k.common(c.hidden, c.layers, c.vocab, c.eps, c.context).attention(c.heads, c.kv_heads, c.head_dim);
    k.per_layer("the layer types (layer_types, attn_type_list)", c.full.len(), c.layers).rope(&c.rope, c.head_dim).top_k(c.experts, c.top_k);
    k.done()
}

pub fn check_minimax_m2(c: &crate::minimax_m2::MiniMaxM2Config, src: &crate::source::Source) -> Result<()> {
    let mut k = Checks::new(src);
    k.common(c.hidden, c.layers, c.vocab, c.eps, c.context).attention(c.heads, c.kv_heads, c.head_dim);
    k.rope(&c.rope, c.head_dim).top_k(c.experts, c.top_k);
    if c.m3 {
        k.per_layer("the sparse-attention layers", c.sparse.len(), c.layers).per_layer("the dense layers", c.dense.len(), c.layers);
    }
    k.done()
}

pub fn check_nemotron_h(c: &crate::nemotron_h::NemotronHConfig, src: &crate::source::Source) -> Result<()> {
    let mut k = Checks::new(src);
    k.common(c.hidden, c.mixers.len(), c.vocab, c.eps, c.context).attention(c.heads, c.kv_heads, c.head_dim);
    k.count("ssm.conv_kernel (conv_kernel)", c.conv_kernel).count("ssm.state_size (ssm_state_size)", c.ssm.state_dim);
    k.count("ssm.head_dim (mamba_head_dim)", c.ssm.head_dim).divides(
        "ssm.group_count (n_groups)",
        c.ssm.groups,
        "ssm.head_count (mamba_num_heads)",
        c.ssm.heads,
    );
    if c.experts > 0 {
        k.top_k(c.experts, c.top_k);
    }
    k.done()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn llama() -> crate::llama::LlamaConfig {
        crate::llama::LlamaConfig {
            hidden: 64,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            ffn: 128,
            vocab: 256,
            eps: 1e-5,
            rope: braid_ops::Rope::new(1e4, 16, true),
            context: 256,
        }
    }

    #[test]
    fn broken_hyperparameters_are_refused_by_name() {
        let src = crate::source::Source::open(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/fixtures/llama")).unwrap();
        check_llama(&llama(), &src).unwrap();
        let bad = |f: fn(&mut crate::llama::LlamaConfig), field: &str| {
            let mut c = llama();
            f(&mut c);
            let e = check_llama(&c, &src).unwrap_err().to_string();
            assert!(e.contains(field), "wanted {field} in: {e}");
        };
        bad(|c| c.heads = 0, "attention.head_count (num_attention_heads) is 0");
        bad(|c| c.kv_heads = 3, "num_key_value_heads) is 3, which does not divide");
        bad(|c| c.hidden = 0, "embedding_length (hidden_size) is 0");
        bad(|c| c.head_dim = 0, "head_dim) is 0");
        bad(|c| c.layers = 0, "block_count (num_hidden_layers) is 0");
        bad(|c| c.eps = f32::NAN, "rms_norm_eps) is NaN");
        bad(|c| c.rope.dims = 0, "rope.dimension_count");
        bad(|c| c.rope.dims = 32, "at most the head dimension 16");
        bad(|c| c.context = 0, "context_length (max_position_embeddings) is 0");
        bad(|c| c.rope.theta = f32::INFINITY, "rope_theta) is inf");
    }

    #[test]
    fn both_forms_of_rope_and_floats() {
        let dir = Path::new("/m");
        let v5 = json!({
            "rope_parameters": {"full_attention": {"rope_theta": 1e6, "rope_type": "proportional", "partial_rotary_factor": 0.25},
                                "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}},
            "final_logit_softcapping": {"__float__": "Infinity"}, "sliding_window": null
        });
        let c = HfConfig::new(&v5, dir);
        let g = c.rope(Some("full_attention"), 1.0).unwrap();
        assert_eq!((g.theta, g.rope_type.as_str(), g.partial_rotary_factor), (1e6, "proportional", 0.25));
        assert_eq!(c.rope(Some("sliding_attention"), 1.0).unwrap().theta, 1e4);
        assert_eq!(c.opt_f32("final_logit_softcapping").unwrap(), Some(f32::INFINITY));
        assert_eq!(c.opt_usize("sliding_window").unwrap(), None);

        let hub = json!({"rope_theta": 1e6, "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "head_dim": "x"});
        let c = HfConfig::new(&hub, dir);
        let g = c.rope(Some("full_attention"), 1.0).unwrap();
        assert_eq!((g.theta, g.rope_type.as_str(), g.factor), (1e6, "linear", 8.0));
        let l = c.rope(Some("sliding_attention"), 1.0).unwrap();
        assert_eq!((l.theta, l.rope_type.as_str(), l.factor), (1e4, "default", 1.0));
        assert!(c.usize("head_dim").unwrap_err().to_string().contains("head_dim"));

        let flat = json!({"rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}});
        assert_eq!(HfConfig::new(&flat, dir).rope(None, 1.0).unwrap().theta, 5e5);
        assert_eq!(HfConfig::new(&json!({}), dir).rope(None, 1e4).unwrap().theta, 1e4);
    }
}
