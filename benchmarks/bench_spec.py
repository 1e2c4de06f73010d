"""Time of one DFlash speculative step (draft + verify + accept) against one plain decode step.

Qwen3-8B-shaped target and a Qwen3-8B-DFlash-b16-shaped drafter (5 layers, hidden 4096, taps
[1, 9, 17, 25, 33]), random bf16 weights. The step floor is (target + drafter weight bytes) over the
copy bandwidth, i.e. about 1.14x a plain step, since verifying 16 rows reads the same weights.

    python benchmarks/bench_spec.py --out spec.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from blockspec.bench.arch import QWEN3_8B, QWEN3_8B_DFLASH, param_bytes, random_drafter, random_target, step_bytes
from blockspec.bench.timing import copy_bandwidth, cuda_time
from blockspec.engine.runner import ModelRunner
from blockspec.sample import verify_greedy


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    bw = copy_bandwidth()
    target = random_target(QWEN3_8B, args.context + 128)
    drafter = random_drafter(QWEN3_8B_DFLASH)
    drafter.bind_target(target)
    t_bytes, d_bytes = step_bytes(target), param_bytes(drafter)
    result = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(), "copy_bandwidth_TBps": bw / 1e12,
              "target_GB": t_bytes / 1e9, "drafter_GB": d_bytes / 1e9,
              "floor_ratio_spec_over_plain": (t_bytes + d_bytes) / t_bytes, "runs": []}
    print(json.dumps(result), flush=True)
    k = drafter.num_draft_slots
    for b in (int(x) for x in args.batches.split(",")):
        runner = ModelRunner(target, b, args.context + 64, taps=drafter.target_layer_ids)
        dcache = drafter.new_cache(b, args.context + 64)
        slots, ctx = list(range(b)), args.context
        prompt = torch.randint(0, 150000, (b, ctx), device="cuda")
        _, feats = runner.forward_ids(prompt, [ctx] * b, [0] * b, slots, with_taps=True)
        drafter.append_context(dcache, slots, [0] * b, [ctx] * b, feats)
        anchors = prompt[:, -1].contiguous()
        new_feats = feats[:, -k - 1:].contiguous()

        def plain() -> torch.Tensor:
            hidden, _ = runner.forward_ids(anchors[:, None], [1] * b, [ctx] * b, slots)
            return runner.greedy_ids(hidden)

        def draft() -> torch.Tensor:
            drafter.append_context(dcache, slots, [ctx - k - 1] * b, [k + 1] * b, new_feats)
            hidden = drafter.block_hidden(dcache, slots, [ctx] * b, anchors, target.embed)
            return runner.greedy_ids(drafter.slot_hidden(hidden))

        drafts = draft()

        def verify() -> torch.Tensor:
            ids = torch.cat([anchors[:, None], drafts], 1)
            hidden, _ = runner.forward_ids(ids, [k + 1] * b, [ctx] * b, slots, with_taps=True)
            acc, out = verify_greedy(runner.greedy_ids(hidden), drafts, torch.full((b,), k, device="cuda"))
            return torch.cat([acc[:, None], out], 1).cpu()  # the step's one host copy

        def step() -> torch.Tensor:
            draft()
            return verify()

        p = cuda_time(plain, args.iters, args.repeats)
        d = cuda_time(draft, args.iters, args.repeats)
        v = cuda_time(verify, args.iters, args.repeats)
        s = cuda_time(step, args.iters, args.repeats)
        run = {"batch": b, "plain_step_ms": p[0] * 1e3, "draft_ms": d[0] * 1e3, "verify_ms": v[0] * 1e3,
               "spec_step_ms": s[0] * 1e3, "spec_step_ms_min": s[1] * 1e3, "spec_step_ms_max": s[2] * 1e3,
               "spec_over_plain": s[0] / p[0], "peak_mem_GB": torch.cuda.max_memory_allocated() / 1e9}
        result["runs"].append(run)
        print(json.dumps(run), flush=True)
        del runner, dcache
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
