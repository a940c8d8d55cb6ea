//! Small pieces the hybrid families share: where each recurrent layer's
//! state sits in a stream's state row, the batch's sequences as the
//! recurrent ops take them, HF folders only, and scratch buffers.

use anyhow::{bail, ensure, Result};
use braid_ops::{Device, StateSeq};

use crate::config::HfConfig;
use crate::source::Source;
use crate::Batch;

/// Lays out a stream's state row: each recurrent layer takes the next
/// `len` values.
#[derive(Clone, Debug, Default)]
pub struct StateLayout {
    size: usize,
}

impl StateLayout {
    /// The offset of a new part of `len` values.
    pub fn take(&mut self, len: usize) -> usize {
        let at = self.size;
        self.size += len;
        at
    }

    pub fn size(&self) -> usize {
        self.size
    }
}

/// Each sequence of the batch with its state row.
pub fn state_seqs(batch: &Batch<'_>) -> Result<Vec<StateSeq>> {
    if batch.state_slots.len() != batch.seqs.len() {
        bail!("batch of {} sequences has {} state rows", batch.seqs.len(), batch.state_slots.len());
    }
    Ok(batch.seqs.iter().zip(batch.state_slots).map(|(s, &slot)| StateSeq { start: s.q_start, len: s.q_len, slot }).collect())
}

/// The config of an HF folder; these families load from safetensors only.
/// A hybrid's per-layer KV head counts from llama.cpp's per-layer
/// `{arch}.attention.head_count_kv` (0: the layer does not attend), one a
/// layer.
pub fn gguf_kv_heads(g: &braid_formats::gguf::Gguf, arch: &str, layers: usize) -> Result<Vec<u64>> {
    let key = format!("{arch}.attention.head_count_kv");
    let path = g.path().display();
    let kv = match g.get(&key).and_then(|v| v.as_array()) {
        Some(_) => g.get_u64_array(&key)?,
        None => bail!("{path}: {key} is not a per-layer list (which layers attend?)"),
    };
    ensure!(kv.len() == layers, "{path}: {key} names {} layers, the model has {layers}", kv.len());
    Ok(kv)
}

pub fn hf_config<'a>(src: &'a Source, family: &str) -> Result<HfConfig<'a>> {
    match src {
        Source::Hf(h) => Ok(HfConfig::new(h.config(), h.dir())),
        Source::Gguf(g) => bail!("{}: {family} is supported from an HF folder (config.json + safetensors), not GGUF", g.path().display()),
    }
}

/// `N` scratch buffers from `extra`, made when first asked for.
pub fn extras<'a, D: Device, const N: usize>(dev: &D, extra: &'a mut Vec<D::Tensor>) -> [&'a mut D::Tensor; N] {
    while extra.len() < N {
        extra.push(dev.tensor(0, 0));
    }
    let mut it = extra.iter_mut();
    std::array::from_fn(|_| it.next().expect("grown above"))
}
