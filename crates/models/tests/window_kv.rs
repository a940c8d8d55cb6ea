//! Sliding-window layers that keep only their window (a KV group of their
//! own, see `backend.rs`' `WindowGroup`), on the Gemma 3 and Gemma 4
//! fixtures: prompts many windows long give the same logits, bit for bit,
//! as the same backend keeping every row in every layer
//! (`BackendConfig::window_kv` off), whole, stepped, batched, after
//! rewinds and marks; a stream holds a bounded number of window blocks, so
//! one longer than the window group runs; and the prefix cache starts a
//! prompt only where the window group still holds the window before it.

mod fixtures_common;

use std::sync::Arc;

use braid_engine::{
    Backend, DecodeRow, DraftModel, DraftModelConfig, Drafter, Lane, LaneConfig, NgramConfig, PromptLookup, Request, SamplingParams, StopRules, StreamId,
};
use braid_models::backend::REWIND_ROWS;
use braid_models::{BackendConfig, LayerState, ModelBackend};
use braid_ops::cpu::Cpu;
use fixtures_common::{backend_config, tokens, Fixture, NoText};

/// The fixtures with sliding-window layers (windows of 8 and 5 rows).
const WINDOWED: [&str; 6] = ["gemma3_text", "gemma3_softcap", "gemma3_text_six", "gemma4_text", "gemma4_text_moe", "gemma4_text_k_eq_v"];

/// Blocks of 4 rows (from `backend_config`): a window spans several.
fn config(window_kv: bool) -> BackendConfig {
    BackendConfig { window_kv, ..backend_config() }
}

fn window_of(be: &ModelBackend<Cpu>) -> usize {
    be.model().layer_states().iter().filter_map(|l| if let LayerState::SlidingKv { window } = l { Some(*window) } else { None }).max().unwrap()
}

/// The most window blocks a stream holds between forwards, past its first.
fn bound(be: &ModelBackend<Cpu>) -> usize {
    (window_of(be) + REWIND_ROWS).div_ceil(backend_config().block_tokens) + 2
}

/// `n` token ids of the fixture's vocabulary, varied by `seed`.
fn prompt(f: &Fixture, n: usize, seed: usize) -> Vec<u32> {
    (0..n).map(|i| ((i * 7919 + seed * 104_729 + 13) % f.vocab) as u32).collect()
}

fn argmax(row: &[f32]) -> u32 {
    row.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, &x)| if x > b.1 { (i, x) } else { b }).0 as u32
}

/// Feed `prompt` to the open `stream` in chunks of at most `cap`, then
/// `decode` greedy tokens a round each: every row's logits, and the tokens.
/// Each decode round checks the stream's window blocks stay bounded.
fn run(be: &mut ModelBackend<Cpu>, stream: StreamId, prompt: &[u32], cap: usize, decode: usize) -> (Vec<f32>, Vec<u32>) {
    let vocab = be.model().vocab();
    let mut out = Vec::new();
    let bt = be.fill().block_tokens;
    for c in prompt.chunks(cap.max(1)) {
        out.extend(be.decode_logits(&[DecodeRow { stream, tokens: c.to_vec() }]).unwrap());
        // A chunk's rows are held besides the window of its first row.
        if let Some((held, _)) = be.window_blocks(stream) {
            assert!(held <= bound(be) + c.len().div_ceil(bt), "stream {stream} holds {held} window blocks after a chunk of {}", c.len());
        }
    }
    let mut toks = Vec::new();
    for _ in 0..decode {
        let t = argmax(&out[out.len() - vocab..]);
        toks.push(t);
        out.extend(be.decode_logits(&[DecodeRow { stream, tokens: vec![t] }]).unwrap());
        if let Some((held, _)) = be.window_blocks(stream) {
            assert!(held <= bound(be), "stream {stream} holds {held} window blocks, over {}", bound(be));
        }
    }
    (out, toks)
}

