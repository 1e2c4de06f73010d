"""The draft-length policy: tokens per second from measured acceptance and measured step cost."""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter

import pytest

from blockspec.config import ConfigError
from blockspec.speculative import policy as policy_module
from blockspec.speculative.policy import PARK_TURNOVERS, PLAIN_RUN, SPEC_RUN, UNTIMED_PLAIN_PARKS, DraftLengthPolicy


def feed(policy: DraftLengthPolicy, rates: list[float], times: dict[int, float], batch: int = 1, steps: int = 400):
    """Deterministic observations: a draft of K is accepted to depth floor(prefix * steps share)."""
    for k, t in times.items():
        for _ in range(2):  # the policy trusts a candidate after two measurements
            policy.observe_time(batch, k, t)
    prefix, p = [], 1.0
    for r in rates:
        p *= r
        prefix.append(p)
    for s in range(steps):
        u = (s * 0.6180339887 + 0.31) % 1.0  # low-discrepancy order, so decay sees no trend
        accepted = sum(1 for q in prefix if u < q)
        policy.observe_acceptance([policy.k_max], [accepted])


def drawn(rng: random.Random, k: int, rate: float, requests: int) -> list[int]:
    """Accepted drafts of each of `requests` drafting k, each draft accepted with probability `rate` once
    the ones before it were."""
    return [next((i for i in range(k) if rng.random() >= rate), k) for _ in range(requests)]


def drive(policy: DraftLengthPolicy, steps: int, step_time: dict[int, float], accept: float,
          batch: int = 1) -> list[int]:
    """Let the policy choose for `steps` steps, each taking step_time[K] and accepting the drafts whose
    prefix probability accept ** depth stays above one half; returns the choices."""
    chosen = []
    for _ in range(steps):
        k = policy.choose(batch)
        chosen.append(k)
        policy.observe_time(batch, k, step_time[k])
        if k:
            policy.observe_acceptance([k], [sum(1 for i in range(k) if accept ** (i + 1) > 0.5)])
    return chosen


def whole_block_shares(k_max: int, step_ms: dict[int, float], accept: float, runs: int, settle: int,
                       steps: int = 150) -> list[float]:
    """Per seeded run of `steps` steps, the share of steps after the first `settle` that took the whole
    block. Each step costs step_ms[K] and accepts consecutive drafts with probability `accept` each; as in
    the engine, each choice is made before the last step's acceptance is seen."""
    shares = []
    for seed in range(runs):
        rng = random.Random(seed)
        policy, chosen, seen = DraftLengthPolicy(k_max), [], None
        for _ in range(steps):
            k = policy.choose(1)
            if seen is not None:
                policy.observe_acceptance(*seen)
            chosen.append(k)
            policy.observe_time(1, k, step_ms[k] / 1e3)
            accepted = 0
            while accepted < k and rng.random() < accept:
                accepted += 1
            seen = ([k], [accepted]) if k else None
        shares.append(chosen[settle:].count(k_max) / len(chosen[settle:]))
    return shares


def test_good_drafter_cheap_verify_takes_the_whole_block():
    policy = DraftLengthPolicy(15)
    feed(policy, [0.95] * 15, {0: 1.0, 1: 1.1, 3: 1.1, 7: 1.15, 15: 1.25})
    policy.last_tried = {(1, k): 10**9 for k in policy.candidates}
    assert policy.choose(1) == 15


def test_bad_drafter_falls_back_to_plain():
    policy = DraftLengthPolicy(15)
    feed(policy, [0.05] * 15, {0: 1.0, 1: 1.3, 3: 1.35, 7: 1.5, 15: 1.6})
    policy.last_tried = {(1, k): 10**9 for k in policy.candidates}
    assert policy.choose(1) == 0


def test_short_drafts_when_only_the_first_positions_survive():
    policy = DraftLengthPolicy(15)
    feed(policy, [0.9, 0.8, 0.7] + [0.05] * 12, {0: 1.0, 1: 1.2, 3: 1.35, 5: 1.8, 7: 2.2, 15: 3.0})
    policy.last_tried = {(1, k): 10**9 for k in policy.candidates}
    assert policy.choose(1) == 3
    assert abs(policy.expected_tokens(3) - (1 + 0.9 + 0.72 + 0.504)) < 0.05


def test_plain_is_measured_first_and_fixed_mode_ignores_costs():
    policy = DraftLengthPolicy(7)
    assert [policy.choose(4), policy.choose(4)] == [0, 0] and policy.candidates == [0, 1, 3, 5, 7]
    assert DraftLengthPolicy(7, adaptive=False).choose(4) == 7


def test_only_candidates_that_could_win_are_measured():
    """An unmeasured K is scored at the least it can cost (a shorter K's time). When short drafts already
    cost far more than they yield, longer ones are never paid for; when drafting is cheap, they are."""
    def explore(step_time: dict[int, float], accept: float) -> list[int]:
        return drive(DraftLengthPolicy(7), 40, step_time, accept)

    costly = explore({0: 1.0, 1: 3.0, 3: 3.2, 5: 3.4, 7: 3.6}, accept=0.3)  # a CPU-like step, a weak drafter
    assert set(costly) == {0, 1} and costly.count(0) >= 35
    cheap = explore({0: 1.0, 1: 1.02, 3: 1.06, 5: 1.1, 7: 1.15}, accept=0.95)  # a GPU-like step, a strong one
    assert 7 in cheap and cheap[-5:] == [7] * 5


