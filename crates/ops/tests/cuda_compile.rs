//! The CUDA kernels compile (NVRTC only: no GPU needed), and every kernel
//! the device loads by name is defined in the sources. The compile skips
//! when the `cuda` feature is off or libnvrtc is not on the library path
//! (PyPI's `nvidia-cuda-nvrtc-cu12` / `-cu13` wheels ship it: put its `lib`
//! folder on `LD_LIBRARY_PATH`).

#[cfg(feature = "cuda")]
#[test]
fn kernels_compile_for_hopper_and_ampere() {
    if !braid_ops::cuda::nvrtc_present() {
        eprintln!("SKIP: libnvrtc not found");
        return;
    }
    let (head_dims, groups) = ([32, 64, 80, 96, 128, 256, 512], [1, 3, 4, 8, 16]);
    for arch in ["sm_90a", "sm_80"] {
        let t = std::time::Instant::now();
        braid_ops::cuda::compile_check(arch, &head_dims, &groups).unwrap_or_else(|e| panic!("{arch}: {e:#}"));
        eprintln!(
            "NVRTC {arch}: the base module, the hybrid module and {} attention modules (head dims {head_dims:?} x groups {groups:?}) compiled in {:.1} s",
            head_dims.len() * groups.len(),
            t.elapsed().as_secs_f64()
        );
    }
}

/// The kernel names `src` defines: each `extern "C" __global__` function
/// (after any `__launch_bounds__(..)`).
fn defined(src: &str) -> std::collections::HashSet<String> {
    let mut out = std::collections::HashSet::new();
    for part in src.split("extern \"C\" __global__").skip(1) {
        let mut rest = part.trim_start().strip_prefix("void").unwrap_or(part).trim_start();
        if let Some(r) = rest.strip_prefix("__launch_bounds__(") {
            rest = r.split_once(')').map_or(r, |(_, tail)| tail).trim_start();
        }
        let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
        if !name.is_empty() {
            out.insert(name);
        }
    }
    out
}

/// The comma-separated names of the invocation `mac!(...)` in `src` (not
/// its `macro_rules!` definition), in one list per `;`-separated part,
/// each part's `label:` dropped.
fn invocation(src: &str, mac: &str) -> Vec<Vec<String>> {
    let start = src.find(&format!("\n{mac}!(")).unwrap_or_else(|| panic!("no {mac}!( invocation")) + mac.len() + 3;
    let body = &src[start..start + src[start..].find(");").expect("the invocation's end")];
    body.split(';')
        .map(|part| {
            let part = part.split_once(':').map_or(part, |(_, names)| names);
            part.split(',').map(|n| n.trim().to_string()).filter(|n| !n.is_empty()).collect()
        })
        .collect()
}

/// Every kernel `Fns::load` (kernels.rs), the hybrid module's `Fns::load`
/// (recurrent.rs) and `attn_fns` (attention.rs) ask for by name is defined
/// in the CUDA sources: a kernel renamed on one side only fails here, not
/// at `Cuda::new` on a GPU.
#[test]
fn every_kernel_the_device_loads_is_defined() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/cuda");
    let read = |p: &str| std::fs::read_to_string(dir.join(p)).unwrap_or_else(|e| panic!("{p}: {e}"));
    let base = defined(&(read("kernels/base.cu") + &read("kernels/sampling.cu") + &read("kernels/gemv.cu") + &read("kernels/skinny.cu")));
    let lists = invocation(&read("kernels.rs"), "base_kernels");
    assert_eq!(lists.len(), 2, "base_kernels!: plain and gemv lists");
    let mut missing = Vec::new();
    for name in &lists[0] {
        if !base.contains(name) {
            missing.push(name.clone());
        }
    }
    // Each GEMV in its four builds (gemv.rs: `GvFns::load`).
    for name in &lists[1] {
        for build in [name.clone(), format!("{name}8"), format!("{name}_lean"), format!("{name}8_lean")] {
            if !base.contains(&build) {
                missing.push(build);
            }
        }
    }
    let hybrid = defined(&read("kernels/recurrent.cu"));
    let hy = invocation(&read("recurrent.rs"), "hybrid_kernels");
    for name in hy.iter().flatten() {
        if !hybrid.contains(&format!("hy_{name}")) {
            missing.push(format!("hy_{name}"));
        }
    }
    let attention = defined(&read("kernels/attention.cu"));
    let attn = ["attn_decode", "attn_decode_cl", "attn_combine", "attn_prefill", "attn_prefill_cl", "attn_prefill_combine"];
    for name in attn {
        if !attention.contains(name) {
            missing.push(name.to_string());
        }
    }
    assert!(missing.is_empty(), "kernels loaded by name but not defined: {missing:?}");
    eprintln!(
        "{} base kernels ({} GEMVs in 4 builds), {} hybrid kernels and {} attention kernels are defined",
        lists[0].len() + 4 * lists[1].len(),
        lists[1].len(),
        hy.iter().flatten().count(),
        attn.len()
    );
}

#[cfg(not(feature = "cuda"))]
#[test]
fn cuda_feature_off() {
    eprintln!("SKIP: built without the cuda feature");
}
