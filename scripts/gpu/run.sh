#!/usr/bin/env bash
# On the GPU machine, from the repository root, after scripts/gpu/build.sh
# here carried .device-bin/: the CUDA correctness tests, then braid's GPU
# benchmark and the transformers peer on the same shape, then the table of
# ratios. Logs go to $OUT (or /tmp/braid-gpu).
set -uo pipefail
OUT=${OUT:-/tmp/braid-gpu}
mkdir -p "$OUT"
B=.device-bin
export BRAID_MODELS=${BRAID_MODELS:-$PWD/$B/models}
export BRAID_TESTDATA=$PWD/testdata
mkdir -p "$BRAID_MODELS"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
timeout 240 $B/cuda_ops --test-threads=1 --nocapture 2>&1 | tee "$OUT/cuda_ops.log" | grep -E "^test |rel err|SKIP|panicked|result:|seed|graph"
timeout 300 $B/gpu_bench --json "$OUT/braid.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
# GPU time per kernel (events around each launch; eager), appended to the bench log.
[ -n "${PROFILE:-}" ] && timeout 120 $B/gpu_bench --profile --streams 1,64 2>&1 | tee -a "$OUT/bench.log"
timeout 300 $B/cuda_models --test-threads=1 --nocapture 2>&1 | tee "$OUT/cuda_models.log" | grep -E "^test |rel err|agreement|SKIP|panicked|result:|whole|tok/s"
PYTHONUNBUFFERED=1 timeout 400 python3 scripts/gpu/hf_bench.py --json "$OUT/hf.json" 2>&1 | grep -v Warning | tee "$OUT/hf.log"
python3 scripts/gpu/compare.py "$OUT/braid.json" "$OUT/hf.json" | tee "$OUT/compare.md"
