"""Keyed noise: exact formula, determinism, key separation, distribution, CPU == CUDA."""

from __future__ import annotations

import math

import pytest
import torch

from blockspec.sample.rng import (STREAM_ACCEPT, STREAM_DRAFT, STREAM_RESIDUAL, STREAM_TARGET, gumbel,
                                  gumbel_from_keys, keyed_uniform, row_key, uniform_from_keys)
from blockspec.kernels import interpreted, triton
from factories import TRITON_SKIP_REASON, triton_interpretable

MASK = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15


def _mix(x: int) -> int:
    x &= MASK
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & MASK
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def _reference(seed: int, position: int, stream: int, round_: int | None, column: int) -> float:
    """The documented formula with Python's unbounded integers (independent of torch's wrapping)."""
    h = _mix(seed * GAMMA + stream)
    h = _mix(h + (position + 1) * GAMMA)
    if round_ is not None:
        h = _mix(h + (round_ + 1) * GAMMA)
    return ((_mix(h + (column + 1) * GAMMA) >> 12) * 2 + 1) / 2.0**53


def _keys(n: int = 6):
    seed = torch.tensor([0, 1, -7, 2**62 + 5, -(2**63), 123456789][:n])
    position = torch.tensor([0, 5, 3, 2**40, 17, 99][:n])
    round_ = torch.tensor([0, 1, -1, 7, 2**33, 4][:n])
    return seed, position, round_


@pytest.mark.parametrize("use_round", [False, True])
def test_matches_python_reference(use_round: bool) -> None:
    seed, position, round_ = _keys()
    u = keyed_uniform(seed, position, STREAM_ACCEPT, round_ if use_round else None, 7)
    assert u.dtype == torch.float64 and u.shape == (6, 7)
    for n in range(6):
        for j in range(7):
            ref = _reference(int(seed[n]), int(position[n]), STREAM_ACCEPT, int(round_[n]) if use_round else None, j)
            assert u[n, j].item() == ref


def test_deterministic_and_row_independent() -> None:
    seed, position, round_ = _keys()
    a = keyed_uniform(seed, position, STREAM_RESIDUAL, round_, 50)
    b = keyed_uniform(seed, position, STREAM_RESIDUAL, round_, 50)
    assert torch.equal(a, b)
    for n in range(6):  # a row alone gives the same numbers as inside the batch
        alone = keyed_uniform(seed[n:n + 1], position[n:n + 1], STREAM_RESIDUAL, round_[n:n + 1], 50)
        assert torch.equal(alone[0], a[n])
    wide = keyed_uniform(seed, position, STREAM_RESIDUAL, round_, 80)
    assert torch.equal(wide[:, :50], a)


def test_every_key_field_changes_the_numbers() -> None:
    seed, position, round_ = _keys()
    base = keyed_uniform(seed, position, STREAM_DRAFT, round_, 64)
    variants = [keyed_uniform(seed + 1, position, STREAM_DRAFT, round_, 64),
                keyed_uniform(seed, position + 1, STREAM_DRAFT, round_, 64),
                keyed_uniform(seed, position, STREAM_ACCEPT, round_, 64),
                keyed_uniform(seed, position, STREAM_DRAFT, round_ + 1, 64),
                keyed_uniform(seed, position, STREAM_DRAFT, None, 64)]
    for v in variants:
        assert (v != base).float().mean() > 0.99
    assert len({STREAM_TARGET, STREAM_DRAFT, STREAM_ACCEPT, STREAM_RESIDUAL}) == 4
    # swapping seed and position must not collide (fields are absorbed in order)
    swapped = keyed_uniform(position, seed, STREAM_DRAFT, round_, 64)
    differ = seed != position
    assert differ.sum() == 5 and (swapped[differ] != base[differ]).float().mean() > 0.99


def test_open_interval_and_uniform_moments() -> None:
    n = 4096
    seed = torch.arange(n)
    u = keyed_uniform(seed, torch.zeros(n, dtype=torch.int64), STREAM_TARGET, None, 64).flatten()
    assert (u > 0).all() and (u < 1).all()
    m = u.numel()
    assert abs(u.mean().item() - 0.5) < 5 * math.sqrt(1 / 12 / m)
    assert abs(u.var().item() - 1 / 12) < 5 * math.sqrt(1 / 180 / m)
    # 64-bin histogram, chi-square well inside 10 sigma of its mean
    counts = torch.bincount((u * 64).long(), minlength=64).double()
    chi2 = ((counts - m / 64) ** 2 / (m / 64)).sum().item()
    assert chi2 < 63 + 10 * math.sqrt(2 * 63)
    # neighbouring seeds and columns are not correlated
    grid = u.view(n, 64)
    assert abs(torch.corrcoef(torch.stack([grid[:-1, 0], grid[1:, 0]]))[0, 1].item()) < 0.1
    assert abs(torch.corrcoef(torch.stack([grid[:, 0], grid[:, 1]]))[0, 1].item()) < 0.1


