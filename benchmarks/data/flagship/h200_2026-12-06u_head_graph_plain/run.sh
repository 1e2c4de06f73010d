# Session 41, call 1: the GPU tests whole (the head-graph tests never passed on a GPU), the step graphs'
# device time at 16 rows, #25's bench at batch 1 and 16 in flight against the head-graphed plain step, and a
# per-step trace of plain and DSpark at 16 in flight. Returns summary.txt, raw.tar.xz, triton-cache.tar.xz.
source scripts/gpu/env.sh
R=/tmp/r; mkdir -p $R
device_info > $R/device.txt
set +e
lap() { echo "$1 $(( $(date +%s) - s )) s" >> $R/device.txt; s=$(date +%s); }
s=$(date +%s)
timeout 200 python3 -m pytest -q -p no:cacheprovider -rf --durations=8 tests/test_gpu.py > $R/gpu_tests_full.txt 2>&1
tail -25 $R/gpu_tests_full.txt > $R/gpu_tests.txt; lap tests
timeout 70 python3 benchmarks/graph_times.py --batch 16 --methods dspark,dflash --iters 30 --repeats 5 --out $R/graph_kernels > $R/graph_times_b16.txt 2>&1; lap graph_times
timeout 140 python3 -m blockspec bench --preset default --device cuda --methods plain,dflash,dspark --batch-sizes 1,16 \
  --waves 4 --temperatures 0,0.7 --repeats 3 --no-plots --out $R/bench > $R/bench.log 2>&1; lap bench
timeout 90 python3 .devcarry/s41/step_trace.py $R/trace plain,dspark 0,0.7 > $R/step_trace.log 2>&1; lap trace
for f in device.txt gpu_tests.txt graph_times_b16.txt bench/bench.md trace/step_trace.txt; do echo "##### $f"; cat $R/$f; done > $OUT/summary.txt 2>&1
tail -20 $R/bench.log $R/step_trace.log >> $OUT/summary.txt 2>&1
(cd $R && tar cJf $OUT/raw.tar.xz .)
save_triton_cache
