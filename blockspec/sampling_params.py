"""SamplingParams: per-request decoding controls, shaped like vLLM's and validated on construction."""

from __future__ import annotations

import copy
import enum
import logging
import math
import numbers
import reprlib
from dataclasses import dataclass, field
from typing import Any


class SamplingError(ValueError):
    """An invalid sampling value; the message names the field and the allowed range."""


log = logging.getLogger("blockspec")

MAX_LOGPROBS = 20
MAX_BAD_WORDS = 128  # each is matched against every sampled row's history on the host (vLLM's runner V2: as many)
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values, to which from_optional clamps them (vLLM's)
INT64 = (-(2**63), 2**63 - 1)  # seeds are keyed as int64 on the device
FLOAT32_MAX = 3.4028234663852886e38
MIN_TEMPERATURE = 1e-2  # a positive temperature below this is raised to it (vLLM's: smaller ones overflow float32)
SHORT = reprlib.Repr()  # a bad value quoted in an error, cut short
SHORT.maxstring = SHORT.maxother = 60
SHORT.maxlong = 40


def is_int(value: object) -> bool:
    """An integer that is not a bool (True is an int to Python, never a count to a user); NumPy's integer
    scalars count, as they do to vLLM."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """A real number that is not a bool (NumPy's scalars included)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def plain_ints(values: Any) -> Any:
    """A list or tuple of integers as Python ints (NumPy's scalars converted), anything else as it is."""
    return [int(v) for v in values] if isinstance(values, (list, tuple)) and all(map(is_int, values)) else values


class RequestOutputKind(enum.Enum):
    """vLLM's `SamplingParams.output_kind`: what each output of a request holds. The offline `LLM` returns
    every request's final output whichever is given (vLLM's `LLM` does the same); the server streams
    deltas by the request's `stream` flag."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


def token_id(key: object) -> int | None:
    """A token id given as an int or a string of digits (JSON object keys are strings), else None."""
    if is_int(key):
        return int(key) if key >= 0 else None
    if isinstance(key, str) and key.isascii() and key.isdigit():
        return int(key)
    return None


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint every generated token must keep: the output matches a JSON schema (`json`, a dict or
    its text), any JSON object (`json_object`), a regular expression (`regex`), one of `choice`, or a
    Lark or GBNF grammar (`grammar`). Exactly one is given (vLLM's names)."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object is True else []
        if len(given) != 1:
            raise SamplingError(f"SamplingParams.structured_outputs needs exactly one of json, regex, choice, "
                                f"grammar, json_object; got {given or 'none'}")
        checks = {"json": isinstance(self.json, (dict, str)), "regex": isinstance(self.regex, str),
                  "grammar": isinstance(self.grammar, str), "json_object": True,
                  "choice": isinstance(self.choice, (list, tuple)) and bool(self.choice)
                  and all(isinstance(c, str) and c for c in self.choice)}
        if not checks[given[0]]:
            allowed = {"json": "a JSON schema (dict or text)", "regex": "a string",
                       "grammar": "a Lark or GBNF grammar string",
                       "choice": "a non-empty list of non-empty strings"}[given[0]]
            raise SamplingError(f"SamplingParams.structured_outputs.{given[0]}={SHORT.repr(getattr(self, given[0]))} "
                                f"is invalid; allowed: {allowed}")


@dataclass
class SamplingParams:
    """How one request is decoded. temperature 0 is greedy; a positive one below 0.01 samples at 0.01, with a
    warning (vLLM's rule: the scaled logits of a smaller one can overflow float32); top_k 0 or -1 turns top-k
    off. With n > 1 and a seed, copy i samples with seed + i (vLLM's), so copy 0 is the request run alone.

    `prompt_logprobs` (k): every prompt token after the first with its logprob given the tokens before
    it and the k most likely alternatives with their ranks (the first token: None). They are the model's
    raw logprobs, before any sampling processor (vLLM's default): a prompt is read, not sampled.
    `logprobs` (k): each sampled token's and the k most likely tokens' logprobs, of the raw logits by default
    (the engine's `logprobs_mode`, vLLM's: raw_logprobs, raw_logits or processed_logprobs).
    `bad_words`: strings never emitted (vLLM's rule: each word tokenized as given and with a leading
    space; a one-token word's token is banned at every row, a longer word's last token where the output
    so far ends with its other tokens).
    `detokenize=False`: token ids only, as vLLM returns them: the outputs' text stays empty and the
    logprobs' decoded_token None (no decoding cost); stop strings, matched in the text, are refused.
    `best_of` (vLLM V0's; V1 dropped it): None or n, since every sample is returned and none is ranked.
    `allowed_token_ids`: the only tokens the request may emit (every other token's logit -inf, as vLLM masks
    them), in plain steps and verify rows alike, so speculation keeps the output.
    `truncate_prompt_tokens`: keep only the prompt's last k tokens (vLLM's left truncation); -1 keeps as many
    as the context holds beside one output token.
    `thinking_token_budget` (vLLM's; needs the engine's reasoning_parser): once the output has thought that many
    tokens in its think block, `</think>` is the only token it may emit (0: the block closes at once).
    `spaces_between_special_tokens`: accepted as vLLM accepts it, and, as with vLLM's detokenizer for a fast
    tokenizer, the text does not depend on it: the tokenizers blockspec loads (the `tokenizers` library's
    decoders, transformers 5's Python tokenizers) join special tokens without that choice.
    vLLM's conventions: `seed=-1` is no seed; `logprobs` / `prompt_logprobs` True is 1 and -1 is the whole
    vocabulary (both bounded by the engine's `max_logprobs`); NumPy scalars are numbers.
    `skip_reading_prefix_cache`: prefill the whole prompt even where prefix caching remembers its start
    (always so with prompt_logprobs). `output_kind` and `extra_args` (vLLM's, for plugins) are taken and
    change nothing here."""

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
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    use_speculation: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    detokenize: bool = True
    best_of: int | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    thinking_token_budget: int | None = None
    logits_processors: list[Any] | None = None  # vLLM's name, refused unless empty: see `verify`
    skip_reading_prefix_cache: bool | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    extra_args: dict[str, Any] | None = None
    flat_logprobs: bool = False  # vLLM's flat logprobs container: refused unless False
    stop_strings: tuple[str, ...] = field(init=False, repr=False, default=())

    def __post_init__(self) -> None:
        self.verify()

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's `SamplingParams.clone`): changing it leaves this one as it is."""
        return copy.deepcopy(self)

    def verify(self) -> None:
        """Check every field (SamplingError naming the first bad one) and derive stop_strings. Construction
        runs it, and `LLM.generate` again before any work, so a field changed after construction (the
        dataclass is mutable, as vLLM's is) is checked and honoured, not run unchecked or ignored."""

        def check(ok: bool, name: str, allowed: str) -> None:
            if not ok:
                raise SamplingError(f"SamplingParams.{name}={SHORT.repr(getattr(self, name))} is invalid; allowed: {allowed}")

        check(not self.logits_processors, "logits_processors", "None: per-request logits processors (Python "
              "callables on every row) are not supported, as in vLLM V1; logit_bias, allowed_token_ids, bad_words "
              "and structured_outputs run on the device")

        if self.seed == -1 and is_int(self.seed):  # vLLM's "no seed"
            self.seed = None
        for name in ("logprobs", "prompt_logprobs"):  # vLLM's True = 1 (False = 0)
            if isinstance(getattr(self, name), bool):
                setattr(self, name, int(getattr(self, name)))

        def number(name: str) -> float:
            value = getattr(self, name)
            check(is_number(value) and math.isfinite(value), name, "a finite number")
            setattr(self, name, float(value))
            return float(value)

        def integer(name: str, low: int, high: int | None, allowed: str, optional: bool = False) -> None:
            value = getattr(self, name)
            check((optional and value is None) or (is_int(value) and low <= value and (high is None or value <= high)),
                  name, allowed)
            if value is not None:
                setattr(self, name, int(value))

        integer("n", 1, 128, "an integer in [1, 128]")
        integer("best_of", self.n, self.n, f"None or n ({self.n}): every sample is returned and none is ranked "
                "(vLLM V1 dropped best_of)", optional=True)
        check(number("temperature") >= 0, "temperature", ">= 0 (0 = greedy)")
        if 0 < self.temperature < MIN_TEMPERATURE:
            log.warning("temperature %g is below %g, whose scaled logits stay finite: sampling at %g (vLLM's rule)",
                        self.temperature, MIN_TEMPERATURE, MIN_TEMPERATURE)
            self.temperature = MIN_TEMPERATURE
        check(self.temperature > 0 or self.n == 1, "n", "1 with greedy sampling (temperature 0): its copies would "
              "all be the same (vLLM's rule)")
        check(0 < number("top_p") <= 1, "top_p", "in (0, 1]")
        integer("top_k", -1, INT64[1], "an integer >= -1 (0 or -1 = off)")
        check(0 <= number("min_p") <= 1, "min_p", "in [0, 1]")
        check(-2 <= number("presence_penalty") <= 2, "presence_penalty", "in [-2, 2]")
        check(-2 <= number("frequency_penalty") <= 2, "frequency_penalty", "in [-2, 2]")
        check(number("repetition_penalty") > 0, "repetition_penalty", "> 0 (1 = off)")
        integer("seed", INT64[0], INT64[1], f"an integer in [{INT64[0]}, {INT64[1]}] or None", optional=True)
        integer("max_tokens", 1, None, "an integer >= 1, or None (until the context is full)", optional=True)
        integer("min_tokens", 0, None, "an integer >= 0")
        if self.max_tokens is not None:
            check(self.min_tokens <= self.max_tokens, "min_tokens", f"<= max_tokens ({self.max_tokens})")
        integer("logprobs", -1, None, "None or an integer >= -1 (number of top alternatives; -1: the whole "
                "vocabulary)", optional=True)
        integer("prompt_logprobs", -1, None, "None or an integer >= -1 (number of top alternatives per prompt "
                "token; -1: the whole vocabulary)", optional=True)
        check(self.skip_reading_prefix_cache in (None, True, False), "skip_reading_prefix_cache",
              "None, True or False")
        check(isinstance(self.output_kind, RequestOutputKind), "output_kind", "a RequestOutputKind")
        check(self.extra_args is None or isinstance(self.extra_args, dict), "extra_args", "None or a dict")
        check(self.flat_logprobs is False, "flat_logprobs", "False: logprobs come as vLLM's list of dicts")
        check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
              "structured_outputs", "None or a StructuredOutputsParams")
        for flag in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                     "spaces_between_special_tokens", "detokenize", "use_speculation"):
            check(isinstance(getattr(self, flag), bool), flag, "True or False")
        self.stop_token_ids = plain_ints(self.stop_token_ids)
        self.allowed_token_ids = plain_ints(self.allowed_token_ids)
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        check(isinstance(stops, (list, tuple)) and all(isinstance(s, str) and s for s in stops), "stop",
              "a non-empty string or a list of them")
        check(not stops or self.detokenize, "stop", "None with detokenize=False: stop strings are matched in the "
              "output text, which it does not make (vLLM's rule)")
        self.stop_strings = tuple(stops)
        self.stop = list(dict.fromkeys(stops))  # vLLM's shape: a list, each string once
        ids = self.stop_token_ids or []
        check(isinstance(ids, (list, tuple)) and all(is_int(i) and i >= 0 for i in ids), "stop_token_ids",
              "a list of token ids >= 0")
        bias = self.logit_bias or {}
        check(isinstance(bias, dict) and all(
            token_id(k) is not None and is_number(v) and abs(v) <= FLOAT32_MAX for k, v in bias.items()),
            "logit_bias", "a dict of token id (>= 0) -> a bias finite in float32, where logits are biased")
        self.logit_bias = {token_id(k): float(v) for k, v in bias.items()} or None
        allowed = self.allowed_token_ids
        check(allowed is None or (isinstance(allowed, (list, tuple)) and len(allowed) > 0
                                  and all(is_int(i) and i >= 0 for i in allowed)), "allowed_token_ids",
              "None or a non-empty list of token ids >= 0")
        self.allowed_token_ids = list(dict.fromkeys(allowed)) if allowed is not None else None
        truncate = self.truncate_prompt_tokens
        check(truncate is None or (is_int(truncate) and (truncate == -1 or 1 <= truncate <= INT64[1])),
              "truncate_prompt_tokens", "None, -1 (as many as the context holds) or an integer >= 1")
        budget = self.thinking_token_budget
        check(budget is None or (is_int(budget) and 0 <= budget <= INT64[1]), "thinking_token_budget",
              "None or an integer >= 0")
        words = self.bad_words
        check(words is None or (isinstance(words, (list, tuple)) and len(words) <= MAX_BAD_WORDS and all(
            isinstance(w, str) and w.strip() for w in words)), "bad_words",
            f"None or a list of at most {MAX_BAD_WORDS} strings, none empty or only whitespace")
        self.bad_words = list(words) if words else []
        self.stop_token_ids = list(dict.fromkeys(ids))

    @classmethod
    def from_optional(cls, **fields: Any) -> SamplingParams:
        """vLLM's constructor for API layers: the numeric knobs given as None take their defaults, and logit_bias
        values are clamped to OpenAI's [-100, 100]; every other field as given."""
        knobs = ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "min_tokens")
        given = {k: v for k, v in fields.items() if v is not None or k not in knobs}
        bias = given.get("logit_bias")
        if isinstance(bias, dict):
            given["logit_bias"] = {k: max(-MAX_LOGIT_BIAS, min(MAX_LOGIT_BIAS, v)) if is_number(v) else v
                                   for k, v in bias.items()}
        return cls(**given)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def reads_prefix_cache(self) -> bool:
        """Whether prefix caching may skip the prompt's remembered start: not where the request asks for
        every prompt token's logprobs, or says not to (vLLM's rule)."""
        return self.prompt_logprobs is None and not self.skip_reading_prefix_cache

    def check_model(self, vocab_size: int, max_logprobs: int = MAX_LOGPROBS) -> None:
        """Token ids named by the request must exist in the model's vocabulary, and the logprobs it asks
        for fit the engine's `max_logprobs` (-1 on either side: the whole vocabulary)."""
        most = vocab_size if max_logprobs == -1 else max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            asked = top_count(getattr(self, name), vocab_size)
            if asked > most:
                raise SamplingError(f"SamplingParams.{name}={getattr(self, name)} asks for {asked} logprobs a token; "
                                    f"the engine's max_logprobs is {max_logprobs} (LLM(max_logprobs=...), "
                                    "--max-logprobs; -1: the whole vocabulary)")
        for name, ids in (("stop_token_ids", self.stop_token_ids or []), ("logit_bias", self.logit_bias or {}),
                          ("allowed_token_ids", self.allowed_token_ids or [])):
            bad = [i for i in ids if i >= vocab_size]
            if bad:
                raise SamplingError(f"SamplingParams.{name} has token ids {bad[:5]} outside the vocabulary "
                                    f"[0, {vocab_size})")


def top_count(k: int | None, vocab_size: int) -> int:
    """The alternatives `logprobs` / `prompt_logprobs` k asks for: -1 is the whole vocabulary, None none."""
    return vocab_size if k == -1 else k or 0
