"""Programmatic dependent launch (PDL) against plain launches, in a graphed decode step of a random-weight
target: one runner (and CUDA graph) per launch mode over the same weights, timed in interleaved rounds.

Modes: `off` (plain launches) and `on` (the decode path's kernels launched with PDL, `kernels.PDL`); a mode
may repeat, to show the spread between two runners of the same mode. Floor: the bytes the graphed forward reads (`bench.arch.step_bytes` less the LM head, which the runner's
hidden states stop before) over the measured copy bandwidth. Each mode's
hidden states are checked bit for bit against `off`'s.

    PYTHONPATH=.:benchmarks python benchmarks/bench_pdl.py --arch qwen3-8b --quantization none,fp8 --out pdl.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from blockspec import kernels
from blockspec.bench.arch import ARCHS, get_arch, random_target, step_bytes
from blockspec.bench.timing import copy_bandwidth, cuda_time
from blockspec.kernels.attention import resolve_backend
from blockspec.models.quant import quantize_model
from blockspec.models.runner import ModelRunner


def set_mode(mode: str) -> None:
    if mode not in ("off", "on"):
        raise SystemExit(f"bench_pdl: mode {mode!r} is not off or on")
    kernels.PDL = mode == "on"


def measure(model: torch.nn.Module, modes: list[str], batch: int, context: int, iters: int, rounds: int,
            floor_s: float, checks: int) -> dict:
    """Each mode's decode graph (the runner's own capture) replayed `iters` times a sample, the modes in
    rotating order each round; its output checked against the first mode's, and against itself over
    `checks` replays (a launch race would show as a replay that differs)."""
    slots = list(range(batch))
    prompt = torch.randint(0, 150000, (batch, context), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    last = prompt[:, -1:].contiguous()
    labels = [f"{m}#{i}" if modes.count(m) > 1 else m for i, m in enumerate(modes)]
    graphs, outputs, unstable = {}, {}, {}
    for label, mode in zip(labels, modes):
        set_mode(mode)
        runner = ModelRunner(model, batch, context + 64)
        runner.forward_ids(prompt, [context] * batch, [0] * batch, slots)  # prefill (eager)
        for _ in range(3):  # compile, capture, replay
            runner.forward_ids(last, [1] * batch, [context] * batch, slots)
        captured = list(runner.graphs.values())[-1]  # the decode graph
        outputs[label] = captured.hidden.clone()
        unstable[label] = 0
        for _ in range(checks):
            captured.graph.replay()
            unstable[label] += not torch.equal(captured.hidden, outputs[label])
        graphs[label] = (runner, captured.graph)
    times: dict[str, list[float]] = {m: [] for m in labels}
    for r in range(rounds):
        for label in labels[r % len(labels):] + labels[:r % len(labels)]:
            times[label].append(cuda_time(graphs[label][1].replay, iters, 1)[0])
    base = labels[0]
    report = {}
    for label in labels:
        ratios = sorted(b / t for b, t in zip(times[base], times[label]))
        med = statistics.median(times[label])
        report[label] = {"step_ms": med * 1e3, "step_ms_min": min(times[label]) * 1e3,
                         "step_ms_max": max(times[label]) * 1e3, "of_floor": floor_s / med,
                         f"speedup_vs_{base}": statistics.median(ratios), "speedup_min": ratios[0],
                         "speedup_max": ratios[-1], "identical_to_base": bool(torch.equal(outputs[label], outputs[base])),
                         "replays_differing": unstable[label], "replays_checked": checks}
        print(label, json.dumps(report[label]), flush=True)
    return report


def forward_bytes(model: torch.nn.Module) -> int:
    """A decode step's bytes without the LM head's (unless tied to the embedding, which they leave out)."""
    head = model.lm_head.weight
    return step_bytes(model) - (0 if head is model.embed_tokens.weight else head.numel() * head.element_size())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="qwen3-8b", choices=list(ARCHS))
    ap.add_argument("--quantization", default="none", help="comma list of none, fp8 (quantized in place, in turn)")
    ap.add_argument("--modes", default="off,on")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--checks", type=int, default=50, help="replays checked bit for bit against the first")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    bw = copy_bandwidth()
    model = random_target(get_arch(args.arch).target, args.context + 128)
    model.attention_backend = resolve_backend("triton", torch.device("cuda"))
    result = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "arch": args.arch, "batch": args.batch, "context": args.context, "copy_bandwidth_TBps": bw / 1e12,
              "runs": {}}
    for quant in args.quantization.split(","):
        if quant != "none":
            quantize_model(model, quant)
        floor_s = forward_bytes(model) / bw
        print(f"{args.arch} {quant}: floor {floor_s * 1e3:.3f} ms", flush=True)
        result["runs"][quant] = {"floor_ms": floor_s * 1e3,
                                 **measure(model, args.modes.split(","), args.batch, args.context, args.iters,
                                           args.rounds, floor_s, args.checks)}
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
