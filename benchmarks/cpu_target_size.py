"""How big the embedded target must be for a CPU decode step to be weight streaming: random Qwen3 code-model
shapes (the embedded tokenizer's 16384 tokens, tied head) in float32 through the engine on this machine's
CPU, one thread by default as the demo runs.

For each shape: a plain decode step (ms a token, from two generate() lengths, so prefill cancels), its
floor (the weights a step streams, the tied head once, over this machine's measured copy bandwidth) and
the ratio to it; and a verify-sized forward of 16 rows with the head over them against one row (what a
speculative step pays to check 15 drafts, where 1.0x would be free). A step at many times its floor is
per-op overhead, which speculation cannot amortise as it amortises weight reads.

    OMP_NUM_THREADS=1 python benchmarks/cpu_target_size.py --out size.json [--shapes 256x6,384x8,512x8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

VOCAB = 16384


def copy_bandwidth_cpu(nbytes: int = 512 << 20, repeats: int = 5) -> float:
    """Host memory copy bandwidth in bytes/s (read + write), the best of `repeats` copies."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    best = min(_seconds(lambda: dst.copy_(src)) for _ in range(repeats))
    return 2 * nbytes / best


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def save_shape(path: Path, hidden: int, layers: int) -> int:
    """A random Qwen3 checkpoint of `hidden` x `layers` (SwiGLU 4x wide, heads of 64, 2 q heads a KV head);
    returns the float32 bytes a decode step streams (every weight, the tied head once)."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    heads = hidden // 64
    cfg = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=4 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=heads,
                                   num_key_value_heads=max(1, heads // 2), head_dim=64, tie_word_embeddings=True,
                                   max_position_embeddings=2048, eos_token_id=0, pad_token_id=1)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg)
    model.save_pretrained(path)
    return 4 * sum(p.numel() for p in model.parameters())


def measure(path: Path, repeats: int) -> dict[str, float]:
    from blockspec.llm import LLM
    from blockspec.sampling_params import SamplingParams

    llm = LLM(str(path), device="cpu", dtype="float32", max_num_seqs=1, seed=0)
    prompt = {"prompt_token_ids": list(range(3, 67))}

    def wall(tokens: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        return _seconds(lambda: llm.generate([prompt], params, use_tqdm=False))

    wall(8)  # warm-up
    short, long_ = 16, 144
    per_token = statistics.median((wall(long_) - wall(short)) / (long_ - short) for _ in range(repeats))
    runner = llm.engine.runner
    times = {}
    for rows in (1, 16):
        ids = torch.full((1, rows), 5, dtype=torch.long)

        def forward() -> None:
            hidden, _ = runner.forward_ids(ids, [rows], [64], [0])
            runner.logits(hidden)

        forward()
        times[rows] = statistics.median(_seconds(forward) for _ in range(10 * repeats))
    return {"decode_ms_per_token": 1e3 * per_token, "forward_1_row_ms": 1e3 * times[1],
            "forward_16_rows_ms": 1e3 * times[16]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="256x6,384x8,512x8,512x12,768x12", help="HIDDENxLAYERS, comma separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    bandwidth = copy_bandwidth_cpu()
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write); threads {torch.get_num_threads()}")
    print("shape     params M  step MB  decode ms/token  floor ms  x floor  16 rows / 1 row")
    runs = []
    for shape in args.shapes.split(","):
        hidden, layers = (int(v) for v in shape.split("x"))
        with tempfile.TemporaryDirectory() as tmp:
            nbytes = save_shape(Path(tmp), hidden, layers)
            run = {"hidden": hidden, "layers": layers, "params_m": nbytes / 4e6, "step_mb": nbytes / 1e6,
                   **measure(Path(tmp), args.repeats)}
        run["floor_ms"] = 1e3 * nbytes / bandwidth
        run["x_floor"] = run["decode_ms_per_token"] / run["floor_ms"]
        run["verify_16_over_1"] = run["forward_16_rows_ms"] / run["forward_1_row_ms"]
        runs.append(run)
        print(f"{shape:9s} {run['params_m']:8.1f} {run['step_mb']:8.1f} {run['decode_ms_per_token']:16.2f} "
              f"{run['floor_ms']:9.2f} {run['x_floor']:8.1f} {run['verify_16_over_1']:16.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"copy_bandwidth_GBps": bandwidth / 1e9,
                                              "threads": torch.get_num_threads(), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
