"""The LM heads on the CPU: a drafter's in bfloat16 where the CPU multiplies bfloat16 in hardware, the target's
from a packed float32 copy over more than one row, both through oneDNN only where oneDNN agrees with `F.linear`;
a greedy verify's ids screened through the drafter's bfloat16 copy and decided in float32; the engine's output
stays plain decoding's."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from blockspec import LLM, SamplingParams
from blockspec.models import cpu_linear
from blockspec.models.cpu_linear import (PackedProduct, ScreenedGreedy, bf16_products, draft_head_product,
                                         onednn_available, screened_greedy, verify_head_product)

from factories import save_drafter_target


def test_a_oneDNN_that_disagrees_with_the_reference_is_not_used(monkeypatch):
    """The negative control: a oneDNN product that is off by a little fails the self-check, and no head takes
    it."""
    monkeypatch.setattr(cpu_linear, "_onednn_linear", lambda x, w, b: F.linear(x, w, b) * 1.001)
    monkeypatch.setattr(cpu_linear, "_pack", lambda w: w)
    onednn_available.cache_clear()
    bf16_products.cache_clear()
    try:
        assert not onednn_available() and not bf16_products()
        assert draft_head_product(nn.Linear(4, 8, bias=False)) is None
        assert verify_head_product(nn.Linear(4, 8, bias=False)) is None
    finally:
        onednn_available.cache_clear()
        bf16_products.cache_clear()


needs_onednn = pytest.mark.skipif(not cpu_linear.onednn_available(), reason="oneDNN is not built in or disagrees")
needs_bf16 = pytest.mark.skipif(not cpu_linear.bf16_products(), reason="this CPU has no bfloat16 products")
DRAFTERS = Path(__file__).parent / "fixtures" / "drafters"


@needs_bf16
def test_a_bfloat16_product_is_the_product_of_the_rounded_operands_and_follows_its_weight():
    gen = torch.Generator().manual_seed(5)
    w, x = torch.randn(300, 64, generator=gen), torch.randn(2, 5, 64, generator=gen)
    product = PackedProduct(w, torch.bfloat16)
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
    assert isinstance(draft_head_product(head), PackedProduct)
    assert draft_head_product(nn.Linear(4, 8)) is None  # a bias: the head's own product
    shard = type("VocabParallelLMHead", (nn.Module,), {})()  # a rank's shard gathers across ranks
    shard.weight, shard.bias = head.weight, None
    assert draft_head_product(shard) is None
    monkeypatch.setattr(cpu_linear, "PACK_MAX_BYTES", head.weight.numel())  # no room for the copy
    assert draft_head_product(head) is None
    monkeypatch.setattr(cpu_linear, "PACK_MAX_BYTES", 2 << 30)
    monkeypatch.setattr(cpu_linear, "DRAFT_HEAD_BF16", False)
    assert draft_head_product(head) is None


@needs_onednn
def test_the_packed_float32_head_is_the_float32_product_above_one_row_and_follows_its_weight():
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(3000, 96, generator=gen)
    product = verify_head_product(nn.Linear(96, 3000, bias=False).requires_grad_(False))
    product.weight = w
    one, rows = torch.randn(1, 1, 96, generator=gen), torch.randn(2, 9, 96, generator=gen)
    for _ in range(2):  # the second time after an in-place change of the weight
        assert torch.equal(product(one), F.linear(one, w))  # one row: the head's own product, bit for bit
        y = product(rows)
        assert y.dtype == torch.float32 and y.shape == (2, 9, 3000)
        close = lambda weight: ((y.double() - F.linear(rows.double(), weight.double())).abs()  # noqa: E731
                                <= F.linear(rows, weight).abs() * 1e-5 + 1e-4).all()
        assert close(w) and not close(w * 1.0002)  # the tolerance tells the weight from one 2e-4 off
        w.mul_(3.0)
    assert torch.equal(pickle.loads(pickle.dumps(product))(rows), product(rows))


def test_the_target_head_is_packed_only_where_it_is_one_float32_linear(monkeypatch):
    monkeypatch.setattr(cpu_linear, "onednn_available", lambda: True)
    head = nn.Linear(4, 8, bias=False)
    assert isinstance(verify_head_product(head), PackedProduct) and verify_head_product(head).min_rows == 2
    assert verify_head_product(nn.Linear(4, 8)) is None  # a bias
    assert verify_head_product(nn.Linear(4, 8, bias=False).bfloat16()) is None  # not float32
    shard = type("VocabParallelLMHead", (nn.Module,), {})()
    shard.weight, shard.bias = head.weight, None
    assert verify_head_product(shard) is None
    monkeypatch.setattr(cpu_linear, "PACK_MAX_BYTES", head.weight.numel() * 4 - 1)  # no room for the copy
    assert verify_head_product(head) is None


def near_tie(vocab: int, hidden: int, gap: float, tie: bool, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A head and a row whose two best logits (about 0.1, at two random ids) differ by `gap` or tie exactly (a
    repeated weight row), from unit weight rows in unrelated directions, so rounding the row to bfloat16 moves
    the two logits apart by more than the gap; the head's other logits stay far below."""
    weight = torch.randn(vocab, hidden, generator=g) * 5e-4
    x = torch.randn(hidden, generator=g) * 3

    def at(logit: float) -> torch.Tensor:  # a unit-sized row whose product with x is `logit`
        r = torch.randn(hidden, generator=g) / hidden ** 0.5
        return r - (r @ x) * x / x.norm() ** 2 + logit * x / x.norm() ** 2

    a, b = torch.randperm(vocab, generator=g)[:2].tolist()
    weight[a] = at(0.1)
    weight[b] = weight[a] if tie else at(0.1 + gap)
    return weight, x[None]


