"""Engine step times on the GPU: plain decode vs DFlash vs DSpark speculative steps, the DSpark Markov
head's cost, and the sampling step's peak memory.

Qwen3-8B-shaped target (random bf16); a Qwen3-8B-DFlash-b16-shaped drafter (5 layers, hidden 4096,
taps [1, 9, 17, 25, 33]) and a DSpark drafter of the same backbone with block 7, a vanilla Markov
head of rank 256 and a confidence head. Steps go through `Engine.step()` (scheduling, drafting with
its CUDA graph, verify graph, acceptance, the one host copy), timed with CUDA events, median of
repeats. Random drafters are rejected almost always, so every step commits one token: this
measures step cost, not speedup. Floor of the DFlash step ratio: (target + drafter bytes) / target
bytes = 1.14x.

    PYTHONPATH=.:benchmarks python benchmarks/bench_spec.py --out spec.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

from blockspec.bench.arch import QWEN3_8B, QWEN3_8B_DFLASH, param_bytes, random_drafter, random_target, step_bytes
from blockspec.bench.timing import copy_bandwidth, cuda_time, event_seconds
from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.engine.engine import Engine
from blockspec.sampling_params import SamplingParams
from blockspec.drafters import DSparkDraft, DSparkHeads


def drafters() -> dict[str, torch.nn.Module]:
    """DFlash in the Qwen3-8B-DFlash-b16 shape; DSpark on the same backbone, block 7, Markov rank 256."""
    dspark = dataclasses.replace(QWEN3_8B_DFLASH, block_size=7, anchor_first=True)
    return {"dflash": random_drafter(QWEN3_8B_DFLASH),
            "dspark": random_drafter(dspark, heads=DSparkHeads(markov_rank=256))}


def step_times(engine: Engine, batch: int, context: int, steps: int, speculate: bool) -> list[float]:
    """Seconds of each decode step (CUDA events) for `batch` requests after prefill and warm-up."""
    params = SamplingParams(temperature=0, max_tokens=steps * 20, ignore_eos=True, use_speculation=speculate)
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        engine.add_request(f"{speculate}-{i}", None, torch.randint(0, 150000, (context,), generator=g).tolist(), params)
    while any(r.num_cached < len(r.prompt_token_ids) for r in engine.running) or engine.waiting:
        engine.step()
    for _ in range(3):
        engine.step()  # warm-up: graph capture, policy, allocator
    times = [event_seconds(engine.step) for _ in range(steps)]
    for r in list(engine.running):
        engine.abort(r.request_id)
    return times


def markov_cost(drafter: DSparkDraft, batch: int, repeats: int = 20) -> dict[str, float]:
    """Sequential Markov drafting (7 steps) vs a plain argmax of the same base logits, ms."""
    k = drafter.num_draft_slots
    h = torch.randn(batch, k, 4096, device="cuda", dtype=torch.bfloat16)
    base = drafter.logits(h)
    anchors = torch.randint(0, 150000, (batch,), device="cuda")

    return {"markov_draft_ms": cuda_time(lambda: drafter.draft_greedy(base, h, anchors), repeats, 3)[0] * 1e3,
            "argmax_only_ms": cuda_time(lambda: base.argmax(-1), repeats, 3)[0] * 1e3}


def sampling_memory(batch: int = 64, k: int = 15, vocab: int = 151936) -> dict[str, float]:
    """Peak extra GPU memory (GB) of one verify call per method, beyond its [R, K+1, V] fp32 logits."""
    from blockspec.sample import (RowParams, process_logits, sample_draft, verify_block, verify_greedy,
                                  verify_sample_and_match, verify_standard)

    rows = batch * (k + 1)
    logits = torch.randn(rows, vocab, device="cuda")
    draft_logits = torch.randn(batch, k, vocab, device="cuda")
    drafts = torch.randint(0, vocab, (batch, k), device="cuda")
    lens = torch.full((batch,), k, device="cuda")
    round_ = torch.arange(batch, device="cuda")
    params = RowParams.from_host(temperature=[1.0] * rows, seed=list(range(rows)), position=list(range(rows)),
                                 device="cuda")
    dparams = RowParams.from_host(temperature=[1.0] * batch * k, seed=list(range(batch * k)),
                                  position=list(range(batch * k)), device="cuda")

    def peak(fn) -> float:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 1e9

    out = {"greedy_ids": peak(lambda: verify_greedy(logits.view(batch, k + 1, vocab).argmax(-1), drafts, lens))}
    processed = process_logits(logits, params).view(batch, k + 1, vocab)
    out["process_logits"] = peak(lambda: process_logits(logits, params))
    out["sample_and_match"] = peak(lambda: verify_sample_and_match(processed, drafts, lens, params))
    out["standard_one_hot"] = peak(lambda: verify_standard(processed, None, drafts, lens, params, round_))
    q_drafts, q = sample_draft(draft_logits, dparams, round_)
    out["draft_sampling_probabilistic"] = peak(lambda: sample_draft(draft_logits, dparams, round_))
    out["standard_with_q"] = peak(lambda: verify_standard(processed, q, q_drafts, lens, params, round_))
    out["block_with_q"] = peak(lambda: verify_block(processed, q, q_drafts, lens, params, round_))
    out["logits_buffer_GB"] = logits.numel() * 4 / 1e9
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--attention-backend", default="auto", choices=["auto", "triton", "sdpa"])
    ap.add_argument("--skip-extras", action="store_true", help="step times only (no Markov / memory figures)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    bw = copy_bandwidth()
    target = random_target(QWEN3_8B, args.context + 2048)
    models = drafters()
    t_bytes = step_bytes(target)
    result = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(), "copy_bandwidth_TBps": bw / 1e12,
              "target_GB": t_bytes / 1e9,
              "drafter_GB": {m: param_bytes(d) / 1e9 for m, d in models.items()}, "runs": []}
    result["floor_ratio"] = {m: 1 + g / result["target_GB"] for m, g in result["drafter_GB"].items()}
    print(json.dumps(result), flush=True)
    for method, drafter in models.items():
        spec = SpeculativeConfig(method=method, model="(random)", adaptive_draft_length=False)
        for b in (int(x) for x in args.batches.split(",")):
            engine = Engine(target, None, EngineConfig(max_model_len=args.context + 1024, max_num_seqs=b,
                                                       attention_backend=args.attention_backend), spec, drafter)
            plain = step_times(engine, b, args.context, args.steps, speculate=False)
            fast = step_times(engine, b, args.context, args.steps, speculate=True)
            p, s = statistics.median(plain), statistics.median(fast)
            run = {"method": method, "batch": b, "plain_step_ms": p * 1e3, "spec_step_ms": s * 1e3,
                   "spec_step_ms_min": min(fast) * 1e3, "spec_step_ms_max": max(fast) * 1e3,
                   "spec_over_plain": s / p, "draft_graphs": len(engine.proposer.graphs.graphs),
                   "peak_mem_GB": torch.cuda.max_memory_allocated() / 1e9}
            result["runs"].append(run)
            print(json.dumps(run), flush=True)
            del engine
            torch.cuda.empty_cache()
    result["attention_backend"] = args.attention_backend
    if args.skip_extras:
        return write(result, args.out)
    result["markov"] = {str(b): markov_cost(models["dspark"], b) for b in (1, 64)}
    print(json.dumps(result["markov"]), flush=True)
    del models, target
    torch.cuda.empty_cache()
    result["sampling_memory_GB_batch64_K15"] = sampling_memory()
    print(json.dumps(result["sampling_memory_GB_batch64_K15"]), flush=True)
    write(result, args.out)


def write(result: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