def test_one_slow_first_measurement_does_not_stick():
    """A slow first call (compilation, allocator) must not keep the plain path looking expensive."""
    policy = DraftLengthPolicy(4)
    for k in policy.candidates:
        policy.observe_time(1, k, 1.5 if k else 50.0)  # the first plain step was slow
    feed(policy, [0.02] * 4, {k: (1.0 if k == 0 else 1.5) for k in policy.candidates})
    policy.last_tried = {(1, k): 10**9 for k in policy.candidates}
    assert policy.choose(1) == 0


def test_new_batch_size_borrows_cost_ratios_and_only_measures_plain():
    policy = DraftLengthPolicy(4)
    feed(policy, [0.9] * 4, {0: 1.0, 1: 1.1, 2: 1.2, 4: 1.3}, batch=8)
    policy.last_tried = {(8, k): 10**9 for k in policy.candidates}
    assert [policy.choose(2) for _ in range(2)] == [0, 0]  # plain twice at the new batch size ...
    policy.observe_time(2, 0, 0.5)
    policy.observe_time(2, 0, 0.5)
    assert policy.estimate(2, 4) == 0.5 * 1.3 / 1.0  # ... then the other costs come from batch 8's ratios
    assert policy.choose(2) == 4


def test_a_stale_plain_estimate_is_re_measured_soon():
    """Noisy plain samples can make a draft length that yields nothing look a little better than plain;
    the plain path must then be re-measured within a few dozen steps, not after a whole retry interval."""
    policy = DraftLengthPolicy(4)
    feed(policy, [0.02] * 4, {0: 1.3, 1: 1.2, 3: 1.3, 4: 1.4})  # plain measured during a noisy burst
    policy.last_tried = {(1, k): policy.clock[1] for k in policy.candidates}
    choices = [policy.choose(1) for _ in range(40)]
    assert choices[0] != 0 and 0 in choices


def test_a_new_batch_size_does_not_retry_every_borrowed_candidate_at_once():
    """Batch sizes come and go under load; each new one must not pay one slow step per candidate."""
    policy = DraftLengthPolicy(4)
    feed(policy, [0.3] * 4, {0: 1.0, 1: 3.0, 3: 3.3, 4: 3.5}, batch=8)
    policy.clock[8] = 1000  # long after every clock at batch 8 started
    policy.last_tried = {(8, k): 1000 for k in policy.candidates}
    for _ in range(2):
        policy.observe_time(32, 0, 2.0)  # a new batch size: plain measured, the rest borrowed
    assert [policy.choose(32) for _ in range(20)] == [0] * 20


def test_retries_of_a_losing_draft_length_back_off():
    """When speculation keeps losing (a weak drafter, a slow draft step), every re-try of K > 0 is a
    slow step; each re-try that confirms the loss doubles that K's interval (up to 16x), so over a
    long run they stay a small share. A K that starts to win is still found, within the longest
    interval."""
    times = {0: 1.0, 1: 3.0, 3: 3.3, 4: 3.5}

    def run(policy: DraftLengthPolicy, steps: int, rate: float) -> list[int]:
        return drive(policy, steps, times, rate, batch=8)

    policy = DraftLengthPolicy(4)
    feed(policy, [0.2] * 4, times, batch=8)
    chosen = run(policy, 20000, 0.2)
    without = DraftLengthPolicy(4)
    feed(without, [0.2] * 4, times, batch=8)
    without.confirmed_losses = type("Never", (dict,), {"get": lambda self, key, default=0: 0})()
    chosen_without = run(without, 20000, 0.2)
    retries, retries_without = sum(k > 0 for k in chosen), sum(k > 0 for k in chosen_without)
    assert retries_without > 100 and retries < retries_without / 4, (retries, retries_without)
    # the drafter turns good and the draft step cheap: the policy switches within the longest interval
    times.update({1: 1.05, 3: 1.15, 4: 1.2})
    later = run(policy, 16 * 16 * 64, 0.99)
    assert later[-100:].count(4) > 90, later[-100:]


def test_a_strong_drafter_reaches_its_whole_block_while_short_drafts_are_explored():
    """On a GPU every K costs about the same step time; with 86 % acceptance per position (expected
    6.5 tokens at K=15) the whole block is best by 23 %. Exploring short drafts first offers deep
    positions only a few times; those few trials must not read as a collapse that parks the policy
    at a shorter K. As in the engine, each choice is made before the last step's acceptance is seen
    (seeded draws: consecutive acceptances at 0.86 each; 60 runs of 150 steps)."""
    # H200, Qwen3-8B shape, DFlash, batch 1 (K = 3 and 7 between the 6.01, 6.24 and 6.26 ms measured at 2, 4 and 8)
    step_ms = {0: 4.46, 1: 5.97, 3: 6.12, 5: 6.19, 7: 6.25, 15: 6.33}
    shares = whole_block_shares(15, step_ms, 0.86, runs=60, settle=40)
    assert sum(s < 0.9 for s in shares) <= 1 and sum(shares) / len(shares) > 0.95, [round(s, 2) for s in shares]