/// `run` on a fresh stream of a fresh backend.
fn alone(f: &Fixture, cfg: BackendConfig, prompt: &[u32], cap: usize, decode: usize) -> (Vec<f32>, Vec<u32>) {
    let mut be = f.backend_with(cfg);
    be.open(1).unwrap();
    run(&mut be, 1, prompt, cap, decode)
}

fn same_bits(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a.to_bits() != b.to_bits()) {
        panic!("{what}: logit {i} differs: {} against {}", got[i], want[i]);
    }
}

/// A 70-token prompt (many windows, 18 blocks) and 12 greedy tokens:
/// window-only KV equals full KV bit for bit, whole and stepped (and
/// stepped equals whole where the model is chunk invariant), and a stream
/// batched with another equals it alone; the window group is reported.
#[test]
fn window_only_kv_is_bit_identical_to_full_kv() {
    for name in WINDOWED {
        let f = Fixture::load(name);
        let (p, q) = (prompt(&f, 70, 1), prompt(&f, 45, 2));
        let full = alone(&f, config(false), &p, usize::MAX, 12);
        let whole = alone(&f, config(true), &p, usize::MAX, 12);
        same_bits(&format!("{name} whole"), &whole.0, &full.0);
        assert_eq!(whole.1, full.1, "{name}: greedy tokens");
        let be = f.backend_with(config(true));
        let (fill, invariant) = (be.fill(), be.model().chunk_invariant());
        assert!(fill.window_blocks_total > 0 && fill.window_blocks_total <= fill.blocks_total, "{name}: {fill:?}");
        assert_eq!(f.backend_with(config(false)).fill().window_blocks_total, 0, "{name}: no window group when off");
        for cap in [1, 5, 9] {
            let w = alone(&f, config(true), &p, cap, 12);
            same_bits(&format!("{name} stepped by {cap}"), &w.0, &alone(&f, config(false), &p, cap, 12).0);
            if invariant {
                same_bits(&format!("{name} stepped by {cap} against whole"), &w.0, &whole.0);
            }
        }
        // Two streams of different lengths decoding in shared rounds.
        let batched = |window_kv: bool| -> Vec<Vec<u32>> {
            let mut be = f.backend_with(config(window_kv));
            let vocab = be.model().vocab();
            let mut last = Vec::new();
            for (id, pr) in [(1, &p), (2, &q)] {
                be.open(id).unwrap();
                let l = run(&mut be, id, pr, 16, 0).0;
                last.push(argmax(&l[l.len() - vocab..]));
            }
            let mut toks = vec![vec![last[0]], vec![last[1]]];
            for _ in 0..11 {
                let rows: Vec<DecodeRow> = (0..2).map(|i| DecodeRow { stream: i as u64 + 1, tokens: vec![*toks[i].last().unwrap()] }).collect();
                let l = be.decode_logits(&rows).unwrap();
                for (i, t) in toks.iter_mut().enumerate() {
                    t.push(argmax(&l[i * vocab..(i + 1) * vocab]));
                }
            }
            toks
        };
        let (wb, fb) = (batched(true), batched(false));
        assert_eq!(wb, fb, "{name}: batched, window-only against full KV");
        if be.capabilities().batch_invariant {
            assert_eq!(wb[0], alone(&f, config(true), &p, 16, 12).1, "{name}: batched against alone");
        }
    }
}

