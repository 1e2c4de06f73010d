"""The two ways an engine is driven: to completion for a batch of requests (`OfflineRunner`, what
`LLM.generate` and every tensor-parallel rank run), and as a server's loop (`EngineLoop`), which
the server's engine process (or thread) and every tensor-parallel rank run alike.

The Engine is not thread-safe and its steps block, so one loop owns it outright: submissions and
aborts reach it as commands drained between steps (so requests join and leave the running batch at
step boundaries), and each step sends back one `StepReport`: every request's new output as a
`Delta`'s fields and the metrics' observations, all plain values built from the engine's Request
objects, so the report can cross to another process.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from blockspec.engine.engine import Engine
from blockspec.engine.latency import Finish
from blockspec.errors import USER_ERRORS, RanksParted
from blockspec.inputs import ModelInputs, Prompt
from blockspec.request import Logprob, Request, RequestOutput, SpecStats, group_metrics
from blockspec.sampling_params import SamplingParams
from blockspec.speculative.policy import PolicyView

log = logging.getLogger("blockspec.engine")


class Interrupted(Exception):
    """A run stopped at the user's request (a tensor-parallel rank's view of the user's Ctrl-C)."""


class OfflineRunner:
    """Runs checked prompts to completion on an engine; outputs come back in prompt order. `interrupted`,
    asked before each step with the run's step count, stops the run (its requests aborted) with
    `Interrupted` when it says so."""

    def __init__(self, engine: Engine, interrupted: Callable[[int], bool] | None = None) -> None:
        self.engine = engine
        self.interrupted = interrupted
        self._ids = itertools.count()

    def run(self, prompts: list[Prompt], params: list[SamplingParams],
            use_tqdm: bool | Callable[..., Any] = True) -> list[RequestOutput]:
        engine = self.engine
        groups: list[list[Request]] = []
        try:  # queueing too: an interrupt while the prompts go in leaves none of them queued
            for p, sp in zip(prompts, params):
                groups.append(engine.add_request(str(next(self._ids)), p.text, p.ids, sp, p.cache_salt))
            self._steps(sum(len(g) for g in groups), use_tqdm)
        except BaseException:  # interrupted (Ctrl-C) or the engine broke: nothing of this call stays queued
            for group in groups:
                for req in group:
                    engine.abort(req.request_id)
            raise
        outputs = []
        for group in groups:
            first = group[0].to_output()
            first.request_id = group[0].request_id.rsplit("-", 1)[0] if len(group) > 1 else first.request_id
            first.outputs = [req.to_output().outputs[0] for req in group]
            first.metrics = group_metrics(group)
            errors = [req.error for req in group if req.error]
            first.error = errors[0] if errors else None
            outputs.append(first)
        return outputs

    def _steps(self, total: int, use_tqdm: bool | Callable[..., Any]) -> None:
        """Step until every request is done; `use_tqdm` True shows tqdm's bar, a callable is the bar's class
        (vLLM's habit: a tqdm subclass or `tqdm.notebook.tqdm`)."""
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar_type = use_tqdm if callable(use_tqdm) else tqdm
            bar = bar_type(total=total, desc="Generating", unit="req", dynamic_ncols=True)
        steps = 0
        while self.engine.has_unfinished():
            if self.interrupted is not None and self.interrupted(steps):
                raise Interrupted("the run was interrupted")
            steps += 1
            changed = self.engine.step()
            if bar is not None:
                finished = sum(1 for r in changed if r.finish_reason is not None)
                if finished:
                    bar.update(finished)
        if bar is not None:
            bar.close()


@dataclass
class EngineGauges:
    """The engine's queue, KV and cumulative counters after a step: plain values, so a step's report
    can cross to the server's front process."""

    running: int
    waiting: int
    kv_usage: float
    num_generated: int
    spec: SpecStats
    policy: PolicyView | None = None  # the draft-length policy's view, when this report carries it
    num_preemptions: int = 0
    prefix_cache: tuple[int, int] = (0, 0)  # prompt tokens looked up in the prefix cache, and found
    num_prefilled: int = 0  # prompt positions the target has run (Engine.num_prefilled_tokens)

    @classmethod
    def of(cls, engine: Engine) -> EngineGauges:
        pages = engine.pages
        spec = SpecStats()
        spec.merge(engine.spec_totals)
        prefix = (pages.prefix.queried_tokens, pages.prefix.hit_tokens) if pages.prefix else (0, 0)
        return cls(len(engine.running), len(engine.waiting), 1 - pages.num_free_pages / pages.num_pages,
                   engine.num_generated, spec, num_preemptions=engine.num_preemptions, prefix_cache=prefix,
                   num_prefilled=engine.num_prefilled_tokens)


