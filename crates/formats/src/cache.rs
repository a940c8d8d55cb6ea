//! Where braid keeps models: `$BRAID_MODELS`, else `$XDG_CACHE_HOME/braid`,
//! else `~/.cache/braid`.

use std::path::PathBuf;

pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("BRAID_MODELS").filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(d).join("braid");
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("braid")
}

/// A cached model file by name, if present (for tests and tools).
pub fn cached_model(file: &str) -> Option<PathBuf> {
    let p = cache_dir().join(file);
    p.exists().then_some(p)
}
