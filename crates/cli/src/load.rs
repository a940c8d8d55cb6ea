//! Loading a model, its tokenizer and chat template, with a progress bar.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::bail;
use anyhow::{Context, Result};
use braid_engine::{Backend, DecodeRow, DraftModel, DraftModelConfig, Drafter, NgramConfig, PromptLookup, RoundCost};
use braid_formats::template::ChatTemplate;
use braid_formats::tokenizer::Tokenizer;
use braid_models::dflash::{DFlash, DFlashDrafter};
use braid_models::{BackendConfig, Mmproj, ModelBackend, Source};
use braid_ops::cpu::Cpu;
use braid_ops::AllOps;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};

use crate::fetch;
use crate::ModelArgs;

pub struct Loaded {
    pub path: PathBuf,
    /// None for a model that ships none (an HF folder without
    /// `tokenizer.json`): commands on token ids still run; those that need
    /// text ask for it through [`Loaded::tokenizer`].
    tokenizer: Option<Arc<Tokenizer>>,
    pub template: Option<ChatTemplate>,
    pub backend: Box<dyn Backend>,
    /// The speculative drafter `--drafter` named, ready for the lane.
    pub drafter: Option<Box<dyn Drafter>>,
    /// The device, in words.
    pub device: String,
    pub vocab: usize,
    pub context: usize,
    /// Why there is no tokenizer, for the error of a command that needs one.
    missing: Option<String>,
    /// How the model takes images (`None`: it takes none).
    pub vision: Option<braid_server::VisionInfo>,
}

/// The speculative drafter options of `run` and `serve`.
#[derive(Args, Clone, Debug, Default)]
pub struct DraftArgs {
    /// Speculative drafter: `ngram` (prompt lookup) or a DFlash or DSpark drafter's folder.
    #[arg(long, value_name = "DIR|ngram", conflicts_with = "draft_model")]
    pub drafter: Option<String>,
    /// Speculative draft model: a smaller model of the same tokenizer (a
    /// GGUF file, HF folder or known name) that proposes tokens for the
    /// model to verify, on the same device.
    #[arg(long, value_name = "PATH|NAME")]
    pub draft_model: Option<String>,
    /// Most tokens the draft model proposes per round (each costs it one
    /// forward; fewer are proposed while a stream's drafts are rejected).
    #[arg(long, default_value_t = 6, value_name = "N")]
    pub draft_tokens: usize,
    /// Rounds with more decoding streams than this draft nothing (a full
    /// batch gains little from drafts and pays for rejected ones). Default:
    /// 1 on the CPU, where a verified row costs nearly what a decoded one
    /// does (7 rows took 4.5x one row on a 2-core machine), 4 on a GPU.
    #[arg(long, value_name = "N")]
    pub draft_max_streams: Option<usize>,
}

impl DraftArgs {
    /// `--draft-max-streams`, or its default for `device` (in words).
    pub fn max_streams(&self, device: &str) -> usize {
        self.draft_max_streams.unwrap_or(if device.starts_with("cpu") { 1 } else { 4 })
    }

    /// The method these options draft with, as requests name it
    /// (`"speculative": {"method": ...}`): `ngram`, `draft`, `dflash` or
    /// `dspark`; `None` without a drafter.
    pub fn method(&self) -> Option<String> {
        if self.draft_model.is_some() {
            return Some("draft".into());
        }
        let d = self.drafter.as_deref()?;
        if d == "ngram" {
            return Some("ngram".into());
        }
        // A folder: DSpark's configs name it (its architecture or speculators' type).
        let cfg = std::fs::read_to_string(std::path::Path::new(d).join("config.json")).unwrap_or_default();
        let v: serde_json::Value = serde_json::from_str(&cfg).unwrap_or_default();
        let spec = v.get("speculators_model_type").and_then(|t| t.as_str());
        let arch = v.get("architectures").and_then(|a| a.as_array()).into_iter().flatten().filter_map(|a| a.as_str()).any(|a| a.starts_with("DSpark"));
        Some(if spec == Some("dspark") || arch { "dspark" } else { "dflash" }.into())
    }
}

/// Which device `--device` names.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum DeviceChoice {
    Cpu,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Cuda(usize),
}

/// `cpu`, `cuda`, `cuda:N`, or `auto` (CUDA when this build has it and a GPU answers, else the CPU).
pub fn device_choice(spec: &str) -> Result<DeviceChoice> {
    let spec = spec.trim().to_ascii_lowercase();
    if spec == "cpu" {
        return Ok(DeviceChoice::Cpu);
    }
    #[cfg(feature = "cuda")]
    {
        if spec == "auto" {
            // Asked once: opening a device to see that it answers costs a context.
            static AUTO: std::sync::OnceLock<DeviceChoice> = std::sync::OnceLock::new();
            return Ok(*AUTO.get_or_init(|| match braid_ops::cuda::Cuda::new(0) {
                Ok(_) => DeviceChoice::Cuda(0),
                Err(_) => DeviceChoice::Cpu,
            }));
        }
        match braid_ops::cuda::Cuda::parse_ordinal(&spec) {
            Some(n) => Ok(DeviceChoice::Cuda(n)),
            None => bail!("unknown device '{spec}': use cpu, cuda, cuda:N or auto"),
        }
    }
    #[cfg(not(feature = "cuda"))]
    {
        if spec == "auto" {
            return Ok(DeviceChoice::Cpu);
        }
        if spec.starts_with("cuda") {
            bail!("this braid was built without CUDA support: rebuild with `cargo build --release --features cuda`");
        }
        bail!("unknown device '{spec}': use cpu, cuda, cuda:N or auto")
    }
}

