"""DSpark's fused greedy Markov drafting (`kernels.markov`) held to the drafter's reference loop
(`DSparkDraft.draft_greedy` on the CPU) and to the formula it documents. Without a GPU it runs in
Triton's interpreter."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from blockspec.bench.arch import ARCHS, random_drafter
from blockspec.kernels.markov import BLOCK_V, MAX_ROWS, MAX_SLOTS, candidate_ids, markov_greedy
from factories import TRITON_SKIP_REASON, compile_for_sm90, triton_interpretable

pytestmark = pytest.mark.skipif(not triton_interpretable(), reason=TRITON_SKIP_REASON)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def formula(base, w1, w2, anchors, d2t, scale):
    """token_k = argmax(U_k + scale * W2 W1[token_{k-1}]) (the bias in W2's dtype), mapped by d2t."""
    prev, out = anchors, []
    for k in range(base.shape[1]):
        bias = F.linear(w1[prev], w2).float() * scale
        draft = (base[:, k] + bias).argmax(-1)
        prev = draft + d2t[draft] if d2t is not None else draft
        out.append(prev)
    return torch.stack(out, 1)


def inputs(seed: int, r: int, k: int, vocab: int, rank: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(r, k, vocab, generator=g)
    w1 = (torch.randn(vocab, rank, generator=g) / rank**0.5).to(dtype)
    w2 = torch.randn(vocab, rank, generator=g).to(dtype)
    anchors = torch.randint(0, vocab, (r,), generator=g)
    return base, w1, w2, anchors


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("vocab, rank", [(300, 16), (2 * BLOCK_V, 80)])  # a ragged last block; two rank steps
def test_the_kernel_drafts_what_the_formula_drafts(dtype, vocab, rank):
    """Tokens equal the formula's at every position, the Markov bias deciding many of them (the
    negative control: without it a large share differ), with and without a draft-to-target map."""
    base, w1, w2, anchors = inputs(vocab + rank, 6, 7, vocab, rank, dtype)
    for d2t in (None, torch.zeros(vocab, dtype=torch.int64)):  # the map's path, mapping each id to itself
        want = formula(base, w1, w2, anchors, d2t, 0.5)
        got = markov_greedy(base.to(DEVICE), w1.to(DEVICE), w2.to(DEVICE), anchors.to(DEVICE),
                            None if d2t is None else d2t.to(DEVICE), 0.5).cpu()
        assert torch.equal(got, want)
    plain = base.argmax(-1)
    assert (plain != want).float().mean() > 0.3


@pytest.mark.parametrize("per_position, vocab", [(0, 300), (2, 300), (10, 10)])
def test_drafts_do_not_depend_on_the_candidates(per_position, vocab):
    """The bias of the token before a position comes from the candidates the first launch stored or,
    for a token outside them, from W2 again: the same drafts either way. With none (every bias from W2),
    two a position (both ways taken: the test checks some previous tokens are candidates and some are
    not) and a whole vocabulary of 10 (every bias stored)."""
    rank = 32
    base, w1, w2, anchors = inputs(7, 4, 7, vocab, rank, torch.float16)
    want = formula(base, w1, w2, anchors, None, 0.5)
    got = markov_greedy(base.to(DEVICE), w1.to(DEVICE), w2.to(DEVICE), anchors.to(DEVICE), None, 0.5,
                        per_position=per_position).cpu()
    assert torch.equal(got, want)
    cands = candidate_ids(base, anchors, None, per_position)
    stored = torch.tensor([[bool((cands[r] == want[r, i]).any()) for i in range(want.shape[1] - 1)]
                           for r in range(want.shape[0])])
    share = stored.float().mean().item()
    assert share == {0: 0.0, 2: share, 10: 1.0}[per_position]
    if per_position == 2:
        assert 0.3 < share < 1.0


def test_a_row_stores_at_most_max_slots_candidates():
    """Asked for more candidates than MAX_SLOTS holds, each position adds as many as fit, best first."""
    base, _, _, anchors = inputs(8, 3, 16, 500, 8, torch.float32)
    cands = candidate_ids(base, anchors, None, 300)
    per = (MAX_SLOTS - 1) // 15
    assert cands.shape == (3, 1 + 15 * per)
    assert torch.equal(cands[:, 1 : 1 + per], base[:, 0].topk(per, -1).indices)


def test_a_draft_to_target_map_feeds_the_mapped_token_back():
    """With a draft vocabulary smaller than the target's, each draft is mapped (target = draft + d2t)
    before it is returned and before its W1 row biases the next position."""
    g = torch.Generator().manual_seed(3)
    r, k, vocab, target_vocab, rank = 4, 5, 40, 200, 16
    base = torch.randn(r, k, vocab, generator=g)
    w1 = torch.randn(target_vocab, rank, generator=g)
    w2 = torch.randn(vocab, rank, generator=g)
    d2t = torch.randint(0, target_vocab - vocab, (vocab,), generator=g)
    anchors = torch.randint(0, target_vocab, (r,), generator=g)
    want = formula(base, w1, w2, anchors, d2t, 1.0)
    got = markov_greedy(base.to(DEVICE), w1.to(DEVICE), w2.to(DEVICE), anchors.to(DEVICE), d2t.to(DEVICE), 1.0)
    assert torch.equal(got.cpu(), want) and (want >= vocab).any()


def test_ties_go_to_the_lowest_id_across_blocks():
    """Equal logits in two vocabulary blocks: the lower id wins, as torch.argmax breaks ties."""
    vocab, rank = 3 * BLOCK_V, 8
    base = torch.zeros(2, 2, vocab)
    base[:, :, [BLOCK_V + 5, 2 * BLOCK_V + 1, BLOCK_V + 9]] = 1.0
    w1, w2 = torch.zeros(vocab, rank), torch.zeros(vocab, rank)
    got = markov_greedy(base.to(DEVICE), w1.to(DEVICE), w2.to(DEVICE), torch.tensor([0, 1], device=DEVICE), None, 1.0)
    assert got.tolist() == [[BLOCK_V + 5] * 2] * 2


@pytest.mark.parametrize("r", [1, MAX_ROWS, MAX_ROWS + 1])
def test_the_drafter_takes_the_kernel_and_drafts_as_its_reference(monkeypatch, r):
    """`DSparkDraft.draft_greedy` with kernels on (interpreted without a GPU) returns what its reference
    loop returns on the same logits, confidences included; past MAX_ROWS rows it keeps the reference."""
    arch = ARCHS["tiny"]
    drafter = random_drafter(arch.dspark(), DEVICE, torch.float32, arch.init_std, 5, arch.dspark_heads)
    g = torch.Generator().manual_seed(4)
    k, h = drafter.config.block_size, drafter.config.hidden_size
    base = (torch.randn(r, k, drafter.config.vocab_size, generator=g) * 2).to(DEVICE)
    hidden = torch.randn(r, k, h, generator=g).to(DEVICE)
    anchors = torch.randint(0, drafter.config.vocab_size, (r,), generator=g).to(DEVICE)
    calls = []
    from blockspec.drafters import dspark

    def spy(*args):
        calls.append(args)
        return markov_greedy(*args)

    monkeypatch.setattr(dspark, "use_kernels", lambda *tensors: False)
    want = drafter.draft_greedy(base, hidden, anchors)
    monkeypatch.setattr(dspark, "use_kernels", lambda *tensors: True)
    monkeypatch.setattr(dspark, "markov_greedy", spy)
    got = drafter.draft_greedy(base, hidden, anchors)
    assert len(calls) == (r <= MAX_ROWS) and torch.equal(got[0], want[0])
    assert (got[1] is None) == (want[1] is None) and (got[1] is None or torch.equal(got[1], want[1]))


def test_the_kernel_compiles_for_sm90():
    signature = {"Base": "*fp32", "W1": "*bf16", "W2": "*bf16", "Anchors": "*i64", "D2T": "*i64", "Cands": "*i64",
                 "CandBias": "*fp32", "PartMax": "*fp32", "PartIdx": "*i64", "Tokens": "*i64", "stride_br": "i64",
                 "stride_bk": "i64", "stride_w1": "i64", "stride_w2": "i64", "stride_cr": "i64", "stride_cbr": "i64",
                 "stride_cbc": "i64", "stride_pr": "i64", "stride_pk": "i64", "stride_t": "i64", "scale": "fp32"}
    cases = [("_markov_position", signature, {"BLOCK_V": BLOCK_V, "BLOCK_R": 64, "BLOCK_P": 2048, "BLOCK_C": 16,
                                              "HAS_D2T": d2t, "ROUND": True, "LOGITS": logits, "PRECISION": "tf32"})
             for d2t in (False, True) for logits in (False, True)]
    compile_for_sm90("blockspec.kernels.markov", cases)
