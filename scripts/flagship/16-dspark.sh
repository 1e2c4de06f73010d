# Session 2, call 16 (timeout_s 600): DSpark continued; repeat while dspark_metrics.json has "stopped": null.
# carry: []
# runs: a DSpark slice on DEV/regen against DEV/target from DEV/dspark-state (updated there); each evaluation
#       exports the drafter and measures greedy acceptance through the engine on held-out stdlib prompts
# returns: dspark_metrics.json (evals, best, stopped), dspark-state/{state.json, drafter-*, trainer-*, best-*}
source scripts/flagship/common.sh
sync_in
drafter_slice dspark "${FLAGSHIP_MINUTES:-8}"
