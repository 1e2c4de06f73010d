"""GPU-only checks: the CUDA-graph path against the eager reference path (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from blockspec import LLM, SamplingParams
from factories import save_tiny

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
