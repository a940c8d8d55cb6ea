//! What the start-up line and `/props` tell of a model that its loading
//! does not: the architecture, the parameter count, the template it is
//! served with, and its own sampling defaults.

use std::path::Path;

use anyhow::Result;
use braid_formats::gguf::Gguf;
use braid_formats::safetensors::HfFolder;
use braid_formats::template::{self, TemplateSource};
use braid_server::SamplingDefaults;

use crate::load::Loaded;

/// The architecture (as the file names it) and the weights counted from
/// its tensors; `("?", 0)` where the file cannot say.
pub fn architecture_and_parameters(path: &Path) -> (String, u64) {
    let count = |shape: &[usize]| shape.iter().map(|&d| d as u64).product::<u64>();
    if path.is_dir() {
        let Ok(h) = HfFolder::open(path) else { return ("?".into(), 0) };
        let arch = h.config().get("model_type").and_then(|v| v.as_str()).unwrap_or("?").to_string();
        let names: Vec<String> = h.tensor_names().map(str::to_string).collect();
        let params = names.iter().filter_map(|n| h.tensor(n).ok()).map(|t| count(&t.shape)).sum();
        return (arch, params);
    }
    let Ok(g) = Gguf::open(path) else { return ("?".into(), 0) };
    let arch = g.architecture().unwrap_or("?").to_string();
    (arch, g.tensor_infos().iter().map(|t| count(&t.shape)).sum())
}

/// The model's own sampling defaults: an HF folder's
/// `generation_config.json`, or a GGUF's `general.sampling.*` keys; else
/// braid's set.
pub fn sampling_defaults(path: &Path) -> SamplingDefaults {
    let own = if path.is_dir() {
        let file = path.join("generation_config.json");
        std::fs::read_to_string(&file)
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .and_then(|v| SamplingDefaults::from_generation_config(&v, "generation_config.json"))
    } else {
        Gguf::open(path).ok().and_then(|g| {
            let f = |k: &str| g.opt_f32(&format!("general.sampling.{k}")).ok().flatten().map(|v| serde_json::json!(v));
            let i = |k: &str| g.opt_u64(&format!("general.sampling.{k}")).ok().flatten().map(|v| serde_json::json!(v));
            let mut cfg = serde_json::Map::new();
            for (key, v) in
                [("temperature", f("temp")), ("top_p", f("top_p")), ("min_p", f("min_p")), ("top_k", i("top_k")), ("repetition_penalty", f("penalty_repeat"))]
            {
                if let Some(v) = v {
                    cfg.insert(key.into(), v);
                }
            }
            SamplingDefaults::from_generation_config(&serde_json::Value::Object(cfg), "the GGUF's general.sampling")
        })
    };
    own.unwrap_or_default()
}

/// Puts the template `--chat-template` (or `chat_template.jinja` beside the
/// model) asks for in `m`, and says where it came from.
pub fn choose_template(m: &mut Loaded, flag: Option<&str>) -> Result<TemplateSource> {
    let tok = m.tokenizer()?.clone();
    let (t, source) = template::select(flag, &m.path, m.template.take(), &tok)?;
    m.template = t;
    Ok(source)
}

/// `135M`, `1.7B`: a parameter count as people write it.
pub fn short_count(n: u64) -> String {
    match n {
        0 => "?".into(),
        n if n >= 1_000_000_000 => format!("{:.1}B", n as f64 / 1e9),
        n if n >= 1_000_000 => format!("{}M", (n as f64 / 1e6).round()),
        n => format!("{}K", (n as f64 / 1e3).round()),
    }
}
