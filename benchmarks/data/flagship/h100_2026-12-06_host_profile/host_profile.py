"""Where the host's time goes for the embedded pair with 16 requests in flight on a GPU: plain and each method,
64 held-out prompts x 256 tokens, cProfile over one timed pass after a warm pass."""
import cProfile
import os
import pstats
import sys
import time

from blockspec.demo import continued_prompts, default_pair, heldout_prompts
from blockspec.llm import LLM
from blockspec.sampling_params import SamplingParams

out = os.environ["OUT"]
base, _ = default_pair()
for method in sys.argv[1:]:
    spec = None if method == "plain" else {"method": method, "model": str(base / method)}
    llm = LLM(str(base / "target"), device="cuda", dtype="float32", speculative_config=spec, seed=0, max_num_seqs=16)
    prompts = continued_prompts(llm, heldout_prompts(128), 64)
    params = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    t0 = time.perf_counter()
    done = llm.generate(prompts, params, use_tqdm=False)
    plain_s = time.perf_counter() - t0
    pr = cProfile.Profile()
    pr.enable()
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    prof_s = time.perf_counter() - t0
    pr.disable()
    tokens = sum(len(o.outputs[0].token_ids) for o in done)
    steps = llm.engine.num_steps
    with open(f"{out}/host_{method}.txt", "w") as f:
        f.write(f"{method}: {tokens} tokens, {tokens / plain_s:.1f} tok/s unprofiled, {tokens / prof_s:.1f} profiled, "
                f"engine steps so far {steps}\n")
        st = pstats.Stats(pr, stream=f)
        st.sort_stats("tottime").print_stats(60)
        st.sort_stats("cumulative").print_stats(80)
    print(method, tokens, round(tokens / plain_s, 1), round(tokens / prof_s, 1), flush=True)
    del llm
