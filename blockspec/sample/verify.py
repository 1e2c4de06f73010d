"""Acceptance rules for one verify step, vectorised over requests, with no host sync.

Shapes: drafts [R, K] int64 (-1 after each request's own draft), draft_lens [R] in 0..K, target
rows [R, K+1, V] where row i predicts the token after drafts[:, :i] (row K is the bonus row).
Target tensors are processed log-probs from ``process_logits`` (greedy rows: shifted scores),
and ``params`` is the RowParams of those R*(K+1) rows, request-major.

Every rule returns ``(num_accepted [R] int64, out_tokens [R, K+1] int64)``: out_tokens[r, :a] are
the accepted drafts, out_tokens[r, a] the recovered or bonus token, the rest -1. A request with a bad
row (NaN, +inf, all -inf: no token can be sampled) among the rows it reads, 0..a, gets out_tokens[r, a] = -1
after its accepted drafts, so the engine commits those drafts as plain decoding would (one that stops the
request ends it there, the bad row never read) and then fails it with a clear error while the others
continue; a bad row past them follows drafts that were not accepted, which plain decoding never reaches,
and fails nothing (a grammar's mask after a draft that ends it, with min_tokens banning EOS, is such a row).
A draft id outside [0, V) inside the draft truncates the block there (it is treated as the end of the draft).

Greedy requests (temperature 0) follow ``verify_greedy`` under every rule.

Randomness (rng.py): acceptance uniforms use STREAM_ACCEPT and the residual STREAM_RESIDUAL, both
keyed with ``round_`` so no value observed in one round is reused in a later one. The bonus token
(every draft accepted) is drawn with STREAM_TARGET keyed by (seed, absolute position) only: it is
an ordinary target sample at a position that is committed as soon as it is drawn, so the value
is never reused, and a fully accepted step draws its bonus exactly as plain sampling would.

Memory: the greedy path holds ids only. The probabilistic paths work on the given tensors plus
chunked temporaries: residual/bonus draws and block residual masses run over request chunks of
at most CHUNK_ELEMS vocab elements (about 50 bytes each, ~400 MiB at the default).
"""

from __future__ import annotations

import torch
from torch import Tensor

from blockspec.kernels.accept import accept_matching as accept_kernel
from blockspec.kernels.ops import use_kernels
from blockspec.sample.processors import CHUNK_ELEMS, RowParams, bad_rows, row_chunks
from blockspec.sample.rng import STREAM_ACCEPT, STREAM_RESIDUAL, STREAM_TARGET, keyed_uniform, row_key
from blockspec.sample.sampler import greedy_ids, gumbel_argmax, sample_processed

__all__ = ["bad_rows", "verify_block", "verify_greedy", "verify_sample_and_match", "verify_standard"]


def verify_greedy(target: Tensor, drafts: Tensor, draft_lens: Tensor) -> tuple[Tensor, Tensor]:
    """T = 0: accept the longest prefix with draft == argmax; then the argmax at the first
    mismatch (or of the bonus row). ``target`` is logits [R, K+1, V] or argmax ids [R, K+1]
    (ids of -1 mark bad rows)."""
    if target.is_floating_point():
        r, k1, vocab = target.shape
        return accept_matching(greedy_ids(target.reshape(r * k1, vocab)).view(r, k1), drafts, draft_lens, vocab)
    return accept_matching(target, drafts, draft_lens, None)


def verify_sample_and_match(target: Tensor, drafts: Tensor, draft_lens: Tensor,
                            params: RowParams) -> tuple[Tensor, Tensor]:
    """Sample every row with STREAM_TARGET noise keyed (seed, absolute position), accept while the
    sample equals the draft, emit the sample at the first mismatch (sampling.md 1.3, 9.3).

    Each row's token is exactly what ``sample`` gives at that position, so with the same seed and
    logits the output equals plain sampling token for token. Lossless for any drafter; for
    one-hot drafts it has the law of token-wise rejection sampling."""
    r, k1, vocab = target.shape
    if target.device.type == "cpu":
        ids = _sampled_while_matching(target, drafts, _draft_lengths(drafts, draft_lens, vocab), params)
    else:
        ids = sample_processed(target.reshape(r * k1, vocab), params).view(r, k1)
    return accept_matching(ids, drafts, draft_lens, vocab)


