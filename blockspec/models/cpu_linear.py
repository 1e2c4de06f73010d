"""Float32 linears on the CPU through oneDNN rather than the default BLAS.

On an AVX-512 host oneDNN's fp32 products are 2.6-3x faster than `F.linear`'s default path for the
one to sixteen rows of a decode or verify step (a 16384 x 256 LM head: 0.14 against 0.36 ms for one
row, 0.45 against 1.2 ms for nine). Same precision: fp32 inputs and accumulation, results within
float32 rounding of `F.linear` (the reference path, which `use_onednn_linears` keeps wherever oneDNN
is missing or disagrees with it). Neither path is bitwise invariant to the number of rows.

A weight that oneDNN reads in its own blocked layout ("packed") streams faster, and many rows then
cost what one does: a 2048 x 256 weight from memory, 58 against 72 us for one row, 69 against 100 us
for nine. Packing keeps a second copy of each weight, so a model is packed only while its float32
linear weights fit `PACK_MAX_BYTES`.

A drafter's LM head is the exception to float32 (`BF16Product`): on a CPU that multiplies bfloat16 in
hardware it reads a bfloat16 copy, half the bytes of the largest weight a draft streams. Drafts need
no more precision than the bfloat16 their drafters are trained and published in; the verification
that decides the output stays in float32.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

PACK_ROWS = 16  # the row count oneDNN lays a packed weight out for: a verify's or a draft block's rows
PACK_MAX_BYTES = 2 << 30  # the float32 linear weights of a model packed at most (the copy's memory)
DRAFT_HEAD_BF16 = True  # a drafter's LM head in bfloat16 where the CPU has bf16 products (benchmarks turn it off)


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` in oneDNN's blocked layout (an opaque tensor only `_onednn_linear` reads)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)


class OneDNNLinear(nn.Linear):
    """An `nn.Linear` whose product runs in oneDNN; its parameters (and any tie to them) are unchanged.
    oneDNN's op has no backward, so a forward that autograd records takes `F.linear`. With `pack`, the
    product reads a packed copy of the weight, made again when the weight changes in place (its version
    counter; a change through `.data` is not seen)."""

    pack = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return F.linear(x, self.weight, self.bias)
        return _onednn_linear(x, self._packed_weight() if self.pack else self.weight, self.bias)

    def _packed_weight(self) -> torch.Tensor:
        return _packed_copy(self.__dict__, self.weight, self.weight.dtype)

    def __getstate__(self) -> dict:
        return without_packed_copy(self.__dict__)


class BF16Product:
    """x -> x @ weight^T, both rounded to bfloat16, accumulated in float32 and returned in bfloat16 by oneDNN,
    from a packed bfloat16 copy of `weight` (made on first use, and again when the weight changes in place)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        packed = _packed_copy(self.__dict__, self.weight, torch.bfloat16)
        return _onednn_linear(x.reshape(-1, x.shape[-1]).to(torch.bfloat16), packed, None).view(*x.shape[:-1], -1)

    def __getstate__(self) -> dict:
        return without_packed_copy(self.__dict__)


def _packed_copy(state: dict, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`weight` in `dtype`, packed, kept in `state` (an object's __dict__) until the weight changes (its
    version counter; a change through `.data` is not seen)."""
    return _kept_packed(state, (weight.data_ptr(), weight._version), lambda: weight.to(dtype))


def _kept_packed(state: dict, key: tuple, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """make(), packed, kept in `state` while `key` stays the same."""
    if state.get("_packed_key") != key:
        state["_packed"], state["_packed_key"] = _pack(make()), key
    return state["_packed"]


def packed_product(state: dict, key: tuple, make: Callable[[], torch.Tensor], x: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W^T + b through oneDNN, W = make() (float32) packed once and kept in `state` (an object's __dict__)
    while `key` stays the same: for weights the model holds in another form (FP8 and its scales)."""
    return _onednn_linear(x, _kept_packed(state, key, make), bias)


def without_packed_copy(state: dict) -> dict:
    """`state` without the packed copy (an opaque tensor cannot be copied or pickled): it is made again."""
    return {k: v for k, v in state.items() if k not in ("_packed", "_packed_key")}


def draft_head_product(head: nn.Module) -> BF16Product | None:
    """The product a drafter's LM head (its own or the target's) takes on the CPU: `BF16Product` over its
    weight where the head is one linear (not a rank's shard), this CPU multiplies bfloat16 in hardware
    (AVX512-BF16 or AMX) and the copy fits `PACK_MAX_BYTES`; None, the head's own product, elsewhere."""
    if not (DRAFT_HEAD_BF16 and type(head) in (nn.Linear, OneDNNLinear) and head.bias is None
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


def use_onednn_linears(model: nn.Module) -> int:
    """Run every plain float32 `nn.Linear` of `model` that lives on the CPU through oneDNN, in place (the
    class changes, the parameters stay, so tied weights and references to the modules hold), from packed
    weights where they fit `PACK_MAX_BYTES`. Quantized and parallel linears are other classes and keep
    their paths. Returns how many were switched."""
    if not onednn_available():
        return 0
    linears = [m for m in model.modules() if type(m) is nn.Linear and m.weight.device.type == "cpu"
               and m.weight.dtype == torch.float32]
    pack = sum(m.weight.nbytes for m in linears) <= PACK_MAX_BYTES
    for module in linears:
        module.__class__ = OneDNNLinear
        module.pack = pack
    return len(linears)
