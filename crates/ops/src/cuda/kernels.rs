//! CUDA C sources, compiled by NVRTC at run time for the device's arch.
//!
//! No CUDA headers are needed: bf16 values travel as `unsigned short` and are
//! converted with bit operations, and the tensor-core attention uses inline
//! PTX. Activations are f32; every kernel whose output feeds a GEMM also
//! writes a bf16 copy (the "shadow") so the GEMM can read it directly.

/// What every module's source starts with (each NVRTC module is compiled
/// on its own): the bf16 type and conversions, `NEG_INF`, warp reductions,
/// and the programmatic-dependent-launch macros every kernel opens with.
pub const PRELUDE: &str = r#"
typedef unsigned short bf16_t;
// Programmatic dependent launch (Hopper on): every kernel is launched
// allowed to start while the one before it runs. Each lets its successor
// launch at once, so the blocks of the next few kernels can sit on the SMs
// with their first weight loads issued (weights, never written, may be
// read before the wait; the GEMVs do), then waits for its predecessor
// (all of it, memory included; the predecessor finished only after its
// own wait, so everything earlier is complete too) before touching
// anything a kernel wrote. PDL_LATE (`BRAID_CUDA_PDL_EARLY=0`): let the
// successor launch only after the wait, one kernel ahead.
#if __CUDA_ARCH__ >= 900
#define PDL_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")
#define PDL_LAUNCH() asm volatile("griddepcontrol.launch_dependents;" ::: "memory")
#else
#define PDL_WAIT()
#define PDL_LAUNCH()
#endif
// PDL_PRE, work that reads only what no kernel of this forward writes
// (weights, uploaded indices), then PDL_POST.
#ifdef PDL_LATE
#define PDL_PRE() do { PDL_WAIT(); PDL_LAUNCH(); } while (0)
#define PDL_POST()
#else
#define PDL_PRE() PDL_LAUNCH()
#define PDL_POST() PDL_WAIT()
#endif
#define PDL_ENTRY() do { PDL_PRE(); PDL_POST(); } while (0)
#define NEG_INF (__int_as_float(0xff800000))

__device__ __forceinline__ float bf2f(bf16_t b) { return __uint_as_float(((unsigned)b) << 16); }
__device__ __forceinline__ bf16_t f2bf(float f) {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
"#;

/// A module's full source: the prelude, then `body`.
pub fn with_prelude(body: &str) -> String {
    format!("{}{PRELUDE}{body}", defines())
}

/// The compile-time settings from the environment: `PDL_LATE`, and
/// `GV_MINB`, the blocks per SM the 1–2-row GEMV kernels are built for
/// (`BRAID_CUDA_GEMV_MINB`).
fn defines() -> String {
    format!("{}#define GV_MINB {}\n", pdl_define(), super::gemv_min_blocks().max(1))
}

/// `BRAID_CUDA_PDL_EARLY=0`: kernels let their successor launch only after
/// their own wait (`PDL_LATE`).
fn pdl_define() -> &'static str {
    if super::env_flag("BRAID_CUDA_PDL_EARLY") {
        ""
    } else {
        "#define PDL_LATE\n"
    }
}

/// The attention module for head dim `hd` and `g` query heads per KV head.
pub fn attention_source(hd: usize, g: usize) -> String {
    format!("{}#define HD {hd}\n#define G {g}\n{PRELUDE}{ATTENTION}", pdl_define())
}

/// Elementwise, norm, RoPE, KV, gather and sampling kernels.
pub const BASE: &str = r#"
extern "C" __global__ void to_bf16(const float* __restrict__ x, bf16_t* __restrict__ y, long n) {
    PDL_ENTRY();
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) y[i] = f2bf(x[i]);
}

extern "C" __global__ void embed(const bf16_t* __restrict__ table, const unsigned* __restrict__ ids, int cols, int vocab,
                                 float scale, float* __restrict__ out, bf16_t* __restrict__ out_bf) {
    PDL_ENTRY();
    unsigned id = ids[blockIdx.x];
    if (id >= (unsigned)vocab) id = vocab - 1;
    const bf16_t* src = table + (long)id * cols;
    long base = (long)blockIdx.x * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float v = bf2f(src[c]) * scale;
        out[base + c] = v;
        out_bf[base + c] = f2bf(v);
    }
}

// One block (256 threads) per group of g elements.
extern "C" __global__ void rms_norm_block(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ out,
                                          bf16_t* __restrict__ out_bf, int g, float eps) {
    PDL_ENTRY();
    __shared__ float red[32];
    long base = (long)blockIdx.x * g;
    float ss = 0.f;
    for (int i = threadIdx.x; i < g; i += blockDim.x) { float v = x[base + i]; ss += v * v; }
    ss = warp_sum(ss);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) red[warp] = ss;
    __syncthreads();
    if (warp == 0) {
        float t = lane < (int)(blockDim.x >> 5) ? red[lane] : 0.f;
        t = warp_sum(t);
        if (lane == 0) red[0] = t;
    }
    __syncthreads();
    float inv = rsqrtf(red[0] / g + eps);
    for (int i = threadIdx.x; i < g; i += blockDim.x) {
        float v = x[base + i] * inv * (w ? w[i] : 1.f);
        out[base + i] = v;
        out_bf[base + i] = f2bf(v);
    }
}

// One warp per group (small groups: per-head norms).
extern "C" __global__ void rms_norm_warp(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ out,
                                         bf16_t* __restrict__ out_bf, int groups, int g, float eps) {
    PDL_ENTRY();
    int gi = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (gi >= groups) return;
    long base = (long)gi * g;
    float ss = 0.f;
    for (int i = lane; i < g; i += 32) { float v = x[base + i]; ss += v * v; }
    ss = warp_sum(ss);
    float inv = rsqrtf(ss / g + eps);
    for (int i = lane; i < g; i += 32) {
        float v = x[base + i] * inv * (w ? w[i] : 1.f);
        out[base + i] = v;
        out_bf[base + i] = f2bf(v);
    }
}

// x += y, then out = rms_norm(x) (one block per row; g = row width).
extern "C" __global__ void add_rms_norm(float* __restrict__ x, const float* __restrict__ y, const float* __restrict__ w,
                                        float* __restrict__ out, bf16_t* __restrict__ out_bf, int g, float eps) {
    PDL_ENTRY();
    __shared__ float red[32];
    long base = (long)blockIdx.x * g;
    float ss = 0.f;
    for (int i = threadIdx.x; i < g; i += blockDim.x) { float v = x[base + i] + y[base + i]; x[base + i] = v; ss += v * v; }
    ss = warp_sum(ss);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) red[warp] = ss;
    __syncthreads();
    if (warp == 0) {
        float t = lane < (int)(blockDim.x >> 5) ? red[lane] : 0.f;
        t = warp_sum(t);
        if (lane == 0) red[0] = t;
    }
    __syncthreads();
    float inv = rsqrtf(red[0] / g + eps);
    for (int i = threadIdx.x; i < g; i += blockDim.x) {
        float v = x[base + i] * inv * (w ? w[i] : 1.f);
        out[base + i] = v;
        out_bf[base + i] = f2bf(v);
    }
}

extern "C" __global__ void add(float* __restrict__ x, const float* __restrict__ y, long n) {
    PDL_ENTRY();
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) x[i] += y[i];
}

extern "C" __global__ void scale(float* __restrict__ x, float s, long n) {
    PDL_ENTRY();
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) x[i] *= s;
}

extern "C" __global__ void softcap(float* __restrict__ x, float cap, long n) {
    PDL_ENTRY();
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) x[i] = cap * tanhf(x[i] / cap);
}

extern "C" __global__ void silu_mul(const float* __restrict__ g, const float* __restrict__ u, float* __restrict__ out,
                                    bf16_t* __restrict__ out_bf, long n) {
    PDL_ENTRY();
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        float a = g[i];
        float v = a / (1.f + expf(-a)) * u[i];
        out[i] = v;
        out_bf[i] = f2bf(v);
    }
}

