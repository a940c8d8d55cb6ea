// What every module's source starts with (each NVRTC module is compiled on
// its own, after the `#define`s `kernels.rs` puts first): the bf16 type and
// conversions, `NEG_INF`, warp reductions, and the
// programmatic-dependent-launch macros every kernel opens with.
//
// No CUDA headers are needed: bf16 values travel as `unsigned short` and are
// converted with bit operations. Activations are f32; every kernel whose
// output feeds a GEMM also writes a bf16 copy (the "shadow") so the GEMM can
// read it directly.
typedef unsigned short bf16_t;
// Programmatic dependent launch (Hopper on): every kernel is launched
// allowed to start while the one before it runs. Each lets its successor
// launch at once, so the blocks of the next few kernels can sit on the SMs
// with their first weight loads issued (weights, never written, may be
// read before the wait; the GEMVs do), then waits for its predecessor
// (all of it, memory included; the predecessor finished only after its
// own wait, so everything earlier is complete too) before touching
// anything a kernel wrote. PDL_LATE (`Tuning::pdl_early` off): let the
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
