// Elementwise, norm, RoPE, KV-write, gather and fill kernels (the base
// module: compiled after prelude.cuh, then sampling.cu and gemv.cu follow).

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

// The sum of every thread's `v` over the block, returned to every thread;
// `red` is 32 floats of shared memory.
__device__ __forceinline__ float block_sum(float v, float* red) {
    v = warp_sum(v);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) red[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float t = lane < (int)(blockDim.x >> 5) ? red[lane] : 0.f;
        t = warp_sum(t);
        if (lane == 0) red[0] = t;
    }
    __syncthreads();
    return red[0];
}

// Element i of the norm's group at `base`: x · inv · w (no w: 1), and its bf16 copy.
__device__ __forceinline__ void rms_store(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ out,
                                          bf16_t* __restrict__ out_bf, long base, int i, float inv) {
    float v = x[base + i] * inv * (w ? w[i] : 1.f);
    out[base + i] = v;
    out_bf[base + i] = f2bf(v);
}

// One block (256 threads) per group of g elements.
extern "C" __global__ void rms_norm_block(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ out,
                                          bf16_t* __restrict__ out_bf, int g, float eps) {
    PDL_ENTRY();
    __shared__ float red[32];
    long base = (long)blockIdx.x * g;
    float ss = 0.f;
    for (int i = threadIdx.x; i < g; i += blockDim.x) { float v = x[base + i]; ss += v * v; }
    float inv = rsqrtf(block_sum(ss, red) / g + eps);
    for (int i = threadIdx.x; i < g; i += blockDim.x) {
        rms_store(x, w, out, out_bf, base, i, inv);
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
        rms_store(x, w, out, out_bf, base, i, inv);
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
    float inv = rsqrtf(block_sum(ss, red) / g + eps);
    for (int i = threadIdx.x; i < g; i += blockDim.x) {
        rms_store(x, w, out, out_bf, base, i, inv);
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

// out = act(gate) * up, elementwise, f32 and its bf16 copy. act: 0 silu,
// 1 gelu (tanh), 2 identity, 3 sigmoid, 4 MiniMax-M3's clamped SwiGLU
// (g = min(gate, limit), u = clamp(up, -limit, limit), (u + 1) g sigmoid(alpha g)).
extern "C" __global__ void gated(const float* __restrict__ g, const float* __restrict__ u, float* __restrict__ out,
                                 bf16_t* __restrict__ out_bf, long n, int act, float limit, float alpha) {
    PDL_ENTRY();
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        float a = g[i], b = u[i], v;
        if (act == 0) v = a / (1.f + expf(-a)) * b;
        else if (act == 1) v = 0.5f * a * (1.f + tanhf(0.7978846f * (a + 0.044715f * a * a * a))) * b;
        else if (act == 2) v = a * b;
        else if (act == 3) v = b / (1.f + expf(-a));
        else {
            a = fminf(a, limit);
            b = fminf(fmaxf(b, -limit), limit);
            v = (b + 1.f) * a / (1.f + expf(-alpha * a));
        }
        out[i] = v;
        out_bf[i] = f2bf(v);
    }
}

// x[i] += y[i % cols]: one row (a bias) added to every row.
extern "C" __global__ void add_row(float* __restrict__ x, const float* __restrict__ y, long n, int cols) {
    PDL_ENTRY();
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) x[i] += y[i % cols];
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

// rope on q and k, then k and v into the KV pool (one block per row; the
// same arithmetic as `rope` and `kv_write`). Rows past nslots are rotated
// but not stored.
// Many rows (prefill): one block per row, threads over (head, pair), then
// the row's KV write.
extern "C" __global__ void rope_kv_rows(float* q, float* k, float* v, const unsigned* __restrict__ pos,
                                   const unsigned* __restrict__ slots, int nslots, int q_cols, int kv_w, int head_dim, int dims,
                                   float theta, float pscale, int neox, bf16_t* __restrict__ kc, bf16_t* __restrict__ vc,
                                   const float* __restrict__ src, int ld) {
    PDL_ENTRY();
    const int half = dims / 2;
    const int qh = q_cols / head_dim, kh = kv_w / head_dim;
    const float p = (float)pos[blockIdx.x] / pscale;
    float* qrow = q + (long)blockIdx.x * q_cols;
    float* krow = k + (long)blockIdx.x * kv_w;
    if (src) {
        // One GEMM wrote the row's q, k and v side by side, ld wide.
        const float* s = src + (long)blockIdx.x * ld;
        float* vrow = v + (long)blockIdx.x * kv_w;
        for (int i = threadIdx.x; i < q_cols + 2 * kv_w; i += blockDim.x) {
            const float x = s[i];
            if (i < q_cols) qrow[i] = x;
            else if (i < q_cols + kv_w) krow[i - q_cols] = x;
            else vrow[i - q_cols - kv_w] = x;
        }
        __syncthreads();
    }
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
extern "C" __global__ void rope_kv(float* q, float* k, float* v, const unsigned* __restrict__ pos,
                                   const unsigned* __restrict__ slots, int nslots, int q_cols, int kv_w, int head_dim, int dims,
                                   float theta, float pscale, int neox, bf16_t* __restrict__ kc, bf16_t* __restrict__ vc,
                                   const float* __restrict__ src, int ld) {
    PDL_ENTRY();
    const int half = dims / 2;
    const int qh = q_cols / head_dim;
    const int row = blockIdx.x, h = blockIdx.y;
    const float p = (float)pos[row] / pscale;
    float* hd = h < qh ? q + (long)row * q_cols + h * head_dim : k + (long)row * kv_w + (h - qh) * head_dim;
    if (src) {
        // One GEMM wrote the row's q, k and v side by side, ld wide: this
        // block's head, and a k head's v beside it.
        const float* s = src + (long)row * ld + (h < qh ? h * head_dim : q_cols + (h - qh) * head_dim);
        for (int i = threadIdx.x; i < head_dim; i += blockDim.x) hd[i] = s[i];
        if (h >= qh) {
            float* vd = v + (long)row * kv_w + (h - qh) * head_dim;
            for (int i = threadIdx.x; i < head_dim; i += blockDim.x) vd[i] = s[kv_w + i];
        }
        __syncthreads();
    }
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

extern "C" __global__ void gather_rows(const float* __restrict__ x, const unsigned* __restrict__ rows, int cols,
                                       float* __restrict__ out, bf16_t* __restrict__ out_bf) {
    PDL_ENTRY();
    // A row per blockIdx.x, its columns over blockIdx.y: a logits row
    // (128k values) in one block took ~0.2 ms.
    long src = (long)rows[blockIdx.x] * cols;
    long dst = (long)blockIdx.x * cols;
    for (int i = blockIdx.y * blockDim.x + threadIdx.x; i < cols; i += gridDim.y * blockDim.x) {
        float v = x[src + i];
        out[dst + i] = v;
        out_bf[dst + i] = f2bf(v);
    }
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
