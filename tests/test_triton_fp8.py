"""The FP8 weight products (`kernels.fp8`, `ops.skinny_linear` with e4m3 weights) held to a float64
reference of the dequantized weight; without a GPU they run in Triton's interpreter (fp32 and fp16
inputs), on a GPU also bf16, the row-count dispatch, CUDA-graph capture and torch._scaled_mm."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from blockspec.kernels import fp8
from blockspec.kernels import ops as triton_ops
from factories import TRITON_SKIP_REASON, compile_for_sm90, shared_for_sm90, triton_interpretable

pytestmark = pytest.mark.skipif(not triton_interpretable(), reason=TRITON_SKIP_REASON)
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")
# Triton's interpreter runs bf16 dots wrongly (numpy has no bf16): bf16 only on the GPU
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def rand(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEVICE, dtype)


def quantized(n: int, k: int, layout: str, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
    """An [n, k] weight in e4m3 with scales: per channel, in 32 x 32 blocks (ragged at the edges when n
    or k is not a multiple), or those block scales spread to one row each ((1, 32) blocks)."""
    w = rand(n, k, seed=seed) / k**0.5 * torch.linspace(0.2, 3.0, n, device=DEVICE)[:, None]  # rows of varied size
    if layout == "channel":
        q, s = fp8.quantize_per_channel(w)
        return q, s, (1, k)
    q, s = fp8.quantize_blocks(w, (32, 32))
    if layout == "rows":
        return q, s.repeat_interleave(32, 0)[:n].contiguous(), (1, 32)
    return q, s, (32, 32)


def reference(x, w, scale, block, bias=None, norm_weight=None, swiglu=False, residual=None, glu=False):
    """float64: the dequantized weight, and the ops the kernel fuses, one after the other."""
    x = x.double()
    weight = w.double() * fp8.expand_scale(scale.double(), block, *w.shape)
    if norm_weight is not None:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_weight.double()
    if swiglu:
        gate, up = x.chunk(2, dim=-1)
        x = F.silu(gate) * up
    y = x @ weight.T + (bias.double() if bias is not None else 0)
    if glu:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y if residual is None else y + residual.double()


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> bool:
    return torch.allclose(got.double(), want, atol=TOL[dtype], rtol=TOL[dtype])


# each fusion with two or three scale layouts (not all: every pairing is a kernel variant to compile on a GPU)
FUSION_LAYOUTS = [("bias", "channel"), ("bias", "block"), ("norm", "rows"), ("norm", "block"), ("swiglu", "channel"),
                  ("swiglu", "block"), ("residual", "rows"), ("residual", "channel"), ("norm+glu", "block"),
                  ("norm+glu", "channel"), ("norm+glu", "rows")]


@pytest.mark.parametrize("dtype", [d for d in DTYPES if not (CUDA and d == torch.float16)])  # fp16: the CPU's
@pytest.mark.parametrize("rows", [1, 3, 17])  # one row, a dot block, two row blocks
@pytest.mark.parametrize("fusion, layout", FUSION_LAYOUTS)
def test_skinny_linear_streams_fp8_weights(dtype, rows, fusion, layout):
    n, k = 48, 80  # neither a multiple of the 32-column tiles nor of the 32 x 32 scale blocks
    glu = fusion.endswith("+glu")
    cfg = triton_ops.SkinnyConfig(block_m=1 if rows == 1 else 16, block_n=32, block_k=64, num_warps=4, num_stages=2)
    w, s, block = quantized(2 * n if glu else n, k, layout)
    x = rand(rows, 2 * k if fusion == "swiglu" else k, seed=2, dtype=dtype)
    b = rand(w.shape[0], seed=3, dtype=dtype) if fusion == "bias" else None
    nw = rand(k, seed=4, dtype=dtype) if "norm" in fusion else None
    res = rand(rows, n, seed=5, dtype=dtype) if fusion == "residual" else None
    kw = dict(norm_weight=nw, swiglu=fusion == "swiglu", residual=res, glu=glu)
    got = triton_ops.skinny_linear(x, w, b, eps=1e-6, config=cfg, weight_scale=s, scale_block=block, **kw)
    want = reference(x, w, s, block, b, **kw)
    assert got.shape == (rows, n) and got.dtype == dtype
    assert close(got, want, dtype)
    # negative control: the scales of other rows (a misaligned layout) give another product
    wrong = triton_ops.skinny_linear(x, w, b, eps=1e-6, config=cfg, weight_scale=s.flip(0).contiguous(),
                                     scale_block=block, **kw)
    assert not close(wrong, want, dtype)


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.float32])  # VEC_K serves 16-bit inputs
@pytest.mark.parametrize("fusion, layout", [("swiglu", "channel"), ("residual", "block"), ("norm", "rows"),
                                            ("norm+glu", "channel")])
def test_k_runs_of_eight_compute_the_same_one_row_product(dtype, fusion, layout):
    """VEC_K only hides from the compiler how far K runs are contiguous (the offsets are the same numbers),
    so the one-row product with it equals the one without, bit for bit, and the reference; K = 84 ends
    inside a run. With GLU a program streams 4 gate and 4 up rows (half its block_n of 8: one-row tiles
    take no tensor-core minimum of 16)."""
    n, k = 48, 84
    glu = fusion.endswith("+glu")
    w, s, block = quantized(2 * n if glu else n, k, layout)
    x = rand(1, 2 * k if fusion == "swiglu" else k, seed=2, dtype=dtype)
    kw = dict(norm_weight=rand(k, seed=4, dtype=dtype) if "norm" in fusion else None, swiglu=fusion == "swiglu",
              residual=rand(1, n, seed=5, dtype=dtype) if fusion == "residual" else None, glu=glu)
    base = triton_ops.SkinnyConfig(block_m=1, block_n=8, block_k=32, num_warps=4, num_stages=2)
    runs = triton_ops.skinny_linear(x, w, eps=1e-6, config=replace(base, vec_k=8), weight_scale=s, scale_block=block,
                                    **kw)
    plain = triton_ops.skinny_linear(x, w, eps=1e-6, config=base, weight_scale=s, scale_block=block, **kw)
    assert torch.equal(runs, plain)
    assert close(runs, reference(x, w, s, block, None, **kw), dtype)


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.float32])  # 16-bit inputs only
@pytest.mark.parametrize("rows", [17, 144, 300])
@pytest.mark.parametrize("fusion, layout", [("bias", "channel"), ("bias", "block"), ("glu", "channel"),
                                            ("glu", "rows"), ("glu", "block")])
@pytest.mark.parametrize("split", [1, 2])
def test_multirow_linear_streams_fp8_weights(dtype, rows, fusion, layout, split):
    n, k = 48, 80
    glu = fusion == "glu"
    cfg = triton_ops.MultirowConfig(block_n=32, block_k=64, num_warps=4, num_stages=2, split=split)
    w, s, block = quantized(2 * n if glu else n, k, layout)
    x = rand(rows, k, seed=2, dtype=dtype)
    b = rand(w.shape[0], seed=3, dtype=dtype) if fusion == "bias" else None
    got = triton_ops.multirow_linear(x, w, b, glu=glu, config=cfg, weight_scale=s, scale_block=block)
    want = reference(x, w, s, block, b, glu=glu)
    assert got.shape == (rows, n) and got.dtype == dtype
    assert close(got, want, dtype)
    # negative control: the scales of other rows (a misaligned layout) give another product
    wrong = triton_ops.multirow_linear(x, w, b, glu=glu, config=cfg, weight_scale=s.flip(0).contiguous(),
                                       scale_block=block)
    assert not close(wrong, want, dtype)


def test_multirow_tiles_fit_in_shared_memory():
    """Each FP8 class's tiles with SwiGLU's second weight tile, at the largest row group (128 + 32 rows),
    compiled for sm_90 with the stages `multirow_stages` gives them, fit in an H200 program's 227 KB;
    the tall tiles' own 4 stages would not (a launch fails with OutOfResources)."""
    sig = {"X": "*bf16", "W": "*fp8e4nv", "Bias": "*bf16", "WScale": "*fp32", "Out": "*bf16", "Part": "*fp32"}
    cases = []
    for cls, tiles in [*fp8.MULTIROW_TILES.items(), ("tall, its own stages", fp8.MULTIROW_TILES["tall"])]:
        cfg = triton_ops.MultirowConfig(*tiles)
        stages = cfg.num_stages if "own" in cls else triton_ops.multirow_stages(
            cfg.num_stages, cfg.block_n, cfg.block_k, 160, True, 1, 2)
        const = dict(ROWS_A=128, ROWS_B=32, HAS_B=True, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=cfg.split,
                     GLU=True, HAS_BIAS=False, WSCALE=1, SCALE_BR=1, SCALE_BC=4096, EVEN_K=True, PDL=True)
        cases.append(("_multirow_linear", sig, const, {"num_warps": cfg.num_warps, "num_stages": stages,
                                                       "launch_pdl": True}, ["n", "k", "k_split"]))
    *fitted, own = shared_for_sm90("blockspec.kernels.ops", cases)
    assert all(b <= 227 << 10 for b in fitted), fitted
    assert own > 227 << 10  # negative control: without the cap this tile cannot launch


