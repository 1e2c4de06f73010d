# The embedded pair at T = 0, 16 in flight (64 requests, 4 waves), the three methods in one process, the bench's timed
# rounds frozen out of the collector's walks: bash inflight_t0.sh (from the repository root, on the device).
source scripts/gpu/env.sh
device_info
set +e
for i in 1 2; do
  s=$(date +%s)
  python3 -m blockspec bench --preset default --device cuda --batch-sizes 16 --waves 4 --repeats 5 --no-plots \
    --out $OUT/inflight_t0_$i > $OUT/inflight_t0_$i.log 2>&1
  echo "== inflight_t0_$i ($(( $(date +%s) - s )) s)"
  grep -E "^\| (plain|dflash|dspark) \| 16 \| 0.0 \| [0-9]+ \| [0-9]" $OUT/inflight_t0_$i/bench.md
done 2>&1 | tee $OUT/inflight_t0.txt
for d in $OUT/*/; do echo "### $(basename $d)"; cat $d/bench.md; done > $OUT/inflight_t0_reports.md
for f in $OUT/*.log; do echo "### $(basename $f)"; cat $f; done > $OUT/inflight_t0_logs.txt
rm -rf $OUT/*/ $OUT/*.log
