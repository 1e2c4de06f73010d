"""Float32 linears on the CPU: `F.linear` (the default BLAS, MKL on x86 builds) against oneDNN's product from a
packed weight, alone and in the engine.

1. Alone (`--shapes`, `--rows`): us per product, the weight hot in cache, medians of a tight loop.
2. In the engine: the embedded pair (DSpark, policy on) decoding the demo's held-out prompts at batch 1 (and
   `--batches` requests at once), plain and speculative, in three arms alternated round by round in one process:
   as shipped (the target's LM head packed from two rows up, `cpu_linear.verify_head_product`), the target's
   head on `F.linear` too, and every float32 linear of the target and the drafter on oneDNN's packed product.
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
def _head_on_f_linear(model: nn.Module) -> Iterator[None]:
    product, model.head_product = model.head_product, None
    try:
        yield
    finally:
        model.head_product = product


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
    """The three arms paired inside one engine (`cpu_ab.paired`), plain and speculative each."""
    from cpu_ab import embedded_llm, paired

    llm = embedded_llm("dspark", batch)
    linears = [m for part in (llm.engine.model, llm.engine.proposer.drafter) for m in part.modules()
               if type(m) is nn.Linear and m.weight.dtype == torch.float32]
    arms = {"shipped": contextlib.nullcontext, "head on F.linear": lambda: _head_on_f_linear(llm.engine.model),
            "every linear packed": lambda: _on_onednn(linears)}
    return paired(llm, arms, rounds, ("plain", "spec"), batch, max_tokens, seed=None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="512x256,1536x256,256x768,2048x512,3072x1024,16384x256",
                    help="out x in of the weights timed alone")
    ap.add_argument("--rows", default="1,2,4,9,16")
    ap.add_argument("--repeats", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3, help="rounds over the prompts in the engine runs")
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
