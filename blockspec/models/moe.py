"""The sparse mixture-of-experts MLP of Qwen3-MoE and Qwen2-MoE, and the loader's expert stacking.

A router (a linear map to one logit per expert) picks each row's top-k experts from the softmax of
its logits, in fp32, renormalising the k probabilities to sum to 1 where the config says so
(`norm_topk_prob`). Each expert is a SwiGLU MLP; the row's output is the router-weighted sum of its k
experts' outputs (plus, in Qwen2-MoE, a shared expert gated by a sigmoid). The experts are stacked in
two tensors, gate_up [E, 2I, H] (gate rows first) and down [E, H, I], the layout transformers 5
keeps in memory, so one grouped kernel (`kernels.moe`) reads each selected expert's weights once.

The loop over experts here is the reference (CPU, training, and the oracle the kernels are tested
against); on CUDA inference the block runs the fused kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from blockspec.config import ModelConfig
from blockspec.errors import ModelLoadError
from blockspec.kernels import moe as moe_kernels
from blockspec.kernels.ops import PreNormed, skinny_linear, use_kernels
from blockspec.models.layers import GatedMLP, RMSNorm, rms_norm, silu_mul, stream
from blockspec.models.quant import PER_EXPERT


def route(logits: Tensor, top_k: int, renorm: bool) -> tuple[Tensor, Tensor]:
    """logits [M, E] -> (weights [M, k] in the logits' dtype, expert ids [M, k] int64), best first.
    Softmax and top-k in fp32, as transformers' Qwen-MoE routers compute them."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renorm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def experts_reference(x: Tensor, gate_up: Tensor, down: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
    """sum_j weights[m, j] * expert_{ids[m, j]}(x[m]) for x [M, H]; gate_up [E, 2I, H], down [E, H, I].

    One pass per expert that some row selected, over the rows that selected it; each expert's output
    is rounded to x's dtype (as a linear layer rounds), the weighted sum is kept in fp32 and rounded once."""
    out = torch.zeros(x.shape[0], down.shape[1], dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():
        rows, slot = (ids == e).nonzero(as_tuple=True)
        y = F.linear(silu_mul(F.linear(x[rows], gate_up[e])), down[e])
        out.index_add_(0, rows, y.float() * weights[rows, slot, None].float())
    return out.to(x.dtype)


class Experts(nn.Module):
    """The stacked expert weights (named as transformers 5 names them: experts.gate_up_proj, .down_proj);
    `models.quant.Fp8Experts` holds them in e4m3."""

    scales: moe_kernels.ExpertScales | None = None  # in the model's dtype: no scales

    def __init__(self, num_experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))

    def reference_weights(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """gate_up and down as the reference path computes with them."""
        return self.gate_up_proj, self.down_proj


@dataclass(frozen=True)
class RoutingModel:
    """A benchmark's model of how a request's rows in one step route (random weights route as their own
    hidden states do, which a deep random model makes nearly alike across a sequence's positions).

    Row j of every request first sees the experts in its own fixed random order (`perms[j % P]`), which
    makes the rows' choices independent and uniform; then, with rho > 0, each request's Q rows of logits
    are split into their mean m and deviations d and recombined as sqrt(1 - rho) d + sqrt(1 + (Q - 1) rho) m
    (in fp32): independent rows of equal variance become equicorrelated by rho with the same variance."""

    perms: Tensor  # [P, E] int64: row j's expert order
    rho: float

    def apply(self, logits: Tensor) -> Tensor:
        """logits [R, Q, E] -> the modelled logits [R, Q, E] (fp32)."""
        r, q, e = logits.shape
        order = self.perms if q <= self.perms.shape[0] else self.perms.repeat(-(-q // self.perms.shape[0]), 1)
        z = logits.float().gather(-1, order[:q].unsqueeze(0).expand(r, q, e))
        if self.rho:
            m = z.mean(dim=1, keepdim=True)
            z = (1 - self.rho) ** 0.5 * (z - m) + (1 + (q - 1) * self.rho) ** 0.5 * m
        return z


class SparseMoE(nn.Module):
    """Router + experts (+ the gated shared expert where the config has one), a drop-in for GatedMLP."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_experts = cfg.num_experts
        self.top_k = cfg.num_experts_per_tok
        self.renorm = cfg.norm_topk_prob
        self.inter = cfg.moe_intermediate_size  # local width under tensor parallelism
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        shared = cfg.shared_expert_intermediate_size
        self.shared_expert = GatedMLP(cfg.hidden_size, shared) if shared else None
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False) if shared else None
        # tensor parallelism sets this: the sum over ranks of the block's partial outputs
        self.all_reduce: Callable[[Tensor], None] | None = None
        # benchmark-only routing model (bench/expert_union.py); None routes by the model's own logits
        self.routing: RoutingModel | None = None
        # called with each forward's expert ids [rows, k] where set (measurements; eager runs only)
        self.observe: Callable[[Tensor], None] | None = None

    def router_logits(self, h: Tensor, logits: Tensor | None = None) -> Tensor:
        """h [..., H] -> logits [rows, E] (`logits`: the router's product of h, where already made), through
        the benchmark's routing model where one is set (h [R, Q, H]: Q rows of each of R requests)."""
        logits = F.linear(h, self.gate.weight) if logits is None else logits
        if self.routing is not None and h.dim() == 3 and h.shape[1] > 1:
            logits = self.routing.apply(logits)
        return logits.reshape(-1, self.num_experts)

    def forward(self, x: Tensor | PreNormed, norm: RMSNorm | None = None, residual: Tensor | None = None,
                next_norm: RMSNorm | None = None) -> Tensor:
        """residual + moe(norm(x)), both optional, as `GatedMLP.forward` takes them (`next_norm` is not
        used: the output is plain rows, which the next layer norms itself)."""
        h = stream(x)
        if norm is not None:
            h = rms_norm(h, norm.weight, norm.eps)
        shape = h.shape
        rows = h.reshape(-1, shape[-1])
        w = self.experts
        fused = use_kernels(rows, w.gate_up_proj)
        one_row = fused and rows.shape[0] == 1  # a decode row: the router's narrow product streams (ROUTER_TILE)
        logits = self.router_logits(h, skinny_linear(rows, self.gate.weight, config=moe_kernels.ROUTER_TILE)
                                    if one_row else None)
        if fused:
            weights, ids = moe_kernels.route(logits, self.top_k, self.renorm, rows.dtype)
        else:
            weights, ids = route(logits, self.top_k, self.renorm)
            weights = weights.to(rows.dtype)
        if self.observe is not None:
            self.observe(ids)
        add_now = residual is not None and self.shared_expert is None and self.all_reduce is None
        res = residual.reshape(rows.shape) if add_now else None
        if fused:
            out = moe_kernels.fused_experts(rows, w.gate_up_proj, w.down_proj, weights, ids, residual=res,
                                            scales=w.scales)
        else:
            out = experts_reference(rows, *w.reference_weights(rows.dtype), weights, ids)
            out = out if res is None else res + out
        if self.shared_expert is not None:
            gate = torch.sigmoid(F.linear(rows, self.shared_expert_gate.weight))
            out = out + gate * self.shared_expert(rows)
        if self.all_reduce is not None:
            self.all_reduce(out)
        out = out.view(shape)
        return out if residual is None or add_now else residual + out


def stack_experts(state: dict[str, Tensor], source: str) -> dict[str, Tensor]:
    """Per-expert tensors (`...mlp.experts.{e}.gate_up_proj.weight` after gate/up fusion, and
    `.down_proj.weight`: the hub checkpoints' names) stacked into `...mlp.experts.gate_up_proj`
    [E, 2I, H] and `.down_proj` [E, H, I]; tensors already stacked (transformers 5's own layout) pass."""
    out: dict[str, Tensor] = {}
    groups: dict[tuple[str, str], dict[int, Tensor]] = {}
    for name, t in state.items():
        m = PER_EXPERT.match(name)
        if m is None:
            out[name] = t
        else:
            groups.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = t
    for (prefix, part), experts in groups.items():
        missing = sorted(set(range(max(experts) + 1)) - set(experts))
        if missing:
            raise ModelLoadError(f"{source}: {prefix}: checkpoint lacks experts {missing[:8]} of {part}")
        key = f"{prefix}.{part}"
        if key in out:
            raise ModelLoadError(f"{source}: {key} is both stacked and per expert in the checkpoint")
        out[key] = torch.stack([experts[e] for e in range(len(experts))])
    return out
