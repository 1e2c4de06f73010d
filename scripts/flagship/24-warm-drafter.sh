# A drafter trained on from the shipped one, call 24 (timeout_s 600), after call 20 in the same lease: the
# second regenerated piece, then FLAGSHIP_METHOD (default dflash) from blockspec/assets/default/METHOD's
# weights (--init; a fresh optimiser and cosine schedule) for FLAGSHIP_EPOCHS (default 6) epochs within
# FLAGSHIP_MINUTES (default 8.5), early-stopped on held-out acceptance like any run; repeat the call while
# its metrics' "stopped" is null. The shipped drafters were still gaining at their last evaluations.
# carry: ["out/flagship/regen/regen-00001.u16.xz", "out/flagship/regen/regen-00001.json"]
# returns: METHOD_metrics.json, METHOD-warm-state/{state.json, drafter-*, trainer-*, best-*}
source scripts/flagship/common.sh
sync_in
check_pieces "$DEV/regen"
method=${FLAGSHIP_METHOD:-dflash}
FLAGSHIP_EPOCHS=${FLAGSHIP_EPOCHS:-6} FLAGSHIP_STATE=${FLAGSHIP_STATE:-$method-warm-state} \
  FLAGSHIP_INIT=blockspec/assets/default/$method drafter_slice "$method" "${FLAGSHIP_MINUTES:-8.5}"
