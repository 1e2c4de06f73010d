# Call 23 (timeout_s 600): the shipped pair on the H200: the demo of both drafters and the bench preset at
# batch 1 and 16. A demo whose outputs differ from plain decoding exits 1: the call records that and goes on.
# carry: nothing
# returns: demo_dspark.txt, demo_dflash.txt, bench/ (the bench report)
source scripts/flagship/common.sh
device_info
for m in dspark dflash; do
  rc=0
  python -m blockspec demo --device cuda --method "$m" --no-color > "$OUT/demo_$m.txt" 2>&1 || rc=$?
  echo "demo $m: exit $rc" >> "$OUT/demo_$m.txt"
  tail -8 "$OUT/demo_$m.txt"
done
python -m blockspec bench --preset default --device cuda --batch-sizes 1,16 --repeats 5 --out "$OUT/bench" 2>&1 | tail -30
