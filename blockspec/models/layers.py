"""Building blocks shared by the target models and the drafters: norm, RoPE, MLP, attention math."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from blockspec.config import RopeConfig
from blockspec.kernels import ops as triton_ops
from blockspec.kernels.ops import PreNormed, use_kernels
from blockspec.kernels.fp8 import fp8_linear
from blockspec.models.quant import Fp8Linear


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """RMSNorm computed in fp32 and cast back, as the HF Llama/Qwen implementations do (a Triton
    kernel in CUDA inference; these ops are the reference); without a weight, the normalized rows (for a
    caller that scales several heads by their own weights at once). All-fp32 rows take `F.rms_norm`, the
    same ops in one call: equal bit for bit, and on the CPU a third of a small row's time, which is op
    overhead (a decode step makes several norms a layer)."""
    if weight is not None and use_kernels(x, weight) and weight.dtype == x.dtype:
        return triton_ops.rms_norm(x, weight, eps)
    if x.dtype == torch.float32 and (weight is None or weight.dtype == torch.float32):
        return F.rms_norm(x, x.shape[-1:], weight, eps)
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return normed if weight is None else weight * normed


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(x + residual, rms_norm(x + residual)) in one pass: the pre-norm residual stream."""
    if use_kernels(x, residual, weight) and weight.dtype == x.dtype == residual.dtype:
        return triton_ops.rms_norm(x, weight, eps, residual)
    total = x + residual
    return total, rms_norm(total, weight, eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> tuple[Tensor, float]:
    """Inverse frequencies and the attention scaling for a RoPE config (default, linear, llama3, yarn)."""
    wave = rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    inv = 1.0 / wave
    scale = 1.0
    if rope.type == "linear":
        inv = inv / rope.factor
    elif rope.type == "llama3":
        old = rope.original_max_position_embeddings
        low_wavelen = old / rope.low_freq_factor
        high_wavelen = old / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    elif rope.type == "yarn":
        old = rope.original_max_position_embeddings
        base = rope.theta

        def correction_dim(rotations: float) -> float:
            return (head_dim * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(base))

        def mscale(weight: float = 1.0) -> float:  # the paper's 0.1 * weight * ln(factor) + 1
            return 0.1 * weight * math.log(rope.factor) + 1.0 if rope.factor > 1 else 1.0

        low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
        if rope.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp
        inv = 1.0 / (rope.factor * wave) * (1 - extrapolation) + inv * extrapolation  # rounded as transformers does
        if rope.attention_factor is not None:
            scale = rope.attention_factor
        elif rope.mscale and rope.mscale_all_dim:
            scale = mscale(rope.mscale) / mscale(rope.mscale_all_dim)
        else:
            scale = mscale()
    return inv, scale


class Rotary(nn.Module):
    """Precomputed cos/sin tables indexed by absolute position (neox / rotate-half layout)."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        inv, scale = rope_inv_freq(rope, head_dim)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos() * scale, persistent=False)
        self.register_buffer("sin", emb.sin() * scale, persistent=False)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos/sin of shape [*positions.shape, head_dim] in `dtype` (callers keep positions in range)."""
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [R, heads, Q, hd]; cos/sin: [R, Q, hd]."""
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def few_rows(x: Tensor) -> bool:
    """Whether `dense` streams this input's products through the skinny kernel (CUDA inference with at
    most SKINNY_MAX_ROWS rows: decode, verify and draft steps of small batches)."""
    return x.numel() <= triton_ops.SKINNY_MAX_ROWS * x.shape[-1] and use_kernels(x)


def one_row_fusions(rows: Tensor) -> bool:
    """Whether `dense` fuses as it does at one row (the norm and SwiGLU in the product's prologue, no
    PreNormed rows): at one row, and where the skinny kernel streams every row on its own
    (`streams_per_row`: float32), which pays no tensor-core penalty for a prologue and so computes
    each row as a single row is computed, bit for bit (a verify row's products are a decode row's)."""
    m = rows.numel() // rows.shape[-1]
    return m == 1 or (few_rows(rows) and triton_ops.streams_per_row(m, rows.element_size()))


def stream(x: Tensor | PreNormed) -> Tensor:
    """The residual-stream rows of a layer's output (see `dense`'s `next_norm`)."""
    return x.rows if isinstance(x, PreNormed) else x


def dense(x: Tensor | PreNormed, proj: nn.Linear, *, norm: RMSNorm | None = None, swiglu: bool = False,
          glu: bool = False, residual: Tensor | None = None, next_norm: RMSNorm | None = None) -> Tensor | PreNormed:
    """residual + g(proj(f(x))): f the pre-norm (`norm`) or SwiGLU's silu(gate) * up (`swiglu`), g the
    same SwiGLU over the product's halves (`glu`).

    With few rows the product is a weight stream (`triton_ops.skinny_linear`) with g and the residual
    add inside it, and at one row (or rows streamed one by one, `one_row_fusions`) f too. Above one row
    a prologue is slow on the tensor-core path:
    SwiGLU runs first (`GatedMLP` puts it in gate_up's epilogue instead), and the norm takes its
    statistics from the product before, which returns PreNormed rows when given `next_norm` (the
    norm that comes next on the residual stream); without them the norm is a kernel of its own.
    Otherwise, and as the reference, the ops run one after the other; the results agree up to the
    products' summation order and roundings. An `Fp8Linear` streams its e4m3 weight alike, and
    above SKINNY_MAX_ROWS takes g in its product's epilogue too (`kernels.fp8.fp8_linear`).
    """
    rows = stream(x)
    fp8 = type(proj) is Fp8Linear
    if few_rows(rows) and (fp8 or type(proj) is nn.Linear):  # a parallel layer's own forward reduces across ranks
        many = not one_row_fusions(rows)
        prenormed = x if isinstance(x, PreNormed) and norm is not None and x.weight is norm.weight else None
        if many and prenormed is None:
            rows = rms_norm(rows, norm.weight, norm.eps) if norm is not None else silu_mul(rows) if swiglu else rows
            norm, swiglu = None, False
        emit = next_norm.weight if many and next_norm is not None and residual is not None else None
        return triton_ops.skinny_linear(rows, proj.weight, proj.bias, norm_weight=None if norm is None else norm.weight,
                                        eps=0.0 if norm is None else norm.eps, swiglu=swiglu, glu=glu,
                                        residual=residual, prenormed=prenormed, emit_norm=emit,
                                        weight_scale=proj.weight_scale if fp8 else None,
                                        scale_block=proj.block if fp8 else None)
    x = rows
    if norm is not None:
        x = norm(x)
    if swiglu:
        x = silu_mul(x)
    if fp8 and use_kernels(x):  # its SwiGLU in the product's epilogue where the row count's kernel takes it
        y = fp8_linear(x, proj.weight, proj.weight_scale, proj.block, proj.bias, glu=glu)
    else:
        y = proj(x)
        y = silu_mul(y) if glu else y
    return y if residual is None else residual + y


class GatedMLP(nn.Module):
    """SwiGLU MLP with gate and up fused into one matmul."""

    def __init__(self, hidden: int, inter: int, bias: bool = False) -> None:
        super().__init__()
        self.inter = inter
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)

    def forward(self, x: Tensor | PreNormed, norm: RMSNorm | None = None, residual: Tensor | None = None,
                next_norm: RMSNorm | None = None) -> Tensor | PreNormed:
        """residual + mlp(norm(x)); both optional (`next_norm`: see `dense`). SwiGLU runs where it
        streams fastest: in gate_up's epilogue, except at one row (and rows streamed one by one) of 16-bit
        weights, where down's prologue takes it (benchmarks/bench_gemv.py). Over FP8 weights at one row
        the epilogue wins: the H200 streams Qwen3-8B's MLP in 49 us that way against 54.5
        (benchmarks/data/fp8/h200_2026-12-04c_one_row_mlp/)."""
        in_down = one_row_fusions(stream(x)) and type(self.gate_up_proj) is not Fp8Linear
        h = dense(x, self.gate_up_proj, norm=norm, glu=not in_down)
        return dense(h, self.down_proj, swiglu=in_down, residual=residual, next_norm=next_norm)


def silu_mul(gate_up: Tensor) -> Tensor:
    if use_kernels(gate_up):
        return triton_ops.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def qkv_heads(qkv: Tensor, heads: int, kv_heads: int, head_dim: int, q_weight: Tensor | None,
              k_weight: Tensor | None, eps: float, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """A fused [q | k | v] projection's heads, moved to dim 1, with q and k per-head RMSNormed (Qwen3; skipped when
    the weights are None) and rotated. q's and k's heads are adjacent in the projection, so they are normed (each
    head scaled by its own norm's weight) and rotated as one tensor: the values of two passes, in half the ops,
    which on the CPU cost more than their arithmetic.

    qkv: [R, Q, (Hq + 2 Hkv) hd] -> q [R, Hq, Q, hd], k and v [R, Hkv, Q, hd]."""
    r, n, _ = qkv.shape
    qk_size = (heads + kv_heads) * head_dim
    qk = qkv[..., :qk_size].view(r, n, heads + kv_heads, head_dim)
    if k_weight is not None:
        weight = torch.cat([q_weight.expand(heads, -1), k_weight.expand(kv_heads, -1)])
        qk = rms_norm(qk, None, eps) * weight
    qk = apply_rotary(qk.transpose(1, 2), cos, sin)
    v = qkv[..., qk_size:].view(r, n, kv_heads, head_dim).transpose(1, 2)
    return qk[:, :heads], qk[:, heads:], v


def additive_mask(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """Boolean keep-mask -> additive float mask, converted once per forward instead of once per layer."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """Masked GQA attention. q: [R, Hq, Q, hd]; k, v: [R, Hkv, L, hd]; mask: [R, 1, Q, L], bool (True =
    attend) or additive float; None: every query sees every key."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