/// The model's tokenizer; None when it has none (a GGUF without
/// `tokenizer.ggml.*` keys, an HF folder without `tokenizer.json`). One that
/// is there but broken is an error.
fn tokenizer_of(src: &Source) -> Result<Option<Tokenizer>> {
    match src {
        Source::Gguf(g) if g.get("tokenizer.ggml.model").is_none() => Ok(None),
        Source::Gguf(g) => Tokenizer::from_gguf(g).map(Some),
        Source::Hf(h) => match h.tokenizer_json() {
            None => Ok(None),
            Some(p) => Tokenizer::from_tokenizer_json(&p, h.tokenizer_config().as_ref()).map(Some),
        },
    }
}

fn no_tokenizer(src: &Source) -> anyhow::Error {
    match src {
        Source::Hf(h) => anyhow::anyhow!("{} has no tokenizer.json; this command needs one (logits and bench run on token ids without it)", h.dir().display()),
        Source::Gguf(g) => anyhow::anyhow!("{} holds no tokenizer; this command needs one (logits and bench run on token ids without it)", g.path().display()),
    }
}

fn template_of(src: &Source, tok: &Tokenizer) -> Result<Option<ChatTemplate>> {
    match src {
        Source::Gguf(g) => ChatTemplate::from_gguf(g, tok),
        Source::Hf(h) => {
            let Some(cfg) = h.tokenizer_config() else { return Ok(None) };
            let Some(t) = cfg.get("chat_template").and_then(|v| v.as_str()) else { return Ok(None) };
            let name = |id: Option<u32>| id.and_then(|i| tok.token_text(i)).unwrap_or("").to_string();
            Ok(Some(ChatTemplate::new(t, &name(tok.bos()), &name(tok.eos()))?))
        }
    }
}

pub fn tokenizer_only(args: &ModelArgs) -> Result<Tokenizer> {
    let path = fetch::resolve(&args.model)?;
    let src = Source::open(&path)?;
    tokenizer_of(&src)?.ok_or_else(|| no_tokenizer(&src))
}

/// Load everything; `kv_tokens` sizes the KV pool (at least one full context).
pub fn load_with(args: &ModelArgs, cfg: BackendConfig) -> Result<Loaded> {
    load_drafted(args, cfg, &DraftArgs::default())
}

/// [`load_with`], and the drafter `draft` names: `ngram` (prompt lookup),
/// a DFlash or DSpark drafter's folder (whose target layers the backend then taps),
/// or a draft model.
pub fn load_drafted(args: &ModelArgs, cfg: BackendConfig, draft: &DraftArgs) -> Result<Loaded> {
    let path = fetch::resolve(&args.model)?;
    match device_choice(&args.device)? {
        DeviceChoice::Cpu => load_on(Cpu::new(args.threads), args, path, cfg, draft),
        #[cfg(feature = "cuda")]
        DeviceChoice::Cuda(n) => load_on(braid_ops::cuda::Cuda::new(n)?, args, path, cfg, draft),
        #[cfg(not(feature = "cuda"))]
        DeviceChoice::Cuda(_) => unreachable!("device_choice refuses cuda in this build"),
    }
}

/// The mmproj file for the model at `path`: `--mmproj`, else the one
/// `mmproj*.gguf` beside a GGUF of an architecture that takes one (none
/// where there are several: which is meant cannot be told, and is warned of).
fn mmproj_for(args: &ModelArgs, path: &Path, src: &Source) -> Result<Option<Mmproj>> {
    if let Some(m) = &args.mmproj {
        return Mmproj::open(m).map(Some);
    }
    let Source::Gguf(_) = src else { return Ok(None) };
    if !braid_models::takes_mmproj(&src.architecture()?) {
        return Ok(None);
    }
    let found = mmproj_beside(path);
    match found.as_slice() {
        [] => Ok(None),
        [one] => {
            tracing::info!(mmproj = %one.display(), "taking the vision tower from the mmproj beside the model");
            Mmproj::open(one).map(Some)
        }
        several => {
            let names: Vec<String> = several.iter().map(|p| p.display().to_string()).collect();
            tracing::warn!("several mmproj files beside the model ({}); taking none: name one with --mmproj", names.join(", "));
            Ok(None)
        }
    }
}

/// The `mmproj*.gguf` files in the folder of the model file `path`, by name.
fn mmproj_beside(path: &Path) -> Vec<PathBuf> {
    let Some(dir) = path.parent().map(|d| if d.as_os_str().is_empty() { Path::new(".") } else { d }) else { return Vec::new() };
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut found: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file() && p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("mmproj") && n.ends_with(".gguf")))
        .collect();
    found.sort();
    found
}

