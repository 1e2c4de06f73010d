"""The experts a step reads: per mixture-of-experts layer, the union of the experts its rows route to,
as a function of the rows each request verifies and the requests in the batch, under a routing model.

A plain decode step of one request reads its token's top-k experts; a verify step of Q rows reads
the union of the Q rows' experts, up to the whole layer. That union, not the row count, prices a
verify step on an MoE target, and it depends on how local routing is:

- "own": the random-weight model's own routing. Across requests it is a near-uniform draw, but a deep
  random model's hidden states are nearly alike across one sequence's positions, so a request's rows
  mostly pick the same experts (compare adjacent_rows_share with top_k / experts): a best case that
  says nothing of a trained router.
- "uniform": each row of a step picks its experts independently and uniformly (`RoutingModel` with
  rho 0): the worst case for verification (16 rows of top-8 of 128 reach ~82 experts; the table's
  uniform expectation is that count).
- "local": a locality-aware model. The uniform rows' router logits are made equicorrelated within
  each request with correlation LOCAL_RHO, so consecutive rows share part of their experts, as a
  trained router's consecutive tokens tend to.

All three are routing on random weights, not measurements of a trained router: every result says
which it used. The rows' hidden states come from one forward of the random target over random tokens
(the router inputs of every MoE layer), and each (requests, rows) point averages over random windows.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from blockspec.bench.arch import get_arch, random_target, step_bytes
from blockspec.drafters import DFlashDraft
from blockspec.models.kv_cache import dense_causal_meta
from blockspec.models.llama import CausalLM
from blockspec.models.moe import RoutingModel, SparseMoE, route

LOCAL_RHO = 0.8
ROUTING_MODELS = {"own": None, "uniform": 0.0, "local": LOCAL_RHO}  # name -> rho of the RoutingModel
ROUTING_NOTE = {
    "own": "random weights' own routing: across requests a near-uniform draw, but a request's rows mostly share "
           "their experts (a deep random model's positions look alike; see adjacent_rows_share); a best case",
    "uniform": "each row of a step routes independently and uniformly (its own fixed random expert order); "
               "the worst case",
    "local": f"locality-aware model: the uniform rows' router logits equicorrelated within each request with "
             f"rho={LOCAL_RHO}; a model, not a trained router",
}
ORDERS = 64  # the distinct per-row expert orders (verify blocks are at most 16 rows; longer runs repeat them)


def moe_blocks(model: CausalLM) -> list[SparseMoE]:
    return [layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoE)]


def set_routing(model: CausalLM, routing: str, seed: int = 0) -> CausalLM:
    """Route `model`'s MoE layers by the named routing model (in place; the model is returned). Each layer
    draws its own row orders, so a row's choices are independent across layers too."""
    if routing not in ROUTING_MODELS:
        raise ValueError(f"routing model {routing!r} unknown; allowed: {', '.join(ROUTING_MODELS)}")
    rho = ROUTING_MODELS[routing]
    g = torch.Generator().manual_seed(seed)
    for block in moe_blocks(model):
        if rho is None:
            block.routing = None
            continue
        perms = torch.stack([torch.randperm(block.num_experts, generator=g) for _ in range(ORDERS)])
        block.routing = RoutingModel(perms.to(block.gate.weight.device), rho)
    return model


@torch.no_grad()
def router_inputs(model: CausalLM, sequences: int, length: int, seed: int = 0) -> list[Tensor]:
    """The rows entering each MoE layer ([sequences, length, H], normed) in one cache-free forward of
    random tokens."""
    dev = model.embed_tokens.weight.device
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (sequences, length), generator=g).to(dev)
    taken: list[Tensor] = []
    hooks = [b.register_forward_pre_hook(lambda _m, args: taken.append(args[0].detach())) for b in moe_blocks(model)]
    try:
        model(ids, dense_causal_meta(sequences, length, dev, layer_types=model.config.layer_types), None)
    finally:
        for h in hooks:
            h.remove()
    return taken


