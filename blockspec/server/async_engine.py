"""Drive one Engine for an asyncio server: on a thread of the server's process, or in an engine
process of its own (the default of `blockspec serve`).

The Engine is not thread-safe and its steps block, so one loop (`EngineLoop`) owns it outright:
submissions and aborts reach it as commands drained between steps (so requests join and leave the
running batch at step boundaries), and each step sends back one `StepReport`: every request's new
output as a `Delta` and the metrics' observations, all plain values built from the engine's Request
objects. The front (`AsyncEngine`, on the event loop) routes a report's deltas to the requests'
queues and applies its metrics.

In a process of its own the engine's host work (scheduling, launches, detokenisation) no longer
shares the interpreter lock with the HTTP side, whose work grows with the clients: at 64 streaming
clients that work took most of each step's time on a thread. A front that falls behind merges the
deltas waiting for a request into one, so it sends fewer, larger chunks instead of falling further
behind.
"""

from __future__ import annotations

import asyncio
import logging
import math
import multiprocessing
import queue
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from blockspec.engine.engine import Engine
from blockspec.request import Logprob, Request, SpecStats
from blockspec.errors import USER_ERRORS
from blockspec.llm import LLM, ModelInputs
from blockspec.sampling_params import SamplingParams
from blockspec.server.metrics import EngineGauges, ServerMetrics, StepMetrics

log = logging.getLogger("blockspec.server")


class EngineError(RuntimeError):
    """The engine could not serve a request (it stopped, or a step failed it); the message is the
    client's to read and names no internals."""

Prompt = tuple[str | None, list[int]]  # (text or None, token ids), as ModelInputs.prompt_ids returns


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

    def then(self, later: Delta) -> Delta:
        """This delta followed by a later one of the same choice, as one."""
        logprobs = None if self.logprobs is None and later.logprobs is None else \
            (self.logprobs or []) + (later.logprobs or [])
        return Delta(self.index, self.text + later.text, self.token_ids + later.token_ids, logprobs,
                     later.finish_reason, later.stop_reason, later.error or self.error, later.spec or self.spec)


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
    Deltas travel as plain tuples: a report crosses a pipe every step, and 64 dataclasses took 190 us
    to pickle and 150 us to unpickle on this project's CPU, 64 tuples 22 and 29 us."""

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
    started: bool = False

    def poll(self) -> DeltaFields | None:
        """The new output since the last poll (a Delta's fields), or None. While a stop string could
        still match, its possible beginning is held back, so streamed text never has to be taken back."""
        req = self.req
        done = req.finish_reason is not None
        n = len(req.output_ids)
        if n == self.sent_tokens and not done:
            return None
        text = req.text
        visible = len(text)
        if not done and req.params.stop_strings:
            visible = max(self.sent_chars, visible - max(map(len, req.params.stop_strings)) + 1)
        spec = None
        if done:
            spec = SpecStats()
            spec.merge(req.spec)
        delta = (self.index, text[self.sent_chars:visible], req.output_ids[self.sent_tokens:n],
                 req.logprobs[self.sent_tokens:n] if req.logprobs is not None else None,
                 req.finish_reason, req.stop_reason, req.error, spec)
        self.sent_tokens, self.sent_chars = n, visible
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
                else:
                    engine.abort(cmd.request_id)
            if engine.has_unfinished():
                try:
                    engine.step()
                except Exception:  # the engine's own recovery failed: fail what is in flight, keep serving
                    error_id = uuid.uuid4().hex[:12]
                    log.exception("engine step failed (error id %s); failing the %d requests in flight",
                                  error_id, len(self._trackers))
                    self._fail_all(error_id)
            self._report(outputs)

    def _add(self, cmd: Add, outputs: Outputs) -> None:
        added = []
        try:
            for i, (text, ids) in enumerate(cmd.prompts):
                for req in self.engine.add_request(f"{cmd.request_id}-{i}", text, ids, cmd.params):
                    added.append(_Tracker(req, cmd.request_id, i * cmd.params.n + req.index, cmd.arrival))
        except USER_ERRORS as exc:  # all prompts go in, or none
            self.engine.abort(cmd.request_id)
            outputs.append((cmd.request_id, exc))
            return
        self._trackers.update((t.req.request_id, t) for t in added)

    def _report(self, outputs: Outputs) -> None:
        """Send every request's new output with the metrics (which the front applies first: a client
        that got its answer sees the counts)."""
        metrics = StepMetrics(EngineGauges.of(self.engine))
        finished = False
        for rid, t in list(self._trackers.items()):
            req = t.req
            if not t.started and req.first_token_time is not None:
                t.started = True
                metrics.first_token(req, t.arrival)
            delta = t.poll()
            if delta is None:
                continue
            outputs.append((t.request_id, delta))
            if req.finish_reason is not None:  # its last delta
                metrics.finish(req, t.arrival, req.finish_time or time.perf_counter())
                del self._trackers[rid]
                finished = True
        now = time.perf_counter()
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


