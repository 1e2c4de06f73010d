"""What enabling speculation costs the steps that do not draft: the same engine decodes batches of
requests (greedy, or seeded sampling at `--temperature`; joining one step apart, as at a server)
that opted out of speculation (`use_speculation=False`), that joined a parked batch (the policy
told them not to feed the drafter, as where plain wins at a busy server), that may speculate but
take the plain path every step (the policy forced to K = 0: their taps are still kept for the
drafter), and that speculate as the policy chooses. Per setting: output tok/s and the median, p10
and p90 wall time of an engine step (host clock around `step()`, which ends on the step's
read-back; the device is not synced between steps, as when serving).

With `--max-tokens M` the batch churns as at a busy server: each request stops after M tokens and
a new one (prompt length varying around `--prompt-len`) takes its place in the same step, so
prefills, the drafter's prompt context and changing batch sizes are in the price.

    python benchmarks/spec_overhead.py --model blockspec/assets/default/target \
        --draft-model blockspec/assets/default/dspark --method dspark --out overhead.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
from collections import Counter

from blockspec import LLM, SamplingParams


SETTINGS = ("opted out", "parked", "plain forced", "adaptive")


def measure(llm: LLM, batch: int, setting: str, steps: int, prompt_len: int,
            temperature: float = 0.0, profile: bool = False, max_tokens: int | None = None) -> dict:
    engine = llm.engine
    policy = engine.policy
    choose, feeds = policy.choose, policy.feeds_drafter
    speculate = setting != "opted out"
    choices: Counter[int] = Counter()

    def counted(b: int) -> int:
        k = 0 if setting == "plain forced" else choose(b)
        choices[k] += 1
        return k

    policy.choose = counted
    if setting == "parked":
        policy.feeds_drafter = lambda b, joining=1: False
    added = 0

    def add() -> None:
        nonlocal added
        i, added = added, added + 1
        length = prompt_len if max_tokens is None else prompt_len // 2 + (i * 37) % prompt_len  # mixed
        params = SamplingParams(temperature=temperature, seed=i, max_tokens=max_tokens or 10**6, ignore_eos=True,
                                use_speculation=speculate)
        engine.add_request(f"r{i}", None, [5 + (i + j) % 50 for j in range(length)], params)

    def step() -> None:
        for req in engine.step():
            if req.finish_reason is not None:  # a finished request's place goes to a new one at once
                add()

    for _ in range(batch):  # one request joins per step, as requests arrive at a server
        add()
        step()
    for _ in range(20):  # the policy's first measurements at the full batch
        step()
    walls, generated, drafts = [], engine.num_generated, engine.spec_totals.as_dict().get("num_drafts", 0)
    choices.clear()
    profiler = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    for _ in range(steps):
        start = time.perf_counter()
        if profiler:
            profiler.enable()
        step()
        if profiler:
            profiler.disable()
        walls.append((time.perf_counter() - start) * 1e3)
    seconds = time.perf_counter() - t0
    out = {"batch": batch, "temperature": temperature, "use_speculation": speculate, "setting": setting,
           "tok_s": (engine.num_generated - generated) / seconds, "step_ms_median": statistics.median(walls),
           "step_ms_p10": sorted(walls)[steps // 10], "step_ms_p90": sorted(walls)[9 * steps // 10],
           "drafts": engine.spec_totals.as_dict().get("num_drafts", 0) - drafts,
           "choices": {str(k): n for k, n in sorted(choices.items())}}
    if profiler:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(20)
        out["profile"] = text.getvalue()
    for i in range(added):
        engine.abort(f"r{i}")
    while engine.has_unfinished():
        engine.step()
    policy.choose, policy.feeds_drafter = choose, feeds
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft-model", required=True)
    ap.add_argument("--method", default="dspark", choices=("dflash", "dspark"))
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=1, help="measure each setting this often, alternating the order")
    ap.add_argument("--prompt-len", type=int, default=55)
    ap.add_argument("--temperature", type=float, default=0.0, help="every request's (seeded per request)")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="churn: each request stops after this many tokens and a new one takes its place")
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=SETTINGS)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--profile", action="store_true", help="print each setting's hottest host functions (cProfile)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(args.model, device=args.device, max_num_seqs=max(batches),
              speculative_config={"method": args.method, "model": args.draft_model})
    rows = []
    settings = [s for s in SETTINGS if s in args.settings]
    for batch, rnd in ((b, r) for b in batches for r in range(args.rounds)):
        for setting in settings if rnd % 2 == 0 else settings[::-1]:  # alternate the order
            row = measure(llm, batch, setting, args.steps, args.prompt_len, args.temperature,
                          args.profile, args.max_tokens)
            row["round"] = rnd
            rows.append(row)
            print(f"batch {batch:3d}  {setting:12}  "
                  f"{row['tok_s']:8.0f} tok/s  step {row['step_ms_median']:.3f} ms "
                  f"(p10 {row['step_ms_p10']:.3f}, p90 {row['step_ms_p90']:.3f})  "
                  f"drafts {row['drafts']}  choices {row['choices']}", flush=True)
            if args.profile:
                print(row["profile"], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "draft_model": args.draft_model, "max_tokens": args.max_tokens, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
