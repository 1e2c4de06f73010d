"""`blockspec demo`: speculative vs plain decoding on the embedded default model, measured in one run.

The default pair (a small Qwen3-architecture code model and its DFlash / DSpark drafters, trained on
the Python standard library) ships inside the package, so this runs offline on any machine.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

ASSETS = Path(__file__).parent / "assets" / "default"


def default_prompts(limit: int) -> list[str]:
    """Held-out prompts written by the recipe (from stdlib packages kept out of all training)."""
    path = ASSETS / "prompts.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the embedded default model is not installed")
    with open(path) as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()][:limit]


def run_demo(args: argparse.Namespace) -> int:
    from blockspec import LLM, SamplingParams
    from blockspec.cli import format_spec_metrics

    target = Path(args.target or ASSETS / "target")
    drafter = Path(args.drafter or ASSETS / args.method)
    for p in (target, drafter):
        if not p.is_dir():
            raise FileNotFoundError(f"{p} is missing: the embedded default model is not installed")
    prompts = args.prompt or default_prompts(args.num_prompts)
    spec = {"method": args.method, "model": str(drafter)}
    if args.num_speculative_tokens:
        spec["num_speculative_tokens"] = args.num_speculative_tokens
    llm = LLM(str(target), device=args.device, speculative_config=spec, max_model_len=1024, seed=0)
    base = dict(temperature=args.temperature, seed=0, max_tokens=args.max_tokens)
    plain = SamplingParams(**base, use_speculation=False)
    fast = SamplingParams(**base)
    llm.generate(prompts[:1], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up

    def timed(params: SamplingParams) -> tuple[list[Any], float]:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return outs, time.perf_counter() - t0

    before = llm.get_metrics()
    spec_outs, t_spec = timed(fast)
    after = llm.get_metrics()
    plain_outs, t_plain = timed(plain)
    n_spec = sum(len(o.outputs[0].token_ids) for o in spec_outs)
    n_plain = sum(len(o.outputs[0].token_ids) for o in plain_outs)
    same = all(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(spec_outs, plain_outs))
    delta = {k: after[k] - before.get(k, 0) for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    per_pos = [a - (before["num_accepted_tokens_per_pos"][i] if i < len(before["num_accepted_tokens_per_pos"]) else 0)
               for i, a in enumerate(after["num_accepted_tokens_per_pos"])]
    delta["num_accepted_tokens_per_pos"] = per_pos
    delta["acceptance_rate"] = delta["num_accepted_tokens"] / max(delta["num_draft_tokens"], 1)
    delta["mean_acceptance_length"] = 1 + delta["num_accepted_tokens"] / max(delta["num_drafts"], 1)
    print(f"=== prompt 1 of {len(prompts)} ===\n{prompts[0]}", end="")
    print(f"\033[1m{spec_outs[0].outputs[0].text}\033[0m" if args.color else spec_outs[0].outputs[0].text)
    print("=" * 60)
    print(f"target {target.name}, drafter {args.method} ({drafter}), device {llm.engine.device}, "
          f"temperature {args.temperature}")
    print(format_spec_metrics(delta))
    print(f"speculative: {n_spec} tokens in {t_spec:.2f} s = {n_spec / t_spec:.1f} tok/s")
    print(f"plain:       {n_plain} tokens in {t_plain:.2f} s = {n_plain / t_plain:.1f} tok/s")
    print(f"speedup {(n_spec / t_spec) / (n_plain / t_plain):.2f}x; outputs identical to plain decoding: "
          f"{'yes' if same else 'NO'}")
    return 0 if same or args.temperature > 0 else 1


def add_demo_parser(sub: Any) -> None:
    p = sub.add_parser("demo", help="speculative vs plain decoding on the embedded default model",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", default="dflash", choices=["dflash", "dspark"])
    p.add_argument("--target", default=None, help="target directory (default: the embedded model)")
    p.add_argument("--drafter", default=None, help="drafter directory (default: the embedded one for --method)")
    p.add_argument("--prompt", action="append", default=None, help="prompt (repeatable; default: held-out set)")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-speculative-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--device", default="auto")
    p.add_argument("--color", action=argparse.BooleanOptionalAction, default=True)
    p.set_defaults(func=run_demo)