fn load_on<D: AllOps + Clone>(dev: D, args: &ModelArgs, path: PathBuf, cfg: BackendConfig, draft: &DraftArgs) -> Result<Loaded> {
    let src = Source::open(&path)?;
    let mmproj = mmproj_for(args, &path, &src)?;
    let tokenizer = tokenizer_of(&src)?;
    let template = match &tokenizer {
        Some(t) => template_of(&src, t)?,
        None => None,
    };
    let missing = tokenizer.is_none().then(|| no_tokenizer(&src).to_string());
    let bar =
        ProgressBar::new(1).with_style(ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} layers").unwrap_or_else(|_| ProgressStyle::default_bar()));
    bar.set_message(format!("loading {}", path.file_name().and_then(|n| n.to_str()).unwrap_or("model")));
    let model = braid_models::load_with(&dev, &src, mmproj.as_ref(), &|i, n| {
        bar.set_length(n as u64);
        bar.set_position(i as u64);
    })?;
    bar.finish_and_clear();
    let vision = match model.vision() {
        Some(v) => Some(braid_server::VisionInfo { prep: image_prep(&path, v)?, tokens: v.tokens, boi: v.boi_token, eoi: v.eoi_token }),
        None => None,
    };
    let vocab = model.vocab();
    let model_ctx = model.context();
    let mut cfg = cfg;
    if cfg.context == 0 {
        cfg.context = args.ctx.unwrap_or(model_ctx.min(8192));
    }
    if cfg.kv_tokens == 0 {
        cfg.kv_tokens =
            kv_tokens_for(dev.memory_free(), &|kv_tokens| kv_bytes(model.as_ref(), &BackendConfig { kv_tokens, ..cfg.clone() }).ok().flatten(), &cfg);
    }
    cfg.kv_tokens = cfg.kv_tokens.max(cfg.context);
    let context = cfg.context;
    let device = dev.name();
    let (kv_tokens, block_tokens, kv_dtype) = (cfg.kv_tokens, cfg.block_tokens, cfg.kv_dtype);
    check_sizes(kv_bytes(model.as_ref(), &cfg)?, &cfg, device.starts_with("cpu"))?;
    let draft_cfg = cfg.clone();
    let mut backend = ModelBackend::new(dev.clone(), model, cfg)?;
    if let Some(name) = &draft.draft_model {
        let d = load_draft_model(&dev, name, draft_cfg, vocab, tokenizer.as_ref(), draft.draft_tokens)?;
        let drafter = Some(Box::new(d) as Box<dyn Drafter>);
        return Ok(Loaded { path, tokenizer: tokenizer.map(Arc::new), missing, template, backend: Box::new(backend), drafter, device, vocab, context, vision });
    }
    let drafter: Option<Box<dyn Drafter>> = match draft.drafter.as_deref() {
        None => None,
        Some("ngram") => Some(Box::new(PromptLookup::new(NgramConfig::default()))),
        Some(dir) => {
            let dir = PathBuf::from(dir);
            let d = DFlash::load(&dev, &dir, &src).with_context(|| format!("loading the drafter in {}", dir.display()))?;
            // The drafter's context rows need as much room as the target's.
            let mut drafter = DFlashDrafter::new(dev, d, kv_tokens, block_tokens, kv_dtype)?;
            drafter.share_taps(&mut backend).with_context(|| format!("the drafter in {} does not fit {}", dir.display(), path.display()))?;
            Some(Box::new(drafter))
        }
    };
    Ok(Loaded { path, tokenizer: tokenizer.map(Arc::new), missing, template, backend: Box::new(backend), drafter, device, vocab, context, vision })
}

/// How images are made pixels for the tower `v` of the model at `path`:
/// an HF folder's `preprocessor_config.json` (SigLIP's settings without
/// one), with the normalisation an mmproj states.
fn image_prep(path: &Path, v: &braid_models::siglip::VisionConfig) -> Result<braid_formats::images::ImagePrep> {
    let mut prep = braid_formats::images::ImagePrep::load(path, v.image_size as u32)?;
    if let (Some(mean), Some(std)) = (v.image_mean, v.image_std) {
        (prep.mean, prep.std) = (mean, std);
    }
    Ok(prep)
}

/// The draft model `name` on `dev`, with room for as many streams and
/// rows as the target (`cfg`, the target's settings). Its vocabulary must
/// be the target's, token for token where both ship a tokenizer: its
/// proposals are token ids.
fn load_draft_model<D: AllOps + Clone>(dev: &D, name: &str, cfg: BackendConfig, vocab: usize, target: Option<&Tokenizer>, tokens: usize) -> Result<DraftModel> {
    let path = fetch::resolve(name).with_context(|| format!("the draft model {name}"))?;
    let src = Source::open(&path)?;
    let model = braid_models::load(dev, &src, &|_, _| {}).with_context(|| format!("loading the draft model {}", path.display()))?;
    if model.vocab() != vocab {
        bail!(
            "the draft model {} has a vocabulary of {} tokens, the model's is {vocab}: a draft model must share the tokenizer",
            path.display(),
            model.vocab()
        );
    }
    if let (Some(t), Some(d)) = (target, tokenizer_of(&src)?) {
        if let Some(i) = (0..vocab as u32).find(|&i| t.token_text(i) != d.token_text(i)) {
            bail!(
                "the draft model {} has another tokenizer: its token {i} is {:?}, the model's is {:?}",
                path.display(),
                d.token_text(i).unwrap_or(""),
                t.token_text(i).unwrap_or("")
            );
        }
    }
    // Marks and a block cache would only hold what the target's cache holds.
    let cfg = BackendConfig { max_marks: 0, ..cfg };
    check_sizes(kv_bytes(model.as_ref(), &cfg)?, &cfg, dev.name().starts_with("cpu"))?;
    let backend = ModelBackend::new(dev.clone(), model, cfg)?;
    DraftModel::new(Box::new(backend), DraftModelConfig { max_tokens: tokens, ..DraftModelConfig::default() })
        .with_context(|| format!("the draft model {}", path.display()))
}

/// The shortest context served: a chat template's markup alone takes a
/// dozen tokens, so less would refuse every request.
const MIN_CONTEXT: usize = 16;

