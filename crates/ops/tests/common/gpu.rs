//! The CUDA device for a GPU test, or `None` (with a notice) where no GPU
//! or driver is present, so the test passes as a skip, as in CI. Included
//! by `#[path]` from the ops and the models CUDA tests, so both skip alike.

use braid_ops::cuda::Cuda;

pub fn gpu() -> Option<Cuda> {
    match Cuda::new(0) {
        Ok(d) => Some(d),
        Err(e) => {
            eprintln!("SKIP: no CUDA device: {e:#}");
            None
        }
    }
}
