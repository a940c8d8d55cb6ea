#!/usr/bin/env bash
# Build the CUDA programs here (no CUDA needed: the libraries load at run
# time) and copy them into .device-bin/ (git-ignored), which the device
# tool carries to the GPU machine. Then, there: scripts/gpu/run.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .device-bin
# The server with the BRAID_CUDA_* knobs read (docs/CUDA.md), for the stall
# scenario (side_by_side.sh); TUNING=0 builds it as released.
[ "${TUNING:-1}" = 0 ] && feat=() || feat=(--features braid-ops/cuda-tuning)
cargo build --release -p braid "${feat[@]}"
cp target/release/braid .device-bin/
# BEFORE=REV: also the server as of REV (.device-bin/braid-before, built in
# a worktree under target/), for an A/B in one device call.
progs=(braid gpu_bench stall_probe metronome cuda_ops cuda_models)
if [ -n "${BEFORE:-}" ]; then
  rm -rf target/before && git worktree prune && git worktree add --detach target/before "$BEFORE"
  (cd target/before && CARGO_TARGET_DIR=../before-target cargo build --release -p braid "${feat[@]}")
  cp target/before-target/release/braid .device-bin/braid-before
  git worktree remove --force target/before
  progs+=(braid-before)
fi
cargo build --release -p braid-models --features cuda "${feat[@]}" --example gpu_bench
cp target/release/examples/gpu_bench .device-bin/
cargo build --release -p braid-server --example stall_probe --example metronome
cp target/release/examples/stall_probe target/release/examples/metronome .device-bin/
# Test executables (cargo names them by hash: ask cargo which).
for t in "braid-ops cuda_ops" "braid-models cuda_models"; do
  set -- $t
  exe=$(cargo test --release -p "$1" --features cuda --test "$2" --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json,sys
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["name"]==sys.argv[1]: print(m["executable"])' "$2" | tail -1)
  cp "$exe" ".device-bin/$2"
done
(cd .device-bin && strip "${progs[@]}")
# Compressed, they and the working tree fit the device tool's carry
# (64 MiB); scripts/gpu/unpack.sh restores them there.
python3 - "${progs[@]}" <<'PY'
import lzma, os, sys
for f in sys.argv[1:]:
    p = os.path.join(".device-bin", f)
    with open(p, "rb") as src, lzma.open(p + ".xz", "wb") as dst:
        dst.write(src.read())
    os.remove(p)
PY
ls -la .device-bin
