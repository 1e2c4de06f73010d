"""Held-out acceptance of the embedded default pair per drafter, temperature and verification method.

Acceptance does not depend on the hardware, so this runs anywhere (tok/s printed beside it is only
meaningful on an otherwise idle machine). Draft length is fixed (adaptive off) so that every
position is measured. Requests stop at the end-of-text token, as a user's do (and as the drafters'
early stopping measures them); `--ignore-eos` drafts on past it, over text no user would be shown.

    python benchmarks/acceptance.py --out acceptance.json
    python benchmarks/acceptance.py --drafters dflash --dflash out/flagship/dflash-l4 --temperatures 0   # a candidate
    python benchmarks/acceptance.py --target-confidence --drafters none   # how sure the target is of its own tokens
    python benchmarks/acceptance.py --target DIR --temperatures 0   # another target, e.g. `blockspec quantize`'s

`--target-confidence` adds what bounds a drafter from the target's side: the target's probability of each token of
its own greedy continuation, and its margin over the runner-up (a drafter matches a near-tie's argmax only by
reproducing the target's computation closely).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

from blockspec import LLM, SamplingParams
from blockspec.assets import PAIR
from blockspec.demo import heldout_prompts
from blockspec.models import cpu_linear
from blockspec.train.regen import repeated_line_share

METHODS = [("greedy", "standard"), ("probabilistic", "standard"), ("probabilistic", "block")]


def target_confidence(target: Path, prompts: list[str], max_tokens: int, ignore_eos: bool) -> dict:
    """The target's top-1 probability and its margin over the second, over every token of its greedy
    continuations (plain decoding, the logprobs the engine returns), and the share of their lines that repeat an
    earlier line of the same continuation (the flagship issue's measure of degenerate greedy code)."""
    llm = LLM(str(target), device="cpu", seed=0)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos,
                                                logprobs=2), use_tqdm=False)
    top, margin = [], []
    for out in outs:
        for alternatives in out.outputs[0].logprobs:
            p = sorted((math.exp(lp.logprob) for lp in alternatives.values()), reverse=True) + [0.0]
            top.append(p[0])
            margin.append(p[0] - p[1])
    return {"kind": "target_confidence", "prompts": len(prompts), "tokens": len(top),
            "top1_mean": statistics.fmean(top), "top1_median": statistics.median(top),
            "share_top1_below_0.5": sum(t < 0.5 for t in top) / len(top),
            "share_top1_above_0.95": sum(t > 0.95 for t in top) / len(top),
            "share_margin_below_0.1": sum(m < 0.1 for m in margin) / len(margin),
            "repeated_line_share": repeated_line_share([out.outputs[0].text for out in outs])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--temperatures", default="0,0.7,1.0")
    ap.add_argument("--ignore-eos", action="store_true", help="decode max-tokens whatever the target emits")
    ap.add_argument("--out", default=None)
    ap.add_argument("--drafters", default="dflash,dspark", help="which drafters to measure (none: no drafter)")
    ap.add_argument("--draft-head-fp32", action="store_true",
                    help="the drafters' LM head in float32 where the CPU would take it in bfloat16 (cpu_linear)")
    ap.add_argument("--target-confidence", action="store_true",
                    help="also report the target's confidence in its own greedy tokens")
    ap.add_argument("--target", type=Path, default=PAIR / "target",
                    help="the target measured (default: the shipped one; e.g. its FP8 twin from blockspec quantize)")
    for drafter in ("dflash", "dspark"):
        ap.add_argument(f"--{drafter}", type=Path, default=PAIR / drafter,
                        help=f"the {drafter} drafter measured (default: the shipped one)")
    args = ap.parse_args()
    cpu_linear.DRAFT_HEAD_BF16 = not args.draft_head_fp32
    prompts = heldout_prompts(args.prompts)
    rows = []
    if args.target_confidence:
        rows.append(target_confidence(args.target, prompts, args.max_tokens, args.ignore_eos))
        print(json.dumps(rows[-1]), flush=True)
    for drafter in [d for d in args.drafters.split(",") if d != "none"]:
        for draft_method, rule in METHODS:
            spec = {"method": drafter, "model": str(getattr(args, drafter)), "adaptive_draft_length": False,
                    "draft_sample_method": draft_method, "rejection_sample_method": rule}
            llm = LLM(str(args.target), device="cpu", speculative_config=spec, seed=0)
            for temp in (float(t) for t in args.temperatures.split(",")):
                if temp == 0 and draft_method != "greedy":
                    continue  # at T = 0 every method is greedy verification
                before = llm.get_stats()
                params = [SamplingParams(temperature=temp, seed=i, max_tokens=args.max_tokens,
                                         ignore_eos=args.ignore_eos)
                          for i in range(len(prompts))]
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                dt = time.perf_counter() - t0
                after = llm.get_stats()
                drafts = after["num_drafts"] - before["num_drafts"]
                accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
                per_pos = [a - (before["num_accepted_tokens_per_pos"][i]
                                if i < len(before["num_accepted_tokens_per_pos"]) else 0)
                           for i, a in enumerate(after["num_accepted_tokens_per_pos"])]
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                row = {"drafter": drafter, "target": str(args.target), "model": str(getattr(args, drafter)),
                       "draft_sample_method": draft_method,
                       "rejection_sample_method": rule, "draft_head": "fp32" if args.draft_head_fp32 else "auto",
                       "temperature": temp, "prompts": len(prompts), "ignore_eos": args.ignore_eos,
                       "tokens": tokens, "steps": drafts,
                       "mean_acceptance_length": 1 + accepted / max(drafts, 1),
                       "per_position": [round(n / max(drafts, 1), 3) for n in per_pos],
                       "tok_s_cpu": tokens / dt}
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
