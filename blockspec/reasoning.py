"""Thinking models' think blocks, as vLLM's `reasoning_parser` names them: a model that thinks before it answers
(Qwen3, DeepSeek-R1) writes its thinking between `<think>` and `</think>`, each one token of its tokenizer.

The engine reads the blocks by token (a structured output's grammar holds the answer, not the thinking:
`structured.Grammar`); the server splits the text alike (`server.reasoning`: reasoning_content and content).

- an output thinks where its prompt left a block open (Qwen3's thinking-only templates and R1's open it there), or
  where its first token opens one;
- a prompt that closed its block at its end (Qwen3's template with `enable_thinking` false) gets the answer at once;
- `deepseek_r1`: with no tag in its prompt an output starts thinking (R1's older templates leave the opening to the
  model, which may also skip writing it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from blockspec.config import ConfigError

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ThinkTokens:
    """A reasoning parser over a tokenizer: its rule and the ids of its block's tags."""

    parser: str
    start: int
    end: int

    @classmethod
    def of(cls, parser: str, tokenizer: Any, vocab_size: int) -> ThinkTokens:
        """The parser's (one of config.REASONING_PARSERS) tags in `tokenizer`, or a ConfigError naming what is
        missing."""
        if tokenizer is None:
            raise ConfigError(f"reasoning_parser {parser!r} reads {START} and {END} tokens, and this model has no "
                              "tokenizer")
        vocab = tokenizer.get_vocab()
        missing = [tag for tag in (START, END) if tag not in vocab]
        if missing:
            raise ConfigError(f"reasoning_parser {parser!r}: the tokenizer has no {' or '.join(missing)} token (a "
                              f"thinking model's tokenizer holds {START} and {END} as one token each)")
        outside = [tag for tag in (START, END) if vocab[tag] >= vocab_size]
        if outside:
            raise ConfigError(f"reasoning_parser {parser!r}: the tokenizer's {' and '.join(outside)} (id "
                              f"{', '.join(str(vocab[t]) for t in outside)}) lie outside the model's vocabulary of "
                              f"{vocab_size}")
        return cls(parser, vocab[START], vocab[END])

    def step(self, phase: str, tok: int) -> tuple[str, bool]:
        """The phase after the output's next token `tok`, and whether `tok` is the answer's (not thinking, nor a
        tag)."""
        if phase == "answer":
            return "answer", True
        if phase == "first":
            return ("thinking", False) if tok == self.start else ("answer", True)
        return ("answer" if tok == self.end else "thinking"), False

    def phase(self, prompt_ids: Sequence[int], decode: Callable[[list[int]], str]) -> str:
        """Where an output of this prompt starts (`decode`: the text of ids):

        - "thinking": inside a block, the prompt's last tag being `<think>` (or, under deepseek_r1, the prompt
          holding no tag);
        - "answer": the prompt closed its block at its end, whitespace aside (Qwen3's enable_thinking false, a
          continued message whose block is closed): vLLM's reading of such a prompt;
        - "first": its first token may open a block, else it is the answer (qwen3 with no tag in the prompt, and
          either parser after an earlier turn's closed block).
        """
        for i in range(len(prompt_ids) - 1, -1, -1):
            if prompt_ids[i] == self.start:
                return "thinking"
            if prompt_ids[i] == self.end:
                return "answer" if not decode(list(prompt_ids[i + 1:])).strip() else "first"
        return "thinking" if self.parser == "deepseek_r1" else "first"


@dataclass
class ThinkingBudget:
    """vLLM's `thinking_token_budget`: once an output has thought `budget` tokens in its block (the tags aside),
    `</think>` is the only token it may emit. Advanced by committed tokens; a verify row's state follows the
    drafts before it."""

    think: ThinkTokens
    budget: int
    phase: str  # ThinkTokens.phase, then where the committed output is
    spent: int = 0  # thinking tokens of the current block

    def _after(self, phase: str, spent: int, tok: int) -> tuple[str, int]:
        after, _ = self.think.step(phase, tok)
        return after, spent + 1 if phase == after == "thinking" else 0

    def consume(self, tokens: Sequence[int]) -> None:
        for tok in tokens:
            self.phase, self.spent = self._after(self.phase, self.spent, tok)

    def forced(self, drafts: Sequence[int]) -> list[int]:
        """The rows (0: the next token, j: the token after drafts[:j]) whose budget is spent: `</think>` only."""
        phase, spent, rows = self.phase, self.spent, []
        for j in range(len(drafts) + 1):
            if phase == "thinking" and spent >= self.budget:
                rows.append(j)
            if j < len(drafts):
                phase, spent = self._after(phase, spent, drafts[j])
        return rows