def _sampled_while_matching(target: Tensor, drafts: Tensor, lens: Tensor, params: RowParams) -> Tensor:
    """`sample_processed`'s ids [R, K+1] on the CPU for the rows the rule reads: row by row in position order,
    each request's sampled rows while its drafts match, since the noise (tens of operations a vocabulary
    element) is most of a row's cost and a mismatch ends what its request emits. A row past the first
    mismatch keeps its greedy id: never emitted, and -1 exactly where the row is bad, which fails its
    request as sampling it would."""
    r, k1, vocab = target.shape
    flat = target.reshape(r * k1, vocab)
    ids = greedy_ids(flat)
    sampled = ((params.temperature > 0) & (ids >= 0)).tolist()
    drafted, n = drafts.tolist(), lens.tolist()
    live = list(range(r))
    for i in range(k1):
        rows = [q * k1 + i for q in live if sampled[q * k1 + i]]
        if rows:
            at = torch.tensor(rows)
            ids[at] = gumbel_argmax(flat[at], row_key(params.seed[at], params.position[at], STREAM_TARGET, None))
        if i < k1 - 1:
            row = ids[i::k1].tolist()  # position i's token of every request
            live = [q for q in live if i < n[q] and drafted[q][i] == row[q]]
        if not live:
            break
    return ids.view(r, k1)


def verify_standard(target: Tensor, q_probs: Tensor | None, drafts: Tensor, draft_lens: Tensor,
                    params: RowParams, round_: Tensor,
                    chunk_elems: int = CHUNK_ELEMS) -> tuple[Tensor, Tensor]:
    """Token-wise rejection sampling (Leviathan et al.; sampling.md 1.2).

    Accept draft i while u_i <= p_i(X_i) / q_i(X_i) (rejected if q_i(X_i) = 0); at the first
    rejection emit y ~ max(p - q, 0) / Z (p itself if Z = 0); if all are accepted emit the bonus
    y ~ p_{K+1}. ``q_probs`` [R, K, V] is the distribution each draft was drawn from; None means
    one-hot (greedy) drafts: accept iff u <= p(d), residual = p with d removed (closed form)."""
    lens, row_bad, greedy_req, greedy_out = _common(target, drafts, draft_lens, params)
    log_ratio, u = _ratios(target, q_probs, drafts, params, round_)
    k = drafts.shape[1]
    steps = torch.arange(k, device=drafts.device).unsqueeze(0)
    accept = (u.log() <= log_ratio) & (steps < lens.unsqueeze(1))
    a = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)
    log_rho = torch.zeros(a.shape, dtype=torch.float64, device=a.device)
    nxt = _next_token(target, q_probs, drafts, a, lens, log_rho, params, round_, chunk_elems)
    return _finish(a, nxt, drafts, row_bad, greedy_req, greedy_out)


