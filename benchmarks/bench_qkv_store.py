"""The fused q/k RMSNorm + RoPE + paged K/V store (`qkv_rope_store`) by heads a program and row count,
against its bytes' floor (qkv read, q, k and v written, at the measured copy bandwidth): one head a
program is launch-bound at verify widths, a group of heads loses a little at one row.

    PYTHONPATH=. python benchmarks/bench_qkv_store.py --groups 1,2,4,8 --rows 1,16,144,576,1600
"""

from __future__ import annotations

import argparse
import statistics

import torch

from blockspec.bench.timing import copy_bandwidth, graph_seconds
from blockspec.kernels.ops import qkv_rope_store


def inputs(rows: int, q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, page: int = 64,
           device: str = "cuda") -> tuple:
    """Rows of one token each, every row its own request at position 500 + row (pages of `page`)."""
    g = torch.Generator(device=device).manual_seed(0)
    qkv = torch.randn(rows, 1, (q_heads + 2 * kv_heads) * head_dim, device=device, dtype=dtype, generator=g)
    qw, kw = (torch.randn(head_dim, device=device, dtype=dtype, generator=g) for _ in range(2))
    inv = 1e6 ** -(torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    angles = (torch.arange(rows, device=device)[:, None] + 500.0) * inv[None]
    angles = torch.cat([angles, angles], -1)[:, None]
    k_cache = torch.zeros(2 * rows, kv_heads, page, head_dim, device=device, dtype=dtype)
    table = torch.arange(2 * rows, device=device, dtype=torch.int32).view(rows, 2)
    slots = torch.arange(rows, device=device, dtype=torch.int32)
    write_pos = torch.full((rows, 1), page + 6, device=device, dtype=torch.int32)
    return (qkv, q_heads, kv_heads, head_dim, qw, kw, 1e-6, angles.cos(), angles.sin(), k_cache,
            torch.zeros_like(k_cache), table, slots, write_pos)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", default="1,2,4,8")
    ap.add_argument("--rows", default="1,16,144,576,1600")
    ap.add_argument("--heads", default="32,8,128", help="q heads, kv heads, head_dim (default Qwen3-8B)")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    args = ap.parse_args()
    q_heads, kv_heads, head_dim = (int(v) for v in args.heads.split(","))
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; us per call, median (min-max) of 20 replays of 20 calls")
    print("| dtype | rows | floor us | " + " | ".join(f"{g} heads a program" for g in args.groups.split(",")) + " |")
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
        for rows in (int(r) for r in args.rows.split(",")):
            call = inputs(rows, q_heads, kv_heads, head_dim, dtype)
            # qkv read (q + 2 kv heads), then q and the k, v heads written
            floor = rows * (2 * q_heads + 4 * kv_heads) * head_dim * dtype.itemsize / bandwidth * 1e6
            cells = []
            for group in (int(g) for g in args.groups.split(",")):
                us = [t * 1e6 for t in graph_seconds([lambda: qkv_rope_store(*call, group=group)] * 20)]
                cells.append(f"{statistics.median(us):.2f} ({min(us):.2f}-{max(us):.2f})")
            print(f"| {str(dtype)[6:]} | {rows} | {floor:.2f} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
