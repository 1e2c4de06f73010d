"""Tensor parallelism on CPU: 2 gloo ranks (spawned processes; 1 thread each, from conftest's 1) must produce exactly the
tokens of the single-process engine, greedy and seeded-sampled, with and without DFlash speculation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from factories import save_drafter_target, save_tiny

from blockspec import LLM, SamplingParams
from blockspec.config import ConfigError
from blockspec.errors import RequestError
from blockspec.models.loader import load_target
from blockspec.parallel import shard_model
from blockspec.parallel import tp as tp_module

DFLASH = str(Path(__file__).parent / "fixtures" / "drafters" / "dflash")
SPEC = {"method": "dflash", "model": DFLASH, "adaptive_draft_length": False}
ADAPTIVE = {"method": "dflash", "model": DFLASH}  # the policy decides from each rank's clock: rank 0's counts
PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 3, 44, 2, 17, 30]},
           {"prompt_token_ids": [70, 12]}]
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
SAMPLED = [SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=s, ignore_eos=True) for s in (1, 2, 3)]
HOT = SamplingParams(max_tokens=40, temperature=1.5, seed=4, ignore_eos=True)  # the random drafter gets some accepted


def tokens(outputs: list) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def reference(path: Path, spec: dict | None, params) -> list[list[int]]:
    return tokens(LLM(path, seed=0, speculative_config=spec).generate(PROMPTS, params, use_tqdm=False))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> Path:
    """Shaped to fit the DFlash drafter fixture; 2 KV heads split one per rank."""
    return save_drafter_target(tmp_path_factory.mktemp("q3"))


@pytest.mark.parametrize("spec", [None, SPEC, ADAPTIVE], ids=["plain", "dflash", "dflash adaptive"])
def test_tp2_matches_tp1_greedy_and_seeded(qwen3, spec):
    ref_greedy = reference(qwen3, spec, GREEDY)
    ref_sampled = reference(qwen3, spec, SAMPLED)
    with LLM(qwen3, tensor_parallel_size=2, seed=0, speculative_config=spec) as tp:
        assert tokens(tp.generate(PROMPTS, GREEDY, use_tqdm=False)) == ref_greedy
        assert tokens(tp.generate(PROMPTS, SAMPLED, use_tqdm=False)) == ref_sampled
        if spec is SPEC:  # drafts, acceptances and tokens identical to the single-process run (with a
            # fixed K: an adaptive policy's choices follow the clock of the process that decides)
            ref = LLM(qwen3, seed=0, speculative_config=spec)
            ref_hot = tokens(ref.generate(PROMPTS, HOT, use_tqdm=False))
            before = tp.get_stats()
            assert tokens(tp.generate(PROMPTS, HOT, use_tqdm=False)) == ref_hot
            after, want = tp.get_stats(), ref.get_stats()
            assert want["num_accepted_tokens"] > 0
            for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
                assert after[key] - before[key] == want[key]
        # A bad request fails on every rank alike, before any collective; the ranks stay usable.
        with pytest.raises(RequestError, match="outside"):
            tp.generate([{"prompt_token_ids": [500]}], GREEDY, use_tqdm=False)
        assert tokens(tp.generate(PROMPTS[:1], GREEDY, use_tqdm=False)) == ref_greedy[:1]
    if spec is not None:  # speculation is exact: the same tokens as plain decoding
        assert ref_greedy == reference(qwen3, None, GREEDY)


DSPARK_BUDGET = {"method": "dspark", "model": str(Path(DFLASH).parent / "dspark_vanilla"),
                 "adaptive_verification": True}


def _rank_whose_verify_rows_cost_more(rank: int, *args) -> None:
    """Rank 1's clock prices verify rows higher than rank 0's (a slower or busier device): its profile runs the
    same forwards (their collectives match); only the times it reports differ."""
    if rank == 1:
        import blockspec.speculative.proposer as proposer

        real = proposer.profile_verify
        proposer.profile_verify = lambda runner, batch, rows: (real(runner, batch, rows), 0.001 * rows ** 3)[1]
    return tp_module._rank_main(rank, *args)


def test_dspark_verify_budget_is_rank0s(qwen3, monkeypatch):
    """DSpark's load-aware verify budget prices rows by each process's clock: ranks whose clocks differ verify
    rank 0's draft counts (each verified its own, and their collectives parted: a rank aborted)."""
    monkeypatch.setattr(tp_module, "_rank_main", _rank_whose_verify_rows_cost_more)
    prompts = [{"prompt_token_ids": [5 + i, 6, 7, 8 + i, 9]} for i in range(4)]
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    want = tokens(LLM(qwen3, seed=0).generate(prompts, params, use_tqdm=False))
    with LLM(qwen3, tensor_parallel_size=2, seed=0, speculative_config=DSPARK_BUDGET) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.error for o in outs] == [None] * len(prompts) and tokens(outs) == want


