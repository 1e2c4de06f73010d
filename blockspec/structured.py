"""Structured output: the grammar a request's tokens must keep (a JSON schema, any JSON object, a regex, a
choice, a Lark or GBNF grammar), compiled by llguidance, and the token bitmask it allows at each sampled row.

A request's matcher advances only on committed tokens. A verify row j of a speculative step gets the
mask of the state after drafts 1..j (the matcher consumes them, fills the masks, and rolls back), so
the target's processed distribution at every verified position is exactly the constrained one: a
draft the grammar forbids has probability zero there and is rejected, never emitted. Drafts
themselves are not constrained.

With a reasoning parser the grammar holds the answer, not the thinking (`Grammar`): the tokens of a think block
are free, and the grammar starts at the token after its `</think>`, a committed one or a draft.

llguidance loads at the first constrained request, not with blockspec: its torch helpers import torch's
compiler stack and its tokenizer bridge transformers, about 4 s that a run without grammars never needs.
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from torch import Tensor

from blockspec.errors import ConstraintError, RequestError
from blockspec.reasoning import ThinkTokens
from blockspec.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import llguidance
    from llguidance import LLMatcher as GrammarMatcher
    from llguidance import LLTokenizer


def grammar_of(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint."""
    from llguidance import LLMatcher

    if spec.json is not None:
        return LLMatcher.grammar_from_json_schema(spec.json)
    if spec.json_object:
        return LLMatcher.grammar_from_json_schema({"type": "object"})
    if spec.regex is not None:
        return LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        return LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in spec.choice))
    from llguidance.gbnf_to_lark import any_to_lark

    try:  # Lark as written; GBNF (llama.cpp's, as vLLM's docs write grammars) translated to it
        lark = any_to_lark(spec.grammar)
    except Exception as exc:  # the translator raises plain exceptions for the grammar's faults
        raise ValueError(f"grammar: {exc}") from None
    return LLMatcher.grammar_from_lark(lark)


class _TextTokens:
    """A tokenizer whose decoder llguidance cannot read (neither byte-level nor byte-fallback), given to it
    as each token's text: right for tokenizers whose tokens are whole characters or words."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = list(tokenizer.all_special_ids)
        special = set(self.special_token_ids)
        self.tokens = [b"" if i in special or i >= len(tokenizer) else tokenizer.decode([i]).encode()
                       for i in range(vocab_size)]

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)


@functools.lru_cache(maxsize=4)
def ll_tokenizer(tokenizer: Any, vocab_size: int, eos_ids: tuple[int, ...]) -> LLTokenizer:
    """llguidance's view of a tokenizer over the model's vocabulary (ids past the tokenizer's are never
    allowed); built once per tokenizer (about a second for a large vocabulary)."""
    import llguidance.hf
    from llguidance import LLTokenizer, TokenizerWrapper

    eos = list(eos_ids) or None
    try:
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
    except ValueError:  # a decoder llguidance does not read: the tokens' text instead
        return LLTokenizer(TokenizerWrapper(_TextTokens(tokenizer, vocab_size)), n_vocab=vocab_size, eos_token=eos)


def one_line(error: str) -> str:
    """llguidance's error as one line: a compiler's drawing (a source line echoed above a line of carets
    under the fault) dropped, the rest joined."""
    lines = [line.strip() for line in error.splitlines()] + [""]
    kept = []
    for line, below in zip(lines, lines[1:]):
        if not line.strip("^~ ") or (below and not below.strip("^~ ")):  # blank, carets, or the line they mark
            continue
        kept.append(line.removeprefix("error: ") if kept else line)
    return " ".join(kept) or error.strip()


def new_matcher(spec: StructuredOutputsParams, tokenizer: Any, vocab_size: int, eos_ids: tuple[int, ...],
                where: str) -> GrammarMatcher:
    """A matcher at the start of the output, or a RequestError naming the request and the problem."""
    if tokenizer is None:
        raise RequestError(f"{where}: structured outputs need the model's tokenizer, and this model has none")
    try:
        grammar = grammar_of(spec)
    except ValueError as exc:
        raise ConstraintError.of(where, one_line(str(exc))) from None
    compiled = _compiled(grammar, ll_tokenizer(tokenizer, vocab_size, eos_ids))
    if compiled.is_error():
        raise ConstraintError.of(where, one_line(compiled.get_error()))
    with _copying:
        return compiled.deep_copy()


_copying = threading.Lock()  # the server checks requests' constraints from several threads


@functools.lru_cache(maxsize=32)
def _compiled(grammar: str, tokenizer: LLTokenizer) -> GrammarMatcher:
    """A grammar compiled once, at the start of an output: each request (each prompt of a list, each of n
    copies) takes a copy, not a compile of its own (a large choice or schema takes a large part of a second)."""
    from llguidance import LLMatcher

    return LLMatcher(tokenizer, grammar, log_level=0)


class Grammar:
    """A request's constraint and where it starts: at the output's first token, or with a reasoning parser
    (`think`) after the output's think block. An output that may open a block with its first token (phase
    "first") has that token's row allow `<think>` beside what the grammar allows."""

    def __init__(self, matcher: GrammarMatcher, think: ThinkTokens | None = None, phase: str = "answer") -> None:
        self.matcher = matcher
        self.think = think
        # "answer": the grammar holds each token; "thinking": free until `</think>`; "first": the first token
        # may open a block, else the grammar holds it (`ThinkTokens.phase`)
        self.phase = phase

    def copy(self) -> Grammar:
        """An independent copy (each of a prompt's n copies advances its own)."""
        return Grammar(self.matcher.deep_copy(), self.think, self.phase)

    def _start(self, tokens: Sequence[int]) -> int | None:
        """The index in `tokens` (the next tokens of the output) of the first the grammar holds; None where all of
        them are thinking."""
        phase = self.phase
        if phase == "answer":
            return 0
        for i, tok in enumerate(tokens):
            phase, answer = self.think.step(phase, tok)
            if answer:
                return i
            if phase == "answer":
                return i + 1
        return len(tokens) if phase == "first" else None

    def consume(self, tokens: Sequence[int]) -> bool:
        """Advance by committed tokens; False where one left the grammar."""
        if not tokens:
            return True
        start = self._start(tokens)
        if start is None:
            self.phase = "thinking"
            return True
        self.phase = "answer"
        return self.matcher.consume_tokens(list(tokens[start:]))

    def is_stopped(self) -> bool:
        return self.phase == "answer" and self.matcher.is_stopped()

    def error(self) -> str:
        return self.matcher.get_error()

    def ends_after(self, tokens: list[int]) -> int | None:
        """How many of `tokens` complete the grammar (it stops after them), or None: it runs on past them, or one
        leaves it. The request ends there (`engine.output.grammar_ending`): rows past it are never emitted from."""
        start = self._start(tokens)
        if start is None:
            return None
        ahead = self.matcher.deep_copy()
        for i, tok in enumerate(tokens[start:]):
            if not ahead.consume_token(tok):
                return None
            if ahead.is_stopped():
                return start + i + 1
        return None

    def rows(self, row: int, drafts: list[int]) -> tuple[list[tuple[GrammarMatcher, int, list[int]]], int | None]:
        """The mask fills of a request's rows from `row` (one, then one after each draft): (matcher, first row, the
        drafts it follows from there) entries, and the row that also allows `<think>` (or None). Rows before the
        grammar starts allow everything."""
        start = self._start(drafts)
        if self.phase != "first":
            return ([] if start is None else [(self.matcher, row + start, drafts[start:])]), None
        if start == 0:  # the first token either opens a block or is the grammar's
            return [(self.matcher, row, drafts)], row
        fills = [(self.matcher, row, [])]  # the first draft opened a block: its row as above, then free rows
        if start is not None:  # the block closes within the drafts: the grammar from the row after its end
            fills.append((self.matcher.deep_copy(), row + start, drafts[start:]))
        return fills, row


