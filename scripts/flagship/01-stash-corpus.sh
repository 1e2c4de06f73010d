# Session 1, call 01 (about 2 min with the machine's start): the corpus's small files and train piece 0.
# carry: ["out/flagship/corpus/manifest.json", "out/flagship/corpus/tokenizer",
#         "out/flagship/corpus/pieces/validation-00000.u16.xz", "out/flagship/corpus/pieces/validation-00000.json",
#         "out/flagship/corpus/pieces/train-00000.u16.xz", "out/flagship/corpus/pieces/train-00000.json"]
# runs: the copy into DEV, a read-back of every piece there, the device's versions
# returns: nothing
source scripts/flagship/common.sh
device_info
sync_in
check_pieces "$DEV/corpus/pieces"
