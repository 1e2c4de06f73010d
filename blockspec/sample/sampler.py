"""Sampling tokens from processed logits: greedy ids, seeded Gumbel-max, draft sampling, logprobs.

A sampled row's token is argmax(processed_logprobs + gumbel(seed, position, stream)). The noise is
a pure function of its key (rng.py), so the token a row gets does not depend on the batch, and a
verify row at absolute position t gets the same token as the plain decode step at t.
Bad rows (NaN, +inf, all -inf) get the sentinel id -1 instead of an out-of-range token.
"""

from __future__ import annotations

import torch
from torch import Tensor

from blockspec.sample.processors import (CHUNK_ELEMS, RowParams, features, needs_full_processing,
                                         process_logits, row_chunks)
from blockspec.kernels.ops import use_kernels
from blockspec.kernels.gumbel import greedy_ids_kernel, gumbel_argmax_kernel
from blockspec.sample.rng import STREAM_DRAFT, STREAM_TARGET, gumbel_from_keys, row_key


CPU_NOISE_BLOCK = 1 << 18
"""Row x vocab elements of Gumbel noise a CPU builds at once: its int64 and float64 words (2 MiB) stay in cache
across the hash's passes, several times faster than a pass over all of a batch's noise at once."""


def greedy_ids(logits: Tensor) -> Tensor:
    """Argmax over the last dim (ties -> lowest id), -1 for bad rows; ids only, no vocab buffer. On the
    GPU one Triton pass over the logits (`greedy_ids_kernel`), the same ids."""
    if use_kernels(logits) and logits.stride(-1) == 1:
        return greedy_ids_kernel(logits.reshape(-1, logits.shape[-1])).view(logits.shape[:-1])
    values, ids = logits.max(dim=-1)
    return torch.where(torch.isfinite(values), ids, -1)


def sample(logits: Tensor, p: RowParams) -> Tensor:
    """One token per row [N] int64 from raw logits [N, V]: the plain (non-speculative) sampler.

    Batches that are all greedy with nothing to apply take the raw-logits argmax; this is the same
    token the processed path gives (process_logits keeps greedy rows argmax-exact)."""
    if not needs_full_processing(p):
        return greedy_ids(logits)
    return sample_processed(process_logits(logits, p), p)


