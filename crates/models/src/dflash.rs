//! DFlash: a block drafter that reads the target's features (arXiv
//! 2602.06036). A few Qwen3-style layers predict a whole block of tokens in
//! one forward, from the newest token followed by mask tokens, while they
//! attend to the target's hidden rows as injected context:
//!
//! * context: the rows tapped after the target layers the config names,
//!   side by side, projected by `fc` and RMS-normed (`hidden_norm`). Every
//!   layer projects the same context rows to its own keys and values, which
//!   are kept per stream like a KV cache (they never change once written).
//! * block: `[last, mask, mask, ...]` embedded with the target's embedding
//!   table, at the positions after the context.
//! * each layer: `x += o(attn(norm(x)))`, `x += mlp(norm(x))`; queries come
//!   from the block, keys and values from context and block; q and k are
//!   RMS-normed per head, then rotated at their own positions; attention is
//!   not causal (every block row sees the whole context and the whole block).
//! * head: the drafter's final norm, then the target's output head (or the
//!   drafter's own over a reduced draft vocabulary mapped back by `d2t`), on
//!   block rows 1.. (row 0 holds the known token).
//!
//! Two checkpoint layouts load: the authors' (`architectures:
//! ["DFlashDraftModel"]`, `dflash_config: {target_layer_ids,
//! mask_token_id}`, `block_size`) and vLLM speculators' (`speculators_model_type:
//! "dflash"`, `transformer_layer_config`, `aux_hidden_state_layer_ids`,
//! `draft_vocab_size` with `d2t` / `t2d`).
//!
//! DSpark is DFlash with a low-rank sequential ("Markov") head over the
//! block: proposal row k's logits gain `W2 · W1[prev_k]`, where `prev_1` is
//! the known token and `prev_{k+1}` the token row k picked, so each
//! proposal hears the one before it for two thin products. A confidence
//! head scores each row, `sigmoid(w · [h_k; W1[prev_k]] + b)`. Its layouts:
//! DeepSeek's (`architectures: ["DSparkDraftModel"]`, `dspark_config:
//! {target_layer_ids, mask_token_id, markov_rank, markov_head_type}`,
//! `markov_head.*`, `confidence_head.*`, and its own `embed_tokens` and
//! `lm_head`) and speculators' (`speculators_model_type: "dspark"`).

use std::collections::HashMap;
use std::path::Path;

use anyhow::{bail, ensure, Context, Result};
use braid_engine::{Drafter, Gate, StreamId};
use braid_formats::safetensors::HfFolder;
use braid_formats::{Bytes, TensorView};
use braid_ops::{Act, AttnSeq, Device, KvDtype, KvPoolSpec, KvShape, Map, Rope};
use serde_json::Value;

use crate::backend::SharedTaps;
use crate::blocks::{gated_mlp, Attention};
use crate::config::HfConfig;
use crate::llama::hf_rope;
use crate::source::Source;
use crate::{ModelBackend, Scratch};

#[derive(Clone, Debug)]
pub struct DFlashConfig {
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub ffn: usize,
    pub eps: f32,
    pub rope: Rope,
    /// Rows of one block: the known token and `block_size - 1` proposals.
    pub block_size: usize,
    /// Target layers whose output rows make the context, in `fc`'s order.
    pub target_layers: Vec<usize>,
    pub mask_token: u32,
    /// The target's vocabulary (the embedding table's rows).
    pub vocab: usize,
    /// Rows of the drafter's own head over a reduced vocabulary (speculators'
    /// `draft_vocab_size`), when it has one.
    pub draft_vocab: Option<usize>,
    /// The noise embedding's scale (`input_embedding_scale`, 1 when absent).
    pub embed_scale: f32,
    /// Logits are multiplied by this, then softcapped (`output_multiplier`,
    /// `final_logit_softcapping`).
    pub output_multiplier: f32,
    pub softcap: Option<f32>,
    /// DSpark: the rank of the Markov head (`markov_rank`).
    pub markov_rank: Option<usize>,
}

/// A value the authors' layouts keep in `dflash_config` (`dspark_config`)
/// or at the top.
fn draft_value<'a>(cfg: &'a Value, key: &str) -> Option<&'a Value> {
    ["dflash_config", "dspark_config"].iter().find_map(|section| cfg.get(*section).and_then(|d| d.get(key))).or_else(|| cfg.get(key)).filter(|v| !v.is_null())
}

/// DSpark's Markov head: its rank, and a clear refusal of the head types
/// braid does not run.
fn markov_rank(raw: &Value, path: &Path) -> Result<usize> {
    let rank =
        number(draft_value(raw, "markov_rank"), "markov_rank", path)?.with_context(|| format!("{}: a DSpark drafter with no markov_rank", path.display()))?;
    ensure!(rank >= 1.0 && rank.fract() == 0.0, "{}: markov_rank {rank} is not a positive whole number", path.display());
    match draft_value(raw, "markov_head_type").map(|v| v.as_str().unwrap_or("")) {
        None | Some("vanilla") => Ok(rank as usize),
        Some(other) => bail!("{}: markov_head_type '{other}' is not supported (only vanilla)", path.display()),
    }
}

