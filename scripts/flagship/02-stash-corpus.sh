# Session 1, call 02 (about 0.5 min): train piece 1.
# carry: ["out/flagship/corpus/pieces/train-00001.u16.xz",
#         "out/flagship/corpus/pieces/train-00001.json"]
# runs: the copy into DEV and a read-back of every piece there
# returns: nothing
source scripts/flagship/common.sh
sync_in
check_pieces "$DEV/corpus/pieces"
