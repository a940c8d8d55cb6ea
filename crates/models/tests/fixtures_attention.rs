//! The attention families on the tiny random fixtures, against transformers:
//! Llama, Qwen2 (untied and tied), Qwen3, Gemma 3 and Gemma 4 (dense and
//! MoE) from HF folders.
//!
//! Every family: layer states as meta.json declares them; logits of one
//! whole-sequence prefill and of incremental decode within `TOL` of the
//! reference; chunk caps 1, 3, 7 and whole bit-identical; marks restored
//! into new streams; several streams batched bit-identical to each alone.

mod fixtures_common;
use fixtures_common::*;

/// Absolute logit tolerance (logits here reach |60| with std ≈ 8).
const TOL: f32 = 1e-4;

macro_rules! family {
    ($m:ident, $name:literal) => {
        mod $m {
            use super::*;

            crate::fixture_checks!($name;
                layer_states_match_meta => check_states(),
                full_forward => check_full(TOL),
                incremental_decode => check_incremental(TOL),
                stepped_prefill => check_stepped(TOL),
                marks => check_marks(TOL),
                multi_stream => check_multi_stream(),
            );
        }
    };
}

family!(llama, "llama");
family!(qwen2, "qwen2");
family!(qwen2_tied, "qwen2_tied");
family!(qwen3, "qwen3");
family!(gemma3, "gemma3_text");
family!(gemma4, "gemma4_text");
family!(gemma4_moe, "gemma4_text_moe");

// Other points of each family's configuration space (`VARIANTS` in
// make_fixtures.py; each meta.json's notes.variant says what differs).
family!(llama_linear_rope, "llama_linear_rope");
family!(llama_attention_bias, "llama_attention_bias");
family!(qwen3_tied, "qwen3_tied");
family!(gemma3_softcap, "gemma3_softcap");
family!(gemma3_six, "gemma3_text_six");
family!(gemma4_k_eq_v, "gemma4_text_k_eq_v");

use braid_models::gemma3::Gemma3;
use braid_models::gemma4::Gemma4;
use braid_models::{Model, ModelBackend, Source};
use braid_ops::cpu::Cpu;
use braid_ops::KvShape;
use serde_json::{json, Value};

/// Logits of the whole sequence through `model` (a fixture model altered by a test).
fn full_logits(fx: &Fixture, model: Box<dyn Model<Cpu>>) -> Vec<f32> {
    let mut be = ModelBackend::new(Cpu::new(None), model, backend_config()).unwrap();
    stepped(&mut be, 1, &fx.tokens, usize::MAX)
}

/// The model with its sliding window widened past the sequence agrees with
/// the reference on the rows the window does not cut, and is far off after:
/// so the 40-token fixture exercises the window, and the match of the real
/// model shows sliding layers read only the last `window` positions.
fn check_window_matters(fx: &Fixture, window: usize, wide: Box<dyn Model<Cpu>>) {
    let v = fx.vocab;
    let got = full_logits(fx, wide);
    let want = fx.logits("logits_full");
    assert_close(&format!("{} without window, rows < {window}", fx.name), &got[..window * v], &want[..window * v], v, TOL);
    let d = diff(&got[window * v..], &want[window * v..], v);
    assert!(d.max > 0.1, "{}: widening the window changed later logits by only {:.2e}", fx.name, d.max);
}

#[test]
fn gemma3_sliding_layers_see_only_the_window() {
    let fx = Fixture::load("gemma3_text");
    let dev = Cpu::new(None);
    let mut m = Gemma3::load(&dev, &Source::open(&fx.dir).unwrap(), &|_, _| {}).unwrap();
    assert_eq!(m.cfg.window, 8);
    m.cfg.window = 1 << 20;
    check_window_matters(&fx, 8, Box::new(m));
}

#[test]
fn gemma4_sliding_layers_see_only_the_window() {
    for name in ["gemma4_text", "gemma4_text_moe"] {
        let fx = Fixture::load(name);
        let dev = Cpu::new(None);
        let mut m = Gemma4::load(&dev, &Source::open(&fx.dir).unwrap(), &|_, _| {}).unwrap();
        assert_eq!(m.cfg.window, 8);
        m.cfg.window = 1 << 20;
        check_window_matters(&fx, 8, Box::new(m));
    }
}

