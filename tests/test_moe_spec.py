"""Speculative decoding on a mixture-of-experts target: what only MoE targets need.

Every exactness check of test_spec.py (greedy, seeded sampling, probabilistic drafts, stops,
preemption, steps launched ahead) also runs there on Qwen3-MoE and Qwen2-MoE targets of the drafter
fixtures' shape. Here: the negative control for routing (a step whose rows' routing mixes must part
from plain decoding), and on a GPU the fused MoE kernels against the CPU reference and the CUDA graphs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from blockspec import LLM, SamplingParams
from factories import save_moe_target
from test_spec import FIXTURES, add_oracle, prompts, run

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen2_moe"])
def target(request, tmp_path_factory) -> Path:
    return save_moe_target(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def plain(target) -> LLM:
    return LLM(str(target), device="cpu", max_model_len=128)


def spec_llm(target: Path, method: str, fixture: str, **spec) -> LLM:
    spec.setdefault("adaptive_draft_length", False)  # every step verifies the whole block
    return LLM(str(target), device="cpu", dtype="float32", max_model_len=128,
               speculative_config={"method": method, "model": str(FIXTURES / fixture), **spec})


def test_routing_that_mixes_a_steps_rows_is_caught(target, plain):
    """Negative control: under the benchmark's locality routing model (a verify step's rows routed by a
    model of their request's step, not by their own logits alone) the outputs part from plain decoding."""
    from blockspec.bench.expert_union import set_routing

    ps = prompts(4, seed=0)
    expected = run(plain, ps, GREEDY)
    llm = spec_llm(target, "dflash", "dflash")
    add_oracle(llm, {tuple(p["prompt_token_ids"]): e for p, e in zip(ps, expected)}, corrupt=0.15)
    set_routing(llm.engine.model, "local")
    assert run(llm, ps, GREEDY) != expected


# ---------------------------------------------------------------------------------------- GPU
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
def test_kernel_path_logits_equal_the_cpu_reference(target):
    """The fused MoE kernels inside the fused decoder path (Triton attention: few rows fold the norms and
    residual adds into the products) against the CPU reference, fp32: a prefill, a decode row, a
    5-row verify."""
    from blockspec.models.kv_cache import causal_meta
    from blockspec.models.loader import load_target

    ids = (torch.arange(40) * 7 % 90 + 2).view(1, -1)
    out = {}
    for device in ("cpu", "cuda"):
        model, _ = load_target(target, "float32", device, max_positions=256)
        model.attention_backend = "triton" if device == "cuda" else "sdpa"
        cache = model.new_cache(2, 64)
        logits, start = [], 0
        for n in (34, 1, 5):
            meta = causal_meta([1], [start], [n], n, cache.trash, device, layer_types=model.config.layer_types)
            logits.append(model.compute_logits(model(ids[:, start: start + n].to(device), meta, cache)[0]).cpu())
            start += n
        out[device] = torch.cat(logits, dim=1)
    assert (out["cuda"] - out["cpu"]).abs().max() < 1e-4


@pytest.mark.gpu
@needs_cuda
def test_cuda_graphs_keep_plain_and_speculative_tokens_exact(target):
    ps = prompts(4, seed=0)
    eager = LLM(str(target), device="cuda", dtype="float32", max_model_len=128)
    eager.engine.runner.use_graphs = False
    plain = LLM(str(target), device="cuda", dtype="float32", max_model_len=128)
    want = run(eager, ps, GREEDY)
    assert run(plain, ps, GREEDY) == want
    sampled = SamplingParams(temperature=0.8, seed=5, max_tokens=24, ignore_eos=True)
    want_sampled = run(plain, ps, sampled)
    for method, fixture in (("dflash", "dflash"), ("dspark", "dspark_vanilla")):
        spec = {"method": method, "model": str(FIXTURES / fixture), "adaptive_draft_length": False}
        llm = LLM(str(target), device="cuda", dtype="float32", max_model_len=128, speculative_config=spec)
        assert run(llm, ps, GREEDY) == want
        # accepted drafts too: the oracle replaces Proposer.propose, which a chained (asynchronous) step skips
        oracle = LLM(str(target), device="cuda", dtype="float32", max_model_len=128, speculative_config=spec,
                     async_scheduling=False)
        add_oracle(oracle, {tuple(p["prompt_token_ids"]): e for p, e in zip(ps, want)}, corrupt=0.15)
        assert run(oracle, ps, GREEDY) == want
        assert oracle.get_stats()["mean_acceptance_length"] > 2.0
        assert run(llm, ps, sampled) == want_sampled
