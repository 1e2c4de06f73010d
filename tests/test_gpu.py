"""GPU-only checks: the CUDA-graph path against the eager reference path (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from blockspec import LLM, SamplingParams
from factories import save_drafter_target, save_tiny, watched_kernels

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.7, seed=3),
                                      dict(temperature=0.9, top_p=0.8, top_k=20, seed=4)])
def test_cuda_graph_decode_equals_eager(tmp_path, sampling):
    """Graphed decode steps (the forward, then the head and sampler) emit the eager path's tokens, greedy,
    sampled, and sampled through top-k / top-p."""
    path = save_tiny(tmp_path / "m", "qwen3", seed=2)
    prompts = [{"prompt_token_ids": list(range(2, 2 + n))} for n in (3, 40, 11)]
    params = SamplingParams(**sampling, max_tokens=48, ignore_eos=True)
    graphed = LLM(str(path), device="cuda", dtype="float32", max_model_len=256)
    eager = LLM(str(path), device="cuda", dtype="float32", max_model_len=256)
    eager.engine.runner.use_graphs = False
    replayed = []
    runner = graphed.engine.runner
    replay = runner._replay
    runner._replay = lambda *a, **k: replayed.append(a[5]) or replay(*a, **k)
    heads, head_key = [], runner.head_key
    runner.head_key = lambda *a: heads.append(head_key(*a)) or heads[-1]
    a = [o.outputs[0].token_ids for o in graphed.generate(prompts, params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    assert a == b
    assert replayed[0][:2] == (4, 64) and replayed[1][:2] == (4, 1)  # the prefill of all three, then decode
    assert heads and all(key is not None for key in heads)  # every plain step's head was a graph's


@pytest.mark.gpu
def test_the_plain_step_head_graphs_give_the_eager_tokens(tmp_path):
    """Greedy ids and sampled tokens through the head graphs equal the eager head and sampler's, row for
    row: batches padded to their bucket, greedy and sampled rows mixed, min-p, top-k and top-p (their own
    graph), a bad row (-1). Each replay reads the columns written for it: another seed draws other tokens,
    the eager ones for that seed."""
    from blockspec.models.runner import FILTERED_HEAD, SAMPLED_HEAD
    from blockspec.sample import Columns

    llm = LLM(str(save_tiny(tmp_path / "m", "qwen3", seed=2)), device="cuda", dtype="float32", warmup=False)
    runner = llm.engine.runner
    gen = torch.Generator(device="cuda").manual_seed(0)

    def both(hidden, columns):
        runner.use_graphs = True
        graphed = runner.next_ids(hidden, columns).clone()
        runner.use_graphs = False
        eager = runner.next_ids(hidden, columns)
        runner.use_graphs = True
        return graphed.tolist(), eager.tolist()

    h = runner.model.config.hidden_size
    for rows in (1, 3, 5):
        hidden = torch.randn(rows, h, device="cuda", generator=gen) * 4
        hidden[-1, 0] = float("nan") if rows > 1 else hidden[-1, 0]
        cases = [None,
                 Columns.from_values([0.7] * rows, [11] * rows, list(range(rows))),
                 Columns.from_values([0.0, 0.7, 1.3, 0.0, 2.0][:rows], [1, 2, 3, 4, 5][:rows], [9] * rows,
                                     min_p=[0.0, 0.1, 0.0, 0.2, 0.0][:rows]),
                 Columns.from_values([1.0] * rows, [7] * rows, [3] * rows, top_k=[0, 5, 3, 0, 2][:rows],
                                     top_p=[0.9, 1.0, 0.5, 0.7, 1.0][:rows])]
        for columns in cases:
            graphed, eager = both(hidden, columns)
            assert graphed == eager, (rows, columns)
            assert (graphed[-1] == -1) == (rows > 1)
        reseeded = Columns.from_values([1.0] * rows, [99] * rows, list(range(rows)))
        assert both(hidden, reseeded)[0] != both(hidden, cases[1])[0] or rows == 1
    assert {(4, None), (4, SAMPLED_HEAD), (4, FILTERED_HEAD), (8, SAMPLED_HEAD)} <= set(runner.head_graphs)


@pytest.mark.gpu
def test_prefill_graphs_equal_the_eager_prefill(tmp_path):
    """A prefill batch replays a graph padded to a power-of-two width and gives the eager forward's
    hidden rows, taps and cache K/V; the taps it returns outlive the next prefill graph (its hidden
    rows are read in the step that made them, from a buffer every prefill graph shares)."""
    target = save_drafter_target(tmp_path / "t")
    llm = LLM(str(target), device="cuda", dtype="float32", max_model_len=256, warmup=False)
    model = llm.model
    model.attention_backend = "triton"
    from blockspec.models.runner import ModelRunner

    runner = ModelRunner(model, 4, 300, taps=(0, 2), graph_prefill_tokens=256)
    replayed = []
    replay = runner._replay
    runner._replay = lambda *a, **k: replayed.append(a[5]) or replay(*a, **k)
    runs = [[2 + (i * 7 + j) % 90 for j in range(n)] for i, n in enumerate((3, 40, 11))]
    slots, starts = [0, 1, 2], [0, 0, 0]
    runner.graph_prefill_tokens = 0
    hidden_e, feats_e = runner.forward(runs, starts, slots, with_taps=True)
    keys = lambda layer: runner.cache.gather(layer, torch.tensor(slots, device="cuda"), 40)[0]  # noqa: E731
    k_e = [keys(layer) for layer in range(len(runner.cache.k))]
    for k in runner.cache.k:
        k.zero_()
    runner.graph_prefill_tokens = 256
    hidden_g, feats_g = runner.forward(runs, starts, slots, with_taps=True)
    assert [key[:2] for key in replayed] == [(4, 64)]
    for i, run in enumerate(runs):
        n = len(run)
        torch.testing.assert_close(hidden_g[i, :n], hidden_e[i, :n])
        torch.testing.assert_close(feats_g[i, :n], feats_e[i, :n])
        for layer in range(len(runner.cache.k)):
            torch.testing.assert_close(keys(layer)[i, :, :n], k_e[layer][i, :, :n])
    kept = feats_g.clone()
    runner.forward([[5] * 20], [0], [3], with_taps=True)  # another prefill graph: (1, 32)
    assert [key[:2] for key in replayed] == [(4, 64), (1, 32)]
    assert torch.equal(feats_g, kept)


@pytest.mark.gpu
@pytest.mark.parametrize("method, fixture", [("dflash", "dflash"), ("dspark", "dspark_vanilla")])
def test_a_prefill_graph_appends_the_draft_context_the_eager_path_does(tmp_path, method, fixture):
    """A tapped prefill graph writes the prompt's context K/V into the drafter's cache itself: the
    same K/V as the eager prefill and `Proposer.extend_context`, only for requests that feed the
    drafter, and the same drafts and output after it."""
    from pathlib import Path

    target = save_drafter_target(tmp_path / "t")
    spec = {"method": method, "model": str(Path(__file__).parent / "fixtures" / "drafters" / fixture),
            "adaptive_draft_length": False}
    graphed = LLM(str(target), device="cuda", dtype="float32", max_model_len=256, speculative_config=spec)
    eager = LLM(str(target), device="cuda", dtype="float32", max_model_len=256, speculative_config=spec,
                graph_prefill_tokens=0)
    lengths = (3, 40, 11)
    for llm in (graphed, eager):
        for pool in llm.engine.context.cache.k + llm.engine.context.cache.v:
            pool.zero_()  # what the warm-up's requests left in the pages
        for i, n in enumerate(lengths):
            params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, use_speculation=i != 2)
            llm.engine.add_request(str(i), None, [2 + (i * 7 + j) % 90 for j in range(n)], params)
        llm.engine.step()  # the prefill of all three
    cache_g, cache_e = graphed.engine.context.cache, eager.engine.context.cache
    reqs_g, reqs_e = list(graphed.engine.running), list(eager.engine.running)
    assert [r.num_draft_ctx for r in reqs_g] == [r.num_draft_ctx for r in reqs_e] == [3, 40, 0]
    def context(cache, req, n):
        return [t for layer in range(len(cache.k)) for t in cache.gather(layer, torch.tensor([req.slot]).cuda(), n)]

    for rg, re, n in zip(reqs_g, reqs_e, (3, 40)):
        for kg, ke in zip(context(cache_g, rg, n), context(cache_e, re, n)):
            torch.testing.assert_close(kg, ke)
    assert not any(t.any() for t in context(cache_g, reqs_g[2], 11))  # the opted-out request fed nothing
    outputs = []
    for llm, reqs in ((graphed, reqs_g), (eager, reqs_e)):
        while llm.engine.has_unfinished():
            llm.engine.step()
        outputs.append(([r.output_ids for r in reqs], llm.get_stats()["num_accepted_tokens_per_pos"]))
    assert outputs[0] == outputs[1] and sum(outputs[0][1]) > 0


@pytest.mark.gpu
@pytest.mark.parametrize("method, fixture", [("dflash", "dflash"), ("dspark", "dspark_vanilla")])
def test_cuda_graph_draft_step_equals_eager(tmp_path, method, fixture):
    """Graphed steps give the eager path's drafts: same acceptance counts, and output equal to plain
    decoding, for the chained step's graph (asynchronous scheduling: every step, the first from
    committed state) and for the draft graph (context append + block + drafts) that a synchronous
    engine's steps replay before their verify graph."""
    from pathlib import Path

    target = save_drafter_target(tmp_path / "t")
    spec = {"method": method, "model": str(Path(__file__).parent / "fixtures" / "drafters" / fixture),
            "adaptive_draft_length": False}
    prompts = [{"prompt_token_ids": list(range(2, 2 + n))} for n in (3, 30, 11)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    graphed = LLM(str(target), device="cuda", dtype="float32", max_model_len=256, speculative_config=spec)
    eager = LLM(str(target), device="cuda", dtype="float32", max_model_len=256, speculative_config=spec)
    eager.engine.proposer.graphs.use_graphs = False  # the same tensor code, run eagerly
    eager.engine.proposer.steps.use_graphs = False
    plain = LLM(str(target), device="cuda", dtype="float32", max_model_len=256)
    replays = (graphed.engine.proposer.steps.replays, eager.engine.proposer.steps.replays)  # warm-up's
    a = [o.outputs[0].token_ids for o in graphed.generate(prompts, params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    c = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert graphed.engine.proposer.graphs.graphs and a == b == c
    ga, ea = graphed.get_stats(), eager.get_stats()
    assert ga["num_accepted_tokens_per_pos"] == ea["num_accepted_tokens_per_pos"]
    assert ga["num_spec_steps_chained"] > 0  # graphed steps launched from device results ran too
    # each chained step and each batch's first step one graph replay; the eager engine's ran its tensor code
    assert graphed.engine.proposer.steps.replays - replays[0] == \
        ga["num_spec_steps_chained"] + ga["num_spec_steps_from_committed"]
    assert ga["num_spec_steps_from_committed"] >= 1
    assert eager.engine.proposer.steps.replays == replays[1] and ea["num_spec_steps_chained"] > 0
    synced = LLM(str(target), device="cuda", dtype="float32", max_model_len=256, speculative_config=spec)
    synced.engine.async_scheduling = False
    drafted = []
    run = synced.engine.proposer.graphs.run
    synced.engine.proposer.graphs.run = lambda *args, **kw: drafted.append(1) or run(*args, **kw)
    d = [o.outputs[0].token_ids for o in synced.generate(prompts, params, use_tqdm=False)]
    assert d == c and drafted
    assert synced.get_stats()["num_accepted_tokens_per_pos"] == ga["num_accepted_tokens_per_pos"]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "sdpa"])
def test_warmup_captures_every_graph_serving_needs(tmp_path, backend):
    """After LLM start-up no request captures a graph or compiles a kernel: every batch size up to
    max_num_seqs, prompt length and context length, greedy or sampled, replays what warm-up made."""
    from pathlib import Path

    from blockspec.models.runner import CAPTURES

    target = save_drafter_target(tmp_path / "t")
    spec = {"method": "dflash", "model": str(Path(__file__).parent / "fixtures" / "drafters" / "dflash")}
    llm = LLM(str(target), device="cuda", dtype="float32", max_model_len=300, max_num_seqs=8,
              speculative_config=spec, attention_backend=backend)
    assert llm.engine.num_steps == 0 and llm.engine.num_generated == 0  # warm-up left no trace
    # every kind captured, all in one memory pool; what each added to it is the bench's memory breakdown
    engine = llm.engine
    assert engine.runner.pool == engine.proposer.graphs.pool == engine.proposer.steps.pool is not None
    assert set(engine.graph_bytes) == {"target", "draft", "step"}
    assert engine.graph_bytes["target"] > 0 and all(n >= 0 for n in engine.graph_bytes.values())
    # the draft graphs' outputs, read after the verify's replay, lie outside the pool the target's scratch is in
    pool = [(s["address"], s["total_size"]) for s in torch.cuda.memory_snapshot()
            if tuple(s["segment_pool_id"]) == tuple(engine.runner.pool)]
    drafts = [t.data_ptr() for cap in engine.proposer.graphs.graphs.values() for t in (cap.tokens, cap.confidence)
              if t is not None]
    assert pool and drafts and not [p for p in drafts if any(a <= p < a + n for a, n in pool)]
    before = CAPTURES[0]
    compiled = triton_compiled()
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    sampled = SamplingParams(temperature=0.7, seed=1, max_tokens=40, ignore_eos=True)
    for batch in (1, 3, 8):
        prompts = [{"prompt_token_ids": [2 + i % 90 for i in range(n)]} for n in (3, 30, 11, 250, 5, 64, 17, 2)[:batch]]
        llm.generate(prompts, params, use_tqdm=False)
        llm.generate(prompts, sampled, use_tqdm=False)
    for n in (1, 16, 48, 97, 128):  # lengths of 1 and multiples of 16 are where Triton would specialise
        llm.generate([{"prompt_token_ids": [2 + i % 90 for i in range(n)]}], params, use_tqdm=False)
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, use_speculation=False)
    llm.generate([{"prompt_token_ids": [3, 4, 5]}], plain, use_tqdm=False)
    assert CAPTURES[0] == before
    new = triton_compiled() - compiled
    assert not new, new  # and no Triton kernel compiled a variant for a new shape


