//! The tiny random Gemma 3 vision model (`testdata/fixtures/gemma3_vision`,
//! made by `scripts/fixtures/make_vision.py`) against transformers: the
//! projector's rows, and the logits of a prompt with two images, whose
//! image tokens attend to their own image both ways. And the same model
//! as llama.cpp users hold it, a text GGUF plus an mmproj GGUF
//! (`gemma3_vision_gguf`, made by `scripts/fixtures/make_vision_gguf.py`).

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
    vision_of("gemma3_vision")
}

fn vision_of(name: &str) -> Vision {
    let fx = Fixture::load(name);
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

/// The text GGUF with the mmproj `mmproj` (a file of `gemma3_vision_gguf`).
fn gguf_backend(v: &Vision, mmproj: &str) -> ModelBackend<Cpu> {
    let dev = Cpu::new(None);
    let (_src, model) = braid_models::open_with(&dev, &v.fx.dir.join("model-f32.gguf"), Some(&v.fx.dir.join(mmproj))).unwrap();
    ModelBackend::new(dev, model, backend_config()).unwrap()
}

/// Both images' rows (without the trailing zero row) of `be`'s model.
fn rows_of(be: &ModelBackend<Cpu>, v: &Vision) -> Vec<f32> {
    let dev = Cpu::new(None);
    let (tokens, hidden) = (be.model().vision().unwrap().tokens, v.fx.reference["image_rows"].shape[2]);
    let mut out = Vec::new();
    for m in &v.images {
        let rows = be.model().encode_image(&dev, &m.pixels).unwrap();
        assert_eq!(dev.shape(&rows), (tokens + 1, hidden), "the image's rows and a zero row");
        out.extend_from_slice(&dev.download(&rows).unwrap()[..tokens * hidden]);
    }
    out
}

/// The F16 mmproj's bound: its matrices (the tower's and the projector's)
/// are rounded to 11 bits; measured 9.2e-4 on the rows (whose spread is 1)
/// and 9.3e-3 on the logits (spread 8), against a misread tensor's error
/// of the rows' size or more.
const F16_TOL: f32 = 3e-2;

#[test]
fn mmproj_rows_equal_the_hf_folders() {
    let v = vision_of("gemma3_vision_gguf");
    let want = &v.fx.reference["image_rows"].data;
    let hidden = v.fx.reference["image_rows"].shape[2];
    let hf = rows_of(&v.fx.backend(), &v);
    assert_close("HF folder rows vs transformers", &hf, want, hidden, TOL);
    let be = gguf_backend(&v, "mmproj-f32.gguf");
    let vc = be.model().vision().unwrap().clone();
    let hf_cfg = v.fx.backend().model().vision().unwrap().clone();
    // The sizes read from the mmproj's keys are the config's; the image
    // tokens are the text model's (this GGUF has no vocabulary to name them).
    assert_eq!((vc.hidden, vc.layers, vc.heads, vc.ffn, vc.channels), (hf_cfg.hidden, hf_cfg.layers, hf_cfg.heads, hf_cfg.ffn, hf_cfg.channels));
    assert_eq!((vc.image_size, vc.patch, vc.eps, vc.tokens, vc.text_hidden), (hf_cfg.image_size, hf_cfg.patch, hf_cfg.eps, hf_cfg.tokens, hf_cfg.text_hidden));
    assert_eq!((vc.image_mean, vc.image_std), (Some([0.5; 3]), Some([0.5; 3])));
    let got = rows_of(&be, &v);
    assert_close("F32 mmproj rows vs HF folder", &got, &hf, hidden, 1e-5);
    assert_close("F32 mmproj rows vs transformers", &got, want, hidden, TOL);
    let f16 = rows_of(&gguf_backend(&v, "mmproj-f16.gguf"), &v);
    let d = assert_close("F16 mmproj rows vs transformers", &f16, want, hidden, F16_TOL);
    assert!(d.max > 1e-5, "the F16 mmproj's rows equal the F32 reference ({:.2e}): not its F16 weights", d.max);
}

#[test]
fn gguf_and_mmproj_prompt_logits_equal_the_hf_folders() {
    let v = vision_of("gemma3_vision_gguf");
    let vocab = v.fx.vocab;
    let full = v.fx.logits("logits_full");
    let causal = v.fx.logits("logits_text");
    let mut hf_be = v.fx.backend();
    hf_be.open(1).unwrap();
    let hf = stepped(&mut hf_be, 1, &v, 0, &v.prompt);
    for (mmproj, tol_hf, tol_ref) in [("mmproj-f32.gguf", 1e-5, TOL), ("mmproj-f16.gguf", F16_TOL, F16_TOL)] {
        let mut be = gguf_backend(&v, mmproj);
        be.open(1).unwrap();
        let got = stepped(&mut be, 1, &v, 0, &v.prompt);
        assert_eq!(got.len(), hf.len());
        let mut max_causal = 0f32;
        for ((row, l), (_, h)) in got.iter().zip(&hf) {
            assert_close(&format!("{mmproj} row {row} vs HF folder"), l, h, vocab, tol_hf);
            assert_close(&format!("{mmproj} row {row} vs transformers"), l, &full[row * vocab..(row + 1) * vocab], vocab, tol_ref);
            max_causal = max_causal.max(diff(l, &causal[row * vocab..(row + 1) * vocab], vocab).max);
        }
        // The image rows were placed, and see their image both ways.
        assert!(max_causal > 1.0, "{mmproj}: logits without the image mask differ by only {max_causal}");
    }
    // The HF folder itself against transformers (the variant's reference).
    for (row, l) in &hf {
        assert_close(&format!("HF folder row {row}"), l, &full[row * vocab..(row + 1) * vocab], vocab, TOL);
    }
}

/// A copy of the fixture's F32 mmproj in a scratch folder, with `from`
/// replaced by `to` (as many bytes) where it first occurs.
fn patched_mmproj(v: &Vision, name: &str, from: &[u8], to: &[u8]) -> std::path::PathBuf {
    assert_eq!(from.len(), to.len());
    let mut bytes = std::fs::read(v.fx.dir.join("mmproj-f32.gguf")).unwrap();
    let at = bytes.windows(from.len()).position(|w| w == from).expect("the pattern is in the mmproj");
    bytes[at..at + to.len()].copy_from_slice(to);
    let dir = scratch();
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

/// This process's scratch folder for patched mmproj files.
fn scratch() -> std::path::PathBuf {
    std::env::temp_dir().join(format!("braid-mmproj-{}", std::process::id()))
}

fn open_err(model: &std::path::Path, mmproj: &std::path::Path) -> String {
    match braid_models::open_with(&Cpu::new(None), model, Some(mmproj)) {
        Ok(_) => panic!("{} with the mmproj {} loads", model.display(), mmproj.display()),
        Err(e) => format!("{e:#}"),
    }
}

#[test]
fn a_wrong_mmproj_is_refused_by_name() {
    let v = vision_of("gemma3_vision_gguf");
    let text = v.fx.dir.join("model-f32.gguf");
    let mmproj = v.fx.dir.join("mmproj-f32.gguf");
    // For a text-only architecture.
    let llama = fixtures_dir().join("llama/model-f32.gguf");
    let e = open_err(&llama, &mmproj);
    assert!(e.contains("architecture 'llama' takes no images") && e.contains("mmproj-f32.gguf"), "{e}");
    // A model's GGUF given as the mmproj.
    let e = open_err(&text, &text);
    assert!(e.contains("not an mmproj file") && e.contains("'gemma3'"), "{e}");
    // Beside an HF folder that has its own tower.
    let e = open_err(&v.fx.dir, &mmproj);
    assert!(e.contains("has a vision tower of its own"), "{e}");
    // Another model's width: the projector's 64 made 48 (`projection_dim`, a u32 (type 4) of 64).
    let key = b"clip.vision.projection_dim";
    let (from, to) = ([&key[..], &4u32.to_le_bytes(), &64u32.to_le_bytes()].concat(), [&key[..], &4u32.to_le_bytes(), &48u32.to_le_bytes()].concat());
    let e = open_err(&text, &patched_mmproj(&v, "wide.gguf", &from, &to));
    assert!(e.contains("the projector's width 48 is not the text model's 64") && e.contains("wide.gguf"), "{e}");
    // A tensor missing (renamed).
    let e = open_err(&text, &patched_mmproj(&v, "holed.gguf", b"v.post_ln.weight", b"v.post_ln.wxxxxx"));
    assert!(e.contains("holed.gguf") && e.contains("`v.post_ln.weight`"), "{e}");
    // Another projector.
    let e = open_err(&text, &patched_mmproj(&v, "idefics.gguf", b"gemma3", b"ldfics"));
    assert!(e.contains("projector is 'ldfics'"), "{e}");
    let _ = std::fs::remove_dir_all(scratch());
}
