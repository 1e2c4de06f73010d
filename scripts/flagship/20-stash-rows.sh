# Longer drafter runs, call 20 (about 2 min with the machine's start): the first regenerated piece (with the
# shipped pair the tree takes 46 MiB of disk blocks, so the two pieces travel in two calls).
# carry: ["out/flagship/regen/regen-00000.u16.xz", "out/flagship/regen/regen-00000.json"]
# runs: the copy into DEV, a read-back of the piece, the device's versions
# returns: nothing
source scripts/flagship/common.sh
device_info
sync_in
check_pieces "$DEV/regen"
