# The embedded pair's bench, 16 in flight (4 waves), all three methods in one process, the collector frozen over
# the timed rounds or not, alternated: bash ab.sh (from the repository root, on the device).
source scripts/gpu/env.sh
set +e
here=benchmarks/data/flagship/h100_2026-12-06b_coresident
i=0
for arm in on off on off; do
  i=$((i + 1))
  python3 $here/bench_freeze.py $arm --preset default --device cuda --batch-sizes 16 --waves 4 --repeats 3 --no-plots \
    --out $OUT/run${i}_$arm > $OUT/run${i}_$arm.log 2>&1
  echo "== run $i, collector frozen: $arm"; grep -E "^\| (plain|dflash|dspark) " $OUT/run${i}_$arm/bench.md
done 2>&1 | tee $OUT/ab.txt
