#!/usr/bin/env bash
# FP8 mixture-of-experts target (issues #29 and #30): random Qwen3-30B-A3B-shape weights with the experts in e4m3
# against bf16, in two calls of at most 10 minutes each:
#   PART=kernels bash scripts/gpu/moe_fp8.sh   the MoE kernels' GPU tests (the FP8 experts held to their dequantized
#                                              reference at Qwen3-30B-A3B's shapes); one layer's experts
#                                              (`bench_moe.py`: bf16, e4m3 per channel and over 128 x 128 blocks,
#                                              against their bytes); the batch-1 decode step's kernels, bf16 and
#                                              `--quantization fp8` (experts per channel)
#   PART=bench bash scripts/gpu/moe_fp8.sh     plain / DFlash / DSpark in interleaved rounds at 1 and 16 requests
#                                              under uniform routing, bf16 and `--quantization fp8`
# returns: kernels: tests.log, layer_{bf16,channel,block}.{txt,json}, step_{bf16,fp8}.txt;
#          bench: bench_{bf16,fp8}.log, bench_{bf16,fp8}/{bench.json, bench.md}; both: triton-cache.tar.xz
source scripts/gpu/env.sh
set +e
device_info
quant() { if [ "$1" = fp8 ]; then echo --quantization fp8; fi; }
case "${PART:?kernels or bench}" in
  kernels)
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_triton_moe.py -k "fp8 or bf16" 2>&1 | tail -15 \
      | tee "$OUT/tests.log"
    for fp8 in "" channel block; do  # bf16, e4m3 per channel, e4m3 over 128 x 128 blocks
      PYTHONPATH=$PYTHONPATH:benchmarks timeout 80 python3 benchmarks/bench_moe.py --rows 1,4,16,64 \
        ${fp8:+--fp8 $fp8} --out "$OUT/layer_${fp8:-bf16}.json" > "$OUT/layer_${fp8:-bf16}.txt" 2>&1
    done
    for name in bf16 fp8; do
      PYTHONPATH=$PYTHONPATH:benchmarks timeout 90 python3 benchmarks/profile_step.py --arch qwen3-30b-a3b \
        --methods plain --skip-eager --steps 30 $(quant "$name") > "$OUT/step_$name.txt" 2>&1
    done ;;
  bench)
    for name in bf16 fp8; do
      timeout 270 python3 -m blockspec bench --random-weights --arch qwen3-30b-a3b --moe-routing uniform \
        $(quant "$name") --methods plain,dflash,dspark --batch-sizes 1,16 --input-len 128 --output-len 64 \
        --synthetic-acceptance 6.5 --repeats 2 --no-plots --out "$OUT/bench_$name" > "$OUT/bench_$name.log" 2>&1
    done ;;
  *) echo "PART must be kernels or bench" >&2; exit 2 ;;
esac
save_triton_cache
