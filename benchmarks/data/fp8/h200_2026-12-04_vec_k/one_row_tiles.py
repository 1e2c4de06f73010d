"""One-row FP8 products of Qwen3-8B's shapes, per-channel e4m3, on the shipped tiles against candidate
tiles with K runs of 8 (VEC_K), plain and as the decode step calls them. Each product a CUDA graph over
enough weight copies to defeat the L2 cache; variants interleaved, 3 rounds of 10 replays, median us.
Run from the repository root on the device machine:
    python3 benchmarks/data/fp8/h200_2026-12-04_vec_k/one_row_tiles.py"""
import statistics

import torch

from blockspec.bench.timing import graph_seconds
from blockspec.kernels import fp8
from blockspec.kernels.ops import PreNormed, SkinnyConfig, skinny_config, skinny_linear

CANDIDATES = [(8, 1024, 4, 3), (8, 1024, 4, 1), (4, 1024, 4, 3), (16, 1024, 4, 3), (8, 2048, 8, 3)]
CASES = {  # name: (n, k, the call's fusions)
    "qkv": (6144, 4096, {}), "o": (4096, 4096, {}), "gate_up": (24576, 4096, {}), "down": (4096, 12288, {}),
    "qkv_prenormed": (6144, 4096, {"prenormed": True}), "o_residual_emit": (4096, 4096, {"residual": True}),
    "gate_up_prenormed_glu": (24576, 4096, {"prenormed": True, "glu": True}),
    "down_swiglu": (4096, 12288, {"swiglu": True}),
}


def case(n: int, k: int, swiglu: bool = False, residual: bool = False, prenormed: bool = False, glu: bool = False):
    copies = max(1, (512 << 20) // (n * k))
    weights = [fp8.quantize_per_channel(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5)
               for _ in range(copies)]
    x = torch.randn(1, 2 * k if swiglu else k, device="cuda", dtype=torch.bfloat16)
    kw = {"swiglu": swiglu, "glu": glu}
    if residual:
        kw |= {"residual": torch.randn(1, n, device="cuda", dtype=torch.bfloat16),
               "emit_norm": torch.ones(n, device="cuda", dtype=torch.bfloat16)}
    if prenormed:
        kw["prenormed"] = PreNormed(x, x.clone(), torch.full((1, 1), float(k), device="cuda"),
                                    torch.ones(k, device="cuda", dtype=torch.bfloat16))
    shipped = skinny_config(1, n, k, 2 if swiglu else 0, 2, fp8=True)
    configs = {"shipped": shipped} | {f"{c} vec 8": SkinnyConfig(1, *c, vec_k=8) for c in CANDIDATES}
    return {name: [lambda q=q, s=s, c=c: skinny_linear(x, q, weight_scale=s, scale_block=(1, k), config=c, **kw)
                   for q, s in weights] for name, c in configs.items()}


for name, (n, k, fusions) in CASES.items():
    calls = case(n, k, **fusions)
    times = {v: [] for v in calls}
    for _ in range(3):
        for v, fns in calls.items():
            times[v] += graph_seconds(fns, replays=10)
    print(name, "  ".join(f"{v} {statistics.median(t) * 1e6:.1f}" for v, t in times.items()), flush=True)
