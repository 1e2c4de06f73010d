"""Per-row logits processing: the one function that turns target (or draft) logits into the
distribution plain sampling uses at that row.

Plain decode rows and speculative verify rows go through the same code, so a verify row whose
history (penalty counts, min_tokens progress) has been advanced through the draft prefix gets
exactly the distribution the non-speculative sampler would have used (sampling.md 6).

Order (vLLM's, V1 and Model Runner V2 alike):

0. the structured-output bitmask (tokens a row's grammar forbids -> -inf),
1. logit bias (sparse additive; bad-word bans come as -inf entries, where vLLM bans them just before the
   bias: adding -inf commutes with the bias),
2. eos suppression (min_tokens not reached: stop/eos ids -> -inf),
3. penalties: repetition (tokens in prompt or output: positive logits divided, negative
   multiplied), then frequency (minus f * count), then presence (minus p * [count > 0]),
4. temperature (greedy rows keep temperature 1),
5. min-p (drop tokens with prob < min_p * max prob),
6. top-k (keep values >= the k-th largest),
7. top-p (keep the smallest prefix of the sorted distribution whose mass reaches top_p, computed
   on the top-k-filtered distribution),
8. log_softmax.

Greedy rows (temperature 0) stop after step 3: filters 5-7 never move the argmax, and their row is
returned as ``scores - max(scores)``, i.e. log-probabilities up to a per-row constant. That shift
is order-exact (x - m == 0 only where x == m), so the argmax of the returned row is bit-for-bit
the argmax of the penalised scores, and equals the raw-logits argmax when the row has no
penalties, bias or eos suppression; a log_softmax could merge two top logits closer than one ulp
of the log-normaliser. ``sampler.logprobs`` renormalises, so T=1 log-probs remain available.

Every step is a per-row elementwise op or a per-row reduction, so a row's result does not depend
on the other rows in the batch or on chunking; a processor that is off for a row (top_k 0,
top_p 1, min_p 0, penalties neutral) is a bit-exact identity on it, so skipping it for the whole
batch changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from blockspec.transfer import to_device

CHUNK_ELEMS = 1 << 23
"""Rows are processed in chunks of at most this many row x vocab elements. Processing and noise
temporaries take about 50 bytes per element (sort values + int64 indices, int64 hash words,
float64 uniforms), so transient memory stays near 400 MiB whatever the batch size (measured on an
H200: 0.41 GiB above the outputs for 288 rows x 151936)."""


@dataclass(frozen=True)
class Features:
    """Host-side summary of which processors any row uses, so hot paths can skip unused work
    without reading device tensors (which would be a host sync)."""

    sampled: bool  # some row has temperature > 0
    top_k: bool
    top_p: bool
    min_p: bool
    greedy: bool = True  # some row has temperature 0 (False: every row samples, no greedy-row work)


@dataclass(frozen=True)
class Columns:
    """A batch's per-row sampling values on the host, in the layout of `RowParams`' device columns: two
    tables (float32 and int64) that reach the device in one copy each, or straight into a captured
    graph's inputs (`ModelRunner.next_ids`)."""

    floats: list[list[float]]  # temperature, top_p, min_p, presence, frequency and repetition penalties
    ints: list[list[int]]  # top_k, seed, position, suppress_eos
    features: Features

    @classmethod
    def from_values(cls, temperature: Sequence[float], seed: Sequence[int], position: Sequence[int],
                    top_k: Sequence[int] | None = None, top_p: Sequence[float] | None = None,
                    min_p: Sequence[float] | None = None, presence_penalty: Sequence[float] | None = None,
                    frequency_penalty: Sequence[float] | None = None,
                    repetition_penalty: Sequence[float] | None = None,
                    suppress_eos: Sequence[bool] | None = None) -> Columns:
        """Per-row values (None = off for every row) and the `Features` they use."""
        n = len(temperature)

        def host(values: Sequence[float] | Sequence[int] | Sequence[bool] | None, default: float | int | bool
                 ) -> list:
            return list(values) if values is not None else [default] * n

        feats = Features(sampled=any(t > 0 for t in temperature),
                         top_k=top_k is not None and any(k > 0 for k in top_k),
                         top_p=top_p is not None and any(v < 1 for v in top_p),
                         min_p=min_p is not None and any(v > 0 for v in min_p),
                         greedy=any(t <= 0 for t in temperature))
        return cls([host(temperature, 0.0), host(top_p, 1.0), host(min_p, 0.0), host(presence_penalty, 0.0),
                    host(frequency_penalty, 0.0), host(repetition_penalty, 1.0)],
                   [host(top_k, 0), host(seed, 0), host(position, 0), [int(v) for v in host(suppress_eos, False)]],
                   feats)

    def padded(self, rows: int) -> Columns:
        """The columns with rows appended up to `rows`: each a copy of row 0 (valid values of this batch's
        features; a graph's padding rows are computed and never read)."""
        pad = rows - len(self.floats[0])
        return Columns([c + c[:1] * pad for c in self.floats], [c + c[:1] * pad for c in self.ints], self.features)

    def params(self, device: torch.device | str, **extra: Any) -> RowParams:
        """The rows' `RowParams` on `device` (two host-to-device copies, neither waits for the device)."""
        return RowParams.from_columns(to_device(self.floats, torch.float32, device),
                                      to_device(self.ints, torch.int64, device), self.features, **extra)


