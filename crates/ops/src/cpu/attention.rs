//! Causal attention over paged f16 KV, batched over sequences of any length.
//!
//! A task is one (sequence, KV head, block of up to `QB` query rows): every
//! query head of that KV head's group and every row of the block share each
//! key and value row, which is converted from f16 once per task. Each query
//! keeps its own running max and sum (online softmax), and visits its keys
//! in position order with the same arithmetic whatever block or batch it sits
//! in, so results do not depend on chunking or batching.

use half::f16;

use super::{pool, CpuKv, CpuTensor, SendPtr};
use crate::AttnSeq;

const MAX_HEAD_DIM: usize = 512;
/// Query rows per task.
const QB: usize = 8;
/// Queries per task, roughly (rows × heads of one group).
const MAX_Q: usize = 64;

struct Task {
    seq: usize,
    kv_head: usize,
    row0: usize,
    rows: usize,
}

pub fn paged_attention(q: &CpuTensor, kv: &CpuKv, layer: usize, seqs: &[AttnSeq<'_>], scale: f32, softcap: Option<f32>, out: &mut CpuTensor) {
    let shape = kv.spec.layers[layer];
    let hd = shape.head_dim;
    assert!(hd <= MAX_HEAD_DIM, "head dim {hd} over {MAX_HEAD_DIM}");
    let heads = q.cols / hd;
    let group = heads / shape.kv_heads;
    let qb = (MAX_Q / group).clamp(1, QB);
    let mut tasks = Vec::new();
    for (si, s) in seqs.iter().enumerate() {
        for kv_head in 0..shape.kv_heads {
            let mut r = 0;
            while r < s.q_len {
                let rows = qb.min(s.q_len - r);
                tasks.push(Task { seq: si, kv_head, row0: r, rows });
                r += rows;
            }
        }
    }
    // Longest tasks (latest rows) first, so the pool's dynamic hand-out
    // balances the causal triangle.
    tasks.sort_by_key(|t| std::cmp::Reverse(seqs[t.seq].kv_len - seqs[t.seq].q_len + t.row0 + t.rows));
    let optr = SendPtr(out.data.as_mut_ptr());
    let ctx = Ctx { q, kv, layer, seqs, scale, softcap, hd, group, out: optr };
    let run = |i: usize| {
        let t = &tasks[i];
        #[cfg(target_arch = "x86_64")]
        {
            if has_avx2() && hd % 8 == 0 {
                // SAFETY: the CPU has AVX2, FMA and F16C (checked above).
                return unsafe { task_avx2(&ctx, t) };
            }
        }
        task_generic(&ctx, t)
    };
    if tasks.len() == 1 {
        run(0);
    } else {
        pool::parallel_for(tasks.len(), &run);
    }
}

struct Ctx<'a> {
    q: &'a CpuTensor,
    kv: &'a CpuKv,
    layer: usize,
    seqs: &'a [AttnSeq<'a>],
    scale: f32,
    softcap: Option<f32>,
    hd: usize,
    group: usize,
    out: SendPtr,
}

#[cfg(target_arch = "x86_64")]
fn has_avx2() -> bool {
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

/// Row/vector kernels the task body is written against.
trait Kern {
    fn load_f16(src: &[f16], dst: &mut [f32]);
    fn dot(a: &[f32], b: &[f32]) -> f32;
    /// `acc = acc * c + p * v`
    fn scale_add(acc: &mut [f32], c: f32, p: f32, v: &[f32]);
}

struct Generic;
impl Kern for Generic {
    #[inline(always)]
    fn load_f16(src: &[f16], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = s.to_f32();
        }
    }
    #[inline(always)]
    fn dot(a: &[f32], b: &[f32]) -> f32 {
        // Eight lanes, then a fixed reduction: the same order as the AVX2 path.
        let mut s = [0f32; 8];
        for (x, y) in a.chunks_exact(8).zip(b.chunks_exact(8)) {
            for k in 0..8 {
                s[k] = x[k].mul_add(y[k], s[k]);
            }
        }
        let mut t = ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
        let rem = a.len() - a.len() % 8;
        for (x, y) in a[rem..].iter().zip(&b[rem..]) {
            t += x * y;
        }
        t
    }
    #[inline(always)]
    fn scale_add(acc: &mut [f32], c: f32, p: f32, v: &[f32]) {
        for (a, x) in acc.iter_mut().zip(v) {
            *a = p.mul_add(*x, *a * c);
        }
    }
}

