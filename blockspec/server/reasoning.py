"""Reasoning in chat completions, as vLLM's `--reasoning-parser` returns it: a model that thinks before it
answers (Qwen3, DeepSeek-R1) writes its thinking between `<think>` and `</think>`; the message's
`reasoning_content` is that thinking and its content the rest, where tool calls are looked for. Streamed,
thinking goes out as reasoning_content deltas until `</think>`, then content. Whole and streamed answers split
alike: the whole text goes through the same reader as the pieces.

- `qwen3`: an output thinks where it opens `<think>` first (whitespace aside), or where its prompt left a block
  open (Qwen3's thinking-only templates open it in the prompt); with `enable_thinking` false the template
  closes an empty block in the prompt, and the output is all content.
- `deepseek_r1`: an output always starts thinking (R1's template opens the block in the prompt; R1-0528 also
  writes `<think>` itself), until `</think>` or its end.

One think block, at the output's start: a `<think>` later on is content.
"""

from __future__ import annotations

from dataclasses import dataclass

from blockspec.server.tools import before

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    starts_thinking_always: bool

    def starts_thinking(self, prompt_tail: str) -> bool:
        """Whether an output begins inside a think block, from the end of its prompt's text."""
        return self.starts_thinking_always or prompt_tail.rfind(START) > prompt_tail.rfind(END)

    def split(self, text: str, thinking: bool) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None for an empty part (vLLM's)."""
        reader = ReasoningStream(thinking)
        reasoning, content = reader.feed(text)
        more, rest = reader.finish()
        return (reasoning + more) or None, (content + rest) or None


PARSERS = {"qwen3": ReasoningParser(starts_thinking_always=False),
           "deepseek_r1": ReasoningParser(starts_thinking_always=True)}


@dataclass
class ReasoningStream:
    """One choice's output read piece by piece: what of each piece is thinking, what content. A tail that may be
    the start of a tag is held until the next piece says."""

    thinking: bool  # inside the think block
    at_start: bool = True  # nothing but whitespace read yet: the output may still open its block
    held: str = ""

    def feed(self, piece: str) -> tuple[str, str]:
        """(reasoning, content) to send now."""
        text, self.held = self.held + piece, ""
        if self.at_start:  # the output may open its block (or write the <think> its prompt opened: R1-0528)
            opening = text.lstrip()
            if not opening or START.startswith(opening) and opening != START:
                self.held = text  # whitespace, or the tag's beginning: not known yet
                return "", ""
            self.at_start = False
            if opening.startswith(START):
                self.thinking, text = True, opening[len(START):]
        if not self.thinking:
            return "", text
        at = text.find(END)
        if at >= 0:
            self.thinking = False
            return text[:at], text[at + len(END):]
        sure = before(text, END)
        self.held = text[len(sure):]
        return sure, ""

    def finish(self) -> tuple[str, str]:
        """(reasoning, content) held back, once the output has ended."""
        held, self.held = self.held, ""
        return (held, "") if self.thinking else ("", held)
