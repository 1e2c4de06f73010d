"""Speculative decoding through the engine is exact: DFlash and DSpark against plain decoding.

The drafters are the reference-checked fixtures (random weights: mostly rejected). An "oracle"
wrapper replaces most drafts with the plain-decoding continuation, so long accepted blocks, stops
inside accepted blocks and bonus tokens are exercised too.
"""

from __future__ import annotations

import gc
import itertools
import logging
import operator
import time as clock
from pathlib import Path

import pytest
import torch

from blockspec import LLM, SamplingParams
from blockspec.config import ConfigError
from blockspec.engine.pipeline import SpecLaunch, priced_from
from blockspec.speculative.policy import UNTIMED_PLAIN_PARKS
from factories import save_drafter_target, save_moe_target, save_tiny

FIXTURES = Path(__file__).parent / "fixtures" / "drafters"


@pytest.fixture(scope="module", params=["dense", "qwen3_moe", "qwen2_moe"])
def target(request, tmp_path_factory) -> Path:
    """The drafter fixtures' dense target, and Qwen3-MoE and Qwen2-MoE (shared experts) targets of the
    same shape, sparse and dense layers mixed: every check here holds on each. On a MoE target the
    verify rows of a step route to experts independently of each other, as a plain step's row does."""
    if request.param == "dense":
        return save_drafter_target(tmp_path_factory.mktemp("target"))
    return save_moe_target(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def plain(target) -> LLM:
    return LLM(str(target), device="cpu", max_model_len=160)


def prompts(n: int = 5, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(2, 95, (int(length),), generator=g).tolist()}
            for length in torch.randint(1, 30, (n,), generator=g)]


def spec_llm(target: Path, method: str, fixture: str, device: str = "cpu", engine: dict | None = None,
             **spec) -> LLM:
    """Fixed draft length unless the test asks otherwise, so acceptance assertions see every position.
    `engine`: further LLM arguments."""
    spec.setdefault("adaptive_draft_length", False)
    return LLM(str(target), device=device, dtype="float32", max_model_len=160,
               speculative_config={"method": method, "model": str(FIXTURES / fixture), **spec}, **(engine or {}))


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                        reason="needs CUDA")])


def add_oracle(llm: LLM, expected: dict[tuple, list[int]], corrupt: float = 0.15, seed: int = 0) -> None:
    """Replace drafts with the plain continuation, corrupting a fraction so rejections happen too. A block's
    anchor is the token at position num_cached (a step launched before the commit has advanced it)."""
    proposer = llm.engine.proposer
    real = proposer.propose
    g = torch.Generator().manual_seed(seed)

    def propose(reqs, budgets, last_tokens=None, draft_params=None):
        block = real(reqs, budgets, last_tokens, draft_params)
        tokens = block.tokens.clone()
        for r, req in enumerate(reqs):
            want = expected[tuple(req.prompt_token_ids)]
            n = req.num_cached + 1 - len(req.prompt_token_ids)
            for i in range(block.lens[r]):
                truth = want[n + i] if n + i < len(want) else 3
                tokens[r, i] = int(torch.randint(2, 95, (1,), generator=g)) if torch.rand(1, generator=g) < corrupt \
                    else truth
        block.tokens = tokens
        return block

    proposer.propose = propose


def counter_clock(monkeypatch) -> list[float]:
    """The engine's clock (engine, pipeline and timer modules) as a counter the test moves, `now[0] += s`:
    a price then counts the delays a test puts in a step, whatever the machine's speed (real sleeps
    failed on a busy host)."""
    import types

    from blockspec.engine import engine as engine_module
    from blockspec.engine import pipeline, timer

    now = [0.0]
    for module in (engine_module, pipeline, timer):
        monkeypatch.setattr(module, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    return now


def run(llm: LLM, ps: list[dict], params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]


GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
CASES = [("dflash", "dflash", None), ("dflash", "dflash", 2), ("dflash", "dflash_swa", None),
         ("dspark", "dspark_speculators", None),
         ("dspark", "dspark_vanilla", None), ("dspark", "dspark_gated", 2), ("dspark", "dspark_rnn", None)]


@pytest.mark.parametrize("method, fixture, k", CASES)
@pytest.mark.parametrize("oracle", [False, True], ids=["random-drafter", "oracle-drafter"])
def test_greedy_equals_plain(target, plain, method, fixture, k, oracle):
    ps = prompts()
    expected = run(plain, ps, GREEDY)
    llm = spec_llm(target, method, fixture, **({"num_speculative_tokens": k} if k else {}))
    if oracle:
        add_oracle(llm, {tuple(p["prompt_token_ids"]): e for p, e in zip(ps, expected)})
    assert run(llm, ps, GREEDY) == expected
    m = llm.get_stats()
    k_eff = k or llm.engine.proposer.drafter.num_draft_slots
    assert m["num_drafts"] > 0 and len(m["num_accepted_tokens_per_pos"]) <= k_eff
    if oracle:
        assert m["mean_acceptance_length"] > 2.0


def test_stops_inside_accepted_blocks(target, plain):
    ps = prompts(4, seed=1)
    base = run(plain, ps, GREEDY)
    llm = spec_llm(target, "dflash", "dflash")
    add_oracle(llm, {tuple(p["prompt_token_ids"]): e for p, e in zip(ps, base)}, corrupt=0.0)
    for stop_at in (4, 9, 13):
        stops = sorted({e[stop_at] for e in base})
        for max_tokens in (7, 11, 40):
            params = SamplingParams(temperature=0, max_tokens=max_tokens, stop_token_ids=stops, ignore_eos=True)
            got = llm.generate(ps, params, use_tqdm=False)
            want = plain.generate(ps, params, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
            assert [o.outputs[0].finish_reason for o in got] == [o.outputs[0].finish_reason for o in want]
    assert llm.get_stats()["mean_acceptance_length"] > 3.0  # blocks really were accepted whole
    pages = llm.engine.pages
    assert not llm.engine.running and pages.num_free_slots == llm.engine.config.max_num_seqs
    assert pages.num_free_pages == pages.num_pages  # every page back in the pool


@pytest.mark.parametrize("fixture, method", [("dflash", "dflash"), ("dspark_vanilla", "dspark")])
def test_seeded_sampling_equals_plain_with_greedy_drafts(target, plain, fixture, method):
    """Sample-and-match: same seed, same tokens as plain sampling, at several temperatures and filters.
    The oracle drafts plain sampling's own continuation, so most drafts are accepted."""
    ps = prompts(4, seed=2)
    for params in (SamplingParams(temperature=0.7, seed=11, max_tokens=30, ignore_eos=True),
                   SamplingParams(temperature=1.0, top_k=8, top_p=0.9, seed=5, max_tokens=30, ignore_eos=True),
                   SamplingParams(temperature=1.3, min_p=0.05, frequency_penalty=0.8, presence_penalty=0.3,
                                  repetition_penalty=1.2, seed=3, max_tokens=30, ignore_eos=True)):
        expected = run(plain, ps, params)
        llm = spec_llm(target, method, fixture)
        add_oracle(llm, {tuple(p["prompt_token_ids"]): e for p, e in zip(ps, expected)}, corrupt=0.3)
        assert run(llm, ps, params) == expected
        assert llm.get_stats()["mean_acceptance_length"] > 1.5


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits", "processed_logprobs"])
def test_verify_rows_report_the_logprobs_plain_decoding_does(target, mode):
    """Every emitted token's logprobs (and its top alternatives) from a verify row equal plain decoding's at
    that position, in each logprobs_mode, greedy and sampled; the oracle's drafts are mostly accepted, so
    most tokens come from verify rows."""
    ps = prompts(3, seed=4)
    plain_llm = LLM(str(target), device="cpu", max_model_len=160, logprobs_mode=mode)
    for params in (SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=3),
                   SamplingParams(temperature=0.8, top_k=10, seed=7, max_tokens=20, ignore_eos=True, logprobs=3)):
        want = [o.outputs[0] for o in plain_llm.generate(ps, params, use_tqdm=False)]
        llm = spec_llm(target, "dflash", "dflash", engine={"logprobs_mode": mode})
        add_oracle(llm, {tuple(p["prompt_token_ids"]): w.token_ids for p, w in zip(ps, want)}, corrupt=0.2)
        got = [o.outputs[0] for o in llm.generate(ps, params, use_tqdm=False)]
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
        for g, w in zip(got, want):
            assert [sorted(e) for e in g.logprobs] == [sorted(e) for e in w.logprobs]
            assert all(abs(a.logprob - b.logprob) < 1e-4 or a.logprob == b.logprob for eg, ew in
                       zip(g.logprobs, w.logprobs) for a, b in ((eg[t], ew[t]) for t in eg))
        assert llm.get_stats()["num_accepted_tokens"] > 0


def test_mixed_batch_with_opt_out_and_greedy(target, plain):
    ps = prompts(3, seed=3)
    params = [SamplingParams(temperature=0, max_tokens=25, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=1, max_tokens=25, ignore_eos=True, use_speculation=False),
              SamplingParams(temperature=0.9, seed=2, max_tokens=25, ignore_eos=True)]
    llm = spec_llm(target, "dflash", "dflash")
    assert [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in plain.generate(ps, params, use_tqdm=False)]
    out = llm.generate(ps, params, use_tqdm=False)
    assert out[1].metrics["num_drafts"] == 0 and out[0].metrics["num_drafts"] > 0


def test_opted_out_request_keeps_no_draft_context(target):
    """A request that opted out never drafts, so it must not hold target features for the drafter
    (they would pile up for its whole life)."""
    llm = spec_llm(target, "dflash", "dflash")
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, use_speculation=False)
    (req,) = engine.add_request("out", None, prompts(1, seed=5)[0]["prompt_token_ids"], params)
    for _ in range(6):
        engine.step()
    assert len(req.output_ids) >= 5 and req.num_pending == 0
    while engine.has_unfinished():
        engine.step()


def record_taps(engine) -> list:
    """A list that gets the `with_taps` of every target forward the engine's runner makes from now on."""
    taps = []
    for name in ("forward", "forward_ids"):
        real = getattr(engine.runner, name)
        setattr(engine.runner, name, lambda *a, real=real, **kw: taps.append(kw.get("with_taps")) or real(*a, **kw))
    return taps