def token_bit(tok: int) -> tuple[int, int]:
    """(word, value) of token `tok`'s bit in a bitmask row: bit tok % 32 of word tok // 32, as a signed int32."""
    bit = 1 << tok % 32
    return tok // 32, bit - (1 << 32 if bit >= 1 << 31 else 0)


class Masks:
    """Token bitmasks of a batch's rows ([rows, ceil(V / 32)] int32, bit t of a row: token t allowed),
    filled in parallel by llguidance; rows of requests without a grammar allow everything."""

    def __init__(self, rows: int, vocab_size: int) -> None:
        import llguidance.torch

        self.bits = llguidance.torch.allocate_token_bitmask(rows, vocab_size)
        self._entries: list[tuple[GrammarMatcher, int, list[int]]] = []
        self._opening: list[tuple[int, int]] = []  # (row, token): a row that also allows the token

    def add(self, grammar: Grammar, row: int, drafts: list[int]) -> None:
        """Row `row` gets the grammar's current mask; row `row + 1 + j` the mask after drafts[0..j], up to
        the first draft the grammar forbids (rows past it are never emitted from)."""
        fills, opening = grammar.rows(row, drafts)
        self._entries.extend(fills)
        if opening is not None:
            self._opening.append((opening, grammar.think.start))

    def fill(self) -> Tensor:
        import llguidance.torch

        with_drafts = [e for e in self._entries if e[2]]
        alone = [(matcher, row) for matcher, row, drafts in self._entries if not drafts]
        if with_drafts:
            llguidance.torch.fill_next_token_bitmask_par_with_draft_tokens(_executor(), with_drafts, self.bits)
        if alone:
            llguidance.torch.fill_next_token_bitmask_par(_executor(), alone, self.bits)
        for row, tok in self._opening:
            word, value = token_bit(tok)
            self.bits[row, word] |= value
        return self.bits


@functools.cache
def _executor() -> llguidance.LLExecutor:
    import llguidance

    return llguidance.LLExecutor()
