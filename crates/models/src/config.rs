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

impl<'a> HfConfig<'a> {
    /// The config `v` read from `dir/config.json`; a multimodal config's
    /// `text_config` is used when present.
    pub fn new(v: &'a Value, dir: &Path) -> HfConfig<'a> {
        let v = v.get("text_config").filter(|t| t.is_object()).unwrap_or(v);
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

    pub fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => match v.as_u64() {
                Some(x) => Ok(Some(x as usize)),
                None => self.bad(key, "a non-negative integer"),
            },
        }
    }

    pub fn usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?.with_context(|| format!("{}: `{key}` is missing", self.path.display()))
    }

    pub fn opt_f32(&self, key: &str) -> Result<Option<f32>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => match as_f64(v) {
                Some(x) => Ok(Some(x as f32)),
                None => self.bad(key, "a number"),
            },
        }
    }

    pub fn f32(&self, key: &str) -> Result<f32> {
        self.opt_f32(key)?.with_context(|| format!("{}: `{key}` is missing", self.path.display()))
    }

    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => match v.as_bool() {
                Some(b) => Ok(Some(b)),
                None => self.bad(key, "true or false"),
            },
        }
    }

    pub fn opt_str(&self, key: &str) -> Result<Option<&'a str>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => match v.as_str() {
                Some(s) => Ok(Some(s)),
                None => self.bad(key, "a string"),
            },
        }
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
    /// (`{"3": {"head_dim": 32}}`).
    pub fn per_layer_usize(&self, layer: usize, key: &str) -> Result<Option<usize>> {
        let Some(v) = self.get("per_layer_config").and_then(|p| p.get(layer.to_string())).and_then(|l| l.get(key)) else { return Ok(None) };
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

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