#[test]
fn gemma4_shared_kv_tail_holds_no_cache() {
    // Dense: layers 2 and 3 reuse layers 0 and 1's cache, so the pool has two layers.
    let be = Fixture::load("gemma4_text").backend();
    let kv = be.model().kv_layers();
    assert_eq!(kv, vec![KvShape { kv_heads: 2, head_dim: 16 }, KvShape { kv_heads: 2, head_dim: 32 }]);
    // MoE: no sharing; global layers have one kv head of 32 (K = V).
    let be = Fixture::load("gemma4_text_moe").backend();
    let g = KvShape { kv_heads: 1, head_dim: 32 };
    let l = KvShape { kv_heads: 2, head_dim: 16 };
    assert_eq!(be.model().kv_layers(), vec![l, g, l, g]);
}

/// A copy of a fixture folder with `edit` applied to its config.json (the
/// weights linked, not copied).
fn with_config(fx: &Fixture, tag: &str, edit: impl Fn(&mut Value)) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("braid-fixture-{}-{tag}-{}", fx.name, std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut cfg = fx.config.clone();
    edit(&mut cfg);
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&cfg).unwrap()).unwrap();
    let weights = fx.dir.join("model.safetensors").canonicalize().unwrap();
    if std::os::unix::fs::symlink(&weights, dir.join("model.safetensors")).is_err() {
        std::fs::copy(&weights, dir.join("model.safetensors")).unwrap();
    }
    dir
}

/// The config as the Hub writes it must load to the same model.
fn check_hub_form(name: &str, edit: impl Fn(&mut Value)) {
    let fx = Fixture::load(name);
    let dir = with_config(&fx, "hub", edit);
    let dev = Cpu::new(None);
    let (_src, model) = braid_models::open(&dev, &dir).unwrap();
    let got = full_logits(&fx, model);
    std::fs::remove_dir_all(&dir).unwrap();
    assert_close(&format!("{name} (Hub-form config)"), &got, fx.logits("logits_full"), fx.vocab, TOL);
}

fn remove(cfg: &mut Value, key: &str) -> Value {
    cfg.as_object_mut().unwrap().remove(key).unwrap_or(Value::Null)
}

#[test]
fn hub_form_configs_load_the_same_models() {
    // Llama / Qwen3: rope_theta at the top instead of rope_parameters.
    for name in ["llama", "qwen2", "qwen2_tied", "qwen3"] {
        check_hub_form(name, |c| {
            let p = remove(c, "rope_parameters");
            c["rope_theta"] = p["rope_theta"].clone();
        });
    }
    // Gemma 3: rope_theta + rope_local_base_freq, softcaps as the Infinity float.
    check_hub_form("gemma3_text", |c| {
        let p = remove(c, "rope_parameters");
        c["rope_theta"] = p["full_attention"]["rope_theta"].clone();
        c["rope_local_base_freq"] = p["sliding_attention"]["rope_theta"].clone();
        c["final_logit_softcapping"] = json!({"__float__": "Infinity"});
    });
    // Gemma 4: global_head_dim / num_global_key_value_heads instead of per_layer_config.
    check_hub_form("gemma4_text", |c| {
        remove(c, "per_layer_config");
        c["global_head_dim"] = json!(32);
    });
    // transformers zero-pads per_layer_config's keys past 9 layers ("03").
    check_hub_form("gemma4_text", |c| {
        let p = remove(c, "per_layer_config");
        let padded: serde_json::Map<String, Value> =
            p.as_object().unwrap().iter().map(|(k, v)| (format!("{:02}", k.parse::<usize>().unwrap()), v.clone())).collect();
        assert!(!padded.is_empty());
        c["per_layer_config"] = Value::Object(padded);
    });
    check_hub_form("gemma4_text_moe", |c| {
        remove(c, "per_layer_config");
        c["global_head_dim"] = json!(32);
        c["num_global_key_value_heads"] = json!(1);
    });
}

/// A Gemma 4 config that loses its global layers' head dim (no
/// per_layer_config, no global_head_dim) is refused at load by name.
#[test]
fn a_gemma4_config_that_misreads_a_head_dim_is_refused() {
    let fx = Fixture::load("gemma4_text");
    let dir = with_config(&fx, "no-global-dim", |c| {
        remove(c, "per_layer_config");
    });
    let err = braid_models::open(&Cpu::new(None), &dir).err().expect("a wrong head dim must not load");
    std::fs::remove_dir_all(&dir).unwrap();
    let msg = format!("{err:#}");
    assert!(msg.contains("layer 1's k_proj has 64 rows") && msg.contains("2 KV heads of 16"), "{msg}");
}