def test_extreme_values_stay_inside() -> None:
    # the smallest and largest representable outputs, through the documented mapping
    assert 1 / 2.0**53 > 0 and (2 * (2**52 - 1) + 1) / 2.0**53 < 1.0
    g = gumbel(torch.arange(256), torch.arange(256), STREAM_TARGET, None, 512, dtype=torch.float64)
    assert torch.isfinite(g).all()
    assert abs(g.mean().item() - 0.5772156649) < 0.02  # Euler-Mascheroni constant
    g32 = gumbel(torch.arange(256), torch.arange(256), STREAM_TARGET, None, 512)
    assert g32.dtype == torch.float32 and torch.equal(g32, g.float())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu() -> None:
    seed = torch.randint(-(2**62), 2**62, (512,))
    position = torch.randint(0, 2**40, (512,))
    round_ = torch.randint(0, 2**30, (512,))
    cpu = keyed_uniform(seed, position, STREAM_RESIDUAL, round_, 4096)
    gpu = keyed_uniform(seed.cuda(), position.cuda(), STREAM_RESIDUAL, round_.cuda(), 4096)
    assert torch.equal(cpu, gpu.cpu())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_gumbel_argmax_draws_the_cpu_token() -> None:
    """Sampling on the GPU (the one-pass kernel) draws the token the CPU's torch ops draw, over a
    Qwen-sized vocabulary, for a decode batch and a verify-sized one."""
    from blockspec.sample.rng import row_key
    from blockspec.sample.sampler import gumbel_argmax

    for rows in (1, 64 * 16):
        g = torch.Generator().manual_seed(rows)
        scores = (torch.randn(rows, 151936, generator=g) * 3).log_softmax(-1)
        keys = row_key(torch.arange(rows) * 3 + 1, torch.arange(rows) + 512, STREAM_TARGET, None)
        cpu = gumbel_argmax(scores, keys)
        gpu = gumbel_argmax(scores.cuda(), keys.cuda()).cpu()
        assert torch.equal(cpu, gpu), (rows, (cpu != gpu).sum().item())


@pytest.mark.skipif(not triton_interpretable(), reason=TRITON_SKIP_REASON)
@pytest.mark.parametrize("rows", [1, 37, 1500])
def test_row_keys_kernel_hashes_the_reference_bits(rows):
    """One launch makes the keys `row_key`'s torch ops make, bit for bit: every stream, with and
    without a round, int64 seeds across their range (the wrapping multiplies and logical shifts), an
    int32 position, more rows than a program holds. Another stream or round gives other keys."""
    from blockspec.kernels.gumbel import row_keys_kernel

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(rows)
    seed = torch.randint(-(2**63), 2**63 - 1, (rows,), generator=g, dtype=torch.int64)
    position = torch.randint(0, 2**31 - 1, (rows,), generator=g, dtype=torch.int64).to(torch.int32)
    round_ = torch.randint(0, 2**40, (rows,), generator=g, dtype=torch.int64)
    seen = set()
    for stream in (STREAM_TARGET, STREAM_DRAFT, STREAM_RESIDUAL):
        for r in (None, round_):
            got = row_keys_kernel(seed.to(device), position.to(device), stream,
                                  None if r is None else r.to(device)).cpu()
            assert got.dtype == torch.int64 and torch.equal(got, row_key(seed, position, stream, r))  # CPU: torch ops
            seen.add(tuple(got.tolist()))
    assert len(seen) == 6  # each stream and round its own keys
    assert row_keys_kernel(seed[:0].to(device), position[:0].to(device), STREAM_TARGET, None).shape == (0,)


@pytest.mark.skipif(not triton_interpretable(), reason=TRITON_SKIP_REASON)
@pytest.mark.parametrize("rows, vocab, programs", [(1, 5000, 528), (3, 2500, 528), (3, 2500, 1)],
                         ids=["vocab-split-five-ways", "split-three-ways", "unsplit"])
