# Session 43: A/B of decoding before an arrival's prefill while a speculative step is in flight (reorder, engine.py
# of branch decode-before-prefill) against main's order, DSpark and plain at 16 in flight, trees alternated three
# times, then a split + timeline step trace of each tree. Results to OUT as each stage ends.
source scripts/gpu/env.sh
R=/tmp/r; mkdir -p $R/ab
device_info > $R/device.txt
set +e
here=$PWD
s=$(date +%s)
lap() { echo "$1 $(( $(date +%s) - s )) s" >> $R/device.txt; s=$(date +%s); cp $R/device.txt $OUT/; }
pack() { (cd $R && tar cJf $OUT/raw.tar.xz .); }
rm -rf /tmp/reorder && mkdir -p /tmp/reorder && cp -r blockspec benchmarks /tmp/reorder/ && cp -r .devcarry/s43/reorder/blockspec /tmp/reorder/
bench() {
  local arm=$1 name=$2; local root=$here; [ "$arm" = reorder ] && root=/tmp/reorder
  (cd $root && PYTHONPATH=$root:/tmp/site timeout 60 python3 -m blockspec bench --preset default --device cuda --methods plain,dspark \
     --batch-sizes 16 --waves 4 --temperatures 0 --repeats 3 --no-plots --out $R/ab/$name > $R/ab/$name.log 2>&1)
  echo "== $name"; grep -E "^\| (plain|dflash|dspark) \| 16" $R/ab/$name/bench.md; grep -i "prefill" $R/ab/$name/bench.md | head -4; tail -2 $R/ab/$name.log
}
i=0; for arm in main reorder main reorder; do bench $arm ${arm}_$((++i)) >> $OUT/ab.txt 2>&1; lap $arm; done; pack
timeout 80 python3 benchmarks/step_trace.py --methods dspark --split --timeline --out $R/trace_main > $R/trace_main.log 2>&1; lap trace_main
cp $R/trace_main/step_trace.txt $OUT/trace_main.txt; pack
(cd /tmp/reorder && PYTHONPATH=/tmp/reorder:/tmp/site timeout 80 python3 benchmarks/step_trace.py --methods dspark --split --timeline --out $R/trace_reorder > $R/trace_reorder.log 2>&1); lap trace_reorder
cp $R/trace_reorder/step_trace.txt $OUT/trace_reorder.txt; pack
save_triton_cache
