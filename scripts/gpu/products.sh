#!/usr/bin/env bash
# On the GPU machine, from the repository root, after scripts/gpu/build.sh
# here: the product kernels against the skinny GEMM's alternative, in one
# call. The op tests (cuda_ops), then decode rounds at 1-64 streams and
# rounds of 6 decode rows beside a prompt chunk, each with the skinny GEMM
# (the default) and with it off (cuBLAS past the GEMV's rows), interleaved
# and repeated, and a kernel profile of both (BENCH=0: the tests alone);
# then the model tests (MODELS_TESTS=0: not). Logs under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/products}
B=.device-bin
mkdir -p "$OUT"
. scripts/gpu/unpack.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
# TEST_FILTER: only the cuda_ops tests whose names hold it.
[ "${TESTS:-1}" = 0 ] || timeout 240 "$B/cuda_ops" --test-threads=1 ${TEST_FILTER:-} 2>&1 | tee "$OUT/cuda_ops.log" | grep -E "^test |panicked|result:|seed"
STREAMS=${STREAMS:-1,2,4,6,8,16,32,64}
[ "${BENCH:-1}" = 0 ] && REPS="" || REPS=${REPS:-1 2}
for rep in $REPS; do
  for s in 0 32; do
    timeout 120 "$B/gpu_bench" --no-eager --streams "$STREAMS" --prefill 2048 --skinny-rows $s > "$OUT/bench-s$s-$rep.md" 2> "$OUT/bench-s$s-$rep.log"
    echo "skinny-rows $s, rep $rep:"; grep -E "^\|" "$OUT/bench-s$s-$rep.md" | head -20
  done
done
for s in ${REPS:+0 32}; do
  timeout 90 "$B/gpu_bench" --mixed 6:1000:1000:0,1,4,16,32,48,64,96,128,192,250 --skinny-rows $s > "$OUT/mixed-s$s.md" 2>&1
  echo "mixed, skinny-rows $s:"; grep -E "^\|" "$OUT/mixed-s$s.md"
done
[ "${PROFILE:-1}" = 0 ] || for s in ${REPS:+0 32}; do
  timeout 90 "$B/gpu_bench" --profile --streams 8 --prefill 256 --skinny-rows $s > "$OUT/profile-s$s.md" 2>&1
done
[ "${MODELS_TESTS:-1}" = 0 ] || timeout 240 "$B/cuda_models" --test-threads=1 2>&1 | tee "$OUT/cuda_models.log" | grep -E "^test |panicked|result:"
