"""The LM heads' products on the CPU, through oneDNN from packed copies of the head's weight (`PackedProduct`).

Float32 linears stay on `F.linear` (MKL): in the engine it is as fast as oneDNN's product from a packed weight
or faster for the decoder's products at every row count measured (`benchmarks/bench_cpu_linear.py`: with every
float32 linear packed the embedded pair's plain decode is 1.30x slower, its speculative decode 1.10x), since a
oneDNN call costs about 14 us more, which a small product does not win back; and it holds no second copy.

The LM heads are the exceptions, the largest weights a step streams:
- a drafter's head, on a CPU that multiplies bfloat16 in hardware, reads a bfloat16 copy, half the bytes. Drafts
  need no more precision than the bfloat16 their drafters are trained and published in;
- the target's head, over more than one row (a verify step's, a prefill's), reads a packed float32 copy: MKL's
  product of a few rows with the transposed [vocab, hidden] weight takes 2-3x its one-row time, oneDNN's from
  the packed copy about its one-row time (the embedded pair's speculative decode about 5 % faster, its plain
  decode unchanged). One row stays on `F.linear`'s vector product, which is faster there. The output is still
  decided in float32;
- where the drafter reads the target's head through a bfloat16 copy, a greedy verify's ids come from that copy
  (`ScreenedGreedy`): its bfloat16 logits leave a few candidates a row within a proven error bound, whose float32
  logits decide, so the ids are the float32 argmax's, for half the head's bytes, and those in cache from the
  step's drafts (speculative decode about 4 % faster on the embedded pair).
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn
from torch.nn import functional as F

PACK_ROWS = 16  # the row count oneDNN lays a packed weight out for: a draft or verify block's rows
PACK_MAX_BYTES = 2 << 30  # the largest packed head copy made (its memory)
DRAFT_HEAD_BF16 = True  # a drafter's LM head in bfloat16 where the CPU has bf16 products (benchmarks turn it off)


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` in oneDNN's blocked layout (an opaque tensor only `_onednn_linear` reads)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)


class PackedProduct:
    """x -> x @ weight^T, both in `dtype` (bfloat16: rounded, accumulated in float32, returned in bfloat16), by
    oneDNN from a packed copy of `weight` in `dtype` (made on first use, and again when the weight changes in
    place); inputs of fewer than `min_rows` rows take `F.linear` over `weight` itself."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, min_rows: int = 1) -> None:
        self.weight, self.dtype, self.min_rows = weight, dtype, min_rows

    @property
    def nbytes(self) -> int:
        """The packed copy's bytes (held from the first product on)."""
        return self.weight.numel() * self.dtype.itemsize

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] < self.min_rows:
            return F.linear(x, self.weight)
        packed = _packed_copy(self.__dict__, self.weight, self.dtype)
        return _onednn_linear(rows.to(self.dtype), packed, None).view(*x.shape[:-1], -1)

    def __getstate__(self) -> dict:  # the packed copy (opaque: neither copied nor pickled) is made again
        return {k: v for k, v in self.__dict__.items() if k not in ("_packed", "_packed_key")}


BF16_ROUNDOFF = 2.0 ** -9  # bfloat16's unit roundoff: a rounded value is within this share of the exact one
FLOAT32_SAFE = 1e37  # logits beyond this may overflow float32 where bfloat16 did not: the float32 head decides
SCREEN_TOP = 8  # bfloat16 logits a row weighed in float32 at once (1.5 candidates a row on the embedded pair)
SCREEN_MAX_ROWS = 64  # above this many rows (a wide batch's verify, a prefill's) the float32 head's product serves


