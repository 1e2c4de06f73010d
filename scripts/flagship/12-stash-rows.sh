# Session 2, call 12 (about 0.5 min): the regenerated pieces (at most 64,000 rows of 512 tokens, about 20 MiB; if
# `local.sh carry out/flagship/regen` says they do not fit, carry half of the regen-* files in each of two calls).
# carry: ["out/flagship/regen"]
# runs: the copy into DEV and a read-back of every piece there
# returns: nothing
source scripts/flagship/common.sh
sync_in
check_pieces "$DEV/regen"
