# DSpark on the embedded pair at T = 0.7, 16 in flight (64 requests), with the draft-length policy's trace and fixed
# K = 3 and 8 in the same rounds: where the policy drafts near break-even, what it saw and what each fixed K gives.
# bash run.sh (repository root, on the device).
source scripts/gpu/env.sh
device_info
set +e
python3 -m blockspec bench --preset default --device cuda --methods plain,dspark --batch-sizes 16 --waves 4 \
  --temperatures 0.7 --repeats 3 --k-sweep 3,8 --trace-policy --no-plots --out $OUT/run > $OUT/run.log 2>&1
grep -E "^\| (plain|dspark)" $OUT/run/bench.md | head -8
cp $OUT/run/bench.md $OUT/bench.md
python3 - "$OUT/run" "$OUT/policy_trace.json.xz" <<'PY'
import lzma, sys
from pathlib import Path
src = Path(sys.argv[1]) / "policy_trace.json"
if src.is_file():
    Path(sys.argv[2]).write_bytes(lzma.compress(src.read_bytes()))
PY
rm -rf $OUT/run
