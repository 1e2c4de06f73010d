# Session 1, call 07 (timeout_s 600): regeneration, 8 minutes, with the target the last target call exported.
# carry: ["out/flagship/prompts"] (or FLAGSHIP_PROMPTS=prompts-seed1 and that folder: `flagship prompts --seed 1`)
# runs: greedy and T = 0.7 continuations (448 tokens) of the prompts, batch 512, from the next prompt on
# returns: regen/{regen-NNNNN.u16.xz, regen-NNNNN.json (16384 rows of 512 tokens a piece), regen_state.json,
#          regen_metrics.json (generated_tokens_per_s, total_generated_tokens, greedy repeated-line share)}
source scripts/flagship/common.sh
sync_in
check_pieces "$DEV/${FLAGSHIP_PROMPTS:-prompts}"
regen_slice "${FLAGSHIP_MINUTES:-8}"