extern "C" __global__ void gelu_mul(const float* __restrict__ g, const float* __restrict__ u, float* __restrict__ out,
                                    bf16_t* __restrict__ out_bf, long n) {
    PDL_ENTRY();
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        float a = g[i];
        float v = 0.5f * a * (1.f + tanhf(0.7978846f * (a + 0.044715f * a * a * a))) * u[i];
        out[i] = v;
        out_bf[i] = f2bf(v);
    }
}

// One block per row; threads over (head, pair).
// Rotate pair i of one head at position p (pairs (i, i + dims/2) when
// neox, else (2i, 2i + 1)): the one RoPE step every kernel here shares.
__device__ __forceinline__ void rope_pair(float* hd, int i, int dims, float p, float theta, int neox) {
    const int half = dims / 2;
    float f = powf(theta, -((float)(2 * i)) / (float)dims);
    float s, c;
    sincosf(p * f, &s, &c);
    int a = neox ? i : 2 * i;
    int b = neox ? i + half : 2 * i + 1;
    float x0 = hd[a], x1 = hd[b];
    hd[a] = x0 * c - x1 * s;
    hd[b] = x0 * s + x1 * c;
}

extern "C" __global__ void rope(float* __restrict__ x, const unsigned* __restrict__ pos, int cols, int head_dim, int dims,
                                float theta, float pscale, int neox) {
    PDL_ENTRY();
    int half = dims / 2;
    int heads = cols / head_dim;
    float p = (float)pos[blockIdx.x] / pscale;
    float* row = x + (long)blockIdx.x * cols;
    for (int t = threadIdx.x; t < heads * half; t += blockDim.x) rope_pair(row + (t / half) * head_dim, t % half, dims, p, theta, neox);
}

extern "C" __global__ void kv_write(const float* __restrict__ k, const float* __restrict__ v, const unsigned* __restrict__ slots,
                                    int w, bf16_t* __restrict__ kc, bf16_t* __restrict__ vc) {
    PDL_ENTRY();
    long dst = (long)slots[blockIdx.x] * w;
    long src = (long)blockIdx.x * w;
    for (int i = threadIdx.x; i < w; i += blockDim.x) {
        kc[dst + i] = f2bf(k[src + i]);
        vc[dst + i] = f2bf(v[src + i]);
    }
}

extern "C" __global__ void gather_rows(const float* __restrict__ x, const unsigned* __restrict__ rows, int cols,
                                       float* __restrict__ out, bf16_t* __restrict__ out_bf) {
    PDL_ENTRY();
    long src = (long)rows[blockIdx.x] * cols;
    long dst = (long)blockIdx.x * cols;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        float v = x[src + i];
        out[dst + i] = v;
        out_bf[dst + i] = f2bf(v);
    }
}

// Greedy sampling: the first index of each row's largest value. Blocks
// split a row; each folds (value, index) into one 64-bit key per row with
// atomicMax (order-preserving float bits above, the complemented index
// below, so ties go to the first index). `out` starts at zero.
// A value and its column as one key that orders like the host's top_n:
// larger value first, then the lower column; NaN counts as -inf (never
// wins). 0 is below every key (padding).
__device__ __forceinline__ unsigned long long rank_key(float v, int i) {
    unsigned u = v != v ? 0xff800000u : __float_as_uint(v);
    unsigned ord = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ((unsigned long long)ord << 32) | (unsigned long long)(0xffffffffu - (unsigned)i);
}

// Sort s[0..n) (n a power of two) largest first, by the whole block.
__device__ __forceinline__ void bitonic_desc(unsigned long long* s, int n) {
    for (int size = 2; size <= n; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            __syncthreads();
            for (int t = threadIdx.x; t < n / 2; t += blockDim.x) {
                const int lo = 2 * t - (t & (stride - 1)), hi = lo + stride;
                const unsigned long long a = s[lo], b = s[hi];
                if (((lo & size) == 0) ? a < b : a > b) { s[lo] = b; s[hi] = a; }
            }
        }
    }
    __syncthreads();
}

// Top-k of each row in two steps: each block sorts one chunk of a row (n,
// a power of two, at most 4096 values) and keeps its k best keys; then one
// block per row sorts the m = chunks * k kept keys (n2 >= m) and keeps k.
#define TOPK_MAX_N 4096
extern "C" __global__ void topk_chunks(const float* __restrict__ x, int cols, int n, int k, unsigned long long* __restrict__ part) {
    PDL_ENTRY();
    __shared__ unsigned long long s[TOPK_MAX_N];
    const float* row = x + (long)blockIdx.y * cols;
    const int a = blockIdx.x * n;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s[i] = a + i < cols ? rank_key(row[a + i], a + i) : 0ull;
    bitonic_desc(s, n);
    unsigned long long* out = part + ((long)blockIdx.y * gridDim.x + blockIdx.x) * k;
    for (int i = threadIdx.x; i < k; i += blockDim.x) out[i] = s[i];
}

extern "C" __global__ void topk_merge(const unsigned long long* __restrict__ part, int m, int n2, int k, unsigned long long* __restrict__ out) {
    PDL_ENTRY();
    __shared__ unsigned long long s[TOPK_MAX_N];
    const unsigned long long* p = part + (long)blockIdx.x * m;
    for (int i = threadIdx.x; i < n2; i += blockDim.x) s[i] = i < m ? p[i] : 0ull;
    bitonic_desc(s, n2);
    for (int i = threadIdx.x; i < k; i += blockDim.x) out[(long)blockIdx.x * k + i] = s[i];
}

// Each row's argmax, over gridDim.y blocks a row: the blocks' best keys
// meet in keys (atomicMax); the last block to finish turns every row's key
// into its token id (ids, and dst if any: where a round prepared ahead
// reads its tokens) and clears keys and the count for the next call, so
// no clearing launch comes before. keys and done start zeroed.
extern "C" __global__ void argmax_rows(const float* __restrict__ x, int cols, unsigned long long* keys, unsigned* done,
                                       unsigned* __restrict__ ids, unsigned* __restrict__ dst) {
    PDL_ENTRY();
    __shared__ unsigned long long best_s[32];
    __shared__ bool last;
    const float* row = x + (long)blockIdx.x * cols;
    const int chunk = (cols + gridDim.y - 1) / gridDim.y;
    const int a = blockIdx.y * chunk, b = min(cols, a + chunk);
    unsigned long long best = 0ull;
    // Unrolled so several loads are out at once (the row sits in L2).
    #pragma unroll 4
    for (int i = a + threadIdx.x; i < b; i += blockDim.x) {
        const unsigned long long key = rank_key(row[i], i);
        best = key > best ? key : best;
    }
    for (int o = 16; o > 0; o >>= 1) {
        unsigned long long other = __shfl_xor_sync(0xffffffffu, best, o);
        best = other > best ? other : best;
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) best_s[warp] = best;
    __syncthreads();
    if (warp == 0) {
        best = lane < (int)(blockDim.x >> 5) ? best_s[lane] : 0ull;
        for (int o = 16; o > 0; o >>= 1) {
            unsigned long long other = __shfl_xor_sync(0xffffffffu, best, o);
            best = other > best ? other : best;
        }
        if (lane == 0) {
            if (best != 0ull) atomicMax(keys + blockIdx.x, best);
            __threadfence();
            last = atomicAdd(done, 1u) == gridDim.x * gridDim.y - 1;
        }
    }
    __syncthreads();
    if (last) {
        __threadfence();
        for (int r = threadIdx.x; r < gridDim.x; r += blockDim.x) {
            const unsigned long long k = atomicExch(keys + r, 0ull);
            const unsigned id = k == 0ull ? 0u : 0xffffffffu - (unsigned)(k & 0xffffffffull);
            ids[r] = id;
            if (dst) dst[r] = id;
        }
        if (threadIdx.x == 0) *done = 0u;
    }
}

// ---- Few-row GEMV (decode): y[i, j] = x[i, :] · w[j, :] for n <= 8 rows of x ----
// cuBLAS's kernels for a handful of rows leave much of the HBM bandwidth
// unused; here each warp streams one weight row (or a slice of it) with
// 16-byte non-allocating loads, 4 in flight per lane, against every x row
// (x is small and stays in L1/L2). A block of 8 warps covers R weight rows,
// each split over 8 / R warps along k so small weights still fill the GPU;
// the slices meet in shared memory.
#define GV_WARPS 8

