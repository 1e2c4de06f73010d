"""Prometheus metrics with vLLM's names, labels and buckets, so existing dashboards and the usual
"difference the spec-decode counters over a run" recipes work unchanged: the metrics vLLM has are
named `vllm:...` (or `blockspec:...` with `--metrics-prefix blockspec`), labelled model_name and
engine; the ones only blockspec has (the draft-length policy's view, requests that failed) are
always `blockspec:...`. No `_created` series are exported (vLLM exports none).

Each app gets its own CollectorRegistry (several servers can live in one process, as in tests).
The engine side describes each step in plain values (`StepMetrics`), which the server's event loop
applies, so the engine may run in another process. The same observations feed the periodic log
lines (`interval_summary`), which read like vLLM's.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from blockspec.engine.latency import (FINISH_REASONS, ITERATION_BUCKETS, N_BUCKETS, REQUEST_BUCKETS, TOKEN_BUCKETS,
                                      TPOT_BUCKETS, TTFT_BUCKETS, Copies)
from blockspec.engine.loop import StepMetrics
from blockspec.request import SpecStats
from blockspec.speculative.policy import PolicyView

LABELS = ["model_name", "engine"]  # vLLM's; this server runs one engine, "0"


class ServerMetrics:
    """The server's metrics, updated from each engine step's `StepMetrics`."""

    def __init__(self, model_name: str, prefix: str = "vllm") -> None:
        disable_created_metrics()  # process-wide in prometheus_client: no `_created` series anywhere
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.labels = (model_name, "0")
        r = self.registry

        def vllm(kind: type, name: str, doc: str, extra: tuple[str, ...] = (), **kw: Any) -> Any:
            return kind(f"{prefix}:{name}", doc, LABELS + list(extra), registry=r, **kw)

        def own(kind: type, name: str, doc: str, extra: tuple[str, ...] = ()) -> Any:
            return kind(f"blockspec:{name}", doc, LABELS + list(extra), registry=r)

        self.running = vllm(Gauge, "num_requests_running", "Requests holding a KV slot (prefilling or decoding).")
        self.waiting = vllm(Gauge, "num_requests_waiting", "Requests queued for a slot and KV pages (preempted ones "
                                                           "too).")
        self.kv_usage = vllm(Gauge, "kv_cache_usage_perc", "Fraction of KV cache pages in use (1 = full).")
        self.preemptions = vllm(Counter, "num_preemptions", "Requests preempted for KV pages (recomputed later).")
        self.prefix_queries = vllm(Counter, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = vllm(Counter, "prefix_cache_hits", "Prompt tokens found in the prefix cache (not "
                                                              "prefilled).")
        self.prompt_tokens = vllm(Counter, "prompt_tokens", "Prefilled prompt tokens.")
        self.generation_tokens = vllm(Counter, "generation_tokens", "Generated (committed) tokens.")
        self.request_success = vllm(Counter, "request_success", "Finished requests by finish reason (stop, length, "
                                    "abort).", ("finished_reason",))
        self.drafts = vllm(Counter, "spec_decode_num_drafts", "Verify steps in which a request drafted.")
        self.draft_tokens = vllm(Counter, "spec_decode_num_draft_tokens", "Draft tokens sent to verification.")
        self.accepted = vllm(Counter, "spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.accepted_per_pos = vllm(Counter, "spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens accepted, by position in the block.", ("position",))
        self.ttft = vllm(Histogram, "time_to_first_token_seconds", "From arrival to the first token.",
                         buckets=TTFT_BUCKETS)
        self.itl = vllm(Histogram, "inter_token_latency_seconds", "Between the steps that give a request tokens "
                        "(with speculation a step gives several).", buckets=TPOT_BUCKETS)
        self.tpot = vllm(Histogram, "time_per_output_token_seconds", "vLLM's earlier name of "
                         "inter_token_latency_seconds (the same observations), kept for dashboards that read it.",
                         buckets=TPOT_BUCKETS)
        self.request_tpot = vllm(Histogram, "request_time_per_output_token_seconds", "Mean time per output token "
                                 "after the first, per request.", buckets=TPOT_BUCKETS)
        self.e2e = vllm(Histogram, "e2e_request_latency_seconds", "From arrival to finish.", buckets=REQUEST_BUCKETS)
        self.queue_time = vllm(Histogram, "request_queue_time_seconds", "From the engine's arrival to the first "
                               "slot (WAITING).", buckets=REQUEST_BUCKETS)
        self.prefill_time = vllm(Histogram, "request_prefill_time_seconds", "From the first slot to the first token "
                                 "(PREFILL).", buckets=REQUEST_BUCKETS)
        self.decode_time = vllm(Histogram, "request_decode_time_seconds", "From the first token to the last (DECODE).",
                                buckets=REQUEST_BUCKETS)
        self.inference_time = vllm(Histogram, "request_inference_time_seconds", "From the first slot to the last "
                                   "token (RUNNING).", buckets=REQUEST_BUCKETS)
        self.request_prompt_tokens = vllm(Histogram, "request_prompt_tokens", "Prompt tokens of each finished "
                                          "request.", buckets=TOKEN_BUCKETS)
        self.request_generation_tokens = vllm(Histogram, "request_generation_tokens", "Generated tokens of each "
                                              "finished request.", buckets=TOKEN_BUCKETS)
        self.request_max_generation = vllm(Histogram, "request_max_num_generation_tokens", "The most tokens one "
                                           "of a prompt's n copies generated, once its copies all finished.",
                                           buckets=TOKEN_BUCKETS)
        self.request_params_n = vllm(Histogram, "request_params_n", "The n of each finished request, once its "
                                     "copies all finished.", buckets=N_BUCKETS)
        self.request_params_max_tokens = vllm(Histogram, "request_params_max_tokens", "The max_tokens of each "
                                              "finished request that gave one.", buckets=TOKEN_BUCKETS)
        self.iteration_tokens = vllm(Histogram, "iteration_tokens_total", "Tokens of each engine step: prompt "
                                     "positions prefilled and tokens generated.", buckets=ITERATION_BUCKETS)
        self.request_failure = own(Counter, "request_failure", "Requests the engine failed (a step that failed while "
                                   "it ran alone, or non-finite logits); not in the latency histograms.")
        self.policy_steps = own(Counter, "spec_decode_policy_steps",
                                "Decode steps by the number of drafts the policy chose (0 = plain).", ("draft_length",))
        self.policy_step_seconds = own(Gauge, "spec_decode_policy_step_seconds",
                                       "The policy's measured step time (lower median of recent samples).",
                                       ("batch_bucket", "draft_length"))
        self.policy_expected_tokens = own(Gauge, "spec_decode_policy_expected_tokens",
                                          "Tokens per request and step the policy expects of each draft length.",
                                          ("draft_length",))
        self.policy_parked = own(Gauge, "spec_decode_policy_parked",
                                 "1 while the policy parks this batch bucket: plain won there, and requests that "
                                 "join it do not feed the drafter.", ("batch_bucket",))
        self.parked_joins = own(Counter, "spec_decode_policy_parked_requests",
                                "Requests that joined a parked batch: they ran as plain decoding.")
        for metric in (self.running, self.waiting, self.kv_usage, self.preemptions, self.prompt_tokens,
                       self.generation_tokens, self.request_failure, self.drafts, self.draft_tokens, self.accepted,
                       self.ttft, self.itl, self.tpot, self.request_tpot, self.e2e, self.queue_time, self.prefill_time,
                       self.decode_time, self.inference_time, self.request_prompt_tokens,
                       self.request_generation_tokens, self.request_max_generation, self.request_params_n,
                       self.request_params_max_tokens, self.iteration_tokens):
            metric.labels(*self.labels)  # export every series from the start, at zero
        for reason in FINISH_REASONS:
            self.request_success.labels(*self.labels, reason)
        # a finished request's histograms by their names in `Finish.observations`
        self.finished = {"e2e_request_latency_seconds": self.e2e, "request_queue_time_seconds": self.queue_time,
                         "request_prefill_time_seconds": self.prefill_time,
                         "request_decode_time_seconds": self.decode_time,
                         "request_inference_time_seconds": self.inference_time,
                         "request_time_per_output_token_seconds": self.request_tpot,
                         "request_prompt_tokens": self.request_prompt_tokens,
                         "request_generation_tokens": self.request_generation_tokens,
                         "request_params_max_tokens": self.request_params_max_tokens}
        self.copies = Copies()
        self._seen_spec = SpecStats()
        self._seen_generated = 0
        self._seen_prefilled = 0
        self._seen_preemptions = 0
        self._seen_prefix = (0, 0)
        self._prompt_total = 0
        self._seen_chosen: dict[int, int] = {}
        self._seen_parked: tuple[set[int], int] = (set(), 0)  # buckets parked, requests that joined them
        self._last_gauges = (0, 0, 0.0)  # running, waiting, KV usage of the latest report
        # the periodic log's interval: its start, and the totals then (prompt, generated, speculation)
        self._interval = (time.monotonic(), 0, 0, SpecStats())

    def observe(self, report: StepMetrics) -> None:
        """One engine step's observations: queue gauges, KV usage, the engine's cumulative counters
        (differenced since the last report), and the requests that got tokens or finished."""
        labels, s = self.labels, report.engine
        self._last_gauges = (s.running, s.waiting, s.kv_usage)
        self.running.labels(*labels).set(s.running)
        self.waiting.labels(*labels).set(s.waiting)
        self.kv_usage.labels(*labels).set(s.kv_usage)
        self.generation_tokens.labels(*labels).inc(s.num_generated - self._seen_generated)
        step_tokens = s.num_generated - self._seen_generated + s.num_prefilled - self._seen_prefilled
        if step_tokens > 0:
            self.iteration_tokens.labels(*labels).observe(step_tokens)
        self._seen_generated, self._seen_prefilled = s.num_generated, s.num_prefilled
        self.preemptions.labels(*labels).inc(s.num_preemptions - self._seen_preemptions)
        self._seen_preemptions = s.num_preemptions
        self.prefix_queries.labels(*labels).inc(s.prefix_cache[0] - self._seen_prefix[0])
        self.prefix_hits.labels(*labels).inc(s.prefix_cache[1] - self._seen_prefix[1])
        self._seen_prefix = s.prefix_cache
        seen, spec = self._seen_spec, s.spec
        self.drafts.labels(*labels).inc(spec.num_drafts - seen.num_drafts)
        self.draft_tokens.labels(*labels).inc(spec.num_draft_tokens - seen.num_draft_tokens)
        self.accepted.labels(*labels).inc(spec.num_accepted_tokens - seen.num_accepted_tokens)
        before = seen.num_accepted_tokens_per_pos
        for pos, n in enumerate(spec.num_accepted_tokens_per_pos):
            self.accepted_per_pos.labels(*labels, str(pos)).inc(n - (before[pos] if pos < len(before) else 0))
        self._seen_spec = spec  # each report's counters are a copy of its own
        if s.policy is not None:
            self._observe_policy(s.policy)
        for prompt_tokens, ttft in report.first_tokens:
            self._prompt_total += prompt_tokens
            self.prompt_tokens.labels(*labels).inc(prompt_tokens)
            self.ttft.labels(*labels).observe(ttft)
        for seconds in report.inter_token:
            self.itl.labels(*labels).observe(seconds)
            self.tpot.labels(*labels).observe(seconds)
        for f in report.finishes:
            if f.reason == "error":
                self.request_failure.labels(*labels).inc()
            else:
                self.request_success.labels(*labels, f.reason).inc()
            for name, value in f.observations():
                self.finished[name].labels(*labels).observe(value)
            done = self.copies.finished(f)
            if done is not None:
                self.request_params_n.labels(*labels).observe(done[0])
                self.request_max_generation.labels(*labels).observe(done[1])

    def interval_summary(self) -> list[str]:
        """Lines for the periodic log, over the time since the last call (vLLM's fields: prompt and
        generation throughput, running and waiting requests, KV usage; with drafts, the speculation's
        acceptance); none while idle."""
        start, prompt, generated, spec = self._interval
        now = time.monotonic()
        seconds = max(now - start, 1e-9)
        self._interval = (now, self._prompt_total, self._seen_generated, self._seen_spec)
        running, waiting, kv = self._last_gauges
        new_prompt, new_generated = self._prompt_total - prompt, self._seen_generated - generated
        if not (new_prompt or new_generated or running or waiting):
            return []
        lines = [f"Avg prompt throughput: {new_prompt / seconds:.1f} tokens/s, Avg generation throughput: "
                 f"{new_generated / seconds:.1f} tokens/s, Running: {running} reqs, Waiting: {waiting} reqs, "
                 f"KV cache usage: {kv:.1%}"]
        now_spec = self._seen_spec
        drafts = now_spec.num_drafts - spec.num_drafts
        if drafts:
            drafted = now_spec.num_draft_tokens - spec.num_draft_tokens
            accepted = now_spec.num_accepted_tokens - spec.num_accepted_tokens
            before = spec.num_accepted_tokens_per_pos
            rates = ", ".join(f"{(n - (before[i] if i < len(before) else 0)) / drafts:.3f}"
                              for i, n in enumerate(now_spec.num_accepted_tokens_per_pos))
            lines.append(f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / drafts:.2f}, Accepted "
                         f"throughput: {accepted / seconds:.2f} tokens/s, Drafted throughput: {drafted / seconds:.2f} "
                         f"tokens/s, Accepted: {accepted} tokens, Drafted: {drafted} tokens, Per-position acceptance "
                         f"rate: {rates}, Avg Draft acceptance rate: {accepted / max(drafted, 1):.1%}")
        return lines

    def _observe_policy(self, view: PolicyView) -> None:
        labels = self.labels
        for k, n in view.chosen.items():
            self.policy_steps.labels(*labels, str(k)).inc(n - self._seen_chosen.get(k, 0))
        self._seen_chosen = dict(view.chosen)
        for (bucket, k), seconds in view.step_seconds.items():
            self.policy_step_seconds.labels(*labels, str(bucket), str(k)).set(seconds)
        for k, tokens in view.expected_tokens.items():
            self.policy_expected_tokens.labels(*labels, str(k)).set(tokens)
        buckets, joins = self._seen_parked
        for bucket in buckets | set(view.parked):
            self.policy_parked.labels(*labels, str(bucket)).set(bucket in view.parked)
        self.parked_joins.labels(*labels).inc(view.parked_joins - joins)
        self._seen_parked = (buckets | set(view.parked), view.parked_joins)

    def render(self) -> bytes:
        return generate_latest(self.registry)
