// The skinny GEMM: y[i, j] = x[i, :] · w[j, :] for 5 to 32 rows of x, on
// the tensor cores (part of the base module, after gemv.cu).
//
// A decode round of several streams, or one with a short prompt chunk
// beside it, multiplies 5-32 rows of x by every weight. cuBLAS's kernels
// for that shape streamed the weights at about half the HBM bandwidth, and
// the GEMV's FMAs grow with the rows. Here a warp runs mma.m16n8k16 with 16
// weight rows as A and 8 rows of x as B. Both come straight from global
// memory in 16-byte loads: at each 32-wide step of k, lane l loads 8
// consecutive k of weight rows g and g + 8 and of x row g (g = l / 4),
// starting at 8 * (l % 4). That is A's and B's fragment layout once k is
// permuted alike in both operands, and a dot product may sum k in any
// order: no shared memory, no ldmatrix. A block of 8 warps takes R tiles
// of 16 weight rows, each tile split over 8 / R warps along k, and every
// row of x (T tiles of 8); the slices' partial sums meet in shared memory.
//
// Past 32 rows it lost to cuBLAS (H100, a 64-row chunk beside 6 decode
// rows: +1.5 ms against +0.7): each block reads all of x for its k range,
// and with a block or two an SM (to fill the GPU) x's traffic from L2
// outgrows the weights' (Llama-1B's down projection at 70 rows: ~1.1 MB of
// x a block, 128 blocks, for 34 MB of weights). Blocks that each took 32
// rows, the weights read again for each, were slower still (the second
// read did not come from L2). Wider variants that split k over blocks
// lost too (docs/CUDA.md).
#define SK_WARPS 8
// The shared partial sums' row: 32 x rows and a pad word.
#define SK_LD 33

