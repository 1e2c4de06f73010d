"""DSpark's greedy Markov drafting (vanilla head) with one Triton launch per draft position.

Each draft position k takes token_k = argmax(U_k + s * W2 W1[token_{k-1}]) over the draft vocabulary
(`DSparkDraft.draft_greedy`, the reference). In torch that is five small kernels a position (the W1
row gather, the W2 product, the cast, the add, the argmax) and eight positions a step, launched
one after the other because each reads the token the one before chose, and each reads all of W2
(the vocabulary times the rank: 78 MB at Qwen3's vocabulary and rank 256).

Here W2 is read once a step. The token before position k is almost always among the few best of
U_{k-1} (the bias re-ranks the top of the base logits), and the base logits of every position are known
before drafting starts: so the first launch computes the bias for a set of candidate tokens at once, the
anchor and the CANDIDATES best of each U_k (`candidate_ids`), while it reads W2. Each later launch reduces
the position before to its token, takes that token's bias from the stored candidates, or computes it from
W2 when the token is not one of them, and scores its own vocabulary blocks; a last launch reduces the
last position. Whichever way a bias is found it is the same tensor-core product of the same operands, so
the drafts do not depend on the candidates.

Arithmetic as the reference rounds it: the bias accumulates in fp32 and is rounded to W2's dtype (the
linear layer's output), then scaled, then added to the fp32 logits; ties go to the lowest id, as
`torch.argmax` breaks them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from blockspec.kernels import triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _candidate_bias(W1, W2, ids, id_ok, cols, col_ok, rank, stride_w1, stride_w2,
                        BLOCK_R: tl.constexpr, PRECISION: tl.constexpr):
        """W2[cols] W1[ids]^T in fp32, [BLOCK_V, BLOCK_C]: the Markov bias of each candidate token over a
        block of the vocabulary (ids outside id_ok give zeros). PRECISION "ieee" for fp32 drafters (no
        tf32 rounding of the operands)."""
        acc = tl.zeros([cols.shape[0], ids.shape[0]], tl.float32)
        for r0 in range(0, rank, BLOCK_R):
            rr = r0 + tl.arange(0, BLOCK_R)
            r_ok = rr < rank
            w = tl.load(W2 + cols.to(tl.int64)[:, None] * stride_w2 + rr[None, :],
                        mask=col_ok[:, None] & r_ok[None, :], other=0.0)
            e = tl.load(W1 + ids.to(tl.int64)[:, None] * stride_w1 + rr[None, :],
                        mask=id_ok[:, None] & r_ok[None, :], other=0.0)
            acc = tl.dot(w, tl.trans(e), acc, input_precision=PRECISION)
        return acc

    @triton.jit
    def _markov_position(Base, W1, W2, Anchors, D2T, Cands, CandBias, PartMax, PartIdx, Tokens,
                         stride_br, stride_bk, stride_w1, stride_w2, stride_cr, stride_cbr, stride_cbc,
                         stride_pr, stride_pk, stride_t,
                         k, vocab, rank, n_blocks, n_cands, scale,
                         BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
                         BLOCK_C: tl.constexpr, HAS_D2T: tl.constexpr, ROUND: tl.constexpr,
                         LOGITS: tl.constexpr, PRECISION: tl.constexpr):
        """Program (row, vocabulary block): the row's token at position k - 1 (the anchor at k = 0),
        then with LOGITS this block's maximum of position k's logits and its lowest argmax. At k = 0 it
        also stores this block of every candidate's bias (CandBias [R, n_cands, vocab]); later
        positions take the token's bias from there when it is a candidate (Cands [R, n_cands])."""
        row = tl.program_id(0).to(tl.int64)
        blk = tl.program_id(1)
        if k == 0:
            prev = tl.load(Anchors + row)
        else:
            parts = tl.arange(0, BLOCK_P)
            at = row * stride_pr + (k - 1) * stride_pk + parts
            maxima = tl.load(PartMax + at, mask=parts < n_blocks, other=float("-inf"))
            best = tl.argmax(maxima, 0, tie_break_left=True)
            draft = tl.load(PartIdx + row * stride_pr + (k - 1) * stride_pk + best)
            prev = draft + tl.load(D2T + draft) if HAS_D2T else draft
            if blk == 0:
                tl.store(Tokens + row * stride_t + k - 1, prev)
        if LOGITS:
            cols = blk * BLOCK_V + tl.arange(0, BLOCK_V)
            col_ok = cols < vocab
            slots = tl.arange(0, BLOCK_C)
            cand = tl.load(Cands + row * stride_cr + slots, mask=slots < n_cands, other=-1)
            slot = tl.min(tl.where(cand == prev, slots, BLOCK_C), 0)  # the token's first slot (the anchor's: 0)
            if (k > 0) & (slot < n_cands):
                bias = tl.load(CandBias + row * stride_cbr + slot * stride_cbc + cols, mask=col_ok, other=0.0)
            else:  # from W2: at k = 0 every candidate's bias (stored), else the token's alone in slot 0
                ids_ok = slots < tl.where(k == 0, n_cands, 1)
                acc = _candidate_bias(W1, W2, tl.where(slots == 0, prev, cand), ids_ok, cols, col_ok, rank,
                                      stride_w1, stride_w2, BLOCK_R, PRECISION)
                if ROUND:  # the linear layer's output dtype
                    acc = acc.to(W2.dtype.element_ty).to(tl.float32)
                if k == 0:
                    tl.store(CandBias + row * stride_cbr + slots.to(tl.int64)[None, :] * stride_cbc + cols[:, None],
                             acc, mask=col_ok[:, None] & (slots < n_cands)[None, :])
                bias = tl.sum(tl.where(slots[None, :] == 0, acc, 0.0), 1)
            logits = tl.load(Base + row * stride_br + k * stride_bk + cols, mask=col_ok, other=0.0) + bias * scale
            logits = tl.where(col_ok, logits, float("-inf"))
            local = tl.argmax(logits, 0, tie_break_left=True)
            tl.store(PartMax + row * stride_pr + k * stride_pk + blk, tl.max(logits, 0))
            tl.store(PartIdx + row * stride_pr + k * stride_pk + blk, blk * BLOCK_V + local)


