"""Held-out acceptance of the embedded default pair per drafter, temperature and verification method.

Acceptance does not depend on the hardware, so this runs anywhere (tok/s printed beside it is only
meaningful on an otherwise idle machine). Draft length is fixed (adaptive off) so that every
position is measured. Requests stop at the end-of-text token, as a user's do (and as the drafters'
early stopping measures them); `--ignore-eos` drafts on past it, over text no user would be shown.

    python benchmarks/acceptance.py --out acceptance.json
    python benchmarks/acceptance.py --drafters dflash --dflash out/flagship/dflash-l4 --temperatures 0   # a candidate
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from blockspec import LLM, SamplingParams
from blockspec.demo import ASSETS, heldout_prompts

METHODS = [("greedy", "standard"), ("probabilistic", "standard"), ("probabilistic", "block")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--temperatures", default="0,0.7,1.0")
    ap.add_argument("--ignore-eos", action="store_true", help="decode max-tokens whatever the target emits")
    ap.add_argument("--out", default=None)
    ap.add_argument("--drafters", default="dflash,dspark", help="which drafters to measure")
    for drafter in ("dflash", "dspark"):
        ap.add_argument(f"--{drafter}", type=Path, default=ASSETS / drafter,
                        help=f"the {drafter} drafter measured (default: the shipped one)")
    args = ap.parse_args()
    prompts = heldout_prompts(args.prompts)
    rows = []
    for drafter in args.drafters.split(","):
        for draft_method, rule in METHODS:
            spec = {"method": drafter, "model": str(getattr(args, drafter)), "adaptive_draft_length": False,
                    "draft_sample_method": draft_method, "rejection_sample_method": rule}
            llm = LLM(str(ASSETS / "target"), device="cpu", speculative_config=spec, seed=0)
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
                row = {"drafter": drafter, "model": str(getattr(args, drafter)), "draft_sample_method": draft_method, "rejection_sample_method": rule,
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
