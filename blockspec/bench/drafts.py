"""What the speculative steps of a run drafted and accepted: the per-step log a measured engine keeps,
the acceptance figures drawn from it, and how a run that drafted nothing is reported."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from blockspec.request import SpecStats

NO_DRAFTS_WHY = ("no drafts: the draft-length policy chose plain decoding at every step (a step with drafts gave "
                 "fewer tokens per second here)")


@dataclass
class StepLog(SpecStats):
    """The engine's speculation counters, also keeping (drafts, accepted) per request since the last drain.

    The engine picks the draft length per step, so per-position rates need what each step offered,
    not only what it accepted; and step times are grouped by the draft length they ran with.
    """

    pending: list[tuple[int, int]] = field(default_factory=list)

    def record(self, num_draft: int, num_accepted: int) -> None:
        super().record(num_draft, num_accepted)
        if num_draft > 0:
            self.pending.append((num_draft, num_accepted))

    def drain(self) -> list[tuple[int, int]]:
        out, self.pending = self.pending, []
        return out


def acceptance(drafts: list[tuple[int, int]], k: int) -> dict[str, Any]:
    """Acceptance length (tokens per verify step, bonus included) and per-position rates, where position i's
    rate is the share of steps drafting at least i tokens whose first i were all accepted (None: never drafted)."""
    n = len(drafts)
    offered = [sum(d > i for d, _ in drafts) for i in range(k)]
    accepted = [sum(a > i for _, a in drafts) for i in range(k)]
    return {
        "num_speculative_tokens": k,
        "num_drafts": n,
        "mean_draft_length": sum(d for d, _ in drafts) / n if n else None,
        "mean_acceptance_length": 1 + sum(a for _, a in drafts) / n if n else None,
        "acceptance_rate": sum(accepted) / sum(offered) if n else None,
        "per_position": [a / o if o else None for a, o in zip(accepted, offered)],
    }


def drafted(run: dict[str, Any]) -> bool:
    """Whether a speculative run's timed passes verified any draft."""
    return bool(run.get("acceptance") and run["acceptance"]["num_drafts"])


def drafting_share(run: dict[str, Any]) -> float | None:
    """Share of a run's decode steps that verified drafts (the rest were plain steps); None without steps."""
    steps = run.get("steps_by_draft_length") or {}
    total = sum(v["steps"] for v in steps.values())
    return sum(v["steps"] for k, v in steps.items() if int(k)) / total if total else None