def test_requests_that_join_a_parked_batch_run_plain_and_feed_no_drafter(target, plain):
    """Arrivals that join a parked batch bucket (counting every arrival of the step) get no draft
    context, neither their prompt's nor their steps' taps; while one runs, the batch takes plain steps
    (no request drafts); when they have left, speculation resumes. Outputs equal plain decoding."""
    llm = spec_llm(target, "dflash", "dflash")
    engine = llm.engine
    engine.policy.park_left[4] = 10**9  # batches of 3 or 4 requests that may speculate
    ps = [p["prompt_token_ids"] for p in prompts(7, seed=11)]
    short, long = (SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 40))

    def add(i: int, params: SamplingParams):
        (req,) = engine.add_request(f"r{i}", None, ps[i], params)
        return req

    def run_out(reqs: list) -> None:
        while any(r.status.value != "finished" for r in reqs):
            engine.step()

    taps = record_taps(engine)
    burst = [add(i, short) for i in range(3)]  # three at once make a batch of 3, though each alone would not
    run_out(burst)
    assert not any(r.feeds_drafter or r.spec.num_drafts for r in burst) and not any(taps)
    assert all(r.num_draft_ctx == 0 and r.num_pending == 0 for r in burst)
    first = [add(3, long), add(4, long)]  # a batch of 2: not parked
    for _ in range(4):
        engine.step()
    assert all(r.feeds_drafter and r.spec.num_drafts > 0 for r in first)
    joined = [add(5, short), add(6, short)]  # with them, a batch of 4
    engine.step()
    drafts = [r.spec.num_drafts for r in first]
    run_out(joined)
    assert not any(r.feeds_drafter for r in joined)
    assert all(r.num_draft_ctx == 0 and r.num_pending == 0 for r in joined)
    assert [r.spec.num_drafts for r in first] == drafts  # no speculative step while they ran
    run_out(first)
    assert any(r.spec.num_drafts > d for r, d in zip(first, drafts))  # speculation resumed after them
    expected = [o.outputs[0].token_ids for o in plain.generate(
        [{"prompt_token_ids": p} for p in ps], [short] * 3 + [long] * 2 + [short] * 2, use_tqdm=False)]
    assert [r.output_ids for r in burst + first + joined] == expected


def test_requests_that_fed_without_drafting_stop_when_the_batch_grows_into_a_park(target, plain):
    """A burst reaching a server joins over a few steps: its first arrivals, judged at a small batch,
    feed the drafter. When the batch grows into a parked size, those that have not drafted yet stop
    feeding (their held taps dropped), so the batch runs as plain decoding with no taps at all.
    Outputs equal plain decoding."""
    llm = spec_llm(target, "dflash", "dflash")
    engine = llm.engine
    engine.policy.park_left[4] = 10**9  # batches of 3 or 4 requests that may speculate
    engine.policy.choose = lambda batch: 0  # nobody drafts before the burst is in
    ps = [p["prompt_token_ids"] for p in prompts(4, seed=12)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    taps = record_taps(engine)
    first = [engine.add_request(str(i), None, ps[i], params)[0] for i in range(2)]  # a batch of 2: not parked
    for _ in range(3):
        engine.step()
    assert all(r.feeds_drafter for r in first) and any(taps) and any(r.num_pending for r in first)
    joins = engine.policy.view().parked_joins
    rest = [engine.add_request(str(i), None, ps[i], params)[0] for i in range(2, 4)]  # with them, a batch of 4
    engine.step()
    assert not any(r.feeds_drafter or r.num_pending for r in first + rest)
    assert engine.policy.view().parked_joins == joins + 4
    taps.clear()
    while engine.has_unfinished():
        engine.step()
    assert taps and not any(taps)
    expected = plain.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    assert [r.output_ids for r in first + rest] == [o.outputs[0].token_ids for o in expected]


def test_decode_steps_beside_prefill_chunks_are_priced_and_do_not_park_the_batch(target, plain):
    """With long prompts in small chunks, every decode step shares its engine step with a chunk of the
    next prompt. Those steps, plain and speculative alike, are priced (from the chunk's end on a GPU),
    so the plain path gets a time and the batch size is never parked for lack of one (with steps
    launched ahead, a plain step beside a chunk went unpriced, and after UNTIMED_PLAIN_PARKS choices the
    policy parked the batch: at 32k-token prompts speculation never ran). Outputs equal plain decoding."""
    llm = spec_llm(target, "dflash", "dflash", adaptive_draft_length=True,
                   engine={"max_prefill_tokens": 4, "async_scheduling": True})
    engine = llm.engine
    engine.policy.trace = []
    g = torch.Generator().manual_seed(21)
    ps = [torch.randint(2, 95, (96,), generator=g).tolist() for _ in range(3)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    reqs = [engine.add_request(str(i), None, p, params)[0] for i, p in enumerate(ps)]
    beside = 0  # decode steps that shared their step with a chunk
    while engine.has_unfinished():
        chunk = any(r.num_cached < r.prefill_len for r in engine.scheduler.running)
        decoding = any(r.num_cached >= r.prefill_len for r in engine.scheduler.running)
        beside += chunk and decoding
        engine.step()
    assert beside >= UNTIMED_PLAIN_PARKS
    plain_times = [e for e in engine.policy.trace if e[0] == "time" and e[2] == 0]
    assert plain_times and max(engine.policy.untimed_plain.values(), default=0) < UNTIMED_PLAIN_PARKS
    assert any(k for k in engine.policy.chosen)  # the drafts were tried
    expected = plain.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    assert [r.output_ids for r in reqs] == [o.outputs[0].token_ids for o in expected]


class _DeviceStamp:
    """A CUDA timing event's part in pricing: passing it takes `wait` seconds of the host's clock, and the
    device ran `ms` from `start` to it."""

    def __init__(self, wait: float = 0.0, ms: float = 0.0) -> None:
        self.wait, self.ms = wait, ms

    def synchronize(self) -> None:
        clock.sleep(self.wait)

    def elapsed_time(self, end: "_DeviceStamp") -> float:
        return end.ms


def test_a_step_behind_a_prefill_is_priced_from_when_the_device_passed_the_prefill():
    """The moment a prefill's work ended is read after waiting for the step behind it: now, less the
    1 ms the device ran from one to the other. Read before the wait, it would be the launch's own moment
    (and the step's price would hold the wait for the prefill)."""
    t0 = clock.perf_counter()
    start = priced_from(t0, _DeviceStamp(), _DeviceStamp(wait=0.05, ms=1.0))
    assert t0 + 0.045 < start < clock.perf_counter()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_a_decode_step_behind_a_prefill_is_priced_without_it(target):
    """On a GPU a decode step launched beside a prefill chunk queues behind the chunk's device work, and
    is priced from where that work ends. Each chunk here is followed on the device by a 0.2 s spin, and the
    steps alternate plain, plain, K = 2: steps beside chunks are priced (plain ones launched ahead, committed
    before the device passed them, as well as speculative ones), and no price holds the spin (with it in, a
    speculative step beside a chunk cost more than the spin, plain ones there went unpriced, and then were
    priced from their launch)."""
    llm = spec_llm(target, "dflash", "dflash", device="cuda", adaptive_draft_length=True,
                   engine={"max_prefill_tokens": 8})
    engine = llm.engine
    plan = itertools.cycle([0, 0, 2])
    engine.policy.choose = lambda batch: next(plan)
    spin = 0.2
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10**7)
    end.record()
    end.synchronize()
    cycles = int(10**7 * spin / (start.elapsed_time(end) / 1e3))
    prefill = engine._prefill

    def slow_prefill(reqs):
        out = prefill(reqs)
        torch.cuda._sleep(cycles)  # on the engine's stream, after the chunk
        return out

    engine._prefill = slow_prefill
    beside: list[tuple[int, float]] = []
    observe = engine.policy.observe_time
    chunk = [False]

    def watch(batch, k, seconds, refill=False):
        if chunk[0]:
            beside.append((k, seconds))
        observe(batch, k, seconds, refill)

    engine.policy.observe_time = watch
    g = torch.Generator().manual_seed(22)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    for i, n in enumerate((8, 120)):  # the first decodes while the second prefills in 15 chunks
        engine.add_request(str(i), None, torch.randint(2, 95, (n,), generator=g).tolist(), params)
    while engine.has_unfinished():
        chunk[0] = any(r.num_cached < r.prefill_len for r in engine.scheduler.running)
        engine.step()
    assert {k for k, _ in beside} >= {0} and any(k for k, _ in beside), beside
    assert max(seconds for _, seconds in beside) < spin, beside


@pytest.mark.parametrize("again", [True, False], ids=["second park", "first park"])
def test_a_batch_whose_size_the_policy_parks_stops_feeding_the_drafter(target, plain, again):
    """Requests that joined an unparked batch feed the drafter; when the policy's re-tries find plain
    best at their batch size again and park it a second time, the whole batch stops feeding (drafted
    or not): no taps in its later forwards. On a first park (decided from a few steps), a plain
    choice leaves them feeding. Outputs equal plain decoding."""
    llm = spec_llm(target, "dflash", "dflash")
    engine = llm.engine
    plan = iter([3, 3] + [0] * 200)  # two speculative steps, then plain
    engine.policy.choose = lambda batch: next(plan)
    ps = [p["prompt_token_ids"] for p in prompts(3, seed=14)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    taps = record_taps(engine)
    reqs = [engine.add_request(str(i), None, p, params)[0] for i, p in enumerate(ps)]
    for _ in range(4):
        engine.step()
    assert all(r.feeds_drafter and r.spec.num_drafts for r in reqs)
    engine.policy.park_left[4] = 10**9
    engine.policy.park_rounds[4] = 2 if again else 1
    joins = engine.policy.view().parked_joins
    engine.step()
    assert all(r.feeds_drafter is not again for r in reqs)
    assert engine.policy.view().parked_joins == joins + (3 if again else 0)
    taps.clear()
    while engine.has_unfinished():
        engine.step()
    assert any(taps) is not again
    expected = plain.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    assert [r.output_ids for r in reqs] == [o.outputs[0].token_ids for o in expected]


@pytest.mark.parametrize("overrule", ["draft length", "feeding"])
def test_the_engine_acts_on_the_agreed_decision_not_its_own(target, plain, overrule):
    """Tensor-parallel ranks take rank 0's policy decisions through Engine.agree. Overruled to the plain
    path (K = 0) the engine drafts nothing; overruled to not feeding, its requests feed no drafter."""
    llm = spec_llm(target, "dflash", "dflash")  # its own decisions: always K = K_max, always feed
    engine = llm.engine
    k_max = engine.proposer.num_speculative_tokens
    assert k_max > 1
    engine.agree = (lambda d: 0 if d == k_max else d) if overrule == "draft length" else (lambda d: 0 if d is True else d)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ps = [p["prompt_token_ids"] for p in prompts(3, seed=13)]
    reqs = [engine.add_request(f"a{i}", None, p, params)[0] for i, p in enumerate(ps)]
    while engine.has_unfinished():
        engine.step()
    assert not any(r.spec.num_drafts for r in reqs)
    assert all(r.feeds_drafter for r in reqs) == (overrule == "draft length")
    assert [r.output_ids for r in reqs] == run(plain, [{"prompt_token_ids": p} for p in ps], params)


@pytest.mark.parametrize("method, fixture", [("dflash", "dflash"), ("dspark", "dspark_vanilla"),
                                             ("dspark", "dspark_rnn")])
@pytest.mark.parametrize("rejection", ["standard", "block"])
def test_probabilistic_drafts_run_and_greedy_rows_stay_exact(target, plain, method, fixture, rejection):
    llm = spec_llm(target, method, fixture, draft_sample_method="probabilistic", rejection_sample_method=rejection)
    ps = prompts(3, seed=4)
    sampled = SamplingParams(temperature=1.0, seed=9, max_tokens=20, ignore_eos=True)
    outs = llm.generate(ps, [sampled, GREEDY, sampled], use_tqdm=False)
    assert all(o.error is None for o in outs)
    assert outs[1].outputs[0].token_ids == run(plain, [ps[1]], GREEDY)[0]
    assert [len(o.outputs[0].token_ids) for o in outs] == [20, 40, 20]
    assert all(0 <= t < 96 for o in outs for t in o.outputs[0].token_ids)
    assert llm.get_stats()["num_drafts"] > 0


@pytest.mark.parametrize("method, fixture", [("dflash", "dflash"), ("dspark", "dspark_vanilla")])
def test_probabilistic_drafts_near_the_end_keep_each_requests_parameters(target, method, fixture, caplog):
    """A step drafting fewer than K positions (its requests near max_tokens) took its draft rows' sampling
    parameters from a table of K rows a request: DFlash's sampler failed on the size (every request of the
    step recomputed, a logit_bias request failed), DSpark's drew with another request's seed, position and
    temperature, so a seeded request's tokens changed with its batch. Each must draw alone as batched."""
    llm = spec_llm(target, method, fixture, draft_sample_method="probabilistic")
    ps = prompts(3, seed=6)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=n, ignore_eos=True, logit_bias={3: 2.0})
              for s, n in ((5, 11), (7, 12), (9, 13))]
    with caplog.at_level(logging.ERROR, logger="blockspec"):
        alone = [llm.generate([p], q, use_tqdm=False)[0] for p, q in zip(ps, params)]
        batched = llm.generate(ps, params, use_tqdm=False)
    assert "engine step failed" not in caplog.text
    assert all(o.error is None for o in alone + batched)
    assert [o.outputs[0].token_ids for o in batched] == [o.outputs[0].token_ids for o in alone]
    assert [len(o.outputs[0].token_ids) for o in batched] == [11, 12, 13]
    assert llm.get_stats()["num_drafts"] > 0