/// The bytes of the KV pool the backend makes for `model` under `cfg`, at
/// least 2 an element (f16 KV), keys and values; sliding-window layers
/// count their window group's blocks. `None` past `usize`.
fn kv_bytes<D: braid_ops::Device>(model: &dyn braid_models::Model<D>, cfg: &BackendConfig) -> Result<Option<usize>> {
    Ok(braid_models::backend::KvLayout::of(model, cfg)?.bytes(2))
}

/// Refuses a context or KV pool that cannot work: too short to answer
/// anything, or too large to allocate (rather than abort on allocation);
/// `bytes`: the pool's ([`kv_bytes`]).
fn check_sizes(bytes: Option<usize>, cfg: &BackendConfig, cpu: bool) -> Result<()> {
    if cfg.context < MIN_CONTEXT {
        bail!("--ctx {} is too short: at least {MIN_CONTEXT} tokens are needed to answer anything", cfg.context);
    }
    let Some(bytes) = bytes else {
        bail!("--kv-tokens {} (or --ctx {}) is too large: its KV memory overflows", cfg.kv_tokens, cfg.context);
    };
    if let Some(total) = cpu.then(memory_total).flatten() {
        if bytes > total {
            bail!(
                "--kv-tokens {} (or --ctx {}) needs at least {:.1} GiB of KV memory; this machine has {:.1} GiB",
                cfg.kv_tokens,
                cfg.context,
                bytes as f64 / (1u64 << 30) as f64,
                total as f64 / (1u64 << 30) as f64
            );
        }
    }
    Ok(())
}

/// KV tokens when none were asked for (`kv_tokens` 0): on a device with
/// memory of its own (`free`, bytes, after the weights), every stream slot's
/// full context within half of it (the rest is for activations, recorded
/// forwards and a drafter); elsewhere [`HOST_KV_TOKENS`]. `bytes`: the
/// pool's bytes for so many KV tokens ([`kv_bytes`]), which grow with them
/// (by less than a token's in every layer where window layers keep only
/// their window).
fn kv_tokens_for(free: Option<usize>, bytes: &dyn Fn(usize) -> Option<usize>, cfg: &BackendConfig) -> usize {
    let Some(free) = free else { return HOST_KV_TOKENS };
    let fits = |t: usize| bytes(t).is_some_and(|b| b <= free / 2);
    let wanted = cfg.max_streams.max(1).saturating_mul(cfg.context);
    if fits(wanted) {
        return wanted;
    }
    // The most tokens that fit, by bisection: `lo` fits (or is 0), `hi` does not.
    let (mut lo, mut hi) = (0, wanted);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}

/// KV tokens by default where the KV lives in the host's memory.
pub const HOST_KV_TOKENS: usize = 32768;

/// This machine's memory in bytes (`MemTotal`), where the system says.
fn memory_total() -> Option<usize> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kb: usize = info.lines().find_map(|l| l.strip_prefix("MemTotal:"))?.trim().trim_end_matches("kB").trim().parse().ok()?;
    kb.checked_mul(1024)
}

/// `--itl-target MS` as a duration (a positive, finite number of milliseconds).
pub fn itl_target(ms: Option<f64>) -> Result<Option<std::time::Duration>> {
    match ms {
        None => Ok(None),
        Some(ms) if ms.is_finite() && ms > 0.0 => Ok(Some(std::time::Duration::from_secs_f64(ms / 1e3))),
        Some(ms) => anyhow::bail!("--itl-target must be a positive number of milliseconds, got {ms}"),
    }
}

pub fn load(args: &ModelArgs, min_ctx: usize) -> Result<Loaded> {
    let ctx = args.ctx.unwrap_or(8192).max(min_ctx);
    load_with(args, BackendConfig { context: ctx, kv_tokens: ctx, max_batch: 512, ..BackendConfig::default() })
}

impl Loaded {
    /// The tokenizer, or an error naming the model and what it lacks.
    pub fn tokenizer(&self) -> Result<&Arc<Tokenizer>> {
        match &self.tokenizer {
            Some(t) => Ok(t),
            None => bail!("{}", self.missing.as_deref().unwrap_or("this model has no tokenizer")),
        }
    }

    /// The ids that end a generation; none without a tokenizer.
    pub fn stop_ids(&self) -> Vec<u32> {
        self.tokenizer.as_ref().map(|t| t.stop_ids()).unwrap_or_default()
    }

    /// Logits at every position of `tokens` (one forward per 512 rows).
    pub fn logits_all(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        const STREAM: u64 = u64::MAX;
        self.backend.open(STREAM)?;
        let mut out = Vec::with_capacity(tokens.len() * self.vocab);
        let result = (|| {
            for chunk in tokens.chunks(512) {
                out.extend(self.backend.decode_logits(&[DecodeRow { stream: STREAM, tokens: chunk.to_vec() }])?);
            }
            Ok(())
        })();
        self.backend.forget(STREAM);
        result.map(|_| out)
    }
}