def test_a_near_tie_with_the_plain_path_stays_plain():
    """Near ties go to the longer draft only among speculative choices: when the plain path leads,
    even by less than the tie margin, it is taken (its lead is the never-slower guarantee)."""
    policy = DraftLengthPolicy(15)
    # at 50 % per position K drafts yield 2 - 0.5^K tokens; each K costs 1-3 % more per token than plain
    feed(policy, [0.5] * 15, {0: 1.0, 1: 1.5 / 0.99, 3: 1.875 / 0.985, 5: 1.96875 / 0.9825,
                          7: 1.9921875 / 0.98, 15: 2.0 / 0.97})
    policy.last_tried = {(1, k): 10**9 for k in policy.candidates}
    scores = {k: policy.expected_tokens(k) / policy.estimate(1, k) for k in policy.candidates}
    assert max(scores, key=scores.get) == 0
    assert any(k and scores[k] >= 0.98 * scores[0] for k in scores), scores  # a speculative K within the margin
    assert policy.choose(1) == 0


class _Sticky(DraftLengthPolicy):
    """Negative control: a settled choice that new step times never unsettle."""

    def observe_time(self, batch: int, k: int, seconds: float) -> None:
        settled = self._settled
        super().observe_time(batch, k, seconds)
        self._settled = settled


def _lockstep(fast: DraftLengthPolicy, seed: int, steps: int = 2500, plain: list[int] | None = None) -> bool:
    """Drive `fast` and a policy that scores every step through the same random workload (batch sizes
    that change, step costs that drift and jitter, acceptance that shifts, so that speculation pays in
    some stretches and not in others); True while they agree. Counts the plain choices in `plain`."""
    rng = random.Random(seed)
    full = DraftLengthPolicy(fast.k_max)
    full.settles = False
    batch, per_draft, accept = 1, rng.uniform(0.02, 1.0), rng.uniform(0.1, 0.95)
    for step in range(steps):
        if rng.random() < 0.01:
            batch = rng.choice([1, 2, 4, 16, 64])
        if step % 500 == 499:  # the workload changes: drafts get cheaper or dearer, acceptance moves
            per_draft, accept = rng.uniform(0.02, 1.0), rng.uniform(0.1, 0.95)
        k = fast.choose(batch)
        if k != full.choose(batch):
            return False
        if plain is not None:
            plain.append(k == 0)
        seconds = (1.0 + per_draft * k) * batch**0.3 * (1 + 0.2 * rng.random())
        accepted = sum(1 for _ in iter(lambda: rng.random() < accept, False))
        for policy in (fast, full):
            policy.observe_time(batch, k, seconds)
            if k:
                policy.observe_acceptance([k], [min(k, accepted)])
    return fast.last_tried == full.last_tried and fast.confirmed_losses == full.confirmed_losses


def test_a_settled_choice_is_what_scoring_every_step_would_choose():
    """choose() keeps its last choice without re-scoring until a re-try is due or an observation could
    change it; step for step it chooses what scoring every step chooses. The plain path, where speculation
    does not pay, is where it settles (a speculative step observes acceptance, which unsettles it): most
    plain choices take the short path. A settled choice that ignores new step times diverges."""
    scored, plain = 0, []
    for seed in range(12):
        policy = DraftLengthPolicy(7)
        estimate, counted = policy.estimate, []
        policy.estimate = lambda b, k, estimate=estimate, counted=counted: counted.append(1) or estimate(b, k)
        assert _lockstep(policy, seed, plain=plain)
        scored += len(counted) // len(policy.candidates)
    assert sum(plain) > 2000 and scored < len(plain) - sum(plain) / 2
    assert not all(_lockstep(_Sticky(7), seed) for seed in range(12))


def test_view_reports_what_was_chosen_measured_and_expected():
    """The metrics' view: steps per chosen K, each measured (bucket, K)'s lower median, expected tokens."""
    policy = DraftLengthPolicy(8)
    chosen = drive(policy, 300, {0: 1.0, 1: 1.1, 3: 1.3, 5: 1.5, 7: 1.7, 8: 1.8}, accept=0.9, batch=16)
    view = policy.view()
    assert view.chosen == {k: chosen.count(k) for k in set(chosen)} and sum(view.chosen.values()) == 300
    assert view.step_seconds == {(16, k): t for k, t in {0: 1.0, 1: 1.1, 3: 1.3, 5: 1.5, 7: 1.7, 8: 1.8}.items()
                                 if k in chosen}
    prefix = policy.prefix_acceptance()
    assert view.expected_tokens == {k: 1 + sum(prefix[:k]) for k in (0, 1, 3, 5, 7, 8)}
    assert view.expected_tokens[0] == 1 and view.expected_tokens[8] > view.expected_tokens[1] > 1


def settle(policy: DraftLengthPolicy, times: dict[int, float], accept: float, batch: int, steps: int = 6) -> list[int]:
    """Choices once every candidate has been measured at this batch size (each K costs times[K])."""
    feed(policy, [accept] * policy.k_max, times, batch=batch)
    return drive(policy, steps, times, accept, batch=batch)


def arrivals(policy: DraftLengthPolicy, batch: int, n: int) -> list[bool]:
    """feeds_drafter for n requests joining one by one."""
    return [policy.feeds_drafter(batch) for _ in range(n)]


