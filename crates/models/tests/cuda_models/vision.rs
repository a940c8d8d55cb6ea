//! Gemma 3's vision tower and projector on the GPU, from the transformers
//! fixture and from the text GGUF with its mmproj.

use super::*;

/// Gemma 3's vision tower and projector on the GPU: each image's rows, and
/// the logits of the fixture's two-image prompt (every text row and each
/// image's last), against transformers at bf16 tolerance.
#[test]
fn gemma3_vision_fixture_bf16() {
    let Some(dev) = gpu() else { return };
    vision_bf16(&dev, "gemma3_vision", &fixture_dir("gemma3_vision"), None);
}

/// The same from the text GGUF and the F32 mmproj (`gemma3_vision_gguf`).
#[test]
fn gemma3_vision_gguf_mmproj_bf16() {
    let Some(dev) = gpu() else { return };
    let dir = fixture_dir("gemma3_vision_gguf");
    vision_bf16(&dev, "gemma3_vision_gguf", &dir.join("model-f32.gguf"), Some(&dir.join("mmproj-f32.gguf")));
}

/// [`gemma3_vision_fixture_bf16`] for fixture `name`, its model at `model`
/// with the mmproj `mmproj` where given.
fn vision_bf16(dev: &Cuda, name: &str, model_path: &std::path::Path, mmproj: Option<&std::path::Path>) {
    let r = reference(name);
    let config: Value = serde_json::from_str(&std::fs::read_to_string(fixture_dir(name).join("config.json")).unwrap()).unwrap();
    let (_src, model) = braid_models::open_with(dev, model_path, mmproj).unwrap();
    let (pshape, pixels) = &r["image_rows"];
    let (tokens, hidden) = (pshape[1], pshape[2]);
    let px = &r["pixel_values"].1;
    let per = px.len() / r["pixel_values"].0[0];
    for n in 0..pshape[0] {
        let rows = dev.download(&model.encode_image(dev, &px[n * per..(n + 1) * per]).unwrap()).unwrap();
        let (rel, _, _) = compare(&rows[..tokens * hidden], &pixels[n * tokens * hidden..(n + 1) * tokens * hidden], hidden);
        eprintln!("{name} on {}: image {n} rows rel err {rel:.2e}", dev.name());
        assert!(rel < BF16_REL, "{name}: image {n} rows rel err {rel}");
    }

    let image_token = config["image_token_index"].as_u64().unwrap() as u32;
    let tokens: Vec<u32> = r["tokens"].1.iter().map(|&t| t as u32).collect();
    let (prompt, images) = fixtures_common::image_prompt(&tokens, image_token, px, per);
    let mut be = ModelBackend::new(dev.clone(), model, gpu_config()).unwrap();
    be.open(1).unwrap();
    be.encode_images(1, &images).unwrap();
    let (vocab, full) = (r["logits_full"].0[1], &r["logits_full"].1);
    let (mut got, mut want) = (Vec::new(), Vec::new());
    let mut pos = 0;
    while pos < prompt.len() {
        let end = images.iter().find(|m| m.start <= pos && pos < m.end()).map_or(pos + 1, |m| m.end());
        got.extend(be.prefill_step(1, Chunk { start: pos, tokens: &prompt[pos..end], want_logits: true }).unwrap().unwrap());
        want.extend_from_slice(&full[(end - 1) * vocab..end * vocab]);
        pos = end;
    }
    let (rel, agree, rows) = compare(&got, &want, vocab);
    eprintln!("{name} on {}: prompt with two images, logits rel err {rel:.2e}, top-1 {agree}/{rows}", dev.name());
    assert!(rel < BF16_REL, "{name}: logits rel err {rel}");
    assert!(agree * 10 >= rows * 9, "{name}: top-1 agreement {agree}/{rows}");
}