fn usize_list(v: Option<&Value>, what: &str, path: &Path) -> Result<Vec<usize>> {
    let list = v.and_then(Value::as_array).with_context(|| format!("{}: no {what} list", path.display()))?;
    list.iter().map(|x| x.as_u64().map(|n| n as usize).with_context(|| format!("{}: {what} holds {x}, not a layer number", path.display()))).collect()
}

fn number(v: Option<&Value>, key: &str, path: &Path) -> Result<Option<f64>> {
    match v {
        None => Ok(None),
        Some(x) => x.as_f64().map(Some).with_context(|| format!("{}: {key} is {x}, not a number", path.display())),
    }
}

impl DFlashConfig {
    /// Read `dir/config.json` in either layout.
    pub fn from_folder(dir: &Path, raw: &Value) -> Result<DFlashConfig> {
        let path = dir.join("config.json");
        let archs: Vec<&str> = raw.get("architectures").and_then(Value::as_array).map(|a| a.iter().filter_map(Value::as_str).collect()).unwrap_or_default();
        let spec_type = raw.get("speculators_model_type").and_then(Value::as_str);
        let dspark = spec_type == Some("dspark") || (spec_type.is_none() && archs.iter().any(|a| a.starts_with("DSpark")));
        let (layer_cfg, target_layers, mask, block, draft_vocab) = match spec_type {
            Some("dflash" | "dspark") => {
                let layer = raw
                    .get("transformer_layer_config")
                    .filter(|v| v.is_object())
                    .with_context(|| format!("{}: no transformer_layer_config object", path.display()))?;
                let taps = usize_list(raw.get("aux_hidden_state_layer_ids"), "aux_hidden_state_layer_ids", &path)?;
                let draft_vocab = number(raw.get("draft_vocab_size"), "draft_vocab_size", &path)?.map(|n| n as usize);
                (layer, taps, raw.get("mask_token_id"), raw.get("block_size"), draft_vocab)
            }
            Some(other) => bail!("{}: speculators_model_type '{other}' is not a drafter braid loads (supported: dflash, dspark)", path.display()),
            None if archs.contains(&"DFlashDraftModel") || dspark => {
                let section = if dspark { "dspark_config" } else { "dflash_config" };
                let taps = usize_list(draft_value(raw, "target_layer_ids"), &format!("{section}.target_layer_ids"), &path)?;
                (raw, taps, draft_value(raw, "mask_token_id"), draft_value(raw, "block_size"), None)
            }
            None => bail!(
                "{}: not a DFlash or DSpark drafter (architectures {archs:?}; expected [\"DFlashDraftModel\"], [\"DSparkDraftModel\"] or speculators_model_type \"dflash\" or \"dspark\")",
                path.display()
            ),
        };
        let markov_rank = if dspark { Some(markov_rank(raw, &path)?) } else { None };
        let c = HfConfig::new(layer_cfg, dir);
        let hidden = c.usize("hidden_size")?;
        let heads = c.usize("num_attention_heads")?;
        let head_dim = c.opt_usize("head_dim")?.unwrap_or(hidden / heads);
        let layers = c.usize("num_hidden_layers")?;
        // Sliding or causal drafter layers (DFlash2) attend differently.
        if let Some(types) = c.layer_types(layers)? {
            if let Some(t) = types.iter().find(|t| t.as_str() != "full_attention") {
                bail!("{}: drafter layers of type '{t}' are not supported (only full_attention)", path.display());
            }
        }
        if c.opt_bool("is_causal")? == Some(true) {
            bail!("{}: a causal DFlash drafter is not supported (its block attention is bidirectional)", path.display());
        }
        ensure!(!target_layers.is_empty(), "{}: the drafter names no target layers", path.display());
        let mask = number(mask, "mask_token_id", &path)?.with_context(|| format!("{}: no mask_token_id", path.display()))? as u32;
        let block_size = number(block, "block_size", &path)?.map_or(16, |b| b as usize);
        ensure!(block_size >= 2, "{}: block_size {block_size} proposes nothing (it must be at least 2)", path.display());
        let vocab = c.usize("vocab_size")?;
        let f = |k: &str| number(draft_value(raw, k).or_else(|| c.get(k)), k, &path);
        Ok(DFlashConfig {
            hidden,
            layers,
            heads,
            kv_heads: c.opt_usize("num_key_value_heads")?.unwrap_or(heads),
            head_dim,
            ffn: c.usize("intermediate_size")?,
            eps: c.opt_f32("rms_norm_eps")?.unwrap_or(1e-6),
            rope: hf_rope(&c, None, head_dim, dir)?,
            block_size,
            target_layers,
            mask_token: mask,
            vocab,
            draft_vocab: draft_vocab.filter(|&d| d != vocab),
            embed_scale: f("input_embedding_scale")?.unwrap_or(1.0) as f32,
            output_multiplier: f("output_multiplier")?.unwrap_or(1.0) as f32,
            softcap: f("final_logit_softcapping")?.filter(|&s| s > 0.0).map(|s| s as f32),
            markov_rank,
        })
    }
}

struct Layer<D: Device> {
    attn_norm: D::Tensor,
    attn: Attention<D>,
    ffn_norm: D::Tensor,
    w_gate: D::Weight,
    w_up: D::Weight,
    w_down: D::Weight,
}

