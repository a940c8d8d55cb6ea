//! Sampling defaults: what a request samples with for each field it leaves
//! out. The model's own (`generation_config.json`, or a GGUF's
//! `general.sampling.*`) where it ships them, field by field; else braid's
//! one set, which `braid run` shares:
//!
//! | field | braid's default |
//! | --- | --- |
//! | temperature | 0.8 |
//! | top_k | 40 |
//! | top_p | 0.95 |
//! | min_p | 0.05 |
//! | repetition_penalty | 1.0 (off) |

use braid_engine::SamplingParams;
use serde_json::{Map, Value};

/// The values a request's absent sampling fields take, and where they came from.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingDefaults {
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    pub repetition_penalty: f32,
    /// Where the values came from, in words (`braid`, or the model file's
    /// name), for the start-up line and `/props`.
    pub source: String,
}

impl Default for SamplingDefaults {
    fn default() -> Self {
        SamplingDefaults { temperature: 0.8, top_k: 40, top_p: 0.95, min_p: 0.05, repetition_penalty: 1.0, source: "braid".into() }
    }
}

impl SamplingDefaults {
    /// braid's set with the fields a `generation_config.json` sets taken
    /// from it; `None` when it sets none of them.
    pub fn from_generation_config(config: &Value, source: &str) -> Option<SamplingDefaults> {
        let num = |k: &str| config.get(k).and_then(Value::as_f64);
        let mut d = SamplingDefaults { source: source.to_string(), ..SamplingDefaults::default() };
        let mut any = false;
        if let Some(t) = num("temperature").filter(|t| (0.0..=2.0).contains(t)) {
            (d.temperature, any) = (t as f32, true);
        }
        if let Some(k) = config.get("top_k").and_then(Value::as_i64) {
            (d.top_k, any) = (k.max(0) as usize, true);
        }
        if let Some(p) = num("top_p").filter(|p| *p > 0.0 && *p <= 1.0) {
            (d.top_p, any) = (p as f32, true);
        }
        if let Some(p) = num("min_p").filter(|p| (0.0..=1.0).contains(p)) {
            (d.min_p, any) = (p as f32, true);
        }
        if let Some(r) = num("repetition_penalty").filter(|r| *r > 0.0) {
            (d.repetition_penalty, any) = (r as f32, true);
        }
        any.then_some(d)
    }

    /// The fields of `sampling` that the request body `map` left out (or
    /// sent as null) take these values.
    pub fn fill(&self, map: &Map<String, Value>, sampling: &mut SamplingParams) {
        let absent = |k: &str| map.get(k).is_none_or(Value::is_null);
        if absent("temperature") {
            sampling.temperature = self.temperature;
        }
        if absent("top_k") {
            sampling.top_k = self.top_k;
        }
        if absent("top_p") {
            sampling.top_p = self.top_p;
        }
        if absent("min_p") {
            sampling.min_p = self.min_p;
        }
        if absent("repetition_penalty") {
            sampling.repetition_penalty = self.repetition_penalty;
        }
    }

    /// The values as JSON (`/props`).
    pub fn to_json(&self) -> Value {
        // As written (0.8), not as the nearest f64 to the f32 (0.800000011920929).
        let short = |v: f32| v.to_string().parse::<f64>().unwrap_or(f64::from(v));
        serde_json::json!({
            "temperature": short(self.temperature),
            "top_k": self.top_k,
            "top_p": short(self.top_p),
            "min_p": short(self.min_p),
            "repetition_penalty": short(self.repetition_penalty),
            "source": self.source,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_generation_config_overrides_only_the_fields_it_sets() {
        let d = SamplingDefaults::from_generation_config(&json!({"temperature": 0.6, "top_p": 0.9, "do_sample": true}), "gen").unwrap();
        assert_eq!((d.temperature, d.top_p, d.top_k, d.min_p), (0.6, 0.9, 40, 0.05));
        assert!(SamplingDefaults::from_generation_config(&json!({"bos_token_id": 1}), "gen").is_none());
    }

    #[test]
    fn only_absent_fields_are_filled() {
        let d = SamplingDefaults::default();
        let mut s = SamplingParams { temperature: 0.0, top_k: 3, ..SamplingParams::default() };
        let body = json!({"temperature": 0, "top_p": null}).as_object().unwrap().clone();
        d.fill(&body, &mut s);
        assert_eq!((s.temperature, s.top_k, s.top_p, s.min_p), (0.0, 40, 0.95, 0.05));
    }
}
