// The hybrid families' kernels (recurrent.rs): LFM2's short conv, Mamba2's
// selective scan and gated group norm, MiniMax's lightning (linear) and
// block-sparse attention, Qwen3-Next's gated delta rule, the pointwise ops around them, Gemma 4's RoPE
// from a frequency table, and the MoE scatter. Compiled after prelude.cuh
// as a module of its own. Every kernel opens with `PDL_ENTRY()`: the
// programmatic-dependent-launch wait (on sm_90+, where the instruction
// exists) before it touches global memory, since it may start while the
// previous kernel is still running.
// The prelude's helpers under this module's `hy_` names.
#define HY_NEG_INF NEG_INF
#define hy_bf2f bf2f
#define hy_f2bf f2bf
#define hy_warp_sum warp_sum
#define hy_warp_max warp_max
__device__ __forceinline__ unsigned long long hy_warp_max_u64(unsigned long long v) {
    for (int o = 16; o > 0; o >>= 1) {
        unsigned long long u = __shfl_xor_sync(0xffffffffu, v, o);
        v = u > v ? u : v;
    }
    return v;
}
__device__ __forceinline__ float hy_sigmoid(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float hy_silu1(float x) { return x / (1.f + expf(-x)); }

#define HY_LOOP(i, n) for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < (n); i += (long)gridDim.x * blockDim.x)

// ---- RoPE from a table, MoE scatter ----

// One block per row; threads over (head, pair). The pair (i, i + half)
// turns by pos * inv_freq[i].
extern "C" __global__ void hy_rope_freqs(float* __restrict__ x, const unsigned* __restrict__ pos, const float* __restrict__ inv_freq,
                                         int cols, int head_dim, int half) {
    PDL_ENTRY();
    int heads = cols / head_dim;
    float p = (float)pos[blockIdx.x];
    float* row = x + (long)blockIdx.x * cols;
    for (int t = threadIdx.x; t < heads * half; t += blockDim.x) {
        int h = t / half, i = t - h * half;
        float s, c;
        sincosf(p * inv_freq[i], &s, &c);
        float* hd = row + (long)h * head_dim;
        float x0 = hd[i], x1 = hd[i + half];
        hd[i] = x0 * c - x1 * s;
        hd[i + half] = x0 * s + x1 * c;
    }
}

// out[rows[i]] += w[i] * y[i]. Threads over columns; blocks in y over the
// rows of y. With gridDim.y == 1 one thread adds every row in order (the
// host picks that when a target row repeats).
extern "C" __global__ void hy_scatter_add(float* __restrict__ out, const float* __restrict__ y, const unsigned* __restrict__ rows,
                                          const float* __restrict__ w, int n, int cols) {
    PDL_ENTRY();
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    for (int i = blockIdx.y; i < n; i += gridDim.y) out[(long)rows[i] * cols + c] += w[i] * y[(long)i * cols + c];
}

// ---- pointwise (each writes its f32 result and the bf16 copy) ----

extern "C" __global__ void hy_silu(float* __restrict__ x, bf16_t* __restrict__ xb, long n) {
    PDL_ENTRY();
    HY_LOOP(i, n) {
        float v = hy_silu1(x[i]);
        x[i] = v;
        xb[i] = hy_f2bf(v);
    }
}

extern "C" __global__ void hy_relu2(const float* __restrict__ x, float* __restrict__ out, bf16_t* __restrict__ ob, long n) {
    PDL_ENTRY();
    HY_LOOP(i, n) {
        float r = fmaxf(x[i], 0.f);
        float v = r * r;
        out[i] = v;
        ob[i] = hy_f2bf(v);
    }
}

// One warp per group of g values; the weight is a whole row wide.
extern "C" __global__ void hy_group_rms_norm(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ out,
                                             bf16_t* __restrict__ ob, int groups, int g, int cols, float eps) {
    PDL_ENTRY();
    int gi = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (gi >= groups) return;
    long base = (long)gi * g;
    const float* wg = w + (int)(base % cols);
    float ss = 0.f;
    for (int i = lane; i < g; i += 32) { float v = x[base + i]; ss += v * v; }
    ss = hy_warp_sum(ss);
    float inv = 1.f / sqrtf(ss / (float)g + eps);
    for (int i = lane; i < g; i += 32) {
        float v = x[base + i] * inv * wg[i];
        out[base + i] = v;
        ob[base + i] = hy_f2bf(v);
    }
}

// ---- recurrent ops; meta holds [start, len, slot] per sequence ----

// Short conv outputs: one thread per (row, channel), all rows at once (an
// output needs only the K inputs up to it: the batch's, or before the
// sequence's first row, the ones its state row keeps). After meta's
// sequences, one entry per batch row: its sequence, or ~0 for none.
extern "C" __global__ void hy_conv(const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ bias,
                                   const float* __restrict__ state, float* __restrict__ out, const unsigned* __restrict__ meta,
                                   int nseq, int rows, int C, int K, int scols, int soff, int silu) {
    PDL_ENTRY();
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const int tail = K - 1;
    const unsigned* row_seq = meta + 3 * nseq;
    const float* wc = w + (long)c * K;
    const float b = bias ? bias[c] : 0.f;
    for (int t = blockIdx.y; t < rows; t += gridDim.y) {
        unsigned si = row_seq[t];
        if (si == 0xffffffffu) continue;
        int start = (int)meta[3 * si];
        const float* st = state + (long)meta[3 * si + 2] * scols + soff + (long)c * tail;
        float acc = b;
        for (int k = 0; k < K; k++) {
            int src = t - tail + k;
            float v = src >= start ? x[(long)src * C + c] : st[tail - (start - src)];
            acc += wc[k] * v;
        }
        out[(long)t * C + c] = silu ? hy_silu1(acc) : acc;
    }
}

// The conv state after each sequence: its last K - 1 inputs (one thread
// per (channel, sequence); runs after hy_conv, which read the old state).
extern "C" __global__ void hy_conv_state(const float* __restrict__ x, float* __restrict__ state, const unsigned* __restrict__ meta,
                                         int C, int K, int scols, int soff) {
    PDL_ENTRY();
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const int s = blockIdx.y, tail = K - 1;
    const int start = (int)meta[3 * s], len = (int)meta[3 * s + 1];
    float* st = state + (long)meta[3 * s + 2] * scols + soff + (long)c * tail;
    float keep[15];
    for (int j = 0; j < tail; j++) {
        int src = start + len - tail + j;
        keep[j] = src >= start ? x[(long)src * C + c] : st[tail - (start - src)];
    }
    for (int j = 0; j < tail; j++) st[j] = keep[j];
}

// Mamba2 scan. Block: 4 warps (x gridDim.x) over the head's channels p,
// SSM_ROWS channels a warp; each lane keeps the state values n = lane + 32m
// of its channels in registers through the sequence's tokens; y_p is a
// warp sum. Grid: (channel blocks, heads, sequences).
#define SSM_ROWS 4
#define SSM_NPL 8
extern "C" __global__ void hy_ssm_scan(const float* __restrict__ xbc, const float* __restrict__ dt, const float* __restrict__ dt_bias,
                                       const float* __restrict__ a, const float* __restrict__ d, float* __restrict__ state,
                                       float* __restrict__ out, const unsigned* __restrict__ meta, int heads, int hd, int N,
                                       int groups, int scols, int soff, float dt_min, float dt_max) {
    PDL_ENTRY();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int h = blockIdx.y, s = blockIdx.z;
    const int p0 = (blockIdx.x * (blockDim.x >> 5) + warp) * SSM_ROWS;
    const unsigned start = meta[3 * s], len = meta[3 * s + 1];
    const int inner = heads * hd, xcols = inner + 2 * groups * N;
    const int gi = h / (heads / groups);
    float* st = state + (long)meta[3 * s + 2] * scols + soff + (long)h * hd * N;
    float S[SSM_ROWS][SSM_NPL];
#pragma unroll
    for (int r = 0; r < SSM_ROWS; r++) {
#pragma unroll
        for (int m = 0; m < SSM_NPL; m++) {
            int p = p0 + r, n = lane + 32 * m;
            S[r][m] = (p < hd && n < N) ? st[(long)p * N + n] : 0.f;
        }
    }
    const float ah = a[h], dh = d[h], bias = dt_bias[h];
    for (unsigned t = start; t < start + len; t++) {
        const float* row = xbc + (long)t * xcols;
        float v = dt[(long)t * heads + h] + bias;
        float step = v > 20.f ? v : log1pf(expf(v));
        step = fminf(fmaxf(step, dt_min), dt_max);
        const float decay = expf(step * ah);
        float bv[SSM_NPL], cv[SSM_NPL];
#pragma unroll
        for (int m = 0; m < SSM_NPL; m++) {
            int n = lane + 32 * m;
            bv[m] = n < N ? row[inner + gi * N + n] : 0.f;
            cv[m] = n < N ? row[inner + groups * N + gi * N + n] : 0.f;
        }
#pragma unroll
        for (int r = 0; r < SSM_ROWS; r++) {
            int p = p0 + r;
            if (p < hd) {  // the same for the whole warp
                float xp = row[h * hd + p];
                float dx = step * xp;
                float acc = 0.f;
#pragma unroll
                for (int m = 0; m < SSM_NPL; m++) {
                    S[r][m] = decay * S[r][m] + dx * bv[m];
                    acc += S[r][m] * cv[m];
                }
                acc = hy_warp_sum(acc);
                if (lane == 0) out[(long)t * inner + h * hd + p] = acc + dh * xp;
            }
        }
    }
#pragma unroll
    for (int r = 0; r < SSM_ROWS; r++) {
#pragma unroll
        for (int m = 0; m < SSM_NPL; m++) {
            int p = p0 + r, n = lane + 32 * m;
            if (p < hd && n < N) st[(long)p * N + n] = S[r][m];
        }
    }
}

// Lightning attention: S = e^-slope S + k^T v, o = q S. Block: 4 warps
// (x gridDim.x) over the value columns j, 4 a warp; the 8 lanes of a
// column hold S[i][j] for i = sub + 8m in registers, and o_j is their sum.
// Grid: (column blocks, heads, sequences).
#define LA_MPL 32
extern "C" __global__ void hy_linear_attention(const float* __restrict__ qkv, const float* __restrict__ slopes, float* __restrict__ state,
                                               float* __restrict__ out, const unsigned* __restrict__ meta, int heads, int hd,
                                               int scols, int soff) {
    PDL_ENTRY();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, sub = lane & 7;
    const int j = (blockIdx.x * (blockDim.x >> 5) + warp) * 4 + (lane >> 3);
    const int h = blockIdx.y, s = blockIdx.z;
    const unsigned start = meta[3 * s], len = meta[3 * s + 1];
    float* st = state + (long)meta[3 * s + 2] * scols + soff + (long)h * hd * hd;
    const int mpl = (hd + 7) >> 3;
    float S[LA_MPL];
#pragma unroll
    for (int m = 0; m < LA_MPL; m++) {
        int i = sub + 8 * m;
        S[m] = (m < mpl && i < hd && j < hd) ? st[(long)i * hd + j] : 0.f;
    }
    const float decay = expf(-slopes[h]);
    const long rw = (long)heads * 3 * hd;
    for (unsigned t = start; t < start + len; t++) {
        const float* r = qkv + (long)t * rw + (long)h * 3 * hd;
        const float vj = j < hd ? r[2 * hd + j] : 0.f;
        float acc = 0.f;
#pragma unroll
        for (int m = 0; m < LA_MPL; m++) {
            int i = sub + 8 * m;
            if (m < mpl && i < hd) {
                S[m] = decay * S[m] + r[hd + i] * vj;
                acc += r[i] * S[m];
            }
        }
        acc += __shfl_xor_sync(0xffffffffu, acc, 1);
        acc += __shfl_xor_sync(0xffffffffu, acc, 2);
        acc += __shfl_xor_sync(0xffffffffu, acc, 4);
        if (sub == 0 && j < hd) out[(long)t * heads * hd + (long)h * hd + j] = acc;
    }
#pragma unroll
    for (int m = 0; m < LA_MPL; m++) {
        int i = sub + 8 * m;
        if (m < mpl && i < hd && j < hd) st[(long)i * hd + j] = S[m];
    }
}

// The gated delta rule: per value head h (key head kh), q and k
// L2-normalised, S = e^g S, S += k (x) beta (v - S^T k), o = S^T q. As the
// lightning attention above: 4 warps (x gridDim.x) over the value columns
// j, 4 a warp; the 8 lanes of a column hold S[i][j] for i = sub + 8m. Each
// warp sums q^2 and k^2 itself (every lane takes part, j past dv too).
// Grid: (column blocks, value heads, sequences).
#define DN_MPL 32
extern "C" __global__ void hy_gated_delta_rule(const float* __restrict__ qkv, const float* __restrict__ a, const float* __restrict__ b,
                                               const float* __restrict__ dt_bias, const float* __restrict__ decay,
                                               float* __restrict__ state, float* __restrict__ out, const unsigned* __restrict__ meta,
                                               int nk, int nv, int dk, int dv, float eps, float scale, int scols, int soff) {
    PDL_ENTRY();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, sub = lane & 7;
    const int j = (blockIdx.x * (blockDim.x >> 5) + warp) * 4 + (lane >> 3);
    const int h = blockIdx.y, s = blockIdx.z;
    const int kh = h / (nv / nk);
    const unsigned start = meta[3 * s], len = meta[3 * s + 1];
    float* st = state + (long)meta[3 * s + 2] * scols + soff + (long)h * dk * dv;
    const int mpl = (dk + 7) >> 3;
    float S[DN_MPL];
#pragma unroll
    for (int m = 0; m < DN_MPL; m++) {
        int i = sub + 8 * m;
        S[m] = (m < mpl && i < dk && j < dv) ? st[(long)i * dv + j] : 0.f;
    }
    const float bias = dt_bias[h], ah = decay[h];
    const long rw = 2L * nk * dk + (long)nv * dv;
    for (unsigned t = start; t < start + len; t++) {
        const float* qr = qkv + (long)t * rw + (long)kh * dk;
        const float* kr = qr + (long)nk * dk;
        const float* vr = qkv + (long)t * rw + 2L * nk * dk + (long)h * dv;
        float qq = 0.f, kk = 0.f;
        for (int i = lane; i < dk; i += 32) {
            float x = qr[i], y = kr[i];
            qq += x * x;
            kk += y * y;
        }
        qq = hy_warp_sum(qq);
        kk = hy_warp_sum(kk);
        const float qs = scale / sqrtf(qq + eps), ks = 1.f / sqrtf(kk + eps);
        const float av = a[(long)t * nv + h] + bias;
        const float g = expf(ah * (av > 20.f ? av : log1pf(expf(av))));
        const float beta = hy_sigmoid(b[(long)t * nv + h]);
        const float vj = j < dv ? vr[j] : 0.f;
        float kv = 0.f;
#pragma unroll
        for (int m = 0; m < DN_MPL; m++) {
            int i = sub + 8 * m;
            if (m < mpl && i < dk) {
                S[m] *= g;
                kv += S[m] * (kr[i] * ks);
            }
        }
        kv += __shfl_xor_sync(0xffffffffu, kv, 1);
        kv += __shfl_xor_sync(0xffffffffu, kv, 2);
        kv += __shfl_xor_sync(0xffffffffu, kv, 4);
        const float delta = beta * (vj - kv);
        float acc = 0.f;
#pragma unroll
        for (int m = 0; m < DN_MPL; m++) {
            int i = sub + 8 * m;
            if (m < mpl && i < dk) {
                S[m] += (kr[i] * ks) * delta;
                acc += S[m] * (qr[i] * qs);
            }
        }
        acc += __shfl_xor_sync(0xffffffffu, acc, 1);
        acc += __shfl_xor_sync(0xffffffffu, acc, 2);
        acc += __shfl_xor_sync(0xffffffffu, acc, 4);
        if (sub == 0 && j < dv) out[(long)t * nv * dv + (long)h * dv + j] = acc;
    }
#pragma unroll
    for (int m = 0; m < DN_MPL; m++) {
        int i = sub + 8 * m;
        if (m < mpl && i < dk && j < dv) st[(long)i * dv + j] = S[m];
    }
}

// ---- block-sparse attention; meta: [q_start, q_len, kv_len, table offset]
// per sequence, [sequence, i] per query row at off_rows, block tables at off_bt ----

#define BSA_MAXD 512
#define BSA_MAXK 256

// An order-preserving key: larger score first, then the lower block.
__device__ __forceinline__ unsigned long long hy_block_key(float s, unsigned b) {
    unsigned u = __float_as_uint(s);
    unsigned ord = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ((unsigned long long)ord << 32) | (unsigned long long)(0xffffffffu - b);
}

// One block per (query row, indexer head): each key block's score is its
// best iq . key over the visible keys (a warp per key block, a lane per
// key), then the local blocks and the best others are kept, ascending.
extern "C" __global__ void hy_bsa_select(const float* __restrict__ iq, int iq_cols, const bf16_t* __restrict__ ik,
                                         const unsigned* __restrict__ meta, int off_rows, int off_bt, int bt, int idim, int block,
                                         int local, int topk, int nbmax, float* __restrict__ scores, unsigned* __restrict__ chosen) {
    PDL_ENTRY();
    __shared__ float qs[BSA_MAXD];
    __shared__ unsigned kept[BSA_MAXK];
    __shared__ unsigned long long red[32];
    __shared__ int nkept;
    const int w = blockIdx.x, h = blockIdx.y, ih = gridDim.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
    const unsigned si = meta[off_rows + 2 * w], i = meta[off_rows + 2 * w + 1];
    const unsigned q_start = meta[4 * si], q_len = meta[4 * si + 1], kv_len = meta[4 * si + 2];
    const unsigned* table = meta + off_bt + meta[4 * si + 3];
    const int pos = (int)(kv_len - q_len + i);
    const int qb = pos / block;
    const float* qv = iq + (long)(q_start + i) * iq_cols + (long)h * idim;
    for (int d = threadIdx.x; d < idim; d += blockDim.x) qs[d] = qv[d];
    __syncthreads();
    float* sc = scores + ((long)w * ih + h) * nbmax;
    for (int b = warp; b <= qb; b += nwarps) {
        float best = HY_NEG_INF;
        const int j1 = min((b + 1) * block, pos + 1);
        for (int j = b * block + lane; j < j1; j += 32) {
            const bf16_t* kr = ik + ((long)table[j / bt] * bt + j % bt) * idim;
            float dot = 0.f;
            for (int d = 0; d < idim; d++) dot += qs[d] * hy_bf2f(kr[d]);
            best = fmaxf(best, dot);
        }
        best = hy_warp_max(best);
        if (lane == 0) sc[b] = best;
    }
    if (threadIdx.x == 0) {
        int n = 0;
        for (int l = 0; l < local; l++) {
            unsigned b = qb >= l ? (unsigned)(qb - l) : 0u;
            bool dup = false;
            for (int k = 0; k < n; k++) dup |= kept[k] == b;
            if (n < topk && !dup) kept[n++] = b;
        }
        nkept = n;
    }
    __syncthreads();
    // The best remaining blocks, one block-wide max a pick.
    for (int pick = nkept; pick < topk; pick++) {
        unsigned long long best = 0ull;
        for (int b = threadIdx.x; b <= qb; b += blockDim.x) {
            bool taken = false;
            for (int k = 0; k < pick; k++) taken |= kept[k] == (unsigned)b;
            if (!taken) {
                unsigned long long key = hy_block_key(sc[b], (unsigned)b);
                best = key > best ? key : best;
            }
        }
        best = hy_warp_max_u64(best);
        if (lane == 0) red[warp] = best;
        __syncthreads();
        if (threadIdx.x == 0) {
            unsigned long long m = 0ull;
            for (int k = 0; k < nwarps; k++) m = red[k] > m ? red[k] : m;
            if (m != 0ull) {
                kept[pick] = 0xffffffffu - (unsigned)(m & 0xffffffffull);
                nkept = pick + 1;
            }
        }
        __syncthreads();
        if (nkept == pick) break;  // no block left
    }
    if (threadIdx.x == 0) {
        const int n = nkept;
        for (int a = 1; a < n; a++) {
            unsigned v = kept[a];
            int k = a - 1;
            while (k >= 0 && kept[k] > v) { kept[k + 1] = kept[k]; k--; }
            kept[k + 1] = v;
        }
        unsigned* dst = chosen + ((long)w * ih + h) * topk;
        for (int k = 0; k < topk; k++) dst[k] = k < n ? kept[k] : 0xffffffffu;
    }
}

// One block of 4 warps per (query row, head): the warps take turns over
// the keys of the kept blocks, each with its own online softmax (lanes
// over the head dim), merged at the end.
extern "C" __global__ void hy_bsa_attend(const float* __restrict__ q, int q_cols, const bf16_t* __restrict__ kc, const bf16_t* __restrict__ vc,
                                         const unsigned* __restrict__ meta, int off_rows, int off_bt, int bt, int hd, int kv_w, int group,
                                         int per_index, int ih, int block, int topk, const unsigned* __restrict__ chosen, float scale,
                                         float* __restrict__ out, bf16_t* __restrict__ ob) {
    PDL_ENTRY();
    __shared__ float sm[4], sl[4];
    __shared__ float sacc[4][256];
    const int w = blockIdx.x, hh = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const unsigned si = meta[off_rows + 2 * w], i = meta[off_rows + 2 * w + 1];
    const unsigned q_start = meta[4 * si], q_len = meta[4 * si + 1], kv_len = meta[4 * si + 2];
    const unsigned* table = meta + off_bt + meta[4 * si + 3];
    const int pos = (int)(kv_len - q_len + i);
    const long qrow = q_start + i;
    const int kvh = hh / group;
    const unsigned* kept = chosen + ((long)w * ih + hh / per_index) * topk;
    float qv[8], acc[8];
#pragma unroll
    for (int m = 0; m < 8; m++) {
        int d = lane + 32 * m;
        qv[m] = d < hd ? q[qrow * q_cols + (long)hh * hd + d] : 0.f;
        acc[m] = 0.f;
    }
    float mx = HY_NEG_INF, l = 0.f;
    for (int k = 0; k < topk; k++) {
        const unsigned b = kept[k];
        if (b == 0xffffffffu) break;
        const int j1 = min(((int)b + 1) * block, pos + 1);
        for (int j = (int)b * block + warp; j < j1; j += 4) {
            const long off = ((long)table[j / bt] * bt + j % bt) * kv_w + (long)kvh * hd;
            float dot = 0.f;
#pragma unroll
            for (int m = 0; m < 8; m++) {
                int d = lane + 32 * m;
                if (d < hd) dot += qv[m] * hy_bf2f(kc[off + d]);
            }
            const float s = hy_warp_sum(dot) * scale;
            const float nm = fmaxf(mx, s);
            const float corr = expf(mx - nm), p = expf(s - nm);
            l = l * corr + p;
#pragma unroll
            for (int m = 0; m < 8; m++) {
                int d = lane + 32 * m;
                if (d < hd) acc[m] = acc[m] * corr + p * hy_bf2f(vc[off + d]);
            }
            mx = nm;
        }
    }
    if (lane == 0) { sm[warp] = mx; sl[warp] = l; }
#pragma unroll
    for (int m = 0; m < 8; m++) {
        int d = lane + 32 * m;
        if (d < hd) sacc[warp][d] = acc[m];
    }
    __syncthreads();
    float M = fmaxf(fmaxf(sm[0], sm[1]), fmaxf(sm[2], sm[3]));
    float e[4], L = 0.f;
    for (int k = 0; k < 4; k++) {
        e[k] = sm[k] == HY_NEG_INF ? 0.f : expf(sm[k] - M);
        L += sl[k] * e[k];
    }
    const float inv = L > 0.f ? 1.f / L : 0.f;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float o = (sacc[0][d] * e[0] + sacc[1][d] * e[1] + sacc[2][d] * e[2] + sacc[3][d] * e[3]) * inv;
        out[qrow * q_cols + (long)hh * hd + d] = o;
        ob[qrow * q_cols + (long)hh * hd + d] = hy_f2bf(o);
    }
}
