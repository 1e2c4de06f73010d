# Session 2 (the pair shipped: blockspec/assets/default/target is the target), call 21 (timeout_s 600):
# the regenerated rows, then a fresh DFlash run of FLAGSHIP_EPOCHS (default 10) epochs, FLAGSHIP_MINUTES (default 8).
# carry: ["out/flagship/regen"]
# returns: dflash_metrics.json, dflash-e10-state/{state.json, drafter-*, trainer-*, best-*}
source scripts/flagship/common.sh
device_info
sync_in
check_pieces "$DEV/regen"
FLAGSHIP_EPOCHS=${FLAGSHIP_EPOCHS:-10} FLAGSHIP_STATE=dflash-e10-state drafter_slice dflash "${FLAGSHIP_MINUTES:-8}"