def test_gumbel_argmax_kernel_draws_the_reference_token(rows, vocab, programs):
    """The one-pass kernel hashes and draws in registers what `gumbel_from_keys` builds as tensors:
    the same token for every row, with masked (-inf) columns and a row with a single live column.
    Ties go to the lowest id, as torch's argmax gives: a row with none live (id 0) and one with two
    +inf scores, in the same lane of different blocks and in different lanes."""
    from blockspec.kernels.gumbel import gumbel_argmax_kernel
    from blockspec.sample.rng import gumbel_from_keys, row_key

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(rows)
    scores = torch.randn(rows, vocab, generator=g).log_softmax(-1)
    scores[:, 1:-1:3] = float("-inf")  # top-k style masking
    scores[0, : vocab - 1] = float("-inf")  # one live column: the last
    if rows > 1:
        scores[1] = float("-inf")
        scores[2, [1030, 1031 + 1024, 1030 + 1024]] = float("inf")
    scores = scores.to(device)
    seed, position = torch.arange(rows) * 7 + 1, torch.arange(rows) + 100
    keys = row_key(seed, position, STREAM_TARGET, None).to(device)
    want = (scores + gumbel_from_keys(keys, vocab)).argmax(dim=1)
    got = gumbel_argmax_kernel(scores, keys, programs)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    assert got[0] == vocab - 1 and (rows == 1 or got[1:3].tolist() == [0, 1030])
    # negative control: another stream's noise draws other tokens
    wide = torch.randn(8, vocab, generator=g).to(device)
    k8 = row_key(torch.arange(8), torch.arange(8), STREAM_TARGET, None).to(device)
    drawn = gumbel_argmax_kernel(wide, k8, programs)
    assert torch.equal(drawn, (wide + gumbel_from_keys(k8, vocab)).argmax(dim=1))
    assert not torch.equal(drawn, gumbel_argmax_kernel(wide, k8 + 1, programs))


def _float32_noise(odd: torch.Tensor) -> torch.Tensor:
    """`kernels.gumbel._approx_gumbel` of int64 odd numbers (u = odd * 2**-53), through a one-line kernel."""
    out = torch.empty(odd.shape, dtype=torch.float32, device=odd.device)
    _noise_kernel[(triton.cdiv(odd.numel(), 1024),)](odd, out, odd.numel(), FAST=not interpreted(), BLOCK=1024)
    return out


