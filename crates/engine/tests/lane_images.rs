//! Image rows in a lane, against the recording fake: a pass makes its
//! image rows once, by its first chunk (also when it is stopped and
//! resumed), never cuts inside an image, runs stepped as it runs whole,
//! lets other streams decode between its chunks and between the steps
//! that make its image rows, and the prefix cache tells images apart by
//! their content.

mod common;

use std::sync::{Arc, Mutex};

use braid_engine::fake::{Call, CallLog, FakeBackend, FakeConfig};
use braid_engine::{image_token_ids, prefill_whole, Backend, CutPlan, Event, LaneConfig, Pass, PromptImage, Request, SubmitError};
use common::*;

/// `prompt(n, seed)` with an image of `len` rows at `at`, named by `hash`.
fn with_image(n: usize, seed: u32, at: usize, len: usize, hash: u64) -> (Vec<u32>, PromptImage) {
    let mut p = prompt(n, seed);
    p.splice(at..at + len, image_token_ids(hash, len));
    (p, PromptImage { start: at, len, hash, pixels: vec![hash as f32; 3].into() })
}

fn request(p: &[u32], image: &PromptImage, max_tokens: usize) -> Request {
    Request { images: vec![image.clone()], ..greedy(p.to_vec(), max_tokens) }
}

/// An `encode_images` call: its index in the log and each image's `(start, len, hash)`.
type Encode = (usize, Vec<(usize, usize, u64)>);

/// The `encode_images` calls of `stream`.
fn encodes(log: &[Call], stream: u64) -> Vec<Encode> {
    log.iter()
        .enumerate()
        .filter_map(|(i, c)| match c {
            Call::EncodeImages { stream: s, images } if *s == stream => Some((i, images.clone())),
            _ => None,
        })
        .collect()
}

fn started(h: &braid_engine::StreamHandle) -> usize {
    match wait_event(h, |e| matches!(e, Event::Started { .. })) {
        Event::Started { cached_tokens } => cached_tokens,
        _ => unreachable!(),
    }
}

#[test]
fn a_pass_makes_its_image_rows_once_also_when_stopped_and_resumed() {
    let (p, img) = with_image(30, 2, 9, 8, 77);
    let plan = CutPlan { prompt_len: 30, chunk_tokens: 4, planned_start: 0, marks: vec![], max_rows: None, free_cuts: false, images: vec![(9, 17)] };
    let log = CallLog::default();
    let mut be = FakeBackend::new(FakeConfig::default(), log.clone());
    be.open(1).unwrap();
    let mut pass = Pass::new(1, p.clone().into(), plan, true).with_images(vec![img].into());
    pass.step(&mut be, None).unwrap();
    pass.step(&mut be, None).unwrap();
    pass.cancel(&mut be);
    pass.step(&mut be, None).unwrap();
    pass.cancel(&mut be);
    prefill_whole(&mut be, None, &mut pass).unwrap();
    let calls = log.snapshot();
    let made = encodes(&calls, 1);
    assert_eq!(made.len(), 1, "image rows made once: {calls:?}");
    // Before the first chunk, and dropped after the last.
    assert!(made[0].0 < chunk_calls(&calls, 1)[0]);
    assert_eq!(made[0].1, vec![(9, 8, 77)]);
    let dropped = calls.iter().position(|c| *c == Call::DropImages(1)).expect("the image rows are dropped when the pass is done");
    assert_eq!(dropped, calls.len() - 1);
    // The image ran in one chunk of its own: 0..4, 4..8, 8..9, 9..17, ...
    let starts: Vec<usize> = prefills(&calls, 1).iter().map(|c| c.0).collect();
    assert_eq!(starts, vec![0, 4, 8, 9, 17, 20, 24, 28]);
}

