"""Acceptance by step index within a request (embedded pair, batch 1, CPU)."""
import sys, statistics
from blockspec.bench.drafts import StepLog
from blockspec.demo import default_pair, continued_prompts, heldout_prompts
from blockspec.llm import LLM
from blockspec.sampling_params import SamplingParams
method, temp, n = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
base, _ = default_pair()
llm = LLM(str(base / "target"), device="cpu", speculative_config={"method": method, "model": str(base / method),
          "adaptive_draft_length": False}, seed=0, max_num_seqs=1)
prompts = continued_prompts(llm, heldout_prompts(2 * n), n)
llm.engine.spec_totals = log = StepLog()
by_step = {}
for p in prompts:
    llm.generate([p], SamplingParams(temperature=temp, seed=0, max_tokens=128), use_tqdm=False)
    for i, (d, a) in enumerate(log.drain()):
        by_step.setdefault(min(i, 12), []).append(a)
for i, xs in sorted(by_step.items()):
    print(i if i < 12 else "12+", len(xs), "mean accepted %.2f" % statistics.mean(xs), "p1 %.2f" % statistics.mean(x >= 1 for x in xs))
