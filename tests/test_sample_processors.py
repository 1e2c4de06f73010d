"""Logits processing: each processor on hand-computed examples, the order, batch independence."""

from __future__ import annotations

import math

import pytest
import torch

from blockspec.sample.processors import (Features, RowParams, bad_rows, expand_history, features,
                                         needs_full_processing, process_logits)

NEG = float("-inf")


def _params(n: int, **kw) -> RowParams:
    kw.setdefault("temperature", [1.0] * n)
    kw.setdefault("seed", [0] * n)
    kw.setdefault("position", [0] * n)
    return RowParams.from_host(**kw)


def _close(actual: torch.Tensor, expected: list[float]) -> None:
    exp = torch.tensor(expected, dtype=torch.float64)
    act = actual.double()
    assert torch.equal(torch.isinf(act), torch.isinf(exp)), (act, exp)
    fin = torch.isfinite(exp)
    assert torch.allclose(act[fin], exp[fin], atol=1e-6), (act, exp)


def _lp(probs: list[float]) -> list[float]:
    total = sum(probs)
    return [math.log(v / total) if v > 0 else NEG for v in probs]


def test_temperature() -> None:
    out = process_logits(torch.tensor([[1.0, 2.0, 3.0]]), _params(1, temperature=[2.0]))
    _close(out[0], torch.log_softmax(torch.tensor([0.5, 1.0, 1.5], dtype=torch.float64), 0).tolist())


def test_top_k() -> None:
    out = process_logits(torch.tensor([[1.0, 3.0, 2.0, 0.0]]), _params(1, top_k=[2]))
    _close(out[0], _lp([0.0, math.exp(3), math.exp(2), 0.0]))
    off = process_logits(torch.tensor([[1.0, 3.0, 2.0, 0.0]]), _params(1, top_k=[-1]))
    assert torch.isfinite(off).all()


@pytest.mark.parametrize("top_p,kept", [(0.5, 1), (0.7, 2), (0.81, 3), (1.0, 4)])
def test_top_p(top_p: float, kept: int) -> None:
    probs = [0.5, 0.3, 0.15, 0.05]
    out = process_logits(torch.tensor([probs]).log(), _params(1, top_p=[top_p]))
    _close(out[0], _lp(probs[:kept] + [0.0] * (4 - kept)))


def test_min_p() -> None:
    probs = [0.5, 0.3, 0.15, 0.05]
    out = process_logits(torch.tensor([probs]).log(), _params(1, min_p=[0.2]))
    _close(out[0], _lp([0.5, 0.3, 0.15, 0.0]))  # threshold 0.2 * 0.5 = 0.1


def test_top_p_sees_top_k_filtered_distribution() -> None:
    # after top-k 3 the mass before the third token is 7/9 >= 0.75 -> 2 kept; on the raw
    # distribution it would be 0.7 < 0.75 -> 3 kept. Fixes the order top-k -> top-p.
    probs = [0.4, 0.3, 0.2, 0.1]
    out = process_logits(torch.tensor([probs]).log(), _params(1, top_k=[3], top_p=[0.75]))
    _close(out[0], _lp([0.4, 0.3, 0.0, 0.0]))


def test_top_k_keeps_ties() -> None:
    out = process_logits(torch.tensor([[2.0, 1.0, 2.0, 0.0]]), _params(1, top_k=[1]))
    _close(out[0], _lp([1.0, 0.0, 1.0, 0.0]))


def _penalised_params(n: int, temperature: float, **kw) -> RowParams:
    counts = torch.tensor([[0, 2, 1, 0]] * n, dtype=torch.int32)
    prompt = torch.tensor([[True, False, False, False]] * n)
    return _params(n, temperature=[temperature] * n, repetition_penalty=[2.0] * n, frequency_penalty=[0.5] * n,
                   presence_penalty=[0.25] * n, output_counts=counts, prompt_mask=prompt, **kw)


