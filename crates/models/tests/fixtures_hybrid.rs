//! The hybrid families on the tiny random fixtures, against transformers:
//! LFM2, LFM2-MoE, Nemotron-H, MiniMax (linear attention), MiniMax-M2,
//! the MiniMax-M3 text tower (block-sparse attention), Granite 4
//! (Mamba2 + attention + MoE) and Qwen3-Next (gated DeltaNet + gated
//! attention + MoE with a shared expert), from HF folders.
//!
//! Every family: declared state kinds; logits of one full forward and of
//! incremental decode within 1e-4 of transformers; chunk caps 1, 3, 7 and
//! whole bit-identical (each family declares chunk invariance: its scans run
//! step by step); marks restored into a fresh stream continue bit-identically;
//! several streams in one round bit-identical to each alone.

mod fixtures_common;
use fixtures_common::*;

use braid_engine::Backend;

use std::path::PathBuf;

use serde_json::{json, Value};

const TOL: f32 = 1e-4;

/// f32 values of recurrent state per stream, from meta.json's cache shapes:
/// transformers keeps `L` inputs per conv channel where `L - 1` suffice, so
/// braid keeps one fewer.
fn needed_state(fx: &Fixture) -> usize {
    let prod = |v: &Value| v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as usize).product::<usize>();
    let conv = |v: &Value| {
        let s = v.as_array().unwrap();
        s[0].as_u64().unwrap() as usize * (s[1].as_u64().unwrap() as usize - 1)
    };
    fx.meta["state_per_layer"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| match l["kind"].as_str().unwrap() {
            "conv" => conv(&l["shape"]),
            "mamba2" => conv(&l["conv"]) + prod(&l["ssm"]),
            "linear_attention" => prod(&l["shape"]),
            "gated_deltanet" => conv(&l["conv"]) + prod(&l["recurrent"]),
            _ => 0,
        })
        .sum()
}

/// One test per check, so a failure names the family and the check.
macro_rules! family {
    ($name:ident, $fixture:literal, incremental = $inc:literal) => {
        mod $name {
            use super::*;

            #[test]
            fn states() {
                let fx = Fixture::load($fixture);
                fx.check_states();
                let be = fx.backend();
                assert!(be.model().chunk_invariant(), "{} should declare chunk invariance", $fixture);
                assert_eq!(be.model().state_size(), needed_state(&fx), "{}: state_size()", $fixture);
                // Recurrent state cannot be cut back: such a backend must not offer rewind.
                assert_eq!(be.capabilities().supports_rewind, needed_state(&fx) == 0, "{}: rewind capability", $fixture);
            }

            /// transformers' chunks of 16, 11 and 13 rows on top of the cache.
            #[test]
            fn chunked() {
                let fx = Fixture::load($fixture);
                let mut be = fx.backend();
                be.open(1).unwrap();
                let (a, b) = (16, 16 + 11);
                let mut got = run_rows(&mut be, 1, &fx.tokens[..a]);
                got.extend(run_rows(&mut be, 1, &fx.tokens[a..b]));
                got.extend(run_rows(&mut be, 1, &fx.tokens[b..]));
                assert_close(&format!("{} chunked", $fixture), &got, fx.logits("logits_chunked"), fx.vocab, TOL);
            }

            #[test]
            fn incremental() {
                let fx = Fixture::load($fixture);
                let mut be = fx.backend();
                let got = fixtures_common::incremental(&mut be, 1, &fx.tokens, PREFILL);
                assert_close(&format!("{} incremental vs {}", $fixture, $inc), &got, fx.logits($inc), fx.vocab, TOL);
            }

            crate::fixture_checks!($fixture;
                full => check_full(TOL),
                stepped => check_stepped(TOL),
                marks => check_marks(TOL),
                multi_stream => check_multi_stream(),
            );
        }
    };
}