def test_a_batch_size_where_plain_wins_is_parked_and_re_tried_when_the_park_ends():
    """Where plain wins, requests joining that batch bucket stop feeding the drafter for PARK_TURNOVERS
    times the bucket in arrivals; then they feed it again, the first choice with the whole batch able to
    draft re-tries a K > 0, and when plain still wins the next park is twice as long. Smaller buckets
    are not parked."""
    policy = DraftLengthPolicy(4)
    times = {0: 1.0, 1: 3.0, 3: 3.3, 4: 3.5}
    assert policy.feeds_drafter(8)  # nothing parked yet
    assert settle(policy, times, 0.2, batch=8) == [0] * 6
    first = PARK_TURNOVERS * 8
    assert arrivals(policy, 5, 2) == [False, False]  # 5 and 8 share bucket 8
    assert policy.feeds_drafter(4) and policy.feeds_drafter(1)
    view = policy.view()
    assert view.parked == [8] and view.parked_joins == 2
    assert arrivals(policy, 8, first - 2 + 1) == [False] * (first - 2) + [True]
    assert policy.view().parked == []
    retried = drive(policy, 8, times, 0.2, batch=8)
    assert retried[0] > 0 and retried[-1] == 0, retried  # re-tried at once, then plain again
    assert arrivals(policy, 8, 2 * first + 1) == [False] * 2 * first + [True]  # parked twice as long


def test_a_park_ends_when_the_bucket_s_own_steps_find_drafting_best():
    """A first park set on a batch's first steps, where drafts were mostly rejected, ends as soon as the
    same bucket's running requests (which keep feeding through it) find drafting best: requests that
    join afterwards feed the drafter. Kept, it would turn the batch's next requests into plain decoding
    for PARK_TURNOVERS times the bucket in arrivals."""
    policy = DraftLengthPolicy(4)
    times = {0: 1.0, 1: 1.3, 3: 1.4, 4: 1.5}
    feed(policy, [0.2] * 4, times, batch=4, steps=16)
    assert drive(policy, 6, times, 0.2, batch=4) == [0] * 6
    assert policy.view().parked == [4]
    chosen = drive(policy, 400, times, 0.97, batch=4)  # acceptance rises; re-tries find it
    assert chosen[-1] == 4 and policy.view().parked == [] and policy.feeds_drafter(4)
    assert policy.view().parked_joins == 0


def test_a_batch_size_where_speculation_wins_is_never_parked():
    policy = DraftLengthPolicy(4)
    chosen = settle(policy, {0: 1.0, 1: 1.05, 3: 1.15, 4: 1.2}, 0.9, batch=8, steps=200)
    assert chosen[-1] == 4 and policy.feeds_drafter(8) and policy.view().parked == []


def test_a_batch_size_whose_plain_step_is_never_timed_is_parked():
    """A prefill in nearly every step leaves no run of plain decode steps to time: the choice stays
    plain there, so after UNTIMED_PLAIN_PARKS such choices the bucket stops feeding the drafter."""
    policy = DraftLengthPolicy(4)
    assert [policy.choose(32) for _ in range(UNTIMED_PLAIN_PARKS)] == [0] * UNTIMED_PLAIN_PARKS
    assert not policy.feeds_drafter(32) and policy.feeds_drafter(16)


def test_a_larger_batch_size_not_decided_yet_starts_parked_while_a_smaller_one_is():
    """A wave of arrivals into a new, larger batch would feed a drafter that the smaller batch already
    found not worth it twice in a row; it starts parked, and its park ends and is re-tried like any
    other. A first park, a smaller batch size, or one whose own steps decide it, passes on nothing."""
    policy = DraftLengthPolicy(4)
    times = {0: 1.0, 1: 3.0, 3: 3.3, 4: 3.5}
    settle(policy, times, 0.2, batch=8)
    assert policy.view().parked == [8] and policy.feeds_drafter(64)  # a first park is not passed on
    arrivals(policy, 8, PARK_TURNOVERS * 8 + 1)  # the park ends; the re-tries find plain best again
    drive(policy, 8, times, 0.2, batch=8)
    assert policy.view().parked == [8]
    assert not policy.feeds_drafter(256) and policy.view().parked == [8, 256]
    assert policy.feeds_drafter(4)
    for _ in range(2):
        policy.observe_time(32, 0, 2.0)  # batch 32 has its own plain time: its own steps decide it
    assert policy.feeds_drafter(32)
    assert arrivals(policy, 256, PARK_TURNOVERS * 256) == [False] * (PARK_TURNOVERS * 256 - 1) + [True]
    arrivals(policy, 8, 2 * PARK_TURNOVERS * 8)
    assert policy.feeds_drafter(8) and policy.view().parked == []
    assert policy.feeds_drafter(512)  # nothing smaller is parked now


def test_a_strong_drafter_is_found_where_one_draft_costs_more_than_it_yields():
    """On a CPU a step with one draft costs about what one with the whole block does (the drafter's
    forward dominates), so K = 1 loses to plain while K = 7 at 95 % acceptance per position wins by 2x.
    A couple of K = 1 trials must not condemn the longer drafts they never offered: an unmeasured K is
    scored with its positions' acceptance at the upper end of what their few trials allow, tried, and
    kept (seeded draws, 40 runs of 150 steps; the choice made before the last step's acceptance is seen)."""
    step_ms = {0: 1.08, 1: 2.72, 3: 2.78, 5: 2.82, 7: 2.86}  # 2-core CPU, tiny shape, DFlash block 8, batch 1
    shares = whole_block_shares(7, step_ms, 0.95, runs=40, settle=30)
    assert sum(s < 0.9 for s in shares) <= 1 and sum(shares) / len(shares) > 0.95, [round(s, 2) for s in shares]