def test_penalties_vllm_semantics() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0]])
    # repetition (prompt or output): 2 -> 1, -1 -> -2, 0.5 -> 0.25; frequency: -1.0, -0.5;
    # presence: -0.25, -0.25; token 3 untouched
    scores = [1.0, -3.25, -0.5, 1.0]
    sampled = process_logits(logits, _penalised_params(1, 1.0))
    _close(sampled[0], torch.log_softmax(torch.tensor(scores, dtype=torch.float64), 0).tolist())
    greedy = process_logits(logits, _penalised_params(1, 0.0))
    _close(greedy[0], [s - 1.0 for s in scores])  # greedy rows: scores minus their max


def test_logit_bias_comes_before_penalties() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0], [2.0, -1.0, 0.5, 1.0]])
    bias = (torch.tensor([0, 0]), torch.tensor([1, 3]), torch.tensor([5.0, -1.0]))
    out = process_logits(logits, _penalised_params(2, 0.0, logit_bias=bias))
    # row 0, token 1: (-1 + 5) / 2 - 1 - 0.25 = 0.75 (penalty first would give 1.75); token 3: 1 - 1 = 0
    _close(out[0], [1.0 - 1.0, 0.75 - 1.0, -0.5 - 1.0, 0.0 - 1.0])
    _close(out[1], [0.0, -4.25, -1.5, 0.0])  # row 1 has no bias


def test_eos_suppression_per_row() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.0]] * 2)
    p = _params(2, temperature=[0.0, 0.0], suppress_eos=[True, False], eos_ids=torch.tensor([1, 3]))
    out = process_logits(logits, p)
    _close(out[0], [-1.0, NEG, 0.0, NEG])
    _close(out[1], [-5.0, 0.0, -4.0, -1.0])


def test_greedy_rows_skip_filters_and_keep_exact_argmax() -> None:
    vocab = 4096
    logits = torch.full((1, vocab), 1.0)
    logits[0, 10] = torch.nextafter(torch.tensor(2.0), torch.tensor(0.0))
    logits[0, 20] = 2.0
    p = _params(1, temperature=[0.0], top_k=[1], top_p=[0.1], min_p=[0.9])
    out = process_logits(logits, p)
    assert torch.isfinite(out).all()  # filters are not applied to greedy rows
    assert out[0].argmax().item() == 20
    # negative control: a plain log_softmax merges the two top logits, and its argmax is wrong
    assert torch.log_softmax(logits, dim=1)[0].argmax().item() == 10


def test_expand_history() -> None:
    req_counts = torch.tensor([[1, 0, 0, 0, 0], [0, 0, 2, 0, 0]], dtype=torch.int32)
    block = torch.tensor([[3, 3, 1], [4, -1, -1]])
    row_req = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    offset = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
    out = expand_history(req_counts, row_req, block, offset)
    assert out.dtype == torch.int32
    assert out.tolist() == [[1, 0, 0, 0, 0], [1, 0, 0, 1, 0], [1, 0, 0, 2, 0], [1, 1, 0, 2, 0],
                            [0, 0, 2, 0, 0], [0, 0, 2, 0, 1], [0, 0, 2, 0, 1], [0, 0, 2, 0, 1]]
    assert req_counts.tolist() == [[1, 0, 0, 0, 0], [0, 0, 2, 0, 0]]  # input untouched


def test_needs_full_processing_and_features() -> None:
    assert not needs_full_processing(_params(2, temperature=[0.0, 0.0], top_k=[5, 0]))
    assert needs_full_processing(_params(2, temperature=[0.0, 0.5]))
    assert needs_full_processing(_penalised_params(1, 0.0))
    assert needs_full_processing(_params(1, temperature=[0.0], eos_ids=torch.tensor([1])))
    bias = (torch.tensor([0]), torch.tensor([1]), torch.tensor([1.0]))
    assert needs_full_processing(_params(1, temperature=[0.0], logit_bias=bias))
    p = _params(3, temperature=[0.0, 0.7, 1.0], top_k=[0, 4, 0], top_p=[1.0, 1.0, 0.9], min_p=[0.0, 0.0, 0.0])
    assert p.features == Features(sampled=True, top_k=True, top_p=True, min_p=False)
    p.features = None
    assert features(p) == Features(sampled=True, top_k=True, top_p=True, min_p=False)