MARKED = [91, 5, 6]  # a prompt whose request makes every rank's decode raise


def _decode_fails(when) -> None:
    """Make this rank's decode raise whenever `when(engine, requests)` says so."""
    from blockspec.engine.engine import Engine

    decode = Engine._decode

    def failing(self, decoding):
        if when(self, decoding):
            raise RuntimeError("simulated device fault")
        return decode(self, decoding)

    Engine._decode = failing


def _ranks_failing_on_the_marked_request(rank: int, *args) -> None:
    _decode_fails(lambda engine, reqs: any(r.prompt_token_ids[:3] == MARKED for r in reqs))
    return tp_module._rank_main(rank, *args)


def test_a_step_failing_on_every_rank_is_recovered_by_all_alike(qwen3, monkeypatch):
    """A request whose rows make every rank's step fail fails alone, on every rank the same way; the requests
    beside it give the tokens of a single process, and the ranks serve the next call."""
    monkeypatch.setattr(tp_module, "_rank_main", _ranks_failing_on_the_marked_request)
    want = tokens(LLM(qwen3, seed=0).generate(PROMPTS, GREEDY, use_tqdm=False))
    with LLM(qwen3, tensor_parallel_size=2, seed=0) as llm:
        outs = llm.generate([PROMPTS[0], {"prompt_token_ids": MARKED}, *PROMPTS[1:]], GREEDY, use_tqdm=False)
        assert outs[1].outputs[0].finish_reason == "error" and "error id" in outs[1].error
        assert [o.error for o in outs[::2]] == [None, None] and tokens(outs[:1] + outs[2:]) == want
        assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == want


def _rank_1_faults_at_its_third_decode(rank: int, *args) -> None:
    tp_module.FAILED_ALIKE_WAIT_S = 2.0  # how long rank 1 waits for rank 0 to fail too (it never does)
    if rank == 1:
        calls = iter(range(10**6))
        _decode_fails(lambda engine, reqs: next(calls) == 2)
    return tp_module._rank_main(rank, *args)


def _rank_1_dies_at_its_third_decode(rank: int, *args) -> None:
    if rank == 1:
        import os

        calls = iter(range(10**6))
        _decode_fails(lambda engine, reqs: next(calls) == 2 and os._exit(9))
    return tp_module._rank_main(rank, *args)


