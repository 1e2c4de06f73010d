"""Float32 linears through oneDNN on the CPU: the same products as `F.linear` (the reference path), switched
in place without touching parameters or ties, and never where oneDNN disagrees with the reference. The
drafts' bf16 vocabulary head: a bf16 rounding of the head, used only where bf16 products are native and
agree, and never changing what the engine emits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from blockspec import LLM, SamplingParams
from blockspec.models import cpu_linear
from blockspec.models.cpu_linear import (BF16Linear, OneDNNLinear, bf16_draft_head, native_bf16, onednn_available,
                                          use_onednn_linears)

from factories import save_drafter_target, save_tiny_model_with_tokenizer

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="oneDNN products unavailable on this CPU build")
needs_bf16 = pytest.mark.skipif(not native_bf16(), reason="no native bf16 products on this CPU")
DRAFTERS = Path(__file__).parent / "fixtures" / "drafters"


@needs_onednn
@pytest.mark.parametrize("shape", [(1, 64), (9, 64), (2, 5, 64), (0, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_linear_matches_the_reference(shape, bias):
    gen = torch.Generator().manual_seed(1)
    lin = nn.Linear(64, 300, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(300, 64, generator=gen))
    x = torch.randn(shape, generator=gen)
    ref = F.linear(x, lin.weight, lin.bias)
    use_onednn_linears(lin)
    assert isinstance(lin, OneDNNLinear)
    out = lin(x)
    assert out.shape == ref.shape and torch.allclose(out, ref, rtol=1e-5, atol=1e-4)
    assert torch.allclose(lin(x.transpose(-1, -2).contiguous().transpose(-1, -2)), ref, rtol=1e-5, atol=1e-4)


@needs_onednn
def test_only_plain_float32_cpu_linears_switch_and_ties_hold():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(50, 16)
            self.head = nn.Linear(16, 50, bias=False)
            self.head.weight = self.embed.weight
            self.low = nn.Linear(16, 16).to(torch.bfloat16)

    m = Tied()
    assert use_onednn_linears(m) == 1
    assert type(m.head) is OneDNNLinear and m.head.weight is m.embed.weight
    assert type(m.low) is nn.Linear


def test_a_oneDNN_that_disagrees_with_the_reference_is_not_used(monkeypatch):
    """The negative control: a oneDNN product that is off by a little fails the self-check, and nothing
    switches."""
    monkeypatch.setattr(cpu_linear, "_onednn_linear", lambda x, w, b: F.linear(x, w, b) * 1.001)
    onednn_available.cache_clear()
    try:
        assert not onednn_available()
        assert use_onednn_linears(nn.Linear(4, 4)) == 0
    finally:
        onednn_available.cache_clear()


@needs_onednn
def test_the_cpu_engine_decodes_through_onednn_as_through_the_reference(tmp_path):
    path = save_tiny_model_with_tokenizer(tmp_path / "m")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(str(path), device="cpu", seed=0)
    assert any(type(m) is OneDNNLinear for m in llm.engine.model.modules())
    fast = llm.generate(["hello world"], params, use_tqdm=False)[0].outputs[0].token_ids
    for m in llm.engine.model.modules():
        if type(m) is OneDNNLinear:
            m.__class__ = nn.Linear
    assert llm.generate(["hello world"], params, use_tqdm=False)[0].outputs[0].token_ids == fast


@needs_onednn
def test_a_switched_linear_still_trains():
    """oneDNN's product has no backward: a switched module that autograd records must give the reference's
    gradients, not none."""
    gen = torch.Generator().manual_seed(2)
    ref, lin = nn.Linear(32, 8), nn.Linear(32, 8)
    lin.load_state_dict(ref.state_dict())
    use_onednn_linears(lin)
    x = torch.randn(5, 32, generator=gen)
    ref(x).square().sum().backward()
    lin(x).square().sum().backward()
    assert lin.weight.grad is not None and torch.allclose(lin.weight.grad, ref.weight.grad, rtol=1e-5, atol=1e-5)


@needs_bf16
def test_the_bf16_draft_head_is_the_heads_bf16_rounding():
    gen = torch.Generator().manual_seed(3)
    lin = nn.Linear(64, 300, bias=False).requires_grad_(False)
    lin.weight.copy_(torch.randn(300, 64, generator=gen))
    head = bf16_draft_head(lin)
    assert isinstance(head, BF16Linear)
    x = torch.randn(9, 64, generator=gen)
    out = head(x)
    rounded = F.linear(x.bfloat16().float(), lin.weight.bfloat16().float())  # bf16 operands, fp32 sums
    assert out.dtype == torch.float32 and torch.allclose(out, rounded, rtol=2e-2, atol=5e-2)
    assert not torch.equal(out, F.linear(x, lin.weight))  # it is not the fp32 product
    assert bf16_draft_head(nn.Linear(64, 8).to(torch.bfloat16)) is None and bf16_draft_head(nn.Identity()) is None


def test_a_bf16_product_that_disagrees_is_not_used(monkeypatch):
    """The negative control: fp32 products agree, bf16 ones are 20 % off: no bf16 head is made."""
    def product(x, w, b):
        out = F.linear(x.float(), w.float(), None if b is None else b.float())
        return out if x.dtype == torch.float32 else (out * 1.2).to(x.dtype)

    monkeypatch.setattr(cpu_linear, "_onednn_linear", product)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    onednn_available.cache_clear()
    native_bf16.cache_clear()
    try:
        assert onednn_available() and not native_bf16()
        assert bf16_draft_head(nn.Linear(64, 8)) is None
    finally:
        onednn_available.cache_clear()
        native_bf16.cache_clear()


@needs_bf16
@pytest.mark.parametrize("method, fixture", [("dflash", "dflash"), ("dspark", "dspark_vanilla")])
def test_the_cpu_engine_drafts_through_the_bf16_head_and_emits_what_plain_decoding_does(tmp_path, method, fixture):
    target = save_drafter_target(tmp_path / "target")
    llm = LLM(str(target), device="cpu", dtype="float32", max_model_len=160, seed=0, speculative_config={
        "method": method, "model": str(DRAFTERS / fixture), "adaptive_draft_length": False})
    drafter = llm.engine.proposer.drafter
    assert isinstance(drafter.head_for_drafts, BF16Linear) and not drafter.plain_target_head
    prompts = [{"prompt_token_ids": list(range(5 + i, 25 + 2 * i))} for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    spec = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    plain = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, use_speculation=False),
                         use_tqdm=False)
    assert spec == [o.outputs[0].token_ids for o in plain]
    assert llm.get_stats()["num_drafts"] > 0