def verify_block(target: Tensor, q_probs: Tensor | None, drafts: Tensor, draft_lens: Tensor,
                 params: RowParams, round_: Tensor,
                 chunk_elems: int = CHUNK_ELEMS) -> tuple[Tensor, Tensor]:
    """Block verification (Sun et al., ICLR 2025; sampling.md 1.4), same arguments as
    ``verify_standard``. With gamma the request's draft length:

        rho_0 = 1, rho_i = min(1, rho_{i-1} p_i(X_i) / q_i(X_i))
        Z_i = sum_x max(rho_i p_{i+1}(x) - q_{i+1}(x), 0)
        h_i = Z_i / (Z_i + 1 - rho_i) (1 if the denominator is 0) for i < gamma, h_gamma = rho_gamma
        tau = max{i <= gamma : eta_i <= h_i} (0 if none), a max over ALL i
        y ~ p_{gamma+1} if tau = gamma, else max(rho_tau p_{tau+1} - q_{tau+1}, 0) / Z_tau

    A truncated block uses h = rho at its last real position, never a placeholder row. One-hot
    drafts use the closed forms rho_i = prod p_j(d_j), Z_i = rho_i (1 - p_{i+1}(d_{i+1})); there
    block and token-wise acceptance have the same law (sampling.md 1.4)."""
    lens, row_bad, greedy_req, greedy_out = _common(target, drafts, draft_lens, params)
    log_ratio, eta = _ratios(target, q_probs, drafts, params, round_)
    r, k = drafts.shape
    # a bad row (no token to sample: an emptied mask) is a continuation of probability 0, not NaN, whose h would
    # read as 1 and choose a tau past it
    log_ratio = log_ratio.masked_fill(row_bad[:, :k], float("-inf"))
    log_rho = [torch.zeros(r, dtype=torch.float64, device=drafts.device)]
    for i in range(k):
        log_rho.append(torch.clamp(log_rho[-1] + log_ratio[:, i], max=0.0))
    log_rho_t = torch.stack(log_rho, dim=1)  # [R, K+1], column i = log rho_i
    rho = log_rho_t.exp()
    mass = _residual_mass(target, q_probs, drafts, rho[:, :k], log_ratio, chunk_elems)  # Z_0..Z_{K-1}
    mass = mass.masked_fill(row_bad[:, :k], 0.0)
    z_next = torch.cat([mass[:, 1:], torch.zeros_like(mass[:, :1])], dim=1)  # Z_i for i = 1..K
    denom = z_next + 1 - rho[:, 1:]
    h = torch.where(denom > 0, z_next / denom, 1.0)
    steps = torch.arange(1, k + 1, device=drafts.device).unsqueeze(0)
    h = torch.where(steps == lens.unsqueeze(1), rho[:, 1:], h)
    chosen = (eta <= h) & (steps <= lens.unsqueeze(1))
    tau = torch.where(chosen, steps, 0).amax(dim=1) if k > 0 else torch.zeros_like(lens)
    nxt = _next_token(target, q_probs, drafts, tau, lens, log_rho_t.gather(1, tau.unsqueeze(1)).squeeze(1),
                      params, round_, chunk_elems)
    return _finish(tau, nxt, drafts, row_bad, greedy_req, greedy_out)


def accept_matching(ids: Tensor, drafts: Tensor, draft_lens: Tensor, vocab: int | None) -> tuple[Tensor, Tensor]:
    """Accept while draft == the row's token id ([R, K + 1] ids, -1 for a bad row), drafts cut at their
    length and at the first id outside [0, vocab). One Triton program per request on the GPU
    (`kernels.accept`), a loop over host ints on the CPU, these torch ops elsewhere: the same result."""
    if use_kernels(ids):
        return accept_kernel(ids.contiguous(), drafts.contiguous(), draft_lens.contiguous(), vocab)
    if ids.device.type == "cpu":
        return _accept_on_host(ids, drafts, draft_lens, vocab)
    return _verify_ids(ids, drafts, _draft_lengths(drafts, draft_lens, vocab))


def _accept_on_host(ids: Tensor, drafts: Tensor, draft_lens: Tensor, vocab: int | None) -> tuple[Tensor, Tensor]:
    """The torch rule (`_verify_ids` after `_draft_lengths`) over Python ints: on the CPU a step's few rows
    cost less read out whole than the rule's thirty small tensor ops cost to dispatch."""
    k = drafts.shape[1]
    counts, rows = [], []
    for row, draft, n in zip(ids.tolist(), drafts.tolist(), draft_lens.tolist()):
        n = next((j for j, d in enumerate(draft[:n]) if d < 0 or (vocab is not None and d >= vocab)), min(n, k))
        a = 0
        while a < n and draft[a] == row[a]:
            a += 1
        counts.append(a)  # row[a] -1 (the row its next token comes from is bad): it fails after its drafts
        rows.append(draft[:a] + [row[a]] + [-1] * (k - a))
    out = torch.tensor(rows, dtype=torch.int64).view(len(rows), k + 1)
    return torch.tensor(counts, dtype=torch.int64), out


