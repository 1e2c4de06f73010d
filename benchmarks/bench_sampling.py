"""Seeded Gumbel-max sampling over a Qwen-sized vocabulary: the one-pass Triton kernel against the
torch ops of `rng.gumbel_from_keys`, at decode and verify row counts.

Each figure is device time per call (CUDA events, median of repeated runs after warm-up), eager as
the engine calls it, so the launches count. The floor of a call is its fp32 scores read once over
the measured copy bandwidth.

    python benchmarks/bench_sampling.py --out sampling.json
    python benchmarks/bench_sampling.py --device cpu --rows 1,16,64   # the CPU's blocked path vs whole rows

On a CPU (no kernel) it compares the sampler's blocked Gumbel-max (`sampler.gumbel_argmax`: cache-sized blocks,
a running argmax) with the torch ops over whole rows, in interleaved rounds, wall time; the floor there is the
scores read once at the bandwidth of one pass over a 512 MB tensor.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from blockspec.bench.timing import add_run, copy_bandwidth, cpu_read_bandwidth, cuda_time, kernel_record, wall_seconds
from blockspec.kernels.gumbel import gumbel_argmax_kernel
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
        add_run(result, measure(rows, bw))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