@pytest.mark.parametrize("dtype", [d for d in DTYPES if not (CUDA and d == torch.float16)])
@pytest.mark.parametrize("rows", [1, 17])
def test_block_scales_keep_long_k_tiles(dtype, rows):
    """A program's columns in one block row: K tiles of 128 span four 32-column scale blocks, each k
    scaled by its own block (per-k scales), where a tile per scale block would cap K tiles at 32."""
    n, k = 64, 200
    assert triton_ops.scale_mode(32, 32, k, n, block_n=32, block_k=128) == (3, 128)
    assert triton_ops.scale_mode(32, 32, k, n, block_n=64, block_k=128) == (2, 32)  # columns over two block rows
    assert triton_ops.scale_mode(32, 32, k, 48, block_n=16, block_k=128, glu=True) == (2, 32)  # up rows straddle
    assert triton_ops.scale_mode(1, k, k, n, block_n=64, block_k=128) == (1, 128)
    cfg = triton_ops.SkinnyConfig(block_m=1 if rows == 1 else 16, block_n=32, block_k=128, num_warps=4, num_stages=2)
    w, s, block = quantized(n, k, "block")
    x = rand(rows, k, seed=2, dtype=dtype)
    want = reference(x, w, s, block)
    assert close(triton_ops.skinny_linear(x, w, config=cfg, weight_scale=s, scale_block=block), want, dtype)
    # negative control: the K blocks' scales in reverse order
    wrong = triton_ops.skinny_linear(x, w, config=cfg, weight_scale=s.flip(1).contiguous(), scale_block=block)
    assert not close(wrong, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("glu", [False, True])
def test_prenormed_rows_norm_an_fp8_product(dtype, glu):
    """The decoder's chain above one row with FP8 weights: o/down writes the residual stream and the
    next norm's statistics, qkv/gate_up norms inside its stream."""
    rows, k, n, n2 = 5, 96, 80, 48
    cfg = triton_ops.SkinnyConfig(block_m=16, block_n=32, block_k=64, num_warps=4, num_stages=2)
    x = rand(rows, k, dtype=dtype)
    w1, s1, b1 = quantized(n, k, "block", seed=1)
    res = rand(rows, n, seed=2, dtype=dtype)
    nw = rand(n, seed=3, dtype=dtype)
    w2, s2, b2 = quantized(2 * n2 if glu else n2, n, "channel", seed=4)
    pre = triton_ops.skinny_linear(x, w1, residual=res, emit_norm=nw, config=cfg, weight_scale=s1, scale_block=b1)
    got = triton_ops.skinny_linear(pre.rows, w2, prenormed=pre, eps=1e-6, glu=glu, config=cfg, weight_scale=s2,
                                   scale_block=b2)
    h = reference(x, w1, s1, b1, residual=res)
    want = reference(h, w2, s2, b2, norm_weight=nw, glu=glu)
    assert close(pre.rows, h, dtype) and close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["channel", "block"])
