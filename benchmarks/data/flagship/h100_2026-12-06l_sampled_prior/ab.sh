# The embedded pair at T = 0.7, 16 in flight (4 waves), plain and DFlash and DSpark in one process, the policy told
# which requests sample or not, alternated: bash ab.sh (from the repository root, on the device).
source scripts/gpu/env.sh
device_info
set +e
here=benchmarks/data/flagship/h100_2026-12-06l_sampled_prior
i=0
for arm in on off on off; do
  i=$((i + 1))
  python3 $here/bench_prior.py $arm --preset default --device cuda --batch-sizes 16 --waves 4 --temperatures 0.7 \
    --repeats 3 --no-plots --out $OUT/run${i}_$arm > $OUT/run${i}_$arm.log 2>&1
  echo "== run $i, told which requests sample: $arm"
  grep -E "^\| (plain|dflash|dspark) \| 16 \| 0.7 \| [0-9]+ \| [0-9]" $OUT/run${i}_$arm/bench.md
done 2>&1 | tee $OUT/ab.txt
for d in $OUT/*/; do echo "### $(basename $d)"; cat $d/bench.md; done > $OUT/reports.md
rm -rf $OUT/*/ $OUT/*.log