/// DSpark's sequential head: `W1` (an embedding of the previous token,
/// `vocab x rank`), `W2` (`vocab x rank`, the bias it adds), and the
/// confidence head's weights on the host (`hidden + rank` and a bias).
struct Markov<D: Device> {
    w1: D::Weight,
    w2: D::Weight,
    confidence: Option<(Vec<f32>, f32)>,
}

/// The drafter's weights (and the target's embedding and head it borrows).
pub struct DFlash<D: Device> {
    pub cfg: DFlashConfig,
    layers: Vec<Layer<D>>,
    /// `fc` split by its input columns, one part per tap: the context
    /// projection is the sum of each tap's rows through its part, so the
    /// taps need not sit side by side (on a device they stay apart).
    fc: Vec<D::Weight>,
    hidden_norm: D::Tensor,
    norm: D::Tensor,
    embed: D::Weight,
    head: D::Weight,
    /// Target id of each row of a reduced draft head (speculators' d2t).
    draft_ids: Option<Vec<u32>>,
    /// Width of one tapped target row (`fc`'s input over the taps).
    target_hidden: usize,
    markov: Option<Markov<D>>,
}

impl<D: Device> DFlash<D> {
    /// Load the drafter in `dir` for the target whose weights are `target`
    /// (its embedding table, and its output head unless the drafter brings
    /// its own).
    pub fn load(dev: &D, dir: &Path, target: &Source) -> Result<DFlash<D>> {
        let folder = HfFolder::open(dir)?;
        let cfg = DFlashConfig::from_folder(dir, folder.config())?;
        let w = |n: &str| dev.weight(&folder.tensor(n)?);
        let v = |n: &str| dev.vector(&folder.tensor(n)?, 0.0);
        let mut layers = Vec::with_capacity(cfg.layers);
        for i in 0..cfg.layers {
            let p = |n: &str| format!("layers.{i}.{n}.weight");
            layers.push(Layer {
                attn_norm: v(&p("input_layernorm"))?,
                attn: Attention::load_hf(&w, &v, &format!("layers.{i}.self_attn."), "o_proj", Some(("q_norm", "k_norm")))?.checked(
                    dev,
                    i,
                    cfg.heads,
                    cfg.kv_heads,
                    cfg.head_dim,
                    cfg.hidden,
                )?,
                ffn_norm: v(&p("post_attention_layernorm"))?,
                w_gate: w(&p("mlp.gate_proj"))?,
                w_up: w(&p("mlp.up_proj"))?,
                w_down: w(&p("mlp.down_proj"))?,
            });
        }
        let fc_view = folder.tensor("fc.weight")?;
        let (fc_out, fc_in) = (fc_view.rows(), fc_view.cols());
        let taps = cfg.target_layers.len();
        ensure!(fc_out == cfg.hidden, "{}: fc maps to {fc_out} columns, the drafter is {} wide", dir.display(), cfg.hidden);
        ensure!(taps > 0 && fc_in % taps == 0, "{}: fc reads {fc_in} columns, not a multiple of its {taps} target layers", dir.display());
        let fc = split_cols(&fc_view, taps)?.iter().map(|v| dev.weight(v)).collect::<Result<Vec<_>>>()?;
        // DeepSeek's DSpark ships its own embedding and head; others borrow the target's.
        let embed = if folder.has_tensor("embed_tokens.weight") { w("embed_tokens.weight")? } else { dev.weight(&target.tensor("token_embd.weight")?)? };
        let (rows, width) = dev.weight_shape(&embed);
        ensure!(width == cfg.hidden, "the target's embeddings are {width} wide, the drafter in {} is {}", dir.display(), cfg.hidden);
        ensure!((cfg.mask_token as usize) < rows, "{}: mask token {} is past the target's {rows} embeddings", dir.display(), cfg.mask_token);
        let (head, draft_ids) = match cfg.draft_vocab {
            Some(n) => {
                let head = w("lm_head.weight")?;
                ensure!(dev.weight_shape(&head) == (n, cfg.hidden), "{}: lm_head.weight is not {n}x{}", dir.display(), cfg.hidden);
                let d2t = read_i64(&folder, "d2t")?;
                ensure!(d2t.len() == n, "{}: d2t holds {} entries for a draft vocabulary of {n}", dir.display(), d2t.len());
                let ids = d2t.iter().enumerate().map(|(i, &off)| i as i64 + off).collect::<Vec<i64>>();
                if let Some(bad) = ids.iter().find(|&&t| t < 0 || t as usize >= rows) {
                    bail!("{}: d2t maps a draft token to {bad}, outside the target's {rows} tokens", dir.display());
                }
                (head, Some(ids.into_iter().map(|t| t as u32).collect()))
            }
            None if folder.has_tensor("lm_head.weight") => {
                let head = w("lm_head.weight")?;
                ensure!(dev.weight_shape(&head) == (rows, cfg.hidden), "{}: lm_head.weight is not {rows}x{}", dir.display(), cfg.hidden);
                (head, None)
            }
            None => {
                let name = if target.has_tensor("output.weight") { "output.weight" } else { "token_embd.weight" };
                (dev.weight(&target.tensor(name)?)?, None)
            }
        };
        let markov = match cfg.markov_rank {
            None => None,
            Some(rank) => {
                ensure!(cfg.draft_vocab.is_none(), "{}: a DSpark drafter over a reduced draft vocabulary is not supported", dir.display());
                let (w1, w2) = (w("markov_head.markov_w1.weight")?, w("markov_head.markov_w2.weight")?);
                for (name, m) in [("markov_w1", &w1), ("markov_w2", &w2)] {
                    ensure!(dev.weight_shape(m) == (rows, rank), "{}: markov_head.{name}.weight is not {rows}x{rank}", dir.display());
                }
                let confidence = if folder.has_tensor("confidence_head.proj.weight") {
                    let weight = folder.tensor("confidence_head.proj.weight")?.to_f32()?;
                    ensure!(
                        weight.len() == cfg.hidden + rank,
                        "{}: confidence_head.proj.weight holds {} values, not {}",
                        dir.display(),
                        weight.len(),
                        cfg.hidden + rank
                    );
                    let bias = if folder.has_tensor("confidence_head.proj.bias") { folder.tensor("confidence_head.proj.bias")?.to_f32()? } else { vec![0.0] };
                    ensure!(bias.len() == 1, "{}: confidence_head.proj.bias holds {} values, not 1", dir.display(), bias.len());
                    Some((weight, bias[0]))
                } else {
                    None
                };
                Some(Markov { w1, w2, confidence })
            }
        };
        Ok(DFlash {
            layers,
            fc,
            hidden_norm: v("hidden_norm.weight")?,
            norm: v("norm.weight")?,
            embed,
            head,
            draft_ids,
            target_hidden: fc_in / taps,
            cfg,
            markov,
        })
    }