__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
    uint4 r;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

template <int N>
__device__ __forceinline__ void gv_fma8(uint4 w, const uint4* __restrict__ x, int k8, int c, float* acc) {
    const unsigned wu[4] = {w.x, w.y, w.z, w.w};
    #pragma unroll
    for (int i = 0; i < N; i++) {
        const uint4 xv = x[(long)i * k8 + c];
        const unsigned xu[4] = {xv.x, xv.y, xv.z, xv.w};
        float a = acc[i];
        #pragma unroll
        for (int e = 0; e < 4; e++) {
            a = fmaf(__uint_as_float(wu[e] << 16), __uint_as_float(xu[e] << 16), a);
            a = fmaf(__uint_as_float(wu[e] & 0xffff0000u), __uint_as_float(xu[e] & 0xffff0000u), a);
        }
        acc[i] = a;
    }
}

// An RMSNorm of x folded into the product (the weight's columns were
// scaled by the norm's weight at load, see `Cuda::fold_norm`): xf, x's f32
// rows, gives each row's sum of squares, read once per block while the
// first weight loads are out, and 1/rms scales the sums at the end, so no
// weight load waits for it. xf null: no norm.
struct GvIn {
    const float* xf;
    float eps;
};

// The block's share of each x row's sum of squares, into red[64 + warp * 8 + i].
template <int N>
__device__ __forceinline__ void gv_sumsq(GvIn nx, int k8, float* red) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    #pragma unroll
    for (int i = 0; i < N; i++) {
        const float4* row = (const float4*)(nx.xf + (long)i * k8 * 8);
        float ss = 0.f;
        for (int c = threadIdx.x; c < k8 * 2; c += blockDim.x) {
            const float4 v = row[c];
            ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
        ss = warp_sum(ss);
        if (lane == 0) red[64 + warp * 8 + i] = ss;
    }
}

// Row i's 1/rms from the partial sums (after the block's barrier); 1 without a norm.
__device__ __forceinline__ float gv_scale(const float* red, GvIn nx, int k8, int i) {
    if (!nx.xf) return 1.f;
    float s = 0.f;
    for (int w = 0; w < GV_WARPS; w++) s += red[64 + w * 8 + i];
    return rsqrtf(s / (float)(k8 * 8) + nx.eps);
}

// One warp's share: weight row `w` (k8 chunks of 8 values), chunks
// [c0, c1), into red[warp * 8 + i] (lane sums folded).
template <int N, int U>
__device__ __forceinline__ void gv_warp(const bf16_t* __restrict__ w, const uint4* __restrict__ x, GvIn nx, int k8, int c0, int c1, float* red) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float acc[N];
    #pragma unroll
    for (int i = 0; i < N; i++) acc[i] = 0.f;
    // U loads in flight per lane; the first U go out before waiting for
    // x's producer.
    const uint4* wr = (const uint4*)w;
    int c = c0 + lane;
    const bool pre = w && c + 32 * (U - 1) < c1;
    uint4 wv[U];
    if (pre) {
        #pragma unroll
        for (int u = 0; u < U; u++) wv[u] = ld_stream(wr + c + 32 * u);
    }
    PDL_ENTRY();
    if (nx.xf) gv_sumsq<N>(nx, k8, red);
    if (w) {
        if (pre) {
            #pragma unroll
            for (int u = 0; u < U; u++) gv_fma8<N>(wv[u], x, k8, c + 32 * u, acc);
            c += 32 * U;
        }
        for (; c + 32 * (U - 1) < c1; c += 32 * U) {
            #pragma unroll
            for (int u = 0; u < U; u++) wv[u] = ld_stream(wr + c + 32 * u);
            #pragma unroll
            for (int u = 0; u < U; u++) gv_fma8<N>(wv[u], x, k8, c + 32 * u, acc);
        }
        for (; c < c1; c += 32) gv_fma8<N>(ld_stream(wr + c), x, k8, c, acc);
    }
    #pragma unroll
    for (int i = 0; i < N; i++) {
        float v = warp_sum(acc[i]);
        if (lane == 0) red[warp * 8 + i] = v;
    }
}

// Virtual row vr (0 <= vr < R) of this block, its k slice, and its weight
// row pointer (null past the end).
template <int N, int U>
__device__ __forceinline__ void gv_block(const bf16_t* __restrict__ w, int row0, int m, const uint4* __restrict__ x, GvIn nx, int k8, int R, float* red) {
    const int warp = threadIdx.x >> 5;
    const int S = GV_WARPS / R;
    const int r = warp % R, slice = warp / R;
    const int j = row0 + r;
    const int per = (k8 + S - 1) / S;
    const int c0 = min(k8, slice * per), c1 = min(k8, c0 + per);
    gv_warp<N, U>(j < m ? w + (long)j * k8 * 8 : (const bf16_t*)0, x, nx, k8, c0, c1, red);
}

// Sum of the S slices of virtual row vr, for x row i.
__device__ __forceinline__ float gv_total(const float* red, int R, int vr, int i) {
    float s = 0.f;
    for (int q = vr; q < GV_WARPS; q += R) s += red[q * 8 + i];
    return s;
}

// resid: y += the product (the residual stream); y_bf, if any, gets the
// result's bf16 copy.
template <int N, int U>
__device__ __forceinline__ void gemv_n(const bf16_t* __restrict__ w, int blk, int m, const uint4* __restrict__ x, GvIn nx, int k8, int R,
                                       float* __restrict__ y, bf16_t* __restrict__ y_bf, int resid, float* red) {
    gv_block<N, U>(w, blk * R, m, x, nx, k8, R, red);
    __syncthreads();
    const int t = threadIdx.x;
    if (t < R * N) {
        const int r = t / N, i = t % N, j = blk * R + r;
        if (j < m) {
            const long o = (long)i * m + j;
            const float v = gv_total(red, R, r, i) * gv_scale(red, nx, k8, i) + (resid ? y[o] : 0.f);
            y[o] = v;
            if (y_bf) y_bf[o] = f2bf(v);
        }
    }
}

// CALL(N) with the x row count n as the template argument N (1..8); the
// lean kernels (LEAN) take 1 or 2 rows only. A kernel's registers are
// those of its largest case: without the 3..8-row cases, a lean kernel
// fits GV_MINB blocks on an SM where the full one fits 2, which keeps more
// weight loads in flight and lets the next kernel's blocks in sooner.
#define GV_ROWS(n, CALL) if (LEAN) { if (n == 1) CALL(1); else CALL(2); } else switch (n) { \
    case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; case 4: CALL(4); break; \
    case 5: CALL(5); break; case 6: CALL(6); break; case 7: CALL(7); break; default: CALL(8); break; }

// Up to three weights sharing x (q, k, v): blocks [0, nb0) for w0, the next
// nb1 for w1, the rest for w2. y_bf may be null.
template <int U, bool LEAN>
__device__ __forceinline__ void gemv_body(const bf16_t* __restrict__ x_, int n, int k8, int R,
    const bf16_t* w0, const bf16_t* w1, const bf16_t* w2, float* y0, float* y1, float* y2,
    bf16_t* b0, bf16_t* b1, bf16_t* b2, int m0, int m1, int m2, int nb0, int nb1, GvIn nx, int resid) {
    __shared__ float red[GV_WARPS * 16];
    const uint4* x = (const uint4*)x_;
    int blk = blockIdx.x;
    const bf16_t* w = w0; float* y = y0; bf16_t* yb = b0; int m = m0;
    if (blk >= nb0 + nb1) { blk -= nb0 + nb1; w = w2; y = y2; yb = b2; m = m2; }
    else if (blk >= nb0) { blk -= nb0; w = w1; y = y1; yb = b1; m = m1; }
#define GV_CALL(NN) gemv_n<NN, U>(w, blk, m, x, nx, k8, R, y, yb, resid, red)
    GV_ROWS(n, GV_CALL)
#undef GV_CALL
}

