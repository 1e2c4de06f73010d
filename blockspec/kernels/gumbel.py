"""Argmax over a row's vocabulary in one Triton pass: Gumbel-max sampling with the noise made in
registers, or greedy (no noise).

`rng.gumbel_from_keys` builds the noise as [rows, vocab] tensors: about twenty int64 and float64
passes over the vocabulary (hash, shifts, two logs), each a kernel launch and a full read and
write of 8-byte words. At a verify of 64 requests x 16 rows over a 152K vocabulary that is tens
of GB of traffic; at batch 1 it is some sixty launches. This kernel hashes, draws and takes the
argmax of scores + noise in one read of the scores. It runs the same integer hash as the torch ops
and screens each tile with float32 noise; the tiles that could hold the winner take the same
float64 logs as the torch ops and alone compete, so it picks the same token (the tests hold it to
them, near-ties included). A row's key (`rng.row_key`, a few int64 ops a row) is made in one launch
too (`row_keys_kernel`). Greedy rows (`greedy_ids_kernel`: the verify's and the draft head's argmax)
take the same pass without noise: torch's reduction reads 256 x 152K logits at about 2.5x their
bytes' time.

The vocabulary is split over programs when there are few rows (one program would walk 152K
columns alone); each split keeps its first maximum, and a second launch takes the first split
holding the row's maximum: ties go to the lowest id, as torch's argmax does.
"""

from __future__ import annotations

import torch
from torch import Tensor

from blockspec.kernels import interpreted, triton


