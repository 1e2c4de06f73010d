"""A request's life: its tokens, cache lengths, stop handling, text and metrics; and the outputs users see."""

from __future__ import annotations

import bisect
import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import Tensor

from blockspec.bad_words import BadWords
from blockspec.sampling_params import SamplingParams

if TYPE_CHECKING:
    from blockspec.reasoning import ThinkingBudget
    from blockspec.structured import Grammar


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SpecStats:
    """Speculation counters with vLLM's names and meanings."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def record(self, num_draft: int, num_accepted: int) -> None:
        if num_draft <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        if len(self.num_accepted_tokens_per_pos) < num_draft:
            self.num_accepted_tokens_per_pos.extend([0] * (num_draft - len(self.num_accepted_tokens_per_pos)))
        for i in range(num_accepted):
            self.num_accepted_tokens_per_pos[i] += 1

    def merge(self, other: "SpecStats") -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for i, n in enumerate(other.num_accepted_tokens_per_pos):
            if i >= len(self.num_accepted_tokens_per_pos):
                self.num_accepted_tokens_per_pos.append(0)
            self.num_accepted_tokens_per_pos[i] += n

    def as_dict(self) -> dict[str, Any]:
        rate = self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
        length = 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
            "acceptance_rate": rate,
            "mean_acceptance_length": length,
        }


@dataclass
class Logprob:
    """vLLM's: the value, its rank (1 = most likely) and the token's text alone (None without a tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class TokenStrings:
    """Token id -> the text of that token alone, as logprobs show it ('token_id:N' without a tokenizer)."""

    def __init__(self, tokenizer: object) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, tok: int) -> str:
        if tok not in self.cache:
            self.cache[tok] = self.tokenizer.decode([tok]) if self.tokenizer is not None else f"token_id:{tok}"
        return self.cache[tok]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: str | int | None = None
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        """Whether this sequence has ended (vLLM's `CompletionOutput.finished()`)."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict[str, Any]
    error: str | None = None
    # with SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (nothing before it)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # prompt tokens found in the prefix cache at the request's first admission (None: not admitted yet)
    num_cached_tokens: int | None = None


def prompt_tail(tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool) -> list[int]:
    """The prompt tokens an output's text is decoded after: the last 6, or where those are all skipped special
    tokens, as many more (doubling) as it takes to reach text, else a decoder that strips a leading space
    (Llama-2, Mistral) takes the first output token's."""
    n = 6
    while skip_special_tokens and tokenizer is not None and n < len(prompt_ids) \
            and not tokenizer.decode(prompt_ids[-n:], skip_special_tokens=True):
        n *= 2
    return list(prompt_ids[-n:])


