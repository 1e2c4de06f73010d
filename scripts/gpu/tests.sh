#!/usr/bin/env bash
# The tests that need CUDA (skipped on the CPU): the Triton kernels' files whole, and the engine's CUDA tests.
#   bash scripts/gpu/tests.sh
# returns: gpu_tests.txt
source scripts/gpu/env.sh
device_info
{ python3 -m pytest -q -p no:cacheprovider -rf tests/test_triton_*.py
  python3 -m pytest -q -p no:cacheprovider -rf tests/test_gpu.py tests/test_spec.py -k "markov or cuda or gpu"
} 2>&1 | tee "$OUT/gpu_tests.txt" || true