def triton_compiled() -> set[str]:
    """Kernel variants Triton has compiled so far for blockspec's kernels (name: specialisation)."""
    kernels = watched_kernels()
    if not hasattr(kernels[0], "device_caches"):
        pytest.skip("this Triton version keeps its kernel cache elsewhere")
    return {f"{k.fn.__name__}: {key}" for k in kernels for caches in k.device_caches.values() for key in caches[0]}


@pytest.mark.gpu
@pytest.mark.parametrize("method, fixture", [("dflash", "dflash"), ("dspark", "dspark_vanilla")])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_a_step_waits_for_the_device_once(tmp_path, method, fixture, temperature):
    """A decode step (plain or speculative) blocks the host only on its one copy of the results:
    every host-to-device copy inside it is asynchronous, so the GPU never idles mid-step while the
    host prepares the next launch."""
    import warnings
    from pathlib import Path

    target = save_drafter_target(tmp_path / "t")
    spec = {"method": method, "model": str(Path(__file__).parent / "fixtures" / "drafters" / fixture)}
    llm = LLM(str(target), device="cuda", dtype="float32", max_model_len=256, max_num_seqs=4, speculative_config=spec)
    engine = llm.engine
    for i, speculate in enumerate((True, True, False)):
        params = SamplingParams(temperature=temperature, max_tokens=200, ignore_eos=True, seed=i,
                                use_speculation=speculate)
        engine.add_request(str(i), None, [2 + (i + j) % 50 for j in range(20 + 7 * i)], params)
    for _ in range(12):  # prefill, catch-up, the policy's first choices
        engine.step()
    steps = 10

    def syncs(fn) -> list[str]:
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return [str(w.message) for w in caught if "synchroniz" in str(w.message)]

    found = syncs(lambda: [engine.step() for _ in range(steps)])
    # each step has a speculative part and a plain part (the opted-out request): one copy each at
    # most (pipelined plain steps wait on an event instead, which is no stream sync)
    assert len(found) <= 2 * steps, found[:5]
    # the detector works here: a host copy of a device value is reported
    assert len(syncs(lambda: torch.ones(1, device="cuda").sum().item())) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("method, fixture", [(None, None), ("dflash", "dflash"), ("dspark", "dspark_vanilla")])
