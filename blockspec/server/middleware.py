"""What every HTTP request passes through around its route: the API key, the body-size limit, and the
last-resort 500 (pure ASGI, so streamed responses pass untouched).

Each answers in the OpenAI error format. The 500 is sent here rather than by Starlette's outermost
handler, which re-raises after answering and so makes the server drop a keep-alive connection.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import uuid
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

log = logging.getLogger("blockspec.server")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def error_body(message: str, type: str, param: str | None = None, code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


async def send_error(send: Send, status: int, body: dict[str, Any], headers: list[tuple[bytes, bytes]] = ()) -> None:
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": payload})


SHUTDOWN_MESSAGE = ("the server is shutting down and stopped this request before it finished (--shutdown-timeout "
                    "lets the requests in flight finish first)")


class InternalErrors:
    """An exception no handler took becomes a 500 whose body names no internals (the log has them,
    under the id the body gives), and the connection stays open for the client's next request.

    A route cancelled by the server's shutdown (uvicorn cancels the requests in flight once --shutdown-timeout
    has passed) is answered in the same format: a 503, or, for a stream under way, an error event and
    `[DONE]`, so a client learns why it ended (it got a plain-text 500 or a cut connection, and the log a
    traceback per request)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = streaming = ended = False

        async def watch(message: Message) -> None:
            nonlocal started, streaming, ended
            if message["type"] == "http.response.start":
                started = True
                streaming = dict(message.get("headers", ())).get(b"content-type", b"").startswith(b"text/event-stream")
            elif message["type"] == "http.response.body":
                ended = not message.get("more_body", False)
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except asyncio.CancelledError:  # the shutdown's; nothing awaits this task's end, so it ends here
            log.warning("%s %s stopped by the server's shutdown", scope.get("method"), scope.get("path"))
            body = error_body(SHUTDOWN_MESSAGE, "service_unavailable", code=503)
            if not started:
                await send_error(send, 503, body)
            elif streaming and not ended:
                await send({"type": "http.response.body", "more_body": False,
                            "body": f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()})
        except Exception:
            error_id = uuid.uuid4().hex[:12]
            log.exception("%s %s failed (error id %s)", scope.get("method"), scope.get("path"), error_id)
            if not started:  # else the response is under way: closing it is all that is left
                await send_error(send, 500, error_body(
                    f"internal server error (error id {error_id}; the server log has the details)",
                    "internal_server_error"))


class BodyLimit:
    """Refuses (413) a request body over `max_bytes` before the route parses it: by its Content-Length,
    or, for a chunked body, once what has arrived passes the limit. The body is read here and handed on
    whole (the routes read it whole anyway)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers", ())).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._refuse(send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._refuse(send)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if delivered:
                return await receive()  # after the body: the disconnect a route may wait for
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send) -> None:
        await send_error(send, 413, error_body(
            f"the request body is larger than this server accepts ({self.max_bytes} bytes; "
            "--max-request-bytes sets it)", "invalid_request_error", code="request_too_large"),
            headers=[(b"connection", b"close")])


def route_path(scope: Scope) -> str:
    """The request's path as the routes see it: under --root-path, uvicorn's scope path starts with the root
    path (the ASGI rule), which routing strips."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


class APIKey:
    """With a key set (or several, any one of which opens them: vLLM's), /v1/ routes need
    `Authorization: Bearer <key>` (as the OpenAI client sends it); /health and /metrics stay open for probes and
    scrapers."""

    def __init__(self, app: ASGIApp, key: str | Sequence[str]) -> None:
        self.app = app
        self.expected = [f"Bearer {k}".encode() for k in ([key] if isinstance(key, str) else key)]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and route_path(scope).startswith("/v1/"):
            given = dict(scope.get("headers", ())).get(b"authorization", b"")
            if not any([secrets.compare_digest(given, key) for key in self.expected]):  # each compared: no early exit
                return await send_error(send, 401, error_body(
                    "missing or incorrect API key: send it as 'Authorization: Bearer <key>'",
                    "invalid_request_error", code="invalid_api_key"))
        await self.app(scope, receive, send)