def test_metrics_names_and_per_request(target):
    llm = spec_llm(target, "dflash", "dflash")
    out = llm.generate(prompts(2), GREEDY, use_tqdm=False)
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos",
                "acceptance_rate", "mean_acceptance_length"):
        assert key in out[0].metrics and key in llm.get_stats()
    m = llm.get_stats()
    assert m["num_draft_tokens"] == sum(o.metrics["num_draft_tokens"] for o in out)
    assert m["acceptance_rate"] == pytest.approx(m["num_accepted_tokens"] / m["num_draft_tokens"])
    assert m["mean_acceptance_length"] == pytest.approx(1 + m["num_accepted_tokens"] / m["num_drafts"])
    assert {"draft_s", "verify_s", "rest_s"} <= set(m)
    # n copies: a prompt's metrics count every copy's tokens and drafts (they were the first copy's)
    llm = spec_llm(target, "dflash", "dflash")
    (many,) = llm.generate(prompts(1), SamplingParams(n=3, temperature=0.8, seed=2, max_tokens=9, stop_token_ids=[5]),
                           use_tqdm=False)
    assert many.metrics["num_generated_tokens"] == sum(len(c.token_ids) for c in many.outputs)
    assert many.metrics["num_draft_tokens"] == llm.get_stats()["num_draft_tokens"] > 0


def test_drafter_that_does_not_fit_the_target(tmp_path):
    other = save_tiny(tmp_path / "t", "qwen3", seed=0, vocab=96, hidden=64, layers=5, heads=4, kv_heads=2)
    with pytest.raises(ConfigError, match="hidden_size"):
        spec_llm(other, "dflash", "dflash")
    with pytest.raises(ConfigError, match="num_speculative_tokens=9 exceeds"):
        spec_llm(save_drafter_target(tmp_path / "t2"), "dflash", "dflash",
                 num_speculative_tokens=9)


def test_adaptive_draft_length_stays_exact_and_backs_off(target, plain):
    """With a drafter that is never right, the policy learns that plain steps give more tokens/s."""
    ps = prompts(3, seed=5)
    llm = spec_llm(target, "dflash", "dflash", adaptive_draft_length=True)
    params = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
    llm.engine.policy.retry_every = 10**6  # measure each candidate once, then exploit
    assert run(llm, ps, params) == run(plain, ps, params)
    policy = llm.engine.policy
    assert policy.prefix_acceptance()[0] < 0.3
    measured = [k for k in policy.candidates if policy.estimate(4, k) is not None]
    score = {k: policy.expected_tokens(k) / policy.estimate(4, k) for k in measured}
    best = max(measured, key=score.__getitem__)
    if best:  # among speculative K a near tie goes to a longer one (the policy's rule)
        best = policy._break_tie(best, measured, score)
    choice = policy.choose(3)
    # the best measured K, unless a K not measured twice yet could still win at its least cost
    assert choice == best or policy.estimate(4, choice) is None, (choice, best)


@pytest.mark.parametrize("spec", [{"confidence_threshold": 0.5}, {"adaptive_verification": True},
                                  {"confidence_threshold": 0.3, "adaptive_verification": True}])
def test_confidence_pruning_stays_exact(target, plain, spec):
    ps = prompts(4, seed=6)
    expected = run(plain, ps, GREEDY)
    llm = spec_llm(target, "dspark", "dspark_vanilla", **spec)
    add_oracle(llm, {tuple(p["prompt_token_ids"]): e for p, e in zip(ps, expected)}, corrupt=0.2)
    assert run(llm, ps, GREEDY) == expected
    sampled = SamplingParams(temperature=0.8, seed=4, max_tokens=30, ignore_eos=True)
    assert run(llm, ps, sampled) == run(plain, ps, sampled)
    m = llm.get_stats()
    assert len(m["confidence_predicted_per_pos"]) == 4 and len(m["confidence_realised_per_pos"]) == 4
    if spec.get("adaptive_verification"):
        assert m["verify_budget_mean"] >= 0
        assert llm.engine.proposer.cost_table.rest  # the steps as they ran priced the rest of a step


def test_calibration_from_host_survival_equals_the_device_sums(target):
    """Steps that read the confidences on the host (threshold, budget) record the predicted survival there;
    captured steps on the device. Both must give the same per-position sums, verified drafts only."""
    proposer = spec_llm(target, "dspark", "dspark_vanilla", adaptive_verification=True).engine.proposer
    k = proposer.num_speculative_tokens
    confidence = torch.rand(5, k, generator=torch.Generator().manual_seed(3), dtype=torch.float64).float()
    lens = [k, 0, 2, k - 1, 1]
    survival = [list(itertools.accumulate(row, operator.mul)) for row in confidence.tolist()]
    proposer.reset_stats()
    proposer._record_calibration(confidence, torch.tensor(lens))
    device = proposer.calibration.tolist()
    proposer.reset_stats()
    proposer._record_host_calibration(survival, lens)
    assert proposer.host_calibration[1] == [sum(n > j for n in lens) for j in range(k)]
    assert proposer.host_calibration[1] == device[1]
    assert proposer.host_calibration[0] == pytest.approx(device[0], rel=1e-6)
    assert proposer.host_calibration[0][1] == pytest.approx(survival[0][1] + survival[2][1] + survival[3][1])
    metrics = proposer.calibration_metrics()["confidence_predicted_per_pos"]
    assert metrics[1] == pytest.approx(proposer.host_calibration[0][1] / 3)


@pytest.mark.parametrize("spec", [{}, {"adaptive_verification": True}], ids=["chained", "cost-table"])
def test_a_dropped_llm_is_freed_at_once(target, spec):
    """Dropping a speculating LLM frees its engine at once, after chained steps or the verify cost
    table's profiling: a reference cycle would hold the model, caches and (on a GPU) CUDA graphs until
    the cyclic collector runs, which may be inside another engine's graph capture, where freeing a
    graph invalidates the capture."""
    import gc
    import weakref

    llm = spec_llm(target, "dspark", "dspark_vanilla", **spec)
    llm.engine.async_scheduling = True
    run(llm, prompts(2), GREEDY)
    engine = llm.engine
    if spec:  # the steps, launched ahead of their commits or not, priced the rest of a step
        assert engine.proposer.cost_table is not None and engine.proposer.cost_table.rest
    else:
        assert engine.num_spec_steps_chained > 0
    refs = [weakref.ref(x) for x in (engine, engine.proposer, engine.proposer.steps, engine.runner, engine.model)]
    gc.disable()
    try:
        del llm, engine
        assert [r() is None for r in refs] == [True] * len(refs)
    finally:
        gc.enable()


def test_confidence_threshold_prunes_drafts(target):
    full = spec_llm(target, "dspark", "dspark_vanilla")
    pruned = spec_llm(target, "dspark", "dspark_vanilla", confidence_threshold=0.9)
    run(full, prompts(3), GREEDY)
    run(pruned, prompts(3), GREEDY)
    assert pruned.get_stats()["num_draft_tokens"] < full.get_stats()["num_draft_tokens"]


def test_confidence_options_need_a_confidence_head(target):
    with pytest.raises(ConfigError, match="confidence head"):
        spec_llm(target, "dflash", "dflash", confidence_threshold=0.5)


def test_given_draft_lengths_are_the_only_ones_chosen_and_stay_exact(target, plain):
    """With draft_length_candidates the adaptive policy chooses among those, 0 and K only, and greedy output
    stays plain decoding's."""
    ps = prompts(4, seed=21)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    llm = spec_llm(target, "dflash", "dflash", adaptive_draft_length=True, draft_length_candidates=[2])
    assert llm.engine.policy.candidates == [0, 2, 3]  # the fixture drafts 3: 1 is left out
    out = [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]
    assert out == [o.outputs[0].token_ids for o in plain.generate(ps, params, use_tqdm=False)]
    chosen = llm.engine.policy.chosen
    assert sum(chosen.values()) > 0 and set(chosen) <= set(llm.engine.policy.candidates)
    with pytest.raises(ConfigError, match="each must be in 1..3"):
        spec_llm(target, "dflash", "dflash", adaptive_draft_length=True, draft_length_candidates=[2, 9])


