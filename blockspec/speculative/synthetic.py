"""Benchmark-only proposer with a set acceptance profile: real drafter and verify forwards, drawn acceptance.

Random weights give real shapes and real timings but no real acceptance (a random drafter almost never
agrees with a random target). To measure what the engine would do with a trained drafter, this proposer
runs the real draft forward and the real verify forward (so every kernel of the step is timed) and then
replaces each request's accepted count by a seeded draw from a per-position acceptance profile.

The draws are keyed noise (`sample.rng`), by the request (its sampling seed, else its prompt) and the
position of its block's anchor, not a stream per engine: engines that verify a request from the same
position draw the same counts, so a bench compares their step costs and choices, not their luck.

The emitted tokens are then the drafts themselves up to the drawn count, plus one more token: they are
NOT what the target would produce. The caches stay consistent (the committed rows are exactly the rows
the verify forward ran), so the following steps cost what they would with real acceptance. Anything
measured with this proposer must be labelled synthetic; it refuses to run without an explicit profile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from blockspec.config import ConfigError, SpeculativeConfig
from blockspec.drafters import DraftModel
from blockspec.models.runner import ModelRunner
from blockspec.sample import RowParams
from blockspec.request import Request
from blockspec.models.llama import CausalLM
from blockspec.speculative.context import DraftContext
from blockspec.sample.rng import STREAM_SYNTHETIC, row_key, uniform_from_keys
from blockspec.speculative.proposer import DraftBlock, Proposer
from blockspec.transfer import to_device

__all__ = ["AcceptanceProfile", "SyntheticProposer", "geometric_rate", "mean_length"]


def geometric_rate(length: float, k: int) -> float:
    """The constant conditional acceptance p whose expected acceptance length with k drafts is `length`.

    Expected length (bonus token included) = 1 + p + p^2 + ... + p^k, increasing in p: solved by bisection.
    """
    if not 1.0 <= length < k + 1:
        raise ConfigError(f"synthetic acceptance length {length} must be in [1, {k + 1}) for {k} drafts "
                          f"per step (the bonus token counts, so {k} drafts give at most {k + 1})")
    lo, hi = 0.0, 1.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if mean_length([mid] * k) < length:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def mean_length(rates: list[float]) -> float:
    """Expected tokens per verify step, bonus included: 1 + r1 + r1 r2 + ... (rates are conditional)."""
    total, survive = 1.0, 1.0
    for p in rates:
        survive *= p
        total += survive
    return total


@dataclass(frozen=True)
class AcceptanceProfile:
    """Conditional acceptance per draft position: rates[i] = P(draft i+1 accepted | drafts 1..i accepted).

    ``spec`` is what the user wrote: a list of rates ("0.9,0.85,0.8"; positions past the list are
    rejected), or one number >= 1, a target mean acceptance length mapped to a constant (geometric)
    rate for the drafter's whole block. A step that verifies fewer drafts keeps the first rates, so a
    shorter draft length never looks better than the same drafter's full one.
    """

    spec: str

    def __post_init__(self) -> None:
        values = self._values()
        if len(values) == 1 and values[0] >= 1:
            return
        bad = [v for v in values if not 0.0 <= v <= 1.0]
        if bad:
            raise ConfigError(f"synthetic acceptance {self.spec!r}: per-position rates must be in [0, 1], got {bad} "
                              "(or give one number >= 1: a mean acceptance length)")

    def _values(self) -> list[float]:
        try:
            values = [float(x) for x in self.spec.split(",") if x.strip()]
        except ValueError:
            values = []
        if not values or not all(math.isfinite(v) for v in values):
            raise ConfigError(f"synthetic acceptance {self.spec!r}: expected comma-separated rates in [0, 1] "
                              "(e.g. 0.9,0.85,0.8) or one mean acceptance length >= 1 (e.g. 6.5)")
        return values

    @property
    def is_mean_length(self) -> bool:
        values = self._values()
        return len(values) == 1 and values[0] >= 1

    def rates(self, k: int) -> list[float]:
        """The k conditional rates this profile gives a drafter that proposes k tokens per step."""
        values = self._values()
        if self.is_mean_length:
            return [geometric_rate(values[0], k)] * k
        return (values + [0.0] * k)[:k]

    def expected_length(self, k: int) -> float:
        """Expected tokens per verify step (bonus included) with k drafts and no budget cut."""
        return mean_length(self.rates(k))


@dataclass
class KeyedBlock(DraftBlock):
    """A draft block with the key of each row's drawn acceptance."""

    keys: Tensor | None = None  # [R] int64 (`rng.row_key`)


