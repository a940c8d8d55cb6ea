//! `braid run`: one prompt through a lane, streamed to the terminal.

use std::io::Write;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use braid_engine::{Event, Lane, LaneConfig, Request, SamplingParams, StopRules};
use braid_formats::template::ChatMessage;
use braid_server::{SamplingDefaults, TokenizerText};
use clap::Args;

use crate::load::{self, Loaded};
use crate::ModelArgs;

/// Sampling flags. Each one left out takes the model's own default
/// (generation_config.json, or a GGUF's general.sampling.*), else braid's,
/// which the server shares (see `braid_server::SamplingDefaults`).
#[derive(Args, Clone, Debug)]
pub struct SamplingArgs {
    /// Temperature; 0 picks the most likely token every time (greedy). [default: the model's, else 0.8]
    #[arg(long)]
    pub temperature: Option<f32>,
    /// Keep only the k most likely tokens (0 = off). [default: the model's, else 40]
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Keep the smallest set of tokens whose probability reaches p (1 = off). [default: the model's, else 0.95]
    #[arg(long)]
    pub top_p: Option<f32>,
    /// Drop tokens less likely than min_p × the top token's probability (0 = off). [default: the model's, else 0.05]
    #[arg(long)]
    pub min_p: Option<f32>,
    /// Divide the logits of tokens seen recently (1 = off). [default: the model's, else 1]
    #[arg(long)]
    pub repetition_penalty: Option<f32>,
    /// Subtract from the logits of tokens already generated (OpenAI's presence penalty).
    #[arg(long, default_value_t = 0.0)]
    pub presence_penalty: f32,
    /// Subtract per occurrence of a token already generated (OpenAI's frequency penalty).
    #[arg(long, default_value_t = 0.0)]
    pub frequency_penalty: f32,
    /// Seed for sampling: the same seed gives the same text.
    #[arg(long)]
    pub seed: Option<u64>,
}

impl SamplingArgs {
    /// The flags given, the rest from `defaults`.
    pub fn params(&self, defaults: &SamplingDefaults) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature.unwrap_or(defaults.temperature),
            top_k: self.top_k.unwrap_or(defaults.top_k),
            top_p: self.top_p.unwrap_or(defaults.top_p),
            min_p: self.min_p.unwrap_or(defaults.min_p),
            repetition_penalty: self.repetition_penalty.unwrap_or(defaults.repetition_penalty),
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            seed: self.seed,
            ..SamplingParams::default()
        }
    }
}

#[derive(Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Render the prompt as a user message with the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// A system message (with --chat).
    #[arg(long)]
    pub system: Option<String>,
    /// The chat template (with --chat): a Jinja file or a built-in name
    /// (chatml, llama3, gemma, plain). Default: chat_template.jinja beside
    /// the model, else the model's own.
    #[arg(long, value_name = "FILE|NAME")]
    pub chat_template: Option<String>,
    /// Most tokens to generate.
    #[arg(long, short = 'n', default_value_t = 256)]
    pub max_tokens: usize,
    /// Stop when this text appears (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    /// Keep generating past the end-of-text token.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Print no timing line at the end.
    #[arg(long, short = 'q')]
    pub quiet: bool,
    /// An image (PNG, JPEG or WebP) to put before the prompt's text, for a
    /// model that takes images (repeatable).
    #[arg(long, value_name = "FILE")]
    pub image: Vec<std::path::PathBuf>,
    #[command(flatten)]
    pub draft: load::DraftArgs,
    /// The prompt.
    pub prompt: String,
}

/// The lane settings every command uses for a loaded model.
pub fn lane_config(m: &Loaded) -> LaneConfig {
    LaneConfig { max_context: m.context, eos_ids: m.stop_ids(), ..LaneConfig::default() }
}

/// Turn the prompt (plain or chat) into token ids.
pub fn prompt_ids(m: &Loaded, prompt: &str, chat: bool, system: Option<&str>) -> Result<Vec<u32>> {
    if !chat {
        return m.tokenizer()?.encode(prompt, true);
    }
    let Some(t) = &m.template else {
        bail!("{} has no chat template (a base model?); run without --chat, or pass --chat-template FILE|NAME", m.path.display())
    };
    let mut msgs = Vec::new();
    if let Some(s) = system {
        msgs.push(ChatMessage { role: "system".into(), content: s.into() });
    }
    msgs.push(ChatMessage { role: "user".into(), content: prompt.into() });
    let text = t.render(&msgs, true)?;
    // Templates usually write BOS themselves; add it only where they did not.
    let tok = m.tokenizer()?;
    let has_bos = tok.bos().and_then(|b| tok.token_text(b)).is_some_and(|b| !b.is_empty() && text.starts_with(b));
    tok.encode(&text, !has_bos)
}