@needs_onednn
@pytest.mark.skipif(not bf16_products(), reason="needs bfloat16 products in hardware")
def test_screened_greedy_ids_are_the_float32_argmax_at_near_and_exact_ties(monkeypatch):
    """The screened ids equal the float32 product's argmax (ties to the lowest id) on random rows and on rows
    whose two best logits are 5e-4 apart (either order) or equal, or whose best ties more ids than the screen
    weighs at once; a head that is not bfloat16-exact too.
    Negative control: with a zero error bound only the bfloat16 maximum is a candidate, and near ties then go
    wrong."""
    g = torch.Generator().manual_seed(0)
    cases = [near_tie(128, 64, 5e-4 * (-1) ** i, i % 3 == 0, g) for i in range(48)]
    w = torch.randn(512, 64, generator=g)
    cases += [(w, torch.randn(32, 64, generator=g)), (w.bfloat16().float(), torch.randn(32, 64, generator=g))]
    many, x = near_tie(128, 64, 0.0, True, g)  # more candidates than SCREEN_TOP: a row's best repeated 20 times
    best = int(F.linear(x, many).argmax())
    many[torch.randperm(128, generator=g)[:20]] = many[best].clone()
    cases.append((many, x))
    screens = [(ScreenedGreedy(w, PackedProduct(w, torch.bfloat16)), x, F.linear(x, w).max(dim=-1).indices)
               for w, x in cases]
    assert all(torch.equal(screen(x), want) for screen, x, want in screens)
    monkeypatch.setattr(cpu_linear, "BF16_ROUNDOFF", 0.0)
    assert sum(int((screen(x) != want).sum()) for screen, x, want in screens) >= 3


@needs_onednn
@pytest.mark.skipif(not bf16_products(), reason="needs bfloat16 products in hardware")
def test_screened_greedy_leaves_bad_rows_and_other_heads_to_the_float32_logits():
    """A row with a non-finite value gives None (the float32 logits then mark it -1), and so do more rows than the
    host loop serves; the screen is made only over a bfloat16 copy of the target head's own float32 weight."""
    head = nn.Linear(64, 512, bias=False)
    x = torch.randn(3, 64)
    screen = screened_greedy(head, PackedProduct(head.weight, torch.bfloat16))
    assert isinstance(screen, ScreenedGreedy) and screen(x) is not None
    assert screen(torch.randn(cpu_linear.SCREEN_MAX_ROWS + 1, 64)) is None  # a wide batch: the float32 head
    x[1, 5] = float("inf")
    assert screen(x) is None
    assert screened_greedy(head, None) is None
    assert screened_greedy(head, PackedProduct(head.weight, torch.float32)) is None
    assert screened_greedy(head, PackedProduct(nn.Linear(64, 512, bias=False).weight, torch.bfloat16)) is None