/// A stream of 250 rows in a pool whose window group holds 21 blocks (84
/// rows): it runs (the full layers' 64 blocks hold it), holds no more
/// window blocks than a window's worth at any round, and equals full KV.
#[test]
fn a_stream_longer_than_the_window_group_runs_in_bounded_window_blocks() {
    let f = Fixture::load("gemma3_text");
    let small = |window_kv| BackendConfig { kv_tokens: 256, max_streams: 1, max_marks: 0, max_batch: 8, ..config(window_kv) };
    let p = prompt(&f, 240, 3);
    let mut be = f.backend_with(small(true));
    let fill = be.fill();
    let bt = fill.block_tokens;
    assert!(fill.window_blocks_total * bt < p.len() + 10, "the window group could not hold every row: {fill:?}");
    be.open(1).unwrap();
    let (got, toks) = run(&mut be, 1, &p, 8, 10);
    let fill = be.fill();
    let (held, entries) = be.window_blocks(1).unwrap();
    assert_eq!((fill.window_blocks_used, entries), (held, (p.len() + 10).div_ceil(bt)), "a table entry for every block of rows");
    assert_eq!(fill.blocks_used, (p.len() + 10).div_ceil(bt), "the full layers hold every row");
    let (want, want_toks) = alone(&f, small(false), &p, 8, 10);
    same_bits("a long stream", &got, &want);
    assert_eq!(toks, want_toks);
}

/// Drafts rejected (a rewind into the last forward's rows) and a rewind
/// within `REWIND_ROWS` of a forward's start continue exactly as full KV;
/// a rewind past what the window layers kept is refused, not wrong.
#[test]
fn rewinds_continue_exactly_and_refuse_rows_let_go() {
    let f = Fixture::load("gemma3_text");
    let p = prompt(&f, 60, 4);
    let script = |window_kv: bool| -> (Vec<f32>, bool) {
        let mut be = f.backend_with(config(window_kv));
        be.open(1).unwrap();
        let mut out = run(&mut be, 1, &p, 8, 4).0;
        // A draft of 6 rows, of which 2 are kept.
        out.extend(be.decode_logits(&[DecodeRow { stream: 1, tokens: prompt(&f, 6, 9) }]).unwrap());
        be.rewind(1, 66).unwrap();
        out.extend(run(&mut be, 1, &prompt(&f, 5, 10), 1, 3).0);
        // Cut back by the slack below the last forward's start (row 73 of 74).
        be.rewind(1, 73 - REWIND_ROWS).unwrap();
        out.extend(run(&mut be, 1, &prompt(&f, 3, 11), 3, 3).0);
        let far = be.rewind(1, 20).is_ok();
        (out, far)
    };
    let (w, wfar) = script(true);
    let (full, ffar) = script(false);
    same_bits("rewinds", &w, &full);
    assert!(ffar && !wfar, "a rewind far past the window is refused with window-only KV only");
}

/// A mark holds its window: a stream restored from it continues as the
/// stream it was kept from, bit for bit with full KV.
#[test]
fn a_mark_restores_its_window() {
    let f = Fixture::load("gemma4_text");
    let p = prompt(&f, 50, 5);
    let script = |window_kv: bool| -> Vec<f32> {
        let mut be = f.backend_with(config(window_kv));
        be.open(1).unwrap();
        run(&mut be, 1, &p[..47], 6, 0);
        let mark = be.keep_mark(1).unwrap();
        run(&mut be, 1, &p[47..], 3, 20);
        be.forget(1);
        be.open(2).unwrap();
        assert_eq!(be.restore_mark(2, mark).unwrap(), 47);
        be.drop_mark(mark);
        run(&mut be, 2, &p[47..], 3, 8).0
    };
    same_bits("restored mark", &script(true), &script(false));
}

/// `stream`'s greedy reply to `prompt` from the prefix cache: the rows
/// attached, and the logits of the rows it ran.
fn cached_reply(be: &mut ModelBackend<Cpu>, stream: StreamId, prompt: &[u32]) -> (usize, Vec<f32>) {
    be.open(stream).unwrap();
    let rows = be.attach_prefix(stream, prompt, 0, prompt.len() - 1).unwrap();
    let (l, _) = run(be, stream, &prompt[rows..], 8, 8);
    let vocab = be.model().vocab();
    (rows, l[(prompt.len() - 1 - rows) * vocab..].to_vec())
}

