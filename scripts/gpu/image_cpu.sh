#!/usr/bin/env bash
# On the GPU machine (its 16-core CPU), with .device-bin/ from
# scripts/gpu/build.sh and .peer/ as side_by_side.sh says: the image arrival
# beside 4 decoding streams, and a text arrival, each through a fresh
# `braid serve --device cpu` with the round trace kept (scripts/gpu/gaps.py
# reads it; the logs come back xz-compressed). The vision-stall model is made
# there (scripts/bench/make_vision_stall_model.py, NumPy, ~2 GB).
# IMG_THREADS (12), ARRS ("image text"), GEN (3000), T (110 s a probe).
set -uo pipefail
OUT=${OUT:-/tmp/img}; mkdir -p "$OUT"
B=.device-bin
. scripts/gpu/unpack.sh
M=$HOME/vsm
[ -s $M/config.json ] || python3 scripts/bench/make_vision_stall_model.py $M > "$OUT/make.log" 2>&1
for arr in ${ARRS:-image text}; do
  RUST_LOG=info,braid_engine::lane::round=trace $B/braid serve --device cpu --threads ${IMG_THREADS:-12} -m $M --chat-template gemma --port 8099 > "$OUT/serve-$arr.log" 2>&1 &
  sp=$!
  for _ in $(seq 1 240); do curl -sf 127.0.0.1:8099/health > /dev/null && break; sleep 0.5; done
  if [ $arr = image ]; then prog=(python3 scripts/bench/image_stall.py --probe .peer/stall_probe.py --); else prog=(python3 .peer/stall_probe.py); fi
  timeout ${T:-110} "${prog[@]}" http://127.0.0.1:8099 --streams 4 --gen ${GEN:-3000} --long-tokens 40 --ignore-eos on --seed 5 --timeout 100 --dump "$OUT/dump-$arr.json" > "$OUT/probe-$arr.txt" 2>&1
  tail -3 "$OUT/probe-$arr.txt"
  kill $sp; wait $sp 2>/dev/null
  python3 scripts/gpu/gaps.py "$OUT/serve-$arr.log" | tail -2
  xz -k "$OUT/serve-$arr.log"; rm "$OUT/serve-$arr.log"
done
