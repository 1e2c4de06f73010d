"""Samplers: greedy ids, seeded Gumbel-max law and determinism, draft sampling with q, logprobs."""

from __future__ import annotations

import pytest
import torch

from blockspec.sample.processors import RowParams, process_logits
from blockspec.sample.sampler import greedy_ids, logprobs, sample, sample_draft, sample_processed


def chi2_pvalue(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson chi-square p-value; cells expected below 5 are merged into one."""
    counts, expected = counts.double().flatten(), expected.double().flatten()
    small = expected < 5
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum().view(1)])
        expected = torch.cat([expected[~small], expected[small].sum().view(1)])
    if expected[-1] == 0:  # nothing merged and nothing expected there
        assert counts[-1] == 0
        counts, expected = counts[:-1], expected[:-1]
    stat = ((counts - expected) ** 2 / expected).sum()
    df = torch.tensor(float(len(counts) - 1), dtype=torch.float64)
    return torch.special.gammaincc(df / 2, stat / 2).item()


def _uniform_params(n: int, **kw) -> RowParams:
    kw.setdefault("seed", list(range(n)))
    kw.setdefault("position", [0] * n)
    return RowParams.from_host(**kw)


def test_greedy_ties_lowest_and_bad_rows() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [0.0, float("nan"), 1.0, 0.0], [float("-inf")] * 4,
                           [0.0, float("inf"), 0.0, 0.0]])
    assert greedy_ids(logits).tolist() == [1, -1, -1, -1]
    p = _uniform_params(4, temperature=[0.0] * 4)
    assert sample(logits, p).tolist() == [1, -1, -1, -1]  # fast path
    p = _uniform_params(4, temperature=[0.0, 1.0, 0.5, 0.9])
    assert sample(logits, p).tolist() == [1, -1, -1, -1]  # processed path


def test_greedy_rows_use_penalised_scores() -> None:
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    counts = torch.tensor([[1, 0, 0]], dtype=torch.int32)
    p = _uniform_params(1, temperature=[0.0], frequency_penalty=[1.0], output_counts=counts)
    assert sample(logits, p).item() == 1


def test_seeded_rows_are_deterministic_and_batch_independent() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(40, 500, generator=g)
    temps = [0.0, 0.6, 1.0, 1.5] * 10
    p = _uniform_params(40, temperature=temps, position=list(range(100, 140)), top_k=[0, 20] * 20)
    first = sample(logits, p)
    assert torch.equal(first, sample(logits, p))
    for i in range(40):
        alone = _uniform_params(1, temperature=[temps[i]], seed=[i], position=[100 + i], top_k=[[0, 20][i % 2]])
        assert sample(logits[i:i + 1], alone).item() == first[i].item()
    other = _uniform_params(40, temperature=temps, position=list(range(100, 140)), top_k=[0, 20] * 20,
                            seed=[i + 1000 * (i % 2) for i in range(40)])
    moved = sample(logits, other)
    assert torch.equal(moved[0::2], first[0::2])  # unchanged keys -> unchanged tokens
    assert (moved[1::4] != first[1::4]).any()  # changed seeds on sampled rows -> new tokens
    assert torch.equal(sample_processed(process_logits(logits, p), p, chunk_elems=500 * 3), first)


def _law_counts(dist_logits: torch.Tensor, p: RowParams) -> tuple[torch.Tensor, torch.Tensor]:
    n = p.seed.shape[0]
    processed = process_logits(dist_logits.expand(n, -1), p)
    tokens = sample_processed(processed, p)
    return torch.bincount(tokens, minlength=dist_logits.shape[1]), processed[0].double().exp()


def test_gumbel_sampling_law_with_filters() -> None:
    n = 30000
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -3.0, 1.5, 0.2]])
    p = _uniform_params(n, temperature=[0.8] * n, top_k=[6] * n, top_p=[0.95] * n, position=list(range(n)))
    counts, probs = _law_counts(logits, p)
    assert (counts[probs == 0] == 0).all() and (probs == 0).sum() >= 2  # filtered tokens never drawn
    assert chi2_pvalue(counts, n * probs) > 1e-4
    # negative control: the law at a different temperature is rejected
    wrong = torch.softmax(logits[0].double() / 1.0, 0)
    assert chi2_pvalue(counts, n * wrong) < 1e-9


def test_sample_draft_q_is_the_sampled_law() -> None:
    r, k, vocab = 20000, 2, 6
    row_logits = torch.tensor([[1.0, 0.0, 2.0, -1.0, 0.5, 0.0], [0.0, 3.0, 0.0, 1.0, -2.0, 0.5]])
    draft_logits = row_logits.expand(r, k, vocab)
    p = _uniform_params(r * k, seed=[i // k for i in range(r * k)], position=[i % k for i in range(r * k)],
                        temperature=[0.9, 1.2] * r, top_k=[0, 4] * r)
    round_ = torch.full((r,), 7)
    tokens, q = sample_draft(draft_logits, p, round_)
    assert tokens.shape == (r, k) and q.shape == (r, k, vocab) and q.dtype == torch.float32
    assert torch.allclose(q.sum(-1), torch.ones(r, k), atol=1e-6)
    for i in range(k):
        assert chi2_pvalue(torch.bincount(tokens[:, i], minlength=vocab), r * q[0, i].double()) > 1e-4
    # drafts use their own stream: same keys under STREAM_TARGET give different tokens
    target = sample_processed(process_logits(draft_logits.reshape(r * k, vocab), p), p).view(r, k)
    assert (target == tokens).float().mean() < 0.8
    # a new round gives fresh draft noise
    again, _ = sample_draft(draft_logits, p, round_ + 1)
    assert (again != tokens).any()
    greedy_tokens, no_q = sample_draft(draft_logits, p, round_, greedy=True)
    assert no_q is None and torch.equal(greedy_tokens, row_logits.argmax(-1).expand(r, k))


def test_sample_draft_greedy_rows_and_bad_rows() -> None:
    draft_logits = torch.tensor([[[0.0, 2.0, 1.0], [float("nan"), 0.0, 0.0]]])
    p = _uniform_params(2, temperature=[0.0, 1.0])
    tokens, q = sample_draft(draft_logits, p, torch.zeros(1, dtype=torch.int64))
    assert tokens.tolist() == [[1, -1]]
    assert q[0, 0].tolist() == [0.0, 1.0, 0.0] and torch.isnan(q[0, 1]).all()


def test_logprobs() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.5, 0.0, 2.0, -1.0], [0.0, 1.0, 0.5, -1.0]])
    p = _uniform_params(3, temperature=[0.0, 1.0, 0.7], top_k=[0, 0, 2])
    processed = process_logits(logits, p)
    tokens = torch.tensor([1, 3, -1])
    chosen, top_ids, top_lp = logprobs(processed, tokens, 2)
    ref = torch.log_softmax(logits, dim=1)  # greedy rows report T=1 log-probs
    assert torch.allclose(chosen[:2], torch.stack([ref[0, 1], ref[1, 3]]), atol=1e-6)
    assert torch.isnan(chosen[2])
    assert top_ids[:2].tolist() == [[1, 2], [2, 0]]
    assert torch.allclose(top_lp[:2], torch.stack([ref[0, [1, 2]], ref[1, [2, 0]]]), atol=1e-6)
    assert top_ids[2, 0].item() == 1 and torch.isclose(top_lp[2].exp().sum(), torch.tensor(1.0))
    empty = logprobs(processed, tokens, 0)
    assert empty[1].shape == (3, 0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
def test_a_batch_that_only_samples_skips_the_greedy_rows_work_and_keeps_every_token(device: str) -> None:
    """With no greedy row, processing skips the greedy rows' selections and sampling skips its greedy pass
    (-1 rows from the processed rows' maxima instead): the same processed values bit for bit and the same
    tokens as the general path, bad rows (NaN, +inf, all -inf; a temperature that overflows) included."""
    import dataclasses

    g = torch.Generator().manual_seed(11)
    logits = torch.randn(12, 300, generator=g) * 4
    logits[2, 7] = float("nan")
    logits[5] = float("-inf")
    logits[8, 3] = float("inf")
    logits[10, 0] = 3.0e38  # over a temperature of 1e-5: +inf before the log-softmax
    logits = logits.to(device)
    temps = [0.7, 1.0, 1.3, 0.5, 2.0, 0.9, 0.8, 1.1, 0.6, 1.2, 1e-5, 0.75]
    for filters in ({}, {"top_k": [0, 5, 50] * 4, "top_p": [1.0, 0.9, 0.5, 0.95] * 3, "min_p": [0.0, 0.05] * 6}):
        p = _uniform_params(12, temperature=temps, position=list(range(40, 52)), device=device, **filters)
        assert not p.features.greedy
        general = dataclasses.replace(p, features=dataclasses.replace(p.features, greedy=True))
        fast, ref = process_logits(logits, p), process_logits(logits, general)
        torch.testing.assert_close(fast, ref, rtol=0, atol=0, equal_nan=True)
        tokens = sample_processed(fast, p)
        assert torch.equal(tokens, sample_processed(ref, general))
        assert tokens[[2, 5, 8, 10]].tolist() == [-1] * 4 and bool((tokens[[0, 1, 3, 4, 6, 7, 9, 11]] >= 0).all())
        assert torch.equal(sample(logits, p), tokens)
