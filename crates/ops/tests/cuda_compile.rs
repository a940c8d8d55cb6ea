//! The CUDA kernels compile (NVRTC only: no GPU needed). Skips when the
//! `cuda` feature is off or libnvrtc is not on the library path.

#[cfg(feature = "cuda")]
#[test]
fn kernels_compile_for_hopper_and_ampere() {
    if !braid_ops::cuda::nvrtc_present() {
        eprintln!("SKIP: libnvrtc not found");
        return;
    }
    for arch in ["sm_90a", "sm_80"] {
        braid_ops::cuda::compile_check(arch, &[32, 64, 96, 128, 256], &[1, 4, 8, 16]).unwrap_or_else(|e| panic!("{arch}: {e:#}"));
    }
}

#[cfg(not(feature = "cuda"))]
#[test]
fn cuda_feature_off() {
    eprintln!("SKIP: built without the cuda feature");
}
