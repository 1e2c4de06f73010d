"""The greedy draft step as one CUDA graph: append the new context rows, run the block, take drafts.

A decode-time draft step appends at most K+1 context rows per request (the rows committed last
step), so a graph with K+1 feature rows per request, bucketed by batch size (and, under SDPA, key
length), covers every step after prefill. Padded requests read and write only the scratch slot. The eager path
(`Proposer`) stays the reference and handles the rest (prefill-sized context, sampled drafts).

Its inputs are device tensors, so a step can be launched from counts the GPU has computed and the
host not read yet. Without CUDA graphs (the CPU) the same tensor code runs eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from blockspec.engine.kv_cache import KVCache
from blockspec.engine.runner import BATCH_BUCKETS, bucket, capture, kv_extent, kv_extents
from blockspec.models.llama import CausalLM
from blockspec.transfer import to_device


@dataclass
class CapturedDraft:
    graph: "torch.cuda.CUDAGraph"
    control: Tensor  # [4, B]: slots, context start, context rows, anchor ids
    features: Tensor  # [B, C, F]
    tokens: Tensor  # [B, K] output
    confidence: Tensor | None  # [B, K] output (DSpark)


class DraftGraphs:
    def __init__(self, drafter: Any, target: CausalLM, cache: KVCache, num_drafts: int, target_head: bool,
                 markov_top_k: int = 0, use_graphs: bool = True) -> None:
        self.use_graphs = use_graphs
        self.markov_top_k = markov_top_k
        self.drafter = drafter
        self.target_head = target_head  # drafter logits are exactly the target LM head's
        self.target = target
        self.cache = cache
        self.k = num_drafts
        self.rows = num_drafts + 1  # context rows appended per request per step
        self.graphs: dict[tuple[int, int], CapturedDraft] = {}
        self._pool = None

    @property
    def whole_cache(self) -> bool:
        return self.drafter.attention_backend == "triton"

    def capture_all(self, batch_sizes: list[int]) -> None:
        """Capture the draft step of these batch buckets at every key extent."""
        for b in batch_sizes:
            for kv in kv_extents(self.cache.max_len - self.rows, self.whole_cache):
                if (b, kv) not in self.graphs:
                    self._capture(b, kv)

    def fits(self, batch: int, pending_rows: list[int], max_ctx: int) -> bool:
        b = bucket(batch, BATCH_BUCKETS)
        return b is not None and max(pending_rows) <= self.rows and max_ctx + self.rows <= self.cache.max_len

    def run(self, slots: list[int], starts: list[int], counts: list[int] | Tensor, features: Tensor | None,
            anchors: Tensor, ctx_end: int | None = None) -> tuple[Tensor, Tensor | None]:
        """Append features[r, :counts[r]] at starts[r]..., then draft from the block at starts[r] + counts[r].
        `counts` may be a device tensor; `ctx_end` then bounds every block's start on the host."""
        r = len(slots)
        if ctx_end is None:
            ctx_end = max(s + c for s, c in zip(starts, counts))
        if not self.use_graphs:
            device = anchors.device
            as_t = lambda v: v if isinstance(v, Tensor) else to_device(v, torch.int64, device)  # noqa: E731
            control = torch.stack([as_t(slots), as_t(starts), as_t(counts), anchors])
            return self._step(control, features, ctx_end)
        b = bucket(r, BATCH_BUCKETS)
        kv = kv_extent(ctx_end, self.cache.max_len - self.rows, self.whole_cache)
        cap = self.graphs.get((b, kv)) or self._capture(b, kv)
        pad = b - r
        host_counts = [0] * r if isinstance(counts, Tensor) else list(counts)
        cap.control[:3].copy_(to_device([slots + [self.cache.scratch_slot] * pad, starts + [0] * pad,
                                         host_counts + [0] * pad], torch.int64, cap.control.device))
        if isinstance(counts, Tensor):
            cap.control[2, :r].copy_(counts)
        cap.control[3, :r].copy_(anchors)
        if features is not None:
            cap.features[:r, : features.shape[1]].copy_(features)
        cap.graph.replay()
        conf = cap.confidence[:r] if cap.confidence is not None else None
        return cap.tokens[:r], conf

    def _step(self, control: Tensor, features: Tensor | None, kv: int) -> tuple[Tensor, Tensor | None]:
        """The draft step's tensor code: control rows are slots, context starts, context rows, anchors;
        `kv` bounds every block's start."""
        d = self.drafter
        slots, starts, counts, anchors = control[0], control[1], control[2], control[3]
        if features is not None:
            d.append_context_tensors(self.cache, slots, starts, counts, features, kv + self.rows)
        hidden = d.block_hidden_tensors(self.cache, slots, starts + counts, anchors, kv, self.target.embed)
        slot_hidden = d.slot_hidden(hidden, self.k)
        if hasattr(d, "draft_greedy"):
            return d.draft_greedy(d.logits(slot_hidden), slot_hidden, anchors, self.markov_top_k)
        if self.target_head:  # argmax of the head's own-dtype logits = argmax of their fp32 copy
            return self.target.lm_head(slot_hidden).argmax(-1), None
        return d.draft_to_target(d.logits(slot_hidden).argmax(-1)), None

    def _capture(self, b: int, kv: int) -> CapturedDraft:
        d = self.drafter
        dev = self.cache.k[0].device
        control = torch.zeros(4, b, dtype=torch.int64, device=dev)
        control[0] = self.cache.scratch_slot
        feat_dim = d.fc.in_features
        features = torch.zeros(b, self.rows, feat_dim, dtype=d.dtype, device=dev)

        def step() -> tuple[Tensor, Tensor | None]:
            return self._step(control, features, kv)

        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph, (tokens, conf) = capture(step, self._pool)
        cap = CapturedDraft(graph, control, features, tokens, conf)
        self.graphs[(b, kv)] = cap
        return cap
