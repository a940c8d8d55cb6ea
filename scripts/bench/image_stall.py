#!/usr/bin/env python3
"""The stall scenario with an image-bearing arrival: ../shared/bench/stall_probe.py, whose
newcomer is sent to /v1/chat/completions as one user message of its text and an image
(a `data:` PNG of SIDE x SIDE pixels, made here: gradients and noise). Every flag is the
probe's; its newcomer's first token is the first content delta of the chat stream.

    python3 scripts/bench/image_stall.py [--side 896] [--probe PATH] -- PROBE ARGS...
"""

from __future__ import annotations

import argparse
import base64
import importlib.util
import json
import random
import struct
import sys
import time
import zlib
from pathlib import Path


def png(side: int, seed: int = 7) -> bytes:
    rnd = random.Random(seed)
    raw = bytearray()
    for y in range(side):
        raw.append(0)  # filter: none
        for x in range(side):
            n = rnd.randrange(64)
            raw += bytes(((x + n) % 256, (y + n) % 256, (x + y + n) % 256))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    head = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", head) + chunk(b"IDAT", zlib.compress(bytes(raw), 6)) + chunk(b"IEND", b"")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--side", type=int, default=896, help="image side in pixels")
    ap.add_argument("--probe", default=str(Path(__file__).resolve().parents[2] / ".." / "shared" / "bench" / "stall_probe.py"))
    ours, rest = ap.parse_known_args()
    if rest[:1] == ["--"]:
        rest = rest[1:]
    spec = importlib.util.spec_from_file_location("stall_probe", ours.probe)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    url = "data:image/png;base64," + base64.b64encode(png(ours.side)).decode()

    class Stream(probe.Stream):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if self.name_ == "newcomer":
                # The 3 MB body is made now, not as it is sent: on a machine
                # the server shares, encoding it then took the server's
                # cores at the arrival being measured.
                p = dict(self.payload)
                text = p.pop("prompt")
                p["messages"] = [{"role": "user", "content": [
                    {"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]}]
                self.body = json.dumps(p).encode()

        def run(self):
            if self.name_ != "newcomer":
                return super().run()
            c = self.client.conn()
            try:
                self.t_sent = time.perf_counter()
                c.request("POST", self.client.prefix + "/v1/chat/completions", body=self.body,
                          headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
                r = c.getresponse()
                if r.status != 200:
                    self.error = f"HTTP {r.status}: {r.read()[:300]!r}"
                    return
                while line := r.readline():
                    now = time.perf_counter()
                    line = line.strip()
                    if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                        continue
                    ev = json.loads(line[5:])
                    if ev.get("usage"):
                        self.usage = ev["usage"]
                    for ch in ev.get("choices") or []:
                        self.finish_reason = ch.get("finish_reason") or self.finish_reason
                        if (ch.get("delta") or {}).get("content"):
                            self.times.append(now)
                            self.first_token.set()
            except Exception as e:  # noqa: BLE001
                self.error = repr(e)
            finally:
                self.t_done = time.perf_counter()
                self.first_token.set()
                c.close()

    probe.Stream = Stream
    sys.argv = [ours.probe] + rest
    return probe.main()


if __name__ == "__main__":
    sys.exit(main())
