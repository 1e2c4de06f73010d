"""Prefix caching: full KV pages remembered by their tokens, shared by later prompts that start alike.

The page bookkeeping is checked on its own (exact keys, holders, idle pages evicted oldest first); the
engine with caching gives the outputs it gives without (greedy and seeded sampling, plain, DFlash and
DSpark, under preemption), the hits are counted, and a corrupted remembered page changes the output:
the control that shows the hits are read, not recomputed.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import pytest
import torch

from blockspec import LLM, SamplingParams
from blockspec.config import ConfigError
from blockspec.errors import RequestError
from blockspec.models.kv_cache import PageTable, SharedKVStore
from factories import save_drafter_target, save_moe_target

FIX = Path(__file__).parent / "fixtures" / "drafters"
PAGE = 8
DRAFTERS = {"dflash": "dflash", "dspark": "dspark_vanilla"}


def table(pages: int = 8) -> PageTable:
    t = PageTable(max_slots=4, max_len=64, page_size=4, num_pages=pages, device="cpu")
    t.enable_prefix_caching()
    return t


def test_pages_are_found_by_every_token_up_to_their_end():
    t = table()
    a = t.allocate()
    t.reserve(a, 11)
    tokens = list(range(10, 21))
    t.remember(a, tokens, 11, 11)  # two full pages; the third holds 3 positions
    first, second, _ = t._held[a]
    assert t.prefix.lookup(tokens, 11) == [first, second]
    assert t.prefix.lookup(tokens, 7) == [first]  # at most `limit` positions
    assert t.prefix.lookup(tokens[:5] + [99] + tokens[6:], 11) == [first]  # differs in the second page
    assert t.prefix.lookup([99] + tokens[1:], 11) == []  # differs in the first: the second is not reached


def test_a_cache_salt_keeps_pages_to_the_requests_of_that_salt():
    t = table()
    a = t.allocate()
    tokens = list(range(10, 21))
    t.reserve(a, 11)
    t.remember(a, tokens, 11, 11, salt="tenant-a")
    assert len(t.prefix.lookup(tokens, 11, "tenant-a")) == 2
    assert t.prefix.lookup(tokens, 11) == [] and t.prefix.lookup(tokens, 11, "tenant-b") == []
    b = t.allocate()
    t.reserve(b, 11)
    t.remember(b, tokens, 11, 11)  # the same tokens unsalted: pages of their own, not the salted ones
    unsalted = t.prefix.lookup(tokens, 11)
    assert len(unsalted) == 2 and not set(unsalted) & set(t.prefix.lookup(tokens, 11, "tenant-a"))


def test_a_request_cut_by_a_stop_string_remembers_only_pages_its_tokens_fill():
    """A stop string inside an accepted block leaves the cache holding positions past the cut output: a page
    keyed by the tokens left (fewer than a page) would be a key no lookup ever matches."""
    from blockspec.engine.scheduler import Scheduler
    from blockspec.request import Request

    t = table()
    sched = Scheduler(t, 64, 0)
    req = Request("a", None, [1, 2, 3, 4, 5], SamplingParams(), 0)
    sched.add([req])
    sched.admit()
    req.output_ids = [6, 7]  # 7 tokens; the cache holds 9 positions (2 of tokens the stop string cut)
    t.reserve(req.slot, 9)
    req.num_cached = 9
    sched.remember(req)
    assert [len(tokens) for _, tokens in t.prefix.key_of.values()] == [4]
    assert len(t.prefix.lookup([1, 2, 3, 4, 5, 6, 7, 9, 9], 9)) == 1


def test_shared_pages_stay_until_no_slot_holds_them_then_idle_pages_go_oldest_first():
    t = table(pages=4)
    a = t.allocate()
    t.reserve(a, 8)
    t.remember(a, list(range(8)), 8, 8)
    pages = list(t._held[a])
    b = t.allocate()
    t.share(b, t.prefix.lookup(list(range(8)), 8))
    assert t._held[b] == pages and t.num_free_pages == 2
    t.release(a)
    assert t.num_free_pages == 2  # b still holds both
    t.release(b)
    assert t.num_free_pages == 4 and list(t.prefix.idle) == pages[::-1]  # released in reverse column order
    c = t.allocate()
    assert t.reserve(c, 12)  # two free pages, then the oldest idle one
    assert pages[1] in t._held[c] and pages[0] not in t._held[c]
    assert t.prefix.lookup(list(range(8)), 8) == [pages[0]]
    t.reserve(c, 16)
    assert t.prefix.lookup(list(range(8)), 8) == []


def test_a_page_computed_twice_stays_with_its_slot_and_is_freed_with_it():
    t = table()
    a, b = t.allocate(), t.allocate()
    t.reserve(a, 4), t.reserve(b, 4)
    t.remember(a, [1, 2, 3, 4], 4, 4)
    t.remember(b, [1, 2, 3, 4], 4, 4)
    assert t.prefix.lookup([1, 2, 3, 4, 5], 4) == t._held[a]
    free = t.num_free_pages
    t.release(b)
    assert t.num_free_pages == free + 1 and not t.prefix.idle


def test_pages_without_the_drafter_context_give_way_to_a_copy_with_it():
    """A page written by a request that fed no drafter serves only requests that will not draft. The
    same tokens computed with the drafter's context take its key: a held old copy is freed when its
    last holder lets go (once, however many held it), an idle one at once; the pages keyed after the
    old copy are reached no more and wait, idle, to be evicted."""
    t = table()
    a = t.allocate()
    t.reserve(a, 8)
    t.remember(a, list(range(8)), 8, 0)  # the target's K/V only
    old = list(t._held[a])
    assert t.prefix.lookup(list(range(8)), 8) == old and t.prefix.with_draft(old) == 0
    b = t.allocate()
    t.share(b, old)
    free = len(t._free_pages)
    c = t.allocate()
    t.reserve(c, 8)
    t.remember(c, list(range(8)), 8, 4)  # the drafter's context in its first page only
    new = list(t._held[c])
    assert t.prefix.lookup(list(range(8)), 8) == new and t.prefix.with_draft(new) == 1
    assert len(t._free_pages) == free - 2  # old[0] is held by a and b: an orphan, not free yet
    t.remember(a, list(range(8)), 8, 0)  # its holder remembers again: the key stays with the better copy
    audit(t)
    assert t.prefix.lookup(list(range(8)), 8)[0] == new[0] and old[0] in t.prefix.orphans
    t.release(a)
    assert old[0] not in t._free_pages
    t.release(b)
    assert t._free_pages.count(old[0]) == 1 and list(t.prefix.idle) == [old[1]]
    t.remember(c, list(range(8)), 8, 8)  # c's second page now holds the drafter's context too
    assert t.prefix.with_draft(t.prefix.lookup(list(range(8)), 8)) == 2
    t.release(c)
    d = t.allocate()
    t.reserve(d, 4)
    t.remember(d, [7, 7, 7, 7], 4, 0)
    idle = t._held[d][0]
    t.release(d)
    assert idle in t.prefix.idle
    e = t.allocate()
    t.reserve(e, 4)
    t.remember(e, [7, 7, 7, 7], 4, 4)  # an idle copy without the drafter's context is freed at once
    assert t.prefix.lookup([7, 7, 7, 7], 4) == t._held[e] and idle not in t.prefix.idle
    assert t._free_pages.count(idle) == 1


def test_an_orphan_takes_its_key_back_when_the_copy_that_took_it_is_evicted():
    t = table(pages=4)
    a, b = t.allocate(), t.allocate()
    t.reserve(a, 4)
    t.remember(a, [1, 2, 3, 4], 4, 0)
    old = t._held[a][0]
    t.share(b, [old])
    c = t.allocate()
    t.reserve(c, 4)
    t.remember(c, [1, 2, 3, 4], 4, 4)  # old: an orphan held by a and b
    t.release(c)  # the better copy is idle
    d = t.allocate()
    assert t.reserve(d, 12)  # two free pages and the idle copy, evicted
    audit(t)
    t.remember(a, [1, 2, 3, 4], 4, 0)
    audit(t)
    assert t.prefix.lookup([1, 2, 3, 4, 5], 4) == [old] and t.prefix.holders[old] == 2
    t.release(a), t.release(b)
    assert list(t.prefix.idle) == [old]


def test_forgetting_every_prefix_leaves_held_pages_with_their_holders():
    t = table()
    a, b = t.allocate(), t.allocate()
    t.reserve(a, 8)
    t.remember(a, list(range(8)), 8, 8)
    t.share(b, t.prefix.lookup(list(range(8)), 4))
    t.release(a)  # the second page is idle, the first held by b
    t.forget_prefixes()
    audit(t)
    assert t.prefix.lookup(list(range(8)), 8) == [] and t.num_free_pages == t.num_pages - 1
    t.release(b)
    audit(t)
    assert t.num_free_pages == t.num_pages and len(t._free_pages) == t.num_pages


def test_engines_that_share_one_kv_store_cannot_remember_pages():
    store = SharedKVStore()
    with store.engine(), pytest.raises(ConfigError, match="enable_prefix_caching: engines that take turns"):
        table()


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return save_drafter_target(tmp_path_factory.mktemp("target"))


def llm(target: Path, caching: bool, method: str | None = None, **engine) -> LLM:
    spec = None if method is None else {"method": method, "model": str(FIX / DRAFTERS[method]),
                                        "num_speculative_tokens": 3, "adaptive_draft_length": False}
    return LLM(str(target), device="cpu", dtype="float32", max_model_len=160, enable_prefix_caching=caching,
               speculative_config=spec, **{"kv_page_size": PAGE, **engine})


def prompts(seed: int) -> list[dict]:
    """A shared 40-token opening (five pages) and suffixes of 1 to 20 tokens; one prompt twice."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(2, 95, (40,), generator=g).tolist()
    out = [shared + torch.randint(2, 95, (int(n),), generator=g).tolist() for n in (1, 7, 20, 13)]
    return [{"prompt_token_ids": p} for p in out + out[:1]]


