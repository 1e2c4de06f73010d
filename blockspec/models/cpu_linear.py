"""Float32 linears on the CPU through oneDNN rather than the default BLAS.

On an AVX-512 host oneDNN's fp32 products are 2.6-3x faster than `F.linear`'s default path for the
one to sixteen rows of a decode or verify step (a 16384 x 256 LM head: 0.14 against 0.36 ms for one
row, 0.45 against 1.2 ms for nine). Same precision: fp32 inputs and accumulation, results within
float32 rounding of `F.linear` (the reference path, which `use_onednn_linears` keeps wherever oneDNN
is missing or disagrees with it). Neither path is bitwise invariant to the number of rows.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.nn import functional as F


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class OneDNNLinear(nn.Linear):
    """An `nn.Linear` whose product runs in oneDNN; its parameters (and any tie to them) are unchanged.
    oneDNN's op has no backward, so a forward that autograd records takes `F.linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return F.linear(x, self.weight, self.bias)
        return _onednn_linear(x, self.weight, self.bias)


class BF16Linear(nn.Module):
    """A bf16 copy of a float32 linear whose product runs in oneDNN: fp32 rows in, fp32 out. For a
    product whose result only proposes (a drafter's vocabulary head), where on a CPU with native bf16
    products (AVX512-BF16, AMX) eight rows of a 16384 x 256 head take 0.24 ms against 0.55 ms."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight = nn.Parameter(linear.weight.detach().to(torch.bfloat16), requires_grad=False)
        bias = linear.bias
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(torch.bfloat16), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _onednn_linear(x.to(torch.bfloat16), self.weight, self.bias).float()


@functools.cache
def native_bf16() -> bool:
    """This CPU multiplies bf16 in hardware, and oneDNN's bf16 product agrees with `F.linear` to bf16 rounding."""
    if not (onednn_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return False
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 64, generator=gen), torch.randn(48, 64, generator=gen)
    try:
        got = _onednn_linear(x.bfloat16(), w.bfloat16(), None).float()
    except RuntimeError:
        return False
    return torch.allclose(got, F.linear(x, w), rtol=0.05, atol=0.1)


def bf16_draft_head(head: nn.Module) -> BF16Linear | None:
    """A bf16 oneDNN copy of a CPU float32 vocabulary head for drafting, where this CPU has native bf16
    products (None elsewhere, or for a head that is not a plain linear)."""
    if not (isinstance(head, nn.Linear) and head.weight.device.type == "cpu"
            and head.weight.dtype == torch.float32 and native_bf16()):
        return None
    return BF16Linear(head)


@functools.cache
def onednn_available() -> bool:
    """oneDNN is built in and its product agrees with `F.linear` on this machine."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    gen = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(shape, generator=gen) for shape in ((3, 64), (48, 64), (48,)))
    try:
        return torch.allclose(_onednn_linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    except RuntimeError:
        return False


def use_onednn_linears(model: nn.Module) -> int:
    """Run every plain float32 `nn.Linear` of `model` that lives on the CPU through oneDNN, in place (the
    class changes, the parameters stay, so tied weights and references to the modules hold). Quantized
    and parallel linears are other classes and keep their paths. Returns how many were switched."""
    if not onednn_available():
        return 0
    switched = 0
    for module in model.modules():
        if type(module) is nn.Linear and module.weight.device.type == "cpu" and module.weight.dtype == torch.float32:
            module.__class__ = OneDNNLinear
            switched += 1
    return switched