def unlucky_start(recorded: list[float] | None, steps: int = 150, seed: int = 0) -> list[int]:
    """A drafter accepting each next position at 75 % whose first two drafted steps are rejected
    outright, at the flagship pair's CPU step times (batch 1, DSpark block 8); returns the choices."""
    step_ms = {0: 4.6, 1: 14.0, 3: 12.0, 5: 11.95, 7: 11.9, 8: 12.0}
    policy, rng, drafted, chosen = DraftLengthPolicy(8, recorded=recorded), random.Random(seed), 0, []
    for _ in range(steps):
        k = policy.choose(1)
        chosen.append(k)
        policy.observe_time(1, k, step_ms[k] / 1e3)
        if k:
            drafted += 1
            depth = 0
            while drafted > 2 and depth < k and rng.random() < 0.75:
                depth += 1
            policy.observe_acceptance([k], [depth])
    return chosen


def test_a_recorded_acceptance_outweighs_two_unlucky_first_drafts():
    """Expected 3.3 tokens per 12 ms drafting step against 1 per 4.6 ms plain: drafting wins 1.3x. With
    the drafter's recorded acceptance as the starting belief, two rejected first drafts do not stop the
    policy from drafting the whole block; without it (the control), they keep it on the plain path
    until a late re-try. (The plain re-tries, three steps each, take most of the rest.)"""
    recorded = [0.73, 0.54, 0.42, 0.32, 0.24, 0.2, 0.16, 0.13]
    for seed in range(5):
        with_prior, without = unlucky_start(recorded, seed=seed), unlucky_start(None, seed=seed)
        assert with_prior.count(8) >= 120, with_prior
        assert without.count(8) == 0, without


def sampled_run(sampled: bool | None, steps: int = 300, seed: int = 0) -> list[int]:
    """The flagship DSpark's recorded greedy acceptance as the prior, and requests that sample (T = 0.7), where
    its drafts are accepted at 45 % a position: drafting yields about 1.8 tokens an 8 ms step, 0.95 of one
    token a 4.2 ms plain step's rate. `sampled`: what the engine tells the policy of
    the requests (None: nothing, as before it told). Returns the choices."""
    recorded = [0.78, 0.64, 0.53, 0.45, 0.39, 0.34, 0.31, 0.27]
    step_ms = {0: 4.2, 1: 7.8, 3: 7.9, 5: 8.0, 7: 8.0, 8: 8.0}
    policy, rng, chosen = DraftLengthPolicy(8, recorded=recorded), random.Random(seed), []
    for _ in range(steps):
        k = policy.choose(1)
        chosen.append(k)
        policy.observe_time(1, k, step_ms[k] / 1e3)
        if k:
            policy.observe_acceptance([k], drawn(rng, k, 0.45, 1), None if sampled is None else [sampled])
    return chosen


def test_sampled_requests_do_not_borrow_the_recorded_greedy_acceptance():
    """At T > 0 the recorded greedy rates overstate acceptance: told the requests sample, the policy weighs
    what it sees and settles on the plain path; left to the recorded rates (the control), their eight
    pseudo-trials a position keep the deep drafts looking good and it drafts most steps, losing. Greedy
    requests keep the prior as before."""
    for seed in range(5):
        told, untold = sampled_run(True, seed=seed), sampled_run(None, seed=seed)
        assert told[100:].count(0) >= 170, told
        assert sum(k > 0 for k in untold[100:]) >= 100, untold
        assert sampled_run(False, seed=seed) == untold  # greedy requests: the recorded prior as before


def test_recorded_acceptance_becomes_conditional_rates():
    from blockspec.speculative.policy import conditional_rates

    assert conditional_rates([0.8, 0.4, 0.1, 0.0, 0.0]) == [0.8, 0.5, 0.25, 0.0, 0.0]


def test_deep_rates_are_conditional_on_reaching_the_position_when_draft_lengths_mix():
    """Most steps draft 4, a few re-tries draft 8: draft 5's rate is counted over the re-tries whose first
    4 drafts were accepted, not over every re-try (that would read a steady 0.87 as 0.87 ** 5 and keep a
    longer K from ever winning)."""
    rng, policy = random.Random(0), DraftLengthPolicy(15)
    for step in range(400):
        k = 8 if step % 20 == 0 else 4
        accepted = drawn(rng, k, 0.87, 64)
        policy.observe_acceptance([k] * 64, accepted)
    prefix = policy.prefix_acceptance()
    rates = [prefix[0]] + [b / a for a, b in zip(prefix, prefix[1:])]
    assert all(abs(r - 0.87) < 0.04 for r in rates[:8]), rates[:8]