@dataclass
class RowParams:
    """Sampling parameters, one entry per logits row; all tensors on the logits' device."""

    temperature: Tensor  # [N] float32, 0 => greedy row
    top_k: Tensor  # [N] int64, <= 0 => off
    top_p: Tensor  # [N] float32, 1.0 => off
    min_p: Tensor  # [N] float32, 0.0 => off
    presence_penalty: Tensor  # [N] float32
    frequency_penalty: Tensor  # [N] float32
    repetition_penalty: Tensor  # [N] float32, 1.0 => off
    seed: Tensor  # [N] int64
    position: Tensor  # [N] int64, absolute position of the token this row samples
    suppress_eos: Tensor  # [N] bool, min_tokens not reached at this row: mask eos_ids
    output_counts: Tensor | None = None  # [N, V] int32 counts of generated tokens (incl. earlier drafts)
    prompt_mask: Tensor | None = None  # [N, V] bool tokens present in the prompt
    logit_bias: tuple[Tensor, Tensor, Tensor] | None = None  # (row [M] int64, token [M] int64, bias [M] float32)
    eos_ids: Tensor | None = None  # [E] int64 ids masked where suppress_eos
    allowed: Tensor | None = None  # [N, ceil(V / 32)] int32 bitmask of the tokens a row may emit (grammar,
    # allowed_token_ids)
    features: Features | None = None  # host-side flags; None => derived from the tensors (one host sync)

    @classmethod
    def from_host(cls, *, temperature: Sequence[float], seed: Sequence[int], position: Sequence[int],
                  device: torch.device | str = "cpu", top_k: Sequence[int] | None = None,
                  top_p: Sequence[float] | None = None, min_p: Sequence[float] | None = None,
                  presence_penalty: Sequence[float] | None = None, frequency_penalty: Sequence[float] | None = None,
                  repetition_penalty: Sequence[float] | None = None, suppress_eos: Sequence[bool] | None = None,
                  output_counts: Tensor | None = None, prompt_mask: Tensor | None = None,
                  logit_bias: tuple[Tensor, Tensor, Tensor] | None = None,
                  eos_ids: Tensor | None = None, allowed: Tensor | None = None) -> RowParams:
        """Build from per-row host values (None = off for every row), with ``features`` filled in
        from the host values so that no later call needs to read them back from the device."""
        columns = Columns.from_values(temperature, seed, position, top_k, top_p, min_p, presence_penalty,
                                      frequency_penalty, repetition_penalty, suppress_eos)
        return columns.params(device, output_counts=output_counts, prompt_mask=prompt_mask, logit_bias=logit_bias,
                              eos_ids=eos_ids, allowed=allowed)

    @classmethod
    def from_columns(cls, floats: Tensor, ints: Tensor, feats: Features, **extra: Any) -> RowParams:
        """Views of the device columns [6, N] float32 and [4, N] int64 (`Columns`' order), plus `extra` fields."""
        return cls(temperature=floats[0], top_p=floats[1], min_p=floats[2], presence_penalty=floats[3],
                   frequency_penalty=floats[4], repetition_penalty=floats[5], top_k=ints[0], seed=ints[1],
                   position=ints[2], suppress_eos=ints[3].bool(), features=feats, **extra)

    def take(self, rows: Tensor) -> RowParams:
        """The parameters of a subset of rows (e.g. one block position of every request)."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Tensor) and f.name != "eos_ids":
                value = value[rows]
            elif f.name == "logit_bias" and value is not None:
                row, tok, bias = value
                remap = torch.full((self.temperature.shape[0],), -1, dtype=torch.int64, device=rows.device)
                remap[rows] = torch.arange(rows.shape[0], device=rows.device)
                keep = remap[row] >= 0
                value = (remap[row][keep], tok[keep], bias[keep])
            out[f.name] = value
        return RowParams(**out)


def token_bitmask(ids: Sequence[int], vocab_size: int, device: torch.device | str) -> Tensor:
    """[ceil(V / 32)] int32 with bit t set for each token t of `ids` (`apply_bitmask`'s layout)."""
    words = (vocab_size + 31) // 32
    bits = torch.zeros(words * 32, dtype=torch.int64)
    bits[torch.tensor(list(ids), dtype=torch.int64)] = 1
    packed = (bits.view(words, 32) << torch.arange(32, dtype=torch.int64)).sum(-1)
    return (packed - (packed >= 2**31).to(torch.int64) * 2**32).to(torch.int32).to(device)


def apply_bitmask(logits: Tensor, bits: Tensor) -> Tensor:
    """Logits of the tokens each row's bitmask forbids set to -inf, in place (bit t of a row: token t
    allowed)."""
    shifts = torch.arange(32, device=bits.device, dtype=torch.int32)
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).view(bits.shape[0], -1)[:, : logits.shape[-1]]
    return logits.masked_fill_(allowed == 0, float("-inf"))


