"""The small kernels around the matrix products, written once in Triton instead of compiled per shape.

- `rms_norm` (optionally adding the residual first): one program per row;
- `silu_mul`: SwiGLU's gate * up;
- `qkv_rope_store`: per-head q/k RMSNorm, RoPE, and the store of this step's K/V into the cache,
  from the fused qkv projection in one kernel (it replaces six per layer: two norms, two rotations
  and two scattered stores).

torch.compile produced the first two before, but it specialises on shapes (batch 1 vs 2, rank 3
vs 4), so new request shapes recompiled inside served requests for up to seconds. These kernels
have no shape guards and launch with far less host work, which is what bounds an eager prefill.

Each follows the reference ops' roundings: the norm rounds to the model dtype before the weight
multiply, as the HF implementations do; RoPE rounds once at the end (within one unit in the last
place of the reference's per-op rounding). The reference ops in `layers` stay the CPU and training
path; tests hold the kernels to them (on the CPU through Triton's interpreter).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from blockspec.kernels import check_head_scales, dependent_launch, triton, triton_available

if triton is not None:
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def dependent_start(PDL: tl.constexpr):
        """A small kernel launched with programmatic dependent launch (`kernels.dependent_launch`): let the
        next kernel's programs be scheduled once all of this one's are, then wait for the kernel before
        (its writes visible). Nothing the step wrote may be read, and nothing written, before the wait."""
        if PDL:
            gdc_launch_dependents()
            gdc_wait()

    @triton.jit
    def _rms_norm(X, Res, W, Out, ResOut, stride_x, stride_r, stride_o, stride_ro, n_cols, eps,
                  HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        dependent_start(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < n_cols
        x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0)
        if HAS_RES:  # the residual stream: x + residual, rounded to the model dtype, is also returned
            x = (x + tl.load(Res + row * stride_r + cols, mask=ok, other=0.0)).to(Out.dtype.element_ty)
            tl.store(ResOut + row * stride_ro + cols, x, mask=ok)
        x32 = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, 0) / n_cols + eps)
        normed = (x32 * rstd).to(Out.dtype.element_ty).to(tl.float32)
        w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(Out + row * stride_o + cols, (w * normed).to(Out.dtype.element_ty), mask=ok)

    @triton.jit
    def _silu_mul(GateUp, Out, stride_g, stride_o, n_cols, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        dependent_start(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < n_cols
        gate = tl.load(GateUp + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(GateUp + row * stride_g + n_cols + cols, mask=ok, other=0.0).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(Out.dtype.element_ty).to(tl.float32)
        tl.store(Out + row * stride_o + cols, (act * up).to(Out.dtype.element_ty), mask=ok)

    @triton.jit(do_not_specialize=["rows_per_req"])  # a new prompt length must not compile a variant
    def _qkv_rope_store(
        QKV, QW, KW, Cos, Sin, Table, Slots, WritePos, QOut, KCache, VCache, KScale, VScale,
        stride_x, stride_cs, stride_qo, stride_qh,
        stride_kp, stride_kh, stride_kl, stride_vp, stride_vh, stride_vl, stride_t,
        rows_per_req, eps, k_inv, v_inv,
        Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF_BLOCK: tl.constexpr,
        HEADS: tl.constexpr, QK_NORM: tl.constexpr, PAGE: tl.constexpr, KV_FP8: tl.constexpr = False,
        HEAD_SCALES: tl.constexpr = False, PDL: tl.constexpr = False,
    ):
        """One program per (row, group of HEADS heads) of the fused projection [q heads | k heads | v heads].
        HEADS divides both head counts, so a group is all q, all k or all v heads, and a row's page is
        looked up once for its group. KV_FP8: K and V stored in e4m3, times k_inv / v_inv (1 / their
        scales) and saturated; with HEAD_SCALES times 1 / each KV head's scale (KScale, VScale [KV_HEADS]
        fp32, the reciprocal rounded as torch rounds it) instead."""
        dependent_start(PDL)
        row = tl.program_id(0).to(tl.int64)
        first = tl.program_id(1) * HEADS  # the group's first head
        half = HEAD_DIM // 2
        d = tl.arange(0, HALF_BLOCK)[None, :]
        h = tl.arange(0, HEADS)[:, None]
        ok = (d < half) & (h < HEADS)  # [HEADS, HALF_BLOCK], the tiles' shape
        base = QKV + row * stride_x + (first + h) * HEAD_DIM
        x1 = tl.load(base + d, mask=ok, other=0.0)  # [HEADS, HALF_BLOCK]
        x2 = tl.load(base + half + d, mask=ok, other=0.0)
        is_v = first >= Q_HEADS + KV_HEADS
        if not is_v:
            if QK_NORM:
                a, b = x1.to(tl.float32), x2.to(tl.float32)
                rstd = 1.0 / tl.sqrt((tl.sum(a * a, 1) + tl.sum(b * b, 1)) / HEAD_DIM + eps)[:, None]
                is_q = first < Q_HEADS
                w1 = tl.where(is_q, tl.load(QW + d, mask=d < half, other=0.0),
                              tl.load(KW + d, mask=d < half, other=0.0))
                w2 = tl.where(is_q, tl.load(QW + half + d, mask=d < half, other=0.0),
                              tl.load(KW + half + d, mask=d < half, other=0.0))
                w1, w2 = w1.to(tl.float32), w2.to(tl.float32)
                x1 = (w1 * (a * rstd).to(x1.dtype).to(tl.float32)).to(x1.dtype)
                x2 = (w2 * (b * rstd).to(x2.dtype).to(tl.float32)).to(x2.dtype)
            c1 = tl.load(Cos + row * stride_cs + d, mask=d < half, other=0.0).to(tl.float32)
            c2 = tl.load(Cos + row * stride_cs + half + d, mask=d < half, other=0.0).to(tl.float32)
            s1 = tl.load(Sin + row * stride_cs + d, mask=d < half, other=0.0).to(tl.float32)
            s2 = tl.load(Sin + row * stride_cs + half + d, mask=d < half, other=0.0).to(tl.float32)
            a, b = x1.to(tl.float32), x2.to(tl.float32)
            x1 = (a * c1 - b * s1).to(x1.dtype)
            x2 = (b * c2 + a * s2).to(x2.dtype)
        if first < Q_HEADS:  # q_out and the cache pointer differ in type (fp8 pages): distinct names
            q_out = QOut + row * stride_qo + (first + h) * stride_qh
            tl.store(q_out + d, x1, mask=ok)
            tl.store(q_out + half + d, x2, mask=ok)
        else:
            slot = tl.load(Slots + row // rows_per_req).to(tl.int64)
            pos = tl.load(WritePos + row).to(tl.int64)
            page = tl.load(Table + slot * stride_t + pos // PAGE).to(tl.int64)
            at = pos % PAGE
            if is_v:
                out = VCache + page * stride_vp + (first - Q_HEADS - KV_HEADS + h) * stride_vh + at * stride_vl
            else:
                out = KCache + page * stride_kp + (first - Q_HEADS + h) * stride_kh + at * stride_kl
            if KV_FP8:
                if HEAD_SCALES:
                    kv_head = first - Q_HEADS - tl.where(is_v, KV_HEADS, 0) + h  # [HEADS, 1]
                    inv = tl.math.div_rn(1.0, tl.where(is_v, tl.load(VScale + kv_head), tl.load(KScale + kv_head)))
                else:
                    inv = tl.where(is_v, v_inv, k_inv)
                y1 = tl.minimum(tl.maximum(x1.to(tl.float32) * inv, -448.0), 448.0)
                y2 = tl.minimum(tl.maximum(x2.to(tl.float32) * inv, -448.0), 448.0)
                tl.store(out + d, y1.to(KCache.dtype.element_ty), mask=ok)
                tl.store(out + half + d, y2.to(KCache.dtype.element_ty), mask=ok)
            else:
                tl.store(out + d, x1, mask=ok)
                tl.store(out + half + d, x2, mask=ok)

    @triton.jit
    def _dot_step(acc, xv, wv, ws, BLOCK_M: tl.constexpr, IEEE: tl.constexpr, WSCALE: tl.constexpr):
        """One K tile of the product: at one row a multiply-add kept per (column, k) and summed at the
        end; above it a tensor-core dot. An FP8 weight tile is converted to the input's dtype (exact).
        WSCALE as in `_skinny_linear` (0 and 1: nothing here, a per-channel scale multiplies the
        product); 2: `ws` holds its columns' scales for this K block (the tile lies in one), which
        multiply the tile, or the tile's dot; WSCALE 3: `ws` holds each k's scale (the program's
        columns lie in one block row), which multiply the input at one row, else the weight before it
        is rounded to the input's dtype (as `kernels.fp8.dequantize` rounds)."""
        if BLOCK_M == 1:
            w32 = wv.to(tl.float32)
            if WSCALE == 2:
                w32 = w32 * ws[:, None]
            if WSCALE == 3:
                acc += w32 * (xv.to(tl.float32) * ws[None, :])
            else:
                acc += w32 * xv.to(tl.float32)
        else:
            if WSCALE == 3:
                wv = (wv.to(tl.float32) * ws[None, :]).to(xv.dtype)
            elif wv.dtype == tl.float8e4nv:  # through fp32: e4m3 -> bf16 directly takes a slow conversion per value
                wv = wv.to(tl.float32).to(xv.dtype)
            else:
                wv = wv.to(xv.dtype)
            if WSCALE == 2:
                if IEEE:
                    acc += tl.dot(xv, tl.trans(wv), input_precision="ieee") * ws[None, :]
                else:
                    acc += tl.dot(xv, tl.trans(wv)) * ws[None, :]
            elif IEEE:  # fp32 models: no tf32 rounding of the inputs
                acc = tl.dot(xv, tl.trans(wv), acc, input_precision="ieee")
            else:
                acc = tl.dot(xv, tl.trans(wv), acc)
        return acc

    @triton.jit
    def _dot_result(acc, rstd, Bias, cols, col_ok, col_scale, BLOCK_M: tl.constexpr, SCALE: tl.constexpr,
                    HAS_BIAS: tl.constexpr, COL_SCALED: tl.constexpr):
        """The fp32 product [BLOCK_M, BLOCK_N]: the one-row partials summed, an FP8 weight's per-channel
        scales applied (COL_SCALED), the rows' RMS scale applied (SCALE: a norm whose weight the input
        already carries), the bias added."""
        if BLOCK_M == 1:
            acc = tl.sum(acc, 1)[None, :]
        if COL_SCALED:
            acc = acc * col_scale[None, :]
        if SCALE:
            acc = acc * rstd[:, None]
        if HAS_BIAS:
            acc += tl.load(Bias + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        return acc

    @triton.jit(do_not_specialize=["m"])  # the row count follows the batch: never a new variant
    def _skinny_linear(
        X, W, Bias, NormW, Res, Out, Sums, Scaled, WScale, m, n, k, n_sums, stride_x, stride_w, stride_r, stride_o,
        stride_s, eps,
        PROLOGUE: tl.constexpr, GLU: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
        EMIT: tl.constexpr, SUMS_BLOCK: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
        IEEE: tl.constexpr, WSCALE: tl.constexpr = 0, SCALE_BR: tl.constexpr = 1, SCALE_BC: tl.constexpr = 1,
        PDL: tl.constexpr = False, VEC_K: tl.constexpr = 0,
    ):
        """Out[m, n] = g(f(X)[m, :] @ W[n, :]^T (+ bias)) (+ Res), for few rows: one program per BLOCK_N
        output columns streams its weight rows once. f is the identity, the RMSNorm (PROLOGUE 1, with
        weight NormW), SwiGLU's silu(gate) * up (PROLOGUE 2, X = [gate | up] of width 2k), or the
        RMSNorm of rows that already carry the norm's weight (PROLOGUE 3: X = rows * weight, Sums
        [n_sums, m] the partial sums of the rows' squares; the RMS scale multiplies the product, so
        the operand streams unmodified). g is the identity, or with GLU silu(gate) * up of the
        product's halves (W = [gate | up], 2n rows). EMIT (with Res, the residual stream): also store
        what PROLOGUE 3 of the next product takes, Out * NormW in Scaled and each program's sums of
        squares in Sums[program]. An FP8 weight (W e4m3) is dequantized in registers: WSCALE 1, one
        scale per output row (WScale [n_rows, 1]) applied to the product; WSCALE 2 and 3, scales over
        (SCALE_BR x SCALE_BC) blocks (WScale [rows / BR, k / BC]): 2 applied per K tile, which lies in
        one K block (BLOCK_K divides SCALE_BC); 3 per k, where a program's columns lie in one block
        row (BLOCK_N divides SCALE_BR), so K tiles of any length stream (`scale_mode`)."""
        # row blocks vary fastest over the grid: the programs that run together share their weight tiles,
        # so rows past the first read them from L2
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < m
        col_ok = cols < n
        offs = tl.arange(0, BLOCK_K)
        if VEC_K:  # runs of VEC_K contiguous k only, so an FP8 tile loads as many k a thread as the input does
            offs = offs // VEC_K * VEC_K + offs % VEC_K
        x_rows = X + rows.to(tl.int64)[:, None] * stride_x
        w_rows = W + cols.to(tl.int64)[:, None] * stride_w
        u_rows = W + (cols + n).to(tl.int64)[:, None] * stride_w  # GLU: the up rows, n below the gate rows
        if PDL:
            gdc_wait()
        dtype = Out.dtype.element_ty
        rstd = tl.full([BLOCK_M], 1.0, tl.float32)
        if PROLOGUE == 3:  # the producer's partial sums, read before the weight stream starts
            part = tl.arange(0, SUMS_BLOCK)
            sums = tl.load(Sums + part.to(tl.int64)[None, :] * m + rows[:, None],
                           mask=row_ok[:, None] & (part < n_sums)[None, :], other=0.0)
            rstd = 1.0 / tl.sqrt(tl.sum(sums, 1) / k + eps)
        if PROLOGUE == 1:  # the row's RMS first: x is a few KB, read again from L2 in the main loop
            sq = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
            for k0 in range(0, k, BLOCK_K):
                kk = k0 + offs
                xv = tl.load(x_rows + kk[None, :], mask=row_ok[:, None] & (kk < k)[None, :], other=0.0)
                xv = xv.to(tl.float32)
                sq += xv * xv
            rstd = 1.0 / tl.sqrt(tl.sum(sq, 1) / k + eps)
        if BLOCK_M == 1:
            acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_up = tl.zeros_like(acc)
        block_row = (tl.program_id(1) * BLOCK_N // SCALE_BR).to(tl.int64)  # WSCALE 3: the columns' one block row
        for k0 in range(0, k, BLOCK_K):
            kk = k0 + offs
            if EVEN_K:
                x_ok = row_ok[:, None]
                w_ok = col_ok[:, None]
            else:
                x_ok = row_ok[:, None] & (kk < k)[None, :]
                w_ok = col_ok[:, None] & (kk < k)[None, :]
            if PROLOGUE == 2:  # rounded as the silu_mul kernel rounds
                gate = tl.load(x_rows + kk[None, :], mask=x_ok, other=0.0).to(tl.float32)
                up = tl.load(x_rows + k + kk[None, :], mask=x_ok, other=0.0).to(tl.float32)
                act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
                xv = (act * up).to(dtype)
            else:
                xv = tl.load(x_rows + kk[None, :], mask=x_ok, other=0.0)
                if PROLOGUE == 1:  # rounded as the rms_norm kernel rounds
                    nw = tl.load(NormW + kk, mask=kk < k, other=0.0).to(tl.float32)
                    xv = (nw[None, :] * (xv.to(tl.float32) * rstd[:, None]).to(dtype).to(tl.float32)).to(dtype)
            ws = 1.0
            if WSCALE == 2:  # this K block's scale of each column
                ws = tl.load(WScale + (cols // SCALE_BR).to(tl.int64) * stride_s + k0 // SCALE_BC, mask=col_ok,
                             other=0.0)
            if WSCALE == 3:  # each k's scale in the block row of the program's columns
                ws = tl.load(WScale + block_row * stride_s + kk // SCALE_BC, mask=kk < k, other=0.0)
            acc = _dot_step(acc, xv, tl.load(w_rows + kk[None, :], mask=w_ok, other=0.0), ws, BLOCK_M, IEEE, WSCALE)
            if GLU:
                if WSCALE == 2:
                    ws = tl.load(WScale + ((cols + n) // SCALE_BR).to(tl.int64) * stride_s + k0 // SCALE_BC,
                                 mask=col_ok, other=0.0)
                if WSCALE == 3:
                    ws = tl.load(WScale + (block_row + n // SCALE_BR) * stride_s + kk // SCALE_BC, mask=kk < k,
                                 other=0.0)
                acc_up = _dot_step(acc_up, xv, tl.load(u_rows + kk[None, :], mask=w_ok, other=0.0), ws, BLOCK_M,
                                   IEEE, WSCALE)
        if PDL:  # the stream is done: the next kernel's programs may take the SMs as these drain
            gdc_launch_dependents()
        cs = 1.0
        if WSCALE == 1:
            cs = tl.load(WScale + cols.to(tl.int64) * stride_s, mask=col_ok, other=0.0)
        y = _dot_result(acc, rstd, Bias, cols, col_ok, cs, BLOCK_M, PROLOGUE == 3, HAS_BIAS, WSCALE == 1).to(dtype)
        if GLU:  # the product rounded as the unfused linear rounds, then as the silu_mul kernel rounds
            if WSCALE == 1:
                cs = tl.load(WScale + (cols + n).to(tl.int64) * stride_s, mask=col_ok, other=0.0)
            up = _dot_result(acc_up, rstd, Bias + n, cols, col_ok, cs, BLOCK_M, PROLOGUE == 3, HAS_BIAS,
                             WSCALE == 1).to(dtype)
            gate = y.to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
            y = (act * up.to(tl.float32)).to(dtype)
        ok = row_ok[:, None] & col_ok[None, :]
        if HAS_RES:  # the residual stream: (x @ W^T) rounded, plus the residual, rounded (as x + residual)
            res = tl.load(Res + rows.to(tl.int64)[:, None] * stride_r + cols[None, :], mask=ok, other=0.0)
            y = (y.to(tl.float32) + res.to(tl.float32)).to(dtype)
        tl.store(Out + rows.to(tl.int64)[:, None] * stride_o + cols[None, :], y, mask=ok)
        if EMIT:
            y32 = tl.where(ok, y.to(tl.float32), 0.0)
            tl.store(Sums + tl.program_id(1).to(tl.int64) * m + rows, tl.sum(y32 * y32, 1), mask=row_ok)
            nw = tl.load(NormW + cols, mask=col_ok, other=0.0).to(tl.float32)
            tl.store(Scaled + rows.to(tl.int64)[:, None] * stride_o + cols[None, :], (y32 * nw[None, :]).to(dtype),
                     mask=ok)

    @triton.jit
    def _multirow_dot(acc_a, acc_b, w, xa, xb, ws, HAS_B: tl.constexpr, WSCALE: tl.constexpr):
        """One K tile of `_multirow_linear`: the weight tile [BLOCK_N, BLOCK_K] times both row chunks'
        transposed tiles. WSCALE 2: `ws` [BLOCK_N] is this K block's scale of each column (the tile
        lies in one block), applied to the tile's dots."""
        if w.dtype == tl.float8e4nv:  # through fp32: e4m3 -> bf16 directly takes a slow conversion per value
            w = w.to(tl.float32).to(xa.dtype)
        if WSCALE == 2:
            acc_a += tl.dot(w, tl.trans(xa)) * ws[:, None]
            if HAS_B:
                acc_b += tl.dot(w, tl.trans(xb)) * ws[:, None]
        else:
            acc_a = tl.dot(w, tl.trans(xa), acc_a)
            if HAS_B:
                acc_b = tl.dot(w, tl.trans(xb), acc_b)
        return acc_a, acc_b

    @triton.jit
    def _multirow_store(Out, acc, rows, cols, m, n, stride_o, up, Bias, WScale, stride_s,
                        GLU: tl.constexpr, HAS_BIAS: tl.constexpr, WSCALE: tl.constexpr):
        """Out[rows, cols] from a chunk's fp32 product [BLOCK_N, rows] (and with GLU its up half):
        per-channel scales, bias, then SwiGLU rounded as `_skinny_linear`'s epilogue rounds."""
        col_ok = cols < n
        dtype = Out.dtype.element_ty
        if WSCALE == 1:
            acc = acc * tl.load(WScale + cols.to(tl.int64) * stride_s, mask=col_ok, other=0.0)[:, None]
        if HAS_BIAS:
            acc += tl.load(Bias + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
        y = acc.to(dtype)
        if GLU:
            if WSCALE == 1:
                up = up * tl.load(WScale + (cols + n).to(tl.int64) * stride_s, mask=col_ok, other=0.0)[:, None]
            if HAS_BIAS:
                up += tl.load(Bias + n + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
            gate = y.to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
            y = (act * up.to(dtype).to(tl.float32)).to(dtype)
        ok = (rows < m)[None, :] & col_ok[:, None]
        tl.store(Out + rows.to(tl.int64)[None, :] * stride_o + cols[:, None], y, mask=ok)

    @triton.jit(do_not_specialize=["m", "group"])  # the row count follows the batch: only its chunking is a variant
    def _multirow_linear(
        X, W, Bias, WScale, Out, Part, m, group, n, k, k_split, stride_x, stride_w, stride_o, stride_s,
        ROWS_A: tl.constexpr, ROWS_B: tl.constexpr, HAS_B: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, GLU: tl.constexpr, HAS_BIAS: tl.constexpr,
        WSCALE: tl.constexpr, SCALE_BR: tl.constexpr, SCALE_BC: tl.constexpr, EVEN_K: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        """Out[m, n] = g(X @ W^T * scales + bias) for tens to hundreds of rows (verify and draft steps of
        batches): one program per group of `group` rows, BLOCK_N weight rows and (with SPLIT > 1) K range
        of k_split streams those weight rows once for every row of its group; the groups of a column
        block run side by side (the grid's fastest dimension), so past the first they read it from L2.
        The weight rows are the tensor cores' M (units of 64) and the input rows their N (any multiple
        of 8): a group is two chunks of ROWS_A and ROWS_B rows (powers of two; the second only with
        HAS_B), so 144 rows compute as 128 + 16, not as 256. g: as `_skinny_linear`'s
        GLU (W = [gate | up], 2n rows). FP8 weights as `_skinny_linear`'s WSCALE 1 and 2. With SPLIT > 1
        the fp32 partial products go to Part [SPLIT, m, n (2n with GLU)] for `_multirow_reduce`."""
        row0 = tl.program_id(0) * group
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < n
        last = tl.minimum(row0 + group, m)  # the group's rows: row0 to last - 1
        rows_a = row0 + tl.arange(0, ROWS_A)
        rows_b = row0 + ROWS_A + tl.arange(0, ROWS_B)
        offs = tl.arange(0, BLOCK_K)
        xa_rows = X + rows_a.to(tl.int64)[:, None] * stride_x
        xb_rows = X + rows_b.to(tl.int64)[:, None] * stride_x
        w_rows = W + cols.to(tl.int64)[:, None] * stride_w
        u_rows = W + (cols + n).to(tl.int64)[:, None] * stride_w  # GLU: the up rows, n below the gate rows
        if PDL:
            gdc_wait()
        acc_a = tl.zeros([BLOCK_N, ROWS_A], tl.float32)
        acc_b = tl.zeros([BLOCK_N, ROWS_B], tl.float32)
        up_a = tl.zeros_like(acc_a)
        up_b = tl.zeros_like(acc_b)
        k_lo = tl.program_id(2) * k_split
        k_hi = tl.minimum(k_lo + k_split, k)
        xb = tl.zeros([ROWS_B, BLOCK_K], X.dtype.element_ty)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            kk = k0 + offs
            k_ok = kk < k_hi
            if EVEN_K:
                xa = tl.load(xa_rows + kk[None, :], mask=(rows_a < last)[:, None], other=0.0)
                if HAS_B:
                    xb = tl.load(xb_rows + kk[None, :], mask=(rows_b < last)[:, None], other=0.0)
                w = tl.load(w_rows + kk[None, :], mask=col_ok[:, None], other=0.0)
            else:
                xa = tl.load(xa_rows + kk[None, :], mask=(rows_a < last)[:, None] & k_ok[None, :], other=0.0)
                if HAS_B:
                    xb = tl.load(xb_rows + kk[None, :], mask=(rows_b < last)[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_rows + kk[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            ws = 1.0
            if WSCALE == 2:
                ws = tl.load(WScale + (cols // SCALE_BR).to(tl.int64) * stride_s + k0 // SCALE_BC, mask=col_ok,
                             other=0.0)
            acc_a, acc_b = _multirow_dot(acc_a, acc_b, w, xa, xb, ws, HAS_B, WSCALE)
            if GLU:
                if EVEN_K:
                    u = tl.load(u_rows + kk[None, :], mask=col_ok[:, None], other=0.0)
                else:
                    u = tl.load(u_rows + kk[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
                if WSCALE == 2:
                    ws = tl.load(WScale + ((cols + n) // SCALE_BR).to(tl.int64) * stride_s + k0 // SCALE_BC,
                                 mask=col_ok, other=0.0)
                up_a, up_b = _multirow_dot(up_a, up_b, u, xa, xb, ws, HAS_B, WSCALE)
        if PDL:  # the stream is done: the next kernel's programs may take the SMs as these drain
            gdc_launch_dependents()
        if SPLIT == 1:
            _multirow_store(Out, acc_a, rows_a, cols, last, n, stride_o, up_a, Bias, WScale, stride_s, GLU,
                            HAS_BIAS, WSCALE)
            if HAS_B:
                _multirow_store(Out, acc_b, rows_b, cols, last, n, stride_o, up_b, Bias, WScale, stride_s, GLU,
                                HAS_BIAS, WSCALE)
        else:
            width = 2 * n if GLU else n
            part = Part + tl.program_id(2).to(tl.int64) * m * width + cols[:, None]
            ok_a = (rows_a < last)[None, :] & col_ok[:, None]
            tl.store(part + rows_a.to(tl.int64)[None, :] * width, acc_a, mask=ok_a)
            if GLU:
                tl.store(part + n + rows_a.to(tl.int64)[None, :] * width, up_a, mask=ok_a)
            if HAS_B:
                ok_b = (rows_b < last)[None, :] & col_ok[:, None]
                tl.store(part + rows_b.to(tl.int64)[None, :] * width, acc_b, mask=ok_b)
                if GLU:
                    tl.store(part + n + rows_b.to(tl.int64)[None, :] * width, up_b, mask=ok_b)

    @triton.jit
    def _multirow_reduce(Part, Bias, WScale, Out, m, n, stride_o, stride_s, SPLIT: tl.constexpr,
                         BLOCK: tl.constexpr, GLU: tl.constexpr, HAS_BIAS: tl.constexpr, WSCALE: tl.constexpr,
                         PDL: tl.constexpr = False):
        """`_multirow_linear`'s SPLIT partial products summed in a fixed order, then its epilogue: one
        program per (row, BLOCK columns)."""
        dependent_start(PDL)
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        width = 2 * n if GLU else n
        base = Part + row.to(tl.int64) * width + cols
        acc = tl.zeros([BLOCK], tl.float32)
        up = tl.zeros([BLOCK], tl.float32)
        for s in range(SPLIT):
            acc += tl.load(base + s * m * width, mask=cols < n, other=0.0)
            if GLU:
                up += tl.load(base + s * m * width + n, mask=cols < n, other=0.0)
        _multirow_store(Out, acc[:, None], tl.full([1], 0, tl.int32) + row, cols, m, n, stride_o, up[:, None], Bias,
                        WScale, stride_s, GLU, HAS_BIAS, WSCALE)


def use_kernels(*tensors: Tensor) -> bool:
    """The kernels serve CUDA inference; CPU runs, autograd (training) and autocast take the reference."""
    return (tensors[0].is_cuda and triton_available() and not torch.is_autocast_enabled("cuda")
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)))


def _rows(x: Tensor) -> Tensor:
    return x.reshape(-1, x.shape[-1]) if x.stride(-1) == 1 else x.contiguous().view(-1, x.shape[-1])


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None
             ) -> Tensor | tuple[Tensor, Tensor]:
    """RMSNorm over the last dim; with `residual`, returns (x + residual, its norm)."""
    rows = _rows(x)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    res_in = _rows(residual) if residual is not None else rows
    res_out = torch.empty_like(out) if residual is not None else out
    n = rows.shape[-1]
    block = triton.next_power_of_2(n)
    _rms_norm[(rows.shape[0],)](rows, res_in, weight, out, res_out, rows.stride(0), res_in.stride(0), out.stride(0),
                                res_out.stride(0), n, eps, HAS_RES=residual is not None, BLOCK=block,
                                num_warps=max(1, min(16, block // 256)), **dependent_launch(x))
    if residual is None:
        return out.view(x.shape)
    return res_out.view(x.shape), out.view(x.shape)


def silu_mul(gate_up: Tensor) -> Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dim."""
    rows = _rows(gate_up)
    n = rows.shape[-1] // 2
    out = torch.empty(rows.shape[0], n, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(n))
    _silu_mul[(rows.shape[0], triton.cdiv(n, block))](rows, out, rows.stride(0), out.stride(0), n, BLOCK=block,
                                                      num_warps=4, **dependent_launch(gate_up))
    return out.view(*gate_up.shape[:-1], n)


def qkv_rope_store(qkv: Tensor, q_heads: int, kv_heads: int, head_dim: int, q_weight: Tensor | None,
                   k_weight: Tensor | None, eps: float, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                   table: Tensor, slots: Tensor, write_pos: Tensor, k_scale: float | Tensor = 1.0,
                   v_scale: float | Tensor = 1.0, group: int | None = None) -> Tensor:
    """qkv [R, Q, (q_heads + 2 kv_heads) * head_dim] -> q [R, Q, q_heads, head_dim] normed and rotated;
    k (normed, rotated) and v are stored at (slots[r], head, write_pos[r, i]) of the paged caches
    [pages, kv_heads, page_size, head_dim], the page found in `table` [S, columns] (see `PageTable`).
    cos/sin [R, Q, head_dim]. q_heads may be 0 (context K/V only); the q/k RMSNorm runs when
    k_weight is given (Qwen3), else only RoPE (Llama, Qwen2). Caches in float8_e4m3fn take K / k_scale
    and V / v_scale, saturated (`kv_cache.quantize_kv`; floats, or [kv_heads] fp32 tensors of one scale per
    KV head). `group`: heads a program (`head_group` by default; benchmarks/bench_qkv_store.py sweeps it)."""
    r, nq, width = qkv.shape
    if width != (q_heads + 2 * kv_heads) * head_dim or qkv.stride(-1) != 1:
        raise ValueError(f"qkv_rope_store: qkv {tuple(qkv.shape)} is not [R, Q, ({q_heads} + 2 x {kv_heads}) x "
                         f"{head_dim}] with a contiguous last dim")
    if head_dim % 2:
        raise ValueError(f"qkv_rope_store: head_dim {head_dim} must be even for RoPE")
    head_scales = check_head_scales(k_scale, v_scale, kv_heads, "qkv_rope_store")
    rows = qkv.view(r * nq, width) if qkv.is_contiguous() else qkv.reshape(r * nq, width)
    cos = cos.reshape(r * nq, head_dim)
    sin = sin.reshape(r * nq, head_dim)
    q = torch.empty(r, nq, q_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    qk_norm = k_weight is not None
    if qk_norm and q_heads and q_weight is None:
        raise ValueError("qkv_rope_store: q/k-norm needs both weights (q_weight is None)")
    write_pos = write_pos.reshape(r * nq)
    group = group or head_group(q_heads, kv_heads)
    if q_heads % group or kv_heads % group:
        raise ValueError(f"qkv_rope_store: {group} heads a program must divide both head counts ({q_heads}, {kv_heads})")
    _qkv_rope_store[(r * nq, (q_heads + 2 * kv_heads) // group)](
        rows, q_weight if q_weight is not None else rows, k_weight if qk_norm else rows, cos, sin, table, slots,
        write_pos, q, k_cache, v_cache, k_scale if head_scales else cos, v_scale if head_scales else cos,
        rows.stride(0), cos.stride(0), q_heads * head_dim, head_dim,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), table.stride(0), nq, eps, 1.0 if head_scales else 1.0 / k_scale,
        1.0 if head_scales else 1.0 / v_scale,
        Q_HEADS=q_heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim, HALF_BLOCK=triton.next_power_of_2(head_dim // 2),
        HEADS=group, QK_NORM=qk_norm, PAGE=k_cache.shape[2], KV_FP8=k_cache.dtype == torch.float8_e4m3fn,
        HEAD_SCALES=head_scales,
        num_warps=group,  # a warp a head, as many threads per head as one head a program had
        **dependent_launch(qkv),
    )
    return q


def head_group(q_heads: int, kv_heads: int, most: int = 8) -> int:
    """Heads per program of `qkv_rope_store`: the largest power of two (at most `most`) dividing both
    head counts. It depends on the model only, never on the row count, so each row is computed the
    same way in a call of any size (plain and verify rows agree bit for bit). One head a program makes
    a 576-row verify of Qwen3-8B 27,648 programs of 128 elements, launch-bound at several times its
    bytes' time; a warp a head keeps a one-row call about as fast (benchmarks/RESULTS.md, Kernels)."""
    group = 1
    while group < most and q_heads % (2 * group) == 0 and kv_heads % (2 * group) == 0:
        group *= 2
    return group


SKINNY_MAX_ROWS = 16
"""Up to this many rows a linear layer streams its weights through `skinny_linear` (decode, verify and
draft steps of small batches); above it cuBLAS's GEMM is faster (measured in benchmarks/bench_gemv.py)."""


@dataclass(frozen=True)
class SkinnyConfig:
    block_m: int  # 1: a multiply-add over K per column; 16 or more: tensor-core dots over row blocks
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    vec_k: int = 0  # > 0: K read in runs of vec_k (`_skinny_linear`'s VEC_K)


# (rows class, product class) -> (block_m, block_n, block_k, num_warps, num_stages): the best of a
# sweep on an H200 (benchmarks/bench_gemv.py) for Qwen3-8B's products, classed as wide (gate_up,
# n = 6k), qkv (n = 1.5k) and square or tall (o, down); at one row SwiGLU in the prologue (down)
# has its own best tile.
SKINNY_TILES = {
    ("one", "swiglu"): (1, 8, 512, 4, 1),
    ("one", "wide"): (1, 32, 256, 8, 1),
    ("one", "qkv"): (1, 8, 512, 4, 3),
    ("one", "tall"): (1, 16, 1024, 8, 3),
    ("few", "wide"): (16, 64, 256, 4, 2),
    ("few", "qkv"): (16, 64, 256, 4, 4),
    ("few", "tall"): (16, 32, 512, 4, 4),
}


FP8_ONE_TILES = {"wide": (1, 8, 1024, 4, 3, 8), "tall": (1, 8, 1024, 4, 3, 8), "swiglu": (1, 8, 1024, 4, 3, 8)}
"""One row of an FP8 weight from a 16-bit input, where these beat the bf16 tiles: K read in runs of 8
(VEC_K), so each thread's 8 weight bytes of a K tile pair with the 8 input values it loads itself, and
4 warps x 32 threads x 8 = the K tile: the input reaches the weight's layout in registers (on the bf16
tiles it went through shared memory, eight barriers a K tile). A one-row GLU program streams block_n / 2
rows of each half, 4 + 4 here (at 16 + 16 its two [16, 1024] fp32 accumulators spill). H200, Qwen3-8B's
products as the decode step calls them (benchmarks/data/fp8/h200_2026-12-04_vec_k/ and
h200_2026-12-04c_one_row_mlp/): gate_up with the norm and its GLU epilogue 34.4 -> 30.7 us, o with its
residual 7.8 -> 7.1, down 17.3 -> 14.9 (with SwiGLU in the prologue 23.9 -> 19.0); qkv keeps the bf16
tile (10.2 against 9.5 us)."""

FP8_FEW_TILES = {"wide": (16, 64, 256, 4, 3), "qkv": (16, 64, 512, 4, 3), "tall": (16, 32, 512, 4, 3)}
"""2-16 rows of an FP8 weight, by product class: the best per-channel tiles of a sweep on an H200
(benchmarks/bench_fp8_gemm.py --sweep --sweep-rows 16) for Qwen3-8B's products, 14 % less time over a
layer's four than the bf16 weights' tiles take."""


def streams_per_row(m: int, itemsize: int) -> bool:
    """Whether `skinny_linear` streams each of m rows on its own (the one-row tiles): at one row, and at
    every row count in float32, where an exact tensor-core dot ("ieee") runs several times slower than
    a multiply-add stream per row. A row's product then does not depend on the call's row count."""
    return m == 1 or itemsize >= 4


def product_class(n: int, k: int) -> str:
    """The tile tables' class of an [n, k] weight: wide (gate_up, n >= 4k), qkv (k < n < 4k), or tall
    (o and down, n <= k)."""
    return "wide" if n >= 4 * k else "qkv" if n > k else "tall"


def skinny_config(m: int, n: int, k: int, prologue: int = 0, itemsize: int = 2, fp8: bool = False) -> SkinnyConfig:
    """Tile sizes for `skinny_linear` (prologue 1: norm, 2: SwiGLU; `itemsize`: the input's), from
    SKINNY_TILES, or FP8_FEW_TILES for an FP8 weight above one row (FP8_ONE_TILES at one row where they
    beat the bf16 tiles). Wider elements take shorter K tiles, so the pipeline's buffers fit in shared
    memory."""
    one = streams_per_row(m, itemsize)
    if fp8 and not one:
        return SkinnyConfig(*FP8_FEW_TILES[product_class(n, k)])
    shape = "swiglu" if one and prologue == 2 else product_class(n, k)
    if fp8 and itemsize == 2 and shape in FP8_ONE_TILES:
        return SkinnyConfig(*FP8_ONE_TILES[shape])
    cfg = SkinnyConfig(*SKINNY_TILES["one" if one else "few", shape])
    return replace(cfg, block_k=max(32, cfg.block_k * 2 // itemsize))


def scale_mode(br: int, bc: int, k: int, n: int, block_n: int, block_k: int, glu: bool = False) -> tuple[int, int]:
    """(WSCALE, K tile) of an FP8 product over (br x bc) scale blocks (see `_skinny_linear`): per
    channel (1) keeps any K tile; where each program's block_n columns (and with glu their up rows,
    n below) lie in one block row, per-k scales (3) keep it too; else each K tile must lie in one
    scale block (2), which caps it at the block's width (at 128 x 128 blocks a one-row stream of
    128-column tiles runs at about half the speed of its per-channel twin)."""
    if br == 1 and bc >= k:
        return 1, block_k
    if br % block_n == 0 and (not glu or n % br == 0):
        return 3, block_k
    capped = min(block_k, bc & -bc)
    if capped < 16:
        raise ValueError(f"skinny_linear: scale blocks of {bc} columns need K tiles of {capped} < 16")
    return 2, capped


@dataclass(frozen=True)
class PreNormed:
    """Rows of the residual stream with what the RMSNorm after them needs, written by the product that
    made them (`skinny_linear(..., emit_norm=weight)`): the rows times the norm's weight and the
    partial sums of their squares. The next product then norms inside its weight stream, with no
    norm kernel between the two (the decoder layer's norms above one row)."""

    rows: Tensor
    scaled: Tensor
    sums: Tensor  # [producer programs, rows] fp32
    weight: Tensor


def skinny_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, norm_weight: Tensor | None = None,
                  eps: float = 0.0, swiglu: bool = False, glu: bool = False, residual: Tensor | None = None,
                  prenormed: PreNormed | None = None, emit_norm: Tensor | None = None,
                  config: SkinnyConfig | None = None, weight_scale: Tensor | None = None,
                  scale_block: tuple[int, int] | None = None) -> Tensor | PreNormed:
    """linear(f(x), weight, bias) (+ residual) for few rows, f fused into the product's prologue:

    - `norm_weight`: f = RMSNorm (the layer's pre-norm), so the normed rows are never stored;
    - `prenormed`: f = the RMSNorm (weight `prenormed.weight`) of rows x whose statistics the
      product before made (x is then `prenormed.rows`);
    - `swiglu`: x = [gate | up] (width 2K) and f = silu(gate) * up (the MLP's activation);
    - `glu`: the weight is [gate | up] (2N rows) and the output silu(gate) * up (width N): the MLP's
      activation after its first product instead of before its second;
    - `residual`: the output is residual + the product, each rounded as the unfused ops round;
      with `emit_norm`, returned as PreNormed for the RMSNorm of that weight;
    - `weight_scale`: the weight is FP8 (e4m3), dequantized as it streams: its fp32 scales over
      `scale_block` (rows, columns) blocks, [ceil(N / rows), ceil(K / columns)] (`kernels.fp8`).
    """
    rows = _rows(x)
    m = rows.shape[0]
    n, k = weight.shape
    if rows.shape[1] != (2 * k if swiglu else k) or weight.stride(1) != 1:
        raise ValueError(f"skinny_linear: input width {rows.shape[1]} does not match weight {tuple(weight.shape)}"
                         f"{' (swiglu takes 2K)' if swiglu else ''}")
    if glu and (n % 2 or residual is not None):
        raise ValueError(f"skinny_linear: glu takes a weight of 2N rows and no residual (weight {tuple(weight.shape)}, "
                         f"residual {'given' if residual is not None else 'none'})")
    if emit_norm is not None and residual is None:
        raise ValueError("skinny_linear: emit_norm describes the residual stream: it needs `residual`")
    prologue = 3 if prenormed is not None else 1 if norm_weight is not None else 2 if swiglu else 0
    cfg = config or skinny_config(m, n, k, 2 if swiglu else 0, x.element_size(), fp8=weight_scale is not None)
    wscale, (br, bc), stride_s = 0, scale_block or (1, 1), 0
    if (weight_scale is None) == (weight.dtype == torch.float8_e4m3fn):
        raise ValueError(f"skinny_linear: an FP8 weight needs weight_scale, and only an FP8 weight takes one "
                         f"(weight {weight.dtype}, weight_scale {'given' if weight_scale is not None else 'none'})")
    if weight_scale is not None:
        if weight_scale.dtype != torch.float32 or scale_block is None:
            raise ValueError(f"skinny_linear: weight_scale takes a float8_e4m3fn weight, fp32 scales and their "
                             f"scale_block (got {weight.dtype}, {weight_scale.dtype}, block {scale_block})")
        if tuple(weight_scale.shape) != (-(-n // br), -(-k // bc)):
            raise ValueError(f"skinny_linear: weight_scale {tuple(weight_scale.shape)} does not cover weight "
                             f"{tuple(weight.shape)} in {br} x {bc} blocks")
        stride_s = weight_scale.stride(0)
    block_n = cfg.block_n
    if glu:  # each program streams block_n weight rows: half gate, half up (a tensor-core tile 16 of each at least)
        n, block_n = n // 2, max(1 if cfg.block_m == 1 else 16, block_n // 2)
    if weight_scale is not None:
        wscale, block_k = scale_mode(br, bc, k, n, block_n, cfg.block_k, glu)
        cfg = replace(cfg, block_k=block_k)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    res = _rows(residual) if residual is not None else out
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, block_n))
    if prenormed is not None:
        rows, sums = _rows(prenormed.scaled), prenormed.sums
        norm_weight = prenormed.weight
    elif emit_norm is not None:
        sums, norm_weight = torch.empty(grid[1], m, dtype=torch.float32, device=x.device), emit_norm
    else:
        sums = out
    scaled = torch.empty_like(out) if emit_norm is not None else out
    _skinny_linear[grid](
        rows, weight, bias if bias is not None else out, norm_weight if norm_weight is not None else out, res,
        out, sums, scaled, weight_scale if weight_scale is not None else out, m, n, k, sums.shape[0], rows.stride(0),
        weight.stride(0), res.stride(0), out.stride(0), stride_s, eps,
        PROLOGUE=prologue, GLU=glu, HAS_BIAS=bias is not None, HAS_RES=residual is not None,
        EMIT=emit_norm is not None, SUMS_BLOCK=triton.next_power_of_2(sums.shape[0]) if prologue == 3 else 1,
        BLOCK_M=cfg.block_m, BLOCK_N=block_n, BLOCK_K=cfg.block_k,
        EVEN_K=k % cfg.block_k == 0, IEEE=x.dtype == torch.float32, WSCALE=wscale, SCALE_BR=br, SCALE_BC=bc,
        VEC_K=cfg.vec_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **dependent_launch(x),
    )
    if emit_norm is not None:
        return PreNormed(out.view(*x.shape[:-1], n), scaled.view(*x.shape[:-1], n), sums, emit_norm)
    return out.view(*x.shape[:-1], n)


@dataclass(frozen=True)
class MultirowConfig:
    """Tiles of `multirow_linear` (tables by product class: `kernels.fp8.MULTIROW_TILES`)."""

    block_n: int  # weight rows a program (the tensor cores' M: 64 or 128)
    block_k: int
    num_warps: int
    num_stages: int
    split: int  # K ranges a column block is cut into (programs for narrow weights; reduced after)


MULTIROW_GROUP_MAX = 160
"""Rows a `_multirow_linear` program computes at most (128 + 32): its fp32 accumulators, BLOCK_N of them a
row, live in registers; more rows take groups side by side, which share the weight tiles through L2."""


MULTIROW_SMEM_BYTES = 224 << 10
"""Shared memory `_multirow_linear`'s pipeline stages may take, by `multirow_linear`'s estimate of a
stage (an H100 / H200 program has 227 KB): a tile with GLU's second weight tile and long K tiles runs
with fewer stages than its config's (128 x 128 tiles with GLU at 4 stages take 240 KB, 3 fit)."""


def multirow_stages(stages: int, block_n: int, block_k: int, rows: int, glu: bool, weight_bytes: int,
                    input_bytes: int) -> int:
    """Pipeline stages of a `_multirow_linear` tile: its config's, fewer where a stage's tiles (weight,
    GLU's second weight tile, the group's rows) would take the stages past MULTIROW_SMEM_BYTES."""
    stage = block_k * (block_n * (2 if glu else 1) * weight_bytes + rows * input_bytes)
    return max(1, min(stages, MULTIROW_SMEM_BYTES // stage))


def row_groups(m: int) -> tuple[int, int, int]:
    """(rows a group, ROWS_A, ROWS_B) of `_multirow_linear` for m rows: as few equal groups as keep a
    group within MULTIROW_GROUP_MAX rows; a group's rows are the largest power of two up to its size,
    then the rest rounded up to a power of two (at least 16; 0 when nothing is left)."""
    if m < 1:
        raise ValueError(f"multirow_linear: {m} rows")
    group = -(-m // -(-m // MULTIROW_GROUP_MAX))
    a = 1 << (group.bit_length() - 1)
    rest = group - a
    return group, a, 0 if rest == 0 else max(16, 1 << (rest - 1).bit_length())


def multirow_scales_fit(scale_block: tuple[int, int], k: int) -> bool:
    """Whether `multirow_linear` takes FP8 scales over `scale_block` (rows, columns) blocks of a K-wide
    weight: one per output row (per channel), or K tiles that fit in a block's columns, at least 16."""
    br, bc = scale_block
    return (br == 1 and bc >= k) or (bc & -bc) >= 16


def multirow_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, glu: bool = False,
                    weight_scale: Tensor | None = None, scale_block: tuple[int, int] | None = None,
                    config: MultirowConfig) -> Tensor:
    """linear(x, weight, bias), with `glu` silu(gate) * up of its halves (`skinny_linear`'s glu), for
    the tens to hundreds of rows of a batch's verify and draft steps: each weight tile is read once
    for up to MULTIROW_GROUP_MAX rows and converted once where it is FP8 (`weight_scale`,
    `scale_block`, as `skinny_linear` takes them: per channel, or blocks of at least 16 columns).
    `kernels.fp8` dispatches FP8 weights here; with 16-bit weights cuBLAS measured faster on the
    H200 (benchmarks/bench_gemv.py --multirow-rows)."""
    rows = _rows(x)
    m, k = rows.shape
    n = weight.shape[0]
    if weight.shape[1] != k or weight.stride(1) != 1:
        raise ValueError(f"multirow_linear: input width {k} does not match weight {tuple(weight.shape)}")
    if glu and n % 2:
        raise ValueError(f"multirow_linear: glu takes a weight of 2N rows (weight {tuple(weight.shape)})")
    n = n // 2 if glu else n
    wscale, (br, bc), stride_s, block_k = 0, scale_block or (1, 1), 0, config.block_k
    if (weight_scale is None) != (weight.dtype != torch.float8_e4m3fn):
        raise ValueError(f"multirow_linear: an FP8 weight needs weight_scale, and only an FP8 weight takes one "
                         f"(weight {weight.dtype}, weight_scale {'given' if weight_scale is not None else 'none'})")
    if weight_scale is not None:
        if tuple(weight_scale.shape) != (-(-weight.shape[0] // br), -(-k // bc)):
            raise ValueError(f"multirow_linear: weight_scale {tuple(weight_scale.shape)} does not cover weight "
                             f"{tuple(weight.shape)} in {br} x {bc} blocks")
        stride_s = weight_scale.stride(0)
        if not multirow_scales_fit((br, bc), k):
            raise ValueError(f"multirow_linear: scale blocks of {bc} columns need K tiles of {bc & -bc} < 16")
        wscale = 1 if br == 1 and bc >= k else 2
        block_k = block_k if wscale == 1 else min(block_k, bc & -bc)
    group, rows_a, rows_b = row_groups(m)
    stages = multirow_stages(config.num_stages, config.block_n, block_k, rows_a + rows_b, glu, weight.element_size(),
                             rows.element_size())
    k_split = triton.cdiv(triton.cdiv(k, config.split), block_k) * block_k
    split = triton.cdiv(k, k_split)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    part = torch.empty(split, m, 2 * n if glu else n, dtype=torch.float32, device=x.device) if split > 1 else out
    scales = weight_scale if weight_scale is not None else out
    _multirow_linear[(triton.cdiv(m, group), triton.cdiv(n, config.block_n), split)](
        rows, weight, bias if bias is not None else out, scales, out, part, m, group, n, k, k_split, rows.stride(0),
        weight.stride(0), out.stride(0), stride_s,
        ROWS_A=rows_a, ROWS_B=max(rows_b, 16), HAS_B=rows_b > 0, BLOCK_N=config.block_n, BLOCK_K=block_k,
        SPLIT=split, GLU=glu, HAS_BIAS=bias is not None, WSCALE=wscale, SCALE_BR=br, SCALE_BC=bc,
        EVEN_K=k % k_split == 0,
        num_warps=config.num_warps, num_stages=stages, **dependent_launch(x),
    )
    if split > 1:
        _multirow_reduce[(m, triton.cdiv(n, 1024))](
            part, bias if bias is not None else out, scales, out, m, n, out.stride(0), stride_s, SPLIT=split,
            BLOCK=1024, GLU=glu, HAS_BIAS=bias is not None, WSCALE=wscale, num_warps=4, **dependent_launch(x))
    return out.view(*x.shape[:-1], n)