@torch.no_grad()
def union_sizes(model: CausalLM, inputs: list[Tensor], requests: int, rows: int, samples: int,
                seed: int = 0) -> tuple[list[float], float]:
    """(mean union of experts per MoE layer, mean share of top-k that consecutive rows keep) over
    `samples` draws of `requests` sequences' windows of `rows` consecutive rows."""
    blocks = moe_blocks(model)
    g = torch.Generator().manual_seed(seed)
    sequences, length, _ = inputs[0].shape
    unions = [0.0] * len(blocks)
    kept, pairs = 0.0, 0
    for _ in range(samples):
        pick = torch.randperm(sequences, generator=g)[:requests]
        start = int(torch.randint(length // 2, length - rows + 1, (1,), generator=g))
        for i, (block, x) in enumerate(zip(blocks, inputs)):
            h = x[pick.to(x.device), start: start + rows]
            _, ids = route(block.router_logits(h), block.top_k, block.renorm)
            unions[i] += ids.unique().numel() / samples
            if rows > 1:
                hit = torch.zeros(requests, rows, block.num_experts, device=ids.device)
                hit.scatter_(2, ids.view(requests, rows, -1), 1.0)
                kept += float((hit[:, 1:] * hit[:, :-1]).sum(-1).mean()) / block.top_k
                pairs += 1
    return unions, kept / max(pairs, 1)


def measure(model: CausalLM, requests: tuple[int, ...] = (1, 4, 16, 64), rows: tuple[int, ...] = (1, 2, 4, 8, 16),
            routing: tuple[str, ...] = ("own", "uniform", "local"), length: int = 64, samples: int = 8,
            bandwidth: float | None = None, drafter_bytes: int = 0, seed: int = 0) -> dict[str, Any]:
    """The union table for each routing model, with each point's weight bytes and, given a bandwidth
    (bytes/s), its floor; `vs_plain` is a verify step's bytes over a plain step's at the same batch
    (the mean accepted length a speculative step must beat to gain, drafter bytes included)."""
    cfg = model.config
    blocks = moe_blocks(model)
    if not blocks:
        raise ValueError("the model has no mixture-of-experts layer")
    old = [b.routing for b in blocks]
    set_routing(model, "own")
    inputs = router_inputs(model, max(requests), max(max(rows) * 2, length), seed)
    out: dict[str, Any] = {"experts": cfg.num_experts, "top_k": cfg.num_experts_per_tok, "moe_layers": len(blocks),
                           "routing_models": {r: ROUTING_NOTE[r] for r in routing}, "points": []}
    try:
        for name in routing:
            set_routing(model, name)
            plain: dict[int, int] = {}
            for q in sorted(rows):
                for r in requests:
                    per_layer, kept = union_sizes(model, inputs, r, q, samples, seed)
                    mean = sum(per_layer) / len(per_layer)
                    nbytes = step_bytes(model, mean)
                    if q == 1:
                        plain[r] = nbytes
                    point = {"routing": name, "requests": r, "rows": q, "union_mean": mean,
                             "union_per_layer": [round(u, 2) for u in per_layer],
                             "uniform_expectation": cfg.num_experts * (1 - (1 - cfg.num_experts_per_tok
                                                                                / cfg.num_experts) ** (r * q)),
                             "adjacent_rows_share": kept if q > 1 else None, "step_gb": nbytes / 1e9,
                             "vs_plain": (nbytes + (drafter_bytes if q > 1 else 0)) / plain[r] if r in plain else None}
                    if bandwidth:
                        point["floor_ms"] = 1e3 * nbytes / bandwidth
                    out["points"].append(point)
    finally:
        for b, routing in zip(blocks, old):
            b.routing = routing
    return out


def markdown(result: dict[str, Any]) -> str:
    lines = [f"## Experts read per MoE layer ({result['experts']} experts, top-{result['top_k']}, "
             f"{result['moe_layers']} layers)", ""]
    for name, note in result["routing_models"].items():
        lines += [f"- **{name}**: {note}"]
    lines += ["", "| routing | requests | rows each | union (mean/layer) | uniform expectation | adjacent rows share | "
              "step GB | vs plain | floor ms |", "|---|---|---|---|---|---|---|---|---|"]
    for p in result["points"]:
        share = "" if p["adjacent_rows_share"] is None else f"{p['adjacent_rows_share']:.2f}"
        vs = "" if p["vs_plain"] is None else f"{p['vs_plain']:.2f}"
        floor = f"{p['floor_ms']:.3f}" if "floor_ms" in p else "n/a"
        lines.append(f"| {p['routing']} | {p['requests']} | {p['rows']} | {p['union_mean']:.1f} | "
                     f"{p['uniform_expectation']:.1f} | {share} | {p['step_gb']:.2f} | {vs} | {floor} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """python -m blockspec.bench.expert_union --arch qwen3-30b-a3b --out DIR: the union table of the
    arch's random target (bf16 on CUDA), as expert_union.json and expert_union.md."""
    from blockspec.bench.timing import copy_bandwidth
    from blockspec.models.loader import resolve_device

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", default="qwen3-30b-a3b")
    p.add_argument("--device", default="auto")
    p.add_argument("--requests", default="1,4,16,64")
    p.add_argument("--rows", default="1,2,4,8,16")
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--out", default="expert-union")
    args = p.parse_args(argv)
    arch = get_arch(args.arch)
    if not arch.target.is_moe:
        raise SystemExit(f"--arch {args.arch} has no mixture-of-experts layer")
    dev = resolve_device(args.device)
    cuda = dev.type == "cuda"
    bandwidth = copy_bandwidth() if cuda else None
    model = random_target(arch.target, 256, dev, torch.bfloat16 if cuda else torch.float32, arch.init_std)
    itemsize = model.embed_tokens.weight.element_size()
    with torch.device("meta"):  # the drafter's own weights, counted without building them
        own = sum(p.numel() for p in DFlashDraft(arch.dflash).parameters()) * itemsize
    head = model.lm_head.weight.numel() * itemsize  # the drafts' logits go through the target's LM head
    ints = lambda text: tuple(int(v) for v in text.split(","))  # noqa: E731
    result = measure(model, ints(args.requests), ints(args.rows), samples=args.samples, bandwidth=bandwidth,
                     drafter_bytes=own + head)
    result.update(arch=args.arch, device=str(dev), copy_bandwidth_TBps=bandwidth / 1e12 if bandwidth else None,
                  plain_batch1_step_gb=step_bytes(model) / 1e9, dflash_drafter_step_gb=(own + head) / 1e9,
                  note="vs_plain counts a DFlash step's drafter weights (its own and the target's LM head) on the "
                       "verify side")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "expert_union.json").write_text(json.dumps(result, indent=1))
    (out / "expert_union.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
