"""Thinking models' think blocks, as vLLM's `reasoning_parser` names them: a model that thinks before it answers
(Qwen3, DeepSeek-R1) writes its thinking between `<think>` and `</think>`, each one token of its tokenizer.

The engine reads the blocks by token (a structured output's grammar holds the answer, not the thinking:
`structured.Grammar`); the server splits the text alike (`server.reasoning`: reasoning_content and content).

- `qwen3`: an output thinks where its first token opens a block, or where its prompt left one open (Qwen3's
  thinking-only templates open it in the prompt); with `enable_thinking` false the template closes an empty
  block in the prompt, and the output is all answer.
- `deepseek_r1`: an output always starts thinking (R1's template opens the block in the prompt; R1-0528 also
  writes `<think>` itself), until `</think>` or its end.
"""

from __future__ import annotations

from collections.abc import Sequence
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
    def of(cls, parser: str, tokenizer: Any) -> ThinkTokens:
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
        return cls(parser, vocab[START], vocab[END])

    def starts_thinking(self, prompt_ids: Sequence[int]) -> bool:
        """Whether an output begins inside a think block: always under deepseek_r1; under qwen3 where the
        prompt's last `<think>` comes after its last `</think>`."""
        if self.parser == "deepseek_r1":
            return True
        for tok in reversed(prompt_ids):
            if tok == self.end:
                return False
            if tok == self.start:
                return True
        return False

    @property
    def may_open(self) -> bool:
        """Whether an output that does not start thinking may open a block with its first token (qwen3)."""
        return self.parser == "qwen3"
