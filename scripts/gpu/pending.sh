#!/usr/bin/env bash
# The GPU call prepared in stop 54 and not yet run (docs/dev/cuda-sessions.md,
# "Stop 54"), up to ~560 s, from the repository root on the device:
# * SmolLM2's 16-32-row chunks in the prefill kernel instead of the decode
#   kernel (BRAID_CUDA_ATTN_DEC_ROWS=16 against the default 32): mixed
#   rounds at 1,000-4,000 keys beside 6 and 16 streams, then the 16-stream
#   arrival (stop 54's pass ran 92 rounds of 16 rows: the round after the
#   admission read short, which `23ddfac` leaves out, expecting ~30 rounds
#   of 48-64 rows; and 24 and 32 rows read dear);
# * the 32-stream arrival with the probe and the server on cores of their
#   own (PROBE_CPUS / SERVE_CPUS): are the host's slow rounds the probe's?
# If ATTN_DEC_ROWS=16 shortens the 16-stream TTFT without a larger gap,
# make it the default (`Tuning::attn_decode_max_rows`).
# * a guided stream's cost (stop 55): a greedy guided stream whose mask
#   came late now takes its argmax when its grammar does (a copy of its
#   constraint on the lane's thread) instead of sitting out a round;
#   bench_guided.py's words and records on both shapes (H100, stop 54's
#   build: words 9.8-31.9% slower, records 0.5-1.1%). Built with
#   `BEFORE=0239ac0 scripts/gpu/build.sh`, the build before the checker
#   runs too, interleaved, for an A/B in the same call.
#
# Before it, here: scripts/gpu/build.sh (.device-bin/) and .peer/ as
# scripts/gpu/side_by_side.sh says. Carry [".device-bin", ".peer"]. The
# device tool brings back at most eight files: everything is in one tar.
set -uo pipefail
OUT=${OUT:-/tmp/v54}; mkdir -p "$OUT"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$OUT/times.txt"; }
before() { [ $(( $(date +%s) - T0 )) -lt "$1" ]; }
B=.device-bin
. scripts/gpu/unpack.sh
export BRAID_TESTDATA=$PWD/testdata BRAID_MODELS=$PWD/$B/models
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
el mixed
for n in 6 16; do for c in 1000 2000 4000; do for rows in 32 16; do
  before 150 || continue
  r=$(BRAID_CUDA_ATTN_DEC_ROWS=$rows timeout 60 $B/gpu_bench --preset smollm2-135m --mixed $n:$c:$c:0,16,24,32,48,64 2>/dev/null | grep "^| [0-9]" | awk -F'|' '{printf "%s:%s ", $2+0, $3+0}')
  echo "smollm2 $n streams ctx $c dec_rows=$rows: $r" | tee -a "$OUT/mixed.txt"
done; done; done
el stall
for run in "16:32::" "16:16::" "32:32::" "32:32:12-15:0-11" "6:16::"; do
  IFS=: read -r n rows pc sc <<< "$run"
  before 470 || continue
  BRAID_CUDA_ATTN_DEC_ROWS=$rows PROBE_CPUS=$pc SERVE_CPUS=$sc STREAMS=$n OUT=$OUT/stall-$n-$rows-${pc:-all} SEEDS=1 MODELS=smollm2 PROBE=rust BRAID_ONLY=1 \
    timeout 80 bash scripts/gpu/side_by_side.sh 2>&1 | tail -2 | sed "s/^/smollm2 streams $n dec_rows $rows probe cpus ${pc:-all}: /" | tee -a "$OUT/stall.txt"
done
el guided
builds=(braid); [ -x $B/braid-before ] && builds+=(braid-before)
for mod in llama1b smollm2; do for bin in "${builds[@]}"; do
  before 545 || continue
  $B/$bin serve --device cuda -m "$HOME/lc/rand-$mod.gguf" --port 8111 > "$OUT/guided-$mod-$bin.log" 2>&1 &
  pid=$!
  for i in $(seq 120); do curl -sf localhost:8111/health > /dev/null && break; sleep 0.5; done
  for sch in words record; do
    echo "$mod $bin $sch: $(timeout 40 python3 scripts/bench_guided.py http://127.0.0.1:8111 --tokens 128 --runs 3 --schema $sch 2>&1 | tail -1)" | tee -a "$OUT/guided.txt"
  done
  kill $pid; wait $pid 2>/dev/null
done; done
el done
cd "$OUT" && tar cJf /tmp/v54.tar.xz stall-*/ guided-*.log *.txt 2>/dev/null && rm -rf stall-* && mv /tmp/v54.tar.xz "$OUT/all.tar.xz"