/// One throw-away prompt pass of `rows` rows on a GPU backend, so its
/// scratch buffers are sized (and its kernels loaded) before the first
/// request: a decode round that later shares its forward with a whole
/// chunk would otherwise pay those one-time costs as a stall of every
/// stream. The CPU device grows its buffers cheaply and skips this.
///
/// Then a throw-away arrival beside a decoding stream: prompt steps of
/// growing size, each in the other's decode round, the last asking for
/// logits. On the H200 a first arrival's first and last shared rounds took
/// 12-15 ms against ~4 for the rest (and for every later arrival): costs
/// paid once per process, which this pays before any client waits.
pub fn warm_up(backend: &mut dyn Backend, device: &str, rows: usize) -> Result<Vec<RoundCost>> {
    if device.starts_with("cpu") || rows == 0 {
        return Ok(Vec::new());
    }
    let caps = backend.capabilities();
    let rows = rows.min(caps.max_context).min(if caps.max_batch == 0 { usize::MAX } else { caps.max_batch });
    // The recordings' pass runs every replayed size twice back to back, so
    // it may reach past one batch (chunks, each within it).
    let positions = rows.max(CHUNKS_SPAN * caps.replayed_chunk_rows).min(caps.max_context);
    let tokens: Vec<u32> = (0..positions).map(|i| (i % caps.vocab_size.max(1)) as u32).collect();
    let tokens_batch = &tokens[..rows];
    let (id, bg) = (u64::MAX, u64::MAX - 1);
    backend.open(id)?;
    let r = backend.prefill_step(id, braid_engine::Chunk { start: 0, tokens: tokens_batch, want_logits: true });
    backend.forget(id);
    r?;
    if rows < 16 {
        return Ok(Vec::new());
    }
    let bgs: Vec<u64> = (0..4).map(|i| bg - i).collect();
    backend.open(id)?;
    let r = (|| -> Result<()> {
        open_short(backend, &bgs, &tokens)?;
        let mut start = 0;
        let mut step = 1;
        while start < rows - 8 {
            let n = step.min(rows - 8 - start);
            let last = start + n == rows - 8;
            let round: Vec<_> = bgs.iter().map(|&b| braid_engine::DecodeRow { stream: b, tokens: vec![tokens[start % 8]] }).collect();
            let chunk = braid_engine::Chunk { start, tokens: &tokens[start..start + n], want_logits: last };
            backend.round(braid_engine::Step::new(&round, Some((id, chunk)), braid_engine::Pick::Logits))?;
            start += n;
            step = (step * 3).div_ceil(2);
        }
        Ok(())
    })();
    backend.forget(id);
    bgs.iter().for_each(|&b| backend.forget(b));
    r?;
    record_rounds(backend, &tokens)
}

/// Open `ids`, each holding the first 8 of `tokens`: the warm-ups'
/// decoding streams.
fn open_short(backend: &mut dyn Backend, ids: &[u64], tokens: &[u32]) -> Result<()> {
    for &b in ids {
        backend.open(b)?;
        backend.prefill_step(b, braid_engine::Chunk { start: 0, tokens: &tokens[..8], want_logits: false })?;
    }
    Ok(())
}

/// Most decoding streams whose rounds [`record_rounds`] records.
const RECORDED_STREAMS: usize = 32;

/// Stream counts whose recorded rounds are replayed twice more, timed, as
/// the start of the pacer's cost model (`LaneConfig::round_costs`).
const TIMED_STREAMS: [usize; 8] = [1, 2, 4, 6, 8, 12, 16, 32];

/// Passes of those counts' rounds timed as served ([`served_pass`]), on a
/// backend that starts rounds ahead.
const SERVED_PASSES: usize = 2;

/// The chunks for [`record_rounds`] as `(start, rows, want_logits)`: each
/// replayed size from `most` down to 1, without and then with its logits,
/// back to back in a pass of at most `limit` tokens; a chunk that would
/// pass it starts a new pass at 0.
fn replayed_chunks(most: usize, limit: usize) -> Vec<(usize, usize, bool)> {
    braid_engine::replayed_sizes(most)
        .flat_map(|s| [(s, false), (s, true)])
        .scan(0, |start, (size, want)| {
            if *start + size > limit {
                *start = 0;
            }
            let at = *start;
            *start += size;
            Some((at, size, want))
        })
        .collect()
}

/// A new pass of stream `id` where a chunk starts at 0 (the first, or one
/// past a pass's limit in [`replayed_chunks`]).
fn reopen_at(backend: &mut dyn Backend, id: u64, start: usize) -> Result<()> {
    if start == 0 {
        backend.forget(id);
        backend.open(id)?;
    }
    Ok(())
}

/// [`replayed_chunks`] spans at most this many times its largest size in
/// one pass: twice the sum of the sizes, under 7·most (the powers of two
/// below 2·most, the 3, 5 and 7 times them below 4.5·most).
const CHUNKS_SPAN: usize = 14;

