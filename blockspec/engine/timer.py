"""Where a step's time goes (draft, verify, the rest), measured without waiting for the device."""

from __future__ import annotations

import itertools
import time
from collections import deque
from typing import Any

import torch

from blockspec.models.runner import CAPTURES


class StepTimer:
    """Splits step time into draft / verify / rest (a chained step, one graph: chained) with CUDA events,
    read once they have passed (a step may close while the GPU still runs it: the next step is
    launched before its read-back)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        # the stream the engine's work goes to, looked up once: `Event.record()` without one looks up the
        # current stream, several Python calls, at every mark
        self.stream = torch.cuda.current_stream(device) if self.cuda else None
        self._totals = {"draft_s": 0.0, "verify_s": 0.0, "chained_s": 0.0, "rest_s": 0.0}
        self._marks: list[tuple[str, Any]] = []
        self._closed: deque[list[tuple[str, Any]]] = deque()  # closed steps whose events are not read yet
        self._captures_at_start = 0
        self.step_captured = False

    def mark(self, name: str) -> None:
        if not self._marks:
            self._captures_at_start = CAPTURES[0]
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(self.stream)
            self._marks.append((name, ev))
        else:
            self._marks.append((name, time.perf_counter()))

    def stamp(self) -> Any:
        """Now on the device's clock: a timing event recorded on the engine's stream (CUDA), or the host's
        clock (CPU, where the work launched so far is done)."""
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(self.stream)
        return ev

    @staticmethod
    def seconds(start: Any, end: Any) -> float:
        """Seconds between two `stamp`s (waits for the device to pass `end`)."""
        if isinstance(start, float):
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def discard(self) -> None:
        """Drop the open marks unaccounted (a step that started its timing but launched nothing, or
        a draft launched ahead that the next step did not use)."""
        self._marks.clear()

    def close(self) -> None:
        """End one step's marks; they are accounted (each interval to the mark that opens it) once
        its end has passed on the device, without waiting for it."""
        self.mark("end")
        self._closed.append(self._marks)
        self._marks = []
        # a step that captured a CUDA graph timed the capture too: not a sample of its steady cost
        self.step_captured = CAPTURES[0] != self._captures_at_start
        self._account(wait=False)

    def _account(self, wait: bool) -> None:
        while self._closed:
            marks = self._closed[0]
            if self.cuda:
                if not wait and not marks[-1][1].query():
                    return
                marks[-1][1].synchronize()
            for (name, a), (_, b) in itertools.pairwise(marks):
                dt = a.elapsed_time(b) / 1000 if self.cuda else b - a
                self._totals[f"{name}_s"] = self._totals.get(f"{name}_s", 0.0) + dt
            self._closed.popleft()

    @property
    def totals(self) -> dict[str, float]:
        """Seconds per phase over every closed step (waits for the device to pass their ends)."""
        self._account(wait=True)
        return dict(self._totals)
