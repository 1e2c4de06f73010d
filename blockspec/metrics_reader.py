"""`LLM.get_metrics()` in the shape of vLLM's `vllm.v1.metrics.reader`: a list of Counter, Gauge, Vector and
Histogram objects, each with a name and labels, so code written against vLLM's reader (its speculative decoding
example reads `vllm:spec_decode_num_drafts` and the per-position Vector by name, its metrics example prints
every histogram's count and sum) runs unchanged. The histograms are the engine's finished requests' (from each
request's arrival at the engine; the server's, on /metrics, count from its arrival at the server).

Names vLLM has are under `vllm:`; counts only blockspec keeps (the draft-length policy's choices) are
under `blockspec:`. The engine's own dict, with the time split and calibration figures, stays
available as `LLM.get_stats()`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from blockspec.engine.latency import FINISH_REASONS


@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    """A count that only grows."""

    value: int


@dataclass
class Vector(Metric):
    """Counts by position: vLLM's shape for spec_decode_num_accepted_tokens_per_pos."""

    values: list[int]


@dataclass
class Gauge(Metric):
    """A value that goes up and down."""

    value: float


@dataclass
class Histogram(Metric):
    """Observations counted by bucket: `buckets` maps each upper bound (as Prometheus writes it, "+Inf" last)
    to the observations at or below it, as vLLM's reader gives them."""

    count: int
    sum: float
    buckets: dict[str, int]


def histogram(name: str, labels: dict[str, str], bounds: tuple[float, ...], counts: list[int], total: float
              ) -> Histogram:
    """A Histogram from per-bucket counts (the last past every bound): cumulative, as Prometheus keeps them."""
    cumulative = list(itertools.accumulate(counts))
    keys = [repr(float(b)) for b in bounds] + ["+Inf"]
    return Histogram(name, labels, cumulative[-1], total, dict(zip(keys, cumulative)))


# the engine's counters (`Engine.metrics()` keys) and vLLM's names for them
ENGINE_COUNTERS = {"num_generated_tokens": "vllm:generation_tokens", "num_prompt_tokens": "vllm:prompt_tokens",
                   "num_preemptions": "vllm:num_preemptions",
                   "num_prefix_cache_queries": "vllm:prefix_cache_queries",
                   "num_prefix_cache_hits": "vllm:prefix_cache_hits"}
SPEC_COUNTERS = {"num_drafts": "vllm:spec_decode_num_drafts", "num_draft_tokens": "vllm:spec_decode_num_draft_tokens",
                 "num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens"}


def metrics_of(stats: dict[str, Any], model_name: str, speculative: bool) -> list[Metric]:
    """The engine's dict as vLLM's reader objects, labelled as vLLM labels them (model_name, engine)."""
    labels = {"model_name": model_name, "engine": "0"}
    out: list[Metric] = [Gauge(f"vllm:num_requests_{state}", dict(labels), stats[f"num_requests_{state}"])
                         for state in ("running", "waiting")]
    out += [Counter(name, dict(labels), stats[key]) for key, name in ENGINE_COUNTERS.items()]
    out.append(Gauge("vllm:kv_cache_usage_perc", dict(labels), stats["kv_cache_usage"]))
    finished = stats["finished_requests"]
    out += [Counter("vllm:request_success", {**labels, "finished_reason": reason}, finished.get(reason, 0))
            for reason in FINISH_REASONS]
    out.append(Counter("blockspec:request_failure", dict(labels), finished.get("error", 0)))
    out += [histogram(f"vllm:{name}", dict(labels), *counts) for name, counts in stats["request_histograms"].items()]
    if speculative:
        out += [Counter(name, dict(labels), stats[key]) for key, name in SPEC_COUNTERS.items()]
        per_pos = list(stats["num_accepted_tokens_per_pos"])  # a position drafts reach once is counted from then
        out.append(Vector("vllm:spec_decode_num_accepted_tokens_per_pos", dict(labels),
                          per_pos + [0] * (stats["num_speculative_tokens"] - len(per_pos))))
        out += [Counter("blockspec:spec_decode_policy_steps", {**labels, "draft_length": str(k)}, n)
                for k, n in sorted(stats["policy_steps"].items())]
        out.append(Counter("blockspec:spec_decode_policy_parked_requests", dict(labels), stats["num_parked_requests"]))
    return out