def test_wide_row_tiles_match_the_reference(dtype, layout):
    """Above SKINNY_MAX_ROWS: the same kernel in each of fp8.ROW_TILES' row tiles (two row tiles here, the
    second ragged)."""
    w, s, block = quantized(160, 256, layout)
    x = rand(70, 256, seed=2, dtype=dtype)
    for cfg in fp8.ROW_TILES.values():
        got = triton_ops.skinny_linear(x, w, config=cfg, weight_scale=s, scale_block=block)
        assert close(got, reference(x, w, s, block), dtype), cfg


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["channel", "block", "rows"])
def test_dequantize_kernel_is_the_reference(dtype, layout):
    w, s, block = quantized(72, 200, layout)
    want = fp8.dequantize_reference(w, s, block, dtype)
    assert torch.equal(fp8.dequantize_kernel(w, s, block, dtype), want)
    assert close(want, w.double() * fp8.expand_scale(s.double(), block, 72, 200), dtype)
    if layout == "block":  # negative control: row r given block r % 3's scales (one scale row per weight row)
        assert not torch.equal(fp8.dequantize_kernel(w, s.repeat(24, 1).contiguous(), (1, 32), dtype), want)


@pytest.mark.parametrize("layout", ["channel", "block"])
def test_quantization_error_is_e4m3_rounding(layout):
    w = rand(100, 300) * torch.logspace(-3, 1, 100, device=DEVICE)[:, None]
    q, s = fp8.quantize_per_channel(w) if layout == "channel" else fp8.quantize_blocks(w, (32, 128))
    block = (1, 300) if layout == "channel" else (32, 128)
    assert q.dtype == torch.float8_e4m3fn and s.shape == fp8.scale_shape(100, 300, block)
    scale = fp8.expand_scale(s, block, 100, 300)
    err = (fp8.dequantize_reference(q, s, block, torch.float32) - w).abs()
    # half an e4m3 step: 2^-4 relative for normal values, 2^-10 of the scale among the subnormals
    assert (err <= w.abs() * 2**-4 + scale * 2**-10 + 1e-12).all()
    assert (q.float().abs().amax(dim=1) == fp8.E4M3_MAX).all() if layout == "channel" else True
    # negative control: scales off by a factor of two are far outside that bound
    wrong = (fp8.dequantize_reference(q, s * 2, block, torch.float32) - w).abs()
    assert not (wrong <= w.abs() * 2**-4 + scale * 2**-10 + 1e-12).all()