PARAMS = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
          SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True)]


def ids(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("method", [None, "dflash", "dspark"])
def test_outputs_with_caching_equal_those_without_and_later_prompts_hit(target, method):
    """Two rounds: the second finds the first's pages (the shared opening and the repeated prompt's
    own). Greedy and seeded sampling, plain and speculative: the same tokens with caching as without."""
    first, second = prompts(1), prompts(2)
    on, off = llm(target, True, method), llm(target, False, method)
    for params in PARAMS:
        for batch in (first, second, first):
            assert ids(on.generate(batch, params, use_tqdm=False)) == ids(off.generate(batch, params, use_tqdm=False))
    stats = on.get_stats()
    # a round's prompts are admitted together, so they find the pages of the rounds before: 4 rounds of 5
    assert stats["num_prefix_cache_hits"] >= 40 * 20
    assert stats["num_prefix_cache_hits"] <= stats["num_prefix_cache_queries"]
    assert off.get_stats()["num_prefix_cache_queries"] == 0
    if method is not None:  # the remembered pages hold the drafter's context too: the same drafts
        assert stats["num_accepted_tokens_per_pos"] == off.get_stats()["num_accepted_tokens_per_pos"]


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe", "fp8"])
def test_mixture_of_experts_and_fp8_targets_remember_pages_exactly(tmp_path, target, kind):
    """Caching is the attention's business, whatever the MLP: Qwen3-MoE and Qwen2-MoE targets (routing
    per row) and FP8 weights quantized at load give, with DSpark, the same tokens and drafts with
    caching as without, and the later rounds hit."""
    if kind == "fp8":
        model, extra = target, {"quantization": "fp8"}
    else:
        model, extra = save_moe_target(tmp_path / kind, kind), {}
    on, off = llm(model, True, "dspark", **extra), llm(model, False, "dspark", **extra)
    for params in PARAMS:
        for batch in (prompts(4), prompts(4)):
            assert ids(on.generate(batch, params, use_tqdm=False)) == ids(off.generate(batch, params, use_tqdm=False))
    stats = on.get_stats()
    assert stats["num_prefix_cache_hits"] >= 40 * 5
    assert stats["num_accepted_tokens_per_pos"] == off.get_stats()["num_accepted_tokens_per_pos"]


@pytest.mark.parametrize("method", [None, "dspark"])
def test_a_prompt_shares_the_pages_of_a_request_still_running(target, method):
    """Two slots: each later prompt is admitted while an earlier one with the same opening decodes, and
    maps that request's prompt pages into its own slot; nothing either writes lands in them."""
    batch = prompts(3)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (60, 10, 30, 5, 40)]
    on = llm(target, True, method, max_num_seqs=2)
    expected = ids(llm(target, False, method, max_num_seqs=2).generate(batch, params, use_tqdm=False))
    assert ids(on.generate(batch, params, use_tqdm=False)) == expected
    assert on.get_stats()["num_prefix_cache_hits"] >= 40 * 3


