"""FP8 weight products of a Qwen3-8B-shaped model against bf16, by row count: what `kernels.fp8`
dispatches to (the streaming kernel up to 16 rows, its row tiles (ROW_TILES) up to ROW_TILE_MAX_ROWS,
dequantize + cuBLAS above) and the alternatives at each size (tiles, dequantize + cuBLAS, and FP8 tensor
cores through torch._scaled_mm: per-token activation scales for per-channel weights, 1 x 128 groups for
128 x 128 blocks), per-channel and 128 x 128 block scales.

Each figure is one product timed as a CUDA graph of calls over enough weight copies to defeat the L2
cache, median of repeated replays; the floor is the FP8 weight bytes over the measured copy bandwidth.
`--sweep` first times a few streaming tiles at `--sweep-rows` (the bf16 tiles were tuned for bf16); its
kernels compile faster side by side:

    for i in $(seq 0 7); do python benchmarks/bench_fp8_gemm.py --sweep-rows 16,64 --compile-shard $i/8 & done
    wait
    python benchmarks/bench_fp8_gemm.py --sweep --sweep-rows 16,64 --out fp8_gemm.json
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

from blockspec.bench.timing import add_run, copy_bandwidth, graph_seconds, kernel_record
from blockspec.kernels import fp8
from blockspec.kernels import ops as triton_ops
from blockspec.kernels.ops import MultirowConfig, SkinnyConfig
from bench_gemv import multirow_space

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
L2_DEFEAT_BYTES = 512 << 20


class Case:
    """One product shape at one row count: bf16 weights and their FP8 copies (per channel, 128 x 128). With
    `glu` (gate_up) every path ends in SwiGLU over the product's halves, fused where the kernel takes it, as
    the engine calls that product."""

    def __init__(self, n: int, k: int, m: int, bf16: bool = True, copies: int | None = None, glu: bool = False
                 ) -> None:
        self.n, self.k, self.m, self.glu = n, k, m, glu
        copies = copies or max(1, -(-L2_DEFEAT_BYTES // (n * k)))
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
        self.bf16 = [w.clone() for _ in range(max(1, copies // 2))] if bf16 else []
        q, s = fp8.quantize_per_channel(w)
        self.channel = [(q.clone(), s, (1, k)) for _ in range(copies)]
        q, s = fp8.quantize_blocks(w, (128, 128))
        self.block = [(q.clone(), s, (128, 128)) for _ in range(copies)]
        self.x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)

    def tiles(self) -> MultirowConfig:
        return MultirowConfig(*fp8.MULTIROW_TILES[triton_ops.product_class(self.n, self.k)])

    def calls(self, kind: str, path: str, cfg: SkinnyConfig | MultirowConfig | None = None
              ) -> list[Callable[[], object]]:
        """`path`: dispatch (what fp8_linear runs), skinny (cfg's tiles), tiles (the row tiles of
        fp8.ROW_TILES at any row count), multirow (`multirow_linear`, cfg's tiles or fp8.MULTIROW_TILES),
        dequantize (+ cuBLAS), scaled_mm."""
        x, glu = self.x, self.glu
        swiglu = triton_ops.silu_mul if glu else (lambda y: y)  # the unfused paths' SwiGLU kernel
        if kind == "bf16":
            if path == "skinny":
                return [lambda w=w: triton_ops.skinny_linear(x, w, glu=glu, config=cfg) for w in self.bf16]
            if path == "multirow":
                return [lambda w=w: triton_ops.multirow_linear(x, w, glu=glu, config=cfg or self.tiles())
                        for w in self.bf16]
            return [lambda w=w: swiglu(F.linear(x, w)) for w in self.bf16]
        weights = self.channel if kind == "channel" else self.block
        if path == "dispatch":
            return [lambda a=a: fp8.fp8_linear(x, *a, glu=glu) for a in weights]
        if path in ("skinny", "tiles"):
            cfg = fp8.ROW_TILES[triton_ops.product_class(self.n, self.k)] if path == "tiles" else cfg
            return [lambda a=a: triton_ops.skinny_linear(x, a[0], glu=glu, weight_scale=a[1], scale_block=a[2],
                                                         config=cfg) for a in weights]
        if path == "multirow":
            return [lambda a=a: triton_ops.multirow_linear(x, a[0], glu=glu, weight_scale=a[1], scale_block=a[2],
                                                           config=cfg or self.tiles()) for a in weights]
        if path == "dequantize":
            return [lambda a=a: swiglu(F.linear(x, fp8.dequantize(*a, x.dtype))) for a in weights]
        if path == "scaled_mm":
            mm = fp8.scaled_mm_rowwise if kind == "channel" else fp8.scaled_mm_blockwise
            return [lambda a=a: swiglu(mm(x, a[0], a[1])) for a in weights]
        raise ValueError(path)


def timed(calls: list[Callable[[], object]]) -> float | str:
    try:
        return statistics.median(graph_seconds(calls)) * 1e6
    except Exception as exc:  # a tile that does not fit, a recipe this build lacks
        return repr(exc)[:120]


def sweep_space(m: int) -> list[SkinnyConfig]:
    """Tiles to time at m rows. At one row, the bf16 table's best tiles and tiles of more columns and shorter
    K (the fp32 partial sums a program holds, columns x K, stay at most 8k): a program then streams more
    bytes past its fixed costs. Above 16 rows, tiles of 64 and 128 rows (a program converts its weight
    tile once for all its rows) and column tiles from 32 (more programs for o and down, n = 4096) to 128."""
    if m == 1:
        shapes = [(8, 512), (16, 512), (8, 1024), (16, 256), (32, 256), (32, 128), (64, 128), (64, 64), (128, 64)]
        grid = ((1, n, k, w, s) for (n, k), w, s in itertools.product(shapes, [4, 8], [1, 3]))
    elif m <= triton_ops.SKINNY_MAX_ROWS:
        grid = itertools.product([16], [32, 64], [256, 512], [4], [2, 3])
    else:
        grid = itertools.product([64, 128], [32, 64, 128], [128, 256], [4, 8], [3])
    return [SkinnyConfig(*c) for c in grid]


def sweep(result: dict, rows: list[int], bw: float, shard: tuple[int, int] | None = None) -> None:
    """Each tile of the sweep space of each row count, per-channel and 128 x 128 scales, all four shapes:
    us and the FP8 bytes' time over it. `shard` (i, n): only compile the i-th of n parts (one call each,
    one weight copy), so that n processes fill Triton's cache side by side first."""
    for m in rows:
        cases = {name: Case(n, k, m, bf16=False, copies=1 if shard else None, glu=name == "gate_up")
                 for name, (n, k) in SHAPES.items()}
        points = list(itertools.product(sweep_space(m), ("channel", "block")))
        for cfg, kind in points[shard[0]::shard[1]] if shard else points:
            if shard:
                for case in cases.values():
                    try:
                        case.calls(kind, "skinny", cfg)[0]()
                    except Exception:  # a tile that does not fit: the timed pass records it
                        pass
                continue
            row = {"rows": m, "scales": kind, "config": cfg.__dict__}
            for name, case in cases.items():
                t = timed(case.calls(kind, "skinny", cfg))
                row[name + "_us"] = t
                row[name + "_floor_ratio"] = case.n * case.k / bw / (t * 1e-6) if isinstance(t, float) else t
            result["sweep"].append(row)
            print(json.dumps(row), flush=True)
        del cases
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,16,64,144,256,2048")
    ap.add_argument("--sweep", action="store_true", help="time streaming tiles at --sweep-rows first")
    ap.add_argument("--sweep-rows", default="1,16", help="row counts of the sweep (above 16: the row tiles)")
    ap.add_argument("--compile-shard", default=None, metavar="I/N",
                    help="only compile part I of N of the sweep (run N of these side by side first)")
    ap.add_argument("--multirow-rows", default="", help="row counts at which to sweep `multirow_linear`'s tiles "
                                                         "(each compiles), e.g. 144,256")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="only these products, e.g. gate_up,down")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.compile_shard:
        i, n = (int(v) for v in args.compile_shard.split("/"))
        sweep({}, [int(r) for r in args.sweep_rows.split(",")], 0.0, (i, n))
        return
    bw = copy_bandwidth()
    result = kernel_record(bw, row_tile_max_rows=fp8.ROW_TILE_MAX_ROWS,
                           row_tiles={c: cfg.__dict__ for c, cfg in fp8.ROW_TILES.items()}, sweep=[])
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, list)}), flush=True)
    if args.sweep:
        sweep(result, [int(r) for r in args.sweep_rows.split(",")], bw)
    for m in (int(r) for r in args.multirow_rows.split(",") if r):
        for name in args.shapes.split(","):
            n, k = SHAPES[name]
            case = Case(n, k, m, bf16=False, glu=name == "gate_up")
            for kind in ("channel", "block"):
                row = {"rows": m, "layer": name, "scales": kind, "fp8_floor_us": n * k / bw * 1e6,
                       "dispatch_us": timed(case.calls(kind, "dispatch"))}
                for cfg in multirow_space(n // 2 if name == "gate_up" else n):
                    row[",".join(str(v) for v in cfg.__dict__.values())] = timed(case.calls(kind, "multirow", cfg))
                result["sweep"].append(row)
                tiles = {key: v for key, v in row.items() if "," in key and isinstance(v, float)}
                best = min(tiles, key=tiles.get)
                print(json.dumps({key: row[key] for key in ("rows", "layer", "scales", "fp8_floor_us", "dispatch_us")}
                                 | {"best": best, "best_us": tiles[best]}), flush=True)
            del case
            torch.cuda.empty_cache()
    for m in (int(r) for r in args.rows.split(",") if r):
        for name in args.shapes.split(","):
            n, k = SHAPES[name]
            case = Case(n, k, m, glu=name == "gate_up")
            floor = n * k / bw
            run = {"rows": m, "layer": name, "n": n, "k": k, "fp8_floor_us": floor * 1e6,
                   "bf16_floor_us": 2 * floor * 1e6}
            run["bf16_us"] = timed(case.calls("bf16", "skinny" if m <= triton_ops.SKINNY_MAX_ROWS else "cublas"))
            wide = m > triton_ops.SKINNY_MAX_ROWS
            if wide:
                run["bf16_multirow_us"] = timed(case.calls("bf16", "multirow"))
            paths = ["dispatch"] + (["tiles", "multirow", "dequantize"] if wide else [])
            for kind in ("channel", "block"):
                for path in paths + (["scaled_mm"] if wide else []):
                    t = timed(case.calls(kind, path))
                    run[f"{kind}_{path}_us"] = t
                    if isinstance(t, float) and isinstance(run["bf16_us"], float):
                        run[f"{kind}_{path}_vs_bf16"] = run["bf16_us"] / t
            del case
            add_run(result, run)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
