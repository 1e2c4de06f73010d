#!/usr/bin/env bash
# Speculation over an FP8 target with the drafters in bf16 and in FP8 (issue #30: measure both): random
# Qwen3-8B-shape weights, per-channel FP8 target, synthetic acceptance 6.5, plain / DFlash / DSpark in
# interleaved rounds, one run per drafter precision (compare each run's ratios to its own plain rounds):
#   BATCHES=1,16 REPEATS=2 bash scripts/gpu/fp8_drafter.sh      (about 5 minutes with the machine's start)
# returns: drafter_bf16.log, drafter_fp8.log, drafter_{bf16,fp8}/{bench.json, bench.md}
source scripts/gpu/env.sh
device_info
for precision in bf16 fp8; do
  spec='{}'
  if [ "$precision" = fp8 ]; then spec='{"quantization": "fp8"}'; fi
  timeout 270 python3 -m blockspec bench --random-weights --arch qwen3-8b --quantization fp8 --temperatures 0 \
    --methods plain,dflash,dspark --batch-sizes "${BATCHES:-1,16}" --input-len 512 --output-len 128 \
    --synthetic-acceptance 6.5 --repeats "${REPEATS:-2}" --speculative-config "$spec" --no-plots \
    --out "$OUT/drafter_$precision" 2>&1 | tee "$OUT/drafter_$precision.log" || true
done
