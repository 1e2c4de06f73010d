"""Which requests hold a KV slot and pages (`running`, oldest first) and which wait (`waiting`).

Admission takes waiting requests in order while a slot and the pages of their first prefill chunk
are free; every step, each running request gets pages for its next positions and a lookahead (the
steps launched before the next reservation); where the pool runs short the newest is preempted: its
slot and pages go back and it waits first, to be recomputed through a prefill. Suspects (the
requests of a step that raised) are admitted one at a time, so one that breaks a step does so alone.
With prefix caching, an admitted request starts from the remembered pages its tokens begin with under its
cache salt (never its last token: the prefill computes at least one), and the full pages of final K/V it
writes are remembered after each prefill chunk, when it is preempted and when it finishes.
"""

from __future__ import annotations

import itertools
import time
from collections import deque

from blockspec.models.kv_cache import PageTable
from blockspec.request import Request, Status


class Scheduler:
    def __init__(self, pages: PageTable, max_prefill_tokens: int, lookahead: int,
                 with_drafter: bool = False) -> None:
        self.pages = pages
        # a remembered page must hold the drafter's context too, where there is a drafter
        self.with_drafter = with_drafter
        self.max_prefill_tokens = max_prefill_tokens
        # positions past its length a request's next two steps may write (this one's and one launched
        # ahead of its commit): verify rows and the drafter's block; pages are reserved that far
        self.lookahead = lookahead
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.request_ids: set[str] = set()  # of the requests waiting or running
        self.num_preemptions = 0

    def add(self, reqs: list[Request]) -> None:
        self.waiting.extend(reqs)
        self.request_ids.update(r.request_id for r in reqs)

    def find(self, request_id: str) -> list[Request]:
        """The requests of `request_id` (its n > 1 copies are `request_id-i`), waiting or running; not another
        caller's request whose id merely starts with it."""
        return [r for r in itertools.chain(self.waiting, self.running)
                if r.request_id == request_id or (r.params.n > 1 and r.request_id == f"{request_id}-{r.index}")]

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def retire(self, req: Request) -> None:
        """A finished request leaves the queues; its slot and pages go back."""
        if req.status is Status.RUNNING:
            self.running.remove(req)
            if req.finish_reason != "error":
                self.remember(req)
            self.pages.release(req.slot)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        self.request_ids.discard(req.request_id)
        req.status = Status.FINISHED

    # ---------------------------------------------------------------- pages
    def pages_wanted(self, req: Request) -> int:
        """Positions a request needs pages for this step: its prefill chunk, or its length, and the
        lookahead of the steps launched before the next reservation."""
        if req.num_cached < req.prefill_len:
            end = min(req.prefill_len, req.num_cached + self.max_prefill_tokens)
        else:
            end = req.length
        return end + self.lookahead

    def reserve(self) -> list[Request]:
        """Give every running request, oldest first, pages for this step and the one launched ahead of
        its commit; where too few are free, preempt the newest until they suffice. A request alone
        always fits: start-up refuses a pool smaller than one max_model_len sequence. Returns the
        requests preempted."""
        preempted = []
        for req in list(self.running):
            if req.status is not Status.RUNNING:  # preempted for an older one
                continue
            wanted = self.pages_wanted(req)
            if wanted <= req.kv_capacity:  # most steps: nothing to do (a page holds several steps)
                continue
            while not self.pages.reserve(req.slot, wanted):
                victim = self.running[-1]
                self.preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            else:
                req.kv_capacity = self.pages.held(req.slot) * self.pages.page_size
        return preempted

    def preempt(self, req: Request) -> None:
        """Take a request's slot and pages back and queue it first. What it emitted stands: it returns
        through a prefill of its prompt and output so far (all but the last token, the anchor), which
        recomputes the K/V and the drafter's context; sampling is keyed by position, so its tokens
        are what they would have been. Rows of it in a step launched ahead are dropped at that
        step's commit, as for an abort."""
        self.remember(req)
        self.requeue(req)
        req.num_preemptions += 1
        self.num_preemptions += 1

    def requeue(self, req: Request, at: int = 0) -> None:
        """Release a running request's slot and pages and queue it (first, or at `at`), to be recomputed."""
        self.running.remove(req)
        self.pages.release(req.slot)
        req.status = Status.WAITING
        req.requeues += 1
        req.slot = -1
        req.num_cached = req.kv_capacity = req.cached_draft_ctx = 0
        req.shares_settled = False
        self.waiting.insert(at, req)

    def admit(self) -> list[Request]:
        """Admit waiting requests in order while a slot and the pages of their first prefill chunk
        are free, keeping a watermark of free pages (a hundredth of the pool) for the running
        requests' growth, so an admission is not undone by a preemption at the next step. A suspect
        runs alone: it joins no batch and none joins it. Returns the requests admitted."""
        joined = []
        while self.waiting and self.pages.num_free_slots:
            req = self.waiting[0]
            if self.running and (req.suspect or self.running[0].suspect):
                break
            slot = self.pages.allocate()
            self._share_prefix(req, slot)
            need = self.pages_wanted(req)
            watermark = self.pages.num_pages // 100 if self.running else 0
            if self.pages.missing(slot, need) + watermark > self.pages.num_free_pages:
                self.pages.release(slot)
                req.num_cached = 0
                break
            self.pages.reserve(slot, need)
            req.kv_capacity = self.pages.held(slot) * self.pages.page_size
            self.waiting.popleft()
            req.slot = slot
            req.status = Status.RUNNING
            if req.scheduled_time is None:  # its first admission: a preempted request's queue time ended before
                req.scheduled_time = time.perf_counter()
            self.running.append(req)
            joined.append(req)
            if req.suspect:
                break
        return joined

    # ---------------------------------------------------------------- prefix caching
    def _share_prefix(self, req: Request, slot: int) -> None:
        """Map the remembered pages the request's tokens start with into its new slot and count them as
        computed. A request that wants its prompt's logprobs, or skips reading the cache, computes every
        position."""
        if self.pages.prefix is None or not req.params.reads_prefix_cache:
            return
        pages = self._remembered(req, needs_draft=False)  # whether it feeds the drafter is decided after
        self.pages.share(slot, pages)
        req.num_cached = len(pages) * self.pages.page_size
        req.cached_draft_ctx = self.pages.prefix.with_draft(pages) * self.pages.page_size

    def settle_shares(self, req: Request) -> None:
        """A request's shared pages are final for its first prefill chunk since its admission: its prompt's
        lookup counts at the first of these, once (vLLM's prefix-cache queries and hits: its tokens, and those
        it shares; a preempted or retried request finding its own pages again is not counted, as vLLM keeps
        those lookups apart)."""
        req.shares_settled = True
        prefix = self.pages.prefix
        if prefix is not None and req.params.reads_prefix_cache and not req.prefix_lookup_counted:
            req.prefix_lookup_counted = True
            prefix.count(req.prefill_len, req.num_cached)

    def _remembered(self, req: Request, needs_draft: bool) -> list[int]:
        """The remembered pages the request's tokens start with (never its last token); with `needs_draft`,
        only those that hold the drafter's context too."""
        limit = req.prefill_len - 1
        pages = self.pages.prefix.lookup(req.token_slice(0, limit), limit, req.cache_salt)
        return pages[: self.pages.prefix.with_draft(pages)] if needs_draft else pages

    def _needs_draft(self, req: Request) -> bool:
        """Whether the pages a request shares must hold the drafter's context: it feeds the drafter, which
        needs every position's taps."""
        return self.with_drafter and req.params.use_speculation and req.feeds_drafter

    def share_more(self, req: Request) -> bool:
        """Before its first prefill chunk after an admission, a request shares what is remembered by then: what a request
        admitted beside it (a burst sharing a system prompt) has written since, in place of its own pages,
        which hold nothing yet; and, where it feeds the drafter, none of the pages it shared at admission
        that lack the drafter's context (written by requests that fed none): it prefills those itself.
        False where the pool then lacks its remaining pages: it waits again, first in the queue, as an
        admission that did not fit."""
        prefix, size = self.pages.prefix, self.pages.page_size
        if prefix is None or not req.params.reads_prefix_cache:
            return True
        pages = self._remembered(req, self._needs_draft(req))
        held = self.pages.shared_columns(req.slot, pages)
        if held == len(pages) == req.num_cached // size:
            return True
        self.pages.truncate(req.slot, held)
        self.pages.share(req.slot, pages[held:])
        req.num_cached = len(pages) * size
        req.cached_draft_ctx = prefix.with_draft(pages) * size
        if self.pages.reserve(req.slot, self.pages_wanted(req)):
            req.kv_capacity = self.pages.held(req.slot) * size
            return True
        self.requeue(req)
        return False

    def waits_for_page(self, req: Request, writing: list[tuple[Request, int, int]]) -> bool:
        """Whether a request about to start its prefill should wait a step: one of `writing` (a request of
        this step and the positions its chunk covers) writes the page this prefill would start with, the
        same tokens up to that page's end, and remembers it; the next step maps it in (`share_more`)."""
        size = self.pages.page_size
        start, end = req.num_cached, req.num_cached + size
        if self.pages.prefix is None or not req.params.reads_prefix_cache or end > req.prefill_len - 1:
            return False
        needs_draft, want = self._needs_draft(req), req.token_slice(0, end)
        return any(lo <= start and hi >= end and other.cache_salt == req.cache_salt
                   and other.token_slice(0, end) == want and (not needs_draft or self._needs_draft(other))
                   for other, lo, hi in writing)

    def remember(self, req: Request) -> None:
        """Remember the request's full pages of final K/V, and which of them hold its drafter context. A stop
        string inside an accepted block cuts the output below what the cache holds: only its tokens count."""
        if self.pages.prefix is None:
            return
        final = min(req.num_cached, req.length)
        draft = min(final, req.num_draft_ctx) if self.with_drafter else final
        self.pages.remember(req.slot, req.token_slice(0, final), final, draft, req.cache_salt)

    def clear_suspect(self) -> None:
        """After a step that did not raise: a suspect (running alone) that committed a token is cleared;
        while other suspects wait it goes back behind them (to be recomputed), so the next runs alone
        now, not after its whole life."""
        req = self.running[0] if self.running else None
        if req is None or not req.suspect or len(req.output_ids) <= req.suspect_since:
            return
        req.suspect = False
        if self.waiting and self.waiting[0].suspect:
            self.requeue(req, at=sum(1 for _ in itertools.takewhile(lambda r: r.suspect, self.waiting)))
