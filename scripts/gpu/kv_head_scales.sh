#!/usr/bin/env bash
# FP8 KV cache scales a KV head (issue #30) on the GPU, in one call of about 4 minutes: the store and attention
# kernels' GPU tests (bf16 too, bit for bit where the test asks), the graphed FP8 engines, and decode / verify
# attention over FP8 pages with a scale a layer against a scale a KV head, in the same run.
# returns: tests.log, attention.{txt,json,md}, triton-cache.tar.xz
source scripts/gpu/env.sh
set +e
device_info
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_triton_fp8.py \
  -k "per_kv_head or rope_store or fp8_cache or graphed or compile" 2>&1 | tail -15 | tee "$OUT/tests.log"
PYTHONPATH=$PYTHONPATH:benchmarks timeout 150 python3 benchmarks/bench_attention.py --batches 1 16 \
  --contexts 512 8192 --extents 0 --page-size 64 --kv-dtype fp8 --kinds decode verify --head-scales \
  --out "$OUT/attention.json" > "$OUT/attention.txt" 2>&1
save_triton_cache
