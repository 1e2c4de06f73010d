# Sourced at the start of every device-machine call (see scripts/gpu/README.md).
# The device machine has no package index: blockspec's dependencies it lacks (llguidance, loaded only to compile a
# grammar) travel as wheels, downloaded here into .devcarry/whl (git-ignored) and carried by name by the calls that
# need them (carry: [".devcarry/whl"]; the tracked tree takes about 47 of the 64 MiB a call may carry, in disk blocks:
# scripts/gpu/README.md).
set -euo pipefail
export PYTHONUNBUFFERED=1
: "${OUT:?run on the device machine, where OUT is set}"
WHEELS=${BLOCKSPEC_WHEELS:-.devcarry/whl}
if [ ! -d /tmp/site/llguidance ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$WHEELS"/*.whl
fi
export PYTHONPATH=$PWD:/tmp/site

# Compiled Triton kernels travel between calls and sessions, so a call spends its minutes running, not
# compiling: the cache a call saved (copied here as .devcarry/triton-cache.tar.xz and carried by name) is
# unpacked once per machine, and `save_triton_cache` packs it into OUT at the end of a call. What travels
# to the machine is at most 64 MiB with the tracked tree (about 47 MiB with the embedded pair), so the pack keeps
# the newest kernel variants that fit TRITON_CACHE_MAX_MIB (compressed one by one, default 8).
export TRITON_CACHE_DIR=/tmp/triton-cache
if [ ! -d "$TRITON_CACHE_DIR" ]; then
  mkdir -p "$TRITON_CACHE_DIR"
  if [ -f .devcarry/triton-cache.tar.xz ]; then  # a pack cut short (its call killed while saving) is skipped
    python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="data")' \
      .devcarry/triton-cache.tar.xz "$TRITON_CACHE_DIR" 2>/dev/null \
      || { rm -rf "${TRITON_CACHE_DIR:?}"/*; echo "triton cache: the pack is unreadable; kernels compile on first use" >&2; }
  fi
fi

save_triton_cache() {  # Python's lzma and tarfile: the machine need not have xz
  python3 - "$TRITON_CACHE_DIR" "$OUT/triton-cache.tar.xz" "${TRITON_CACHE_MAX_MIB:-8}" <<'PY'
import lzma, os, sys, tarfile
from pathlib import Path
root, out, budget = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3]) * 2**20
kept, packed = [], 0
for entry in sorted(root.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True):  # a kernel variant each
    size = len(lzma.compress(b"".join(f.read_bytes() for f in sorted(entry.rglob("*")) if f.is_file())))
    if packed + size <= budget:
        kept.append(entry)
        packed += size
with tarfile.open(out, "w:xz") as tar:
    for entry in kept:
        tar.add(entry, arcname=entry.name)
total = len(list(root.iterdir()))
print(f"triton cache: {len(kept)} of {total} kernel variants packed, {os.path.getsize(out) / 2**20:.1f} MiB")
PY
}

device_info() {
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
}
