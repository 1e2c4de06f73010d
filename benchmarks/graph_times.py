"""Where the embedded default pair's steps go on the GPU: the device time of one replay of each CUDA
graph an engine captured (the target's decode and verify graphs, the draft graphs, the chained step
graphs), and the per-kernel CUDA time of a generate.

Its steps are host-bound on a large GPU, so the question is what a step costs the device once the
host is out of the way: replays back to back, timed with CUDA events after warm-up (median of
`--repeats` runs of `--iters` replays). A replay repeats its step on the same buffers, which is what
its device time needs; the engine is dropped afterwards.

    PYTHONPATH=. python benchmarks/graph_times.py --dtypes float32,bfloat16 --batch 1 --out graph_times
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from blockspec.bench.timing import cuda_time
from blockspec.demo import default_pair, heldout_prompts
from blockspec.llm import LLM
from blockspec.models.runner import BATCH_BUCKETS, bucket
from blockspec.sampling_params import SamplingParams


def graph_lines(llm: LLM, batch: int, iters: int, repeats: int) -> list[str]:
    """Device ms of one replay of each graph captured at this batch's bucket."""
    eng = llm.engine
    size = bucket(batch, BATCH_BUCKETS)
    groups = (("target", eng.runner.graphs), ("draft", eng.proposer.graphs.graphs), ("step", eng.proposer.steps.graphs))
    lines = []
    for name, graphs in groups:
        for key, cap in graphs.items():
            if key[0] == size:
                med, lo, hi = cuda_time(cap.graph.replay, iters, repeats)
                lines.append(f"{name} graph {key}: {1e3 * med:.3f} ms [{1e3 * lo:.3f}-{1e3 * hi:.3f}]")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", default="float32", help="comma-separated: float32, bfloat16")
    ap.add_argument("--methods", default="dspark,dflash")
    ap.add_argument("--batch", type=int, default=1, help="requests at once (graphs of its batch bucket are timed)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="graph_times", help="folder for the per-kernel tables")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base, _ = default_pair()
    prompts = heldout_prompts(args.batch)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    for dtype in args.dtypes.split(","):
        for method in args.methods.split(","):
            llm = LLM(str(base / "target"), device="cuda", dtype=dtype, seed=0, max_num_seqs=args.batch,
                      speculative_config={"method": method, "model": str(base / method),
                                          "adaptive_draft_length": False})
            llm.generate(prompts, params, use_tqdm=False)  # every graph the run needs is captured and warm
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                llm.generate(prompts, params, use_tqdm=False)
                torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=45, max_name_column_width=100)
            (out / f"kernels_{dtype}_{method}_b{args.batch}.txt").write_text(table)
            for line in graph_lines(llm, args.batch, args.iters, args.repeats):
                print(f"{dtype} {method} b{args.batch} {line}", flush=True)
            del llm
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
