# Longer drafter runs, call 21 (timeout_s 600): the second regenerated piece, then a fresh DFlash run of
# FLAGSHIP_EPOCHS (default 10) epochs for FLAGSHIP_MINUTES (default 8) against the shipped target
# (FLAGSHIP_LAYERS: another depth; FLAGSHIP_STATE: the state's name, default dflash-e10-state).
# carry: ["out/flagship/regen/regen-00001.u16.xz", "out/flagship/regen/regen-00001.json"]
# returns: dflash_metrics.json, dflash-e10-state/{state.json, drafter-*, trainer-*, best-*}
source scripts/flagship/common.sh
sync_in
check_pieces "$DEV/regen"
FLAGSHIP_EPOCHS=${FLAGSHIP_EPOCHS:-10} FLAGSHIP_STATE=${FLAGSHIP_STATE:-dflash-e10-state} drafter_slice dflash "${FLAGSHIP_MINUTES:-8}"