@pytest.mark.parametrize("budget", [41, 4096])
@pytest.mark.parametrize("method", [None, "dspark"])
def test_a_burst_sharing_an_opening_prefills_it_once(target, method, budget):
    """Admitted together: the first request writes the opening, and each later one, at its first chunk,
    maps in the pages remembered since; with room for them all in one step's prefill, they wait a step
    for the first one's pages rather than computing them beside it."""
    batch = prompts(10)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    on = llm(target, True, method, max_prefill_tokens=budget)
    expected = ids(llm(target, False, method, max_prefill_tokens=budget).generate(batch, params, use_tqdm=False))
    outs = on.generate(batch, params, use_tqdm=False)
    assert ids(outs) == expected
    assert [o.num_cached_tokens for o in outs][1:] == [40] * 4
    assert on.get_stats()["num_prefix_cache_hits"] == 160


@pytest.mark.parametrize("method", [None, "dspark"])
def test_preempted_requests_come_back_through_their_remembered_pages(target, method):
    """A pool of about one request's pages: requests are preempted and come back finding the pages they
    wrote (fewer positions prefilled than without caching); outputs equal a run without caching. A
    request's lookup counts once, at its first prefill (vLLM keeps a preempted request's lookups of its own
    pages out of the prefix-cache counters: they made its hit rate 53 % with no prompt shared)."""
    batch = prompts(4)[:4]
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    on, off = llm(target, True, method, num_kv_pages=24), llm(target, False, method, num_kv_pages=24)
    assert ids(on.generate(batch, params, use_tqdm=False)) == ids(off.generate(batch, params, use_tqdm=False))
    stats = on.get_stats()
    assert stats["num_preemptions"] > 0 and on.engine.num_prefilled_tokens < off.engine.num_prefilled_tokens
    assert stats["num_prefix_cache_queries"] == sum(len(p["prompt_token_ids"]) for p in batch)