#define GEMV_ARGS const bf16_t* __restrict__ x_, int n, int k8, int R, const bf16_t* w0, const bf16_t* w1, const bf16_t* w2, \
    float* y0, float* y1, float* y2, bf16_t* b0, bf16_t* b1, bf16_t* b2, int m0, int m1, int m2, int nb0, int nb1, \
    const float* xf, float eps, int resid
#define GEMV_PASS x_, n, k8, R, w0, w1, w2, y0, y1, y2, b0, b1, b2, m0, m1, m2, nb0, nb1, GvIn{xf, eps}, resid
// gemv8: eight loads in flight per lane (long rows).
extern "C" __global__ void __launch_bounds__(256) gemv(GEMV_ARGS) { gemv_body<4, false>(GEMV_PASS); }
extern "C" __global__ void __launch_bounds__(256) gemv8(GEMV_ARGS) { gemv_body<8, false>(GEMV_PASS); }
extern "C" __global__ void __launch_bounds__(256, GV_MINB) gemv_lean(GEMV_ARGS) { gemv_body<4, true>(GEMV_PASS); }
extern "C" __global__ void __launch_bounds__(256, GV_MINB) gemv8_lean(GEMV_ARGS) { gemv_body<8, true>(GEMV_PASS); }

// q, k and v with RoPE and the KV write in the store (few rows): one launch
// instead of the GEMV and rope_kv. Each block takes 8 weight rows, one per
// warp: for q and k the two halves of 4 RoPE pairs (rows (p, p + hd/2) of
// a head with neox, else (2p, 2p + 1)), so both values of a pair meet in
// the block; for v 8 consecutive rows. Rotary dims must span the head.
__device__ __forceinline__ int rope_row(int pair, int member, int hd, int neox) {
    const int half = hd / 2, head = pair / half, p = pair % half;
    return head * hd + (neox ? p + member * half : 2 * p + member);
}

template <int N, int U>
__device__ __forceinline__ void gemv_rope_n(const bf16_t* __restrict__ w, int kind, int blk, int m, const uint4* __restrict__ x, GvIn nx, int k8,
    float* __restrict__ y, int hd, int neox, float theta, float pscale, const unsigned* __restrict__ pos,
    const unsigned* __restrict__ slots, int nslots, bf16_t* __restrict__ cache, int kv_w, float* red) {
    const int warp = threadIdx.x >> 5;
    const int j = kind == 2 ? blk * 8 + warp : rope_row(blk * 4 + (warp & 3), warp >> 2, hd, neox);
    gv_warp<N, U>(j < m ? w + (long)j * k8 * 8 : (const bf16_t*)0, x, nx, k8, 0, k8, red);
    __syncthreads();
    const int t = threadIdx.x;
    if (t >= 8 * N) return;
    const int r = t / N, i = t % N;
    const float sc = gv_scale(red, nx, k8, i);
    float v;
    int col;
    if (kind == 2) {
        col = blk * 8 + r;
        if (col >= m) return;
        v = red[r * 8 + i] * sc;
    } else {
        const int pair = blk * 4 + (r & 3), member = r >> 2, half = hd / 2, pi = pair % half;
        col = rope_row(pair, member, hd, neox);
        if (col >= m) return;
        // rope_pair's arithmetic.
        const float f = powf(theta, -((float)(2 * pi)) / (float)hd);
        float sn, cs;
        sincosf((float)pos[i] / pscale * f, &sn, &cs);
        const float x0 = red[(r & 3) * 8 + i] * sc, x1 = red[((r & 3) + 4) * 8 + i] * sc;
        v = member ? x0 * sn + x1 * cs : x0 * cs - x1 * sn;
    }
    y[(long)i * m + col] = v;
    if (kind > 0 && i < nslots) cache[(long)slots[i] * kv_w + col] = f2bf(v);
}

template <int U, bool LEAN>
__device__ __forceinline__ void gemv_rope_body(const bf16_t* __restrict__ x_, int n, int k8, const bf16_t* wq, const bf16_t* wk,
    const bf16_t* wv, float* yq, float* yk, float* yv, int mq, int mk, int nbq, int nbk, int hd, int neox, float theta,
    float pscale, const unsigned* __restrict__ pos, const unsigned* __restrict__ slots, int nslots, bf16_t* kc, bf16_t* vc, GvIn nx) {
    __shared__ float red[GV_WARPS * 16];
    const uint4* x = (const uint4*)x_;
    int blk = blockIdx.x, kind = 0;
    const bf16_t* w = wq; float* y = yq; int m = mq; bf16_t* cache = 0;
    if (blk >= nbq + nbk) { blk -= nbq + nbk; kind = 2; w = wv; y = yv; m = mk; cache = vc; }
    else if (blk >= nbq) { blk -= nbq; kind = 1; w = wk; y = yk; m = mk; cache = kc; }
#define GV_CALL(NN) gemv_rope_n<NN, U>(w, kind, blk, m, x, nx, k8, y, hd, neox, theta, pscale, pos, slots, nslots, cache, mk, red)
    GV_ROWS(n, GV_CALL)
#undef GV_CALL
}

#define ROPE_ARGS const bf16_t* __restrict__ x_, int n, int k8, const bf16_t* wq, const bf16_t* wk, const bf16_t* wv, float* yq, \
    float* yk, float* yv, int mq, int mk, int nbq, int nbk, int hd, int neox, float theta, float pscale, \
    const unsigned* __restrict__ pos, const unsigned* __restrict__ slots, int nslots, bf16_t* kc, bf16_t* vc, const float* xf, float eps
#define ROPE_PASS x_, n, k8, wq, wk, wv, yq, yk, yv, mq, mk, nbq, nbk, hd, neox, theta, pscale, pos, slots, nslots, kc, vc, GvIn{xf, eps}
extern "C" __global__ void __launch_bounds__(256) gemv_rope(ROPE_ARGS) { gemv_rope_body<4, false>(ROPE_PASS); }
extern "C" __global__ void __launch_bounds__(256) gemv_rope8(ROPE_ARGS) { gemv_rope_body<8, false>(ROPE_PASS); }
extern "C" __global__ void __launch_bounds__(256, GV_MINB) gemv_rope_lean(ROPE_ARGS) { gemv_rope_body<4, true>(ROPE_PASS); }
extern "C" __global__ void __launch_bounds__(256, GV_MINB) gemv_rope8_lean(ROPE_ARGS) { gemv_rope_body<8, true>(ROPE_PASS); }

__device__ __forceinline__ float gate_act(float a, int act) {
    return act == 0 ? a / (1.f + expf(-a)) : 0.5f * a * (1.f + tanhf(0.7978846f * (a + 0.044715f * a * a * a)));
}

// Gated MLP input for few rows: each block takes R rows of gate (virtual
// rows 0..R) and the same R rows of up (R..2R), then out = act(g) * u.
template <int N, int U>
__device__ __forceinline__ void gemv_gated_n(const bf16_t* __restrict__ wg, const bf16_t* __restrict__ wu, int m,
                                             const uint4* __restrict__ x, GvIn nx, int k8, int R, int act,
                                             float* __restrict__ out, bf16_t* __restrict__ out_bf, float* red) {
    const int warp = threadIdx.x >> 5;
    const int R2 = 2 * R;
    const int S = GV_WARPS / R2;
    const int vr = warp % R2, slice = warp / R2;
    const int j = blockIdx.x * R + (vr < R ? vr : vr - R);
    const int per = (k8 + S - 1) / S;
    const int c0 = min(k8, slice * per), c1 = min(k8, c0 + per);
    const bf16_t* w = vr < R ? wg : wu;
    gv_warp<N, U>(j < m ? w + (long)j * k8 * 8 : (const bf16_t*)0, x, nx, k8, c0, c1, red);
    __syncthreads();
    const int t = threadIdx.x;
    if (t < R * N) {
        const int r = t / N, i = t % N, jj = blockIdx.x * R + r;
        if (jj < m) {
            const float sc = gv_scale(red, nx, k8, i);
            const float g = gv_total(red, R2, r, i) * sc, u = gv_total(red, R2, R + r, i) * sc;
            const float v = gate_act(g, act) * u;
            out[(long)i * m + jj] = v;
            out_bf[(long)i * m + jj] = f2bf(v);
        }
    }
}

