"""Attention of a block of query rows over a slot of the KV cache, as one Triton kernel (+ a merge).

Every engine attention is "query rows of request r attend to keys lo[r, i]..hi[r, i] of cache slot
slots[r]": decode and verify (hi = the row's own position), the drafter's non-causal block (hi =
the block's last position) and sliding windows (lo > 0). The kernel reads keys in place from the
cache, so nothing is gathered, repeated per query head or masked with a materialised tensor; the
query heads that share a KV head are processed together, so each key is loaded once per step.
When a batch has too few (request, KV head) pairs to fill the GPU (batch-1 decode), the key range
is split over programs and a second kernel merges the partial softmaxes (flash-decoding).

`scaled_dot_product_attention` over the gathered keys with a boolean mask stays the reference
(CPU, training); tests hold this kernel to it, on the CPU through Triton's interpreter.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from blockspec.config import ConfigError

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference path is used
    triton = None


@functools.cache
def triton_available() -> bool:
    return triton is not None


def resolve_backend(requested: str, device: torch.device) -> str:
    """`auto` takes the kernel on CUDA when Triton is installed, else the SDPA reference."""
    if requested == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "sdpa"
    if requested == "triton" and not triton_available():
        raise ConfigError("attention_backend='triton' needs the triton package (pip install triton)")
    return requested


if triton is not None:

    @triton.jit
    def _block_attention(
        Q, K, V, Slots, Lo, Hi, Out, PartAcc, PartMax, PartSum,
        stride_qr, stride_qq, stride_qh,
        stride_ks, stride_kh, stride_kl,
        stride_vs, stride_vh, stride_vl,
        stride_br,
        stride_or, stride_oq, stride_oh,
        num_queries, keys_per_split, scale_log2,
        KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr,
    ):
        """One program: BLOCK_M (query row, head-in-group) pairs of one (request, KV head), over one
        split of the keys. Online softmax in fp32 (base 2)."""
        pid_rh = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_s = tl.program_id(2)
        r = pid_rh // KV_HEADS
        kvh = pid_rh % KV_HEADS
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        qi = rows // GROUP
        head = kvh * GROUP + rows % GROUP
        row_ok = qi < num_queries
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        q = tl.load(Q + r * stride_qr + qi[:, None] * stride_qq + head[:, None] * stride_qh + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        lo = tl.load(Lo + r * stride_br + qi, mask=row_ok, other=2147483647)
        hi = tl.load(Hi + r * stride_br + qi, mask=row_ok, other=-1)
        slot = tl.load(Slots + r)
        first = tl.maximum(pid_s * keys_per_split, (tl.min(lo, 0) // BLOCK_N) * BLOCK_N)
        end = tl.minimum((pid_s + 1) * keys_per_split, tl.max(hi, 0) + 1)
        k_base = K + slot.to(tl.int64) * stride_ks + kvh * stride_kh
        v_base = V + slot.to(tl.int64) * stride_vs + kvh * stride_vh
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for start in range(first, end, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            n_ok = n < end
            k = tl.load(k_base + n[:, None] * stride_kl + d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            if IEEE:  # fp32 models: exact fp32 products, not TF32
                s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2
            else:
                s = tl.dot(q, tl.trans(k)) * scale_log2
            visible = (n[None, :] >= lo[:, None]) & (n[None, :] <= hi[:, None]) & n_ok[None, :]
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            base = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
            alpha = tl.exp2(m_i - base)
            p = tl.exp2(s - base[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + n[:, None] * stride_vl + d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        if SPLIT:
            part = (pid_rh * tl.num_programs(2) + pid_s) * tl.num_programs(1) * BLOCK_M + rows
            tl.store(PartMax + part, m_i)
            tl.store(PartSum + part, l_i)
            tl.store(PartAcc + part[:, None] * BLOCK_D + d[None, :], acc)
        else:
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(Out + r * stride_or + qi[:, None] * stride_oq + head[:, None] * stride_oh + d[None, :],
                     out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])

    @triton.jit
    def _merge_splits(
        Out, PartAcc, PartMax, PartSum,
        stride_or, stride_oq, stride_oh,
        num_queries, num_splits, rows_per_head,
        KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        SPLITS: tl.constexpr,
    ):
        """One program per output row: combine its per-split (max, sum, unnormalised output)."""
        pid_rh = tl.program_id(0)
        row = tl.program_id(1)
        r = pid_rh // KV_HEADS
        qi = row // GROUP
        head = (pid_rh % KV_HEADS) * GROUP + row % GROUP
        s = tl.arange(0, SPLITS)
        s_ok = s < tl.where(qi < num_queries, num_splits, 0)  # padding rows of the last row block: nothing
        d = tl.arange(0, BLOCK_D)
        part = (pid_rh * num_splits + s) * rows_per_head + row
        m = tl.load(PartMax + part, mask=s_ok, other=float("-inf"))
        m_all = tl.max(m, 0)
        w = tl.where(s_ok, tl.exp2(m - tl.where(m_all == float("-inf"), 0.0, m_all)), 0.0)
        total = tl.sum(tl.load(PartSum + part, mask=s_ok, other=0.0) * w, 0)
        acc = tl.load(PartAcc + part[:, None] * BLOCK_D + d[None, :], mask=s_ok[:, None], other=0.0)
        out = tl.sum(acc * w[:, None], 0) / tl.where(total > 0, total, 1.0)
        tl.store(Out + r * stride_or + qi * stride_oq + head * stride_oh + d, out.to(Out.dtype.element_ty),
                 mask=d < tl.where(qi < num_queries, HEAD_DIM, 0))


BLOCK_N = 64
TARGET_PROGRAMS = 264  # about two waves of an H100/H200's 132 SMs


def block_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, lo: Tensor, hi: Tensor,
                    scale: float, max_keys: int) -> Tensor:
    """q [R, Q, Hq, hd] (any strides with unit last stride); k/v_cache [S, Hkv, L, hd]; slots [R];
    lo/hi [R, Q]: the first and last key position each query row attends to (inclusive; every key
    index < max_keys <= L). Returns [R, Q, Hq, hd] in q's dtype.

    Shapes and `max_keys` fix the launch grid, so the call is CUDA-graph capturable."""
    r, nq, hq, hd = q.shape
    hkv = k_cache.shape[1]
    group = hq // hkv
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("block_attention: the head dimension must be contiguous")
    lo = lo.to(torch.int32).contiguous()
    hi = hi.to(torch.int32).contiguous()
    out = torch.empty(r, nq, hq, hd, dtype=q.dtype, device=q.device)
    rows = nq * group
    block_m = min(64, max(16, triton.next_power_of_2(rows)))
    m_blocks = triton.cdiv(rows, block_m)
    programs = r * hkv * m_blocks
    key_tiles = triton.cdiv(max_keys, BLOCK_N)
    splits = max(1, min(key_tiles, TARGET_PROGRAMS // programs))
    keys_per_split = triton.cdiv(key_tiles, splits) * BLOCK_N
    splits = triton.cdiv(max_keys, keys_per_split)
    block_d = max(16, triton.next_power_of_2(hd))  # tl.dot needs K >= 16
    if splits > 1:
        n_part = r * hkv * splits * m_blocks * block_m
        part_acc = torch.empty(n_part, block_d, dtype=torch.float32, device=q.device)
        part_max = torch.empty(n_part, dtype=torch.float32, device=q.device)
        part_sum = torch.empty(n_part, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_max = part_sum = out
    consts = dict(KV_HEADS=hkv, GROUP=group, HEAD_DIM=hd, BLOCK_D=block_d)
    _block_attention[(r * hkv, m_blocks, splits)](
        q, k_cache, v_cache, slots, lo, hi, out, part_acc, part_max, part_sum,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        lo.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        nq, keys_per_split, scale * math.log2(math.e),
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, SPLIT=splits > 1, IEEE=q.dtype == torch.float32, num_warps=4, **consts,
    )
    if splits > 1:
        _merge_splits[(r * hkv, rows)](
            out, part_acc, part_max, part_sum, out.stride(0), out.stride(1), out.stride(2), nq, splits,
            m_blocks * block_m, SPLITS=triton.next_power_of_2(splits), num_warps=1, **consts,
        )
    return out