@pytest.mark.parametrize("draft_method", ["greedy", "probabilistic"])
def test_markov_top_k_restriction_stays_exact(target, plain, draft_method):
    ps = prompts(3, seed=7)
    llm = spec_llm(target, "dspark", "dspark_rnn", markov_top_k=5, draft_sample_method=draft_method)
    assert run(llm, ps, GREEDY) == run(plain, ps, GREEDY)
    sampled = SamplingParams(temperature=0.9, seed=2, max_tokens=20, ignore_eos=True)
    outs = llm.generate(ps, sampled, use_tqdm=False)
    assert all(o.error is None and len(o.outputs[0].token_ids) == 20 for o in outs)


def test_policy_turns_speculation_off_when_confidence_prunes_every_draft(target):
    """A step whose drafts were all pruned by confidence costs a draft and yields one token: the policy
    must learn that choosing K > 0 does not pay, not mistake those steps for plain ones. They are
    timed as the K chosen and count as drafts of it that were all rejected. (Which path then wins
    rests on timing: on a CPU a pruned K = 1 step costs about what a plain one does.)"""
    llm = spec_llm(target, "dspark", "dspark_vanilla", confidence_threshold=0.999999, adaptive_draft_length=True)
    policy = llm.engine.policy
    choices: list[int] = []
    timed: list[int] = []
    choose, observe_time = policy.choose, policy.observe_time
    policy.choose = lambda batch: choices.append(choose(batch)) or choices[-1]
    policy.observe_time = lambda batch, k, *rest, **kw: timed.append(k) or observe_time(batch, k, *rest, **kw)
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    llm.generate([prompts(1, seed=8)[0]], params, use_tqdm=False)
    assert llm.get_stats()["num_draft_tokens"] == 0  # every draft was pruned
    assert any(choices) and timed.count(0) <= choices.count(0), (choices, timed)
    assert policy.reached[0] > 0 and policy.accepted[0] == 0  # first drafts offered, none accepted


def assert_draft_cache_is_one_append(engine, reqs, device, behind: int) -> None:
    """Each request's cached draft context K/V equal one append of the target's taps over its whole
    sequence into a fresh cache; at most `behind` of its tokens are not in yet."""
    from blockspec.models.kv_cache import causal_meta

    drafter, model = engine.proposer.drafter, engine.model
    for req in reqs:
        n = req.num_draft_ctx
        seq = req.prompt_token_ids + req.output_ids
        assert n >= len(seq) - behind
        cache = model.new_cache(1, len(seq) + 1)
        meta = causal_meta([0], [0], [n], n, cache.trash, device, model.config.sliding_window, model.config.layer_types)
        _, feats = model(torch.tensor([seq[:n]], device=device), meta, cache, tuple(drafter.target_layer_ids))
        fresh = drafter.new_cache(1, n + drafter.block_size + 1, device, torch.float32)
        drafter.append_context(fresh, [0], [0], [n], feats)
        for layer in range(len(fresh.k)):
            got = engine.context.cache.gather(layer, torch.tensor([req.slot], device=device), n)
            want = fresh.gather(layer, torch.tensor([0], device=device), n)
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("method, fixture", [("dflash", "dflash"), ("dspark", "dspark_vanilla")])
@pytest.mark.parametrize("ahead", [False, True], ids=["synchronous", "launched-ahead"])
@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_draft_cache_holds_what_one_append_of_the_whole_context_gives(target, plain, method, fixture, ahead, device):
    """However the context reached the draft cache (a prefill chunk, plain steps' rows held and
    flushed K + 1 at a time, a verify's accepted rows appended by the next draft, rows derived on
    the device for a step launched before the read-back), each request's cached context K/V equal
    those of one append of the target's taps over its whole sequence into a fresh cache."""
    llm = spec_llm(target, method, fixture, device, adaptive_draft_length=True, num_speculative_tokens=3)
    if device != "cpu":  # on the GPU: CUDA graphs, the tap sink inside them, the captured flush
        plain = LLM(str(target), device=device, dtype="float32", max_model_len=160)
    engine = llm.engine
    engine.async_scheduling = ahead
    plan = iter([0, 0, 0, 0, 0, 0, 3, 3, 0, 0, 2, 3, 3, 3, 0] * 20)  # plain runs longer than K + 1, spec runs
    engine.policy.choose = lambda batch: next(plan)
    ps = [p["prompt_token_ids"] for p in prompts(3, seed=21)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (40, 27, 33)]
    expected = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in ps], params,
                                                              use_tqdm=False)]
    add_device_oracle(llm, {tuple(p): e for p, e in zip(ps, expected)})  # accepted runs of every length
    reqs = [engine.add_request(str(i), None, p, q)[0] for i, (p, q) in enumerate(zip(ps, params))]
    checks = 0
    while engine.has_unfinished():
        engine.step()
        if engine.num_steps % 4 == 0:  # while they run: a finished request's pages go back to the pool
            decoding = [r for r in engine.running if r.num_cached >= r.prefill_len]
            assert_draft_cache_is_one_append(engine, decoding, device, behind=5)
            checks += len(decoding)
    assert [r.output_ids for r in reqs] == expected and checks >= 10
    # (on the GPU the graphed draft steps launched from device results draft for real: mostly rejected)
    assert llm.get_stats()["mean_acceptance_length"] > (1.8 if device == "cpu" or not ahead else 1.0)


@pytest.mark.parametrize("method, fixture", [("dflash", "dflash"), ("dspark", "dspark_vanilla")])
@pytest.mark.parametrize("ahead", [False, True], ids=["synchronous", "launched-ahead"])
def test_preempted_requests_recompute_their_context_and_stay_exact(target, plain, method, fixture, ahead):
    """With KV pages for about one request of max_model_len, four requests that grow long run short
    of pages: the newest are preempted (their pages freed, in-flight rows dropped) and come back
    through a prefill of their prompt and output so far. Outputs equal plain decoding, greedy and
    seeded-sampled (drafts matched by sampling); a resumed request's draft cache holds one append of
    its whole sequence; requests are preempted and resumed more than once."""
    llm = spec_llm(target, method, fixture, engine={"num_kv_pages": 13, "kv_page_size": 16}, num_speculative_tokens=3)
    engine = llm.engine
    engine.async_scheduling = ahead
    plan = iter([0, 0, 0, 0, 0, 3, 3, 0, 2, 3, 3, 3, 0] * 40)  # plain and speculative steps
    engine.policy.choose = lambda batch: next(plan)
    ps = [p["prompt_token_ids"] for p in prompts(4, seed=22)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (110, 90, 100)]
    params.append(SamplingParams(temperature=0.8, seed=5, max_tokens=95, ignore_eos=True))
    expected = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in ps], params,
                                                              use_tqdm=False)]
    add_device_oracle(llm, {tuple(p): e for p, e in zip(ps, expected)})
    reqs = [engine.add_request(str(i), None, p, q)[0] for i, (p, q) in enumerate(zip(ps, params))]
    checked = set()
    while engine.has_unfinished():
        engine.step()
        resumed = [r for r in engine.running if r.num_preemptions and r.num_cached >= r.prefill_len
                   and r.request_id not in checked]
        assert_draft_cache_is_one_append(engine, resumed, "cpu", behind=5)
        checked |= {r.request_id for r in resumed}
    assert [r.output_ids for r in reqs] == expected
    assert engine.metrics()["num_preemptions"] == sum(r.num_preemptions for r in reqs) > 2 and len(checked) >= 2
    assert llm.get_stats()["mean_acceptance_length"] > 1.8  # the drafts of resumed requests are accepted too


def test_plain_steps_of_requests_that_joined_apart_append_their_held_rows_together(target, plain):
    """Requests that joined at different steps fill their held rows in turn; when one fills, all
    append together, so a run of plain steps launches one append every K + 1 steps, not one a step
    (a drafter launch per plain step is host work a small model's step shows in full), and the
    draft cache still holds exactly the context."""
    llm = spec_llm(target, "dflash", "dflash", adaptive_draft_length=True, num_speculative_tokens=3)
    engine = llm.engine
    engine.policy.choose = lambda batch: 0
    launches: list[list[int]] = []
    append = engine.proposer.graphs.append

    def watch(slots, starts, counts):
        launches.append(list(counts))
        return append(slots, starts, counts)

    engine.proposer.graphs.append = watch
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    reqs = []
    for i, p in enumerate(prompts(4, seed=17)):  # joins one step apart: held rows out of phase
        reqs += engine.add_request(str(i), None, p["prompt_token_ids"], params)
        engine.step()
    launches.clear()
    for _ in range(24):
        engine.step()
    assert len(launches) <= 24 // 4 + 1, launches  # K + 1 = 4 rows a launch; out of phase it was 24
    assert all(len(c) == 4 and max(c) == 4 for c in launches), launches  # all four, one of them full
    assert_draft_cache_is_one_append(engine, reqs, "cpu", behind=4)
    while engine.has_unfinished():
        engine.step()
    want = plain.generate(prompts(4, seed=17), params, use_tqdm=False)
    assert [r.output_ids for r in reqs] == [o.outputs[0].token_ids for o in want]