#if __CUDA_ARCH__ >= 800
__device__ __forceinline__ void sk_mma(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One 32-wide step of k at uint4 offset c: wa, wb are weight rows g and
// g + 8 (physical k 8t..8t+7, t = lane % 4), each x row's 16 bytes the same
// k. The first MMA takes their first two words, the second the last two:
// A's (row g, k 2t..2t+1), (g + 8, same), (g, 2t+8..), (g + 8, 2t+8..) and
// B's (k 2t.., x row g), (k 2t+8.., g) are physical k 8t, 8t+2 (first) and
// 8t+4, 8t+6 (second), in both operands.
template <int T>
__device__ __forceinline__ void sk_step(float (&acc)[T][4], uint4 wa, uint4 wb, const uint4* px, const int (&xo)[T], int c) {
    #pragma unroll
    for (int i = 0; i < T; i++) {
        const uint4 xv = px[xo[i] + c];
        sk_mma(acc[i], wa.x, wb.x, wa.y, wb.y, xv.x, xv.y);
        sk_mma(acc[i], wa.z, wb.z, wa.w, wb.w, xv.z, xv.w);
    }
}

// x is read through plain (coherent) loads, never `__restrict__`: its
// producer may still be running until PDL_WAIT, and a read-only load
// could be hoisted above it (with more tiles per warp, one was: products
// of 5 and 6 rows read stale inputs).
// A warp's share: 16 rows of w from row0 (rows past m read row m - 1, their
// sums dropped later), 32-wide k steps [kb0, kb1), against T tiles of 8 x
// rows (rows past n read row n - 1). U steps of weight loads in flight; the
// first U go out before waiting for x's producer.
template <int T, int U>
__device__ __forceinline__ void sk_warp(const bf16_t* __restrict__ w, int row0, int m, const bf16_t* x, int n, int k8, int kb0,
                                        int kb1, float (&acc)[T][4]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    #pragma unroll
    for (int i = 0; i < T; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
    const uint4* pa = (const uint4*)w + (long)min(row0 + g, m - 1) * k8 + t;
    const uint4* pb = (const uint4*)w + (long)min(row0 + g + 8, m - 1) * k8 + t;
    const uint4* px = (const uint4*)x + t;
    int xo[T];
    #pragma unroll
    for (int i = 0; i < T; i++) xo[i] = min(i * 8 + g, n - 1) * k8;
    uint4 wa[U], wb[U];
    int kb = kb0;
    const bool pre = kb + U <= kb1;
    if (pre) {
        #pragma unroll
        for (int u = 0; u < U; u++) {
            wa[u] = ld_stream(pa + (kb + u) * 4);
            wb[u] = ld_stream(pb + (kb + u) * 4);
        }
    }
    PDL_WAIT();
    if (pre) {
        #pragma unroll
        for (int u = 0; u < U; u++) sk_step<T>(acc, wa[u], wb[u], px, xo, (kb + u) * 4);
        kb += U;
    }
    for (; kb + U <= kb1; kb += U) {
        #pragma unroll
        for (int u = 0; u < U; u++) {
            wa[u] = ld_stream(pa + (kb + u) * 4);
            wb[u] = ld_stream(pb + (kb + u) * 4);
        }
        #pragma unroll
        for (int u = 0; u < U; u++) sk_step<T>(acc, wa[u], wb[u], px, xo, (kb + u) * 4);
    }
    for (; kb < kb1; kb++) sk_step<T>(acc, ld_stream(pa + kb * 4), ld_stream(pb + kb * 4), px, xo, kb * 4);
}

// The block's products for its R * 16 (or H * 16) outputs and every x row:
// each warp its tile (16 rows of w from row0) over its slice of k, into
// red[(warp * 16 + row) * SK_LD + x row].
template <int T>
__device__ __forceinline__ void sk_block(const bf16_t* __restrict__ w, int row0, int m, const bf16_t* x, int n, int k8, int R, float* red) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int S = SK_WARPS / R, kbn = k8 / 4, per = (kbn + S - 1) / S;
    const int kb0 = min(kbn, (warp / R) * per), kb1 = min(kbn, kb0 + per);
    float acc[T][4];
    sk_warp<T, 4>(w, row0, m, x, n, k8, kb0, kb1, acc);
    // Dependents launch only now: launched at entry, the next kernels'
    // blocks took the SM room this one's later blocks needed.
    PDL_LAUNCH();
    float* r0 = red + (warp * 16 + g) * SK_LD + 2 * t;
    float* r1 = r0 + 8 * SK_LD;
    #pragma unroll
    for (int i = 0; i < T; i++) {
        r0[i * 8] = acc[i][0];
        r0[i * 8 + 1] = acc[i][1];
        r1[i * 8] = acc[i][2];
        r1[i * 8 + 1] = acc[i][3];
    }
}

// sk_block with T = the tiles of 8 that n x rows take (the rows past n
// repeat row n - 1, unstored).
__device__ __forceinline__ void sk_blocks(const bf16_t* __restrict__ w, int row0, int m, const bf16_t* x, int n, int k8, int R, float* red) {
    const int tiles = (n + 7) / 8;
    if (tiles <= 1) sk_block<1>(w, row0, m, x, n, k8, R, red);
    else if (tiles == 2) sk_block<2>(w, row0, m, x, n, k8, R, red);
    else if (tiles == 3) sk_block<3>(w, row0, m, x, n, k8, R, red);
    else sk_block<4>(w, row0, m, x, n, k8, R, red);
}
#else
__device__ __forceinline__ void sk_blocks(const bf16_t*, int, int, const bf16_t*, int, int, int, float*) { __trap(); }
#endif

// Tile `tile`'s sum over the k slices (warps tile, tile + R, ...), weight
// row `row` of the tile, x row i.
__device__ __forceinline__ float sk_total(const float* red, int R, int tile, int row, int i) {
    float s = 0.f;
    for (int q = tile; q < SK_WARPS; q += R) s += red[(q * 16 + row) * SK_LD + i];
    return s;
}

// Up to three weights sharing x (q, k, v): blocks [0, nb0) along y take
// w0, the next nb1 w1, the rest w2. mode 0: y f32; 1: y bf16; 2: y (f32) += the
// product. At most 32 rows of x.
extern "C" __global__ void __launch_bounds__(256, 2) gemm_skinny(const bf16_t* x, int n, int k8, int R, const bf16_t* w0,
    const bf16_t* w1, const bf16_t* w2, void* y0, void* y1, void* y2, int m0, int m1, int m2, int nb0, int nb1, int mode) {
    __shared__ float red[SK_WARPS * 16 * SK_LD];
    int blk = blockIdx.y;
    const bf16_t* w = w0;
    void* y = y0;
    int m = m0;
    if (blk >= nb0 + nb1) { blk -= nb0 + nb1; w = w2; y = y2; m = m2; }
    else if (blk >= nb0) { blk -= nb0; w = w1; y = y1; m = m1; }
    const int warp = threadIdx.x >> 5;
    sk_blocks(w, (blk * R + warp % R) * 16, m, x, n, k8, R, red);
    __syncthreads();
    for (int o = threadIdx.x; o < R * 16 * n; o += blockDim.x) {
        const int i = o / (R * 16), f = o % (R * 16), j = blk * R * 16 + f;
        if (j >= m) continue;
        const float v = sk_total(red, R, f / 16, f % 16, i);
        const long at = (long)i * m + j;
        if (mode == 1) ((bf16_t*)y)[at] = f2bf(v);
        else if (mode == 2) ((float*)y)[at] += v;
        else ((float*)y)[at] = v;
    }
}

// Gate, up and the activation: a block takes R / 2 tiles of gate (warps'
// tiles 0..R/2) and the same rows of up (R/2..R); out = act(gate) * up in
// f32 and bf16, gate and up never written. At most 32 rows of x.
extern "C" __global__ void __launch_bounds__(256, 2) gemm_skinny_gated(const bf16_t* x, int n, int k8, int R,
    const bf16_t* __restrict__ wg, const bf16_t* __restrict__ wu, int m, int act, float* __restrict__ out, bf16_t* __restrict__ out_bf) {
    __shared__ float red[SK_WARPS * 16 * SK_LD];
    const int warp = threadIdx.x >> 5, H = R / 2, tile = warp % R;
    const int row0 = (blockIdx.y * H + (tile < H ? tile : tile - H)) * 16;
    sk_blocks(tile < H ? wg : wu, row0, m, x, n, k8, R, red);
    __syncthreads();
    for (int o = threadIdx.x; o < H * 16 * n; o += blockDim.x) {
        const int i = o / (H * 16), f = o % (H * 16), j = blockIdx.y * H * 16 + f;
        if (j >= m) continue;
        const float g = sk_total(red, R, f / 16, f % 16, i), u = sk_total(red, R, H + f / 16, f % 16, i);
        const float v = gate_act(g, act) * u;
        const long at = (long)i * m + j;
        out[at] = v;
        out_bf[at] = f2bf(v);
    }
}