template <int U, bool LEAN>
__device__ __forceinline__ void gemv_gated_body(const bf16_t* __restrict__ x_, int n, int k8, int R,
    const bf16_t* __restrict__ wg, const bf16_t* __restrict__ wu, int m, int act, float* __restrict__ out, bf16_t* __restrict__ out_bf,
    GvIn nx) {
    __shared__ float red[GV_WARPS * 16];
    const uint4* x = (const uint4*)x_;
#define GV_CALL(NN) gemv_gated_n<NN, U>(wg, wu, m, x, nx, k8, R, act, out, out_bf, red)
    GV_ROWS(n, GV_CALL)
#undef GV_CALL
}

#define GATED_ARGS const bf16_t* __restrict__ x_, int n, int k8, int R, const bf16_t* __restrict__ wg, const bf16_t* __restrict__ wu, \
    int m, int act, float* __restrict__ out, bf16_t* __restrict__ out_bf, const float* xf, float eps
#define GATED_PASS x_, n, k8, R, wg, wu, m, act, out, out_bf, GvIn{xf, eps}
extern "C" __global__ void __launch_bounds__(256) gemv_gated(GATED_ARGS) { gemv_gated_body<4, false>(GATED_PASS); }
extern "C" __global__ void __launch_bounds__(256) gemv_gated8(GATED_ARGS) { gemv_gated_body<8, false>(GATED_PASS); }
extern "C" __global__ void __launch_bounds__(256, GV_MINB) gemv_gated_lean(GATED_ARGS) { gemv_gated_body<4, true>(GATED_PASS); }
extern "C" __global__ void __launch_bounds__(256, GV_MINB) gemv_gated8_lean(GATED_ARGS) { gemv_gated_body<8, true>(GATED_PASS); }

// Gated activation over bf16 gate/up (the GEMMs wrote bf16: half the bytes
// of f32 both ways); out in f32 and bf16.
extern "C" __global__ void act_mul_bf(const bf16_t* __restrict__ g, const bf16_t* __restrict__ u, float* __restrict__ out,
                                      bf16_t* __restrict__ out_bf, long n, int act) {
    PDL_ENTRY();
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        float v = gate_act(bf2f(g[i]), act) * bf2f(u[i]);
        out[i] = v;
        out_bf[i] = f2bf(v);
    }
}

// The same over 8 values a thread (16-byte loads and stores): n8 = n / 8.
extern "C" __global__ void act_mul_bf8(const uint4* __restrict__ g, const uint4* __restrict__ u, float4* __restrict__ out,
                                       uint4* __restrict__ out_bf, long n8, int act) {
    PDL_ENTRY();
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n8; i += (long)gridDim.x * blockDim.x) {
        const uint4 gv = g[i], uv = u[i];
        const unsigned gw[4] = {gv.x, gv.y, gv.z, gv.w}, uw[4] = {uv.x, uv.y, uv.z, uv.w};
        float v[8];
        #pragma unroll
        for (int e = 0; e < 4; e++) {
            v[2 * e] = gate_act(__uint_as_float(gw[e] << 16), act) * __uint_as_float(uw[e] << 16);
            v[2 * e + 1] = gate_act(__uint_as_float(gw[e] & 0xffff0000u), act) * __uint_as_float(uw[e] & 0xffff0000u);
        }
        out[2 * i] = make_float4(v[0], v[1], v[2], v[3]);
        out[2 * i + 1] = make_float4(v[4], v[5], v[6], v[7]);
        uint4 b;
        b.x = (unsigned)f2bf(v[0]) | ((unsigned)f2bf(v[1]) << 16);
        b.y = (unsigned)f2bf(v[2]) | ((unsigned)f2bf(v[3]) << 16);
        b.z = (unsigned)f2bf(v[4]) | ((unsigned)f2bf(v[5]) << 16);
        b.w = (unsigned)f2bf(v[6]) | ((unsigned)f2bf(v[7]) << 16);
        out_bf[i] = b;
    }
}

// rope on q and k, then k and v into the KV pool (one block per row; the
// same arithmetic as `rope` and `kv_write`). Rows past nslots are rotated
// but not stored.
// Many rows (prefill): one block per row, threads over (head, pair), then
// the row's KV write.
extern "C" __global__ void rope_kv_rows(float* q, float* k, const float* __restrict__ v, const unsigned* __restrict__ pos,
                                   const unsigned* __restrict__ slots, int nslots, int q_cols, int kv_w, int head_dim, int dims,
                                   float theta, float pscale, int neox, bf16_t* __restrict__ kc, bf16_t* __restrict__ vc) {
    PDL_ENTRY();
    const int half = dims / 2;
    const int qh = q_cols / head_dim, kh = kv_w / head_dim;
    const float p = (float)pos[blockIdx.x] / pscale;
    float* qrow = q + (long)blockIdx.x * q_cols;
    float* krow = k + (long)blockIdx.x * kv_w;
    for (int t = threadIdx.x; t < (qh + kh) * half; t += blockDim.x) {
        const int h = t / half;
        rope_pair(h < qh ? qrow + h * head_dim : krow + (h - qh) * head_dim, t % half, dims, p, theta, neox);
    }
    __syncthreads();
    if ((int)blockIdx.x < nslots) {
        const long dst = (long)slots[blockIdx.x] * kv_w;
        const float* vrow = v + (long)blockIdx.x * kv_w;
        for (int i = threadIdx.x; i < kv_w; i += blockDim.x) {
            kc[dst + i] = f2bf(krow[i]);
            vc[dst + i] = f2bf(vrow[i]);
        }
    }
}

// Few rows (decode): one block per (row, head), RoPE of that q or k head; a
// k head's block then writes its k and v slice to the KV cache (a single
// block per row was latency-bound: 5.9 µs a layer at one stream).
extern "C" __global__ void rope_kv(float* q, float* k, const float* __restrict__ v, const unsigned* __restrict__ pos,
                                   const unsigned* __restrict__ slots, int nslots, int q_cols, int kv_w, int head_dim, int dims,
                                   float theta, float pscale, int neox, bf16_t* __restrict__ kc, bf16_t* __restrict__ vc) {
    PDL_ENTRY();
    const int half = dims / 2;
    const int qh = q_cols / head_dim;
    const int row = blockIdx.x, h = blockIdx.y;
    const float p = (float)pos[row] / pscale;
    float* hd = h < qh ? q + (long)row * q_cols + h * head_dim : k + (long)row * kv_w + (h - qh) * head_dim;
    for (int i = threadIdx.x; i < half; i += blockDim.x) rope_pair(hd, i, dims, p, theta, neox);
    if (h >= qh && row < nslots) {
        __syncthreads();
        const int off = (h - qh) * head_dim;
        const long dst = (long)slots[row] * kv_w + off;
        const float* vrow = v + (long)row * kv_w + off;
        for (int i = threadIdx.x; i < head_dim; i += blockDim.x) {
            kc[dst + i] = f2bf(hd[i]);
            vc[dst + i] = f2bf(vrow[i]);
        }
    }
}

// w[j, c] *= g[c] (bf16 weight, f32 g): an RMSNorm's weight folded into
// the product that reads the norm (see GvIn).
extern "C" __global__ void scale_cols(bf16_t* __restrict__ w, const float* __restrict__ g, long n, int cols) {
    PDL_ENTRY();
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        w[i] = f2bf(bf2f(w[i]) * g[i % cols]);
}

// Random bf16 values, uniform in [-a, a) + bias, from a counter hash (random-weight models).
__device__ __forceinline__ unsigned hash32(unsigned long long x) {
    x ^= x >> 33; x *= 0xff51afd7ed558ccdULL; x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ULL; x ^= x >> 33;
    return (unsigned)x;
}
extern "C" __global__ void fill_random_bf16(bf16_t* __restrict__ y, long n, unsigned long long seed, float a, float bias) {
    PDL_ENTRY();
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        float u = (hash32(seed * 0x9e3779b97f4a7c15ULL + (unsigned long long)i) >> 8) * (1.0f / 16777216.0f);
        y[i] = f2bf((2.f * u - 1.f) * a + bias);
    }
}
extern "C" __global__ void fill_f32(float* __restrict__ y, long n, float v) {
    PDL_ENTRY();
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) y[i] = v;
}
"#;

