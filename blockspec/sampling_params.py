"""SamplingParams: per-request decoding controls, shaped like vLLM's and validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


class SamplingError(ValueError):
    """An invalid sampling value; the message names the field and the allowed range."""


MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """How one request is decoded. temperature 0 is greedy; top_k 0 or -1 turns top-k off."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    use_speculation: bool = True
    stop_strings: tuple[str, ...] = field(init=False, repr=False, default=())

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, allowed: str) -> None:
            if not ok:
                raise SamplingError(f"SamplingParams.{name}={getattr(self, name)!r} is invalid; allowed: {allowed}")

        def number(name: str) -> float:
            value = getattr(self, name)
            check(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
                  name, "a finite number")
            return float(value)

        check(isinstance(self.n, int) and 1 <= self.n <= 128, "n", "an integer in [1, 128]")
        check(number("temperature") >= 0, "temperature", ">= 0 (0 = greedy)")
        check(0 < number("top_p") <= 1, "top_p", "in (0, 1]")
        check(isinstance(self.top_k, int) and self.top_k >= -1, "top_k", "an integer >= -1 (0 or -1 = off)")
        check(0 <= number("min_p") <= 1, "min_p", "in [0, 1]")
        check(-2 <= number("presence_penalty") <= 2, "presence_penalty", "in [-2, 2]")
        check(-2 <= number("frequency_penalty") <= 2, "frequency_penalty", "in [-2, 2]")
        check(0 < number("repetition_penalty") <= 10, "repetition_penalty", "in (0, 10]")
        check(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)), "seed",
              "an integer or None")
        check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1), "max_tokens",
              "an integer >= 1, or None (until the context is full)")
        check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", "an integer >= 0")
        if self.max_tokens is not None:
            check(self.min_tokens <= self.max_tokens, "min_tokens", f"<= max_tokens ({self.max_tokens})")
        check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
              "logprobs", f"None or an integer in [0, {MAX_LOGPROBS}] (number of top alternatives)")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        check(all(isinstance(s, str) and s for s in stops), "stop", "a non-empty string or a list of them")
        self.stop_strings = tuple(stops)
        ids = self.stop_token_ids or []
        check(all(isinstance(i, int) and i >= 0 for i in ids), "stop_token_ids", "a list of token ids >= 0")
        bias = self.logit_bias or {}
        check(all(isinstance(int(k), int) and math.isfinite(float(v)) for k, v in bias.items()), "logit_bias",
              "a dict of token id -> finite bias")
        self.logit_bias = {int(k): float(v) for k, v in bias.items()} or None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids named by the request must exist in the model's vocabulary."""
        for name, ids in (("stop_token_ids", self.stop_token_ids or []), ("logit_bias", self.logit_bias or {})):
            bad = [i for i in ids if i >= vocab_size]
            if bad:
                raise SamplingError(f"SamplingParams.{name} has token ids {bad[:5]} outside the vocabulary "
                                    f"[0, {vocab_size})")