class SyntheticProposer(Proposer):
    """Proposer whose accepted counts are keyed draws from an AcceptanceProfile (benchmarks only)."""

    def __init__(self, drafter: DraftModel, target: CausalLM, runner: ModelRunner, cfg: SpeculativeConfig,
                 context: DraftContext, profile: AcceptanceProfile | None = None, seed: int = 0) -> None:
        if profile is None:
            raise ConfigError("SyntheticProposer replaces the target's acceptance with drawn counts (its outputs are "
                              "not the target's); it runs only with an explicit acceptance profile "
                              "(blockspec bench --synthetic-acceptance PROFILE)")
        super().__init__(drafter, target, runner, cfg, context)
        self.profile = profile
        self.rates = profile.rates(drafter.num_draft_slots)[: self.num_speculative_tokens]
        self.rates_t = torch.tensor(self.rates, dtype=torch.float64, device=target.embed_tokens.weight.device)
        self.seed = seed

    def expected_length(self, drafts: int) -> float:
        """Expected tokens per verify step (bonus included) for a request drafting `drafts` tokens."""
        return mean_length(self.rates[:drafts])

    def propose(self, reqs: list[Request], budgets: list[int], last_tokens: list[int] | None = None,
                draft_params: RowParams | None = None) -> DraftBlock:
        block = super().propose(reqs, budgets, last_tokens, draft_params)
        device = block.tokens.device
        keys = to_device([self.request_key(r) for r in reqs], torch.int64, device)
        return self.keyed(block, keys, to_device([r.num_cached for r in reqs], torch.int64, device))

    def keyed(self, block: DraftBlock, keys: Tensor, anchors_at: Tensor) -> KeyedBlock:
        """`block` with its rows' draw keys: the request and the position of its block's anchor (a new
        position each verify round, so no drawn value is used twice)."""
        draws = row_key(keys, anchors_at, STREAM_SYNTHETIC, None)
        return KeyedBlock(**{f.name: getattr(block, f.name) for f in fields(DraftBlock)}, keys=draws)

    def request_key(self, req: Request) -> int:
        """The same request in every engine of a bench: its sampling seed (the bench sets one), else its
        prompt; and the proposer's seed."""
        base = req.params.seed if req.params.seed is not None else tuple(req.prompt_token_ids)
        return hash((self.seed, base)) & ((1 << 62) - 1)

    def draw(self, lens: Tensor, keys: Tensor) -> Tensor:
        """Accepted drafts per request, drawn on the device (so a step can be launched from them before
        the host reads them): consecutive successes, position i passing with rates[i], at most lens[r]."""
        width = int(self.rates_t.shape[0])
        u = uniform_from_keys(keys, width)
        passed = (u < self.rates_t) & (torch.arange(width, device=lens.device)[None, :] < lens[:, None])
        return passed.long().cumprod(1).sum(1)

    def verify(self, reqs: list[Request], block: DraftBlock, hidden: Tensor, params: RowParams | None,
               want_logprobs: bool = False) -> tuple[list[int], list[list[int]], tuple[Tensor, Tensor] | None]:
        if want_logprobs:
            raise ConfigError("SyntheticProposer: logprobs are not available (synthetic tokens have none)")
        return super().verify(reqs, block, hidden, params)

    def outcome(self, num_acc: Tensor, out: Tensor, block: DraftBlock) -> tuple[Tensor, Tensor]:
        """Drawn counts (the real verification still ran, and is timed as usual): each request emits
        its drafts up to the count and one more token, the target's own wherever the count is within
        the real acceptance. A row whose target logits were bad (-1) keeps failing its request."""
        width = block.tokens.shape[1]
        drawn = self.draw(block.lens_t, block.keys)
        # out[i] == drafts[i] for i < real count, so the last token is the target's whenever drawn <= real
        last = out.gather(1, torch.minimum(drawn, num_acc.clamp(min=0))[:, None])
        cols = torch.arange(width + 1, device=out.device)[None, :]
        drafts = torch.cat([block.tokens, block.tokens.new_full((block.tokens.shape[0], 1), -1)], dim=1)
        synthetic = torch.where(cols < drawn[:, None], drafts, torch.where(cols == drawn[:, None], last, -1))
        failed = num_acc < 0
        return torch.where(failed, num_acc, drawn), torch.where(failed[:, None], out, synthetic)