class ScreenedGreedy:
    """Greedy ids (argmax over the vocabulary, ties to the lowest id) of x @ weight^T in float32, from `screen`,
    a bfloat16 product of the same weight (inputs and weight rounded to bfloat16, products summed in float32,
    each logit rounded to bfloat16).

    Bound: with u the bfloat16 roundoff and S_v = sum_i |W_vi x_i| <= |W_v| |x| <= w_max |x|, each bfloat16 logit is
    within 5u w_max |x| of the exact product: rounding the input and the weight u S_v each, the float32 sums far
    below u S_v, rounding the logit u |logit| <= u S_v (2u if it truncates); so is any float32 evaluation of it.
    Ids whose bfloat16 logit is below the row's largest by more than twice that cannot be the argmax; the others
    (the row's largest, and near ties) are weighed in float32, ties to the lowest id."""

    def __init__(self, weight: torch.Tensor, screen: PackedProduct) -> None:
        self.weight, self.screen = weight, screen
        self._norm_key: tuple[int, int] | None = None  # the weight (address, version) `_norm_max` was made from
        self._norm_max = 0.0

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        """ids [R] of x [R, H]; None where the float32 logits must decide: a row not finite or near float32's range
        (those logits say which rows are bad), or more than SCREEN_MAX_ROWS rows. The rows' SCREEN_TOP largest
        bfloat16 logits are weighed in float32 in one batched product, and the rest on the host: a verify's rows
        are few, and each tensor op here costs more than its arithmetic."""
        if x.shape[0] > SCREEN_MAX_ROWS:
            return None
        approx = self.screen(x)
        top = min(SCREEN_TOP, approx.shape[-1])
        top_values, top_ids = approx.topk(top, dim=-1)
        exact = torch.bmm(self.weight[top_ids], x[:, :, None]).squeeze(-1)
        margin = 2 * 5 * BF16_ROUNDOFF * self._row_norm_max()
        out = []
        for r, (values, ids, logits, norm) in enumerate(zip(top_values.tolist(), top_ids.tolist(), exact.tolist(),
                                                            torch.linalg.vector_norm(x, dim=-1).tolist())):
            if not (math.isfinite(values[0]) and math.isfinite(norm) and abs(values[0]) < FLOAT32_SAFE):
                return None
            floor = values[0] - margin * norm
            n = sum(v >= floor for v in values)  # the candidates: a prefix, the values sorted
            if n == top < approx.shape[-1]:  # more than SCREEN_TOP of them: every id above the floor
                ids = (approx[r].float() >= floor).nonzero()[:, 0].tolist()
                logits = (self.weight[ids] @ x[r]).tolist()
                n = len(ids)
            if not all(map(math.isfinite, logits[:n])):
                return None
            out.append(min(zip(logits[:n], ids[:n]), key=lambda pair: (-pair[0], pair[1]))[1])
        return torch.tensor(out)

    def _row_norm_max(self) -> float:
        """The weight's largest row norm, made again when the weight changes in place."""
        key = (self.weight.data_ptr(), self.weight._version)
        if self._norm_key != key:
            self._norm_max = torch.linalg.vector_norm(self.weight.detach(), dim=-1, dtype=torch.float64).max().item()
            self._norm_key = key
        return self._norm_max


def _packed_copy(state: dict, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`weight` in `dtype`, packed, kept in `state` (an object's __dict__) until the weight changes (its
    version counter; a change through `.data` is not seen)."""
    key = (weight.data_ptr(), weight._version)
    if state.get("_packed_key") != key:
        state["_packed"], state["_packed_key"] = _pack(weight.to(dtype)), key
    return state["_packed"]


def _packable(head: nn.Module, dtype: torch.dtype) -> bool:
    """One linear without a bias (not a rank's shard, which gathers across ranks) on the CPU, whose copy in
    `dtype` fits `PACK_MAX_BYTES`, where oneDNN agrees with `F.linear`."""
    return (type(head) is nn.Linear and head.bias is None and head.weight.device.type == "cpu"
            and head.weight.numel() * dtype.itemsize <= PACK_MAX_BYTES and onednn_available())


def draft_head_product(head: nn.Module) -> PackedProduct | None:
    """The product a drafter's LM head (its own or the target's) takes on the CPU: a bfloat16 `PackedProduct`
    where the head is packable and this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX); None, the
    head's own product, elsewhere."""
    ok = DRAFT_HEAD_BF16 and _packable(head, torch.bfloat16) and bf16_products()
    return PackedProduct(head.weight, torch.bfloat16) if ok else None


def verify_head_product(head: nn.Module) -> PackedProduct | None:
    """The product the target's LM head takes on the CPU: a float32 `PackedProduct` from two rows up (verify
    and prefill rows) where the head is a packable float32 linear; None, the head's own product, elsewhere."""
    ok = head.weight.dtype == torch.float32 and _packable(head, torch.float32)
    return PackedProduct(head.weight, torch.float32, min_rows=2) if ok else None


def screened_greedy(head: nn.Module, draft_product: PackedProduct | None) -> ScreenedGreedy | None:
    """The target head's screened greedy ids where the drafter's head product is a bfloat16 copy of that head's
    float32 weight (the drafter shares the target's head); None elsewhere."""
    ok = (draft_product is not None and draft_product.weight is head.weight and draft_product.dtype == torch.bfloat16
          and head.weight.dtype == torch.float32)
    return ScreenedGreedy(head.weight, draft_product) if ok else None


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