/// Paged attention, compiled once per (HD = head dim, G = query heads per KV
/// head). The metadata array (`meta`) holds, per sequence, `[q_start, q_len,
/// kv_len, window, block-table offset]`, then the work lists, then the block
/// tables (see `cuda::attention_meta`).
pub const ATTENTION: &str = r#"
__device__ __forceinline__ unsigned pack_bf2(float lo, float hi) { return (unsigned)f2bf(lo) | ((unsigned)f2bf(hi) << 16); }

#define DEC_THREADS 128
#define DEC_NO ((G * HD / 2 + DEC_THREADS - 1) / DEC_THREADS)
// Keys per tile. The tile's K and V rows sit in shared memory; sizes keep
// the block under 48 KB for G up to 16.
#define DEC_TK ((HD <= 64 ? 128 : HD <= 128 ? 64 : 32) / (G > 8 ? 2 : 1))
// A K/V row in 16-byte chunks, padded by one chunk so that the 8 threads
// of a quarter warp reading one chunk of 8 rows hit distinct banks.
#define DEC_RC (HD / 8)
#define DEC_RP (DEC_RC + 1)
// Threads per key for the scores: each takes every DEC_GS-th head, DEC_HPT of them.
#define DEC_GS (DEC_THREADS / DEC_TK)
#define DEC_HPT ((G + DEC_GS - 1) / DEC_GS)

#if __CUDA_ARCH__ >= 900
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// A float in block `rank`'s shared memory, at the address `p` has in this block's.
__device__ __forceinline__ float ld_cluster(const float* p, unsigned rank) {
    unsigned a = (unsigned)__cvta_generic_to_shared(p), r;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(r) : "memory");
    return v;
}
#endif

// 16 bytes global -> shared without registers (Ampere on).
__device__ __forceinline__ void copy16_async(uint4* dst, const uint4* src) {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src) : "memory");
#else
    *dst = *src;
#endif
}
__device__ __forceinline__ void copy_async_wait_all() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}

// The splits' (acc, m, l) of the cluster's blocks (block = split, cp in
// each block's shared memory, G x (HD + 2)) merged as attn_combine does;
// each block writes a share of the G x HD outputs. A thread loads all its
// remote values before using any (one round trip, not one per split). The
// second barrier keeps every block's shared memory alive until all have
// read it.
__device__ __forceinline__ void cl_merge(const float* cp, int row, int kvh, int split, int nsplit, int q_cols,
                                         float* __restrict__ out, bf16_t* __restrict__ out_bf) {
#if __CUDA_ARCH__ >= 900
    cluster_sync();
    for (int idx = split * DEC_THREADS + threadIdx.x; idx < G * HD; idx += nsplit * DEC_THREADS) {
        const int g = idx / HD, d = idx % HD;
        const float* pg = cp + g * (HD + 2);
        float ms[8], ls[8], as[8];
        #pragma unroll
        for (int k = 0; k < 8; k++) {
            if (k < nsplit) {
                ms[k] = ld_cluster(pg + HD, k);
                ls[k] = ld_cluster(pg + HD + 1, k);
                as[k] = ld_cluster(pg + d, k);
            }
        }
        float M = NEG_INF;
        #pragma unroll
        for (int k = 0; k < 8; k++) if (k < nsplit) M = fmaxf(M, ms[k]);
        float L = 0.f, acc = 0.f;
        #pragma unroll
        for (int k = 0; k < 8; k++) {
            if (k < nsplit && ms[k] != NEG_INF) {
                const float w = __expf(ms[k] - M);
                L += w * ls[k];
                acc += w * as[k];
            }
        }
        const float v = L > 0.f ? acc / L : 0.f;
        const long off = (long)row * q_cols + (kvh * G + g) * HD + d;
        out[off] = v;
        out_bf[off] = f2bf(v);
    }
    cluster_sync();
#endif
}

// Decode attention: one block per (split, kv head, query row). Each block
// walks its share of the row's keys in tiles of DEC_TK. The tile's key
// slots come from the uploaded block table before the wait for q's
// producer; after it, the tile's K and V rows are copied into shared
// memory all at once (one memory round trip, not one per key). Then the
// scores for the G query heads of this KV head, an online-softmax update
// per head (one warp per head), and P·V with threads over (head, dim
// pair), all out of shared memory. With nsplit > 1 the block leaves (acc,
// m, l) for attn_combine, or (CL: the splits of a row and KV head form
// one thread-block cluster) in its shared memory, where the cluster's
// blocks merge them (cl_merge).
template <bool CL>
__device__ __forceinline__ void attn_decode_body(
    const float* __restrict__ q, int q_cols, const bf16_t* __restrict__ kc, const bf16_t* __restrict__ vc, int kv_w, int bt,
    const unsigned* __restrict__ meta, int off_rows, int off_bt, int nsplit, float scale, float softcap, int heads,
    float* __restrict__ out, bf16_t* __restrict__ out_bf, float* __restrict__ part)
{
    PDL_PRE();
    // K rows, then V rows; after the last tile, the splits' partials (cp).
    __shared__ uint4 kv_s[2][DEC_TK][DEC_RP];
    __shared__ float qs[G][HD];
    __shared__ float sc[G][DEC_TK];
    __shared__ int slot_s[DEC_TK];
    __shared__ float m_s[G], l_s[G], corr_s[G];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int z = blockIdx.z, kvh = blockIdx.y, split = blockIdx.x;
    const unsigned s = meta[off_rows + 2 * z], i = meta[off_rows + 2 * z + 1];
    const unsigned* st = meta + 5 * s;
    const int q_start = st[0], q_len = st[1], kv_len = st[2], window = st[3];
    const unsigned* blocks = meta + off_bt + st[4];
    const int row = q_start + i;
    const int pos = kv_len - q_len + i;
    const int lo = window > 0 ? max(0, pos + 1 - window) : 0;
    const int n = pos + 1 - lo;
    int chunk = (n + nsplit - 1) / nsplit;
    chunk = (chunk + 15) & ~15;
    const int a = lo + split * chunk;
    const int b = min(pos + 1, a + chunk);
    if (tid < DEC_TK) slot_s[tid] = a + tid < b ? (int)blocks[(a + tid) / bt] * bt + (a + tid) % bt : 0;
    if (tid < G) { m_s[tid] = NEG_INF; l_s[tid] = 0.f; }
    PDL_POST();

    for (int idx = tid; idx < G * HD; idx += DEC_THREADS) {
        int g = idx / HD, d = idx % HD;
        qs[g][d] = q[(long)row * q_cols + (kvh * G + g) * HD + d] * scale;
    }
    float2 acc[DEC_NO];
    #pragma unroll
    for (int o = 0; o < DEC_NO; o++) acc[o] = make_float2(0.f, 0.f);
    __syncthreads();

    for (int t0 = a; t0 < b; t0 += DEC_TK) {
        const int nk = min(DEC_TK, b - t0);
        for (int c = tid; c < nk * DEC_RC; c += DEC_THREADS) {
            const int key = c / DEC_RC, part_c = c % DEC_RC;
            const long base = (long)slot_s[key] * kv_w + kvh * HD;
            copy16_async(&kv_s[0][key][part_c], (const uint4*)(kc + base) + part_c);
            copy16_async(&kv_s[1][key][part_c], (const uint4*)(vc + base) + part_c);
        }
        // The next tile's slot, its block-table read beside the copies.
        const int jn = t0 + DEC_TK + tid;
        const int next = tid < DEC_TK && jn < b ? (int)blocks[jn / bt] * bt + jn % bt : 0;
        copy_async_wait_all();
        __syncthreads();
        if (tid < DEC_TK) slot_s[tid] = next;
        {
            const int key = tid % DEC_TK, g0 = tid / DEC_TK;
            float sg[DEC_HPT];
            #pragma unroll
            for (int h = 0; h < DEC_HPT; h++) sg[h] = 0.f;
            if (key < nk) {
                #pragma unroll 4
                for (int c = 0; c < DEC_RC; c++) {
                    const uint4 kv = kv_s[0][key][c];
                    const unsigned w4[4] = {kv.x, kv.y, kv.z, kv.w};
                    #pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const float k0 = __uint_as_float(w4[e] << 16), k1 = __uint_as_float(w4[e] & 0xffff0000u);
                        #pragma unroll
                        for (int h = 0; h < DEC_HPT; h++) {
                            const int g = g0 + h * DEC_GS;
                            if (g < G) sg[h] += qs[g][c * 8 + 2 * e] * k0 + qs[g][c * 8 + 2 * e + 1] * k1;
                        }
                    }
                }
            }
            #pragma unroll
            for (int h = 0; h < DEC_HPT; h++) {
                const int g = g0 + h * DEC_GS;
                if (g >= G) continue;
                float v = sg[h];
                if (softcap > 0.f) v = softcap * tanhf(v / softcap);
                sc[g][key] = key < nk ? v : NEG_INF;
            }
        }
        __syncthreads();
        for (int g = warp; g < G; g += DEC_THREADS / 32) {
            float mx = NEG_INF;
            for (int k = lane; k < DEC_TK; k += 32) mx = fmaxf(mx, sc[g][k]);
            mx = warp_max(mx);
            const float mold = m_s[g];
            const float mnew = fmaxf(mold, mx);
            const float corr = mold == NEG_INF ? 0.f : __expf(mold - mnew);
            float sum = 0.f;
            for (int k = lane; k < DEC_TK; k += 32) {
                const float sv = sc[g][k];
                const float p = sv == NEG_INF ? 0.f : __expf(sv - mnew);
                sc[g][k] = p;
                sum += p;
            }
            sum = warp_sum(sum);
            __syncwarp();
            if (lane == 0) { l_s[g] = l_s[g] * corr + sum; m_s[g] = mnew; corr_s[g] = corr; }
        }
        __syncthreads();
        #pragma unroll
        for (int o = 0; o < DEC_NO; o++) {
            const int idx = tid + o * DEC_THREADS;
            if (idx < G * HD / 2) {
                const int g = idx / (HD / 2), d2 = idx % (HD / 2);
                const float c = corr_s[g];
                float ax = acc[o].x * c, ay = acc[o].y * c;
                #pragma unroll 8
                for (int k = 0; k < nk; k++) {
                    const float p = sc[g][k];
                    const unsigned vv = ((const unsigned*)kv_s[1][k])[d2];
                    ax += p * __uint_as_float(vv << 16);
                    ay += p * __uint_as_float(vv & 0xffff0000u);
                }
                acc[o] = make_float2(ax, ay);
            }
        }
        __syncthreads();
    }

    float* cp = (float*)kv_s;
    #pragma unroll
    for (int o = 0; o < DEC_NO; o++) {
        const int idx = tid + o * DEC_THREADS;
        if (idx < G * HD / 2) {
            const int g = idx / (HD / 2), d2 = idx % (HD / 2);
            const int h = kvh * G + g;
            if (nsplit == 1) {
                const float l = l_s[g];
                const float inv = l > 0.f ? 1.f / l : 0.f;
                const long off = (long)row * q_cols + h * HD + 2 * d2;
                out[off] = acc[o].x * inv;
                out[off + 1] = acc[o].y * inv;
                out_bf[off] = f2bf(acc[o].x * inv);
                out_bf[off + 1] = f2bf(acc[o].y * inv);
            } else {
                float* pp = CL ? cp + g * (HD + 2) : part + (((long)z * heads + h) * nsplit + split) * (HD + 2);
                pp[2 * d2] = acc[o].x;
                pp[2 * d2 + 1] = acc[o].y;
                if (d2 == 0) { pp[HD] = m_s[g]; pp[HD + 1] = l_s[g]; }
            }
        }
    }
    if (CL && nsplit > 1) cl_merge(cp, row, kvh, split, nsplit, q_cols, out, out_bf);
}

