"""The confidence scheduler: prefixes only, early break, and never deciding x_k from c_{k+1}."""

from __future__ import annotations

import itertools

import torch

from blockspec.speculative.confidence import schedule_prefixes, threshold_lengths


def staircase(batch: int, rows: int) -> float:
    """A verify cost that jumps once any draft is verified and is flat after: one uncertain draft alone
    does not pay, several together might."""
    return 1.0 if rows == 1 else 1.6


def global_search(survival, budgets, cost):
    """A deliberately broken scheduler: the best prefix set over all choices (no early break)."""
    best, best_lens = len(survival) / cost(len(survival), 1), [0] * len(survival)
    for lens in itertools.product(*[range(b + 1) for b in budgets]):
        value = (len(survival) + sum(sum(row[:n]) for row, n in zip(survival, lens))) / cost(len(survival),
                                                                                             max(lens) + 1)
        if value > best:
            best, best_lens = value, list(lens)
    return best_lens


def verifies_first_draft_for_every_c2(scheduler) -> set[bool]:
    """Whether x_1 of request 0 is verified, as c_2 (computed from x_1) varies: must be one answer."""
    answers = set()
    for c2 in [i / 20 for i in range(21)]:
        c = [0.5, c2, 0.9]
        survival = [[c[0], c[0] * c[1], c[0] * c[1] * c[2]]]
        answers.add(scheduler(survival, [3], staircase)[0] >= 1)
    return answers


def test_early_break_never_lets_c_next_decide():
    assert len(verifies_first_draft_for_every_c2(schedule_prefixes)) == 1


def test_negative_control_global_search_leaks_the_future():
    assert len(verifies_first_draft_for_every_c2(global_search)) == 2


def test_greedy_admission_by_survival_and_budgets():
    linear = lambda batch, rows: 1.0 + 0.05 * rows  # noqa: E731
    survival = [[0.9, 0.8, 0.7, 0.1], [0.5, 0.2, 0.1, 0.05]]
    lens = schedule_prefixes(survival, [4, 4], linear)
    assert lens[0] >= lens[1] and lens[0] >= 3
    assert schedule_prefixes(survival, [1, 0], linear) == [1, 0]
    assert schedule_prefixes(survival, [4, 4], lambda b, r: 1.0 if r == 1 else 100.0) == [0, 0]


def test_threshold_cuts_at_first_low_position():
    conf = torch.tensor([[0.9, 0.6, 0.95, 0.9], [0.3, 0.9, 0.9, 0.9], [0.8, 0.8, 0.8, 0.8]])
    assert threshold_lengths(conf, [4, 4, 2], 0.7) == [1, 0, 2]