def features(p: RowParams) -> Features:
    """``p.features`` if the caller supplied it, else read from the tensors (one host sync)."""
    if p.features is not None:
        return p.features
    flags = torch.stack([(p.temperature > 0).any(), (p.top_k > 0).any(), (p.top_p < 1).any(),
                         (p.min_p > 0).any(), (p.temperature <= 0).any()]).tolist()
    return Features(*flags)


def needs_full_processing(p: RowParams) -> bool:
    """False when every row is greedy with no penalties, bias or eos suppression: the caller may
    then take the argmax of the raw logits and keep ids only."""
    return (features(p).sampled or p.output_counts is not None or p.prompt_mask is not None
            or p.logit_bias is not None or p.eos_ids is not None or p.allowed is not None)


def row_chunks(n: int, width: int, chunk_elems: int = CHUNK_ELEMS) -> Iterator[slice]:
    """Row slices covering range(n) with at most ``chunk_elems`` elements of ``width`` each."""
    step = max(1, chunk_elems // max(1, width))
    for start in range(0, n, step):
        yield slice(start, min(n, start + step))


def bad_rows(logits: Tensor) -> Tensor:
    """Rows (over the last dim) that contain NaN or +inf, or are entirely -inf: no valid sample.

    One reduction: amax propagates NaN, is +inf with a +inf entry and -inf for an all -inf row.
    """
    return ~torch.isfinite(logits.amax(dim=-1))


def expand_history(req_counts: Tensor, row_req: Tensor, block_tokens: Tensor, row_offset: Tensor) -> Tensor:
    """Output-token counts for verify rows, [N, V] int32.

    Row n belongs to request ``row_req[n]`` and sits at block offset ``row_offset[n]`` (0 = the
    anchor row, predicting the first draft); it sees the request's committed counts plus the
    drafts ``block_tokens[r, :offset]`` before it, so penalties are exact at every block position.
    -1 entries in ``block_tokens`` are padding and count nothing.
    """
    counts = req_counts.index_select(0, row_req)
    tokens = block_tokens.index_select(0, row_req)
    k = tokens.shape[1]
    earlier = torch.arange(k, device=tokens.device).unsqueeze(0) < row_offset.unsqueeze(1)
    add = (earlier & (tokens >= 0)).to(counts.dtype)
    return counts.scatter_add_(1, tokens.clamp(min=0), add)


def process_logits(logits: Tensor, p: RowParams, chunk_elems: int = CHUNK_ELEMS) -> Tensor:
    """Processed log-probabilities [N, V] float32 of the distribution plain sampling uses per row.

    Sampled rows: the log_softmax after the full pipeline (module docstring), masked tokens -inf.
    Greedy rows: penalised scores minus their max (argmax-exact, see module docstring).
    Bad rows (NaN, +inf, or nothing left unmasked): all NaN, so ``bad_rows`` flags them.
    The input is not modified; work runs in row chunks of ``chunk_elems`` elements.
    """
    out = logits.to(torch.float32, copy=True)
    if p.allowed is not None:
        apply_bitmask(out, p.allowed)
    if p.logit_bias is not None:
        rows, toks, bias = p.logit_bias
        out.index_put_((rows, toks), bias.to(torch.float32), accumulate=True)
    f = features(p)
    chunks = list(row_chunks(out.shape[0], out.shape[1], chunk_elems))
    if len(chunks) == 1:  # the rows' own result, not copied back into `out`
        return _process_rows(out, p, chunks[0], f)
    for s in chunks:
        out[s] = _process_rows(out[s], p, s, f)
    return out


def _process_rows(x: Tensor, p: RowParams, s: slice, f: Features) -> Tensor:
    """Steps 2-8 of the module docstring for the rows ``s`` (x is their biased logits)."""
    if p.eos_ids is not None:
        x[:, p.eos_ids] = x[:, p.eos_ids].masked_fill(p.suppress_eos[s].unsqueeze(1), float("-inf"))
    if p.output_counts is not None or p.prompt_mask is not None:
        x = _apply_penalties(x, p, s)
    bad = bad_rows(x).unsqueeze(1)
    if not f.sampled:
        return (x - x.amax(dim=1, keepdim=True)).masked_fill_(bad, float("nan"))
    greedy = (p.temperature[s] <= 0) if f.greedy else None  # None: every row samples

    def sampled_rows(value: Tensor, identity: float) -> Tensor:
        """A processor's per-row value, its identity on greedy rows (no selection where none is greedy)."""
        return value if greedy is None else torch.where(greedy, identity, value)

    y = x / sampled_rows(p.temperature[s], 1.0).unsqueeze(1)
    if f.min_p:
        y = _min_p(y, sampled_rows(p.min_p[s], 0.0))
    if f.top_k or f.top_p:
        y = _top_k_top_p(y, sampled_rows(p.top_k[s], 0) if f.top_k else None,
                         sampled_rows(p.top_p[s], 1.0) if f.top_p else None)
    out = torch.log_softmax(y, dim=1)
    if greedy is not None:
        out = torch.where(greedy.unsqueeze(1), x - x.amax(dim=1, keepdim=True), out)
    return out.masked_fill_(bad, float("nan"))


def _apply_penalties(x: Tensor, p: RowParams, s: slice) -> Tensor:
    """vLLM semantics: repetition over prompt + output tokens, frequency and presence over output."""
    counts = p.output_counts[s] if p.output_counts is not None else None
    seen = p.prompt_mask[s] if p.prompt_mask is not None else None
    if counts is not None:
        seen = counts > 0 if seen is None else seen | (counts > 0)
    rep = p.repetition_penalty[s].unsqueeze(1)
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    if counts is not None:
        x = x - p.frequency_penalty[s].unsqueeze(1) * counts.to(torch.float32)
        x = x - p.presence_penalty[s].unsqueeze(1) * (counts > 0).to(torch.float32)
    return x


def _min_p(y: Tensor, min_p: Tensor) -> Tensor:
    """Drop tokens with p < min_p * p_max, i.e. y - y_max < log(min_p) (log 0 = -inf drops none)."""
    limit = y.amax(dim=1, keepdim=True) + torch.log(min_p).unsqueeze(1)
    return y.masked_fill(y < limit, float("-inf"))


def _top_k_top_p(y: Tensor, top_k: Tensor | None, top_p: Tensor | None) -> Tensor:
    """Top-k then top-p with one descending sort. Each filter becomes a per-row value threshold,
    so tokens tied with the last kept value are kept too (deterministic, batch-independent)."""
    vocab = y.shape[1]
    ordered = y.sort(dim=1, descending=True).values
    if top_k is not None:
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
        kth = ordered.gather(1, (k - 1).unsqueeze(1))
        y = y.masked_fill(y < kth, float("-inf"))
        ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    if top_p is not None:
        cum = torch.softmax(ordered, dim=1).cumsum(dim=1)
        mass_before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=1)
        keep = (mass_before < top_p.unsqueeze(1)).sum(dim=1, keepdim=True).clamp(min=1)
        last = ordered.gather(1, keep - 1)
        y = y.masked_fill((y < last) & (top_p < 1).unsqueeze(1), float("-inf"))
    return y
