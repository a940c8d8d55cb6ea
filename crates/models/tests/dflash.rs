//! The DFlash and DSpark drafters against their PyTorch references
//! (`scripts/fixtures/make_dflash.py`, `make_dspark.py`): tiny random
//! drafters for the gemma3_text fixture, in the authors' layouts and in
//! speculators', fed the target's hidden rows as transformers computes them.

mod fixtures_common;

use std::path::Path;

use braid_engine::Drafter;
use braid_models::dflash::{DFlash, DFlashConfig, DFlashDrafter};
use braid_models::Source;
use braid_ops::cpu::Cpu;
use braid_ops::KvDtype;
use fixtures_common::*;
use serde_json::json;

const TOL: f32 = 1e-4;

struct Case {
    drafter: DFlashDrafter<Cpu>,
    reference: std::collections::HashMap<String, RefTensor>,
    tokens: Vec<u32>,
    width: usize,
}

fn case(name: &str) -> Case {
    let dir = fixtures_dir().join(name);
    let target = Source::open(&fixtures_dir().join("gemma3_text")).unwrap();
    let model = DFlash::load(&Cpu::new(None), &dir, &target).unwrap_or_else(|e| panic!("{name}: {e:#}"));
    let width = model.feature_dim();
    // Blocks of 4 rows: contexts and blocks cross block boundaries.
    let drafter = DFlashDrafter::new(Cpu::new(None), model, 1024, 4, KvDtype::F32).unwrap();
    let reference = read_safetensors(&dir.join("reference.safetensors"));
    let tokens = reference["tokens"].data.iter().map(|&t| t as u32).collect();
    Case { drafter, reference, tokens, width }
}

impl Case {
    fn features(&self, from: usize, to: usize) -> &[f32] {
        &self.reference["features"].data[from * self.width..to * self.width]
    }

    /// Absorb rows `from..to` of the reference features in `pieces` calls.
    fn absorb(&mut self, stream: u64, from: usize, to: usize, pieces: usize) {
        let step = (to - from).div_ceil(pieces).max(1);
        let mut at = from;
        while at < to {
            let end = (at + step).min(to);
            let f = self.features(at, end).to_vec();
            let t = self.tokens[at..end].to_vec();
            self.drafter.absorb(stream, &t, &f);
            at = end;
        }
    }

    /// Propose after token `n` and check the block logits against `logits_n`.
    /// A new stream fed the first `n` rows in `pieces`, then checked.
    fn fresh(&mut self, stream: u64, n: usize, pieces: usize) -> Vec<u32> {
        self.drafter.open(stream, &[]);
        self.absorb(stream, 0, n, pieces);
        self.check(stream, n)
    }

    fn check(&mut self, stream: u64, n: usize) -> Vec<u32> {
        let picks = self.drafter.propose_block(stream, self.tokens[n], 3).unwrap();
        let want = &self.reference[&format!("logits_{n}")];
        assert_close(&format!("block logits after {n} rows"), &self.drafter.last_logits, &want.data, want.shape[1], TOL);
        assert_eq!(picks.len(), 3, "block_size 4 proposes 3 tokens");
        picks
    }
}

fn cases(c: &Case) -> Vec<usize> {
    c.reference["cases"].data.iter().map(|&n| n as usize).collect()
}

#[test]
fn native_layout_matches_the_reference() {
    let mut c = case("dflash_gemma3");
    assert_eq!(c.drafter.model().cfg.target_layers, vec![0, 2]);
    assert_eq!(c.width, 128);
    for (i, n) in cases(&c).into_iter().enumerate() {
        let stream = i as u64;
        let picks = c.fresh(stream, n, 1);
        // Greedy picks are the logits' argmax, in the target's ids.
        let rows: Vec<u32> = c.drafter.last_logits.chunks(256).map(braid_ops::argmax_host).collect();
        assert_eq!(picks, rows);
        // Asked for the first proposal only, the head runs on that row alone.
        let first = c.drafter.propose_block(stream, c.tokens[n], 1).unwrap();
        assert_eq!(first, picks[..1]);
        assert_close("the first row alone", &c.drafter.last_logits, &c.reference[&format!("logits_{n}")].data[..256], 256, TOL);
    }
}

#[test]
fn context_kept_across_proposals_matches_the_reference() {
    // One stream: the context grows in pieces between proposals, as the
    // lane feeds it (prompt chunks, then each round's kept rows), and each
    // proposal's block rows are overwritten by the context that follows.
    let mut c = case("dflash_gemma3");
    c.drafter.open(7, &[]);
    c.absorb(7, 0, 5, 2);
    c.check(7, 5);
    c.absorb(7, 5, 24, 3);
    c.check(7, 24);
    c.absorb(7, 24, 31, 7);
    c.check(7, 31);
    // A forgotten stream starts over: its blocks are free again.
    c.drafter.forget(7);
    c.fresh(7, 24, 1);
}