/// On a backend that replays recorded forwards: the rounds a served
/// arrival takes, recorded now — 1 to 32 streams decoding, alone and beside
/// a prompt chunk of every replayed size (with and without the chunk's
/// logits), each such chunk alone, and the rounds of more streams, up to
/// every slot but one, alone. Recorded on first use instead, each
/// cost a decoding stream a 3–5 ms gap on the H200. Largest first, so no
/// later buffer growth moves what the recordings read. For the stream
/// counts of [`TIMED_STREAMS`] the rounds are then replayed twice more and
/// timed: what they cost, for the pacer (the least of the two per size).
fn record_rounds(backend: &mut dyn Backend, tokens: &[u32]) -> Result<Vec<RoundCost>> {
    let caps = backend.capabilities();
    let slots = backend.fill().slots_total;
    let streams = RECORDED_STREAMS.min(slots.saturating_sub(1));
    // No larger chunk than a round beside the most streams holds (a
    // smaller --chunk: its cuts never reach the largest sizes).
    let room = if caps.max_batch == 0 { usize::MAX } else { caps.max_batch.saturating_sub(streams) };
    let most = braid_engine::replayed_sizes(caps.replayed_chunk_rows.min(room)).next().unwrap_or(0);
    if most == 0 || streams == 0 || tokens.len() < most {
        return Ok(Vec::new());
    }
    let id = u64::MAX;
    // Every stream a round may hold decodes once first, so the logits
    // rows are as large as they will grow.
    let widest = slots.saturating_sub(1).min(caps.max_batch.saturating_sub(1)).max(streams);
    let t0 = std::time::Instant::now();
    // Tens of seconds on a GPU: said, so a server that is listening but not
    // yet ready does not look stuck.
    tracing::info!(graphs = recorded_graphs(streams, widest, most), streams, widest, "recording the rounds a served arrival takes");
    let bgs: Vec<u64> = (1..=widest as u64).map(|i| id - i).collect();
    let r = (|| -> Result<Vec<RoundCost>> {
        open_short(backend, &bgs, tokens)?;
        let all: Vec<_> = bgs.iter().map(|&b| braid_engine::DecodeRow { stream: b, tokens: vec![tokens[0]] }).collect();
        backend.round(braid_engine::Step::new(&all, None, braid_engine::Pick::Logits))?;
        // A chunk alone in its forward: a pass's first chunk beside a decode
        // round launched ahead runs so (the launched round serves the rows).
        for (start, size, want_logits) in replayed_chunks(most, tokens.len()) {
            reopen_at(backend, id, start)?;
            backend.prefill_step(id, braid_engine::Chunk { start, tokens: &tokens[start..start + size], want_logits })?;
        }
        backend.forget(id);
        // The decoding streams' lengths: 8 tokens, then the round above.
        let mut lens = vec![9usize; bgs.len()];
        // The first `n` decoding streams' rows, each fed one token.
        let rows_of =
            |n: usize| -> Vec<_> { bgs[..n].iter().map(|&b| braid_engine::DecodeRow { stream: b, tokens: vec![tokens[n % tokens.len()]] }).collect() };
        // Past 32 streams the plain rounds alone (beside a chunk too, every
        // count and size would double the recordings): a 33rd stream
        // joining would otherwise record its round while serving.
        for n in (streams + 1..=widest).rev() {
            timed_round(backend, argmax_step(&rows_of(n), None), &mut lens, None)?;
        }
        let mut costs = Vec::new();
        let chunks = replayed_chunks(most, tokens.len());
        for n in (1..=streams).rev() {
            let rows = rows_of(n);
            // Recorded on the first pass, then (for some stream counts)
            // replayed and timed twice for the pacer, which keeps each
            // size's least: one sample flipped a size past a share of 0.45
            // on one H100 server of three (48 rows beside six streams of
            // Llama-1B's shape, 0.43 of a plain round in gpu_bench).
            let passes = if TIMED_STREAMS.contains(&n) { 3 } else { 1 };
            let served_passes = if passes > 1 && caps.launches_ahead { SERVED_PASSES } else { 0 };
            // The decoding streams grow a token a round: started again
            // where this count's rounds would pass the context.
            if lens[0] + passes * (1 + chunks.len()) + served_passes * (2 + chunks.len()) > caps.max_context {
                bgs[..n].iter().for_each(|&b| backend.forget(b));
                open_short(backend, &bgs[..n], tokens)?;
                lens[..n].iter_mut().for_each(|l| *l = 8);
            }
            for pass in 0..passes {
                let mut timed = (pass > 0).then_some(&mut costs);
                timed_round(backend, argmax_step(&rows, None), &mut lens, timed.as_deref_mut())?;
                for &(start, size, want_logits) in &chunks {
                    reopen_at(backend, id, start)?;
                    let chunk = braid_engine::Chunk { start, tokens: &tokens[start..start + size], want_logits };
                    timed_round(backend, argmax_step(&rows, Some((id, chunk))), &mut lens, timed.as_deref_mut())?;
                }
                backend.forget(id);
            }
            // Timed as served too, each round started ahead by the one
            // before: the rounds above wait on their host work, which a
            // served round's predecessor has done (the pacer keeps each
            // size's least, so a chain that fails to start its rounds ahead
            // costs nothing).
            for _ in 0..served_passes {
                served_pass(backend, &rows, id, tokens, &chunks, &mut lens, &mut costs)?;
            }
            if n % 8 == 0 {
                tracing::info!(streams = n, secs = t0.elapsed().as_secs(), "recorded the rounds of {n} streams and more");
            }
        }
        tracing::info!(secs = format!("{:.1}", t0.elapsed().as_secs_f64()), "recorded the rounds a served arrival takes");
        Ok(costs)
    })();
    backend.forget(id);
    bgs.iter().for_each(|&b| backend.forget(b));
    r
}

/// About how many graphs [`record_rounds`] records for `streams` (up to
/// `widest` alone) and chunks up to `most` rows: per stream count a plain
/// round and each replayed chunk beside it, with and without its logits;
/// each chunk alone; the plain rounds of more streams; the round of every
/// stream.
fn recorded_graphs(streams: usize, widest: usize, most: usize) -> usize {
    let chunks = replayed_chunks(most, usize::MAX).len();
    streams * (1 + chunks) + chunks + widest.saturating_sub(streams) + 1
}