def test_a_prompt_lookup_counts_once_however_its_request_comes_back(target):
    """A request preempted before its first prefill chunk counts its prompt's lookup at the chunk it later
    runs (it was never counted); one retried after a failed step is not counted again, with its output
    (it was)."""
    tight = llm(target, True, num_kv_pages=21, max_prefill_tokens=32)
    prompt = list(range(2, 50))
    tight.generate([{"prompt_token_ids": prompt}] * 4,
                   [SamplingParams(temperature=0.9, seed=i, max_tokens=60, ignore_eos=True) for i in range(4)],
                   use_tqdm=False)
    stats = tight.get_stats()
    assert stats["num_preemptions"] > 0 and stats["num_prefix_cache_queries"] == 4 * len(prompt)
    flaky = llm(target, True)
    real, calls = flaky.engine.runner.forward_ids, []

    def failing_once(*args, **kwargs):  # the third forward (a decode step) fails, as a device fault would
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("device fault")
        return real(*args, **kwargs)

    flaky.engine.runner.forward_ids = failing_once
    batch = [{"prompt_token_ids": [5 + i] * 20} for i in range(2)]
    outs = flaky.generate(batch, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert len(calls) > 3 and [o.outputs[0].finish_reason for o in outs] == ["length", "length"]
    assert flaky.get_stats()["num_prefix_cache_queries"] == 40


def test_a_corrupted_remembered_page_changes_the_output(target):
    """The negative control: the second request reads the first one's pages. Garbage in them changes its
    tokens; the same garbage in pages nobody remembers changes nothing."""
    prompt = prompts(5)[2]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = ids(llm(target, False).generate([prompt], params, use_tqdm=False))

    def second_run(corrupt_remembered: bool) -> list[list[int]]:
        engine_llm = llm(target, True)
        engine_llm.generate([prompt], params, use_tqdm=False)
        pages = engine_llm.engine.pages
        remembered = sorted(pages.prefix.key_of)
        assert len(remembered) >= 5
        chosen = remembered if corrupt_remembered else sorted(set(range(pages.num_pages)) - set(remembered))
        cache = engine_llm.engine.runner.cache
        for pool in cache.k + cache.v:
            pool[chosen] = torch.randn_like(pool[chosen]) * 10
        return ids(engine_llm.generate([prompt], params, use_tqdm=False))

    assert second_run(corrupt_remembered=False) == expected
    assert second_run(corrupt_remembered=True) != expected


@pytest.mark.parametrize("method", [None, "dspark"])
def test_prompts_of_another_cache_salt_find_nothing(target, method):
    """vLLM's cache_salt on a prompt dict: a salted prompt finds only pages written under its salt, in a
    later call and in a burst admitted together (which otherwise waits a step for the first one's
    pages); the tokens are those of an engine without caching."""
    batch = prompts(8)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    on = llm(target, True, method)
    expected = ids(llm(target, False, method).generate(batch, params, use_tqdm=False))

    def run(salts: list[str | None]) -> list[int | None]:
        outs = on.generate([{**p, "cache_salt": s} if s else p for p, s in zip(batch, salts)], params, use_tqdm=False)
        assert ids(outs) == expected
        return [o.num_cached_tokens for o in outs]

    assert run(["a", "b", "a", "b", None]) == [0, 0, 40, 40, 0]  # a burst: each salt writes its own opening
    assert run(["c"] * 5) == [0, 40, 40, 40, 40]
    # the fourth's own pages (53 tokens) were written under "c"; the fifth is the first prompt again
    assert run(["a", "b", None, "c", "a"]) == [40, 40, 40, 48, 40]
    with pytest.raises(RequestError, match=r"^prompt 0: cache_salt must be a non-empty string, got ''"):
        on.generate({**batch[0], "cache_salt": ""}, params, use_tqdm=False)


def test_prompt_logprobs_requests_prefill_every_position(target):
    prompt = prompts(6)[2]
    on, off = llm(target, True), llm(target, False)
    plain = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with_lp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    on.generate([prompt], plain, use_tqdm=False)
    queried = on.get_stats()["num_prefix_cache_queries"]
    got, want = on.generate([prompt], with_lp, use_tqdm=False)[0], off.generate([prompt], with_lp, use_tqdm=False)[0]
    assert on.get_stats()["num_prefix_cache_queries"] == queried
    assert len(got.prompt_logprobs) == len(prompt["prompt_token_ids"])
    for a, b in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:]):
        assert {t: round(lp.logprob, 5) for t, lp in a.items()} == {t: round(lp.logprob, 5) for t, lp in b.items()}


