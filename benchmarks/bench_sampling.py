"""Seeded Gumbel-max sampling over a Qwen-sized vocabulary: the one-pass Triton kernel against the
torch ops of `rng.gumbel_from_keys`, at decode and verify row counts.

Each figure is device time per call (CUDA events, median of repeated runs after warm-up), eager as
the engine calls it, so the launches count. The floor of a call is its fp32 scores read once over
the measured copy bandwidth.

    python benchmarks/bench_sampling.py --out sampling.json
    python benchmarks/bench_sampling.py --device cpu --rows 1,16,64   # the CPU's blocked path vs whole rows
    python benchmarks/bench_sampling.py --greedy --rows 1,32,256   # greedy ids: the one-pass kernel vs torch's max

`--greedy` times `greedy_ids` (bf16 logits, as the verify's head gives them) through torch's max reduction and
through `greedy_ids_kernel` at a few column blocks, program counts and warps a program, each in CUDA graphs over
copies of the logits that together pass the L2 cache, in interleaved rounds; the floor is the logits read once.

On a CPU (no kernel) it compares the sampler's blocked Gumbel-max (`sampler.gumbel_argmax`: cache-sized blocks,
a running argmax) with the torch ops over whole rows, in interleaved rounds, wall time; the floor there is the
scores read once at the bandwidth of one pass over a 512 MB tensor.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from pathlib import Path

import torch

from blockspec.bench.timing import (add_run, copy_bandwidth, cpu_read_bandwidth, cuda_time, graph_seconds,
                                    kernel_record, wall_seconds)
from blockspec.kernels.gumbel import GREEDY_BLOCK, greedy_ids_kernel, gumbel_argmax_kernel
from blockspec.sample.rng import STREAM_TARGET, gumbel_from_keys, row_key
from blockspec.sample.sampler import gumbel_argmax

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


def measure_greedy(rows: int, bandwidth: float, rounds: int = 5) -> dict:
    """Greedy ids of bf16 logits: torch's max reduction and the kernel at a few launch shapes (checked to give the
    same ids first), A B C ... per round, median and range of each, us a call."""
    copies = max(2, -(-(256 << 20) // (rows * VOCAB * 2)))
    logits = [torch.randn(rows, VOCAB, device="cuda").to(torch.bfloat16) for _ in range(copies)]

    def torch_max(x: torch.Tensor) -> torch.Tensor:
        values, ids = x.max(dim=-1)
        return torch.where(torch.isfinite(values), ids, -1)

    paths = {"torch_max": torch_max}
    for block, programs, warps in itertools.product(sorted({GREEDY_BLOCK, 4096}), (528, 2112), (4, 8)):
        paths[f"kernel_b{block}_p{programs}_w{warps}"] = \
            lambda x, b=block, p=programs, w=warps: greedy_ids_kernel(x, programs=p, block=b, warps=w)
    for fn in paths.values():
        assert torch.equal(fn(logits[0]), torch_max(logits[0]))
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(rounds):
        for name, fn in paths.items():
            times[name].append(statistics.median(graph_seconds([lambda x=x: fn(x) for x in logits], 10)))
    floor = rows * VOCAB * 2 / bandwidth
    run = {"rows": rows, "floor_us": floor * 1e6}
    for name, ts in times.items():
        run[name + "_us"] = [statistics.median(ts) * 1e6, min(ts) * 1e6, max(ts) * 1e6]
    return run


def measure_cpu(rows: int, bandwidth: float, rounds: int = 7) -> dict:
    """The blocked path and whole-row torch ops at one row count, A B A B ..., median and range of each."""
    scores = torch.randn(rows, VOCAB).log_softmax(-1)
    keys = row_key(torch.arange(rows), torch.arange(rows) + 512, STREAM_TARGET, None)
    whole = lambda: (scores + gumbel_from_keys(keys, VOCAB)).argmax(1)  # noqa: E731
    blocked = lambda: gumbel_argmax(scores, keys)  # noqa: E731
    assert torch.equal(blocked(), whole())
    times: dict[str, list[float]] = {"whole_rows": [], "blocked": []}
    for _ in range(rounds):
        for name, fn in (("whole_rows", whole), ("blocked", blocked)):
            times[name].append(wall_seconds(fn))
    floor = scores.numel() * 4 / bandwidth
    run = {"rows": rows, "floor_ms": floor * 1e3}
    for name, ts in times.items():
        run[name + "_ms"] = [statistics.median(ts) * 1e3, min(ts) * 1e3, max(ts) * 1e3]
        run[name + "_floor_ratio"] = floor / statistics.median(ts)
    run["speedup"] = statistics.median(times["whole_rows"]) / statistics.median(times["blocked"])
    print(json.dumps(run), flush=True)
    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,16,64,256,1024", help="rows per call: decode batches, verify blocks")
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--greedy", action="store_true", help="greedy ids (bf16 logits) instead of sampling")
    args = ap.parse_args()
    if args.device == "cpu":
        bw = cpu_read_bandwidth()
        runs = [measure_cpu(int(r), bw) for r in args.rows.split(",")]
        result = {"device": "cpu", "threads": torch.get_num_threads(), "read_bandwidth_gb_s": bw / 1e9,
                  "vocab": VOCAB, "runs": runs}
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
        return
    bw = copy_bandwidth()
    result = kernel_record(bw, vocab=VOCAB)
    for rows in (int(r) for r in args.rows.split(",")):
        add_run(result, measure_greedy(rows, bw) if args.greedy else measure(rows, bw))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
