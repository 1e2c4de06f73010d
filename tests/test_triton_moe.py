"""The fused mixture-of-experts kernels (route, align, grouped gate_up / down, combine) held to the
reference in `models.moe`. Without a GPU the small cases run in Triton's interpreter; the bf16 cases at
Qwen3-30B-A3B's expert shapes and the CUDA-graph capture need CUDA."""

from __future__ import annotations

import pytest
import torch

from blockspec.kernels import moe as K
from blockspec.models import moe as M
from factories import TRITON_SKIP_REASON, compile_for_sm90, triton_interpretable

pytestmark = pytest.mark.skipif(not triton_interpretable(), reason=TRITON_SKIP_REASON)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def rand(*shape: int, dtype: torch.dtype, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(DEVICE, dtype)


def experts(num: int, hidden: int, inter: int, dtype: torch.dtype, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [E, 2I, H], down [E, H, I], scaled so activations stay near 1."""
    return (rand(num, 2 * inter, hidden, dtype=dtype, seed=seed, scale=hidden ** -0.5),
            rand(num, hidden, inter, dtype=dtype, seed=seed + 1, scale=inter ** -0.5))


def reference(x, gate_up, down, logits, k, renorm):
    weights, ids = M.route(logits, k, renorm)
    return M.experts_reference(x, gate_up, down, weights.to(x.dtype), ids)


def fused(x, gate_up, down, logits, k, renorm, **kw):
    weights, ids = K.route(logits, k, renorm, x.dtype)
    return K.fused_experts(x, gate_up, down, weights, ids, **kw)


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """fp32: summation order only; half types: a rounding boundary crossed here and there (one ulp of
    the largest values at most, and rarely)."""
    err = (got.float() - want.float()).abs()
    scale = want.float().abs().max().item()
    if dtype == torch.float32:
        assert err.max() <= 1e-5 * max(1.0, scale), err.max()
    else:
        assert err.max() <= 2 ** -7 * scale + 1e-3, (err.max(), scale)
        assert err.mean() <= 2 ** -10 * scale, (err.mean(), scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("renorm", [False, True])
@pytest.mark.parametrize("num_experts,k", [(6, 2), (16, 4)])  # a padded expert block; a wider top-k
def test_route_matches_reference(dtype, renorm, num_experts, k):
    logits = rand(13, num_experts, dtype=dtype, seed=3, scale=2.0)
    weights, ids = K.route(logits, k, renorm, dtype)
    want_w, want_ids = M.route(logits, k, renorm)
    assert ids.dtype == torch.int32 and torch.equal(ids.long(), want_ids)
    assert weights.dtype == dtype and torch.allclose(weights.float(), want_w.float(), atol=1e-3, rtol=1e-3)
    other = K.route(logits, k, not renorm, dtype)[0]  # negative control: the other normalisation
    assert not torch.allclose(other.float(), want_w.float(), atol=1e-3)



@pytest.mark.parametrize("chunk", [8, 64])  # passes of a few pairs (decode) and of many
@pytest.mark.parametrize("pairs,num_experts,block_m", [(1, 8, 16), (30, 6, 16), (140, 16, 16), (600, 16, 64),
                                                       (600, 128, 16)])
def test_align_kernel_equals_the_sort(pairs, num_experts, block_m, chunk):
    """The one-program counting sort and tile table against the stable torch sort, tile by tile."""
    ids = torch.randint(0, num_experts, (pairs,), generator=torch.Generator().manual_seed(pairs)).to(DEVICE,
                                                                                                   torch.int32)
    tiles = K.num_tiles(pairs, 1, num_experts, block_m)
    got = K.Schedule(*(torch.full((n,), -7, dtype=torch.int32, device=DEVICE) for n in (pairs, tiles, tiles, tiles)))
    K._moe_align[(1,)](ids, got.sorted_pairs, got.tile_expert, got.tile_lo, got.tile_hi, pairs, num_experts, tiles,
                       BLOCK_M=block_m, E_BLOCK=K.triton.next_power_of_2(num_experts), CHUNK=chunk)
    want = K.align_torch(ids, num_experts, block_m, tiles)
    used = want.tile_expert >= 0
    assert torch.equal(got.sorted_pairs, want.sorted_pairs) and torch.equal(got.tile_expert, want.tile_expert)
    assert torch.equal(got.tile_lo[used], want.tile_lo[used]) and torch.equal(got.tile_hi[used], want.tile_hi[used])
    # the tiles cover every pair once, each within one expert and at most block_m long
    lo, hi, ex = want.tile_lo[used].long(), want.tile_hi[used].long(), want.tile_expert[used].long()
    assert int((hi - lo).sum()) == pairs and bool(((hi - lo) <= block_m).all() and ((hi - lo) > 0).all())
    for a, b, e in zip(lo.tolist(), hi.tolist(), ex.tolist()):
        assert bool((ids[want.sorted_pairs[a:b].long()] == e).all())


# one row (each pair its own tile, no alignment); a few; past one 16-row tile; past MOE_FEW_ROWS
# (64-pair tiles, several for an expert)
@pytest.mark.parametrize("dtype,rows,num_experts,k", [(torch.float32, 1, 16, 4), (torch.float16, 1, 6, 2),
                                                      (torch.float16, 5, 6, 2), (torch.float32, 17, 16, 4),
                                                      (torch.float16, 70, 6, 2)])
def test_fused_experts_match_reference(dtype, rows, num_experts, k):
    hidden, inter = 64, 48  # a ragged last K block of the down projection (48 % 32)
    x = rand(rows, hidden, dtype=dtype)
    gate_up, down = experts(num_experts, hidden, inter, dtype)
    logits = rand(rows, num_experts, dtype=dtype, seed=4)
    want = reference(x, gate_up, down, logits, k, True)
    got = fused(x, gate_up, down, logits, k, True)
    assert got.shape == want.shape and got.dtype == dtype
    assert_close(got, want, dtype)
    swapped = torch.cat(gate_up.chunk(2, dim=1)[::-1], dim=1)  # negative control: gate and up swapped
    assert (fused(x, swapped, down, logits, k, True).float() - want.float()).abs().max() > 1e-2


def fp8_experts(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked experts in e4m3 over `block` blocks, expert by expert: (weights, scales)."""
    from blockspec.kernels import fp8

    parts = [fp8.quantize_blocks(w[e].float(), block) for e in range(w.shape[0])]
    return torch.stack([q for q, _ in parts]).to(DEVICE), torch.stack([s for _, s in parts]).to(DEVICE)


# blocks that divide the K tile (32 x 32), per channel (one block spans K), rows of one scale each with a
# block narrower than the default K tile (16 columns), and a width that is not a power of two (48)
@pytest.mark.parametrize("dtype,rows,up_block,down_block", [(torch.float32, 1, (32, 32), (32, 32)),
                                                            (torch.float16, 5, (1, 64), (1, 48)),
                                                            (torch.float32, 17, (1, 16), (16, 48)),
                                                            (torch.float16, 70, (32, 32), (32, 16))])
def test_fp8_experts_match_their_dequantized_reference(dtype, rows, up_block, down_block):
    """e4m3 experts with scales over blocks, dequantized tile by tile in the grouped kernels, against the
    reference over `dequantize_reference`'s weights; the control drops the scales."""
    from blockspec.kernels import fp8

    hidden, inter, num_experts, k = 64, 48, 6, 2
    x = rand(rows, hidden, dtype=dtype)
    gate_up, down = experts(num_experts, hidden, inter, dtype)
    (gu, gs), (dw, ds) = fp8_experts(gate_up, up_block), fp8_experts(down, down_block)
    dequant = [torch.stack([fp8.dequantize_reference(q[e].cpu(), s[e].cpu(), b, dtype) for e in range(num_experts)])
               .to(DEVICE) for q, s, b in ((gu, gs, up_block), (dw, ds, down_block))]
    logits = rand(rows, num_experts, dtype=dtype, seed=4)
    want = reference(x, *dequant, logits, k, True)
    got = fused(x, gu, dw, logits, k, True, scales=K.ExpertScales(gs, ds, up_block, down_block))
    assert got.dtype == dtype
    assert_close(got, want, dtype)
    ones = K.ExpertScales(torch.ones_like(gs), torch.ones_like(ds), up_block, down_block)
    assert not torch.allclose(fused(x, gu, dw, logits, k, True, scales=ones).float(), want.float(), atol=1.0)


def test_residual_is_added_as_the_unfused_add_rounds():
    x = rand(5, 64, dtype=torch.float16)
    res = rand(5, 64, dtype=torch.float16, seed=9)
    gate_up, down = experts(8, 64, 32, torch.float16)
    logits = rand(5, 8, dtype=torch.float16, seed=4)
    weights, ids = K.route(logits, 2, False, torch.float16)
    plain = K.fused_experts(x, gate_up, down, weights, ids)
    assert torch.equal(K.fused_experts(x, gate_up, down, weights, ids, residual=res), res + plain)


def moe_block(cfg_kw: dict, dtype: torch.dtype) -> M.SparseMoE:
    from blockspec.config import ModelConfig

    cfg = ModelConfig(**{"model_type": "qwen3_moe", "vocab_size": 8, "hidden_size": 64, "intermediate_size": 8,
                         "num_hidden_layers": 1, "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 8,
                         "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "moe_layers": (0,),
                         **cfg_kw})
    torch.manual_seed(0)
    block = M.SparseMoE(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, p.shape[-1] ** -0.5)
    return block.to(DEVICE, dtype).eval().requires_grad_(False)


@pytest.mark.parametrize("shared", [0, 40], ids=["qwen3_moe", "shared-expert"])
@pytest.mark.parametrize("shape", [(2, 3), (1, 1)], ids=["rows", "one-row"])
def test_block_takes_the_kernels_where_they_serve(monkeypatch, shared, shape):
    """The SparseMoE block with the kernels (forced on here, as on CUDA) against its reference path,
    with the layer's pre-norm and residual folded in as the decoder layer passes them (at one row the
    router's product streams and the experts take no alignment)."""
    block = moe_block({"norm_topk_prob": True, "shared_expert_intermediate_size": shared}, torch.float16)
    assert_block_takes_the_kernels(monkeypatch, block, shape)


def assert_block_takes_the_kernels(monkeypatch, block: M.SparseMoE, shape: tuple[int, int]) -> None:
    from blockspec.models.layers import RMSNorm

    hidden, dtype = block.gate.weight.shape[1], block.gate.weight.dtype
    norm = RMSNorm(hidden).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(1.0 + rand(hidden, dtype=dtype, seed=6, scale=0.2))
    x = rand(*shape, hidden, dtype=dtype)
    res = rand(*shape, hidden, dtype=dtype, seed=5)
    monkeypatch.setattr(M, "use_kernels", lambda *t: False)
    want = block(x, norm=norm, residual=res)
    seen = []
    block.observe = seen.append
    monkeypatch.setattr(M, "use_kernels", lambda *t: True)
    got = block(x, norm=norm, residual=res)
    assert got.shape == x.shape and len(seen) == 1 and seen[0].shape == (shape[0] * shape[1], block.top_k)
    assert_close(got - res, want - res, dtype)
    assert (block(x, residual=res) - want).abs().max() > 1e-2  # negative control: the pre-norm left out


# ---------------------------------------------------------------------------------------- GPU, bf16
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("rows", [1, 4, 16, 64, 65, 300])
@pytest.mark.parametrize("num_experts,k", [(128, 8), (64, 4), (8, 2)])
@pytest.mark.parametrize("renorm", [True, False])
def test_bf16_expert_shapes_match_reference(rows, num_experts, k, renorm):
    """Qwen3-30B-A3B's expert shapes (H 2048, I 768) in bf16, at decode, verify and prefill row counts,
    and coarser experts (Mixtral-like 8 x top-2: many pairs an expert, several tiles above 64 rows)."""
    dtype = torch.bfloat16
    x = rand(rows, 2048, dtype=dtype)
    gate_up, down = experts(num_experts, 2048, 768, dtype)
    logits = rand(rows, num_experts, dtype=dtype, seed=4)
    want = reference(x, gate_up, down, logits, k, renorm)
    got = fused(x, gate_up, down, logits, k, renorm)
    assert_close(got, want, dtype)
    assert (fused(x, gate_up, down, logits.flip(-1), k, renorm).float() - want.float()).abs().max() > 1e-2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("rows", [1, 16, 65])
@pytest.mark.parametrize("block", [(128, 128), None])  # Qwen3-30B-A3B-FP8's blocks; per channel
def test_fp8_expert_shapes_match_their_dequantized_reference(rows, block):
    """Qwen3-30B-A3B's experts (128 x top-8, H 2048, I 768) in e4m3 with bf16 activations, at decode,
    verify and prefill row counts, against the reference in float32 over the exactly dequantized weights
    (e4m3 times its scale, which a bf16 copy would round: the one-row path keeps it whole) and the router
    weights the kernels take (bf16)."""
    from blockspec.kernels import fp8

    dtype, num_experts, k = torch.bfloat16, 128, 8
    x = rand(rows, 2048, dtype=dtype)
    gate_up, down = experts(num_experts, 2048, 768, dtype)
    up_block, down_block = block or (1, 2048), block or (1, 768)
    (gu, gs), (dw, ds) = fp8_experts(gate_up, up_block), fp8_experts(down, down_block)
    dequant = [torch.stack([fp8.dequantize_reference(q[e], s[e], b, torch.float32) for e in range(num_experts)])
               for q, s, b in ((gu, gs, up_block), (dw, ds, down_block))]
    logits = rand(rows, num_experts, dtype=dtype, seed=4)
    weights, ids = M.route(logits, k, True)
    want = M.experts_reference(x.float(), *dequant, weights.to(dtype).float(), ids)
    assert_close(fused(x, gu, dw, logits, k, True, scales=K.ExpertScales(gs, ds, up_block, down_block)), want, dtype)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("rows", [1, 16, 64, 256])
def test_bf16_steps_replay_in_a_cuda_graph(rows):
    """Route, align and the grouped products captured once, replayed on new rows and new routing: the
    eager results, with nothing read back to the host in between."""
    dtype = torch.bfloat16
    gate_up, down = experts(128, 2048, 768, dtype)
    x = rand(rows, 2048, dtype=dtype)
    logits = rand(rows, 128, dtype=dtype, seed=4)
    run = lambda: fused(x, gate_up, down, logits, 8, True)  # noqa: E731
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for seed in (7, 8):
        x.copy_(rand(rows, 2048, dtype=dtype, seed=seed))
        logits.copy_(rand(rows, 128, dtype=dtype, seed=seed + 10))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fused(x, gate_up, down, logits, 8, True))
        assert_close(out, reference(x, gate_up, down, logits, 8, True), dtype)



@pytest.mark.gpu
@needs_cuda
def test_bf16_block_at_one_row_matches_its_reference(monkeypatch):
    """A decode row through the block at Qwen3-30B-A3B's shapes: the router's streamed product and the
    experts without alignment, against cuBLAS's router and the expert loop."""
    block = moe_block({"norm_topk_prob": True, "hidden_size": 2048, "num_experts": 128, "num_experts_per_tok": 8,
                       "moe_intermediate_size": 768}, torch.bfloat16)
    assert_block_takes_the_kernels(monkeypatch, block, (1, 1))


def test_the_moe_kernels_compile_for_the_gpu():
    """Through Triton's front end for sm_90 (`compile_for_sm90`), which type-checks what the interpreter
    does not: route, align, both grouped products (K blocks that divide
    the width and ones that do not; tiles from the table and one row's pairs; e4m3 weights with block
    scales) and the combine, in bf16 and fp32."""
    cases = []
    for dtype in ("bf16", "fp32"):
        t = f"*{dtype}"
        ints = {"Ids": "*i32", "Sorted": "*i32", "TileExpert": "*i32", "TileLo": "*i32", "TileHi": "*i32"}
        cases.append(("_moe_route", {"Logits": t, "Weights": t, "Ids": "*i32"},
                      {"TOP_K": 8, "K_BLOCK": 8, "E_BLOCK": 128, "RENORM": True}))
        cases.append(("_moe_align", ints, {"BLOCK_M": 16, "E_BLOCK": 128, "CHUNK": 8}))
        for even in (True, False):  # the one-row tiles with the ragged K blocks
            cases.append(("_moe_gate_up", {"X": t, "W": t, "Out": t, **ints},
                          {"TOP_K": 8, "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "EVEN_K": even,
                           "IEEE": dtype == "fp32", "ONE_ROW": not even}))
            cases.append(("_moe_down", {"H": t, "W": t, "RouteW": t, "Y": "*fp32", **ints},
                          {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "EVEN_K": even, "IEEE": dtype == "fp32",
                           "ONE_ROW": not even}))
            fp8 = {"WSCALE": True, "SCALE_BR": 128, "SCALE_BC": 128}  # e4m3 experts over 128 x 128 blocks
            cases.append(("_moe_gate_up", {"X": t, "W": "*fp8e4nv", "WS": "*fp32", "Out": t, **ints},
                          {"TOP_K": 8, "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "EVEN_K": even,
                           "IEEE": dtype == "fp32", "ONE_ROW": not even, **fp8}))
            cases.append(("_moe_down", {"H": t, "W": "*fp8e4nv", "WS": "*fp32", "RouteW": t, "Y": "*fp32", **ints},
                          {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "EVEN_K": even, "IEEE": dtype == "fp32",
                           "ONE_ROW": not even, **fp8}))
        cases.append(("_moe_combine", {"Y": "*fp32", "Res": t, "Out": t},
                      {"TOP_K": 8, "HAS_RES": True, "BLOCK": 1024}))
    compile_for_sm90("blockspec.kernels.moe", cases)