family!(lfm2, "lfm2", incremental = "logits_incremental");
family!(lfm2_moe, "lfm2_moe", incremental = "logits_incremental");
family!(nemotron_h, "nemotron_h", incremental = "logits_incremental_clamped");
family!(minimax, "minimax", incremental = "logits_incremental");
family!(minimax_m2, "minimax_m2", incremental = "logits_incremental");
family!(minimax_m3, "minimax_m3_vl_text", incremental = "logits_incremental");
family!(granite_hybrid, "granitemoehybrid", incremental = "logits_incremental");
family!(granite_rope_dense, "granitemoehybrid_rope_dense", incremental = "logits_incremental");
family!(qwen3_next, "qwen3_next", incremental = "logits_incremental");

// Other points of each family's configuration space (`VARIANTS` in
// make_fixtures.py; each meta.json's notes.variant says what differs).
family!(lfm2_conv4, "lfm2_conv4", incremental = "logits_incremental");
family!(lfm2_moe_scaled, "lfm2_moe_scaled", incremental = "logits_incremental");
family!(nemotron_h_grouped, "nemotron_h_grouped", incremental = "logits_incremental_clamped");
family!(minimax_plain, "minimax_plain", incremental = "logits_incremental");
family!(minimax_m2_quarter_rope, "minimax_m2_quarter_rope", incremental = "logits_incremental");
family!(minimax_m3_wide_index, "minimax_m3_vl_text_wide_index", incremental = "logits_incremental");
family!(qwen3_next_dense_wide_keys, "qwen3_next_dense_wide_keys", incremental = "logits_incremental");

/// transformers' own decode does not clamp dt (`logits_incremental` drifts
/// by 2e-2 from `logits_full`); braid clamps in decode too, so it must be far
/// from that table while matching the clamped one (checked above).
#[test]
fn nemotron_h_clamps_dt_in_decode() {
    let fx = Fixture::load("nemotron_h");
    let mut be = fx.backend();
    let got = incremental(&mut be, 1, &fx.tokens, PREFILL);
    let d = diff(&got, fx.logits("logits_incremental"), fx.vocab);
    assert!(d.max > 1e-3, "decode matches transformers' unclamped decode ({:.2e}): dt is not clamped", d.max);
}

/// A change to a config.json.
type ConfigEdit = dyn Fn(&mut serde_json::Map<String, Value>);

/// The Hub's older form of the RoPE base: a top-level `rope_theta`, not
/// `rope_parameters`.
fn flat_rope_theta(c: &mut serde_json::Map<String, Value>) {
    let theta = c.remove("rope_parameters").unwrap()["rope_theta"].clone();
    c.insert("rope_theta".into(), theta);
}

/// A copy of a fixture folder with `edit` applied to its config.json (the
/// Hub form of a config, say).
fn edited_fixture(name: &str, tag: &str, edit: &ConfigEdit) -> PathBuf {
    let src = fixtures_dir().join(name);
    let dir = std::env::temp_dir().join(format!("braid-hybrid-{name}-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    edit(cfg.as_object_mut().unwrap());
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&cfg).unwrap()).unwrap();
    std::fs::copy(src.join("model.safetensors"), dir.join("model.safetensors")).unwrap();
    dir
}

/// Full-forward logits of the model in `dir`.
fn full_logits(dir: &std::path::Path, tokens: &[u32]) -> Vec<f32> {
    let dev = braid_ops::cpu::Cpu::new(None);
    let (_src, model) = braid_models::open(&dev, dir).unwrap_or_else(|e| panic!("{}: {e:#}", dir.display()));
    let mut be = braid_models::ModelBackend::new(dev, model, backend_config()).unwrap();
    stepped(&mut be, 1, tokens, usize::MAX)
}

