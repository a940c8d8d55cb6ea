// Sampling on the device: greedy argmax and top-k (part of the base module,
// after base.cu).

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
// allow, if not null, holds a bit per column (words per row): a column
// whose bit is clear counts as -inf (a guided stream's mask).
#define TOPK_MAX_N 4096
extern "C" __global__ void topk_chunks(const float* __restrict__ x, int cols, int n, int k, unsigned long long* __restrict__ part,
                                       const unsigned* __restrict__ allow, int words) {
    PDL_ENTRY();
    __shared__ unsigned long long s[TOPK_MAX_N];
    const float* row = x + (long)blockIdx.y * cols;
    const unsigned* bits = allow ? allow + (long)blockIdx.y * words : nullptr;
    const int a = blockIdx.x * n;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const int c = a + i;
        s[i] = c < cols ? rank_key(!bits || ((bits[c >> 5] >> (c & 31)) & 1u) ? row[c] : NEG_INF, c) : 0ull;
    }
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
// no clearing launch comes before. keys and done start zeroed. allow, if
// not null, holds a bit per column (words per row): a column whose bit is
// clear never wins (a guided stream's mask).
extern "C" __global__ void argmax_rows(const float* __restrict__ x, int cols, unsigned long long* keys, unsigned* done,
                                       unsigned* __restrict__ ids, unsigned* __restrict__ dst,
                                       const unsigned* __restrict__ allow, int words) {
    PDL_ENTRY();
    __shared__ unsigned long long best_s[32];
    __shared__ bool last;
    const float* row = x + (long)blockIdx.x * cols;
    const int chunk = (cols + gridDim.y - 1) / gridDim.y;
    const int a = blockIdx.y * chunk, b = min(cols, a + chunk);
    unsigned long long best = 0ull;
    // Unrolled so several loads are out at once (the row sits in L2).
    if (allow) {
        const unsigned* bits = allow + (long)blockIdx.x * words;
        for (int i = a + threadIdx.x; i < b; i += blockDim.x) {
            const unsigned long long key = (bits[i >> 5] >> (i & 31)) & 1u ? rank_key(row[i], i) : 0ull;
            best = key > best ? key : best;
        }
    } else {
        #pragma unroll 4
        for (int i = a + threadIdx.x; i < b; i += blockDim.x) {
            const unsigned long long key = rank_key(row[i], i);
            best = key > best ? key : best;
        }
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

// A sampler's penalties, in place before a pick: each entry names a value
// (row, column; one entry per value) and changes it as `Penalty::apply`
// does, in the same f32 operations, so the pick sees what the host's
// sampler would.
struct Penalty { unsigned row, col; float repeat, sub; };
extern "C" __global__ void penalize(float* __restrict__ x, int cols, const Penalty* __restrict__ p, int n) {
    PDL_ENTRY();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const Penalty e = p[i];
    float* v = x + (long)e.row * cols + e.col;
    float a = *v;
    // Rounded as written: left to itself the compiler fuses a * repeat - sub
    // into one FMA, a rounding the host does not make.
    if (e.repeat != 1.0f) a = a > 0.0f ? __fdiv_rn(a, e.repeat) : __fmul_rn(a, e.repeat);
    *v = __fsub_rn(a, e.sub);
}

// A sampled draw per row (RowPick::Draw, draw_host on the host says what
// it finds): one block a row. A column's weight is exp((x - max) / t), 0
// where masked or NaN, so the largest weighs 1 and every weight's bits,
// as an unsigned, order like the weight. The floors (top-k, top-p, min-p)
// are found by search over those bits: each pass over the row counts (or
// weighs) the columns at or above DRAW_WAYS candidate floors at once, so
// ~8 passes pin a floor to the bit. The token is then walked to in column
// order: each thread sums its own run of columns, a block scan places the
// runs, and the run holding u times the kept mass walks to the column.
// Sums are in a fixed order: the same row and u give the same token.
struct DrawRow { float t; unsigned k; float p; float min_p; float u; };
#define DRAW_WAYS 15
#define DRAW_THREADS 512

__device__ __forceinline__ float draw_w(const float* row, const unsigned* bits, int c, float mx, float inv_t) {
    const float x = row[c];
    if (x != x || (bits && !((bits[c >> 5] >> (c & 31)) & 1u))) return 0.f;
    return __expf((x - mx) * inv_t);
}

// Block sums of each thread's DRAW_WAYS values into res (every thread
// reads them after).
__device__ __forceinline__ void draw_sums(float (&v)[DRAW_WAYS], float* sh, float* res) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int j = 0; j < DRAW_WAYS; j++) {
        const float s = warp_sum(v[j]);
        if (lane == 0) sh[warp * 16 + j] = s;
    }
    __syncthreads();
    if (threadIdx.x < DRAW_WAYS) {
        float s = 0.f;
        for (int w = 0; w < nw; w++) s += sh[w * 16 + threadIdx.x];
        res[threadIdx.x] = s;
    }
    __syncthreads();
}