/// One pass of [`record_rounds`]'s chunks beside `rows` as a served
/// arrival runs them: a plain round starts a second ahead (timed as the
/// plain one), which names the first chunk, and so on, each round fed the
/// tokens the one before picked, so the round started ahead is the one
/// asked for. Each timed call into `costs`. (A chunk that starts a pass
/// of `chunks` again reopens its stream, so it starts afresh: its other
/// variant, with or without logits, starts ahead.)
fn served_pass(
    backend: &mut dyn Backend,
    rows: &[DecodeRow],
    id: u64,
    tokens: &[u32],
    chunks: &[(usize, usize, bool)],
    lens: &mut [usize],
    costs: &mut Vec<RoundCost>,
) -> Result<()> {
    let chunk_at =
        |i: usize| chunks.get(i).map(|&(start, size, want_logits)| (id, braid_engine::Chunk { start, tokens: &tokens[start..start + size], want_logits }));
    let mut rows = rows.to_vec();
    // Open before the round that names its first chunk, so that one starts ahead too.
    reopen_at(backend, id, 0)?;
    // Rounds: the untimed plain one, the timed plain one, then each chunk.
    for i in 0..chunks.len() + 2 {
        let chunk = i.checked_sub(2).and_then(chunk_at);
        if let Some((_, c)) = chunk.filter(|_| i > 2) {
            reopen_at(backend, id, c.start)?;
        }
        let step = braid_engine::Step { next_chunk: i.checked_sub(1).and_then(chunk_at), next_plain: i == 0, ..argmax_step(&rows, chunk) };
        if let braid_engine::Picked::Tokens(t) = timed_round(backend, step, lens, (i > 0).then_some(&mut *costs))? {
            rows.iter_mut().zip(t).for_each(|(r, t)| r.tokens = vec![t]);
        }
    }
    backend.forget(id);
    Ok(())
}

