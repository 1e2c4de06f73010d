# Session 2, call 14 (timeout_s 600): DFlash continued; repeat while dflash_metrics.json has "stopped": null.
# carry: []
# runs: a DFlash slice on DEV/regen against DEV/target from DEV/dflash-state (updated there); each evaluation
#       exports the drafter and measures greedy acceptance through the engine on held-out stdlib prompts
# returns: dflash_metrics.json (evals, best, stopped), dflash-state/{state.json, drafter-*, trainer-*, best-*}
source scripts/flagship/common.sh
sync_in
drafter_slice dflash "${FLAGSHIP_MINUTES:-8}"