#define DEC_ARGS const float* __restrict__ q, int q_cols, const bf16_t* __restrict__ kc, const bf16_t* __restrict__ vc, int kv_w, \
    int bt, const unsigned* __restrict__ meta, int off_rows, int off_bt, int nsplit, float scale, float softcap, int heads, \
    float* __restrict__ out, bf16_t* __restrict__ out_bf, float* __restrict__ part
#define DEC_PASS q, q_cols, kc, vc, kv_w, bt, meta, off_rows, off_bt, nsplit, scale, softcap, heads, out, out_bf, part
extern "C" __global__ void __launch_bounds__(DEC_THREADS) attn_decode(DEC_ARGS) { attn_decode_body<false>(DEC_PASS); }
// Launched with clusters of nsplit blocks along x (Hopper on): no attn_combine.
extern "C" __global__ void __launch_bounds__(DEC_THREADS) attn_decode_cl(DEC_ARGS) { attn_decode_body<true>(DEC_PASS); }

// Merge the splits of attn_decode: one block of HD threads per (row, head).
extern "C" __global__ void attn_combine(const float* __restrict__ part, const unsigned* __restrict__ meta, int off_rows, int nsplit,
                                        int heads, int q_cols, float* __restrict__ out, bf16_t* __restrict__ out_bf) {
    PDL_ENTRY();
    const int z = blockIdx.x, h = blockIdx.y, d = threadIdx.x;
    const unsigned s = meta[off_rows + 2 * z], i = meta[off_rows + 2 * z + 1];
    const int row = meta[5 * s] + i;
    const float* pp = part + ((long)z * heads + h) * nsplit * (HD + 2);
    float M = NEG_INF;
    for (int k = 0; k < nsplit; k++) M = fmaxf(M, pp[k * (HD + 2) + HD]);
    float L = 0.f, acc = 0.f;
    for (int k = 0; k < nsplit; k++) {
        const float m = pp[k * (HD + 2) + HD];
        if (m == NEG_INF) continue;
        const float w = __expf(m - M);
        L += w * pp[k * (HD + 2) + HD + 1];
        acc += w * pp[k * (HD + 2) + d];
    }
    const float v = L > 0.f ? acc / L : 0.f;
    const long off = (long)row * q_cols + h * HD + d;
    out[off] = v;
    out_bf[off] = f2bf(v);
}

#if __CUDA_ARCH__ >= 800
// Prefill attention on tensor cores (mma.sync m16n8k16, bf16 in, f32
// accumulate): one block of 4 warps per (64 query rows of one sequence,
// query head); each warp owns 16 rows. K and V tiles of PF_KT keys are
// gathered from the paged pool into shared memory (V transposed), rows
// padded by 8 values so the fragment loads are free of bank conflicts. A
// warp skips tiles wholly outside its rows' causal (and window) range and
// masks only the tiles that cross an edge. Scores are kept in log2 units.
#define PF_KT (HD > 128 ? 32 : 64)
#define PF_KP (HD + 8)
#define PF_VP (PF_KT + 8)
#define PF_BQ 64
#define PF_THREADS 128

