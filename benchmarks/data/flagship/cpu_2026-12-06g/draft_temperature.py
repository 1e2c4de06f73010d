"""Held-out acceptance at T > 0 with the drafts sampled at a scaled temperature (probabilistic drafts, block or
standard verification): the drafts' own distribution q is any distribution the verifier is told, so the output
stays the target's; only how often drafts are accepted moves. Factor 1: drafts at the request's temperature.

    python draft_temperature.py --factors 1,0.7,0.5,0.3 --temperatures 0.7,1.0 --out draft_temperature.json
"""
import argparse
import dataclasses
import json
import time
from pathlib import Path

from blockspec.demo import default_pair, heldout_prompts
from blockspec.llm import LLM
from blockspec.sampling_params import SamplingParams


def scaled(propose_fn, factor):
    """The proposer's `propose` with its draft rows' temperatures scaled (the verify rows keep theirs)."""
    def propose(reqs, budgets, last_tokens=None, draft_params=None):
        if draft_params is not None:
            draft_params = dataclasses.replace(draft_params, temperature=draft_params.temperature * factor)
        return propose_fn(reqs, budgets, last_tokens, draft_params)
    return propose


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--factors", default="1,0.7,0.5,0.3")
    ap.add_argument("--temperatures", default="0.7")
    ap.add_argument("--drafters", default="dflash,dspark")
    ap.add_argument("--rule", default="block")
    ap.add_argument("--out")
    args = ap.parse_args()
    base, _ = default_pair()
    prompts = heldout_prompts(args.prompts)
    rows = []
    for drafter in args.drafters.split(","):
        spec = {"method": drafter, "model": str(base / drafter), "adaptive_draft_length": False,
                "draft_sample_method": "probabilistic", "rejection_sample_method": args.rule}
        llm = LLM(str(base / "target"), device="cpu", speculative_config=spec, seed=0)
        proposer = llm.engine.proposer
        original = proposer.propose
        for temp in (float(t) for t in args.temperatures.split(",")):
            for factor in (float(f) for f in args.factors.split(",")):
                proposer.propose = original if factor == 1 else scaled(original, factor)
                before = llm.get_stats()
                params = [SamplingParams(temperature=temp, seed=i, max_tokens=args.max_tokens) for i in range(len(prompts))]
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                dt = time.perf_counter() - t0
                after = llm.get_stats()
                drafts = after["num_drafts"] - before["num_drafts"]
                accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                row = {"drafter": drafter, "rule": args.rule, "temperature": temp, "draft_temperature_factor": factor,
                       "tokens": tokens, "steps": drafts, "mean_acceptance_length": round(1 + accepted / max(drafts, 1), 3),
                       "tok_s_cpu": round(tokens / dt, 1)}
                rows.append(row)
                print(json.dumps(row), flush=True)
        proposer.propose = original
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
