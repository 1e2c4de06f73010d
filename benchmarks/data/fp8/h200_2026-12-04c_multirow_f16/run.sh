# Next session, call 3: FP8 multirow products with fp16 rows (fp8.MULTIROW_F16_ROWS, off by default) against bf16 rows:
# the four products at 144 rows (dispatch path), then DFlash over FP8 at batch 16 (the 1.52x cell), arms alternated.
source scripts/gpu/env.sh
device_info
set +e
export PYTHONPATH=$PYTHONPATH:benchmarks
for arm in off on off on; do
timeout 65 python3 - $arm <<'PY' 2>&1 | grep -E '"layer"|ARM' | tee -a $OUT/multirow_f16.txt
import sys
import blockspec.kernels.fp8 as fp8
fp8.MULTIROW_F16_ROWS = sys.argv[1] == "on"
print("ARM", sys.argv[1])
sys.argv = ["bench_fp8_gemm.py", "--rows", "144,256"]
import runpy
runpy.run_path("benchmarks/bench_fp8_gemm.py", run_name="__main__")
PY
done
for arm in off on; do
timeout 140 python3 - $arm <<'PY' >> $OUT/multirow_f16_engine.log 2>&1
import sys
import blockspec.kernels.fp8 as fp8
fp8.MULTIROW_F16_ROWS = sys.argv[1] == "on"
print("ARM", sys.argv[1], flush=True)
from blockspec.cli import main
main(["bench", "--random-weights", "--arch", "qwen3-8b", "--quantization", "fp8", "--methods", "plain,dflash,dspark",
      "--batch-sizes", "16", "--input-len", "512", "--output-len", "128", "--synthetic-acceptance", "6.5", "--repeats", "2",
      "--no-plots"])
PY
done
grep -E "^ARM|^\| (plain|dflash|dspark)" $OUT/multirow_f16_engine.log
save_triton_cache