@needs_onednn
def test_a_plain_engine_beside_a_speculative_one_on_the_same_model_decodes_as_alone(tmp_path, monkeypatch):
    """Engines that share one target (a benchmark's, timed in turns) must each take the path it takes alone:
    the speculative engine's screen of its drafter's bfloat16 head is its own, never the plain engine's (whose
    batches would then go through it: another path, other timings)."""
    from blockspec.config import EngineConfig, SpeculativeConfig
    from blockspec.engine.engine import Engine

    spec = {"method": "dflash", "model": str(DRAFTERS / "dflash"), "adaptive_draft_length": False}
    llm = LLM(str(save_drafter_target(tmp_path / "target")), device="cpu", seed=0, speculative_config=spec)
    model, drafter = llm.engine.model, llm.engine.proposer.drafter
    plain = Engine(model, None, EngineConfig(max_model_len=64, max_num_seqs=4))
    fast = Engine(model, None, EngineConfig(max_model_len=64, max_num_seqs=4), SpeculativeConfig(**spec), drafter)
    screened: list[int] = []
    call = ScreenedGreedy.__call__
    monkeypatch.setattr(ScreenedGreedy, "__call__", lambda self, x: screened.append(x.shape[0]) or call(self, x))

    def decode(engine: Engine) -> list[list[int]]:
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        reqs = [engine.add_request(f"r{i}", None, [3 + i, 4, 5], params)[0] for i in range(4)]
        while engine.has_unfinished():
            engine.step()
        return [r.output_ids for r in reqs]

    out = decode(plain)
    assert not screened  # four rows a step, and not one through the other engine's screen
    assert decode(fast) == out and bool(screened) == bf16_products()
    assert isinstance(fast.runner.head_screen, ScreenedGreedy) == bf16_products() and plain.runner.head_screen is None


def _recording(product, rows: list[int]):
    return lambda h: rows.append(h.numel() // h.shape[-1]) or product(h)


@needs_onednn
@pytest.mark.parametrize("method", ["dflash", "dspark_vanilla"])
def test_the_cpu_engine_drafts_and_verifies_through_the_packed_heads_and_decodes_as_plain(tmp_path, method):
    """The target's head packed in float32 (rows above one through it, one row on `F.linear`), the drafter's in
    bfloat16 where the CPU multiplies it, and then a greedy verify's ids screened through the drafter's copy;
    greedy output is plain decoding's, and sampled output (float32 logits) too."""
    target = save_drafter_target(tmp_path / "target")
    spec = {"method": method.split("_")[0], "model": str(DRAFTERS / method), "adaptive_draft_length": False}
    llm = LLM(str(target), device="cpu", seed=0, speculative_config=spec)
    drafter, model, runner = llm.engine.proposer.drafter, llm.engine.model, llm.engine.runner
    assert isinstance(model.head_product, PackedProduct)
    assert isinstance(drafter.head_product, PackedProduct) == bf16_products()
    assert isinstance(runner.head_screen, ScreenedGreedy) == bf16_products()
    assert drafter.plain_target_head == (drafter.head_product is None)
    drafted, verified, screened = [], [], []
    model.head_product = _recording(model.head_product, verified)
    if drafter.head_product is not None:
        drafter.head_product = _recording(drafter.head_product, drafted)
        runner.head_screen = _recording(runner.head_screen, screened)
    prompt = {"prompt_token_ids": [3, 4, 5, 6]}
    outputs = []
    for params in (dict(temperature=0, max_tokens=24, ignore_eos=True),
                   dict(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True)):
        fast = llm.generate(prompt, SamplingParams(**params), use_tqdm=False)[0].outputs[0].token_ids
        plain = llm.generate(prompt, SamplingParams(**params, use_speculation=False),
                             use_tqdm=False)[0].outputs[0].token_ids
        assert fast == plain
        outputs.append(plain)
    plain_greedy = outputs[0]
    assert max(verified) > 1 and 1 in verified  # sampled verify rows, and plain's one row
    assert bool(drafted) == bf16_products() and bool(screened) == bf16_products()
    assert not screened or max(screened) > 1
    declined = []  # a screen that declines (a bad row, a wide batch): the float32 logits decide
    runner.head_screen = lambda h: declined.append(h.shape[0]) and None
    verified.clear()
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids == plain_greedy
    assert declined and max(verified) > 1
    assert llm.get_stats()["num_drafts"] > 0
