"""How a batch's rows are sampled: per-row sampling tensors (`RowParams`), the penalty history each
request keeps on the device, the plain step's token per request, and logprob entries (of sampled rows,
and of the prompt's tokens from its prefill).

The proposer gets what it needs of this as arguments (the rows' `RowParams`); it never asks the
engine for it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from blockspec.bad_words import banned_tokens
from blockspec.models.runner import ModelRunner
from blockspec.request import Logprob, Request
from blockspec.sample import Columns, RowParams, expand_history, logprobs as top_logprobs, process_logits, sample
from blockspec.sample.processors import row_chunks, token_bitmask
from blockspec.sampling_params import top_count
from blockspec.structured import Masks, token_bit
from blockspec.transfer import to_device

LogprobEntries = list[list[dict[int, Logprob]]]  # per request, per emitted row: token -> Logprob


def entries(scores: Tensor, tokens: Tensor, tops: list[int], normalize: bool = True) -> list[dict[int, Logprob]]:
    """One logprob dict per row of `scores` (log-probabilities up to a per-row constant, or with
    `normalize=False` the values to report as they are): its token's value and rank (1 + the tokens more
    likely), then its `tops[row]` most likely tokens, ranked 1..n (no text: `BatchSampling.named`)."""
    lp, top_ids, top_lp = top_logprobs(scores, tokens.clamp(min=0), max(tops, default=0), normalize)
    rank = (scores >= scores.gather(1, tokens.clamp(min=0)[:, None])).sum(-1)  # vLLM's: ties rank ahead of it
    host = torch.cat([lp[:, None], rank[:, None].float(), top_lp], 1).tolist()
    ids = torch.cat([tokens[:, None], top_ids], 1).tolist()
    out = []
    for row, top in enumerate(tops):
        tok = ids[row][0]
        if tok < 0:  # no token was sampled: the commit fails that request alone, with no entry to report
            out.append({})
            continue
        entry = {tok: Logprob(host[row][0], int(host[row][1]))}
        # the alternatives come sorted, most likely first: the i-th has rank i + 1, the sampled token's included
        # (vLLM's: its place among them replaces its own rank)
        for place, (t, v) in enumerate(zip(ids[row][1 : 1 + top], host[row][2:]), 1):
            entry[t] = Logprob(v, place)
        out.append(entry)
    return out


def needs_processing(reqs: list[Request]) -> bool:
    """False when every row is plain greedy: then ids are all the step keeps."""
    return any(r.needs_processing for r in reqs)


def needs_history(reqs: list[Request]) -> bool:
    """True when a row's sampling depends on committed tokens (penalties count them, min_tokens
    counts them) or its step keeps more than ids (logprobs): such a step cannot be launched
    before the one in flight is committed."""
    return any(r.needs_history for r in reqs)


class BatchSampling:
    """Sampling rows for the target's outputs: the plain step's tokens, and the `RowParams` a verify
    (or a sampled draft) processes its rows with."""

    def __init__(self, runner: ModelRunner, vocab_size: int, eos_ids: list[int],
                 logprobs_mode: str = "raw_logprobs", decode: Callable[[int], str] | None = None) -> None:
        self.runner = runner
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self.logprobs_mode = logprobs_mode  # config.LOGPROBS_MODES
        self.decode = decode  # a token's text, for each logprob's decoded_token (None: no tokenizer)
        self.device = runner.device

    def params(self, reqs: list[Request], rows_per_req: list[int], block_tokens: Tensor | None = None,
               ahead: int | list[int] = 0, constrained: bool = True) -> RowParams:
        """Per-row sampling parameters; row j of request r samples the token at position length + ahead + j
        (`ahead`: tokens launched but not yet committed, see `needs_history`; one for every request, or a
        list of each request's). `block_tokens`: the drafts a verify's rows follow. `constrained`: the rows
        of a request with a grammar get its masks, and those of a request with bad words their bans, each
        after the drafts before the row (not for drafting, which is unconstrained)."""
        dev = self.device
        req_of_row = [i for i, c in enumerate(rows_per_req) for _ in range(c)]
        offset = [j for c in rows_per_req for j in range(c)]
        ps = [reqs[i].params for i in req_of_row]
        drafts = self._host_drafts(reqs, rows_per_req, block_tokens) if constrained else None
        aheads = ahead if isinstance(ahead, list) else [ahead] * len(reqs)
        # a row after drafts that complete a request's grammar is never emitted from (the commit ends the request
        # there): it keeps the grammar's own mask (its end), without the bans that would leave it no token
        ends = [r.grammar.ends_after(d) if r.grammar is not None and d else None
                for r, d in zip(reqs, drafts)] if drafts is not None else [None] * len(reqs)

        def col(values: list[Any], dtype: torch.dtype) -> Tensor:
            return to_device(values, dtype, dev)

        bias_rows, bias_ids, bias_vals = [], [], []
        for row, (ri, j) in enumerate(zip(req_of_row, offset)):
            req = reqs[ri]
            p = req.params
            for tok, b in (p.logit_bias or {}).items():
                bias_rows.append(row), bias_ids.append(tok), bias_vals.append(b)
            if ends[ri] is not None and j >= ends[ri]:
                continue
            if constrained and req.bad_words:  # banned after the output and the drafts before this row
                for tok in banned_tokens(req.bad_words, req.output_ids, drafts[ri][:j] if drafts else ()):
                    bias_rows.append(row), bias_ids.append(tok), bias_vals.append(float("-inf"))
            if len(req.output_ids) + j < p.min_tokens:  # min_tokens: stop and EOS ids (ignore_eos too) impossible here
                for tok in set(p.stop_token_ids or []) | set(self.eos_ids):
                    bias_rows.append(row), bias_ids.append(tok), bias_vals.append(float("-inf"))
        logit_bias = (col(bias_rows, torch.int64), col(bias_ids, torch.int64), col(bias_vals, torch.float32)) \
            if bias_rows else None
        output_counts = prompt_mask = None
        if any(p.uses_penalties for p in ps):
            # a request without penalties beside ones with them: no history, which its neutral
            # penalty values leave without effect
            none_counts = torch.zeros(self.vocab_size, dtype=torch.int32, device=dev)
            none_mask = torch.zeros(self.vocab_size, dtype=torch.bool, device=dev)
            counts = torch.stack([none_counts if r.output_counts is None else r.output_counts for r in reqs])
            masks = torch.stack([none_mask if r.prompt_mask is None else r.prompt_mask for r in reqs])
            req_idx = col(req_of_row, torch.int64)
            if block_tokens is None:
                block_tokens = torch.full((len(reqs), 1), -1, dtype=torch.int64, device=dev)
            output_counts = expand_history(counts, req_idx, block_tokens, col(offset, torch.int64))
            prompt_mask = masks[req_idx]
        return self._columns(reqs, req_of_row, offset, aheads).params(
            dev, output_counts=output_counts, prompt_mask=prompt_mask, logit_bias=logit_bias,
            allowed=self._allowed(reqs, rows_per_req, drafts, ends) if constrained else None)

    @staticmethod
    def _columns(reqs: list[Request], req_of_row: list[int], offset: list[int], aheads: list[int]) -> Columns:
        """The rows' own sampling values: row n of request reqs[req_of_row[n]] samples the token at position
        length + aheads[request] + offset[n]."""
        ps = [reqs[i].params for i in req_of_row]
        return Columns.from_values(
            [p.temperature for p in ps], [reqs[i].seed for i in req_of_row],
            [reqs[i].length + aheads[i] + j for i, j in zip(req_of_row, offset)],
            top_k=[max(p.top_k, 0) for p in ps], top_p=[p.top_p for p in ps], min_p=[p.min_p for p in ps],
            presence_penalty=[p.presence_penalty for p in ps], frequency_penalty=[p.frequency_penalty for p in ps],
            repetition_penalty=[p.repetition_penalty for p in ps])

    def _allowed(self, reqs: list[Request], rows_per_req: list[int], drafts: list[list[int]] | None,
                 ends: list[int | None]) -> Tensor | None:
        """Each row's bitmask of the tokens it may emit: its grammar's (`_grammar_masks`) and its
        allowed_token_ids' (not past the drafts that end its grammar: `ends`), or `</think>` alone where its
        thinking budget is spent; None when no request restricts its tokens."""
        grammar = self._grammar_masks(reqs, rows_per_req, drafts)
        starts = list(itertools.accumulate(rows_per_req, initial=0))
        # rows whose thinking budget is spent: `</think>` alone (ThinkingBudget.forced)
        forced = [(start + j, r.thinking_budget.think.end)
                  for r, start, d in zip(reqs, starts, drafts or [[]] * len(reqs))
                  if r.thinking_budget is not None for j in r.thinking_budget.forced(d)]
        if all(r.allowed_bits is None for r in reqs) and not forced:
            return grammar
        everything = torch.full(((self.vocab_size + 31) // 32,), -1, dtype=torch.int32, device=self.device)
        per_req = torch.stack([everything if r.allowed_bits is None else r.allowed_bits for r in reqs])
        rows = per_req.repeat_interleave(to_device(rows_per_req, torch.int64, self.device), dim=0)
        if any(end is not None for end in ends):  # rows past a grammar's end: its mask alone
            past = [row + j for row, n, end in zip(starts, rows_per_req, ends) if end is not None
                    for j in range(end, n)]
            rows[to_device(past, torch.int64, self.device)] = -1
        allowed = rows if grammar is None else grammar & rows
        if forced:  # one bit a row
            rows_at = to_device([row for row, _ in forced], torch.int64, self.device)
            words, values = zip(*(token_bit(tok) for _, tok in forced))
            allowed[rows_at] = 0
            allowed[rows_at, to_device(list(words), torch.int64, self.device)] = to_device(list(values), torch.int32,
                                                                                          self.device)
        return allowed

    @staticmethod
    def _host_drafts(reqs: list[Request], rows_per_req: list[int], block_tokens: Tensor | None
                     ) -> list[list[int]] | None:
        """Each request's drafts its verify rows follow, up to the first padding, read to the host once
        where a grammar or a bad word of several tokens depends on them; else None."""
        follow = [r.grammar is not None or r.thinking_budget is not None or any(len(w) > 1 for w in r.bad_words)
                  for r in reqs]
        if block_tokens is None or not any(follow):
            return None
        return [list(itertools.takewhile(lambda t: t >= 0, block[: rows - 1]))
                for block, rows in zip(block_tokens.tolist(), rows_per_req)]

    def _grammar_masks(self, reqs: list[Request], rows_per_req: list[int], drafts: list[list[int]] | None
                       ) -> Tensor | None:
        """Each constrained request's rows: the mask of its grammar's state, and after each of the drafts
        its verify rows follow; None when no request has a grammar."""
        if not any(r.grammar is not None for r in reqs):
            return None
        masks = Masks(sum(rows_per_req), self.vocab_size)
        row = 0
        for i, (req, rows) in enumerate(zip(reqs, rows_per_req)):
            if req.grammar is not None:
                masks.add(req.grammar, row, drafts[i] if drafts is not None else [])
            row += rows
        return to_device(masks.fill(), torch.int32, self.device)

    def next_ids(self, reqs: list[Request], hidden_rows: Tensor, ahead: int = 0) -> Tensor:
        """One token id per request on the device (-1 for a non-finite row), sampled `ahead` tokens
        past each request's committed ones: the noise is keyed by position, so a step launched
        before the commit draws what the step after the commit would."""
        if not needs_processing(reqs):
            return self.runner.next_ids(hidden_rows)
        if all(r.row_values_only for r in reqs):  # the values alone, which a graph of the head takes as they are
            rows = list(range(len(reqs)))
            return self.runner.next_ids(hidden_rows, self._columns(reqs, rows, [0] * len(reqs), [ahead] * len(reqs)))
        return sample(self.runner.logits(hidden_rows), self.params(reqs, [1] * len(reqs), ahead=ahead))

    def sample(self, reqs: list[Request], hidden_rows: Tensor) -> tuple[list[int], LogprobEntries | None]:
        """One token per request from its last hidden row (one host copy of the ids), with logprob
        entries where a request asks for them."""
        if all(r.logprobs is None for r in reqs):
            return self.next_ids(reqs, hidden_rows).tolist(), None
        logits = self.runner.logits(hidden_rows)
        params = self.params(reqs, [1] * len(reqs))
        tokens = sample(logits, params)  # -1 for a non-finite row: the commit fails that request alone
        processed = process_logits(logits, params) if self.logprobs_mode == "processed_logprobs" else None
        return tokens.tolist(), self.logprob_entries(reqs, logits, processed, tokens, [1] * len(reqs))

    def logprob_entries(self, reqs: list[Request], logits: Tensor, processed: Tensor | None, tokens: Tensor,
                        rows_per_req: list[int]) -> LogprobEntries:
        """Logprob dicts (sampled token + top-n) per emitted row, of the raw `logits` or the `processed`
        distribution the rows were sampled from (None unless logprobs_mode asks for it)."""
        tops = [top_count(r.params.logprobs, self.vocab_size) for r, c in zip(reqs, rows_per_req) for _ in range(c)]
        if self.logprobs_mode == "processed_logprobs":
            flat = entries(processed, tokens, tops)
        else:
            flat = entries(logits.float(), tokens, tops, self.logprobs_mode == "raw_logprobs")
        bounds = itertools.pairwise(itertools.accumulate(rows_per_req, initial=0))
        return [self.named(r, flat[a:b]) for r, (a, b) in zip(reqs, bounds)]

    def named(self, req: Request, rows: list[dict[int, Logprob]]) -> list[dict[int, Logprob]]:
        """`rows` with each token's text as its decoded_token, unless there is no tokenizer or the request
        asked for token ids only (detokenize=False: no decoding cost, decoded_token None, as vLLM)."""
        if self.decode is not None and req.params.detokenize:
            for entry in rows:
                for t, lp in entry.items():
                    lp.decoded_token = self.decode(t)
        return rows

    def add_prompt_logprobs(self, req: Request, hidden: Tensor, start: int) -> None:
        """Append the prompt logprobs a prefill chunk gives (`hidden`: its rows, from position `start`):
        row i predicts the token at start + i + 1. Only positions not computed yet (a request recomputed
        after a preemption, or another of its n copies, has them) and inside the prompt (past it, rows
        predict the output). Raw logprobs of the model, in row chunks of bounded size."""
        done, prompt = req.prompt_logprobs, req.prompt_token_ids
        first, end = max(len(done) - 1 - start, 0), min(len(prompt) - 1 - start, hidden.shape[0])
        for s in row_chunks(end - first, self.vocab_size):
            rows = slice(first + s.start, first + s.stop)
            tokens = to_device(prompt[start + rows.start + 1 : start + rows.stop + 1], torch.int64, self.device)
            logits = self.runner.logits(hidden[rows]).float()
            done.extend(self.named(req, entries(logits, tokens, [top_count(req.params.prompt_logprobs, self.vocab_size)] * len(tokens))))

    def start_device_state(self, req: Request) -> None:
        """What the request's sampling reads on the device: for penalties the prompt's tokens and counts of
        the output's, for allowed_token_ids their bitmask."""
        if req.params.allowed_token_ids is not None and req.allowed_bits is None:
            req.allowed_bits = token_bitmask(req.params.allowed_token_ids, self.vocab_size, self.device)
        if req.params.uses_penalties:
            req.output_counts = torch.zeros(self.vocab_size, dtype=torch.int32, device=self.device)
            req.prompt_mask = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
            req.prompt_mask[to_device(req.prompt_token_ids, torch.int64, self.device)] = True

    def add_history(self, req: Request, tokens: list[int]) -> None:
        """Count a step's committed tokens in the request's penalty history (one scatter for all)."""
        if req.output_counts is not None and tokens:
            index = to_device(tokens, torch.int64, self.device)
            req.output_counts.index_add_(0, index, torch.ones_like(index, dtype=torch.int32))
