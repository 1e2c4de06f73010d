"""The step loop: schedule, prefill, then plain or speculative decode steps, commit, detokenise, stop.

One step touches the host once: the sampled/accepted ids (and counts) come back in a single copy;
everything else (logits, probabilities, acceptance) stays on the device.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.engine import memory
from blockspec.errors import RequestError
from blockspec.models.kv_cache import PageTable
from blockspec.request import IncrementalDetokenizer, Logprob, Request, SpecStats, Status
from blockspec.models.runner import BATCH_BUCKETS, CAPTURES, ModelRunner, bucket
from blockspec.models.llama import CausalLM
from blockspec.kernels.attention import resolve_backend
from blockspec.sample import RowParams, logprobs as top_logprobs, process_logits, sample
from blockspec.speculative.policy import DraftLengthPolicy
from blockspec.sampling_params import SamplingParams
from blockspec.transfer import to_device

log = logging.getLogger("blockspec.engine")

# A request that took part in this many failed steps is failed at the next, even where it did not run
# alone: each isolation lets it commit a token, so a fault it causes only beside others ends there.
MAX_FAILED_STEPS = 3


class StepTimer:
    """Splits step time into draft / verify / rest with CUDA events, read once they have passed (a
    step may close while the GPU still runs it: the next step is launched before its read-back)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._totals = {"draft_s": 0.0, "verify_s": 0.0, "rest_s": 0.0}
        self._marks: list[tuple[str, Any]] = []
        self._closed: deque[list[tuple[str, Any]]] = deque()  # closed steps whose events are not read yet
        self._captures_at_start = 0
        self.step_captured = False

    def mark(self, name: str) -> None:
        if not self._marks:
            self._captures_at_start = CAPTURES[0]
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._marks.append((name, ev))
        else:
            self._marks.append((name, time.perf_counter()))

    def discard(self) -> None:
        """Drop the open marks unaccounted (a step that started its timing but launched nothing, or
        a draft launched ahead that the next step did not use)."""
        self._marks.clear()

    def close(self) -> None:
        """End one step's marks; they are accounted (each interval to the mark that opens it) once
        its end has passed on the device, without waiting for it."""
        self.mark("end")
        self._closed.append(self._marks)
        self._marks = []
        # a step that captured a CUDA graph timed the capture too: not a sample of its steady cost
        self.step_captured = CAPTURES[0] != self._captures_at_start
        self._account(wait=False)

    def _account(self, wait: bool) -> None:
        while self._closed:
            marks = self._closed[0]
            if self.cuda:
                if not wait and not marks[-1][1].query():
                    return
                marks[-1][1].synchronize()
            for (name, a), (_, b) in itertools.pairwise(marks):
                dt = a.elapsed_time(b) / 1000 if self.cuda else b - a
                self._totals[f"{name}_s"] = self._totals.get(f"{name}_s", 0.0) + dt
            self._closed.popleft()

    @property
    def totals(self) -> dict[str, float]:
        """Seconds per phase over every closed step (waits for the device to pass their ends)."""
        self._account(wait=True)
        return dict(self._totals)


@dataclass
class PlainLaunch:
    """A plain greedy step launched but not committed yet. The next plain step is launched from its
    device ids before the host reads them back, so the host's commit, detokenisation and stop
    checks overlap the GPU's next forward instead of leaving the GPU idle."""

    reqs: list[Request]
    ids: Tensor  # [R] int64 next tokens on the device (-1: non-finite logits)
    host: Tensor  # [R] pinned copy of ids, valid once `ready` has passed
    ready: Any  # torch.cuda.Event (None on the CPU, where the copy is synchronous)
    captures: int  # CUDA graph captures before the launch (a launch that captured is no timing sample)


@dataclass
class SpecLaunch:
    """A speculative step launched (draft, verify forward and, for greedy rows, acceptance on the
    device) whose results the host has not read yet. With asynchronous scheduling the next greedy
    step is launched whole before this one's tokens are committed, so the GPU drafts and verifies
    while the host detokenises, checks stops and schedules."""

    reqs: list[Request]
    k: int
    budgets: list[int] | None  # drafts asked per request (None: known on the device only, = the block's lengths)
    block: Any  # DraftBlock
    hidden: Tensor  # verify rows' final hidden states (sampled verification reads them at the finish)
    feats: Tensor  # verify rows' tap features, for the drafter's context
    result: Tensor | None  # greedy rows: [R, 2 + W] accepted count, draft length, emitted tokens (Proposer.pack)
    host: Tensor | None  # pinned copy of `result`, valid once `ready`
    ready: Any  # torch.cuda.Event (None on the CPU, where the copy is synchronous)
    captures: int  # CUDA graph captures before the launch (a launch that captured is no timing sample)


