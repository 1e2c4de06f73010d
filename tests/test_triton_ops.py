"""The norm, SwiGLU and fused q/k-norm + RoPE + KV-store kernels held to the reference ops in
`layers` (which they replace in CUDA inference). Without a GPU they run in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from blockspec.config import RopeConfig
from blockspec.models.kv_cache import KVCache, PageTable, causal_meta
from blockspec.kernels import ops as triton_ops
from blockspec.models import layers
from blockspec.models.quant import Fp8Linear
from factories import TRITON_SKIP_REASON, triton_interpretable, watched_kernels

pytestmark = pytest.mark.skipif(not triton_interpretable(), reason=TRITON_SKIP_REASON)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}  # fp16: one unit in the last place of values near 1


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    return torch.allclose(a.float(), b.float(), atol=TOL[dtype], rtol=TOL[dtype])


def rand(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(dtype, with_residual):
    x = rand(3, 5, 96, dtype=dtype)
    res = rand(3, 5, 96, dtype=dtype, seed=1)
    w = rand(96, dtype=dtype, seed=2)
    with torch.enable_grad():  # the reference ops (kernels serve inference only)
        want = layers.add_rms_norm(x, res, w, 1e-6) if with_residual else (None, layers.rms_norm(x, w, 1e-6))
    got = triton_ops.rms_norm(x, w, 1e-6, res) if with_residual else (None, triton_ops.rms_norm(x, w, 1e-6))
    assert got[1].shape == x.shape and got[1].dtype == dtype
    assert close(got[1], want[1], dtype)
    if with_residual:
        assert torch.equal(got[0], want[0])
    # negative control: the norm without its weight is far from it
    assert not close(triton_ops.rms_norm(x, torch.ones_like(w), 1e-6), want[1], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_mul_matches_reference(dtype):
    gate_up = rand(4, 2, 2 * 80, dtype=dtype)
    with torch.enable_grad():
        want = layers.silu_mul(gate_up)
    got = triton_ops.silu_mul(gate_up)
    assert got.shape == (4, 2, 80) and close(got, want, dtype)
    swapped = torch.cat(gate_up.chunk(2, dim=-1)[::-1], dim=-1)  # negative control: gate and up swapped
    assert not close(triton_ops.silu_mul(swapped), want, dtype)


def reference_store(qkv, hq, hkv, hd, qw, kw, cos, sin, cache, meta):
    """The reference: q/k-norm + RoPE of the fused projection's heads (layers.qkv_heads), then KVCache.write."""
    with torch.enable_grad():
        q, k, v = layers.qkv_heads(qkv, hq, hkv, hd, qw, kw, 1e-6, cos, sin)
    cache.write(0, meta, k, v)
    return q.transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hq,hkv,hd,qk_norm", [(4, 2, 16, True), (2, 2, 8, False), (0, 2, 16, True),
                                               (6, 3, 12, True), (16, 8, 16, True)])
def test_qkv_rope_store_matches_reference(dtype, hq, hkv, hd, qk_norm):
    r, n, slots, length = 3, 4, 5, 40
    qkv = rand(r, n, (hq + 2 * hkv) * hd, dtype=dtype)
    qw = rand(hd, dtype=dtype, seed=3) if qk_norm else None
    kw = rand(hd, dtype=dtype, seed=4) if qk_norm else None
    # rows at different starts, one request with a padding row (its K/V go to the trash column)
    meta = causal_meta([4, 0, 2], [7, 0, 30], [4, 4, 3], n, length, DEVICE)
    rotary = layers.Rotary(RopeConfig(theta=10000.0), hd, 64).to(DEVICE)
    cos, sin = rotary(meta.positions, dtype)
    table = PageTable.full(slots, length, DEVICE, page_size=8)  # a slot's pages are not adjacent
    caches = [KVCache(1, hkv, hd, length, dtype, DEVICE, table) for _ in range(2)]
    for c in caches:  # existing context must survive the store untouched
        c.k[0].copy_(rand(*c.k[0].shape, dtype=dtype, seed=5))
        c.v[0].copy_(rand(*c.v[0].shape, dtype=dtype, seed=6))
    want_q = reference_store(qkv, hq, hkv, hd, qw, kw, cos, sin, caches[0], meta)
    # context K/V (hq = 0) pass no q weight, as the drafter does
    got_q = triton_ops.qkv_rope_store(qkv, hq, hkv, hd, qw if hq else None, kw, 1e-6, cos, sin, caches[1].k[0],
                                      caches[1].v[0], table.table, meta.slots, meta.write_pos)
    assert got_q.shape == (r, n, hq, hd)
    if hq:
        assert close(got_q, want_q, dtype)
    assert close(caches[1].k[0], caches[0].k[0], dtype)
    assert torch.equal(caches[1].v[0], caches[0].v[0])
    # negative control: RoPE at positions one further along stores different keys
    caches[1].k[0].copy_(caches[0].k[0])
    cos1, sin1 = rotary(meta.positions + 1, dtype)
    triton_ops.qkv_rope_store(qkv, hq, hkv, hd, qw, kw, 1e-6, cos1, sin1, caches[1].k[0], caches[1].v[0],
                              table.table, meta.slots, meta.write_pos)
    assert not close(caches[1].k[0], caches[0].k[0], dtype)


