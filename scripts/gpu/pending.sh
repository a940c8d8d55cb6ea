#!/usr/bin/env bash
# The GPU calls prepared in stop 53 and not yet run (docs/dev/cuda-sessions.md,
# "Stop 53"), in one call of up to ~560 s, from the repository root on the device:
# the attention tests (the lanes decode kernel at 32 pairs beside the
# default, with a round's decode rows launched apart from a short chunk's)
# and cuda_models rounds:: drafting::; mixed rounds with
# BRAID_CUDA_ATTN_DEC_PAIRS=32 and 0; then the stall with each (SmolLM2 and
# Llama-1B, seeds 1 and 2), and at 16 streams (the pacer's `f6994e1`).
# If the arrival's TTFT and ratio hold with 32, make it the default
# (`Tuning::attn_decode_lanes_pairs`). Results under $OUT.
#
# Before it, here: scripts/gpu/build.sh (.device-bin/), and a git-ignored .peer/
# holding ../shared/gpu as gpu/, ../shared/bench/stall_probe.py, the `gguf`
# wheel unpacked as gguf-py/ (`pip download --no-deps gguf`, then
# `python3 -m zipfile -e gguf-*.whl .peer/gguf-py`), and meta.json
# (`python3 .peer/gpu/dump_meta.py SMOLLM2.gguf .peer/meta.json .peer/gguf-py`).
# Carry [".device-bin", ".peer"].
set -uo pipefail
OUT=${OUT:-/tmp/v53}; mkdir -p "$OUT"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$OUT/times.txt"; }
before() { [ $(( $(date +%s) - T0 )) -lt "$1" ]; }
B=.device-bin
. scripts/gpu/unpack.sh
export BRAID_TESTDATA=$PWD/testdata BRAID_MODELS=$PWD/$B/models
mkdir -p $BRAID_MODELS $HOME/lc
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
( for s in smollm2 llama1b; do [ -s $HOME/lc/rand-$s.gguf ] || python3 .peer/gpu/make_random_gguf.py .peer/gguf-py .peer/meta.json $HOME/lc/rand-$s.gguf $s > "$OUT/gguf-$s.log" 2>&1; done ) &
gg=$!
el ops; timeout 200 $B/cuda_ops --test-threads=1 --nocapture attention 2>&1 | grep -E "^test |rel err|panicked|result" > "$OUT/cuda_ops.log"; grep -E "result|FAIL|panicked" "$OUT/cuda_ops.log"
el models; timeout 120 $B/cuda_models --test-threads=1 rounds:: drafting:: 2>&1 | grep -E "^test |panicked|result" > "$OUT/cuda_models.log"; grep -E "result|FAIL|panicked" "$OUT/cuda_models.log"
el mixed
for p in smollm2-135m llama-3.2-1b; do for c in 250 2000 4000; do for pairs in 0 32; do
  before 260 || continue
  r=$(BRAID_CUDA_ATTN_DEC_PAIRS=$pairs timeout 60 $B/gpu_bench --preset $p --mixed 6:$c:$c:0,8,16,32,64 2>/dev/null | grep "^| [0-9]" | awk -F'|' '{printf "%s:%s ", $2+0, $3+0}')
  echo "$p ctx $c pairs=$pairs: $r" | tee -a "$OUT/mixed.txt"
done; done; done
wait $gg; el stall
for run in "6:smollm2:1" "6:llama1b:1" "6:smollm2:2" "6:llama1b:2" "16:smollm2:1"; do
  IFS=: read -r n mod seed <<< "$run"
  for pairs in 0 32; do
    before 480 || continue
    BRAID_CUDA_ATTN_DEC_PAIRS=$pairs STREAMS=$n OUT=$OUT/stall-$mod-$n-$seed-$pairs SEEDS=$seed MODELS=$mod PROBE=rust BRAID_ONLY=1 timeout 80 bash scripts/gpu/side_by_side.sh 2>&1 \
      | tail -2 | sed "s/^/$mod streams $n seed $seed pairs $pairs: /" | tee -a "$OUT/stall.txt"
  done
done
el done
# The device tool brings back a limited number of files: the traces in one.
cd "$OUT" && tar cJf /tmp/traces.tar.xz stall-*/*.log 2>/dev/null && mv /tmp/traces.tar.xz "$OUT/" && rm -rf stall-*
