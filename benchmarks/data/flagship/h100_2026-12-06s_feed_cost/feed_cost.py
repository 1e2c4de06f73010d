"""What feeding the drafter costs a plain step: the embedded pair's DSpark engine at 16 in flight with its
policy held at K = 0, its requests feeding the drafter or not (as in a parked batch), in alternated rounds;
then a profile of each. python3 feed_cost.py OUT [temperature]"""
import cProfile, io, pstats, statistics, sys, time
from pathlib import Path
import os
import torch
DEV = os.environ.get("DEV", "cuda")
SYNC = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)
from blockspec.demo import default_pair, continued_prompts, heldout_prompts
from blockspec.llm import LLM
from blockspec.sampling_params import SamplingParams

out, temp = Path(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 0.7
base, _ = default_pair()
llm = LLM(str(base / "target"), device=DEV, speculative_config={"method": "dspark", "model": str(base / "dspark")},
          seed=0, max_num_seqs=16)
engine, pol = llm.engine, llm.engine.policy
prompts = continued_prompts(llm, heldout_prompts(64), 16)
feed = {"on": True}
pol.choose = lambda batch: 0
pol.feeds_drafter = lambda batch, joining=1: feed["on"]
pol.parked_again = lambda batch: False
params = SamplingParams(temperature=temp, seed=0, max_tokens=int(os.environ.get("TOKENS", 256)), ignore_eos=True)
def run(mode: str) -> float:
    feed["on"] = mode == "feeding"
    SYNC(); t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    SYNC()
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)
for mode in ("feeding", "parked"):
    run(mode)
rates = {"feeding": [], "parked": []}
for r in range(int(os.environ.get("ROUNDS", 4))):
    for mode in (("feeding", "parked") if r % 2 == 0 else ("parked", "feeding")):
        rates[mode].append(run(mode))
lines = [f"T={temp} 16 prompts x 256 tokens, output tok/s per round"]
for mode, xs in rates.items():
    lines.append(f"{mode}: median {statistics.median(xs):.0f} ({min(xs):.0f}-{max(xs):.0f}) {[round(x) for x in xs]}")
for mode in ("feeding", "parked"):
    feed["on"] = mode == "feeding"
    prof = cProfile.Profile()
    prof.enable(); llm.generate(prompts, params, use_tqdm=False); SYNC(); prof.disable()
    s = io.StringIO(); pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(80)
    (out / f"cprofile_{mode}.txt").write_text(s.getvalue())
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        llm.generate(prompts, params, use_tqdm=False); SYNC()
    (out / f"torchprof_{mode}.txt").write_text(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
text = "\n".join(lines)
print(text)
(out / "rates.txt").write_text(text + "\n")
