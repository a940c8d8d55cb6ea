//! What several of these tests share: where the real model files and the
//! golden outputs live (absent ones skip, with a notice), and GPT-2's byte
//! table. Not every test file uses every helper.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

use serde_json::Value;

/// `$BRAID_MODELS`, else `$XDG_CACHE_HOME/braid`, else `~/.cache/braid`.
pub fn model_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("BRAID_MODELS").filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(d).join("braid");
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_default();
    home.join(".cache").join("braid")
}

/// `file` in [`model_dir`], or `None` (with a notice) when it is absent.
pub fn model_path(file: &str) -> Option<PathBuf> {
    let p = model_dir().join(file);
    if p.exists() {
        Some(p)
    } else {
        eprintln!("SKIP: {} not found (set BRAID_MODELS to the folder holding it)", p.display());
        None
    }
}

/// A golden file of `$BRAID_GOLDEN` (default the copies committed under
/// testdata/golden, so a clean clone runs these tests), or `None` (with a
/// notice) when it is absent.
pub fn golden(name: &str) -> Option<Value> {
    let dir = std::env::var_os("BRAID_GOLDEN").map(PathBuf::from).unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/golden"));
    let path = dir.join(name);
    match std::fs::read_to_string(&path) {
        Ok(s) => Some(serde_json::from_str(&s).expect("golden json")),
        Err(_) => {
            eprintln!("SKIP: golden file {} not found (set BRAID_GOLDEN)", path.display());
            None
        }
    }
}

/// GPT-2's byte → character table, written out independently of the crate.
pub fn byte_char(b: u8) -> char {
    let printable = |b: u8| matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF);
    if printable(b) {
        return b as char;
    }
    let n = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(0x100 + n).unwrap()
}