def test_an_eager_append_computes_only_the_rows_its_requests_hold(target, plain):
    """Without graphs (the CPU) an append computes each slot's first max(counts) held rows, not the held
    buffer's whole width (K + 2 rows, a graph's); its requests' output stays plain decoding's."""
    llm = spec_llm(target, "dspark", "dspark_vanilla", num_speculative_tokens=3)
    drafter, width = llm.engine.proposer.drafter, llm.engine.proposer.context.pending.shape[1]
    appended: list[tuple[int, int]] = []
    append = drafter.append_context_tensors

    def watch(cache, slots, starts, counts, features, max_pos):
        appended.append((features.shape[1], int(counts.max())))
        return append(cache, slots, starts, counts, features, max_pos)

    drafter.append_context_tensors = watch
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    got = llm.generate(prompts(2, seed=5), params, use_tqdm=False)
    decode = [rows for rows, held in appended if held < width]  # prefill chunks hand over their own rows
    assert decode and all(rows == held for rows, held in appended), appended
    want = plain.generate(prompts(2, seed=5), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_draft_context_is_never_more_than_a_draft_step_behind(target, plain):
    """Prefill chunks hand their features to the drafter at once; plain steps hold theirs until they
    fill one draft step's append (K + 1 rows). So when the policy switches to speculation the graphed
    draft step absorbs the backlog: no eager catch-up (several plain steps' worth at a large batch),
    and no features piling up over a long stretch of plain steps. Output stays plain's."""
    llm = spec_llm(target, "dflash", "dflash", adaptive_draft_length=True, num_speculative_tokens=3)
    engine = llm.engine
    plan = iter([0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 3] + [0, 0, 0, 0, 0, 3] * 100)
    engine.policy.choose = lambda batch: next(plan)
    pending_at_draft: list[int] = []
    propose = engine.proposer.propose

    def watch(reqs, budgets, last_tokens=None, draft_params=None):
        pending_at_draft.extend(r.num_pending for r in reqs)
        return propose(reqs, budgets, last_tokens, draft_params)

    engine.proposer.propose = watch
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    (req,) = engine.add_request("r", None, prompts(1, seed=3)[0]["prompt_token_ids"], params)
    engine.step()  # prefill: its features are in the draft cache at once
    assert req.num_draft_ctx == req.num_cached == len(req.prompt_token_ids) and req.num_pending == 0
    behind = []
    while engine.has_unfinished():
        engine.step()
        behind.append(req.num_cached - req.num_draft_ctx)
        assert behind[-1] == req.num_pending
    # behind by at most K + 1 = 4 rows (a verify's accepted rows); plain steps hold at most K = 3 and
    # then flush (without the flush the 9 plain steps would leave it 9 behind)
    assert max(behind) <= 4 and max(behind[:9]) == 3 and min(behind[:9]) == 0, behind
    assert pending_at_draft and max(pending_at_draft) <= 4, pending_at_draft
    assert not engine.proposer.graphs.use_graphs or engine.proposer.graphs.graphs  # (GPU) drafts took the graph
    ps = [prompts(1, seed=3)[0]]
    assert req.output_ids == plain.generate(ps, params, use_tqdm=False)[0].outputs[0].token_ids


def test_policy_prices_steps_by_wall_time_with_host_work(target):
    """What a step costs the policy includes the host's work after the device is done (committing,
    detokenising, stop checks): with a tiny model that work dominates, and pricing only the device
    time would make speculation look cheaper than it is."""
    llm = spec_llm(target, "dflash", "dflash", adaptive_draft_length=True)
    engine = llm.engine
    plan = iter([0, 0, 2, 2, 2, 0] * 20)
    engine.policy.choose = lambda batch: next(plan)
    delay = 0.02  # several times a step of this model, so the check cannot pass without it
    commit = engine.output.commit

    def slow_commit(req, tokens, lps):
        clock.sleep(delay * len(tokens))  # a slow detokeniser: host work per emitted token
        return commit(req, tokens, lps)

    engine.output.commit = slow_commit
    seen: list[tuple[int, float, int]] = []
    observe = engine.policy.observe_time
    before = [0]

    def watch(batch, k, seconds, refill=False):
        seen.append((k, seconds, engine.num_generated - before[0]))
        observe(batch, k, seconds, refill)

    engine.policy.observe_time = watch
    engine.add_request("r", None, prompts(1, seed=4)[0]["prompt_token_ids"],
                       SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    while engine.has_unfinished():
        before[0] = engine.num_generated
        engine.step()
    assert {k for k, _, _ in seen} == {0, 2}
    for k, seconds, tokens in seen:  # every emitted token's host work is inside its step's price
        assert seconds >= delay * tokens, (k, seconds, tokens)


def policy_choices(target: Path, plain: LLM, monkeypatch, spec_delay: float, gap: float) -> list[int]:
    """The draft lengths an adaptive engine chose, step by step, for one request of 60 sampled tokens whose
    drafts are its own continuation (10 % corrupted; sample-and-match accepts the rest): on the counter
    clock, every speculative launch takes `spec_delay`, and the caller works `gap` between steps (a server
    streaming what each step emitted); the model's own compute takes no time."""
    p = prompts(1, seed=9)[0]
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=60, ignore_eos=True)
    expected = {tuple(p["prompt_token_ids"]): run(plain, [p], params)[0]}
    llm = spec_llm(target, "dflash", "dflash", adaptive_draft_length=True, num_speculative_tokens=3)
    add_oracle(llm, expected, corrupt=0.1, seed=3)
    engine = llm.engine
    engine.async_scheduling = True
    now = counter_clock(monkeypatch)

    def slow(*args, real=engine._launch_spec, **kw):
        now[0] += spec_delay
        return real(*args, **kw)

    engine._launch_spec = slow
    chosen = []
    choose = engine.policy.choose
    engine.policy.choose = lambda batch: chosen.append(choose(batch)) or chosen[-1]
    engine.add_request("r", None, p["prompt_token_ids"], params)
    while engine.has_unfinished():
        engine.step()
        now[0] += gap
    return chosen


def test_where_plain_steps_are_faster_as_they_run_the_policy_takes_them(target, plain, monkeypatch):
    """A plain step here costs the caller's gap (30 ms), a speculative one that and its 300 ms launch for
    about 3.4 tokens: plain decoding is about three times faster, and the engine takes the plain path once
    it has measured both. Where a launch costs 5 ms (the control), speculation is about three times faster
    and the engine drafts. (How a plain re-try between speculative steps is priced:
    `test_pipelined_steps_are_priced_one_step_each_across_switches`.)"""
    slow = policy_choices(target, plain, monkeypatch, spec_delay=0.3, gap=0.03)
    settled = slow[len(slow) // 3:]
    assert settled.count(0) >= 0.8 * len(settled), slow
    fast = policy_choices(target, plain, monkeypatch, spec_delay=0.005, gap=0.03)
    assert fast[len(fast) // 3:].count(0) <= 0.2 * len(fast[len(fast) // 3:]), fast


def test_policy_prices_a_step_from_the_end_of_the_one_before(target, monkeypatch):
    """A server works between steps (it streams what each step emitted); a pipelined plain step's
    commit-to-commit price holds that work, so a step the host runs start to finish is priced from
    the previous step's end too. Priced from its own launch, a speculative step at T > 0 looked
    cheaper than it was beside pipelined plain steps, and a busy server drafted where it lost."""
    llm = spec_llm(target, "dflash", "dflash", adaptive_draft_length=True)
    engine = llm.engine
    plan = iter([0, 0, 2, 2, 2, 0] * 20)
    engine.policy.choose = lambda batch: next(plan)
    seen: list[tuple[int, float]] = []
    observe = engine.policy.observe_time
    engine.policy.observe_time = lambda batch, k, seconds, refill=False: (seen.append((k, seconds)),
                                                                          observe(batch, k, seconds, refill))
    now, gap = counter_clock(monkeypatch), 0.125  # the caller's work between steps; the steps take no time
    engine.add_request("r", None, prompts(1, seed=4)[0]["prompt_token_ids"],
                       SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True))
    engine.step()  # prefill: no step before it to price from
    while engine.has_unfinished():
        now[0] += gap
        engine.step()
    assert {k for k, _ in seen} == {0, 2}
    # the first decode step follows the prefill, whose end prices nothing; every later one holds the gap
    assert seen[0][1] == 0 and all(seconds == gap for _, seconds in seen[1:]), seen


@pytest.mark.parametrize("open_launch", ["draft", "step"])
def test_the_time_split_holds_steps_not_the_idle_time_between_requests(target, open_launch):
    """Requests aborted after a step that launched their next draft (sampling that reads the committed
    history: a presence penalty), or their whole next step (sample-and-match keyed by position), leave
    the engine idle with that launch open; it is dropped, so its timer marks do not span the idle time
    until the next request's first step (they did: seconds of "draft" a bench pass on the GPU, more than
    the pass took). The split's growth over the next generate() call lies within that call's wall time."""
    llm = spec_llm(target, "dflash", "dflash", num_speculative_tokens=3)
    engine = llm.engine
    engine.async_scheduling = True
    engine.policy.choose = lambda batch: 3
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=40, ignore_eos=True,
                            presence_penalty=0.5 if open_launch == "draft" else 0.0)
    for i, p in enumerate(prompts(2, seed=5)):
        engine.add_request(f"r{i}", None, p["prompt_token_ids"], params)
    opened = (lambda: engine.proposer.ahead is not None) if open_launch == "draft" else \
        (lambda: engine.pipeline.inflight is not None)
    for _ in range(20):  # decode until a step has launched the next one's draft, or the next step
        engine.step()
        if opened():
            break
    assert opened()
    for i in range(2):
        engine.abort(f"r{i}")
    assert not engine.has_unfinished() and engine.proposer.ahead is None and engine.pipeline.inflight is None
    before = sum(engine.timer.totals.values())
    clock.sleep(1.0)  # idle: longer than the next call takes here
    t0 = clock.perf_counter()
    llm.generate(prompts(1, seed=6), params, use_tqdm=False)
    busy = clock.perf_counter() - t0
    assert 0 < sum(engine.timer.totals.values()) - before <= busy


@pytest.mark.parametrize("method, fixture", [("dflash", "dflash"), ("dspark", "dspark_vanilla")])
def test_pipelined_plain_steps_between_speculative_ones_keep_output_exact(target, plain, method, fixture):
    """Plain steps launched ahead of their predecessor's commit (asynchronous scheduling, on by
    default on CUDA), switching with speculative steps as the policy alternates: output equals plain
    decoding, and every draft step still finds at most K + 1 rows to append."""
    llm = spec_llm(target, method, fixture, adaptive_draft_length=True, num_speculative_tokens=3)
    engine = llm.engine
    engine.async_scheduling = True
    plan = iter([0, 0, 0, 0, 0, 2, 0, 0, 3, 3] * 100)
    engine.policy.choose = lambda batch: next(plan)
    pending_at_draft: list[int] = []
    propose = engine.proposer.propose

    def watch(reqs, budgets, last_tokens=None, draft_params=None):
        assert engine.pipeline.inflight is None  # a speculative step starts from committed state
        pending_at_draft.extend(r.num_pending for r in reqs)
        return propose(reqs, budgets, last_tokens, draft_params)

    engine.proposer.propose = watch
    ps = prompts(3, seed=11)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (30, 9, 23)]
    got = [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]
    assert got == [o.outputs[0].token_ids for o in plain.generate(ps, params, use_tqdm=False)]
    assert pending_at_draft and max(pending_at_draft) <= 4
    assert llm.get_stats()["num_drafts"] > 0


def run_launching_ahead(target, method, fixture, ps, params, ahead: bool) -> tuple[list[list[int]], dict]:
    """Outputs and metrics of a fixed-K speculative run, launching ahead or not."""
    llm = spec_llm(target, method, fixture, num_speculative_tokens=3)
    llm.engine.async_scheduling = ahead
    llm.engine.policy.choose = lambda batch: 3
    return [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)], llm.get_stats()


