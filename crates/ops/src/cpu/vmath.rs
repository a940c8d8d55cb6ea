//! A vectorized `exp` and the activations built on it.
//!
//! libm's `expf`/`tanhf` cost tens of nanoseconds a call; attention and the
//! gated MLPs call them millions of times per prompt. Here `exp` is a
//! Cephes-style range reduction and degree-5 polynomial (about 1 ulp), eight
//! lanes at a time. Every lane is computed by the same operations whatever
//! its neighbours, and the scalar form ([`exp`]) performs exactly the same
//! fused operations, so a value's result never depends on how a slice was
//! split into vectors and tails.

const LOG2E: f32 = std::f32::consts::LOG2_E;
/// ln 2 split in two, so `x - n ln 2` is exact in its first step.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// Above this the result would overflow; clamped (e^88 is finite).
const X_HI: f32 = 88.0;
/// Below this the result is flushed to 0 (2^-126 is the last normal).
const X_LO: f32 = -87.33;
const P: [f32; 6] = [1.987_569_1e-4, 1.398_2e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5];

/// e^x, as the vector kernels compute it lane by lane.
#[inline]
pub fn exp(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    if x < X_LO {
        return 0.0;
    }
    let x = x.min(X_HI);
    let n = (x * LOG2E).round_ties_even();
    let r = n.mul_add(-LN2_HI, x);
    let r = n.mul_add(-LN2_LO, r);
    let mut p = P[0];
    for c in &P[1..] {
        p = p.mul_add(r, *c);
    }
    let y = p.mul_add(r * r, r) + 1.0;
    y * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// `x * sigmoid(x)`.
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + exp(-x))
}

/// GELU, tanh form: `0.5 x (1 + tanh(u))` with `u = √(2/π)(x + 0.044715 x³)`,
/// computed as the equal `x / (1 + e^(-2u))`.
#[inline]
pub fn gelu(x: f32) -> f32 {
    let u = GELU_C * (x + 0.044715 * x * x * x);
    x / (1.0 + exp(-2.0 * u))
}

const GELU_C: f32 = 0.797_884_6; // sqrt(2/pi)

/// `out[i] = silu(gate[i]) * up[i]`.
pub fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU has AVX2 and FMA.
        return unsafe { avx2::silu_mul(gate, up, out) };
    }
    for ((o, g), u) in out.iter_mut().zip(gate).zip(up) {
        *o = silu(*g) * u;
    }
}

/// `out[i] = gelu(gate[i]) * up[i]`.
pub fn gelu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU has AVX2 and FMA.
        return unsafe { avx2::gelu_mul(gate, up, out) };
    }
    for ((o, g), u) in out.iter_mut().zip(gate).zip(up) {
        *o = gelu(*g) * u;
    }
}

/// AVX2 + FMA (+ F16C, which the other CPU kernels need too).
#[cfg(target_arch = "x86_64")]
pub fn has_avx2() -> bool {
    use std::sync::atomic::{AtomicU8, Ordering};
    static HAS: AtomicU8 = AtomicU8::new(0);
    match HAS.load(Ordering::Relaxed) {
        1 => false,
        2 => true,
        _ => {
            let yes = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c");
            HAS.store(if yes { 2 } else { 1 }, Ordering::Relaxed);
            yes
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
pub fn has_avx2() -> bool {
    false
}

/// [`has_avx2`] and AVX-512 F, BW, VL and DQ, unless `BRAID_CPU_ISA` caps
/// the kernels below AVX-512 ([`Isa::cap`](super::quant::Isa::cap), as it
/// does the matmuls').
#[cfg(target_arch = "x86_64")]
pub fn has_avx512() -> bool {
    use std::sync::atomic::{AtomicU8, Ordering};
    static HAS: AtomicU8 = AtomicU8::new(0);
    match HAS.load(Ordering::Relaxed) {
        1 => false,
        2 => true,
        _ => {
            let yes = super::quant::Isa::cap() == super::quant::Isa::Avx512Vnni
                && has_avx2()
                && is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512dq");
            HAS.store(if yes { 2 } else { 1 }, Ordering::Relaxed);
            yes
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
pub fn has_avx512() -> bool {
    false
}

#[cfg(target_arch = "x86_64")]
pub mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    /// Eight lanes of [`exp`](super::exp): the same operations, in order.
    ///
    /// # Safety
    /// AVX2 and FMA available.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub fn exp8(x: __m256) -> __m256 {
        let x0 = x;
        let nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x);
        let keep = _mm256_cmp_ps::<_CMP_GE_OQ>(x, _mm256_set1_ps(X_LO));
        let x = _mm256_min_ps(x, _mm256_set1_ps(X_HI));
        const RND: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        let n = _mm256_round_ps::<RND>(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)));
        let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_HI), x);
        let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_LO), r);
        let mut p = _mm256_set1_ps(P[0]);
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P[1]));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P[2]));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P[3]));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P[4]));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P[5]));
        let y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0));
        // Lanes below X_LO have n < -126; the mask zeroes them before the
        // exponent bits could wrap.
        let e = _mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)));
        let v = _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(e)), keep);
        _mm256_blendv_ps(v, x0, nan)
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn silu8(x: __m256) -> __m256 {
        let e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
        _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0), e))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn gelu8(x: __m256) -> __m256 {
        // Same operation order as the scalar `gelu`.
        let x3 = _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715), x), x), x);
        let u = _mm256_mul_ps(_mm256_set1_ps(GELU_C), _mm256_add_ps(x, x3));
        let e = exp8(_mm256_mul_ps(_mm256_set1_ps(-2.0), u));
        _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0), e))
    }

    /// `out = act(gate) * up`, eight lanes at a time then the tail: a macro,
    /// not a function taking `act`, so the vector activation inlines into
    /// each caller's AVX2 code.
    macro_rules! gated_mul {
        ($gate:ident, $up:ident, $out:ident, $act8:ident, $act:ident) => {
            let n = $out.len().min($gate.len()).min($up.len());
            let n8 = n / 8 * 8;
            for i in (0..n8).step_by(8) {
                let g = _mm256_loadu_ps($gate.as_ptr().add(i));
                let u = _mm256_loadu_ps($up.as_ptr().add(i));
                _mm256_storeu_ps($out.as_mut_ptr().add(i), _mm256_mul_ps($act8(g), u));
            }
            for i in n8..n {
                $out[i] = $act($gate[i]) * $up[i];
            }
        };
    }

    /// # Safety
    /// AVX2 and FMA available.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
        gated_mul!(gate, up, out, silu8, silu);
    }

    /// # Safety
    /// AVX2 and FMA available.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn gelu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
        gated_mul!(gate, up, out, gelu8, gelu);
    }
}

