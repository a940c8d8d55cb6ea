//! Image inputs: decoding what a client sends (PNG, JPEG, WebP; raw bytes
//! or a `data:` URL) within bounded memory, and making a model's input
//! pixels as its preprocessor config (`preprocessor_config.json`) says.
//!
//! Every refusal says what is wrong (not an image, a format not taken,
//! truncated, too large, a decompression bomb), and none panics.

use std::hash::{BuildHasher, Hash, Hasher};
use std::io::{BufRead, Cursor, Read, Seek, SeekFrom};
use std::path::Path;
use std::time::{Duration, Instant};

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

/// Work cut into slices with pauses between them, so that a thread
/// sharing its cores with a CPU lane's rounds takes at most `duty` of a
/// core, a fraction of a millisecond at a time, instead of one burst that
/// stalls a round (each round waits on the slowest of its threads).
#[derive(Clone, Debug)]
pub struct Pacing {
    duty: f64,
    since: Instant,
    /// Time spent in its pauses so far.
    paused: Duration,
}

/// The longest a paced slice runs before its pause.
const SLICE: Duration = Duration::from_micros(500);

impl Pacing {
    /// No pauses.
    pub fn off() -> Pacing {
        Pacing::at(1.0)
    }

    /// At most `duty` (in (0, 1]; 1: no pauses) of a core.
    pub fn at(duty: f64) -> Pacing {
        Pacing { duty: duty.clamp(0.01, 1.0), since: Instant::now(), paused: Duration::ZERO }
    }

    /// How long its pauses took so far.
    pub fn paused(&self) -> Duration {
        self.paused
    }

    /// Between two pieces of work: past a slice, pause for as long as
    /// keeps the work within its duty.
    pub fn tick(&mut self) {
        if self.duty >= 1.0 {
            return;
        }
        let busy = self.since.elapsed();
        if busy >= SLICE {
            let t = Instant::now();
            std::thread::sleep(busy.mul_f64(1.0 / self.duty - 1.0));
            self.since = Instant::now();
            self.paused += self.since - t;
        }
    }
}

/// Encoded bytes read a little at a time, pacing between reads (the
/// decoders work as they read).
struct PacedBytes<'a> {
    cur: Cursor<&'a [u8]>,
    pace: &'a mut Pacing,
}

/// Bytes a paced read hands over at once.
const PACED_READ: usize = 8 << 10;

impl Read for PacedBytes<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.pace.tick();
        let n = buf.len().min(PACED_READ);
        self.cur.read(&mut buf[..n])
    }
}

impl BufRead for PacedBytes<'_> {
    fn fill_buf(&mut self) -> std::io::Result<&[u8]> {
        self.pace.tick();
        let b = self.cur.fill_buf()?;
        Ok(&b[..b.len().min(PACED_READ)])
    }

    fn consume(&mut self, n: usize) {
        self.cur.consume(n)
    }
}

impl Seek for PacedBytes<'_> {
    fn seek(&mut self, to: SeekFrom) -> std::io::Result<u64> {
        self.cur.seek(to)
    }
}

/// The bytes of a `data:image/...;base64,...` URL (decoded in pieces, paced).
pub fn data_url_bytes(url: &str, limits: &ImageLimits, pace: &mut Pacing) -> Result<Vec<u8>, ImageError> {
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
    let (data, b64) = (data.trim(), &base64::engine::general_purpose::STANDARD);
    let mut bytes = Vec::with_capacity(estimate);
    // Whole 4-character groups a piece, so only the last piece pads.
    for piece in data.as_bytes().chunks(64 << 10) {
        if b64.decode_vec(piece, &mut bytes).is_err() {
            // Named as a decode of the whole names it (its offset).
            return Err(ImageError::Base64(b64.decode(data).err().map_or_else(|| "invalid".into(), |e| e.to_string())));
        }
        pace.tick();
    }
    if bytes.len() > limits.max_bytes {
        return Err(ImageError::TooManyBytes { got: bytes.len(), max: limits.max_bytes });
    }
    Ok(bytes)
}

