# attention splits, round 2 (one-split grids compiled apart): tests, kernel A/B, engine steps A/B at 32 and 4 requests
source scripts/gpu/env.sh >/dev/null 2>&1; set +e
FINAL=$OUT; OUT=$OUT/w; mkdir -p $OUT
device_info > $OUT/device.txt 2>&1; head -3 $OUT/device.txt
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_triton_attention.py tests/test_triton_fp8.py -k "attention or store" > $OUT/gpu_tests.txt 2>&1; tail -2 $OUT/gpu_tests.txt
timeout 80 python3 benchmarks/bench_attention.py --page-size 64 --batches 1 4 16 32 --contexts 512 1024 --extents 2048 --kinds decode verify --rows 8 --baseline .devcarry/attention_old.py --out $OUT/attn_ab.json > $OUT/attn_ab.log 2>&1
grep "best" $OUT/attn_ab.log | sed 's/, pages of 64//g' | cut -c1-170
for arm in new old new old; do
  cp .devcarry/attention_$arm.py blockspec/kernels/attention.py; n=$(ls $OUT | grep -c "^b32_$arm")
  PYTHONPATH=.:benchmarks timeout 90 python3 benchmarks/profile_step.py --methods plain,dflash --skip-eager --batch 32 --k 7 --steps 20 > $OUT/b32_${arm}_$n.txt 2>&1
  echo "$arm b32: $(grep 'wall' $OUT/b32_${arm}_$n.txt | cut -c1-60 | tr '\n' ' ')"
done
for arm in new old; do
  cp .devcarry/attention_$arm.py blockspec/kernels/attention.py
  PYTHONPATH=.:benchmarks timeout 80 python3 benchmarks/profile_step.py --methods plain,dflash --skip-eager --batch 4 --steps 20 > $OUT/b4_${arm}.txt 2>&1
  echo "$arm b4: $(grep 'wall' $OUT/b4_${arm}.txt | cut -c1-60 | tr '\n' ' ')"
done
cp .devcarry/attention_new.py blockspec/kernels/attention.py
save_triton_cache 2>/dev/null
tar czf $FINAL/results.tgz -C $FINAL w && rm -rf $FINAL/w; ls -la $FINAL
