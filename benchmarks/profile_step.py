"""Where a step's time goes on the GPU, for a random-weight target of a bench shape (`--arch`, Qwen3-8B by
default), with FP8 weights or an FP8 KV cache when asked:

- per-kernel CUDA time of one eager target forward (decode and a 512-token prefill), every kernel visible;
- per-kernel CUDA time of engine steps (CUDA graphs), plain, DFlash and DSpark (`--batch`, `--k`,
  `--temperature`);
- each step's wall time against its kernel time (the difference is the GPU waiting for the host),
  and the host's hottest Python functions (cProfile) over the same steps.

    PYTHONPATH=.:benchmarks python benchmarks/profile_step.py --out profile.txt
    PYTHONPATH=.:benchmarks python benchmarks/profile_step.py --arch qwen3-30b-a3b --methods plain --skip-eager
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from blockspec import kernels
from blockspec.bench.arch import ARCHS, get_arch, random_drafter, random_target
from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.engine.engine import Engine
from blockspec.models.quant import quantize_model
from blockspec.models.runner import ModelRunner
from blockspec.sampling_params import SamplingParams


def kernel_ms(prof: profile) -> tuple[float, list]:
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: -e.self_device_time_total)
    return sum(e.self_device_time_total for e in events) / 1e3, events


def table(prof: profile, title: str, steps: int, rows: int = 25) -> str:
    total, events = kernel_ms(prof)
    lines = [f"== {title}: {total / steps:.3f} ms of kernels per step, "
             f"{sum(e.count for e in events) / steps:.0f} kernels per step"]
    for e in events[:rows]:
        lines.append(f"{e.self_device_time_total / steps / 1e3:8.3f} ms {e.count / steps:6.1f}x  {e.key[:110]}")
    return "\n".join(lines)


def eager_forwards(target: torch.nn.Module, context: int, steps: int) -> list[str]:
    out = []
    for backend in ("sdpa", "triton"):
        target.attention_backend = backend
        runner = ModelRunner(target, 1, context + 64, use_cuda_graphs=False)
        prompt = torch.randint(0, 150000, (1, context), device="cuda")
        for _ in range(2):
            runner.forward_ids(prompt, [context], [0], [0])
        torch.cuda.synchronize()
        walls = []
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                runner.forward_ids(prompt, [context], [0], [0])
                b.record()
                b.synchronize()
                walls.append(a.elapsed_time(b))
        out.append(f"(prefill of {context} tokens: {statistics.median(walls):.2f} ms wall, median of {steps})\n"
                   + table(prof, f"eager prefill forward, {context} tokens, {backend}", steps, rows=12)
                   + "\n" + host_hot_spots(lambda: runner.forward_ids(prompt, [context], [0], [0]), steps,
                                           f"eager prefill, {backend}"))
        last = prompt[:, -1:].contiguous()
        for _ in range(3):
            runner.greedy_ids(runner.forward_ids(last, [1], [context], [0])[0])
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                runner.greedy_ids(runner.forward_ids(last, [1], [context], [0])[0])
            torch.cuda.synchronize()
        out.append(table(prof, f"eager decode forward + head, batch 1, {backend}", steps))
        print("\n\n".join(out[-2:]), flush=True)
        del runner
    return out


def engine_steps(engine: Engine, name: str, context: int, steps: int, speculate: bool, batch: int,
                 temperature: float = 0.0) -> list[str]:
    """Kernel table, wall vs kernel time, and host hot spots of `steps` steady decode steps."""
    params = SamplingParams(temperature=temperature, seed=0, max_tokens=100000, ignore_eos=True,
                            use_speculation=speculate)
    for i in range(batch):
        engine.add_request(f"{name}-{i}", None, torch.randint(0, 150000, (context,)).tolist(), params)
    for _ in range(8 + -(-batch * context // engine.config.max_prefill_tokens)):
        engine.step()  # prefill (in chunks of max_prefill_tokens), catch-up, policy, allocator
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    walls = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()  # ends on its one host copy of the step's tokens
        walls.append((time.perf_counter() - t0) * 1e3)
    hot = host_hot_spots(engine.step, steps, name)
    for i in range(batch):
        engine.abort(f"{name}-{i}")
    kernel_total, _ = kernel_ms(prof)
    wall = statistics.median(walls)
    gap = wall - kernel_total / steps
    # with programmatic dependent launch a kernel's time includes its wait for the one before: kernels overlap
    gap_note = f"the GPU waits {gap:.3f} ms per step" if gap >= 0 else (
        f"kernels overlap by {-gap:.3f} ms per step (each dependent launch's time counts its wait)")
    return [table(prof, f"engine steps (CUDA graphs), {name}, batch {batch}", steps),
            f"== {name}: wall {wall:.3f} ms per step (min {min(walls):.3f}, max {max(walls):.3f}), kernels "
            f"{kernel_total / steps:.3f} ms: {gap_note}", hot]


def host_hot_spots(fn: Callable[[], object], calls: int, name: str, rows: int = 22) -> str:
    """The host's hottest Python functions over `calls` calls of fn (cProfile, which slows Python)."""
    host = cProfile.Profile()
    host.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    host.disable()
    text = io.StringIO()
    pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(rows)
    hot = "\n".join(line for line in text.getvalue().splitlines() if line.strip())
    return f"== host hot spots, {name} ({calls} calls under cProfile)\n{hot}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--skip-eager", action="store_true", help="engine steps only")
    ap.add_argument("--batch", type=int, default=1, help="requests per engine step")
    ap.add_argument("--k", type=int, default=None, help="drafts per speculative step (default: the block's)")
    ap.add_argument("--arch", default="qwen3-8b", choices=list(ARCHS))
    ap.add_argument("--methods", default="plain,dflash,dspark", help="comma list of plain, dflash, dspark")
    ap.add_argument("--quantization", default=None, choices=["fp8"], help="the target's weights in FP8 (per channel)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    ap.add_argument("--no-pdl", action="store_true",
                    help="plain launches: with programmatic dependent launch a kernel's time counts its wait")
    ap.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of the requests")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    kernels.PDL = not args.no_pdl
    arch = get_arch(args.arch)
    methods = args.methods.split(",")
    target = random_target(arch.target, args.context + 2048)
    if args.quantization:
        quantize_model(target, args.quantization)
    out = [] if args.skip_eager else eager_forwards(target, args.context, args.steps)
    for method, cfg in (("dflash", arch.dflash), ("dspark", arch.dspark())):
        wanted = [(False, "plain")] if method == "dflash" and "plain" in methods else []
        wanted += [(True, method)] if method in methods else []
        if not wanted:
            continue
        drafter = random_drafter(cfg, heads=arch.dspark_heads if method == "dspark" else None)
        spec = SpeculativeConfig(method=method, model="(random)", adaptive_draft_length=False,
                                 num_speculative_tokens=args.k and min(args.k, drafter.num_draft_slots))
        engine = Engine(target, None, EngineConfig(max_model_len=args.context + 1024, max_num_seqs=args.batch,
                                                   attention_backend=args.attention_backend,
                                                   kv_cache_dtype=args.kv_cache_dtype), spec, drafter)
        engine.warmup()
        for speculate, name in wanted:
            name = f"{name} K={engine.proposer.num_speculative_tokens}" if speculate else name
            out += engine_steps(engine, name, args.context, args.steps, speculate, args.batch, args.temperature)
            print("\n\n".join(out[-3:]), flush=True)
        del engine
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n\n".join(out) + "\n")


if __name__ == "__main__":
    main()
