# Session 14, call D: the landed defaults (FP8 one-row MLP with GLU epilogue, edge masks) tested and re-measured.
source scripts/gpu/env.sh
device_info
set +e
git log --oneline -1 > $OUT/commit.txt 2>/dev/null
timeout 200 python3 -m pytest -q -p no:cacheprovider -rf tests/test_triton_attention.py tests/test_triton_ops.py \
  -k "attention or one_row_mlp or own_tiles or float32_layer" 2>&1 | tail -6 | tee $OUT/gpu_tests.txt
timeout 60 python3 benchmarks/profile_step.py --arch qwen3-8b --methods plain --skip-eager --quantization fp8 2>&1 \
  | grep -E "== plain: wall" | tee $OUT/fp8_step.txt
mkdir -p $OUT/c32 $OUT/fp8_c1
timeout 240 python3 -m blockspec bench --preset concurrency --batch-sizes 32 --methods plain,dflash,dspark --repeats 2 \
  --out $OUT/c32 > $OUT/c32/log.txt 2>&1; grep -E "^\| (plain|dflash|dspark)" $OUT/c32/log.txt
timeout 120 python3 -m blockspec bench --preset concurrency --batch-sizes 1 --methods plain,dflash --quantization fp8 \
  --repeats 2 --out $OUT/fp8_c1 > $OUT/fp8_c1/log.txt 2>&1; grep -E "^\| (plain|dflash)" $OUT/fp8_c1/log.txt
save_triton_cache
