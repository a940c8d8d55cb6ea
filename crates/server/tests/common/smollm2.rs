//! SmolLM2 from the model cache behind a real lane, for the tests that
//! serve a real model.

use std::sync::Arc;

use braid_engine::{Lane, LaneConfig};
use braid_formats::cache::cached_model;
use braid_formats::gguf::Gguf;
use braid_formats::template::ChatTemplate;
use braid_formats::tokenizer::Tokenizer;
use braid_models::{BackendConfig, ModelBackend};
use braid_ops::cpu::Cpu;
use braid_server::{ModelInfo, TokenizerText};

pub const MODEL: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// A lane over SmolLM2 (streams of `context` tokens, `kv_tokens` of KV
/// memory, the rest of `lane_cfg`) and what the server needs of the model;
/// `None`, said, where the model is not fetched.
pub fn lane(lane_cfg: LaneConfig, context: usize, kv_tokens: usize) -> Option<(Lane, ModelInfo)> {
    let Some(path) = cached_model(MODEL) else {
        eprintln!("SKIP: {MODEL} not in the model cache (run `braid fetch smollm2`)");
        return None;
    };
    let gguf = Gguf::open(&path).expect("open gguf");
    let tokenizer = Arc::new(Tokenizer::from_gguf(&gguf).expect("tokenizer"));
    let template = ChatTemplate::from_gguf(&gguf, &tokenizer).expect("template");
    let dev = Cpu::new(None);
    let (_src, model) = braid_models::open(&dev, &path).expect("load model");
    let backend = ModelBackend::new(dev, model, BackendConfig { context, kv_tokens, max_streams: 16, ..BackendConfig::default() }).expect("backend");
    let lane_cfg = LaneConfig { eos_ids: tokenizer.stop_ids(), max_context: context, ..lane_cfg };
    let lane = Lane::spawn(Box::new(backend), Arc::new(TokenizerText(tokenizer.clone())), lane_cfg);
    let stop_ids = tokenizer.stop_ids();
    Some((lane, ModelInfo { tokenizer, template, context, stop_ids, vision: None }))
}
