//! Images in chat messages: `image_url` content parts decoded to the
//! model's pixels, and placed in the rendered prompt as the model's image
//! rows (begin-of-image, one row per soft token named by the image's
//! content, end-of-image), where the part stood in the message.

use std::sync::Arc;

use braid_engine::{image_token_ids, PromptImage};
use braid_formats::images::{data_url_bytes, decode_image, pixels_hash, ImageLimits, ImagePrep, Pacing};

use crate::error::ApiError;
use crate::params::{ImagePart, Message};
use crate::ModelInfo;

/// Where an image part stood in a message's text, until the rendered
/// prompt is split there (U+FFFC, the object replacement character).
pub(crate) const PLACE: char = '\u{FFFC}';

/// What the server needs of a model that takes images.
#[derive(Clone, Debug)]
pub struct VisionInfo {
    pub prep: ImagePrep,
    /// Rows per image.
    pub tokens: usize,
    pub boi: Option<u32>,
    pub eoi: Option<u32>,
}

/// How images may reach the server.
#[derive(Clone, Debug)]
pub struct ImageRules {
    pub limits: ImageLimits,
    /// Fetch `http(s)` image URLs (off: only `data:` URLs are taken; the
    /// server reaches nothing on a client's behalf).
    pub allow_urls: bool,
    /// The most of a core decoding an image may take at a time (1: all it
    /// gets), in slices of under a millisecond: below 1 where the model
    /// runs on every core of the CPU, whose rounds a burst of other work
    /// stalls (see [`Pacing`]).
    pub duty: f64,
}

impl Default for ImageRules {
    fn default() -> Self {
        ImageRules { limits: ImageLimits::default(), allow_urls: false, duty: 1.0 }
    }
}

/// One decoded image: the model's pixels and their hash.
pub(crate) struct Decoded {
    pub pixels: Arc<[f32]>,
    pub hash: u64,
}

/// Decode every image part of `messages`, in order.
pub(crate) fn decode_all(info: &ModelInfo, messages: &[Message], rules: &ImageRules) -> Result<Vec<Decoded>, ApiError> {
    let parts: Vec<_> = messages.iter().flat_map(|m| &m.images).collect();
    if parts.is_empty() {
        return Ok(Vec::new());
    }
    let Some(v) = &info.vision else {
        return Err(ApiError::param(&parts[0].at, "This model takes no images (it has no vision tower); send text content parts only."));
    };
    // On a thread of its own at a low priority: the decoding (tens of ms of
    // an 896-pixel image) would otherwise take cores from the rounds of the
    // streams decoding meanwhile (on two cores, a round at the arrival of
    // an image took 66-70 ms against 26).
    std::thread::scope(|s| {
        std::thread::Builder::new()
            .name("braid-image".into())
            .spawn_scoped(s, || {
                lower_priority();
                decode_parts(v, &parts, rules)
            })
            .map_err(|e| ApiError::internal_logged(&format!("no thread to decode images on: {e}")))?
            .join()
            .unwrap_or_else(|_| Err(ApiError::internal_logged("decoding an image panicked")))
    })
}

/// The current thread yields its cores to the others of the process
/// (nice 10; it never asks for them back, so a thread of its own).
fn lower_priority() {
    #[cfg(target_os = "linux")]
    // SAFETY: plain system calls on the calling thread.
    unsafe {
        libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, 10);
    }
}

fn decode_parts(v: &VisionInfo, parts: &[&ImagePart], rules: &ImageRules) -> Result<Vec<Decoded>, ApiError> {
    let mut out = Vec::with_capacity(parts.len());
    let pace = &mut Pacing::at(rules.duty);
    for p in parts {
        let bad = |why: String| ApiError::param(&p.at, format!("`{}`: {why}", p.at)).with_code("invalid_image");
        let url = p.url.trim_start();
        let bytes = if url.starts_with("http://") || url.starts_with("https://") {
            if !rules.allow_urls {
                return Err(bad(
                    "image URLs are not fetched by this server; send the image inline as a base64 `data:` URL (or start the server with --allow-image-urls)"
                        .into(),
                ));
            }
            fetch(url, &rules.limits).map_err(bad)?
        } else {
            data_url_bytes(url, &rules.limits, pace).map_err(|e| bad(e.to_string()))?
        };
        let img = decode_image(&bytes, &rules.limits, pace).map_err(|e| bad(e.to_string()))?;
        let pixels = v.prep.pixels(&img, pace).map_err(|e| bad(format!("{e:#}")))?;
        out.push(Decoded { hash: pixels_hash(&pixels), pixels: pixels.into() });
    }
    Ok(out)
}

