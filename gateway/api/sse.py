"""JSON bytes and Server-Sent Events framing for the HTTP APIs, and the streaming
response that writes them."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.types import Receive, Scope, Send

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def json_bytes(obj: Any) -> bytes:
    """Compact UTF-8 JSON; a lone surrogate (never expected) becomes "?" instead of
    failing the whole response (docs/acceptance.md#valid-utf-8-always)."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "replace")


def sse(data: bytes, event: str | None = None) -> bytes:
    """One Server-Sent Event: ``event: name`` (when given, as Anthropic's and the
    Responses API's streams name theirs) and ``data: ...``, then a blank line."""
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + data + b"\n\n"


class SSEResponse:
    """An ASGI response streaming Server-Sent Events written by ``produce(emit)``;
    ``emit(frame)`` sends one whole event as ``sse`` built it."""

    def __init__(self, produce: Callable[[Callable[[bytes], Awaitable[None]]], Awaitable[None]],
                 headers: dict[str, str]) -> None:
        self.produce = produce
        self.headers = [(b"content-type", b"text/event-stream; charset=utf-8")] + [
            (k.encode("latin-1"), v.encode("latin-1")) for k, v in {**SSE_HEADERS, **headers}.items()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.headers})

        async def emit(frame: bytes) -> None:
            await send({"type": "http.response.body", "body": frame, "more_body": True})

        await self.produce(emit)
        await send({"type": "http.response.body", "body": b"", "more_body": False})