@pytest.mark.parametrize("hq,hkv", [(32, 8), (6, 3), (0, 4)])
def test_qkv_rope_store_rows_do_not_depend_on_the_call(hq, hkv):
    """A row's q and K/V are the same bit for bit whether it is stored alone or among many rows (plain
    decode rows and verify rows must agree for greedy speculation to equal plain decoding)."""
    hd, length = 16, 40
    assert triton_ops.head_group(hq, hkv) == {(32, 8): 8, (6, 3): 1, (0, 4): 4}[(hq, hkv)]
    qkv = rand(3, 4, (hq + 2 * hkv) * hd, dtype=torch.float32)
    qw, kw = rand(hd, dtype=torch.float32, seed=3), rand(hd, dtype=torch.float32, seed=4)
    meta = causal_meta([4, 0, 2], [7, 0, 30], [4, 4, 3], 4, length, DEVICE)
    cos, sin = layers.Rotary(RopeConfig(theta=10000.0), hd, 64).to(DEVICE)(meta.positions, torch.float32)
    table = PageTable.full(5, length, DEVICE, page_size=8)
    many, alone = (KVCache(1, hkv, hd, length, torch.float32, DEVICE, table) for _ in range(2))
    q_many = triton_ops.qkv_rope_store(qkv, hq, hkv, hd, qw if hq else None, kw, 1e-6, cos, sin, many.k[0],
                                       many.v[0], table.table, meta.slots, meta.write_pos)
    q_alone = triton_ops.qkv_rope_store(qkv[2:], hq, hkv, hd, qw if hq else None, kw, 1e-6, cos[2:], sin[2:],
                                        alone.k[0], alone.v[0], table.table, meta.slots[2:], meta.write_pos[2:])
    assert torch.equal(q_many[2:], q_alone)
    with pytest.raises(ValueError, match="5 heads a program must divide both head counts"):
        triton_ops.qkv_rope_store(qkv, hq, hkv, hd, qw if hq else None, kw, 1e-6, cos, sin, many.k[0], many.v[0],
                                  table.table, meta.slots, meta.write_pos, group=5)
    for got, want in zip(alone.gather(0, meta.slots[2:], length), many.gather(0, meta.slots[2:], length)):
        assert got.abs().sum() > 0 and torch.equal(got, want)


def test_qkv_rope_store_names_a_bad_shape():
    qkv = torch.zeros(1, 2, 40, device=DEVICE)
    cache = torch.zeros(2, 2, 8, 8, device=DEVICE)
    with pytest.raises(ValueError, match=r"qkv_rope_store: qkv \(1, 2, 40\)"):
        triton_ops.qkv_rope_store(qkv, 4, 2, 8, None, None, 1e-6, qkv, qkv, cache, cache,
                                  torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.int64),
                                  torch.zeros(1, 2, dtype=torch.int64))


