//! Image inputs: decoding what a client sends (PNG, JPEG, WebP; raw bytes
//! or a `data:` URL) within bounded memory, and making a model's input
//! pixels as its preprocessor config (`preprocessor_config.json`) says.
//!
//! Every refusal says what is wrong (not an image, a format not taken,
//! truncated, too large, a decompression bomb), and none panics.

use std::hash::{BuildHasher, Hash, Hasher};
use std::io::Cursor;
use std::path::Path;

use anyhow::{bail, Context, Result};
use base64::Engine as _;
use image::imageops::FilterType;
use image::{ImageFormat, ImageReader, RgbImage};
use serde_json::Value;

/// Bounds on one image a client sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ImageLimits {
    /// Encoded size.
    pub max_bytes: usize,
    /// Width and height, each.
    pub max_side: u32,
    /// Memory a decode may allocate (a small file that inflates to a huge
    /// image is refused before it is decoded).
    pub max_alloc: u64,
}

impl Default for ImageLimits {
    fn default() -> Self {
        ImageLimits { max_bytes: 20 << 20, max_side: 8192, max_alloc: 128 << 20 }
    }
}

/// Why an image was refused: what a client is told.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ImageError {
    #[error("the image URL is not a base64 `data:` URL ({0})")]
    NotDataUrl(String),
    #[error("the image's base64 data is invalid: {0}")]
    Base64(String),
    #[error("the image is {got} bytes; at most {max} are taken")]
    TooManyBytes { got: usize, max: usize },
    #[error("the data is not a PNG, JPEG or WebP image")]
    UnknownFormat,
    #[error("{0} images are not taken; send PNG, JPEG or WebP")]
    Unsupported(String),
    #[error("the image is {width}x{height} pixels; at most {max} per side are taken")]
    TooLarge { width: u32, height: u32, max: u32 },
    #[error("decoding the image would take more than {max_mib} MiB (a decompression bomb?)")]
    Bomb { max_mib: u64 },
    #[error("the {format} image is truncated or corrupt: {detail}")]
    Corrupt { format: String, detail: String },
}

/// The bytes of a `data:image/...;base64,...` URL.
pub fn data_url_bytes(url: &str, limits: &ImageLimits) -> Result<Vec<u8>, ImageError> {
    let clip = |s: &str| s.chars().take(40).collect::<String>();
    let rest = url.strip_prefix("data:").ok_or_else(|| ImageError::NotDataUrl(format!("it begins `{}`", clip(url))))?;
    let (head, data) = rest.split_once(',').ok_or_else(|| ImageError::NotDataUrl("no `,` before the data".into()))?;
    if !head.ends_with(";base64") {
        return Err(ImageError::NotDataUrl(format!("`{}` is not base64", clip(head))));
    }
    // Base64 is 4/3 of the bytes: refuse before decoding what would be too big.
    let estimate = data.len() / 4 * 3;
    if estimate > limits.max_bytes + 3 {
        return Err(ImageError::TooManyBytes { got: estimate, max: limits.max_bytes });
    }
    let bytes = base64::engine::general_purpose::STANDARD.decode(data.trim()).map_err(|e| ImageError::Base64(e.to_string()))?;
    if bytes.len() > limits.max_bytes {
        return Err(ImageError::TooManyBytes { got: bytes.len(), max: limits.max_bytes });
    }
    Ok(bytes)
}

/// Decode a PNG, JPEG or WebP image to RGB (alpha dropped), within `limits`.
pub fn decode_image(bytes: &[u8], limits: &ImageLimits) -> Result<RgbImage, ImageError> {
    if bytes.len() > limits.max_bytes {
        return Err(ImageError::TooManyBytes { got: bytes.len(), max: limits.max_bytes });
    }
    let format = image::guess_format(bytes).map_err(|_| ImageError::UnknownFormat)?;
    let name = match format {
        ImageFormat::Png => "PNG",
        ImageFormat::Jpeg => "JPEG",
        ImageFormat::WebP => "WebP",
        other => return Err(ImageError::Unsupported(format!("{other:?}"))),
    };
    let corrupt = |e: image::ImageError| match e {
        image::ImageError::Limits(_) => ImageError::Bomb { max_mib: limits.max_alloc >> 20 },
        e => ImageError::Corrupt { format: name.into(), detail: e.to_string() },
    };
    let reader = |bytes| {
        let mut r = ImageReader::with_format(Cursor::new(bytes), format);
        let mut l = image::Limits::default();
        l.max_image_width = Some(limits.max_side);
        l.max_image_height = Some(limits.max_side);
        l.max_alloc = Some(limits.max_alloc);
        r.limits(l);
        r
    };
    // The header first: its dimensions name the problem better than a limit error.
    let mut plain = ImageReader::with_format(Cursor::new(bytes), format);
    plain.no_limits();
    let (width, height) = plain.into_dimensions().map_err(corrupt)?;
    if width > limits.max_side || height > limits.max_side {
        return Err(ImageError::TooLarge { width, height, max: limits.max_side });
    }
    if width == 0 || height == 0 {
        return Err(ImageError::Corrupt { format: name.into(), detail: format!("it is {width}x{height} pixels") });
    }
    // Decoded RGBA at most; refuse what would not fit before allocating it.
    if u64::from(width) * u64::from(height) * 4 > limits.max_alloc {
        return Err(ImageError::Bomb { max_mib: limits.max_alloc >> 20 });
    }
    Ok(reader(bytes).decode().map_err(corrupt)?.to_rgb8())
}

