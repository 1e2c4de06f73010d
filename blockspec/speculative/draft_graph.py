"""The greedy draft step as one CUDA graph: append the new context rows, run the block, take drafts.

A decode-time draft step appends at most K+1 context rows per request (the rows committed last
step), so a graph with K+1 feature rows per request, bucketed by batch size (and, under SDPA, key
length), covers every step after prefill. Padded requests read and write only the scratch slot. The
eager path (`Proposer`) stays the reference and handles the rest (prefill-sized context, sampled
drafts).

The block is always whole (its positions attend to each other), but only the drafts a step verifies
go through the heads: graphs of two head widths, K and the longest of the policy's draft lengths
below it (by default `aligned_lengths`), so a step verifying 7 of 15 drafts (the draft length the policy
settles on when a large batch's verify is compute-bound) pays neither 15 nor 8 rows of the vocabulary
product. Both are captured at start: a width first captured mid-run would stall its step. A chained
step (`StepGraphs`), captured per K, runs `step` at exactly its K.

Its tensor code (`step`) takes device tensors only: the chained step (`StepGraphs`) runs it on counts
the GPU has computed and the host not read yet. Without CUDA graphs (the CPU) it runs eagerly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from blockspec.drafters import DraftModel
from blockspec.models.kv_cache import KVCache
from blockspec.models.runner import BATCH_BUCKETS, bucket, capture, kv_extent, kv_extents
from blockspec.models.llama import CausalLM
from blockspec.sample.sampler import greedy_ids
from blockspec.speculative.policy import aligned_lengths
from blockspec.transfer import to_device


@dataclass
class CapturedDraft:
    graph: "torch.cuda.CUDAGraph"
    control: Tensor  # [4, B]: slots, context start, context rows, anchor ids
    tokens: Tensor  # [B, K] output
    confidence: Tensor | None  # [B, K] output (DSpark)


@dataclass
class CapturedAppend:
    graph: "torch.cuda.CUDAGraph"
    control: Tensor  # [3, B]: slots, context start, context rows


class DraftGraphs:
    """`pending` [slots + 1, K + 2, F] (the proposer's) holds each slot's target taps not yet in the
    draft cache; both steps read their context rows from it (one gather inside the graph)."""

    def __init__(self, drafter: DraftModel, target: CausalLM, cache: KVCache, pending: Tensor, num_drafts: int,
                 markov_top_k: int = 0, use_graphs: bool = True, lengths: Sequence[int] | None = None) -> None:
        """`lengths`: the draft lengths the policy chooses among below num_drafts (default: its own,
        `aligned_lengths`); the narrower head width is the longest of them."""
        self.use_graphs = use_graphs
        self.markov_top_k = markov_top_k
        self.drafter = drafter
        self.target = target
        self.cache = cache
        self.pending = pending
        self.k = num_drafts
        self.rows = num_drafts + 1  # context rows appended per request per step
        shorter = [n for n in (aligned_lengths(num_drafts) if lengths is None else lengths) if n < num_drafts]
        self.widths = sorted({num_drafts, max(shorter, default=num_drafts)})  # head widths
        self.graphs: dict[tuple[int, int, int], CapturedDraft] = {}  # (batch bucket, key extent, head width)
        self.appends: dict[int, CapturedAppend] = {}
        self.pool = None

    @property
    def whole_cache(self) -> bool:
        return self.drafter.attention_backend == "triton"

    def width(self, k: int | None = None) -> int:
        """The head width of a step verifying up to k drafts (all K by default): the narrowest of
        `widths` that holds them."""
        return next(w for w in self.widths if w >= min(self.k if k is None else k, self.k))

    def capture_all(self, batch_sizes: list[int]) -> None:
        """Capture the draft step of these batch buckets at every key extent and head width, and their
        context append."""
        for b in batch_sizes:
            for kv in kv_extents(self.max_ctx, self.whole_cache):
                for width in self.widths:
                    if (b, kv, width) not in self.graphs:
                        self._capture(b, kv, width)
            if b not in self.appends:
                self._capture_append(b)

    def fits(self, batch: int, pending_rows: list[int], max_ctx: int) -> bool:
        b = bucket(batch, BATCH_BUCKETS)
        return b is not None and max(pending_rows) <= self.rows and max_ctx <= self.max_ctx

    def run(self, slots: list[int], starts: list[int], counts: list[int], anchors: Tensor,
            k: int | None = None) -> tuple[Tensor, Tensor | None]:
        """Append each slot's first counts[r] held rows at starts[r]..., then draft from the block at
        starts[r] + counts[r]: at least the first k drafts (all K by default), [R, width(k)]."""
        ctx_end = max(s + c for s, c in zip(starts, counts))
        width = self.width(k)
        if not self.use_graphs:
            return self._step(self._control(slots, starts, counts, anchors), ctx_end, width)
        b = bucket(len(slots), BATCH_BUCKETS)
        kv = kv_extent(ctx_end, self.max_ctx, self.whole_cache)
        cap = self.graphs.get((b, kv, width)) or self._capture(b, kv, width)
        self._fill(cap.control, slots, starts, counts, anchors)
        cap.graph.replay()
        r = len(slots)
        return cap.tokens[:r], cap.confidence[:r] if cap.confidence is not None else None

    @property
    def max_ctx(self) -> int:
        """The largest key extent of a draft step: room for its context rows after it."""
        return self.cache.max_len - self.rows

    def append(self, slots: list[int], starts: list[int], counts: list[int]) -> None:
        """Append each slot's first counts[r] held rows to the draft cache at starts[r]... (no block)."""
        b = bucket(len(slots), BATCH_BUCKETS)
        if not self.use_graphs or b is None:  # the CPU, or more requests than any graph: eager, only the rows held
            self._append(self._control(slots, starts, counts), max(counts))
            return
        cap = self.appends.get(b) or self._capture_append(b)
        self._fill(cap.control, slots, starts, counts)
        cap.graph.replay()

    def _control(self, slots: list[int], starts: list[int], counts: list[int],
                 anchors: Tensor | None = None) -> Tensor:
        """The control rows of an eager step: slots, starts, counts (and anchors)."""
        rows = to_device([slots, starts, counts], torch.int64, self.pending.device)
        return rows if anchors is None else torch.cat([rows, anchors[None]])

    def _fill(self, control: Tensor, slots: list[int], starts: list[int], counts: list[int],
              anchors: Tensor | None = None) -> None:
        """Write a captured step's control rows: padding rows read and write only the scratch slot."""
        r, pad = len(slots), control.shape[1] - len(slots)
        control[:3].copy_(to_device([slots + [self.cache.scratch_slot] * pad, starts + [0] * pad,
                                     counts + [0] * pad], torch.int64, control.device))
        if anchors is not None:
            control[3, :r].copy_(anchors)

    def _append(self, control: Tensor, rows: int | None = None) -> None:
        """Append each slot's held rows (the first `rows` of every slot's, all by default: a graph's width)."""
        slots, starts, counts = control[0], control[1], control[2]
        held = self.pending[slots] if rows is None else self.pending[slots, :rows]
        self.drafter.append_context_tensors(self.cache, slots, starts, counts, held, self.cache.max_len)

    def _step(self, control: Tensor, kv: int, width: int) -> tuple[Tensor, Tensor | None]:
        return self.step(control[0], control[1], control[2], control[3], kv, width)

    def step(self, slots: Tensor, starts: Tensor, counts: Tensor, anchors: Tensor, kv: int,
             width: int, rows: int | None = None) -> tuple[Tensor, Tensor | None]:
        """The draft step's tensor code: append each slot's counts[r] held rows at starts[r]..., run the
        block at starts[r] + counts[r] from anchors[r] and take the first `width` drafts; `kv` bounds
        every block's start. `rows`: the held rows a slot's append computes (all by default), at
        least every counts[r]."""
        d = self.drafter
        held = self.pending[slots] if rows is None else self.pending[slots, :rows]
        d.append_context_tensors(self.cache, slots, starts, counts, held, kv + self.rows)
        hidden = d.block_hidden_tensors(self.cache, slots, starts + counts, anchors, kv, self.target.embed,
                                        d.block_rows(width))
        # where the drafter's logits are the target's, the greedy ids of the head's own-dtype logits (as eager)
        return d.greedy_drafts(d.slot_hidden(hidden, width), anchors, self.markov_top_k,
                               head_argmax=lambda h: greedy_ids(self.target.head_logits(h)))

    def _new_control(self, rows: int, b: int) -> Tensor:
        control = torch.zeros(rows, b, dtype=torch.int64, device=self.pending.device)
        control[0] = self.cache.scratch_slot  # warm-up and capture write only the scratch slot
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        return control

    def _capture(self, b: int, kv: int, width: int) -> CapturedDraft:
        control = self._new_control(4, b)
        # its outputs are read after other graphs' replays (the verify's): outside the pool it may share
        graph, (tokens, conf) = capture(lambda: self._step(control, kv, width), self.pool, outputs_outside=True)
        cap = CapturedDraft(graph, control, tokens, conf)
        self.graphs[(b, kv, width)] = cap
        return cap

    def _capture_append(self, b: int) -> CapturedAppend:
        control = self._new_control(3, b)
        graph, _ = capture(lambda: self._append(control), self.pool)
        cap = CapturedAppend(graph, control)
        self.appends[b] = cap
        return cap
