"""Float32 linears on the CPU: `F.linear` (the default BLAS, MKL on x86 builds) against oneDNN's product from a
packed weight, alone and in the engine.

1. Alone (`--shapes`, `--rows`): us per product, the weight hot in cache, medians of a tight loop.
2. In the engine (`--engine`): the embedded pair (DSpark, policy on) decoding the demo's held-out prompts at
   batch 1 (and `--batch` requests at once), plain and speculative, every float32 linear of the target and the
   drafter on `F.linear` or on oneDNN's packed product, the two alternated round by round in one process.
   Outputs must agree between the arms; each arm's median seconds and the speculative/plain ratio are printed.

    python benchmarks/bench_cpu_linear.py --out cpu_linear.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from blockspec.models import cpu_linear


def _median_us(fn, repeats: int) -> float:
    for _ in range(repeats // 10 + 5):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def alone(shapes: list[tuple[int, int]], rows: list[int], repeats: int) -> list[dict]:
    out = []
    for n, k in shapes:
        w = torch.randn(n, k)
        packed = cpu_linear._pack(w)
        for r in rows:
            x = torch.randn(r, k)
            row = {"out": n, "in": k, "weight_kb": w.nbytes >> 10, "rows": r,
                   "f_linear_us": _median_us(lambda: F.linear(x, w), repeats),
                   "onednn_packed_us": _median_us(lambda: cpu_linear._onednn_linear(x, packed, None), repeats)}
            out.append(row)
            print(f"{n:6d} x {k:5d} rows {r:3d}: F.linear {row['f_linear_us']:8.1f} us, oneDNN packed "
                  f"{row['onednn_packed_us']:8.1f} us", flush=True)
    return out


class _OneDNNPacked(nn.Linear):
    """The arm under test: an `nn.Linear` whose product is oneDNN's from a packed copy of its weight."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.__dict__.get("_packed_key") != self.weight.data_ptr():
            self.__dict__["_packed"], self.__dict__["_packed_key"] = cpu_linear._pack(self.weight), self.weight.data_ptr()
        return cpu_linear._onednn_linear(x, self.__dict__["_packed"], self.bias)


@contextlib.contextmanager
def _on_onednn(modules: list[nn.Linear]) -> Iterator[None]:
    for m in modules:
        m.__class__ = _OneDNNPacked
    try:
        yield
    finally:
        for m in modules:
            m.__class__ = nn.Linear


def in_engine(rounds: int, batch: int, max_tokens: int) -> dict:
    from blockspec.demo import continued_prompts, default_pair, heldout_prompts
    from blockspec.llm import LLM
    from blockspec.sampling_params import SamplingParams

    base, _ = default_pair()
    spec = {"method": "dspark", "model": str(base / "dspark")}
    llm = LLM(str(base / "target"), device="cpu", dtype="float32", speculative_config=spec, seed=0,
              max_num_seqs=batch)
    prompts = continued_prompts(llm, heldout_prompts(16), 8)
    linears = [m for part in (llm.engine.model, llm.engine.proposer.drafter) for m in part.modules()
               if type(m) is nn.Linear and m.weight.dtype == torch.float32]
    arms = {"F.linear": contextlib.nullcontext, "oneDNN packed": lambda: _on_onednn(linears)}
    seconds: dict[str, list[float]] = {}
    outputs: dict[str, set] = {}
    for _ in range(rounds):
        for arm, context in arms.items():
            with context():
                for mode in ("plain", "spec"):
                    params = SamplingParams(temperature=0, max_tokens=max_tokens, use_speculation=mode == "spec")
                    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
                    start = time.perf_counter()
                    if batch == 1:
                        done = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
                    else:
                        done = llm.generate(prompts, params, use_tqdm=False)
                    seconds.setdefault(f"{arm}, {mode}", []).append(time.perf_counter() - start)
                    outputs.setdefault(mode, set()).add(tuple(tuple(o.outputs[0].token_ids) for o in done))
    medians = {k: statistics.median(v) for k, v in seconds.items()}
    result = {"batch": batch, "rounds": rounds, "seconds": seconds, "median_s": medians,
              "spec_over_plain": {arm: medians[f"{arm}, plain"] / medians[f"{arm}, spec"] for arm in arms},
              "outputs_agree": all(len(v) == 1 for v in outputs.values())}
    for key, value in medians.items():
        print(f"batch {batch}, {key}: {value:.3f} s (rounds {[round(s, 3) for s in seconds[key]]})", flush=True)
    print(f"batch {batch}: speculative over plain {result['spec_over_plain']}; outputs agree: "
          f"{result['outputs_agree']}", flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="512x256,1536x256,256x768,2048x512,3072x1024,16384x256",
                    help="out x in of the weights timed alone")
    ap.add_argument("--rows", default="1,2,4,9,16")
    ap.add_argument("--repeats", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3, help="alternated rounds of the engine arms")
    ap.add_argument("--batches", default="1,4", help="requests at once in the engine runs")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    result = {"threads": torch.get_num_threads(), "torch": torch.__version__,
              "alone": alone(shapes, [int(r) for r in args.rows.split(",")], args.repeats),
              "engine": [in_engine(args.rounds, int(b), args.max_tokens) for b in args.batches.split(",")]}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