/// How a model's processor turns an image into pixels: resized to a square
/// side, rescaled (usually by 1/255), normalised by mean and std per
/// channel, channels first.
#[derive(Clone, Debug, PartialEq)]
pub struct ImagePrep {
    pub side: u32,
    pub resize: bool,
    pub rescale: Option<f32>,
    pub mean: [f32; 3],
    pub std: [f32; 3],
    pub normalize: bool,
}

impl ImagePrep {
    /// SigLIP's settings at `side` pixels (Gemma 3's processor).
    pub fn siglip(side: u32) -> ImagePrep {
        ImagePrep { side, resize: true, rescale: Some(1.0 / 255.0), mean: [0.5; 3], std: [0.5; 3], normalize: true }
    }

    /// The settings of `dir/preprocessor_config.json`, for a model that
    /// takes images of `side` pixels; SigLIP's when the file is absent.
    pub fn load(dir: &Path, side: u32) -> Result<ImagePrep> {
        let path = dir.join("preprocessor_config.json");
        if !path.is_file() {
            return Ok(ImagePrep::siglip(side));
        }
        let text = std::fs::read_to_string(&path).with_context(|| format!("{}: cannot read", path.display()))?;
        let v: Value = serde_json::from_str(&text).with_context(|| format!("{}: not JSON", path.display()))?;
        ImagePrep::from_json(&v, side).with_context(|| path.display().to_string())
    }

    pub fn from_json(v: &Value, side: u32) -> Result<ImagePrep> {
        let mut p = ImagePrep::siglip(side);
        let triple = |k: &str| -> Result<Option<[f32; 3]>> {
            match v.get(k) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::Array(a)) if a.len() == 3 && a.iter().all(Value::is_number) => {
                    Ok(Some([0, 1, 2].map(|i| a[i].as_f64().unwrap_or_default() as f32)))
                }
                Some(other) => bail!("`{k}` is {other}, expected three numbers"),
            }
        };
        let flag = |k: &str, d: bool| v.get(k).and_then(Value::as_bool).unwrap_or(d);
        p.mean = triple("image_mean")?.unwrap_or(p.mean);
        p.std = triple("image_std")?.unwrap_or(p.std);
        if p.std.iter().any(|s| *s <= 0.0 || !s.is_finite()) {
            bail!("`image_std` {:?} must be positive", p.std);
        }
        p.resize = flag("do_resize", true);
        p.normalize = flag("do_normalize", true);
        let factor = v.get("rescale_factor").and_then(Value::as_f64).unwrap_or(1.0 / 255.0) as f32;
        p.rescale = flag("do_rescale", true).then_some(factor);
        if let Some(size) = v.get("size").filter(|s| s.is_object()) {
            let (h, w) = (size.get("height").and_then(Value::as_u64), size.get("width").and_then(Value::as_u64));
            if let (Some(h), Some(w)) = (h, w) {
                if h != w || h != u64::from(side) {
                    bail!("`size` is {h}x{w}, but the model takes {side}x{side} images");
                }
            }
        }
        Ok(p)
    }

    /// The model's input: `[3, side, side]`, channels first.
    pub fn pixels(&self, img: &RgbImage) -> Result<Vec<f32>> {
        let side = self.side;
        let resized;
        let img = if img.dimensions() == (side, side) {
            img
        } else if self.resize {
            // Bilinear, as the SigLIP and Gemma 3 processors resample.
            resized = image::imageops::resize(img, side, side, FilterType::Triangle);
            &resized
        } else {
            bail!("the image is {}x{} and the processor does not resize; the model takes {side}x{side}", img.width(), img.height())
        };
        let n = (side * side) as usize;
        let mut out = vec![0f32; 3 * n];
        for (i, px) in img.pixels().enumerate() {
            for c in 0..3 {
                let mut v = px.0[c] as f32;
                if let Some(r) = self.rescale {
                    v *= r;
                }
                if self.normalize {
                    v = (v - self.mean[c]) / self.std[c];
                }
                out[c * n + i] = v;
            }
        }
        Ok(out)
    }
}

