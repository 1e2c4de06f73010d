# Session 2, call 22 (timeout_s 600; repeat while dspark_metrics.json's "stopped" is null): a DSpark run of
# FLAGSHIP_EPOCHS (default 8) epochs, FLAGSHIP_MINUTES (default 8.5) a call; 2 epochs took 124 s of steps on the H200.
# carry: []
# returns: dspark_metrics.json, dspark-e8-state/{state.json, drafter-*, trainer-*, best-*}
source scripts/flagship/common.sh
sync_in
FLAGSHIP_EPOCHS=${FLAGSHIP_EPOCHS:-8} FLAGSHIP_STATE=${FLAGSHIP_STATE:-dspark-e8-state} drafter_slice dspark "${FLAGSHIP_MINUTES:-8.5}"
