"""The few-row linear layers of a model shape (`--arch`, default Qwen3-8B): `skinny_linear` (tile sweep,
fused prologues) against cuBLAS, next to the copy bandwidth that bounds them. A mixture-of-experts
shape has only its attention products here (its experts: `benchmarks/bench_moe.py`).

Each figure is one layer's product (and what is fused into it) timed as a CUDA graph of calls over
enough weight copies to defeat the L2 cache, median of repeated replays. The floor of a call is its
weight bytes over the measured copy bandwidth.

    python benchmarks/bench_gemv.py --out gemv.json
    python benchmarks/bench_gemv.py --arch qwen3-30b-a3b --sweep --rows 1
    python benchmarks/bench_gemv.py --rows "" --multirow-rows 144,288   # `multirow_linear` tiles against cuBLAS
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from blockspec.bench.arch import get_arch
from blockspec.bench.timing import add_run, copy_bandwidth, graph_seconds, kernel_record
from blockspec.kernels import ops as triton_ops
from blockspec.models import layers
from blockspec.kernels.ops import MultirowConfig, SkinnyConfig


def shapes(arch: str) -> dict[str, tuple[int, int, str]]:
    """name: (n, k, fusion) of the arch's decoder-layer products; the fusion is what the decoder layer
    folds into it (SwiGLU: down's prologue at one row, gate_up's epilogue above it, as `GatedMLP` places
    it; above one row the norm's statistics come from the product before, which writes them beside the
    residual stream)."""
    cfg = get_arch(arch).target
    heads = cfg.num_attention_heads * cfg.head_dim
    qkv = heads + 2 * cfg.num_key_value_heads * cfg.head_dim
    out = {"qkv": (qkv, cfg.hidden_size, "norm"), "o": (cfg.hidden_size, heads, "residual")}
    if not cfg.num_experts:
        out |= {"gate_up": (2 * cfg.intermediate_size, cfg.hidden_size, "norm+glu"),
                "down": (cfg.hidden_size, cfg.intermediate_size, "swiglu+residual")}
    return out


L2_DEFEAT_BYTES = 512 << 20


class Case:
    """One product at one row count, over enough weight copies to stream from HBM on every call."""

    def __init__(self, n: int, k: int, fusion: str, m: int) -> None:
        self.n, self.k, self.fusion, self.m = n, k, fusion, m
        copies = max(1, -(-L2_DEFEAT_BYTES // (n * k * 2)))
        self.weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for _ in range(copies)]
        width = 2 * k if "swiglu" in fusion else k
        self.x = torch.randn(m, width, device="cuda", dtype=torch.bfloat16)
        self.norm_w = torch.randn(k, device="cuda", dtype=torch.bfloat16) if "norm" in fusion else None
        self.res = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) if "residual" in fusion else None
        self.next_w = torch.randn(n, device="cuda", dtype=torch.bfloat16) if "residual" in fusion else None
        self.prenormed = None
        if self.norm_w is not None:  # as o / down would leave them: sums from 128 programs of 32 columns
            sums = self.x.float().pow(2).view(m, 128, -1).sum(-1).T.contiguous()
            self.prenormed = triton_ops.PreNormed(self.x, self.x * self.norm_w, sums, self.norm_w)

    @property
    def weight_bytes(self) -> int:
        return self.n * self.k * 2

    def skinny(self, cfg: SkinnyConfig | None, fused: bool = True) -> list[Callable[[], object]]:
        """What `layers.dense` runs: the residual add inside the product; at one row the norm or SwiGLU
        too; above it SwiGLU in gate_up's epilogue, the norm from the statistics the product before
        wrote, and (o, down) those statistics written for the next norm."""
        one_row = self.m == 1
        swiglu = fused and one_row and "swiglu" in self.fusion
        x = self.x if swiglu or "swiglu" not in self.fusion else self.x[:, :self.k]
        kw = dict(norm_weight=self.norm_w if one_row else None, eps=1e-6, glu=not one_row and "+glu" in self.fusion,
                  residual=self.res, prenormed=None if one_row else self.prenormed,
                  emit_norm=None if one_row else self.next_w) if fused else {}
        return [lambda w=w: triton_ops.skinny_linear(x, w, config=cfg, swiglu=swiglu, **kw) for w in self.weights]

    def cublas(self, fused: bool = True) -> list[Callable[[], object]]:
        """The unfused ops the engine ran before: the norm / SwiGLU kernel, cuBLAS, the residual add."""
        def call(w: torch.Tensor) -> torch.Tensor:
            x = self.x
            if fused and self.norm_w is not None:
                x = layers.rms_norm(x, self.norm_w, 1e-6)
            if "swiglu" in self.fusion:
                x = layers.silu_mul(x) if fused else x[:, :self.k]
            y = F.linear(x, w)
            return y + self.res if fused and self.res is not None else y
        return [lambda w=w: call(w) for w in self.weights]

    def multirow(self, cfg: MultirowConfig) -> list[Callable[[], object]]:
        """`multirow_linear` over these bf16 weights (gate_up with SwiGLU in its epilogue), against
        `cublas_product`: `layers.dense` runs it for FP8 weights only, and this measures whether bf16
        should."""
        glu = "+glu" in self.fusion
        x = self.x[:, :self.k]
        return [lambda w=w: triton_ops.multirow_linear(x, w, glu=glu, config=cfg) for w in self.weights]

    def cublas_product(self) -> list[Callable[[], object]]:
        """cuBLAS's product, gate_up followed by the SwiGLU kernel: what `multirow` replaces."""
        glu = "+glu" in self.fusion
        x = self.x[:, :self.k]
        return [lambda w=w: (layers.silu_mul(F.linear(x, w)) if glu else F.linear(x, w)) for w in self.weights]


