"""The acceptance-by-match kernel held to the torch rule it replaces on the GPU (`verify._verify_ids` with
`_draft_lengths`), on every case the rule distinguishes. Without a GPU it runs in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from blockspec.kernels.accept import accept_matching
from blockspec.sample.verify import _draft_lengths, _verify_ids
from factories import TRITON_SKIP_REASON, acceptance_cases, compile_for_sm90, triton_interpretable

pytestmark = pytest.mark.skipif(not triton_interpretable(), reason=TRITON_SKIP_REASON)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB = 50


def cases(seed: int, r: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(x.to(DEVICE) for x in acceptance_cases(seed, r, k, VOCAB))


def reference(ids, drafts, lens, vocab):
    return _verify_ids(ids, drafts, _draft_lengths(drafts, lens, vocab))


@pytest.mark.parametrize("k", [0, 1, 7, 15])  # 0: every draft pruned
@pytest.mark.parametrize("vocab", [VOCAB, None])
def test_the_kernel_gives_the_torch_rules_counts_and_tokens(k, vocab):
    ids, drafts, lens = cases(k, 64, k)
    want = reference(ids, drafts, lens, vocab)
    got = accept_matching(ids, drafts, lens, vocab)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # the cases reach every outcome: nothing, part and all of a draft accepted, and failed requests
    a, out = want
    assert (a == 0).any() and (a == lens).any() and (out[:, 0] == -1).any()
    assert k <= 1 or ((a > 0) & (a < lens)).any()


def test_a_changed_row_id_changes_the_kernels_result():
    """Negative control: the comparison sees the kernel's reading of each id."""
    ids, drafts, lens = cases(3, 16, 7)
    base = accept_matching(ids, drafts, lens, VOCAB)
    row = int(torch.nonzero(base[0] >= 2)[0, 0])
    ids[row, 0] = (drafts[row, 0] + 1) % VOCAB  # the first draft no longer matches
    got = accept_matching(ids, drafts, lens, VOCAB)
    assert got[0][row] == 0 and got[1][row, 0] == ids[row, 0]
    assert torch.equal(got[1], reference(ids, drafts, lens, VOCAB)[1])


def test_no_requests():
    empty = torch.zeros(0, 4, dtype=torch.int64, device=DEVICE)
    a, out = accept_matching(torch.zeros(0, 5, dtype=torch.int64, device=DEVICE), empty,
                             torch.zeros(0, dtype=torch.int64, device=DEVICE), None)
    assert a.shape == (0,) and out.shape == (0, 5)


def test_the_kernel_compiles_for_sm90():
    signature = {"Ids": "*i64", "Drafts": "*i64", "Lens": "*i64", "NumAcc": "*i64", "Out": "*i64",
                 "stride_i": "i64", "stride_d": "i64", "stride_o": "i64", "k": "i32", "vocab": "i64"}
    compile_for_sm90("blockspec.kernels.accept", [("_accept_matching", signature, {"BLOCK": b}) for b in (1, 16)])
