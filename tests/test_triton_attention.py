"""The Triton attention kernel held to the SDPA reference: the kernel alone, the target forward, and
whole generations. Without a GPU the kernel runs in Triton's interpreter (set in conftest)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from blockspec import LLM, SamplingParams
from blockspec.models.kv_cache import range_mask
from blockspec.models.runner import ModelRunner
from blockspec.kernels import attention as triton_attention, ops as triton_ops
from blockspec.models import layers
from blockspec.models.loader import load_target
from factories import TRITON_SKIP_REASON, save_drafter_target, save_tiny, triton_interpretable

pytestmark = pytest.mark.skipif(not triton_interpretable(), reason=TRITON_SKIP_REASON)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def gpu_kernels_on_cpu(monkeypatch) -> None:
    """The CUDA inference path everywhere: norms, SwiGLU and the few-row products (with their fused
    norms and residual adds) run as Triton kernels, in the interpreter on the CPU."""
    def use_kernels(*tensors):
        return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))

    monkeypatch.setattr(triton_ops, "use_kernels", use_kernels)
    monkeypatch.setattr(layers, "use_kernels", use_kernels)


def reference(q, k_cache, v_cache, slots, lo, hi, scale, max_keys):
    """SDPA in fp32 over the gathered slots with the boolean mask of lo..hi."""
    k = k_cache[slots, :, :max_keys].float()
    v = v_cache[slots, :, :max_keys].float()
    mask = range_mask(lo, hi, torch.arange(max_keys, device=q.device))[:, None]
    out = F.scaled_dot_product_attention(q.transpose(1, 2).float(), k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    return out.transpose(1, 2)


def case(r, nq, hq, hkv, hd, length, dtype, window=None, seed=0, extent=None):
    """Rows reading at most `length` keys, from a cache of `extent` keys (default: as many)."""
    g = torch.Generator().manual_seed(seed)
    slots_total = r + 2
    k = torch.randn(slots_total, hkv, (extent or length) + 1, hd, generator=g).to(DEVICE, dtype)
    v = torch.randn(slots_total, hkv, (extent or length) + 1, hd, generator=g).to(DEVICE, dtype)
    # q as the model makes it: [R, Hq, Q, hd] seen through a transpose
    q = torch.randn(r, hq, nq, hd, generator=g).to(DEVICE, dtype).transpose(1, 2)
    slots = torch.randperm(slots_total, generator=g)[:r].to(DEVICE)
    starts = torch.randint(0, length - nq + 1, (r,), generator=g).to(DEVICE)
    hi = starts[:, None] + torch.arange(nq, device=DEVICE)[None]
    lo = (hi - window + 1).clamp(min=0) if window else torch.zeros_like(hi)
    return q, k, v, slots, lo, hi


def paged(cache, page_size, seed=0):
    """The dense [slots, H, L, hd] cache as the engine holds it: pages of `page_size` positions in a
    shuffled pool, and the table [slots, columns] that finds them."""
    s, h, length, d = cache.shape
    cols = -(-length // page_size)
    dense = torch.zeros(s, h, cols * page_size, d, dtype=cache.dtype, device=cache.device)
    dense[:, :, :length] = cache
    order = torch.randperm(s * cols, generator=torch.Generator().manual_seed(seed)).to(cache.device)
    pool = torch.empty(s * cols, h, page_size, d, dtype=cache.dtype, device=cache.device)
    pool[order] = dense.view(s, h, cols, page_size, d).transpose(1, 2).reshape(s * cols, h, page_size, d)
    return pool, order.view(s, cols).to(torch.int32)


CASES = [  # r, q, hq, hkv, hd, keys, window, page size
    (1, 1, 8, 2, 64, 300, None, 16),  # batch-1 decode: keys split over programs, then merged
    (3, 5, 4, 2, 32, 200, 17, 24),  # a sliding window, several slots, pages across the key tiles
    (2, 16, 4, 4, 16, 100, None, 64),  # verify-sized blocks, MHA
    (2, 40, 4, 1, 32, 130, None, 7),  # 160 rows per KV head: several row blocks
    (2, 3, 6, 3, 80, 90, None, 91),  # head_dim not a power of two; one page a slot
    (2, 2, 4, 2, 8, 70, None, 16),  # head_dim below tl.dot's minimum of 16
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("shape", CASES)
def test_kernel_matches_reference(shape, split, dtype, monkeypatch):
    if not split:  # one program per row block
        monkeypatch.setattr(triton_attention, "TILES", triton_attention.AttentionTiles(target_programs=1))
    r, nq, hq, hkv, hd, length, window, page_size = shape
    q, k, v, slots, lo, hi = case(r, nq, hq, hkv, hd, length, dtype, window)
    check_kernel(q, k, v, slots, lo, hi, hd**-0.5, length, dtype, split, page_size)


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("shape", CASES)
def test_every_tile_masked_computes_what_edge_masks_do(shape, split, monkeypatch):
    """`AttentionTiles.edge_masks` (the default, which the other tests run) masks only the tiles some real
    row sees in part (a causal block's last tile, a sliding window's first, a split's partial end), and
    the cases read such tiles, so a tile wrongly left unmasked shows in their output; with it off every
    tile takes the mask, as here."""
    tiles = triton_attention.AttentionTiles(edge_masks=False, target_programs=264 if split else 1)
    monkeypatch.setattr(triton_attention, "TILES", tiles)
    r, nq, hq, hkv, hd, length, window, page_size = shape
    q, k, v, slots, lo, hi = case(r, nq, hq, hkv, hd, length, torch.float32, window)
    check_kernel(q, k, v, slots, lo, hi, hd**-0.5, length, torch.float32, split, page_size)


@pytest.mark.parametrize("programs", [16, 264])
def test_decode_split_over_many_programs_looks_each_key_page_up(programs, monkeypatch):
    """Decode blocks split over many programs load each key's page (no tile's page loaded ahead):
    programs of two tiles each (16 programs aimed for) and of one (264), on shuffled pages of 64."""
    tiles = triton_attention.AttentionTiles(target_programs=programs, per_key_splits=8)
    monkeypatch.setattr(triton_attention, "TILES", tiles)
    q, k, v, slots, lo, hi = case(1, 1, 8, 2, 64, 700, torch.float32)
    hi = torch.full_like(hi, 699)  # the row reads all 700 keys
    assert min(-(-700 // tiles.block_n), programs // 2) >= tiles.per_key_splits  # the per-key path runs
    check_kernel(q, k, v, slots, lo, hi, 64**-0.5, 700, torch.float32, True)


@pytest.mark.parametrize("block_n", [32, 128])
@pytest.mark.parametrize("page_size", [16, 64])  # tiles over several pages, and pages over several tiles
@pytest.mark.parametrize("shape", [(1, 1, 8, 2, 64, 300), (2, 16, 4, 2, 32, 200)])  # decode, verify
def test_other_key_tiles_match_reference(shape, page_size, block_n, monkeypatch):
    """The key tiles `benchmarks/bench_attention.py` times beside the default (`AttentionTiles.block_n`)."""
    monkeypatch.setattr(triton_attention, "TILES", triton_attention.AttentionTiles(block_n=block_n))
    r, nq, hq, hkv, hd, length = shape
    q, k, v, slots, lo, hi = case(r, nq, hq, hkv, hd, length, torch.float32)
    check_kernel(q, k, v, slots, lo, hi, hd**-0.5, length, torch.float32, True, page_size)


@pytest.mark.parametrize("shape", [(1, 1, 8, 2, 64, 600), (1, 16, 8, 2, 32, 1200)])  # decode, verify
def test_short_context_in_a_long_cache(shape):
    """CUDA graphs launch over the whole cache; the rows' real keys (here a tenth of it) are divided
    among the splits, and the merge gathers more splits than its loop unrolls at once."""
    r, nq, hq, hkv, hd, length = shape
    q, k, v, slots, lo, hi = case(r, nq, hq, hkv, hd, length, torch.float32, extent=10 * length)
    hi = hi - hi[:, :1] + length - nq  # the last row reads all `length` keys
    check_kernel(q, k, v, slots, lo, hi, hd**-0.5, 10 * length, torch.float32, True, page_control=False)
    tiles = triton_attention.TILES
    rows = nq * hq // hkv
    wide = rows > 16
    programs = r * hkv * -(-rows // (tiles.wide_block_m if wide else 16))
    splits = min(-(-10 * length // tiles.block_n), tiles.target_programs // programs)
    key_tiles = -(-(int(hi.max()) + 1) // tiles.block_n)
    fill = max(1, tiles.one_wave // programs)
    used = max(min(fill, -(-key_tiles // (tiles.min_tiles_wide if wide else 1))),
               -(-key_tiles // (tiles.long_tiles_wide if wide else tiles.long_tiles)))
    used = min(used, splits, tiles.max_used_wide if wide else splits)
    assert splits > used > tiles.merge_unroll  # idle splits beside those merged


def check_kernel(q, k, v, slots, lo, hi, scale, max_keys, dtype, split, page_size=64, page_control=True):
    """The kernel over the cache's pages, shuffled, against SDPA over the dense cache (`page_control`:
    also show that reading the pages in pool order fails)."""
    ref = reference(q, k, v, slots, lo, hi, scale, max_keys)
    (k, table), (v, _) = paged(k, page_size), paged(v, page_size)
    out = triton_attention.block_attention(q, k, v, table, slots, lo, hi, scale, max_keys)
    r, nq, hq, hd = q.shape
    tol = 2e-5 if dtype == torch.float32 else 1e-3
    assert out.dtype == dtype and out.shape == (r, nq, hq, hd)
    assert (out.float() - ref).abs().max() <= tol
    if split:  # the merging programs leave the arrival counters at zero, so a graph replay starts clean
        assert not triton_attention._COUNTERS[q.device].any()
        again = triton_attention.block_attention(q, k, v, table, slots, lo, hi, scale, max_keys)
        assert torch.equal(again, out)
    # negative controls: one key fewer per row, or the pages read in pool order, break the tolerance
    short = triton_attention.block_attention(q, k, v, table, slots, lo, hi - 1, scale, max_keys)
    assert (short.float() - ref).abs().max() > 2 * tol
    if not page_control:
        return
    unpaged = torch.arange(table.numel(), dtype=torch.int32, device=table.device).view(table.shape)
    assert (triton_attention.block_attention(q, k, v, unpaged, slots, lo, hi, scale, max_keys).float()
            - ref).abs().max() > 2 * tol


def test_bf16_on_gpu():
    if DEVICE != "cuda":
        pytest.skip("Triton's interpreter has no bf16 matmul; the GPU runs this")
    q, k, v, slots, lo, hi = case(4, 16, 32, 8, 128, 1000, torch.bfloat16)
    ref = reference(q, k, v, slots, lo, hi, 128**-0.5, 1000)
    (k, table), (v, _) = paged(k, 16), paged(v, 16)
    out = triton_attention.block_attention(q, k, v, table, slots, lo, hi, 128**-0.5, 1000)
    assert (out.float() - ref).abs().max() <= 2e-2


@pytest.mark.parametrize("family, extra", [("qwen3", {}), ("qwen2", {"use_sliding_window": True,
                                                                     "sliding_window": 6, "max_window_layers": 2})])
def test_target_forward_matches_reference(tmp_path, family, extra, monkeypatch):
    """Prefill of three prompts of different lengths, then a decode row and a verify block each, and
    one request's decode row alone: the kernel path's hidden states equal the SDPA path's (fp32).
    The last three steps take the few-row products (one row: norms and adds fused into them)."""
    path = save_tiny(tmp_path / "m", family, seed=3, **extra)
    runs = {}
    for backend in ("sdpa", "triton"):
        if backend == "triton":
            gpu_kernels_on_cpu(monkeypatch)
        model, _ = load_target(path, "float32", torch.device(DEVICE), max_positions=128)
        model.attention_backend = backend
        runner = ModelRunner(model, 4, 64, taps=(0, 2), use_cuda_graphs=False)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(2, 90, (n,), generator=g).tolist() for n in (9, 3, 14)]
        slots = [2, 0, 3]
        out = [runner.forward(prompts, [0, 0, 0], slots, with_taps=True)]
        lens = [len(p) for p in prompts]
        out.append(runner.forward([[5], [6], [7]], lens, slots, with_taps=True))
        out.append(runner.forward([[5, 8, 9, 10], [11], [12, 13]], [n + 1 for n in lens], slots, with_taps=True))
        out.append(runner.forward([[14]], [lens[0] + 5], slots[:1], with_taps=True))
        runs[backend] = out
    for (h_ref, f_ref), (h, f) in zip(runs["sdpa"], runs["triton"]):
        assert (h - h_ref).abs().max() <= 1e-4 and (f - f_ref).abs().max() <= 1e-4


@pytest.mark.parametrize("dtype, norm_kernels", [("float16", 2), ("float32", 1)])
def test_few_row_layers_take_norm_statistics_from_the_product_before(tmp_path, monkeypatch, dtype, norm_kernels):
    """Above one row in half precision each decoder layer's two norms come from the product that wrote
    the residual stream before them: a verify block runs the norm kernel only for the first layer's
    pre-norm and the final norm (a layer count of its own per layer would be 2 per layer + 1). In
    float32, whose rows stream one by one, every pre-norm is in its product's prologue, as at one
    row: only the final norm is a kernel of its own."""
    path = save_tiny(tmp_path / "m", "qwen3", seed=3)
    gpu_kernels_on_cpu(monkeypatch)
    model, _ = load_target(path, dtype, torch.device(DEVICE), max_positions=128)
    model.attention_backend = "triton"
    assert len(model.layers) >= 2
    runner = ModelRunner(model, 2, 64, use_cuda_graphs=False)
    runner.forward([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]], [0], [0])  # 17 rows: cuBLAS
    calls = []
    real = triton_ops.rms_norm
    monkeypatch.setattr(triton_ops, "rms_norm", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    runner.forward([[22, 23, 24, 25]], [17], [0])
    assert len(calls) == norm_kernels


def test_generation_matches_reference(tmp_path, monkeypatch):
    """Greedy output with the kernels equals the SDPA path's, plain and with a DFlash drafter."""
    from pathlib import Path

    target = save_drafter_target(tmp_path / "t")
    spec = {"method": "dflash", "model": str(Path(__file__).parent / "fixtures" / "drafters" / "dflash")}
    prompts = [{"prompt_token_ids": list(range(2, 2 + n))} for n in (3, 20, 11)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = {}
    for backend, speculative in (("sdpa", None), ("triton", None), ("triton", spec)):
        if backend == "triton":
            gpu_kernels_on_cpu(monkeypatch)
        llm = LLM(str(target), device=DEVICE, dtype="float32", max_model_len=128, speculative_config=speculative,
                  attention_backend=backend)
        assert llm.engine.attention_backend == backend
        outs[backend, speculative is None] = [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                                              use_tqdm=False)]
    assert outs["sdpa", True] == outs["triton", True] == outs["triton", False]
