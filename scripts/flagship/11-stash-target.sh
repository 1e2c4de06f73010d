# Session 2, call 11 (about 2 min with the machine's start): the target, exported locally (local.sh export-target).
# carry: ["out/flagship/target"]
# runs: the copy into DEV, a load of the target through the engine
# returns: nothing
source scripts/flagship/common.sh
device_info
sync_in
python -c "from blockspec import LLM; LLM('$DEV/target', max_num_seqs=4, enforce_eager=True); print('target loads')"
