"""A drafter's LM head in bfloat16 on the CPU (`BF16Product`), through oneDNN.

Float32 linears stay on `F.linear` (MKL): in the engine it is as fast as oneDNN's product from a packed weight
or faster at every row count measured, one-row decode through 36-row verify steps (`benchmarks/
bench_cpu_linear.py`: the embedded pair's plain decode 1.30x faster on `F.linear`, its speculative decode
1.10x; a 1024-wide model's plain decode 1.19x), since a oneDNN call costs about 14 us more and the weights
stream from memory, where oneDNN's packed layout gains nothing; and it holds no second copy of the weights.

The drafter's LM head is the exception: on a CPU that multiplies bfloat16 in hardware it reads a bfloat16 copy,
half the bytes of the largest weight a draft streams. Drafts need no more precision than the bfloat16 their
drafters are trained and published in; the verification that decides the output stays in float32.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.nn import functional as F

PACK_ROWS = 16  # the row count oneDNN lays a packed weight out for: a draft block's rows
PACK_MAX_BYTES = 2 << 30  # the largest bfloat16 head copy made (its memory)
DRAFT_HEAD_BF16 = True  # a drafter's LM head in bfloat16 where the CPU has bf16 products (benchmarks turn it off)


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` in oneDNN's blocked layout (an opaque tensor only `_onednn_linear` reads)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)


class BF16Product:
    """x -> x @ weight^T, both rounded to bfloat16, accumulated in float32 and returned in bfloat16 by oneDNN,
    from a packed bfloat16 copy of `weight` (made on first use, and again when the weight changes in place)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        packed = _packed_copy(self.__dict__, self.weight, torch.bfloat16)
        return _onednn_linear(x.reshape(-1, x.shape[-1]).to(torch.bfloat16), packed, None).view(*x.shape[:-1], -1)

    def __getstate__(self) -> dict:  # the packed copy (opaque: neither copied nor pickled) is made again
        return {k: v for k, v in self.__dict__.items() if k not in ("_packed", "_packed_key")}


def _packed_copy(state: dict, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`weight` in `dtype`, packed, kept in `state` (an object's __dict__) until the weight changes (its
    version counter; a change through `.data` is not seen)."""
    key = (weight.data_ptr(), weight._version)
    if state.get("_packed_key") != key:
        state["_packed"], state["_packed_key"] = _pack(weight.to(dtype)), key
    return state["_packed"]


def draft_head_product(head: nn.Module) -> BF16Product | None:
    """The product a drafter's LM head (its own or the target's) takes on the CPU: `BF16Product` over its
    weight where the head is one linear (not a rank's shard), this CPU multiplies bfloat16 in hardware
    (AVX512-BF16 or AMX) and the copy fits `PACK_MAX_BYTES`; None, the head's own product, elsewhere."""
    if not (DRAFT_HEAD_BF16 and type(head) is nn.Linear and head.bias is None
            and head.weight.device.type == "cpu" and bf16_products()):
        return None
    return BF16Product(head.weight) if head.weight.numel() * 2 <= PACK_MAX_BYTES else None


@functools.cache
def bf16_products() -> bool:
    """oneDNN takes bfloat16 here and the CPU multiplies it in hardware (elsewhere oneDNN emulates it, slower
    than float32)."""
    native = (getattr(torch.cpu, "_is_avx512_bf16_supported", bool)()
              or getattr(torch.cpu, "_is_amx_tile_supported", bool)())
    return native and onednn_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


@functools.cache
def onednn_available() -> bool:
    """oneDNN is built in and its product agrees with `F.linear` on this machine."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    gen = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(shape, generator=gen) for shape in ((3, 64), (48, 64), (48,)))
    ref = F.linear(x, w, b)
    try:
        return all(torch.allclose(_onednn_linear(x, weight, b), ref, rtol=1e-5, atol=1e-5) for weight in (w, _pack(w)))
    except RuntimeError:
        return False