def _loaded(load: Callable[[], LLM], send: Callable[[Report], None]) -> LLM | None:
    """`load()`, or None once the reason it failed is sent."""
    try:
        return load()
    except Exception as exc:
        message = str(exc) if isinstance(exc, USER_ERRORS) else f"{type(exc).__name__}: {exc}"
        log.error("loading the model failed: %s", message, exc_info=not isinstance(exc, USER_ERRORS))
        send(LoadFailed(message))
        return None


def serve_engine(llm: LLM, commands: Callable[[bool], list[Command]], send: Callable[[Report], None]) -> None:
    """Say the engine is ready, then run its loop until a Stop."""
    send(Loaded(llm.inputs))
    EngineLoop(llm.engine, send).run(commands)


def _drain(first: Callable[[], Command], more: Callable[[], Command | None], block: bool) -> list[Command]:
    cmds = [first()] if block else []
    while (cmd := more()) is not None:
        cmds.append(cmd)
    return cmds


def _engine_process(load: Callable[[], LLM], commands: Connection, reports: Connection) -> None:
    """The engine process: what loading left alive is frozen out of the collector's reach (the process
    lives for it), then the engine serves the pipe until a Stop or until the front goes away. A
    tensor-parallel model's ranks run the engine loop themselves; this process relays to rank 0."""
    from blockspec.parallel.tp import TPLLM
    from blockspec.server import freezing_after

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the front stops the engine

    def more() -> Command | None:
        return commands.recv() if commands.poll() else None

    try:
        llm = _loaded(freezing_after(load), reports.send)
        if isinstance(llm, TPLLM):
            try:
                llm.serve(commands, reports)
            finally:
                llm.close()
        elif llm is not None:
            serve_engine(llm, lambda block: _drain(commands.recv, more, block), reports.send)
    except (EOFError, BrokenPipeError):  # the front is gone: nothing is left to serve
        pass