/// The same prompt twice hits the cache and replies as cold; once the
/// window group has evicted the blocks of the prompt's later windows, the
/// next hit starts where the window group still holds the window before
/// it (40 rows of 59 here) and still replies as cold.
#[test]
fn prefix_reuse_starts_where_the_window_is_cached() {
    let f = Fixture::load("gemma3_text");
    let cfg = BackendConfig { kv_tokens: 1024, max_streams: 1, max_marks: 0, max_batch: 16, ..config(true) };
    let p = prompt(&f, 60, 6);
    let (_, cold) = cached_reply(&mut f.backend_with(cfg.clone()), 1, &p);
    let mut be = f.backend_with(cfg.clone());
    assert_eq!(cached_reply(&mut be, 1, &p).0, 0);
    be.forget(1);
    let (rows, warm) = cached_reply(&mut be, 2, &p);
    assert_eq!(rows, 59, "all but the last row");
    same_bits("a cache hit", &warm, &cold);
    be.forget(2);
    // D shares the first 40 rows: it holds again (and lets go last) the
    // window blocks before row 40, rows 32..40.
    let mut d = p[..40].to_vec();
    d.extend(prompt(&f, 8, 7));
    assert_eq!(cached_reply(&mut be, 3, &d).0, 40);
    be.forget(3);
    // A new prompt evicts, oldest first, the other 16 window blocks of p.
    be.open(4).unwrap();
    be.attach_prefix(4, &prompt(&f, 200, 8), 0, 199).unwrap();
    let before = be.fill().window_blocks_evicted;
    let q = prompt(&f, 250, 8);
    for c in q.chunks(4) {
        if be.fill().window_blocks_evicted >= before + 16 {
            break;
        }
        be.decode_logits(&[DecodeRow { stream: 4, tokens: c.to_vec() }]).unwrap();
    }
    assert_eq!(be.fill().window_blocks_evicted, before + 16, "{:?}", be.fill());
    assert_eq!(be.fill().blocks_evicted, 0, "the full layers kept every block");
    be.forget(4);
    let (rows, warm) = cached_reply(&mut be, 5, &p);
    assert_eq!(rows, 40, "the window group holds rows 32..40 only of p's windows");
    same_bits("a hit cut back to its cached window", &warm, &cold);
}

/// A model without window layers has no window group (and its batches no
/// window rows); where the full group holds every stream's whole context,
/// Gemma 3's window group is a fraction of it.
#[test]
fn the_window_group_is_sized_by_streams_and_windows() {
    for name in ["llama", "qwen3"] {
        let f = Fixture::load(name);
        let mut be = f.backend();
        be.open(1).unwrap();
        run(&mut be, 1, &prompt(&f, 30, 1), 8, 2);
        assert_eq!((be.fill().window_blocks_total, be.window_blocks(1)), (0, None), "{name}");
    }
    let f = Fixture::load("gemma3_text");
    let be = f.backend_with(BackendConfig { kv_tokens: 4 * 256, max_streams: 4, max_batch: 16, ..config(true) });
    let fill = be.fill();
    // 2 * 4 streams of 8 blocks, 2 rounds of 4, and an eighth of 256: no marks, as a lane keeps none here.
    assert_eq!((fill.blocks_total, fill.window_blocks_total), (256, 8 * 8 + 8 + 32));
}

