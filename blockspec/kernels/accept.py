"""Acceptance by token match in one Triton program per request.

The torch rule (`blockspec.sample.verify._verify_ids` with `_draft_lengths`) is about twenty small
ops over [R, K + 1] int64 tensors: at batch 1 each is a kernel launch of a few microseconds of work
and tens of microseconds of host time, in every greedy speculative step. This kernel reads a
request's row ids, drafts and draft length once and writes what the rule returns: the accepted count
and the emitted tokens (the accepted drafts, then the row's id at the first mismatch, then -1), with
a count of 0 and every token -1 for a request whose id at that first mismatch is bad (-1). A draft
id outside [0, vocab) ends the draft there.
"""

from __future__ import annotations

import torch
from torch import Tensor

from blockspec.kernels import triton

NO_VOCAB = 1 << 62  # a bound no token id reaches: the rows' ids are already target ids

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _accept_matching(Ids, Drafts, Lens, NumAcc, Out, stride_i, stride_d, stride_o, k, vocab,
                         BLOCK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        in_k = cols < k
        drafts = tl.load(Drafts + r * stride_d + cols, mask=in_k, other=-1)
        ids = tl.load(Ids + r * stride_i + cols, mask=cols <= k, other=0)
        # the draft ends at its length or at its first id outside [0, vocab)
        invalid = in_k & ((drafts < 0) | (drafts >= vocab))
        n = tl.minimum(tl.load(Lens + r), tl.min(tl.where(invalid, cols, k), 0).to(tl.int64))
        # accepted: drafts before the first one that differs from its row's id, at most n
        a = tl.min(tl.where((cols < n) & (drafts != ids), cols, n), 0)
        nxt = tl.sum(tl.where(cols == a, ids, 0), 0)
        # a bad row at a (nxt -1, the row its next token comes from) fails the request after its accepted
        # drafts, as plain decoding commits them before it reads that row; rows past it follow rejected drafts
        out = tl.where(cols < a, drafts, tl.where(cols == a, nxt, -1))
        tl.store(Out + r * stride_o + cols, out, mask=cols <= k)
        tl.store(NumAcc + r, a)


def accept_matching(ids: Tensor, drafts: Tensor, draft_lens: Tensor, vocab: int | None) -> tuple[Tensor, Tensor]:
    """(num_accepted [R], out_tokens [R, K + 1]) for row ids [R, K + 1], drafts [R, K] and draft
    lengths [R] (int64, on the GPU), as `verify._verify_ids(ids, drafts, _draft_lengths(...))` gives."""
    r, k = drafts.shape
    num_acc = torch.empty(r, dtype=torch.int64, device=ids.device)
    out = torch.empty(r, k + 1, dtype=torch.int64, device=ids.device)
    if r:
        _accept_matching[(r,)](ids, drafts, draft_lens, num_acc, out, ids.stride(0), drafts.stride(0), out.stride(0),
                               k, NO_VOCAB if vocab is None else vocab, BLOCK=triton.next_power_of_2(k + 1))
    return num_acc, out
