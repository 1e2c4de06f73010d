#!/usr/bin/env bash
# The tests that need CUDA (skipped on the CPU), in pieces that fit a call:
#   bash scripts/gpu/tests.sh engine    # CUDA graphs, the engine and speculation on CUDA (about 3 minutes)
#   bash scripts/gpu/tests.sh kernels   # every Triton kernel file (about 10 minutes: a call of its own)
#   bash scripts/gpu/tests.sh FILE...   # these test files whole
# returns: gpu_tests.txt, triton-cache.tar.xz
source scripts/gpu/env.sh
device_info
case "${1:-engine}" in
  engine) args=(tests/test_gpu.py tests/test_spec.py tests/test_triton_markov.py -k "markov or cuda or gpu") ;;
  kernels) args=(tests/test_triton_*.py) ;;
  *) args=("$@") ;;
esac
python3 -m pytest -q -p no:cacheprovider -rf "${args[@]}" 2>&1 | tee "$OUT/gpu_tests.txt" || true
save_triton_cache
