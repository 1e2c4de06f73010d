# The embedded pair on the device with the bench's timed rounds frozen out of the collector's walks: batch 1 and
# 16 in flight (4 waves), the three methods in one process, two runs each; then one method a process at 16 in
# flight, as the earlier figures were taken. bash run.sh (from the repository root, on the device).
source scripts/gpu/env.sh
device_info
set +e
for i in 1 2; do
  python3 -m blockspec bench --preset default --device cuda --batch-sizes 1 --repeats 3 --no-plots --out $OUT/b1_$i \
    > $OUT/b1_$i.log 2>&1
  python3 -m blockspec bench --preset default --device cuda --batch-sizes 16 --waves 4 --repeats 5 --no-plots \
    --out $OUT/inflight_$i > $OUT/inflight_$i.log 2>&1
  for f in b1_$i inflight_$i; do echo "== $f"; grep -E "^\| (plain|dflash|dspark) \| [0-9]+ \| 0.0 \| [0-9]+ \| [0-9]" $OUT/$f/bench.md; done
done 2>&1 | tee $OUT/summary.txt
for m in plain dflash dspark; do
  python3 -m blockspec bench --preset default --device cuda --methods $m --batch-sizes 16 --waves 4 --repeats 5 \
    --no-plots --out $OUT/alone_$m > $OUT/alone_$m.log 2>&1
  echo "== alone $m"; grep -E "^\| $m \| 16 \| 0.0 \| [0-9]+ \| [0-9]" $OUT/alone_$m/bench.md
done 2>&1 | tee -a $OUT/summary.txt

# a call returns at most 8 files: one report and one log of everything
for d in $OUT/*/; do echo "### $(basename $d)"; cat $d/bench.md; done > $OUT/reports.md
for f in $OUT/*.log; do echo "### $(basename $f)"; cat $f; done > $OUT/logs.txt
rm -rf $OUT/*/ $OUT/*.log
