# Sampled steps before and after 2026-12-06's change (sample-and-match accepted on the device, so a sampled step
# is launched whole before the commit; a batch that only samples skips the greedy rows' work), alternated:
# the embedded pair at T = 0.7, 16 in flight, twice a tree; then the Qwen3-8B shape at T = 0.7, synthetic
# acceptance 6.5, batch 1 and 16, once a tree. "before": the tree with the five changed modules taken from the
# parent commit (carried in .devcarry/s39/before). bash ab.sh (repository root, on the device).
source scripts/gpu/env.sh
device_info
set +e
rm -rf /tmp/before && mkdir -p /tmp/before && cp -r blockspec /tmp/before/ && cp -r .devcarry/s39/before/blockspec /tmp/before/
here=$PWD
bench() {  # bench ARM NAME ARGS...: blockspec bench from that arm's tree
  local arm=$1 name=$2; shift 2
  local root=$here; [ "$arm" = before ] && root=/tmp/before
  local s=$(date +%s)
  (cd $root && PYTHONPATH=$root:/tmp/site timeout 240 python3 -m blockspec bench "$@" --no-plots --out $OUT/$name > $OUT/$name.log 2>&1)
  echo "== $name ($(( $(date +%s) - s )) s)"
  grep -E "^\| (plain|dflash|dspark) \| [0-9]+ \| 0.7 \| [0-9]+ \| [0-9]" $OUT/$name/bench.md
}
i=0
{
for arm in before after before after; do
  bench $arm pair_${arm}_$((++i)) --preset default --device cuda --batch-sizes 16 --waves 4 --temperatures 0.7 --repeats 3
done
for arm in before after; do
  bench $arm q8b_$arm --random-weights --arch qwen3-8b --methods plain,dflash --batch-sizes 1,16 --temperatures 0.7 \
    --input-len 512 --output-len 128 --repeats 3 --synthetic-acceptance 6.5
done
} 2>&1 | tee $OUT/ab.txt
for d in $OUT/*/; do echo "### $(basename $d)"; cat $d/bench.md; done > $OUT/reports.md
for f in $OUT/*.log; do echo "### $(basename $f)"; tail -30 $f; done > $OUT/logs.txt
rm -rf $OUT/*/ $OUT/*.log
