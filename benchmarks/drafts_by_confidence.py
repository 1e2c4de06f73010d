"""How a drafter's greedy drafts match the embedded target's greedy tokens, by how sure the target is of them.

Teacher-forced on the target's own greedy continuations of the held-out prompts: a block at every position of
each continuation (the drafter sees the true prefix, as in `blockspec train`'s acceptance meter), each draft
position j compared with the target's greedy token, grouped by the target's probability of that token. A drafter
that misses mostly where the target is unsure is limited by the target's near-ties; one that also misses where the
target is sure is limited by itself.

    python benchmarks/drafts_by_confidence.py --out drafts_by_confidence.json [--dflash EXPORT]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from blockspec import LLM, SamplingParams
from blockspec.assets import PAIR
from blockspec.demo import heldout_prompts
from blockspec.drafters import load_dflash, load_dspark
from blockspec.models.loader import load_target
from blockspec.train.trainer import DrafterTrainConfig, drafter_loss, target_forward

BINS = (0.0, 0.5, 0.8, 0.95, 1.0001)
LOADERS = {"dflash": load_dflash, "dspark": load_dspark}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--drafters", default="dflash,dspark")
    for name in LOADERS:
        ap.add_argument(f"--{name}", type=Path, default=PAIR / name, help=f"the {name} export (default: shipped)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    prompts = heldout_prompts(args.prompts)
    llm = LLM(str(PAIR / "target"), device="cpu", seed=0)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens), use_tqdm=False)
    sequences = [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outs]
    target, _ = load_target(PAIR / "target", "float32", "cpu")
    report = {"prompts": len(prompts), "bins": BINS[:-1], "drafters": {}}
    for name in args.drafters.split(","):
        drafter = LOADERS[name](getattr(args, name), device="cpu", dtype="float32")
        cfg = DrafterTrainConfig(method=name, block_size=drafter.block_size, labels="target", device="cpu")
        hits = counts = None  # [bins, K], K the draft positions drafter_loss scores
        for prompt, generated in sequences:
            ids = torch.tensor([prompt + generated])
            seq = ids.shape[1]
            with torch.no_grad():
                final, _ = target_forward(target, ids, ())
                sure = target.compute_logits(final[0]).float().softmax(-1).max(-1).values  # [S]: row t's next token
                anchors = torch.arange(len(prompt) - 1, seq - 1)[None]
                mask = torch.tensor([[0] * len(prompt) + [1] * len(generated)])
                out = drafter_loss(drafter, target, ids, mask, anchors, torch.ones_like(anchors, dtype=torch.bool),
                                   cfg)
            rows = (anchors[0][:, None] + torch.arange(out.valid.shape[-1])).clamp(max=seq - 1)  # [N, K]
            bucket = torch.bucketize(sure[rows], torch.tensor(BINS[1:-1]), right=True)
            if hits is None:
                hits, counts = (torch.zeros(len(BINS) - 1, rows.shape[1]) for _ in range(2))
            for b in range(len(BINS) - 1):
                sel = out.valid[0] & (bucket == b)
                hits[b] += (out.match[0] & sel).sum(0).float()
                counts[b] += sel.sum(0).float()
        per = {f"{BINS[b]}-{min(BINS[b + 1], 1.0)}": {"positions": int(counts[b].sum()),
                                                       "first_draft_match": float(hits[b, 0] / counts[b, 0].clamp(min=1)),
                                                       "match_by_position": [round(float(h / max(c, 1)), 3)
                                                                             for h, c in zip(hits[b], counts[b])]}
               for b in range(len(BINS) - 1)}
        report["drafters"][name] = per
        print(name, json.dumps({key: (v["positions"], round(v["first_draft_match"], 3)) for key, v in per.items()}),
              flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
