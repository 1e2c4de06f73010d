"""DSpark's confidence head put to work: how many of each request's drafts to verify this step.

c_k (per request, per position) is the predicted probability that draft k survives given that
1..k-1 did; it is computed from the backbone state and the token *before* x_k, so it is known before
x_k is drawn. Two uses:

- static threshold: verify up to the first k with c_k < threshold;
- load-aware budget (DSpark paper, Algorithm 1): rank every (request, k) by prefix survival
  a_k = c_1...c_k, admit in that order while the estimated throughput (tokens per step over the
  measured cost of a verify forward of that shape) rises, and stop at the first candidate that does
  not raise it. Stopping there (rather than searching all subsets) is what keeps the output exact:
  whether x_k is verified never depends on c_{k+1}, which is computed from x_k.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import Tensor


def threshold_lengths(confidence: Tensor, budgets: list[int], threshold: float) -> list[int]:
    """Drafts kept per request: up to (not including) the first position with c_k < threshold."""
    k = confidence.shape[1]
    below = (confidence < threshold).float()
    first_low = torch.where(below.any(1), below.argmax(1), torch.full_like(below[:, 0], k, dtype=torch.long))
    return [min(b, int(f)) for b, f in zip(budgets, first_low.tolist())]


def schedule_prefixes(survival: list[list[float]], budgets: list[int],
                      cost: Callable[[int, int], float]) -> list[int]:
    """Algorithm 1: greedy admission of (request, position) by prefix survival, with the early break.

    survival[r][j] = a_{r,j+1}; cost(num_requests, rows_per_request) is the seconds of a verify
    forward of that shape (rows = longest draft + 1, since requests are padded to a common length).
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


class VerifyCostTable:
    """Seconds of a verify forward per (batch bucket, rows per request), profiled once per batch bucket."""

    def __init__(self, measure: Callable[[int, int], float], max_rows: int) -> None:
        self.measure = measure
        self.max_rows = max_rows
        self.table: dict[tuple[int, int], float] = {}

    def __call__(self, batch: int, rows: int) -> float:
        bucket = 1 << max(0, (batch - 1).bit_length())
        if (bucket, 1) not in self.table:
            for q in range(1, self.max_rows + 1):
                self.measure(bucket, q)  # warm-up (and CUDA-graph capture) before timing
                self.table[(bucket, q)] = self.measure(bucket, q)
        return self.table[(bucket, min(rows, self.max_rows))]


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Wall seconds of fn(), synchronised on CUDA (used only while profiling the cost table)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0
