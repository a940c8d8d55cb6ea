#!/usr/bin/env bash
# On the GPU machine, from the repository root, after scripts/gpu/build.sh
# here carried .device-bin/: the CUDA correctness tests, then braid's GPU
# benchmark and the transformers peer on the same shape, then the table of
# ratios. Logs go to $OUT (or /tmp/braid-gpu).
set -uo pipefail
OUT=${OUT:-/tmp/braid-gpu}
mkdir -p "$OUT"
B=.device-bin
. scripts/gpu/unpack.sh
export BRAID_MODELS=${BRAID_MODELS:-$PWD/$B/models}
export BRAID_TESTDATA=$PWD/testdata
mkdir -p "$BRAID_MODELS"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
timeout 150 $B/cuda_ops --test-threads=1 --nocapture 2>&1 | tee "$OUT/cuda_ops.log" | grep -E "^test |rel err|rope_kv|SKIP|panicked|result:|seed|graph"
timeout 200 $B/gpu_bench --json "$OUT/braid.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
# GPU time per kernel (events around each launch; eager), appended to the bench log.
[ -n "${PROFILE:-}" ] && timeout 90 $B/gpu_bench --profile --streams ${PROFILE_STREAMS:-1,64} 2>&1 | tee -a "$OUT/bench.log"
timeout 180 $B/cuda_models --test-threads=1 --nocapture 2>&1 | tee "$OUT/cuda_models.log" | grep -E "^test |rel err|agreement|SKIP|panicked|result:|whole|tok/s"
# transformers takes minutes (its eager decode is host-bound); HF=0 skips it
# and compares against its recorded H200 run (scripts/gpu/hf_h200.json).
HF_JSON=scripts/gpu/hf_h200.json
if [ "${HF:-1}" != 0 ]; then
  PYTHONUNBUFFERED=1 timeout 400 python3 scripts/gpu/hf_bench.py --json "$OUT/hf.json" 2>&1 | grep -v Warning | tee "$OUT/hf.log"
  [ -s "$OUT/hf.json" ] && HF_JSON=$OUT/hf.json
fi
python3 scripts/gpu/compare.py "$OUT/braid.json" "$HF_JSON" | tee "$OUT/compare.md"
