#!/usr/bin/env python3
"""The gaps between braid's rounds, from a `braid serve` log written with
RUST_LOG=info,braid_engine::lane::round=trace: each decoding round's call
plus the loop's own time before it. Prints the median, p99 and largest, the
chunk sizes run, the rounds around the largest gaps (where a stall goes
before the client sees it), and the arrival's rounds by chunk size, then
its summary (the last line). Usage: gaps.py SERVE.LOG"""
import re
import statistics
import sys
from collections import Counter
pat = re.compile(r'decode_rows=(\d+) chunk_rows=(\d+)(?: \w+=\S+)*? ms=([\d.]+) overhead_ms=([\d.]+)')
rows = []
# The pacer's warm-up table: (decode rows, chunk rows, fraction of a plain round added).
warm = []
for line in open(sys.argv[1], errors='replace'):
    if 'what each chunk size added' in line:
        warm = [(int(d), int(n), float(f)) for d, n, f in re.findall(r'\((\d+), (\d+), (-?[\d.]+)\)', line)]
    m = pat.search(line)
    if m:
        d, c, ms, ov = int(m[1]), int(m[2]), float(m[3]), float(m[4])
        rows.append((d, c, ms, ov))
dec = [(i, r) for i, r in enumerate(rows) if r[0] > 0]
if not dec:
    print("no rounds")
    sys.exit()
gaps = sorted(r[2] + r[3] for _, r in dec)
print(f"rounds {len(rows)} decoding {len(dec)} median {statistics.median(gaps):.3f} p99 {gaps[int(0.99*(len(gaps)-1))]:.3f} max {gaps[-1]:.3f}")
chunked = [r for r in rows if r[1] > 0]
print("chunk sizes:", sorted(Counter(r[1] for r in chunked).items()))
top = sorted(dec, key=lambda x: -(x[1][2] + x[1][3]))[:6]
for i, r in top:
    print(f"gap {r[2]+r[3]:.3f} (call {r[2]:.3f} + loop {r[3]:.3f}) round {i}: decode {r[0]} chunk {r[1]}")
    for j in range(max(0, i - 2), min(len(rows), i + 2)):
        print(f"    {j}: {rows[j]}")
# The arrival as the lane saw it: from the first round of the longest pass
# shared with decode rows to its last (the chunks of one prompt run back to
# back, so its rounds are the run of chunk rounds with the most rows), its
# largest gap over the median gap of the plain rounds before it.
runs, cur = [], []
for i, r in enumerate(rows):
    if r[0] > 0 and r[1] > 0:
        cur.append(i)
    elif r[0] > 0 and cur and i - cur[-1] > 2:
        runs.append(cur)
        cur = []
if cur:
    runs.append(cur)
if runs:
    run = max(runs, key=lambda c: sum(rows[i][1] for i in c))
    a, b = run[0], run[-1]
    during = [rows[i][2] + rows[i][3] for i in range(a, b + 1) if rows[i][0] > 0]
    before = sorted(rows[i][2] + rows[i][3] for i in range(max(0, a - 400), a) if rows[i][0] > 0 and rows[i][1] == 0)
    if before and during:
        usual = before[len(before) // 2]
        # What each chunk size's rounds took in it (the pacer's choices and
        # their costs), before the summary line.
        by_size = {}
        for i in range(a, b + 1):
            if rows[i][0] > 0:
                by_size.setdefault(rows[i][1], []).append(rows[i][2] + rows[i][3])
        print("arrival rounds by chunk rows (n, median, max ms):",
              " ".join(f"{c}:{len(v)},{statistics.median(v):.2f},{max(v):.2f}" for c, v in sorted(by_size.items())))
        # Beside it, what the warm-up told the pacer each size adds (its
        # debug line, with braid_engine::lane::pacer=debug), for the
        # arrival's count of decode rows, and what each added here.
        decode = rows[a][0]
        if warm:
            told = {n: f for d, n, f in warm if d == decode}
            print(f"chunk rows: warm-up's / this arrival's fraction added beside {decode} decode rows:",
                  " ".join(f"{n}:{f:.2f}/{statistics.median(by_size[n]) / usual - 1:.2f}" if n in by_size else f"{n}:{f:.2f}/-"
                           for n, f in sorted(told.items())))
        # The largest round's chunk, and whether it was the first of its size
        # in the pass (a size the pacer's climb tried on the warm-up's word).
        big = max((i for i in range(a, b + 1) if rows[i][0] > 0), key=lambda i: rows[i][2] + rows[i][3])
        first = all(rows[i][1] != rows[big][1] for i in range(a, big) if rows[i][0] > 0)
        print(f"largest round: {rows[big][1]} chunk rows, {'the first' if first else 'not the first'} of its size in the arrival")
        # The largest gap of as many decoding rounds just before (the quiet
        # window the probe's max_gap_before_ms reads from the client's side).
        quiet = [rows[i][2] + rows[i][3] for i in range(max(0, a - 1 - len(during)), a - 1) if rows[i][0] > 0]
        quiet_s = f", {max(quiet):.3f} in as many rounds before it" if quiet else ""
        print(f"arrival: rounds {a}-{b}, {sum(rows[i][1] for i in run)} prompt rows, largest gap {max(during):.3f} ms "
              f"over the usual {usual:.3f} (ratio {max(during) / usual:.2f}), {len(during)} rounds{quiet_s}")
