# attention splits: kernel A/B (bench_attention vs the old module), GPU tests, engine steps A/B (new, old, new, old)
source scripts/gpu/env.sh >/dev/null 2>&1; set +e
FINAL=$OUT; OUT=$OUT/w; mkdir -p $OUT
device_info > $OUT/device.txt 2>&1; head -3 $OUT/device.txt
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_triton_attention.py tests/test_triton_fp8.py tests/test_dependent_launch.py -x > $OUT/gpu_tests.txt 2>&1; tail -2 $OUT/gpu_tests.txt
timeout 120 python3 benchmarks/bench_attention.py --page-size 64 --batches 1 4 16 32 --contexts 512 1024 4096 --extents 0 2048 --kinds decode verify --rows 16 --baseline .devcarry/attention_old.py --out $OUT/attn_ab.json > $OUT/attn_ab.log 2>&1
grep "best" $OUT/attn_ab.log | sed 's/, pages of 64//g' | cut -c1-170
timeout 60 python3 benchmarks/bench_attention.py --kv-dtype fp8 --page-size 64 --batches 1 16 --contexts 512 8192 --extents 0 --kinds decode verify --rows 16 --out $OUT/attn_fp8.json > $OUT/attn_fp8.log 2>&1
grep "best" $OUT/attn_fp8.log | cut -c1-130
for arm in new old new old; do
  cp .devcarry/attention_$arm.py blockspec/kernels/attention.py; n=$(ls $OUT | grep -c "^b16_$arm")
  PYTHONPATH=.:benchmarks timeout 90 python3 benchmarks/profile_step.py --methods plain,dflash --skip-eager --batch 16 --k 7 --steps 20 > $OUT/b16_${arm}_$n.txt 2>&1
  PYTHONPATH=.:benchmarks timeout 60 python3 benchmarks/profile_step.py --methods plain --skip-eager --steps 20 > $OUT/b1_${arm}_$n.txt 2>&1
  echo "$arm b16: $(grep 'wall' $OUT/b16_${arm}_$n.txt | cut -c1-60 | tr '\n' ' ')"
  echo "$arm b1: $(grep 'wall' $OUT/b1_${arm}_$n.txt | cut -c1-60)"
done
for arm in new old; do
  cp .devcarry/attention_$arm.py blockspec/kernels/attention.py
  PYTHONPATH=.:benchmarks timeout 80 python3 benchmarks/profile_step.py --arch qwen3-30b-a3b --methods plain --skip-eager --steps 20 > $OUT/moe_${arm}.txt 2>&1
  echo "$arm moe: $(grep 'wall' $OUT/moe_${arm}.txt | cut -c1-60)"
done
cp .devcarry/attention_new.py blockspec/kernels/attention.py
save_triton_cache 2>/dev/null
tar czf $FINAL/results.tgz -C $FINAL w && rm -rf $FINAL/w; ls -la $FINAL
