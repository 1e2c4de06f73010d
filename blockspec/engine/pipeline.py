"""The step in flight: launched on the device, its tokens not yet committed on the host.

With asynchronous scheduling a step is launched before the previous one is committed, so the host's
commit, detokenisation and stop checks overlap the device's next forward. At most one step is in
flight, plain or speculative (`Pipeline.inflight`). The pipeline also keeps the clock a pipelined
step is priced by: from its predecessor's commit to its own, when both were steps of the same kind.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from blockspec.engine.batch import LogprobEntries
from blockspec.engine.timer import StepTimer
from blockspec.request import Request, Status
from blockspec.speculative.proposer import DraftBlock


@dataclass
class Launch:
    """What every launched step records: each of its requests' `requeues` at the launch (`current_rows`)."""

    lives: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        self.lives = tuple(r.requeues for r in self.reqs)  # type: ignore[attr-defined]


@dataclass
class PlainLaunch(Launch):
    """A plain step launched, not committed: the next plain step is launched from its device ids."""

    reqs: list[Request]
    ids: Tensor | None  # [R] int64 next tokens on the device (-1: non-finite logits); None: read already
    host: Tensor  # [R] pinned copy of ids, valid once `ready` has passed
    ready: Any  # torch.cuda.Event (None on the CPU, where the copy is synchronous)
    captures: int  # CUDA graph captures before the launch (a launch that captured is no timing sample)
    logprobs: LogprobEntries | None = None  # where requests asked for them (read with the ids)
    # launched behind a prefill's work: when the launch began (host clock) and `StepTimer.stamp`s of that
    # work's end and of this step's launches' (it is priced from `priced_from` of them)
    after_prefill: tuple[float, Any, Any] | None = None


@dataclass
class SpecLaunch(Launch):
    """A speculative step launched (draft, verify forward and, for greedy rows, acceptance on the
    device) whose results the host has not read yet."""

    reqs: list[Request]
    k: int
    budgets: list[int] | None  # drafts asked per request (None: known on the device only, = the block's lengths)
    block: DraftBlock | None  # None: chained (the host reads its packed result only)
    hidden: Tensor | None  # verify rows' final hidden states (sampled verification reads them; None: chained)
    feats: Tensor  # verify rows' tap features, for the drafter's context
    result: Tensor | None  # greedy rows: [R, 2 + W] accepted count, draft length, emitted tokens (Proposer.pack)
    host: Tensor | None  # pinned copy of `result`, valid once `ready`
    ready: Any  # torch.cuda.Event (None on the CPU, where the copy is synchronous)
    captures: int  # CUDA graph captures before the launch (a launch that captured is no timing sample)


def current_rows(launch: Launch) -> list[int]:
    """The rows of a launch whose request still runs in the stay it was launched in: not finished, aborted,
    or preempted since (and maybe admitted again, with new pages and a recomputed context: its rows of the
    old stay would commit tokens and K/V that no longer exist)."""
    return [j for j, (r, life) in enumerate(zip(launch.reqs, launch.lives))
            if r.status is Status.RUNNING and r.requeues == life]


def verify_rows(launch: SpecLaunch) -> int | None:
    """A launched step's verify rows a request (its widest draft and the anchor); None for a chained step,
    whose drafts only the device knows."""
    return launch.block.tokens.shape[1] + 1 if launch.block is not None else None


def priced_from(t0: float, prefill_end: Any, end: Any) -> float:
    """`t0`, or later where a prefill's work outlasted it: the host-clock moment the device passed
    `prefill_end` (once the device has passed `end`: now, less the seconds from one to the other).
    `StepTimer.stamp`s."""
    ran = StepTimer.seconds(prefill_end, end)  # waits for `end`: "now" is read after
    return max(t0, time.perf_counter() - ran)


class Pipeline:
    def __init__(self) -> None:
        self.inflight: PlainLaunch | SpecLaunch | None = None
        # (batch, K) chosen while launching ahead and then not launched (the choice was the plain path):
        # the next step takes it instead of choosing again
        self.choice: tuple[int, int] | None = None
        # (kind, time) of the last commit of a pipelined step: a pipelined step costs the time from its
        # predecessor's commit, if that predecessor was a step of the same kind ("plain" or "spec")
        self.last_commit: tuple[str, float] | None = None
        self.step_end: float | None = None  # when the last step's decode ended (None: it had none, or a prefill)
        # the device's end of the last prefill's work (a `StepTimer.stamp`; None once a decode step ran
        # after it): a decode step queued behind that work is priced from there
        self.prefill_end: Any = None

    def take(self, kind: type[PlainLaunch] | type[SpecLaunch]) -> Any:
        """The step in flight if it is of `kind` (it leaves the pipeline), else None."""
        launch = self.inflight
        if not isinstance(launch, kind):
            return None
        self.inflight = None
        return launch

    def drop(self) -> None:
        """Forget the step in flight and the clock (its rows are recomputed)."""
        self.inflight = self.choice = None
        self.last_commit = self.step_end = self.prefill_end = None

    def prefill_pending(self) -> bool:
        """Whether a prefill's work is still running on the device (CUDA): a decode launched now queues
        behind it (the chunk, the drafter's copy of a finished prompt)."""
        return isinstance(self.prefill_end, torch.cuda.Event) and not self.prefill_end.query()

    def prefill_passed(self) -> float:
        """Wait for the prefill's work; the host-clock moment it ended (about: now), from which a decode
        launched behind it is priced. Its host work after that still counts, the prefill does not (at a
        32k-token prompt a chunk takes longer than many decode steps: priced in, it would make any K look
        slower than the plain steps between chunks). Called after the decode's launches, so the device
        runs them as soon as the prefill ends."""
        self.prefill_end.synchronize()
        return time.perf_counter()

    def since_last_commit(self, after: str, kind: str | None) -> float | None:
        """Seconds since the last pipelined commit if it was of a step of kind `after` ("plain" or
        "spec"), else None (after a switch of kind the interval spans two different steps); then
        mark now as a commit of `kind` (None: a commit no pipelined step follows)."""
        now = time.perf_counter()
        last, self.last_commit = self.last_commit, (kind, now) if kind is not None else None
        return now - last[1] if last is not None and last[0] == after else None