def test_skinny_linear_names_a_bad_scale():
    w, s, block = quantized(48, 80, "block")
    x = rand(1, 80)
    with pytest.raises(ValueError, match="an FP8 weight needs weight_scale"):
        triton_ops.skinny_linear(x, w)
    with pytest.raises(ValueError, match=r"does not cover weight \(48, 80\) in 16 x 32 blocks"):
        triton_ops.skinny_linear(x, w, weight_scale=s, scale_block=(16, 32))


# ---------------------------------------------------------------- GPU: dispatch, bf16, graphs, _scaled_mm
@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 64, 144, 400])  # skinny, skinny, row tiles, multirow, dequantize + cuBLAS
@pytest.mark.parametrize("layout", ["channel", "block"])
@pytest.mark.parametrize("glu", [False, True])
def test_fp8_linear_by_row_count_matches_the_reference(rows, layout, glu):
    w, s, block = quantized(384, 512, layout)
    x = rand(rows, 512, seed=2, dtype=torch.bfloat16)
    b = rand(384, seed=3, dtype=torch.bfloat16)
    got = fp8.fp8_linear(x, w, s, block, b, glu=glu)
    want = reference(x, w, s, block, b)
    slack = 1.0
    if glu:  # an error in either half comes out scaled by the other: silu(gate) reaches 10 here
        gate, up = want.chunk(2, dim=-1)
        want, slack = F.silu(gate) * up, 1.0 + F.silu(gate).abs() + up.abs()
    tol = TOL[torch.bfloat16]
    assert got.dtype == torch.bfloat16 and ((got.double() - want).abs() <= tol * (slack + want.abs())).all()
    if glu:  # negative control: the halves swapped (up activated instead of gate) is outside that slack
        assert not ((F.silu(up) * gate - want).abs() <= tol * (slack + want.abs())).all()


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 64, 144, 400])
def test_fp8_linear_replays_in_a_cuda_graph(rows):
    w, s, block = quantized(384, 512, "block")
    x = rand(rows, 512, seed=2, dtype=torch.bfloat16)
    fp8.fp8_linear(x, w, s, block)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8.fp8_linear(x, w, s, block)
    x.copy_(rand(rows, 512, seed=7, dtype=torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fp8.fp8_linear(x, w, s, block))


@gpu
@pytest.mark.gpu
def test_scaled_mm_rowwise_is_close_to_the_weight_only_product():
    """FP8 tensor cores quantize the activations too: close to, not equal to, the weight-only model."""
    w, s, block = quantized(512, 1024, "channel")
    x = rand(256, 1024, seed=2, dtype=torch.bfloat16)
    try:
        got = fp8.scaled_mm_rowwise(x, w, s)
    except RuntimeError as exc:  # a build or GPU without row-wise scaled_mm
        pytest.skip(f"torch._scaled_mm row-wise: {exc}"[:200])
    want = reference(x, w, s, block)
    rel = (got.double() - want).norm() / want.norm()
    assert rel < 0.05
    assert (fp8.scaled_mm_rowwise(x, w, s * 2).double() - want).norm() / want.norm() > 0.5  # negative control


@gpu
@pytest.mark.gpu
def test_scaled_mm_blockwise_is_close_to_the_weight_only_product():
    """128 x 128 block weights on FP8 tensor cores (1 x 128 activation groups, CUDA >= 12.9, Hopper)."""
    w = rand(512, 1280) / 1280**0.5
    q, s = fp8.quantize_blocks(w, (128, 128))
    x = rand(256, 1280, seed=2, dtype=torch.bfloat16)
    try:
        got = fp8.scaled_mm_blockwise(x, q, s)
    except (RuntimeError, NotImplementedError) as exc:  # a build or GPU without block-wise scaled_mm
        pytest.skip(f"torch._scaled_mm block-wise: {exc}"[:200])
    want = reference(x, q, s, (128, 128))
    assert (got.double() - want).norm() / want.norm() < 0.05
    wrong = fp8.scaled_mm_blockwise(x, q, s.flip(0).contiguous())  # negative control: other rows' scales
    assert (wrong.double() - want).norm() / want.norm() > 0.05


def test_the_kv_store_compiles_for_the_gpu():
    """Through Triton's front end for sm_90 (`compile_for_sm90`): `_qkv_rope_store` writes q rows and
    cache pages of another type (e4m3) in two branches, which the interpreter does not type-check."""
    cases = []
    for dtype, cache, heads, head_scales in (("fp32", "*fp32", 1, False), ("bf16", "*bf16", 2, False),
                                             ("fp32", "*fp8e4nv", 2, False), ("bf16", "*fp8e4nv", 1, False),
                                             ("bf16", "*fp8e4nv", 2, True)):
        signature = {**{n: f"*{dtype}" for n in ("QKV", "QW", "KW", "QOut")}, "Cos": "*fp32", "Sin": "*fp32",
                     "Table": "*i32", "Slots": "*i32", "WritePos": "*i32", "KCache": cache, "VCache": cache,
                     "KScale": "*fp32", "VScale": "*fp32", "eps": "fp32", "k_inv": "fp32", "v_inv": "fp32"}
        constexprs = {"Q_HEADS": 4, "KV_HEADS": 2, "HEAD_DIM": 128, "HALF_BLOCK": 64, "QK_NORM": True, "PAGE": 16,
                      "HEADS": heads, "KV_FP8": cache == "*fp8e4nv", "HEAD_SCALES": head_scales}
        cases.append(("_qkv_rope_store", signature, constexprs))
    compile_for_sm90("blockspec.kernels.ops", cases)


def test_per_head_attention_scales_compile_for_the_gpu():
    """`_block_attention` with a scale per KV head (HEAD_SCALES) over e4m3 pages, through the sm_90 front end."""
    signature = {"Q": "*bf16", "K": "*fp8e4nv", "V": "*fp8e4nv", "Out": "*bf16", "Table": "*i32", "Slots": "*i32",
                 "Lo": "*i32", "Hi": "*i32", "Counters": "*i32", "PartAcc": "*fp32", "PartMax": "*fp32",
                 "PartSum": "*fp32", "KScale": "*fp32", "VScale": "*fp32", "scale_log2": "fp32", "v_scale": "fp32"}
    constexprs = {"KV_HEADS": 8, "GROUP": 4, "HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_M": 16, "BLOCK_N": 128,
                  "MIN_TILES": 1, "LONG_TILES": 8, "MAX_USED": 264, "MERGE_UNROLL": 4, "IEEE": False, "PAGE": 64,
                  "PER_KEY": False, "F16_DOTS": True, "EDGE_MASKS": True, "HEAD_SCALES": True}
    compile_for_sm90("blockspec.kernels.attention", [("_block_attention", signature, constexprs)])


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("method, fixture, fp8", [("dflash", "dflash", {"quantization": "fp8"}),
                                                  ("dspark", "dspark_vanilla", {"quantization": "fp8"}),
                                                  ("dflash", "dflash", {"kv_cache_dtype": "fp8"}),
                                                  ("dspark", "dspark_vanilla", {"quantization": "fp8",
                                                                                "kv_cache_dtype": "fp8"})])
def test_graphed_speculation_on_an_fp8_target_is_its_plain_decoding(tmp_path, method, fixture, fp8):
    """On the GPU (CUDA graphs, the FP8 streaming kernel at decode and verify widths, FP8 pages in the
    attention kernel): greedy speculation equals the quantized model's plain decoding, graphed plain
    equals eager plain, and seeded sampling equals plain sampling."""
    from blockspec import LLM, SamplingParams
    from factories import save_drafter_target
    from test_spec import FIXTURES, add_oracle, prompts, run

    target = save_drafter_target(tmp_path / "target")
    common = dict(device="cuda", dtype="float32", max_model_len=256, **fp8)
    plain = LLM(str(target), **common)
    eager = LLM(str(target), enforce_eager=True, **common)
    ps = prompts(4, seed=5)
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = run(plain, ps, greedy)
    assert run(eager, ps, greedy) == expected
    config = {"method": method, "model": str(FIXTURES / fixture), "adaptive_draft_length": False}
    spec = LLM(str(target), speculative_config=config, **common)
    assert run(spec, ps, greedy) == expected
    # accepted drafts too: the oracle replaces Proposer.propose, which a chained (asynchronous) step skips
    oracle = LLM(str(target), speculative_config=config, async_scheduling=False, **common)
    add_oracle(oracle, {tuple(p["prompt_token_ids"]): e for p, e in zip(ps, expected)}, corrupt=0.2)
    assert run(oracle, ps, greedy) == expected and oracle.get_stats()["mean_acceptance_length"] > 2.0
    sampled = SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=30, ignore_eos=True)
    assert run(spec, ps, sampled) == run(plain, ps, sampled)