/// A hash of what the model sees of an image (its pixels): equal images
/// share their cached rows, others never do. Keyed at random once per
/// process, so a client cannot craft an image whose hash is another's
/// (its cached rows are not another prompt's to reuse); fast, since it
/// reads every pixel of each image a request brings (SipHash a value at
/// a time took 9.5 ms for an 896-pixel image, beside the rounds).
pub fn pixels_hash(pixels: &[f32]) -> u64 {
    static KEYS: std::sync::OnceLock<ahash::RandomState> = std::sync::OnceLock::new();
    let mut h = KEYS.get_or_init(ahash::RandomState::new).build_hasher();
    pixels.len().hash(&mut h);
    let mut buf = [0u8; 4096];
    for chunk in pixels.chunks(buf.len() / 4) {
        for (b, p) in buf.chunks_exact_mut(4).zip(chunk) {
            b.copy_from_slice(&p.to_bits().to_le_bytes());
        }
        h.write(&buf[..chunk.len() * 4]);
    }
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn png(w: u32, h: u32) -> Vec<u8> {
        let img = RgbImage::from_fn(w, h, |x, y| image::Rgb([x as u8, y as u8, (x + y) as u8]));
        let mut out = Cursor::new(Vec::new());
        img.write_to(&mut out, ImageFormat::Png).unwrap();
        out.into_inner()
    }

    #[test]
    fn equal_pixels_hash_alike_and_a_bit_apart_does_not() {
        let a: Vec<f32> = (0..5000).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut b = a.clone();
        assert_eq!(pixels_hash(&a), pixels_hash(&b));
        b[4321] = f32::from_bits(b[4321].to_bits() ^ 1);
        assert_ne!(pixels_hash(&a), pixels_hash(&b));
        assert_ne!(pixels_hash(&a[..4999]), pixels_hash(&a));
    }

    #[test]
    fn a_png_decodes_and_normalises() {
        let img = decode_image(&png(4, 4), &ImageLimits::default()).unwrap();
        let px = ImagePrep::siglip(4).pixels(&img).unwrap();
        assert_eq!(px.len(), 48);
        // Pixel (1, 0): red 1, green 0, blue 1 -> (v / 255 - 0.5) / 0.5.
        assert_eq!(px[1], (1.0f32 / 255.0 - 0.5) / 0.5);
        assert_eq!(px[16 + 1], -1.0);
        // Resized when the side differs.
        assert_eq!(ImagePrep::siglip(8).pixels(&img).unwrap().len(), 3 * 64);
    }

    #[test]
    fn bad_images_are_named() {
        let l = ImageLimits::default();
        assert_eq!(decode_image(b"hello world, not an image", &l), Err(ImageError::UnknownFormat));
        let p = png(16, 16);
        assert!(matches!(decode_image(&p[..p.len() / 2], &l), Err(ImageError::Corrupt { .. })));
        let small = ImageLimits { max_side: 8, ..l };
        assert_eq!(decode_image(&p, &small), Err(ImageError::TooLarge { width: 16, height: 16, max: 8 }));
        let tight = ImageLimits { max_alloc: 512, ..l };
        assert_eq!(decode_image(&p, &tight), Err(ImageError::Bomb { max_mib: 0 }));
        let gif = b"GIF89a\x01\x00\x01\x00\x00\x00\x00;";
        assert!(matches!(decode_image(gif, &l), Err(ImageError::Unsupported(_))));
        assert!(matches!(data_url_bytes("http://example.invalid/cat.png", &l), Err(ImageError::NotDataUrl(_))));
        assert!(matches!(data_url_bytes("data:image/png;base64,@@@", &l), Err(ImageError::Base64(_))));
    }

    #[test]
    fn a_data_url_round_trips() {
        let p = png(3, 2);
        let url = format!("data:image/png;base64,{}", base64::engine::general_purpose::STANDARD.encode(&p));
        assert_eq!(data_url_bytes(&url, &ImageLimits::default()).unwrap(), p);
    }
}
