"""Prometheus metrics named like vLLM's (`vllm:` becomes `blockspec:`), so existing dashboards and the
usual "difference the spec-decode counters over a run" recipes work unchanged.

Each app gets its own CollectorRegistry (several servers can live in one process, as in tests).
The engine side describes each step in plain values (`StepMetrics`), which the server's event loop
applies, so the engine may run in another process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from blockspec.engine.loop import StepMetrics
from blockspec.speculative.policy import PolicyView

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)


class ServerMetrics:
    """The server's metrics, updated from each engine step's `StepMetrics`."""

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
        self.waiting = gauge("num_requests_waiting", "Requests queued for a slot and KV pages (preempted ones too).")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache pages in use (1 = full).")
        self.preemptions = counter("num_preemptions", "Requests preempted for KV pages (recomputed later).")
        self.prompt_tokens = counter("prompt_tokens", "Prefilled prompt tokens.")
        self.generation_tokens = counter("generation_tokens", "Generated (committed) tokens.")
        self.request_success = counter("request_success", "Finished requests by finish reason (stop, length, "
                                       "abort).", ("finished_reason",))
        self.request_failure = counter("request_failure", "Requests the engine failed (a step that failed while "
                                       "it ran alone, or non-finite logits); not in the latency histograms.")
        self.drafts = counter("spec_decode_num_drafts", "Verify steps in which a request drafted.")
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens sent to verification.")
        self.accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted, by position in the block.", ("position",))
        self.policy_steps = counter("spec_decode_policy_steps",
                                    "Decode steps by the number of drafts the policy chose (0 = plain).",
                                    ("draft_length",))
        self.policy_step_seconds = Gauge("blockspec:spec_decode_policy_step_seconds",
                                         "The policy's measured step time (minimum of recent samples).",
                                         ["model_name", "batch_bucket", "draft_length"], registry=r)
        self.policy_expected_tokens = Gauge("blockspec:spec_decode_policy_expected_tokens",
                                            "Tokens per request and step the policy expects of each draft length.",
                                            ["model_name", "draft_length"], registry=r)
        self.policy_parked = Gauge("blockspec:spec_decode_policy_parked",
                                   "1 while the policy parks this batch bucket: plain won there, and requests "
                                   "that join it do not feed the drafter.", ["model_name", "batch_bucket"], registry=r)
        self.parked_joins = counter("spec_decode_policy_parked_requests",
                                    "Requests that joined a parked batch: they ran as plain decoding.")
        self.ttft = histogram("time_to_first_token_seconds", "From arrival to the first token.", TTFT_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.", TPOT_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "From arrival to finish.", E2E_BUCKETS)
        for metric in (self.running, self.waiting, self.kv_usage, self.preemptions, self.prompt_tokens,
                       self.generation_tokens, self.request_failure,
                       self.drafts, self.draft_tokens, self.accepted, self.ttft, self.tpot, self.e2e):
            metric.labels(model_name)  # export every series from the start, at zero
        self._seen_spec: tuple[int, int, int, list[int]] = (0, 0, 0, [])
        self._seen_generated = 0
        self._seen_preemptions = 0
        self._seen_chosen: dict[int, int] = {}
        self._seen_parked: tuple[set[int], int] = (set(), 0)  # buckets parked, requests that joined them

    def observe(self, report: StepMetrics) -> None:
        """One engine step's observations: queue gauges, KV usage, the engine's cumulative counters
        (differenced since the last report), and the requests that got their first token or finished."""
        name, s = self.model_name, report.engine
        self.running.labels(name).set(s.running)
        self.waiting.labels(name).set(s.waiting)
        self.kv_usage.labels(name).set(s.kv_usage)
        self.generation_tokens.labels(name).inc(s.num_generated - self._seen_generated)
        self._seen_generated = s.num_generated
        self.preemptions.labels(name).inc(s.num_preemptions - self._seen_preemptions)
        self._seen_preemptions = s.num_preemptions
        drafts, draft_tokens, accepted, per_pos = self._seen_spec
        spec = s.spec
        self.drafts.labels(name).inc(spec.num_drafts - drafts)
        self.draft_tokens.labels(name).inc(spec.num_draft_tokens - draft_tokens)
        self.accepted.labels(name).inc(spec.num_accepted_tokens - accepted)
        for pos, n in enumerate(spec.num_accepted_tokens_per_pos):
            self.accepted_per_pos.labels(name, str(pos)).inc(n - (per_pos[pos] if pos < len(per_pos) else 0))
        self._seen_spec = (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens,
                           list(spec.num_accepted_tokens_per_pos))
        if s.policy is not None:
            self._observe_policy(s.policy)
        for prompt_tokens, ttft in report.first_tokens:
            self.prompt_tokens.labels(name).inc(prompt_tokens)
            self.ttft.labels(name).observe(ttft)
        for reason, e2e, tpot in report.finishes:
            if reason == "error":
                self.request_failure.labels(name).inc()
                continue
            self.request_success.labels(name, reason).inc()
            self.e2e.labels(name).observe(e2e)
            if tpot is not None:
                self.tpot.labels(name).observe(tpot)

    def _observe_policy(self, view: PolicyView) -> None:
        name = self.model_name
        for k, n in view.chosen.items():
            self.policy_steps.labels(name, str(k)).inc(n - self._seen_chosen.get(k, 0))
        self._seen_chosen = dict(view.chosen)
        for (bucket, k), seconds in view.step_seconds.items():
            self.policy_step_seconds.labels(name, str(bucket), str(k)).set(seconds)
        for k, tokens in view.expected_tokens.items():
            self.policy_expected_tokens.labels(name, str(k)).set(tokens)
        buckets, joins = self._seen_parked
        for bucket in buckets | set(view.parked):
            self.policy_parked.labels(name, str(bucket)).set(bucket in view.parked)
        self.parked_joins.labels(name).inc(view.parked_joins - joins)
        self._seen_parked = (buckets | set(view.parked), view.parked_joins)

    def render(self) -> bytes:
        return generate_latest(self.registry)
