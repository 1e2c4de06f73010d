"""GPU-only checks: the CUDA-graph path against the eager reference path (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from blockspec import LLM, SamplingParams
from factories import save_drafter_target, save_tiny

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
def test_cuda_graph_decode_equals_eager(tmp_path):
    path = save_tiny(tmp_path / "m", "qwen3", seed=2)
    prompts = [{"prompt_token_ids": list(range(2, 2 + n))} for n in (3, 40, 11)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    graphed = LLM(str(path), device="cuda", dtype="float32", max_model_len=256)
    eager = LLM(str(path), device="cuda", dtype="float32", max_model_len=256)
    eager.engine.runner.use_graphs = False
    a = [o.outputs[0].token_ids for o in graphed.generate(prompts, params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    assert graphed.engine.runner.graphs and a == b


@pytest.mark.gpu
@pytest.mark.parametrize("method, fixture", [("dflash", "dflash"), ("dspark", "dspark_vanilla")])
def test_cuda_graph_draft_step_equals_eager(tmp_path, method, fixture):
    """Graphed draft steps (context append + block + drafts) give the eager path's drafts: same
    acceptance counts, and output equal to plain decoding."""
    from pathlib import Path

    target = save_drafter_target(tmp_path / "t")
    spec = {"method": method, "model": str(Path(__file__).parent / "fixtures" / "drafters" / fixture),
            "adaptive_draft_length": False}
    prompts = [{"prompt_token_ids": list(range(2, 2 + n))} for n in (3, 30, 11)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    graphed = LLM(str(target), device="cuda", dtype="float32", max_model_len=256, speculative_config=spec)
    eager = LLM(str(target), device="cuda", dtype="float32", max_model_len=256, speculative_config=spec)
    eager.engine.proposer.graphs.use_graphs = False  # the same tensor code, run eagerly
    plain = LLM(str(target), device="cuda", dtype="float32", max_model_len=256)
    a = [o.outputs[0].token_ids for o in graphed.generate(prompts, params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    c = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert graphed.engine.proposer.graphs.graphs and a == b == c
    ga, ea = graphed.get_metrics(), eager.get_metrics()
    assert ga["num_accepted_tokens_per_pos"] == ea["num_accepted_tokens_per_pos"]
    assert ga["num_spec_steps_chained"] > 0  # graphed steps launched from device results ran too


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "sdpa"])
def test_warmup_captures_every_graph_serving_needs(tmp_path, backend):
    """After LLM start-up no request captures a graph or compiles a kernel: every batch size up to
    max_num_seqs, prompt length and context length, greedy or sampled, replays what warm-up made."""
    from pathlib import Path

    from blockspec.engine.runner import CAPTURES

    target = save_drafter_target(tmp_path / "t")
    spec = {"method": "dflash", "model": str(Path(__file__).parent / "fixtures" / "drafters" / "dflash")}
    llm = LLM(str(target), device="cuda", dtype="float32", max_model_len=300, max_num_seqs=8,
              speculative_config=spec, attention_backend=backend)
    assert llm.engine.num_steps == 0 and llm.engine.num_generated == 0  # warm-up left no trace
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
    from blockspec.models import triton_attention, triton_ops
    from blockspec.sample import gumbel_kernel

    kernels = [triton_attention._block_attention, triton_ops._rms_norm, triton_ops._silu_mul,
               triton_ops._qkv_rope_store, triton_ops._skinny_linear, gumbel_kernel._gumbel_argmax]
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
def test_a_cache_plan_beyond_the_gpu_is_refused_before_allocating(tmp_path):
    """max_num_seqs x max_model_len beyond the card's memory: a clear error at start-up naming the
    numbers, not a CUDA out-of-memory error from inside an allocation."""
    from blockspec.config import ConfigError

    target = save_drafter_target(tmp_path / "t")
    with pytest.raises(ConfigError, match="sequences of that length fit"):
        LLM(str(target), device="cuda", dtype="float32", max_model_len=250, max_num_seqs=10**7)