/// Hub-style configs (the forms transformers 5.x rewrites) load to the
/// same model: the same logits bit for bit.
#[test]
fn hub_config_forms() {
    let cases: Vec<(&str, Box<ConfigEdit>)> = vec![
        (
            "lfm2",
            Box::new(|c| {
                let idx: Vec<usize> =
                    c["layer_types"].as_array().unwrap().iter().enumerate().filter(|(_, t)| t.as_str() != Some("conv")).map(|(i, _)| i).collect();
                c.remove("layer_types");
                c.insert("full_attn_idxs".into(), json!(idx));
                flat_rope_theta(c);
            }),
        ),
        (
            "nemotron_h",
            Box::new(|c| {
                let map = |t: &Value| match t.as_str().unwrap() {
                    "linear_attention" => 'M',
                    "full_attention" => '*',
                    "mlp" => '-',
                    "moe" => 'E',
                    t => panic!("{t}"),
                };
                let pattern: String = c["layers_block_type"].as_array().unwrap().iter().map(map).collect();
                c.insert("num_hidden_layers".into(), json!(pattern.len()));
                c.remove("layers_block_type");
                c.insert("hybrid_override_pattern".into(), json!(pattern));
                c.insert("time_step_limit".into(), json!([0.0, 1e30]));
            }),
        ),
        (
            "minimax",
            Box::new(|c| {
                let list: Vec<u32> = c["layer_types"].as_array().unwrap().iter().map(|t| (t.as_str() == Some("full_attention")) as u32).collect();
                c.remove("layer_types");
                c.insert("attn_type_list".into(), json!(list));
                flat_rope_theta(c);
            }),
        ),
        (
            "minimax_m2",
            Box::new(|c| {
                // Hub: rotary_dim (kept) and rope_theta, no partial_rotary_factor.
                flat_rope_theta(c);
            }),
        ),
        (
            "minimax_m3_vl_text",
            Box::new(|c| {
                // Hub: the indexer's settings in sparse_attention_config, per-layer 0/1 lists.
                let ones = |key: &str, yes: &str, c: &mut serde_json::Map<String, Value>| -> Vec<u32> {
                    c.remove(key).unwrap().as_array().unwrap().iter().map(|t| (t.as_str() == Some(yes)) as u32).collect()
                };
                let sparse = ones("layer_types", "minimax_m3_sparse", c);
                let moe = ones("mlp_layer_types", "sparse", c);
                let mut sac = serde_json::Map::new();
                for (flat, legacy) in [
                    ("index_n_heads", "sparse_num_index_heads"),
                    ("index_head_dim", "sparse_index_dim"),
                    ("index_block_size", "sparse_block_size"),
                    ("index_topk_blocks", "sparse_topk_blocks"),
                    ("index_local_blocks", "sparse_local_block"),
                ] {
                    sac.insert(legacy.into(), c.remove(flat).unwrap());
                }
                sac.insert("sparse_attention_freq".into(), json!(sparse));
                c.insert("sparse_attention_config".into(), Value::Object(sac));
                c.insert("moe_layer_freq".into(), json!(moe));
            }),
        ),
        (
            "qwen3_next",
            Box::new(|c| {
                // Hub: no layer_types, full attention every `full_attention_interval`
                // layers (the fixture's third of four).
                c.remove("layer_types");
                c.insert("full_attention_interval".into(), json!(3));
            }),
        ),
    ];
    for (name, edit) in cases {
        let fx = Fixture::load(name);
        let want = full_logits(&fx.dir, &fx.tokens);
        let dir = edited_fixture(name, "hub", edit.as_ref());
        let got = full_logits(&dir, &fx.tokens);
        std::fs::remove_dir_all(&dir).ok();
        assert_bit_identical(&format!("{name} from a Hub-style config"), &got, &want, fx.vocab);
    }
}

