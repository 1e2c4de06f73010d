# GPU tests of the engine after c28fbfe, then DSpark's budget at batch 1 with step prices learned under
# asynchronous scheduling, beside every draft, and the demo with the budget forced on.
bash scripts/gpu/tests.sh engine > /dev/null 2>&1
tail -3 $OUT/gpu_tests.txt
source scripts/gpu/env.sh
set +e
B="python3 -m blockspec.cli bench --preset default --device cuda --no-plots"
$B --batch-sizes 1 --repeats 3 --methods plain,dspark --out $OUT/b1_dspark > $OUT/b1_dspark.log 2>&1
$B --batch-sizes 1 --repeats 3 --methods plain,dspark --speculative-config '{"adaptive_verification": true}' --out $OUT/b1_budget > $OUT/b1_budget.log 2>&1
grep -h "b1 T0.0" $OUT/b1_dspark.log $OUT/b1_budget.log | cut -c1-400
python3 -m blockspec.cli demo --device cuda --no-color --adaptive-verification > $OUT/demo_budget.txt 2>&1; tail -4 $OUT/demo_budget.txt