@pytest.mark.parametrize("method, fixture", [("dflash", "dflash"), ("dspark", "dspark_vanilla")])
def test_steps_launched_ahead_of_the_commit_are_the_synchronous_steps(target, plain, method, fixture):
    """With asynchronous scheduling a greedy speculative step launches the next step whole (draft,
    verify, acceptance) before it commits its own tokens. Requests of different lengths finish at
    different steps, so launches carry rows of requests that stopped meanwhile. Each step must
    draft and accept exactly what a synchronous step does: the same acceptance at every position,
    output equal to plain decoding, and the launches must really run."""
    ps = prompts(4, seed=12)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (31, 7, 18, 26)]
    sync_out, sync = run_launching_ahead(target, method, fixture, ps, params, ahead=False)
    out, launched = run_launching_ahead(target, method, fixture, ps, params, ahead=True)
    assert out == sync_out == [o.outputs[0].token_ids for o in plain.generate(ps, params, use_tqdm=False)]
    assert launched["num_accepted_tokens_per_pos"] == sync["num_accepted_tokens_per_pos"]
    assert launched["num_drafts"] == sync["num_drafts"] and launched["num_steps"] == sync["num_steps"]
    assert sync["num_spec_steps_launched_ahead"] == 0
    # every decode step but the first was launched ahead (one step prefilled all four prompts), each
    # with the draft launched first for it, and one more after the last request's last step (dropped)
    assert launched["num_spec_steps_launched_ahead"] == launched["num_steps"] - 1 > 5
    assert launched["num_drafts_launched_ahead_taken"] == launched["num_spec_steps_launched_ahead"]


def run_sampled_with_oracle(target, method, fixture, ps, params, expected, ahead: bool,
                            device: str = "cpu") -> tuple[list[list[int]], dict]:
    """Outputs and metrics of a fixed-K speculative run whose drafts are the plain continuation, wrong at
    fixed output positions (`add_device_oracle`), launching ahead or not."""
    llm = spec_llm(target, method, fixture, device, num_speculative_tokens=3)
    llm.engine.async_scheduling = ahead
    llm.engine.policy.choose = lambda batch: 3
    add_device_oracle(llm, {tuple(p["prompt_token_ids"]): e for p, e in zip(ps, expected)})
    return run(llm, ps, params), llm.get_stats()


@pytest.mark.parametrize("method, fixture", [("dflash", "dflash"), ("dspark", "dspark_vanilla")])
@pytest.mark.parametrize("history", [False, True], ids=["keyed", "penalised"])
@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_sampled_steps_launched_ahead_of_the_commit_are_the_synchronous_steps(target, plain, method, fixture,
                                                                              history, device):
    """Sample-and-match draws each verify row's token from its logits and its (seed, position) alone, so at
    T > 0 a step is launched whole (draft, verify, acceptance) before the one before it commits, as a greedy
    step is: seeded outputs equal plain sampling's and the synchronous run's, with the same acceptance at
    every position, and every decode step after the first is launched ahead. A request whose sampling
    reads the committed history (a presence penalty on the longest here) keeps its batch's verification
    on the host: then only the next draft is launched ahead, and the next step takes every such launch."""
    ps = prompts(4, seed=13)
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=n, ignore_eos=True,
                             presence_penalty=0.5 if history and i == 0 else 0.0)
              for i, n in enumerate((31, 7, 18, 26))]
    if device != "cpu":  # the GPU's own plain sampling: its float32 logits round apart from the CPU's
        plain = LLM(str(target), device=device, dtype="float32", max_model_len=160)
    expected = run(plain, ps, params)
    sync_out, sync = run_sampled_with_oracle(target, method, fixture, ps, params, expected, False, device)
    out, launched = run_sampled_with_oracle(target, method, fixture, ps, params, expected, True, device)
    assert out == sync_out == expected
    assert launched["num_accepted_tokens_per_pos"] == sync["num_accepted_tokens_per_pos"]
    assert launched["num_drafts"] == sync["num_drafts"] and launched["mean_acceptance_length"] > 2.0
    assert sync["num_spec_steps_launched_ahead"] == sync["num_drafts_launched_ahead"] == 0
    if history:
        assert launched["num_spec_steps_launched_ahead"] == 0
        assert launched["num_drafts_launched_ahead_taken"] == launched["num_drafts_launched_ahead"] > 5
    else:
        # every decode step but the first was launched ahead (one step prefilled all four prompts; no chained
        # launch follows the last, which ends every request)
        assert launched["num_spec_steps_launched_ahead"] == launched["num_steps"] - 2 > 5
        assert launched["num_drafts_launched_ahead_taken"] == launched["num_spec_steps_launched_ahead"]


def oracle_tokens(want: list[int], n: int, width: int) -> list[int]:
    """The plain continuation from output index n, wrong at fixed output positions (the same drafts
    whichever path asks, so two runs accept alike), and 3 past its end."""
    truth = [want[i] if i < len(want) else 3 for i in range(n, n + width)]
    return [(t % 90) + 3 if (n + i) % 5 == 4 or (n + i) % 7 == 2 else t for i, t in enumerate(truth)]


def add_device_oracle(llm: LLM, expected: dict[tuple, list[int]]) -> dict[tuple, list[int]]:
    """Oracle drafts on both draft paths: `propose` (host state) and the draft step's tensor code,
    which a step launched from device results runs; there the request is found by its slot and its
    output length by where its block starts (read on the host, so not inside a CUDA graph).
    Returns the drafter's own drafts by (prompt, output index), filled as the run goes: they
    depend on the draft context, which the oracle's tokens would hide."""
    engine, proposer = llm.engine, llm.engine.proposer
    real_propose, real_step, real_eager = proposer.propose, proposer.graphs.step, proposer._eager_draft
    drafted: dict[tuple, list[int]] = {}

    def propose(reqs, budgets, last_tokens=None, draft_params=None):
        block = real_propose(reqs, budgets, last_tokens, draft_params)
        for r, req in enumerate(reqs):
            n = req.num_cached + 1 - len(req.prompt_token_ids)  # the block starts at the cache count
            block.tokens[r, : block.lens[r]] = torch.tensor(
                oracle_tokens(expected[tuple(req.prompt_token_ids)], n, block.lens[r]), dtype=torch.int64)
        return block

    def eager(reqs, anchors, draft_params, k=None):
        tokens, q, confidence = real_eager(reqs, anchors, draft_params, k)
        for r, req in enumerate(reqs):
            drafted[(tuple(req.prompt_token_ids), req.num_cached + 1 - len(req.prompt_token_ids))] = tokens[r].tolist()
        return tokens, q, confidence

    def step(slots, starts, counts, anchors, kv, width, rows=None):
        tokens, confidence = real_step(slots, starts, counts, anchors, kv, width, rows)
        by_slot = {r.slot: r for r in engine.running}
        tokens = tokens.clone()
        for r, (slot, start, count) in enumerate(zip(slots.tolist(), starts.tolist(), counts.tolist())):
            req = by_slot[slot]
            n = start + count + 1 - len(req.prompt_token_ids)
            drafted[(tuple(req.prompt_token_ids), n)] = tokens[r].tolist()
            tokens[r] = torch.tensor(oracle_tokens(expected[tuple(req.prompt_token_ids)], n, tokens.shape[1]))
        return tokens, confidence

    proposer.propose, proposer._eager_draft = propose, eager
    if not proposer.graphs.use_graphs:  # a captured step cannot read its inputs on the host
        proposer.graphs.step = step
    return drafted


def oracle_run(target, method, fixture, ps, params, table, chained, arrivals=None, lengths=(3,)):
    """Outputs, stats and the drafter's drafts of a speculative engine drafting up to 3 tokens a step with
    oracle drafts, steps launched from device results (`chained`) or waiting for the read-back. `arrivals`:
    the engine step before which each request is added (default: all at once); `lengths`: the draft
    lengths its steps take, in turn."""
    llm = spec_llm(target, method, fixture, num_speculative_tokens=3)
    engine = llm.engine
    engine.async_scheduling = chained
    turn = itertools.cycle(lengths)
    engine.policy.choose = lambda batch: next(turn)
    drafted = add_device_oracle(llm, table)
    host_drafts = []  # drafts launched on the reference path (after a read-back, or a batch's first step)
    for name in ("propose", "launch_next"):
        method_ = getattr(engine.proposer, name)
        setattr(engine.proposer, name, lambda *a, _m=method_, _n=name, **kw: host_drafts.append(_n) or _m(*a, **kw))
    arrivals = arrivals or {0: list(range(len(ps)))}
    reqs, step = {}, 0
    while step <= max(arrivals) or engine.has_unfinished():
        for i in arrivals.get(step, []):
            reqs[i] = engine.add_request(str(i), None, ps[i]["prompt_token_ids"], params[i])[0]
        engine.step()
        step += 1
    return [reqs[i].output_ids for i in range(len(ps))], {**engine.metrics(), "host_drafts": len(host_drafts)}, drafted


def assert_steps_alike(sync_run, chain_run, expected):
    """A chained run's outputs are plain decoding's, and its drafter drafted and the target accepted at
    every position what the synchronous run's did (a draft launched ahead for a request that then
    stopped is extra; near a request's token limit one path may take fewer drafts through the heads:
    their common ones count)."""
    (sync_out, sync, sync_drafts), (out, chain, chain_drafts) = sync_run, chain_run
    assert out == sync_out == expected
    assert all(key in chain_drafts for key in sync_drafts) and len(sync_drafts) > 10
    common = {key: min(len(d), len(chain_drafts[key])) for key, d in sync_drafts.items()}
    assert {key: chain_drafts[key][: common[key]] for key in sync_drafts} == \
        {key: d[: common[key]] for key, d in sync_drafts.items()}
    assert chain["num_accepted_tokens_per_pos"] == sync["num_accepted_tokens_per_pos"]
    assert chain["num_drafts"] == sync["num_drafts"] and chain["num_steps"] == sync["num_steps"]
    assert sync["mean_acceptance_length"] > 1.8  # the oracle's drafts really are accepted, at varying lengths


def oracle_case(plain, seed, max_tokens):
    """Prompts, greedy parameters of these token limits, plain decoding's outputs and their table."""
    ps = prompts(len(max_tokens), seed=seed)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    expected = [o.outputs[0].token_ids for o in plain.generate(ps, params, use_tqdm=False)]
    return ps, params, expected, {tuple(p["prompt_token_ids"]): e for p, e in zip(ps, expected)}


