# attention at small work: split or not (batch 1-32, 512-4096 keys), bf16 and fp8 pages
source scripts/gpu/env.sh >/dev/null 2>&1; set +e
device_info > $OUT/device.txt 2>&1; head -3 $OUT/device.txt
V=(default "programs 8" "programs 16" "programs 32" "programs 64" "programs 132" "merge unroll 8")
timeout 280 python3 benchmarks/bench_attention.py --page-size 64 --batches 1 4 16 32 --contexts 512 1024 4096 --extents 0 --kinds decode verify draft --rows 16 --variants "${V[@]}" --out $OUT/attn_bf16.json > $OUT/attn_bf16.log 2>&1
grep -E "best" $OUT/attn_bf16.log | cut -c1-400
timeout 150 python3 benchmarks/bench_attention.py --kv-dtype fp8 --page-size 64 --batches 1 16 --contexts 512 8192 --extents 0 --kinds decode verify --rows 16 --variants "${V[@]}" --out $OUT/attn_fp8.json > $OUT/attn_fp8.log 2>&1
grep -E "best" $OUT/attn_fp8.log | cut -c1-400
ls -la $OUT
