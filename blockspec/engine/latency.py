"""Finished requests' latencies and sizes in vLLM's intervals and buckets, for both metric paths: the server's
Prometheus histograms (`server/metrics.py`, from each step's report) and the engine's own plain counts
(`RequestHistograms`, which `LLM.get_metrics()` gives as vLLM's reader Histogram objects, a rank's included:
plain values cross the pipe)."""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

from blockspec.request import Request

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
# vLLM's inter-token buckets, from 10 ms, with four below it: a step of a small model on a GPU takes less
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
# vLLM's 1-2-5 series for token counts (vLLM ends it at max_model_len; here at a million)
TOKEN_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5) if m * 10**e <= 10**6)
N_BUCKETS = (1, 2, 5, 10, 20)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)  # vLLM's

FINISH_REASONS = ("stop", "length", "abort")  # vLLM's request_success labels (a failed request is counted apart)

# the histograms of a finished request (vLLM's names, without the prefix) and their buckets
REQUEST_HISTOGRAMS = {
    "time_to_first_token_seconds": TTFT_BUCKETS, "e2e_request_latency_seconds": REQUEST_BUCKETS,
    "request_queue_time_seconds": REQUEST_BUCKETS, "request_prefill_time_seconds": REQUEST_BUCKETS,
    "request_decode_time_seconds": REQUEST_BUCKETS, "request_inference_time_seconds": REQUEST_BUCKETS,
    "request_time_per_output_token_seconds": TPOT_BUCKETS, "request_prompt_tokens": TOKEN_BUCKETS,
    "request_generation_tokens": TOKEN_BUCKETS, "request_params_max_tokens": TOKEN_BUCKETS,
    "request_params_n": N_BUCKETS, "request_max_num_generation_tokens": TOKEN_BUCKETS,
}


def span(start: float | None, end: float | None) -> float | None:
    """Seconds from start to end, or None where either did not happen."""
    return None if start is None or end is None else max(end - start, 0.0)


class Finish(NamedTuple):
    """A finished request's times, in vLLM's intervals (None: the phase did not happen, e.g. a request
    aborted while it waited)."""

    reason: str  # stop, length, abort, error
    e2e: float  # from arrival at the front to the finish
    queue: float | None  # from the engine's arrival to its first slot
    prefill: float | None  # from its first slot to its first token
    decode: float | None  # from its first token to its last
    inference: float | None  # from its first slot to its last token
    tpot: float | None  # decode time per output token after the first
    prompt_tokens: int = 0
    generation_tokens: int = 0
    n: int = 1  # the copies its prompt asked for (SamplingParams.n)
    max_tokens: int | None = None  # its SamplingParams.max_tokens
    group: tuple[str, int] = ("", 0)  # its prompt: the front's request id and the prompt's index in it

    @classmethod
    def of(cls, req: Request, arrival: float, finish_time: float, group: tuple[str, int] = ("", 0)) -> Finish:
        """A request's finish, its end to end time from `arrival` (the front's, where a server has one)."""
        first = req.first_token_time
        decode = span(first, finish_time)
        n = len(req.output_ids)
        return cls(req.finish_reason or "abort", max(finish_time - arrival, 0.0),
                   span(req.arrival_time, req.scheduled_time), span(req.scheduled_time, first), decode,
                   span(req.scheduled_time, finish_time), decode / (n - 1) if decode is not None and n > 1 else None,
                   len(req.prompt_token_ids), n, req.params.n, req.params.max_tokens, group)

    def observations(self) -> list[tuple[str, float]]:
        """(histogram, value) for each histogram a finished request adds to, the first token's aside; none
        for a failed one (counted apart, as vLLM leaves failures out of its latencies)."""
        if self.reason == "error":
            return []
        timed = (("e2e_request_latency_seconds", self.e2e), ("request_queue_time_seconds", self.queue),
                 ("request_prefill_time_seconds", self.prefill), ("request_decode_time_seconds", self.decode),
                 ("request_inference_time_seconds", self.inference),
                 ("request_time_per_output_token_seconds", self.tpot),
                 ("request_prompt_tokens", self.prompt_tokens), ("request_generation_tokens", self.generation_tokens),
                 ("request_params_max_tokens", self.max_tokens))
        return [(name, value) for name, value in timed if value is not None]


@dataclass
class Copies:
    """A prompt's n copies until the last of them finishes (a failed copy counts as finished with what it had):
    then its n and the most any copy generated, which vLLM observes once a request."""

    left: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)  # group: (copies left, most)

    def finished(self, f: Finish) -> tuple[int, int] | None:
        left, most = self.left.pop(f.group, (f.n, 0))
        most = max(most, f.generation_tokens)
        if left > 1:
            self.left[f.group] = (left - 1, most)
            return None
        return f.n, most


@dataclass
class Buckets:
    """One histogram's plain counts: per bucket (the last past every bound), and the sum of the values."""

    bounds: tuple[float, ...]
    counts: list[int]
    sum: float = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # Prometheus's buckets: value <= bound
        self.sum += value


class RequestHistograms:
    """The engine's finished requests: REQUEST_HISTOGRAMS' counts from each one's own arrival, and how many
    finished for each reason."""

    def __init__(self) -> None:
        self.histograms = {name: Buckets(bounds, [0] * (len(bounds) + 1))
                           for name, bounds in REQUEST_HISTOGRAMS.items()}
        self.reasons: Counter[str] = Counter()
        self.copies = Copies()

    def observe(self, req: Request) -> None:
        assert req.finish_time is not None
        group = req.request_id.rsplit("-", 1)[0] if req.params.n > 1 else req.request_id
        f = Finish.of(req, req.arrival_time, req.finish_time, (group, 0))
        self.reasons[f.reason] += 1
        if f.reason != "error" and req.first_token_time is not None:
            self.histograms["time_to_first_token_seconds"].observe(span(req.arrival_time, req.first_token_time))
        for name, value in f.observations():
            self.histograms[name].observe(value)
        done = self.copies.finished(f)
        if done is not None:
            self.histograms["request_params_n"].observe(done[0])
            self.histograms["request_max_num_generation_tokens"].observe(done[1])
