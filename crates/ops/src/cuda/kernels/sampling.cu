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
