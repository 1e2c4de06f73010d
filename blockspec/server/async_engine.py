"""Drive one Engine from a background thread for an asyncio server.

The Engine is not thread-safe and its steps block, so it lives on one thread that owns it outright:
the event loop never touches it. Submissions and aborts travel to that thread through a command
queue drained between steps (so requests join and leave the running batch at step boundaries), and
each request's output travels back as `Delta`s put on the request's asyncio queue with
`loop.call_soon_threadsafe`. Deltas are built on the engine thread from the engine's Request
objects, so the loop only ever sees copies.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from blockspec.engine.engine import Engine
from blockspec.engine.request import Logprob, Request, SpecStats
from blockspec.errors import USER_ERRORS
from blockspec.llm import LLM
from blockspec.sampling_params import SamplingParams
from blockspec.server.metrics import ServerMetrics

log = logging.getLogger("blockspec.server")

Prompt = tuple[str | None, list[int]]  # (text or None, token ids), as LLM._prompt_ids returns


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


@dataclass
class _Add:
    request_id: str
    prompts: list[Prompt]
    params: SamplingParams
    out: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    arrival: float


@dataclass
class _Abort:
    request_id: str


class _Stop:
    pass


def _emit(loop: asyncio.AbstractEventLoop, out: asyncio.Queue, item: Delta | BaseException) -> None:
    try:
        loop.call_soon_threadsafe(out.put_nowait, item)
    except RuntimeError:  # the loop is closed: nobody is listening any more
        pass


@dataclass
class _Tracker:
    """Engine-thread bookkeeping of one engine request: what of its output has been sent."""

    req: Request
    index: int
    out: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    arrival: float
    sent_tokens: int = 0
    sent_chars: int = 0
    started: bool = False

    def poll(self) -> Delta | None:
        """The new output since the last poll, or None. While a stop string could still match, its
        possible beginning is held back, so streamed text never has to be taken back."""
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
        delta = Delta(self.index, text[self.sent_chars:visible], req.output_ids[self.sent_tokens:n],
                      req.logprobs[self.sent_tokens:n] if req.logprobs is not None else None,
                      req.finish_reason, req.stop_reason, req.error, spec)
        self.sent_tokens, self.sent_chars = n, visible
        return delta


class AsyncEngine:
    """The loaded LLM's Engine, stepped by one thread; `generate` is the asyncio face of it."""

    def __init__(self, load: Callable[[], LLM], metrics: ServerMetrics,
                 on_load_error: Callable[[str], None] | None = None) -> None:
        self._load = load
        self._on_load_error = on_load_error
        self.metrics = metrics
        self.llm: LLM | None = None  # set by the engine thread once loaded; then read-only for others
        self.load_error: str | None = None
        self._commands: queue.SimpleQueue[_Add | _Abort | _Stop] = queue.SimpleQueue()
        self._trackers: dict[str, _Tracker] = {}
        self._thread = threading.Thread(target=self._run, name="blockspec-engine", daemon=True)

    # ---------------------------------------------------------------- event-loop side
    @property
    def ready(self) -> bool:
        return self.llm is not None

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort whatever is running and stop the thread (a load in progress is left to die with the process)."""
        self._commands.put(_Stop())
        self._thread.join(timeout)

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    async def generate(self, request_id: str, prompts: list[Prompt], params: SamplingParams) -> AsyncIterator[Delta]:
        """Deltas of all choices (choice index = prompt index * n + copy) until every choice finished.

        Leaving early (client gone, task cancelled) aborts the request, so its slot is freed at the
        next step boundary. Errors raised while adding the request are re-raised here.
        """
        loop = asyncio.get_running_loop()
        out: asyncio.Queue[Delta | BaseException] = asyncio.Queue()
        self._commands.put(_Add(request_id, prompts, params, out, loop, time.perf_counter()))
        left = len(prompts) * params.n
        try:
            while left:
                item = await out.get()
                if isinstance(item, BaseException):
                    left = 0
                    raise item
                left -= item.finish_reason is not None
                yield item
        finally:
            if left:
                self.abort(request_id)

    # ---------------------------------------------------------------- engine thread
    def _run(self) -> None:
        try:
            llm = self._load()
        except Exception as exc:
            self.load_error = str(exc) if isinstance(exc, USER_ERRORS) else f"{type(exc).__name__}: {exc}"
            log.error("loading the model failed: %s", self.load_error, exc_info=not isinstance(exc, USER_ERRORS))
            if self._on_load_error is not None:
                self._on_load_error(self.load_error)
            return
        engine = llm.engine
        self.metrics.observe_step(engine)
        self.llm = llm
        while True:
            for cmd in self._next_commands(block=not engine.has_unfinished()):
                if isinstance(cmd, _Stop):
                    for tracker in self._trackers.values():
                        engine.abort(tracker.req.request_id)
                    self._publish()
                    return
                if isinstance(cmd, _Add):
                    self._add(engine, cmd)
                else:
                    engine.abort(cmd.request_id)
            if engine.has_unfinished():
                try:
                    engine.step()
                except Exception as exc:  # a bug or out-of-memory: fail what is in flight, keep serving
                    log.exception("engine step failed; failing the %d requests in flight", len(self._trackers))
                    self._fail_all(engine, exc)
            self.metrics.observe_step(engine)  # before the deltas: a client that got its answer sees the counts
            self._publish()

    def _next_commands(self, block: bool) -> list[_Add | _Abort | _Stop]:
        cmds = [self._commands.get()] if block else []
        while True:
            try:
                cmds.append(self._commands.get_nowait())
            except queue.Empty:
                return cmds

    def _add(self, engine: Engine, cmd: _Add) -> None:
        added = []
        try:
            for i, (text, ids) in enumerate(cmd.prompts):
                for req in engine.add_request(f"{cmd.request_id}-{i}", text, ids, cmd.params):
                    added.append(_Tracker(req, i * cmd.params.n + req.index, cmd.out, cmd.loop, cmd.arrival))
        except USER_ERRORS as exc:  # all prompts go in, or none
            engine.abort(cmd.request_id)
            _emit(cmd.loop, cmd.out, exc)
            return
        self._trackers.update((t.req.request_id, t) for t in added)

    def _publish(self) -> None:
        for rid, t in list(self._trackers.items()):
            req = t.req
            if not t.started and req.first_token_time is not None:
                t.started = True
                self.metrics.observe_first_token(req, t.arrival)
            delta = t.poll()
            if delta is None:
                continue
            _emit(t.loop, t.out, delta)
            if delta.finish_reason is not None:
                self.metrics.observe_finish(req, t.arrival, req.finish_time or time.perf_counter())
                del self._trackers[rid]

    def _fail_all(self, engine: Engine, exc: Exception) -> None:
        error = RuntimeError(f"the engine failed while serving this request: {type(exc).__name__}: {exc}")
        for t in self._trackers.values():
            engine.abort(t.req.request_id)
        self.metrics.observe_step(engine)
        for t in self._trackers.values():
            _emit(t.loop, t.out, error)
        self._trackers.clear()
