#!/usr/bin/env python3
"""The background streams' largest gap over a window, from stall_probe.py's
--dump: the arrival's window (sent to the newcomer's first token, or to the
streams' end if they ended first) and, as a control, the quiet stretch
after the newcomer's first token, where nothing arrives: the largest gap
there, over as many seconds as the arrival's window (or all of it if
shorter), is what the machine and the server do alone. Both against the
probe's baseline (the median gap before the arrival).

    window_gaps.py DUMP.json [DUMP.json ...]"""
import json
import statistics
import sys

for path in sys.argv[1:]:
    d = json.load(open(path))
    res, t_arr, t_first = d["result"], d["t_arrival"], d["t_newcomer_first"]
    bg = [ts for name, ts in d["streams"].items() if name != "newcomer" and ts]
    end = max(ts[-1] for ts in bg)
    base = statistics.median([(b - a) * 1e3 for ts in bg for a, b in zip(ts, ts[1:]) if b <= t_arr])
    w_end = min(t_first or end, end)

    def largest(lo, hi):
        gaps = [(b - a) * 1e3 for ts in bg for a, b in zip(ts, ts[1:]) if b > lo and a < hi]
        return (max(gaps), sorted(gaps)[int(0.99 * (len(gaps) - 1))], len(gaps)) if gaps else (None, None, 0)

    arr = largest(t_arr, w_end)
    print(f"{path}: baseline median {base:.2f} ms; arrival window {w_end - t_arr:.1f} s: largest {arr[0]:.2f} ms ({arr[0] / base:.2f}x), "
          f"p99 {arr[1]:.2f} ({arr[1] / base:.2f}x), {arr[2]} gaps")
    if t_first and t_first < end:
        q = largest(t_first, min(end, t_first + (w_end - t_arr)))
        if q[0] is not None:
            print(f"  after the newcomer's first token, {min(end, t_first + (w_end - t_arr)) - t_first:.1f} s, nothing arriving: "
                  f"largest {q[0]:.2f} ms ({q[0] / base:.2f}x), p99 {q[1]:.2f} ({q[1] / base:.2f}x), {q[2]} gaps")