@pytest.mark.parametrize("method, fixture", [("dflash", "dflash"), ("dspark", "dspark_vanilla")])
def test_steps_launched_from_device_results_are_the_synchronous_steps(target, plain, method, fixture):
    """A greedy step launched from the last step's accepted counts and tokens on the device, before
    the host reads them: its draft context, anchor, positions and draft lengths are all derived on
    the device. With oracle drafts (accepted lengths vary from 0 to K), the outputs equal plain
    decoding, the drafter drafts and the target accepts at every position what they do in the
    synchronous run, and every step after the first is launched that way, the four requests ending
    at their token limits at different steps."""
    ps, params, expected, table = oracle_case(plain, 15, (37, 9, 22, 30))
    sync_run, chain_run = (oracle_run(target, method, fixture, ps, params, table, c) for c in (False, True))
    assert_steps_alike(sync_run, chain_run, expected)
    sync, chain = sync_run[1], chain_run[1]
    # every step launched ahead is launched from device results, through the requests' token limits too
    # (the device caps each one's drafts; rows of a request that ended are dropped)
    assert chain["num_spec_steps_chained"] == chain["num_spec_steps_launched_ahead"] > 3
    assert chain["chained_s"] > 0 and sync["chained_s"] == 0  # one interval of the time split a chained step
    # the batch's first step too: its requests join a chained step from their committed state
    assert chain["host_drafts"] == 0 and sync["host_drafts"] > 3
    assert chain["num_spec_steps_from_committed"] == 1 and sync["num_spec_steps_from_committed"] == 0


@pytest.mark.parametrize("method, fixture", [("dflash", "dflash"), ("dspark", "dspark_vanilla")])
def test_steps_of_changing_draft_lengths_launched_from_device_results_are_the_synchronous_steps(
        target, plain, method, fixture):
    """Draft lengths that change from step to step (up, down, the same): a chained step's drafter puts
    k + 1 context rows a request through its products after a step of no more drafts, all K + 1 after
    a longer one (`StepGraphs.context_rows`). Its drafts and acceptance are the synchronous run's."""
    ps, params, expected, table = oracle_case(plain, 17, (41, 15, 28, 33))
    lengths = (3, 1, 1, 2, 3, 2, 2, 1, 3, 3)
    sync_run, chain_run = (oracle_run(target, method, fixture, ps, params, table, c, lengths=lengths)
                           for c in (False, True))
    assert_steps_alike(sync_run, chain_run, expected)
    assert chain_run[1]["num_spec_steps_chained"] == chain_run[1]["num_spec_steps_launched_ahead"] > 10


@pytest.mark.parametrize("method, fixture", [("dflash", "dflash"), ("dspark", "dspark_vanilla")])
def test_requests_that_arrive_join_the_chained_step(target, plain, method, fixture):
    """A request whose prefill ends while a chained step is in flight joins the next step launched from
    the device results (its block anchored at its committed first token, nothing appended to its
    draft context), so every step launched ahead is chained, arrivals included. With oracle drafts,
    outputs, the drafter's drafts and per-position acceptance equal the synchronous run's, requests
    arriving at three different steps."""
    ps, params, expected, table = oracle_case(plain, 16, (34, 25, 20, 12))
    arrivals = {0: [0, 1], 3: [2], 6: [3]}  # engine step -> requests added before it
    sync_run, chain_run = (oracle_run(target, method, fixture, ps, params, table, c, arrivals) for c in (False, True))
    assert_steps_alike(sync_run, chain_run, expected)
    chain = chain_run[1]
    assert chain["num_spec_steps_chained"] == chain["num_spec_steps_launched_ahead"] > 5
    assert chain["host_drafts"] == 0  # the first step too (`Engine._from_committed`)


def test_steps_launched_ahead_survive_stops_aborts_and_arrivals(target, plain):
    """Launched before the commit, a step carries rows of requests that the commit then stops (a stop
    token inside the accepted block), that are aborted while it is in flight, and misses requests
    that arrive meanwhile: stopped and aborted requests get nothing more, and every other output is
    what plain decoding gives alone."""
    ps = [p["prompt_token_ids"] for p in prompts(4, seed=14)]
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in ps], greedy,
                                                            use_tqdm=False)]
    stop = alone[1][9]
    stopping = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop])
    llm = spec_llm(target, "dflash", "dflash", num_speculative_tokens=3)
    engine = llm.engine
    engine.async_scheduling = True
    engine.policy.choose = lambda batch: 3
    reqs = [engine.add_request(str(i), None, p, stopping if i == 1 else greedy)[0] for i, p in enumerate(ps[:3])]
    for _ in range(3):
        engine.step()
    assert isinstance(engine.pipeline.inflight, SpecLaunch)
    engine.abort("2")
    aborted_at = len(reqs[2].output_ids)
    reqs.append(engine.add_request("3", None, ps[3], greedy)[0])
    while engine.has_unfinished():
        engine.step()
    assert reqs[0].output_ids == alone[0] and reqs[3].output_ids == alone[3]
    assert reqs[1].output_ids == alone[1][: alone[1].index(stop) + 1] and reqs[1].finish_reason == "stop"
    assert len(reqs[2].output_ids) == aborted_at and reqs[2].finish_reason == "abort"
    assert engine.metrics()["num_spec_steps_launched_ahead"] > 5
    # a launch whose every request stops at the commit before it is dropped, not left in flight
    last = engine.add_request("4", None, ps[0], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                               stop_token_ids=[alone[0][12]]))[0]
    while engine.has_unfinished():
        engine.step()
    assert last.finish_reason == "stop" and engine.pipeline.inflight is None


def test_a_launch_whose_requests_all_left_fails_no_other(target, plain, caplog):
    """A step launched ahead whose every request leaves before its finish (aborted here; preempted for pages
    alike) finishes with no current rows. The requests decoding by then, one verified on the host (a
    penalty), take the next step: no draft is launched for an empty batch (it raised, and retried alone the
    penalised request failed with an error)."""
    ps = [p["prompt_token_ids"] for p in prompts(3, seed=15)]
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    penalised = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, repetition_penalty=1.2)
    alone = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in ps[1:]],
                                                            [greedy, penalised], use_tqdm=False)]
    engine = spec_llm(target, "dflash", "dflash", num_speculative_tokens=3).engine
    engine.async_scheduling = True
    engine.policy.choose = lambda batch: 3
    engine.add_request("a", None, ps[0], greedy)
    while not isinstance(engine.pipeline.inflight, SpecLaunch):
        engine.step()
    joined = [engine.add_request(name, None, p, sp)[0]
              for name, p, sp in (("c", ps[1], greedy), ("b", ps[2], penalised))]
    engine.abort("a")
    with caplog.at_level(logging.ERROR, logger="blockspec"):
        while engine.has_unfinished():
            engine.step()
    assert not [r for r in caplog.records if "engine step failed" in r.getMessage()]
    assert [r.output_ids for r in joined] == alone and [r.finish_reason for r in joined] == ["length", "length"]


def test_pipelined_steps_are_priced_one_step_each_across_switches(target, monkeypatch):
    """A pipelined step costs the time from its predecessor's commit, which holds the launch of its
    successor. Three intervals are no sample: after a speculative step, the first plain commit closes
    two steps (the plain launch that committed nothing, and itself); a plain commit that launched no
    successor (the policy turns to speculation) holds no launch; and a speculative finish that launches
    no successor (the policy turns to plain) closes an interval with no launch in it, which would make
    speculation look as cheap as a plain step."""
    llm = spec_llm(target, "dflash", "dflash", adaptive_draft_length=True, num_speculative_tokens=3)
    engine = llm.engine
    engine.async_scheduling = True
    plan = iter([0, 0, 0, 3, 3, 3, 0, 3, 3] * 40)  # runs of plain steps, and lone ones
    engine.policy.choose = lambda batch: next(plan)
    # the engine's clock moves by a delay at each launch and by nothing else, so each step's price counts the
    # launches it holds
    now, delay = counter_clock(monkeypatch), 0.125  # a power of two: sums of it are exact
    for name in ("_plain_step_pipelined", "_launch_spec"):
        def slow(*args, real=getattr(engine, name), **kw):
            now[0] += delay
            return real(*args, **kw)
        setattr(engine, name, slow)
    seen: list[tuple[int, float, bool]] = []
    observe = engine.policy.observe_time
    engine.policy.observe_time = lambda batch, k, seconds, refill=False: (seen.append((k, seconds, refill)),
                                                                          observe(batch, k, seconds, refill))
    llm.generate(prompts(1, seed=5), SamplingParams(temperature=0, max_tokens=60, ignore_eos=True), use_tqdm=False)
    plain = [s for k, s, _ in seen if k == 0]
    spec = [s for k, s, _ in seen if k == 3]
    assert len(plain) >= 5 and len(spec) >= 5
    # after the first switch to speculation, per cycle of the plan: the plain run gives one sample (its
    # second commit: the first closes the switch, the last launches no successor) and the lone plain step
    # none; the speculative step after plain ones (after the run, and after the lone step) says it refills
    # the pipeline, and holds two launches (the plain commit's wait and its own), every step at least one
    first = next(i for i, (_, _, refill) in enumerate(seen) if refill)
    tail = seen[first - 1 : first - 1 + 4 * ((len(seen) - first + 1) // 4)]
    assert len(tail) >= 16 and [(k, r) for k, _, r in tail] == [(0, False), (3, True), (3, False), (3, True)] * (
        len(tail) // 4), seen
    assert all(s == delay for s in plain), plain  # one launch each
    assert all(s == 2 * delay for _, s, r in seen if r) and all(s >= delay for _, s, _ in seen), seen


def test_a_step_returns_every_request_it_emitted_for(target, plain):
    """`step()` returns the requests whose output changed (the progress bar counts the finished ones
    from it): also one that stops in the in-flight plain step a speculative step commits first.
    Stop tokens at successive positions land that stop on every kind of step."""
    ps = prompts(2, seed=6)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in plain.generate(ps, greedy, use_tqdm=False)]
    missed = []
    for at in range(2, 12):
        llm = spec_llm(target, "dflash", "dflash", adaptive_draft_length=True, num_speculative_tokens=3)
        engine = llm.engine
        engine.async_scheduling = True
        plan = iter([0, 0, 3, 0, 0, 0, 3, 3] * 20)
        engine.policy.choose = lambda batch: next(plan)
        stop = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[alone[0][at]])
        reqs = [engine.add_request(str(i), None, p["prompt_token_ids"], q)[0]
                for i, (p, q) in enumerate(zip(ps, (stop, greedy)))]
        while engine.has_unfinished():
            before = [len(r.output_ids) for r in reqs]
            returned = {id(r) for r in engine.step()}
            missed += [(at, i) for i, (r, n) in enumerate(zip(reqs, before))
                       if len(r.output_ids) != n and id(r) not in returned]
    assert not missed, missed


@pytest.mark.parametrize("method, fixture", [("dflash", "dflash"), ("dspark", "dspark_vanilla")])
def test_a_step_verifying_fewer_drafts_takes_only_those_through_the_heads(target, plain, method, fixture):
    """The policy verifying 1 or 2 of the block's drafts: the drafter runs the whole block but its
    heads only over the narrower head width that holds them (DSpark's Markov chain stops there too),
    and those drafts are the whole-width heads' first ones on the same block; outputs equal plain
    decoding."""
    ps = prompts(3, seed=21)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in plain.generate(ps, params, use_tqdm=False)]
    llm = spec_llm(target, method, fixture, adaptive_draft_length=True)
    proposer = llm.engine.proposer
    drafter, k_max = proposer.drafter, proposer.num_speculative_tokens
    plan = iter([1, 2, k_max] * 100)
    llm.engine.policy.choose = lambda batch: next(plan)
    real_slot_hidden, real_greedy, widths, block = drafter.slot_hidden, drafter.greedy_drafts, [], {}

    def slot_hidden(hidden, k=None):
        block["hidden"] = hidden
        return real_slot_hidden(hidden, k)

    def greedy_drafts(rows, anchors, top_k=0, head_argmax=None):
        tokens, confidence = real_greedy(rows, anchors, top_k, head_argmax)
        whole, whole_conf = real_greedy(real_slot_hidden(block["hidden"], k_max), anchors, top_k, head_argmax)
        width = rows.shape[1]
        assert tokens.shape[1] == width and torch.equal(tokens, whole[:, :width])
        if confidence is not None:
            assert torch.allclose(confidence, whole_conf[:, :width])
        widths.append(width)
        return tokens, confidence

    drafter.slot_hidden, drafter.greedy_drafts = slot_hidden, greedy_drafts
    out = [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]
    assert out == expected
    graphs = proposer.graphs
    assert set(widths) == set(graphs.widths) and len(graphs.widths) == 2 and graphs.width(1) < k_max


