"""Prometheus metrics named like vLLM's (`vllm:` becomes `blockspec:`), so existing dashboards and the
usual "difference the spec-decode counters over a run" recipes work unchanged.

Each app gets its own CollectorRegistry (several servers can live in one process, as in tests).
Everything is updated from the engine thread; prometheus-client's metrics are thread-safe.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from blockspec.engine.engine import Engine
from blockspec.engine.request import Request

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)


class ServerMetrics:
    """The server's metrics; `observe_*` are called by the engine thread at the matching events."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r, lbl = self.registry, ["model_name"]

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"blockspec:{name}", doc, lbl + list(extra), registry=r)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"blockspec:{name}", doc, lbl, registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"blockspec:{name}", doc, lbl, buckets=buckets, registry=r)

        self.running = gauge("num_requests_running", "Requests holding a KV slot (prefilling or decoding).")
        self.waiting = gauge("num_requests_waiting", "Requests queued for a free KV slot.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache slots in use (1 = full).")
        self.prompt_tokens = counter("prompt_tokens", "Prefilled prompt tokens.")
        self.generation_tokens = counter("generation_tokens", "Generated (committed) tokens.")
        self.request_success = counter("request_success", "Finished requests by finish reason.", ("finished_reason",))
        self.drafts = counter("spec_decode_num_drafts", "Verify steps in which a request drafted.")
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens sent to verification.")
        self.accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted, by position in the block.", ("position",))
        self.ttft = histogram("time_to_first_token_seconds", "From arrival to the first token.", TTFT_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.", TPOT_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "From arrival to finish.", E2E_BUCKETS)
        for metric in (self.running, self.waiting, self.kv_usage, self.prompt_tokens, self.generation_tokens,
                       self.drafts, self.draft_tokens, self.accepted, self.ttft, self.tpot, self.e2e):
            metric.labels(model_name)  # export every series from the start, at zero
        self._seen_spec: tuple[int, int, int, list[int]] = (0, 0, 0, [])
        self._seen_generated = 0

    def observe_step(self, engine: Engine) -> None:
        """Queue gauges, KV usage and the engine's cumulative counters, differenced since the last step."""
        name = self.model_name
        self.running.labels(name).set(len(engine.running))
        self.waiting.labels(name).set(len(engine.waiting))
        cache = engine.runner.cache
        self.kv_usage.labels(name).set(1 - cache.num_free_slots / cache.max_slots)
        self.generation_tokens.labels(name).inc(engine.num_generated - self._seen_generated)
        self._seen_generated = engine.num_generated
        s = engine.spec_totals
        drafts, draft_tokens, accepted, per_pos = self._seen_spec
        self.drafts.labels(name).inc(s.num_drafts - drafts)
        self.draft_tokens.labels(name).inc(s.num_draft_tokens - draft_tokens)
        self.accepted.labels(name).inc(s.num_accepted_tokens - accepted)
        for pos, n in enumerate(s.num_accepted_tokens_per_pos):
            self.accepted_per_pos.labels(name, str(pos)).inc(n - (per_pos[pos] if pos < len(per_pos) else 0))
        self._seen_spec = (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens,
                           list(s.num_accepted_tokens_per_pos))

    def observe_first_token(self, req: Request, arrival: float) -> None:
        assert req.first_token_time is not None
        self.prompt_tokens.labels(self.model_name).inc(len(req.prompt_token_ids))
        self.ttft.labels(self.model_name).observe(max(req.first_token_time - arrival, 0.0))

    def observe_finish(self, req: Request, arrival: float, finish_time: float) -> None:
        name = self.model_name
        self.request_success.labels(name, req.finish_reason or "abort").inc()
        self.e2e.labels(name).observe(max(finish_time - arrival, 0.0))
        if req.first_token_time is not None and len(req.output_ids) > 1:
            self.tpot.labels(name).observe((finish_time - req.first_token_time) / (len(req.output_ids) - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
