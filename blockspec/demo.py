"""`blockspec demo`: speculative vs plain decoding on the embedded default model, measured in one run.

The default pair (a small Qwen3-architecture code model and its DFlash / DSpark drafters, trained on
Python sources: 39 projects from the package index and the standard library, its json, asyncio and email
packages held out for the prompts) ships inside the package, so this runs offline on any machine. Requests
run one after another at batch 1, as a user at a terminal sends them; each prompt is one round, run
plain and speculative back to back in alternating order (plain, speculative, speculative, plain, ...),
so a drift of the machine's speed falls on both, and the speedup is the median of the rounds' ratios
with their min and max.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from blockspec.assets import PAIR
from blockspec.config import ConfigError

CACHE = Path(os.environ.get("BLOCKSPEC_CACHE", Path.home() / ".cache" / "blockspec")) / "default-quick"
HELDOUT = ("json", "asyncio", "email")  # kept out of all training by the recipe


def default_pair() -> tuple[Path, bool]:
    """The shipped default pair, or (in an install without it) a quick pair built once with the recipe on CPU,
    into a directory of its own renamed into the cache whole: an interrupted build leaves no half pair there."""
    if (PAIR / "target" / "config.json").is_file():
        return PAIR, True
    if not (CACHE / "metrics.json").is_file():  # the recipe's last file: the pair is whole
        from blockspec.train.recipes.embedded_default import run as build

        print(f"No trained default is installed: building a quick pair with the recipe on the CPU (a few "
              f"seconds; cached in {CACHE}, or $BLOCKSPEC_CACHE) ...", flush=True)
        try:
            CACHE.parent.mkdir(parents=True, exist_ok=True)
            partial = Path(tempfile.mkdtemp(prefix=f".{CACHE.name}.partial-", dir=CACHE.parent))
        except OSError as exc:
            raise ConfigError(f"cannot write the quick pair's cache {CACHE.parent}: {exc.strerror or exc} (set "
                              "BLOCKSPEC_CACHE to a writable directory)") from None
        try:
            build(partial, "cpu", 0.0, 0.0, True, 0, False)
            for tar in partial.glob("*.tar"):  # the recipe's packs for a device call: not needed here
                tar.unlink()
            shutil.rmtree(CACHE, ignore_errors=True)  # a half pair an older build left
            partial.replace(CACHE)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    return CACHE, False


def heldout_openings(lines: int = 4) -> list[str]:
    """Every opening (`lines` lines from a `def`) of a function in the stdlib packages that no training run saw,
    in package and file order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    openings = []
    for pkg in HELDOUT:
        for path in sorted((root / pkg).glob("*.py")):
            text = path.read_text(encoding="utf-8", errors="replace").splitlines()
            openings += ["\n".join(text[i : i + lines]) + "\n" for i, line in enumerate(text)
                         if line.lstrip().startswith("def ")]
    return openings


