"""FP8 (e4m3) weights: quantizing, the dequantizing reference, and the products that read them.

A quantized weight is `w` [N, K] float8_e4m3fn with fp32 scales over blocks of `block` = (rows,
columns): W[n, k] = w[n, k] * scale[n // rows, k // columns], `scale` [ceil(N / rows), ceil(K /
columns)]. Per-channel scales are blocks of (1, K); FP8 checkpoints (DeepSeek, Qwen3-*-FP8) use 128 x
128. The weight is what a decode step reads, so it is half the bf16 bytes; activations stay in the
model's dtype (weight-only FP8: every product is x @ dequantized(W)^T, whatever the row count,
unless LARGE_PRODUCT opts in to FP8 tensor cores).

On CUDA the product is chosen by row count (`fp8_linear`):

- up to `SKINNY_MAX_ROWS` (decode, verify and draft steps of small batches): `ops.skinny_linear`
  streams the e4m3 weight and dequantizes in registers, with the same fused prologues and epilogues
  as for bf16 (`layers.dense` calls it directly), above one row on tiles of its own (`ops.FP8_FEW_TILES`);
- up to `ROW_TILE_MAX_ROWS` (wider verify batches): the same kernel in 64-row tiles, tensor-core dots
  of the e4m3 tiles converted to the input's dtype (exact) and scaled per K block;
- up to `MULTIROW_MAX_ROWS` (verify and draft steps of batches): `ops.multirow_linear`, which converts
  each weight tile once for up to 160 rows (`ops.row_groups`);
- above (prefill): the weight dequantized to the input's dtype in one pass
  (`dequantize`), then cuBLAS; or, with LARGE_PRODUCT = "scaled_mm", FP8 tensor cores (`torch._scaled_mm`: per-token
  activation scales for per-channel weights, 1 x 128 groups for 128 x 128 blocks), which quantizes
  the activations too, so it is not the same model: opt in, measured in benchmarks/bench_fp8_gemm.py.

`dequantize_reference` (fp32 arithmetic) is the CPU path and what tests hold the kernels to.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from blockspec.kernels import triton
from blockspec.kernels.ops import (SKINNY_MAX_ROWS, MultirowConfig, SkinnyConfig, multirow_linear, multirow_scales_fit,
                                   product_class, silu_mul, skinny_linear, use_kernels)

E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
FP8 = torch.float8_e4m3fn

ROW_TILE_MAX_ROWS = 64
"""Above SKINNY_MAX_ROWS and up to this many rows, FP8 products run the streaming kernel in ROW_TILES' row
tiles (on the H200 at 144 and 256 rows every product streamed in these tiles was slower than dequantize +
cuBLAS, and `multirow_linear` faster than both: benchmarks/bench_fp8_gemm.py)."""
ROW_TILES = {
    "wide": SkinnyConfig(block_m=64, block_n=128, block_k=128, num_warps=4, num_stages=3),
    "qkv": SkinnyConfig(block_m=64, block_n=64, block_k=256, num_warps=4, num_stages=3),
    "tall": SkinnyConfig(block_m=64, block_n=32, block_k=256, num_warps=4, num_stages=3),
}
"""Tiles by `ops.product_class`: the best at 64 rows of a sweep of 24 tiles on the H200 for Qwen3-8B's
products (per-channel and 128 x 128 scales); narrow column tiles give o and down (n = 4096) more
programs."""
MULTIROW_MAX_ROWS = 320
"""Up to this many rows (16-bit inputs) an FP8 product runs `ops.multirow_linear`; above, the weight is
dequantized for cuBLAS. On the H200 at 144 rows a Qwen3-8B layer's four products take 0.67x (per
channel) and 0.70x (128 x 128 blocks) of dequantize + cuBLAS's time (benchmarks/bench_fp8_gemm.py
--multirow-rows 144,256)."""
MULTIROW_TILES = {"wide": (64, 64, 4, 4, 1), "qkv": (64, 64, 4, 4, 1), "tall": (128, 128, 8, 4, 4)}
"""`ops.MultirowConfig` fields by `product_class`, for FP8 weights: of a sweep on the H200 (Qwen3-8B's
products, 144 and 256 rows, per-channel and 128 x 128 scales), the tiles with the least mean time over
each class's cases relative to the best tile of each."""
LARGE_PRODUCT = "dequantize"  # or "scaled_mm": FP8 tensor cores for per-channel weights, bf16 inputs

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _dequantize(W, S, Out, n, k, br, bc, stride_w, stride_s, stride_o, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
        """Out = W * S[row // br, col // bc], one [BLOCK_N, BLOCK_K] tile a program."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        ok = (rows < n)[:, None] & (cols < k)[None, :]
        w = tl.load(W + rows.to(tl.int64)[:, None] * stride_w + cols[None, :], mask=ok, other=0.0)
        s = tl.load(S + (rows // br).to(tl.int64)[:, None] * stride_s + (cols // bc)[None, :], mask=ok, other=0.0)
        tl.store(Out + rows.to(tl.int64)[:, None] * stride_o + cols[None, :],
                 (w.to(tl.float32) * s).to(Out.dtype.element_ty), mask=ok)


def scale_shape(n: int, k: int, block: tuple[int, int]) -> tuple[int, int]:
    """The scales that cover an [n, k] weight in `block` blocks."""
    return -(-n // block[0]), -(-k // block[1])


def expand_scale(scale: Tensor, block: tuple[int, int], n: int, k: int) -> Tensor:
    """Each weight element's scale, [n, k] (or [n, 1] where the blocks span whole rows)."""
    s = scale.repeat_interleave(block[0], 0)[:n] if block[0] > 1 else scale
    return s.repeat_interleave(block[1], 1)[:, :k] if s.shape[1] > 1 else s


def dequantize_reference(w: Tensor, scale: Tensor, block: tuple[int, int], dtype: torch.dtype) -> Tensor:
    """w * scale in fp32, rounded once to `dtype`: the reference every FP8 product is held to."""
    n, k = w.shape
    return (w.float() * expand_scale(scale.float(), block, n, k)).to(dtype)


def dequantize(w: Tensor, scale: Tensor, block: tuple[int, int], dtype: torch.dtype) -> Tensor:
    """The weight in `dtype`: one Triton pass on CUDA (`dequantize_kernel`), else the reference."""
    if not (w.is_cuda and triton is not None):
        return dequantize_reference(w, scale, block, dtype)
    return dequantize_kernel(w, scale, block, dtype)


def dequantize_kernel(w: Tensor, scale: Tensor, block: tuple[int, int], dtype: torch.dtype) -> Tensor:
    """`dequantize_reference` as one Triton pass: reads the e4m3 weight once, writes `dtype`."""
    n, k = w.shape
    if tuple(scale.shape) != scale_shape(n, k, block) or scale.stride(1) != 1:
        raise ValueError(f"dequantize: scales {tuple(scale.shape)} do not cover weight {(n, k)} in {block} blocks")
    out = torch.empty(n, k, dtype=dtype, device=w.device)
    grid = (triton.cdiv(n, 64), triton.cdiv(k, 128))
    _dequantize[grid](w, scale, out, n, k, block[0], block[1], w.stride(0), scale.stride(0), out.stride(0),
                      BLOCK_N=64, BLOCK_K=128, num_warps=4)
    return out


def quantize_per_channel(w: Tensor) -> tuple[Tensor, Tensor]:
    """(e4m3 weight, fp32 scales [N, 1]): each output row scaled so its largest magnitude is E4M3_MAX.
    Rows are done in chunks, so the fp32 copy never spans a whole large matrix."""
    q = torch.empty(w.shape, dtype=FP8, device=w.device)
    scale = torch.empty(w.shape[0], 1, dtype=torch.float32, device=w.device)
    for lo in range(0, w.shape[0], 4096):
        part = w[lo:lo + 4096].float()
        amax = part.abs().amax(dim=1, keepdim=True)
        s = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
        q[lo:lo + 4096] = (part / s).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8)
        scale[lo:lo + 4096] = s
    return q, scale


