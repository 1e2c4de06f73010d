# Session 1, call 08 (timeout_s 600): regeneration continued; repeat while total_generated_tokens < 20,000,000.
# carry: []
# runs: greedy and T = 0.7 continuations (448 tokens) of the prompts, batch 512, from the next prompt on
# returns: regen/{regen-NNNNN.u16.xz, regen-NNNNN.json (16384 rows of 512 tokens a piece), regen_state.json,
#          regen_metrics.json (generated_tokens_per_s, total_generated_tokens, greedy repeated-line share)}
source scripts/flagship/common.sh
sync_in
regen_slice "${FLAGSHIP_MINUTES:-8}"
