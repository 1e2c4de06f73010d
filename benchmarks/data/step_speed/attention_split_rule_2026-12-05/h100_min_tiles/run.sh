source scripts/gpu/env.sh >/dev/null 2>&1; set +e
FINAL=$OUT; OUT=$OUT/w; mkdir -p $OUT
device_info > $OUT/device.txt 2>&1; head -3 $OUT/device.txt
for rows in 8 16; do
timeout 100 python3 benchmarks/bench_attention.py --page-size 64 --batches 1 4 16 --contexts 512 1024 4096 --extents 2048 --kinds verify --rows $rows --variants default "wide min 2" "wide min 3" --baseline .devcarry/attention_old.py --out $OUT/attn_min_r$rows.json > $OUT/attn_min_r$rows.log 2>&1
grep "best" $OUT/attn_min_r$rows.log | sed 's/, pages of 64//g; s/, one page a slot [0-9.]*//g' | cut -c1-170
done
tar czf $FINAL/results.tgz -C $FINAL w && rm -rf $FINAL/w
