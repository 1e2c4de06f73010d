# Session 2, call 13 (timeout_s 600): DFlash (block 16) training, 8 minutes; evaluations every 2.5 minutes.
# carry: []
# runs: a DFlash slice on DEV/regen against DEV/target from DEV/dflash-state (updated there); each evaluation
#       exports the drafter and measures greedy acceptance through the engine on held-out stdlib prompts
# returns: dflash_metrics.json (evals, best, stopped), dflash-state/{state.json, drafter-*, trainer-*, best-*}
source scripts/flagship/common.sh
sync_in
drafter_slice dflash "${FLAGSHIP_MINUTES:-8}"