def _mixed_batch(n: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, RowParams]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=g) * 3

    def pick(options: list) -> list:
        return [options[i % len(options)] for i in range(n)]

    counts = torch.randint(0, 3, (n, vocab), generator=g, dtype=torch.int32)
    counts *= torch.rand(n, vocab, generator=g) < 0.1
    prompt = torch.rand(n, vocab, generator=g) < 0.05
    bias_rows = torch.arange(0, n, 3)
    bias = (bias_rows, torch.randint(0, vocab, (len(bias_rows),), generator=g),
            torch.randn(len(bias_rows), generator=g))
    p = RowParams.from_host(temperature=pick([0.0, 0.7, 1.0, 1.3, 0.5]), seed=list(range(n)), position=list(range(n)),
                            top_k=pick([0, 5, 0, 40, 1, 0, 7]), top_p=pick([1.0, 0.9, 0.5, 1.0]),
                            min_p=pick([0.0, 0.05, 0.0]), presence_penalty=pick([0.0, 0.5, -0.3]),
                            frequency_penalty=pick([0.0, 0.2, 1.0, 0.0]), repetition_penalty=pick([1.0, 1.2, 0.8]),
                            suppress_eos=pick([False, True]), output_counts=counts, prompt_mask=prompt,
                            logit_bias=bias, eos_ids=torch.tensor([0, 2]))
    return logits, p


def _row(p: RowParams, i: int) -> RowParams:
    """Row i alone, with host features computed for that row only (so every unused processor is skipped)."""

    def pick(t: torch.Tensor) -> list:
        return t[i:i + 1].tolist()

    rows, toks, vals = p.logit_bias
    keep = rows == i
    return RowParams.from_host(
        temperature=pick(p.temperature), seed=pick(p.seed), position=pick(p.position),
        top_k=pick(p.top_k), top_p=pick(p.top_p), min_p=pick(p.min_p), presence_penalty=pick(p.presence_penalty),
        frequency_penalty=pick(p.frequency_penalty), repetition_penalty=pick(p.repetition_penalty),
        suppress_eos=pick(p.suppress_eos), output_counts=p.output_counts[i:i + 1], prompt_mask=p.prompt_mask[i:i + 1],
        logit_bias=(rows[keep] * 0, toks[keep], vals[keep]), eos_ids=p.eos_ids)


def test_rows_independent_of_batch_and_chunking() -> None:
    logits, p = _mixed_batch(37, 300)
    full = process_logits(logits, p)
    assert torch.equal(process_logits(logits, p, chunk_elems=300 * 4), full)  # 4-row chunks
    for i in range(37):
        assert torch.equal(process_logits(logits[i:i + 1], _row(p, i))[0], full[i]), i
    assert torch.isfinite(full.amax(dim=1)).all()


def test_bad_rows_become_nan_and_others_are_untouched() -> None:
    logits, p = _mixed_batch(8, 50, seed=1)
    broken = logits.clone()
    broken[1, 3] = float("nan")
    broken[2, 7] = float("inf")
    broken[3] = NEG
    out = process_logits(broken, p)
    assert bad_rows(out).tolist() == [False, True, True, True, False, False, False, False]
    assert torch.isnan(out[1:4]).all()
    assert torch.equal(out[[0, 4, 5, 6, 7]], process_logits(logits, p)[[0, 4, 5, 6, 7]])
    # everything masked by eos suppression is bad too
    only_eos = torch.full((1, 4), NEG)
    only_eos[0, 1] = 0.0
    q = _params(1, suppress_eos=[True], eos_ids=torch.tensor([1]))
    assert bad_rows(process_logits(only_eos, q)).item()
