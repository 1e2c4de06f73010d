"""The engine's step: schedule, then launch and commit a prefill and a decode (plain or speculative).

`Engine.step` = `Scheduler` (admission, pages, preemption) -> prefill of new requests -> decode of the
running ones with the draft-length policy's K (0: plain) -> commit (`OutputProcessor`: tokens,
text, stops). With asynchronous scheduling a decode step is launched before the previous one is
committed (`Pipeline`), so the host's bookkeeping overlaps the device's next forward.

One step touches the host once: the sampled/accepted ids (and counts) come back in a single copy;
everything else (logits, probabilities, acceptance) stays on the device.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from blockspec.bad_words import word_sequences
from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.drafters import DraftModel
from blockspec.engine import memory
from blockspec.engine.batch import BatchSampling, needs_history, needs_processing
from blockspec.engine.latency import RequestHistograms
from blockspec.engine.output import OutputProcessor
from blockspec.engine.pipeline import Pipeline, PlainLaunch, SpecLaunch, current_rows, priced_from, verify_rows
from blockspec.engine.scheduler import Scheduler
from blockspec.engine.timer import StepTimer
from blockspec.errors import RequestError
from blockspec.kernels.attention import resolve_backend
from blockspec.models.cpu_linear import draft_head_product, screened_greedy, verify_head_product
from blockspec.models.kv_cache import PageTable, kv_storage_dtype
from blockspec.models.llama import CausalLM
from blockspec.models.quant import is_quantized, quantize_model
from blockspec.models.runner import BATCH_BUCKETS, CAPTURES, ModelRunner, bucket, pool_bytes
from blockspec.reasoning import ThinkingBudget, ThinkTokens
from blockspec.request import IncrementalDetokenizer, Logprob, Request, SpecStats, Status, TokenStrings
from blockspec.sampling_params import SamplingParams
from blockspec.speculative.context import DraftContext
from blockspec.speculative.policy import DraftLengthPolicy
from blockspec.speculative.proposer import Proposer, draft_length
from blockspec.structured import Grammar, new_matcher
from blockspec.transfer import to_device

log = logging.getLogger("blockspec.engine")

# A request that took part in this many failed steps is failed at the next, even where it did not run
# alone: each isolation lets it commit a token, so a fault it causes only beside others ends there. A
# failed step whose cause was then found (a request that failed it again alone) counts against no other.
MAX_FAILED_STEPS = 3


class Engine:
    def __init__(
        self,
        model: CausalLM,
        tokenizer: Any,
        config: EngineConfig,
        spec_config: SpeculativeConfig | None = None,
        drafter: DraftModel | None = None,
        eos_token_ids: Iterable[int] = (),
        proposer_cls: Callable[..., Proposer] | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.device = model.embed_tokens.weight.device
        self.vocab_size = model.config.vocab_size
        self.eos_ids = sorted(set(eos_token_ids))
        # a thinking model's think block: structured outputs' grammars start after it, thinking budgets count in it
        self.think = (ThinkTokens.of(config.reasoning_parser, tokenizer, self.vocab_size) if config.reasoning_parser
                      else None)
        self.attention_backend = resolve_backend(config.attention_backend, self.device)
        model.attention_backend = self.attention_backend
        drafter = drafter if spec_config is not None else None
        model.kv_cache_dtype = kv_storage_dtype(config.kv_cache_dtype, model.embed_tokens.weight.dtype)
        if self.device.type == "cpu":
            model.head_product = verify_head_product(model.lm_head)
        if drafter is not None:
            drafter.attention_backend = self.attention_backend
            drafter.kv_cache_dtype = model.kv_cache_dtype
            if spec_config.quantization and not is_quantized(drafter):
                quantize_model(drafter, spec_config.quantization)  # in place: engines sharing it share this
        margin, table_len = memory.cache_extent(config, spec_config, drafter)
        self.pages = PageTable(config.max_num_seqs, table_len, config.kv_page_size,
                               memory.plan_pages(model, drafter, config, table_len), self.device)
        if config.enable_prefix_caching:
            self.pages.enable_prefix_caching()
        # positions past its length a request's next two steps may write (this one's and one launched
        # ahead of its commit): verify rows and the drafter's block
        lookahead = 2 * margin + (drafter.block_size if drafter is not None else 0)
        self.scheduler = Scheduler(self.pages, config.max_prefill_tokens, lookahead, with_drafter=drafter is not None)
        self.proposer: Proposer | None = None
        self.context: DraftContext | None = None
        widths: list[int] = []
        if drafter is not None:
            k = draft_length(spec_config, drafter)
            weight = model.embed_tokens.weight
            self.context = DraftContext(drafter, self.pages, config.max_model_len, k, config.max_num_seqs,
                                        weight.dtype, weight.device)
            self.policy = DraftLengthPolicy(k, spec_config.adaptive_draft_length, recorded=drafter.recorded_acceptance,
                                            lengths=spec_config.draft_length_candidates)
            widths = [1 + c for c in self.policy.candidates]
        context = self.context
        self.runner = ModelRunner(model, self.pages, config.max_model_len + margin,
                                  drafter.target_layer_ids if drafter is not None else (), query_buckets=widths,
                                  tap_sink=context.pending if context else None,
                                  use_cuda_graphs=False if config.enforce_eager else None,
                                  graph_prefill_tokens=0 if config.enforce_eager else
                                  min(config.graph_prefill_tokens, config.max_prefill_tokens),
                                  context_sink=context.append_taps if context else None)
        if drafter is not None:
            # proposer_cls: a Proposer subclass (e.g. the benchmark-only SyntheticProposer); None = Proposer
            self.proposer = (proposer_cls or Proposer)(drafter, model, self.runner, spec_config, context)
            if self.device.type == "cpu":  # after the proposer has the drafter share the target's head
                drafter.head_product = draft_head_product(drafter.lm_head if drafter.use_own_head else model.lm_head)
                self.runner.head_screen = screened_greedy(model.lm_head, drafter.head_product)
        self.sampling = BatchSampling(self.runner, self.vocab_size, self.eos_ids, config.logprobs_mode,
                                      TokenStrings(tokenizer) if tokenizer is not None else None)
        self.output = OutputProcessor(self.eos_ids, config.max_model_len, getattr(tokenizer, "eos_token_id", None))
        self.pipeline = Pipeline()
        self.seed_gen = torch.Generator().manual_seed(config.seed)
        self.spec_totals = SpecStats()
        self.timer = StepTimer(self.device)
        self.num_steps = 0
        self.num_prefilled_tokens = 0  # prompt positions through the target (recomputed ones too)
        self.finished = RequestHistograms()  # finished requests' latencies, sizes and reasons
        self.num_steps_launched_ahead = 0
        self.num_spec_steps_chained = 0
        self.num_spec_steps_from_committed = 0  # a batch's first steps run as the chained step's body
        self.graph_bytes: dict[str, int] = {}  # what each kind of graph added to the shared pool at warm-up
        use_async = config.async_scheduling
        self.async_scheduling = self.device.type == "cuda" if use_async is None else use_async
        # The draft-length policy decides from measured wall times, which differ between processes: the
        # ranks of a tensor-parallel engine take rank 0's decision through this (identity here)
        self.agree: Callable[[int], int] = lambda decision: decision
        # A failed step is recovered by every rank alike only when it failed on every rank: a tensor-parallel
        # engine's ranks check that through this before recovering (it raises RanksParted when they differ)
        self.check_failed_alike: Callable[[Exception], None] = lambda exc: None

    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

    @property
    def waiting(self) -> list[Request]:
        return list(self.scheduler.waiting)

    @property
    def num_generated(self) -> int:
        return self.output.num_generated

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    # ---------------------------------------------------------------- start-up
    @torch.inference_mode()
    def warmup(self) -> dict[str, float]:
        """Pay every one-time cost before the first request: capture the CUDA graph of each batch
        bucket up to max_num_seqs x verify width (with and without taps), of each prefill batch
        within graph_prefill_tokens, of the plain step's head (greedy and sampled), and of the draft step,
        then run short requests end to end, greedy and sampled (each Triton kernel variant prefill,
        decode, the drafter and sampling use, the eager draft path). Counters and the draft-length
        policy start afresh afterwards, so no request and no policy estimate pays for a capture or
        a compilation. Returns what it did; `graph_bytes` keeps what each kind of graph added to the graphs'
        shared memory pool (in capture order: the target's, the draft step's, the chained step's)."""
        if self.device.type != "cuda" or not self.runner.use_graphs:
            return {"graphs": 0, "seconds": 0.0}
        t0 = time.perf_counter()
        captured = CAPTURES[0]
        top = bucket(self.config.max_num_seqs, BATCH_BUCKETS) or self.config.max_num_seqs
        sizes = [b for b in BATCH_BUCKETS if b <= top]
        self.runner.capture_all(sizes, tapped=self.proposer is not None, untapped=True)
        pool = self.runner.pool
        self.graph_bytes = {"target": pool_bytes(pool)}
        if self.proposer is not None and self.proposer.graphs.use_graphs:
            # one memory pool for every graph: no two run at once (one stream), so one's scratch may lie
            # where another's lay. The target's outputs, alive at the later captures, are safe from their
            # scratch; what the later graphs hand on lies outside the pool (the draft's tokens, the chained
            # step's StepIO), where an earlier graph's replay cannot overwrite it
            self.proposer.graphs.pool = pool
            self.proposer.graphs.capture_all(sizes)
            self.graph_bytes["draft"] = pool_bytes(pool) - sum(self.graph_bytes.values())
            if self.async_scheduling and self.proposer.chains:
                self.proposer.steps.pool = pool
                self.proposer.capture_steps(sizes, self.policy.candidates[1:])
                self.graph_bytes["step"] = pool_bytes(pool) - sum(self.graph_bytes.values())
        prompt_len = min(40, self.config.max_model_len - 10)
        # with prefix caching off: the repeated prompts must each prefill, and nothing of them is remembered
        prefix, self.pages.prefix = self.pages.prefix, None
        try:
            for params in (SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                           SamplingParams(temperature=1.0, seed=0, max_tokens=8, ignore_eos=True)):  # sampling kernels
                for n in (1, min(2, self.config.max_num_seqs)):
                    for i in range(n):
                        self.add_request(f"warmup-{n}-{i}", None, [i % self.vocab_size] * prompt_len, params)
                    while self.has_unfinished():
                        self.step()
        finally:
            self.pages.prefix = prefix
        torch.cuda.synchronize(self.device)
        self._reset_counters()
        return {"graphs": CAPTURES[0] - captured, "seconds": time.perf_counter() - t0}

    def _drop_launches(self) -> None:
        """Forget every step launched and not committed (its rows are recomputed: sampling is keyed by
        position, so they draw the same tokens again)."""
        self.pipeline.drop()
        self.timer.discard()
        if self.proposer is not None:
            self.proposer.ahead = None

    def _drop_launches_if_idle(self) -> None:
        """With no request left, what was launched ahead for the last ones is dropped: no step of theirs
        will take it, and its open timer marks would span the idle time until the next request's step."""
        if not self.scheduler.has_unfinished():
            self._drop_launches()

    def _reset_counters(self) -> None:
        self._drop_launches()  # warm-up requests are all finished: whatever is in flight is discarded
        self.spec_totals = SpecStats()
        self.timer = StepTimer(self.device)
        self.num_steps = 0
        self.output.num_generated = self.output.num_prompt_tokens = 0
        self.finished = RequestHistograms()
        self.num_prefilled_tokens = 0
        self.num_steps_launched_ahead = 0
        self.num_spec_steps_chained = 0
        self.num_spec_steps_from_committed = 0
        self.scheduler.num_preemptions = 0
        if self.proposer is not None:
            self.proposer.reset_stats()
            self.policy = self.policy.fresh()

    # ---------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt: str | None, prompt_ids: list[int],
                    params: SamplingParams, cache_salt: str | None = None) -> list[Request]:
        """Validate and queue a request (n copies for n > 1); errors are raised before any work starts.
        `cache_salt`: it shares prefix-cache pages only with requests of the same salt."""
        if not prompt_ids:
            raise RequestError(f"request {request_id}: the prompt is empty (no tokens)")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"request {request_id}: prompt token ids {bad[:5]} outside [0, {self.vocab_size})")
        limit = self.config.max_model_len
        if len(prompt_ids) >= limit:
            raise RequestError(f"request {request_id}: prompt has {len(prompt_ids)} tokens; the context holds "
                               f"{limit} (max_model_len), leaving no room to generate")
        params.check_model(self.vocab_size, self.config.max_logprobs)
        ids = [request_id] if params.n == 1 else [f"{request_id}-{i}" for i in range(params.n)]
        taken = sorted(self.scheduler.request_ids.intersection(ids))
        if taken:  # two requests of one id would share its aborts and its outputs
            raise RequestError(f"request {request_id}: id {taken[0]!r} is already in flight; each request needs its "
                               "own id")
        budget = params.thinking_token_budget
        if budget is not None and self.think is None:
            raise RequestError(f"request {request_id}: thinking_token_budget needs the engine's reasoning_parser, "
                               "which reads the think block")
        # where the output starts (inside a think block, free to open one, or at its answer), for what reads it
        reads_phase = self.think is not None and (budget is not None or params.structured_outputs is not None)
        phase = self.think.phase(prompt_ids, self.tokenizer.decode) if reads_phase else "answer"
        grammar = None
        if params.structured_outputs is not None:  # compiled before queueing: a bad grammar fails here
            grammar = Grammar(new_matcher(params.structured_outputs, self.tokenizer, self.vocab_size,
                                          tuple(self.eos_ids), f"request {request_id}"), self.think, phase)
        bad = word_sequences(params.bad_words, self.tokenizer, self.vocab_size) if params.bad_words else ()
        # the n copies read one prompt: whichever prefills a position first computes its entry, for all
        prompt_logprobs = [None] if params.prompt_logprobs is not None else None
        reqs = []
        for i in range(params.n):
            if params.seed is not None:  # vLLM's: copy i takes seed + i (kept an int64, as the noise keys it)
                seed = (params.seed + i + 2**63) % 2**64 - 2**63
            else:
                seed = int(torch.randint(0, 2**62, (1,), generator=self.seed_gen))
            req = Request(ids[i], prompt, list(prompt_ids), params, seed, index=i, cache_salt=cache_salt, bad_words=bad)
            req.prompt_logprobs = prompt_logprobs
            if params.detokenize:
                req.detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens)
            if params.logprobs is not None:
                req.logprobs = []
            if grammar is not None:
                req.grammar = grammar.copy()
            if budget is not None:
                req.thinking_budget = ThinkingBudget(self.think, budget, phase)
            reqs.append(req)
        self.scheduler.add(reqs)
        return reqs

    def abort(self, request_id: str, error: str | None = None) -> None:
        """Drop a request; its slot (and KV) is freed now, between steps. With `error` it ends as failed,
        with that message."""
        for req in self.scheduler.find(request_id):
            self._finish(req, "abort" if error is None else "error", error=error)
        self._drop_launches_if_idle()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---------------------------------------------------------------- step
    @torch.inference_mode()
    def step(self) -> list[Request]:
        """Run one engine step; return the requests whose output changed.

        A step that raises costs no request its work: the requests it ran are preempted (recomputed
        later, with the same output) and return one at a time, so the one whose rows make a step fail
        fails alone (`_recover`)."""
        try:
            touched = self._step()
        except Exception as exc:
            self.check_failed_alike(exc)
            return self._recover()
        self.scheduler.clear_suspect()
        return touched

    def _step(self) -> list[Request]:
        """Schedule, then prefill chunks of new requests beside the decode of the running ones (two
        forwards in one step), so a long prompt arriving never stalls the others."""
        self._schedule()
        self.pages.sync()
        running = self.scheduler.running
        prefilling = [r for r in running if r.num_cached < r.prefill_len]
        decoding = [r for r in running if r.num_cached >= r.prefill_len]
        touched = []
        if prefilling:  # prefill steps start no pipeline, and no step's price spans one
            touched = self._commit_plain_inflight()
            self.pipeline.last_commit = self.pipeline.step_end = None
            touched += self._prefill(prefilling)
            self.pipeline.prefill_end = self.timer.stamp()
        decoding = [r for r in decoding if r.status is Status.RUNNING]
        if decoding:
            touched += self._decode(decoding)
            self.pipeline.prefill_end = None
        self.pipeline.step_end = time.perf_counter() if decoding else None
        self._drop_launches_if_idle()
        self.num_steps += 1
        return touched

    def _recover(self) -> list[Request]:
        """After a step raised: whatever it launched is dropped, and the requests it ran are queued first
        as suspects, which run alone one after another (`Scheduler.admit`) until each commits a token.
        A suspect whose step fails while it runs alone (or that took part in MAX_FAILED_STEPS failed
        steps) is failed with an error that names no internals; the exception goes to the log under
        the same id."""
        error_id = uuid.uuid4().hex[:12]
        running = self.scheduler.running
        log.exception("engine step failed (error id %s); its %d requests are retried one at a time",
                      error_id, len(running))
        self._drop_launches()
        failed = []
        alone = len(running) == 1 and running[0].suspect
        if alone:  # the cause of the step it was a suspect of: that step counts against the others no more
            self._acquit(running[0])
        for req in reversed(list(running)):  # newest first: each goes to the queue's front, oldest ends first
            req.num_failed_steps += 1
            req.last_failure = error_id
            if alone or req.num_failed_steps >= MAX_FAILED_STEPS:
                self._fail(req, f"the engine failed while serving this request (error id {error_id}; the "
                                "server log has the details)")
                failed.append(req)
            else:
                self.scheduler.requeue(req)
                req.suspect, req.suspect_since = True, len(req.output_ids)
        return failed

    def _acquit(self, culprit: Request) -> None:
        """The requests that shared `culprit`'s last failed step, cleared of it: `culprit` has failed a step
        alone, so it caused that one (a bystander beside three failing requests was failed at the third)."""
        episode = culprit.last_failure
        if episode is None:
            return
        for req in itertools.chain(self.scheduler.running, self.scheduler.waiting):
            if req is not culprit and req.last_failure == episode:
                req.num_failed_steps -= 1
                req.last_failure = None

    # ---------------------------------------------------------------- schedule
    def _schedule(self) -> None:
        """Pages for the running requests' next steps (preempting the newest where they run short);
        in a step that preempted none, admission. Each admitted request is told whether it feeds the
        drafter (`Request.feeds_drafter`): it may speculate, and the batch it joins, all of this step's
        arrivals counted, is not parked. A request that feeds nothing costs what plain decoding costs."""
        if self.scheduler.reserve():
            return
        joined = self.scheduler.admit()
        if self.context is None or not joined:
            return
        for req in joined:
            self.context.forget(req)  # its context restarts with its prefill
        speculating = [r for r in joined if r.params.use_speculation]
        if not speculating:
            return
        batch = sum(r.params.use_speculation for r in self.scheduler.running)
        feeds = bool(self.agree(self.policy.feeds_drafter(batch, len(speculating))))
        for req in speculating:
            req.feeds_drafter = feeds
        if not feeds:
            # the batch has grown into a parked size: a burst reaching the server over a few steps is
            # judged step by step, so its first arrivals fed a drafter that the whole batch could not
            # use; those that have not drafted stop (one that has keeps its context: its batch may
            # shrink back and speculate)
            self._stop_feeding([r for r in self.scheduler.running if r.feeds_drafter and not r.spec.num_drafts])

    def _stop_feeding(self, reqs: list[Request]) -> None:
        """These requests stop feeding the drafter: plain wins at the batch they are in, and they will
        not draft (their held taps are dropped). They count as having joined a parked batch."""
        for req in reqs:
            req.feeds_drafter = False
            self.context.drop_held(req)
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

    # ---------------------------------------------------------------- prefill
    def _remember(self, reqs: list[Request]) -> None:
        """With prefix caching: the full pages a prefill chunk completed are there for later prompts."""
        if self.pages.prefix is not None:
            for req in reqs:
                self.scheduler.remember(req)

    def _prefill(self, reqs: list[Request]) -> list[Request]:
        """Prompt tokens through the target in chunks of at most max_prefill_tokens, several requests
        padded into one forward; a request whose prompt is done samples its first token."""
        budget = self.config.max_prefill_tokens
        runs, starts, chosen = [], [], []
        for req in reqs:
            if budget <= 0:
                break
            if not req.shares_settled:  # its first chunk since its admission: what is remembered by now
                if not self.scheduler.share_more(req):
                    continue
                writing = [(r, s, s + len(run)) for r, s, run in zip(chosen, starts, runs)]
                if self.scheduler.waits_for_page(req, writing):
                    continue
                self.scheduler.settle_shares(req)
                if self.context is not None:
                    self.context.forget(req)  # its context starts after the pages it shares
                if req.num_cached_tokens is None:  # its first prefill: what the prefix cache held of its prompt
                    req.num_cached_tokens = req.num_cached
            take = min(req.prefill_len - req.num_cached, budget)  # chunked prefill (at least one token)
            runs.append(req.token_slice(req.num_cached, req.num_cached + take))
            starts.append(req.num_cached)
            chosen.append(req)
            budget -= take
        self.pages.sync()  # the pages `share_more` mapped in
        if not chosen:  # each waits again: the pool lacked its pages
            return []
        self.timer.mark("rest")
        counts = [len(run) for run in runs]
        self.num_prefilled_tokens += sum(counts)
        context = self._draft_context(chosen, counts) if self._drafts_any(chosen) else None
        hidden, feats = self.runner.forward(runs, starts, [r.slot for r in chosen], with_taps=context is not None,
                                            context=context)
        if context is not None and feats is None:  # a prefill graph appended the chunk to the draft cache
            self.context.appended(chosen, context[2])  # no rows for a request that feeds nothing
        for i, req in enumerate(chosen):
            if req.prompt_logprobs is not None:
                self.sampling.add_prompt_logprobs(req, hidden[i, : counts[i]], starts[i])
        done = []
        for i, req in enumerate(chosen):
            req.num_cached += counts[i]
            # a preempted request's anchor is its last token: it samples nothing here
            if req.num_cached == req.prefill_len and not req.output_ids:
                done.append((i, req, counts[i] - 1))
        if not done:
            self.timer.close()
            self._extend_draft_context(chosen, feats, counts)
            self._remember(chosen)
            return []
        last_hidden = torch.stack([hidden[i, row] for i, _, row in done])
        finished_reqs = [req for _, req, _ in done]
        for req in finished_reqs:
            self.sampling.start_device_state(req)
        tokens, lps = self.sampling.sample(finished_reqs, last_hidden)
        self.timer.close()
        # the drafter's copy of the prompt goes in after the first tokens are read back: it runs
        # while the host commits them, not before the first token
        self._extend_draft_context(chosen, feats, counts)
        self._remember(chosen)
        for j, req in enumerate(finished_reqs):
            self._append(req, [tokens[j]], lps[j] if lps else None)
        return finished_reqs

    def _drafts_any(self, reqs: list[Request]) -> bool:
        """Whether a forward must return taps: only requests that may draft later need their features
        (a request that opted out of speculation never feeds the drafter)."""
        return self.proposer is not None and any(r.feeds_drafter for r in reqs)

    def _extend_draft_context(self, reqs: list[Request], feats: Tensor | None, counts: list[int]) -> None:
        """Hand the drafter the features of the tokens a prefill chunk fed, for the requests that may
        draft later (see DraftContext.extend)."""
        if feats is None:
            return
        rows = [i for i, r in enumerate(reqs) if r.feeds_drafter]
        if rows:
            keep = feats if len(rows) == len(reqs) else feats[to_device(rows, torch.int64, feats.device)]
            self.context.extend([reqs[i] for i in rows], keep, [counts[i] for i in rows])

    def _draft_context(self, reqs: list[Request], counts: list[int]) -> tuple[list[int], list[int], list[int]]:
        """Where a prefill graph puts each request's chunk of taps in the draft cache: (slot, start, rows);
        the scratch slot and no rows for a request that feeds no drafter."""
        scratch = self.pages.scratch_slot  # the draft cache's too: both share the page table
        fed = [r.feeds_drafter for r in reqs]
        return ([r.slot if f else scratch for r, f in zip(reqs, fed)],
                [r.num_draft_ctx if f else 0 for r, f in zip(reqs, fed)],
                [c if f else 0 for c, f in zip(counts, fed)])

    # ---------------------------------------------------------------- decode
    def _decode(self, decoding: list[Request]) -> list[Request]:
        """One decode step for every running request: speculative with the policy's K, or plain."""
        launch = self.pipeline.take(SpecLaunch)
        if launch is not None:  # launched by the last step: this step is its finish
            touched = self._finish_spec(launch)
            seconds = self.pipeline.since_last_commit("spec", "spec")
            # a finish that launched no successor ends the pipeline: its interval holds no launch (the
            # work a pipelined interval pays for is the next step's), so it is no sample
            if seconds is not None and self.pipeline.inflight is not None and launch.captures == CAPTURES[0]:
                self.policy.observe_time(len(launch.reqs), launch.k, seconds)
                if (rows := verify_rows(launch)) is not None:
                    self.proposer.observe_step(len(launch.reqs), rows, seconds)
            return touched  # requests that joined since the launch wait for the next one
        spec = self._speculating(decoding)
        if not spec and self.proposer is not None:  # a plain step the policy did not choose (a batch over
            self.policy.chosen[0] += 1  # max_batch_for_speculation, or none of it may draft): policy_steps' 0
        k = self._choose(len(spec)) if spec else 0
        if spec and not k and self.agree(self.policy.parked_again(len(spec))):
            # the policy's re-tries found plain best at this batch size again: the batch, which could
            # draft, will not, so it stops paying for the drafter's context for the rest of its life
            self._stop_feeding(spec)
        plain = [r for r in decoding if k == 0 or r not in spec]
        touched = []
        inflight = self.pipeline.inflight
        if inflight is not None and (k or inflight.reqs != plain or len(current_rows(inflight)) < len(plain)
                                     or not self._pipelines(plain, ahead=1)):
            touched += self._commit_plain_inflight()  # the pipeline cannot go on: commit what is in flight
            spec = [r for r in spec if r.status is Status.RUNNING]
            plain = [r for r in plain if r.status is Status.RUNNING]
            if k and not spec:
                k = 0
        if not k and plain and self._pipelines(plain, ahead=1 if self.pipeline.inflight is not None else 0):
            return touched + self._plain_step_pipelined(plain)
        # The policy prices a choice by the wall time it costs, host work included (preparing the
        # launches, waiting for the device, committing and detokenising what it emitted): that,
        # not the device time alone, is what decides tokens per second. A step that follows a decode
        # step costs from that step's end, as a pipelined step costs commit to commit: so the work a
        # caller does between steps (a server streaming what each step emitted) and the drain of a
        # plain pipeline this step breaks are in its price too.
        start = self.pipeline.step_end
        if k:
            t0 = time.perf_counter() if start is None else start
            pending = self.pipeline.prefill_pending()
            launch = self._launch_spec(spec, k, after=self._from_committed(spec))
            if pending:  # queued behind a prefill's work: priced from its end
                t0 = self.pipeline.prefill_passed()
            touched += self._finish_spec(launch)
            # after a decode step (not a prefill) this step refills a pipeline the steps before ran
            refill = self.async_scheduling and start is not None
            self._observe_time(len(spec), k, time.perf_counter() - t0, refill=refill, verify_rows=verify_rows(launch))
            self.pipeline.last_commit = ("spec", time.perf_counter())
        if plain:
            t0 = time.perf_counter() if start is None else start
            t0 = self._plain_step(plain, t0)
            touched += plain
            if self.proposer is not None and len(plain) == len(decoding):
                self._observe_time(len(plain), 0, time.perf_counter() - t0)
        return touched

    def _choose(self, batch: int) -> int:
        """The policy's K for this step, unless it was chosen already when this step was due to be
        launched ahead (and was then not launched, because the choice was the plain path)."""
        chosen, self.pipeline.choice = self.pipeline.choice, None
        if chosen is not None and chosen[0] == batch:
            return chosen[1]
        return self.agree(self.policy.choose(batch))

    def _observe_time(self, batch: int, k: int, seconds: float, refill: bool = False,
                      verify_rows: int | None = None) -> None:
        """Feed the policy a step time, unless the step paid a one-off cost (a graph capture). `refill`:
        a step run start to finish where steps are pipelined (see `DraftLengthPolicy.observe_time`).
        `verify_rows`: a speculative step's rows a request, for the prices of DSpark's verify budget
        (not from a refill, which pays a pipeline's switch)."""
        if not self.timer.step_captured:
            self.policy.observe_time(batch, k, seconds, refill)
            if verify_rows is not None and not refill:
                self.proposer.observe_step(batch, verify_rows, seconds)

    # ---------------------------------------------------------------- plain steps
    def _pipelines(self, reqs: list[Request], ahead: int) -> bool:
        """Whether the next plain step of `reqs` can be launched before `ahead` pending tokens of each
        are committed: sampling that needs no committed history (greedy, or seeded sampling keyed by
        position; not penalties, min_tokens or logprobs), and room for one more token after the
        pending ones (a request known to stop before it is not launched)."""
        if not self.async_scheduling or needs_history(reqs):
            return False
        return all(self._has_room(r, ahead) for r in reqs)

    def _launch_plain(self, reqs: list[Request], prev: PlainLaunch | None = None) -> PlainLaunch:
        """The plain step of `reqs` on the device: from their committed last tokens, or from `prev`'s ids
        still on the device at positions one further along (a step launched before `prev`'s commit).
        Its ids are copied back without waiting; logprobs are read at once (they need their values)."""
        ahead = 1 if prev is not None else 0
        ids = prev.ids if prev is not None else to_device([r.output_ids[-1] for r in reqs], torch.int64, self.device)
        captures = CAPTURES[0]
        hold = self._tap_hold(reqs)
        hidden, _ = self.runner.forward_ids(ids.clamp(min=0).view(-1, 1), [1] * len(reqs),
                                            [r.num_cached + ahead for r in reqs], [r.slot for r in reqs],
                                            with_taps=hold is not None, hold=hold)
        if hold is not None:  # account the rows the forward put in the drafter's held context
            self.proposer.flush_held([r for r in reqs if r.feeds_drafter])
        if any(r.logprobs is not None for r in reqs):
            tokens, lps = self.sampling.sample(reqs, hidden[:, 0])
            return PlainLaunch(reqs, None, torch.tensor(tokens), None, captures, lps)
        nxt = self.sampling.next_ids(reqs, hidden[:, 0], ahead)
        return PlainLaunch(reqs, nxt, *self._copy_back(nxt), captures)

    def _copy_back(self, device_result: Tensor) -> tuple[Tensor, Any]:
        """A pinned host copy of a step's result that nothing waits for yet, and the event it is ready
        at (None on the CPU, where the copy is synchronous)."""
        cuda = self.device.type == "cuda"
        host = torch.empty(device_result.shape, dtype=device_result.dtype, pin_memory=cuda)
        host.copy_(device_result, non_blocking=cuda)
        ready = None
        if cuda:
            ready = torch.cuda.Event()
            ready.record(self.timer.stream)
        return host, ready

    def _commit_plain(self, launch: PlainLaunch) -> list[Request]:
        """Commit a plain step (waiting for its ids); requests that finished or were aborted since its
        launch drop their row."""
        if launch.ready is not None:
            launch.ready.synchronize()
        touched = []
        tokens = launch.host.tolist()
        for j in current_rows(launch):
            req = launch.reqs[j]
            req.num_cached += 1
            self._append(req, [tokens[j]], launch.logprobs[j] if launch.logprobs else None)
            touched.append(req)
        return touched

    def _plain_step(self, reqs: list[Request], t0: float) -> float:
        """One plain decode step for `reqs`, launched and committed; returns the moment it is priced from:
        `t0`, or behind a prefill's work, that work's end (`Pipeline.prefill_passed`)."""
        self.timer.mark("rest")
        pending = self.pipeline.prefill_pending()
        launch = self._launch_plain(reqs)
        if pending:
            t0 = self.pipeline.prefill_passed()
        self.timer.close()
        self._commit_plain(launch)
        return t0

    def _plain_step_pipelined(self, reqs: list[Request]) -> list[Request]:
        """Launch the plain step of `reqs`, then commit the one in flight (if any): the GPU runs this
        step while the host does the last one's bookkeeping."""
        self.timer.discard()  # a draft launched ahead and not taken: these steps are not split by phase
        prev = self.pipeline.take(PlainLaunch)
        t0 = time.perf_counter()
        launch = self._launch_plain(reqs, prev)
        if self.pipeline.prefill_end is not None:  # queued behind a prefill's work: priced from its end
            launch.after_prefill = (t0, self.pipeline.prefill_end, self.timer.stamp())
        touched = self._commit_plain_inflight(prev, pipelined=True) if prev is not None else []
        self.pipeline.inflight = launch
        return touched

    def _commit_plain_inflight(self, launch: PlainLaunch | None = None, pipelined: bool = False) -> list[Request]:
        """Commit the plain step in flight (or `launch`, just taken from the pipeline), and price it for
        the policy. `pipelined`: the next step is already launched."""
        if launch is None:
            launch = self.pipeline.take(PlainLaunch)
            if launch is None:
                return []
        start = None
        if launch.after_prefill is not None:  # launched behind a prefill's work: priced from its end
            start = priced_from(*launch.after_prefill)
        touched = self._commit_plain(launch)
        # in a run a step costs commit to commit; the first commit after a speculative step spans the switch
        # (the policy re-tries the plain path as a run) and the last of a run launched no successor: no samples
        if pipelined:
            seconds = self.pipeline.since_last_commit("plain", "plain")
        else:
            seconds = self.pipeline.last_commit = None
        if start is not None:
            seconds = time.perf_counter() - start
        if (seconds is not None and self.proposer is not None and launch.captures == CAPTURES[0]
                and len(touched) == len(launch.reqs)):
            self.policy.observe_time(len(launch.reqs), 0, seconds)
        return touched

    def _tap_hold(self, reqs: list[Request]) -> tuple[list[int], list[int]] | None:
        """Where a plain step's forward puts each request's taps in the drafter's held context (slot,
        next held row; the scratch slot for a request that never drafts), or None when none may draft."""
        if not self._drafts_any(reqs):
            return None
        scratch = self.pages.scratch_slot
        return ([r.slot if r.feeds_drafter else scratch for r in reqs],
                [r.num_pending if r.feeds_drafter else 0 for r in reqs])

    # ---------------------------------------------------------------- speculative steps
    def _launch_spec(self, reqs: list[Request], k: int, ahead: list[int] | None = None,
                     anchors: list[int] | None = None, after: tuple[Tensor, Tensor] | None = None) -> SpecLaunch:
        """Draft and verify `reqs` with up to k drafts each; greedy rows are also accepted on the
        device and copied back without waiting. `ahead`/`anchors`: tokens each request has verified
        but not committed yet, and its last one (the step is launched before that commit).
        `after`: the (packed results, taps) on the device of the greedy step before, which the host
        has not read, with rows for requests joining from their committed state (or only those: a
        batch's first step): this step is launched from them (see `_launch_chained`, `_from_committed`)."""
        captures = CAPTURES[0]
        if after is not None:  # draft, verify and acceptance in one: one interval of the time split
            self.timer.mark("chained")
            # the host's bound: every request emitted all its rows before, and verifies k + 1 rows now
            kv_len = min(max(r.num_cached for r in reqs) + after[1].shape[1] + k + 1, self.runner.cache.max_len + 1)
            result, feats = self.proposer.step_after(reqs, *after, k, [self._tokens_left(r) for r in reqs], kv_len)
            self.timer.mark("rest")
            return SpecLaunch(reqs, k, None, None, None, feats, result, *self._copy_back(result), captures)
        self.timer.mark("draft")
        ahead = ahead or [0] * len(reqs)
        budgets = [min(k, self._draft_budget(r, a)) for r, a in zip(reqs, ahead)]
        draft_params = None
        if self.proposer.probabilistic(reqs):
            k_max = self.proposer.num_speculative_tokens
            draft_params = self.sampling.params(reqs, [k_max] * len(reqs), constrained=False)
        block = self.proposer.propose(reqs, budgets, anchors, draft_params)
        self.timer.mark("verify")
        ids = torch.cat([block.anchors[:, None], block.tokens.clamp(min=0)], dim=1)
        hidden, feats = self.runner.forward_ids(ids, [1 + n for n in block.lens], [r.num_cached for r in reqs],
                                                [r.slot for r in reqs], with_taps=True)
        self.timer.mark("rest")
        result = host = ready = None
        if not needs_processing(reqs):
            result = self.proposer.accept_greedy(block, hidden)
        elif self._accepted_on_device(reqs):
            params = self.sampling.params(reqs, [hidden.shape[1]] * len(reqs), block.tokens, ahead=ahead)
            result = self.proposer.accept_sampled(block, hidden, params)
        if result is not None:
            host, ready = self._copy_back(result)
        return SpecLaunch(reqs, k, budgets, block, hidden, feats, result, host, ready, captures)

    def _accepted_on_device(self, reqs: list[Request]) -> bool:
        """Whether a speculative step of `reqs` is accepted on the device at its launch, with nothing read
        on the host before its results: greedy rows, or sampled ones verified by sample-and-match whose
        sampling reads no committed history (no penalties, min_tokens, grammar or longer bad word) and
        keeps no logprobs. Such a step can be launched before the one before it is committed."""
        return not needs_processing(reqs) or (self.proposer.matches_samples and not needs_history(reqs))

    def _finish_spec(self, launch: SpecLaunch) -> list[Request]:
        """Read a speculative step's results, launch what comes next, then commit the emitted tokens.

        Rows of requests that finished or were aborted since the launch are dropped. With
        asynchronous scheduling the next step is launched before the commit: from this step's
        device results before they are read if it can be (`_launch_chained`), else after the read,
        whole for greedy rows (`_launch_ahead`) or, for sampled verification, its draft: the GPU
        works while the host detokenises."""
        reqs, block = launch.reqs, launch.block
        live = current_rows(launch)
        chained = self._launch_chained(launch, live)
        lps = None
        if launch.host is not None:
            if launch.ready is not None:
                launch.ready.synchronize()
            num_acc, lens, out_tokens = self.proposer.unpack(launch.host.tolist())
        else:
            r, rows = launch.hidden.shape[:2]
            want_logprobs = any(q.logprobs is not None for q in reqs)
            params = self.sampling.params(reqs, [rows] * r, block.tokens)
            num_acc, out_tokens, scores = self.proposer.verify(reqs, block, launch.hidden, params, want_logprobs)
            if scores is not None:  # raw logits, processed distribution, emitted tokens
                lps = self.sampling.logprob_entries(reqs, *scores, [rows] * r)
            lens = block.lens
        if not chained:
            self.timer.close()
        # The policy learns what choosing k yields: the step is timed under k (by the caller) and every
        # draft it asked for counts as offered, so drafts that DSpark's confidence pruned count as not
        # accepted (a step whose drafts were all pruned is a costly plain step, not a plain sample).
        budgets = launch.budgets if launch.budgets is not None else lens
        self.policy.observe_acceptance([budgets[j] for j in live], [max(num_acc[j], 0) for j in live],
                                       [not reqs[j].params.greedy for j in live])
        self.proposer.record_outcome([lens[j] for j in live], [num_acc[j] for j in live])
        for j in live:
            req, a = reqs[j], num_acc[j]  # a bad row gives token -1 after the accepted drafts: _append fails it there
            req.spec.record(lens[j], a)
            self.spec_totals.record(lens[j], a)
            req.num_cached += a + 1
            if chained:  # the launched draft appended these rows on the device
                self.context.caught_up(req)
        if not chained:  # the emitted tokens' taps wait for the next draft
            feats = launch.feats if len(live) == len(reqs) else launch.feats[to_device(live, torch.int64, self.device)]
            self.context.hold([reqs[j] for j in live], feats, [num_acc[j] + 1 for j in live])
        if self.async_scheduling and not chained:
            self._launch_ahead([reqs[j] for j in live], [num_acc[j] + 1 for j in live],
                               [out_tokens[j][max(num_acc[j], 0)] for j in live])
        for j in live:
            self._append(reqs[j], out_tokens[j][: num_acc[j] + 1], lps[j] if lps else None)
        nxt = self.pipeline.inflight
        if nxt is not None and not current_rows(nxt):
            self.pipeline.inflight = None  # every request it carries stopped at this commit: nothing to read
            self.timer.discard()
        return [reqs[j] for j in live]

    def _launch_chained(self, launch: SpecLaunch, live: list[int]) -> bool:
        """Launch the next greedy step from `launch`'s accepted counts and tokens on the device, before
        the host reads them, so the GPU goes from one step to the next without waiting for the host.

        Only when the next step is this one's requests, and any that started decoding since its
        launch (a prefill just finished) join it from their committed state (`Proposer.with_joining`):
        all greedy and speculating, each drafter context holding its whole cache, no draft pruned on
        the host's reading of confidences, K > 0. The device caps
        each request's drafts to the tokens it has left after this step's; rows of requests that
        this step ends (a stop token, their token limit) are dropped at the next finish, and a step
        all of whose requests ended is dropped whole: a wasted step on the device, where the path
        that waits for the read-back would cost the host several times more at every request's
        last steps. Returns whether it launched."""
        reqs = [launch.reqs[j] for j in live]
        proposer = self.proposer
        if not (self.async_scheduling and launch.result is not None and reqs and proposer.chains
                and not needs_processing(reqs)):  # the step graph accepts greedy rows only
            return False
        carried = {id(r) for r in reqs}
        decoding = [r for r in self.scheduler.running if r.num_cached >= r.prefill_len]
        joining = [r for r in decoding if id(r) not in carried]
        batch = reqs + joining
        emitted = launch.result.shape[1] - 2  # rows the step may emit per request (drafts + 1)
        if (len(decoding) != len(batch) or len(self._speculating(batch)) < len(batch) or not self._joinable(joining)
                or any(r.num_pending or r.num_draft_ctx != r.num_cached for r in reqs)
                or not proposer.graphs.fits(len(batch), [emitted], max(r.num_cached for r in batch) + emitted)):
            return False
        k = self._choose(len(batch))
        if not k:
            self.pipeline.choice = (len(batch), 0)  # taken by the plain path, not chosen again
            return False
        result, feats = launch.result, launch.feats
        if len(live) != len(launch.reqs):
            rows = to_device(live, torch.int64, result.device)
            result, feats = result[rows], feats[rows]
        if joining:
            result, feats = proposer.with_joining(result, feats, [r.output_ids[-1] for r in joining])
        self.timer.close()  # this step's marks end here; the next step's begin
        self.pipeline.inflight = self._launch_spec(batch, k, after=(result, feats))
        self.num_steps_launched_ahead += 1
        self.num_spec_steps_chained += 1
        return True

    def _joinable(self, reqs: list[Request]) -> bool:
        """Whether these requests can join a chained step from their committed state: greedy, nothing of
        theirs in flight (the last token committed and not yet in the cache), and a drafter context that
        holds their whole cache."""
        return not needs_processing(reqs) and all(
            r.num_cached == r.length - 1 and not r.num_pending and r.num_draft_ctx == r.num_cached for r in reqs)

    def _from_committed(self, reqs: list[Request]) -> tuple[Tensor, Tensor] | None:
        """What a speculative step of `reqs` with nothing in flight (a batch's first step) is launched from
        with asynchronous scheduling: rows joining the chained step (`Proposer.joining`), so it is the
        step graph's one replay, not a draft graph, a verify graph and the launches between them, and
        the next step chains from it. None where they cannot join: the step takes the reference path."""
        if not (self.async_scheduling and self.proposer.chains and self._joinable(reqs)
                and self.proposer.graphs.fits(len(reqs), [1], max(r.num_cached for r in reqs) + 1)):
            return None
        self.num_spec_steps_from_committed += 1
        return self.proposer.joining([r.output_ids[-1] for r in reqs])

    def _launch_ahead(self, verified: list[Request], emitted: list[int], last: list[int]) -> None:
        """Launch the next speculative step before committing this one: if every request that will
        decode next speculates and is accepted on the device (`_accepted_on_device`), the policy's K for
        that step is chosen now, its draft launched through the heads of that K (not of all K_max) and
        then its verify and acceptance; for verification on the host only the draft, of every K_max. A
        draft launched for a step that then takes the plain path is dropped: it goes through the
        narrowest heads."""
        verified_now = {id(r): (n, t) for r, n, t in zip(verified, emitted, last)}

        def pending(r: Request) -> tuple[int, int]:  # (tokens not yet committed, the last token)
            return verified_now.get(id(r), (0, r.output_ids[-1]))

        nxt = [r for r in self.scheduler.running if r.num_cached >= r.prefill_len
               and self._has_room(r, pending(r)[0])]  # the next step's decode set
        if not nxt:  # every request this step verified ends with it: no step would take a draft
            return
        whole = self._accepted_on_device(nxt) and len(self._speculating(nxt)) == len(nxt)
        reqs = nxt if whole else verified
        if not reqs:  # a step whose requests all left since its launch (aborted, preempted): nothing to draft for
            return
        steps = [pending(r) for r in reqs]
        tokens = [t for _, t in steps]
        k = self._choose(len(nxt)) if whole else None
        self.timer.mark("draft")
        if not self.proposer.launch_next(reqs, tokens, k):
            self.timer.discard()
        if k is None:
            return
        if k:
            self.pipeline.inflight = self._launch_spec(nxt, k, [n for n, _ in steps], tokens)
            self.num_steps_launched_ahead += 1
        else:  # the plain path next: the draft launched above is dropped
            self.pipeline.choice = (len(nxt), 0)

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
        return max(0, min(self.proposer.num_speculative_tokens, self._tokens_left(req) - ahead - 1))

    # ---------------------------------------------------------------- commit
    def _append(self, req: Request, tokens: list[int], lps: list[dict[int, Logprob]] | None) -> None:
        """Commit the step's tokens (which advances a grammar); a request that goes on counts them in its
        penalty history."""
        start = len(req.output_ids)
        ending = self.output.commit(req, tokens, lps)
        if ending is None:
            self.sampling.add_history(req, req.output_ids[start:])
        else:
            self._finish(req, ending.reason, ending.stop_reason, ending.error)

    def _fail(self, req: Request, message: str) -> None:
        self._finish(req, "error", error=message)

    def _finish(self, req: Request, reason: str, stop_reason: str | int | None = None,
                error: str | None = None) -> None:
        req.finish_reason = reason
        req.stop_reason = stop_reason
        if error is not None:
            req.error = error
        req.finish_time = time.perf_counter()
        self.scheduler.retire(req)
        self.finished.observe(req)

    def reset_prefix_cache(self) -> bool:
        """Forget every remembered page (`PageTable.forget_prefixes`); False without prefix caching."""
        if self.pages.prefix is None:
            return False
        self.pages.forget_prefixes()
        return True

    # ---------------------------------------------------------------- metrics
    def metrics(self) -> dict[str, Any]:
        out = self.spec_totals.as_dict()
        out.update(self.timer.totals)
        if self.proposer is not None:
            out.update(self.proposer.calibration_metrics())
            launched, taken = self.proposer.ahead_stats  # and each chained step's draft, launched and taken
            out["num_drafts_launched_ahead"] = launched + self.num_spec_steps_chained
            out["num_drafts_launched_ahead_taken"] = taken + self.num_spec_steps_chained
            out["num_spec_steps_launched_ahead"] = self.num_steps_launched_ahead
            out["num_spec_steps_chained"] = self.num_spec_steps_chained
            out["num_spec_steps_from_committed"] = self.num_spec_steps_from_committed
            out["num_speculative_tokens"] = self.proposer.num_speculative_tokens
            out["policy_steps"] = dict(self.policy.chosen)  # decode steps by the K chosen (0: plain)
            out["num_parked_requests"] = self.policy.parked_joins
        out["num_steps"] = self.num_steps
        out["num_generated_tokens"] = self.num_generated
        out["num_prompt_tokens"] = self.output.num_prompt_tokens
        out["num_preemptions"] = self.num_preemptions
        prefix = self.pages.prefix
        out["num_prefix_cache_queries"] = prefix.queried_tokens if prefix else 0  # prompt tokens looked up
        out["num_prefix_cache_hits"] = prefix.hit_tokens if prefix else 0  # of them found, not prefilled
        out["num_requests_running"], out["num_requests_waiting"] = len(self.running), len(self.waiting)
        out["kv_cache_usage"] = 1 - self.pages.num_free_pages / self.pages.num_pages  # share of KV pages in use
        out["finished_requests"] = dict(self.finished.reasons)  # by finish reason (stop, length, abort, error)
        # each REQUEST_HISTOGRAMS histogram: bucket bounds, counts per bucket (the last past every bound), sum
        out["request_histograms"] = {name: (h.bounds, list(h.counts), h.sum)
                                     for name, h in self.finished.histograms.items()}
        return out
