# Source on the GPU machine after every part of .wheelhouse/peers was copied to /tmp/peer_parts (see
# scripts/peer_wheels.sh): joins and checks them, installs the wheels into /tmp/site_peers once, adds it to
# PYTHONPATH. FlashInfer's JIT builds its kernels with nvcc into $FLASHINFER_WORKSPACE_BASE/.cache.
_peers=/tmp/site_peers
if [ ! -f "$_peers/.complete" ]; then
  read -r _size _sum _n < /tmp/peer_parts/manifest
  cat /tmp/peer_parts/part* > /tmp/peers.tar
  if [ "$(stat -c %s /tmp/peers.tar)" != "$_size" ] || [ "$(sha256sum /tmp/peers.tar | cut -d' ' -f1)" != "$_sum" ]; then
    echo "peer_install.sh: parts missing or damaged ($(ls /tmp/peer_parts | tr '\n' ' ')); expected $_n parts" >&2
    return 3 2>/dev/null || exit 3
  fi
  mkdir -p /tmp/peer_wheels && tar xf /tmp/peers.tar -C /tmp/peer_wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$_peers" /tmp/peer_wheels/*.whl \
    && touch "$_peers/.complete" || { echo "peer_install.sh: pip install failed" >&2; return 4 2>/dev/null || exit 4; }
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$_peers"
export FLASHINFER_WORKSPACE_BASE=/tmp