def test_request_outputs_say_how_many_prompt_tokens_the_cache_held(target):
    """vLLM's RequestOutput.num_cached_tokens: full pages only, never the last prompt token."""
    prompt = prompts(7)[2]  # 60 tokens: seven full pages of 8
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    on, off = llm(target, True), llm(target, False)
    assert [on.generate([prompt], params, use_tqdm=False)[0].num_cached_tokens for _ in range(2)] == [0, 56]
    assert off.generate([prompt], params, use_tqdm=False)[0].num_cached_tokens == 0
    n2 = SamplingParams(temperature=0.8, seed=1, n=2, max_tokens=3, ignore_eos=True)
    assert on.generate([prompt], n2, use_tqdm=False)[0].num_cached_tokens == 56


def test_pages_of_requests_that_fed_no_drafter_serve_only_requests_that_will_not_draft(target):
    """Parked requests (the policy judged plain faster at their batch) write the target's K/V alone:
    later parked requests share them; the first request that feeds the drafter gives them back and
    prefills its prompt, and the next one shares its pages, drafter context included. Outputs equal a
    run without caching throughout."""
    batch = prompts(8)[:4]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    on, off = llm(target, True, "dspark"), llm(target, False, "dspark")
    feeds = [False]
    for engine_llm in (on, off):
        engine_llm.engine.policy.feeds_drafter = lambda batch_size, arrivals: feeds[0]

    def one(prompt: dict) -> tuple[int, int]:
        """Run one request on both; (prompt tokens found in the cache, drafts accepted) on `on`."""
        accepted = on.get_stats()["num_accepted_tokens"]
        got, want = on.generate([prompt], params, use_tqdm=False)[0], off.generate([prompt], params, use_tqdm=False)[0]
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        return got.num_cached_tokens, on.get_stats()["num_accepted_tokens"] - accepted

    assert one(batch[0]) == (0, 0)
    assert one(batch[1]) == (40, 0)  # parked, from the parked request's pages
    feeds[0] = True
    hits, accepted = one(batch[2])
    assert hits == 0 and accepted > 0  # it drafts, so it recomputed the pages without the drafter's context
    assert one(batch[3])[0] == 40  # now there are pages with it
    stats = on.get_stats()
    assert stats["num_prefix_cache_hits"] == 80