def multirow_space(n: int) -> list[MultirowConfig]:
    """`multirow_linear`'s tiles for an n-column product: K cut so that there are 48 to 528 programs a
    row group."""
    out = []
    for width, block_k, warps, split in itertools.product([64, 128], [64, 128], [4, 8], [1, 2, 4]):
        if 48 <= -(-n // width) * split <= 528:
            out.append(MultirowConfig(width, block_k, warps, 4, split))
    return out


def sweep_space(m: int) -> list[SkinnyConfig]:
    if m == 1:
        grid = itertools.product([1], [4, 8, 16, 32], [256, 512, 1024], [4, 8], [1, 3])
    else:
        grid = itertools.product([16], [16, 32, 64], [128, 256, 512], [4, 8], [2, 3, 4])
    return [SkinnyConfig(*c) for c in grid]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="qwen3-8b", help="the model shape whose products are timed")
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    ap.add_argument("--sweep", action="store_true",
                    help="sweep tile sizes first (bare, and with the fusions the engine runs)")
    ap.add_argument("--sweep-rows", default="1,16", help="the row counts of the sweep")
    ap.add_argument("--sweep-kinds", default="bare,fused", help="the sweep's products: bare, fused (as the engine "
                                                                 "runs them) or both; each tile of each compiles")
    ap.add_argument("--multirow-rows", default="", help="row counts at which to sweep `multirow_linear`'s tiles "
                                                         "against cuBLAS (each tile compiles), e.g. 144,288")
    ap.add_argument("--layers", default=None, help="only these products (comma-separated), e.g. gate_up,down")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    products = shapes(args.arch)
    if args.layers:
        products = {name: products[name] for name in args.layers.split(",")}
    bw = copy_bandwidth()
    result = kernel_record(bw, arch=args.arch, sweep=[])
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, list)}), flush=True)
    for m in (int(r) for r in args.multirow_rows.split(",") if r):
        for name, (n, k, fusion) in products.items():
            case = Case(n, k, fusion, m)
            floor = case.weight_bytes / bw
            row = {"rows": m, "layer": name, "floor_us": floor * 1e6,
                   "cublas_us": statistics.median(graph_seconds(case.cublas_product())) * 1e6}
            for cfg in multirow_space(n // 2 if "+glu" in fusion else n):
                key = ",".join(str(v) for v in cfg.__dict__.values())
                try:
                    row[key] = statistics.median(graph_seconds(case.multirow(cfg))) * 1e6
                except Exception as exc:  # a tile that does not fit (shared memory, registers)
                    row[key] = repr(exc)[:80]
            result["multirow"] = result.get("multirow", []) + [row]
            timed = {key: v for key, v in row.items() if isinstance(v, float) and key not in ("floor_us", "cublas_us")}
            best = min(timed, key=timed.get)
            print(json.dumps({"rows": m, "layer": name, "floor_us": row["floor_us"], "cublas_us": row["cublas_us"],
                              "best": best, "best_us": timed[best]}), flush=True)
            del case
            torch.cuda.empty_cache()
    if args.sweep:
        kinds = [kind == "fused" for kind in args.sweep_kinds.split(",")]
        for m in (int(r) for r in args.sweep_rows.split(",")):
            cases = {name: Case(n, k, fusion, m) for name, (n, k, fusion) in products.items()}
            for cfg in sweep_space(m):
                row = {"rows": m, "config": cfg.__dict__}
                for (name, case), fused in itertools.product(cases.items(), kinds):
                    key = name + ("_fused" if fused else "")
                    try:
                        t = statistics.median(graph_seconds(case.skinny(cfg, fused=fused)))
                    except Exception as exc:  # a tile that does not fit (shared memory, registers)
                        row[key] = repr(exc)[:80]
                        continue
                    row[key] = case.weight_bytes / t / bw
                result["sweep"].append(row)
                print(json.dumps(row), flush=True)
            del cases
            torch.cuda.empty_cache()
    for m in (int(r) for r in args.rows.split(",") if r):
        for name, (n, k, fusion) in products.items():
            case = Case(n, k, fusion, m)
            floor = case.weight_bytes / bw
            run = {"rows": m, "layer": name, "n": n, "k": k, "fusion": fusion, "floor_us": floor * 1e6}
            for label, calls in (("skinny_fused", case.skinny(None)), ("skinny_bare", case.skinny(None, fused=False)),
                                 ("cublas_unfused", case.cublas()), ("cublas_bare", case.cublas(fused=False))):
                t = statistics.median(graph_seconds(calls))
                run[label + "_us"] = t * 1e6
                run[label + "_floor_ratio"] = floor / t
            del case
            add_run(result, run)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