#[test]
fn a_pass_paused_for_memory_keeps_its_image_rows() {
    let hold = Arc::new(Mutex::new(()));
    let fc = FakeConfig { blocks_total: 8, block_tokens: 4, hold: Some(hold.clone()), ..FakeConfig::default() };
    let (lane, log) = lane(fc, LaneConfig { chunk_tokens: 4, decode_reserve: 0, ..no_marks() });
    let pa = prompt(4, 4);
    let (pb, img) = with_image(24, 5, 6, 8, 9);
    let guard = hold.lock().unwrap();
    let a = lane.submit(greedy(pa, 27)).unwrap();
    wait_log(&log, "A's open", |l| l.contains(&Call::Open(a.id)));
    let b = lane.submit(request(&pb, &img, 1)).unwrap();
    drop(guard);
    let out_b = drain(&b);
    drain(&a);
    let calls = log.snapshot();
    let cancel = calls.iter().position(|c| *c == Call::CancelPrefill(b.id)).expect("the pass should have been stopped");
    let made = encodes(&calls, b.id);
    assert_eq!(made.len(), 1, "made once, not again on resume");
    assert!(made[0].0 < cancel && made[0].0 < chunk_calls(&calls, b.id)[0]);
    let starts: Vec<usize> = prefills(&calls, b.id).iter().map(|c| c.0).collect();
    assert_eq!(starts, vec![0, 4, 6, 14, 16, 20]);
    assert_eq!(out_b.error, None);
    assert_eq!(out_b.tokens, oracle(&pb, 1, 64));
}

#[test]
fn stepped_equals_whole_with_an_image() {
    let (p, img) = with_image(30, 2, 10, 8, 5);
    let (stepped, whole_calls, whole, out) = stepped_and_whole(slow(), request(&p, &img, 3));
    assert_eq!(stepped, whole_calls);
    // The mark inside the image (12) gives way; the image is one chunk.
    assert_eq!(stepped.iter().map(|c| c.0).collect::<Vec<_>>(), vec![0, 8, 10, 18, 24]);
    assert_eq!(whole.marks.iter().map(|m| m.0).collect::<Vec<_>>(), vec![24, 30]);
    assert_eq!(out.tokens, oracle(&p, 3, 64));
}

/// Stream A decodes while B's prompt (20 rows, an image at 5..13) runs in
/// chunks of 4 on a fake configured by `fc`; B's tokens are checked. The
/// call log and the ids of A and B.
fn image_prompt_beside_a_decoder(fc: FakeConfig) -> (Vec<Call>, u64, u64) {
    let (lane, log) = lane(fc, LaneConfig { chunk_tokens: 4, ..no_marks() });
    let a = decoding(&lane, prompt(3, 6), LONG);
    let (p, img) = with_image(20, 7, 5, 8, 3);
    let b = lane.submit(request(&p, &img, 2)).unwrap();
    let out = drain(&b);
    a.cancel();
    drain(&a);
    assert_eq!(out.tokens, oracle(&p, 2, 64));
    (log.snapshot(), a.id, b.id)
}

#[test]
fn another_stream_decodes_between_the_chunks_of_an_image_prompt() {
    let (calls, a_id, b_id) = image_prompt_beside_a_decoder(slow());
    assert_eq!(prefills(&calls, b_id).iter().map(|c| c.0).collect::<Vec<_>>(), vec![0, 4, 5, 13, 16]);
    let idx = chunk_calls(&calls, b_id);
    for w in idx.windows(2) {
        assert!(calls[w[0] + 1..=w[1]].iter().any(|c| c.decodes(a_id)), "no decode round of A between B's chunks");
    }
}

#[test]
fn another_stream_decodes_between_the_steps_of_an_image_encoding() {
    // Six steps of the vision tower (its layers, on a real model).
    let (calls, a_id, b_id) = image_prompt_beside_a_decoder(FakeConfig { encode_steps: 6, ..slow() });
    let steps: Vec<usize> = calls.iter().enumerate().filter(|(_, c)| matches!(c, Call::EncodeStep { stream, .. } if *stream == b_id)).map(|(i, _)| i).collect();
    assert_eq!(steps.len(), 6, "{calls:?}");
    for w in steps.windows(2) {
        assert!(calls[w[0] + 1..w[1]].iter().any(|c| c.decodes(a_id)), "no decode round of A between two encoding steps of B");
    }
    // The rows are made once, after the last step and before B's first chunk.
    let made = encodes(&calls, b_id);
    assert_eq!(made.len(), 1);
    assert!(made[0].0 > steps[5] && made[0].0 < chunk_calls(&calls, b_id)[0]);
}