/// Put the images in `files` at the start of `prompt` (after its BOS
/// token, each as the model's processor writes an image: `\n\n`, its
/// rows, `\n\n`); the images as the lane takes them.
fn with_images(m: &Loaded, files: &[std::path::PathBuf], prompt: &mut Vec<u32>) -> Result<Vec<braid_engine::PromptImage>> {
    use braid_formats::images::{decode_image, pixels_hash, ImageLimits, Pacing};
    if files.is_empty() {
        return Ok(Vec::new());
    }
    let Some(v) = &m.vision else {
        let hint = if m.path.is_file() { "; a GGUF's comes in an mmproj file: --mmproj FILE" } else { "" };
        bail!("{} takes no images (it has no vision tower{hint})", m.path.display())
    };
    let tok = m.tokenizer()?;
    let gap = tok.encode("\n\n", false)?;
    let at = usize::from(tok.bos().is_some_and(|b| prompt.first() == Some(&b)));
    let mut head = Vec::new();
    let mut images = Vec::new();
    for f in files {
        let bytes = std::fs::read(f).with_context(|| format!("could not read the image {}", f.display()))?;
        let img = decode_image(&bytes, &ImageLimits::default(), &mut Pacing::off()).map_err(|e| anyhow::anyhow!("{}: {e}", f.display()))?;
        let pixels = v.prep.pixels(&img, &mut Pacing::off()).with_context(|| f.display().to_string())?;
        head.extend_from_slice(&gap);
        let (block, image) = braid_server::image_block(v, at + head.len(), pixels_hash(&pixels), pixels.into());
        head.extend(block);
        head.extend_from_slice(&gap);
        images.push(image);
    }
    prompt.splice(at..at, head);
    Ok(images)
}

pub fn run(a: RunArgs) -> Result<()> {
    let ctx = a.model.ctx.unwrap_or(8192);
    let cfg = braid_models::BackendConfig { context: ctx, kv_tokens: ctx, max_batch: 512, ..Default::default() };
    let mut m = load::load_drafted(&a.model, cfg, &a.draft)?;
    crate::about::choose_template(&mut m, a.chat_template.as_deref())?;
    let defaults = crate::about::sampling_defaults(&m.path);
    let mut prompt = prompt_ids(&m, &a.prompt, a.chat, a.system.as_deref())?;
    if prompt.is_empty() {
        bail!("the prompt is empty");
    }
    let images = with_images(&m, &a.image, &mut prompt)?;
    let config = LaneConfig { draft_max_streams: a.draft.max_streams(&m.device), ..lane_config(&m) };
    let text = Arc::new(TokenizerText(m.tokenizer()?.clone()));
    let lane = Lane::spawn_with_drafter(m.backend, m.drafter, text, config);
    let req = Request {
        prompt,
        sampling: a.sampling.params(&defaults),
        stop: StopRules { max_tokens: Some(a.max_tokens), stop_ids: Vec::new(), stop_strings: a.stop.clone(), ignore_eos: a.ignore_eos },
        images,
        ..Request::default()
    };
    let t0 = Instant::now();
    let handle = lane.submit(req).context("the request was refused")?;
    let mut out = std::io::stdout().lock();
    if !a.chat {
        write!(out, "{}", a.prompt)?;
    }
    let mut ttft = None;
    for ev in handle {
        match ev {
            Event::Token { text, .. } => {
                ttft.get_or_insert_with(|| t0.elapsed());
                write!(out, "{text}")?;
                out.flush()?;
            }
            Event::Finished { reason, usage, tail, timing } => {
                writeln!(out, "{tail}")?;
                out.flush()?;
                if !a.quiet {
                    let total = timing.total.as_secs_f64();
                    let first = timing.ttft.map(|d| d.as_secs_f64()).unwrap_or(total);
                    let gen = usage.completion_tokens.saturating_sub(1) as f64;
                    let st = lane.stats();
                    if st.draft_proposed > 0 {
                        eprintln!(
                            "[drafts: {} proposed, {} accepted, {:.2} tokens per decode round]",
                            st.draft_proposed,
                            st.draft_accepted,
                            (gen + 1.0) / st.decode_rounds.max(1) as f64
                        );
                    }
                    eprintln!(
                        "[{} prompt tokens, {} generated, finish: {}; first token after {:.0} ms, then {:.1} tokens/s]",
                        usage.prompt_tokens,
                        usage.completion_tokens,
                        reason.as_str(),
                        first * 1e3,
                        if total > first { gen / (total - first) } else { 0.0 }
                    );
                }
            }
            Event::Error(e) => bail!("generation failed: {e}"),
            Event::GrammarError(e) => bail!("the output could not follow the grammar: {}", e.lines().next().unwrap_or(&e)),
            Event::Queued { .. } | Event::Started { .. } => {}
        }
    }
    lane.shutdown();
    Ok(())
}