def test_preempted_requests_under_cuda_graphs_give_plain_outputs(tmp_path, method, fixture):
    """KV pages for about one max_model_len sequence and four requests that grow long, on the GPU:
    captured graphs (prefill, decode, verify, draft) read page tables that change after their
    capture, steps launched ahead carry rows of requests preempted meanwhile, and every output
    equals plain decoding with room for all, greedy and seeded-sampled."""
    from pathlib import Path

    target = save_drafter_target(tmp_path / "t")
    spec = None if method is None else {
        "method": method, "model": str(Path(__file__).parent / "fixtures" / "drafters" / fixture),
        "adaptive_draft_length": False}
    tight = LLM(str(target), device="cuda", dtype="float32", max_model_len=160, speculative_config=spec,
                num_kv_pages=14, kv_page_size=16)
    roomy = LLM(str(target), device="cuda", dtype="float32", max_model_len=160)
    prompts = [{"prompt_token_ids": [2 + (i * 11 + j) % 90 for j in range(n)]} for i, n in enumerate((5, 28, 12, 20))]
    params = [SamplingParams(temperature=0, max_tokens=120, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=110, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=115, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)]
    want = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    assert got == want
    m = tight.get_stats()
    assert m["num_preemptions"] > 2
    if method is not None:
        assert m["num_drafts"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("method, fixture", [("dflash", "dflash"), ("dspark", "dspark_vanilla")])
def test_a_reasoning_parsers_grammar_under_cuda_graphs_gives_plain_outputs(tmp_path, method, fixture):
    """Structured outputs after a think block, some with a thinking budget, on the GPU (masks copied to the device,
    verify graphs, the plain step launched ahead for the other rows): speculative outputs equal plain decoding's,
    answers keep the grammar."""
    import re
    from pathlib import Path

    from blockspec.sampling_params import StructuredOutputsParams

    target = save_drafter_target(tmp_path / "t", think=True)
    kw = dict(device="cuda", dtype="float32", max_model_len=160, reasoning_parser="qwen3")
    plain = LLM(str(target), **kw)
    spec = LLM(str(target), **kw, speculative_config={
        "method": method, "model": str(Path(__file__).parent / "fixtures" / "drafters" / fixture),
        "adaptive_draft_length": False})
    end = plain.engine.think.end
    prompts = ["hello<think>", "x = 1<think>", "def f():<think>", "The answer<think>", "no block"]
    params = [SamplingParams(temperature=t, seed=4, max_tokens=40, logit_bias={end: 1.5}, thinking_token_budget=budget,
                             structured_outputs=StructuredOutputsParams(regex=r"[a-c]{3}-[0-9]{2}"))
              for t, budget in ((0.0, None), (0.8, 2), (0.0, 1), (0.8, None), (0.0, None))]
    want = plain.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in want]
    for o in want:
        answer = o.outputs[0].text.split("</think>")[-1]
        assert re.fullmatch(r"[a-c]{3}-[0-9]{2}", answer) and o.outputs[0].finish_reason == "stop", o.outputs[0].text
    assert spec.get_stats()["num_drafts"] > 0