# ---------------------------------------------------------------- FP8 KV cache
KV_SCALES = (0.5, 2.0)  # K / 0.5 and V / 2.0 stored: the scales are applied, not assumed to be 1
HEAD_SCALES = ((0.5, 8.0), (2.0, 0.125))  # per KV head (two heads), 16x apart: K's and V's


def head_scales(scales: tuple[tuple[float, ...], ...]) -> list[torch.Tensor]:
    return [torch.tensor(s, dtype=torch.float32, device=DEVICE) for s in scales]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hq", [4, 0])  # the target's (and the draft block's) rows; the drafter's context K/V
@pytest.mark.parametrize("per_head", [False, True])
def test_qkv_rope_store_into_an_fp8_cache(dtype, hq, per_head):
    """K / k_scale and V / v_scale saturated into e4m3 pages, as `KVCache.write` stores them, the scales one
    a tensor or one a KV head: on the GPU
    V bit for bit, K within one e4m3 step (RoPE rounds once where the reference rounds per op). Triton's
    interpreter rounds to e4m3 wrongly where rounding carries into the exponent (1.9375 -> 1.0) and
    flushes subnormals, so on the CPU most values agree (more than 85 %), not all."""
    from blockspec.config import RopeConfig
    from blockspec.models import layers
    from blockspec.models.kv_cache import FP8, KVCache, PageTable, causal_meta
    from test_triton_ops import reference_store

    r, n, hkv, hd, slots, length = 3, 4, 2, 16, 5, 40
    qkv = rand(r, n, (hq + 2 * hkv) * hd, seed=1, dtype=dtype) * 3
    qkv[0, 0, -hd:] = 1000.0  # a V beyond the e4m3 range after scaling: saturates, no inf / nan
    qw, kw = rand(hd, seed=3, dtype=dtype), rand(hd, seed=4, dtype=dtype)
    meta = causal_meta([4, 0, 2], [7, 0, 30], [4, 4, 3], n, length, DEVICE)
    cos, sin = layers.Rotary(RopeConfig(theta=10000.0), hd, 64).to(DEVICE)(meta.positions, dtype)
    table = PageTable.full(slots, length, DEVICE, page_size=8)
    scales = ([s] for s in HEAD_SCALES) if per_head else KV_SCALES  # KVCache takes an entry per layer
    ref, got = (KVCache(1, hkv, hd, length, dtype, DEVICE, table, FP8, *scales) for _ in range(2))
    if per_head:
        assert torch.equal(ref.k_scales[0], head_scales(HEAD_SCALES)[0])
    reference_store(qkv, hq, hkv, hd, qw, kw, cos, sin, ref, meta)
    triton_ops.qkv_rope_store(qkv, hq, hkv, hd, qw if hq else None, kw, 1e-6, cos, sin, got.k[0], got.v[0],
                              table.table, meta.slots, meta.write_pos, ref.k_scales[0], ref.v_scales[0])
    v, v_ref, k, k_ref = got.v[0].float(), ref.v[0].float(), got.k[0].float(), ref.k[0].float()
    kw_, vw_ = k_ref != 0, v_ref != 0  # the entries this store wrote
    assert got.k[0].dtype == FP8 and v.abs().max() == 448.0 and v.isfinite().all()
    if CUDA:
        assert torch.equal(got.v[0].view(torch.uint8), ref.v[0].view(torch.uint8))
        assert torch.allclose(k, k_ref, rtol=2**-3, atol=2**-9) and (k[kw_] == k_ref[kw_]).float().mean() > 0.95
    else:
        assert (v[vw_] == v_ref[vw_]).float().mean() > 0.85 and (k[kw_] == k_ref[kw_]).float().mean() > 0.85
    # negative control: stored without the scales (per head: with the heads' scales swapped)
    wrong = [s.flip(0) for s in head_scales(HEAD_SCALES)] if per_head else [1.0, 1.0]
    triton_ops.qkv_rope_store(qkv, hq, hkv, hd, qw if hq else None, kw, 1e-6, cos, sin, got.k[0], got.v[0],
                              table.table, meta.slots, meta.write_pos, *wrong)
    assert (got.k[0].float()[kw_] == k_ref[kw_]).float().mean() < 0.5
    assert (got.v[0].float()[vw_] == v_ref[vw_]).float().mean() < 0.5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 8, 2, 64, 300, 16), (2, 16, 4, 2, 32, 100, 64), (2, 40, 4, 1, 32, 130, 7)])
