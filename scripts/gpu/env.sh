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

device_info() {
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
}