@pytest.mark.parametrize("fault", ["fails", "dies"])
def test_a_step_failing_on_one_rank_only_closes_the_ranks_with_an_error(qwen3, monkeypatch, capfd, fault):
    """A step that fails on rank 1 only (its device's fault), or a rank 1 that dies mid-run: rank 0 (or 1)
    recovering alone would pair its retry's collectives with the other's next step's (the ranks parted, and
    generate waited out the group's 10-minute timeout, or failed every request). The call fails naming rank 1,
    a rank whose step failed prints its cause, and later calls say the ranks are gone."""
    monkeypatch.setattr(tp_module, "_rank_main", _rank_1_faults_at_its_third_decode if fault == "fails"
                        else _rank_1_dies_at_its_third_decode)
    llm = LLM(qwen3, tensor_parallel_size=2, seed=0)
    try:
        said = "each rank whose step failed printed why" if fault == "fails" else r"rank\(s\) \[1\] died \(exit codes \[9\]"
        with pytest.raises(RuntimeError, match=rf"the ranks no longer step in lockstep.*{said}"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        if fault == "fails":
            assert "rank 1's step failed (RuntimeError: simulated device fault), and not on every rank" in \
                capfd.readouterr().err
        with pytest.raises(RuntimeError, match="tensor-parallel rank"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        llm.close()


class NotebookBar:
    """A progress bar class the ranks cannot import once it is said to live in __main__ (defined in a notebook
    cell or under `python -c`)."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_call_the_ranks_cannot_read_is_an_error_and_a_dead_rank_0_is_named(qwen3, monkeypatch):
    """Arguments that pickle in the user's process but cannot be rebuilt in rank 0 are a ConfigError naming
    them, and the ranks serve the next call (rank 0 died, and later calls raised a bare BrokenPipeError); once
    rank 0 has exited, a call names it."""
    import sys

    monkeypatch.setattr(NotebookBar, "__module__", "__main__")
    monkeypatch.setattr(sys.modules["__main__"], "NotebookBar", NotebookBar, raising=False)
    want = tokens(LLM(qwen3, seed=0).generate(PROMPTS[:1], GREEDY, use_tqdm=False))
    with LLM(qwen3, tensor_parallel_size=2, seed=0) as llm:
        with pytest.raises(ConfigError, match="cannot be read by the tensor-parallel ranks"):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=NotebookBar)
        assert tokens(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)) == want
        rank0 = llm.ranks._procs[0]
        rank0.kill()
        rank0.join()
        with pytest.raises(RuntimeError, match=r"rank\(s\) \[0"):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)


def _rank_1_cannot_build(rank: int, *args) -> None:
    if rank == 1:
        def out_of_memory(*a, **kw):
            raise RuntimeError("CUDA out of memory on rank 1 (simulated)")

        tp_module.build_engine = out_of_memory
    return tp_module._rank_main(rank, *args)


def test_a_start_up_error_on_another_rank_than_0_is_printed(qwen3, monkeypatch, capfd):
    """A start-up error of one rank only (its device's memory) is printed by that rank: rank 0, left in a
    collective, reports only that its peer went away."""
    monkeypatch.setattr(tp_module, "_rank_main", _rank_1_cannot_build)
    with pytest.raises(Exception):
        LLM(qwen3, tensor_parallel_size=2, seed=0)
    assert "rank 1 failed to start: RuntimeError: CUDA out of memory on rank 1" in capfd.readouterr().err


def boost_biases(path: Path, scale: float = 25.0) -> None:
    """Make the checkpoint's biases large enough that counting one world_size times would change tokens."""
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    state = load_file(file)
    save_file({k: v * scale if k.endswith(".bias") else v for k, v in state.items()}, file, metadata={"format": "pt"})


@pytest.mark.parametrize("family,kw", [
    ("qwen2", {"vocab": 97, "tie": True}),  # q/k/v biases; tied embedding; vocab not divisible (padded rows)
    ("llama", {"vocab": 96, "attention_bias": True, "mlp_bias": True}),  # o_proj / down_proj biases added once
], ids=["qwen2-tied-odd-vocab", "llama-all-biases"])
def test_tp2_biases_and_tied_embeddings(tmp_path, family, kw):
    path = save_tiny(tmp_path, family, seed=3, hidden=32, layers=3, heads=4, kv_heads=2, **kw)
    boost_biases(path)
    ref = reference(path, None, GREEDY)
    tp = LLM(path, seed=0, tensor_parallel_size=2)  # the vLLM-shaped entry point, served by two ranks
    assert tp.ranks is not None and tp.ranks.world_size == 2
    with tp:
        assert tokens(tp.generate(PROMPTS, GREEDY, use_tqdm=False)) == ref


def test_kv_heads_must_divide_world_size(qwen3):
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        LLM(qwen3, tensor_parallel_size=3)
    with pytest.raises(ConfigError, match="no option max_num_sequences"):  # checked before any rank is spawned
        LLM(qwen3, tensor_parallel_size=2, max_num_sequences=4)
    model, _ = load_target(qwen3, "float32", "cpu")
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        shard_model(model, 0, 4)
    assert model.layers[0].self_attn.kv_heads == 2  # nothing was changed before the check


def test_world_size_one_is_identity(qwen3):
    model, _ = load_target(qwen3, "float32", "cpu")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    shard_model(model, 0, 1)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_an_idle_tp_server_meets_its_ranks_every_heartbeat(qwen3, monkeypatch):
    """Rank 0 of an idle tensor-parallel server broadcasts an empty command list every heartbeat, so
    the other ranks, waiting in that collective, never wait past the group's timeout; no busy loop
    between heartbeats; a Stop reaches every rank and ends the loop."""
    import threading
    import time
    from multiprocessing import Pipe

    from blockspec.engine.loop import Loaded, Stop
    from blockspec.parallel import tp

    llm = LLM(qwen3, seed=0)
    meets: list[tuple[float, list]] = []
    monkeypatch.setattr(tp.dist, "broadcast_object_list",
                        lambda msg, src, group: meets.append((time.monotonic(), list(msg[0]))))
    monkeypatch.setattr(tp, "SERVE_HEARTBEAT_S", 0.05)
    ours, theirs = Pipe()
    loop = threading.Thread(target=tp._serve, args=(llm.engine, llm.inputs, None, theirs), daemon=True)
    loop.start()
    assert isinstance(ours.recv(), Loaded)
    start = time.monotonic()
    deadline = start + 300  # a busy machine meets less often, never more
    while sum(not cmds for _, cmds in list(meets)) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    elapsed = time.monotonic() - start
    idle = [cmds for _, cmds in list(meets) if not cmds]
    assert 4 <= len(idle) <= elapsed / 0.05 + 2, (len(idle), elapsed)  # a heartbeat, and no busy loop
    ours.send(Stop())
    loop.join(300)
    assert not loop.is_alive() and isinstance(meets[-1][1][-1], Stop)


def _rank_with_its_own_plan(rank: int, init_file: str, model: str, plans: list[int], out: str) -> None:
    """A rank whose memory would allow `plans[rank]` pages: write the pages its engine holds."""
    import torch.distributed as dist

    from blockspec.engine import memory
    from blockspec.config import EngineArgs
    from blockspec.parallel.tp import rank_engine

    torch.set_num_threads(1)
    plan = memory.plan_pages  # a plan given (num_kv_pages) stands; one from memory differs by rank
    memory.plan_pages = lambda model, drafter, config, table_len: plans[rank] \
        if config.num_kv_pages is None else plan(model, drafter, config, table_len)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        setup = rank_engine(rank, 2, None, model, EngineArgs(seed=0, speculative_config=SPEC, device="cpu"))
        Path(out, str(rank)).write_text(str(setup.engine.pages.num_pages))
    finally:
        dist.destroy_process_group()


def test_ranks_whose_memory_differs_hold_the_pages_the_least_allows(qwen3, tmp_path, monkeypatch):
    """Each rank plans its KV pages from its own free memory; if they kept their own plans, one rank
    would preempt where the other does not and their steps would part. Every rank takes the fewest."""
    import torch.multiprocessing as mp

    if Path("/sys/class/net/lo").exists():  # the ranks meet on loopback, as an LLM's ranks do
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(_rank_with_its_own_plan, args=(str(tmp_path / "init"), str(qwen3), [40, 25], str(tmp_path)), nprocs=2)
    assert [(tmp_path / str(rank)).read_text() for rank in (0, 1)] == ["25", "25"]


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="counts threads in /proc")
def test_destroying_a_rank_s_group_stops_its_threads(tmp_path):
    """destroy_process_group must free a rank's gloo group and stop its threads. A group held on (by
    torch.distributed.nn.functional's defaults, `group=group.WORLD`, when that module is first imported
    after the group exists, as building a model on the meta device does) kept them running into the
    interpreter's shutdown, where one dropping its last collective's tensors aborted the rank at exit
    ("terminate called without an active exception"): blockspec.parallel imports it first."""
    import json
    import subprocess
    import sys

    code = """if True:
        import glob, json, os, sys
        import torch.distributed as dist
        from blockspec.parallel.tp import join_group
        threads = lambda: len(glob.glob(f"/proc/{os.getpid()}/task/*"))
        alone = threads()
        join_group(0, 1, sys.argv[1], "cpu")
        import torch.distributed.nn.functional  # what the first meta-device op imports (via torch._dynamo)
        grouped = threads()
        dist.destroy_process_group()
        print(json.dumps([alone, grouped, threads()]))
    """
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path / "init")], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    alone, grouped, after = json.loads(run.stdout.splitlines()[-1])
    assert grouped > alone and after == alone, (alone, grouped, after)  # the group's threads, then none


