"""Counter-based keyed noise: every random number is a pure function of its key.

Why counter-based instead of a stateful generator: a sampled token must not depend on which other
requests share the batch, on how rows are chunked, on whether the step was a plain decode or a
verify block, or on the device. So each uniform is a hash of (seed, absolute position, stream,
round, column) computed with integer arithmetic on the device; int64 multiplies wrap and shifts
are made logical by masking, which gives bit-identical numbers on CPU and CUDA.

Streams keep the independent uses of randomness apart (sampling.md 3.3, 9.4):

- ``STREAM_TARGET``: target sampling, keyed by (seed, absolute position) only. A verify row and
  the plain decode step that samples the same position see the same noise, which is what makes
  sample-and-match verification reproduce plain sampling token for token. A value of this stream
  influences an outcome only when its position is committed, and committed positions are never
  sampled again, so no observed value is ever reused.
- ``STREAM_DRAFT``, ``STREAM_ACCEPT``, ``STREAM_RESIDUAL``: drafting and rejection sampling. They
  take ``round_``, a per-request value unique to each verify round (e.g. the committed length at
  the start of the step). Block verification reads acceptance uniforms beyond the accepted
  prefix; without the round in the key, the next round would reuse those values after they were
  observed to exceed their thresholds, which biases the output (sampling.md 3.3).
"""

from __future__ import annotations

import torch
from torch import Tensor

from blockspec.kernels.gumbel import GAMMA, INV_2_53, MIX1, MIX2, row_keys_kernel  # the kernels hash alike
from blockspec.kernels.ops import use_kernels

STREAM_TARGET = 0
STREAM_DRAFT = 1
STREAM_ACCEPT = 2
STREAM_RESIDUAL = 3
STREAM_SYNTHETIC = 4  # the benchmarks' drawn acceptance (`speculative.synthetic`)


def _srl(x: Tensor, s: int) -> Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix64_(x: Tensor) -> Tensor:
    """splitmix64 finaliser, in place on a tensor the caller owns; a bijection of 64-bit words."""
    x ^= _srl(x, 30)
    x *= MIX1
    x ^= _srl(x, 27)
    x *= MIX2
    x ^= _srl(x, 31)
    return x


def row_key(seed: Tensor, position: Tensor, stream: int, round_: Tensor | None) -> Tensor:
    """One 64-bit state per row, [N] int64; each field is absorbed then mixed, so field order matters.
    On a GPU one kernel launch (`kernels.gumbel.row_keys_kernel`, the same integer arithmetic)."""
    if use_kernels(seed):
        return row_keys_kernel(seed, position, stream, round_)
    h = _mix64_(seed.to(torch.int64) * GAMMA + stream)
    h = _mix64_(h + (position.to(torch.int64) + 1) * GAMMA)
    if round_ is not None:
        h = _mix64_(h + (round_.to(torch.int64) + 1) * GAMMA)
    return h


def uniform_from_keys(keys: Tensor, width: int, start: int = 0) -> Tensor:
    """Uniforms in the open interval (0, 1), shape [N, width], float64, from `row_key` states: the row's
    columns start .. start + width - 1.

    Column j of row n is splitmix64(keys[n] + (j + 1) * gamma): the splitmix64 sequence of the
    row's key. The top 52 bits k give (2k + 1) / 2^53, exactly representable, never 0 or 1.
    """
    cols = (torch.arange(start + 1, start + width + 1, device=keys.device, dtype=torch.int64) * GAMMA).unsqueeze(0)
    x = _mix64_(keys.unsqueeze(1) + cols)
    return (_srl(x, 12) * 2 + 1).to(torch.float64) * INV_2_53


def keyed_uniform(seed: Tensor, position: Tensor, stream: int, round_: Tensor | None, width: int) -> Tensor:
    """`uniform_from_keys` of the rows' keys: [N, width] float64 uniforms in (0, 1)."""
    return uniform_from_keys(row_key(seed, position, stream, round_), width)


def gumbel_from_keys(keys: Tensor, width: int, dtype: torch.dtype = torch.float32, start: int = 0) -> Tensor:
    """Standard Gumbel noise -log(-log u) from `uniform_from_keys` (columns start .. start + width - 1), [N, width].

    Computed in float64 (u has 52 random bits, so both tails stay resolved) and then cast; the
    argmax of logprobs + this noise is a sample from the row's distribution (Gumbel-max).
    """
    return uniform_from_keys(keys, width, start).log_().neg_().log_().neg_().to(dtype)


def gumbel(seed: Tensor, position: Tensor, stream: int, round_: Tensor | None, width: int,
           dtype: torch.dtype = torch.float32) -> Tensor:
    """`gumbel_from_keys` of the rows' keys."""
    return gumbel_from_keys(row_key(seed, position, stream, round_), width, dtype)
