"""Feeding the drafter vs not, with arrivals: the embedded pair's DSpark engine, 64 requests at most 16 in
flight (a finished one's slot refilled), the policy held at K = 0; per-step wall times split into steps
with and without a prefill. python3 feed_cost2.py OUT [temperature]"""
import os, statistics, sys, time
from pathlib import Path
import torch
from blockspec.demo import default_pair, continued_prompts, heldout_prompts
from blockspec.llm import LLM
from blockspec.sampling_params import SamplingParams

DEV = os.environ.get("DEV", "cuda")
SYNC = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)
out, temp = Path(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 0.7
base, _ = default_pair()
llm = LLM(str(base / "target"), device=DEV, speculative_config={"method": "dspark", "model": str(base / "dspark")},
          seed=0, max_num_seqs=16)
engine, pol = llm.engine, llm.engine.policy
prompts = continued_prompts(llm, heldout_prompts(128), 64)
feed = {"on": True}
originals = {n: getattr(pol, n) for n in ("choose", "feeds_drafter", "parked_again")}
held = {"choose": lambda batch: 0, "feeds_drafter": lambda batch, joining=1: feed["on"],
        "parked_again": lambda batch: False}
MODES = ("feeding", "parked", "policy")
steps = []
inner = engine.step
def timed_step():
    pre = any(r.num_cached < r.prefill_len for r in engine.scheduler.running) or bool(engine.scheduler.waiting)
    t0 = time.perf_counter(); res = inner(); steps.append((pre, time.perf_counter() - t0)); return res
engine.step = timed_step
params = SamplingParams(temperature=temp, seed=0, max_tokens=int(os.environ.get("TOKENS", 256)))
def run(mode: str) -> tuple[float, list]:
    feed["on"] = mode == "feeding"
    for name in held:
        setattr(pol, name, originals[name] if mode == "policy" else held[name])
    steps.clear(); SYNC(); t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    SYNC()
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0), list(steps)
for mode in MODES:
    run(mode)
res = {m: [] for m in MODES}
for r in range(int(os.environ.get("ROUNDS", 3))):
    for mode in MODES[r % 3:] + MODES[:r % 3]:
        res[mode].append(run(mode))
lines = [f"T={temp} 64 requests, 16 in flight"]
for mode, runs in res.items():
    rates = [x for x, _ in runs]
    dec = [t * 1e3 for _, s in runs for pre, t in s if not pre]
    pre = [t * 1e3 for _, s in runs for pre, t in s if pre]
    lines.append(f"{mode}: tok/s median {statistics.median(rates):.0f} {[round(x) for x in rates]}; steps/run "
                 f"{len(runs[0][1])}; decode steps median {statistics.median(dec):.3f} ms mean {statistics.mean(dec):.3f}; "
                 f"prefill steps {len(pre) // len(runs)}/run median {statistics.median(pre):.3f} ms mean {statistics.mean(pre):.3f}, "
                 f"total {sum(pre) / len(runs):.1f} ms/run vs decode {sum(dec) / len(runs):.1f}")
text = "\n".join(lines)
print(text)
print(pol.view())
(out / "rates2.txt").write_text(text + "\n")