@pytest.mark.parametrize("v_staged, edge_masks", [(False, False), (True, False), (False, True), (True, True)])
def test_block_attention_reads_an_fp8_cache(dtype, shape, v_staged, edge_masks):
    """Decode (split over keys), verify and wide blocks over e4m3 pages (16-bit queries: fp16 dots), V
    also staged in fp16 (`AttentionTiles.fp8_v_staged`: inline PTX, so on a GPU only): the reference is
    SDPA over the dequantized keys and values; with `AttentionTiles.edge_masks` as well."""
    from blockspec.kernels.attention import AttentionTiles
    from test_triton_attention import case, paged, reference

    if v_staged and not CUDA:
        pytest.skip("staging V runs inline PTX, which Triton's interpreter lacks")
    tiles = AttentionTiles(fp8_v_staged=v_staged, edge_masks=edge_masks)
    r, nq, hq, hkv, hd, length, page = shape
    q, k, v, slots, lo, hi = case(r, nq, hq, hkv, hd, length, dtype)
    kq, vq = (fp8_kv(t * 2, s) for t, s in zip((k, v), KV_SCALES))
    want = reference(q, kq.float() * KV_SCALES[0], vq.float() * KV_SCALES[1], slots, lo, hi, hd**-0.5, length)
    (k_pool, table), (v_pool, _) = paged(kq, page), paged(vq, page)
    got = triton_attention_call(q, k_pool, v_pool, table[slots], lo, hi, hd**-0.5, length, *KV_SCALES, tiles)
    assert got.dtype == dtype
    tol = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]  # bf16: the output's rounding
    assert torch.allclose(got.float(), want, atol=tol, rtol=tol)
    # negative control: the scales left out
    wrong = triton_attention_call(q, k_pool, v_pool, table[slots], lo, hi, hd**-0.5, length, 1.0, 1.0, tiles)
    assert not torch.allclose(wrong.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 8, 2, 64, 300, 16), (2, 16, 4, 2, 32, 100, 64), (2, 3, 4, 1, 32, 70, 16)])
