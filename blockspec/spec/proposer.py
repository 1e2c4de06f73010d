"""Drafting and verification for one engine step: feed the drafter its new context, draft a block for
every speculating request in one forward, and accept on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from blockspec.config import ConfigError, SpeculativeConfig
from blockspec.engine.request import Request
from blockspec.models.llama import CausalLM
from blockspec.sample import (
    bad_rows,
    process_logits,
    sample_draft,
    verify_block,
    verify_greedy,
    verify_sample_and_match,
    verify_standard,
)

if TYPE_CHECKING:
    from blockspec.engine.engine import Engine


@dataclass
class DraftBlock:
    """K draft tokens per request (-1 past each request's own length), and what verification needs."""

    tokens: Tensor  # [R, K] int64
    lens: list[int]  # drafts per request (host)
    q_probs: Tensor | None = None  # [R, K, V] distribution each draft was sampled from (probabilistic)
    confidence: Tensor | None = None  # [R, K] DSpark conditional survival c_k


class Proposer:
    def __init__(self, drafter: Any, target: CausalLM, cfg: SpeculativeConfig, max_slots: int, max_len: int) -> None:
        drafter.check_target(target.config)
        self.drafter = drafter
        self.target = target
        self.cfg = cfg
        slots = drafter.num_draft_slots
        k = cfg.num_speculative_tokens or slots
        if k > slots:
            raise ConfigError(f"speculative_config.num_speculative_tokens={k} exceeds the drafter's block "
                              f"({slots} draft positions for block_size {drafter.block_size})")
        self.num_speculative_tokens = k
        self.taps = tuple(drafter.target_layer_ids)
        weight = target.embed_tokens.weight
        self.cache = drafter.new_cache(max_slots, max_len + drafter.block_size + 1, weight.device, weight.dtype)

    def enabled_for_batch(self, batch: int) -> bool:
        limit = self.cfg.max_batch_for_speculation
        return limit is None or batch <= limit

    # ---------------------------------------------------------------- draft
    def _flush_context(self, reqs: list[Request]) -> None:
        """Append every request's pending target features to the draft cache in one call."""
        todo = [r for r in reqs if r.pending_features]
        if not todo:
            return
        feats = [torch.cat(r.pending_features) if len(r.pending_features) > 1 else r.pending_features[0] for r in todo]
        counts = [f.shape[0] for f in feats]
        padded = feats[0].new_zeros(len(todo), max(counts), feats[0].shape[-1])
        for i, f in enumerate(feats):
            padded[i, : f.shape[0]] = f
        self.drafter.append_context(self.cache, [r.slot for r in todo], [r.num_draft_ctx for r in todo], counts,
                                    padded)
        for r, c in zip(todo, counts):
            r.num_draft_ctx += c
            r.pending_features.clear()

    def propose(self, reqs: list[Request], budgets: list[int], engine: "Engine") -> DraftBlock:
        self._flush_context(reqs)
        for r in reqs:
            assert r.num_draft_ctx == r.num_cached, (r.request_id, r.num_draft_ctx, r.num_cached)
        device = self.target.embed_tokens.weight.device
        anchors = torch.tensor([r.output_ids[-1] for r in reqs], dtype=torch.int64, device=device)
        slots = [r.slot for r in reqs]
        hidden = self.drafter.block_hidden(self.cache, slots, [r.num_cached for r in reqs], anchors, self.target.embed)
        k = self.num_speculative_tokens
        slot_hidden = self.drafter.slot_hidden(hidden)[:, :k]
        q_probs = confidence = None
        probabilistic = self.cfg.draft_sample_method == "probabilistic" and not all(r.params.greedy for r in reqs)
        if hasattr(self.drafter, "draft_greedy") and not probabilistic:
            base = self.drafter.logits(slot_hidden)
            tokens, confidence = self.drafter.draft_greedy(base, slot_hidden, anchors)
        elif probabilistic:
            tokens, q_probs, confidence = self._sample_drafts(reqs, slot_hidden, anchors, engine)
        else:
            tokens = engine.runner.greedy_ids(slot_hidden)
        lens = list(budgets)
        cut = torch.arange(k, device=device)[None, :] >= torch.tensor(lens, device=device)[:, None]
        tokens = tokens.masked_fill(cut, -1)
        return DraftBlock(tokens, lens, q_probs, confidence)

    def _sample_drafts(self, reqs: list[Request], slot_hidden: Tensor, anchors: Tensor,
                       engine: "Engine") -> tuple[Tensor, Tensor, Tensor | None]:
        """Drafts drawn from the processed draft distribution (q recorded exactly as sampled)."""
        r, k = slot_hidden.shape[:2]
        params = engine.row_params(reqs, [k] * r)
        round_ = torch.tensor([req.length for req in reqs for _ in range(k)], device=slot_hidden.device)
        if hasattr(self.drafter, "sample_markov"):
            return self.drafter.sample_markov(slot_hidden, anchors, params, round_)
        logits = self.target.compute_logits(slot_hidden)
        tokens, q = sample_draft(logits, params, round_)
        return tokens, q, None

    # ---------------------------------------------------------------- verify
    def verify(self, engine: "Engine", reqs: list[Request], block: DraftBlock,
               hidden: Tensor) -> tuple[list[int], list[list[int]], list[list[dict]] | None]:
        """Accepted counts and emitted tokens per request (one host copy); -1 count = request failed."""
        r, rows, _ = hidden.shape
        lens = torch.tensor(block.lens, dtype=torch.int64, device=hidden.device)
        want_lp = any(q.logprobs is not None for q in reqs)
        if not engine.needs_processing(reqs):
            ids = engine.runner.greedy_ids(hidden)
            num_acc, out = verify_greedy(ids, block.tokens, lens)
            return self._to_host(num_acc, out) + (None,)
        logits = engine.runner.logits(hidden).view(r * rows, -1)
        params = engine.row_params(reqs, [rows] * r, block.tokens)
        processed = process_logits(logits, params)
        bad = bad_rows(logits.view(r, rows, -1).flatten(1)).view(r) if logits.numel() else None
        processed3 = processed.view(r, rows, -1)
        round_ = torch.tensor([q.length for q in reqs], dtype=torch.int64, device=hidden.device)
        method = self.cfg.rejection_sample_method
        if block.q_probs is None and method == "standard" and self.cfg.draft_sample_method == "greedy":
            num_acc, out = verify_sample_and_match(processed3, block.tokens, lens, params)
        elif method == "block":
            num_acc, out = verify_block(processed3, block.q_probs, block.tokens, lens, params, round_)
        else:
            num_acc, out = verify_standard(processed3, block.q_probs, block.tokens, lens, params, round_)
        if bad is not None:
            num_acc = torch.where(bad, torch.full_like(num_acc, -1), num_acc)
        lps = None
        if want_lp:
            flat_tokens = out.clamp(min=0).view(-1)
            lps = engine.logprob_entries(reqs, processed, flat_tokens, [rows] * r)
        acc, toks = self._to_host(num_acc, out)
        return acc, toks, lps

    @staticmethod
    def _to_host(num_acc: Tensor, out: Tensor) -> tuple[list[int], list[list[int]]]:
        both = torch.cat([num_acc[:, None], out], dim=1).tolist()
        return [row[0] for row in both], [row[1:] for row in both]
