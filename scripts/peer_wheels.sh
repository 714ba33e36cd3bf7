#!/usr/bin/env bash
# The peers' wheels for the GPU machine (it reaches no package registry), in carry-sized parts.
# On the CPU machine, from the repo root:
#   bash scripts/peer_wheels.sh [SPEC ...]      (default: flashinfer-python==0.7.2.post1 and what its import needs)
# Downloads each SPEC (--no-deps: the GPU machine has torch, numpy, ninja, nvcc; the CuTe DSL, TVM-FFI and FA4 wheels
# come with .wheelhouse/b; the small pure-Python packages FlashInfer imports are listed here) and packs them as one tar split into .wheelhouse/peers/p0 (14 MB: fits beside
# .wheelhouse/a in run 1), p1, p2, ... (50 MB each, carried by later runs). Each run that carries a part first
# copies it:  mkdir -p /tmp/peer_parts && cp .wheelhouse/peers/pN/* /tmp/peer_parts/
# Once every part is there:  source scripts/peer_install.sh   (installs into /tmp/site_peers, sets PYTHONPATH).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
specs=("$@")
[ ${#specs[@]} -gt 0 ] || specs=(flashinfer-python==0.7.2.post1 requests urllib3 idna certifi charset-normalizer
                                 nvidia-ml-py einops tabulate click)
dl=.wheelhouse/peers_dl
out=.wheelhouse/peers
mkdir -p "$dl"
plat="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
for spec in "${specs[@]}"; do
  python3 -m pip download -q --no-deps $plat -d "$dl" "$spec"
done
rm -rf "$out" && mkdir -p "$out/p0"
tar cf "$out/peers.tar" -C "$dl" .
size=$(stat -c %s "$out/peers.tar")
head -c $((14 * 1024 * 1024)) "$out/peers.tar" > "$out/p0/part00"
tail -c +$((14 * 1024 * 1024 + 1)) "$out/peers.tar" | split -b 50M -d -a 2 --numeric-suffixes=1 - "$out/part"
n=1
for f in "$out"/part*; do mkdir -p "$out/p$n" && mv "$f" "$out/p$n/"; n=$((n + 1)); done
(cd "$out" && echo "$size $(sha256sum peers.tar | cut -d' ' -f1) $n" > p0/manifest)
rm "$out/peers.tar"
ls "$dl"
du -sh "$out"/p*
echo "carry .wheelhouse/peers/p0 .. p$((n - 1)), one per run (p0 fits beside .wheelhouse/a)"
