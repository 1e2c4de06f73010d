"""Decode and speculative-step speed of a Qwen3-8B-shaped model with random bf16 weights, next to its floor.

Floor: bytes of weights read per step (all linear layers and the LM head) over the measured
device-to-device copy bandwidth. Timing: CUDA events after warm-up, median of repeated runs.

    python benchmarks/bench_decode.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from blockspec.bench.arch import QWEN3_8B, random_target, step_bytes
from blockspec.bench.timing import copy_bandwidth, cuda_time
from blockspec.models.runner import ModelRunner
from blockspec.models.llama import CausalLM
from blockspec.kernels.attention import resolve_backend


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--verify-rows", type=int, default=16)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--e2e-tokens", type=int, default=256)
    ap.add_argument("--attention-backend", default="auto", choices=["auto", "triton", "sdpa"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    bw = copy_bandwidth()
    batches = [int(b) for b in args.batches.split(",")]
    max_len = args.context + args.e2e_tokens + 64
    model = random_target(QWEN3_8B, max_len + 64)
    model.attention_backend = resolve_backend(args.attention_backend, torch.device("cuda"))
    weight_bytes = step_bytes(model)
    floor_s = weight_bytes / bw
    result = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "copy_bandwidth_TBps": bw / 1e12, "weight_bytes_per_step_GB": weight_bytes / 1e9,
              "attention_backend": model.attention_backend, "floor_step_ms": floor_s * 1e3, "floor_tok_s_batch1": 1 / floor_s, "runs": []}
    print(json.dumps(result, indent=1), flush=True)
    for b in batches:
        runner = ModelRunner(model, b, max_len, query_buckets=(1, args.verify_rows))
        slots = list(range(b))
        prompt = torch.randint(0, 150000, (b, args.context), device="cuda")
        runner.forward_ids(prompt, [args.context] * b, [0] * b, slots)  # prefill (eager)
        last = prompt[:, -1:].contiguous()

        def decode() -> torch.Tensor:
            hidden, _ = runner.forward_ids(last, [1] * b, [args.context] * b, slots)
            return runner.greedy_ids(hidden)

        med, lo, hi = cuda_time(decode, args.iters, args.repeats)
        q = args.verify_rows
        block = torch.randint(0, 150000, (b, q), device="cuda")

        def verify() -> torch.Tensor:
            hidden, feats = runner.forward_ids(block, [q] * b, [args.context] * b, slots, with_taps=False)
            return runner.greedy_ids(hidden)

        vmed, vlo, vhi = cuda_time(verify, args.iters, args.repeats)
        run = {"batch": b, "decode_step_ms": med * 1e3, "decode_step_ms_min": lo * 1e3, "decode_step_ms_max": hi * 1e3,
               "decode_tok_s": b / med, "floor_ratio": floor_s / med,
               f"verify{q}_step_ms": vmed * 1e3, "verify_over_decode": vmed / med,
               "graphs_captured": len(runner.graphs)}
        del runner
        torch.cuda.empty_cache()
        run.update(end_to_end(model, b, args.context, args.e2e_tokens, model.attention_backend))
        run["peak_mem_GB"] = torch.cuda.max_memory_allocated() / 1e9
        result["runs"].append(run)
        print(json.dumps(run), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


def end_to_end(model: CausalLM, batch: int, context: int, new_tokens: int, backend: str) -> dict[str, float]:
    """Tokens/s through the engine (scheduling, sampling, host sync per step included)."""
    from blockspec.config import EngineConfig
    from blockspec.engine.engine import Engine
    from blockspec.sampling_params import SamplingParams

    engine = Engine(model, None, EngineConfig(max_model_len=context + new_tokens + 8, max_num_seqs=batch,
                                              attention_backend=backend))
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    g = torch.Generator().manual_seed(0)

    def once() -> tuple[float, int]:
        for i in range(batch):
            engine.add_request(str(i), None, torch.randint(0, 150000, (context,), generator=g).tolist(), params)
        while any(r.num_cached < len(r.prompt_token_ids) for r in engine.running) or engine.waiting:
            engine.step()  # prefill, not timed
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        n0 = engine.num_generated
        while engine.has_unfinished():
            engine.step()
        torch.cuda.synchronize()
        return time.perf_counter() - t0, engine.num_generated - n0

    once()  # warm-up and graph capture
    times = [once() for _ in range(3)]
    rates = sorted(n / t for t, n in times)
    return {"e2e_tok_s": rates[1], "e2e_tok_s_min": rates[0], "e2e_tok_s_max": rates[-1]}


if __name__ == "__main__":
    main()
