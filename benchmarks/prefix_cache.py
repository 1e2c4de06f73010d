"""Time to first token with and without prefix caching: requests one after another (a chat's turns,
an agent's calls) that share a long opening and differ in a short tail.

    python benchmarks/prefix_cache.py [--model default] [--method dspark|dflash|none] [--device cpu]
                                      [--prefix-len 1024] [--suffix-len 16] [--requests 8] [--rounds 3] [--burst]

Two engines, one with `enable_prefix_caching`, take turns round by round; each round sends the same
requests to both, the first of a round warming its cache (`--burst`: the requests of a round arrive
together, no warming request, as clients with one system prompt). The report gives each engine's median TTFT
over the timed requests, the ratio with its spread over rounds, the prompt tokens each request had
to prefill (the bound on the ratio is the prompt over what the cached engine still prefills) and
whether the outputs agree.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from blockspec import LLM, SamplingParams
from blockspec.assets import embedded


def build(args: argparse.Namespace, caching: bool) -> LLM:
    model = embedded(args.model, "target")
    spec = None
    if args.method != "none":
        spec = {"method": args.method, "model": embedded(args.draft_model, args.method)}
    return LLM(model, device=args.device, max_model_len=args.prefix_len + args.suffix_len + args.max_tokens + 64,
               enable_prefix_caching=caching, speculative_config=spec, seed=0)


def prompts(vocab: int, args: argparse.Namespace, round_: int) -> list[dict]:
    """One opening of prefix_len tokens and requests + 1 tails (the first request warms the cache)."""
    g = torch.Generator().manual_seed(round_)
    low = min(16, vocab // 2)  # clear of the special tokens a small vocabulary starts with
    opening = torch.randint(low, vocab, (args.prefix_len,), generator=g).tolist()
    return [{"prompt_token_ids": opening + torch.randint(low, vocab, (args.suffix_len,), generator=g).tolist()}
            for _ in range(args.requests + 1)]


def run_round(llm: LLM, batch: list[dict], params: SamplingParams,
              burst: bool) -> tuple[list[float], list[list[int]], int]:
    """The first request, then each of the others alone, in order; or (`burst`) all but the first together,
    nothing warming the cache. TTFTs and cached prompt tokens of those others, and every output."""
    first = llm.generate(batch[:1], params, use_tqdm=False) if not burst else []
    rest = (llm.generate(batch[1:], params, use_tqdm=False) if burst
            else [llm.generate([p], params, use_tqdm=False)[0] for p in batch[1:]])
    outs = [list(o.outputs[0].token_ids) for o in first + rest]
    return [o.metrics["ttft_s"] for o in rest], outs, sum(o.num_cached_tokens or 0 for o in rest)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="target directory or hub id ('default': the embedded one)")
    p.add_argument("--method", default="dspark", choices=["dspark", "dflash", "none"])
    p.add_argument("--draft-model", default="default", help="drafter directory ('default': the embedded pair's)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=16)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--burst", action="store_true", help="a round's requests arrive together")
    p.add_argument("--out", type=Path, default=None, help="write the report as JSON here")
    args = p.parse_args(argv)
    engines = {"off": build(args, False), "on": build(args, True)}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    vocab = engines["off"].engine.vocab_size
    ttft: dict[str, list[float]] = {"off": [], "on": []}
    ratios, agree, hits = [], True, 0
    for r in range(args.rounds + 1):  # round 0 warms both engines up and is not reported
        batch = prompts(vocab, args, r)
        medians, outs = {}, {}
        for name in (("off", "on") if r % 2 else ("on", "off")):
            times, outs[name], found = run_round(engines[name], batch, params, args.burst)
            medians[name] = statistics.median(times)
            if r:
                ttft[name] += times
                hits += found if name == "on" else 0
        if r:
            ratios.append(medians["off"] / medians["on"])
            agree = agree and outs["off"] == outs["on"]
    prompt_len = args.prefix_len + args.suffix_len
    page = engines["on"].engine.pages.page_size
    computed = prompt_len - min(args.prefix_len // page, (prompt_len - 1) // page) * page  # with every hit
    report = {
        "model": args.model, "method": args.method, "device": args.device, "prefix_len": args.prefix_len,
        "suffix_len": args.suffix_len, "requests_per_round": args.requests, "rounds": args.rounds, "burst": args.burst,
        "kv_page_size": page,
        "ttft_ms_median": {k: round(1e3 * statistics.median(v), 2) for k, v in ttft.items()},
        "ttft_ratio_by_round": [round(x, 2) for x in ratios],
        "ttft_ratio_median": round(statistics.median(ratios), 2),
        "prompt_tokens_prefilled": {"off": prompt_len, "on": prompt_len - hits // (args.requests * args.rounds)},
        "bound_ratio_tokens": round(prompt_len / computed, 1),
        "outputs_agree": agree,
    }
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