class IncrementalDetokenizer:
    """Text of a growing token list without re-decoding it all each step. Seeded with the prompt's
    last tokens (so the first token's leading space comes out right), it returns only new text and
    holds back a token that ends mid-character: prefix / read offsets, as vLLM.

    With a fast tokenizer the two decodes a token costs run as one step of the `tokenizers`
    library's DecodeStream, in Rust, several times faster than the two Python-side decodes (at a
    large batch the decodes are a real share of a step's host time). The stream
    gives the offsets' text chunk for chunk; it is not used where it would not: a tokenizer that
    cleans up spaces after decoding, or a prompt tail that ends mid-character. A step the stream refuses (it checks that
    the text it emitted is still a prefix) hands the request to the offsets, which continue from
    the same state. `fast=False` keeps the offsets throughout (the reference the stream is tested
    against).

    The text is kept as the pieces `add` returned, joined only when read whole: a `str` attribute grown by
    `+=` is copied whole at every token, which over a long output costs more than the decode itself.
    Readers of the newest text (streaming, stop strings) take `text_from`, which reads only the pieces it
    spans."""

    def __init__(self, tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool, fast: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = prompt_tail(tokenizer, prompt_ids, skip_special_tokens)
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self._parts: list[str] = []  # the text as `add` returned it, joined into one on a whole read
        self._starts: list[int] = []  # each part's first character
        self.length = 0  # characters of text
        self.stream: Any = None
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        if fast and self.backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
            if not tokenizer.decode(self.ids, skip_special_tokens=self.skip).endswith("\ufffd"):
                from tokenizers.decoders import DecodeStream

                self.stream = DecodeStream(ids=self.ids, skip_special_tokens=self.skip)

    def add(self, token_id: int) -> str:
        """Append one token; return the newly completed text (may be empty mid-character)."""
        if self.tokenizer is None:
            return ""
        self.ids.append(token_id)
        new = self._step(token_id) if self.stream is not None else self._decode()
        if not new:
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self._parts.append(new)
        self._starts.append(self.length)
        self.length += len(new)
        return new

    @property
    def text(self) -> str:
        """The whole text (its parts joined once, then kept as one)."""
        if len(self._parts) > 1:
            self._parts, self._starts = ["".join(self._parts)], [0]
        return self._parts[0] if self._parts else ""

    def text_from(self, start: int) -> str:
        """text[start:], joining only the parts it spans."""
        if start >= self.length:
            return ""
        i = max(0, bisect.bisect_right(self._starts, start) - 1)
        return "".join(self._parts[i:])[start - self._starts[i]:]

    def _step(self, token_id: int) -> str:
        try:
            return self.stream.step(self.backend, token_id) or ""
        except Exception:  # the stream refused this step: the offsets carry on from the same state
            self.stream = None
            return self._decode()

    def _decode(self) -> str:
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=self.skip)
        full = self.tokenizer.decode(self.ids[self.prefix_offset :], skip_special_tokens=self.skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            return full[len(prefix) :]
        return ""


@dataclass(eq=False)  # a request is itself: `in` / `remove` must not compare every field
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    index: int = 0
    cache_salt: str | None = None  # prefix-cache pages are shared only with requests of the same salt
    arrival_time: float = field(default_factory=time.perf_counter)
    status: Status = Status.WAITING
    slot: int = -1
    output_ids: list[int] = field(default_factory=list)
    num_cached: int = 0  # target KV length (tokens whose K/V are in the cache)
    num_draft_ctx: int = 0  # drafter context length (tokens whose features are in the draft cache)
    num_pending: int = 0  # target taps held in the proposer's device buffer, not in the draft cache yet
    kv_capacity: int = 0  # positions the KV pages of its slot hold
    num_cached_tokens: int | None = None  # prompt tokens its first prefill found in the prefix cache
    cached_draft_ctx: int = 0  # of the positions its shared pages hold, those with the drafter's context too
    shares_settled: bool = False  # since its admission: its shared pages are settled for its first prefill chunk
    prefix_lookup_counted: bool = False  # its prompt's prefix-cache lookup is in the queries and hits (once)
    feeds_drafter: bool = False  # set at admission: the drafter gets its context and it may draft
    output_counts: Tensor | None = None  # [V] int32 history for penalties (device)
    prompt_mask: Tensor | None = None  # [V] bool tokens of the prompt (device)
    allowed_bits: Tensor | None = None  # [ceil(V / 32)] int32 bitmask of allowed_token_ids (device)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    # with prompt_logprobs: the prompt's entries computed so far (prefill chunks append; n copies share one)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    bad_words: BadWords = ()  # SamplingParams.bad_words tokenized (bad_words.word_sequences)
    detok: IncrementalDetokenizer | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    spec: SpecStats = field(default_factory=SpecStats)
    scheduled_time: float | None = None  # when it first got a slot (its time in the queue ends there)
    first_token_time: float | None = None
    finish_time: float | None = None
    truncated_text: str | None = None
    num_preemptions: int = 0  # times its pages were taken back and its tokens recomputed later
    requeues: int = 0  # times it went back to the queue: rows of a step launched in an earlier stay are stale
    num_failed_steps: int = 0  # engine steps it took part in that raised, less those another request was failed for
    last_failure: str | None = None  # the error id of the last of them
    suspect: bool = False  # in a step that raised: it runs alone until it commits a token past suspect_since
    suspect_since: int = 0
    grammar: Grammar | None = None  # structured output: its constraint, advanced by committed tokens
    thinking_budget: ThinkingBudget | None = None  # thinking_token_budget's count, advanced by committed tokens
    # what its parameters ask of every step, fixed at creation: a step tests them for each of its rows
    # sampling reads committed tokens (penalties, min_tokens, a grammar or thinking budget, a longer bad word) or
    # keeps logprobs
    needs_history: bool = field(init=False)
    needs_processing: bool = field(init=False)  # more than the raw logits' argmax (see Engine.needs_processing)
    # its rows sample from their own values alone (temperature, top-k / top-p / min-p, seed, position): no
    # history, bias, bans or token masks (`Columns`)
    row_values_only: bool = field(init=False)

    def __post_init__(self) -> None:
        p = self.params
        # a grammar's masks and a longer bad word's ban follow the committed tokens, as penalties do
        self.needs_history = (p.uses_penalties or bool(p.min_tokens) or p.logprobs is not None
                              or p.structured_outputs is not None or p.thinking_token_budget is not None
                              or any(len(w) > 1 for w in self.bad_words))
        self.needs_processing = (self.needs_history or not p.greedy or bool(p.logit_bias) or bool(self.bad_words)
                                 or p.allowed_token_ids is not None)
        self.row_values_only = not (self.needs_history or p.logit_bias or self.bad_words
                                    or p.allowed_token_ids is not None)

    @property
    def length(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_ids)

    @property
    def prefill_len(self) -> int:
        """Tokens the target must hold before this request decodes: its prompt, or after a preemption
        every token but the last, which is the next step's anchor."""
        return self.length - 1 if self.output_ids else len(self.prompt_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens start..end-1 of prompt + output, without joining the two lists."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_ids[max(start - n, 0) : end - n]

    @property
    def text(self) -> str:
        if self.truncated_text is not None:
            return self.truncated_text
        return self.detok.text if self.detok else ""

    @property
    def text_length(self) -> int:
        if self.truncated_text is not None:
            return len(self.truncated_text)
        return self.detok.length if self.detok else 0

    def text_from(self, start: int) -> str:
        """text[start:] without joining the whole text (`IncrementalDetokenizer.text_from`)."""
        if self.truncated_text is not None:
            return self.truncated_text[start:]
        return self.detok.text_from(start) if self.detok else ""

    def metrics(self) -> dict[str, Any]:
        return group_metrics([self])

    def to_output(self) -> RequestOutput:
        completion = CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=list(self.output_ids),
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
        )
        return RequestOutput(self.request_id, self.prompt, list(self.prompt_token_ids), [completion],
                             self.status is Status.FINISHED, self.metrics(), self.error, self.prompt_logprobs,
                             self.num_cached_tokens)


def group_metrics(copies: list[Request]) -> dict[str, Any]:
    """One prompt's metrics over its n copies (one request for n = 1): from the first token of any copy to
    the last one's finish, tokens and speculation counters summed, the time per output token the copies'
    mean."""
    first = copies[0]
    firsts = [c.first_token_time for c in copies if c.first_token_time]
    ends = [c.finish_time for c in copies]
    out: dict[str, Any] = {
        "arrival_time": first.arrival_time,
        "first_token_time": min(firsts) if firsts else None,
        "finished_time": max(ends) if all(ends) else None,
        "ttft_s": min(firsts) - first.arrival_time if firsts else None,
        "num_prompt_tokens": len(first.prompt_token_ids),
        "num_generated_tokens": sum(len(c.output_ids) for c in copies),
    }
    tpots = [(c.finish_time - c.first_token_time) / (len(c.output_ids) - 1) for c in copies
             if c.finish_time and c.first_token_time and len(c.output_ids) > 1]
    if tpots:
        out["tpot_s"] = sum(tpots) / len(tpots)
    spec = SpecStats()
    for c in copies:
        spec.merge(c.spec)
    out.update(spec.as_dict())
    return out
