"""Seeded Gumbel-max sampling over a Qwen-sized vocabulary: the one-pass Triton kernel against the
torch ops of `rng.gumbel_from_keys`, at decode and verify row counts.

Each figure is device time per call (CUDA events, median of repeated runs after warm-up), eager as
the engine calls it, so the launches count. The floor of a call is its fp32 scores read once over
the measured copy bandwidth.

    python benchmarks/bench_sampling.py --out sampling.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from blockspec.bench.timing import add_run, copy_bandwidth, cuda_time, kernel_record
from blockspec.kernels.gumbel import gumbel_argmax_kernel
from blockspec.sample.rng import STREAM_TARGET, gumbel_from_keys, row_key

VOCAB = 151936


def measure(rows: int, bandwidth: float) -> dict:
    """Both samplers at one row count (checked to draw the same tokens first), with their floor."""
    scores = torch.randn(rows, VOCAB, device="cuda").log_softmax(-1)
    keys = row_key(torch.arange(rows, device="cuda"), torch.arange(rows, device="cuda") + 512, STREAM_TARGET, None)
    assert torch.equal(gumbel_argmax_kernel(scores, keys), (scores + gumbel_from_keys(keys, VOCAB)).argmax(1))
    floor = scores.numel() * 4 / bandwidth
    run = {"rows": rows, "floor_us": floor * 1e6}
    for name, fn in (("torch_ops", lambda: (scores + gumbel_from_keys(keys, VOCAB)).argmax(1)),
                     ("kernel", lambda: gumbel_argmax_kernel(scores, keys))):
        med, lo, hi = cuda_time(fn, iters=20, repeats=15)
        run[name + "_us"] = [med * 1e6, lo * 1e6, hi * 1e6]
        run[name + "_floor_ratio"] = floor / med
    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,16,64,256,1024", help="rows per call: decode batches, verify blocks")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    bw = copy_bandwidth()
    result = kernel_record(bw, vocab=VOCAB)
    for rows in (int(r) for r in args.rows.split(",")):
        add_run(result, measure(rows, bw))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
