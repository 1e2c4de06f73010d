"""Preallocated per-slot KV cache; a request's cache length is just a number, so rollback is free.

Layout per layer: [max_slots, kv_heads, max_len + 1, head_dim]. Column `max_len` is a trash column
that padded query rows write into, so padding never overwrites real keys and is never read (every
real query position is below `max_len`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from blockspec.config import ConfigError
from blockspec.transfer import to_device


class OutOfSlots(RuntimeError):
    """No free slot: the scheduler must queue the request."""


class KVCache:
    def __init__(
        self,
        num_layers: int,
        max_slots: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        # One extra slot (index max_slots) is scratch space for padded rows of captured batches.
        shape = (max_slots + 1, num_kv_heads, max_len + 1, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_slots = max_slots
        self.max_len = max_len
        self.trash = max_len
        self.scratch_slot = max_slots
        self._free = list(range(max_slots - 1, -1, -1))

    @staticmethod
    def planned_bytes(num_layers: int, max_slots: int, num_kv_heads: int, head_dim: int, max_len: int,
                      dtype: torch.dtype) -> int:
        """Bytes a cache of these dimensions allocates (the scratch slot and trash column included)."""
        return 2 * num_layers * (max_slots + 1) * num_kv_heads * (max_len + 1) * head_dim * dtype.itemsize

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def allocate(self) -> int:
        if not self._free:
            raise OutOfSlots("no free KV slot")
        return self._free.pop()

    def release(self, slot: int) -> None:
        if slot in self._free:
            raise ValueError(f"slot {slot} released twice")
        self._free.append(slot)

    def write(self, layer: int, meta: "AttnMeta", k: Tensor, v: Tensor) -> None:
        """k, v: [R, kv_heads, Q, hd], stored at (slot, write_pos) for every query row."""
        idx = (meta.slots[:, None], slice(None), meta.write_pos)
        self.k[layer][idx] = k.transpose(1, 2)
        self.v[layer][idx] = v.transpose(1, 2)

    def read(self, layer: int, meta: "AttnMeta") -> tuple[Tensor, Tensor]:
        """Keys and values of the first kv_len positions of each request's slot: [R, kv_heads, kv_len, hd]."""
        if meta.contiguous_slot is not None:
            s = meta.contiguous_slot
            return self.k[layer][s : s + 1, :, : meta.kv_len], self.v[layer][s : s + 1, :, : meta.kv_len]
        return self.k[layer][meta.slots, :, : meta.kv_len], self.v[layer][meta.slots, :, : meta.kv_len]


