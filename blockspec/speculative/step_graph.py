"""The chained greedy step as one CUDA graph: the last verify's taps into the draft context, the
draft, the drafts cut to each request's budget, the verify forward, acceptance, the packed result.

A chained step (`Engine._launch_chained`) starts from the last step's device results before the
host reads them. Replayed back to back, each graph reads what the one before wrote into its batch
bucket's buffers (`StepIO`), so a step costs the host one control copy and one replay instead of a
draft graph, a verify graph and the few dozen small launches between them, which at batch 1 on a
small model cost more than the GPU's work. Graphs are keyed by batch bucket, K, key extent (one
with Triton attention, SDPA's lengths in steps) and context rows, all captured at start. The body is
the proposer's tensor code (`Proposer.chained_step`); where there are no graphs (the CPU) it runs
eagerly, the reference path.

A step after one of k' drafts appends at most k' + 1 rows a request to the draft context. Its drafter
runs the context's fc and K/V products over `context_rows`: k + 1 rows after a step of no more drafts
than its own k (the steady state), all K + 1 after a longer one, two graphs a K. At K = 5 of 15 the
second would put 16 rows a request through them, the first 6.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from blockspec.models.runner import BATCH_BUCKETS, bucket, capture
from blockspec.transfer import to_device

# (control [4, B], result [B, 2 + W], taps [B, W + 1, F], k, key extent, context rows)
#   -> (the draft block, result [B, 3 + k], taps [B, k + 1, F]); the host reads only the result
StepBody = Callable[[Tensor, Tensor, Tensor, int, int, int], tuple[object, Tensor, Tensor]]


@dataclass
class StepIO:
    """A batch bucket's buffers: a step's graph reads them at its start and writes them at its end."""

    control: Tensor  # [4, B] int64: slots, committed cache counts, tokens left, request keys
    result: Tensor  # [B, 3 + K] packed (accepted count, draft length, emitted tokens)
    taps: Tensor  # [B, K + 1, F] the verify's taps


@dataclass
class CapturedStep:
    graph: torch.cuda.CUDAGraph
    block: object  # the step's draft block: static tensors of the graph, kept as long as it is


class StepGraphs:
    """The step's graphs and buffers. The body comes with each call, not kept: the proposer owns these
    graphs, and a reference back to it would make a cycle, freeing the engine's graphs only when the
    cyclic garbage collector runs, which may be inside another engine's capture (an error there)."""

    def __init__(self, num_drafts: int, taps_like: Tensor, scratch_slot: int, use_graphs: bool) -> None:
        self.k = num_drafts
        self.use_graphs = use_graphs
        self.scratch_slot = scratch_slot
        self.feature_dim, self.dtype, self.device = taps_like.shape[-1], taps_like.dtype, taps_like.device
        self.io: dict[int, StepIO] = {}
        self.graphs: dict[tuple[int, int, int, int], CapturedStep] = {}
        self.replays = 0
        self.pool = None

    def run(self, body: StepBody, rows: list[list[int]], result: Tensor, taps: Tensor, k: int,
            kv_len: int) -> tuple[Tensor, Tensor]:
        """One chained step of len(rows[0]) requests through `body`: `rows` are the control rows (slots,
        committed cache counts, tokens left, request keys), `result` and `taps` the last step's (possibly
        this bucket's buffers, which the last replay wrote); `kv_len` bounds the keys (a captured extent
        on CUDA). Returns the packed result and the verify's taps."""
        r = len(rows[0])
        context = self.context_rows(k, taps.shape[1])
        if not self.use_graphs:
            return body(to_device(rows, torch.int64, result.device), result, taps, k, kv_len, context)[1:]
        b = bucket(r, BATCH_BUCKETS)
        key = (b, k, kv_len, context)
        if key not in self.graphs:  # its warm-up overwrites the buffers: keep the inputs first
            result, taps = result.clone(), taps.clone()
            self._capture(body, key)
        io = self.io[b]
        pad = b - r
        io.control.copy_(to_device([rows[0] + [self.scratch_slot] * pad] + [v + [0] * pad for v in rows[1:]],
                                   torch.int64, self.device))
        if result.data_ptr() != io.result.data_ptr() or taps.data_ptr() != io.taps.data_ptr():
            io.result[:r, : result.shape[1]].copy_(result)
            io.taps[:r, : taps.shape[1]].copy_(taps)
        cap = self.graphs[key]
        cap.graph.replay()
        self.replays += 1
        return io.result[:r, : 3 + k], io.taps[:r, : k + 1]

    def context_rows(self, k: int, emitted: int) -> int:
        """How many of a request's held rows a step of k drafts puts through the drafter's context
        products, after a step that emitted up to `emitted` rows a request: k + 1 where that holds
        them, else all K + 1 (one graph for every longer step before)."""
        return k + 1 if emitted <= k + 1 else self.k + 1

    def capture_all(self, body: StepBody, batch_sizes: list[int], ks: list[int], extents: list[int]) -> None:
        """Capture the step of these batch buckets, draft lengths and key extents, after a step of no
        more drafts and after a longer one."""
        for key in ((b, k, kv, c) for b in batch_sizes for k in ks for kv in extents for c in {k + 1, self.k + 1}):
            if key not in self.graphs:
                self._capture(body, key)

    def _buffers(self, b: int) -> StepIO:
        if b not in self.io:
            control = torch.zeros(4, b, dtype=torch.int64, device=self.device)
            self.io[b] = StepIO(control, torch.zeros(b, 3 + self.k, dtype=torch.int64, device=self.device),
                                torch.zeros(b, self.k + 1, self.feature_dim, dtype=self.dtype, device=self.device))
        io = self.io[b]
        io.control.zero_()
        io.control[0] = self.scratch_slot  # warm-up and capture write only the scratch slot
        return io

    def _capture(self, body: StepBody, key: tuple[int, int, int, int]) -> CapturedStep:
        b, k, kv_len, context = key
        io = self._buffers(b)

        def step() -> object:
            block, result, taps = body(io.control, io.result, io.taps, k, kv_len, context)
            io.result[:, : 3 + k].copy_(result)
            io.taps[:, : k + 1].copy_(taps)
            return block

        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph, block = capture(step, self.pool)
        self.graphs[key] = CapturedStep(graph, block)
        return self.graphs[key]
