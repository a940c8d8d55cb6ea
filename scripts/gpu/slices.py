#!/usr/bin/env python3
"""Carry a file past the device tool's 64 MiB limit: in slices, one a call.

The GPU machine keeps what a call left (its home folder, ignored paths)
while it stays warm, so a file can be rebuilt there over back-to-back
calls, each carrying one slice in a git-ignored folder:

  here:   scripts/gpu/slices.py split FILE OUT [--mb 60]
          (OUT/NAME.000, .001, ... and OUT/NAME.sha256)
  a call: cp OUT/NAME.003 .slice/  (only that slice), carry [".slice"],
          run `scripts/gpu/slices.py add .slice .joined/NAME` (DEST in an
          ignored folder that is not carried: a carried one is replaced)
  last:   the call with NAME.sha256 in .slice: `add` checks the whole file.

`add` appends a slice only if it is the next one DEST lacks (a repeated
or skipped call is refused, not joined twice), and with the checksum it
verifies DEST and reports its size; a mismatch removes DEST.

The 64 MiB covers the whole working tree that travels, tracked files
included (~42 MB at stop 47, mostly testdata/fixtures), so the default
60 MiB slice does not fit beside it: pass --mb for what is left (~20).
"""
import argparse
import hashlib
import os
import sys


def split(path, out, mb):
    os.makedirs(out, exist_ok=True)
    name, size, h = os.path.basename(path), mb << 20, hashlib.sha256()
    with open(path, "rb") as f:
        i = 0
        while chunk := f.read(size):
            h.update(chunk)
            with open(os.path.join(out, f"{name}.{i:03d}"), "wb") as o:
                o.write(chunk)
            i += 1
    with open(os.path.join(out, f"{name}.sha256"), "w") as o:
        o.write(f"{h.hexdigest()} {os.path.getsize(path)} {i}\n")
    print(f"{name}: {i} slices of at most {mb} MiB in {out}")


def add(folder, dest):
    os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
    done = dest + ".slices"
    have = int(open(done).read()) if os.path.exists(done) else 0
    for entry in sorted(os.listdir(folder)):
        path = os.path.join(folder, entry)
        stem, ext = entry.rsplit(".", 1)
        if ext == "sha256":
            want, size, count = open(path).read().split()
            if have != int(count):
                sys.exit(f"{dest}: {have} of {count} slices joined; the checksum waits for the rest")
            got = hashlib.sha256(open(dest, "rb").read()).hexdigest()
            if got != want or os.path.getsize(dest) != int(size):
                os.remove(dest)
                os.remove(done)
                sys.exit(f"{dest}: checksum {got} is not {want}: removed")
            print(f"{dest}: {size} bytes, sha256 {want[:16]}... as split")
            continue
        if int(ext) != have:
            sys.exit(f"{entry}: slice {int(ext)}, but {dest} holds {have} slices (the next is {have})")
        with open(dest, "ab") as o, open(path, "rb") as f:
            o.write(f.read())
        have += 1
        with open(done, "w") as o:
            o.write(str(have))
        print(f"{dest}: slice {int(ext)} of {stem} joined ({os.path.getsize(dest)} bytes)")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("split", help="cut FILE into numbered slices and a checksum in OUT")
    s.add_argument("file")
    s.add_argument("out")
    s.add_argument("--mb", type=int, default=60, help="slice size in MiB (default 60)")
    a = sub.add_parser("add", help="join the slices in FOLDER onto DEST, in order; check it with the checksum")
    a.add_argument("folder")
    a.add_argument("dest")
    args = p.parse_args()
    if args.cmd == "split":
        split(args.file, args.out, args.mb)
    else:
        add(args.folder, args.dest)


if __name__ == "__main__":
    main()
