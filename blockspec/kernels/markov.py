"""DSpark's greedy Markov drafting (vanilla head) with one Triton launch per draft position.

Each draft position k takes token_k = argmax(U_k + s * W2 W1[token_{k-1}]) over the draft vocabulary
(`DSparkDraft.draft_greedy`, the reference). In torch that is five small kernels a position (the W1
row gather, the W2 product, the cast, the add, the argmax) and eight positions a step, launched
one after the other because each reads the token the one before chose: at batch 1 on a small model
they cost more device time than the drafter's layers. Here position k's launch first reduces
position k - 1's per-block maxima to its token, then computes its own bias, logits and per-block
maxima over blocks of the vocabulary in parallel; a last launch reduces the last position's.

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
    def _markov_position(Base, W1, W2, Anchors, D2T, PartMax, PartIdx, Tokens,
                         stride_br, stride_bk, stride_w1, stride_w2, stride_pr, stride_pk, stride_t,
                         k, vocab, rank, n_blocks, scale,
                         BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
                         HAS_D2T: tl.constexpr, ROUND: tl.constexpr, LOGITS: tl.constexpr):
        """Program (row, vocabulary block): the row's token at position k - 1 (the anchor at k = 0),
        then with LOGITS this block's maximum of position k's logits and its lowest argmax."""
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
            acc = tl.zeros([BLOCK_V], tl.float32)
            for r0 in range(0, rank, BLOCK_R):
                rr = r0 + tl.arange(0, BLOCK_R)
                r_ok = rr < rank
                e = tl.load(W1 + prev.to(tl.int64) * stride_w1 + rr, mask=r_ok, other=0.0).to(tl.float32)
                w = tl.load(W2 + cols.to(tl.int64)[:, None] * stride_w2 + rr[None, :],
                            mask=col_ok[:, None] & r_ok[None, :], other=0.0).to(tl.float32)
                acc += tl.sum(w * e[None, :], 1)
            if ROUND:  # the linear layer's output dtype
                acc = acc.to(W2.dtype.element_ty).to(tl.float32)
            logits = tl.load(Base + row * stride_br + k * stride_bk + cols, mask=col_ok, other=0.0) + acc * scale
            logits = tl.where(col_ok, logits, float("-inf"))
            local = tl.argmax(logits, 0, tie_break_left=True)
            tl.store(PartMax + row * stride_pr + k * stride_pk + blk, tl.max(logits, 0))
            tl.store(PartIdx + row * stride_pr + k * stride_pk + blk, blk * BLOCK_V + local)


BLOCK_V = 128  # vocabulary columns a program scores
BLOCK_R = 64  # rank columns a loop step multiplies
# A program scores one row, so every row reads all of W2: past two rows torch's product, which reads it
# once for all of them, is faster (H200, vocab 151936, rank 256, 7 positions in a CUDA graph: 0.22
# against 0.30 ms at one row, 0.29 against 0.31 at two, 0.44 against 0.32 at four, 1.45 against 0.43 at 16)
MAX_ROWS = 2


def markov_greedy(base: Tensor, w1: Tensor, w2: Tensor, anchors: Tensor, d2t: Tensor | None,
                  scale: float) -> Tensor:
    """Greedy drafts [R, K] (target ids) of a vanilla Markov head: base [R, K, V] fp32 logits (the
    drafter's head, logit scale applied), w1 [V_target, rank], w2 [V, rank], anchors [R] target ids,
    d2t [V] draft-to-target offsets or None, scale the logit scale of the bias. CUDA-graph capturable."""
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
    for pos in range(k + 1):  # position k only reduces the last position's maxima to its token
        logits = pos < k
        _markov_position[(r, n_blocks if logits else 1)](
            base, w1, w2, anchors, d2t if d2t is not None else anchors, part_max, part_idx, tokens,
            base.stride(0), base.stride(1), w1.stride(0), w2.stride(0), part_max.stride(0), part_max.stride(1),
            tokens.stride(0), pos, vocab, rank, n_blocks, scale,
            BLOCK_V=BLOCK_V, BLOCK_R=min(BLOCK_R, triton.next_power_of_2(rank)),
            BLOCK_P=triton.next_power_of_2(n_blocks), HAS_D2T=d2t is not None, ROUND=w2.dtype != torch.float32,
            LOGITS=logits, num_warps=4)
    return tokens