/// Config fields transformers' modeling files do not read change nothing
/// (checked once against transformers itself on fixtures made with them):
/// MiniMax-M2 routes by sigmoid, unscaled, whatever `scoring_func` and
/// `routed_scaling_factor` say; Nemotron-H clamps dt to `time_step_min`
/// whatever `time_step_limit` says. Each edit would move the logits if
/// braid read it.
#[test]
fn config_fields_transformers_ignores() {
    let cases: [(&str, Box<ConfigEdit>); 2] = [
        (
            "minimax_m2",
            Box::new(|c| {
                c.insert("scoring_func".into(), json!("softmax"));
                c.insert("routed_scaling_factor".into(), json!(1.5));
            }),
        ),
        ("nemotron_h", Box::new(|c| drop(c.insert("time_step_limit".into(), json!([0.0, 0.01]))))),
    ];
    for (name, edit) in cases {
        let fx = Fixture::load(name);
        let dir = edited_fixture(name, "ignored", edit.as_ref());
        let got = full_logits(&dir, &fx.tokens);
        std::fs::remove_dir_all(&dir).ok();
        assert_bit_identical(&format!("{name} with fields transformers ignores"), &got, &full_logits(&fx.dir, &fx.tokens), fx.vocab);
    }
}

/// MiniMax-M3's block selection and its SwiGLU clamp both shape the
/// fixture's logits: attending to every block, or not clamping, moves them
/// far past the tolerance the model meets.
#[test]
fn minimax_m3_sparsity_and_clamp_matter() {
    let fx = Fixture::load("minimax_m3_vl_text");
    let edits: [(&str, Box<ConfigEdit>); 2] = [
        ("dense", Box::new(|c| drop(c.insert("index_topk_blocks".into(), json!(1000))))),
        ("noclamp", Box::new(|c| drop(c.insert("swiglu_limit".into(), json!(1e9))))),
    ];
    for (tag, edit) in edits {
        let dir = edited_fixture("minimax_m3_vl_text", tag, edit.as_ref());
        let got = full_logits(&dir, &fx.tokens);
        std::fs::remove_dir_all(&dir).ok();
        let d = diff(&got, fx.logits("logits_full"), fx.vocab);
        assert!(d.max > 1e-2, "{tag}: logits moved only {:.2e}", d.max);
    }
}

/// Bad configs and missing tensors are errors that say what is wrong.
#[test]
fn bad_configs_are_errors() {
    let cases: [(&str, &str, Box<ConfigEdit>); 6] = [
        (
            "qwen3_next",
            "layer type `mamba`",
            Box::new(|c| drop(c.insert("layer_types".into(), json!(["linear_attention", "mamba", "full_attention", "linear_attention"])))),
        ),
        ("lfm2", "layer_types", Box::new(|c| drop(c.insert("layer_types".into(), json!(["conv", "conv"]))))),
        (
            "lfm2",
            "model.layers.4",
            Box::new(|c| {
                c.insert("num_hidden_layers".into(), json!(5));
                c.insert("layer_types".into(), json!(["conv", "conv", "full_attention", "conv", "conv"]));
            }),
        ),
        (
            "nemotron_h",
            "hybrid_override_pattern",
            Box::new(|c| {
                c.remove("layers_block_type");
                c.insert("hybrid_override_pattern".into(), json!("MX*-"));
            }),
        ),
        (
            "minimax",
            "attn_type_list",
            Box::new(|c| {
                c.remove("layer_types");
                c.insert("attn_type_list".into(), json!([0, 2, 1, 0]));
            }),
        ),
        ("minimax_m3_vl_text", "indexer heads", Box::new(|c| drop(c.insert("index_n_heads".into(), json!(3))))),
    ];
    for (i, (name, want, edit)) in cases.into_iter().enumerate() {
        let dir = edited_fixture(name, &format!("bad{i}"), edit.as_ref());
        let dev = braid_ops::cpu::Cpu::new(None);
        let err = braid_models::open(&dev, &dir).err().map(|e| format!("{e:#}"));
        std::fs::remove_dir_all(&dir).ok();
        let err = err.unwrap_or_else(|| panic!("{name} case {i}: loaded a bad config"));
        assert!(err.contains(want), "{name} case {i}: error `{err}` does not mention {want}");
    }
}
