"""The served engine's front, on the HTTP server's event loop (`AsyncEngine`), and where the engine
runs: on a thread of the server's process, or in an engine process of its own (the default of
`blockspec serve`), which drives it with `blockspec.engine.loop.EngineLoop`.

In a process of its own the engine's host work (scheduling, launches, detokenisation) no longer
shares the interpreter lock with the HTTP side, whose work grows with the clients: at 64 streaming
clients that work took most of each step's time on a thread. The front routes each step's report to
the requests' queues; a front that falls behind merges the deltas waiting for a request into one,
so it sends fewer, larger chunks instead of falling further behind.
"""

from __future__ import annotations

import asyncio
import atexit
import gc
import logging
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from multiprocessing.connection import Connection
from typing import Any, TypeVar

from blockspec.engine.loop import (
    Abort,
    Add,
    Command,
    Delta,
    Loaded,
    LoadFailed,
    Report,
    Stop,
    StepReport,
    serve_engine,
)
from blockspec.errors import USER_ERRORS
from blockspec.inputs import ModelInputs, Prompt
from blockspec.llm import LLM
from blockspec.sampling_params import SamplingParams
from blockspec.server.metrics import ServerMetrics

T = TypeVar("T")

log = logging.getLogger("blockspec.server")


class EngineError(RuntimeError):
    """The engine could not serve a request (it stopped, or a step failed it); the message is the
    client's to read and names no internals."""



def freezing_after(load: Callable[[], T]) -> Callable[[], T]:
    """`load`, then what is alive (modules, weights' Python objects, the tokenizer, warm-up's
    leftovers) is moved out of the garbage collector's reach. It lives as long as the process, yet
    every full collection walked all of it (hundreds of thousands of objects), a stall of every
    request in flight that a serving loop hits now and then."""

    def load_and_freeze() -> T:
        loaded = load()
        gc.collect()
        gc.freeze()
        return loaded

    return load_and_freeze


def _loaded(load: Callable[[], LLM], send: Callable[[Report], None]) -> LLM | None:
    """`load()`, or None once the reason it failed is sent."""
    try:
        return load()
    except Exception as exc:
        message = str(exc) if isinstance(exc, USER_ERRORS) else f"{type(exc).__name__}: {exc}"
        if not isinstance(exc, USER_ERRORS):  # a user error's one line is the front's to say (`_failed`)
            log.error("loading the model failed: %s", message, exc_info=True)
        send(LoadFailed(message))
        return None


def _drain(first: Callable[[], Command], more: Callable[[], Command | None], block: bool) -> list[Command]:
    cmds = [first()] if block else []
    while (cmd := more()) is not None:
        cmds.append(cmd)
    return cmds


def _engine_process(load: Callable[[], LLM], commands: Connection, reports: Connection) -> None:
    """The engine process: what loading left alive is frozen out of the collector's reach (the process
    lives for it), then the engine serves the pipe until a Stop or until the front goes away. A
    tensor-parallel model's ranks run the engine loop themselves; this process relays to rank 0."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the front stops the engine

    def more() -> Command | None:
        return commands.recv() if commands.poll() else None

    try:
        llm = _loaded(freezing_after(load), reports.send)
        if llm is None:
            return
        try:
            if llm.ranks is not None:
                llm.ranks.serve(commands, reports)
            else:
                serve_engine(llm.engine, llm.inputs, lambda block: _drain(commands.recv, more, block), reports.send)
        finally:
            llm.close()
    except (EOFError, BrokenPipeError):  # the front is gone: nothing is left to serve
        pass
    # served and closed: end here, without the interpreter's teardown, which takes seconds over what
    # loading froze and prints extension modules' leak reports for it
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---------------------------------------------------------------- front (event loop)
class AsyncEngine:
    """The front of the served engine: `generate` is its asyncio face. With `process=True` the engine
    runs in a spawned process (`load` must then pickle); otherwise on a thread of this process."""

    def __init__(self, load: Callable[[], LLM], metrics: ServerMetrics,
                 on_engine_error: Callable[[str], None] | None = None, process: bool = False,
                 on_ready: Callable[[ModelInputs], None] | None = None) -> None:
        self._load = load
        self._on_engine_error = on_engine_error  # told when the engine cannot load, or its process dies
        self._on_ready = on_ready  # told once the engine is loaded
        self._stopping = False  # shutdown() asked the engine to stop: its end is no failure
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

    def _stop_at_exit(self) -> None:
        if not self._stopping:
            self.shutdown(timeout=5.0)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort whatever is running and stop the engine (a load in progress on a thread is left to die
        with the process; an engine process is terminated if it does not stop in time)."""
        atexit.unregister(self._stop_at_exit)
        self._stopping = True
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
        if request_id in self._queues:  # its deltas would go to the other's queue (the server makes ids unique)
            raise RuntimeError(f"request id {request_id!r} is already in flight")
        out: asyncio.Queue[Delta | BaseException] = asyncio.Queue()
        self._queues[request_id] = out
        if self.load_error is not None:  # the engine stopped while this request was checked: none will answer it
            out.put_nowait(EngineError(f"the engine stopped: {self.load_error}"))
        else:
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
            try:
                self.metrics.observe(report.metrics)
            except Exception:  # noqa: BLE001  a metric's fault never costs a request its tokens
                log.exception("metrics: a step's report could not be observed; its outputs go out regardless")
            for request_id, item in report.outputs:
                out = self._queues.get(request_id)
                if out is not None:  # else: the client left; its abort is on its way
                    out.put_nowait(item if isinstance(item, BaseException) else Delta(*item))
        elif isinstance(report, Loaded):
            self.inputs = report.inputs
            if self._on_ready is not None:
                self._on_ready(report.inputs)
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
        else:
            log.error("the engine cannot serve: %s", message)

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
        if llm is not None and llm.ranks is not None:  # its ranks need the pipes of an engine process
            llm.close()
            self._post(LoadFailed("tensor parallelism is served from an engine process (drop --no-engine-process)"))
        elif llm is not None:
            serve_engine(llm.engine, llm.inputs, lambda block: _drain(self._commands.get, more, block), self._post)

    def _start_process(self) -> None:
        ctx = multiprocessing.get_context("spawn")  # never fork a process that has threads (uvicorn, torch)
        commands_out, commands_in = ctx.Pipe(duplex=False)
        reports_out, reports_in = ctx.Pipe(duplex=False)
        # not a daemon: a tensor-parallel engine spawns rank processes of its own
        self._proc = ctx.Process(target=_engine_process, args=(self._load, commands_out, reports_in),
                                 name="blockspec-engine")
        self._proc.start()
        # a forced exit (a second Ctrl-C) skips the app's shutdown, and interpreter exit would wait forever on
        # this non-daemon child waiting for commands: stop it then too
        atexit.register(self._stop_at_exit)
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
            if self._stopping:  # the end shutdown() asked for
                return
            self._proc.join(5)
            if self._proc.exitcode != 0 and not failed:  # killed, or crashed outside a step
                self._post(LoadFailed(f"the engine process exited with code {self._proc.exitcode}"))

        self._threads = [threading.Thread(target=send_commands, name="blockspec-commands", daemon=True),
                         threading.Thread(target=read_reports, name="blockspec-reports", daemon=True)]