@pytest.mark.gpu
def test_a_cache_plan_beyond_the_gpu_is_refused_before_allocating(tmp_path):
    """Too little of the card left for the pages of one max_model_len sequence: a clear error at
    start-up naming the numbers, not a CUDA out-of-memory error from inside an allocation."""
    from blockspec.config import ConfigError

    target = save_drafter_target(tmp_path / "t")
    with pytest.raises(ConfigError, match="one sequence of max_model_len=250 needs .* KV pages"):
        LLM(str(target), device="cuda", dtype="float32", max_model_len=250, gpu_memory_utilization=0.01)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed K", "adaptive"])
def test_tp2_on_gpus_matches_one_gpu(tmp_path, adaptive):
    """Two ranks on two GPUs (NCCL for the model, a gloo group for commands and the policy's
    decisions) give one GPU's tokens, greedy and seeded-sampled, with DFlash speculation."""
    from pathlib import Path


    target = save_drafter_target(tmp_path / "t")
    spec = {"method": "dflash", "model": str(Path(__file__).parent / "fixtures" / "drafters" / "dflash"),
            "adaptive_draft_length": adaptive}
    prompts = [{"prompt_token_ids": [2 + (i * 7 + j) % 90 for j in range(n)]} for i, n in enumerate((4, 37, 2))]
    runs = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
            SamplingParams(temperature=0.9, seed=3, max_tokens=24, ignore_eos=True)]
    one = LLM(str(target), device="cuda", dtype="float32", max_model_len=256, speculative_config=spec, seed=0)
    want = [[o.outputs[0].token_ids for o in one.generate(prompts, p, use_tqdm=False)] for p in runs]
    del one
    with LLM(str(target), tensor_parallel_size=2, device="cuda", dtype="float32", max_model_len=256,
               speculative_config=spec, seed=0) as tp:
        got = [[list(o.outputs[0].token_ids) for o in tp.generate(prompts, p, use_tqdm=False)] for p in runs]
        assert tp.get_stats()["num_drafts"] > 0
    assert got == [[list(t) for t in w] for w in want]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp2_bench_on_gpus_gives_one_gpus_tokens():
    """`blockspec bench -tp 2 --compare-tp1` on two GPUs (NCCL, CUDA graphs with the all-reduces inside):
    plain and a synthetic DFlash (fixed K) give one GPU's tokens, and the report has both ranks' figures."""
    from blockspec.bench import BenchConfig, run_bench

    result = run_bench(BenchConfig(random_weights=True, arch="tiny", device="cuda", dtype="float32", input_len=(8,),
                                   output_len=24, repeats=1, batch_sizes=(1, 4), methods=("plain", "dflash"),
                                   synthetic_acceptance="4", speculative_config={"adaptive_draft_length": False},
                                   tensor_parallel_size=2, compare_tp1=True))
    rows = result["compare_tp1"]["rows"]
    assert len(rows) == 4 and all(row["tokens_match_tp1"] == 1.0 for row in rows)
    assert all(len(run["ranks"]["step_ms"]) == 2 for run in result["runs"])
    assert result["device"] == torch.cuda.get_device_name(0)


@pytest.mark.gpu
def test_prefix_caching_after_warmup_on_cuda(tmp_path):
    """The warm-up's repeated prompts are neither remembered nor counted; afterwards a repeated prompt finds
    its pages through the captured graphs, and a burst that shares an opening maps it in."""
    target = save_drafter_target(tmp_path / "t")
    llm = LLM(str(target), device="cuda", dtype="float32", max_model_len=160, kv_page_size=16,
              enable_prefix_caching=True)
    pages = llm.engine.pages
    assert not pages.prefix.key_of and llm.get_stats()["num_prefix_cache_queries"] == 0
    assert pages.num_free_pages == pages.num_pages
    g = torch.Generator().manual_seed(0)
    opening = torch.randint(2, 95, (64,), generator=g).tolist()
    prompts = [{"prompt_token_ids": opening + [3 + i] * (i + 1)} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    first = llm.generate(prompts[:1], params, use_tqdm=False)[0]
    again = llm.generate(prompts[:1], params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 64
    burst = llm.generate(prompts[1:], params, use_tqdm=False)
    assert [o.num_cached_tokens for o in burst] == [64] * 3
