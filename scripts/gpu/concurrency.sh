#!/usr/bin/env bash
# The serving workload at some concurrencies, with the fixed-K sweep beside the draft-length policy:
#   BATCHES=16 KS=8,15 REPEATS=2 T=330 [EXTRA=--trace-policy] [NAME=bench_c16] [SPEC='{"draft_length_candidates":
#   [1, 3, 5, 7]}'] [METHODS=plain,dflash] bash scripts/gpu/concurrency.sh
# T bounds the bench (seconds) so the call returns what it has; the rounds' lines are in NAME.log either way.
# The preset sends 4 x c requests a point (4 waves, finished slots refilled): c = 16 with three methods and 3
# rounds took about 4 minutes, a K sweep adds two engines a method; EXTRA=--waves 1 times static batches instead.
# returns: NAME.log, NAME/{bench.json, bench.md, policy_trace.json.gz}
source scripts/gpu/env.sh
device_info
name=${NAME:-bench_c${BATCHES//,/_}}
timeout "${T:-540}" python3 -m blockspec bench --preset concurrency --batch-sizes "${BATCHES:?comma list}" \
  --k-sweep "${KS:-8,15}" --repeats "${REPEATS:-2}" --no-plots --out "$OUT/$name" ${EXTRA:-} \
  ${METHODS:+--methods "$METHODS"} ${SPEC:+--speculative-config "$SPEC"} \
  2>&1 | tee "$OUT/$name.log" || true
if [ -f "$OUT/$name/policy_trace.json" ]; then gzip -9 "$OUT/$name/policy_trace.json"; fi
