"""Drafting and verification for one engine step: feed the drafter its new context, draft a block for
every speculating request in one forward, and accept on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from itertools import accumulate
from operator import mul
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from blockspec.config import ConfigError, SpeculativeConfig
from blockspec.drafters import DraftModel
from blockspec.models.runner import ModelRunner, kv_extents
from blockspec.request import Request
from blockspec.models.llama import CausalLM
from blockspec.speculative.context import DraftContext
from blockspec.speculative.draft_graph import DraftGraphs
from blockspec.speculative.step_graph import StepGraphs
from blockspec.speculative.confidence import StepCostTable, schedule_prefixes, threshold_lengths, timed
from blockspec.sample import (
    RowParams,
    process_logits,
    verify_block,
    verify_greedy,
    verify_sample_and_match,
    verify_standard,
)
from blockspec.transfer import to_device

JOINING = -2  # the accepted count of a packed row that stands for a request joining a chained step


@dataclass
class DraftBlock:
    """K draft tokens per request (-1 past each request's own length), and what verification needs."""

    tokens: Tensor  # [R, K] int64
    lens: list[int] | None  # drafts per request on the host (None: known on the device only, see `propose_after`)
    lens_t: Tensor  # [R] int64 the same on the device
    anchors: Tensor  # [R] int64: the block's first token, the verify forward's first row
    q_probs: Tensor | None = None  # [R, K, V] distribution each draft was sampled from (probabilistic)
    confidence: Tensor | None = None  # [R, K] DSpark conditional survival c_k


@dataclass
class DraftLaunch:
    """A greedy draft launched for the next step right after a verify, before the host commits that
    verify's tokens: the GPU drafts while the host detokenises and checks stops. Graphed, its outputs
    are the draft graph's buffers, valid until the graph's next replay (the next launch or a fresh
    draft in `propose`, both after the step that takes this one has copied what it keeps)."""

    reqs: list[Request]
    anchors: list[int]  # host copy of each block's first token, checked against the committed history
    cached: list[int]  # each request's num_cached at the launch: any step since then changes it
    anchor_ids: Tensor  # [R] int64 on the device
    tokens: Tensor  # [R, K]
    confidence: Tensor | None

    def rows_for(self, reqs: list[Request], last_tokens: list[int]) -> tuple[Tensor, Tensor, Tensor | None] | None:
        """(anchors, tokens, confidence) for `reqs` if every one of them was launched from the history
        it has now, ending in `last_tokens` (requests that finished since the launch drop their
        rows), else None."""
        where = {id(r): i for i, r in enumerate(self.reqs)}
        index = [where.get(id(r), -1) for r in reqs]
        if any(i < 0 or r.num_cached != self.cached[i] or r.num_draft_ctx != r.num_cached
               or max(t, 0) != self.anchors[i] for r, i, t in zip(reqs, index, last_tokens)):
            return None
        if index == list(range(len(self.reqs))):
            return self.anchor_ids, self.tokens, self.confidence
        rows = to_device(index, torch.int64, self.tokens.device)
        conf = self.confidence[rows] if self.confidence is not None else None
        return self.anchor_ids[rows], self.tokens[rows], conf


def profile_verify(runner: ModelRunner, batch: int, rows: int) -> float:
    """Seconds of one verify forward of `batch` requests x `rows` rows (scratch slot, no real KV touched)."""
    cache = runner.cache
    start = min(256, cache.max_len - rows - 1)
    ids = torch.zeros(batch, rows, dtype=torch.int64, device=cache.k[0].device)
    return timed(lambda: runner.forward_ids(ids, [rows] * batch, [start] * batch, [cache.scratch_slot] * batch,
                                            with_taps=True), ids.device)


def draft_length(cfg: SpeculativeConfig, drafter: DraftModel) -> int:
    """Drafts verified per step at most (K): `num_speculative_tokens`, or the drafter's whole block."""
    slots = drafter.num_draft_slots
    k = cfg.num_speculative_tokens or slots
    if k > slots:
        raise ConfigError(f"speculative_config.num_speculative_tokens={k} exceeds the drafter's block "
                          f"({slots} draft positions for block_size {drafter.block_size})")
    return k


class Proposer:
    """Drafts for a batch and verifies them, given what it needs as arguments: the requests, their
    budgets and, for sampled rows, their `RowParams`. `runner` is the target's (its LM head reads
    the verify rows; a verify forward prices DSpark's budget)."""

    def __init__(self, drafter: DraftModel, target: CausalLM, runner: ModelRunner, cfg: SpeculativeConfig,
                 context: DraftContext) -> None:
        drafter.check_target(target.config)
        drafter.bind_target(target)
        drafter.share_target_copies(target)
        self.drafter = drafter
        self.target = target
        self.runner = runner
        self.cfg = cfg
        self.context = context
        k = self.num_speculative_tokens = context.num_drafts
        self.taps = tuple(drafter.target_layer_ids)
        self.cost_table: StepCostTable | None = None
        # the load-aware budget's draft counts, as every tensor-parallel rank takes them (rank 0's: the cost
        # table is each process's clock; `build.agree_on_draft_length`)
        self.agree_lengths: Callable[[list[int]], list[int]] = lambda lens: lens
        has_conf = drafter.has_confidence
        if (cfg.confidence_threshold > 0 or cfg.adaptive_verification) and not has_conf:
            raise ConfigError("speculative_config.confidence_threshold / adaptive_verification need a DSpark drafter "
                              f"with a confidence head; {type(drafter).__name__} has none")
        self.has_confidence = has_conf
        heads = getattr(drafter, "heads", None)
        if cfg.markov_top_k and not (heads is not None and heads.markov_rank > 0):
            raise ConfigError(f"speculative_config.markov_top_k restricts a DSpark drafter's Markov head; "
                              f"{type(drafter).__name__} has none")
        self.calibration: Tensor | None = None
        self.reset_stats()
        self.graphs = DraftGraphs(drafter, target, self.context.cache, self.context.pending, k, cfg.markov_top_k,
                                  use_graphs=runner.use_graphs,  # graphed where the target's forwards are
                                  lengths=cfg.draft_length_candidates)
        self.steps = StepGraphs(k, self.context.pending, runner.cache.scratch_slot, use_graphs=runner.use_graphs)
        self.ahead: DraftLaunch | None = None

    def reset_stats(self) -> None:
        """Calibration and budget statistics start from zero (after the engine's warm-up)."""
        k = self.num_speculative_tokens
        # rows: predicted survival summed, positions verified (device; zeroed in place, as captured steps
        # add to it); realised counts on the host
        if not self.has_confidence:
            self.calibration = None
        elif self.calibration is None:
            self.calibration = torch.zeros(2, k, dtype=torch.float64, device=self.target.embed_tokens.weight.device)
        else:
            self.calibration.zero_()
        self.realised = [0] * k
        self.host_calibration = [[0.0] * k, [0] * k]  # the same sums, from steps that read survival on the host
        self.budget_history: list[int] = []
        # drafts launched ahead of their step's commit and taken by the next step, on their own (a chained
        # step's draft, launched and taken with it, is counted by the engine)
        self.ahead_stats = [0, 0]

    @property
    def matches_samples(self) -> bool:
        """Whether sampled rows are verified by sample-and-match (greedy drafts, token-wise rule): then a
        sampled row's token is a pure function of its logits and its (seed, position), and the step's
        acceptance needs nothing from the host between launch and read (`accept_sampled`)."""
        return self.cfg.draft_sample_method == "greedy" and self.cfg.rejection_sample_method == "standard"

    @property
    def chains(self) -> bool:
        """Whether a step can be launched from the last one's device results (`step_after`): not when
        drafts are pruned by confidences read on the host."""
        return self.cfg.confidence_threshold == 0 and not self.cfg.adaptive_verification

    def enabled_for_batch(self, batch: int) -> bool:
        limit = self.cfg.max_batch_for_speculation
        return limit is None or batch <= limit

    def flush_held(self, reqs: list[Request]) -> None:
        """Account the row a plain step's forward put in the held rows of each of `reqs`, and append
        them to the draft cache once one request's fill a draft step's append (`DraftContext.held`)."""
        flush = self.context.held(reqs)
        if flush is not None:
            self.graphs.append(*flush)

    # ---------------------------------------------------------------- draft
    def probabilistic(self, reqs: list[Request]) -> bool:
        """Whether `reqs`' drafts are sampled (they need their rows' `RowParams`)."""
        return self.cfg.draft_sample_method == "probabilistic" and not all(r.params.greedy for r in reqs)

    def _graphable(self, reqs: list[Request]) -> bool:
        """Whether the step's draft can replay a captured graph (greedy drafts, a captured batch size,
        context rows and positions within the graph's extent)."""
        pending = [r.num_pending for r in reqs]
        return (self.graphs.use_graphs and not self.probabilistic(reqs)
                and self.graphs.fits(len(reqs), pending, max(r.num_cached for r in reqs)))

    def launch_next(self, reqs: list[Request], anchors: list[int], k: int | None = None) -> bool:
        """Launch the next step's greedy draft for `reqs` now, before the host commits the tokens just
        verified: their cache counts and pending features are already advanced, and `anchors` are
        their last emitted tokens. `k`: the drafts that step verifies where it is chosen already (all
        K by default; 0, the plain path, takes the narrowest heads). `propose` takes it if the next
        step drafts for these requests (or for those of them still running); else it is dropped.
        Returns whether it launched."""
        self.ahead = None
        if self.probabilistic(reqs):  # sampled drafts draw from the committed history's RNG positions
            return False
        host = [max(a, 0) for a in anchors]  # a failed row's -1: its request is failed at the commit
        ids = to_device(host, torch.int64, self.target.embed_tokens.weight.device)
        if self._graphable(reqs):
            tokens, confidence = self._graphed_draft(reqs, ids, k)
        else:
            tokens, _, confidence = self._eager_draft(reqs, ids, None, k)
        self.ahead = DraftLaunch(list(reqs), host, [r.num_cached for r in reqs], ids, tokens, confidence)
        self.ahead_stats[0] += 1
        return True

    def propose(self, reqs: list[Request], budgets: list[int], last_tokens: list[int] | None = None,
                draft_params: RowParams | None = None) -> DraftBlock:
        """Draft up to budgets[i] tokens for each request (its draft launched ahead if there is one).
        `last_tokens`: each request's last token when it is not committed yet (a step launched ahead).
        `draft_params`: the K draft rows' sampling parameters of each request, where drafts are sampled."""
        device = self.target.embed_tokens.weight.device
        q_probs = confidence = None
        last = last_tokens if last_tokens is not None else [r.output_ids[-1] for r in reqs]
        ahead, self.ahead = self.ahead, None
        widest = max(budgets, default=0)
        launched = ahead.rows_for(reqs, last) if ahead is not None else None
        if launched is not None and launched[1].shape[1] < widest:  # launched narrower than this step verifies
            launched = None
        if launched is not None:
            anchors, tokens, confidence = launched
            self.ahead_stats[1] += 1
        else:
            anchors = to_device([max(t, 0) for t in last], torch.int64, device)
            if self._graphable(reqs):
                tokens, confidence = self._graphed_draft(reqs, anchors, widest)
            else:
                tokens, q_probs, confidence = self._eager_draft(reqs, anchors, draft_params, widest)
        lens, survival = list(budgets), None
        if confidence is not None:
            lens, survival = self._confident_lengths(confidence, lens)
        lens_t = to_device(lens, torch.int64, device)
        if survival is not None:
            self._record_host_calibration(survival, lens)
        elif confidence is not None:
            self._record_calibration(confidence[:, : max(lens)], lens_t)
        block = self._cut(tokens, lens, lens_t, max(lens), anchors, confidence)
        block.q_probs = q_probs[:, : max(lens)] if q_probs is not None else None
        return block

    def step_after(self, reqs: list[Request], result: Tensor, taps: Tensor, k: int, left: list[int],
                   kv_len: int) -> tuple[Tensor, Tensor]:
        """The next greedy step of `reqs` (draft, verify, acceptance) launched from a verify's results on
        the device before the host reads them: `result` [R, 2 + W] as `pack` made it, `taps`
        [R, W + 1, F] that verify's, `left` the tokens each request may still emit (committed state,
        before that verify), `kv_len` the host's bound on every verify row's last key. One graph on
        CUDA (`StepGraphs`). Returns the packed result and the verify's taps."""
        rows = [[r.slot for r in reqs], [r.num_cached for r in reqs], list(left), [self.request_key(r) for r in reqs]]
        kv_len = self.runner.kv_extent(kv_len) if self.steps.use_graphs else kv_len
        return self.steps.run(self.chained_step, rows, result, taps, k, kv_len)

    def joining(self, last_tokens: list[int], width: int = 3) -> tuple[Tensor, Tensor]:
        """Packed rows [R, width] and taps [R, width - 2, F] that stand for requests joining a chained
        step from their committed state: each one's last token (not yet in the cache) anchors its block,
        and its draft context holds its whole cache already, so nothing is appended for it (accepted
        count `JOINING`)."""
        pending = self.context.pending
        rows = to_device([[JOINING, 0, t] + [0] * (width - 3) for t in last_tokens], torch.int64, pending.device)
        return rows, pending.new_zeros(len(last_tokens), width - 2, pending.shape[-1])

    def with_joining(self, result: Tensor, taps: Tensor, last_tokens: list[int]) -> tuple[Tensor, Tensor]:
        """`result` and `taps` of a step with rows for requests that join the chained step launched from
        them (`joining`)."""
        rows, zeros = self.joining(last_tokens, result.shape[1])
        return torch.cat([result, rows]), torch.cat([taps, zeros.to(taps.dtype)])

    def capture_steps(self, batch_sizes: list[int], ks: list[int]) -> None:
        """Capture the chained step of these batch buckets and draft lengths at every key extent."""
        extents = kv_extents(self.runner.cache.max_len + 1, self.runner.whole_cache_graphs)
        self.steps.capture_all(self.chained_step, batch_sizes, ks, extents)

    def chained_step(self, control: Tensor, result: Tensor, taps: Tensor, k: int, kv_len: int,
                     context: int) -> tuple[DraftBlock, Tensor, Tensor]:
        """`step_after`'s tensor code (captured by `StepGraphs`). control: slots, committed cache counts,
        tokens left, request keys. The verify's a + 1 emitted rows go into the draft context at each
        request's cache count, its last emitted token anchors the block, and each request drafts
        min(k, left - (a + 1) - 1) tokens, never past its limits; the verify starts after them. A row
        of a request joining the chain (`with_joining`) appends nothing and drafts min(k, left - 1).
        Every block starts before `kv_len`, the bound of the verify's keys; the drafter's context products
        run over the first `context` rows of each request's (`StepGraphs.context_rows`), and its last
        layer and heads over the k drafts' rows (a graph a K: no head widths to round up to)."""
        slots, starts, left, keys = control
        ctx_end = min(kv_len, self.graphs.max_ctx)
        accepted = result[:, 0].clamp(0, result.shape[1] - 3)  # a failed row (-1) fails its request at the commit
        counts = torch.where(result[:, 0] == JOINING, 0, accepted + 1)  # a joining row appends nothing
        anchors = result[:, 2:].gather(1, accepted[:, None])[:, 0].clamp(min=0)
        self.context.stage(slots, taps[:, :context])
        tokens, confidence = self.graphs.step(slots, starts, counts, anchors, ctx_end, k, context)
        lens = (left - counts - 1).clamp(0, k)
        verify_at = starts + counts
        if confidence is not None:
            self._record_calibration(confidence[:, :k], lens)
        block = self.keyed(self._cut(tokens, None, lens, k, anchors, confidence), keys, verify_at)
        ids = torch.cat([anchors[:, None], block.tokens.clamp(min=0)], dim=1)
        hidden, verify_taps = self.runner.forward_tensors(ids, slots, verify_at, lens + 1, kv_len)
        return block, self.accept_greedy(block, hidden), verify_taps

    def request_key(self, req: Request) -> int:
        """A request's key in a step's control rows (what `keyed` marks its draws with): none here."""
        return 0

    def keyed(self, block: DraftBlock, keys: Tensor, anchors_at: Tensor) -> DraftBlock:
        """`block` as verification needs it, given each request's key and its anchor's position: as it is
        (the synthetic proposer of the benchmarks keys its drawn acceptance by them)."""
        return block

    def _cut(self, tokens: Tensor, lens: list[int] | None, lens_t: Tensor, width: int, anchors: Tensor,
             confidence: Tensor | None) -> DraftBlock:
        """The block verified: `width` columns (the longest draft), drafts past each request's length -1."""
        cut = torch.arange(width, device=tokens.device)[None, :] >= lens_t[:, None]
        confidence = confidence[:, :width] if confidence is not None else None
        return DraftBlock(tokens[:, :width].masked_fill(cut, -1), lens, lens_t, anchors, None, confidence)

    def _graphed_draft(self, reqs: list[Request], anchors: Tensor,
                       k: int | None = None) -> tuple[Tensor, Tensor | None]:
        """Context append + block + the first k greedy drafts (all by default) replayed as one CUDA
        graph (decode-time steps)."""
        counts, starts = self.context.take(reqs)
        for r in reqs:
            assert r.num_draft_ctx == r.num_cached, (r.request_id, r.num_draft_ctx, r.num_cached)
        return self.graphs.run([r.slot for r in reqs], starts, counts, anchors, k=k)

    def _eager_draft(self, reqs: list[Request], anchors: Tensor, draft_params: RowParams | None,
                     k: int | None = None) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """The reference draft path: flush context, block forward, then the first k greedy drafts (all
        by default; heads as wide as the draft graph's), or drafts sampled with `draft_params`."""
        counts, starts = self.context.take(reqs)
        if any(counts):  # one append for every request's new context rows
            self.graphs.append([r.slot for r in reqs], starts, counts)
        for r in reqs:
            assert r.num_draft_ctx == r.num_cached, (r.request_id, r.num_draft_ctx, r.num_cached)
        width = self.graphs.width(k)
        hidden = self.drafter.block_hidden(self.context.cache, [r.slot for r in reqs], [r.num_cached for r in reqs], anchors,
                                           self.target.embed, self.drafter.block_rows(width))
        slot_hidden = self.drafter.slot_hidden(hidden, width)
        if draft_params is not None:
            per = draft_params.temperature.shape[0] // len(reqs)  # the K rows a request's parameters hold
            if per != width:  # drafted: each request's first `width` of them, at their positions and keys
                rows = torch.arange(len(reqs), device=slot_hidden.device)[:, None] * per + \
                    torch.arange(width, device=slot_hidden.device)[None, :]
                draft_params = draft_params.take(rows.flatten())
            round_ = to_device([req.length for req in reqs], torch.int64, slot_hidden.device)
            return self.drafter.sample_drafts(slot_hidden, anchors, draft_params, round_,
                                              self.target.config.vocab_size, self.cfg.markov_top_k)
        # the target head's ids where the drafter's logits are the target's: ids only, chunked over rows
        tokens, confidence = self.drafter.greedy_drafts(slot_hidden, anchors, self.cfg.markov_top_k,
                                                        head_argmax=self.runner.greedy_ids)
        return tokens, None, confidence

    def _confident_lengths(self, confidence: Tensor, lens: list[int]) -> tuple[list[int], list[list[float]] | None]:
        """Prune drafts by DSpark's confidence: static threshold, then the load-aware budget. Returns the
        lengths and, where the confidences were read, each request's prefix survival.

        Reads the [R, K] confidences on the host once (one extra sync in steps that use them); the rest is
        host arithmetic over K values a request, cheaper there than as tensor ops on a CPU.
        """
        if not (self.cfg.confidence_threshold > 0 or self.cfg.adaptive_verification):
            return lens, None
        rows = confidence.float().tolist()
        survival = [list(accumulate(row, mul)) for row in rows]
        if self.cfg.confidence_threshold > 0:
            lens = threshold_lengths(rows, lens, self.cfg.confidence_threshold)
        if self.cfg.adaptive_verification:
            if self.cost_table is None:
                # a function of the runner, not of the proposer, which would then reference itself
                self.cost_table = StepCostTable(partial(profile_verify, self.runner), self.num_speculative_tokens + 1)
            lens = self.agree_lengths(schedule_prefixes(survival, lens, self.cost_table))
            self.budget_history.append(sum(lens))
        return lens, survival

    def observe_step(self, batch: int, rows: int, seconds: float) -> None:
        """A speculative step's seconds, start to finish, at `rows` verify rows a request: the budget's
        step prices (`StepCostTable.observe`)."""
        if self.cost_table is not None:
            self.cost_table.observe(batch, rows, seconds)

    def _record_calibration(self, confidence: Tensor, lens: Tensor) -> None:
        """Predicted prefix survival of every verified draft position (device sums, read only for metrics):
        the steps whose confidences stay on the device (captured steps)."""
        width = confidence.shape[1]
        if width == 0:
            return
        survival = torch.cumprod(confidence.float(), dim=1)
        keep = torch.arange(width, device=survival.device)[None, :] < lens[:, None]
        self.calibration[0, :width] += (survival * keep).sum(0).double()
        self.calibration[1, :width] += keep.sum(0)

    def _record_host_calibration(self, survival: list[list[float]], lens: list[int]) -> None:
        """`_record_calibration` for a step that read each request's prefix survival on the host."""
        predicted, offered = self.host_calibration
        for row, n in zip(survival, lens):
            for j in range(n):
                predicted[j] += row[j]
                offered[j] += 1

    def record_outcome(self, lens: list[int], accepted: list[int]) -> None:
        """Realised acceptance of the verified positions (host counts known after the step's sync)."""
        if self.calibration is None:
            return
        for n, a in zip(lens, accepted):
            for k in range(min(n, max(a, 0))):
                self.realised[k] += 1

    def calibration_metrics(self) -> dict[str, Any]:
        """Predicted vs realised prefix acceptance per position, and the verify budget per step."""
        if self.calibration is None:
            return {}
        device_predicted, device_offered = self.calibration.tolist()
        host_predicted, host_offered = self.host_calibration
        predicted = [d + h for d, h in zip(device_predicted, host_predicted)]
        offered = [d + h for d, h in zip(device_offered, host_offered)]
        out: dict[str, Any] = {
            "confidence_predicted_per_pos": [p / o if o else None for p, o in zip(predicted, offered)],
            "confidence_realised_per_pos": [r / o if o else None for r, o in zip(self.realised, offered)],
        }
        if self.budget_history:
            out["verify_budget_mean"] = sum(self.budget_history) / len(self.budget_history)
            out["verify_budget_last"] = self.budget_history[-64:]
        return out

    # ---------------------------------------------------------------- verify
    def verify(self, reqs: list[Request], block: DraftBlock, hidden: Tensor, params: RowParams | None,
               want_logprobs: bool = False) -> tuple[list[int], list[list[int]], tuple[Tensor, Tensor, Tensor] | None]:
        """Accepted counts and emitted tokens per request (one host copy; a -1 token after the accepted
        drafts: the request fails there), and for logprobs every verify row's raw logits and processed
        distribution with the token each emitted. `params`: the verify rows' sampling parameters; None where
        every row is plain greedy (acceptance by argmax ids)."""
        r, rows, _ = hidden.shape
        if params is None:
            acc, _, toks = self.unpack(self.accept_greedy(block, hidden).tolist())
            return acc, toks, None
        lens = block.lens_t
        logits = self.runner.logits(hidden).view(r * rows, -1)
        processed = process_logits(logits, params)
        processed3 = processed.view(r, rows, -1)
        round_ = to_device([q.length for q in reqs], torch.int64, hidden.device)
        method = self.cfg.rejection_sample_method
        if self.matches_samples:
            num_acc, out = verify_sample_and_match(processed3, block.tokens, lens, params)
        elif method == "block":
            num_acc, out = verify_block(processed3, block.q_probs, block.tokens, lens, params, round_)
        else:
            num_acc, out = verify_standard(processed3, block.q_probs, block.tokens, lens, params, round_)
        acc, _, toks = self.unpack(self.pack(num_acc, out, block).tolist())
        return acc, toks, (logits, processed, out.clamp(min=0).view(-1)) if want_logprobs else None

    def accept_greedy(self, block: DraftBlock, hidden: Tensor) -> Tensor:
        """Greedy acceptance on the device, packed for one host copy (see `pack`)."""
        ids = self.runner.greedy_ids(hidden)
        num_acc, out = verify_greedy(ids, block.tokens, block.lens_t)
        return self.pack(num_acc, out, block)

    def accept_sampled(self, block: DraftBlock, hidden: Tensor, params: RowParams) -> Tensor:
        """Sample-and-match acceptance on the device (`matches_samples`), packed for one host copy as
        `accept_greedy`'s; `params` fix each row's (seed, position), so the step may be launched before
        the tokens before it are committed."""
        r, rows, _ = hidden.shape
        processed = process_logits(self.runner.logits(hidden).view(r * rows, -1), params)
        num_acc, out = verify_sample_and_match(processed.view(r, rows, -1), block.tokens, block.lens_t, params)
        return self.pack(num_acc, out, block)

    def outcome(self, num_acc: Tensor, out: Tensor, block: DraftBlock) -> tuple[Tensor, Tensor]:
        """What the step emits given the verification's counts and tokens: those (the synthetic
        proposer of the benchmarks replaces them)."""
        return num_acc, out

    def pack(self, num_acc: Tensor, out: Tensor, block: DraftBlock) -> Tensor:
        """[R, 2 + W]: each request's accepted count, its draft length, then its emitted tokens (what
        `unpack` reads on the host and `chained_step` on the device)."""
        num_acc, out = self.outcome(num_acc, out, block)
        return torch.cat([num_acc[:, None], block.lens_t[:, None], out], dim=1)

    @staticmethod
    def unpack(rows: list[list[int]]) -> tuple[list[int], list[int], list[list[int]]]:
        """Accepted counts, draft lengths and emitted tokens from the host copy of `pack`."""
        return [row[0] for row in rows], [row[1] for row in rows], [row[2:] for row in rows]
