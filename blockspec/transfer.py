"""Host-to-device copies that never wait for the device.

`torch.tensor(values, device="cuda")` copies from pageable memory synchronously: the host stops
until every kernel already queued has run, so the GPU then idles while the host prepares the next
launch. Within a step that costs milliseconds at batch 1. Staging in pinned memory makes the copy
asynchronous; the caching host allocator keeps the staging block alive until the copy is done.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def to_device(values: Sequence | Tensor, dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """`values` (a host list or CPU tensor) as a tensor on `device`, copied without a host sync."""
    # the host side is built on the CPU explicitly: under a `torch.device("cuda")` context a bare
    # torch.tensor would land on the GPU, which cannot be pinned
    if torch.device(device).type != "cuda":
        host = values.to(dtype) if isinstance(values, Tensor) else torch.tensor(values, dtype=dtype, device="cpu")
        return host.to(device)
    # allocated pinned, not pinned after: `Tensor.pin_memory()` first asks the driver whether the
    # memory is pinned already, tens of microseconds a call on the host's critical path
    if isinstance(values, Tensor):
        host = torch.empty(values.shape, dtype=dtype, device="cpu", pin_memory=True).copy_(values)
    else:
        host = torch.tensor(values, dtype=dtype, device="cpu", pin_memory=True)
    return host.to(device, non_blocking=True)


def copy_from_host(dst: Tensor, values: Sequence) -> None:
    """Write a host list into `dst` (a captured graph's static input) in one copy that does not wait for the
    device."""
    if dst.device.type != "cuda":
        dst.copy_(torch.tensor(values, dtype=dst.dtype))
        return
    dst.copy_(torch.tensor(values, dtype=dst.dtype, device="cpu", pin_memory=True), non_blocking=True)