def audit(pages: PageTable) -> None:
    """Every page is free, idle or held, exactly one of them; holders and orphans count the slots that
    hold a page; a page no one remembers is held by one slot at most; keys and pages agree."""
    prefix = pages.prefix
    held = Counter(p for slot in range(pages.max_slots) for p in pages._held[slot])
    free, idle = pages._free_pages, set(prefix.idle)
    assert len(free) == len(set(free)), "a page is free twice"
    assert not (set(free) & idle) and not (set(free) & set(held)) and not (idle & set(held))
    assert set(free) | idle | set(held) == set(range(pages.num_pages)), "a page is lost"
    for page, n in held.items():
        if page in prefix.orphans:
            assert prefix.orphans[page] == n
        elif page in prefix.key_of:
            assert prefix.holders[page] == n
        else:
            assert n == 1, f"page {page} is shared but not remembered"
    stray = {p: (prefix.holders.get(p), prefix.orphans.get(p), p in prefix.key_of, p in idle, p in free)
             for p in set(prefix.holders) | set(prefix.orphans) if p not in held}
    assert not stray, stray
    assert idle <= set(prefix.key_of) and not (idle & set(prefix.holders))
    assert all(prefix.page_of[key] == page for page, key in prefix.key_of.items())
    assert len(prefix.page_of) == len(prefix.key_of) and prefix.draft <= set(prefix.key_of)
    pages.sync()  # the device table maps each slot's columns to its pages, the rest to the trash page
    for slot in range(pages.max_slots):
        row = pages.table[slot].tolist()
        held_pages = pages._held[slot]
        assert row[: len(held_pages)] == held_pages and set(row[len(held_pages):]) <= {pages.trash_page}, slot


