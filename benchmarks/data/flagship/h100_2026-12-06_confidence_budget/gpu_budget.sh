# DSpark's confidence budget priced by whole steps (StepCostTable) on the embedded pair, H200: 16 in flight one
# method a process (plain / every draft / budget, twice in turn), batch 1 interleaved, and the demo both ways.
source scripts/gpu/env.sh
set +e
device_info | tee $OUT/device.txt
B="python3 -m blockspec.cli bench --preset default --device cuda --no-plots"
BUDGET='{"adaptive_verification": true}'
for r in 1 2; do
  $B --batch-sizes 16 --waves 4 --repeats 3 --methods plain --out $OUT/inflight_plain_$r > $OUT/inflight_plain_$r.log 2>&1
  $B --batch-sizes 16 --waves 4 --repeats 3 --methods dspark --out $OUT/inflight_dspark_$r > $OUT/inflight_dspark_$r.log 2>&1
  $B --batch-sizes 16 --waves 4 --repeats 3 --methods dspark --speculative-config "$BUDGET" --out $OUT/inflight_budget_$r > $OUT/inflight_budget_$r.log 2>&1
  grep -h "b16 T0.0" $OUT/inflight_*_$r.log
done
$B --batch-sizes 1 --repeats 3 --methods plain,dspark --out $OUT/b1_dspark > $OUT/b1_dspark.log 2>&1
$B --batch-sizes 1 --repeats 3 --methods plain,dspark --speculative-config "$BUDGET" --out $OUT/b1_budget > $OUT/b1_budget.log 2>&1
grep -h "b1 T0.0" $OUT/b1_*.log
python3 -m blockspec.cli demo --device cuda --no-color > $OUT/demo_budget.txt 2>&1; tail -4 $OUT/demo_budget.txt
python3 -m blockspec.cli demo --device cuda --no-color --no-adaptive-verification > $OUT/demo_every_draft.txt 2>&1; tail -4 $OUT/demo_every_draft.txt
save_triton_cache