__device__ __forceinline__ void mma16816(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

extern "C" __global__ void __launch_bounds__(PF_THREADS) attn_prefill(
    const float* __restrict__ q, int q_cols, const bf16_t* __restrict__ kc, const bf16_t* __restrict__ vc, int kv_w, int bt,
    const unsigned* __restrict__ meta, int off_tiles, int off_bt, float scale, float softcap,
    float* __restrict__ out, bf16_t* __restrict__ out_bf)
{
    PDL_ENTRY();
    __shared__ __align__(16) bf16_t Ks[PF_KT * PF_KP];
    __shared__ __align__(16) bf16_t Vt[HD * PF_VP];
    const float LOG2E = 1.4426950408889634f;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gid = lane >> 2, tig = lane & 3;
    const int h = blockIdx.y, kvh = h / G;
    const unsigned s = meta[off_tiles + 2 * blockIdx.x];
    const int i0 = meta[off_tiles + 2 * blockIdx.x + 1];
    const unsigned* st = meta + 5 * s;
    const int q_start = st[0], q_len = st[1], kv_len = st[2], window = st[3];
    const unsigned* blocks = meta + off_bt + st[4];
    const int base_pos = kv_len - q_len;
    const int r0 = i0 + warp * 16 + gid, r1 = r0 + 8;
    const int p0 = base_pos + r0, p1 = base_pos + r1;
    const int lo0 = window > 0 ? max(0, p0 + 1 - window) : 0;
    const int lo1 = window > 0 ? max(0, p1 + 1 - window) : 0;
    const int last_row = min(i0 + PF_BQ - 1, q_len - 1);
    const int key_hi = base_pos + last_row;  // inclusive
    const int key_lo = window > 0 ? max(0, base_pos + i0 + 1 - window) : 0;
    // This warp's rows: first and last position, smallest and largest window start.
    const int wr_first = i0 + warp * 16;
    const bool warp_active = wr_first < q_len;
    const int wr_last = min(wr_first + 15, q_len - 1);
    const int wp_first = base_pos + wr_first, wp_last = base_pos + wr_last;
    const int wlo_first = window > 0 ? max(0, wp_first + 1 - window) : 0;
    const int wlo_last = window > 0 ? max(0, wp_last + 1 - window) : 0;
    const bool warp_rows_full = wr_first + 15 < q_len;

    unsigned qa[HD / 16][4];
    {
        const float* q0 = q + (long)(q_start + min(r0, q_len - 1)) * q_cols + h * HD;
        const float* q1 = q + (long)(q_start + min(r1, q_len - 1)) * q_cols + h * HD;
        #pragma unroll
        for (int ks = 0; ks < HD / 16; ks++) {
            const int c = ks * 16 + tig * 2;
            qa[ks][0] = pack_bf2(q0[c], q0[c + 1]);
            qa[ks][1] = pack_bf2(q1[c], q1[c + 1]);
            qa[ks][2] = pack_bf2(q0[c + 8], q0[c + 9]);
            qa[ks][3] = pack_bf2(q1[c + 8], q1[c + 9]);
        }
    }
    float o[HD / 8][4];
    #pragma unroll
    for (int nt = 0; nt < HD / 8; nt++) { o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.f; }
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;

    for (int kb = key_lo; kb <= key_hi; kb += PF_KT) {
        __syncthreads();
        // K and V rows: consecutive threads take consecutive 16-byte parts
        // of a row (coalesced); V is stored transposed.
        for (int c = tid; c < PF_KT * (HD / 8); c += PF_THREADS) {
            const int key = c / (HD / 8), part = c % (HD / 8);
            const int j = kb + key;
            uint4 kv4 = make_uint4(0, 0, 0, 0), vv4 = make_uint4(0, 0, 0, 0);
            if (j < kv_len) {
                const long slot = (long)blocks[j / bt] * bt + j % bt;
                kv4 = *(const uint4*)(kc + slot * kv_w + kvh * HD + part * 8);
                vv4 = *(const uint4*)(vc + slot * kv_w + kvh * HD + part * 8);
            }
            *(uint4*)&Ks[key * PF_KP + part * 8] = kv4;
            const unsigned vw[4] = {vv4.x, vv4.y, vv4.z, vv4.w};
            #pragma unroll
            for (int e = 0; e < 4; e++) {
                Vt[(part * 8 + 2 * e) * PF_VP + key] = (bf16_t)(vw[e] & 0xffffu);
                Vt[(part * 8 + 2 * e + 1) * PF_VP + key] = (bf16_t)(vw[e] >> 16);
            }
        }
        __syncthreads();
        if (!warp_active || kb > wp_last || kb + PF_KT - 1 < wlo_first) continue;
        const bool full = warp_rows_full && kb + PF_KT - 1 <= wp_first && kb >= wlo_last;

        float sacc[PF_KT / 8][4];
        #pragma unroll
        for (int nt = 0; nt < PF_KT / 8; nt++) {
            sacc[nt][0] = sacc[nt][1] = sacc[nt][2] = sacc[nt][3] = 0.f;
            const bf16_t* krow = Ks + (nt * 8 + gid) * PF_KP + tig * 2;
            #pragma unroll
            for (int ks = 0; ks < HD / 16; ks++) {
                const unsigned b0 = *(const unsigned*)(krow + ks * 16);
                const unsigned b1 = *(const unsigned*)(krow + ks * 16 + 8);
                mma16816(sacc[nt], qa[ks], b0, b1);
            }
        }
        float mx0 = NEG_INF, mx1 = NEG_INF;
        #pragma unroll
        for (int nt = 0; nt < PF_KT / 8; nt++) {
            #pragma unroll
            for (int e = 0; e < 4; e++) {
                const bool top = e < 2;
                float v = sacc[nt][e] * scale;
                if (softcap > 0.f) v = softcap * tanhf(v / softcap);
                v *= LOG2E;
                if (!full) {
                    const int key = kb + nt * 8 + tig * 2 + (e & 1);
                    const bool ok = (top ? r0 : r1) < q_len && key <= (top ? p0 : p1) && key >= (top ? lo0 : lo1);
                    v = ok ? v : NEG_INF;
                }
                sacc[nt][e] = v;
                if (top) mx0 = fmaxf(mx0, v); else mx1 = fmaxf(mx1, v);
            }
        }
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
        const float c0 = n0 == NEG_INF ? 1.f : exp2f(m0 - n0);
        const float c1 = n1 == NEG_INF ? 1.f : exp2f(m1 - n1);
        m0 = n0; m1 = n1;
        float s0 = 0.f, s1 = 0.f;
        #pragma unroll
        for (int nt = 0; nt < PF_KT / 8; nt++) {
            #pragma unroll
            for (int e = 0; e < 4; e++) {
                const bool top = e < 2;
                const float v = sacc[nt][e];
                const float p = v == NEG_INF ? 0.f : exp2f(v - (top ? n0 : n1));
                sacc[nt][e] = p;
                if (top) s0 += p; else s1 += p;
            }
        }
        l0 = l0 * c0 + s0;
        l1 = l1 * c1 + s1;
        #pragma unroll
        for (int nt = 0; nt < HD / 8; nt++) { o[nt][0] *= c0; o[nt][1] *= c0; o[nt][2] *= c1; o[nt][3] *= c1; }
        #pragma unroll
        for (int ks = 0; ks < PF_KT / 16; ks++) {
            unsigned pa[4];
            pa[0] = pack_bf2(sacc[2 * ks][0], sacc[2 * ks][1]);
            pa[1] = pack_bf2(sacc[2 * ks][2], sacc[2 * ks][3]);
            pa[2] = pack_bf2(sacc[2 * ks + 1][0], sacc[2 * ks + 1][1]);
            pa[3] = pack_bf2(sacc[2 * ks + 1][2], sacc[2 * ks + 1][3]);
            #pragma unroll
            for (int nt = 0; nt < HD / 8; nt++) {
                const bf16_t* vrow = Vt + (nt * 8 + gid) * PF_VP + ks * 16 + tig * 2;
                const unsigned b0 = *(const unsigned*)(vrow);
                const unsigned b1 = *(const unsigned*)(vrow + 8);
                mma16816(o[nt], pa, b0, b1);
            }
        }
    }
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const float inv0 = l0 > 0.f ? 1.f / l0 : 0.f, inv1 = l1 > 0.f ? 1.f / l1 : 0.f;
    #pragma unroll
    for (int nt = 0; nt < HD / 8; nt++) {
        const int d = nt * 8 + tig * 2;
        if (r0 < q_len) {
            const long off = (long)(q_start + r0) * q_cols + h * HD + d;
            out[off] = o[nt][0] * inv0; out[off + 1] = o[nt][1] * inv0;
            out_bf[off] = f2bf(o[nt][0] * inv0); out_bf[off + 1] = f2bf(o[nt][1] * inv0);
        }
        if (r1 < q_len) {
            const long off = (long)(q_start + r1) * q_cols + h * HD + d;
            out[off] = o[nt][2] * inv1; out[off + 1] = o[nt][3] * inv1;
            out_bf[off] = f2bf(o[nt][2] * inv1); out_bf[off + 1] = f2bf(o[nt][3] * inv1);
        }
    }
}
#endif
"#;