def test_a_batch_whose_verify_grows_with_its_rows_settles_on_the_best_k():
    """64 requests, a step of 12.8 ms + 1.45 ms a draft (a large verify) and a steady 0.87 acceptance per
    draft: K = 7 yields the most tokens a second (5.17 per 22.9 ms against the whole block's 6.86 per 34.5 ms)."""
    rng, policy, chosen = random.Random(1), DraftLengthPolicy(15), []
    for _ in range(400):
        k = policy.choose(64)
        chosen.append(k)
        policy.observe_time(64, k, (7.7 if k == 0 else 12.76 + 1.45 * k) / 1e3)
        if k:
            policy.observe_acceptance([k] * 64, drawn(rng, k, 0.87, 64))
    assert chosen[100:].count(7) > 0.9 * len(chosen[100:])


# H200, Qwen3-8B shape, DFlash at batch 16, 86 % per position: K = 7 beats the whole block by 5 % a token
# (a plain step between speculative ones 7.3 ms; the speculative step after it 6.5 ms over its usual)
BATCH16_MS = {0: 7.3, 1: 7.4, 3: 7.6, 5: 8.05, 7: 8.5, 15: 11.8}


def pipelined_run(policy: DraftLengthPolicy, seed: int, steps: int = 900, fixed: int | None = None,
                  refill_ms: float = 6.5) -> float:
    """Tokens per ms of a batch of 16 over `steps` steps. Steps are priced commit to commit, so host work
    that delays one commit (8-14 ms in 1 % of steps) lengthens that step's interval and shortens the
    next one's; the first speculative step after a plain one costs `refill_ms` more."""
    rng = random.Random(seed)
    delay, last_k, seen, tokens, ms = 0.0, None, None, 0, 0.0
    for _ in range(steps):
        k = fixed if fixed is not None else policy.choose(16)
        if seen:
            policy.observe_acceptance(*seen)
        cost = BATCH16_MS[k] + (refill_ms if k and last_k == 0 else 0.0)
        host = rng.uniform(8, 14) if rng.random() < 0.01 else rng.uniform(0, 0.15)
        policy.observe_time(16, k, (cost + host - delay) / 1e3, refill=bool(k) and last_k == 0)
        delay, last_k = host, k
        accepted = drawn(rng, k, 0.86, 16)
        seen = ([k] * 16, accepted) if k else None
        tokens, ms = tokens + sum(accepted) + 16, ms + cost
    return tokens / ms


def test_a_host_delay_that_shortens_the_next_interval_does_not_make_a_step_look_cheap(monkeypatch):
    """Pipelined step intervals are anti-correlated: a delayed commit makes its step look slow and the next
    one fast (0.8 ms for an 11 ms step, seen on the H200). The policy prices a K by its typical step, so
    it lands within 5 % of the best fixed K in every seeded run; priced by the minimum of recent
    samples (the negative control) it chases the shortened ones."""
    best = sum(pipelined_run(DraftLengthPolicy(15), seed, fixed=7) for seed in range(6)) / 6
    assert best > sum(pipelined_run(DraftLengthPolicy(15), seed, fixed=15) for seed in range(6)) / 6
    ratios = [pipelined_run(DraftLengthPolicy(15), seed) / best for seed in range(6)]
    assert min(ratios) > 0.95, ratios
    monkeypatch.setattr(policy_module, "typical", min)
    assert min(pipelined_run(DraftLengthPolicy(15), seed) / best for seed in range(6)) < 0.9


def test_the_switch_back_from_plain_steps_is_no_sample_of_a_k_that_has_one():
    """The speculative step after plain ones (launched from committed state, nothing hidden behind the
    device) costs more than the K's steps as it runs: it is a switch's cost, neither the K's nor the plain
    path's. A K with no sample yet takes it (its next step gives a second; a price is the lower of two)."""
    policy = DraftLengthPolicy(15)
    policy.observe_time(16, 15, 10e-3), policy.observe_time(16, 15, 10e-3)
    for _ in range(3):
        policy.observe_time(16, 0, 7e-3)
    policy.observe_time(16, 15, 16.5e-3, refill=True)
    assert policy.estimate(16, 15) == 10e-3 and policy.estimate(16, 0) == 7e-3
    assert list(policy.samples[(16, 15)]) == [10e-3, 10e-3]
    policy.observe_time(16, 0, 7e-3)
    policy.observe_time(16, 7, 15e-3, refill=True)  # K = 7's first sample, a switch's
    policy.observe_time(16, 7, 9e-3)
    assert policy.estimate(16, 7) == 9e-3
    # a refill after a step of another speculative K is that K's own
    policy.observe_time(16, 15, 12e-3, refill=True)
    assert policy.samples[(16, 15)][-1] == 12e-3


def test_a_plain_re_try_runs_three_steps_at_its_batch_size():
    """Priced commit to commit, a plain step needs a plain commit before it and a plain launch after it: a
    re-try of the plain path runs PLAIN_RUN steps (the first commit is the switch's, the second the
    sample). A K re-tried where plain is best runs SPEC_RUN. A change of batch size ends a run."""
    policy = DraftLengthPolicy(7)
    drive(policy, 200, {0: 1.0, 1: 2.0, 3: 2.1, 5: 2.2, 7: 2.3}, 0.95, batch=8)  # K = 7 best, 6 tokens / 2.3
    chosen = drive(policy, 400, {0: 1.0, 1: 2.0, 3: 2.1, 5: 2.2, 7: 2.3}, 0.95, batch=8)
    runs = [len(list(g)) for k, g in itertools.groupby(chosen) if k == 0]
    assert runs and all(n == PLAIN_RUN for n in runs), runs
    policy._run = (8, 0, PLAIN_RUN - 1)
    policy.choose(16)  # another bucket: the run is over
    assert policy._run is None
    # plain best (a weak drafter): a K's re-try runs two steps
    weak = DraftLengthPolicy(7)
    chosen = drive(weak, 3000, {0: 1.0, 1: 1.5, 3: 1.6, 5: 1.7, 7: 1.8}, 0.3, batch=8)
    spec_runs = [len(list(g)) for k, g in itertools.groupby(chosen[200:]) if k]
    assert spec_runs and all(n == SPEC_RUN for n in spec_runs), spec_runs


