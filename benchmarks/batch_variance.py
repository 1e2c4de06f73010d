"""How far outputs depend on batch composition and on the verify path in a given dtype.

Speculative decoding is exact when the arithmetic is: in fp32 the outputs equal plain decoding token
for token, greedy and (same seed) sampled. In bf16 a batch of verify rows and a batch of plain rows run
different matrix shapes, so a near tie (greedy) or a sampling boundary (T > 0) can round the other
way. This separates that effect from a defect by comparing four runs of the embedded default pair on
the same prompts:
- speculative at batch N;
- plain at batch N;
- plain one prompt at a time;
- speculative one prompt at a time.
Plain batch N vs plain batch 1 is the variance of the plain engine alone; speculative vs plain one
at a time is the verify path's rounding alone.

    python benchmarks/batch_variance.py --dtype bfloat16 --prompts 16 --max-tokens 64 [--temperature 0.7]
"""

from __future__ import annotations

import argparse
import json

from blockspec import LLM, SamplingParams
from blockspec.assets import PAIR
from blockspec.demo import heldout_prompts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--method", default="dspark", choices=["dflash", "dspark"])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0, help="> 0: prompt i is sampled with seed i")
    ap.add_argument("--adaptive", action="store_true",
                    help="let the policy choose K (default: draft the whole block every step)")
    args = ap.parse_args()
    prompts = heldout_prompts(args.prompts)
    llm = LLM(str(PAIR / "target"), device=args.device, dtype=args.dtype, seed=0,
              speculative_config={"method": args.method, "model": str(PAIR / args.method),
                                  "adaptive_draft_length": args.adaptive})

    def params(speculate: bool) -> list[SamplingParams]:
        return [SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True, seed=i,
                               use_speculation=speculate) for i in range(len(prompts))]

    spec, plain = params(True), params(False)

    def ids(outs: list) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in outs]

    spec_batch = ids(llm.generate(prompts, spec, use_tqdm=False))
    plain_batch = ids(llm.generate(prompts, plain, use_tqdm=False))
    plain_single = [ids(llm.generate([p], [q], use_tqdm=False))[0] for p, q in zip(prompts, plain, strict=True)]
    spec_single = [ids(llm.generate([p], [q], use_tqdm=False))[0] for p, q in zip(prompts, spec, strict=True)]

    def same(a: list[list[int]], b: list[list[int]]) -> int:
        return sum(x == y for x, y in zip(a, b, strict=True))

    print(json.dumps({
        "dtype": args.dtype, "device": str(llm.engine.device), "method": args.method, "prompts": len(prompts),
        "max_tokens": args.max_tokens, "temperature": args.temperature, "adaptive": args.adaptive,
        "drafts": llm.get_stats().get("num_drafts"),
        "identical_outputs": {"spec_batch_vs_plain_batch": same(spec_batch, plain_batch),
                              "plain_batch_vs_plain_single": same(plain_batch, plain_single),
                              "spec_batch_vs_plain_single": same(spec_batch, plain_single),
                              "spec_single_vs_plain_single": same(spec_single, plain_single)},
    }, indent=2))


if __name__ == "__main__":
    main()
