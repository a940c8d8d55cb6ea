# Sourced by the GPU scripts on the device machine, from the repository
# root: the programs scripts/gpu/build.sh left xz-compressed in
# .device-bin/ (the device tool carries 64 MiB with the working tree),
# unpacked beside themselves.
for f in .device-bin/*.xz; do
  [ -e "$f" ] || continue
  python3 -c 'import lzma, sys; open(sys.argv[1][:-3], "wb").write(lzma.open(sys.argv[1]).read())' "$f" && chmod +x "${f%.xz}"
done
