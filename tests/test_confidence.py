"""The confidence scheduler: prefixes only, early break, and never deciding x_k from c_{k+1}."""

from __future__ import annotations

import itertools

import pytest
import torch

from blockspec.speculative.confidence import StepCostTable, schedule_prefixes, threshold_lengths


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
    assert threshold_lengths(conf.tolist(), [4, 4, 2], 0.7) == [1, 0, 2]


def scripted_verify(log: list[tuple[int, int]]):
    """A verify forward of 1 + 0.1 x rows seconds, but 50 at its first timing after the warm-up (a stall of the
    host): the table must not take it."""
    def measure(batch: int, rows: int) -> float:
        log.append((batch, rows))
        nth = sum(1 for b, q in log if (b, q) == (batch, rows))
        return 50.0 if nth == 2 else 1.0 + 0.1 * rows
    return measure


def test_a_busy_stretch_of_the_host_does_not_price_a_row_count_by_itself():
    """Timings taken in rounds over every row count: six consecutive timings 20x slow (another process on a
    shared CPU) land in two rounds, not in all five of a row count's (which made eight drafts look dear, and
    the budget verify one). The table stays non-decreasing in rows."""
    calls = []

    def measure(batch: int, rows: int) -> float:
        calls.append(rows)
        slow = 20.0 if 4 * 9 <= len(calls) < 4 * 9 + 6 else 1.0  # a stretch inside the timings
        return slow * (1.0 + 0.01 * rows)

    table = StepCostTable(measure, max_rows=9, repeats=5)
    prices = [table(1, q) for q in range(1, 10)]
    assert prices == pytest.approx([1.0 + 0.01 * q for q in range(1, 10)])
    ragged = StepCostTable(lambda b, q: 1.0 + 0.01 * q + (0.5 if q == 3 else 0.0), max_rows=9, repeats=3)
    assert [ragged(1, q) for q in (2, 3, 4)] == pytest.approx([1.02, 1.04, 1.04])  # dearer than 4 rows: noise


def test_step_prices_are_robust_verify_timings_plus_the_rest_of_a_step_learned_as_steps_run():
    log: list[tuple[int, int]] = []
    table = StepCostTable(scripted_verify(log), max_rows=9, repeats=5)
    assert table(3, 2) == pytest.approx(1.2)  # batch 3 is priced at its bucket, 4; no step seen: the verify alone
    assert {b for b, _ in log} == {4} and len(log) == 9 * 6  # a warm-up and 5 timings of every row count
    assert [table.verify[(4, q)] for q in (1, 9)] == pytest.approx([1.1, 1.9])  # the median drops the stall
    assert table(4, 20) == pytest.approx(1.9)  # rows past the profiled ones cost the widest's
    # a draft of survival 0.08: priced by the verify alone its row costs more than it yields
    survival, budgets = [[0.08]], [1]
    priced = lambda b, r: table(4, r)  # noqa: E731  (one request's drafts in a step of four requests)
    assert schedule_prefixes(survival, budgets, priced) == [0]
    for seconds in (4.9, 4.9, 60.0):  # steps of 9 rows: 3 s besides the verify, and one outlier
        table.observe(4, 9, seconds)
    assert table(4, 1) == pytest.approx(4.1)
    # with the step's other 3 s in the price, the same row costs a smaller share and is worth verifying
    assert schedule_prefixes(survival, budgets, priced) == [1]
    table.observe(16, 9, 4.9)  # a bucket never profiled learns nothing (nothing to subtract yet)
    assert 16 not in table.rest