def _ending_rank(rank: int, world_size: int, init_file: str, conn, rank1_code: int) -> None:
    """Rank 1 ends at once (`rank1_code`); rank 0 answers a moment later, or not at all if rank 1 crashed."""
    import os
    import time

    if rank:
        os._exit(rank1_code)
    time.sleep(1.0)
    if rank1_code == 0:
        conn.send(("ok", 42))
    else:
        time.sleep(300)  # alive, silent: only rank 1's crash can end the wait


def _sigint_reporting_rank(rank: int, world_size: int, init_file: str, conn) -> None:
    """Rank 0 answers whether SIGINT was ignored when its target began (before anything of blockspec ran)."""
    import signal

    if conn is not None:
        conn.send(("ok", signal.getsignal(signal.SIGINT) is signal.SIG_IGN))


def test_rank_processes_start_with_ctrl_c_ignored():
    """A terminal's Ctrl-C reaches the ranks too: they ignore it from their interpreter's start (a rank still
    importing torch printed a traceback), while the user's process, which handles it, keeps its handler."""
    import signal

    from blockspec.parallel.tp import RankProcesses

    before = signal.getsignal(signal.SIGINT)
    ranks = RankProcesses(_sigint_reporting_rank, 1, ())
    try:
        assert ranks.reply(timeout_s=120) is True
    finally:
        ranks.close()
    assert signal.getsignal(signal.SIGINT) is before