def _signed(c: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


# splitmix64 constants: this kernel and its reference (blockspec.sample.rng) hash with them
GAMMA = _signed(0x9E3779B97F4A7C15)  # the increment (odd, so k -> k * GAMMA is a bijection)
MIX1 = _signed(0xBF58476D1CE4E5B9)
MIX2 = _signed(0x94D049BB133111EB)
INV_2_53 = 2.0**-53

BLOCK = 1024
NOISE_MARGIN = 2.0**-8  # tests hold the float32 noise's error under 1/16 of it (CPU: 2e-6)
TARGET_PROGRAMS = 528  # about four waves of an H100/H200's 132 SMs
GREEDY_BLOCK = 2048  # columns a greedy program reads at a time: its loads in flight, no hash to hide them behind
GREEDY_WARPS = 8  # with no hash to compute, more warps a program keep more loads in flight

if triton is not None:
    import triton.language as tl
    from triton.language.extra import libdevice

    @triton.jit
    def _srl(x, S: tl.constexpr):
        """Logical right shift of int64 (>> is arithmetic)."""
        return (x >> S) & ((1 << (64 - S)) - 1)

    @triton.jit
    def _mix64(x, M1: tl.constexpr, M2: tl.constexpr):
        """splitmix64's finaliser (`rng._mix64_`)."""
        x ^= _srl(x, 30)
        x *= M1
        x ^= _srl(x, 27)
        x *= M2
        x ^= _srl(x, 31)
        return x

    @triton.jit
    def _row_keys(Seed, Position, Round, Keys, n, STREAM: tl.constexpr, HAS_ROUND: tl.constexpr,
                  GAMMA: tl.constexpr, M1: tl.constexpr, M2: tl.constexpr, BLOCK: tl.constexpr):
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = rows < n
        h = _mix64(tl.load(Seed + rows, mask=ok, other=0).to(tl.int64) * GAMMA + STREAM, M1, M2)
        h = _mix64(h + (tl.load(Position + rows, mask=ok, other=0).to(tl.int64) + 1) * GAMMA, M1, M2)
        if HAS_ROUND:
            h = _mix64(h + (tl.load(Round + rows, mask=ok, other=0).to(tl.int64) + 1) * GAMMA, M1, M2)
        tl.store(Keys + rows, h, mask=ok)

    @triton.jit
    def _log(x, FAST: tl.constexpr):
        """Natural log of float32: the GPU's hardware log2 (about 2**-22 of error) with FAST, else
        Triton's (the interpreter has no hardware log)."""
        if FAST:
            return libdevice.fast_log2f(x) * 0.6931471805599453
        else:
            return tl.log(x)

    @triton.jit
    def _approx_gumbel(odd, FAST: tl.constexpr):
        """-log(-log u) for u = odd * 2**-53 (odd < 2**53) in float32, near the float64 noise cast to
        float32 (`NOISE_MARGIN`): -log(u) from u below one half, and as -log1p(-t) of t = 1 - u above it
        (a short series for small t), so u near 1 keeps its bits."""
        lower = odd < 4503599627370496  # u < 1/2 (2**52)
        w = tl.where(lower, odd, 9007199254740992 - odd).to(tl.float32) * 1.1102230246251565e-16  # u or t
        series = w * (1.0 + w * (0.5 + w * (0.3333333333333333 + w * 0.25)))  # -log(1 - t) for t < 2**-6
        e = tl.where(lower | (w >= 0.015625), -_log(tl.where(lower, w, 1.0 - w), FAST), series)
        return -_log(e, FAST)

    @triton.jit
    def _split_argmax(Scores, Keys, BestVal, BestIdx, stride_s, vocab, per_split,
                      NOISE: tl.constexpr, GAMMA: tl.constexpr, M1: tl.constexpr, M2: tl.constexpr,
                      INV: tl.constexpr, MARGIN: tl.constexpr, FAST: tl.constexpr, BLOCK: tl.constexpr):
        """One split of a row: its first maximum of scores (+ the row key's Gumbel noise with NOISE)
        and where it is. Without noise a NaN or +inf score makes the split's maximum NaN (the row has
        no greedy token, as `sampler.greedy_ids` rules).

        With noise each tile is first scored with float32 noise (`_approx_gumbel`); only a tile where
        some column comes within MARGIN (plus 2**-20 of its size) of the best such score of the
        tiles before takes the float64 noise of the reference, and only those tiles compete. The
        margin bounds twice the float32 noise's error and the adds' rounding, so the row's winner and
        any column tying it lie in such tiles: the same token as float64 noise over every column."""
        row = tl.program_id(0)
        split = tl.program_id(1)
        start = split * per_split
        end = tl.minimum(start + per_split, vocab)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        idx = tl.zeros([BLOCK], tl.int32) + start
        bad = tl.zeros([BLOCK], tl.int32)
        if NOISE:
            h = tl.load(Keys + row)
            rough_best = tl.full([], float("-inf"), tl.float32)  # the best float32-noise score of the tiles before
        for c0 in range(start, end, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            ok = cols < end
            v = tl.load(Scores + row.to(tl.int64) * stride_s + cols, mask=ok, other=float("-inf")).to(tl.float32)
            if NOISE:
                x = _mix64(h + (cols.to(tl.int64) + 1) * GAMMA, M1, M2)  # splitmix64 of the key, column j + 1
                odd = _srl(x, 12) * 2 + 1  # u = odd * 2**-53, in (0, 1)
                rough = v + _approx_gumbel(odd, FAST)
                rough = tl.where(ok & (rough == rough), rough, float("-inf"))  # NaN scores never win
                bound = tl.minimum(rough_best, 3.0e38)  # after a +inf only +inf comes near (and loses)
                near = (rough >= bound - (MARGIN + tl.abs(bound) * 9.5367431640625e-07)) & (rough > float("-inf"))
                if tl.max(near.to(tl.int32), 0) > 0:
                    noise = -tl.log(-tl.log(odd.to(tl.float64) * INV))
                    exact = tl.where(ok, v + noise.to(tl.float32), float("-inf"))
                    take = exact > best  # strict: a lane keeps its first maximum
                    best = tl.where(take, exact, best)
                    idx = tl.where(take, cols, idx)
                rough_best = tl.maximum(rough_best, tl.max(rough, 0))
            else:
                bad = bad | ((v != v) | (v == float("inf"))).to(tl.int32)
                take = v > best
                best = tl.where(take, v, best)
                idx = tl.where(take, cols, idx)
        top = tl.max(best, 0)
        first = tl.min(tl.where(best == top, idx, 2147483647), 0)
        if not NOISE:
            top = tl.where(tl.max(bad, 0) > 0, float("nan"), top)
        out = row * tl.num_programs(1) + split
        tl.store(BestVal + out, top)
        tl.store(BestIdx + out, first)

    @triton.jit
    def _merge_splits(BestVal, BestIdx, Out, splits, GREEDY: tl.constexpr, BLOCK_S: tl.constexpr):
        """A row's token from its splits' maxima: the first split holding the largest (with GREEDY,
        -1 where a split found NaN or +inf, or nothing above -inf)."""
        row = tl.program_id(0)
        s = tl.arange(0, BLOCK_S)
        ok = s < splits
        v = tl.load(BestVal + row * splits + s, mask=ok, other=float("-inf"))
        i = tl.load(BestIdx + row * splits + s, mask=ok, other=2147483647)
        nan = v != v
        v = tl.where(nan, float("-inf"), v)
        top = tl.max(v, 0)
        token = tl.min(tl.where(v == top, i, 2147483647), 0).to(tl.int64)
        if GREEDY:
            token = tl.where((tl.max(nan.to(tl.int32), 0) > 0) | (top == float("-inf")), -1, token)
        tl.store(Out + row, token)


def row_keys_kernel(seed: Tensor, position: Tensor, stream: int, round_: Tensor | None) -> Tensor:
    """`rng.row_key` in one launch for its twenty-odd int64 ops: [N] int64 keys, the same bits."""
    n = seed.shape[0]
    keys = torch.empty(n, dtype=torch.int64, device=seed.device)
    if n:
        block = min(1024, triton.next_power_of_2(n))
        _row_keys[(triton.cdiv(n, block),)](seed.contiguous(), position.contiguous(),
                                            (round_ if round_ is not None else position).contiguous(), keys, n,
                                            STREAM=stream, HAS_ROUND=round_ is not None, GAMMA=GAMMA, M1=MIX1,
                                            M2=MIX2, BLOCK=block, num_warps=1)
    return keys


def _argmax_rows(scores: Tensor, keys: Tensor | None, programs: int, block: int, warps: int = 4,
                 margin: float = NOISE_MARGIN) -> Tensor:
    """The token [N] int64 of each row of scores [N, V] (unit column stride): the argmax of scores plus
    the keys' Gumbel noise, or without keys the greedy argmax (-1 for a row with NaN, +inf or nothing
    above -inf). The vocabulary is split until about `programs` programs run; a second launch merges
    the splits."""
    n, vocab = scores.shape
    if scores.stride(1) != 1:
        raise ValueError(f"argmax kernel: scores need a unit column stride, got strides {tuple(scores.stride())}")
    splits = max(1, min(triton.cdiv(vocab, block), programs // max(n, 1)))
    per_split = triton.cdiv(triton.cdiv(vocab, splits), block) * block
    splits = triton.cdiv(vocab, per_split)
    vals = torch.empty(n, splits, dtype=torch.float32, device=scores.device)
    idx = torch.empty(n, splits, dtype=torch.int32, device=scores.device)
    out = torch.empty(n, dtype=torch.int64, device=scores.device)
    if n == 0:
        return out
    _split_argmax[(n, splits)](scores, keys if keys is not None else idx, vals, idx, scores.stride(0), vocab,
                               per_split, NOISE=keys is not None, GAMMA=GAMMA, M1=MIX1, M2=MIX2, INV=INV_2_53,
                               MARGIN=margin, FAST=not interpreted(), BLOCK=block, num_warps=warps)
    _merge_splits[(n,)](vals, idx, out, splits, GREEDY=keys is None,
                        BLOCK_S=max(16, triton.next_power_of_2(splits)), num_warps=1)
    return out


def gumbel_argmax_kernel(scores: Tensor, keys: Tensor, programs: int = TARGET_PROGRAMS,
                         margin: float = NOISE_MARGIN) -> Tensor:
    """argmax(scores + rng.gumbel_from_keys(keys, V), dim=1) for fp32 scores [N, V] and int64 keys [N]
    (`margin`: see `_split_argmax`; the tests shrink it to show what it guards)."""
    if scores.dtype != torch.float32:
        raise ValueError(f"gumbel_argmax: scores must be float32, got {scores.dtype}")
    return _argmax_rows(scores, keys.contiguous(), programs, BLOCK, margin=margin)


def greedy_ids_kernel(logits: Tensor, programs: int = TARGET_PROGRAMS, block: int = GREEDY_BLOCK,
                      warps: int = GREEDY_WARPS) -> Tensor:
    """`sampler.greedy_ids` of logits [N, V] (16- or 32-bit floats) in one pass over them: the argmax
    per row, ties to the lowest id, -1 for a row with NaN, +inf or nothing above -inf."""
    return _argmax_rows(logits, None, programs, block, warps)
