# The plain step's head and sampler in a CUDA graph, before and after: GPU tests of the change, then the
# embedded pair at 16 in flight (64 requests), T = 0 and 0.7, plain and DSpark, the trees alternated.
# "before": the tree with the changed modules of the parent commit (.devcarry/s40/before).
source scripts/gpu/env.sh
device_info
set +e
timeout 110 python3 -m pytest -q -p no:cacheprovider -rf tests/test_gpu.py tests/test_sample_sampler.py \
  -k "head_graphs or graph_decode_equals or warmup_captures or (waits_for_the_device and dspark)" 2>&1 | tail -8 | tee $OUT/gpu_tests.txt
rm -rf /tmp/before && mkdir -p /tmp/before && cp -r blockspec /tmp/before/ && cp -r .devcarry/s40/before/blockspec /tmp/before/
here=$PWD
bench() {
  local arm=$1 name=$2; shift 2
  local root=$here; [ "$arm" = before ] && root=/tmp/before
  local s=$(date +%s)
  (cd $root && PYTHONPATH=$root timeout 100 python3 -m blockspec bench "$@" --no-plots --out $OUT/$name > $OUT/$name.log 2>&1)
  echo "== $name ($(( $(date +%s) - s )) s)"
  grep -E "^\| (plain|dflash|dspark) \| [0-9]+ \| 0(\.7)? \| [0-9]+ \| [0-9]" $OUT/$name/bench.md
}
i=0
{
for arm in before after; do
  bench $arm pair_${arm}_$((++i)) --preset default --device cuda --methods plain,dspark --batch-sizes 16 --waves 4 \
    --temperatures 0,0.7 --repeats 3
done
} 2>&1 | tee $OUT/ab.txt
for d in $OUT/*/; do echo "### $(basename $d)"; cat $d/bench.md; done > $OUT/reports.md
for f in $OUT/*.log; do echo "### $(basename $f)"; tail -30 $f; done > $OUT/logs.txt
rm -rf $OUT/*/ $OUT/*.log
