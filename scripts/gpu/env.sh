# Sourced at the start of every device-machine call (see scripts/gpu/README.md).
# The device machine has no package index: blockspec's dependencies it lacks (llguidance) travel as wheels,
# downloaded here into .devcarry/whl (git-ignored) and carried with the call (carry: [".devcarry"]).
set -euo pipefail
export PYTHONUNBUFFERED=1
: "${OUT:?run on the device machine, where OUT is set}"
WHEELS=${BLOCKSPEC_WHEELS:-.devcarry/whl}
if [ ! -d /tmp/site/llguidance ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$WHEELS"/*.whl
fi
export PYTHONPATH=$PWD:/tmp/site

# Compiled Triton kernels travel between calls and sessions, so a call spends its minutes running, not
# compiling: the cache a call saved (copied here as .devcarry/triton-cache.tar.xz) is unpacked once per
# machine, and `save_triton_cache` packs it into OUT at the end of a call (only what this call compiled
# when the whole cache would pass TRITON_CACHE_MAX_MIB, so the carry stays within its 64 MiB).
export TRITON_CACHE_DIR=/tmp/triton-cache
if [ ! -d "$TRITON_CACHE_DIR" ]; then
  mkdir -p "$TRITON_CACHE_DIR"
  if [ -f .devcarry/triton-cache.tar.xz ]; then
    python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="data")' \
      .devcarry/triton-cache.tar.xz "$TRITON_CACHE_DIR"
  fi
fi
touch /tmp/triton-cache.call-start

save_triton_cache() {  # Python's tarfile: the machine need not have xz
  python3 - "$TRITON_CACHE_DIR" "$OUT/triton-cache.tar.xz" "${TRITON_CACHE_MAX_MIB:-40}" <<'PY'
import os, sys, tarfile
from pathlib import Path
root, out, limit = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]) << 20
entries = list(root.iterdir())  # one folder a kernel variant
size = sum(f.stat().st_size for p in entries for f in p.rglob("*") if f.is_file())
if size > limit:  # only what this call compiled
    since = os.stat("/tmp/triton-cache.call-start").st_mtime
    entries = [p for p in entries if p.stat().st_mtime >= since]
with tarfile.open(out, "w:xz") as tar:
    for p in entries:
        tar.add(p, arcname=p.name)
print(f"triton cache: {len(entries)} entries, {size / 2**20:.1f} MiB here, {os.path.getsize(out) / 2**20:.1f} MiB packed")
PY
}

device_info() {
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
}