def quantize_blocks(w: Tensor, block: tuple[int, int] = (128, 128)) -> tuple[Tensor, Tensor]:
    """(e4m3 weight, fp32 scales [ceil(N / rows), ceil(K / columns)]): each block scaled so its largest
    magnitude is E4M3_MAX (the layout of FP8 checkpoints' `weight_scale_inv`)."""
    n, k = w.shape
    br, bc = block
    nb, kb = scale_shape(n, k, block)
    padded = torch.zeros(nb * br, kb * bc, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w.float()
    tiles = padded.view(nb, br, kb, bc)
    amax = tiles.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (tiles / scale[:, None, :, None]).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8)
    return q.view(nb * br, kb * bc)[:n, :k].contiguous(), scale


def fp8_linear(x: Tensor, w: Tensor, scale: Tensor, block: tuple[int, int], bias: Tensor | None = None,
               glu: bool = False) -> Tensor:
    """x @ dequantized(w)^T + bias, by row count (see the module's docstring); CUDA-graph capturable.
    `glu`: silu(gate) * up of the product's halves (w = [gate | up]), fused where the kernel takes it."""
    if not use_kernels(x):
        y = F.linear(x, dequantize_reference(w, scale, block, x.dtype), bias)
        return y if not glu else F.silu(y[..., :y.shape[-1] // 2]) * y[..., y.shape[-1] // 2:]
    rows = x.numel() // x.shape[-1]
    if rows <= ROW_TILE_MAX_ROWS:
        return skinny_linear(x, w, bias, weight_scale=scale, scale_block=block, config=row_tiles(rows, *w.shape),
                             glu=glu)
    if rows <= MULTIROW_MAX_ROWS and x.element_size() == 2 and multirow_scales_fit(block, w.shape[1]):
        cfg = MultirowConfig(*MULTIROW_TILES[product_class(*w.shape)])
        return multirow_linear(x, w, bias, glu=glu, weight_scale=scale, scale_block=block, config=cfg)
    y = None
    if LARGE_PRODUCT == "scaled_mm" and x.dtype == torch.bfloat16:
        if block == (1, w.shape[1]):
            y = scaled_mm_rowwise(x, w, scale, bias)
        elif block == (128, 128) and w.shape[0] % 128 == 0 and w.shape[1] % 128 == 0:
            y = scaled_mm_blockwise(x, w, scale)
            y = y if bias is None else y + bias
    if y is None:
        y = F.linear(x, dequantize(w, scale, block, x.dtype), bias)
    return silu_mul(y) if glu else y


def row_tiles(rows: int, n: int, k: int) -> SkinnyConfig | None:
    """The streaming kernel's tiles for an FP8 product of `rows` rows and an [n, k] weight: ROW_TILES above
    SKINNY_MAX_ROWS, None at or below it (the kernel's own tiles) and above ROW_TILE_MAX_ROWS."""
    if rows <= SKINNY_MAX_ROWS or rows > ROW_TILE_MAX_ROWS:
        return None
    return ROW_TILES[product_class(n, k)]


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """Dynamic per-row (per-token) e4m3 quantization of activations: (e4m3 rows, fp32 scales [M, 1])."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp_(min=1e-12)
    scale = amax / E4M3_MAX
    return (x.float() / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8), scale


def scaled_mm_rowwise(x: Tensor, w: Tensor, scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """W8A8 on FP8 tensor cores (Hopper): per-token activation scales, per-channel weight scales
    (`torch._scaled_mm`'s row-wise recipe, bf16 out). The activations are quantized too, so this is
    not the weight-only model the other paths compute."""
    rows = x.reshape(-1, x.shape[-1])
    xq, xs = quantize_rows(rows)
    y = torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=scale.view(1, -1), bias=bias, out_dtype=x.dtype)
    return y.view(*x.shape[:-1], w.shape[0])


def scaled_mm_blockwise(x: Tensor, w: Tensor, scale: Tensor) -> Tensor:
    """W8A8 on FP8 tensor cores for 128 x 128 block weights (DeepSeek's recipe: 1 x 128 activation
    groups, cuBLAS with CUDA >= 12.9 on Hopper). Scale layouts as torch's tests give them: the
    activations' [M, K / 128] outer-dim-major, the weight's K blocks padded to a multiple of 4 and
    transposed. N and K must be multiples of 128. Quantizes the activations (see `scaled_mm_rowwise`)."""
    rows = x.reshape(-1, x.shape[-1])
    m, k = rows.shape
    groups = rows.float().view(m, k // 128, 128)
    xs = (groups.abs().amax(dim=-1) / E4M3_MAX).clamp_(min=1e-12)
    xq = (groups / xs[..., None]).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8).view(m, k)
    kb = k // 128
    padded = torch.zeros(scale.shape[0], -(-kb // 4) * 4, dtype=torch.float32, device=scale.device)
    padded[:, :kb] = scale
    y = torch._scaled_mm(xq, w.t(), scale_a=xs.t().contiguous().t(), scale_b=padded.t(), out_dtype=x.dtype)
    return y.view(*x.shape[:-1], w.shape[0])