#[cfg(target_arch = "x86_64")]
pub mod avx512 {
    use super::*;
    use std::arch::x86_64::*;

    /// Sixteen lanes of [`exp`](super::exp): the same operations as
    /// [`exp8`](super::avx2::exp8), in order.
    ///
    /// # Safety
    /// AVX-512 F available.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub fn exp16(x: __m512) -> __m512 {
        let x0 = x;
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
        let keep = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(x, _mm512_set1_ps(X_LO));
        let x = _mm512_min_ps(x, _mm512_set1_ps(X_HI));
        const RND: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        let n = _mm512_roundscale_ps::<RND>(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)));
        let r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_HI), x);
        let r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_LO), r);
        let mut p = _mm512_set1_ps(P[0]);
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P[1]));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P[2]));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P[3]));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P[4]));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P[5]));
        let y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0));
        // As in exp8: lanes below X_LO are zeroed before their exponent
        // bits could wrap.
        let e = _mm512_slli_epi32::<23>(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)));
        let v = _mm512_maskz_mov_ps(keep, _mm512_mul_ps(y, _mm512_castsi512_ps(e)));
        _mm512_mask_mov_ps(v, nan, x0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_close_to_libm_and_handles_the_edges() {
        let mut worst = 0f32;
        let mut x = -87.0f32;
        while x < 88.0 {
            let (a, b) = (exp(x), x.exp());
            worst = worst.max(((a - b) / b).abs());
            x += 0.0137;
        }
        assert!(worst < 3e-7, "exp relative error {worst:e}");
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-100.0), 0.0);
        assert!(exp(1000.0).is_finite());
        assert!(exp(f32::NAN).is_nan());
    }

    #[test]
    fn activations_match_their_definitions() {
        for i in -400..400 {
            let x = i as f32 * 0.037;
            let silu_ref = x / (1.0 + (-x).exp());
            let gelu_ref = 0.5 * x * (1.0 + (GELU_C * (x + 0.044715 * x * x * x)).tanh());
            assert!((silu(x) - silu_ref).abs() <= 1e-6 * (1.0 + x.abs()), "silu({x})");
            assert!((gelu(x) - gelu_ref).abs() <= 1e-6 * (1.0 + x.abs()), "gelu({x}): {} vs {gelu_ref}", gelu(x));
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_lanes_equal_the_scalar_form() {
        if !has_avx2() {
            return;
        }
        // 37 values: four vectors and a scalar tail.
        let gate: Vec<f32> = (0..37).map(|i| (i as f32 - 18.0) * 0.61).collect();
        let up: Vec<f32> = (0..37).map(|i| 1.0 + i as f32 * 0.01).collect();
        let mut out = vec![0.0; 37];
        for (f, name) in [(gelu as fn(f32) -> f32, "gelu"), (silu, "silu")] {
            if name == "gelu" {
                gelu_mul(&gate, &up, &mut out);
            } else {
                silu_mul(&gate, &up, &mut out);
            }
            for i in 0..37 {
                assert_eq!(out[i], f(gate[i]) * up[i], "{name} lane {i}");
            }
        }
        let xs: Vec<f32> =
            (0..64).map(|i| -90.0 + i as f32 * 2.9).chain([f32::NAN, f32::NEG_INFINITY, f32::INFINITY, -0.0, 0.0, 1e-30, -87.33, 88.5]).collect();
        if has_avx512() {
            for c in xs.chunks_exact(16) {
                let mut got = [0f32; 16];
                // SAFETY: AVX-512 checked above.
                unsafe {
                    use std::arch::x86_64::*;
                    _mm512_storeu_ps(got.as_mut_ptr(), avx512::exp16(_mm512_loadu_ps(c.as_ptr())));
                }
                for (g, x) in got.iter().zip(c) {
                    assert_eq!(g.to_bits(), exp(*x).to_bits(), "exp16({x})");
                }
            }
        }
        for c in xs.chunks_exact(8) {
            let mut got = [0f32; 8];
            // SAFETY: AVX2 checked above.
            unsafe {
                use std::arch::x86_64::*;
                _mm256_storeu_ps(got.as_mut_ptr(), avx2::exp8(_mm256_loadu_ps(c.as_ptr())));
            }
            for (g, x) in got.iter().zip(c) {
                assert_eq!(g.to_bits(), exp(*x).to_bits(), "exp({x})");
            }
        }
    }
}
