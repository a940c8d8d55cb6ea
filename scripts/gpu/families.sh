#!/usr/bin/env bash
# Per-family figures on the GPU: for each family braid serves, a model of a
# real checkpoint's shape with random weights (family_models.py, made by
# transformers on the GPU), then `braid bench` on it through the serving
# path, then its folder is removed (the disk holds one at a time). Ends with
# a table: GB one decode step reads, decode tok/s of one stream and its
# share of the HBM bound, 8 streams' aggregate, a 512-token prefill.
#
#   scripts/gpu/families.sh BRAID OUT [FAMILY,...]     (on the device)
#   DEVICE=cpu scripts/gpu/families.sh ...   tiny shapes on the CPU: checks the script
set -uo pipefail
cd "$(dirname "$0")/../.."
braid=$1 out=$2 only=${3:-}
mkdir -p "$out"
models=${FAMILY_MODELS:-$HOME/family-models}
dev=${DEVICE:-cuda}
make=(--device "$dev")
[ "$dev" = cpu ] && make+=(--tiny)
names=${only:-$(python3 -c 'import sys; sys.path.insert(0, "scripts/gpu"); import family_models as f; print(",".join(f.FAMILIES))')}
for name in ${names//,/ }; do
  python3 scripts/gpu/family_models.py "$models" --only "$name" "${make[@]}" 2> "$out/make-$name.log" | tee -a "$out/models.jsonl"
  [ -d "$models/$name" ] || continue
  timeout 200 "$braid" bench --device "$dev" -m "$models/$name" --pp 512 --tg 128 -r 3 --streams 8 --json \
    > "$out/bench-$name.json" 2> "$out/bench-$name.log" || tail -n 5 "$out/bench-$name.log"
  rm -rf "${models:?}/$name"
done
python3 - "$out" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
HBM = 4.8e12  # the H200's HBM3e, bytes/s
print("| family | params (B) | GB read per decode step | decode tok/s, 1 stream | of the HBM bound | 8 streams, aggregate | pp512 tok/s |")
print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
for line in (out / "models.jsonl").read_text().splitlines():
    m = json.loads(line)
    f = out / f"bench-{m['family']}.json"
    if "error" in m or not f.exists() or not f.read_text().strip():
        print(f"| {m['family']} | {m.get('error', 'bench failed')[:80]} |")
        continue
    r = {x["test"]: x["tokens_per_s"]["median"] for x in json.loads(f.read_text())["results"]}
    tg, x8, pp = r.get("tg128", 0), r.get("decode x8 streams (aggregate)", 0), r.get("pp512", 0)
    gb = m["decode_bytes"] / 1e9
    print(f"| {m['family']} | {m['params'] / 1e9:.2f} | {gb:.2f} | {tg:,.0f} | {tg * m['decode_bytes'] / HBM:.0%} | {x8:,.0f} | {pp:,.0f} |")
PY