if triton is not None:
    import triton.language as tl

    from blockspec.kernels.gumbel import _approx_gumbel

    @triton.jit
    def _noise_kernel(Odd, Out, n, FAST: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(Out + i, _approx_gumbel(tl.load(Odd + i, mask=i < n, other=1), FAST), mask=i < n)


def _odd(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """The odd numbers behind `uniform_from_keys`'s draws: u = odd * 2**-53, exactly."""
    return (uniform_from_keys(keys, vocab) * 2.0**53).to(torch.int64)


@pytest.mark.skipif(not triton_interpretable(), reason=TRITON_SKIP_REASON)
def test_float32_noise_stays_well_inside_the_margin() -> None:
    """The kernel skips tiles by float32 noise and lets only tiles within NOISE_MARGIN of the best
    compete in float64: that needs the float32 noise within half the margin of the float64 noise
    cast to float32, less the adds' rounding. Held to a sixteenth, over hashed draws and the
    edges: u at 2**-53 and 1 - 2**-53, either side of one half and of the series' cut (t = 2**-6)."""
    from blockspec.kernels.gumbel import NOISE_MARGIN

    device = "cuda" if torch.cuda.is_available() else "cpu"
    keys = row_key(torch.arange(8) + 3, torch.arange(8), STREAM_TARGET, None)
    edges = torch.tensor([1, 3, 2**52 - 1, 2**52 + 1, 2**53 - 1, 2**53 - 3, 2**53 - 2**47 - 1, 2**53 - 2**47 + 1])
    odd = torch.cat([_odd(keys, 4096).flatten(), edges])
    want = (-(-(odd.double() * 2.0**-53).log()).log()).float()
    error = (_float32_noise(odd.to(device)).cpu() - want).abs()
    assert error.max().item() < NOISE_MARGIN / 16, error.max().item()
    assert torch.isfinite(want).all() and want.max() > 36 and want.min() < -3.5  # the edges reach both tails


@pytest.mark.skipif(not triton_interpretable(), reason=TRITON_SKIP_REASON)
@pytest.mark.parametrize("programs", [1, 528], ids=["unsplit", "split"])
def test_gumbel_argmax_kernel_keeps_float64_ties_and_near_ties(programs) -> None:
    """Scores that cancel the noise make every column's noisy score tie or differ by an ulp: "flat"
    (the first column of the tie wins) and "ramp" (a rise of 2**-22 a column, so the winner is
    near the row's end, tiles after the first). The kernel draws the float64 noise's token in
    both; argmax over float32 noise alone draws others (the tiles' float64 pass decides), and a
    negative margin, which skips tiles that hold the winner, draws others too."""
    from blockspec.kernels.gumbel import gumbel_argmax_kernel

    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows, vocab = 6, 3000
    keys = row_key(torch.arange(rows) + 3, torch.arange(rows), STREAM_TARGET, None)
    noise = gumbel_from_keys(keys, vocab)
    rough = _float32_noise(_odd(keys, vocab).to(device)).cpu()
    for name, scores in (("flat", 5.0 - noise), ("ramp", 5.0 - noise + torch.arange(vocab) * 2.0**-22)):
        want = (scores + noise).argmax(dim=1)
        got = gumbel_argmax_kernel(scores.to(device), keys.to(device), programs).cpu()
        assert torch.equal(got, want), name
        if name == "flat":
            assert want.tolist() == [0] * rows and not torch.equal((scores + rough).argmax(dim=1), want)
        elif programs == 1:  # one split: the tiles after the first compete only through the margin
            assert (want > 2048).all()
            assert not torch.equal(gumbel_argmax_kernel(scores.to(device), keys.to(device), programs,
                                                        margin=-1.0).cpu(), want)


@pytest.mark.skipif(not triton_interpretable(), reason=TRITON_SKIP_REASON)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("programs", [528, 1], ids=["split", "unsplit"])
def test_greedy_ids_kernel_gives_the_reference_ids(programs, dtype):
    """The greedy pass picks `greedy_ids`'s torch ids: ties to the lowest id within a lane, across lanes
    and across splits, -1 for a row with NaN, +inf or nothing above -inf, logits in bf16 and fp32. The
    ties are real: the highest tied id differs from the lowest in those rows."""
    from blockspec.kernels.gumbel import GREEDY_BLOCK, greedy_ids_kernel
    from blockspec.sample.sampler import greedy_ids

    device = "cuda" if torch.cuda.is_available() else "cpu"
    vocab = 3 * GREEDY_BLOCK + 77
    g = torch.Generator().manual_seed(programs)
    logits = torch.randn(9, vocab, generator=g).to(dtype)
    logits[0, [5, 5 + GREEDY_BLOCK]] = 9.0  # one lane, two blocks
    logits[1, [7, 700]] = 9.0  # two lanes of a block
    logits[2, [11, vocab - 3]] = 9.0  # the first and the last split
    logits[3, 40] = float("nan")
    logits[4, 41] = float("inf")
    logits[5] = float("-inf")
    logits[6, :-1] = float("-inf")  # one live column: the last
    logits[7, 1:] = float("-inf")  # one live column: the first
    want = greedy_ids(logits)
    got = greedy_ids_kernel(logits.to(device), programs).cpu()
    assert got.dtype == torch.int64 and torch.equal(got, want)
    assert want.tolist()[:8] == [5, 7, 11, -1, -1, -1, vocab - 1, 0]
    last_tie = vocab - 1 - logits[:3].float().flip(1).argmax(1)  # negative control: ties to the highest id
    assert (last_tie != want[:3]).all()
    assert greedy_ids_kernel(logits[:0].to(device), programs).shape == (0,)


def test_uniforms_from_a_column_offset_are_that_slice_of_the_row() -> None:
    keys = row_key(*_keys()[:2], STREAM_TARGET, None)
    whole = uniform_from_keys(keys, 40)
    assert torch.equal(uniform_from_keys(keys, 13, start=21), whole[:, 21:34])
    seed, position, _ = _keys()
    assert uniform_from_keys(keys, 1, start=39)[2, 0].item() == _reference(int(seed[2]), int(position[2]),
                                                                           STREAM_TARGET, None, 39)


@pytest.mark.parametrize("rows,vocab,block", [(5, 1000, 256), (3, 300, 1024), (7, 97, 64)])
def test_blocked_cpu_gumbel_argmax_draws_the_whole_rows_token(monkeypatch, rows, vocab, block) -> None:
    """The CPU's blocked Gumbel-max (a running argmax over cache-sized blocks) equals argmax over whole rows of
    scores + noise: rows split over several blocks, several rows a block, a row all -inf (token 0 either way),
    a row whose scores tie in two blocks (noise decides, as over the whole row)."""
    from blockspec.sample import sampler

    g = torch.Generator().manual_seed(rows * vocab)
    scores = torch.randn(rows, vocab, generator=g).log_softmax(-1)
    scores[1] = float("-inf")
    scores[2] = -50.0
    scores[2, [3, vocab - 2]] = 0.0
    keys = torch.randint(-(2**62), 2**62, (rows,), generator=g)
    whole = (scores + gumbel_from_keys(keys, vocab)).argmax(dim=1)
    monkeypatch.setattr(sampler, "CPU_NOISE_BLOCK", block)
    assert torch.equal(sampler.gumbel_argmax(scores, keys), whole)
    assert whole[1] == 0 and len(set(whole.tolist())) > 2
