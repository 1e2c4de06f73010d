#!/usr/bin/env bash
# FP8 mixture-of-experts target (issues #29 and #30): random Qwen3-30B-A3B-shape weights with the experts in e4m3
# (per channel, `--quantization fp8`) against bf16, first the MoE kernels' GPU tests (the FP8 experts held to their
# dequantized reference at Qwen3-30B-A3B's shapes), then the batch-1 decode step of each (kernel breakdown, PDL),
# then plain / DFlash / DSpark in interleaved rounds at 1 and 16 requests under uniform routing:
#   bash scripts/gpu/moe_fp8.sh        (about 8 minutes with the machine's start and Triton compiling)
# returns: tests.log, step_{bf16,fp8}.txt, bench_{bf16,fp8}.log, bench_{bf16,fp8}/{bench.json, bench.md}
source scripts/gpu/env.sh
set +e
device_info
timeout 180 python3 -m pytest -q -p no:cacheprovider tests/test_triton_moe.py -k "fp8 or bf16" 2>&1 | tail -15 \
  | tee "$OUT/tests.log"
for name in bf16 fp8; do
  quant=()
  if [ "$name" = fp8 ]; then quant=(--quantization fp8); fi
  PYTHONPATH=$PYTHONPATH:benchmarks timeout 150 python3 benchmarks/profile_step.py --arch qwen3-30b-a3b --methods plain --skip-eager --steps 30 \
    "${quant[@]}" > "$OUT/step_$name.txt" 2>&1
  timeout 240 python3 -m blockspec bench --random-weights --arch qwen3-30b-a3b --moe-routing uniform "${quant[@]}" \
    --methods plain,dflash,dspark --batch-sizes 1,16 --input-len 128 --output-len 64 --synthetic-acceptance 6.5 \
    --repeats 2 --no-plots --out "$OUT/bench_$name" > "$OUT/bench_$name.log" 2>&1
done
save_triton_cache