/// A step of `rows` beside `chunk`, picking each row's argmax.
fn argmax_step<'a>(rows: &'a [DecodeRow], chunk: Option<(u64, braid_engine::Chunk<'a>)>) -> braid_engine::Step<'a> {
    braid_engine::Step::new(rows, chunk, braid_engine::Pick::Argmax)
}

/// A warm-up round, `step` (an argmax of its rows beside its chunk): its
/// backend call's time into `costs` if given, its rows' streams (the first
/// of `lens`, their lengths) a token longer. Returns what it picked.
fn timed_round(
    backend: &mut dyn Backend,
    step: braid_engine::Step<'_>,
    lens: &mut [usize],
    costs: Option<&mut Vec<RoundCost>>,
) -> Result<braid_engine::Picked> {
    let (n, chunk) = (step.rows.len(), step.chunk);
    let t = std::time::Instant::now();
    let out = backend.round(step)?;
    let secs = t.elapsed().as_secs_f64();
    if let Some(costs) = costs {
        let (chunk_rows, chunk_start) = chunk.map_or((0, 0), |(_, c)| (c.tokens.len(), c.start));
        costs.push(RoundCost { decode_rows: n, decode_ctx: lens[..n].iter().sum(), chunk_rows, chunk_start, secs });
    }
    lens[..n].iter_mut().for_each(|l| *l += 1);
    Ok(out.picked)
}

#[cfg(test)]
mod tests {
    use super::{replayed_chunks, CHUNKS_SPAN};

    #[test]
    fn kv_tokens_default_fills_half_a_devices_free_memory_at_most() {
        use super::{kv_tokens_for, HOST_KV_TOKENS};
        let kv = |tokens: usize| Some(tokens * 2048); // 2 KiB a token
        let cfg = braid_models::BackendConfig { context: 1000, max_streams: 8, ..Default::default() };
        assert_eq!(kv_tokens_for(None, &kv, &cfg), HOST_KV_TOKENS);
        // Room for every slot's context when memory allows ...
        assert_eq!(kv_tokens_for(Some(1 << 30), &kv, &cfg), 8000);
        // ... else half the free memory.
        assert_eq!(kv_tokens_for(Some(8 << 20), &kv, &cfg), 2048);
        // A pool whose window layers hold a group of their own grows by less a token.
        let windowed = |tokens: usize| Some(tokens * 1024 + (1 << 20));
        assert_eq!(kv_tokens_for(Some(8 << 20), &windowed, &cfg), 3072);
    }

    #[test]
    fn replayed_chunks_cover_each_size_twice_back_to_back() {
        let c = replayed_chunks(64, usize::MAX);
        let sizes: Vec<(usize, bool)> = c.iter().map(|&(_, n, w)| (n, w)).collect();
        let want: Vec<(usize, bool)> = [64, 48, 32, 24, 16, 8, 4, 2, 1].iter().flat_map(|&n| [(n, false), (n, true)]).collect();
        assert_eq!(sizes, want);
        // Each chunk starts where the one before ended, within the span.
        assert!(c.windows(2).all(|w| w[1].0 == w[0].0 + w[0].1));
        assert_eq!(c[0].0, 0);
        for most in [64, 256, 4096] {
            let end = replayed_chunks(most, usize::MAX).last().map(|&(s, n, _)| s + n).unwrap();
            assert!(end <= CHUNKS_SPAN * most, "{most}: {end}");
        }
        assert_eq!(replayed_chunks(3, usize::MAX).iter().map(|c| c.1).collect::<Vec<_>>(), [2, 2, 1, 1]);
        // Past the limit a chunk starts a new pass at 0, every pass within it.
        let c = replayed_chunks(256, 1000);
        assert_eq!(c.len(), 2 * braid_engine::replayed_sizes(256).count());
        assert!(c.iter().all(|&(s, n, _)| s + n <= 1000));
        assert!(c.iter().filter(|c| c.0 == 0).count() > 1);
        assert!(c.windows(2).all(|w| w[1].0 == 0 || w[1].0 == w[0].0 + w[0].1));
    }

    /// The warm-up runs each shape a served arrival takes, so a device that
    /// records rounds has them before any client waits: 1–32 streams alone
    /// and beside every replayed chunk size (with and without its logits),
    /// each size alone, and past 32 streams the plain rounds, up to every
    /// slot but the newcomer's.
    #[test]
    fn the_warm_up_runs_each_shape_a_served_arrival_takes() {
        use braid_engine::fake::{Call, CallLog, FakeBackend, FakeConfig};
        use braid_engine::Picks;
        use std::collections::HashSet;
        let mut cfg = FakeConfig { slots_total: 40, blocks_total: 1 << 16, ..FakeConfig::default() };
        cfg.caps.replayed_chunk_rows = 16;
        cfg.caps.picks = Picks { argmax: true, top_k: 0, ..Picks::default() };
        let log = CallLog::default();
        let mut be = FakeBackend::new(cfg, log.clone());
        super::warm_up(&mut be, "cuda", 64).unwrap();
        // (decode rows, the chunk's rows and whether it wanted logits)
        let mut seen = HashSet::new();
        for c in log.snapshot() {
            match &c {
                Call::Round { rows, chunk, .. } => seen.insert((rows.len(), chunk.as_ref().map(|c| (c.tokens.len(), c.want_logits)))),
                Call::Prefill(c) => seen.insert((0, Some((c.tokens.len(), c.want_logits)))),
                _ => false,
            };
        }
        let sizes: Vec<usize> = braid_engine::replayed_sizes(16).collect();
        for n in 0..=32 {
            assert!(n == 0 || seen.contains(&(n, None)), "{n} streams alone");
            for &s in &sizes {
                for logits in [false, true] {
                    assert!(seen.contains(&(n, Some((s, logits)))), "{n} streams beside {s} rows (logits {logits})");
                }
            }
        }
        for n in 33..=39 {
            assert!(seen.contains(&(n, None)), "{n} streams alone");
        }
        assert!(!seen.iter().any(|&(n, _)| n > 39), "a round of every slot leaves the newcomer none");
    }

    /// On a backend that starts rounds ahead, the timed counts' rounds are
    /// timed as served too: a plain round asks for the next one plain
    /// ahead, then each round names the next one's chunk, and is fed what
    /// the one before picked (so the round started ahead is the one asked
    /// for); each of those rounds, the first aside, gives the pacer a cost.
    #[test]
    fn the_warm_up_times_rounds_as_served_where_they_start_ahead() {
        use super::{replayed_chunks, SERVED_PASSES, TIMED_STREAMS};
        use braid_engine::fake::{Call, CallLog, FakeBackend, FakeConfig};
        use braid_engine::Picks;
        let costs_with = |ahead: bool| {
            let mut cfg = FakeConfig { slots_total: 40, blocks_total: 1 << 16, ..FakeConfig::default() };
            cfg.caps.replayed_chunk_rows = 16;
            cfg.caps.launches_ahead = ahead;
            cfg.caps.picks = Picks { argmax: true, top_k: 0, ..Picks::default() };
            let log = CallLog::default();
            let mut be = FakeBackend::new(cfg, log.clone());
            let costs = super::warm_up(&mut be, "cuda", 64).unwrap();
            (costs, log.snapshot().into_iter().filter(|c| matches!(c, Call::Round { .. })).collect::<Vec<Call>>())
        };
        let chunks = replayed_chunks(16, usize::MAX).len();
        let (plain_costs, plain_rounds) = costs_with(false);
        assert!(!plain_rounds.iter().any(|c| matches!(c, Call::Round { next_plain: true, .. })));
        let (costs, rounds) = costs_with(true);
        assert_eq!(costs.len(), plain_costs.len() + TIMED_STREAMS.len() * SERVED_PASSES * (1 + chunks));
        let starts: Vec<usize> = (0..rounds.len()).filter(|&i| matches!(rounds[i], Call::Round { next_plain: true, .. })).collect();
        assert_eq!(starts.len(), TIMED_STREAMS.len() * SERVED_PASSES);
        for &k in &starts {
            let pass = &rounds[k..k + chunks + 2];
            let Call::Round { chunk: None, .. } = &pass[1] else { panic!("the second round is plain: {:?}", pass[1]) };
            for w in pass[1..].windows(2) {
                let (Call::Round { next_chunk, .. }, Call::Round { chunk, .. }) = (&w[0], &w[1]) else { unreachable!() };
                assert_eq!(next_chunk, chunk, "a round names the next one's chunk");
            }
            // Fed the picks: the tokens move from round to round.
            let fed: std::collections::HashSet<&Vec<u32>> = pass.iter().map(|c| &c.rows()[0].1).collect();
            assert!(fed.len() > chunks / 2, "{} different tokens fed in {} rounds", fed.len(), pass.len());
        }
    }

    /// The device keeps every graph the warm-up records, with room to spare
    /// for the shapes it does not (more streams, other chunks): a cache
    /// smaller than the warm-up evicted its first recordings, the rounds of
    /// the most streams, and an arrival beside 32 streams recorded them
    /// again while serving.
    #[cfg(feature = "cuda")]
    #[test]
    fn the_graph_cache_holds_what_the_warm_up_records() {
        use super::{recorded_graphs, RECORDED_STREAMS};
        let most = braid_engine::replayed_sizes(braid_models::REPLAY_CHUNK_ROWS).next().unwrap();
        // A GPU server's default: 64 running streams, one slot kept for an arrival.
        let n = recorded_graphs(RECORDED_STREAMS, 63, most);
        assert!(n + n / 4 <= braid_ops::cuda::MAX_GRAPHS, "{n} graphs against a cache of {}", braid_ops::cuda::MAX_GRAPHS);
    }
}
