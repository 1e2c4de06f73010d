"""Reasoning in chat completions, as vLLM's `--reasoning-parser` returns it: a thinking model's think block
(`blockspec.reasoning`: which parser, where an output starts thinking) is the message's `reasoning_content`, and
the rest its content, where tool calls are looked for. Streamed, thinking goes out as reasoning_content deltas
until `</think>`, then content. Whole and streamed answers split alike: the whole text goes through the same
reader as the pieces.

One think block, at the output's start: a `<think>` later on is content.
"""

from __future__ import annotations

from dataclasses import dataclass

from blockspec.reasoning import END, START
from blockspec.server.tools import before


@dataclass
class ReasoningStream:
    """One choice's output read piece by piece: what of each piece is thinking, what content. A tail that may be
    the start of a tag is held until the next piece says."""

    thinking: bool  # inside the think block
    at_start: bool = True  # nothing but whitespace read yet: the output may still open its block
    held: str = ""

    @classmethod
    def starting(cls, phase: str) -> ReasoningStream:
        """A reader of an output that starts at `phase` (`ThinkTokens.phase`): inside its block, free to open one,
        or (its prompt closed the block) all content."""
        return cls(thinking=phase == "thinking", at_start=phase != "answer")

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


def split_reasoning(text: str, phase: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole output that starts at `phase` (`ThinkTokens.phase`); None for an empty part
    (vLLM's)."""
    reader = ReasoningStream.starting(phase)
    reasoning, content = reader.feed(text)
    more, rest = reader.finish()
    return (reasoning + more) or None, (content + rest) or None
