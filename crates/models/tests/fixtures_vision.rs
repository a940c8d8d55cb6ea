//! The tiny random Gemma 3 vision model (`testdata/fixtures/gemma3_vision`,
//! made by `scripts/fixtures/make_vision.py`) against transformers: the
//! projector's rows, and the logits of a prompt with two images, whose
//! image tokens attend to their own image both ways.

mod fixtures_common;

use braid_engine::{Backend, Chunk, DecodeRow, PromptImage, StreamId};
use braid_models::ModelBackend;
use braid_ops::cpu::Cpu;
use braid_ops::Device;
use fixtures_common::*;

const TOL: f32 = 1e-4;

struct Vision {
    fx: Fixture,
    /// The prompt with each image's rows named by its ids.
    prompt: Vec<u32>,
    images: Vec<PromptImage>,
    /// Rows that are not an image's, plus each image's last (the rows
    /// whose logits a stepped pass can ask for).
    rows: usize,
}

fn vision() -> Vision {
    let fx = Fixture::load("gemma3_vision");
    let pixels = &fx.reference["pixel_values"];
    let per = pixels.data.len() / pixels.shape[0];
    let image_token = fx.config["image_token_index"].as_u64().unwrap() as u32;
    let (prompt, images) = image_prompt(&fx.tokens, image_token, &pixels.data, per);
    assert_eq!(images.len(), 2, "the fixture's prompt holds two images");
    let rows = prompt.len();
    Vision { fx, prompt, images, rows }
}

/// The pass over `prompt[..]` from `from` (the stream already holds that
/// many rows), cut at every row outside an image and at each image's end;
/// each cut's last-row logits by the row it ends on.
fn stepped(be: &mut ModelBackend<Cpu>, id: StreamId, v: &Vision, from: usize, prompt: &[u32]) -> Vec<(usize, Vec<f32>)> {
    let images = wanted(v, from, prompt);
    be.encode_images(id, &images).unwrap();
    chunks(be, id, &images, from, prompt)
}

/// The images a pass over `prompt` from `from` runs.
fn wanted(v: &Vision, from: usize, prompt: &[u32]) -> Vec<PromptImage> {
    v.images.iter().filter(|m| m.end() > from && m.end() <= prompt.len()).cloned().collect()
}

/// [`stepped`]'s chunks, the image rows already made.
fn chunks(be: &mut ModelBackend<Cpu>, id: StreamId, images: &[PromptImage], from: usize, prompt: &[u32]) -> Vec<(usize, Vec<f32>)> {
    let mut out = Vec::new();
    let mut pos = from;
    while pos < prompt.len() {
        let end = images.iter().find(|m| m.start <= pos && pos < m.end()).map_or(pos + 1, |m| m.end());
        let l = be.prefill_step(id, Chunk { start: pos, tokens: &prompt[pos..end], want_logits: true }).unwrap().unwrap();
        out.push((end - 1, l));
        pos = end;
    }
    be.drop_images(id);
    out
}

#[test]
fn projector_rows_match_transformers() {
    let v = vision();
    let dev = Cpu::new(None);
    let (_src, model) = braid_models::open(&dev, &v.fx.dir).unwrap();
    let want = &v.fx.reference["image_rows"];
    let (tokens, hidden) = (want.shape[1], want.shape[2]);
    assert_eq!(model.vision().unwrap().tokens, tokens);
    for (n, m) in v.images.iter().enumerate() {
        let rows = model.encode_image(&dev, &m.pixels).unwrap();
        assert_eq!(dev.shape(&rows), (tokens + 1, hidden), "the image's rows and a zero row");
        let got = dev.download(&rows).unwrap();
        assert_close(&format!("image {n} rows"), &got[..tokens * hidden], &want.data[n * tokens * hidden..(n + 1) * tokens * hidden], hidden, TOL);
        assert!(got[tokens * hidden..].iter().all(|&x| x == 0.0), "the last row is zero");
    }
    // The wrong number of pixels is an error, not a panic.
    let Err(err) = model.encode_image(&dev, &[0.0; 10]) else { panic!("a short image is accepted") };
    let err = err.to_string();
    assert!(err.contains("10 values"), "{err}");
}

#[test]
fn prompt_logits_with_images_match_transformers() {
    let v = vision();
    let mut be = v.fx.backend();
    be.open(1).unwrap();
    let got = stepped(&mut be, 1, &v, 0, &v.prompt);
    let vocab = v.fx.vocab;
    let full = v.fx.logits("logits_full");
    let causal = v.fx.logits("logits_text");
    let mut max_causal = 0f32;
    for (row, l) in &got {
        let want = &full[row * vocab..(row + 1) * vocab];
        assert_close(&format!("row {row}"), l, want, vocab, TOL);
        max_causal = max_causal.max(diff(l, &causal[row * vocab..(row + 1) * vocab], vocab).max);
    }
    assert_eq!(got.len(), v.rows - 2 * (v.images[0].len - 1), "every text row and each image's last");
    // Causal attention inside the images would be far off: the mask is tested.
    assert!(max_causal > 1.0, "logits without the image mask differ by only {max_causal}");

    // One whole-prompt chunk gives the same last row as the stepped pass.
    be.open(2).unwrap();
    be.encode_images(2, &v.images).unwrap();
    let whole = be.prefill_step(2, Chunk { start: 0, tokens: &v.prompt, want_logits: true }).unwrap().unwrap();
    assert_close("whole prompt, last row", &whole, &got.last().unwrap().1, vocab, 1e-5);
}

