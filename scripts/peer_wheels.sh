#!/usr/bin/env bash
# The peers' wheels for the GPU machine (it reaches no package registry), in carry-sized parts.
# On the CPU machine, from the repo root:
#   bash scripts/peer_wheels.sh [flashinfer|flashqla] [SPEC ...]
# flashinfer (default): flashinfer-python 0.7.2.post1 and the small pure-Python packages its import needs (the
#   GPU machine has torch, numpy, ninja, nvcc; the CuTe DSL, TVM-FFI and FA4 wheels come with .wheelhouse/b).
#   Parts in .wheelhouse/peers: p0 (14 MB: fits beside .wheelhouse/a in run 1), p1, ... (50 MB each).
# flashqla: flash-qla 0.1.3 with tilelang 0.1.15, z3-solver and apache-tvm-ffi 0.1.12 (tilelang pins
#   apache-tvm-ffi < 0.1.13, older than ours): parts in .wheelhouse/peers_flashqla (50 MB each), installed into a
#   folder of its own and imported only by its own process (`benchmarks.sweep --no-ours --peers flashqla`).
# --no-deps throughout. Each run that carries a part first copies it:
#   mkdir -p /tmp/peer_parts_SET && cp .wheelhouse/peers[_flashqla]/pN/* /tmp/peer_parts_SET/
# Once every part is there:  source scripts/peer_install.sh SET   (installs, sets PYTHONPATH).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
set_name=flashinfer
case "${1:-}" in flashinfer|flashqla) set_name=$1; shift ;; esac
specs=("$@")
if [ ${#specs[@]} -eq 0 ]; then
  if [ "$set_name" = flashinfer ]; then
    specs=(flashinfer-python==0.7.2.post1 requests urllib3 idna certifi charset-normalizer nvidia-ml-py einops
           tabulate click)
  else
    specs=(flash-qla==0.1.3 tilelang==0.1.15 z3-solver==4.15.4.0 apache-tvm-ffi==0.1.12 ml-dtypes psutil
           cloudpickle)
  fi
fi
if [ "$set_name" = flashinfer ]; then out=.wheelhouse/peers first=14; else out=.wheelhouse/peers_flashqla first=50; fi
dl=${out}_dl
mkdir -p "$dl"
plat="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
for spec in "${specs[@]}"; do
  python3 -m pip download -q --no-deps $plat -d "$dl" "$spec"
done
rm -rf "$out" && mkdir -p "$out/p0"
tar cf "$out/peers.tar" -C "$dl" .
size=$(stat -c %s "$out/peers.tar")
head -c $((first * 1024 * 1024)) "$out/peers.tar" > "$out/p0/part00"
tail -c +$((first * 1024 * 1024 + 1)) "$out/peers.tar" | split -b 50M -d -a 2 --numeric-suffixes=1 - "$out/part"
n=1
for f in "$out"/part*; do [ -e "$f" ] || continue; mkdir -p "$out/p$n" && mv "$f" "$out/p$n/"; n=$((n + 1)); done
(cd "$out" && echo "$size $(sha256sum peers.tar | cut -d' ' -f1) $n" > p0/manifest)
rm "$out/peers.tar"
ls "$dl"
du -sh "$out"/p*
echo "carry $out/p0 .. p$((n - 1)), one per run"
