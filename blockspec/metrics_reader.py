"""`LLM.get_metrics()` in the shape of vLLM's `vllm.v1.metrics.reader`: a list of Counter, Gauge and Vector
objects, each with a name and labels (the latency histograms are the server's, on /metrics), so code written
against vLLM's reader (its speculative decoding example reads `vllm:spec_decode_num_drafts` and the
per-position Vector by name) runs unchanged.

Names vLLM has are under `vllm:`; counts only blockspec keeps (the draft-length policy's choices) are
under `blockspec:`. The engine's own dict, with the time split and calibration figures, stays
available as `LLM.get_stats()`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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
    if speculative:
        out += [Counter(name, dict(labels), stats[key]) for key, name in SPEC_COUNTERS.items()]
        per_pos = list(stats["num_accepted_tokens_per_pos"])  # a position drafts reach once is counted from then
        out.append(Vector("vllm:spec_decode_num_accepted_tokens_per_pos", dict(labels),
                          per_pos + [0] * (stats["num_speculative_tokens"] - len(per_pos))))
        out += [Counter("blockspec:spec_decode_policy_steps", {**labels, "draft_length": str(k)}, n)
                for k, n in sorted(stats["policy_steps"].items())]
        out.append(Counter("blockspec:spec_decode_policy_parked_requests", dict(labels), stats["num_parked_requests"]))
    return out
