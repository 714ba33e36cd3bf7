# Source on the GPU machine after every part of a peer set was copied to /tmp/peer_parts_SET (see
# scripts/peer_wheels.sh):  source scripts/peer_install.sh [flashinfer|flashqla]
# Joins and checks the parts, installs the wheels into /tmp/site_SET once, and puts that folder on PYTHONPATH:
# after ours for flashinfer; first for flashqla (its apache-tvm-ffi 0.1.12 must shadow ours, so only its own
# process may import it). FlashInfer's JIT builds its kernels with nvcc into $FLASHINFER_WORKSPACE_BASE/.cache.
_set=${1:-flashinfer}
_parts=/tmp/peer_parts_$_set
[ "$_set" = flashinfer ] && [ ! -d "$_parts" ] && [ -d /tmp/peer_parts ] && _parts=/tmp/peer_parts
_site=/tmp/site_$_set
if [ ! -f "$_site/.complete" ]; then
  read -r _size _sum _n < "$_parts/manifest"
  cat "$_parts"/part* > /tmp/peers_$_set.tar
  if [ "$(stat -c %s /tmp/peers_$_set.tar)" != "$_size" ] || [ "$(sha256sum /tmp/peers_$_set.tar | cut -d' ' -f1)" != "$_sum" ]; then
    echo "peer_install.sh: parts of $_set missing or damaged ($(ls "$_parts" | tr '\n' ' ')); expected $_n parts" >&2
    return 3 2>/dev/null || exit 3
  fi
  mkdir -p /tmp/peer_wheels_$_set && tar xf /tmp/peers_$_set.tar -C /tmp/peer_wheels_$_set
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$_site" \
    /tmp/peer_wheels_$_set/*.whl && touch "$_site/.complete" \
    || { echo "peer_install.sh: pip install of $_set failed" >&2; return 4 2>/dev/null || exit 4; }
fi
if [ "$_set" = flashqla ]; then
  export PYTHONPATH="$_site${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$_site"
fi
export FLASHINFER_WORKSPACE_BASE=/tmp