def check_cache_plan(need: int, per_seq: int, free: int, total: int, utilization: float, reserve: int,
                     max_num_seqs: int, max_model_len: int) -> None:
    """Refuse, with the numbers, KV caches that cannot fit in the GPU's memory, before allocating them.

    The engine may hold `utilization` of `total`; what is in use already (weights) and `reserve`
    (activations of a prefill chunk, logits, graph pools) come off it. `need` is the caches of
    max_num_seqs slots, `per_seq` what each slot adds."""
    gib = 1 << 30
    budget = utilization * total - (total - free) - reserve
    if need <= budget:
        return
    fits = max(0, int(budget // per_seq) - 1) if per_seq else 0  # one scratch slot beside the requests'
    raise ConfigError(
        f"the KV caches for max_num_seqs={max_num_seqs} x max_model_len={max_model_len} need {need / gib:.1f} GiB, "
        f"but {max(budget, 0) / gib:.1f} GiB are left of gpu_memory_utilization={utilization} x {total / gib:.1f} GiB "
        f"after the weights ({(total - free) / gib:.1f} GiB in use) and {reserve / gib:.1f} GiB for activations; "
        f"{fits} sequences of that length fit: lower max_num_seqs or max_model_len, or raise gpu_memory_utilization")


@dataclass
class AttnMeta:
    """Where each query row sits: its slot, RoPE position, cache column, and which keys it sees.

    `bounds[layer_type]` = (lo, hi) [R, Q]: query row i of request r attends to key positions
    lo..hi (inclusive) of its slot. The attention kernel reads them directly; the reference path
    turns them into a boolean mask (`mask`)."""

    slots: Tensor  # [R] int64
    positions: Tensor  # [R, Q] int64, absolute positions (RoPE)
    write_pos: Tensor  # [R, Q] int64, cache column (trash column for padding rows)
    kv_len: int  # keys read per request
    bounds: dict[str, tuple[Tensor, Tensor]]
    contiguous_slot: int | None = None  # single request: read its slot as a view, no gather

    def mask(self, layer_type: str) -> Tensor:
        """[R, 1, Q, kv_len] bool keep-mask of `bounds[layer_type]`."""
        lo, hi = self.bounds[layer_type]
        return range_mask(lo, hi, torch.arange(self.kv_len, device=lo.device)).unsqueeze(1)


def range_mask(lo: Tensor, hi: Tensor, key_pos: Tensor) -> Tensor:
    """[..., Q, L] bool: key_pos[..., L] lies within lo..hi [..., Q] (inclusive)."""
    k = key_pos.unsqueeze(-2)
    return (k >= lo.unsqueeze(-1)) & (k <= hi.unsqueeze(-1))


def causal_bounds(positions: Tensor, sliding_window: int | None, layer_types: tuple[str, ...]
                  ) -> dict[str, tuple[Tensor, Tensor]]:
    """Each row sees keys up to its own position; sliding layers only the last `sliding_window`.
    Made once per forward as contiguous int32, the kernel's format, so no layer converts them."""
    hi = positions.to(torch.int32).contiguous()
    bounds = {"full_attention": (torch.zeros_like(hi), hi)}
    if "sliding_attention" in layer_types:
        assert sliding_window is not None
        bounds["sliding_attention"] = ((hi - sliding_window + 1).clamp_(min=0), hi)
    return bounds


def causal_meta(
    slots: list[int],
    starts: list[int],
    q_lens: list[int],
    num_queries: int,
    trash: int,
    device: torch.device | str,
    sliding_window: int | None = None,
    layer_types: tuple[str, ...] = ("full_attention",),
    kv_len: int | None = None,
) -> AttnMeta:
    """Metadata for a causal forward: request r feeds q_lens[r] tokens at positions starts[r], ... .

    Host lists in, device tensors out: the engine knows every length on the host, so this needs no
    sync. A single request reads its slot as a view instead of a gather.
    """
    kv_len = kv_len or max(s + q for s, q in zip(starts, q_lens))
    as_t = lambda v: to_device(v, torch.int64, device)  # noqa: E731
    meta = meta_from_tensors(as_t(slots), as_t(starts), as_t(q_lens), num_queries, kv_len, trash, sliding_window,
                             layer_types)
    meta.contiguous_slot = slots[0] if len(slots) == 1 else None
    return meta


def meta_from_tensors(
    slots: Tensor,
    starts: Tensor,
    q_lens: Tensor,
    num_queries: int,
    kv_len: int,
    trash: int,
    sliding_window: int | None = None,
    layer_types: tuple[str, ...] = ("full_attention",),
) -> AttnMeta:
    """Device-only metadata (CUDA-graph capturable): query i of request r sits at starts[r] + i and
    sees keys at positions <= its own (its cache plus earlier rows of this forward); rows
    i >= q_lens[r] are padding whose K/V go to the trash column.
    """
    ar = torch.arange(num_queries, device=starts.device)
    valid = ar[None, :] < q_lens[:, None]
    # padding rows sit at their request's start: in range of the RoPE table however wide the batch is
    positions = torch.where(valid, starts[:, None] + ar[None, :], starts[:, None])
    write_pos = torch.where(valid, positions, torch.full_like(positions, trash))
    return AttnMeta(slots, positions, write_pos, kv_len, causal_bounds(positions, sliding_window, layer_types))


def dense_causal_meta(batch: int, seq: int, device: torch.device | str, sliding_window: int | None = None,
                      layer_types: tuple[str, ...] = ("full_attention",)) -> AttnMeta:
    """Metadata for a cache-free causal forward over [batch, seq] tokens at positions 0..seq-1."""
    positions = torch.arange(seq, device=device).expand(batch, seq)
    slots = torch.zeros(batch, dtype=torch.int64, device=device)
    return AttnMeta(slots, positions, positions, seq, causal_bounds(positions, sliding_window, layer_types))