// The largest weight bits b in [lo, hi) whose columns at or above it
// number (count) or weigh at least goal: that of lo is known to, that of
// hi not to.
__device__ unsigned draw_floor(const float* row, const unsigned* bits, int cols, float mx, float inv_t, unsigned lo, unsigned hi, float goal,
                               bool count, float* sh, float* res) {
    while (hi - lo > 1) {
        const unsigned step = (hi - lo + DRAW_WAYS) / (DRAW_WAYS + 1);
        unsigned c[DRAW_WAYS];
        float acc[DRAW_WAYS];
#pragma unroll
        for (int j = 0; j < DRAW_WAYS; j++) {
            const unsigned long long cj = (unsigned long long)lo + (unsigned long long)(j + 1) * step;
            c[j] = cj < hi ? (unsigned)cj : hi;
            acc[j] = 0.f;
        }
        for (int i = threadIdx.x; i < cols; i += blockDim.x) {
            const float w = draw_w(row, bits, i, mx, inv_t);
            const unsigned b = __float_as_uint(w);
            const float add = count ? 1.f : w;
#pragma unroll
            for (int j = 0; j < DRAW_WAYS; j++) acc[j] += b >= c[j] ? add : 0.f;
        }
        draw_sums(acc, sh, res);
        unsigned nlo = lo, nhi = hi;
#pragma unroll
        for (int j = 0; j < DRAW_WAYS; j++) {
            if (c[j] >= hi) continue;
            if (res[j] >= goal) nlo = c[j] > nlo ? c[j] : nlo;
            else nhi = c[j] < nhi ? c[j] : nhi;
        }
        lo = nlo;
        hi = nhi;
    }
    return lo;
}

extern "C" __global__ void __launch_bounds__(DRAW_THREADS) draw_rows(const float* __restrict__ x, int cols, const DrawRow* __restrict__ draws,
                                                                   const unsigned* __restrict__ allow, int words, unsigned* __restrict__ out) {
    PDL_ENTRY();
    __shared__ float sh[32 * 16];
    __shared__ float res[16];
    __shared__ float smax[32];
    __shared__ int sidx[32];
    __shared__ float soff[32];
    __shared__ unsigned token;
    const int r = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const float* row = x + (long)r * cols;
    const unsigned* bits = allow ? allow + (long)r * words : nullptr;
    const DrawRow d = draws[r];
    // The largest allowed value and its first column (the first allowed
    // column when every one is -inf or NaN; none allowed: 0x7fffffff).
    float best = NEG_INF;
    int bi = 0x7fffffff;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        if (bits && !((bits[i >> 5] >> (i & 31)) & 1u)) continue;
        const float v = row[i] != row[i] ? NEG_INF : row[i];
        if (v > best || (v == best && i < bi)) { best = v; bi = i; }
    }
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, best, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > best || (ov == best && oi < bi)) { best = ov; bi = oi; }
    }
    if (lane == 0) { smax[warp] = best; sidx[warp] = bi; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < nw; w++)
            if (smax[w] > smax[0] || (smax[w] == smax[0] && sidx[w] < sidx[0])) { smax[0] = smax[w]; sidx[0] = sidx[w]; }
        token = sidx[0] == 0x7fffffff ? 0u : (unsigned)sidx[0];
    }
    __syncthreads();
    const float mx = smax[0];
    if (d.t <= 0.f || mx == NEG_INF) {
        if (threadIdx.x == 0) out[r] = token;
        return;
    }
    const float inv_t = 1.f / d.t;
    const unsigned top = 0x3f800001u;  // past the bits of 1, the largest weight
    unsigned floor = 0u;
    if (d.k > 0u && d.k < (unsigned)cols) floor = draw_floor(row, bits, cols, mx, inv_t, 0u, top, (float)d.k, true, sh, res);
    if (d.p < 1.f) {
        // The mass at or above the top-k floor, then the top-p floor within it.
        float acc[DRAW_WAYS];
#pragma unroll
        for (int j = 0; j < DRAW_WAYS; j++) acc[j] = 0.f;
        for (int i = threadIdx.x; i < cols; i += blockDim.x) {
            const float w = draw_w(row, bits, i, mx, inv_t);
            acc[0] += __float_as_uint(w) >= floor ? w : 0.f;
        }
        draw_sums(acc, sh, res);
        floor = draw_floor(row, bits, cols, mx, inv_t, floor, top, d.p * res[0], false, sh, res);
    }
    if (d.min_p > 0.f) floor = max(floor, __float_as_uint(d.min_p));
    // Each thread's run of columns and its kept mass, in column order.
    const int per = (cols + blockDim.x - 1) / blockDim.x;
    const int a = threadIdx.x * per, b = min(cols, a + per);
    float m = 0.f;
    for (int i = a; i < b; i++) {
        const float w = draw_w(row, bits, i, mx, inv_t);
        if (w > 0.f && __float_as_uint(w) >= floor) m += w;
    }
    // The runs' places: a scan over the block, each run starting exactly
    // where the one before ends (the same sums), so the runs tile [0, total).
    float wincl = m;
    for (int o = 1; o < 32; o <<= 1) {
        const float y = __shfl_up_sync(0xffffffffu, wincl, o);
        if (lane >= o) wincl += y;
    }
    const float wexcl = __shfl_up_sync(0xffffffffu, wincl, 1);
    if (lane == 31) soff[warp] = wincl;
    __syncthreads();
    if (threadIdx.x == 0) {
        float s = 0.f;
        for (int w = 0; w < nw; w++) { const float t = soff[w]; soff[w] = s; s += t; }
        res[0] = s;
    }
    __syncthreads();
    const float off = soff[warp];
    const float incl = wincl + off, excl = lane == 0 ? off : wexcl + off, total = res[0], target = d.u * total;
    // The run holding the target walks to its column (the last kept
    // column of the last run, should rounding leave the target past all).
    if (m > 0.f && ((excl <= target && target < incl) || (incl >= total && target >= incl))) {
        float cum = excl;
        unsigned last = token;
        for (int i = a; i < b; i++) {
            const float w = draw_w(row, bits, i, mx, inv_t);
            if (w > 0.f && __float_as_uint(w) >= floor) {
                cum += w;
                last = (unsigned)i;
                if (cum > target) break;
            }
        }
        out[r] = last;
    } else if (threadIdx.x == 0 && total <= 0.f) {
        out[r] = token;
    }
}
