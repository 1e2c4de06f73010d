# bash run.sh (from the repository root, on the device): host_profile.py, reports concatenated (a call returns 8 files).
source scripts/gpu/env.sh
device_info
set +e
here=benchmarks/data/flagship/h100_2026-12-06m_sampled_host
python3 $here/host_profile.py $OUT/prof 2>&1 | tail -20
for f in $OUT/prof/*.txt; do echo "### $(basename $f)"; cat $f; done > $OUT/profiles.txt
rm -rf $OUT/prof