def reference_linear(x, w, b, norm_weight, swiglu, residual, glu=False):
    """The unfused ops the skinny kernel replaces: pre-norm or SwiGLU, linear, SwiGLU of the output
    halves, residual add."""
    with torch.enable_grad():
        if norm_weight is not None:
            x = layers.rms_norm(x, norm_weight, 1e-6)
        if swiglu:
            x = layers.silu_mul(x)
        y = torch.nn.functional.linear(x, w, b)
        if glu:
            y = layers.silu_mul(y)
        return y if residual is None else y + residual


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 17])  # one row, a dot block, two row blocks
@pytest.mark.parametrize("fusion", ["bias", "norm", "swiglu", "residual", "norm+glu", "bias+glu"])
@pytest.mark.parametrize("k", [80, 128])  # a ragged and an even last K block
def test_skinny_linear_matches_reference(dtype, rows, fusion, k):
    n = 48  # not a multiple of the 32-column blocks below
    glu = fusion.endswith("+glu")
    cfg = triton_ops.SkinnyConfig(block_m=1 if rows == 1 else 16, block_n=32, block_k=64, num_warps=4, num_stages=2)
    x = rand(rows, 2 * k if fusion == "swiglu" else k, dtype=dtype)
    w = rand(2 * n if glu else n, k, dtype=dtype, seed=1) / k**0.5
    b = rand(w.shape[0], dtype=dtype, seed=2) if "bias" in fusion else None
    nw = rand(k, dtype=dtype, seed=3) if "norm" in fusion else None
    res = rand(rows, n, dtype=dtype, seed=4) if fusion == "residual" else None
    want = reference_linear(x, w, b, nw, fusion == "swiglu", res, glu)
    got = triton_ops.skinny_linear(x, w, b, norm_weight=nw, eps=1e-6, swiglu=fusion == "swiglu", glu=glu,
                                   residual=res, config=cfg)
    assert got.shape == (rows, n) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol)
    # negative controls: the product of the un-normed / un-activated / bias-less / residual-less input,
    # and with glu the halves swapped (up activated instead of gate)
    broken = reference_linear(x[..., :k], w, None, None, False, None, glu)
    assert not torch.allclose(broken.float(), want.float(), atol=tol, rtol=tol)
    if glu:
        swapped = reference_linear(x, torch.cat(w.chunk(2)[::-1]), None if b is None else torch.cat(b.chunk(2)[::-1]),
                                   nw, False, None, True)
        assert not torch.allclose(swapped.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("block_m, block_n, launched", [(1, 8, 4), (1, 32, 16), (16, 16, 16), (16, 64, 32)])
def test_glu_programs_stream_half_their_block_of_gate_rows(block_m, block_n, launched, monkeypatch):
    """With GLU a program streams block_n / 2 gate rows and as many up rows; a tensor-core tile (block_m
    16) at least 16 of each, its dot's minimum, a one-row stream any number (16 + 16 rows of a one-row
    FP8 tile spill its registers: tests/test_kernel_sass.py)."""
    kernel, seen = triton_ops._skinny_linear, {}

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.update(kwargs, grid=grid)
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(triton_ops, "_skinny_linear", Recorder())
    rows, n, k = block_m, 48, 64
    cfg = triton_ops.SkinnyConfig(block_m=block_m, block_n=block_n, block_k=32, num_warps=4, num_stages=1)
    x, w = rand(rows, k, dtype=torch.float32), rand(2 * n, k, dtype=torch.float32, seed=1) / k**0.5
    got = triton_ops.skinny_linear(x, w, glu=True, config=cfg)
    assert seen["BLOCK_N"] == launched and seen["grid"][1] == -(-n // launched)
    assert torch.allclose(got, reference_linear(x, w, None, None, False, None, True), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [17, 40, 144, 300])  # chunks 16 + 16, 32 + 16, 128 + 16; two groups of 150
@pytest.mark.parametrize("fusion", ["none", "bias", "glu", "bias+glu"])
@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("k", [80, 128])  # a ragged and an even last K block
def test_multirow_linear_matches_reference(rows, fusion, split, k):
    n, dtype = 48, torch.float16  # 48 columns: a ragged column block of 32
    glu = "glu" in fusion
    cfg = triton_ops.MultirowConfig(block_n=32, block_k=32, num_warps=4, num_stages=2, split=split)
    x = rand(rows, k, dtype=dtype)
    w = rand(2 * n if glu else n, k, dtype=dtype, seed=1) / k**0.5
    b = rand(w.shape[0], dtype=dtype, seed=2) if "bias" in fusion else None
    want = reference_linear(x, w, b, None, False, None, glu)
    got = triton_ops.multirow_linear(x, w, b, glu=glu, config=cfg)
    assert got.shape == (rows, n) and got.dtype == dtype
    assert torch.allclose(got.float(), want.float(), atol=2e-3, rtol=2e-3)
    # negative controls: the second chunk's rows read from the first chunk's place, and with glu the
    # halves swapped (up activated instead of gate)
    first = triton_ops.row_groups(rows)[1]
    assert not torch.allclose(got[first:].float(), want[:rows - first].float(), atol=2e-3, rtol=2e-3)
    if glu:
        swapped = reference_linear(x, torch.cat(w.chunk(2)[::-1]), None if b is None else torch.cat(b.chunk(2)[::-1]),
                                   None, False, None, True)
        assert not torch.allclose(swapped.float(), want.float(), atol=2e-3, rtol=2e-3)


def test_multirow_row_groups():
    """Rows split into equal groups of at most MULTIROW_GROUP_MAX, each a power-of-two chunk and a
    remainder rounded up: 144 verify rows compute as 128 + 16, not 256; 256 as two groups of 128."""
    assert [triton_ops.row_groups(m) for m in (17, 32, 40, 144, 160, 256, 288, 300, 576)] == [
        (17, 16, 16), (32, 32, 0), (40, 32, 16), (144, 128, 16), (160, 128, 32), (128, 128, 0), (144, 128, 16),
        (150, 128, 32), (144, 128, 16)]
    with pytest.raises(ValueError, match="0 rows"):
        triton_ops.row_groups(0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [3, 17])
@pytest.mark.parametrize("glu", [False, True])
def test_prenormed_rows_norm_the_next_product(dtype, rows, glu):
    """A product that writes the residual stream (o, down) also writes what the next RMSNorm needs,
    and the product after it (qkv, gate_up) norms inside its weight stream: together they equal the
    residual add, the norm and the linear run one after the other."""
    k, n, n2 = 96, 80, 48  # 80 columns: three producer programs of 32, the last one ragged
    cfg = triton_ops.SkinnyConfig(block_m=16, block_n=32, block_k=64, num_warps=4, num_stages=2)
    x = rand(rows, k, dtype=dtype)
    w1 = rand(n, k, dtype=dtype, seed=1) / k**0.5
    res = rand(rows, n, dtype=dtype, seed=2)
    nw = rand(n, dtype=dtype, seed=3)
    w2 = rand(2 * n2 if glu else n2, n, dtype=dtype, seed=4) / n**0.5
    b2 = rand(w2.shape[0], dtype=dtype, seed=5)
    pre = triton_ops.skinny_linear(x, w1, residual=res, emit_norm=nw, config=cfg)
    assert isinstance(pre, triton_ops.PreNormed) and pre.sums.shape == (3, rows) and pre.weight is nw
    got = triton_ops.skinny_linear(pre.rows, w2, b2, prenormed=pre, eps=1e-6, glu=glu, config=cfg)
    h = reference_linear(x, w1, None, None, False, res)
    want = reference_linear(h, w2, b2, nw, False, None, glu)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert torch.allclose(pre.rows.float(), h.float(), atol=tol, rtol=tol)
    assert got.shape == want.shape and torch.allclose(got.float(), want.float(), atol=tol, rtol=tol)
    # negative control: one producer program's sums lost (the ragged last one) changes every row's norm
    lost = triton_ops.PreNormed(pre.rows, pre.scaled, pre.sums[:2].contiguous(), nw)
    broken = triton_ops.skinny_linear(pre.rows, w2, b2, prenormed=lost, eps=1e-6, glu=glu, config=cfg)
    assert not torch.allclose(broken.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("fusion", ["norm", "swiglu", "residual"])
def test_fp32_rows_are_computed_as_one_row_is(fusion):
    """At fp32 every row count takes the one-row tiles: nine rows at once give each row's product
    alone, bit for bit. Negative control: the tensor-core row blocks of the half-precision dtypes do
    not."""
    rows, k, n = 9, 256, 96
    x = rand(rows, 2 * k if fusion == "swiglu" else k, dtype=torch.float32)
    w = rand(n, k, dtype=torch.float32, seed=1) / k**0.5
    nw = rand(k, dtype=torch.float32, seed=3) if fusion == "norm" else None
    res = rand(rows, n, dtype=torch.float32, seed=4) if fusion == "residual" else None
    args = dict(norm_weight=nw, eps=1e-6, swiglu=fusion == "swiglu")

    def run(lo: int, hi: int, config: triton_ops.SkinnyConfig | None = None) -> torch.Tensor:
        return triton_ops.skinny_linear(x[lo:hi], w, residual=None if res is None else res[lo:hi], config=config,
                                        **args)

    assert triton_ops.skinny_config(rows, n, k, itemsize=4).block_m == 1
    alone = torch.cat([run(i, i + 1) for i in range(rows)])
    assert torch.equal(run(0, rows), alone)
    blocks = triton_ops.SkinnyConfig(block_m=16, block_n=32, block_k=64, num_warps=4, num_stages=2)
    assert not torch.equal(run(0, rows, blocks), alone)


def test_fp8_weights_take_their_own_tiles():
    """FP8_FEW_TILES serve an FP8 weight at 2-16 rows; at one row gate_up, o and down (with SwiGLU in the
    prologue or not) take FP8_ONE_TILES, qkv the bf16 tiles; float32 inputs keep the one-row stream."""
    one = triton_ops.SkinnyConfig(*triton_ops.FP8_ONE_TILES["tall"])
    assert one.block_m == 1 and one.vec_k == 8 and one.block_k == one.num_warps * 32 * one.vec_k
    for n, k in ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)):
        tiles = triton_ops.FP8_FEW_TILES[triton_ops.product_class(n, k)]
        assert triton_ops.skinny_config(16, n, k, fp8=True) == triton_ops.SkinnyConfig(*tiles)
        assert triton_ops.skinny_config(2, n, k, fp8=True) == triton_ops.SkinnyConfig(*tiles)
        streamed = triton_ops.product_class(n, k) != "qkv"
        assert (triton_ops.skinny_config(1, n, k, fp8=True) == one) == streamed
        if not streamed:
            assert triton_ops.skinny_config(1, n, k, fp8=True) == triton_ops.skinny_config(1, n, k)
        assert triton_ops.skinny_config(1, n, k, prologue=2, fp8=True) == triton_ops.SkinnyConfig(
            *triton_ops.FP8_ONE_TILES["swiglu"])
        assert triton_ops.skinny_config(16, n, k, itemsize=4, fp8=True).block_m == 1
        assert triton_ops.skinny_config(1, n, k, itemsize=4, fp8=True).vec_k == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_float32_layer_computes_each_row_as_a_single_row(monkeypatch, dtype):
    """A decoder block's products, norms and SwiGLU in float32 (pre-norm q/k/v, the output product into
    the residual stream, the MLP) take the one-row fusions at any row count of the skinny path, so
    nine rows at once equal each row alone, bit for bit: a verify row is computed as a decode row is.
    Half precision (tensor-core row blocks, the norm from the product before) is the negative
    control."""
    monkeypatch.setattr(layers, "use_kernels", lambda *tensors: True)  # the kernels, interpreted on a CPU
    hidden, inter, rows = 64, 96, 9
    qkv, o = (torch.nn.Linear(hidden, hidden, bias=False) for _ in range(2))
    mlp = layers.GatedMLP(hidden, inter)
    norms = [layers.RMSNorm(hidden) for _ in range(3)]
    for module in (qkv, o, mlp, *norms):
        module.to(DEVICE, dtype)
    with torch.no_grad():
        for i, n in enumerate(norms):
            n.weight.copy_(rand(hidden, dtype=dtype, seed=10 + i))
    x = rand(rows, hidden, dtype=dtype)

    def block(x: torch.Tensor) -> torch.Tensor:
        h = layers.dense(layers.dense(x, qkv, norm=norms[0]), o, residual=x, next_norm=norms[1])
        return layers.stream(mlp(h, norm=norms[1], residual=layers.stream(h), next_norm=norms[2]))

    with torch.no_grad():
        together = block(x)
        alone = torch.cat([block(x[i : i + 1]) for i in range(rows)])
    assert torch.equal(together, alone) == (dtype == torch.float32)
    assert layers.one_row_fusions(x) == (dtype == torch.float32)


@pytest.mark.parametrize("fp8", [False, True])
def test_one_row_mlp_runs_swiglu_where_its_weights_stream_fastest(monkeypatch, fp8):
    """`GatedMLP` at one row: SwiGLU in down's prologue over 16-bit weights, in gate_up's GLU epilogue over
    FP8 ones (the faster arrangement of each on the H200); either computes the unfused MLP."""
    monkeypatch.setattr(layers, "use_kernels", lambda *tensors: True)  # the kernels, interpreted on a CPU
    calls, skinny = [], triton_ops.skinny_linear

    def recording(*args, **kw):
        calls.append(("glu" if kw["glu"] else "", "swiglu" if kw["swiglu"] else ""))
        return skinny(*args, **kw)

    monkeypatch.setattr(triton_ops, "skinny_linear", recording)
    hidden, inter = 64, 96
    mlp, norm = layers.GatedMLP(hidden, inter).to(DEVICE, torch.float16), layers.RMSNorm(hidden).to(DEVICE, torch.float16)
    if fp8:
        mlp.gate_up_proj, mlp.down_proj = Fp8Linear.from_linear(mlp.gate_up_proj), Fp8Linear.from_linear(mlp.down_proj)
    x, res = rand(1, hidden, dtype=torch.float16), rand(1, hidden, dtype=torch.float16, seed=3)
    with torch.no_grad():
        got = mlp(x, norm=norm, residual=res)
    assert calls == ([("glu", ""), ("", "")] if fp8 else [("", ""), ("", "swiglu")])

    def weight(proj: torch.nn.Module) -> torch.Tensor:
        return proj.weight.float() * proj.weight_scale if fp8 else proj.weight.float()

    gate, up = (norm(x).float() @ weight(mlp.gate_up_proj).T).chunk(2, dim=-1)
    want = res.float() + (torch.nn.functional.silu(gate) * up) @ weight(mlp.down_proj).T
    assert torch.allclose(got.float(), want, atol=1e-2, rtol=1e-2)


def test_skinny_linear_rejects_mismatched_width():
    w = rand(8, 32, dtype=torch.float32)
    with pytest.raises(ValueError, match="swiglu takes 2K"):
        triton_ops.skinny_linear(rand(1, 32, dtype=torch.float32), w, swiglu=True)
    with pytest.raises(ValueError, match="emit_norm describes the residual stream"):
        triton_ops.skinny_linear(rand(2, 32, dtype=torch.float32), w, emit_norm=rand(8, dtype=torch.float32))
    with pytest.raises(ValueError, match="glu takes a weight of 2N rows and no residual"):
        triton_ops.skinny_linear(rand(1, 32, dtype=torch.float32), rand(7, 32, dtype=torch.float32), glu=True)


def test_dense_keeps_a_parallel_layer_forward(monkeypatch):
    """The few-row path streams an `nn.Linear`'s weight itself; any other layer (tensor parallelism's
    row-parallel products all-reduce inside their forward) keeps its forward, with the norm, SwiGLU
    and residual add around it. The stand-in here adds a constant where the all-reduce would sum."""
    def use_kernels(*tensors):
        return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))

    monkeypatch.setattr(triton_ops, "use_kernels", use_kernels)
    monkeypatch.setattr(layers, "use_kernels", use_kernels)

    class Reduced(torch.nn.Module):
        def __init__(self, weight):
            super().__init__()
            self.weight = torch.nn.Parameter(weight, requires_grad=False)
            self.bias = None

        def forward(self, x):
            return torch.nn.functional.linear(x, self.weight) + 100.0

    w = rand(16, 32, dtype=torch.float32)
    gate_up = rand(1, 64, dtype=torch.float32, seed=1)
    res = rand(1, 16, dtype=torch.float32, seed=2)
    with torch.no_grad():
        got = layers.dense(gate_up, Reduced(w), swiglu=True, residual=res)
    with torch.enable_grad():
        want = res + torch.nn.functional.linear(layers.silu_mul(gate_up), w) + 100.0
    assert torch.allclose(got, want, atol=1e-5)


def test_the_kernels_the_gpu_warmup_test_watches_exist():
    """`test_gpu.py`'s warm-up test (GPU only) watches these kernels for variants compiled while serving; naming
    them here, on every run, makes a renamed kernel fail CI instead of going unseen until a GPU run."""
    kernels = watched_kernels()
    assert len({k.fn.__name__ if hasattr(k, "fn") else k.__name__ for k in kernels}) == len(kernels)