    /// Width of one tapped target row.
    pub fn target_hidden(&self) -> usize {
        self.target_hidden
    }

    /// Width of one feature row (every tap side by side).
    pub fn feature_dim(&self) -> usize {
        self.target_hidden * self.cfg.target_layers.len()
    }

    /// Tap the target layers this drafter reads on `backend`.
    pub fn attach(&self, backend: &mut ModelBackend<D>) -> Result<()> {
        backend.set_feature_layers(&self.cfg.target_layers, self.target_hidden)
    }

    /// The width of one logits row (the draft vocabulary).
    pub fn logits_width(&self) -> usize {
        self.cfg.draft_vocab.unwrap_or(self.cfg.vocab)
    }

    /// The target token of draft-head column `i`.
    pub fn target_token(&self, i: usize) -> u32 {
        self.draft_ids.as_ref().map_or(i as u32, |ids| ids[i])
    }
}

/// An int64 tensor of a safetensors folder (the viewer reads floats only).
fn read_i64(folder: &HfFolder, name: &str) -> Result<Vec<i64>> {
    ensure!(folder.tensor_dtype(name) == Some("I64"), "{}: tensor `{name}` is missing or not I64", folder.dir().display());
    for path in folder.weight_files() {
        let bytes = std::fs::read(path).with_context(|| format!("{}: cannot read", path.display()))?;
        let len = bytes.get(..8).map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")) as usize).unwrap_or(usize::MAX);
        let header = bytes.get(8..8usize.saturating_add(len)).with_context(|| format!("{}: truncated header", path.display()))?;
        let header: Value = serde_json::from_slice(header).with_context(|| format!("{}: bad header", path.display()))?;
        let Some(e) = header.get(name) else { continue };
        let off: Vec<usize> = e["data_offsets"].as_array().map(|a| a.iter().filter_map(|x| x.as_u64()).map(|x| x as usize).collect()).unwrap_or_default();
        let data = (off.len() == 2).then(|| bytes.get(8 + len + off[0]..8 + len + off[1])).flatten();
        let data = data.with_context(|| format!("{}: tensor `{name}` lies outside the file", path.display()))?;
        return Ok(data.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes"))).collect());
    }
    bail!("{}: no tensor named `{name}`", folder.dir().display())
}

/// `view`'s columns in `parts` equal parts, each a weight of its own (a
/// dense type's bytes, sliced row by row).
fn split_cols(view: &TensorView, parts: usize) -> Result<Vec<TensorView>> {
    let (rows, cols) = (view.rows(), view.cols());
    let bytes = view.dtype.bytes_for(rows * cols).filter(|_| !view.dtype.is_quantized());
    ensure!(bytes == Some(view.data.len()), "{}: a {} tensor cannot be split by columns", view.name, view.dtype.name());
    let (es, w) = (view.data.len() / (rows * cols).max(1), cols / parts);
    Ok((0..parts)
        .map(|i| {
            let mut data = Vec::with_capacity(rows * w * es);
            for r in 0..rows {
                let at = (r * cols + i * w) * es;
                data.extend_from_slice(&view.data[at..at + w * es]);
            }
            TensorView { name: format!("{}[{i}]", view.name), dtype: view.dtype, shape: vec![rows, w], data: Bytes::from_vec(data) }
        })
        .collect())
}

/// One stream's drafter state: the context rows' keys and values (in
/// `blocks`, KV rows `0..ctx` at positions `base..base + ctx`), and how
/// long its proposals should be.
struct DraftStream {
    base: usize,
    ctx: usize,
    blocks: Vec<u32>,
    gate: Gate,
    /// Absorbing failed (its pool full): the context has a hole, so the
    /// stream gets no more proposals.
    failed: bool,
}

/// [`DFlash`] as the engine's [`Drafter`]: it keeps each stream's context
/// keys and values in a paged pool of its own, made as each stream's rows
/// are absorbed, and proposes greedily, as many tokens as the stream's
/// [`Gate`] allows (the head runs on those rows only; the whole block runs
/// through the layers, as trained).
pub struct DFlashDrafter<D: Device> {
    dev: D,
    model: DFlash<D>,
    kv: D::Kv,
    block_tokens: usize,
    free: Vec<u32>,
    streams: HashMap<StreamId, DraftStream>,
    s: Scratch<D>,
    /// The target's rows where its backend keeps them ([`DFlashDrafter::share_taps`]).
    taps: Option<SharedTaps<D>>,
    /// Absorbs whose rows are taken there and not yet made context:
    /// stream, forward, first row, rows. They are made a forward at a time
    /// ([`DFlashDrafter::flush`]), so a round's streams cost one pass.
    pending: Vec<(StreamId, u64, usize, usize)>,
    /// The last proposal's block logits (`block_size - 1` rows of
    /// `logits_width`; DSpark's with the Markov bias), for tests and tools.
    pub last_logits: Vec<f32>,
    /// DSpark's confidence in each row of the last proposal (empty without
    /// a confidence head).
    pub last_confidence: Vec<f32>,
    /// Why the last proposal or absorb failed, if it did.
    pub last_error: Option<String>,
    /// Proposals in a row with nothing accepted before a stream skips as
    /// many rounds (0: never).
    pub patience: usize,
}

/// Scratch slots of the drafter's own: the context rows, the Markov head's
/// embedding and bias, then one a tap for the tapped rows.
const CTX: usize = 0;
const MARKOV_E: usize = 1;
const MARKOV_BIAS: usize = 2;
const TAP: usize = 3;

impl<D: Device> DFlashDrafter<D> {
    /// A drafter over `model` whose pool holds `kv_tokens` context rows
    /// over all streams (in blocks of `block_tokens`).
    pub fn new(dev: D, model: DFlash<D>, kv_tokens: usize, block_tokens: usize, kv_dtype: KvDtype) -> Result<DFlashDrafter<D>> {
        ensure!(block_tokens > 0, "block_tokens must be positive");
        let blocks = kv_tokens.div_ceil(block_tokens).max(1);
        let c = &model.cfg;
        let spec = KvPoolSpec::new(blocks, block_tokens, vec![KvShape { kv_heads: c.kv_heads, head_dim: c.head_dim }; c.layers]);
        let kv = dev.kv_pool(&spec, kv_dtype)?;
        let s = Scratch::new(&dev);
        Ok(DFlashDrafter {
            dev,
            model,
            kv,
            block_tokens,
            free: (0..blocks as u32).rev().collect(),
            streams: HashMap::new(),
            s,
            taps: None,
            pending: Vec::new(),
            last_logits: Vec::new(),
            last_confidence: Vec::new(),
            last_error: None,
            patience: 4,
        })
    }

    /// Tap `backend` (the target, on this drafter's device) for the layers
    /// this drafter reads, and read its rows where it keeps them: no
    /// feature row goes through the host.
    pub fn share_taps(&mut self, backend: &mut ModelBackend<D>) -> Result<()> {
        self.model.attach(backend)?;
        self.taps = Some(backend.share_taps());
        Ok(())
    }

    pub fn model(&self) -> &DFlash<D> {
        &self.model
    }

    fn stream(&mut self, id: StreamId) -> &mut DraftStream {
        let gate = Gate::new(self.model.cfg.block_size - 1, self.patience);
        self.streams.entry(id).or_insert_with(|| DraftStream { base: 0, ctx: 0, blocks: Vec::new(), gate, failed: false })
    }

    /// Give `stream` pool blocks for `rows` KV rows.
    fn reserve(&mut self, stream: StreamId, rows: usize) -> Result<()> {
        let need = rows.div_ceil(self.block_tokens);
        let have = self.stream(stream).blocks.len();
        if need > have {
            ensure!(self.free.len() >= need - have, "the drafter's KV pool is full");
            let got: Vec<u32> = (0..need - have).filter_map(|_| self.free.pop()).collect();
            self.stream(stream).blocks.extend(got);
        }
        Ok(())
    }

    /// The pool slots of `stream`'s KV rows `rows`.
    fn slots(&self, stream: StreamId, rows: std::ops::Range<usize>) -> Vec<u32> {
        let (bt, blocks) = (self.block_tokens, &self.streams[&stream].blocks);
        rows.map(|j| blocks[j / bt] * bt as u32 + (j % bt) as u32).collect()
    }

    /// The positions and pool slots of `stream`'s next `rows` context
    /// rows, their blocks reserved.
    fn place(&mut self, stream: StreamId, rows: usize) -> Result<(Vec<u32>, Vec<u32>)> {
        let (base, ctx) = {
            let st = self.stream(stream);
            (st.base, st.ctx)
        };
        self.reserve(stream, ctx + rows)?;
        Ok(((base + ctx..base + ctx + rows).map(|p| p as u32).collect(), self.slots(stream, ctx..ctx + rows)))
    }

    /// Make `stream`'s context keys and values for its next `rows` rows,
    /// whose feature rows are in the tap slots (one tensor a tap).
    fn absorb_rows(&mut self, stream: StreamId, rows: usize) -> Result<()> {
        let (pos, slots) = self.place(stream, rows)?;
        self.context(&pos, &slots);
        self.stream(stream).ctx += rows;
        Ok(())
    }

    /// Put `rows` feature rows of `features` (every tap side by side, as a
    /// backend hands them to the host) into the tap slots.
    fn upload_taps(&mut self, features: &[f32], rows: usize) -> Result<()> {
        let w = self.model.target_hidden;
        let taps = self.model.fc.len();
        for i in 0..taps {
            let part: Vec<f32> = features.chunks_exact(taps * w).flat_map(|r| &r[i * w..(i + 1) * w]).copied().collect();
            *self.s.extra(&self.dev, TAP + i) = self.dev.upload(&part, rows, w)?;
        }
        Ok(())
    }

    /// Take the first `rows` rows `stream` fed the target in its last
    /// forward, where its backend keeps them, to be made context at the
    /// next [`DFlashDrafter::flush`]. False if it keeps none.
    fn take_taps(&mut self, stream: StreamId, rows: usize) -> bool {
        let Some(shared) = &self.taps else { return false };
        let Some((seq, first)) = shared.lock().unwrap_or_else(|e| e.into_inner()).take(stream, rows) else { return false };
        self.pending.push((stream, seq, first, rows));
        true
    }

    /// Make the context rows of the absorbs taken and not yet made: all
    /// the streams' rows of one forward in one pass (one gather a tap, one
    /// projection), not a pass a stream. Before a proposal reads them, and
    /// at the lane's every turn.
    fn flush(&mut self) {
        let pending = std::mem::take(&mut self.pending);
        let mut seqs: Vec<u64> = Vec::new();
        for p in &pending {
            if !seqs.contains(&p.1) {
                seqs.push(p.1);
            }
        }
        for seq in seqs {
            // In the forward's row order: where every row was taken, the
            // kept rows are read where they are, with no gather.
            let mut items: Vec<(StreamId, usize, usize)> = pending.iter().filter(|p| p.1 == seq).map(|p| (p.0, p.2, p.3)).collect();
            items.sort_by_key(|i| i.1);
            let (mut at, mut pos, mut slots, mut made) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            for &(stream, first, n) in &items {
                if self.stream(stream).failed {
                    continue;
                }
                match self.place(stream, n) {
                    Ok((p, s)) => {
                        at.extend(first..first + n);
                        pos.extend(p);
                        slots.extend(s);
                        made.push((stream, n));
                    }
                    Err(e) => {
                        self.last_error = Some(format!("{e:#}"));
                        self.stream(stream).failed = true;
                    }
                }
            }
            let shared = self.taps.clone().expect("rows are taken only where they are shared");
            let mut store = shared.lock().unwrap_or_else(|e| e.into_inner());
            let Some(taps) = store.read(seq, items.len()) else {
                // Not kept (cannot happen while pinned): the streams' contexts have a hole.
                for &(stream, _) in &made {
                    self.stream(stream).failed = true;
                }
                continue;
            };
            if made.is_empty() {
                continue;
            }
            let whole = taps.first().is_some_and(|t| self.dev.shape(t).0 == at.len()) && at.iter().enumerate().all(|(i, &r)| i == r);
            if whole {
                let taps: Vec<&D::Tensor> = taps.iter().collect();
                make_context(&self.dev, &self.model, &mut self.s, &mut self.kv, &taps, &pos, &slots);
            } else {
                for (i, t) in taps.iter().enumerate() {
                    self.dev.gather_rows(t, &at, self.s.extra(&self.dev, TAP + i));
                }
                drop(store);
                self.context(&pos, &slots);
            }
            for (stream, n) in made {
                self.stream(stream).ctx += n;
            }
        }
    }

    /// The block after `last` for `stream`: the logits of its first `rows`
    /// proposals (`rows` rows of `logits_width`, at most `block_size - 1`)
    /// into `last_logits`, and the greedy tokens.
    pub fn propose_block(&mut self, stream: StreamId, last: u32, rows: usize) -> Result<Vec<u32>> {
        self.flush();
        let bs = self.model.cfg.block_size;
        let rows = rows.clamp(1, bs - 1);
        let st = self.streams.get(&stream).with_context(|| format!("stream {stream} is not open in the drafter"))?;
        ensure!(!st.failed, "stream {stream}'s context is incomplete");
        let (base, ctx) = (st.base, st.ctx);
        // The block's rows are written past the context, and overwritten by
        // later context.
        self.reserve(stream, ctx + bs)?;
        let blocks = self.streams[&stream].blocks.clone();
        let block_pos: Vec<u32> = (base + ctx..base + ctx + bs).map(|p| p as u32).collect();
        let block_slots = self.slots(stream, ctx..ctx + bs);
        let mut tokens = vec![self.model.cfg.mask_token; bs];
        tokens[0] = last;
        let kv_len = ctx + bs;
        // Every block row is its own one-row sequence over all the keys:
        // attention over the pool is causal, and one row at the end of its
        // sequence sees every key, so the block attends both ways.
        let seqs: Vec<AttnSeq<'_>> = (0..bs).map(|i| AttnSeq { q_start: i, q_len: 1, kv_len, blocks: &blocks, window: None }).collect();
        self.block(&tokens, &block_pos, &block_slots, &seqs, rows);
        let mut logits = self.dev.download(&self.s.logits)?;
        let width = self.model.logits_width();
        ensure!(logits.len() == rows * width, "the drafter returned {} logits, expected {}", logits.len(), rows * width);
        let picks = if self.model.markov.is_some() {
            self.markov_picks(last, &mut logits)?
        } else {
            logits.chunks_exact(width).map(|row| self.model.target_token(braid_ops::argmax_host(row) as usize)).collect()
        };
        self.last_logits = logits;
        Ok(picks)
    }

    /// DSpark's sequential pass over the block's base logits (in place):
    /// each row gains the Markov bias of the token before it (`last`, then
    /// each row's pick), and is picked greedily; the rows' confidences go
    /// to `last_confidence`.
    fn markov_picks(&mut self, last: u32, logits: &mut [f32]) -> Result<Vec<u32>> {
        let (dev, s) = (&self.dev, &mut self.s);
        let m = self.model.markov.as_ref().expect("checked by the caller");
        let width = self.model.logits_width();
        // `s.h` holds the proposal rows' final-normed hidden rows.
        let hidden = if m.confidence.is_some() { dev.download(&s.h)? } else { Vec::new() };
        let h = self.model.cfg.hidden;
        self.last_confidence.clear();
        let mut prev = last;
        let mut picks = Vec::with_capacity(logits.len() / width);
        for (k, row) in logits.chunks_exact_mut(width).enumerate() {
            let mut e = std::mem::replace(s.extra(dev, MARKOV_E), dev.tensor(0, 0));
            let mut bias = std::mem::replace(s.extra(dev, MARKOV_BIAS), dev.tensor(0, 0));
            dev.embed(&m.w1, &[prev], 1.0, &mut e);
            dev.matmul(&e, &[&m.w2], &mut [&mut bias]);
            let (e_host, b) = (dev.download(&e)?, dev.download(&bias)?);
            *s.extra(dev, MARKOV_E) = e;
            *s.extra(dev, MARKOV_BIAS) = bias;
            ensure!(b.len() == width, "the Markov head gave {} biases for {width} logits", b.len());
            row.iter_mut().zip(&b).for_each(|(l, b)| *l += b);
            if let Some((w, bias)) = &m.confidence {
                let x = hidden.get(k * h..(k + 1) * h).context("fewer hidden rows than logits rows")?;
                let z = bias + x.iter().chain(&e_host).zip(w).map(|(a, b)| a * b).sum::<f32>();
                self.last_confidence.push(1.0 / (1.0 + (-z).exp()));
            }
            prev = braid_ops::argmax_host(row);
            picks.push(prev);
        }
        Ok(picks)
    }

    /// Context rows into the pool: the tapped rows in the tap slots
    /// projected by `fc` and normed, then every layer's keys and values
    /// from them (not normed by the layer's input norm), at `pos`, into
    /// `slots`.
    fn context(&mut self, pos: &[u32], slots: &[u32]) {
        let taps: Vec<D::Tensor> = (0..self.model.fc.len()).map(|i| std::mem::replace(self.s.extra(&self.dev, TAP + i), self.dev.tensor(0, 0))).collect();
        make_context(&self.dev, &self.model, &mut self.s, &mut self.kv, &taps.iter().collect::<Vec<_>>(), pos, slots);
        for (i, t) in taps.into_iter().enumerate() {
            *self.s.extra(&self.dev, TAP + i) = t;
        }
    }

    /// The block through every layer, over the context already in the
    /// pool; the logits of block rows `1..=rows` end in `s.logits`.
    fn block(&mut self, tokens: &[u32], block_pos: &[u32], block_slots: &[u32], seqs: &[AttnSeq<'_>], rows: usize) {
        let (dev, m, s, kv) = (&self.dev, &self.model, &mut self.s, &mut self.kv);
        let c = &m.cfg;
        let hd = c.head_dim;
        let scale = 1.0 / (hd as f32).sqrt();
        dev.embed(&m.embed, tokens, c.embed_scale, &mut s.x);
        for (l, b) in m.layers.iter().enumerate() {
            let Some((q_norm, k_norm)) = &b.attn.qk_norm else { unreachable!("DFlash layers load with q/k norms") };
            dev.rms_norm(&s.x, &b.attn_norm, c.eps, &mut s.h);
            dev.matmul(&s.h, &[&b.attn.wq, &b.attn.wk, &b.attn.wv], &mut [&mut s.q_raw, &mut s.k_raw, &mut s.v]);
            dev.rms_norm(&s.q_raw, q_norm, c.eps, &mut s.q);
            dev.rms_norm(&s.k_raw, k_norm, c.eps, &mut s.k);
            dev.rope(&mut s.q, block_pos, hd, &c.rope);
            dev.rope(&mut s.k, block_pos, hd, &c.rope);
            dev.kv_write(kv, l, &s.k, &s.v, block_slots);
            dev.attention(&s.q, kv, l, seqs, scale, None, &mut s.att);
            dev.matmul(&s.att, &[&b.attn.wo], &mut [&mut s.out]);
            dev.add(&mut s.x, &s.out);
            // SwiGLU MLP.
            dev.rms_norm(&s.x, &b.ffn_norm, c.eps, &mut s.h);
            gated_mlp(dev, s, Act::Silu, &b.w_gate, &b.w_up, &b.w_down);
            dev.add(&mut s.x, &s.out);
        }
        let rows: Vec<usize> = (1..=rows).collect();
        dev.gather_rows(&s.x, &rows, &mut s.last);
        dev.rms_norm(&s.last, &m.norm, c.eps, &mut s.h);
        dev.matmul(&s.h, &[&m.head], &mut [&mut s.logits]);
        if c.output_multiplier != 1.0 {
            dev.map(&mut s.logits, Map::Scale(c.output_multiplier));
        }
        if let Some(cap) = c.softcap {
            dev.map(&mut s.logits, Map::Softcap(cap));
        }
    }
}

/// [`DFlashDrafter::context`] over the tapped rows `taps` (one tensor a
/// tap), wherever they are.
fn make_context<D: Device>(dev: &D, m: &DFlash<D>, s: &mut Scratch<D>, kv: &mut D::Kv, taps: &[&D::Tensor], pos: &[u32], slots: &[u32]) {
    let c = &m.cfg;
    let hd = c.head_dim;
    let mut ctx = std::mem::replace(s.extra(dev, CTX), dev.tensor(0, 0));
    for (i, (fc, tap)) in m.fc.iter().zip(taps).enumerate() {
        if i == 0 {
            dev.matmul(tap, &[fc], &mut [&mut s.out]);
        } else {
            dev.matmul(tap, &[fc], &mut [&mut s.h]);
            dev.add(&mut s.out, &s.h);
        }
    }
    dev.rms_norm(&s.out, &m.hidden_norm, c.eps, &mut ctx);
    for (l, b) in m.layers.iter().enumerate() {
        let Some((_, k_norm)) = &b.attn.qk_norm else { unreachable!("DFlash layers load with q/k norms") };
        dev.matmul(&ctx, &[&b.attn.wk, &b.attn.wv], &mut [&mut s.k_raw, &mut s.v]);
        dev.rms_norm(&s.k_raw, k_norm, c.eps, &mut s.k);
        dev.rope(&mut s.k, pos, hd, &c.rope);
        dev.kv_write(kv, l, &s.k, &s.v, slots);
    }
    *s.extra(dev, CTX) = ctx;
}

impl<D: Device> Drafter for DFlashDrafter<D> {
    fn open(&mut self, stream: StreamId, prefix: &[u32]) {
        self.forget(stream);
        // Rows restored from a prefix were never seen: the context starts
        // after them (positions stay the target's).
        self.stream(stream).base = prefix.len();
    }

    fn absorb(&mut self, stream: StreamId, tokens: &[u32], features: &[f32]) {
        let rows = tokens.len();
        let dim = self.model.feature_dim();
        let st = self.stream(stream);
        st.gate.absorbed(rows);
        if rows == 0 || st.failed {
            return;
        }
        // Host rows where the lane hands them, made context now; else the
        // backend's, on the device, taken for the next flush. (A backend
        // tapping other rows than this drafter reads is refused when the
        // drafter is attached.)
        if features.len() != rows * dim {
            self.take_taps(stream, rows);
            return;
        }
        self.flush();
        if let Err(e) = self.upload_taps(features, rows).and_then(|()| self.absorb_rows(stream, rows)) {
            self.last_error = Some(format!("{e:#}"));
            self.stream(stream).failed = true;
        }
    }

    fn propose(&mut self, stream: StreamId, last: u32) -> Vec<u32> {
        let rows = self.stream(stream).gate.allow();
        if rows == 0 {
            return Vec::new();
        }
        match self.propose_block(stream, last, rows) {
            Ok(t) => {
                self.last_error = None;
                self.stream(stream).gate.proposed(t.len());
                t
            }
            // No proposal costs only speed: the stream decodes one token.
            Err(e) => {
                self.last_error = Some(format!("{e:#}"));
                Vec::new()
            }
        }
    }

    fn may_propose(&self, stream: StreamId) -> bool {
        self.streams.get(&stream).is_none_or(|s| !s.gate.skipping())
    }

    fn forget(&mut self, stream: StreamId) {
        // Its rows taken and not made release their forward here.
        self.flush();
        if let Some(st) = self.streams.remove(&stream) {
            self.free.extend(st.blocks);
        }
    }

    fn cap(&mut self, stream: StreamId, max: usize) {
        self.stream(stream).gate.cap(max);
    }

    fn pace(&mut self, _drafting: bool) {
        // Before the lane's next round: a round's absorbs are made in one
        // pass whether or not any stream proposed.
        self.flush();
    }
}
