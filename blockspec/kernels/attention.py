"""Attention of a block of query rows over a slot of the paged KV cache, as one Triton kernel.

Every engine attention is "query rows of request r attend to keys lo[r, i]..hi[r, i] of cache slot
slots[r]" (its pages found through the page table): decode and verify (hi = the row's own
position), the drafter's non-causal block (hi = the block's last position) and sliding windows
(lo > 0). The kernel reads keys in place from the
cache, so nothing is gathered, repeated per query head or masked with a materialised tensor; the
query heads that share a KV head are processed together, so each key is loaded once per step.
When a batch has too few (request, KV head) pairs to fill the GPU (batch-1 decode), or a row block's
keys are many, the key range is split over programs (flash-decoding): each stores its partial
softmax, and the last split of a row block to finish merges them, in the same kernel (one launch
per layer, not two). A split costs that merge, so a full GPU splits only long key ranges. The grid is
fixed by the cache's extent (CUDA graphs capture the whole cache once), but each row block divides
the keys it actually reads among its splits, so a 512-token context in a 32K cache still spreads
over the splits rather than landing in the first.

`scaled_dot_product_attention` over the gathered keys with a boolean mask stays the reference
(CPU, training); tests hold this kernel to it, on the CPU through Triton's interpreter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from blockspec.config import ConfigError

from blockspec.kernels import check_head_scales, dependent_launch, interpreted, triton, triton_available

if triton is not None:
    import triton.language as tl

    from triton.language.extra.cuda import gdc_wait


def resolve_backend(requested: str, device: torch.device) -> str:
    """`auto` takes the kernel on CUDA when Triton is installed, else the SDPA reference."""
    if requested == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "sdpa"
    if requested == "triton" and not triton_available():
        raise ConfigError("attention_backend='triton' needs the triton package (pip install triton)")
    return requested


if triton is not None:

    @triton.jit
    def _tile_pages(pages, start, end, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, PER_KEY: tl.constexpr):
        """The page of the key tile at `start` (tiles start at multiples of BLOCK_N, so a tile lies in
        one page when PAGE is a multiple of BLOCK_N: one load), else (or with PER_KEY) the page of
        each of its keys."""
        if PAGE % BLOCK_N == 0 and not PER_KEY:
            page = tl.load(pages + start // PAGE, mask=start < end, other=0).to(tl.int64)
        else:
            n = start + tl.arange(0, BLOCK_N)
            page = tl.load(pages + n // PAGE, mask=n < end, other=0).to(tl.int64)
        return page

    @triton.jit
    def _masked_scores(s, n, n_ok, lo, hi):
        """Scores of the keys n a row does not see (outside its lo..hi, or past the split) at -inf."""
        visible = (n[None, :] >= lo[:, None]) & (n[None, :] <= hi[:, None]) & n_ok[None, :]
        return tl.where(visible, s, float("-inf"))

    # Arguments that follow a request's shape are not specialised on (Triton would compile a variant
    # for 1, for multiples of 16 and for the rest): a new prompt length never compiles mid-request.
    @triton.jit(do_not_specialize=["stride_br", "num_queries", "fill"])
    def _block_attention(
        Q, K, V, Table, Slots, Lo, Hi, Out, PartAcc, PartMax, PartSum, Counters, KScale, VScale,
        stride_qr, stride_qq, stride_qh,
        stride_kp, stride_kh, stride_kl,
        stride_vp, stride_vh, stride_vl,
        stride_t, stride_br,
        stride_or, stride_oq, stride_oh,
        num_queries, scale_log2, v_scale, fill,
        KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MIN_TILES: tl.constexpr, LONG_TILES: tl.constexpr,
        MAX_USED: tl.constexpr,
        MERGE_UNROLL: tl.constexpr, IEEE: tl.constexpr, PAGE: tl.constexpr, PER_KEY: tl.constexpr,
        SPLIT: tl.constexpr = True, F16_DOTS: tl.constexpr = False, V_STAGED: tl.constexpr = False,
        EDGE_MASKS: tl.constexpr = False, HEAD_SCALES: tl.constexpr = False, PDL: tl.constexpr = False,
    ):
        """One program: BLOCK_M (query row, head-in-group) pairs of one (request, KV head), over one
        split of the key tiles those rows read. Online softmax in fp32 (base 2). Keys and values of
        an FP8 cache are converted as they load (exact) to q's dtype, or with F16_DOTS to fp16, q
        and the probabilities too; K's scale is in scale_log2, V's (v_scale) multiplies the output;
        with HEAD_SCALES each KV head's (KScale, VScale [KV_HEADS] fp32) multiply them in as well.
        V_STAGED (fp16 dots): V converted where it is loaded and transposed for the P.V product in fp16
        (ldmatrix), behind an opaque copy: without it the compiler converts after transposing the 8-bit
        tile, which it reads from shared memory a byte at a time. EDGE_MASKS: only the tiles that some
        real row sees in part are masked (a uniform branch a tile): the mask's three compares and
        selects a score are a third of an FP8 verify tile's instructions."""
        if PDL:
            gdc_wait()
        pid_rh = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_s = tl.program_id(2)
        r = pid_rh // KV_HEADS
        kvh = pid_rh % KV_HEADS
        if HEAD_SCALES:
            scale_log2 = scale_log2 * tl.load(KScale + kvh)
            v_scale = v_scale * tl.load(VScale + kvh)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        qi = rows // GROUP
        head = kvh * GROUP + rows % GROUP
        row_ok = qi < num_queries
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        q = tl.load(Q + r * stride_qr + qi[:, None] * stride_qq + head[:, None] * stride_qh + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if F16_DOTS:  # saturated: a bf16 q beyond fp16's range would otherwise turn into inf
            q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
        lo = tl.load(Lo + r * stride_br + qi, mask=row_ok, other=2147483647)
        hi = tl.load(Hi + r * stride_br + qi, mask=row_ok, other=-1)
        slot = tl.load(Slots + r)
        # The row block's key tiles, divided evenly among the splits that hold keys (every split of
        # the block computes the same division from the same rows): as many as fill one wave of the
        # GPU (`fill` splits a row block) at MIN_TILES or more a split, more where a split would hold
        # over LONG_TILES, at most MAX_USED (one program merges their partials in turn) and the grid's.
        n_splits = tl.num_programs(2)
        last = tl.max(hi, 0) + 1
        first_tile = tl.min(lo, 0) // BLOCK_N
        tiles = tl.maximum(tl.cdiv(last, BLOCK_N) - first_tile, 0)
        used = 1
        per = tiles
        if SPLIT:  # (a grid of one split compiles without the division and the merge)
            used = tl.maximum(tl.minimum(fill, tl.cdiv(tiles, MIN_TILES)), tl.cdiv(tiles, LONG_TILES))
            used = tl.maximum(tl.minimum(used, tl.minimum(n_splits, MAX_USED)), 1)
            per = tl.maximum(tl.cdiv(tiles, used), 1)
            used = tl.maximum(tl.cdiv(tiles, per), 1)  # the splits past them hold no keys and take no part
        first = (first_tile + pid_s * per) * BLOCK_N
        end = tl.minimum(first + per * BLOCK_N, last)
        pages = Table + slot.to(tl.int64) * stride_t  # the slot's page of each PAGE positions
        k_base = K + kvh * stride_kh
        v_base = V + kvh * stride_vh
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        lo_all = tl.max(tl.where(row_ok, lo, 0), 0)  # keys lo_all..hi_all are visible to every real row
        hi_all = tl.min(tl.where(row_ok, hi, 2147483647), 0)
        page = _tile_pages(pages, first, end, PAGE, BLOCK_N, PER_KEY)
        for start in range(first, end, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            n_ok = n < end
            if PER_KEY:  # a program of a tile or two: nothing to load ahead of
                tile_page = _tile_pages(pages, start, end, PAGE, BLOCK_N, PER_KEY)
            else:  # the next tile's pages are loaded a tile ahead, so its keys need not wait for them
                tile_page = page
                page = _tile_pages(pages, start + BLOCK_N, end, PAGE, BLOCK_N, PER_KEY)
            at = n % PAGE
            k = tl.load(k_base + (tile_page * stride_kp + at * stride_kl)[:, None] + d[None, :],
                        mask=n_ok[:, None] & d_ok[None, :], other=0.0).to(q.dtype)
            if IEEE:  # fp32 models: exact fp32 products, not TF32
                s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2
            else:
                s = tl.dot(q, tl.trans(k)) * scale_log2
            if EDGE_MASKS:  # a tile every real row sees whole (n <= hi implies n < end) takes no mask
                if (start < lo_all) | (start + BLOCK_N - 1 > hi_all):
                    s = _masked_scores(s, n, n_ok, lo, hi)
            else:
                s = _masked_scores(s, n, n_ok, lo, hi)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            base = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
            alpha = tl.exp2(m_i - base)
            p = tl.exp2(s - base[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + (tile_page * stride_vp + at * stride_vl)[:, None] + d[None, :],
                        mask=n_ok[:, None] & d_ok[None, :], other=0.0).to(q.dtype)
            if V_STAGED:
                v = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [v], dtype=tl.float16, is_pure=False,
                                              pack=2)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        write = pid_s == 0  # the row block's keys in one split: its output, no partials
        if SPLIT:
            if used > 1:
                write = pid_s < 0  # (False, as a tensor: the merging split sets it)
                if pid_s < used:
                    # Store this split's partial softmax; the last split of the row block to arrive
                    # merges them all (its acquiring ticket makes every other split's stores visible).
                    rows_per_head = tl.num_programs(1) * BLOCK_M
                    part = (pid_rh * n_splits + pid_s) * rows_per_head + rows
                    tl.store(PartMax + part, m_i, mask=row_ok)  # only the block's real rows: less to merge
                    tl.store(PartSum + part, l_i, mask=row_ok)
                    tl.store(PartAcc + part[:, None] * BLOCK_D + d[None, :], acc, mask=row_ok[:, None])
                    counter = Counters + pid_rh * tl.num_programs(1) + pid_m
                    ticket = tl.atomic_add(counter, 1, sem="acq_rel")
                    if ticket == used - 1:
                        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
                        l_i = tl.zeros([BLOCK_M], tl.float32)
                        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
                        # iterations unrolled so the loads of several splits are in flight at once
                        for split in tl.range(0, used, loop_unroll_factor=MERGE_UNROLL):
                            part = (pid_rh * n_splits + split) * rows_per_head + rows
                            m_s = tl.load(PartMax + part, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
                            m_new = tl.maximum(m_i, m_s)
                            base = tl.where(m_new == float("-inf"), 0.0, m_new)
                            alpha = tl.exp2(m_i - base)
                            beta = tl.exp2(m_s - base)
                            l_i = l_i * alpha + tl.load(PartSum + part, mask=row_ok, other=0.0,
                                                        cache_modifier=".cg") * beta
                            acc = acc * alpha[:, None] + tl.load(PartAcc + part[:, None] * BLOCK_D + d[None, :],
                                                                 mask=row_ok[:, None], other=0.0,
                                                                 cache_modifier=".cg") * beta[:, None]
                            m_i = m_new
                        tl.atomic_xchg(counter, 0)  # ready for the next launch (and the next graph replay)
                        write = pid_s >= 0  # True
        if write:
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None] * v_scale
            tl.store(Out + r * stride_or + qi[:, None] * stride_oq + head[:, None] * stride_oh + d[None, :],
                     out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


_COUNTERS: dict[torch.device, Tensor] = {}
_RETIRED: list[Tensor] = []


def split_counters(n: int, device: torch.device) -> Tensor:
    """Arrival counters of split row blocks, zero between launches (the merging program resets its
    own). One buffer per device, grown outside any graph capture: `capture` runs a call before
    capturing it, and the engine's launches share one stream, so no two launches use it at once."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        if buf is not None:  # graphs captured earlier keep its address: it must never be freed
            _RETIRED.append(buf)
        buf = _COUNTERS[device] = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    return buf


@dataclass(frozen=True)
class AttentionTiles:
    """Launch shape of `block_attention`: key tile; the programs the grid holds (about two waves of an
    H100/H200's 132 SMs) and how many splits of a row block hold keys: enough to fill one wave with
    at least `min_tiles` key tiles a split (1 for decode blocks, `min_tiles_wide` for wide ones),
    more where a split would hold over `long_tiles` (`long_tiles_wide`), at most the grid's and, for
    wide blocks, `max_used_wide` (one program merges the splits in turn, and a wide block's partials
    are four times a decode block's; a split costs a merge, which pays only where the GPU would
    idle or a split is long); the row block of wide blocks (verify, draft, prefill; decode takes 16
    when a KV head serves <= 16 query heads); the merge loop's unrolling; and the fewest splits of a
    decode grid at which each key looks its page up (a vector load) instead of its tile's page being
    loaded a tile ahead: per-key lookups pay where each split holds a tile or two (batch-1 decode)
    and cost where splits hold more (`benchmarks/bench_attention.py` measures both)."""

    block_n: int = 64
    fp8_block_n: int = 128  # an e4m3 tile of 128 keys moves a bf16 tile's bytes
    fp8_v_staged: bool = True  # `_block_attention`'s V_STAGED: FP8 V transposed in fp16, not byte by byte
    edge_masks: bool = True  # `_block_attention`'s EDGE_MASKS: tiles every row sees whole take no mask
    target_programs: int = 264
    one_wave: int = 132
    wide_block_m: int = 64
    min_tiles_wide: int = 4
    long_tiles: int = 8
    long_tiles_wide: int = 32
    max_used_wide: int = 8
    merge_unroll: int = 4
    per_key_splits: int = 32
    num_warps: int = 4
    num_stages: int = 3  # key tiles in flight (Triton's software pipeline)


TILES = AttentionTiles()


def block_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, table: Tensor, slots: Tensor, lo: Tensor,
                    hi: Tensor, scale: float, max_keys: int, tiles: AttentionTiles | None = None,
                    k_scale: float | Tensor = 1.0, v_scale: float | Tensor = 1.0) -> Tensor:
    """q [R, Q, Hq, hd] (any strides with unit last stride); k/v_cache [pages, Hkv, page_size, hd];
    table [S, columns] int32: the page holding each page_size positions of a slot (see
    `PageTable`); slots [R]; lo/hi [R, Q]: the first and last key position each query row attends to
    (inclusive; every key index < max_keys). Returns [R, Q, Hq, hd] in q's dtype.

    Shapes and `max_keys` fix the launch grid, so the call is CUDA-graph capturable. Caches in
    float8_e4m3fn hold K / k_scale and V / v_scale (`kv_cache.quantize_kv`; floats, or [Hkv] fp32 tensors
    of one scale per KV head, both one way or both the other); with 16-bit queries
    their dots run in fp16: e4m3 converts to fp16 in one instruction per pair of values, to bf16
    through a further slow conversion per value, which made an FP8 decode no faster than a bf16
    one (benchmarks/bench_attention.py --kv-dtype fp8)."""
    t = tiles or TILES
    r, nq, hq, hd = q.shape
    hkv = k_cache.shape[1]
    group = hq // hkv
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("block_attention: the head dimension must be contiguous")
    head_scales = check_head_scales(k_scale, v_scale, hkv, "block_attention")
    lo = lo.to(torch.int32).contiguous()
    hi = hi.to(torch.int32).contiguous()
    out = torch.empty(r, nq, hq, hd, dtype=q.dtype, device=q.device)
    rows = nq * group
    # Two row-block sizes and the split count decided here: every shape after start-up reuses a
    # variant the engine's warm-up compiled, so no request waits for a compilation.
    # fp32 takes 16-row blocks at any width: its exact ("ieee") dots are multiply-adds, which cost the
    # block's rows times its keys, so a wide block's padding is paid in full
    ieee = q.dtype == torch.float32
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    block_n = t.fp8_block_n if fp8 else t.block_n
    block_m = 16 if rows <= 16 or ieee else t.wide_block_m
    m_blocks = triton.cdiv(rows, block_m)
    programs = r * hkv * m_blocks
    splits = max(1, min(triton.cdiv(max_keys, block_n), t.target_programs // programs))
    block_d = max(16, triton.next_power_of_2(hd))  # tl.dot needs K >= 16
    n_part = r * hkv * splits * m_blocks * block_m if splits > 1 else 1  # unsplit: unused placeholders
    part_acc = torch.empty(n_part, block_d, dtype=torch.float32, device=q.device)
    part_max = torch.empty(n_part, dtype=torch.float32, device=q.device)
    part_sum = torch.empty(n_part, dtype=torch.float32, device=q.device)
    counters = split_counters(r * hkv * m_blocks, q.device)
    consts = dict(KV_HEADS=hkv, GROUP=group, HEAD_DIM=hd, BLOCK_D=block_d)
    _block_attention[(r * hkv, m_blocks, splits)](
        q, k_cache, v_cache, table, slots, lo, hi, out, part_acc, part_max, part_sum, counters,
        k_scale if head_scales else part_max, v_scale if head_scales else part_max,  # (placeholders: unread)
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        table.stride(0), lo.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        nq, scale * math.log2(math.e) * (1.0 if head_scales else k_scale), 1.0 if head_scales else v_scale,
        max(1, t.one_wave // programs),
        # decode blocks: no floor and no cap (splits <= target_programs), and fixed constants, so a
        # new split count never compiles a variant
        BLOCK_M=block_m, BLOCK_N=block_n, MIN_TILES=1 if block_m == 16 else t.min_tiles_wide,
        LONG_TILES=t.long_tiles if block_m == 16 else t.long_tiles_wide,
        MAX_USED=t.target_programs if block_m == 16 else t.max_used_wide,
        MERGE_UNROLL=t.merge_unroll, IEEE=ieee, PAGE=k_cache.shape[2],
        PER_KEY=block_m == 16 and splits >= t.per_key_splits,
        SPLIT=splits > 1, F16_DOTS=fp8 and not ieee, V_STAGED=fp8 and not ieee and t.fp8_v_staged and not interpreted(),
        EDGE_MASKS=t.edge_masks, HEAD_SCALES=head_scales,
        num_warps=t.num_warps, num_stages=t.num_stages, **consts, **dependent_launch(q),
    )
    return out