/// Decode a PNG, JPEG or WebP image to RGB (alpha dropped), within `limits`
/// (paced as it reads the encoded bytes).
pub fn decode_image(bytes: &[u8], limits: &ImageLimits, pace: &mut Pacing) -> Result<RgbImage, ImageError> {
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
    let reader = |bytes, pace| {
        let mut r = ImageReader::with_format(PacedBytes { cur: Cursor::new(bytes), pace }, format);
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
    Ok(reader(bytes, pace).decode().map_err(corrupt)?.to_rgb8())
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

    /// The model's input: `[3, side, side]`, channels first (paced a row at a time).
    pub fn pixels(&self, img: &RgbImage, pace: &mut Pacing) -> Result<Vec<f32>> {
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
            if i % side as usize == 0 {
                pace.tick();
            }
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
        let img = decode_image(&png(4, 4), &ImageLimits::default(), &mut Pacing::off()).unwrap();
        let px = ImagePrep::siglip(4).pixels(&img, &mut Pacing::off()).unwrap();
        assert_eq!(px.len(), 48);
        // Pixel (1, 0): red 1, green 0, blue 1 -> (v / 255 - 0.5) / 0.5.
        assert_eq!(px[1], (1.0f32 / 255.0 - 0.5) / 0.5);
        assert_eq!(px[16 + 1], -1.0);
        // Resized when the side differs.
        assert_eq!(ImagePrep::siglip(8).pixels(&img, &mut Pacing::off()).unwrap().len(), 3 * 64);
    }

    #[test]
    fn bad_images_are_named() {
        let l = ImageLimits::default();
        assert_eq!(decode_image(b"hello world, not an image", &l, &mut Pacing::off()), Err(ImageError::UnknownFormat));
        let p = png(16, 16);
        assert!(matches!(decode_image(&p[..p.len() / 2], &l, &mut Pacing::off()), Err(ImageError::Corrupt { .. })));
        let small = ImageLimits { max_side: 8, ..l };
        assert_eq!(decode_image(&p, &small, &mut Pacing::off()), Err(ImageError::TooLarge { width: 16, height: 16, max: 8 }));
        let tight = ImageLimits { max_alloc: 512, ..l };
        assert_eq!(decode_image(&p, &tight, &mut Pacing::off()), Err(ImageError::Bomb { max_mib: 0 }));
        let gif = b"GIF89a\x01\x00\x01\x00\x00\x00\x00;";
        assert!(matches!(decode_image(gif, &l, &mut Pacing::off()), Err(ImageError::Unsupported(_))));
        assert!(matches!(data_url_bytes("http://example.invalid/cat.png", &l, &mut Pacing::off()), Err(ImageError::NotDataUrl(_))));
        assert!(matches!(data_url_bytes("data:image/png;base64,@@@", &l, &mut Pacing::off()), Err(ImageError::Base64(_))));
    }

    /// Paced work (the base64 in pieces, the decoder reading a little at a
    /// time, the pixels a row at a time) gives what unpaced work gives,
    /// and pauses: at a quarter duty it takes at least about four times
    /// its busy time. A bad character past the first piece is still named.
    #[test]
    fn paced_decoding_equals_unpaced_and_pauses() {
        // Noise, so the PNG and its base64 span several pieces (64 KiB).
        let mut x = 7u32;
        let img = RgbImage::from_fn(300, 300, |_, _| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            image::Rgb([x as u8, (x >> 8) as u8, (x >> 16) as u8])
        });
        let mut p = Cursor::new(Vec::new());
        img.write_to(&mut p, ImageFormat::Png).unwrap();
        let p = p.into_inner();
        let url = format!("data:image/png;base64,{}", base64::engine::general_purpose::STANDARD.encode(&p));
        assert!(url.len() > 3 * (64 << 10), "{} bytes", url.len());
        let (l, prep) = (ImageLimits::default(), ImagePrep::siglip(224));
        let run = |pace: &mut Pacing| {
            let bytes = data_url_bytes(&url, &l, pace).unwrap();
            let img = decode_image(&bytes, &l, pace).unwrap();
            (bytes, prep.pixels(&img, pace).unwrap())
        };
        let off = run(&mut Pacing::off());
        // At a quarter of a core, each slice of work (a preempted one
        // included: wall time) is followed by a pause three times as long;
        // only the last slice, shorter than `SLICE`, goes unpaused. Read off
        // the pacing's own clock, so a loaded machine cannot fail it.
        let t = Instant::now();
        let mut pace = Pacing::at(0.25);
        let paced = run(&mut pace);
        let (paused, work) = (pace.paused(), t.elapsed() - pace.paused());
        assert_eq!(paced, off);
        assert_eq!(off.0, p);
        assert!(work > 2 * SLICE, "{work:?} of work: too little to pace");
        assert!(paused >= (work - SLICE).mul_f64(2.5), "paused {paused:?} over {work:?} of work, at a quarter of a core");
        let mut bad = url.clone();
        bad.replace_range(url.len() - 10..url.len() - 9, "@");
        let Err(ImageError::Base64(e)) = data_url_bytes(&bad, &l, &mut Pacing::off()) else { panic!("a bad character passed") };
        assert!(e.contains(&format!("{}", bad.len() - 10 - "data:image/png;base64,".len())), "{e}");
    }

    #[test]
    fn a_data_url_round_trips() {
        let p = png(3, 2);
        let url = format!("data:image/png;base64,{}", base64::engine::general_purpose::STANDARD.encode(&p));
        assert_eq!(data_url_bytes(&url, &ImageLimits::default(), &mut Pacing::off()).unwrap(), p);
    }
}
