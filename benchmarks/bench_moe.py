"""One mixture-of-experts layer of Qwen3-30B-A3B's shape (128 experts of width 768, top-8, hidden 2048,
bf16): the fused kernels (route, align, grouped gate_up and down, combine) at decode / verify / prefill
row counts, against the floor of the experts the rows actually select, and a tile sweep; at one row
also the whole block as a decode step runs it (router, route, experts), with a sweep of the router's
tiles (--router-sweep).

Each figure is one layer's call timed as a CUDA graph of calls over several layers' weights (so the
selected experts stream from HBM, not L2), median of repeated replays. The floor of a call is the
bytes of the union of its rows' experts over the measured copy bandwidth. Routing comes from random
router logits: "uniform" (rows independent), or "local" (each request's rows equicorrelated with
rho = 0.8, the locality model of blockspec.bench.expert_union; rows = requests x rows each). For
scale, the dense SwiGLU MLP of the same active width (8 x 768) at the same rows. With --fp8, the
experts are e4m3 (per output channel, or over 128 x 128 blocks as Qwen/Qwen3-30B-A3B-FP8 has them),
dequantized tile by tile in the same kernels, and the floor is their bytes.

    python benchmarks/bench_moe.py --out moe.json [--sweep] [--router-sweep] [--fp8 channel|block]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from blockspec.bench.expert_union import LOCAL_RHO
from blockspec.bench.timing import copy_bandwidth, graph_seconds
from blockspec.kernels import moe as K
from blockspec.kernels.ops import SkinnyConfig, skinny_linear
from blockspec.models.layers import GatedMLP, rms_norm
from blockspec.models.quant import Fp8Experts

EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768
LAYERS = 6  # 6 x 1.2 GB of experts: a step's experts never sit in L2 from the call before
EXPERT_BYTES = 3 * HIDDEN * INTER * 2
# (block_n_up, block_n_down, block_k, num_warps, num_stages) tried for few rows with --sweep
SWEEP = [(16, 32, 128, 4, 3), (32, 64, 128, 4, 3), (32, 32, 256, 4, 2), (64, 64, 128, 4, 3), (32, 64, 64, 4, 4),
         (16, 64, 256, 4, 2), (32, 128, 128, 8, 3), (64, 128, 64, 4, 4)]

# --router-sweep: the router's product at one row (block_m, block_n, block_k, num_warps, num_stages)
ROUTER_SWEEP = [(1, 4, 2048, 8, 1), (1, 1, 2048, 4, 1), (1, 4, 512, 4, 3), (1, 8, 512, 4, 3), (1, 2, 1024, 4, 2),
                (1, 2, 2048, 4, 1), (1, 8, 2048, 8, 1)]


def router_logits(rows: int, per_request: int, rho: float, gen: torch.Generator) -> torch.Tensor:
    """[rows, E] random logits; with rho, each request's `per_request` rows equicorrelated by rho."""
    z = torch.randn(rows // per_request, per_request, EXPERTS, generator=gen)
    if rho and per_request > 1:
        m = z.mean(1, keepdim=True)
        z = (1 - rho) ** 0.5 * (z - m) + (1 + (per_request - 1) * rho) ** 0.5 * m
    return z.reshape(rows, EXPERTS).to("cuda", torch.bfloat16)


class Layers:
    def __init__(self, fp8: str | None = None) -> None:
        g = torch.Generator(device="cuda").manual_seed(0)
        self.gate_up = [torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g)
                        * HIDDEN ** -0.5 for _ in range(LAYERS)]
        self.down = [torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", dtype=torch.bfloat16, generator=g)
                     * INTER ** -0.5 for _ in range(LAYERS)]
        self.scales: list[K.ExpertScales | None] = [None] * LAYERS
        self.expert_bytes = EXPERT_BYTES
        if fp8:  # each layer's experts in e4m3, expert by expert (the bf16 copies are dropped)
            for i in range(LAYERS):
                f = Fp8Experts.from_experts(self.gate_up[i], self.down[i], (128, 128) if fp8 == "block" else None)
                self.gate_up[i], self.down[i], self.scales[i] = f.gate_up_proj, f.down_proj, f.scales
            self.expert_bytes = EXPERT_BYTES // 2
        self.router = [torch.randn(EXPERTS, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g) * HIDDEN ** -0.5
                       for _ in range(LAYERS)]
        self.norm = [1.0 + 0.1 * torch.randn(HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g)
                     for _ in range(LAYERS)]
        with torch.device("cuda"):  # the dense SwiGLU MLP of the same active width (top-8 x 768 = 6144)
            self.dense = [GatedMLP(HIDDEN, TOP_K * INTER).to(torch.bfloat16).eval().requires_grad_(False)
                          for _ in range(LAYERS)]


def measure(layers: Layers, rows: int, per_request: int, rho: float, bandwidth: float,
            cfg: K.MoeConfig | None = None, replays: int = 20) -> dict:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
    logits = [router_logits(rows, per_request, rho, gen) for _ in range(LAYERS)]
    routes = [K.route(z, TOP_K, True, torch.bfloat16) for z in logits]
    union = statistics.mean(ids.unique().numel() for _, ids in routes)
    full = [lambda i=i: K.fused_experts(x, layers.gate_up[i], layers.down[i], *K.route(logits[i], TOP_K, True, x.dtype),
                                        config=cfg, scales=layers.scales[i]) for i in range(LAYERS)]
    block_m = (cfg or K.moe_config(rows)).block_m
    only_routing = [lambda i=i: K.route(logits[i], TOP_K, True, x.dtype) if rows == 1 else  # one row: no align
                    K.align(K.route(logits[i], TOP_K, True, x.dtype)[1].view(-1), EXPERTS, block_m,
                            K.num_tiles(rows, TOP_K, EXPERTS, block_m)) for i in range(LAYERS)]
    t = statistics.median(graph_seconds(full, replays))
    t_route = statistics.median(graph_seconds(only_routing, replays))
    floor = union * layers.expert_bytes / bandwidth
    return {"rows": rows, "rows_per_request": per_request, "routing": "local" if rho else "uniform",
            "union_experts": union, "us": 1e6 * t, "route_align_us": 1e6 * t_route, "floor_us": 1e6 * floor,
            "of_floor": floor / t, "config": None if cfg is None else cfg.__dict__}


