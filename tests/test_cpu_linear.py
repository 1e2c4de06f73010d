"""Float32 linears through oneDNN on the CPU: the same products as `F.linear` (the reference path), switched
in place without touching parameters or ties, and never where oneDNN disagrees with the reference. Packed
weights give the same products and follow in-place changes of the weights. A drafter's LM head takes
bfloat16 products where the CPU has them, and the engine's output stays plain decoding's."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from blockspec import LLM, SamplingParams
from blockspec.models import cpu_linear
from blockspec.models.cpu_linear import (BF16Product, OneDNNLinear, draft_head_product, onednn_available,
                                         use_onednn_linears)

from factories import save_drafter_target, save_tiny_model_with_tokenizer

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="oneDNN products unavailable on this CPU build")


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
    assert isinstance(lin, OneDNNLinear) and lin.pack
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
    monkeypatch.setattr(cpu_linear, "_pack", lambda w: w)
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



@needs_onednn
def test_a_packed_weight_follows_in_place_changes_and_survives_a_copy():
    gen = torch.Generator().manual_seed(4)
    lin = nn.Linear(64, 32).requires_grad_(False)
    use_onednn_linears(lin)
    x = torch.randn(9, 64, generator=gen)
    lin(x)  # packs
    with torch.no_grad():
        lin.weight.mul_(2.0)  # an optimizer step or load_state_dict changes the weight like this
    assert torch.allclose(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-4)
    twin = copy.deepcopy(lin)  # the packed copy is not copied; the twin packs its own
    assert torch.allclose(twin(x), lin(x), rtol=1e-6, atol=1e-6)


@needs_onednn
def test_a_model_too_large_for_a_second_copy_is_not_packed(monkeypatch):
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    monkeypatch.setattr(cpu_linear, "PACK_MAX_BYTES", 64 * 64 * 4)  # room for one weight, not both
    assert use_onednn_linears(model) == 2
    assert not any(m.pack for m in model)
    x = torch.randn(3, 64)
    assert torch.allclose(model(x), F.linear(F.linear(x, model[0].weight, model[0].bias), model[1].weight,
                                              model[1].bias), rtol=1e-5, atol=1e-4)


needs_bf16 = pytest.mark.skipif(not cpu_linear.bf16_products(), reason="this CPU has no bfloat16 products")
DRAFTERS = Path(__file__).parent / "fixtures" / "drafters"


@needs_bf16
def test_a_bfloat16_product_is_the_product_of_the_rounded_operands_and_follows_its_weight():
    gen = torch.Generator().manual_seed(5)
    w, x = torch.randn(300, 64, generator=gen), torch.randn(2, 5, 64, generator=gen)
    product = BF16Product(w)
    for _ in range(2):  # the second time after an in-place change of the weight
        y = product(x)
        ref = F.linear(x.bfloat16().double(), w.bfloat16().double())
        assert y.dtype == torch.bfloat16 and y.shape == (2, 5, 300)
        assert ((y.double() - ref).abs() <= ref.abs() * 2**-7 + 1e-4).all()  # one rounding to bfloat16
        assert not torch.equal(y.float(), F.linear(x, w))  # not the float32 product
        w.mul_(3.0)
    assert torch.equal(pickle.loads(pickle.dumps(product))(x), product(x))  # packs its own copy again


def test_a_drafter_head_is_bfloat16_only_where_the_cpu_multiplies_it(monkeypatch):
    head = nn.Linear(4, 8, bias=False)
    monkeypatch.setattr(cpu_linear, "bf16_products", lambda: False)
    assert draft_head_product(head) is None
    monkeypatch.setattr(cpu_linear, "bf16_products", lambda: True)
    assert isinstance(draft_head_product(head), BF16Product)
    assert draft_head_product(nn.Linear(4, 8)) is None  # a bias: the head's own product
    shard = type("VocabParallelLMHead", (nn.Module,), {})()  # a rank's shard gathers across ranks
    shard.weight, shard.bias = head.weight, None
    assert draft_head_product(shard) is None
    monkeypatch.setattr(cpu_linear, "PACK_MAX_BYTES", head.weight.numel())  # no room for the copy
    assert draft_head_product(head) is None
    monkeypatch.setattr(cpu_linear, "PACK_MAX_BYTES", 2 << 30)
    monkeypatch.setattr(cpu_linear, "DRAFT_HEAD_BF16", False)
    assert draft_head_product(head) is None


@needs_bf16
@pytest.mark.parametrize("method", ["dflash", "dspark_vanilla"])
def test_the_cpu_engine_drafts_through_the_bfloat16_head_and_decodes_as_plain(tmp_path, method):
    target = save_drafter_target(tmp_path / "target")
    spec = {"method": method.split("_")[0], "model": str(DRAFTERS / method), "adaptive_draft_length": False}
    llm = LLM(str(target), device="cpu", seed=0, speculative_config=spec)
    drafter = llm.engine.proposer.drafter
    assert isinstance(drafter.head_product, BF16Product) and not drafter.plain_target_head
    calls = []
    bf16 = drafter.head_product
    drafter.head_product = lambda h: calls.append(h.shape) or bf16(h)
    prompt = {"prompt_token_ids": [3, 4, 5, 6]}
    params = dict(temperature=0, max_tokens=24, ignore_eos=True)
    fast = llm.generate(prompt, SamplingParams(**params), use_tqdm=False)[0].outputs[0].token_ids
    plain = llm.generate(prompt, SamplingParams(**params, use_speculation=False), use_tqdm=False)[0].outputs[0].token_ids
    assert calls and fast == plain
    assert llm.get_stats()["num_drafts"] > 0
