"""Decode and speculative-step speed of a Qwen3-8B-shaped model with random bf16 weights, next to its floor.

Floor: bytes of weights read per step (all linear layers and the LM head) over the measured
device-to-device copy bandwidth. Timing: CUDA events after warm-up, median of repeated runs.

    python benchmarks/bench_decode.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from blockspec.config import ModelConfig, RopeConfig
from blockspec.engine.runner import ModelRunner
from blockspec.models.llama import CausalLM

QWEN3_8B = ModelConfig(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                       num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                       rope=RopeConfig(theta=1e6), max_position_embeddings=40960, qk_norm=True,
                       layer_types=("full_attention",) * 36, torch_dtype="bfloat16", eos_token_ids=(151645,))


def cuda_time(fn: Callable[[], object], iters: int, repeats: int) -> tuple[float, float, float]:
    """Median, min and max seconds per call over `repeats` runs of `iters` calls (after warm-up)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b) / 1000 / iters)
    return statistics.median(samples), min(samples), max(samples)


def copy_bandwidth(nbytes: int = 4 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting read + write."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    med, _, _ = cuda_time(lambda: dst.copy_(src), iters=10, repeats=10)
    del src, dst
    return 2 * nbytes / med


def random_target(cfg: ModelConfig, max_positions: int) -> CausalLM:
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = CausalLM(cfg, max_positions)
    model = model.to(torch.bfloat16)
    for p in model.parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
    return model.eval().requires_grad_(False)


def step_bytes(model: torch.nn.Module) -> int:
    """Weights read by one decode step: every parameter but the embedding table (one row is read)."""
    emb = model.embed_tokens.weight
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not emb) + (
        emb.numel() * emb.element_size() if model.config.tie_word_embeddings else 0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--verify-rows", type=int, default=16)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--e2e-tokens", type=int, default=256)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    bw = copy_bandwidth()
    batches = [int(b) for b in args.batches.split(",")]
    max_len = args.context + args.e2e_tokens + 64
    model = random_target(QWEN3_8B, max_len + 64)
    weight_bytes = step_bytes(model)
    floor_s = weight_bytes / bw
    result = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "copy_bandwidth_TBps": bw / 1e12, "weight_bytes_per_step_GB": weight_bytes / 1e9,
              "floor_step_ms": floor_s * 1e3, "floor_tok_s_batch1": 1 / floor_s, "runs": []}
    print(json.dumps(result, indent=1), flush=True)
    for b in batches:
        runner = ModelRunner(model, b, max_len)
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
        run.update(end_to_end(model, b, args.context, args.e2e_tokens))
        run["peak_mem_GB"] = torch.cuda.max_memory_allocated() / 1e9
        result["runs"].append(run)
        print(json.dumps(run), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


def end_to_end(model: CausalLM, batch: int, context: int, new_tokens: int) -> dict[str, float]:
    """Tokens/s through the engine (scheduling, sampling, host sync per step included)."""
    from blockspec.config import EngineConfig
    from blockspec.engine.engine import Engine
    from blockspec.sampling_params import SamplingParams

    engine = Engine(model, None, EngineConfig(max_model_len=context + new_tokens + 8, max_num_seqs=batch))
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