def test_block_attention_takes_a_scale_per_kv_head(dtype, shape):
    """Decode (split), verify and wide blocks over e4m3 pages each KV head of which holds K and V over its
    own scales (16x apart): equal to SDPA over the keys and values dequantized head by head; with the
    heads' scales swapped (the control) it is not."""
    from test_triton_attention import case, paged, reference

    r, nq, hq, hkv, hd, length, page = shape
    q, k, v, slots, lo, hi = case(r, nq, hq, hkv, hd, length, dtype)
    k_scale, v_scale = (x[:hkv].contiguous() for x in head_scales(HEAD_SCALES))
    big = torch.tensor([1.0, 16.0][:hkv], device=DEVICE).view(-1, 1, 1)  # head 1's values 16x head 0's
    kq, vq = fp8_kv(k.float() * big, k_scale), fp8_kv(v.float() * big, v_scale)
    dequantized = (kq.float() * k_scale.view(-1, 1, 1), vq.float() * v_scale.view(-1, 1, 1))
    want = reference(q, *dequantized, slots, lo, hi, hd**-0.5, length)
    (k_pool, table), (v_pool, _) = paged(kq, page), paged(vq, page)
    got = triton_attention_call(q, k_pool, v_pool, table[slots], lo, hi, hd**-0.5, length, k_scale, v_scale)
    tol = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    atol = tol * float(want.abs().max())  # head 1's outputs are 16x head 0's, and so is their rounding
    assert got.dtype == dtype and torch.allclose(got.float(), want, atol=atol, rtol=tol)
    if hkv > 1:
        wrong = triton_attention_call(q, k_pool, v_pool, table[slots], lo, hi, hd**-0.5, length, k_scale.flip(0),
                                      v_scale.flip(0))
        assert not torch.allclose(wrong.float(), want, atol=atol, rtol=tol)
    with pytest.raises(ValueError, match="both be floats or both per-head tensors"):
        triton_attention_call(q, k_pool, v_pool, table[slots], lo, hi, hd**-0.5, length, k_scale, 1.0)
    with pytest.raises(ValueError, match=rf"contiguous float32 \[{hkv}\] tensor, got torch.float64"):
        triton_attention_call(q, k_pool, v_pool, table[slots], lo, hi, hd**-0.5, length, k_scale.double(),
                              v_scale.double())