def dense_us(layers: Layers, rows: int, replays: int = 20) -> float:
    """The dense SwiGLU MLP of the same active width at `rows` rows (what `GatedMLP` runs: the skinny
    kernel up to 16 rows, cuBLAS above)."""
    x = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
    return 1e6 * statistics.median(graph_seconds([lambda m=m: m(x) for m in layers.dense], replays))


def one_row(layers: Layers, bandwidth: float, sweep: bool) -> dict:
    """One row with the layer's norm and residual, as a decode step runs the block: the norm, the router's
    streamed product (`K.ROUTER_TILE`), the route, the experts with each pair its own tile; with `sweep`,
    the router's product over ROUTER_SWEEP's tiles."""
    x = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    eps = 1e-6

    def router(i: int, rows: torch.Tensor = x, cfg: SkinnyConfig | None = None) -> torch.Tensor:
        return skinny_linear(rows, layers.router[i], config=cfg or K.ROUTER_TILE)

    def block(i: int) -> torch.Tensor:
        h = rms_norm(x, layers.norm[i], eps)
        weights, ids = K.route(router(i, h), TOP_K, True, x.dtype)
        return K.fused_experts(h, layers.gate_up[i], layers.down[i], weights, ids, residual=res,
                               scales=layers.scales[i])

    def us(fn) -> float:
        return 1e6 * statistics.median(graph_seconds([lambda i=i: fn(i) for i in range(LAYERS)], 20))

    floor = (TOP_K * layers.expert_bytes + EXPERTS * HIDDEN * 2) / bandwidth
    out = {"floor_us": 1e6 * floor, "block_us": us(block), "router_us": us(router), "router": []}
    print(f"one row, norm to residual: {out['block_us']:.1f} us (router {out['router_us']:.1f} us); floor "
          f"{out['floor_us']:.1f} us (8 experts and the router)")
    for c in ROUTER_SWEEP if sweep else ():
        out["router"].append({"tiles": c, "us": us(lambda i: router(i, cfg=SkinnyConfig(*c)))})
        print(f"router {c}: {out['router'][-1]['us']:.1f} us")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1,2,4,8,16,32,64,128,512,2048")
    p.add_argument("--sweep", action="store_true", help="also try the SWEEP tiles (at --sweep-rows)")
    p.add_argument("--sweep-rows", default="1,4,16,64")
    p.add_argument("--router-sweep", action="store_true", help="also try the ROUTER_SWEEP tiles at one row")
    p.add_argument("--fp8", default=None, choices=["channel", "block"],
                   help="the experts in e4m3, per output channel or over 128 x 128 blocks (default: bf16)")
    p.add_argument("--out", default="moe.json")
    args = p.parse_args()
    bandwidth = copy_bandwidth()
    layers = Layers(args.fp8)
    runs = []
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; one expert {layers.expert_bytes / 1e6:.1f} MB"
          f"{f' (e4m3, {args.fp8} scales)' if args.fp8 else ''}")
    print("rows  routing  per-req  union   us    route+align us  floor us  of floor  dense us")
    for rows in (int(r) for r in args.rows.split(",")):
        for per_request, rho in ((1, 0.0), (min(rows, 16), LOCAL_RHO)):  # local: requests of up to 16 rows
            if rho and (per_request == 1 or rows % per_request):
                continue
            run = measure(layers, rows, per_request, rho, bandwidth)
            if not rho:
                run["dense_same_active_us"] = dense_us(layers, rows)
            runs.append(run)
            print(f"{rows:5d}  {run['routing']:7s}  {per_request:7d}  {run['union_experts']:5.1f}  {run['us']:7.1f}  "
                  f"{run['route_align_us']:13.1f}  {run['floor_us']:8.1f}  {run['of_floor']:8.0%}  "
                  f"{run.get('dense_same_active_us', float('nan')):8.1f}")
    decode = one_row(layers, bandwidth, args.router_sweep)
    sweep = []
    if args.sweep:
        for rows in (int(r) for r in args.sweep_rows.split(",")):
            best = None
            for tiles in SWEEP:
                cfg = K.MoeConfig(max(16, 1 << (rows - 1).bit_length()), *tiles)
                try:
                    run = measure(layers, rows, 1, 0.0, bandwidth, cfg, replays=10)
                except Exception as exc:  # noqa: BLE001  a tile that does not fit (shared memory) is skipped
                    print(f"rows {rows} {tiles}: {type(exc).__name__}")
                    continue
                sweep.append(run)
                if best is None or run["us"] < best["us"]:
                    best = run
                print(f"rows {rows:3d} tiles {tiles}: {run['us']:.1f} us ({run['of_floor']:.0%} of floor)")
            if best is not None:
                print(f"best at {rows} rows: {best['config']} {best['us']:.1f} us")
    Path(args.out).write_text(json.dumps({"copy_bandwidth_TBps": bandwidth / 1e12, "fp8": args.fp8, "runs": runs,
                                          "sweep": sweep, "one_row": decode},
                                         indent=1))


if __name__ == "__main__":
    main()