#[test]
fn image_rows_made_a_step_at_a_time_between_rounds_are_the_rows_made_whole() {
    let v = vision();
    let mut whole_be = v.fx.backend();
    whole_be.open(1).unwrap();
    let whole = stepped(&mut whole_be, 1, &v, 0, &v.prompt);
    let vc = whole_be.model().vision().unwrap().clone();
    let (patches, stages) = (vc.grid() * vc.grid(), 3 * vc.layers + 2);

    // The least work a step does: one row of the patch embedding.
    let row = v.fx.backend().model().encode_image_step(&Cpu::new(None), &v.images[0].pixels, &mut 0, Some(1)).unwrap().work;
    // Steps of 1, 3, 7 and 50 rows of the embedding (in the other stages,
    // as many rows as that work buys, cut across the stages' ends), one
    // stage a step (None), and all a step may do (a stage: steps end with
    // their stage).
    for budget in [Some(1), Some(3 * row), Some(7 * row), Some(50 * row), None, Some(u64::MAX)] {
        // Another stream decodes between the steps (the tower's work buffers
        // are the model's, the decode round's are the backend's).
        let mut be = v.fx.backend();
        be.open(1).unwrap();
        be.open(2).unwrap();
        let text = &v.fx.tokens[..4];
        be.prefill_step(2, Chunk { start: 0, tokens: text, want_logits: false }).unwrap();
        let images = wanted(&v, 0, &v.prompt);
        let mut steps = 0;
        loop {
            let step = be.encode_images_step(1, &images, budget).unwrap();
            assert!(step.work > 0 || step.done, "{budget:?}: a step did nothing");
            if step.done {
                break;
            }
            steps += 1;
            be.decode_logits(&[DecodeRow { stream: 2, tokens: vec![text[steps % 4]] }]).unwrap();
            // Back to its prompt: hundreds of steps would pass its context.
            be.rewind(2, text.len()).unwrap();
        }
        match budget {
            // A row a step, then the pooling.
            Some(1) => assert_eq!(steps + 1, (patches * stages + 1) * images.len(), "a step per row of each stage"),
            None | Some(u64::MAX) => assert_eq!(steps + 1, (stages + 1) * images.len(), "a step per stage"),
            _ => assert!(steps > 2 * stages, "{budget:?}: {steps} steps"),
        }
        let got = chunks(&mut be, 1, &images, 0, &v.prompt);
        assert_eq!(got, whole, "image rows made in steps of {budget:?} give other logits");
    }
}

#[test]
fn a_pass_that_starts_inside_a_cached_image_gives_the_same_rows() {
    let v = vision();
    let mut be = v.fx.backend();
    // A first stream caches the prompt's blocks; a second prompt shares its
    // rows up to the middle of the first image, then goes on differently.
    be.open(1).unwrap();
    assert_eq!(be.attach_prefix(1, &v.prompt, 0, v.prompt.len() - 1).unwrap(), 0);
    stepped(&mut be, 1, &v, 0, &v.prompt);
    let img = &v.images[0];
    let cut = img.start + img.len / 2 + 1;
    let mut other = v.prompt.clone();
    for t in &mut other[img.end() + 1..] {
        *t = (*t + 7) % 250;
    }
    be.open(2).unwrap();
    let cached = be.attach_prefix(2, &other, 0, cut).unwrap();
    assert!(cached > img.start && cached < img.end(), "the cached prefix ({cached} rows) ends inside the image at {}..{}", img.start, img.end());
    let warm = stepped(&mut be, 2, &v, cached, &other);
    // The same prompt from nothing, in a backend of its own.
    let mut fresh = v.fx.backend();
    fresh.open(3).unwrap();
    let cold = stepped(&mut fresh, 3, &v, 0, &other);
    let cold: Vec<_> = cold.into_iter().filter(|(r, _)| *r >= cached).collect();
    assert_eq!(warm.len(), cold.len());
    for ((r, a), (_, b)) in warm.iter().zip(&cold) {
        assert_close(&format!("row {r} from the cache"), a, b, v.fx.vocab, 1e-5);
    }
}

#[test]
fn image_rows_need_their_rows_made_and_whole_chunks() {
    let v = vision();
    let mut be = v.fx.backend();
    be.open(1).unwrap();
    let img = &v.images[0];
    // An image row with no image rows made is refused.
    let err = be.prefill_step(1, Chunk { start: 0, tokens: &v.prompt[..img.end()], want_logits: false }).err().unwrap().to_string();
    assert!(err.contains("image"), "{err}");
    be.encode_images(1, &v.images).unwrap();
    // A chunk that ends inside an image is refused.
    let err = be.prefill_step(1, Chunk { start: 0, tokens: &v.prompt[..img.start + 3], want_logits: false }).err().unwrap().to_string();
    assert!(err.contains("inside the image"), "{err}");
    // An image of the wrong size is refused by name.
    let short = PromptImage { len: 3, ..img.clone() };
    let err = be.encode_images(1, &[short]).err().unwrap().to_string();
    assert!(err.contains("16 per image"), "{err}");
}