def test_the_trace_records_every_observation_and_choice_in_order():
    """`trace`, when a list, holds what the policy saw and chose, in order (the bench's --trace-policy)."""
    policy = DraftLengthPolicy(4)
    policy.trace = []
    k = policy.choose(2)
    policy.observe_time(2, k, 0.01)
    policy.observe_acceptance([4, 4], [1, 3])
    policy.observe_time(2, 4, 0.02, refill=True)
    assert policy.trace == [("choice", 2, k), ("time", 2, k, 0.01, False), ("acceptance", [4, 4], [1, 3]),
                            ("time", 2, 4, 0.02, True)]
    untraced = DraftLengthPolicy(4)
    untraced.choose(2), untraced.observe_time(2, 0, 0.01)
    assert untraced.trace is None


def test_the_draft_lengths_to_choose_among_can_be_given_and_survive_a_fresh_start():
    """By default the policy chooses among 0, K and the lengths below K whose K + 1 rows a request fill whole
    row tiles (1, 3, 5, 7, ...); `lengths` replaces those (0 and K stay), each within 1..K; `fresh()` keeps
    these settings and forgets what was seen."""
    assert DraftLengthPolicy(15).candidates == [0, 1, 3, 5, 7, 15]
    assert DraftLengthPolicy(8).candidates == [0, 1, 3, 5, 7, 8] and DraftLengthPolicy(4).candidates == [0, 1, 3, 4]
    policy = DraftLengthPolicy(15, recorded=[0.9, 0.8], lengths=[7, 11])
    assert policy.candidates == [0, 7, 11, 15]
    with pytest.raises(ConfigError, match=r"draft_length_candidates \[4, 16\]: each must be in 1..15"):
        DraftLengthPolicy(15, lengths=[16, 4])
    settle(policy, {0: 1.0, 7: 1.2, 11: 1.3, 15: 1.4}, 0.9, batch=4)
    assert policy.chosen and set(policy.chosen) <= {0, 7, 11, 15}
    again = policy.fresh()
    assert (again.candidates, again.k_max, again.adaptive, again.recorded_rates) == (
        policy.candidates, 15, True, policy.recorded_rates)
    assert not again.chosen and not again.samples and again.prefix_acceptance() == DraftLengthPolicy(
        15, recorded=[0.9, 0.8]).prefix_acceptance()


# H200, Qwen3-8B shape, DFlash at 64 requests with K in {1, 3, 5, 7, 15}, 86 % per position: a K = 5 step
# takes 17.57 ms for 4.25 tokens a request and a K = 7 step 20.84 ms for 4.99 (K = 5 leads by 1.1 % a
# token, inside NEAR_TIE); K = 1 and 15 estimated from the measured per-draft cost
BATCH64_MS = {0: 7.61, 1: 11.5, 3: 14.84, 5: 17.57, 7: 20.84, 15: 33.6}


def batch64_run(seed: int, steps: int = 600) -> tuple[list[int], float]:
    """The choices and tokens per ms of 64 requests drafting at 86 % per position."""
    rng, policy, chosen, tokens, ms = random.Random(seed), DraftLengthPolicy(15, lengths=[1, 3, 5, 7]), [], 0, 0.0
    for _ in range(steps):
        k = policy.choose(64)
        chosen.append(k)
        policy.observe_time(64, k, BATCH64_MS[k] * rng.uniform(0.99, 1.01) / 1e3)
        accepted = drawn(rng, k, 0.86, 64)
        if k:
            policy.observe_acceptance([k] * 64, accepted)
        tokens, ms = tokens + 64 + sum(accepted), ms + BATCH64_MS[k]
    return chosen, tokens / ms


def test_a_near_tie_goes_to_the_longer_k_only_while_its_deep_positions_are_under_observed(monkeypatch):
    """At 64 requests K = 5 yields 1.1 % more tokens a second than K = 7. The longer K takes a near tie
    only while its deepest position has fewer than OBSERVED_TRIALS trials, so the policy runs K = 5 and
    offers K = 7 now and then to keep position 7 observed. Where the tie always goes to the longer K
    (the negative control) it runs K = 7 and gives the 1.1 % away."""
    runs = [batch64_run(seed) for seed in range(4)]
    assert all(chosen[200:].count(5) > 0.8 * 400 and 7 in chosen[200:] for chosen, _ in runs), \
        [Counter(chosen[200:]) for chosen, _ in runs]
    monkeypatch.setattr(policy_module, "OBSERVED_TRIALS", math.inf)
    standing = [batch64_run(seed) for seed in range(4)]
    assert all(chosen[200:].count(7) > 0.8 * 400 for chosen, _ in standing)
    assert sum(rate for _, rate in runs) > sum(rate for _, rate in standing)


