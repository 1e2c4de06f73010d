# Fallback, in a new lease: carry a state back (weights and run; the moments' parts too for an exact resume),
# a call's worth at a time (local.sh carry PATHS says what fits), then call the stage's script again.
# carry: ["out/flagship/STATE/state.json", "out/flagship/STATE/<shards of this call>", ...]
# runs: the copy into DEV (nothing there is replaced: DEV is empty in a new lease)
# returns: nothing
source scripts/flagship/common.sh
sync_in
