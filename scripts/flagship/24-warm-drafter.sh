# Drafters trained on from the shipped ones, call 24 (timeout_s 600), after call 07 (or 20) in the same lease, or
# carrying the regenerated pieces: FLAGSHIP_METHODS (default dflash; "dflash dspark" runs both, one after the
# other, FLAGSHIP_MINUTES each, and should set FLAGSHIP_SHIP=run,best so the returned files stay within 8) from
# blockspec/assets/default/METHOD's weights (--init; a fresh optimiser and cosine schedule) for FLAGSHIP_EPOCHS
# (default 6) epochs within FLAGSHIP_MINUTES (default 8.5), early-stopped on held-out acceptance like any run;
# repeat the call while its metrics' "stopped" is null. The shipped drafters were still gaining at their last
# evaluations. FLAGSHIP_LAYERS above the shipped depth (2) grows the drafter: the added layers start as the
# identity.
# carry: ["out/flagship/regen"] (the pieces of call 07), unless the lease still holds them in DEV
# returns: METHOD_metrics.json, METHOD-warm-state/{state.json, the FLAGSHIP_SHIP groups}
source scripts/flagship/common.sh
sync_in
check_pieces "$DEV/regen"
for method in ${FLAGSHIP_METHODS:-dflash}; do
  FLAGSHIP_EPOCHS=${FLAGSHIP_EPOCHS:-6} FLAGSHIP_STATE=$method-warm-state \
    FLAGSHIP_INIT=blockspec/assets/default/$method drafter_slice "$method" "${FLAGSHIP_MINUTES:-8.5}"
done
