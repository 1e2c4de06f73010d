"""Where the host's time goes in a step of the embedded pair on a GPU, greedy and sampled: 64 requests, 16 in flight,
256 tokens each, plain and DFlash (policy on), each mode once to warm up, then once under cProfile and once timed with
the profiler off. python host_profile.py OUTDIR"""
import cProfile
import pstats
import sys
import time
from pathlib import Path

from blockspec.assets import PAIR
from blockspec.demo import heldout_prompts
from blockspec.llm import LLM
from blockspec.sampling_params import SamplingParams

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
prompts = heldout_prompts(64)
engines = {
    "plain": LLM(str(PAIR / "target"), device="cuda", seed=0, max_num_seqs=16),
    "dflash": LLM(str(PAIR / "target"), device="cuda", seed=0, max_num_seqs=16,
                  speculative_config={"method": "dflash", "model": str(PAIR / "dflash")}),
}
summary = []
for name, llm in engines.items():
    for temp in (0.0, 0.7):
        params = [SamplingParams(temperature=temp, max_tokens=256, ignore_eos=True, seed=i) for i in range(len(prompts))]
        llm.generate(prompts, params, use_tqdm=False)  # warm-up (graph captures, compiles)
        engine = llm.engine
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        prof = cProfile.Profile()
        prof.enable()
        llm.generate(prompts, params, use_tqdm=False)
        prof.disable()
        tag = f"{name}_t{temp}"
        with open(out / f"{tag}.txt", "w") as f:
            st = pstats.Stats(prof, stream=f)
            st.sort_stats("tottime").print_stats(45)
            st.sort_stats("cumulative").print_stats(70)
        line = f"{tag}: {64 * 256} tokens in {wall:.3f} s = {64 * 256 / wall:.0f} tok/s"
        print(line, flush=True)
        summary.append(line)
(out / "summary.txt").write_text("\n".join(summary) + "\n")
