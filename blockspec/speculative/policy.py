"""How many drafts to verify this step: the engine's guard against being slower than plain decoding.

Expected tokens per step with K drafts is 1 + sum_{k<=K} P(first k drafts accepted); its cost is the
measured time of a step with K drafts at this batch size (K = 0 is the plain step). The policy picks
the K with the most tokens per second. Acceptance is counted per position from recent steps and step
times are measured (the typical of recent steps). A K is priced as it runs when chosen: where steps are
pipelined, a switch between the plain path and speculation costs more than either (the first step after
it starts from committed state, its host work not hidden), so a re-try of the plain path runs PLAIN_RUN
steps and one of a K from the plain path SPEC_RUN, and the switch's steps are no samples (priced in, they
make a host-bound batch's plain steps look dearer than they run, and it drafts where plain decoding is
faster). An unmeasured K is scored at the least it can cost (the time of a
shorter measured K) and at the most acceptance its trials so far allow, and tried only if even then it
would be best, so drafts that cannot pay are never timed. Measured candidates are re-tried now and
then, so the choice follows the workload: the worse a candidate scored, and the more re-tries in a row
found it still losing, the rarer (the plain path, the baseline, backs off only behind a wide lead), clocked
in steps at each batch size; a re-try's time is weighed with the newest of the K's old ones only, as the
step costs move while it is not chosen (a batch's contexts grow through a wave). The choice is made
before drafting and never looks at the drafts, so it cannot affect what is emitted: exactness does not
depend on it.

Choosing K = 0 is not all of the plain path: a request that may draft still feeds the drafter (its
prompt's context at prefill, the taps of every step): launches on a GPU, compute on a CPU, paid whether
or not a step drafts. So where plain wins, the batch size is parked:
requests that join it do not feed the drafter and the engine runs them as plain decoding. A park
lasts PARK_TURNOVERS times the bucket's size in arrivals (the batch turning over twice), doubling
each time the re-tries after it find plain still best; then joining requests feed the drafter again
and, once every request of the batch can draft, each K is re-tried. A park is counted in arrivals,
not seconds: only an arrival can use what it decides, and an idle gap brings no new evidence. It ends
early where the bucket's own steps (its running requests keep feeding through a first park) come to
find drafting best: the first steps of a batch often accept less than its later ones.
A larger batch size that its own steps have not decided yet starts parked while a smaller one is on
its second park in a row. The engine stops the running requests of a parked batch size feeding too:
those that fed without drafting when arrivals join it, and the whole batch when it chooses the plain
path there on a second park in a row (`parked_again`).
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass

from blockspec.config import ConfigError

PRIOR_TRIALS = 2.0  # pseudo-trials a position's acceptance rate borrows from the position before it
RECORDED_TRIALS = 8.0  # pseudo-trials a position's rate borrows from the drafter's recorded acceptance
EXPLORE_Z = 1.0  # standard errors above its acceptance estimate at which an unmeasured K is scored
NEAR_TIE = 0.02  # scores within this fraction of the best count as a tie, which a longer K takes ...
OBSERVED_TRIALS = 16.0  # ... while its deepest position has fewer (decayed) trials than this
STALE_CHOICES = 8  # a draft length's samples older than this many choices at its batch bucket are stale
PLAIN_LEAD = 0.25  # a lead over the plain path past which its re-tries back off like any losing K's
WIDE_PLAIN_LEAD = 1.0  # ... and past which they are as rare as a losing K's (a plain re-try runs PLAIN_RUN steps)
PLAIN_RUN = 3  # steps a re-try of the plain path takes: the first commit after speculation is a switch, the next
#                is priced commit to commit, as a run of plain steps runs
SPEC_RUN = 2  # steps a re-try of a K takes where the plain path is best: the first refills the pipeline
PARK_TURNOVERS = 2  # the first park of a batch bucket where plain wins covers this many times its size in arrivals
MAX_PARK_DOUBLINGS = 6  # each park whose re-tries find plain still best doubles the next, up to 64x
UNTIMED_PLAIN_PARKS = 32  # choices at a bucket whose plain step has no time yet, after which it is parked


@dataclass
class PolicyView:
    """What the policy has chosen and believes, for metrics: how many steps took each K, the measured
    step seconds per (batch bucket, K) (the lower median of recent samples), the expected tokens per
    request and step of each K from the acceptance seen, the batch buckets parked now, and how many
    requests joined a parked batch (and so never fed the drafter)."""

    chosen: dict[int, int]
    step_seconds: dict[tuple[int, int], float]
    expected_tokens: dict[int, float]
    parked: list[int]
    parked_joins: int


def conditional_rates(prefix: Sequence[float]) -> list[float]:
    """P(draft k accepted | drafts before it accepted) from P(first k drafts accepted)."""
    rates, before = [], 1.0
    for p in prefix:
        rates.append(min(1.0, p / before) if before > 0 else 0.0)
        before = p
    return rates


def typical(samples: Sequence[float]) -> float:
    """The lower median of recent step times: what a step costs. Not their minimum: a step is priced
    commit to commit, so host work that delays one commit (a finishing request's bookkeeping, the
    garbage collector) lengthens that interval and shortens the next, and the minimum of a window
    takes the shortened one. A one-off cost (a slow first call) is outvoted from the third sample on."""
    return sorted(samples)[(len(samples) - 1) // 2]


def aligned_lengths(k_max: int) -> list[int]:
    """The draft lengths K below k_max whose K + 1 verify rows a request fill whole row tiles of the
    verify's products: K + 1 a power of two (1, 3, 7, ...) at any power-of-two batch, and K + 1 = 6
    (K = 5) from 64 requests up (384 rows, three 128-row tiles), where the verify is compute-bound and
    K = 5 is the best fixed K. One draft more (K = 8 at 32 requests: 288 rows) pays a part-empty tile
    for its extra row, which costs more than the draft yields (benchmarks/RESULTS.md)."""
    rows = {1 << i for i in range(1, k_max.bit_length() + 1)} | {6}
    return sorted(r - 1 for r in rows if r - 1 < k_max)


def batch_bucket(batch: int) -> int:
    return 1 << max(0, math.ceil(math.log2(batch)))


class DraftLengthPolicy:
    def __init__(self, k_max: int, adaptive: bool = True, retry_every: int = 64, decay: float = 0.99,
                 recorded: Sequence[float] | None = None, lengths: Sequence[int] | None = None) -> None:
        """`recorded`: the drafter's measured P(first k drafts accepted), k = 1.. (its checkpoint's
        `acceptance.json`), which the first steps' few trials are weighed against. `lengths`: the draft
        lengths to choose among besides 0 and k_max (default: `aligned_lengths`)."""
        self.k_max = k_max
        self.recorded = tuple(recorded) if recorded else ()
        self.recorded_rates = conditional_rates(recorded) if recorded else []
        self.adaptive = adaptive
        self.retry_every = retry_every
        self.decay = decay
        if lengths is None:
            lengths = aligned_lengths(k_max)
        elif any(k < 1 or k > k_max for k in lengths):
            raise ConfigError(f"speculative_config.draft_length_candidates {sorted(lengths)}: each must be in 1.."
                              f"{k_max} (num_speculative_tokens)")
        self.candidates = sorted({0, k_max, *lengths})
        self.offered = [0.0] * k_max  # decayed count of steps that drafted at least k+1 tokens
        self.reached = [0.0] * k_max  # ... and had the first k accepted: the trials of draft k+1's rate
        self.accepted = [0.0] * k_max  # ... and had the first k+1 accepted
        self.greedy_seen = 0.0  # decayed counts of the requests observed greedy and sampled: the recorded
        self.sampled_seen = 0.0  # (greedy) acceptance is the prior for the greedy share of them only
        # (batch bucket, K) -> recent step seconds; estimates take their lower median (`typical`)
        self.samples: dict[tuple[int, int], deque[float]] = {}
        self.last_tried: dict[tuple[int, int], int] = {}
        self.sampled_at: dict[tuple[int, int], int] = {}  # (batch bucket, K) -> its clock at the last sample
        # (batch bucket, K) -> re-tries in a row that found K still losing; each doubles K's interval
        self.confirmed_losses: dict[tuple[int, int], int] = {}
        self._retried: tuple[int, int] | None = None  # the re-try of the previous choose(), if any
        self._run: tuple[int, int, int] | None = None  # (batch bucket, K, steps left) of a re-try's run
        self._last_timed: tuple[int, int] | None = None  # the (batch bucket, K) of the last step timed
        # (bucket, K, last step) of a choice that stands until a re-try is due or an observation could
        # change it: choose() then costs a few operations, not a re-scoring (it runs every step)
        self._settled: tuple[int, int, float] | None = None
        self.settles = True
        self.clock: Counter[int] = Counter()  # batch bucket -> choices made there: the re-tries' clock
        self.chosen: Counter[int] = Counter()  # steps by the K chosen for them
        self.park_left: dict[int, int] = {}  # batch bucket -> arrivals its park still covers
        self.park_rounds: dict[int, int] = {}  # batch bucket -> parks in a row (each doubles the next)
        self.parked_joins = 0  # requests told not to feed the drafter
        self.untimed_plain: Counter[int] = Counter()  # bucket -> choices made there before plain had a time
        # a list to record what the policy saw and chose, in order: ("time", batch, K, seconds, refill),
        # ("acceptance", draft lengths, accepted counts), ("choice", batch, K) (`blockspec bench --trace-policy`)
        self.trace: list[tuple] | None = None

    def fresh(self) -> "DraftLengthPolicy":
        """A policy of the same settings that has seen nothing (the engine's after its warm-up)."""
        return DraftLengthPolicy(self.k_max, self.adaptive, self.retry_every, self.decay, self.recorded or None,
                                 self.candidates[1:])

    # ---------------------------------------------------------------- observations
    def observe_acceptance(self, lens: list[int], accepted: list[int], sampled: list[bool] | None = None) -> None:
        """Each request's drafts offered and accepted; `sampled`: which requests sample (T > 0), whose acceptance
        the drafter's recorded greedy rates overstate."""
        if self.trace is not None:
            self.trace.append(("acceptance", list(lens), list(accepted)))
        for i in range(self.k_max):
            self.offered[i] *= self.decay
            self.reached[i] *= self.decay
            self.accepted[i] *= self.decay
        n_sampled = sum(sampled) if sampled is not None else 0
        self.greedy_seen = self.greedy_seen * self.decay + len(lens) - n_sampled
        self.sampled_seen = self.sampled_seen * self.decay + n_sampled
        for n, a in zip(lens, accepted):
            for i in range(min(n, self.k_max)):
                self.offered[i] += 1
                self.reached[i] += i <= a
                self.accepted[i] += i < a
        self._settled = None

    def observe_time(self, batch: int, k: int, seconds: float, refill: bool = False) -> None:
        """A step's time. A new sample of the settled choice that does not raise its estimate leaves it
        standing: it only makes that K score better (other candidates' borrowed estimates scale with
        it), and the re-try intervals only grow with the best score. `refill`: the step restarted a
        pipeline of steps (launched from committed state, the host's work not hidden behind the device's)."""
        if self.trace is not None:
            self.trace.append(("time", batch, k, seconds, refill))
        key = (batch_bucket(batch), self._candidate(k))
        after, self._last_timed = self._last_timed, key
        window = self.samples.setdefault(key, deque(maxlen=5))
        now = self.clock[key[0]]
        if k and now - self.sampled_at.get(key, now) > STALE_CHOICES:
            # a re-try: its old samples were taken where the batch's contexts were longer or shorter (they
            # grow through a wave and start short in the next), and would outvote the new one; the newest
            # stays, so one outlying sample does not decide alone. The plain path, the baseline whose
            # outliers would park a batch size, keeps its whole window
            while len(window) > 1:
                window.popleft()
        self.sampled_at[key] = now
        if refill and k and after == (key[0], 0) and window:
            # the speculative step after plain ones refills the pipeline: a switch's cost, not this K's as it
            # runs (the next step of its run is its sample); only a K with no sample yet takes it
            return
        before = typical(window) if len(window) >= 2 else None
        window.append(seconds)
        if self._settled is not None and (key != self._settled[:2] or before is None or typical(window) > before):
            self._settled = None

    # ---------------------------------------------------------------- decision
    def prefix_acceptance(self, optimism: float = 0.0) -> list[float]:
        """P(first k drafts accepted), k = 1..k_max.

        Each position's conditional rate borrows RECORDED_TRIALS pseudo-trials at the drafter's recorded
        rate where it has one (so two unlucky first drafts of a good drafter do not condemn it), scaled by
        the share of greedy requests among those seen: the rates were recorded greedy, and a sampled
        request accepts less (the rest of the weight, and a position without a record, borrows
        PRIOR_TRIALS at the rate of the position before it, the first at one half). So an unseen
        position extrapolates the last rate and a rarely offered one moves from it only as evidence
        comes. Shrunk towards one half instead, the few trials deep positions get while short drafts
        are explored would read as a collapse (0 of 2 accepted gives 0.17), and longer drafts would
        never look worth trying.
        With `optimism` z each rate counts z standard errors above its estimate (at most 1): the most
        its trials allow, which an unmeasured K is scored at (the next position still borrows the
        estimate itself)."""
        seen = self.greedy_seen + self.sampled_seen
        greedy = self.greedy_seen / seen if seen > 0 else 1.0  # the share the recorded greedy rates speak for
        out, survive, rate = [], 1.0, 0.5
        for i in range(self.k_max):
            has_record = i < len(self.recorded_rates)
            recorded = RECORDED_TRIALS * greedy if has_record else 0.0
            extrapolated = PRIOR_TRIALS * (1.0 - greedy) if has_record else PRIOR_TRIALS
            trials = self.reached[i] + recorded + extrapolated
            prior = (recorded * self.recorded_rates[i] if has_record else 0.0) + extrapolated * rate
            rate = (self.accepted[i] + prior) / trials
            bound = rate + optimism * math.sqrt(max(rate * (1 - rate), 0.0) / trials)
            survive *= min(bound, 1.0)
            out.append(survive)
        return out

    def expected_tokens(self, k: int, prefix: list[float] | None = None) -> float:
        """1 + sum of the first k prefix-acceptance probabilities (pass `prefix` to reuse one estimate)."""
        return 1.0 + sum((prefix if prefix is not None else self.prefix_acceptance())[:k])

    def choose(self, batch: int) -> int:
        """Drafts to verify per request this step (0 = take the plain path)."""
        k = self._choose(batch)
        self.chosen[k] += 1
        if self.trace is not None:
            self.trace.append(("choice", batch, k))
        return k

    def feeds_drafter(self, batch: int, joining: int = 1) -> bool:
        """Whether the `joining` requests that make a batch of this size should feed the drafter: not
        while its bucket is parked. The first call after a park ends makes every K's re-try due there
        (and unsettles the choice), so the first step in which the whole batch can draft re-tries them."""
        bucket = batch_bucket(batch)
        if bucket not in self.park_left and not self._inherit_park(bucket):
            return True
        if self.park_left[bucket] > 0:
            self.park_left[bucket] -= joining
            self.parked_joins += joining
            return False
        del self.park_left[bucket]
        for k in self.candidates[1:]:
            self.last_tried[(bucket, k)] = -math.inf
        self._settled = None
        return True

    def parked_again(self, batch: int) -> bool:
        """Whether this batch size is parked now by a park that the re-tries after an earlier one
        confirmed. A first park is decided from a few steps, its speculative times perhaps borrowed
        from another batch size, so a batch that could draft keeps feeding through it."""
        bucket = batch_bucket(batch)
        return self.park_left.get(bucket, 0) > 0 and self.park_rounds.get(bucket, 0) >= 2

    def view(self) -> PolicyView:
        prefix = self.prefix_acceptance()
        return PolicyView(dict(self.chosen), {key: typical(w) for key, w in self.samples.items() if w},
                          {k: self.expected_tokens(k, prefix) for k in self.candidates},
                          sorted(b for b, left in self.park_left.items() if left > 0), self.parked_joins)

    def _choose(self, batch: int) -> int:
        if not self.adaptive:
            return self.k_max
        bucket = batch_bucket(batch)
        # Re-tries are clocked in choices at this bucket: a drain through smaller batch sizes at the end of
        # a wave visits each for a few steps, and clocked in all steps every candidate's re-try there
        # would be due on entry (a slow step each)
        self.clock[bucket] += 1
        now = self.clock[bucket]
        if self._run is not None:  # a re-try's run goes on while the batch stays in its bucket
            run_bucket, run_k, left = self._run
            self._run = (run_bucket, run_k, left - 1) if run_bucket == bucket and left > 1 else None
            if run_bucket == bucket:
                self.last_tried[(bucket, run_k)] = now
                return run_k
        if self._settled is not None and self._settled[0] == bucket and now <= self._settled[2]:
            self.last_tried[(bucket, self._settled[1])] = now
            return self._settled[1]
        self._settled = None
        measured = {k: self.estimate(bucket, k) for k in self.candidates}
        if measured[0] is None:  # the plain path is measured first: it is the baseline
            self.last_tried[(bucket, 0)] = now
            # A plain step is timed in a run of decode steps and beside a prefill chunk (from the chunk's
            # end on the device); where it never is (requests that finish within a step or two, or graph
            # captures at every step), the choice stays plain anyway
            self.untimed_plain[bucket] += 1
            if self.untimed_plain[bucket] >= UNTIMED_PLAIN_PARKS:
                self._park(bucket)
            return 0
        prefix = self.prefix_acceptance()
        costs = self._optimistic_costs(measured)
        score = {k: self.expected_tokens(k, prefix) / costs[k] for k in self.candidates}
        timed = [k for k, t in measured.items() if t is not None]
        best = max(timed, key=score.__getitem__)
        if best:
            best = self._break_tie(best, timed, score)
        if self._retried is not None and self._retried[0] == bucket:  # what the last re-try found
            lost = self._retried[1] != best
            self.confirmed_losses[self._retried] = self.confirmed_losses.get(self._retried, 0) + 1 if lost else 0
        self._retried = None
        hope = self.prefix_acceptance(EXPLORE_Z) if None in measured.values() else []
        for k in self.candidates:
            # Optimism under uncertainty, shortest first: an unmeasured K is scored at the least it can
            # cost and at the most its positions' trials allow it to yield, and measured only if even
            # so it would beat the best measured one (its time then bounds the longer ones); a K that
            # cannot win is never paid for, and a few unlucky trials of a short K do not condemn the
            # longer ones (where one draft costs what the whole block does, only they can win).
            if measured[k] is None and self.expected_tokens(k, hope) / costs[k] > score[best]:
                self.last_tried[(bucket, k)] = now
                return k  # tried until it has two samples, the first of which may be a switch's
        due = math.inf  # the first step at which a re-try is due
        for k in self.candidates:  # re-measure stale ones; the worse a candidate, the rarer
            if measured[k] is None:
                continue  # unmeasured, and unable to win even at its least cost
            interval = self.retry_every * min(16.0, score[best] / max(score[k], 1e-9))
            # a K that re-tries keep finding losing waits twice as long each time (up to 16x): on a
            # workload where speculation does not pay, re-tries were most of its remaining cost
            doublings = min(4, self.confirmed_losses.get((bucket, k), 0))
            if k == 0:  # the plain path is the baseline: a stale estimate of it is what makes a step slower
                # than plain decoding, so it is re-measured 4x as often, and backs off (up to 4x) only where
                # speculation leads it by PLAIN_LEAD, which no drift of its time between re-tries closes (a
                # plain re-try's run and the refill after it cost about three speculative steps' tokens);
                # behind a lead of WIDE_PLAIN_LEAD it is re-tried like any losing K (falling acceptance shows
                # in the speculative steps' own trials, and no drift of a step's time doubles it)
                lead = score[best] / max(score[0], 1e-9)
                if lead < 1 + WIDE_PLAIN_LEAD:
                    interval /= 4
                    doublings = min(2, doublings) if lead >= 1 + PLAIN_LEAD else 0
            interval *= 2**doublings
            # a batch size seen for the first time starts every clock now: its borrowed estimates are
            # not stale, and retrying each of them at once would cost a slow step per candidate
            if k != best and now - self.last_tried.setdefault((bucket, k), now) > interval:
                self.last_tried[(bucket, k)] = now
                self._retried = (bucket, k)
                return self._start_run(bucket, k, best)
            if k != best:
                due = min(due, self.last_tried[(bucket, k)] + interval)
        self.last_tried[(bucket, best)] = now
        if best == 0:
            self._park(bucket)
        else:  # this bucket's own steps find drafting best now: a park that earlier steps set is over
            self.park_rounds.pop(bucket, None)
            self.park_left.pop(bucket, None)
        if self.settles:
            self._settled = (bucket, best, due)
        return best

    def _start_run(self, bucket: int, k: int, best: int) -> int:
        """Re-try k for the steps a switch between the plain path and speculation needs to give a sample of
        it as it runs: PLAIN_RUN for the plain path, SPEC_RUN for a K where the plain path is best, else one."""
        steps = PLAIN_RUN if k == 0 else SPEC_RUN if best == 0 else 1
        if steps > 1:
            self._run = (bucket, k, steps - 1)
        return k

    def _break_tie(self, best: int, timed: list[int], score: dict[int, float]) -> int:
        """The speculative K to take for `best`: the longest K within NEAR_TIE of its score whose deepest
        position is under-observed. Deep positions are observed only when offered, so on a near tie the
        longer draft costs next to nothing and keeps their estimate current; once they have
        OBSERVED_TRIALS the tie goes to the better score (a verify-bound batch's best K may lead the next
        longer one by 1 % a token, which a tie rule that always went longer would give away). Never
        over the plain path, whose lead is what keeps a step from being slower."""
        return max(k for k in timed if k == best or (
            k > best and score[k] >= (1 - NEAR_TIE) * score[best] and self.reached[k - 1] < OBSERVED_TRIALS))

    def _inherit_park(self, bucket: int) -> bool:
        """Park a bucket the policy has not decided at when a smaller bucket is parked and its re-tries
        confirmed it (a second park in a row): a draft costs relatively more, not less, as the batch
        grows (its verify rows grow with it), so a wave of arrivals into a new, larger batch would
        otherwise feed a drafter that is never used for the whole of its requests' lives. A first
        park, decided from a few steps, is not enough. The park ends, and is re-tried, like any other."""
        if (bucket, 0) in self.samples or bucket in self.untimed_plain:
            return False  # decided, or being decided, by its own steps
        if not any(b < bucket and left > 0 and self.park_rounds.get(b, 0) >= 2 for b, left in self.park_left.items()):
            return False
        self.park_left[bucket] = PARK_TURNOVERS * bucket
        return True

    def _park(self, bucket: int) -> None:
        """Plain wins here with no re-try due (or its time cannot be taken): requests that join this
        bucket stop feeding the drafter."""
        if bucket in self.park_left:
            return
        rounds = self.park_rounds.get(bucket, 0)
        self.park_left[bucket] = PARK_TURNOVERS * bucket * 2**rounds
        self.park_rounds[bucket] = min(rounds + 1, MAX_PARK_DOUBLINGS)

    def estimate(self, bucket: int, k: int) -> float | None:
        """Step time with k drafts at this batch bucket: measured (two samples or more), or else the
        plain time here scaled by the spec / plain ratio of the nearest bucket that measured both, so
        a new batch size needs only its plain step measured before it can speculate."""
        own = self.samples.get((bucket, k), ())
        if len(own) >= 2:
            return typical(own)
        plain = self.samples.get((bucket, 0), ())
        if k == 0 or len(plain) < 2:
            return None
        others = [b for (b, c) in self.samples if c == k and b != bucket and len(self.samples[(b, k)]) >= 2
                  and len(self.samples.get((b, 0), ())) >= 2]
        if not others:
            return None
        near = min(others, key=lambda b: abs(math.log2(b) - math.log2(bucket)))
        return typical(plain) * typical(self.samples[(near, k)]) / typical(self.samples[(near, 0)])

    @staticmethod
    def _optimistic_costs(measured: dict[int, float | None]) -> dict[int, float]:
        """Each candidate's step time: measured, or for an unmeasured one the highest measured time of a
        shorter candidate (a step never costs less with more drafts), a lower bound."""
        costs: dict[int, float] = {}
        floor = 0.0
        for k, est in measured.items():  # ascending K
            floor = max(floor, est) if est is not None else floor
            costs[k] = est if est is not None else floor
        return costs

    def _candidate(self, k: int) -> int:
        """The candidate a step with k drafts is accounted to (the smallest candidate >= k)."""
        return next(c for c in self.candidates if c >= k)
