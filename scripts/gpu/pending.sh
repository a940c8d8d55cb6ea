#!/usr/bin/env bash
# The GPU calls prepared in stop 50 and not yet run (docs/dev/cuda-sessions.md,
# "Stop 50"), in one call of ~450 s, from the repository root on the device:
# the attention, draw and penalty op tests; cuda_models rounds:: drafting::;
# served top-p throughput with BRAID_CUDA_DRAW=1 and 0 (32 streams, both
# random GGUFs); scripts/bench_guided.py on both; the stall (SmolLM2, Llama-1B,
# --itl-target 3, SmolLM2 with ATTN_CLUSTER_MAX=16). Results under $OUT.
#
# Before it, here: scripts/gpu/build.sh (.device-bin/), and a git-ignored .peer/
# holding ../shared/gpu as gpu/, ../shared/bench/stall_probe.py, the `gguf`
# wheel unpacked as gguf-py/ (`pip download --no-deps gguf`, then
# `python3 -m zipfile -e gguf-*.whl .peer/gguf-py`), and meta.json
# (`python3 .peer/gpu/dump_meta.py SMOLLM2.gguf .peer/meta.json .peer/gguf-py`).
# Carry [".device-bin", ".peer"].
set -uo pipefail
OUT=${OUT:-/tmp/v10}; mkdir -p "$OUT"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$OUT/times.txt"; }
before() { [ $(( $(date +%s) - T0 )) -lt "$1" ]; }
B=.device-bin
. scripts/gpu/unpack.sh
export BRAID_TESTDATA=$PWD/testdata BRAID_MODELS=$PWD/$B/models
mkdir -p $BRAID_MODELS $HOME/lc
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
( for s in smollm2 llama1b; do [ -s $HOME/lc/rand-$s.gguf ] || python3 .peer/gpu/make_random_gguf.py .peer/gguf-py .peer/meta.json $HOME/lc/rand-$s.gguf $s > "$OUT/gguf-$s.log" 2>&1; done ) &
gg=$!
el ops; timeout 120 $B/cuda_ops --test-threads=1 --nocapture attention draws penalties 2>&1 | grep -E "^test |draws:|panicked|result|^seed" > "$OUT/cuda_ops.log"; grep -E "result|FAIL|draws:|panicked" "$OUT/cuda_ops.log"
el models; timeout 120 $B/cuda_models --test-threads=1 rounds:: drafting:: 2>&1 | grep -E "^test |panicked|result" > "$OUT/cuda_models.log"; grep -E "result|FAIL|panicked" "$OUT/cuda_models.log"
wait $gg; el ggufs; ls -la $HOME/lc | tail -2
if grep -q draw_rows $B/braid; then
for mod in smollm2 llama1b; do
  for n in 32; do
    for dr in 1 0; do
      before 260 || continue
      BRAID_CUDA_DRAW=$dr $B/braid serve --device cuda -m $HOME/lc/rand-$mod.gguf --port 8097 > "$OUT/serve-$mod-$n-$dr.log" 2>&1 &
      sp=$!
      for _ in $(seq 1 240); do curl -sf 127.0.0.1:8097/health > /dev/null && break; sleep 0.5; done
      timeout 60 python3 scripts/gpu/sampled_load.py 8097 --streams $n --tokens 256 --label "$mod n$n draw$dr" >> "$OUT/load.jsonl" 2>&1
      curl -s 127.0.0.1:8097/metrics | grep -E "^braid_(draw|top_k|greedy|decode)_rounds_total" | tr '\n' ' ' >> "$OUT/load.jsonl"; echo >> "$OUT/load.jsonl"
      kill $sp; wait $sp 2>/dev/null
    done
  done
done
cat "$OUT/load.jsonl"
fi
el guided
for mod in smollm2 llama1b; do
  before 300 || continue
  $B/braid serve --device cuda -m $HOME/lc/rand-$mod.gguf --port 8096 > "$OUT/serve-guided-$mod.log" 2>&1 &
  sp=$!
  for _ in $(seq 1 240); do curl -sf 127.0.0.1:8096/health > /dev/null && break; sleep 0.5; done
  timeout 60 python3 scripts/bench_guided.py http://127.0.0.1:8096 --tokens 128 --runs 3 > "$OUT/guided-$mod.txt" 2>&1
  echo "$mod: $(tail -1 "$OUT/guided-$mod.txt")"
  kill $sp; wait $sp 2>/dev/null
done

for run in "s:smollm2:1:" "l:llama1b:1:" "i3:llama1b:1::--itl-target 3" "s16:smollm2:1:BRAID_CUDA_ATTN_CLUSTER_MAX=16"; do
  IFS=: read -r tag mod seeds knob args <<< "$run"
  before 400 || continue
  el "$tag"
  env $knob PROBE=rust BRAID_ONLY=1 MODELS=$mod SEEDS="$seeds" BRAID_ARGS="$args" OUT="$OUT/$tag" timeout 90 bash scripts/gpu/side_by_side.sh > "$OUT/$tag.txt" 2>&1
  tail -3 "$OUT/$tag.txt"
  for f in "$OUT/$tag"/braid-serve-*.log; do [ -f "$f" ] && xz "$f"; done
done
el done