@pytest.mark.parametrize("seed", [1, 4, 7])
def test_a_random_workload_keeps_the_pages_consistent_and_the_outputs_of_plain_decoding(target, seed):
    """Prompts built from a few shared stems arrive in waves into a pool that preempts; each step drafts
    a random number of tokens, and arrivals feed the drafter or not at random; some requests decode
    plainly, some are aborted. After every step the page accounting holds (`audit`), and every
    request that finished gives plain decoding's tokens."""
    import random

    rng = random.Random(seed)
    stems = [[rng.randrange(2, 95) for _ in range(12)] for _ in range(3)]
    on = llm(target, True, "dspark", num_kv_pages=60, kv_page_size=4, max_prefill_tokens=rng.choice([16, 48, 4096]))
    engine = on.engine
    engine.policy.choose = lambda batch: rng.choice([0, 1, 2, 3])
    engine.policy.feeds_drafter = lambda batch, joining=1: rng.random() < 0.95
    todo = []
    for i in range(40):
        prompt = stems[rng.randrange(3)] + stems[rng.randrange(3)][: rng.randrange(13)]
        prompt = prompt + [rng.randrange(2, 95) for _ in range(rng.randrange(7))]
        sampled = rng.random() < 0.4
        params = SamplingParams(temperature=0.8 if sampled else 0.0, seed=i, max_tokens=rng.randrange(1, 40),
                                ignore_eos=True, use_speculation=rng.random() < 0.8, n=2 if sampled and i % 3 == 0 else 1)
        todo.append((str(i), prompt, params))
    done, aborted = {}, set()
    pending = list(todo)
    counted = (0, 0)  # the prefix-cache counters only grow (a fall wedged the server's Prometheus counters)
    while pending or engine.has_unfinished():
        for _ in range(rng.choice([0, 0, 1, 2])):
            if pending:
                rid, prompt, params = pending.pop(0)
                engine.add_request(rid, None, prompt, params)
        if engine.running and rng.random() < 0.05:
            victim = rng.choice(engine.running).request_id.split("-")[0]
            aborted.add(victim)
            engine.abort(victim)
        for req in engine.step():
            if req.finish_reason is not None and req.finish_reason != "abort":
                done[req.request_id] = list(req.output_ids)
        audit(engine.pages)
        now = (engine.pages.prefix.queried_tokens, engine.pages.prefix.hit_tokens)
        assert now[0] >= counted[0] and now[1] >= counted[1] and now[1] <= now[0]
        counted = now
    stats = on.get_stats()
    assert stats["num_preemptions"] > 0 and stats["num_prefix_cache_hits"] > 0 and stats["num_accepted_tokens"] > 0
    plain = LLM(str(target), device="cpu", dtype="float32", max_model_len=160)
    checked = 0
    for rid, prompt, params in todo:
        if rid in aborted:
            continue
        want = plain.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs
        names = [rid] if params.n == 1 else [f"{rid}-{i}" for i in range(params.n)]
        assert [done[name] for name in names] == [list(o.token_ids) for o in want], rid
        checked += 1
    assert checked >= 25


def test_reset_prefix_cache_forgets_every_page(target):
    """vLLM's LLM.reset_prefix_cache(): the next prompt prefills in full, and its pages are remembered anew."""
    prompt = prompts(9)[2]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    on = llm(target, True)
    on.generate([prompt], params, use_tqdm=False)
    assert on.reset_prefix_cache()
    audit(on.engine.pages)
    assert not on.engine.pages.prefix.key_of and on.engine.pages.num_free_pages == on.engine.pages.num_pages
    assert [on.generate([prompt], params, use_tqdm=False)[0].num_cached_tokens for _ in range(2)] == [0, 56]
    assert not llm(target, False).reset_prefix_cache()


def test_a_step_whose_every_prefill_waits_again_runs_nothing_and_goes_on(target, caplog):
    """`share_more` may send a request back to wait (the pool short of its pages); a step where every
    prefilling request does so prefills nothing, and the requests come back and finish as without caching."""
    batch = prompts(11)[:2]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    on = llm(target, True)
    scheduler, real = on.engine.scheduler, on.engine.scheduler.share_more
    sent_back = []

    def short_once(req):
        if req.request_id in sent_back:
            return real(req)
        sent_back.append(req.request_id)
        scheduler.requeue(req)
        return False

    scheduler.share_more = short_once
    expected = ids(llm(target, False).generate(batch, params, use_tqdm=False))
    with caplog.at_level(logging.ERROR, logger="blockspec"):
        assert ids(on.generate(batch, params, use_tqdm=False)) == expected and len(sent_back) == 2
    assert not caplog.records  # no step failed (the engine would have retried it)


def test_remembered_pages_of_an_fp8_kv_cache(target):
    """kv_cache_dtype="fp8": the pages hold e4m3 K/V and their scales are per tensor, so a remembered page
    reads as the one its writer read: the same tokens with caching as without."""
    first, params = prompts(12), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    on, off = llm(target, True, "dflash", kv_cache_dtype="fp8"), llm(target, False, "dflash", kv_cache_dtype="fp8")
    for _ in range(2):
        assert ids(on.generate(first, params, use_tqdm=False)) == ids(off.generate(first, params, use_tqdm=False))
    assert on.get_stats()["num_prefix_cache_hits"] >= 40 * 5