def _draft_lengths(drafts: Tensor, draft_lens: Tensor, vocab: int | None) -> Tensor:
    """Draft length per request, cut at the first id outside [0, vocab)."""
    valid = drafts >= 0
    if vocab is not None:
        valid &= drafts < vocab
    return torch.minimum(draft_lens, valid.to(torch.int64).cumprod(dim=1).sum(dim=1))


def _emit(a: Tensor, nxt: Tensor, drafts: Tensor) -> Tensor:
    """out_tokens from the accepted count and the next token; a request whose next token's row is bad
    (nxt -1) gets its accepted drafts and -1 after them: plain decoding commits those drafts (a stop among them
    ends the request there) before it reads the bad row, which fails the request at the commit."""
    r, k = drafts.shape
    cols = torch.arange(k + 1, device=drafts.device).unsqueeze(0)
    padded = torch.cat([drafts, drafts.new_full((r, 1), -1)], dim=1)
    return torch.where(cols < a.unsqueeze(1), padded, torch.where(cols == a.unsqueeze(1), nxt.unsqueeze(1), -1))


def _verify_ids(ids: Tensor, drafts: Tensor, lens: Tensor) -> tuple[Tensor, Tensor]:
    """Accept while draft == the row's token id; emit the row's id at the first mismatch."""
    k = drafts.shape[1]
    steps = torch.arange(k, device=drafts.device).unsqueeze(0)
    match = (drafts == ids[:, :k]) & (steps < lens.unsqueeze(1))
    a = match.to(torch.int64).cumprod(dim=1).sum(dim=1)
    nxt = ids.gather(1, a.unsqueeze(1)).squeeze(1)
    return a, _emit(a, nxt, drafts)


def _common(target: Tensor, drafts: Tensor, draft_lens: Tensor,
            params: RowParams) -> tuple[Tensor, Tensor, Tensor, tuple[Tensor, Tensor]]:
    """Draft lengths, bad rows, greedy requests and their verify_greedy result (ids only)."""
    r, k1, vocab = target.shape
    ids = greedy_ids(target.reshape(r * k1, vocab)).view(r, k1)
    lens = _draft_lengths(drafts, draft_lens, vocab)
    greedy_req = params.temperature.view(r, k1)[:, 0] <= 0
    return lens, ids < 0, greedy_req, _verify_ids(ids, drafts, lens)


def _ratios(target: Tensor, q_probs: Tensor | None, drafts: Tensor, params: RowParams,
            round_: Tensor) -> tuple[Tensor, Tensor]:
    """log(p_i(X_i) / q_i(X_i)) [R, K] float64 (-inf where q_i(X_i) = 0) and the acceptance
    uniforms [R, K] keyed by (seed, position of row i, STREAM_ACCEPT, round_)."""
    r, k = drafts.shape
    idx = drafts.clamp(0, target.shape[2] - 1).unsqueeze(2)
    log_p = target[:, :k].gather(2, idx).squeeze(2).to(torch.float64)
    if q_probs is None:
        log_ratio = log_p
    else:
        log_q = q_probs.gather(2, idx).squeeze(2).to(torch.float64).log()
        log_ratio = torch.where(log_q > float("-inf"), log_p - log_q, float("-inf"))
    k1 = k + 1
    seed = params.seed.view(r, k1)[:, :k].reshape(-1)
    position = params.position.view(r, k1)[:, :k].reshape(-1)
    u = keyed_uniform(seed, position, STREAM_ACCEPT, round_.repeat_interleave(k), 1).view(r, k)
    return log_ratio, u


