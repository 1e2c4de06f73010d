"""Acceptance by step index within a request: the embedded pair at batch 1 on the CPU, every step drafting the
whole block. With --prefilled N each prompt first gets its own N-token greedy continuation appended (prefilled,
so the draft context of the first step is built at prefill).
python3 first_steps.py METHOD TEMPERATURE PROMPTS [--prefilled N]"""
import argparse
import statistics

from blockspec.bench.drafts import StepLog
from blockspec.demo import continued_prompts, default_pair, heldout_prompts
from blockspec.llm import LLM
from blockspec.sampling_params import SamplingParams

ap = argparse.ArgumentParser()
ap.add_argument("method"), ap.add_argument("temperature", type=float), ap.add_argument("prompts", type=int)
ap.add_argument("--prefilled", type=int, default=0)
args = ap.parse_args()
base, _ = default_pair()
llm = LLM(str(base / "target"), device="cpu", seed=0, max_num_seqs=1, speculative_config={
    "method": args.method, "model": str(base / args.method), "adaptive_draft_length": False})
llm.engine.spec_totals = log = StepLog()
by_step: dict[int, list[int]] = {}
for prompt in continued_prompts(llm, heldout_prompts(2 * args.prompts), args.prompts):
    if args.prefilled:
        first = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=args.prefilled, use_speculation=False),
                             use_tqdm=False)[0]
        prompt = {"prompt_token_ids": list(first.prompt_token_ids) + list(first.outputs[0].token_ids)}
        log.drain()
    llm.generate([prompt], SamplingParams(temperature=args.temperature, seed=0, max_tokens=128), use_tqdm=False)
    for i, (_, accepted) in enumerate(log.drain()):
        by_step.setdefault(min(i, 12), []).append(accepted)
for i, xs in sorted(by_step.items()):
    print(i if i < 12 else "12+", len(xs), "mean accepted %.2f" % statistics.mean(xs),
          "p1 %.2f" % statistics.mean(x >= 1 for x in xs))
