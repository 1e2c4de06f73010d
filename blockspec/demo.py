"""`blockspec demo`: speculative vs plain decoding on the embedded default model, measured in one run.

The default pair (a small Qwen3-architecture code model and its DFlash / DSpark drafters, trained on
the Python standard library) ships inside the package, so this runs offline on any machine.
"""

from __future__ import annotations

import argparse
import os
import sysconfig
import time
from pathlib import Path
from typing import Any

ASSETS = Path(__file__).parent / "assets" / "default"
CACHE = Path(os.environ.get("BLOCKSPEC_CACHE", Path.home() / ".cache" / "blockspec")) / "default-quick"
HELDOUT = ("json", "asyncio", "email")  # kept out of all training by the recipe


def default_pair() -> tuple[Path, bool]:
    """The shipped default pair, or (until one is shipped) a quick pair built once with the recipe on CPU."""
    if (ASSETS / "target" / "config.json").is_file():
        return ASSETS, True
    if not (CACHE / "target" / "config.json").is_file():
        from blockspec.train.recipes.embedded_default import run as build

        print(f"No trained default is shipped in this checkout: building a quick pair with the recipe on "
              f"CPU (about a minute, cached in {CACHE}) ...", flush=True)
        build(CACHE, "cpu", 0.0, 0.0, True, 0, False)
    return CACHE, False


def heldout_prompts(limit: int, lines: int = 4) -> list[str]:
    """Openings of functions from stdlib packages that no training run saw: the model continues them."""
    root = Path(sysconfig.get_paths()["stdlib"])
    prompts = []
    for pkg in HELDOUT:
        for path in sorted((root / pkg).glob("*.py")):
            text = path.read_text(encoding="utf-8", errors="replace").splitlines()
            for i, line in enumerate(text):
                if line.lstrip().startswith("def ") and len(prompts) < limit * 8:
                    prompts.append("\n".join(text[i : i + lines]) + "\n")
    return prompts[:: max(1, len(prompts) // limit)][:limit]


def run_demo(args: argparse.Namespace) -> int:
    from blockspec.llm import LLM
    from blockspec.sampling_params import SamplingParams
    from blockspec.cli_options import format_spec_metrics

    shipped = True
    if args.target is None or args.drafter is None:
        base, shipped = default_pair()
    target = Path(args.target or base / "target")
    drafter = Path(args.drafter or base / args.method)
    for p in (target, drafter):
        if not (p / "config.json").is_file():
            raise FileNotFoundError(f"{p}: not a model directory (no config.json)")
    prompts = args.prompt or heldout_prompts(args.num_prompts)
    spec = {"method": args.method, "model": str(drafter)}
    if args.num_speculative_tokens:
        spec["num_speculative_tokens"] = args.num_speculative_tokens
    llm = LLM(str(target), device=args.device, speculative_config=spec, seed=0)
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
    print(f"target {target}, drafter {args.method} ({drafter}), device {llm.engine.device}, "
          f"temperature {args.temperature}, {len(prompts)} held-out prompts")
    if not shipped:
        print("note: this is the quick CPU-built pair (trained for seconds), not the GPU-trained default: its "
              "text is barely trained (often repetitive), so its acceptance figures say little about real drafting")
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
