# Session 2, call 23 (timeout_s 600): the shipped pair on the H200: the demo and the bench preset at batch 1 and 16.
# carry: []
# returns: demo_dspark.txt, demo_dflash.txt, bench/ (the bench report)
source scripts/flagship/common.sh
device_info
for m in dspark dflash; do python -m blockspec demo --device cuda --method "$m" --no-color 2>&1 | tail -8 | tee "$OUT/demo_$m.txt"; done
python -m blockspec bench --preset default --device cuda --batch-sizes 1,16 --repeats 5 --out "$OUT/bench" 2>&1 | tail -30