#[cfg(target_arch = "x86_64")]
struct Avx2;
#[cfg(target_arch = "x86_64")]
impl Kern for Avx2 {
    #[inline(always)]
    fn load_f16(src: &[f16], dst: &mut [f32]) {
        use std::arch::x86_64::*;
        // SAFETY: only reached from `task_avx2` (AVX2/F16C enabled); lengths
        // are equal multiples of 8.
        unsafe {
            for i in (0..dst.len()).step_by(8) {
                let h = _mm_loadu_si128(src.as_ptr().add(i) as *const __m128i);
                _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
            }
        }
    }
    #[inline(always)]
    fn dot(a: &[f32], b: &[f32]) -> f32 {
        use std::arch::x86_64::*;
        // SAFETY: as above.
        unsafe {
            let mut s = _mm256_setzero_ps();
            for i in (0..a.len()).step_by(8) {
                s = _mm256_fmadd_ps(_mm256_loadu_ps(a.as_ptr().add(i)), _mm256_loadu_ps(b.as_ptr().add(i)), s);
            }
            // Lanes (0+4, 2+6, 1+5, 3+7) as in `Generic::dot`.
            let hi = _mm256_extractf128_ps(s, 1);
            let lo = _mm256_castps256_ps128(s);
            let x = _mm_add_ps(lo, hi); // [0+4, 1+5, 2+6, 3+7]
            let y = _mm_add_ps(x, _mm_movehl_ps(x, x)); // [(0+4)+(2+6), (1+5)+(3+7), ..]
            let z = _mm_add_ss(y, _mm_shuffle_ps(y, y, 1));
            _mm_cvtss_f32(z)
        }
    }
    #[inline(always)]
    fn scale_add(acc: &mut [f32], c: f32, p: f32, v: &[f32]) {
        use std::arch::x86_64::*;
        // SAFETY: as above.
        unsafe {
            let (cv, pv) = (_mm256_set1_ps(c), _mm256_set1_ps(p));
            for i in (0..acc.len()).step_by(8) {
                let a = _mm256_mul_ps(_mm256_loadu_ps(acc.as_ptr().add(i)), cv);
                _mm256_storeu_ps(acc.as_mut_ptr().add(i), _mm256_fmadd_ps(pv, _mm256_loadu_ps(v.as_ptr().add(i)), a));
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn task_avx2(c: &Ctx<'_>, t: &Task) {
    task_body::<Avx2>(c, t)
}

fn task_generic(c: &Ctx<'_>, t: &Task) {
    task_body::<Generic>(c, t)
}

#[inline(always)]
fn task_body<K: Kern>(c: &Ctx<'_>, t: &Task) {
    let hd = c.hd;
    let s = &c.seqs[t.seq];
    let shape = c.kv.spec.layers[c.layer];
    let kv_w = shape.kv_heads * hd;
    let bt = c.kv.spec.block_tokens;
    let (kc, vc) = (&c.kv.k[c.layer], &c.kv.v[c.layer]);
    let nq = t.rows * c.group;
    // Per query: running max, running sum, accumulator.
    let mut m = vec![f32::NEG_INFINITY; nq];
    let mut l = vec![0f32; nq];
    let mut acc = vec![0f32; nq * hd];
    let mut kf = [0f32; MAX_HEAD_DIM];
    let mut vf = [0f32; MAX_HEAD_DIM];
    let first_pos = s.kv_len - s.q_len + t.row0;
    let last_pos = first_pos + t.rows - 1;
    let lo_of = |pos: usize| s.window.map_or(0, |w| (pos + 1).saturating_sub(w));
    let qrow = |i: usize, g: usize| {
        let r = s.q_start + t.row0 + i;
        let h = t.kv_head * c.group + g;
        &c.q.data[r * c.q.cols + h * hd..r * c.q.cols + (h + 1) * hd]
    };
    for j in lo_of(first_pos)..=last_pos {
        let slot = s.blocks[j / bt] as usize * bt + j % bt;
        let off = slot * kv_w + t.kv_head * hd;
        K::load_f16(&kc[off..off + hd], &mut kf[..hd]);
        K::load_f16(&vc[off..off + hd], &mut vf[..hd]);
        for i in 0..t.rows {
            let pos = first_pos + i;
            if j > pos || j < lo_of(pos) {
                continue;
            }
            for g in 0..c.group {
                let qi = i * c.group + g;
                let mut score = K::dot(qrow(i, g), &kf[..hd]) * c.scale;
                if let Some(cap) = c.softcap {
                    score = cap * (score / cap).tanh();
                }
                let new_m = m[qi].max(score);
                let corr = (m[qi] - new_m).exp();
                let p = (score - new_m).exp();
                l[qi] = l[qi] * corr + p;
                m[qi] = new_m;
                K::scale_add(&mut acc[qi * hd..(qi + 1) * hd], corr, p, &vf[..hd]);
            }
        }
    }
    for i in 0..t.rows {
        let r = s.q_start + t.row0 + i;
        for g in 0..c.group {
            let qi = i * c.group + g;
            let h = t.kv_head * c.group + g;
            // SAFETY: each (row, head) belongs to exactly one task.
            let dst = unsafe { c.out.slice(r * c.q.cols + h * hd, hd) };
            let inv = 1.0 / l[qi];
            for (d, a) in dst.iter_mut().zip(&acc[qi * hd..(qi + 1) * hd]) {
                *d = a * inv;
            }
        }
    }
}
