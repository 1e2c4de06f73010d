source scripts/gpu/env.sh >/dev/null 2>&1; set +e
FINAL=$OUT; OUT=$OUT/w; mkdir -p $OUT
device_info > $OUT/device.txt 2>&1; head -2 $OUT/device.txt
for arm in new old new old; do
  cp .devcarry/attention_$arm.py blockspec/kernels/attention.py; n=$(ls $OUT | grep -c "^b1_$arm")
  PYTHONPATH=.:benchmarks timeout 70 python3 benchmarks/profile_step.py --methods plain,dflash --skip-eager --batch 1 --steps 20 > $OUT/b1_${arm}_$n.txt 2>&1
  echo "$arm b1: $(grep 'wall' $OUT/b1_${arm}_$n.txt | cut -c1-60 | tr '\n' ' ')"
done
cp .devcarry/attention_new.py blockspec/kernels/attention.py
tar czf $FINAL/results.tgz -C $FINAL w && rm -rf $FINAL/w
