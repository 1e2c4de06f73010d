"""Where a decode step's time goes on the GPU: per-kernel CUDA time of one target forward (eager, so
every kernel is visible) and of one engine step, plain and DFlash, for the Qwen3-8B shape.

    PYTHONPATH=.:benchmarks python benchmarks/profile_step.py --out profile.txt
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from bench_spec import drafters
from blockspec.bench.arch import QWEN3_8B, random_target
from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.engine.engine import Engine
from blockspec.engine.runner import ModelRunner
from blockspec.sampling_params import SamplingParams


def table(prof: profile, title: str, steps: int, rows: int = 25) -> str:
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in events)
    events.sort(key=lambda e: -e.self_device_time_total)
    lines = [f"== {title}: {total / steps / 1e3:.3f} ms of kernels per step, "
             f"{sum(e.count for e in events) / steps:.0f} kernels per step"]
    for e in events[:rows]:
        lines.append(f"{e.self_device_time_total / steps / 1e3:8.3f} ms {e.count / steps:6.1f}x  {e.key[:110]}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    target = random_target(QWEN3_8B, args.context + 2048)
    out = []
    for backend in ("sdpa", "triton"):
        target.attention_backend = backend
        runner = ModelRunner(target, 1, args.context + 64, use_cuda_graphs=False)
        prompt = torch.randint(0, 150000, (1, args.context), device="cuda")
        runner.forward_ids(prompt, [args.context], [0], [0])
        last = prompt[:, -1:].contiguous()
        for _ in range(3):
            runner.greedy_ids(runner.forward_ids(last, [1], [args.context], [0])[0])
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                runner.greedy_ids(runner.forward_ids(last, [1], [args.context], [0])[0])
            torch.cuda.synchronize()
        out.append(table(prof, f"eager decode forward + head, batch 1, {backend}", args.steps))
        print(out[-1], flush=True)
        del runner
    dflash = drafters()["dflash"]
    spec = SpeculativeConfig(method="dflash", model="(random)", adaptive_draft_length=False)
    engine = Engine(target, None, EngineConfig(max_model_len=args.context + 1024, max_num_seqs=1,
                                               attention_backend=args.attention_backend), spec, dflash)
    for speculate in (False, True):
        params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True, use_speculation=speculate)
        engine.add_request(str(speculate), None, torch.randint(0, 150000, (args.context,)).tolist(), params)
        for _ in range(5):
            engine.step()  # prefill, graph capture, warm-up
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                engine.step()
            torch.cuda.synchronize()
        engine.abort(str(speculate))
        name = "DFlash K=15" if speculate else "plain"
        out.append(table(prof, f"engine steps (CUDA graphs), {name}, batch 1", args.steps))
        print(out[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n\n".join(out) + "\n")


if __name__ == "__main__":
    main()
