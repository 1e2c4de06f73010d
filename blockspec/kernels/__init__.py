"""Every Triton kernel of blockspec, each with a PyTorch reference its tests hold it to: the decoder's
ops (`ops`), paged attention (`attention`), Gumbel-max sampling (`gumbel`), acceptance by token match
(`accept`), DSpark's greedy Markov drafting (`markov`) and the mixture-of-experts MLP (`moe`).

Without the triton package (CPU-only installs) `triton` is None and callers take the references.

Kernels on the decode path launch with programmatic dependent launch on Hopper and later
(`dependent_launch`, `ops.dependent_start`): the next kernel's programs are scheduled while this one
drains, and wait (`griddepcontrol.wait`) before they read or write anything, so the gap between two
launches and the tail of the first overlap the next one's start. The dense weight stream
(`ops.skinny_linear`) lets the next kernel in after its main loop, and attention at its end: let in at
their start, the dependents sit on the SMs these kernels still work on (a decode step 7 % slower on an
H200). The others, shorter or one wave of programs at decode sizes, let it in at their start.
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
except ImportError:  # CPU-only installs: the reference paths are used
    triton = None


@functools.cache
def triton_available() -> bool:
    return triton is not None


PDL = True
"""Programmatic dependent launch for the kernels that take it (see the module's docstring); benchmarks
turn it off to measure it (benchmarks/bench_pdl.py)."""


def interpreted() -> bool:
    """Kernels run by Triton's interpreter (TRITON_INTERPRET=1, the CPU tests), which has no inline PTX."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _pdl_capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9 and not interpreted()


def dependent_launch(t: torch.Tensor) -> dict[str, bool]:
    """Launch arguments of a kernel with a `PDL` constexpr, on `t`'s device: PDL on (and Triton's
    `launch_pdl`) on CUDA devices of compute capability 9.0 and up, else nothing (the kernel's default)."""
    on = PDL and t.is_cuda and _pdl_capable(t.device.index if t.device.index is not None else torch.cuda.current_device())
    return {"PDL": True, "launch_pdl": True} if on else {}


def check_head_scales(k_scale: float | torch.Tensor, v_scale: float | torch.Tensor, kv_heads: int, kernel: str) -> bool:
    """Whether a kernel's FP8 cache scales are per KV head ([kv_heads] fp32 tensors, both) rather than one
    float each; a mix or a tensor of another shape or dtype is refused."""
    k_head, v_head = isinstance(k_scale, torch.Tensor), isinstance(v_scale, torch.Tensor)
    if not (k_head or v_head):  # the per-tensor launch: two type checks
        return False
    if not (k_head and v_head):
        raise ValueError(f"{kernel}: K and V cache scales must both be floats or both per-head tensors")
    for s in (k_scale, v_scale):
        if s.shape != (kv_heads,) or s.dtype != torch.float32 or not s.is_contiguous():
            raise ValueError(f"{kernel}: a per-head cache scale must be a contiguous float32 [{kv_heads}] tensor, "
                             f"got {s.dtype} {tuple(s.shape)}")
    return True