/// A config that miscounts KV heads is refused at load, naming the block
/// and the projection (it panicked in the first forward's KV write).
#[test]
fn a_config_that_miscounts_kv_heads_is_refused() {
    for name in ["llama", "qwen3", "gemma3_text", "lfm2", "minimax_m2"] {
        let fx = Fixture::load(name);
        let dir = with_config(&fx, "other-kv-heads", |c| {
            let kv = c["num_key_value_heads"].as_u64().unwrap();
            c["num_key_value_heads"] = json!(if kv == 1 { 2 } else { 1 });
        });
        let err = braid_models::open(&Cpu::new(None), &dir).err().map(|e| format!("{e:#}"));
        std::fs::remove_dir_all(&dir).unwrap();
        let msg = err.unwrap_or_else(|| panic!("{name}: a KV head count the weights disagree with must not load"));
        assert!(msg.contains(": the attention's k projection is") && msg.contains("config gives"), "{name}: {msg}");
    }
}

#[test]
fn unsupported_rope_types_are_refused() {
    let fx = Fixture::load("llama");
    let dir = with_config(&fx, "yarn", |c| c["rope_parameters"]["rope_type"] = json!("yarn"));
    let err = braid_models::open(&Cpu::new(None), &dir).err().expect("a yarn config must not load as plain RoPE");
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(format!("{err:#}").contains("rope_type 'yarn'"), "{err:#}");
}

/// Qwen2's q/k/v biases change the fixture's logits well past the
/// tolerance: the same weights without them are far off.
#[test]
fn qwen2_biases_matter() {
    for name in ["qwen2", "qwen2_tied"] {
        let fx = Fixture::load(name);
        // The biases renamed out of the model's reach; qwen2 requires them, llama reads them where present.
        let dir = with_weights(&fx, "no-bias", |h, _| {
            let biases: Vec<String> = h.keys().filter(|k| k.ends_with("_proj.bias")).cloned().collect();
            for (i, b) in biases.iter().enumerate() {
                let v = h.remove(b).unwrap();
                h.insert(format!("unused.{i}"), v);
            }
        });
        std::fs::write(dir.join("config.json"), std::fs::read_to_string(fx.dir.join("config.json")).unwrap().replace("\"qwen2\"", "\"llama\"")).unwrap();
        let (_src, model) = braid_models::open(&Cpu::new(None), &dir).unwrap();
        let got = full_logits(&fx, model);
        std::fs::remove_dir_all(&dir).unwrap();
        let d = diff(&got, fx.logits("logits_full"), fx.vocab);
        assert!(d.max > 0.1, "{name}: leaving the biases out changed the logits by only {:.2e}", d.max);
    }
}

/// An untied Qwen2 config whose weights hold no head is refused with the reason.
#[test]
fn qwen2_untied_without_a_head_is_refused() {
    let fx = Fixture::load("qwen2_tied");
    let dir = with_config(&fx, "untied", |c| c["tie_word_embeddings"] = json!(false));
    let err = braid_models::open(&Cpu::new(None), &dir).err().expect("an untied config without lm_head.weight must not load");
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(format!("{err:#}").contains("lm_head.weight"), "{err:#}");
}

/// A copy of fixture `fx`'s folder whose model.safetensors header (and
/// data, which `edit` may extend) `edit` changes.
fn with_weights(fx: &Fixture, tag: &str, edit: impl FnOnce(&mut serde_json::Map<String, Value>, &mut Vec<u8>)) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("braid-{}-{tag}-{}", fx.name, std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(fx.dir.join("config.json"), dir.join("config.json")).unwrap();
    let bytes = std::fs::read(fx.dir.join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let mut data = bytes[8 + n..].to_vec();
    edit(header.as_object_mut().unwrap(), &mut data);
    let mut h = serde_json::to_vec(&header).unwrap();
    h.resize(h.len().div_ceil(8) * 8, b' ');
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    out.extend_from_slice(&data);
    std::fs::write(dir.join("model.safetensors"), out).unwrap();
    dir
}

/// A tensor braid does not read is refused, naming it, rather than dropped:
/// the llama fixture with an MLP bias added (`mlp_bias`) does not load.
#[test]
fn unread_mlp_bias_is_refused() {
    let fx = Fixture::load("llama");
    let dir = with_weights(&fx, "mlp-bias", |h, data| {
        let at = data.len();
        data.resize(at + 128 * 4, 0);
        h.insert("model.layers.0.mlp.gate_proj.bias".into(), json!({"dtype": "F32", "shape": [128], "data_offsets": [at, data.len()]}));
    });
    let err = match braid_models::open(&Cpu::new(None), &dir) {
        Ok(_) => panic!("a llama with an MLP bias loaded"),
        Err(e) => format!("{e:#}"),
    };
    std::fs::remove_dir_all(&dir).ok();
    assert!(err.contains("model.layers.0.mlp.gate_proj.bias") && err.contains("not supported"), "{err}");
}
