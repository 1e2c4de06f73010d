"""The mixture-of-experts MLP as Triton kernels: route, group the (row, expert) pairs by expert, one
grouped product per projection that reads each selected expert's weights once, and the weighted sum.

A step of M rows routes each to k experts: P = M * k pairs, pair p = (row p // k, slot p % k).

- `route`: softmax over the router logits in fp32, top-k, optional renormalisation (one program a row).
  At one row the router's product before it streams through `ops.skinny_linear` (`ROUTER_TILE`).
- `align`: the pairs sorted by expert (within an expert by pair index) and a table of tiles, each a
  run of at most BLOCK_M sorted pairs of one expert. With M <= BLOCK_M (decode, verify, draft: up to
  MOE_FEW_ROWS rows) an expert never has more pairs than rows, so it gets one tile and its weights are
  streamed once per step. Small steps align in one Triton program; large ones (prefill) by a stable
  torch sort (`align_torch`, also the Triton version's oracle). A single row needs no alignment: its
  k experts are distinct, so each pair is a tile (`ONE_ROW`).
- `fused_experts`: gate_up over the tiles with SwiGLU in the epilogue, into a buffer in sorted order;
  down over the same tiles, each pair's output times its router weight; then per row the sum of its
  k pair outputs in fp32, rounded once (plus the residual, where given).

The grids are fixed by M, E and k alone: tiles past the ones a step needs find expert -1 in the table
and do nothing, so a step is capturable in a CUDA graph (no host sync, no shape that depends on the
routing). The reference (a loop over the selected experts) is `models.moe.experts_reference`, with
`models.moe.route`; tests hold these kernels to them, on the CPU through Triton's interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from blockspec.kernels import dependent_launch, triton
from blockspec.kernels.ops import SkinnyConfig

if triton is not None:
    import triton.language as tl

    from blockspec.kernels.ops import dependent_start

    @triton.jit
    def _moe_route(Logits, Weights, Ids, stride_l, n_experts, TOP_K: tl.constexpr, K_BLOCK: tl.constexpr,
                   E_BLOCK: tl.constexpr, RENORM: tl.constexpr, PDL: tl.constexpr = False):
        """One row: softmax of its logits in fp32, the TOP_K largest (best first; ties to the lower id),
        renormalised to sum to 1 with RENORM."""
        dependent_start(PDL)
        row = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, E_BLOCK)
        ok = e < n_experts
        z = tl.load(Logits + row * stride_l + e, mask=ok, other=float("-inf")).to(tl.float32)
        z = tl.exp(z - tl.max(z, 0))
        p = tl.where(ok, z / tl.sum(z, 0), -1.0)
        j = tl.arange(0, K_BLOCK)
        vals = tl.zeros([K_BLOCK], tl.float32)
        idx = tl.zeros([K_BLOCK], tl.int32)
        for i in tl.static_range(TOP_K):
            best = tl.max(p, 0)
            at = tl.min(tl.where(p == best, e, E_BLOCK), 0)
            vals = tl.where(j == i, best, vals)
            idx = tl.where(j == i, at, idx)
            p = tl.where(e == at, -2.0, p)
        if RENORM:
            vals = vals / tl.sum(vals, 0)
        tl.store(Weights + row * TOP_K + j, vals.to(Weights.dtype.element_ty), mask=j < TOP_K)
        tl.store(Ids + row * TOP_K + j, idx, mask=j < TOP_K)

    @triton.jit(do_not_specialize=["n_pairs", "n_tiles"])
    def _moe_align(Ids, Sorted, TileExpert, TileLo, TileHi, n_pairs, n_experts, n_tiles,
                   BLOCK_M: tl.constexpr, E_BLOCK: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr = False):
        """One program: count the pairs of each expert, lay out the tiles (expert, first and end
        sorted position; expert -1 past the last), then place each pair at its expert's next slot
        (a counting sort: each chunk's pairs ranked among the chunk's earlier pairs of their expert)."""
        dependent_start(PDL)
        e = tl.arange(0, E_BLOCK)
        q = tl.arange(0, CHUNK)
        counts = tl.zeros([E_BLOCK], tl.int32)
        for c0 in range(0, n_pairs, CHUNK):
            ids = tl.load(Ids + c0 + q, mask=c0 + q < n_pairs, other=-1)
            counts += tl.sum((ids[:, None] == e[None, :]).to(tl.int32), 0)
        tiles = (counts + BLOCK_M - 1) // BLOCK_M
        tile_end = tl.cumsum(tiles, 0)
        tile_begin = tile_end - tiles
        pair_end = tl.cumsum(counts, 0)
        pair_begin = pair_end - counts
        for t0 in range(0, n_tiles, CHUNK):
            t = t0 + q
            owner = tl.sum((tile_end[None, :] <= t[:, None]).to(tl.int32), 1)  # experts whose tiles end before t
            mine = e[None, :] == owner[:, None]
            lo = tl.sum(tl.where(mine, pair_begin[None, :], 0), 1) + \
                (t - tl.sum(tl.where(mine, tile_begin[None, :], 0), 1)) * BLOCK_M
            hi = tl.minimum(lo + BLOCK_M, tl.sum(tl.where(mine, pair_end[None, :], 0), 1))
            ok = t < n_tiles
            tl.store(TileExpert + t, tl.where(owner < n_experts, owner, -1), mask=ok)
            tl.store(TileLo + t, lo, mask=ok)
            tl.store(TileHi + t, hi, mask=ok)
        running = pair_begin
        for c0 in range(0, n_pairs, CHUNK):
            p = c0 + q
            ok = p < n_pairs
            ids = tl.load(Ids + p, mask=ok, other=-1)
            onehot = ids[:, None] == e[None, :]
            base = tl.sum(tl.where(onehot, running[None, :], 0), 1)
            rank = tl.sum(((ids[None, :] == ids[:, None]) & (q[None, :] < q[:, None])).to(tl.int32), 1)
            tl.store(Sorted + base + rank, p, mask=ok)
            running += tl.sum(onehot.to(tl.int32), 0)

    @triton.jit
    def _mma(acc, a, b, IEEE: tl.constexpr):
        """acc + a @ b^T; fp32 models without tf32 rounding of the inputs."""
        if IEEE:
            return tl.dot(a, tl.trans(b), acc, input_precision="ieee")
        return tl.dot(a, tl.trans(b), acc)

    @triton.jit
    def _expert_mma(acc, a, w, S, stride_sn, rows, r_ok, k0, SCALE_BR: tl.constexpr, SCALE_BC: tl.constexpr,
                    IEEE: tl.constexpr, WSCALE: tl.constexpr):
        """acc + a @ w^T for the weight rows `rows`. WSCALE: w is an e4m3 tile within the K block k0 //
        SCALE_BC (BLOCK_K divides the scale blocks' width), converted to a's dtype (exact); its product
        is times each row's scale of that block (S: the expert's [rows / SCALE_BR, K / SCALE_BC] scales)."""
        if WSCALE:
            s = tl.load(S + (rows // SCALE_BR).to(tl.int64) * stride_sn + k0 // SCALE_BC, mask=r_ok, other=0.0)
            acc = acc + _mma(tl.zeros_like(acc), a, w.to(tl.float32).to(a.dtype), IEEE) * s[None, :]
        else:
            acc = _mma(acc, a, w, IEEE)
        return acc

    @triton.jit
    def _tile_rows(TileLo, TileHi, t, BLOCK_M: tl.constexpr, ONE_ROW: tl.constexpr):
        """Tile t's sorted positions (BLOCK_M from its first) and which of them it holds. ONE_ROW: the
        pairs of a single row, whose experts are distinct, each its own tile in pair order (no table)."""
        if ONE_ROW:
            m = t + tl.arange(0, BLOCK_M)
            m_ok = tl.arange(0, BLOCK_M) < 1
        else:
            m = tl.load(TileLo + t) + tl.arange(0, BLOCK_M)
            m_ok = m < tl.load(TileHi + t)
        return m, m_ok

    @triton.jit
    def _tile_pairs(Sorted, m, m_ok, ONE_ROW: tl.constexpr):
        """The pair indices at sorted positions m (with ONE_ROW the positions are the pairs)."""
        if ONE_ROW:
            pair = m
        else:
            pair = tl.load(Sorted + m, mask=m_ok, other=0)
        return pair

    @triton.jit
    def _k_masks(m_ok, c_ok, kk, k, EVEN_K: tl.constexpr):
        """The row and weight masks of the K block kk: the tile's rows and columns, and K's end unless
        the blocks divide it."""
        a_ok = m_ok[:, None]
        w_ok = c_ok[:, None]
        if not EVEN_K:
            a_ok = a_ok & (kk < k)[None, :]
            w_ok = w_ok & (kk < k)[None, :]
        return a_ok, w_ok

    @triton.jit
    def _moe_gate_up(X, W, WS, Sorted, TileExpert, TileLo, TileHi, Out, stride_x, stride_we, stride_wn, stride_o,
                     stride_se, stride_sn, inter, hidden, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
                     ONE_ROW: tl.constexpr, WSCALE: tl.constexpr = False, SCALE_BR: tl.constexpr = 1,
                     SCALE_BC: tl.constexpr = 1, PDL: tl.constexpr = False):
        """Tile t, columns block n: silu(x W_gate^T) * (x W_up^T) for the tile's pairs' rows x, into
        Out at their sorted positions; each product rounded as a linear layer rounds, SwiGLU as the
        silu_mul kernel rounds. WSCALE: W is e4m3 with scales WS over (SCALE_BR x SCALE_BC) blocks
        (`_expert_mma`)."""
        dependent_start(PDL)
        t = tl.program_id(0)
        expert = tl.load(TileExpert + t)
        if expert >= 0:
            m, m_ok = _tile_rows(TileLo, TileHi, t, BLOCK_M, ONE_ROW)
            row = (_tile_pairs(Sorted, m, m_ok, ONE_ROW) // TOP_K).to(tl.int64)
            cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            c_ok = cols < inter
            offs = tl.arange(0, BLOCK_K)
            x_rows = X + row[:, None] * stride_x
            w_gate = W + expert.to(tl.int64) * stride_we + cols.to(tl.int64)[:, None] * stride_wn
            w_up = w_gate + inter * stride_wn
            scales = WS + expert.to(tl.int64) * stride_se
            acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for k0 in range(0, hidden, BLOCK_K):
                kk = k0 + offs
                x_ok, w_ok = _k_masks(m_ok, c_ok, kk, hidden, EVEN_K)
                xv = tl.load(x_rows + kk[None, :], mask=x_ok, other=0.0)
                acc_g = _expert_mma(acc_g, xv, tl.load(w_gate + kk[None, :], mask=w_ok, other=0.0), scales,
                                    stride_sn, cols, c_ok, k0, SCALE_BR, SCALE_BC, IEEE, WSCALE)
                acc_u = _expert_mma(acc_u, xv, tl.load(w_up + kk[None, :], mask=w_ok, other=0.0), scales,
                                    stride_sn, cols + inter, c_ok, k0, SCALE_BR, SCALE_BC, IEEE, WSCALE)
            dtype = Out.dtype.element_ty
            gate = acc_g.to(dtype).to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
            y = (act * acc_u.to(dtype).to(tl.float32)).to(dtype)
            tl.store(Out + m.to(tl.int64)[:, None] * stride_o + cols[None, :], y, mask=m_ok[:, None] & c_ok[None, :])

    @triton.jit
    def _moe_down(H, W, WS, Sorted, TileExpert, TileLo, TileHi, RouteW, Y, stride_h, stride_we, stride_wn, stride_y,
                  stride_se, stride_sn, hidden, inter, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr, ONE_ROW: tl.constexpr,
                  WSCALE: tl.constexpr = False, SCALE_BR: tl.constexpr = 1, SCALE_BC: tl.constexpr = 1,
                  PDL: tl.constexpr = False):
        """Tile t, columns block n: each pair's SwiGLU row (sorted position) times the expert's down
        projection, rounded to the model dtype, times the pair's router weight, into Y (fp32) at the
        pair's own index. WSCALE as in `_moe_gate_up`."""
        dependent_start(PDL)
        t = tl.program_id(0)
        expert = tl.load(TileExpert + t)
        if expert >= 0:
            m, m_ok = _tile_rows(TileLo, TileHi, t, BLOCK_M, ONE_ROW)
            pair = _tile_pairs(Sorted, m, m_ok, ONE_ROW).to(tl.int64)
            cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            c_ok = cols < hidden
            offs = tl.arange(0, BLOCK_K)
            h_rows = H + m.to(tl.int64)[:, None] * stride_h
            w_rows = W + expert.to(tl.int64) * stride_we + cols.to(tl.int64)[:, None] * stride_wn
            scales = WS + expert.to(tl.int64) * stride_se
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for k0 in range(0, inter, BLOCK_K):
                kk = k0 + offs
                h_ok, w_ok = _k_masks(m_ok, c_ok, kk, inter, EVEN_K)
                acc = _expert_mma(acc, tl.load(h_rows + kk[None, :], mask=h_ok, other=0.0),
                                  tl.load(w_rows + kk[None, :], mask=w_ok, other=0.0), scales, stride_sn, cols, c_ok,
                                  k0, SCALE_BR, SCALE_BC, IEEE, WSCALE)
            weight = tl.load(RouteW + pair, mask=m_ok, other=0.0).to(tl.float32)
            y = acc.to(H.dtype.element_ty).to(tl.float32) * weight[:, None]
            tl.store(Y + pair[:, None] * stride_y + cols[None, :], y, mask=m_ok[:, None] & c_ok[None, :])

    @triton.jit
    def _moe_combine(Y, Res, Out, stride_y, stride_r, stride_o, hidden, TOP_K: tl.constexpr, HAS_RES: tl.constexpr,
                     BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        """Row m: the sum of its TOP_K pair outputs in fp32, rounded once; plus the residual (rounded as
        x + residual rounds)."""
        dependent_start(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < hidden
        acc = tl.zeros([BLOCK], tl.float32)
        for j in tl.static_range(TOP_K):
            acc += tl.load(Y + (row * TOP_K + j) * stride_y + cols, mask=ok, other=0.0)
        y = acc.to(Out.dtype.element_ty)
        if HAS_RES:
            y = (y.to(tl.float32) + tl.load(Res + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32))
            y = y.to(Out.dtype.element_ty)
        tl.store(Out + row * stride_o + cols, y, mask=ok)


ROUTER_TILE = SkinnyConfig(1, 4, 2048, 8, 1)
"""The router's product at one row ([E, H] with E of 64-256 experts) through `ops.skinny_linear`: so
narrow a weight needs few columns a program for its stream to cover the GPU (benchmarks/bench_moe.py
--router-sweep on an H200: 2.7 us, against 5.0 us for cuBLAS's product)."""

MOE_FEW_ROWS = 64
"""Up to this many rows a step gives each expert one tile (BLOCK_M >= rows), so each selected expert's
weights are streamed once: decode, verify and draft steps. Above it tiles hold 64 pairs (prefill)."""

ALIGN_IN_ONE_PROGRAM = 1024
"""Up to this many pairs the alignment is the one-program Triton kernel (one launch); above it the
torch sort, whose launches cost less than one program looping over the pairs."""


@dataclass(frozen=True)
class MoeConfig:
    block_m: int  # pairs per tile (a tensor-core dot needs >= 16)
    block_n_up: int  # gate columns per gate_up program (it streams as many up columns)
    block_n_down: int  # output columns per down program
    block_k: int
    num_warps: int
    num_stages: int


def moe_config(rows: int, itemsize: int = 2) -> MoeConfig:
    """Tiles for `fused_experts`: one tile per expert up to MOE_FEW_ROWS rows, narrow column blocks so
    a step of few experts still spreads its weight stream over the GPU; wider elements take shorter K
    tiles, so the pipeline's buffers fit in shared memory. At one row these are the best of
    benchmarks/bench_moe.py's sweep on an H200 (29.4 us a layer, its 8 tiles 29.4-35.7 us); at 4-64
    rows they are first guesses the sweep has not yet replaced."""
    if rows <= MOE_FEW_ROWS:
        cfg = MoeConfig(max(16, triton.next_power_of_2(rows)), 32, 64, 128, 4, 3)
    else:  # the same K tiles: a row's sums run in the same order at every row count
        cfg = MoeConfig(64, 64, 64, 128, 4, 3)
    return MoeConfig(cfg.block_m, cfg.block_n_up, cfg.block_n_down, max(32, cfg.block_k * 2 // itemsize),
                     cfg.num_warps, cfg.num_stages)


def num_tiles(rows: int, top_k: int, num_experts: int, block_m: int) -> int:
    """The static tile count: one per selected expert when no expert can exceed a tile (block_m >=
    rows), else at most one partial tile per selected expert beyond the full ones."""
    pairs = rows * top_k
    return min(num_experts, pairs) + (0 if block_m >= rows else -(-pairs // block_m))


def route(logits: Tensor, top_k: int, renorm: bool, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """logits [M, E] -> (weights [M, k] in `dtype`, ids [M, k] int32), as `models.moe.route`."""
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    m, experts = logits.shape
    weights = torch.empty(m, top_k, dtype=dtype, device=logits.device)
    ids = torch.empty(m, top_k, dtype=torch.int32, device=logits.device)
    block = triton.next_power_of_2(experts)
    _moe_route[(m,)](logits, weights, ids, logits.stride(0), experts, TOP_K=top_k,
                     K_BLOCK=triton.next_power_of_2(top_k), E_BLOCK=block, RENORM=renorm,
                     num_warps=max(1, min(8, block // 128)), **dependent_launch(logits))
    return weights, ids


@dataclass(frozen=True)
class Schedule:
    """Pairs sorted by expert and the tiles over them (see `align`)."""

    sorted_pairs: Tensor  # [P] int32: pair indices, by expert, then by pair index
    tile_expert: Tensor  # [T] int32: -1 for tiles past the last
    tile_lo: Tensor  # [T] int32: the tile's first position in sorted_pairs
    tile_hi: Tensor  # [T] int32: one past its last


def align(ids: Tensor, num_experts: int, block_m: int, tiles: int) -> Schedule:
    """ids [P] int32 (pair p's expert) -> the Schedule of `tiles` tiles of at most block_m pairs."""
    pairs = ids.numel()
    if pairs > ALIGN_IN_ONE_PROGRAM:
        return align_torch(ids, num_experts, block_m, tiles)
    dev = ids.device
    out = Schedule(torch.empty(pairs, dtype=torch.int32, device=dev), *(torch.empty(tiles, dtype=torch.int32,
                                                                                       device=dev) for _ in range(3)))
    _moe_align[(1,)](ids, out.sorted_pairs, out.tile_expert, out.tile_lo, out.tile_hi, pairs, num_experts, tiles,
                     BLOCK_M=block_m, E_BLOCK=triton.next_power_of_2(num_experts), CHUNK=align_chunk(pairs, tiles),
                     num_warps=4 if num_experts <= 128 else 8, **dependent_launch(ids))
    return out


def align_chunk(pairs: int, tiles: int) -> int:
    """Pairs (and tiles) `_moe_align` takes per loop pass: each pass works on a [chunk, experts] grid, so
    a decode step's few pairs take a small grid rather than a 64-row one that is mostly masked."""
    return min(64, max(8, triton.next_power_of_2(max(pairs, tiles))))


def align_torch(ids: Tensor, num_experts: int, block_m: int, tiles: int) -> Schedule:
    """The same Schedule from a stable sort (capturable: no host sync, fixed shapes)."""
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.long, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    per = (counts + block_m - 1) // block_m
    tile_end = per.cumsum(0)
    pair_end = counts.cumsum(0)
    t = torch.arange(tiles, device=ids.device)
    owner = torch.searchsorted(tile_end, t, right=True)  # experts whose tiles end at or before t
    e = owner.clamp(max=num_experts - 1)
    lo = pair_end[e] - counts[e] + (t - tile_end[e] + per[e]) * block_m
    hi = torch.minimum(lo + block_m, pair_end[e])
    expert = torch.where(owner < num_experts, owner, -1)
    return Schedule(order.int(), expert.int(), lo.int(), hi.int())


@dataclass(frozen=True)
class ExpertScales:
    """FP8 experts' scales: expert e's weight W[e, n, k] = w[e, n, k] * scale[e, n // rows, k // columns],
    over `gate_up_block` and `down_block` (rows, columns) blocks."""

    gate_up: Tensor  # [E, ceil(2I / rows), ceil(H / columns)] fp32
    down: Tensor  # [E, ceil(H / rows), ceil(I / columns)] fp32
    gate_up_block: tuple[int, int]
    down_block: tuple[int, int]


def scaled_k_tile(block_k: int, columns: int, k: int) -> int:
    """The K tile of an FP8 expert product over scale blocks `columns` wide: within one block (a power of
    two that divides the width), unless one block spans all of K."""
    return block_k if columns >= k else min(block_k, columns & -columns)


def fused_experts(x: Tensor, gate_up: Tensor, down: Tensor, weights: Tensor, ids: Tensor,
                  residual: Tensor | None = None, config: MoeConfig | None = None,
                  scales: ExpertScales | None = None) -> Tensor:
    """sum_j weights[m, j] * expert_{ids[m, j]}(x[m]) (+ residual[m]) for x [M, H], gate_up [E, 2I, H]
    (gate rows first), down [E, H, I], weights [M, k], ids [M, k]; as `models.moe.experts_reference`.
    With `scales`, gate_up and down are e4m3 and each tile is dequantized as it streams."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, hidden = x.shape
    experts, two_i, _ = gate_up.shape
    inter = two_i // 2
    top_k = ids.shape[1]
    if gate_up.stride(-1) != 1 or down.stride(-1) != 1 or down.shape != (experts, hidden, inter):
        raise ValueError(f"fused_experts: gate_up {tuple(gate_up.shape)} and down {tuple(down.shape)} are not "
                         f"[E, 2I, {hidden}] and [E, {hidden}, I] with contiguous rows")
    cfg = config or moe_config(m, x.element_size())
    one_row = m == 1  # each pair its own tile, in pair order: no alignment (ids stand in for the unread tables)
    tiles = top_k if one_row else num_tiles(m, top_k, experts, cfg.block_m)
    flat = ids.reshape(-1).to(torch.int32)
    sched = Schedule(flat, flat, flat, flat) if one_row else align(flat, experts, cfg.block_m, tiles)
    ieee = x.dtype == torch.float32
    # without scales the kernels take x in their place, unread (WSCALE off)
    up_s, down_s, up_k, down_k, up_scale, down_scale = x, x, cfg.block_k, cfg.block_k, {}, {}
    if scales is not None:
        up_s, down_s = scales.gate_up, scales.down
        if (up_s.shape[0], down_s.shape[0]) != (experts, experts) or any(
                t.dtype != torch.float32 or t.stride(-1) != 1 for t in (up_s, down_s)):
            raise ValueError(f"fused_experts: scales for {up_s.shape[0]} and {down_s.shape[0]} experts "
                             f"({up_s.dtype}, {down_s.dtype}); want fp32 with contiguous K blocks for {experts}")
        (ur, uc), (dr, dc) = scales.gate_up_block, scales.down_block
        up_k, down_k = scaled_k_tile(cfg.block_k, uc, hidden), scaled_k_tile(cfg.block_k, dc, inter)
        up_scale = dict(WSCALE=True, SCALE_BR=ur, SCALE_BC=uc)
        down_scale = dict(WSCALE=True, SCALE_BR=dr, SCALE_BC=dc)
    h = torch.empty(m * top_k, inter, dtype=x.dtype, device=x.device)
    _moe_gate_up[(tiles, triton.cdiv(inter, cfg.block_n_up))](
        x, gate_up, up_s, sched.sorted_pairs, sched.tile_expert, sched.tile_lo, sched.tile_hi, h,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), h.stride(0), up_s.stride(0), up_s.stride(1), inter,
        hidden, TOP_K=top_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n_up, BLOCK_K=up_k, EVEN_K=hidden % up_k == 0,
        IEEE=ieee, ONE_ROW=one_row, **up_scale, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **dependent_launch(x))
    y = torch.empty(m * top_k, hidden, dtype=torch.float32, device=x.device)
    route_w = weights.reshape(-1)
    _moe_down[(tiles, triton.cdiv(hidden, cfg.block_n_down))](
        h, down, down_s, sched.sorted_pairs, sched.tile_expert, sched.tile_lo, sched.tile_hi, route_w, y,
        h.stride(0), down.stride(0), down.stride(1), y.stride(0), down_s.stride(0), down_s.stride(1), hidden, inter,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n_down, BLOCK_K=down_k, EVEN_K=inter % down_k == 0,
        IEEE=ieee, ONE_ROW=one_row, **down_scale, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **dependent_launch(x))
    out = torch.empty(m, hidden, dtype=x.dtype, device=x.device)
    res = residual if residual is None or residual.stride(-1) == 1 else residual.contiguous()
    block = min(1024, triton.next_power_of_2(hidden))
    _moe_combine[(m, triton.cdiv(hidden, block))](
        y, res if res is not None else out, out, y.stride(0), res.stride(0) if res is not None else 0, out.stride(0),
        hidden, TOP_K=top_k, HAS_RES=res is not None, BLOCK=block, num_warps=4, **dependent_launch(x))
    return out