def _residual_mass(target: Tensor, q_probs: Tensor | None, drafts: Tensor, rho: Tensor, log_ratio: Tensor,
                   chunk_elems: int) -> Tensor:
    """Z_i = sum_x max(rho_i p_{i+1}(x) - q_{i+1}(x), 0) for i = 0..K-1, [R, K] float64.

    p_{i+1} is target row i. One-hot drafts: rho_i (1 - p_{i+1}(d_{i+1})), where p_{i+1}(d_{i+1})
    is exp(log_ratio[:, i]) since q = 1 there. Full q: a vocab reduction in request chunks."""
    if q_probs is None:
        return rho * (1 - log_ratio.exp())
    r, k = drafts.shape
    mass = torch.empty_like(rho)
    for s in row_chunks(r, k * target.shape[2], chunk_elems):
        p = target[s, :k].to(torch.float64).exp()
        mass[s] = (rho[s].unsqueeze(2) * p - q_probs[s].to(torch.float64)).clamp_(min=0).sum(dim=2)
    return mass


def _next_token(target: Tensor, q_probs: Tensor | None, drafts: Tensor, a: Tensor, lens: Tensor,
                log_rho: Tensor, params: RowParams, round_: Tensor, chunk_elems: int) -> Tensor:
    """The token after the accepted prefix, [R]: bonus y ~ p at row ``lens`` (STREAM_TARGET) when
    a == lens, else the residual max(rho_a p - q, 0) at row a (STREAM_RESIDUAL, round-keyed),
    falling back to p when the residual has no mass. Gumbel-max over request chunks."""
    r, k1, vocab = target.shape
    k = k1 - 1
    flat = target.reshape(r * k1, vocab)
    rows = torch.arange(r, device=a.device) * k1 + a
    seed, position = params.seed[rows], params.position[rows]
    bonus = (a >= lens).unsqueeze(1)
    draft_at = drafts.gather(1, a.clamp(max=k - 1).unsqueeze(1)).clamp(0, vocab - 1) if k > 0 else None
    out = torch.empty_like(a)
    for s in row_chunks(r, vocab, chunk_elems):
        log_p = flat[rows[s]]
        scores = log_p
        if k > 0:
            residual = _residual_scores(log_p, q_probs, draft_at[s], a[s].clamp(max=k - 1), log_rho[s], s)
            empty = residual.amax(dim=1, keepdim=True) == float("-inf")
            scores = torch.where(bonus[s] | empty, log_p, residual)
        keys = torch.where(bonus[s].squeeze(1), row_key(seed[s], position[s], STREAM_TARGET, None),
                           row_key(seed[s], position[s], STREAM_RESIDUAL, round_[s]))
        out[s] = gumbel_argmax(scores, keys)
    return out


def _residual_scores(log_p: Tensor, q_probs: Tensor | None, draft: Tensor, row: Tensor, log_rho: Tensor,
                     s: slice) -> Tensor:
    """Unnormalised log of max(rho p - q, 0) for a chunk of requests, [c, V] float32.

    One-hot q: p with the draft token removed (rho cancels, since rho p(d) <= 1)."""
    if q_probs is None:
        return log_p.scatter(1, draft, float("-inf"))
    log_q = q_probs[s].gather(1, row.view(-1, 1, 1).expand(-1, 1, q_probs.shape[2])).squeeze(1).log()
    shifted = log_p + log_rho.to(torch.float32).unsqueeze(1)
    return torch.where(log_q < shifted, shifted + torch.log1p(-torch.exp(log_q - shifted)), float("-inf"))


def _finish(a: Tensor, nxt: Tensor, drafts: Tensor, row_bad: Tensor, greedy_req: Tensor,
            greedy_out: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """Emit the probabilistic result, overriding greedy requests with their verify_greedy result. A request with a
    bad row among the rows it read, 0..a, fails there, after its accepted drafts (nxt -1)."""
    rows = torch.arange(row_bad.shape[1], device=a.device).unsqueeze(0)
    nxt = torch.where((row_bad & (rows <= a.unsqueeze(1))).any(dim=1), -1, nxt)
    num = torch.where(greedy_req, greedy_out[0], a)
    return num, torch.where(greedy_req.unsqueeze(1), greedy_out[1], _emit(a, nxt, drafts))