def heldout_prompts(limit: int, lines: int = 4) -> list[str]:
    """Openings of functions from stdlib packages that no training run saw, spread over the first limit x 8:
    the model continues them."""
    prompts = heldout_openings(lines)[: limit * 8]
    return prompts[:: max(1, len(prompts) // limit)][:limit]


def continued_prompts(llm: Any, candidates: list[str], limit: int) -> list[str]:
    """The first `limit` candidates that the target continues past their first token when greedy: a prompt
    it ends at once would show no code, and its round would time a prefill and no decoding."""
    from blockspec.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=2, use_speculation=False)
    outs = llm.generate(candidates, params, use_tqdm=False)
    return [p for p, o in zip(candidates, outs) if len(o.outputs[0].token_ids) > 1][:limit]


def budget_on(asked: bool | None, device_type: str) -> bool:
    """Whether DSpark's confidence budget chooses what each step verifies: as asked, else on the CPU only. On a
    GPU this small pair's step is host work, and a budgeted step reads the confidences on the host mid-step
    and runs as separate launches, not as one captured step: it costs more than the rows it saves there."""
    return asked if asked is not None else device_type == "cpu"


def use_color(enabled: bool) -> bool:
    """Colours only on a terminal, and never with NO_COLOR set (https://no-color.org)."""
    return enabled and sys.stdout.isatty() and not os.environ.get("NO_COLOR")


@dataclass
class Round:
    """One prompt decoded plain and speculative: tokens and seconds of each, and whether they agree."""

    plain_tokens: int
    plain_s: float
    spec_tokens: int
    spec_s: float
    same: bool

    @property
    def speedup(self) -> float:
        return (self.spec_tokens / self.spec_s) / (self.plain_tokens / self.plain_s)


BUDGET_CHOSE = "DSpark's confidence budget verified none of the drafts"
BUDGET_OFF = "--no-adaptive-verification verifies every draft"


def summary(rounds: list[Round], acc: dict[str, Any], adaptive: bool = True, budget: bool = False) -> list[str]:
    """The closing lines: acceptance, tok/s of both runs, and the speedup with its spread; or, when no step
    drafted, what chose plain decoding, and no speedup. `adaptive`: the draft-length policy chose each step's
    drafts; `budget`: DSpark's confidence budget chose how many of them to verify (with neither, a step drafts
    unless no draft fits before the token limit)."""
    from blockspec.bench.drafts import NO_DRAFTS_WHY

    plain_n, plain_s = sum(r.plain_tokens for r in rounds), sum(r.plain_s for r in rounds)
    spec_n, spec_s = sum(r.spec_tokens for r in rounds), sum(r.spec_s for r in rounds)
    choosers = (["the draft-length policy chose plain decoding (--no-adaptive-draft-length drafts every step)"]
                if adaptive else []) + ([f"{BUDGET_CHOSE} ({BUDGET_OFF})"] if budget else [])
    why_fewer = f"for the others, {' or '.join(choosers)}" if choosers else \
        "the others had no room for a draft before the token limit"
    lines = []
    if acc["num_drafts"]:
        per = " ".join("-" if x is None else f"{x:.2f}" for x in acc["per_position"])
        # every decode step emits one token plus the drafts it accepted; each prompt's first token is its prefill's
        steps = spec_n - len(rounds) - round((acc["mean_acceptance_length"] - 1) * acc["num_drafts"])
        lines += [f"speculation: acceptance length {acc['mean_acceptance_length']:.2f} (tokens per verify step, "
                  f"bonus included) over {acc['num_drafts']} verify step(s) of {acc['mean_draft_length']:.1f} "
                  f"drafts on average; {acc['num_drafts']} of {steps} decode steps drafted"
                  + ("" if acc["num_drafts"] >= steps else f" ({why_fewer})"),
                  f"  per-position acceptance (of the steps drafting position i, the share accepting it; - = never "
                  f"drafted): {per}"]
    lines += [f"plain:       {plain_n} tokens in {plain_s:.2f} s = {plain_n / plain_s:.1f} tok/s",
              f"speculative: {spec_n} tokens in {spec_s:.2f} s = {spec_n / spec_s:.1f} tok/s"]
    agree = f"outputs identical to plain decoding: {'yes' if all(r.same for r in rounds) else 'NO'}"
    if not acc["num_drafts"]:
        why = (f"{NO_DRAFTS_WHY} (--no-adaptive-draft-length drafts every step)" if adaptive else
               f"no drafts: {BUDGET_CHOSE} at any step (a step priced faster without them; {BUDGET_OFF})"
               if budget else "no drafts: no decode step had room for a draft before the token limit (--max-tokens)")
        return lines + [f"{why}; the speculative runs decoded as the plain ones did, so there is no speedup to "
                        "report; " + agree]
    # a prompt whose output ended at its first token timed its prefill only: no decoding to compare
    ratios = [r.speedup for r in rounds if r.plain_tokens > 1]
    left_out = len(rounds) - len(ratios)
    skipped = f"; {left_out} prompt(s) ended at their first token (prefill only) and are left out" if left_out else ""
    if not ratios:
        return lines + [f"no round decoded past its first token, so there is no speedup to report{skipped}; {agree}"]
    # each round is another prompt, so the spread is the prompts' (how well each drafts) as much as timing
    # noise: the count of faster rounds says how general the speedup is
    faster = sum(x > 1 for x in ratios)
    return lines + [f"speedup {statistics.median(ratios):.2f}x (median of {len(ratios)} interleaved rounds, one "
                    f"prompt each, min {min(ratios):.2f}x, max {max(ratios):.2f}x; {faster} of {len(ratios)} "
                    f"faster{skipped}); {agree}"]


def run_demo(args: argparse.Namespace) -> int:
    from blockspec.bench.drafts import StepLog, acceptance
    from blockspec.llm import LLM
    from blockspec.models.loader import resolve_device
    from blockspec.sampling_params import SamplingParams

    if args.num_prompts < 1:
        raise ConfigError(f"--num-prompts must be an integer >= 1, got {args.num_prompts}")
    shipped = True
    if args.target is None or args.drafter is None:
        base, shipped = default_pair()
    target = Path(args.target or base / "target")
    drafter = Path(args.drafter or base / args.method)
    for p in (target, drafter):
        if not (p / "config.json").is_file():
            raise FileNotFoundError(f"{p}: not a model directory (no config.json)")
    spec = {"method": args.method, "model": str(drafter), "adaptive_draft_length": args.adaptive_draft_length}
    asked = args.adaptive_verification  # asked for with DFlash, the engine says why it cannot
    if asked or (args.method == "dspark" and budget_on(asked, resolve_device(args.device).type)):
        spec["adaptive_verification"] = True
    if args.num_speculative_tokens is not None:  # the engine refuses 0 or less by name
        spec["num_speculative_tokens"] = args.num_speculative_tokens
    llm = LLM(str(target), device=args.device, dtype=args.dtype, speculative_config=spec, seed=0, max_num_seqs=1)
    engine = llm.engine
    prompts = args.prompt
    if not prompts:
        candidates = heldout_prompts(2 * args.num_prompts)
        if not candidates:  # a Python without its stdlib sources (some distributions ship .pyc only)
            raise ConfigError(f"no held-out prompts: this Python has no sources of its {', '.join(HELDOUT)} packages "
                              f"under {sysconfig.get_paths()['stdlib']}; give --prompt")
        prompts = continued_prompts(llm, candidates, args.num_prompts)
        if not prompts:
            raise ConfigError(f"the target ends each of the {len(candidates)} held-out prompts at once; give --prompt")
    base_params = dict(temperature=args.temperature, seed=0, max_tokens=args.max_tokens)
    modes = {"plain": SamplingParams(**base_params, use_speculation=False), "spec": SamplingParams(**base_params)}
    for use in (False, True):  # warm-up of both paths
        warm = SamplingParams(**base_params | {"max_tokens": 8}, use_speculation=use)
        llm.generate(prompts[:1], warm, use_tqdm=False)
    engine.spec_totals = log = StepLog()  # what each speculative step drafted and accepted
    color = use_color(args.color)
    dim, bold, reset = ("\033[2m", "\033[1m", "\033[0m") if color else ("", "", "")
    dtype = str(engine.model.embed_tokens.weight.dtype).removeprefix("torch.")
    print(f"target {target}, drafter {args.method} ({drafter}), device {engine.device}, {dtype}, temperature "
          f"{args.temperature}; {len(prompts)} prompts, one request at a time (batch 1)")
    if not shipped:
        print("note: this is the quick CPU-built pair (trained for seconds), not the GPU-trained default: its "
              "text is barely trained (often repetitive), so its acceptance figures say little about real drafting")
    rounds, drafted = [], []
    for i, prompt in enumerate(prompts):
        timed = {}
        for mode in (("plain", "spec") if i % 2 == 0 else ("spec", "plain")):
            t0 = time.perf_counter()
            out = llm.generate([prompt], modes[mode], use_tqdm=False)[0].outputs[0]
            timed[mode] = (out, time.perf_counter() - t0)
        (plain, plain_s), (fast, spec_s) = timed["plain"], timed["spec"]
        rounds.append(Round(len(plain.token_ids), plain_s, len(fast.token_ids), spec_s,
                            list(plain.token_ids) == list(fast.token_ids)))
        steps = log.drain()  # this round's verify steps: (drafts, accepted) each
        drafted += steps
        length = f", acceptance length {1 + sum(a for _, a in steps) / len(steps):.2f}" if steps else ", no drafts"
        print(f"\n=== prompt {i + 1} of {len(prompts)} ===\n{dim}{prompt}{reset}{bold}{fast.text}{reset}")
        print(f"--- plain {rounds[-1].plain_tokens / plain_s:.1f} tok/s, speculative "
              f"{rounds[-1].spec_tokens / spec_s:.1f} tok/s ({rounds[-1].speedup:.2f}x){length}"
              + ("" if rounds[-1].same else "; the outputs differ"))
    acc = acceptance(drafted, engine.proposer.num_speculative_tokens)
    print("=" * 60)
    print("\n".join(summary(rounds, acc, args.adaptive_draft_length, spec.get("adaptive_verification", False))))
    return 0 if all(r.same for r in rounds) or args.temperature > 0 else 1


def add_demo_parser(sub: Any) -> None:
    from blockspec.cli_options import HelpFormatter

    p = sub.add_parser("demo", help="speculative vs plain decoding on the embedded default model",
                       description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--method", default="dspark", choices=["dflash", "dspark"],
                   help="the embedded drafter to use (default: dspark, the pair's higher acceptance)")
    p.add_argument("--target", default=None, help="target directory (default: the embedded model)")
    p.add_argument("--drafter", default=None, help="drafter directory (default: the embedded one for --method)")
    p.add_argument("--prompt", action="append", default=None,
                   help="prompt (repeatable; default: openings of held-out stdlib functions)")
    p.add_argument("--num-prompts", type=int, default=8, help="held-out prompts, one round each (default: 8)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens generated per prompt (default: 128)")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="drafts verified per step at most (default: the drafter's draft positions: its block "
                        "less the anchor for DFlash, the whole block for DSpark)")
    p.add_argument("--adaptive-draft-length", action=argparse.BooleanOptionalAction, default=False,
                   help="each step verifies the number of drafts with the most measured tokens per second, down to "
                        "none, as the engine does by default (default here: off, every step drafts the whole "
                        "block, so the demo shows what block drafting does; see --adaptive-verification for "
                        "how many of them are verified)")
    p.add_argument("--adaptive-verification", action=argparse.BooleanOptionalAction, default=None,
                   help="dspark: its confidence head decides how many of each block's drafts to verify, admitting "
                        "them by predicted survival while the measured tokens per second of a step rise "
                        "(speculative_config's adaptive_verification; default: on the CPU, off on a GPU, where "
                        "this small pair's budgeted step costs more than the rows it saves)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: 0, greedy)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default: auto)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="weights and activations (default: float32 on every device, since bf16 products can "
                        "round a verify step's rows differently from a plain step's and so flip near-tied "
                        "greedy tokens of this small model, and the demo checks that the outputs are identical; "
                        "bfloat16 makes both runs faster where products are native bf16)")
    p.add_argument("--color", action=argparse.BooleanOptionalAction, default=True,
                   help="colour the code on a terminal (never into a pipe or a file, nor with NO_COLOR set)")
    p.set_defaults(func=run_demo)