def gumbel_argmax(scores: Tensor, keys: Tensor) -> Tensor:
    """argmax(scores + Gumbel noise of the rows' keys) per row [N]: a Gumbel-max sample of each row's
    distribution. One Triton pass on the GPU (gumbel_kernel), the torch ops of rng elsewhere: the
    same token either way."""
    if use_kernels(scores) and scores.dtype == torch.float32:
        return gumbel_argmax_kernel(scores, keys)
    n, vocab = scores.shape
    if scores.device.type != "cpu" or n * vocab <= CPU_NOISE_BLOCK:
        return (scores + gumbel_from_keys(keys, vocab)).argmax(dim=1)
    # blocks small enough that the hash's dozen passes stay in cache, with a running argmax: the first
    # block holding the row's maximum wins (strictly greater replaces), as argmax over the whole row picks
    rows = max(1, CPU_NOISE_BLOCK // min(vocab, CPU_NOISE_BLOCK))
    cols = CPU_NOISE_BLOCK // rows
    out = torch.empty(n, dtype=torch.int64)
    for r in range(0, n, rows):
        best = torch.full((min(n, r + rows) - r,), float("-inf"), dtype=scores.dtype)
        ids = torch.zeros_like(best, dtype=torch.int64)
        for c in range(0, vocab, cols):
            w = min(cols, vocab - c)
            vals, at = (scores[r:r + rows, c:c + w] + gumbel_from_keys(keys[r:r + rows], w, start=c)).max(dim=1)
            better = vals > best
            best = torch.where(better, vals, best)
            ids = torch.where(better, at + c, ids)
        out[r:r + rows] = ids
    return out


def sample_processed(processed: Tensor, p: RowParams, stream: int = STREAM_TARGET,
                     round_: Tensor | None = None, chunk_elems: int = CHUNK_ELEMS) -> Tensor:
    """Tokens [N] from processed log-probs [N, V]: greedy rows argmax, other rows Gumbel-max with
    noise keyed (seed, position, stream, round_). Noise is built in row chunks (CHUNK_ELEMS)."""
    f = features(p)
    if f.sampled and not f.greedy:  # every row draws: no greedy pass, -1 where it would give -1
        drawn = [gumbel_argmax(processed[s], row_key(p.seed[s], p.position[s], stream,
                                                     None if round_ is None else round_[s]))
                 for s in row_chunks(processed.shape[0], processed.shape[1], chunk_elems)]
        # greedy_ids' -1 rows hold a NaN or nothing above -inf (a drawing row's log-probabilities are never
        # +inf): those whose maximum is not above -inf, as NaN compares false
        tokens = drawn[0] if len(drawn) == 1 else torch.cat(drawn)
        return torch.where(processed.amax(dim=1) > float("-inf"), tokens, -1)
    ids = greedy_ids(processed)
    if not f.sampled:
        return ids
    greedy = p.temperature <= 0
    if processed.device.type == "cpu" and bool(greedy.any()):
        # the host knows which rows draw (no device sync to ask): noise, tens of operations an element, for those alone
        rows = torch.nonzero(~greedy & (ids >= 0)).squeeze(1)
        out = ids.clone()
        for c in row_chunks(rows.numel(), processed.shape[1], chunk_elems):
            r = rows[c]
            out[r] = gumbel_argmax(processed[r], row_key(p.seed[r], p.position[r], stream,
                                                          None if round_ is None else round_[r]))
        return out
    out = torch.empty_like(ids)
    for s in row_chunks(processed.shape[0], processed.shape[1], chunk_elems):
        drawn = gumbel_argmax(processed[s], row_key(p.seed[s], p.position[s], stream,
                                                     None if round_ is None else round_[s]))
        out[s] = torch.where(greedy[s] | (ids[s] < 0), ids[s], drawn)
    return out


def sample_draft(draft_logits: Tensor, p: RowParams, round_: Tensor, greedy: bool = False,
                 chunk_elems: int = CHUNK_ELEMS) -> tuple[Tensor, Tensor | None]:
    """Draft tokens [R, K] and the distribution each was drawn from, q [R, K, V] float32.

    ``p`` has R*K rows (request-major) and describes the draft-side processing; ``round_`` [R] is
    the per-request verify-round value (rng.py). Noise is STREAM_DRAFT, so drafts never share
    noise with acceptance, residual or target sampling. q is exactly the law of the Gumbel-max
    draw: exp of the processed log-probs, one-hot for greedy (temperature 0) rows, NaN for bad
    rows (whose token is -1; the verifier truncates the draft there).
    ``greedy=True``: argmax of the raw draft logits, no q (the DFlash/DSpark default; ids only).
    Memory: q reuses the processed-logits buffer (exponentiated in place); other temporaries are
    per row chunk (CHUNK_ELEMS).
    """
    r, k, vocab = draft_logits.shape
    flat = draft_logits.reshape(r * k, vocab)
    if greedy:
        return greedy_ids(flat).view(r, k), None
    q = process_logits(flat, p, chunk_elems)
    tokens = sample_processed(q, p, STREAM_DRAFT, round_.repeat_interleave(k), chunk_elems)
    is_greedy = (p.temperature <= 0).unsqueeze(1)
    for s in row_chunks(r * k, vocab, chunk_elems):
        chunk = q[s].exp_()
        one_hot = torch.zeros_like(chunk).scatter_(1, tokens[s].clamp(min=0).unsqueeze(1), 1.0)
        chunk.copy_(torch.where(is_greedy[s], one_hot, chunk)).masked_fill_((tokens[s] < 0).unsqueeze(1), float("nan"))
    return tokens.view(r, k), q.view(r, k, vocab)


def logprobs(processed: Tensor, tokens: Tensor, top_n: int, normalize: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """Log-probs of the chosen tokens [N] and the top_n alternatives ([N, top_n] ids and values).

    Rows are renormalised with one logsumexp (greedy rows hold shifted scores; for sampled rows
    it is a no-op up to rounding), so no [N, V] copy is made; `normalize=False` gives the scores
    themselves (raw logits). Tokens of -1 get NaN.
    """
    lse = torch.logsumexp(processed, dim=-1) if normalize else processed.new_zeros(processed.shape[0])
    chosen = processed.gather(-1, tokens.clamp(min=0).unsqueeze(-1)).squeeze(-1) - lse
    chosen = chosen.masked_fill(tokens < 0, float("nan"))
    top_lp, top_ids = processed.topk(top_n, dim=-1)
    return chosen, top_ids, top_lp - lse.unsqueeze(-1)