BLOCK_V = 128  # vocabulary columns a program scores
BLOCK_R = 64  # rank columns a loop step multiplies
CANDIDATES = 2  # best base-logit tokens of each position whose bias the first launch computes
MAX_SLOTS = 64  # candidates a row stores at most: the first launch's [BLOCK_V, slots] fp32 product stays in registers
# A program scores one row, so every row reads all of W2: past four rows torch's product, which reads it
# once for all of them, is faster (H200, vocab 151936, rank 256, 7 positions in a CUDA graph, ms at 1 / 2 /
# 4 / 8 / 16 rows: 0.103 / 0.148 / 0.243 / 0.428 / 0.806 against torch's 0.298 / 0.313 / 0.331 / 0.367 / 0.435;
# benchmarks/data/step_speed/h200_2026-12-03_markov_once/)
MAX_ROWS = 4


def candidate_ids(base: Tensor, anchors: Tensor, d2t: Tensor | None, per_position: int = CANDIDATES) -> Tensor:
    """[R, 1 + n * (K - 1)] target ids whose bias the first launch computes: the anchor (the token before
    position 0), then the n best of U_k for k < K - 1 (the likeliest tokens before position k + 1), mapped
    to target ids; n is `per_position`, less where the vocabulary or MAX_SLOTS holds fewer."""
    r, k, vocab = base.shape
    take = min(per_position, vocab, (MAX_SLOTS - 1) // (k - 1)) if k > 1 else 0
    if not take:
        return anchors[:, None]
    # repeated argmax, not torch's top-k: over a vocabulary as large as Qwen3's that is a radix select of
    # several kernels (about 67 us at 6 x 151936 on an H200, as long as the drafting launches), an argmax one
    rest, picks = base[:, : k - 1], []
    for i in range(take):
        picks.append(rest.argmax(-1, keepdim=True))
        if i + 1 < take:
            rest = rest.scatter(-1, picks[-1], float("-inf"))
    top = torch.cat(picks, -1).reshape(r, -1)
    if d2t is not None:
        top = top + d2t[top]
    return torch.cat([anchors[:, None], top], 1)


def markov_greedy(base: Tensor, w1: Tensor, w2: Tensor, anchors: Tensor, d2t: Tensor | None,
                  scale: float, per_position: int = CANDIDATES) -> Tensor:
    """Greedy drafts [R, K] (target ids) of a vanilla Markov head: base [R, K, V] fp32 logits (the
    drafter's head, logit scale applied), w1 [V_target, rank], w2 [V, rank], anchors [R] target ids,
    d2t [V] draft-to-target offsets or None, scale the logit scale of the bias; `per_position`: the
    candidates a position adds (`candidate_ids`; the drafts do not depend on it). CUDA-graph capturable."""
    r, k, vocab = base.shape
    rank = w2.shape[1]
    tokens = torch.empty(r, k, dtype=torch.int64, device=base.device)
    if r == 0 or k == 0:
        return tokens
    n_blocks = triton.cdiv(vocab, BLOCK_V)
    part_max = torch.empty(r, k, n_blocks, dtype=torch.float32, device=base.device)
    part_idx = torch.empty(r, k, n_blocks, dtype=torch.int64, device=base.device)
    base = base if base.stride(-1) == 1 else base.contiguous()
    anchors = anchors.long()
    cands = candidate_ids(base, anchors, d2t, per_position).contiguous()
    n_cands = cands.shape[1]
    cand_bias = torch.empty(r, n_cands, vocab, dtype=torch.float32, device=base.device)
    for pos in range(k + 1):  # position k only reduces the last position's maxima to its token
        logits = pos < k
        _markov_position[(r, n_blocks if logits else 1)](
            base, w1, w2, anchors, d2t if d2t is not None else anchors, cands, cand_bias, part_max, part_idx,
            tokens, base.stride(0), base.stride(1), w1.stride(0), w2.stride(0), cands.stride(0),
            cand_bias.stride(0), cand_bias.stride(1), part_max.stride(0), part_max.stride(1), tokens.stride(0),
            pos, vocab, rank, n_blocks, n_cands, scale,
            BLOCK_V=BLOCK_V, BLOCK_R=max(16, min(BLOCK_R, triton.next_power_of_2(rank))),
            BLOCK_P=triton.next_power_of_2(n_blocks), BLOCK_C=max(16, triton.next_power_of_2(n_cands)),
            HAS_D2T=d2t is not None, ROUND=w2.dtype != torch.float32, LOGITS=logits,
            PRECISION="ieee" if w2.dtype == torch.float32 else "tf32", num_warps=4)
    return tokens
