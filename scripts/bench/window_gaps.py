#!/usr/bin/env python3
"""The background streams' largest gap over a window, from stall_probe.py's
--dump: the arrival's window (sent to the newcomer's first token, or to the
streams' end if they ended first) and, as a control, the quiet stretch
after the newcomer's first token, where nothing arrives: the largest gap
there, over as many seconds as the longest arrival window of the dumps
given (or all of it if shorter), is what the machine and the server do
alone (a text arrival's dump beside an image arrival's: the image's
window without the image). Both against the
probe's baseline (the median gap before the arrival).

    window_gaps.py DUMP.json [DUMP.json ...]"""
import json
import statistics
import sys



def background(d):
    """The background streams' token times, their last, and where the
    arrival's window ends (the newcomer's first token, or that last)."""
    bg = [ts for name, ts in d["streams"].items() if name != "newcomer" and ts]
    end = max(ts[-1] for ts in bg)
    return bg, end, min(d["t_newcomer_first"] or end, end)


dumps = [(path, json.load(open(path))) for path in sys.argv[1:]]
longest = max(background(d)[2] - d["t_arrival"] for _, d in dumps)
for path, d in dumps:
    t_arr, t_first = d["t_arrival"], d["t_newcomer_first"]
    bg, end, w_end = background(d)
    base = statistics.median([(b - a) * 1e3 for ts in bg for a, b in zip(ts, ts[1:]) if b <= t_arr])

    def largest(lo, hi):
        gaps = [(b - a) * 1e3 for ts in bg for a, b in zip(ts, ts[1:]) if b > lo and a < hi]
        return (max(gaps), sorted(gaps)[int(0.99 * (len(gaps) - 1))], len(gaps)) if gaps else (None, None, 0)

    arr = largest(t_arr, w_end)
    print(f"{path}: baseline median {base:.2f} ms; arrival window {w_end - t_arr:.1f} s: largest {arr[0]:.2f} ms ({arr[0] / base:.2f}x), "
          f"p99 {arr[1]:.2f} ({arr[1] / base:.2f}x), {arr[2]} gaps")
    if t_first and t_first < end:
        q_end = min(end, t_first + longest)
        q = largest(t_first, q_end)
        if q[0] is not None:
            print(f"  after the newcomer's first token, {q_end - t_first:.1f} s, nothing arriving: "
                  f"largest {q[0]:.2f} ms ({q[0] / base:.2f}x), p99 {q[1]:.2f} ({q[1] / base:.2f}x), {q[2]} gaps")