def test_draft_head_widths_are_the_block_and_the_policys_longest_draft_length_below_it():
    """Two head widths, both captured at start (a width captured mid-run would stall its step): K = 15
    gives 7 and 15 (7: the policy's longest default draft length below 15; with draft lengths given, the
    longest of them below K), and a step verifying up to 7 drafts takes the 7-wide heads, one of 8 the whole."""
    from blockspec.speculative.draft_graph import DraftGraphs

    for k, widths in ((1, [1]), (2, [1, 2]), (3, [1, 3]), (7, [5, 7]), (8, [7, 8]), (15, [7, 15]), (16, [15, 16])):
        assert DraftGraphs(None, None, None, None, k, use_graphs=False).widths == widths
    graphs = DraftGraphs(None, None, None, None, 15, use_graphs=False)
    assert [graphs.width(k) for k in (0, 1, 7, 8, 15, 20)] == [7, 7, 7, 15, 15, 15]
    # the policy's lengths where they are given (speculative_config.draft_length_candidates)
    assert DraftGraphs(None, None, None, None, 15, use_graphs=False, lengths=(4, 8)).widths == [8, 15]
    assert DraftGraphs(None, None, None, None, 15, use_graphs=False, lengths=(15,)).widths == [15]


def test_a_draft_launched_narrower_than_its_step_verifies_is_drafted_again(target):
    """A draft launched ahead for a step that was to take the plain path goes through the narrowest heads;
    if a step verifying more drafts takes its place (the batch changed before it ran), `propose` drafts
    again rather than cut the narrow one: the drafts equal those of a step with nothing launched ahead."""
    def drafts(launch: bool, k: int | None = None) -> list[list[int]]:
        llm = spec_llm(target, "dflash", "dflash", engine={"async_scheduling": False})
        engine, ps = llm.engine, prompts(8, seed=1)
        reqs = [engine.add_request(str(i), None, p["prompt_token_ids"],
                                   SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
                for i, p in enumerate(ps)]
        for _ in range(4):
            engine.step()
        proposer, last = engine.proposer, [r.output_ids[-1] for r in reqs]
        if launch:
            assert proposer.launch_next(reqs, last, k)
        return proposer.propose(reqs, [3] * len(reqs)).tokens.tolist()

    fresh = drafts(launch=False)
    assert any(len(set(row)) > 1 for row in fresh)  # drafts that a first draft repeated would not give
    assert drafts(launch=True, k=0) == fresh == drafts(launch=True)


def test_a_draft_launched_ahead_takes_the_heads_of_the_k_chosen_for_its_step(target, plain, monkeypatch):
    """Where steps are not chained, the next step's draft is launched before the host commits this one's
    tokens; when every request is greedy and speculates, that step's K is chosen first and its draft goes
    through that K's heads (DFlash, 3 drafts: one draft the 1-wide heads, 3 the 3-wide), a draft for a step
    that then takes the plain path (and is dropped) through the narrowest. Outputs equal plain decoding."""
    from blockspec.speculative.proposer import Proposer

    monkeypatch.setattr(Proposer, "chains", property(lambda self: False))
    llm = spec_llm(target, "dflash", "dflash", adaptive_draft_length=True, engine={"async_scheduling": True})
    engine = llm.engine
    ks = iter([1, 3, 0] * 100)
    engine.policy.choose = lambda batch: next(ks)
    launch, widths = engine.proposer.launch_next, []

    def recording(reqs, anchors, k=None):
        launched = launch(reqs, anchors, k)
        widths.append((k, engine.proposer.ahead.tokens.shape[1]))
        return launched

    engine.proposer.launch_next = recording
    ps, params = prompts(3), SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    out = llm.generate(ps, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in
                                                     plain.generate(ps, params, use_tqdm=False)]
    assert {k for k, _ in widths} >= {0, 3}, widths
    assert all(w == {0: 1, 1: 1, 3: 3, None: 3}[k] for k, w in widths), widths


@pytest.mark.parametrize("method, fixture", [("dflash", "dflash"), ("dspark", "dspark_vanilla")])
def test_a_request_preempted_with_a_step_in_flight_and_admitted_again_drops_that_steps_rows(target, plain, method,
                                                                                             fixture):
    """A request preempted while a step launched ahead carries its rows, and admitted again before that step
    is read (the step's other requests were all prefilling, so nothing read it): its rows are of the old stay,
    whose pages are gone. They were committed into the new stay (K/V counted that was never written there,
    tokens appended to a request still prefilling) and the output left plain decoding's; now they are
    dropped, for a plain and for a speculative launch."""
    ps = [p["prompt_token_ids"] for p in prompts(2, seed=31)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in ps], params,
                                                              use_tqdm=False)]
    for k in (0, 3):
        llm = spec_llm(target, method, fixture, num_speculative_tokens=3)
        engine = llm.engine
        engine.async_scheduling = True
        engine.policy.choose = lambda batch, _k=k: _k
        add_device_oracle(llm, {tuple(p): e for p, e in zip(ps, expected)})
        reqs = [engine.add_request(str(i), None, p, params)[0] for i, p in enumerate(ps)]
        while not (engine.pipeline.inflight is not None and all(r.output_ids for r in reqs)):
            engine.step()
        stale = engine.pipeline.inflight
        for req in reversed(reqs):  # both out: the next step re-prefills them and reads no launch
            engine.scheduler.preempt(req)
        cache = engine.runner.cache  # pages no request holds: whatever another request would write there
        cache.k_layers.normal_(generator=torch.Generator().manual_seed(k))
        cache.v_layers.normal_(generator=torch.Generator().manual_seed(k + 1))
        engine.step()
        # a speculative launch waits for a decode to read it; a plain one is committed by the prefill step
        assert engine.pipeline.inflight is (stale if k else None)
        assert isinstance(stale, SpecLaunch) == bool(k)
        while engine.has_unfinished():
            engine.step()
        assert [r.output_ids for r in reqs] == expected, k


def test_speculative_options_a_drafter_cannot_use_and_plain_steps_over_the_batch_limit(tmp_path):
    """markov_top_k on a drafter without a Markov head is refused (it was ignored); a DFlash checkpoint given
    as DSpark names the method it is; a batch over max_batch_for_speculation decodes plain, exactly, and its
    steps count as policy_steps' 0 (no step was counted at all)."""
    from blockspec.errors import ModelLoadError

    target = save_drafter_target(tmp_path / "t")
    with pytest.raises(ConfigError, match="markov_top_k restricts a DSpark drafter's Markov head; DFlashDraft has"):
        spec_llm(target, "dflash", "dflash", markov_top_k=5)
    with pytest.raises(ModelLoadError, match="a DFlash checkpoint: speculative_config method 'dflash'"):
        spec_llm(target, "dspark", "dflash")
    for fixture, drafter in (("dspark_vanilla", "DSparkDraft"), ("dflash", "DFlashDraft")):  # no method: the config's
        llm = LLM(str(target), device="cpu", dtype="float32", max_model_len=160,
                  speculative_config={"model": str(FIXTURES / fixture)})
        assert type(llm.engine.proposer.drafter).__name__ == drafter
    llm = spec_llm(target, "dflash", "dflash", max_batch_for_speculation=1)
    ps = prompts(3)
    plain_llm = LLM(str(target), device="cpu", dtype="float32", max_model_len=160)
    assert run(llm, ps, GREEDY) == run(plain_llm, ps, GREEDY)
    stats = llm.get_stats()
    assert stats["policy_steps"].get(0, 0) > 0 and stats["num_drafts"] == sum(
        n for k, n in stats["policy_steps"].items() if k)


@pytest.fixture(scope="module")
def text_target(tmp_path_factory) -> Path:
    return save_drafter_target(tmp_path_factory.mktemp("text_target"), tokenizer=True)


@pytest.mark.parametrize("method,fixture", [("dflash", "dflash"), ("dspark", "dspark_vanilla")])
@pytest.mark.parametrize("logprobs", [None, 1])
def test_a_stop_before_a_row_without_tokens_stops_as_plain_decoding(text_target, method, fixture, logprobs):
    """A request whose own masks leave no token after its stop token (allowed_token_ids {a, b}, b stops it, bad
    words ban both after b): plain decoding stops at b and never reads that row. A verify step that accepts the
    drafted b reads it as its next token's row: the request still stops at b, with plain decoding's tokens (the
    accepted drafts are committed before the bad row fails anything), not an error with its drafts dropped."""
    plain = LLM(str(text_target), device="cpu", max_model_len=160)
    a, b = plain.get_tokenizer().encode("ab")
    ps = [{"prompt_token_ids": [10 + (i * 7 + j) % 80 for i in range(22 + j)]} for j in range(3)]
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=20, allowed_token_ids=[a, b], stop_token_ids=[b],
                            bad_words=["ba", "bb"], logprobs=logprobs)
    want = plain.generate(ps, params, use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "stop" and len(o.outputs[0].token_ids) > 1 for o in want)
    llm = spec_llm(text_target, method, fixture)
    add_oracle(llm, {tuple(p["prompt_token_ids"]): o.outputs[0].token_ids for p, o in zip(ps, want)}, corrupt=0.0)
    got = llm.generate(ps, params, use_tqdm=False)
    assert [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.error) for o in got] == \
        [(o.outputs[0].token_ids, "stop", None) for o in want]
    assert llm.get_stats()["num_accepted_tokens"] > 0
