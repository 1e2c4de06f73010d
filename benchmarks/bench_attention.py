"""The attention kernel at Qwen3-8B's heads (32 query, 8 KV, head_dim 128, bf16 queries; bf16 or FP8 e4m3
K/V pages, `--kv-dtype`): decode (one row),
verify (`--rows` causal rows, 16 by default) and draft (as many rows over the context and the block) at several batches,
contexts and cache extents, for launch shapes (`AttentionTiles`, `--variants`), on shuffled pages
of `--page-size` positions and on one page a slot (the layout before paging), next to the bytes
that bound them.

The engine's CUDA graphs launch over the whole cache (the extent), whatever the context; `--extents`
0 means a cache just long enough. Each figure is a CUDA graph of one call per layer (36 layers, each
its own cache, so keys stream from HBM as in a step), median of repeated replays, per call. The
floor of a call is the K/V bytes its rows read over the measured copy bandwidth; at these sizes
latency, not bandwidth, bounds the kernel, so the floor says how far there is to go, not where.

    python benchmarks/bench_attention.py --out attention.json [--baseline old_triton_attention.py]

`--baseline` times other versions of the kernel module (`git show REV:blockspec/models/
triton_attention.py`): a paged one on the same pages, one from before paging (slots, no page
table) on the one-page-a-slot caches.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import inspect
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from blockspec.bench.timing import copy_bandwidth, graph_seconds
from blockspec.kernels.attention import AttentionTiles, block_attention

Q_HEADS, KV_HEADS, HEAD_DIM, LAYERS, BLOCK = 32, 8, 128, 36, 16
VARIANTS = {
    "default": AttentionTiles(),
    "wide min 2": AttentionTiles(min_tiles_wide=2),
    "wide min 3": AttentionTiles(min_tiles_wide=3),
    "wide used 4": AttentionTiles(max_used_wide=4),
    "wide used 16": AttentionTiles(max_used_wide=16),
    "wide used 33": AttentionTiles(max_used_wide=33, min_tiles_wide=1),
    "programs 8": AttentionTiles(target_programs=8),  # batch-1 decode unsplit (8 KV heads)
    "programs 16": AttentionTiles(target_programs=16),
    "programs 32": AttentionTiles(target_programs=32),
    "programs 64": AttentionTiles(target_programs=64),
    "programs 132": AttentionTiles(target_programs=132),
    "merge unroll 8": AttentionTiles(merge_unroll=8),
    "per-key from 2 splits": AttentionTiles(per_key_splits=2),
    "per-key from 4 splits": AttentionTiles(per_key_splits=4),
    "per-key from 8 splits": AttentionTiles(per_key_splits=8),
    "per-key from 16 splits": AttentionTiles(per_key_splits=16),
    "per-key never": AttentionTiles(per_key_splits=1 << 30),
    # key tiles of bf16 pages (fp8 pages take fp8_block_n: 128 keys move a bf16 tile's bytes)
    "key tile 32": AttentionTiles(block_n=32),
    "key tile 128": AttentionTiles(block_n=128),
    "fp8 key tile 64": AttentionTiles(fp8_block_n=64),
    "programs 528": AttentionTiles(target_programs=528),
    "programs 1056": AttentionTiles(target_programs=1056),
    "warps 8": AttentionTiles(num_warps=8),
    "stages 1": AttentionTiles(num_stages=1),
    "stages 2": AttentionTiles(num_stages=2),
    "fp8 V bytes": AttentionTiles(fp8_v_staged=False),  # FP8 V transposed as 8-bit values (byte loads)
    "stages 4": AttentionTiles(num_stages=4),
    "every tile masked": AttentionTiles(edge_masks=False),
}
KV_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
CACHE_BUDGET = 48 << 30  # bytes of K/V caches one case may allocate


def bounds(kind: str, batch: int, context: int, block: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """lo / hi [batch, rows] of each kind's rows, and its row count: decode reads context + 1 keys,
    verify rows (`block` of them) end at their own positions, the draft block reads the context and the
    whole block."""
    rows = 1 if kind == "decode" else block
    pos = context + torch.arange(rows, device="cuda")
    hi = (torch.full_like(pos, context + rows - 1) if kind == "draft" else pos).expand(batch, rows).contiguous()
    return torch.zeros_like(hi), hi, rows


def shuffled_pages(batch: int, keys: int, page: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A K or V pool of `batch` slots of `keys` positions in pages of `page`, the pages in random order
    (as a busy engine leaves them), and the table that finds them."""
    cols = -(-keys // page)
    table = torch.randperm(batch * cols, device="cuda").view(batch, cols).to(torch.int32)
    pool = torch.randn(batch * cols, KV_HEADS, page, HEAD_DIM, device="cuda", dtype=torch.bfloat16).to(dtype)
    return pool, table


def run(args: argparse.Namespace) -> dict:
    bandwidth = copy_bandwidth()
    kernels: dict[str, Callable[..., torch.Tensor]] = {
        name: functools.partial(block_attention, tiles=VARIANTS[name]) for name in args.variants}
    baselines = {}
    for i, path in enumerate(args.baseline or []):
        spec = importlib.util.spec_from_file_location(f"baseline_attention_{i}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up while it loads
        spec.loader.exec_module(module)
        baselines[Path(path).stem] = module.block_attention
    kv = KV_DTYPES[args.kv_dtype]
    size = kv.itemsize
    results = []
    for batch in args.batches:
        for context in args.contexts:
            for extent in args.extents:
                keys = max(extent, context + args.rows + 1) + 1
                per_layer = 2 * 2 * batch * KV_HEADS * keys * HEAD_DIM * size  # one page a slot, and paged
                read = 2 * batch * KV_HEADS * (context + args.rows) * HEAD_DIM * size
                copies = max(2, min(LAYERS, -(-(256 << 20) // read)))
                if copies * per_layer > CACHE_BUDGET:
                    print(f"skip batch {batch} context {context} extent {keys}: {copies * per_layer / 2**30:.0f} GiB")
                    continue
                # one page a slot (the layout before paging, which --baseline reads), and shuffled pages
                slot_layout = [shuffled_pages(batch, keys, keys, kv) + shuffled_pages(batch, keys, keys, kv)[:1]
                               for _ in range(copies)]
                paged = [shuffled_pages(batch, keys, args.page_size, kv)
                         + shuffled_pages(batch, keys, args.page_size, kv)[:1] for _ in range(copies)]
                slots = torch.arange(batch, device="cuda")
                head_scale = torch.linspace(0.5, 2.0, KV_HEADS, device="cuda")
                for kind in args.kinds:
                    lo, hi, rows = bounds(kind, batch, context, args.rows)
                    q = torch.randn(batch, rows, Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
                    nbytes = 2 * batch * KV_HEADS * (int(hi.max()) + 1) * HEAD_DIM * size + 2 * q.numel() * 2
                    floor_us = nbytes / bandwidth * 1e6
                    row = dict(kind=kind, batch=batch, context=context, extent=keys, floor_us=floor_us, times={})
                    cases = {}
                    for name, kernel in kernels.items():
                        for layout, pools in ((f"pages of {args.page_size}", paged), ("one page a slot", slot_layout)):
                            cases[f"{name}, {layout}"] = [
                                functools.partial(kernel, q, k, v, table, slots, lo, hi, HEAD_DIM**-0.5, keys - 1)
                                for k, table, v in pools]
                        if args.head_scales:  # the same pages under a K and a V scale a KV head
                            cases[f"{name}, pages of {args.page_size}, scale a head"] = [
                                functools.partial(kernel, q, k, v, table, slots, lo, hi, HEAD_DIM**-0.5, keys - 1,
                                                  k_scale=head_scale, v_scale=head_scale) for k, table, v in paged]
                    for name, kernel in baselines.items():
                        if "table" in inspect.signature(kernel).parameters:  # a paged kernel: on the same pages
                            cases[name] = [functools.partial(kernel, q, k, v, table, slots, lo, hi, HEAD_DIM**-0.5,
                                                             keys - 1) for k, table, v in paged]
                        else:  # the slot kernel before paging, on the one-page-a-slot pools
                            cases[name] = [functools.partial(kernel, q, k, v, table.view(-1).long(), lo, hi,
                                                             HEAD_DIM**-0.5, keys - 1) for k, table, v in slot_layout]
                    for name, calls in cases.items():
                        times = graph_seconds(calls, args.replays)
                        row["times"][name] = {"us": statistics.median(times) * 1e6, "spread": max(times) / min(times)}
                    results.append(row)
                    best = min(row["times"], key=lambda n: row["times"][n]["us"])
                    print(f"{kind:6s} b{batch:<3d} ctx {context:6d} extent {keys:6d} floor {floor_us:6.2f} us | "
                          + " | ".join(f"{n} {t['us']:.2f}" for n, t in row["times"].items()) + f" | best: {best}",
                          flush=True)
                del slot_layout, paged
                torch.cuda.empty_cache()
    return dict(bandwidth_gb_s=bandwidth / 1e9, device=torch.cuda.get_device_name(), page_size=args.page_size,
                kv_dtype=args.kv_dtype,
                variants={n: asdict(VARIANTS[n]) for n in args.variants}, results=results)


def markdown(result: dict) -> str:
    names = list(result["results"][0]["times"])
    lines = [f"{result['device']}, copy bandwidth {result['bandwidth_gb_s']:.0f} GB/s, {result['kv_dtype']} pages; us per "
             "call (floor ratio)", "",
             "| kind | batch | context | extent | floor us | " + " | ".join(names) + " |",
             "|---" * (5 + len(names)) + "|"]
    for row in result["results"]:
        cells = [f"{row['times'][n]['us']:.2f} ({row['times'][n]['us'] / row['floor_us']:.1f}x)" for n in names]
        lines.append(f"| {row['kind']} | {row['batch']} | {row['context']} | {row['extent']} | "
                     f"{row['floor_us']:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--extents", type=int, nargs="+", default=[0, 32768],
                    help="cache length the graph launches over (0: context + block)")
    ap.add_argument("--kinds", nargs="+", default=["decode", "verify", "draft"], choices=["decode", "verify", "draft"])
    ap.add_argument("--rows", type=int, default=BLOCK,
                    help="rows of a verify or draft block (a verify of K drafts has K + 1)")
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--baseline", nargs="+", help="other triton_attention.py files to time beside this one (named "
                                                  "by file; one from before paging runs on one page a slot)")
    ap.add_argument("--page-size", type=int, default=16, help="positions a KV page holds")
    ap.add_argument("--variants", nargs="+", default=["default"], choices=list(VARIANTS),
                    help="launch shapes to time")
    ap.add_argument("--kv-dtype", default="bf16", choices=list(KV_DTYPES), help="the K/V pages' dtype")
    ap.add_argument("--head-scales", action="store_true",
                    help="also time each variant with a K and a V cache scale a KV head (FP8 pages' per-head scales)")
    ap.add_argument("--out", help="JSON file; a markdown table is written beside it")
    args = ap.parse_args()
    if args.baseline and args.kv_dtype != "bf16":
        ap.error("--baseline kernels read bf16 pages only")
    result = run(args)
    table = markdown(result)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        with open(args.out.rsplit(".", 1)[0] + ".md", "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