/// GET an `http://` URL (no TLS: `https://` is refused), within the byte limit.
fn fetch(url: &str, limits: &ImageLimits) -> Result<Vec<u8>, String> {
    use std::io::{Read, Write};
    use std::net::{TcpStream, ToSocketAddrs};
    use std::time::Duration;
    let Some(rest) = url.strip_prefix("http://") else {
        return Err("only http:// image URLs are fetched (no TLS here); send https images inline as data: URLs".into());
    };
    let (host, path) = rest.split_once('/').map_or((rest, "/".to_string()), |(h, p)| (h, format!("/{p}")));
    let addr = if host.contains(':') { host.to_string() } else { format!("{host}:80") };
    let sock = addr.to_socket_addrs().map_err(|e| format!("cannot resolve {host}: {e}"))?.next().ok_or(format!("cannot resolve {host}"))?;
    let mut s = TcpStream::connect_timeout(&sock, Duration::from_secs(10)).map_err(|e| format!("cannot reach {host}: {e}"))?;
    let _ = s.set_read_timeout(Some(Duration::from_secs(30)));
    // One write: `write!` on the socket would send the request in pieces.
    let request = format!("GET {path} HTTP/1.0\r\nHost: {host}\r\nAccept: image/*\r\n\r\n");
    s.write_all(request.as_bytes()).map_err(|e| e.to_string())?;
    let mut body = Vec::new();
    s.take(limits.max_bytes as u64 + 65536).read_to_end(&mut body).map_err(|e| format!("reading {url}: {e}"))?;
    let split = body.windows(4).position(|w| w == b"\r\n\r\n").ok_or("the reply has no HTTP header")?;
    let head = String::from_utf8_lossy(&body[..split]);
    if !head.starts_with("HTTP/1.0 200") && !head.starts_with("HTTP/1.1 200") {
        return Err(format!("fetching it answered `{}`", head.lines().next().unwrap_or_default()));
    }
    let data = body[split + 4..].to_vec();
    if data.len() > limits.max_bytes {
        return Err(format!("the image is more than {} bytes", limits.max_bytes));
    }
    Ok(data)
}

/// The prompt rows of an image placed at row `at`: begin-of-image, a row
/// per soft token named by the image's content, end-of-image; and the
/// image as the lane takes it.
pub fn image_block(v: &VisionInfo, at: usize, hash: u64, pixels: Arc<[f32]>) -> (Vec<u32>, PromptImage) {
    let mut ids: Vec<u32> = v.boi.into_iter().collect();
    let image = PromptImage { start: at + ids.len(), len: v.tokens, hash, pixels };
    ids.extend(image_token_ids(hash, v.tokens));
    ids.extend(v.eoi);
    (ids, image)
}

/// Tokenizes a piece of rendered prompt (`true`: with the special tokens it starts with).
pub(crate) type Encode<'a> = dyn Fn(&str, bool) -> Result<Vec<u32>, ApiError> + 'a;

/// `text`, a rendered prompt, tokenized with each image placed where its
/// part stood: the pieces between the places through `encode` (the first
/// with `first_special`), each image as Gemma 3's processor writes it
/// (`\n\n`, begin-of-image, its rows, end-of-image, `\n\n`).
pub(crate) fn place(
    info: &ModelInfo,
    text: &str,
    images: &[Decoded],
    encode: &Encode<'_>,
    first_special: bool,
) -> Result<(Vec<u32>, Vec<PromptImage>), ApiError> {
    let pieces: Vec<&str> = text.split(PLACE).collect();
    if pieces.len() - 1 > images.len() {
        return Err(ApiError::param(
            "messages",
            format!(
                "The messages hold the character U+FFFC, which braid uses to place images; remove it. ({} places, {} images)",
                pieces.len() - 1,
                images.len()
            ),
        ));
    }
    let mut ids = Vec::new();
    let mut placed = Vec::new();
    for (i, piece) in pieces.iter().enumerate() {
        ids.extend(encode(piece, i == 0 && first_special)?);
        let Some(img) = images.get(i).filter(|_| i + 1 < pieces.len()) else { continue };
        let v = info.vision.as_ref().expect("decode_all found the vision info");
        ids.extend(encode("\n\n", false)?);
        let (block, image) = image_block(v, ids.len(), img.hash, img.pixels.clone());
        ids.extend(block);
        placed.push(image);
        ids.extend(encode("\n\n", false)?);
    }
    Ok((ids, placed))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::TcpListener;

    /// A one-shot local HTTP server answering `reply`.
    fn serve_once(reply: Vec<u8>) -> String {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            // The whole request first: closing with unread bytes would
            // reset the connection before the client reads the reply.
            let (mut got, mut buf) = (Vec::new(), [0u8; 1024]);
            while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                match s.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => got.extend_from_slice(&buf[..n]),
                }
            }
            let _ = s.write_all(&reply);
            let _ = s.shutdown(std::net::Shutdown::Write);
            let _ = s.read_to_end(&mut got);
        });
        format!("http://{addr}/cat.png")
    }

    #[test]
    fn fetch_takes_an_http_image_within_the_limit() {
        let body = b"\x89PNG not really".to_vec();
        let ok = [b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\n\r\n".to_vec(), body.clone()].concat();
        assert_eq!(fetch(&serve_once(ok.clone()), &ImageLimits::default()).unwrap(), body);
        let small = ImageLimits { max_bytes: 4, ..ImageLimits::default() };
        assert!(fetch(&serve_once(ok), &small).unwrap_err().contains("more than 4 bytes"));
        let missing = b"HTTP/1.1 404 Not Found\r\n\r\n".to_vec();
        assert!(fetch(&serve_once(missing), &ImageLimits::default()).unwrap_err().contains("404"));
        assert!(fetch("https://example.invalid/cat.png", &ImageLimits::default()).unwrap_err().contains("only http://"));
    }
}
