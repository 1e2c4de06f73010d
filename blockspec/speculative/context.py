"""The drafter's context of every request: its K/V cache over the target's pages, and the target taps
that are not in that cache yet.

A request's tokens feed the drafter as the target computes them: a prefill chunk's taps go into the
draft cache at once (`extend`, or the prefill graph itself through `append_taps`); a verify's
accepted rows wait in `pending` for the next draft (`hold`), which appends them in its own graph;
plain steps' rows wait there too until they fill one draft step's append (`held`). On a request,
`num_draft_ctx` counts its tokens in the draft cache and `num_pending` its rows in `pending`; this
object is the only one that writes them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from blockspec.drafters import DraftModel
from blockspec.models.kv_cache import PageTable
from blockspec.request import Request
from blockspec.transfer import to_device

Flush = tuple[list[int], list[int], list[int]]  # (slots, starts in the draft cache, rows) to append from pending


class DraftContext:
    def __init__(self, drafter: DraftModel, pages: PageTable | int, max_len: int, num_drafts: int,
                 max_slots: int, dtype: torch.dtype, device: torch.device) -> None:
        self.drafter = drafter
        self.num_drafts = num_drafts
        # the target's page table (one page id, the same positions in both caches), or slots of their own
        self.cache = drafter.new_cache(pages, max_len + drafter.block_size + 1, device, dtype)
        # target taps of tokens not in the draft cache yet, by slot (the scratch slot last), so a draft
        # or a flush reads them in one gather: at most a verify's K + 1 rows and one plain step's
        self.pending = torch.zeros(max_slots + 1, num_drafts + 2, drafter.feature_width, dtype=dtype, device=device)

    def forget(self, req: Request) -> None:
        """A request admitted (again, after a preemption) starts its context after the remembered pages
        it shares that hold the drafter's context (`PrefixCache.draft`), else from nothing."""
        req.num_draft_ctx, req.num_pending = req.cached_draft_ctx, 0

    def drop_held(self, req: Request) -> None:
        """The request stops feeding the drafter: the rows it holds will never be drafted from."""
        req.num_pending = 0

    def caught_up(self, req: Request) -> None:
        """A draft launched from the device's results appended everything the request has committed."""
        req.num_draft_ctx = req.num_cached

    def extend(self, reqs: list[Request], features: Tensor, counts: list[int]) -> None:
        """Append the target features of a prefill chunk (features[i, :counts[i]] for reqs[i]) to the
        draft cache at once."""
        self.drafter.append_context(self.cache, [r.slot for r in reqs], [r.num_draft_ctx for r in reqs], counts,
                                    features)
        self.appended(reqs, counts)

    def appended(self, reqs: list[Request], counts: list[int]) -> None:
        """Count rows now in the draft cache (appended here, or by a prefill graph through `append_taps`)."""
        for r, c in zip(reqs, counts):
            r.num_draft_ctx += c

    def append_taps(self, slots: Tensor, starts: Tensor, counts: Tensor, features: Tensor) -> None:
        """Device-only context append (the target's prefill graphs run it as their `context_sink`):
        features[r, :counts[r]] into draft cache slot slots[r] from starts[r]."""
        self.drafter.append_context_tensors(self.cache, slots, starts, counts, features, self.cache.max_len)

    def held(self, reqs: list[Request]) -> Flush | None:
        """Account one row each that a plain step's forward put in `pending` (ModelRunner.tap_sink);
        what to append now, if a request's rows fill one draft step's append.

        Plain steps' rows wait with the request's earlier ones until these fill one draft step's
        append (K + 1 rows), then go in together. Appending every row costs a drafter pass per plain
        step (on a CPU, a third of a small model's step); an unbounded backlog costs memory and,
        after a stretch of plain steps, an eager catch-up before the next speculative step. Bounded
        by K + 1, the backlog is what the graphed draft step appends anyway.

        When one request's rows fill, every request of the step appends what it holds: requests
        that joined at different steps would otherwise fill in turn, one append launch per plain
        step; appended together they stay in phase, one launch every K + 1 steps."""
        room, k, full = self.pending.shape[1], self.num_drafts, False
        for r in reqs:  # one pass: a plain step runs this for every request
            if r.num_pending >= room:
                self._check_room(r, 1)
            r.num_pending += 1
            full = full or r.num_pending > k
        if not full:
            return None
        counts, starts = self.take(reqs)
        return [r.slot for r in reqs], starts, counts

    def hold(self, reqs: list[Request], features: Tensor, counts: list[int]) -> None:
        """Keep features[i, :counts[i]] (a verify's accepted rows) after the rows reqs[i] holds already,
        for its next draft (one scatter for all)."""
        src_row, src_col, slot, col = [], [], [], []
        for i, (r, c) in enumerate(zip(reqs, counts)):
            self._check_room(r, c)
            src_row += [i] * c
            src_col += range(c)
            slot += [r.slot] * c
            col += range(r.num_pending, r.num_pending + c)
            r.num_pending += c
        if src_row:
            idx = to_device([src_row, src_col, slot, col], torch.int64, features.device)
            self.pending[idx[2], idx[3]] = features[idx[0], idx[1]].to(self.pending.dtype)

    def stage(self, slots: Tensor, features: Tensor) -> None:
        """Put a verify's rows [R, W + 1, F] in the slots' held rows, on the device, for a draft launched
        before the host knows how many of them were accepted (rows past each count are never read)."""
        self.pending[slots, : features.shape[1]] = features

    def take(self, reqs: list[Request]) -> tuple[list[int], list[int]]:
        """Each request's held rows and where they start in the draft cache; marks them consumed (the
        caller appends them from the buffer)."""
        counts = [r.num_pending for r in reqs]
        starts = [r.num_draft_ctx for r in reqs]
        for r, c in zip(reqs, counts):
            r.num_draft_ctx += c
            r.num_pending = 0
        return counts, starts

    def _check_room(self, req: Request, rows: int) -> None:
        if req.num_pending + rows > self.pending.shape[1]:
            raise RuntimeError(f"request {req.request_id}: {req.num_pending + rows} held context rows exceed the "
                               f"buffer's {self.pending.shape[1]}")