# ---------------------------------------------------------------- front (event loop)
class AsyncEngine:
    """The front of the served engine: `generate` is its asyncio face. With `process=True` the engine
    runs in a spawned process (`load` must then pickle); otherwise on a thread of this process."""

    def __init__(self, load: Callable[[], LLM], metrics: ServerMetrics,
                 on_engine_error: Callable[[str], None] | None = None, process: bool = False) -> None:
        self._load = load
        self._on_engine_error = on_engine_error  # told when the engine cannot load, or its process dies
        self.metrics = metrics
        self.process = process
        self.inputs: ModelInputs | None = None  # set once the engine is loaded
        self.load_error: str | None = None
        self._queues: dict[str, asyncio.Queue[Delta | BaseException]] = {}
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._threads: list[threading.Thread] = []
        self._proc: Any = None

    @property
    def ready(self) -> bool:
        return self.inputs is not None

    @property
    def process_id(self) -> int | None:
        """The engine process's pid (None when the engine runs on a thread)."""
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        """Start loading (call on the event loop that will serve)."""
        self._loop = asyncio.get_running_loop()
        if self.process:
            self._start_process()
        else:
            self._threads = [threading.Thread(target=self._run_thread, name="blockspec-engine", daemon=True)]
        for t in self._threads:
            t.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort whatever is running and stop the engine (a load in progress on a thread is left to die
        with the process; an engine process is terminated if it does not stop in time)."""
        self._commands.put(Stop())
        if self._proc is not None:
            self._proc.join(timeout)
            if self._proc.is_alive():
                self._proc.terminate()
                self._proc.join(timeout)
        for t in self._threads:
            t.join(timeout)

    def abort(self, request_id: str) -> None:
        self._commands.put(Abort(request_id))

    async def generate(self, request_id: str, prompts: list[Prompt], params: SamplingParams) -> AsyncIterator[Delta]:
        """Deltas of all choices (choice index = prompt index * n + copy) until every choice finished;
        deltas that waited together are merged per choice.

        Leaving early (client gone, task cancelled) aborts the request, so its slot is freed at the
        next step boundary. Errors raised while adding the request are re-raised here.
        """
        out: asyncio.Queue[Delta | BaseException] = asyncio.Queue()
        self._queues[request_id] = out
        self._commands.put(Add(request_id, prompts, params, time.perf_counter()))
        left = len(prompts) * params.n
        try:
            while left:
                waiting = [await out.get()]
                while not out.empty():
                    waiting.append(out.get_nowait())
                merged: dict[int, Delta] = {}
                for item in waiting:
                    if isinstance(item, BaseException):
                        left = 0
                        raise item
                    merged[item.index] = merged[item.index].then(item) if item.index in merged else item
                for delta in merged.values():
                    left -= delta.finish_reason is not None
                    yield delta
        finally:
            del self._queues[request_id]
            if left:
                self.abort(request_id)

    def _receive(self, report: Report) -> None:
        """A report from the engine, on the event loop."""
        if isinstance(report, StepReport):
            self.metrics.observe(report.metrics)
            for request_id, item in report.outputs:
                out = self._queues.get(request_id)
                if out is not None:  # else: the client left; its abort is on its way
                    out.put_nowait(item if isinstance(item, BaseException) else Delta(*item))
        elif isinstance(report, Loaded):
            self.inputs = report.inputs
        else:
            self._failed(report.message)

    def _failed(self, message: str) -> None:
        """The engine cannot serve (it did not load, or its process died): say so and fail what waits."""
        self.inputs = None
        self.load_error = message
        error = EngineError(f"the engine stopped: {message}")
        for out in self._queues.values():
            out.put_nowait(error)
        if self._on_engine_error is not None:
            self._on_engine_error(message)

    def _post(self, report: Report) -> None:
        """Hand a report to the event loop (from an engine or reader thread)."""
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._receive, report)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _run_thread(self) -> None:
        def more() -> Command | None:
            try:
                return self._commands.get_nowait()
            except queue.Empty:
                return None

        llm = _loaded(self._load, self._post)
        if llm is not None and not isinstance(llm, LLM):  # a TPLLM: its ranks need the pipes of an engine process
            llm.close()
            self._post(LoadFailed("tensor parallelism is served from an engine process (drop --no-engine-process)"))
        elif llm is not None:
            serve_engine(llm, lambda block: _drain(self._commands.get, more, block), self._post)

    def _start_process(self) -> None:
        ctx = multiprocessing.get_context("spawn")  # never fork a process that has threads (uvicorn, torch)
        commands_out, commands_in = ctx.Pipe(duplex=False)
        reports_out, reports_in = ctx.Pipe(duplex=False)
        # not a daemon: a tensor-parallel engine spawns rank processes of its own
        self._proc = ctx.Process(target=_engine_process, args=(self._load, commands_out, reports_in),
                                 name="blockspec-engine")
        self._proc.start()
        log.info("engine process started (pid %d)", self._proc.pid)
        commands_out.close()
        reports_in.close()

        def send_commands() -> None:  # a thread, so a large prompt never blocks the event loop on the pipe
            while True:
                cmd = self._commands.get()
                try:
                    commands_in.send(cmd)
                except (BrokenPipeError, OSError):
                    return
                if isinstance(cmd, Stop):
                    return

        def read_reports() -> None:
            failed = False
            while True:
                try:
                    report = reports_out.recv()
                except (EOFError, OSError):
                    break
                failed |= isinstance(report, LoadFailed)
                self._post(report)
            self._proc.join(5)
            if self._proc.exitcode != 0 and not failed:  # killed, or crashed outside a step
                self._post(LoadFailed(f"the engine process exited with code {self._proc.exitcode}"))

        self._threads = [threading.Thread(target=send_commands, name="blockspec-commands", daemon=True),
                         threading.Thread(target=read_reports, name="blockspec-reports", daemon=True)]
