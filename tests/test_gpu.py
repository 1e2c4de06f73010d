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
    eager.engine.proposer.graphs = None
    plain = LLM(str(target), device="cuda", dtype="float32", max_model_len=256)
    a = [o.outputs[0].token_ids for o in graphed.generate(prompts, params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    c = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert graphed.engine.proposer.graphs.graphs and a == b == c
    ga, ea = graphed.get_metrics(), eager.get_metrics()
    assert ga["num_accepted_tokens_per_pos"] == ea["num_accepted_tokens_per_pos"]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "sdpa"])
def test_warmup_captures_every_graph_serving_needs(tmp_path, backend):
    """After LLM start-up no request captures a graph: every batch size up to max_num_seqs, prompt
    length and context length replays one captured at warm-up."""
    from pathlib import Path

    from blockspec.engine.runner import CAPTURES

    target = save_drafter_target(tmp_path / "t")
    spec = {"method": "dflash", "model": str(Path(__file__).parent / "fixtures" / "drafters" / "dflash")}
    llm = LLM(str(target), device="cuda", dtype="float32", max_model_len=300, max_num_seqs=8,
              speculative_config=spec, attention_backend=backend)
    assert llm.engine.num_steps == 0 and llm.engine.num_generated == 0  # warm-up left no trace
    before = CAPTURES[0]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for batch in (1, 3, 8):
        prompts = [{"prompt_token_ids": [2 + i % 90 for i in range(n)]} for n in (3, 30, 11, 250, 5, 60, 17, 2)[:batch]]
        llm.generate(prompts, params, use_tqdm=False)
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, use_speculation=False)
    llm.generate([{"prompt_token_ids": [3, 4, 5]}], plain, use_tqdm=False)
    assert CAPTURES[0] == before