class _OneClock(Counter):
    """Negative control: one re-try clock for every batch bucket (all steps, wherever taken)."""

    def __getitem__(self, bucket: int) -> int:
        return super().__getitem__("all")

    def __setitem__(self, bucket: int, value: int) -> None:
        super().__setitem__("all", value)


def drain_retries(policy: DraftLengthPolicy, seed: int) -> int:
    """Choices other than the best K (re-tries) in the second drain of two waves of 32 requests: a wave
    runs 1,500 steps at batch 32, then drains through batches 16, 8, 4, 2 and 1 for 12 steps each. Each
    step costs (1 + 0.01 batch)(1 + 0.02 K) ms and drafts accept 86 % per position, so K = 15 is best
    at every batch size."""
    rng, drains = random.Random(seed), []
    for _ in range(2):
        for batch in [32] * 1500 + [b for b in (16, 8, 4, 2, 1) for _ in range(12)]:
            k = policy.choose(batch)
            if batch < 32:
                drains.append(k)
            policy.observe_time(batch, k, (1 + 0.01 * batch) * (1 + 0.02 * k) * rng.uniform(0.99, 1.01) / 1e3)
            if k:
                policy.observe_acceptance([k] * batch, drawn(rng, k, 0.86, batch))
    return sum(k != 15 for k in drains[len(drains) // 2:])


def test_a_drain_through_smaller_batch_sizes_does_not_re_try_every_candidate_on_entry():
    """Re-tries are clocked in choices at each batch bucket. Clocked in all steps, every candidate's
    re-try at batch 16, 8, 4, ... is long due when a wave's last requests drain through it, so each entry
    pays a slow step per candidate (the negative control)."""
    own = [drain_retries(DraftLengthPolicy(15), seed) for seed in range(3)]
    shared = []
    for seed in range(3):
        policy = DraftLengthPolicy(15)
        policy.clock = _OneClock()
        shared.append(drain_retries(policy, seed))
    assert max(own) <= 5 and min(shared) >= 15, (own, shared)


def plain_retries(lead: float, steps: int = 3000) -> int:
    """Plain choices in `steps` steps at batch 8 where K = 7 (7 tokens a step) beats the plain path by
    `lead` a token and shorter drafts lose."""
    t7 = 7 / (1 + lead)
    return drive(DraftLengthPolicy(7), steps, {0: 1.0, 1: 0.8 * t7, 3: 0.9 * t7, 5: 0.95 * t7, 7: t7}, 0.9, batch=8).count(0)


def test_plain_re_tries_back_off_only_where_speculation_leads_by_a_wide_margin(monkeypatch):
    """A plain re-try costs its run's tokens and the pipeline's refill after it. Where speculation leads by
    50 %, re-tries that keep finding plain losing wait up to 4x longer; by 150 %, they are as rare as a
    losing K's; at a 10 % lead, where a drifting plain time could matter, they keep their interval. The
    negative control never backs off."""
    wide, mid, thin = plain_retries(1.5), plain_retries(0.5), plain_retries(0.1)
    monkeypatch.setattr(policy_module, "PLAIN_LEAD", math.inf)
    monkeypatch.setattr(policy_module, "WIDE_PLAIN_LEAD", math.inf)
    assert wide < mid / 3 and wide < plain_retries(1.5) / 10, (wide, mid)
    assert mid < plain_retries(0.5) / 3 and thin == plain_retries(0.1) and thin > 100, (mid, thin)


def drifting_run(seed: int) -> list[int]:
    """The choices at 64 requests while contexts change under the policy: 600 steps where a K = 5 step
    takes 19.0 ms and K = 7 21.3 (K = 7 best by 5 % a token at 86 % per position), then 600 where they
    take 17.0 and 20.6 (K = 5 best by 3 %)."""
    rng, policy, chosen = random.Random(seed), DraftLengthPolicy(7, lengths=[5]), []
    for step_ms in ({0: 9.0, 5: 19.0, 7: 21.3}, {0: 8.0, 5: 17.0, 7: 20.6}):
        for _ in range(600):
            k = policy.choose(64)
            chosen.append(k)
            policy.observe_time(64, k, step_ms[k] * rng.uniform(0.99, 1.01) / 1e3)
            if k:
                policy.observe_acceptance([k] * 64, drawn(rng, k, 0.86, 64))
    return chosen


def test_a_re_try_is_weighed_against_the_newest_old_sample_not_a_stale_window(monkeypatch):
    """A draft length not chosen for a while keeps the samples of when it last ran. Once the step costs
    move (contexts grow through a wave, and start short in the next), its first re-try finds it best
    and the policy switches to it; where a re-try joins the old window (the negative control), the old
    samples outvote it and the policy stays on the worse K for the rest of the run."""
    switched = [drifting_run(seed)[600:] for seed in range(3)]
    assert all(after.count(5) > 100 and after[-100:].count(5) > 90 for after in switched), \
        [Counter(after) for after in switched]
    monkeypatch.setattr(policy_module, "STALE_CHOICES", math.inf)
    assert all(drifting_run(seed)[600:].count(5) <= 5 for seed in range(3))
