"""DSpark's confidence head put to work: how many of each request's drafts to verify this step.

c_k (per request, per position) is the predicted probability that draft k survives given that
1..k-1 did; it is computed from the backbone state and the token *before* x_k, so it is known before
x_k is drawn. Two uses:

- static threshold: verify up to the first k with c_k < threshold;
- load-aware budget (DSpark paper, Algorithm 1): rank every (request, k) by prefix survival
  a_k = c_1...c_k, admit in that order while the estimated throughput (tokens per step over the
  measured seconds of a step of that verify shape, `StepCostTable`) rises, and stop at the first
  candidate that does not raise it. Stopping there (rather than searching all subsets) is what
  keeps the output exact: whether x_k is verified never depends on c_{k+1}, which is computed
  from x_k.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable

import torch

from blockspec.speculative.policy import batch_bucket


def threshold_lengths(confidence: list[list[float]], budgets: list[int], threshold: float) -> list[int]:
    """Drafts kept per request: up to (not including) the first position with c_k < threshold
    (confidence[r] the request's c_1..c_K, read on the host)."""
    return [min(b, next((j for j, c in enumerate(row) if c < threshold), len(row)))
            for b, row in zip(budgets, confidence)]


def schedule_prefixes(survival: list[list[float]], budgets: list[int],
                      cost: Callable[[int, int], float]) -> list[int]:
    """Algorithm 1: greedy admission of (request, position) by prefix survival, with the early break.

    survival[r][j] = a_{r,j+1}; cost(num_requests, rows_per_request) is the seconds of a step of
    that verify shape (rows = longest draft + 1, since requests are padded to a common length).
    """
    r = len(survival)
    lens = [0] * r
    candidates = sorted(((a, i, j) for i, row in enumerate(survival) for j, a in enumerate(row[: budgets[i]])
                         if a > 0), key=lambda c: (-c[0], c[1], c[2]))
    expected = float(r)  # every request emits at least one token
    best = expected / cost(r, 1)
    for a, i, j in candidates:
        if j != lens[i]:  # prefixes only (a_{i,j} <= a_{i,j-1} and ties keep j order, so never taken)
            continue
        trial_expected = expected + a
        trial_rows = max(max(lens), j + 1) + 1
        throughput = trial_expected / cost(r, trial_rows)
        if throughput <= best:
            break
        lens[i] = j + 1
        expected, best = trial_expected, throughput
    return lens


class StepCostTable:
    """Seconds of a speculative step by (batch, verify rows per request): the reciprocal of Algorithm 1's
    SPS, the engine's steps per second at that verify shape.

    A step is its verify forward, whose cost grows with the rows, and the rest (drafting, heads, acceptance,
    the host's work), which is the same whatever is verified. The verify forward is profiled once per batch
    bucket (`measure`, the median of `repeats` timings after a warm-up: one timing on a shared CPU is as
    large as a row's cost). The rest is learned from the steps as they run (`observe`: each step's seconds
    less its verify forward's, the median of the latest `window`); until a step is seen it is taken as 0.
    Priced by its verify forward alone, a row looks dearer than it is, and the budget verifies too little."""

    def __init__(self, measure: Callable[[int, int], float], max_rows: int, repeats: int = 5,
                 window: int = 16) -> None:
        self.measure = measure
        self.max_rows = max_rows
        self.repeats = repeats
        self.verify: dict[tuple[int, int], float] = {}
        self.rest: dict[int, deque[float]] = {}  # the latest samples of the rest of a step, by batch bucket
        self.rest_seconds: dict[int, float] = {}  # their median (Algorithm 1 prices a step several times)
        self.window = window

    def __call__(self, batch: int, rows: int) -> float:
        bucket = batch_bucket(batch)
        return self.verify_seconds(bucket, rows) + self.rest_seconds.get(bucket, 0.0)

    def verify_seconds(self, bucket: int, rows: int) -> float:
        if (bucket, 1) not in self.verify:
            shapes = range(1, self.max_rows + 1)
            for q in shapes:
                self.measure(bucket, q)  # warm-up (and CUDA-graph capture) before timing
            # rounds over every row count: a stretch of a busy host lands in a round, which the median drops,
            # not in all the timings of one row count
            times = list(zip(*([self.measure(bucket, q) for q in shapes] for _ in range(self.repeats))))
            cheapest_wider = math.inf  # more rows never cost less: a count dearer than a wider one was noise
            for q, samples in reversed(list(zip(shapes, times))):
                cheapest_wider = min(cheapest_wider, statistics.median(samples))
                self.verify[(bucket, q)] = cheapest_wider
        return self.verify[(bucket, min(rows, self.max_rows))]

    def observe(self, batch: int, rows: int, seconds: float) -> None:
        """A step of `batch` requests verified `rows` rows each in `seconds`, start to finish."""
        bucket = batch_bucket(batch)
        if (bucket, 1) in self.verify:
            rest = self.rest.setdefault(bucket, deque(maxlen=self.window))
            rest.append(max(0.0, seconds - self.verify_seconds(bucket, rows)))
            self.rest_seconds[bucket] = statistics.median(rest)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Wall seconds of fn(), synchronised on CUDA (used only while profiling the cost table)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0
