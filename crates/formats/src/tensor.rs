//! A stored tensor as the file holds it: name, element type, shape, raw bytes.

use anyhow::{bail, Result};

use crate::{Bytes, DType};

/// One tensor of a model file, zero-copy: `data` points into the mapped file.
///
/// `shape` is row-major in PyTorch order (`[out, in]` for a linear weight),
/// i.e. GGUF's `ne` reversed. Quantized types pack whole blocks along the last
/// dimension, so `data` holds `rows()` rows of `cols()` elements each.
#[derive(Clone, Debug)]
pub struct TensorView {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub data: Bytes,
}

impl TensorView {
    /// Number of elements (1 for a shape of no dimensions).
    pub fn elements(&self) -> usize {
        // Readers check the product for overflow when they build a view.
        self.shape.iter().product()
    }

    /// Product of all dimensions but the last (1 for a vector or a scalar).
    pub fn rows(&self) -> usize {
        match self.shape.split_last() {
            Some((_, rest)) => rest.iter().product(),
            None => 1,
        }
    }

    /// The last dimension (1 for a scalar).
    pub fn cols(&self) -> usize {
        self.shape.last().copied().unwrap_or(1)
    }

    /// Decodes a plain float tensor (F32, F16, BF16) to f32. Quantized types
    /// are an error here: the ops layer dequantizes those.
    pub fn to_f32(&self) -> Result<Vec<f32>> {
        let n = self.elements();
        let want = self.dtype.bytes_for(n);
        if want != Some(self.data.len()) {
            bail!("tensor `{}`: {} data is {} bytes, but shape {:?} needs {:?}", self.name, self.dtype, self.data.len(), self.shape, want);
        }
        let d: &[u8] = &self.data;
        // The data may sit at any byte offset of the mapping, so decode from
        // bytes rather than casting the slice.
        Ok(match self.dtype {
            DType::F32 => d.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            DType::F16 => d.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            DType::BF16 => d.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            q => bail!("tensor `{}` is quantized ({q}); to_f32 handles only F32, F16 and BF16", self.name),
        })
    }
}
