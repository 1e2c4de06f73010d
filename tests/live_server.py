"""A live server for the tests: uvicorn on a free loopback port in a thread, and HTTP helpers whose
waits are bounded by what a busy machine could take, never by how fast a request runs."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

import httpx
import openai
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

# What the tests wait for a server, a response or a stream: results, never speed, so the bound is what a
# busy 2-core CI machine could take, not what a request takes.
PATIENCE = 300.0


def get(url: str, **kw) -> httpx.Response:
    return httpx.get(url, timeout=kw.pop("timeout", PATIENCE), **kw)


def post(url: str, **kw) -> httpx.Response:
    return httpx.post(url, timeout=kw.pop("timeout", PATIENCE), **kw)


def stream(method: str, url: str, **kw):
    return httpx.stream(method, url, timeout=kw.pop("timeout", PATIENCE), **kw)


def wait_until(cond: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll `cond` until it holds; fail only after `timeout` s (PATIENCE: a busy machine is slow, not broken)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


class LiveServer:
    """uvicorn serving `app` on a free loopback port, in a thread."""

    def __init__(self, app) -> None:
        self.app = app
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        # idle keep-alive connections stay open as long as a test waits: with uvicorn's 5 s a busy machine lets a
        # pooled connection close just as a client sends on it, and that request reads a dropped connection
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_keep_alive=int(PATIENCE)))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started, PATIENCE, "uvicorn to start")

    def wait_ready(self) -> LiveServer:
        wait_until(lambda: get(f"{self.url}/health").status_code == 200, PATIENCE, "/health to answer 200")
        return self

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=PATIENCE, **kw)

    def metrics(self) -> dict[tuple[str, frozenset], float]:
        text = get(f"{self.url}/metrics").text
        return {(s.name, frozenset(s.labels.items())): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(20)


def metric(samples: dict, name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels`."""
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls)


