// Paged attention, compiled once per (HD = head dim, G = query heads per KV
// head), both `#define`d before prelude.cuh. The metadata array (`meta`)
// holds, per sequence, `[q_start, q_len, kv_len, window, block-table
// offset]`, then the work lists, then the block tables (see
// `attention.rs`).
__device__ __forceinline__ unsigned pack_bf2(float lo, float hi) { return (unsigned)f2bf(lo) | ((unsigned)f2bf(hi) << 16); }

#define DEC_THREADS 128
#define DEC_NO ((G * HD / 2 + DEC_THREADS - 1) / DEC_THREADS)
// Keys per tile. The tile's K and V rows sit in shared memory; sizes keep
// the block under 48 KB for G up to 16 (up to 8 past HD 256: Gemma 4's
// global layers, HD 512).
#define DEC_TK (HD > 256 ? 8 : (HD <= 64 ? 128 : HD <= 128 ? 64 : 32) / (G > 8 ? 2 : 1))
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
// Two floats (8-byte aligned) of block `rank`'s shared memory.
__device__ __forceinline__ float2 ld_cluster2(const float* p, unsigned rank) {
    unsigned a = (unsigned)__cvta_generic_to_shared(p), r;
    float2 v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
    asm volatile("ld.shared::cluster.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(r) : "memory");
    return v;
}
#endif
// 2^x on the SFU, subnormal results flushed to zero (2^-inf = 0): exp2f
// adds a range check and a rescale around each one.
__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

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

// The splits' (acc, m, l) of the cluster's blocks (block = split; in each
// block's shared memory `cp`, `items` rows of HD + 2 floats) merged as
// attn_combine does; each block writes a share of the items x HD outputs,
// item i's at out + off(i) (off < 0: no such row). A thread loads all its
// remote values before using any (one round trip, not one per split). The
// second barrier keeps every block's shared memory alive until all have
// read it. At most CMAX splits (its arrays are registers: the prefill
// kernel's, at most PF_CL_MAX, stay small whatever the decode's CL_MAX).
template <int CMAX, class Off>
__device__ __forceinline__ void cl_merge(const float* cp, int items, int split, int nsplit, Off off,
                                         float* __restrict__ out, bf16_t* __restrict__ out_bf) {
#if __CUDA_ARCH__ >= 900
    cluster_sync();
    // Two outputs a step: the splits' m and l are loaded and weighed once
    // for both (a step per output spent a seventh of attn_prefill_cl's
    // instructions here, at 5 splits).
    for (int idx = split * blockDim.x + threadIdx.x; idx < items * (HD / 2); idx += nsplit * blockDim.x) {
        const int it = idx / (HD / 2), d = idx % (HD / 2) * 2;
        const long o = off(it);
        if (o < 0) continue;
        const float* pg = cp + it * (HD + 2);
        float ms[CMAX], ls[CMAX];
        float2 as[CMAX];
        #pragma unroll
        for (int k = 0; k < CMAX; k++) {
            if (k < nsplit) {
                ms[k] = ld_cluster(pg + HD, k);
                ls[k] = ld_cluster(pg + HD + 1, k);
                as[k] = ld_cluster2(pg + d, k);
            }
        }
        float M = NEG_INF;
        #pragma unroll
        for (int k = 0; k < CMAX; k++) if (k < nsplit) M = fmaxf(M, ms[k]);
        // A split with no keys has m = -inf: weight 2^-inf = 0 (and with
        // every split empty, M is -inf and L stays 0).
        const float Mb = M == NEG_INF ? 0.f : M;
        float L = 0.f, a0 = 0.f, a1 = 0.f;
        #pragma unroll
        for (int k = 0; k < CMAX; k++) {
            if (k < nsplit) {
                const float w = ex2((ms[k] - Mb) * 1.4426950408889634f);
                L += w * ls[k];
                a0 += w * as[k].x;
                a1 += w * as[k].y;
            }
        }
        const float inv = L > 0.f ? __frcp_rn(L) : 0.f;
        out[o + d] = a0 * inv;
        out[o + d + 1] = a1 * inv;
        out_bf[o + d] = f2bf(a0 * inv);
        out_bf[o + d + 1] = f2bf(a1 * inv);
    }
    cluster_sync();
#endif
}

// The decode kernels' arguments (their bodies, and the kernels that take them).
#define DEC_ARGS const float* __restrict__ q, int q_cols, const bf16_t* __restrict__ kc, const bf16_t* __restrict__ vc, int kv_w, \
    int bt, const unsigned* __restrict__ meta, int off_rows, int off_bt, int nsplit, float scale, float softcap, int heads, \
    float* __restrict__ out, bf16_t* __restrict__ out_bf, float* __restrict__ part
#define DEC_PASS q, q_cols, kc, vc, kv_w, bt, meta, off_rows, off_bt, nsplit, scale, softcap, heads, out, out_bf, part

// A decode work item's query row, its block table, and the keys [a, b)
// its split walks: from the window's first key on (a sliding-window
// layer's blocks before it may be let go, their table entries stand-ins,
// never read), in chunks of a multiple of 16 keys a split.
struct DecKeys {
    int row, a, b;
    const unsigned* blocks;
};
__device__ __forceinline__ DecKeys dec_keys(const unsigned* __restrict__ meta, int off_rows, int off_bt, int z, int split, int nsplit) {
    const unsigned s = meta[off_rows + 2 * z], i = meta[off_rows + 2 * z + 1];
    const unsigned* st = meta + 5 * s;
    const int q_start = st[0], q_len = st[1], kv_len = st[2], window = st[3];
    const int pos = kv_len - q_len + i;
    const int lo = window > 0 ? max(0, pos + 1 - window) : 0;
    int chunk = (pos + 1 - lo + nsplit - 1) / nsplit;
    chunk = (chunk + 15) & ~15;
    const int a = lo + split * chunk;
    return DecKeys{q_start + (int)i, a, min(pos + 1, a + chunk), meta + off_bt + st[4]};
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
__device__ __forceinline__ void attn_decode_body(DEC_ARGS) {
    PDL_PRE();
    // K rows, then V rows; after the last tile, the splits' partials (cp).
    __shared__ uint4 kv_s[2][DEC_TK][DEC_RP];
    __shared__ float qs[G][HD];
    __shared__ float sc[G][DEC_TK];
    __shared__ int slot_s[DEC_TK];
    __shared__ float m_s[G], l_s[G], corr_s[G];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int z = blockIdx.z, kvh = blockIdx.y, split = blockIdx.x;
    const DecKeys r = dec_keys(meta, off_rows, off_bt, z, split, nsplit);
    const int row = r.row, a = r.a, b = r.b;
    const unsigned* blocks = r.blocks;
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
    if (CL && nsplit > 1) cl_merge<CL_MAX>(cp, G, split, nsplit, [&](int g) { return (long)row * q_cols + (kvh * G + g) * HD; }, out, out_bf);
}

extern "C" __global__ void __launch_bounds__(DEC_THREADS) attn_decode(DEC_ARGS) { attn_decode_body<false>(DEC_PASS); }
// Launched with clusters of nsplit blocks along x (Hopper on): no attn_combine.
extern "C" __global__ void __launch_bounds__(DEC_THREADS) attn_decode_cl(DEC_ARGS) { attn_decode_body<true>(DEC_PASS); }

// Decode attention, lanes over keys (head dims 16–256 a power of two, at
// most 8 query heads a KV head, G x HD at most 1024): the grid and the
// splits of attn_decode, DL_WARPS warps a block. A key's row is read by
// HD / 8 lanes, 16 bytes each, straight into registers, so a warp reads
// 32 / (HD / 8) keys at once and DL_U such sets a step: every lane has
// 2 x DL_U loads in flight, and the next step's slots are read from the
// block table beside them. Each group of lanes on one key keeps its own
// online softmax (scores in log2 units) over the keys it reads; the groups
// of a warp merge by shuffles at the end, the warps through shared memory,
// and the splits as attn_decode's do. attn_decode, one warp a query head
// and the scores and P·V out of shared memory after each tile's copy,
// kept ~5 warps an SM waiting on one dependent step after another (ncu at
// 2,000 keys: 15 µs a layer, DRAM at 19%).
#if (HD == 16 || HD == 32 || HD == 64 || HD == 128 || HD == 256) && G <= 8 && G * HD <= 1024
#define DL_LPK (HD / 8)
#define DL_KPW (32 / DL_LPK)
#define DL_U (G <= 4 ? 4 : 2)
#define DL_STEP (DL_KPW * DL_U)
#define DL_THREADS (DL_WARPS * 32)
#define DL_NO ((G * HD + DL_THREADS - 1) / DL_THREADS)

template <bool CL>
__device__ __forceinline__ void attn_decode_lanes_body(DEC_ARGS) {
    PDL_PRE();
    // Each warp's (acc, m, l) a head; then the block's, for the merge (cp).
    __shared__ float red[DL_WARPS][G][HD + 2];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int kq = lane / DL_LPK, dc = lane % DL_LPK;
    const int z = blockIdx.z, kvh = blockIdx.y, split = blockIdx.x;
    const DecKeys r = dec_keys(meta, off_rows, off_bt, z, split, nsplit);
    const int row = r.row, a = r.a, b = r.b;
    const unsigned* blocks = r.blocks;
    // Key j of a step from `base`: base + j * DL_KPW + kq; its slot, or -1 past b.
    int slot[DL_U];
    int base = a + warp * DL_STEP;
    #pragma unroll
    for (int j = 0; j < DL_U; j++) {
        const int k = base + j * DL_KPW + kq;
        slot[j] = k < b ? (int)blocks[k / bt] * bt + k % bt : -1;
    }
    PDL_POST();

    float qr[G][8], acc[G][8], m[G], l[G];
    #pragma unroll
    for (int g = 0; g < G; g++) {
        const float4* qp = (const float4*)(q + (long)row * q_cols + (kvh * G + g) * HD + dc * 8);
        const float4 q0 = qp[0], q1 = qp[1];
        qr[g][0] = q0.x * scale; qr[g][1] = q0.y * scale; qr[g][2] = q0.z * scale; qr[g][3] = q0.w * scale;
        qr[g][4] = q1.x * scale; qr[g][5] = q1.y * scale; qr[g][6] = q1.z * scale; qr[g][7] = q1.w * scale;
        m[g] = NEG_INF;
        l[g] = 0.f;
        #pragma unroll
        for (int e = 0; e < 8; e++) acc[g][e] = 0.f;
    }
    const long col = (long)kvh * HD + dc * 8;
    for (; base < b; base += DL_WARPS * DL_STEP) {
        uint4 kr[DL_U], vr[DL_U];
        #pragma unroll
        for (int j = 0; j < DL_U; j++) {
            if (slot[j] >= 0) {
                const long o = (long)slot[j] * kv_w + col;
                kr[j] = *(const uint4*)(kc + o);
                vr[j] = *(const uint4*)(vc + o);
            } else {
                kr[j] = make_uint4(0, 0, 0, 0);
                vr[j] = kr[j];
            }
        }
        const int nb = base + DL_WARPS * DL_STEP;
        #pragma unroll
        for (int j = 0; j < DL_U; j++) {
            const int k = nb + j * DL_KPW + kq;
            slot[j] = k < b ? (int)blocks[k / bt] * bt + k % bt : -1;
        }
        float sc[DL_U][G];
        #pragma unroll
        for (int j = 0; j < DL_U; j++) {
            const unsigned w4[4] = {kr[j].x, kr[j].y, kr[j].z, kr[j].w};
            #pragma unroll
            for (int g = 0; g < G; g++) {
                float v = 0.f;
                #pragma unroll
                for (int e = 0; e < 4; e++) v += qr[g][2 * e] * __uint_as_float(w4[e] << 16) + qr[g][2 * e + 1] * __uint_as_float(w4[e] & 0xffff0000u);
                sc[j][g] = v;
            }
        }
        #pragma unroll
        for (int o = 1; o < DL_LPK; o <<= 1) {
            #pragma unroll
            for (int j = 0; j < DL_U; j++) {
                #pragma unroll
                for (int g = 0; g < G; g++) sc[j][g] += __shfl_xor_sync(0xffffffffu, sc[j][g], o);
            }
        }
        #pragma unroll
        for (int g = 0; g < G; g++) {
            float mx = m[g];
            #pragma unroll
            for (int j = 0; j < DL_U; j++) {
                float v = sc[j][g];
                if (softcap > 0.f) v = softcap * tanhf(v / softcap);
                v = base + j * DL_KPW + kq < b ? v * 1.4426950408889634f : NEG_INF;
                sc[j][g] = v;
                mx = fmaxf(mx, v);
            }
            if (mx == NEG_INF) continue;
            const float corr = ex2(m[g] - mx);
            m[g] = mx;
            l[g] *= corr;
            #pragma unroll
            for (int e = 0; e < 8; e++) acc[g][e] *= corr;
            #pragma unroll
            for (int j = 0; j < DL_U; j++) {
                const float p = ex2(sc[j][g] - mx);
                l[g] += p;
                const unsigned w4[4] = {vr[j].x, vr[j].y, vr[j].z, vr[j].w};
                #pragma unroll
                for (int e = 0; e < 4; e++) {
                    acc[g][2 * e] += p * __uint_as_float(w4[e] << 16);
                    acc[g][2 * e + 1] += p * __uint_as_float(w4[e] & 0xffff0000u);
                }
            }
        }
    }
    // The warp's key groups merged (lanes of one 16-byte chunk of the row).
    #pragma unroll
    for (int o = DL_LPK; o < 32; o <<= 1) {
        #pragma unroll
        for (int g = 0; g < G; g++) {
            const float mo = __shfl_xor_sync(0xffffffffu, m[g], o), lo_ = __shfl_xor_sync(0xffffffffu, l[g], o);
            const float mx = fmaxf(m[g], mo);
            const float w1 = mx == NEG_INF ? 0.f : ex2(m[g] - mx), w2 = mx == NEG_INF ? 0.f : ex2(mo - mx);
            l[g] = l[g] * w1 + lo_ * w2;
            #pragma unroll
            for (int e = 0; e < 8; e++) acc[g][e] = acc[g][e] * w1 + __shfl_xor_sync(0xffffffffu, acc[g][e], o) * w2;
            m[g] = mx;
        }
    }
    if (kq == 0) {
        #pragma unroll
        for (int g = 0; g < G; g++) {
            #pragma unroll
            for (int e = 0; e < 8; e++) red[warp][g][dc * 8 + e] = acc[g][e];
            if (dc == 0) { red[warp][g][HD] = m[g]; red[warp][g][HD + 1] = l[g]; }
        }
    }
    __syncthreads();
    // The warps merged: output a (head, dim) a thread; m back in natural
    // units for the splits' merge.
    float ov[DL_NO], om[DL_NO], ol[DL_NO];
    #pragma unroll
    for (int t = 0; t < DL_NO; t++) {
        const int idx = tid + t * DL_THREADS;
        if (idx >= G * HD) continue;
        const int g = idx / HD, d = idx % HD;
        float M = NEG_INF;
        #pragma unroll
        for (int w = 0; w < DL_WARPS; w++) M = fmaxf(M, red[w][g][HD]);
        float L = 0.f, A = 0.f;
        if (M != NEG_INF) {
            #pragma unroll
            for (int w = 0; w < DL_WARPS; w++) {
                const float wt = ex2(red[w][g][HD] - M);
                L += wt * red[w][g][HD + 1];
                A += wt * red[w][g][d];
            }
        }
        ov[t] = A;
        om[t] = M * 0.6931471805599453f;
        ol[t] = L;
    }
    __syncthreads();
    float* cp = &red[0][0][0];
    #pragma unroll
    for (int t = 0; t < DL_NO; t++) {
        const int idx = tid + t * DL_THREADS;
        if (idx >= G * HD) continue;
        const int g = idx / HD, d = idx % HD;
        const int h = kvh * G + g;
        if (nsplit == 1) {
            const float inv = ol[t] > 0.f ? 1.f / ol[t] : 0.f;
            const long off = (long)row * q_cols + h * HD + d;
            out[off] = ov[t] * inv;
            out_bf[off] = f2bf(ov[t] * inv);
        } else {
            float* pp = CL ? cp + g * (HD + 2) : part + (((long)z * heads + h) * nsplit + split) * (HD + 2);
            pp[d] = ov[t];
            if (d == 0) { pp[HD] = om[t]; pp[HD + 1] = ol[t]; }
        }
    }
    if (CL && nsplit > 1) cl_merge<CL_MAX>(cp, G, split, nsplit, [&](int g) { return (long)row * q_cols + (kvh * G + g) * HD; }, out, out_bf);
}

extern "C" __global__ void __launch_bounds__(DL_THREADS) attn_decode_lanes(DEC_ARGS) { attn_decode_lanes_body<false>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(DL_THREADS) attn_decode_lanes_cl(DEC_ARGS) { attn_decode_lanes_body<true>(DEC_PASS); }
#endif

// One output value from nsplit partials (o unnormalised, m, l) at pp:
// what attn_combine and attn_prefill_combine share.
__device__ __forceinline__ void merge_splits(const float* __restrict__ pp, int nsplit, int d, float* __restrict__ out,
                                             bf16_t* __restrict__ out_bf, long off) {
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
    out[off] = v;
    out_bf[off] = f2bf(v);
}

// Merge the splits of attn_decode: one block of HD threads per (row, head).
extern "C" __global__ void attn_combine(const float* __restrict__ part, const unsigned* __restrict__ meta, int off_rows, int nsplit,
                                        int heads, int q_cols, float* __restrict__ out, bf16_t* __restrict__ out_bf) {
    PDL_ENTRY();
    const int z = blockIdx.x, h = blockIdx.y, d = threadIdx.x;
    const unsigned s = meta[off_rows + 2 * z], i = meta[off_rows + 2 * z + 1];
    const int row = meta[5 * s] + i;
    merge_splits(part + ((long)z * heads + h) * nsplit * (HD + 2), nsplit, d, out, out_bf, (long)row * q_cols + h * HD + d);
}

#if __CUDA_ARCH__ >= 800 && HD <= 256
// Prefill attention on tensor cores (HD 256 at most: a warp keeps 16 rows
// of output in registers) (mma.sync m16n8k16, bf16 in, f32
// accumulate): one block of 4 warps per (64 packed query rows of one
// sequence, KV head); each warp owns 16 of them. A packed row is a (query
// row, query head of the KV head) pair, row-major: packed row p is row
// p / G of head p % G. The G heads sharing a KV head thus share its K and V
// tiles, and a short chunk fills its tile (24 rows of 4 heads: 96 packed
// rows, 2 tiles, where one tile per head left 40 of 64 rows idle). K and V tiles of PF_KT keys are
// gathered from the paged pool into shared memory by cp.async, two tiles in
// flight (the next tile's loads run under this tile's products: without
// that, a 64-row chunk at 1000 keys was latency-bound at ~22 µs a layer on
// the H200). Both are stored as rows padded by 8 values, so the K fragment
// loads and the transposing ldmatrix of V are free of bank conflicts. A
// warp skips tiles wholly outside its rows' causal (and window) range and
// masks only the tiles that cross an edge. Scores are kept in log2 units.
// With nsplit > 1 the tile's keys are split over blockIdx.z (a short chunk
// at a long context is otherwise a few blocks walking every key alone);
// each split leaves its rows' (o, m, l) in `part` for attn_prefill_combine,
// or (attn_prefill_cl: the splits along x, one cluster) merges them with
// the cluster's other blocks.
#define PF_KT (HD <= 64 ? 64 : HD <= 128 ? 32 : 16)
#define PF_KP (HD + 8)
#define PF_BQ 64
// PF_CL_MAX, the most key splits of a chunk's cluster, comes from
// attention.rs (kernels.rs defines it), which caps the split count.
#define PF_THREADS 128

__device__ __forceinline__ void mma16816(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// Four 8x8 bf16 matrices from shared memory, transposed (each lane names
// one row of one matrix): B fragments from row-major V.
__device__ __forceinline__ void ldsm_x4_t(unsigned* r, const bf16_t* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"((unsigned)__cvta_generic_to_shared(p)));
}
__device__ __forceinline__ void copy_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void copy_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory"); }

// A thread's 16-byte parts of one tile's K (and V) rows.
#define PF_LD ((PF_KT * (HD / 8) + PF_THREADS - 1) / PF_THREADS)
// A split's partials for the cluster merge, (o, m, l) per tile row: they
// take the tiles' shared memory once the keys are done (HD 128 at most).
#define PF_CL_OK (PF_BQ * (HD + 2) * 4 <= 2 * 2 * PF_KT * PF_KP * 2)

template <bool CL>
__device__ __forceinline__ void attn_prefill_body(
    const float* __restrict__ q, int q_cols, const bf16_t* __restrict__ kc, const bf16_t* __restrict__ vc, int kv_w, int bt,
    const unsigned* __restrict__ meta, int off_tiles, int off_bt, float scale, float softcap,
    float* __restrict__ out, bf16_t* __restrict__ out_bf, int nsplit, float* __restrict__ part)
{
    PDL_ENTRY();
    __shared__ __align__(16) bf16_t KVs[2][2][PF_KT * PF_KP];
    bf16_t (*Ks)[PF_KT * PF_KP] = KVs[0];
    bf16_t (*Vs)[PF_KT * PF_KP] = KVs[1];
    const float LOG2E = 1.4426950408889634f;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gid = lane >> 2, tig = lane & 3;
    // The cluster's blocks (the splits of one tile and KV head) lie along x.
    const int tile = CL ? blockIdx.z : blockIdx.x, split = CL ? blockIdx.x : blockIdx.z;
    const int kvh = blockIdx.y;
    const unsigned s = meta[off_tiles + 2 * tile];
    const int i0 = meta[off_tiles + 2 * tile + 1];  // packed
    const unsigned* st = meta + 5 * s;
    const int q_start = st[0], q_len = st[1], kv_len = st[2], window = st[3];
    const int n_packed = q_len * G;
    const unsigned* blocks = meta + off_bt + st[4];
    const int base_pos = kv_len - q_len;
    // This lane's two packed rows: their query rows and heads.
    const int pr0 = i0 + warp * 16 + gid, pr1 = pr0 + 8;
    const int r0 = pr0 / G, r1 = pr1 / G;
    const int h0 = kvh * G + pr0 % G, h1 = kvh * G + pr1 % G;
    const int p0 = base_pos + r0, p1 = base_pos + r1;
    const int lo0 = window > 0 ? max(0, p0 + 1 - window) : 0;
    const int lo1 = window > 0 ? max(0, p1 + 1 - window) : 0;
    const int last_row = min(i0 + PF_BQ - 1, n_packed - 1) / G;
    const int key_hi = base_pos + last_row;  // inclusive
    // Tiles start at the tile's first row's window (blocks before it may be
    // let go, their entries stand-ins: never loaded); later rows mask more.
    const int key_lo = window > 0 ? max(0, base_pos + i0 / G + 1 - window) : 0;
    // This warp's rows: first and last position, smallest and largest window start.
    const int wpk_first = i0 + warp * 16;
    const bool warp_active = wpk_first < n_packed;
    const int wr_first = wpk_first / G, wr_last = min(wpk_first + 15, n_packed - 1) / G;
    const int wp_first = base_pos + wr_first, wp_last = base_pos + wr_last;
    const int wlo_first = window > 0 ? max(0, wp_first + 1 - window) : 0;
    const int wlo_last = window > 0 ? max(0, wp_last + 1 - window) : 0;
    const bool warp_rows_full = wpk_first + 15 < n_packed;

    // This split's key tiles (all of them when nsplit is 1).
    const int ktiles = (key_hi - key_lo) / PF_KT + 1, per = (ktiles + nsplit - 1) / nsplit;
    const int kb_a = key_lo + split * per * PF_KT, kb_b = min(key_hi + 1, kb_a + per * PF_KT);
    // The pool slots of this thread's keys of tile kb (-1 past the
    // sequence), looked up a tile ahead of their loads: the block-table
    // read is a memory round trip the next loads would otherwise wait on.
    // (A shift, not a division, for the usual power-of-two block size.)
    const int bsh = (bt & (bt - 1)) == 0 ? __ffs(bt) - 1 : -1;
    long slots[PF_LD];
    auto lookup = [&](int kb) {
        #pragma unroll
        for (int i = 0; i < PF_LD; i++) {
            const int j = kb + (tid + i * PF_THREADS) / (HD / 8);
            const int bi = bsh >= 0 ? j >> bsh : j / bt;
            slots[i] = j < kv_len ? (long)blocks[bi] * bt + (j - bi * bt) : -1;
        }
    };
    // Tile kb's K and V rows into buffer b, from the slots looked up:
    // consecutive threads take consecutive 16-byte parts of a row
    // (coalesced); keys past the sequence are zeros (their weights are
    // zero, and 0 * garbage may not be).
    auto load = [&](int b) {
        #pragma unroll
        for (int i = 0; i < PF_LD; i++) {
            const int c = tid + i * PF_THREADS;
            if (c >= PF_KT * (HD / 8)) break;
            const int off = (c / (HD / 8)) * PF_KP + (c % (HD / 8)) * 8;
            if (slots[i] >= 0) {
                const long src = slots[i] * kv_w + kvh * HD + (c % (HD / 8)) * 8;
                copy16_async((uint4*)&Ks[b][off], (const uint4*)(kc + src));
                copy16_async((uint4*)&Vs[b][off], (const uint4*)(vc + src));
            } else {
                *(uint4*)&Ks[b][off] = make_uint4(0, 0, 0, 0);
                *(uint4*)&Vs[b][off] = make_uint4(0, 0, 0, 0);
            }
        }
        copy_async_commit();
    };
    if (kb_a < kb_b) {
        lookup(kb_a);
        load(0);
        if (kb_a + PF_KT < kb_b) lookup(kb_a + PF_KT);
    }

    unsigned qa[HD / 16][4];
    {
        const float* q0 = q + (long)(q_start + min(r0, q_len - 1)) * q_cols + h0 * HD;
        const float* q1 = q + (long)(q_start + min(r1, q_len - 1)) * q_cols + h1 * HD;
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

    for (int kb = kb_a, it = 0; kb < kb_b; kb += PF_KT, it++) {
        const int b = it & 1;
        if (kb + PF_KT < kb_b) {
            load(b ^ 1);
            if (kb + 2 * PF_KT < kb_b) lookup(kb + 2 * PF_KT);
            copy_async_wait<1>();
        } else {
            copy_async_wait<0>();
        }
        __syncthreads();
        if (warp_active && kb <= wp_last && kb + PF_KT - 1 >= wlo_first) {
            const bool full = warp_rows_full && kb + PF_KT - 1 <= wp_first && kb >= wlo_last;
            const bf16_t* Kt = Ks[b];
            const bf16_t* Vt = Vs[b];

            float sacc[PF_KT / 8][4];
            #pragma unroll
            for (int nt = 0; nt < PF_KT / 8; nt++) {
                sacc[nt][0] = sacc[nt][1] = sacc[nt][2] = sacc[nt][3] = 0.f;
                const bf16_t* krow = Kt + (nt * 8 + gid) * PF_KP + tig * 2;
                #pragma unroll
                for (int ks = 0; ks < HD / 16; ks++) {
                    const unsigned b0 = *(const unsigned*)(krow + ks * 16);
                    const unsigned b1 = *(const unsigned*)(krow + ks * 16 + 8);
                    mma16816(sacc[nt], qa[ks], b0, b1);
                }
            }
            // Scores in log2 units; the softcap (uniform) and the mask (a
            // warp's edge tiles only) as loops of their own, so the usual
            // tile pays one multiply a score.
            if (softcap > 0.f) {
                #pragma unroll
                for (int nt = 0; nt < PF_KT / 8; nt++) {
                    #pragma unroll
                    for (int e = 0; e < 4; e++) sacc[nt][e] = softcap * tanhf(sacc[nt][e] * scale / softcap) * LOG2E;
                }
            } else {
                const float sl = scale * LOG2E;
                #pragma unroll
                for (int nt = 0; nt < PF_KT / 8; nt++) {
                    #pragma unroll
                    for (int e = 0; e < 4; e++) sacc[nt][e] *= sl;
                }
            }
            if (!full) {
                #pragma unroll
                for (int nt = 0; nt < PF_KT / 8; nt++) {
                    #pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const bool top = e < 2;
                        const int key = kb + nt * 8 + tig * 2 + (e & 1);
                        const bool ok = (top ? r0 : r1) < q_len && key <= (top ? p0 : p1) && key >= (top ? lo0 : lo1);
                        if (!ok) sacc[nt][e] = NEG_INF;
                    }
                }
            }
            float mx0 = NEG_INF, mx1 = NEG_INF;
            #pragma unroll
            for (int nt = 0; nt < PF_KT / 8; nt++) {
                mx0 = fmaxf(mx0, fmaxf(sacc[nt][0], sacc[nt][1]));
                mx1 = fmaxf(mx1, fmaxf(sacc[nt][2], sacc[nt][3]));
            }
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
            const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
            // A row with no key yet (n = -inf) subtracts 0: its scores, and
            // its old m, are -inf, and 2^-inf = 0 (o and l are 0 already).
            const float b0 = n0 == NEG_INF ? 0.f : n0, b1 = n1 == NEG_INF ? 0.f : n1;
            const float c0 = ex2(m0 - b0), c1 = ex2(m1 - b1);
            m0 = n0; m1 = n1;
            float s0 = 0.f, s1 = 0.f;
            #pragma unroll
            for (int nt = 0; nt < PF_KT / 8; nt++) {
                sacc[nt][0] = ex2(sacc[nt][0] - b0);
                sacc[nt][1] = ex2(sacc[nt][1] - b0);
                sacc[nt][2] = ex2(sacc[nt][2] - b1);
                sacc[nt][3] = ex2(sacc[nt][3] - b1);
                s0 += sacc[nt][0] + sacc[nt][1];
                s1 += sacc[nt][2] + sacc[nt][3];
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
                // Lane l names row l % 8 of matrix l / 8: keys +0 / +8 (bit 0),
                // value columns +0 / +8 (bit 1); out come b0, b1 of two n-tiles.
                const int mi = lane >> 3;
                const bf16_t* vrow = Vt + (ks * 16 + (mi & 1) * 8 + (lane & 7)) * PF_KP + (mi >> 1) * 8;
                #pragma unroll
                for (int np = 0; np < HD / 16; np++) {
                    unsigned vb[4];
                    ldsm_x4_t(vb, vrow + np * 16);
                    mma16816(o[2 * np], pa, vb[0], vb[1]);
                    mma16816(o[2 * np + 1], pa, vb[2], vb[3]);
                }
            }
        }
        // Every warp is done with buffer b before the next tile's loads reuse it.
        __syncthreads();
    }
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    if (nsplit > 1) {
        // Partials by (packed tile row, KV head, split): o unnormalised, m in natural
        // units (as attn_decode leaves them), l. In a cluster, this block's
        // tile rows in its shared memory (every warp is past its last tile:
        // the loop ends on a barrier).
        float* cp = (float*)&KVs[0][0][0];
        #pragma unroll
        for (int half = 0; half < 2; half++) {
            const int pr = half ? pr1 : pr0;
            if (!CL && pr >= n_packed) continue;
            const long z = (long)tile * PF_BQ + (pr - i0);
            float* pp = CL ? cp + (pr - i0) * (HD + 2) : part + ((z * gridDim.y + kvh) * nsplit + split) * (HD + 2);
            #pragma unroll
            for (int nt = 0; nt < HD / 8; nt++) {
                const int d = nt * 8 + tig * 2;
                pp[d] = o[nt][2 * half];
                pp[d + 1] = o[nt][2 * half + 1];
            }
            if (tig == 0) {
                const float m = half ? m1 : m0;
                pp[HD] = m == NEG_INF ? NEG_INF : m * 0.6931471805599453f;
                pp[HD + 1] = half ? l1 : l0;
            }
        }
        if (CL) {
            cl_merge<PF_CL_MAX>(cp, PF_BQ, split, nsplit, [&](int r) {
                const int p = i0 + r;
                return p < n_packed ? (long)(q_start + p / G) * q_cols + (kvh * G + p % G) * HD : -1L;
            }, out, out_bf);
        }
        return;
    }
    const float inv0 = l0 > 0.f ? 1.f / l0 : 0.f, inv1 = l1 > 0.f ? 1.f / l1 : 0.f;
    #pragma unroll
    for (int nt = 0; nt < HD / 8; nt++) {
        const int d = nt * 8 + tig * 2;
        if (r0 < q_len) {
            const long off = (long)(q_start + r0) * q_cols + h0 * HD + d;
            out[off] = o[nt][0] * inv0; out[off + 1] = o[nt][1] * inv0;
            out_bf[off] = f2bf(o[nt][0] * inv0); out_bf[off + 1] = f2bf(o[nt][1] * inv0);
        }
        if (r1 < q_len) {
            const long off = (long)(q_start + r1) * q_cols + h1 * HD + d;
            out[off] = o[nt][2] * inv1; out[off + 1] = o[nt][3] * inv1;
            out_bf[off] = f2bf(o[nt][2] * inv1); out_bf[off + 1] = f2bf(o[nt][3] * inv1);
        }
    }
}

#define PF_ARGS const float* __restrict__ q, int q_cols, const bf16_t* __restrict__ kc, const bf16_t* __restrict__ vc, int kv_w, int bt, \
    const unsigned* __restrict__ meta, int off_tiles, int off_bt, float scale, float softcap, float* __restrict__ out, \
    bf16_t* __restrict__ out_bf, int nsplit, float* __restrict__ part
#define PF_PASS q, q_cols, kc, vc, kv_w, bt, meta, off_tiles, off_bt, scale, softcap, out, out_bf, nsplit, part
extern "C" __global__ void __launch_bounds__(PF_THREADS) attn_prefill(PF_ARGS) { attn_prefill_body<false>(PF_PASS); }
#if __CUDA_ARCH__ >= 900 && PF_CL_OK
// Launched with clusters of nsplit blocks along x (grid: split, head,
// tile; Hopper on, HD 128 at most): no attn_prefill_combine.
extern "C" __global__ void __launch_bounds__(PF_THREADS) attn_prefill_cl(PF_ARGS) { attn_prefill_body<true>(PF_PASS); }
#endif

// Merge attn_prefill's key splits: one block of HD threads per (packed
// tile row, KV head); packed rows past their sequence's end have no partials.
extern "C" __global__ void attn_prefill_combine(const float* __restrict__ part, const unsigned* __restrict__ meta, int off_tiles,
                                                int nsplit, int kv_heads, int q_cols, float* __restrict__ out, bf16_t* __restrict__ out_bf) {
    PDL_ENTRY();
    const int z = blockIdx.x, kvh = blockIdx.y, d = threadIdx.x;
    const unsigned s = meta[off_tiles + 2 * (z / PF_BQ)];
    const int p = meta[off_tiles + 2 * (z / PF_BQ) + 1] + z % PF_BQ;
    if (p >= (int)meta[5 * s + 1] * G) return;
    const long row = meta[5 * s] + p / G;
    merge_splits(part + ((long)z * kv_heads + kvh) * nsplit * (HD + 2), nsplit, d, out, out_bf, row * q_cols + (kvh * G + p % G) * HD + d);
}
#endif
