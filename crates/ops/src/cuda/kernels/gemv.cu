// The few-row GEMVs (decode) and the gated activation over the GEMMs' bf16
// outputs (part of the base module, after sampling.cu; `GV_MINB` comes from
// the `#define`s).

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
// Gate's and up's rows are m8 units wide, ld8 apart (m8 = ld8 = n8: one
// row each; ld8 = 2 m8: a row's gate then its up, one GEMM's output).
extern "C" __global__ void act_mul_bf8(const uint4* __restrict__ g, const uint4* __restrict__ u, float4* __restrict__ out,
                                       uint4* __restrict__ out_bf, long n8, int act, long m8, long ld8) {
    PDL_ENTRY();
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n8; i += (long)gridDim.x * blockDim.x) {
        const long at = (i / m8) * ld8 + i % m8;
        const uint4 gv = g[at], uv = u[at];
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

// w[j, c] *= g[c] (bf16 weight, f32 g): an RMSNorm's weight folded into
// the product that reads the norm (see GvIn).
extern "C" __global__ void scale_cols(bf16_t* __restrict__ w, const float* __restrict__ g, long n, int cols) {
    PDL_ENTRY();
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        w[i] = f2bf(bf2f(w[i]) * g[i % cols]);
}