#[test]
fn paced_encoding_steps_beside_a_decoder_get_budgets_alone_none() {
    let (lane, log) = lane(FakeConfig { encode_steps: 6, ..slow() }, LaneConfig { chunk_tokens: 4, prefill_share: Some(0.15), ..no_marks() });
    // Alone: steps of the backend's choosing.
    let (p, img) = with_image(20, 7, 5, 8, 3);
    drain(&lane.submit(request(&p, &img, 2)).unwrap());
    let budgets = |calls: &[Call]| -> Vec<Option<u64>> {
        calls.iter().filter_map(|c| if let Call::EncodeStep { budget, .. } = c { Some(*budget) } else { None }).collect()
    };
    assert_eq!(budgets(&log.snapshot()), vec![None; 6]);
    // Beside a decoding stream: sized by the pacer, the first the least.
    let a = decoding(&lane, prompt(3, 6), LONG);
    let before = log.snapshot().len();
    let (p, img) = with_image(20, 8, 5, 8, 4);
    let b = lane.submit(request(&p, &img, 2)).unwrap();
    assert_eq!(drain(&b).tokens, oracle(&p, 2, 64));
    a.cancel();
    drain(&a);
    let paced = budgets(&log.snapshot()[before..]);
    assert_eq!(paced.len(), 6);
    assert_eq!(paced[0], Some(1), "{paced:?}");
    assert!(paced.iter().all(|b| b.is_some_and(|b| b >= 1)), "{paced:?}");
}

#[test]
fn the_prefix_cache_tells_images_apart_by_content() {
    for blocks in [false, true] {
        let caps = braid_engine::Capabilities { prefix_blocks: blocks, ..FakeConfig::default().caps };
        let (lane, log) = lane(FakeConfig { caps, ..FakeConfig::default() }, LaneConfig { chunk_tokens: 8, ..LaneConfig::default() });
        let (p, img) = with_image(30, 3, 6, 8, 41);
        let first = lane.submit(request(&p, &img, 2)).unwrap();
        assert_eq!(started(&first), 0);
        drain(&first);
        // The same image again: its rows come from the cache, and are not made again.
        let again = lane.submit(request(&p, &img, 2)).unwrap();
        let cached = started(&again);
        assert!(cached >= img.end(), "prefix_blocks {blocks}: {cached} cached rows");
        let out = drain(&again);
        assert_eq!(out.tokens, oracle(&p, 2, 64));
        assert!(encodes(&log.snapshot(), again.id).is_empty());
        // Another image at the same place: nothing past its start is reused.
        let (q, other) = with_image(30, 3, 6, 8, 42);
        let third = lane.submit(request(&q, &other, 2)).unwrap();
        let cached = started(&third);
        assert!(cached <= other.start, "prefix_blocks {blocks}: {cached} rows cached past the image's start");
        drain(&third);
        assert_eq!(encodes(&log.snapshot(), third.id).len(), 1);
    }
}

#[test]
fn images_are_checked_at_submission() {
    let (lane, _log) = lane(FakeConfig::default(), no_marks());
    let (p, img) = with_image(20, 1, 4, 8, 5);
    // Rows that do not hold the image's ids.
    let wrong = PromptImage { hash: 6, ..img.clone() };
    assert!(matches!(lane.submit(request(&p, &wrong, 1)), Err(SubmitError::Invalid(e)) if e.contains("do not hold its ids")));
    // Past the prompt's end.
    let past = PromptImage { start: 16, ..img.clone() };
    assert!(matches!(lane.submit(request(&p, &past, 1)), Err(SubmitError::Invalid(e)) if e.contains("inside the prompt")));
    // An image wider than a round (its rows run in one chunk).
    let (q, wide) = with_image(90, 1, 4, 80, 5);
    assert!(matches!(lane.submit(request(&q, &wide, 1)), Err(SubmitError::Invalid(e)) if e.contains("more than the 64")));
    // Image ids without an image are out of the vocabulary.
    assert!(matches!(lane.submit(greedy(p.clone(), 1)), Err(SubmitError::Invalid(e)) if e.contains("outside the vocabulary")));
    // A backend that makes no image rows takes none.
    let caps = braid_engine::Capabilities { images: false, ..FakeConfig::default().caps };
    let (plain, _) = common::lane(FakeConfig { caps, ..FakeConfig::default() }, no_marks());
    assert!(matches!(plain.submit(request(&p, &img, 1)), Err(SubmitError::Unsupported(e)) if e.contains("no images")));
}
