# fp32 kernels on the H200: kernel tests, per-graph device time, the default pair's bench and demo
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .devcarry/whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
timeout ${TT:-200} python -m pytest -q -p no:cacheprovider -rf -x tests/test_triton_ops.py tests/test_triton_attention.py tests/test_gpu.py -k "${TK:-not spec}" > $OUT/tests.log 2>&1; echo "tests rc $?"; tail -3 $OUT/tests.log
# .devcarry/profile_kernels.py: the script that became benchmarks/graph_times.py
DTYPES=float32 timeout 120 python .devcarry/profile_kernels.py > $OUT/graphs.txt 2>&1; grep device $OUT/graphs.txt
timeout 200 python -m blockspec bench --preset default --device cuda --batch-sizes 1,16 --repeats 5 --no-plots --out $OUT/bench > $OUT/bench.log 2>&1
grep -E "^\| (plain|dflash|dspark) |^- d.*K=|^- (dflash|dspark)|plain decode" $OUT/bench/bench.md | cut -c1-400
for m in dspark dflash; do timeout 80 python -m blockspec demo --device cuda --method $m --no-color > $OUT/demo_$m.txt 2>&1; tail -2 $OUT/demo_$m.txt; done