@dataclass
class StepMetrics:
    """What the metrics learn from one engine step."""

    engine: EngineGauges
    first_tokens: list[tuple[int, float]] = field(default_factory=list)  # (prompt tokens, seconds to first token)
    # per request that got tokens this step after its first: seconds since the step that gave its last
    # ones (with speculation a step can give several tokens: vLLM's inter-token latency is per step too)
    inter_token: list[float] = field(default_factory=list)
    finishes: list[Finish] = field(default_factory=list)

    def first_token(self, req: Request, arrival: float) -> None:
        assert req.first_token_time is not None
        self.first_tokens.append((len(req.prompt_token_ids), max(req.first_token_time - arrival, 0.0)))

    def finish(self, req: Request, arrival: float, finish_time: float, group: tuple[str, int] = ("", 0)) -> None:
        self.finishes.append(Finish.of(req, arrival, finish_time, group))


@dataclass
class Delta:
    """What one choice produced since its last delta; the last one has finish_reason set."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    spec: SpecStats | None = None  # the request's speculation counters, on the last delta
    # with prompt_logprobs: the prompt's entries (SamplingParams.prompt_logprobs), on the choice's first delta
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    cached_tokens: int | None = None  # the prompt tokens found in the prefix cache, on the last delta

    def then(self, later: Delta) -> Delta:
        """This delta followed by a later one of the same choice, as one."""
        logprobs = None if self.logprobs is None and later.logprobs is None else \
            (self.logprobs or []) + (later.logprobs or [])
        return Delta(self.index, self.text + later.text, self.token_ids + later.token_ids, logprobs,
                     later.finish_reason, later.stop_reason, later.error or self.error, later.spec or self.spec,
                     self.prompt_logprobs or later.prompt_logprobs,
                     later.cached_tokens if later.cached_tokens is not None else self.cached_tokens)


# ---------------------------------------------------------------- messages between front and engine
@dataclass
class Add:
    request_id: str
    prompts: list[Prompt]
    params: SamplingParams
    arrival: float  # time.perf_counter() at the front: CLOCK_MONOTONIC, one clock for every process on Linux


@dataclass
class Abort:
    request_id: str


@dataclass
class Stop:
    pass


Command = Add | Abort | Stop


@dataclass
class Loaded:
    """The engine is ready; the front checks requests with `inputs`."""

    inputs: ModelInputs


@dataclass
class LoadFailed:
    message: str


DeltaFields = tuple  # a Delta's fields in order: how a delta crosses to the front
Outputs = list[tuple[str, DeltaFields | BaseException]]  # (the front's request id, its new output)


@dataclass
class StepReport:
    """One step's output: each request's new output (or the error that ended it), and the metrics.
    Deltas travel as plain tuples: a report crosses a pipe every step, and tuples pickle and unpickle
    several times faster than dataclasses."""

    outputs: Outputs
    metrics: StepMetrics


Report = Loaded | LoadFailed | StepReport


# ---------------------------------------------------------------- engine side
@dataclass
class _Tracker:
    """Engine-side bookkeeping of one engine request: what of its output has been sent."""

    req: Request
    request_id: str  # the front's id of the request this choice belongs to
    index: int
    arrival: float
    sent_tokens: int = 0
    sent_chars: int = 0
    sent_prompt: bool = False  # its prompt logprobs went with a delta
    started: bool = False
    last_tokens_at: float | None = None  # when the report with its latest tokens was sent

    def poll(self) -> DeltaFields | None:
        """The new output since the last poll (a Delta's fields), or None. While a stop string that the output
        would not keep could still match, its possible beginning is held back, so streamed text never has to be
        taken back."""
        req = self.req
        done = req.finish_reason is not None
        n = len(req.output_ids)
        if n == self.sent_tokens and not done:
            return None
        visible = req.text_length
        if not done and req.params.stop_strings and not req.params.include_stop_str_in_output:
            visible = max(self.sent_chars, visible - max(map(len, req.params.stop_strings)) + 1)
        spec = None
        if done:
            spec = SpecStats()
            spec.merge(req.spec)
        # the prompt's logprobs are whole once the first token is sampled: they go with the first delta
        prompt = req.prompt_logprobs if not self.sent_prompt else None
        text = req.text_from(self.sent_chars)[: max(0, visible - self.sent_chars)]
        delta = (self.index, text, req.output_ids[self.sent_tokens:n],
                 req.logprobs[self.sent_tokens:n] if req.logprobs is not None else None,
                 req.finish_reason, req.stop_reason, req.error, spec, prompt,
                 req.num_cached_tokens if done else None)
        self.sent_tokens, self.sent_chars, self.sent_prompt = n, visible, True
        return delta


class EngineLoop:
    """Owns an Engine: applies commands between steps, steps while there is work, and sends what each
    step produced as one StepReport."""

    # how often a report carries the draft-length policy's view (about 20 us to build), and when the
    # last request in flight finishes
    POLICY_EVERY_S = 0.5

    def __init__(self, engine: Engine, send: Callable[[Report], None]) -> None:
        self.engine = engine
        self.send = send
        self._trackers: dict[str, _Tracker] = {}  # engine request id -> tracker
        self._policy_sent = -math.inf

    def run(self, commands: Callable[[bool], list[Command]]) -> None:
        """Serve until a Stop; `commands(block)` returns the commands waiting (blocking for one when
        the engine is idle)."""
        engine = self.engine
        self._report([])
        while True:
            outputs: Outputs = []
            for cmd in commands(not engine.has_unfinished()):
                if isinstance(cmd, Stop):
                    for tracker in self._trackers.values():
                        engine.abort(tracker.req.request_id)
                    self._report(outputs)
                    return
                if isinstance(cmd, Add):
                    self._add(cmd, outputs)
                else:  # the front's request: every engine request of its prompts and copies
                    for tracker in [t for t in self._trackers.values() if t.request_id == cmd.request_id]:
                        engine.abort(tracker.req.request_id)
            if engine.has_unfinished():
                try:
                    engine.step()
                except RanksParted:  # no rank can step on: the ranks close
                    raise
                except Exception:  # the engine's own recovery failed: fail what is in flight, keep serving
                    error_id = uuid.uuid4().hex[:12]
                    log.exception("engine step failed (error id %s); failing the %d requests in flight",
                                  error_id, len(self._trackers))
                    self._fail_all(error_id)
            self._report(outputs)

    def _add(self, cmd: Add, outputs: Outputs) -> None:
        added = []
        try:
            for i, p in enumerate(cmd.prompts):
                for req in self.engine.add_request(f"{cmd.request_id}-{i}", p.text, p.ids, cmd.params, p.cache_salt):
                    added.append(_Tracker(req, cmd.request_id, i * cmd.params.n + req.index, cmd.arrival))
        except USER_ERRORS as exc:  # all prompts go in, or none
            for tracker in added:
                self.engine.abort(tracker.req.request_id)
            outputs.append((cmd.request_id, exc))
            return
        self._trackers.update((t.req.request_id, t) for t in added)

    def _report(self, outputs: Outputs) -> None:
        """Send every request's new output with the metrics (which the front applies first: a client
        that got its answer sees the counts)."""
        metrics = StepMetrics(EngineGauges.of(self.engine))
        finished = False
        now = time.perf_counter()
        for rid, t in list(self._trackers.items()):
            req = t.req
            if not t.started and req.first_token_time is not None:
                t.started = True
                metrics.first_token(req, t.arrival)
            delta = t.poll()
            if delta is None:
                continue
            if delta[2]:  # new tokens
                if t.last_tokens_at is not None:
                    metrics.inter_token.append(now - t.last_tokens_at)
                t.last_tokens_at = now
            outputs.append((t.request_id, delta))
            if req.finish_reason is not None:  # its last delta
                metrics.finish(req, t.arrival, req.finish_time or now, (t.request_id, t.index // req.params.n))
                del self._trackers[rid]
                finished = True
        drained = finished and not self.engine.has_unfinished()  # the last answer: exact counts at rest
        if self.engine.proposer is not None and (drained or now - self._policy_sent >= self.POLICY_EVERY_S):
            metrics.engine.policy = self.engine.policy.view()
            self._policy_sent = now
        self.send(StepReport(outputs, metrics))

    def _fail_all(self, error_id: str) -> None:
        """Fail every request in flight: each ends with the error as its last delta, counted as a failure."""
        for t in self._trackers.values():
            self.engine.abort(t.req.request_id, f"the engine failed while serving this request (error id "
                                                f"{error_id}; the server log has the details)")


def serve_engine(engine: Engine, inputs: ModelInputs, commands: Callable[[bool], list[Command]],
                 send: Callable[[Report], None]) -> None:
    """Say the engine is ready, then run its loop until a Stop."""
    send(Loaded(inputs))
    EngineLoop(engine, send).run(commands)
