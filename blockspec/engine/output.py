"""Committing a step's tokens to a request: text through its incremental detokeniser, logprobs, and
the rules that end it (EOS, stop ids, stop strings, max_tokens, the context, a structured-output
grammar's end), token by token. A stop inside a block of accepted tokens drops the rest of the block,
so a speculative step ends a request exactly where plain decoding would."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from blockspec.request import Logprob, Request

if TYPE_CHECKING:
    from blockspec.structured import Grammar

NON_FINITE = "the target produced non-finite logits (NaN or inf) for this request"
NO_TOKEN = "no token could be sampled"  # how the error of a request whose own masks leave no token begins


def no_token(req: Request) -> str:
    """Why a row gave no token: its logits were not finite, or the request's own masks left no token (an
    allowed_token_ids that a grammar or bad_words rules out): those it has are named."""
    p = req.params
    masks = [name for name, on in (("allowed_token_ids", p.allowed_token_ids), ("bad_words", p.bad_words),
                                   ("structured_outputs", p.structured_outputs),
                                   ("min_tokens", len(req.output_ids) < p.min_tokens)) if on]
    if not masks:
        return NON_FINITE
    return (f"{NO_TOKEN} at output token {len(req.output_ids) + 1}: this request's "
            f"{', '.join(masks)} leave no token allowed there, or the target's logits were not finite")


@dataclass(frozen=True)
class Ending:
    """How a request ended: finish reason (stop, length, error), what stopped it, the error message."""

    reason: str
    stop_reason: str | int | None = None
    error: str | None = None


class OutputProcessor:
    def __init__(self, eos_ids: list[int], max_model_len: int, primary_eos: int | None = None) -> None:
        self.eos_ids = eos_ids
        # the tokenizer's EOS; a stop at another of eos_ids (generation_config's) names its id as stop_reason, as
        # vLLM's stop_token_ids from generation_config do
        self.primary_eos = primary_eos
        self.max_model_len = max_model_len
        self.num_generated = 0  # tokens committed, over every request
        self.num_prompt_tokens = 0  # each request's prompt at its first token (n copies: n times, as vLLM counts)

    def commit(self, req: Request, tokens: list[int], lps: list[dict[int, Logprob]] | None) -> Ending | None:
        """Append tokens one by one until one ends the request; how it ended, or None while it runs on.
        A -1 token (a row whose logits were not finite) fails the request there. A request with a grammar
        advances it by each token and ends at the token that completes it."""
        p = req.params
        for j, tok in enumerate(tokens):
            if tok < 0:
                return Ending("error", error=no_token(req))
            if req.first_token_time is None:  # a request failing before any token has no first-token time
                req.first_token_time = time.perf_counter()
                self.num_prompt_tokens += len(req.prompt_token_ids)
            req.output_ids.append(tok)
            self.num_generated += 1
            if req.thinking_budget is not None:
                req.thinking_budget.consume([tok])
            if lps is not None and req.logprobs is not None:
                req.logprobs.append(lps[j])
                req.cumulative_logprob += lps[j][tok].logprob
            n_out = len(req.output_ids)
            eos = n_out >= p.min_tokens and not p.ignore_eos and tok in self.eos_ids
            stop_id = n_out >= p.min_tokens and bool(p.stop_token_ids) and tok in p.stop_token_ids
            # the token that stops a request is in its token ids, its text only with include_stop_str_in_output
            # (vLLM's rule, EOS included); the tokenizer's EOS has no stop_reason, a stop id (or another EOS) is its own
            shown = req.detok is not None and (not (eos or stop_id) or p.include_stop_str_in_output)
            new_text = req.detok.add(tok) if shown else ""
            if eos or stop_id:
                return Ending("stop", None if eos and tok == self.primary_eos else tok)
            # a stop string must end in text made after the min_tokens-th token (vLLM's rule)
            if n_out > p.min_tokens and p.stop_strings and new_text:
                stop = self._stop_string(req, len(new_text))
                if stop is not None:
                    return Ending("stop", stop)
            if p.max_tokens is not None and n_out >= p.max_tokens:
                return Ending("length")
            if req.length >= self.max_model_len:
                return Ending("length")
            if req.grammar is not None:
                ending = grammar_ending(req.grammar, [tok])
                if ending is not None:
                    return ending
        return None

    @staticmethod
    def _stop_string(req: Request, new_len: int) -> str | None:
        """The stop string the newest text completes (the text is cut before it, or after it with
        include_stop_str_in_output), or None. Each string is looked for where it could end in the newest
        text only: one completed earlier (before min_tokens) does not stop the request later."""
        oldest = max(0, req.detok.length - new_len - max(len(s) for s in req.params.stop_strings) + 1)
        text = req.detok.text_from(oldest)
        for s in req.params.stop_strings:
            start = max(0, req.detok.length - new_len - len(s) + 1)
            at = text.find(s, start - oldest)
            if at >= 0:
                end = oldest + at + (len(s) if req.params.include_stop_str_in_output else 0)
                req.truncated_text = req.detok.text[:end]
                return s
        return None


def grammar_ending(grammar: Grammar, tokens: list[int]) -> Ending | None:
    """Advance a request's grammar by committed tokens: it ends (stop) once the grammar is complete,
    and fails if a token left it (the masks make that impossible unless they are bypassed)."""
    if not grammar.consume(tokens):  # llguidance's error: a line, then its parser's state (kilobytes)
        reason = (grammar.error().strip().splitlines() or ["no reason given"])[0][:200]
        return Ending("error", error=f"the output left its structured-output grammar: {reason}")
    return Ending("stop") if grammar.is_stopped() else None