def test_rank_processes_wait_for_rank_0_past_a_clean_exit_and_fail_fast_on_a_crash():
    """A rank other than 0 that ends cleanly before rank 0's answer lands (a sweep's last gather) is no
    failure: the answer is read; one that crashed fails the wait at once."""
    from blockspec.parallel.tp import RankProcesses

    ranks = RankProcesses(_ending_rank, 2, (0,))
    try:
        assert ranks.reply(timeout_s=120) == 42
    finally:
        ranks.close()
    ranks = RankProcesses(_ending_rank, 2, (3,))
    try:
        with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] exited \(codes \[3\]\)"):
            ranks.reply(timeout_s=120)
    finally:
        ranks._procs[0].kill()  # not close()'s 10 s grace: this rank obeys no call
        ranks.close()


@pytest.mark.parametrize("caching", [False, True])
def test_tp2_preempts_in_step_and_gives_one_process_tokens(qwen3, caching):
    """A pool too small for every request: the ranks preempt and resume the same requests at the same
    steps (or their collectives would part), and give the tokens of one process with the same pool,
    which are plain decoding's. With prefix caching the ranks remember and share the same pages."""
    pool = {"num_kv_pages": 9, "kv_page_size": 16, "max_model_len": 64, "enable_prefix_caching": caching}
    want = tokens(LLM(qwen3, seed=0).generate(PROMPTS, HOT, use_tqdm=False))
    ref = LLM(qwen3, seed=0, speculative_config=SPEC, **pool)
    assert tokens(ref.generate(PROMPTS, HOT, use_tqdm=False)) == want
    assert ref.get_stats()["num_preemptions"] > 0
    with LLM(qwen3, tensor_parallel_size=2, seed=0, speculative_config=SPEC, **pool) as tp:
        assert tokens(tp.generate(PROMPTS, HOT, use_tqdm=False)) == want
        assert tp.get_stats()["num_preemptions"] == ref.get_stats()["num_preemptions"]
        counted = [(st["num_prefix_cache_queries"], st["num_prefix_cache_hits"])
                   for st in (ref.get_stats(), tp.get_stats())]
        assert counted[0] == counted[1] and (counted[0][0] > 0) == caching


def test_an_interrupted_tp_call_stops_its_run_and_the_next_call_reads_its_own_reply(qwen3, monkeypatch):
    """Ctrl-C during a tensor-parallel generate (a notebook's interrupt: the user's process only): the
    ranks stop that run, its reply is dropped, and the next calls answer themselves, as one process does
    (the reply used to stay in the pipe, and every later call returned the one before's); so too after a
    Ctrl-C that lands once the call has ended."""
    import _thread
    import threading

    from blockspec.parallel.tp import RankGroup

    long = SamplingParams(max_tokens=480, temperature=0.0, ignore_eos=True)
    want = tokens(LLM(qwen3, seed=0).generate(PROMPTS[:1], GREEDY, use_tqdm=False))
    with LLM(qwen3, tensor_parallel_size=2, seed=0, max_model_len=512) as tp:
        reply = RankGroup.reply

        def interrupt_soon(self, *a, **kw):  # once the long run is under way
            threading.Timer(0.5, _thread.interrupt_main).start()
            monkeypatch.setattr(RankGroup, "reply", reply)
            return reply(self, *a, **kw)

        monkeypatch.setattr(RankGroup, "reply", interrupt_soon)
        with pytest.raises(KeyboardInterrupt):
            tp.generate(PROMPTS[1:] * 8, long, use_tqdm=False)
        assert tp.get_stats()["num_generated_tokens"] < 16 * 480  # stopped, not run to its end
        assert tokens(tp.generate(PROMPTS[:1], GREEDY, use_tqdm=False)) == want
        # a Ctrl-C landing just after a call's reply was read: nothing to stop, and the ranks serve on (they were
        # closed once the interrupt's wait for a reply that never came ran out)
        tp.ranks._drop_reply()
        assert tokens(tp.generate(PROMPTS[:1], GREEDY, use_tqdm=False)) == want


def test_a_tp_llm_nobody_closes_stops_its_ranks_when_collected(qwen3):
    """No rank process or rendezvous directory outlives a tensor-parallel LLM that was never closed."""
    import gc
    import os

    tp = LLM(qwen3, tensor_parallel_size=2, seed=0)
    procs, directory = list(tp.ranks._procs), tp.ranks._dir
    assert os.path.isdir(directory) and all(p.is_alive() for p in procs)
    del tp
    gc.collect()
    assert not any(p.is_alive() for p in procs) and not os.path.exists(directory)