/// Through a lane, as `braid serve` runs it: long prompts in small chunks
/// beside decoding streams, then the same prompts again one at a time
/// (from the prefix cache), with no drafter, an n-gram drafter and a Gemma 3 draft model
/// (itself with window-only KV: its backend cuts back the drafts it fed):
/// greedy replies equal full KV's.
#[test]
fn a_lane_with_drafts_and_the_prefix_cache_answers_as_full_kv() {
    let f = Fixture::load("gemma3_text");
    // Repeating runs, so the n-gram drafter finds proposals.
    let prompts: Vec<Vec<u32>> = (0..3).map(|i| prompt(&f, 9, 20 + i).into_iter().cycle().take(50 + 15 * i).collect()).collect();
    let serve = |window_kv: bool, drafter: &str| -> Vec<Vec<u32>> {
        let d: Option<Box<dyn Drafter>> = match drafter {
            "ngram" => Some(Box::new(PromptLookup::new(NgramConfig { min_n: 1, ..NgramConfig::default() }))),
            "model" => {
                let draft = Fixture::load("gemma3_softcap").backend_with(config(window_kv));
                Some(Box::new(DraftModel::new(Box::new(draft), DraftModelConfig { max_tokens: 4, patience: 4 }).unwrap()))
            }
            _ => None,
        };
        let lane_cfg = LaneConfig { chunk_tokens: 7, max_rows: Some(5), max_running: 8, draft_max_streams: 8, ..LaneConfig::default() };
        let l = Lane::spawn_with_drafter(Box::new(f.backend_with(config(window_kv))), d, Arc::new(NoText), lane_cfg);
        let req = |p: &Vec<u32>| Request {
            prompt: p.clone(),
            sampling: SamplingParams::greedy(),
            stop: StopRules { max_tokens: Some(30), ignore_eos: true, ..Default::default() },
            ..Default::default()
        };
        let hs: Vec<_> = prompts.iter().map(|p| l.submit(req(p)).unwrap()).collect();
        let mut out: Vec<Vec<u32>> = hs.into_iter().map(tokens).collect();
        out.extend(prompts.iter().map(|p| tokens(l.submit(req(p)).unwrap())));
        if drafter != "none" {
            assert!(l.stats().draft_proposed > 0, "{drafter}: {:?}", l.stats());
        }
        out
    };
    let want = serve(false, "none");
    assert_eq!(want[..3], want[3..], "the prefix cache changed a reply");
    for drafter in ["none", "ngram", "model"] {
        assert_eq!(serve(true, drafter), want, "window-only KV with drafter {drafter}");
    }
}

/// A Gemma 3 draft model with window-only KV, driven as a lane drives it
/// (propose, verify against the target's tokens, absorb what was kept):
/// the target follows the draft model's own greedy tokens but for two in
/// every seven, so drafts are cut back below the start of the draft
/// backend's last forward (with no rewind slack, `REWIND_ROWS` 0, this
/// fails), without an error, proposing what the same draft model with
/// full KV proposes.
#[test]
fn a_draft_model_cuts_back_its_rejected_drafts() {
    let d = Fixture::load("gemma3_softcap");
    let mut target = prompt(&d, 40, 30);
    {
        let mut be = d.backend_with(config(false));
        be.open(1).unwrap();
        let mut l = run(&mut be, 1, &target, 64, 0).0;
        for i in 0..90 {
            let t = argmax(&l[l.len() - d.vocab..]);
            // Two changed in a row: a draft after the first misses at once.
            let t = match i % 7 {
                5 => (t + 1) % d.vocab as u32,
                6 => (t + 2) % d.vocab as u32,
                _ => t,
            };
            target.push(t);
            l = be.decode_logits(&[DecodeRow { stream: 1, tokens: vec![t] }]).unwrap();
        }
    }
    let drive = |window_kv: bool| -> Vec<Vec<u32>> {
        let mut m = DraftModel::new(Box::new(d.backend_with(config(window_kv))), DraftModelConfig { max_tokens: 6, patience: 100 }).unwrap();
        m.open(1, &target[..40]);
        let (mut at, mut proposals) = (40, Vec::new());
        while at + 8 < target.len() {
            let last = target[at];
            let draft = m.propose(1, last);
            let kept = 1 + draft.iter().zip(&target[at + 1..]).take_while(|(a, b)| a == b).count();
            let mut fed = vec![last];
            fed.extend(&draft);
            m.absorb(1, &fed[..kept.min(fed.len())], &[]);
            assert_eq!(m.last_error, None, "after {} proposals", proposals.len());
            proposals.push(draft);
            at += kept.min(fed.len());
        }
        proposals
    };
    let got = drive(true);
    assert!(got.iter().filter(|p| p.len() >= 4).count() > 5, "long drafts: {got:?}");
    assert_eq!(got, drive(false));
}