class Engine:
    def __init__(
        self,
        model: CausalLM,
        tokenizer: Any,
        config: EngineConfig,
        spec_config: SpeculativeConfig | None = None,
        drafter: Any = None,
        eos_token_ids: Iterable[int] = (),
        proposer_cls: Callable[..., Any] | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.device = model.embed_tokens.weight.device
        self.vocab_size = model.config.vocab_size
        self.eos_ids = sorted(set(eos_token_ids))
        self.proposer = None
        taps: tuple[int, ...] = ()
        self.attention_backend = resolve_backend(config.attention_backend, self.device)
        model.attention_backend = self.attention_backend
        if drafter is not None:
            drafter.attention_backend = self.attention_backend
        drafter = drafter if spec_config is not None else None
        margin, table_len = memory.cache_extent(config, spec_config, drafter)
        self.pages = PageTable(config.max_num_seqs, table_len, config.kv_page_size,
                               memory.plan_pages(model, drafter, config, table_len), self.device)
        # positions past its length a request's next two steps may write (this one's and one launched
        # ahead of its commit): verify rows and the drafter's block; pages are reserved that far
        self.lookahead = 2 * margin + (drafter.block_size if drafter is not None else 0)
        if spec_config is not None:
            from blockspec.speculative.proposer import Proposer

            # proposer_cls: a Proposer subclass (e.g. the benchmark-only SyntheticProposer); None = Proposer
            make = proposer_cls or Proposer
            self.proposer = make(drafter, model, spec_config, config.max_num_seqs, config.max_model_len,
                                 pages=self.pages)
            self.policy = DraftLengthPolicy(self.proposer.num_speculative_tokens, spec_config.adaptive_draft_length)
            taps = self.proposer.taps
        widths = [1 + k for k in self.policy.candidates] if self.proposer else []
        self.runner = ModelRunner(model, self.pages, config.max_model_len + margin, taps, query_buckets=widths,
                                  tap_sink=self.proposer.pending if self.proposer else None,
                                  graph_prefill_tokens=min(config.graph_prefill_tokens, config.max_prefill_tokens),
                                  context_sink=self.proposer.append_taps if self.proposer else None)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.seed_gen = torch.Generator().manual_seed(config.seed)
        self.spec_totals = SpecStats()
        self.timer = StepTimer(self.device)
        self.num_steps = 0
        self.num_generated = 0
        self.num_steps_launched_ahead = 0
        self.num_spec_steps_chained = 0
        self.num_preemptions = 0
        use_async = config.async_scheduling
        self.async_scheduling = self.device.type == "cuda" if use_async is None else use_async
        self._inflight: PlainLaunch | None = None
        # (kind, time) of the last commit of a pipelined step: a pipelined step costs the time from its
        # predecessor's commit, if that predecessor was a step of the same kind ("plain" or "spec")
        self._last_commit: tuple[str, float] | None = None
        self._step_end: float | None = None  # when the last step's decode ended (None: it had none, or a prefill)
        self._spec_inflight: SpecLaunch | None = None
        self._next_choice: tuple[int, int] | None = None  # (batch, K) chosen while launching ahead
        # The draft-length policy decides from measured wall times, which differ between processes: the
        # ranks of a tensor-parallel engine take rank 0's decision through this (identity here)
        self.agree: Callable[[int], int] = lambda decision: decision

    # ---------------------------------------------------------------- start-up
    @torch.no_grad()
    def warmup(self) -> dict[str, float]:
        """Pay every one-time cost before the first request: capture the CUDA graph of each batch
        bucket up to max_num_seqs x verify width (with and without taps), of each prefill batch
        within graph_prefill_tokens, and of the draft step,
        then run short requests end to end, greedy and sampled (each Triton kernel variant prefill,
        decode, the drafter and sampling use, the eager draft path). Counters and the draft-length
        policy start afresh afterwards, so no request and no policy estimate pays for a capture or
        a compilation. Returns what it did."""
        if self.device.type != "cuda" or not self.runner.use_graphs:
            return {"graphs": 0, "seconds": 0.0}
        t0 = time.perf_counter()
        captured = CAPTURES[0]
        top = bucket(self.config.max_num_seqs, BATCH_BUCKETS) or self.config.max_num_seqs
        sizes = [b for b in BATCH_BUCKETS if b <= top]
        self.runner.capture_all(sizes, tapped=self.proposer is not None, untapped=True)
        if self.proposer is not None and self.proposer.graphs.use_graphs:
            self.proposer.graphs.capture_all(sizes)
        prompt_len = min(40, self.config.max_model_len - 10)
        for params in (SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                       SamplingParams(temperature=1.0, seed=0, max_tokens=8, ignore_eos=True)):  # sampling kernels
            for n in (1, min(2, self.config.max_num_seqs)):
                for i in range(n):
                    self.add_request(f"warmup-{n}-{i}", None, [i % self.vocab_size] * prompt_len, params)
                while self.has_unfinished():
                    self.step()
        torch.cuda.synchronize(self.device)
        self._reset_counters()
        return {"graphs": CAPTURES[0] - captured, "seconds": time.perf_counter() - t0}

    def _drop_launches(self) -> None:
        """Forget every step launched and not committed (its rows are recomputed: sampling is keyed by
        position, so they draw the same tokens again)."""
        self._inflight = None
        self._spec_inflight = self._next_choice = None
        self._last_commit = self._step_end = None
        self.timer.discard()
        if self.proposer is not None:
            self.proposer.ahead = None

    def _reset_counters(self) -> None:
        self._drop_launches()  # warm-up requests are all finished: whatever is in flight is discarded
        self.spec_totals = type(self.spec_totals)()
        self.timer = StepTimer(self.device)
        self.num_steps = 0
        self.num_generated = 0
        self.num_steps_launched_ahead = 0
        self.num_spec_steps_chained = 0
        self.num_preemptions = 0
        if self.proposer is not None:
            self.proposer.reset_stats()
            self.policy = DraftLengthPolicy(self.proposer.num_speculative_tokens, self.policy.adaptive)

    # ---------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt: str | None, prompt_ids: list[int],
                    params: SamplingParams) -> list[Request]:
        """Validate and queue a request (n copies for n > 1); errors are raised before any work starts."""
        if not prompt_ids:
            raise RequestError(f"request {request_id}: the prompt is empty (no tokens)")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"request {request_id}: prompt token ids {bad[:5]} outside [0, {self.vocab_size})")
        limit = self.config.max_model_len
        if len(prompt_ids) >= limit:
            raise RequestError(f"request {request_id}: prompt has {len(prompt_ids)} tokens; the context holds "
                               f"{limit} (max_model_len), leaving no room to generate")
        params.check_vocab(self.vocab_size)
        reqs = []
        for i in range(params.n):
            seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self.seed_gen))
            if params.n > 1:
                seed = hash((seed, i)) & (2**62 - 1)
            rid = request_id if params.n == 1 else f"{request_id}-{i}"
            req = Request(rid, prompt, list(prompt_ids), params, seed, index=i)
            req.detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens)
            if params.logprobs is not None:
                req.logprobs = []
            self.waiting.append(req)
            reqs.append(req)
        return reqs

    def abort(self, request_id: str, error: str | None = None) -> None:
        """Drop a request; its slot (and KV) is freed now, between steps. With `error` it ends as failed,
        with that message."""
        for req in list(self.waiting) + list(self.running):
            if req.request_id == request_id or req.request_id.startswith(f"{request_id}-"):
                if req.status is Status.WAITING:
                    self.waiting.remove(req)
                if error is None:
                    self._finish(req, "abort")
                else:
                    self._fail(req, error)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---------------------------------------------------------------- step
    @torch.no_grad()
    def step(self) -> list[Request]:
        """Run one engine step; return the requests whose output changed.

        A step that raises costs no request its work: the requests it ran are preempted (recomputed
        later, with the same output) and return one at a time, so the one whose rows make a step fail
        fails alone (`_recover`)."""
        try:
            touched = self._step()
        except Exception:
            return self._recover()
        if self.running and self.running[0].suspect:  # a suspect runs alone
            self._clear_suspect(self.running[0])
        return touched

    def _step(self) -> list[Request]:
        """Prefill chunks of new requests run beside the decode of the running ones (two forwards in
        one step), so a long prompt arriving never stalls the others. Pages for the running requests'
        next two steps come first (`_reserve`); new requests are admitted only in a step that preempted
        none."""
        if not self._reserve():
            self._admit()
        self.pages.sync()
        prefilling = [r for r in self.running if r.num_cached < r.prefill_len]
        decoding = [r for r in self.running if r.num_cached >= r.prefill_len]
        touched = []
        if prefilling:  # prefill steps start no pipeline, and no step's price spans one
            touched = self._commit_launch()
            self._last_commit = self._step_end = None
        touched += self._prefill(prefilling) if prefilling else []
        decoding = [r for r in decoding if r.status is Status.RUNNING]
        if decoding:
            touched += self._decode(decoding)
        self._step_end = time.perf_counter() if decoding else None
        self.num_steps += 1
        return touched

    def _clear_suspect(self, req: Request) -> None:
        """A suspect that committed a token running alone is cleared; while other suspects wait it goes
        back behind them (to be recomputed), so the next runs alone now, not after its whole life."""
        if len(req.output_ids) <= req.suspect_since:
            return
        req.suspect = False
        if self.waiting and self.waiting[0].suspect:
            self._requeue(req, at=sum(1 for _ in itertools.takewhile(lambda r: r.suspect, self.waiting)))

    def _recover(self) -> list[Request]:
        """After a step raised: whatever it launched is dropped, and the requests it ran are queued first
        as suspects, which run alone one after another (`_admit`) until each commits a token. A suspect whose step
        fails while it runs alone (or that took part in MAX_FAILED_STEPS failed steps) is failed with
        an error that names no internals; the exception goes to the log under the same id."""
        error_id = uuid.uuid4().hex[:12]
        log.exception("engine step failed (error id %s); its %d requests are retried one at a time",
                      error_id, len(self.running))
        self._drop_launches()
        failed = []
        alone = len(self.running) == 1 and self.running[0].suspect
        for req in reversed(list(self.running)):  # newest first: each goes to the queue's front, oldest ends first
            req.num_failed_steps += 1
            if alone or req.num_failed_steps >= MAX_FAILED_STEPS:
                self._fail(req, f"the engine failed while serving this request (error id {error_id}; the "
                                "server log has the details)")
                failed.append(req)
            else:
                self._requeue(req)
                req.suspect, req.suspect_since = True, len(req.output_ids)
        return failed

    def _decode(self, decoding: list[Request]) -> list[Request]:
        """One decode step for every running request: speculative with the policy's K, or plain."""
        if self._spec_inflight is not None:  # launched by the last step: this step is its finish
            launch, self._spec_inflight = self._spec_inflight, None
            touched = self._finish_spec(launch)
            seconds = self._since_last_commit("spec", "spec")
            # a finish that launched no successor ends the pipeline: its interval holds no launch (the
            # work a pipelined interval pays for is the next step's), so it is no sample
            if seconds is not None and self._spec_inflight is not None and launch.captures == CAPTURES[0]:
                self.policy.observe_time(len(launch.reqs), launch.k, seconds)
            return touched  # requests that joined since the launch wait for the next one
        spec = self._speculating(decoding)
        k = self._choose(len(spec)) if spec else 0
        if spec and not k and self.agree(self.policy.parked_again(len(spec))):
            # the policy's re-tries found plain best at this batch size again: the batch, which could
            # draft, will not, so it stops paying for the drafter's context for the rest of its life
            self._stop_feeding(spec)
        plain = [r for r in decoding if k == 0 or r not in spec]
        touched = []
        launch = self._inflight
        if launch is not None and (k or launch.reqs != plain or not self._pipelines(plain, ahead=1)):
            touched += self._commit_launch()  # the pipeline cannot go on: commit what is in flight
            spec = [r for r in spec if r.status is Status.RUNNING]
            plain = [r for r in plain if r.status is Status.RUNNING]
            if k and not spec:
                k = 0
        if not k and plain and self._pipelines(plain, ahead=1 if self._inflight is not None else 0):
            return touched + self._plain_step_async(plain)
        # The policy prices a choice by the wall time it costs, host work included (preparing the
        # launches, waiting for the device, committing and detokenising what it emitted): that,
        # not the device time alone, is what decides tokens per second. A step that follows a decode
        # step costs from that step's end, as a pipelined step costs commit to commit: so the work a
        # caller does between steps (a server streaming what each step emitted) and the drain of a
        # plain pipeline this step breaks are in its price too. Priced from its own launch, a
        # speculative step at T > 0 looked cheap beside pipelined plain steps at a busy server, and
        # was chosen where it lost.
        start = self._step_end
        if k:
            t0 = time.perf_counter() if start is None else start
            touched += self._finish_spec(self._launch_spec(spec, k))
            self._observe_time(len(spec), k, time.perf_counter() - t0)
            self._last_commit = ("spec", time.perf_counter())
        if plain:
            t0 = time.perf_counter() if start is None else start
            self._plain_step(plain)
            touched += plain
            if self.proposer is not None and len(plain) == len(decoding):
                self._observe_time(len(plain), 0, time.perf_counter() - t0)
        return touched

    # ---------------------------------------------------------------- asynchronous plain steps
    def _pipelines(self, reqs: list[Request], ahead: int) -> bool:
        """Whether the next plain step of `reqs` can be launched before `ahead` pending tokens of each
        are committed: sampling that needs no committed history (greedy, or seeded sampling keyed by
        position; not penalties, min_tokens or logprobs), and room for one more token after the
        pending ones (a request known to stop before it is not launched)."""
        if not self.async_scheduling or self.needs_history(reqs):
            return False
        return all(self._has_room(r, ahead) for r in reqs)

    def _plain_step_async(self, reqs: list[Request]) -> list[Request]:
        """Launch the plain step of `reqs`, then commit the one in flight (if any): the GPU runs this
        step while the host does the last one's bookkeeping. Its input tokens are the in-flight
        step's ids, still on the device; its positions are one further along."""
        self.timer.discard()  # a draft launched ahead and not taken: these steps are not split by phase
        prev = self._inflight
        ahead = 1 if prev is not None else 0
        ids = prev.ids if prev is not None else to_device([r.output_ids[-1] for r in reqs], torch.int64, self.device)
        captures = CAPTURES[0]
        hold = self._tap_hold(reqs)
        hidden, _ = self.runner.forward_ids(ids.clamp(min=0).view(-1, 1), [1] * len(reqs),
                                            [r.num_cached + ahead for r in reqs], [r.slot for r in reqs],
                                            with_taps=hold is not None, hold=hold)
        self._held(reqs, hold)
        nxt = self._next_ids(reqs, hidden[:, 0], ahead)
        cuda = self.device.type == "cuda"
        host = torch.empty(len(reqs), dtype=torch.int64, pin_memory=cuda)
        host.copy_(nxt, non_blocking=cuda)
        ready = None
        if cuda:
            ready = torch.cuda.Event()
            ready.record()
        touched = self._commit_launch(pipelined=True) if prev is not None else []
        self._inflight = PlainLaunch(reqs, nxt, host, ready, captures)
        return touched

    def _commit_launch(self, pipelined: bool = False) -> list[Request]:
        """Commit the plain step in flight (waiting for its ids); requests that finished or were
        aborted since its launch drop their row. `pipelined`: the next step is already launched."""
        launch, self._inflight = self._inflight, None
        if launch is None:
            return []
        if launch.ready is not None:
            launch.ready.synchronize()
        touched = []
        for req, tok in zip(launch.reqs, launch.host.tolist()):
            if req.status is Status.RUNNING:
                req.num_cached += 1
                self._append(req, [tok], None)
                touched.append(req)
        # in a run a step costs commit to commit; a lone plain step between speculative ones costs
        # from the speculative commit before it; the last of a run launched no successor: no sample
        seconds = self._since_last_commit("plain" if pipelined else "spec", "plain" if pipelined else None)
        if (seconds is not None and self.proposer is not None and launch.captures == CAPTURES[0]
                and len(touched) == len(launch.reqs)):
            self.policy.observe_time(len(launch.reqs), 0, seconds)
        return touched

    def _since_last_commit(self, after: str, kind: str | None) -> float | None:
        """Seconds since the last pipelined commit if it was of a step of kind `after` ("plain" or
        "spec"), else None (after a switch of kind the interval spans two different steps); then
        mark now as a commit of `kind` (None: a commit no pipelined step follows)."""
        now = time.perf_counter()
        last, self._last_commit = self._last_commit, (kind, now) if kind is not None else None
        return now - last[1] if last is not None and last[0] == after else None

    def _drafts_any(self, reqs: list[Request]) -> bool:
        """Whether a forward must return taps: only requests that may draft later need their features
        (a request that opted out of speculation never feeds the drafter)."""
        return self.proposer is not None and any(r.feeds_drafter for r in reqs)

    def _observe_time(self, batch: int, k: int, seconds: float) -> None:
        """Feed the policy a step time, unless the step paid a one-off cost (a graph capture)."""
        if not self.timer.step_captured:
            self.policy.observe_time(batch, k, seconds)

    def _extend_draft_context(self, reqs: list[Request], feats: Tensor | None, counts: list[int]) -> None:
        """Hand the drafter the features of the tokens a prefill chunk fed, for the requests that may
        draft later (see Proposer.extend_context)."""
        if feats is None:
            return
        rows = [i for i, r in enumerate(reqs) if r.feeds_drafter]
        if rows:
            keep = feats if len(rows) == len(reqs) else feats[to_device(rows, torch.int64, feats.device)]
            self.proposer.extend_context([reqs[i] for i in rows], keep, [counts[i] for i in rows])

    def _draft_context(self, reqs: list[Request], counts: list[int]) -> tuple[list[int], list[int], list[int]]:
        """Where a prefill graph puts each request's chunk of taps in the draft cache: (slot, start, rows);
        the scratch slot and no rows for a request that feeds no drafter."""
        scratch = self.pages.scratch_slot  # the draft cache's too: both share the page table
        fed = [r.feeds_drafter for r in reqs]
        return ([r.slot if f else scratch for r, f in zip(reqs, fed)],
                [r.num_draft_ctx if f else 0 for r, f in zip(reqs, fed)],
                [c if f else 0 for c, f in zip(counts, fed)])

    def _tap_hold(self, reqs: list[Request]) -> tuple[list[int], list[int]] | None:
        """Where a plain step's forward puts each request's taps in the proposer's buffer (slot, next
        held row; the scratch slot for a request that never drafts), or None when none may draft."""
        if not self._drafts_any(reqs):
            return None
        scratch = self.pages.scratch_slot
        return ([r.slot if r.feeds_drafter else scratch for r in reqs],
                [r.num_pending if r.feeds_drafter else 0 for r in reqs])

    def _held(self, reqs: list[Request], hold: tuple[list[int], list[int]] | None) -> None:
        """Account the rows a plain step's forward put in the buffer (see `_tap_hold`)."""
        if hold is not None:
            self.proposer.held([r for r in reqs if r.feeds_drafter])

    def _pages_wanted(self, req: Request) -> int:
        """Positions a request needs pages for this step: its prefill chunk, or its length, and the
        lookahead of the steps launched before the next reservation."""
        if req.num_cached < req.prefill_len:
            end = min(req.prefill_len, req.num_cached + self.config.max_prefill_tokens)
        else:
            end = req.length
        return end + self.lookahead

    def _reserve(self) -> bool:
        """Give every running request, oldest first, pages for this step and the one launched ahead of
        its commit; where too few are free, preempt the newest (`_preempt`) until they suffice. A
        request alone always fits: start-up refuses a pool smaller than one max_model_len sequence.
        Returns whether any request was preempted."""
        preempted = False
        for req in list(self.running):
            if req.status is not Status.RUNNING:  # preempted for an older one
                continue
            wanted = self._pages_wanted(req)
            if wanted <= req.kv_capacity:  # most steps: nothing to do (a page holds several steps)
                continue
            while not self.pages.reserve(req.slot, wanted):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                req.kv_capacity = self.pages.held(req.slot) * self.pages.page_size
        return preempted

    def _preempt(self, req: Request) -> None:
        """Take a request's slot and pages back and queue it first. What it emitted stands: it returns
        through a prefill of its prompt and output so far (all but the last token, the anchor), which
        recomputes the K/V and the drafter's context; sampling is keyed by position, so its tokens
        are what they would have been. Rows of it in a step launched ahead are dropped at that
        step's commit, as for an abort."""
        self._requeue(req)
        req.num_preemptions += 1
        self.num_preemptions += 1

    def _requeue(self, req: Request, at: int = 0) -> None:
        """Release a running request's slot and pages and queue it (first, or at `at`), to be recomputed."""
        self.running.remove(req)
        self.pages.release(req.slot)
        req.status = Status.WAITING
        req.slot = -1
        req.num_cached = req.num_draft_ctx = req.num_pending = req.kv_capacity = 0
        self.waiting.insert(at, req)

    def _admit(self) -> None:
        """Admit waiting requests in order while a slot and the pages of their first prefill chunk
        are free, keeping a watermark of free pages (a hundredth of the pool) for the running
        requests' growth, so an admission is not undone by a preemption at the next step."""
        joined = []
        while self.waiting and self.pages.num_free_slots:
            req = self.waiting[0]
            if self.running and (req.suspect or self.running[0].suspect):  # a suspect runs alone
                break
            slot = self.pages.allocate()
            need = self._pages_wanted(req)
            watermark = self.pages.num_pages // 100 if self.running else 0
            if self.pages.missing(slot, need) + watermark > self.pages.num_free_pages:
                self.pages.release(slot)
                break
            self.pages.reserve(slot, need)
            req.kv_capacity = self.pages.held(slot) * self.pages.page_size
            self.waiting.popleft()
            req.slot = slot
            req.status = Status.RUNNING
            self.running.append(req)
            joined.append(req)
            if req.suspect:
                break
        if self.proposer is not None and joined:
            # whether each feeds the drafter (its prompt's context, its steps' taps): it may speculate
            # and the batch it joins, all of this step's arrivals counted, is not parked
            speculating = [r for r in joined if r.params.use_speculation]
            if speculating:
                batch = sum(r.params.use_speculation for r in self.running)
                feeds = bool(self.agree(self.policy.feeds_drafter(batch, len(speculating))))
                for req in speculating:
                    req.feeds_drafter = feeds
                if not feeds:
                    # the batch has grown into a parked size: a burst reaching the server over a few
                    # steps is judged step by step, so its first arrivals fed a drafter that the whole
                    # batch could not use; those that have not drafted stop (one that has keeps its
                    # context: its batch may shrink back and speculate)
                    self._stop_feeding([r for r in self.running if r.feeds_drafter and not r.spec.num_drafts])

    def _stop_feeding(self, reqs: list[Request]) -> None:
        """These requests stop feeding the drafter: plain wins at the batch they are in, and they will
        not draft (their held taps are dropped). They count as having joined a parked batch."""
        for req in reqs:
            req.feeds_drafter = False
            req.num_pending = 0
        self.policy.parked_joins += len(reqs)

    def _speculating(self, reqs: list[Request]) -> list[Request]:
        """The requests of a batch that may speculate this step: a drafter, a batch within
        max_batch_for_speculation, and no opt-out. None while a request that joined a parked batch
        (and so has no draft context) is still running: drafting for the others would add a draft and a
        verify forward beside its plain one, a step that costs more than either."""
        if self.proposer is None or not self.proposer.enabled_for_batch(len(reqs)):
            return []
        spec = [r for r in reqs if r.params.use_speculation]
        return spec if all(r.feeds_drafter for r in spec) else []

    def _prefill(self, reqs: list[Request]) -> list[Request]:
        budget = self.config.max_prefill_tokens
        runs, starts, chosen = [], [], []
        for req in reqs:
            take = min(req.prefill_len - req.num_cached, budget)  # chunked prefill
            if take <= 0:
                break
            runs.append(req.token_slice(req.num_cached, req.num_cached + take))
            starts.append(req.num_cached)
            chosen.append(req)
            budget -= take
        self.timer.mark("rest")
        counts = [len(run) for run in runs]
        context = self._draft_context(chosen, counts) if self._drafts_any(chosen) else None
        hidden, feats = self.runner.forward(runs, starts, [r.slot for r in chosen], with_taps=context is not None,
                                            context=context)
        if context is not None and feats is None:  # a prefill graph appended the chunk to the draft cache
            self.proposer.context_appended(chosen, context[2])  # no rows for a request that feeds nothing
        done = []
        for i, req in enumerate(chosen):
            req.num_cached += counts[i]
            # a preempted request's anchor is its last token: it samples nothing here
            if req.num_cached == req.prefill_len and not req.output_ids:
                done.append((i, req, counts[i] - 1))
        if not done:
            self.timer.close()
            self._extend_draft_context(chosen, feats, counts)
            return []
        last_hidden = torch.stack([hidden[i, row] for i, _, row in done])
        finished_reqs = [req for _, req, _ in done]
        for req in finished_reqs:
            self._init_history(req)
        tokens, lps = self._sample(finished_reqs, last_hidden)
        self.timer.close()
        # the drafter's copy of the prompt goes in after the first tokens are read back: it runs
        # while the host commits them, not before the first token
        self._extend_draft_context(chosen, feats, counts)
        for j, req in enumerate(finished_reqs):
            self._append(req, [tokens[j]], lps[j] if lps else None)
        return finished_reqs

    def _plain_step(self, reqs: list[Request]) -> None:
        """One plain decode step for `reqs`."""
        self.timer.mark("rest")
        runs = [[r.output_ids[-1]] for r in reqs]
        starts = [r.num_cached for r in reqs]
        hold = self._tap_hold(reqs)
        hidden, _ = self.runner.forward(runs, starts, [r.slot for r in reqs], with_taps=hold is not None, hold=hold)
        self._held(reqs, hold)
        tokens, lps = self._sample(reqs, hidden[:, 0])
        self.timer.close()
        for j, req in enumerate(reqs):
            req.num_cached += 1
            self._append(req, [tokens[j]], lps[j] if lps else None)

    def _choose(self, batch: int) -> int:
        """The policy's K for this step, unless it was chosen already when this step was due to be
        launched ahead (and was then not launched, because the choice was the plain path)."""
        chosen, self._next_choice = self._next_choice, None
        if chosen is not None and chosen[0] == batch:
            return chosen[1]
        return self.agree(self.policy.choose(batch))

    def _launch_spec(self, reqs: list[Request], k: int, ahead: list[int] | None = None,
                     anchors: list[int] | None = None, after: tuple[Tensor, Tensor] | None = None) -> SpecLaunch:
        """Draft and verify `reqs` with up to k drafts each; greedy rows are also accepted on the
        device and copied back without waiting. `ahead`/`anchors`: tokens each request has verified
        but not committed yet, and its last one (the step is launched before that commit).
        `after`: the (packed results, taps) on the device of the greedy step before, which the host
        has not read: this step is launched from them (see `_launch_chained`)."""
        assert self.proposer is not None
        captures = CAPTURES[0]
        self.timer.mark("draft")
        kv_len = None
        if after is None:
            ahead = ahead or [0] * len(reqs)
            budgets = [min(k, self._draft_budget(r, a)) for r, a in zip(reqs, ahead)]
            block = self.proposer.propose(reqs, budgets, self, anchors)
            starts, q_lens = [r.num_cached for r in reqs], [1 + n for n in block.lens]
        else:
            budgets = None
            block, starts = self.proposer.propose_after(reqs, *after, k, [self._tokens_left(r) for r in reqs])
            q_lens = block.lens_t + 1
            # the host's bound: every request emitted all its rows before, and verifies k + 1 rows now
            kv_len = min(max(r.num_cached for r in reqs) + after[1].shape[1] + k + 1, self.runner.cache.max_len + 1)
        self.timer.mark("verify")
        ids = torch.cat([block.anchors[:, None], block.tokens.clamp(min=0)], dim=1)
        hidden, feats = self.runner.forward_ids(ids, q_lens, starts, [r.slot for r in reqs], with_taps=True,
                                                kv_len=kv_len)
        self.timer.mark("rest")
        result = host = ready = None
        if not self.needs_processing(reqs):
            result = self.proposer.accept_greedy(self, block, hidden)
            cuda = self.device.type == "cuda"
            host = torch.empty(result.shape, dtype=result.dtype, pin_memory=cuda)
            host.copy_(result, non_blocking=cuda)
            if cuda:
                ready = torch.cuda.Event()
                ready.record()
        return SpecLaunch(reqs, k, budgets, block, hidden, feats, result, host, ready, captures)

    def _finish_spec(self, launch: SpecLaunch) -> list[Request]:
        """Read a speculative step's results, launch what comes next, then commit the emitted tokens.

        Rows of requests that finished or were aborted since the launch are dropped. With
        asynchronous scheduling the next step is launched before the commit: from this step's
        device results before they are read if it can be (`_launch_chained`), else after the read,
        whole for greedy rows (`_launch_ahead`) or, for sampled verification, its draft: the GPU
        works while the host detokenises."""
        assert self.proposer is not None
        reqs, block = launch.reqs, launch.block
        live = [j for j, r in enumerate(reqs) if r.status is Status.RUNNING]
        chained = self._launch_chained(launch, live)
        if launch.host is not None:
            if launch.ready is not None:
                launch.ready.synchronize()
            num_acc, lens, out_tokens = self.proposer.unpack(launch.host.tolist())
            lps = None
        else:
            num_acc, out_tokens, lps = self.proposer.verify(self, reqs, block, launch.hidden)
            lens = block.lens
        if not chained:
            self.timer.close()
        # The policy learns what choosing k yields: the step is timed under k (by the caller) and every
        # draft it asked for counts as offered, so drafts that DSpark's confidence pruned count as not
        # accepted (a step whose drafts were all pruned is a costly plain step, not a plain sample).
        budgets = launch.budgets if launch.budgets is not None else lens
        self.policy.observe_acceptance([budgets[j] for j in live], [max(num_acc[j], 0) for j in live])
        self.proposer.record_outcome([lens[j] for j in live], [num_acc[j] for j in live])
        for j in live:
            req, a = reqs[j], num_acc[j]  # a non-finite row gives a = 0 and token -1: _append fails it alone
            req.spec.record(lens[j], a)
            self.spec_totals.record(lens[j], a)
            req.num_cached += a + 1
            if chained:  # the launched draft appended these rows on the device
                req.num_draft_ctx = req.num_cached
        if not chained:  # the emitted tokens' taps wait for the next draft
            feats = launch.feats if len(live) == len(reqs) else launch.feats[to_device(live, torch.int64, self.device)]
            self.proposer.hold([reqs[j] for j in live], feats, [num_acc[j] + 1 for j in live])
        if self.async_scheduling and not chained:
            self._launch_ahead([reqs[j] for j in live], [num_acc[j] + 1 for j in live],
                               [out_tokens[j][max(num_acc[j], 0)] for j in live])
        for j in live:
            self._append(reqs[j], out_tokens[j][: num_acc[j] + 1], lps[j] if lps else None)
        nxt = self._spec_inflight
        if nxt is not None and all(r.status is not Status.RUNNING for r in nxt.reqs):
            self._spec_inflight = None  # every request it carries stopped at this commit: nothing to read
            self.timer.discard()
        return [reqs[j] for j in live]

    def _launch_chained(self, launch: SpecLaunch, live: list[int]) -> bool:
        """Launch the next greedy step from `launch`'s accepted counts and tokens on the device, before
        the host reads them, so the GPU goes from one step to the next without waiting for the host.

        Only when the next step is this one again: the same requests decoding (a request that
        arrives meanwhile joins through `_launch_ahead` at the step after), all greedy and
        speculating, none near its token limit, no draft pruned on the host's reading of
        confidences, K > 0. Rows of requests that this step stops (a stop token) are dropped at the
        next finish. Returns whether it launched."""
        reqs = [launch.reqs[j] for j in live]
        proposer = self.proposer
        if not (self.async_scheduling and launch.result is not None and reqs and proposer.chains):
            return False
        decoding = {id(r) for r in self.running if r.num_cached >= r.prefill_len}
        emitted = launch.result.shape[1] - 2  # rows the step may emit per request (drafts + 1)
        # a request that may reach its limit in this step is left to `_launch_ahead`, which knows
        if (decoding != {id(r) for r in reqs} or not all(self._has_room(r, launch.k + 1) for r in reqs)
                or len(self._speculating(reqs)) < len(reqs)
                or any(r.num_pending or r.num_draft_ctx != r.num_cached for r in reqs)
                or not proposer.graphs.fits(len(reqs), [emitted], max(r.num_cached for r in reqs) + emitted)):
            return False
        k = self._choose(len(reqs))
        if not k:
            self._next_choice = (len(reqs), 0)  # taken by the plain path, not chosen again
            return False
        result, feats = launch.result, launch.feats
        if len(live) != len(launch.reqs):
            rows = to_device(live, torch.int64, result.device)
            result, feats = result[rows], feats[rows]
        self.timer.close()  # this step's marks end here; the next step's begin
        self._spec_inflight = self._launch_spec(reqs, k, after=(result, feats))
        self.num_steps_launched_ahead += 1
        self.num_spec_steps_chained += 1
        return True

    def _launch_ahead(self, verified: list[Request], emitted: list[int], last: list[int]) -> None:
        """Launch the next speculative step before committing this one: its draft first (a draft
        does not depend on K, so the GPU starts at once), then, if every request that will decode
        next is greedy and speculates, its verify and acceptance with the policy's K chosen now for
        that step; for sampled verification only the draft."""
        verified_now = {id(r): (n, t) for r, n, t in zip(verified, emitted, last)}

        def pending(r: Request) -> tuple[int, int]:  # (tokens not yet committed, the last token)
            return verified_now.get(id(r), (0, r.output_ids[-1]))

        nxt = [r for r in self.running if r.num_cached >= r.prefill_len
               and self._has_room(r, pending(r)[0])]  # the next step's decode set
        whole = bool(nxt) and not self.needs_processing(nxt) and len(self._speculating(nxt)) == len(nxt)
        reqs = nxt if whole else verified
        steps = [pending(r) for r in reqs]
        tokens = [t for _, t in steps]
        self.timer.mark("draft")
        if not self.proposer.launch_next(reqs, tokens, self):
            self.timer.discard()
        if not whole:
            return
        k = self._choose(len(nxt))
        if k:
            self._spec_inflight = self._launch_spec(nxt, k, [n for n, _ in steps], tokens)
            self.num_steps_launched_ahead += 1
        else:  # the plain path next: the draft launched above is dropped
            self._next_choice = (len(nxt), 0)

    def _tokens_left(self, req: Request) -> int:
        """Tokens a request may still emit: up to max_tokens and the context, from its committed state."""
        left = self.config.max_model_len - req.length
        if req.params.max_tokens is not None:
            left = min(left, req.params.max_tokens - len(req.output_ids))
        return left

    def _has_room(self, req: Request, ahead: int) -> bool:
        """Whether a request can take one more token after `ahead` uncommitted ones (a request known
        to stop before it is not launched)."""
        return self._tokens_left(req) > ahead

    def _draft_budget(self, req: Request, ahead: int = 0) -> int:
        """Drafts worth sending: never past max_tokens or the context (emitted tokens <= drafts + 1),
        counting `ahead` tokens verified but not committed yet."""
        assert self.proposer is not None
        return max(0, min(self.proposer.num_speculative_tokens, self._tokens_left(req) - ahead - 1))

    # ---------------------------------------------------------------- sampling
    def row_params(self, reqs: list[Request], rows_per_req: list[int], block_tokens: Tensor | None = None,
                   ahead: int = 0) -> RowParams:
        """Per-row sampling parameters; row j of request r samples the token at position length + ahead + j
        (`ahead`: tokens launched but not yet committed, see `needs_history`)."""
        dev = self.device
        req_of_row = [i for i, c in enumerate(rows_per_req) for _ in range(c)]
        offset = [j for c in rows_per_req for j in range(c)]
        ps = [reqs[i].params for i in req_of_row]

        def col(values: list[Any], dtype: torch.dtype) -> Tensor:
            return to_device(values, dtype, dev)

        bias_rows, bias_ids, bias_vals = [], [], []
        for row, (ri, j) in enumerate(zip(req_of_row, offset)):
            req = reqs[ri]
            p = req.params
            for tok, b in (p.logit_bias or {}).items():
                bias_rows.append(row), bias_ids.append(tok), bias_vals.append(b)
            if len(req.output_ids) + j < p.min_tokens:  # min_tokens: stop ids impossible at this row
                for tok in set(p.stop_token_ids or []) | (set() if p.ignore_eos else set(self.eos_ids)):
                    bias_rows.append(row), bias_ids.append(tok), bias_vals.append(float("-inf"))
        logit_bias = (col(bias_rows, torch.int64), col(bias_ids, torch.int64), col(bias_vals, torch.float32)) \
            if bias_rows else None
        output_counts = prompt_mask = None
        if any(p.uses_penalties for p in ps):
            from blockspec.sample import expand_history

            # a request without penalties beside ones with them: no history, which its neutral
            # penalty values leave without effect
            none_counts = torch.zeros(self.vocab_size, dtype=torch.int32, device=dev)
            none_mask = torch.zeros(self.vocab_size, dtype=torch.bool, device=dev)
            counts = torch.stack([none_counts if r.output_counts is None else r.output_counts for r in reqs])
            masks = torch.stack([none_mask if r.prompt_mask is None else r.prompt_mask for r in reqs])
            req_idx = col(req_of_row, torch.int64)
            if block_tokens is None:
                block_tokens = torch.full((len(reqs), 1), -1, dtype=torch.int64, device=dev)
            output_counts = expand_history(counts, req_idx, block_tokens, col(offset, torch.int64))
            prompt_mask = masks[req_idx]
        return RowParams.from_host(
            temperature=[p.temperature for p in ps],
            seed=[reqs[i].seed for i in req_of_row],
            position=[reqs[i].length + ahead + j for i, j in zip(req_of_row, offset)],
            device=dev,
            top_k=[max(p.top_k, 0) for p in ps],
            top_p=[p.top_p for p in ps],
            min_p=[p.min_p for p in ps],
            presence_penalty=[p.presence_penalty for p in ps],
            frequency_penalty=[p.frequency_penalty for p in ps],
            repetition_penalty=[p.repetition_penalty for p in ps],
            output_counts=output_counts,
            prompt_mask=prompt_mask,
            logit_bias=logit_bias,
        )

    @staticmethod
    def needs_processing(reqs: list[Request]) -> bool:
        """False when every row is plain greedy: then ids are all the step keeps."""
        return any(r.needs_processing for r in reqs)

    @staticmethod
    def needs_history(reqs: list[Request]) -> bool:
        """True when a row's sampling depends on committed tokens (penalties count them, min_tokens
        counts them) or its step keeps more than ids (logprobs): such a step cannot be launched
        before the one in flight is committed."""
        return any(r.needs_history for r in reqs)

    def _next_ids(self, reqs: list[Request], hidden_rows: Tensor, ahead: int = 0) -> Tensor:
        """One token id per request on the device (-1 for a non-finite row), sampled `ahead` tokens
        past each request's committed ones: the noise is keyed by position, so a step launched
        before the commit draws what the step after the commit would."""
        if not self.needs_processing(reqs):
            return self.runner.greedy_ids(hidden_rows)
        return sample(self.runner.logits(hidden_rows), self.row_params(reqs, [1] * len(reqs), ahead=ahead))

    def _sample(self, reqs: list[Request], hidden_rows: Tensor) -> tuple[list[int], list[list[dict]] | None]:
        """Sample one token per request from its last hidden row; one host copy of the ids."""
        if all(r.logprobs is None for r in reqs):
            return self._next_ids(reqs, hidden_rows).tolist(), None
        logits = self.runner.logits(hidden_rows)
        params = self.row_params(reqs, [1] * len(reqs))
        tokens = sample(logits, params)  # -1 for a non-finite row: _append fails that request alone
        return tokens.tolist(), self.logprob_entries(reqs, process_logits(logits, params), tokens, [1] * len(reqs))

    def logprob_entries(self, reqs: list[Request], processed: Tensor, tokens: Tensor,
                        rows_per_req: list[int]) -> list[list[dict]]:
        """Logprob dicts (sampled token + top-n) per emitted row, from the processed distribution."""
        top_n = max((r.params.logprobs or 0) for r in reqs)
        lp, top_ids, top_lp = top_logprobs(processed, tokens.clamp(min=0), top_n)
        rank = (processed > processed.gather(1, tokens.clamp(min=0)[:, None])).sum(-1) + 1
        host = torch.cat([lp[:, None], rank[:, None].float(), top_lp], 1).tolist()
        ids = torch.cat([tokens[:, None], top_ids], 1).tolist()
        out, row = [], 0
        for req, c in zip(reqs, rows_per_req):
            entries = []
            for _ in range(c):
                tok = ids[row][0]
                entry = {tok: Logprob(host[row][0], int(host[row][1]))}
                for t, v in zip(ids[row][1 : 1 + (req.params.logprobs or 0)], host[row][2:]):
                    entry.setdefault(t, Logprob(v))
                entries.append(entry)
                row += 1
            out.append(entries)
        return out

    def _init_history(self, req: Request) -> None:
        if req.params.uses_penalties:
            req.output_counts = torch.zeros(self.vocab_size, dtype=torch.int32, device=self.device)
            req.prompt_mask = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
            req.prompt_mask[to_device(req.prompt_token_ids, torch.int64, self.device)] = True

    # ---------------------------------------------------------------- commit / stop
    def _append(self, req: Request, tokens: list[int], lps: list[dict] | None) -> None:
        """Commit the step's tokens, then update the penalty history once for all of them."""
        start = len(req.output_ids)
        self._commit(req, tokens, lps)
        new = req.output_ids[start:]
        if req.output_counts is not None and new and req.status is Status.RUNNING:
            index = to_device(new, torch.int64, self.device)
            req.output_counts.index_add_(0, index, torch.ones_like(index, dtype=torch.int32))

    def _commit(self, req: Request, tokens: list[int], lps: list[dict] | None) -> None:
        """Commit tokens one by one; a stop inside the block truncates the rest."""
        if req.first_token_time is None:
            req.first_token_time = time.perf_counter()
        p = req.params
        for j, tok in enumerate(tokens):
            if tok < 0:
                self._fail(req, "the target produced non-finite logits (NaN or inf) for this request")
                return
            req.output_ids.append(tok)
            self.num_generated += 1
            if lps is not None and req.logprobs is not None:
                req.logprobs.append(lps[j])
                req.cumulative_logprob += lps[j][tok].logprob
            new_text = req.detok.add(tok) if req.detok else ""
            n_out = len(req.output_ids)
            if n_out >= p.min_tokens:
                if not p.ignore_eos and tok in self.eos_ids:
                    return self._finish(req, "stop", tok)
                if p.stop_token_ids and tok in p.stop_token_ids:
                    return self._finish(req, "stop", tok)
                if p.stop_strings and new_text and self._check_stop_strings(req, len(new_text)):
                    return
            if p.max_tokens is not None and n_out >= p.max_tokens:
                return self._finish(req, "length")
            if req.length >= self.config.max_model_len:
                return self._finish(req, "length")

    def _check_stop_strings(self, req: Request, new_len: int) -> bool:
        text = req.detok.text
        longest = max(len(s) for s in req.params.stop_strings)
        window_start = max(0, len(text) - new_len - longest + 1)
        for s in req.params.stop_strings:
            at = text.find(s, window_start)
            if at >= 0:
                end = at + len(s) if req.params.include_stop_str_in_output else at
                req.truncated_text = text[:end]
                self._finish(req, "stop", s)
                return True
        return False

    def _fail(self, req: Request, message: str) -> None:
        req.error = message
        self._finish(req, "error")

    def _finish(self, req: Request, reason: str, stop_reason: str | int | None = None) -> None:
        req.finish_reason = reason
        req.stop_reason = stop_reason
        req.finish_time = time.perf_counter()
        if req.status is Status.RUNNING:
            self.running.remove(req)
            self.pages.release(req.slot)
        req.status = Status.FINISHED
        req.num_pending = 0

    # ---------------------------------------------------------------- metrics
    def metrics(self) -> dict[str, Any]:
        out = self.spec_totals.as_dict()
        out.update(self.timer.totals)
        if self.proposer is not None:
            out.update(self.proposer.calibration_metrics())
            out["num_drafts_launched_ahead"], out["num_drafts_launched_ahead_taken"] = self.proposer.ahead_stats
            out["num_spec_steps_launched_ahead"] = self.num_steps_launched_ahead
            out["num_spec_steps_chained"] = self.num_spec_steps_chained
        out["num_steps"] = self.num_steps
        out["num_generated_tokens"] = self.num_generated
        out["num_preemptions"] = self.num_preemptions
        return out