@gpu
@pytest.mark.gpu
def test_bf16_queries_beyond_fp16_range_saturate():
    """The fp16 dots of an FP8 cache saturate a bf16 query past 65504 instead of turning it into inf:
    the scores stay finite and the softmax picks the same key (the one its huge component selects)."""
    from test_triton_attention import case, paged, reference

    q, k, v, slots, lo, hi = case(2, 1, 8, 2, 64, 200, torch.bfloat16)
    q[..., 0] = 1e5
    kq, vq = (fp8_kv(t, s) for t, s in zip((k, v), KV_SCALES))
    want = reference(q, kq.float() * KV_SCALES[0], vq.float() * KV_SCALES[1], slots, lo, hi, 64**-0.5, 200)
    (k_pool, table), (v_pool, _) = paged(kq, 64), paged(vq, 64)
    got = triton_attention_call(q, k_pool, v_pool, table[slots], lo, hi, 64**-0.5, 200, *KV_SCALES)
    assert torch.isfinite(got).all()
    assert torch.allclose(got.float(), want, atol=2e-2, rtol=2e-2)


def fp8_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    from blockspec.models.kv_cache import quantize_kv

    return quantize_kv(x, scale)


def triton_attention_call(q, k_pool, v_pool, table, lo, hi, scale, length, k_scale, v_scale, tiles=None):
    from blockspec.kernels.attention import block_attention

    slots = torch.arange(table.shape[0], device=q.device)
    return block_attention(q, k_pool, v_pool, table, slots, lo, hi, scale, length, tiles, k_scale=k_scale,
                           v_scale=v_scale)