#[test]
fn speculators_layout_matches_the_reference_and_maps_draft_ids() {
    let mut c = case("dflash_gemma3_speculators");
    assert_eq!(c.drafter.model().logits_width(), 128);
    for (i, n) in cases(&c).into_iter().enumerate() {
        let picks = c.fresh(i as u64, n, 2);
        // The fixture's draft vocabulary is the odd tokens: d2t maps draft
        // column i to target token 2i + 1.
        let cols: Vec<u32> = c.drafter.last_logits.chunks(128).map(braid_ops::argmax_host).collect();
        assert_eq!(picks, cols.iter().map(|&i| 2 * i + 1).collect::<Vec<_>>());
    }
}

#[test]
fn layouts_braid_cannot_run_are_refused_by_name() {
    let dir = Path::new("/nonexistent");
    let base = json!({"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4, "intermediate_size": 64, "vocab_size": 256,
        "architectures": ["DFlashDraftModel"], "dflash_config": {"target_layer_ids": [0], "mask_token_id": 3}, "block_size": 4});
    assert!(DFlashConfig::from_folder(dir, &base).is_ok());
    let err = |edit: &dyn Fn(&mut serde_json::Value)| {
        let mut v = base.clone();
        edit(&mut v);
        format!("{:#}", DFlashConfig::from_folder(dir, &v).unwrap_err())
    };
    assert!(err(&|v| v["architectures"] = json!(["LlamaForCausalLM"])).contains("not a DFlash or DSpark drafter"));
    assert!(err(&|v| v["layer_types"] = json!(["sliding_attention"])).contains("sliding_attention"));
    assert!(err(&|v| v["dflash_config"]["mask_token_id"] = json!(null)).contains("mask_token_id"));
    assert!(err(&|v| v["block_size"] = json!(1)).contains("block_size"));
    assert!(err(&|v| v["speculators_model_type"] = json!("eagle3")).contains("eagle3"));
}

/// DSpark's block: the logits with the Markov bias, the sequential greedy
/// picks and the confidences, against `make_dspark.py`.
fn check_dspark(name: &str) {
    let mut c = case(name);
    assert_eq!(c.drafter.model().cfg.markov_rank, Some(8));
    for (i, n) in cases(&c).into_iter().enumerate() {
        let picks = c.fresh(i as u64, n, 2);
        let want: Vec<u32> = c.reference[&format!("draft_{n}")].data.iter().map(|&t| t as u32).collect();
        assert_eq!(picks, want, "{name}: the greedy proposal after {n} rows");
        let conf = &c.reference[&format!("confidence_{n}")];
        assert_close(&format!("{name}: confidence after {n} rows"), &c.drafter.last_confidence, &conf.data, conf.data.len(), TOL);
        // Asked for fewer rows, the first ones are the same.
        let first = c.drafter.propose_block(i as u64, c.tokens[n], 2).unwrap();
        assert_eq!(first, want[..2]);
    }
}

#[test]
fn dspark_deepseek_layout_matches_the_reference() {
    // Its own embedding and head, a Markov head and a confidence head.
    check_dspark("dspark_gemma3");
}

#[test]
fn dspark_speculators_layout_matches_the_reference() {
    // The target's embedding and head, with the Markov and confidence heads.
    check_dspark("dspark_gemma3_speculators");
}

#[test]
fn dspark_heads_braid_cannot_run_are_refused_by_name() {
    let dir = Path::new("/nonexistent");
    let base = json!({"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4, "intermediate_size": 64, "vocab_size": 256,
        "architectures": ["DSparkDraftModel"], "block_size": 4,
        "dspark_config": {"target_layer_ids": [0], "mask_token_id": 3, "markov_rank": 8, "markov_head_type": "vanilla"}});
    assert_eq!(DFlashConfig::from_folder(dir, &base).unwrap().markov_rank, Some(8));
    let err = |edit: &dyn Fn(&mut serde_json::Value)| {
        let mut v = base.clone();
        edit(&mut v);
        format!("{:#}", DFlashConfig::from_folder(dir, &v).unwrap_err())
    };
    assert!(err(&|v| v["dspark_config"]["markov_head_type"] = json!("rnn")).contains("'rnn' is not supported"));
    assert!(err(&|v| v["dspark_config"]["markov_rank"] = json!(null)).contains("no markov_rank"));
    assert!(err(&|v| v["dspark_config"]["markov_rank"] = json!(0)).contains("markov_rank 0"));
}
