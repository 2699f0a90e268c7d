"""A client that goes away is not an error: counted, never a 500 or a traceback.

A client may hang up while it sends a request body, or while the answer streams. Neither
is the gateway's failure, so neither may be logged as one (a thousand hang-ups were a
thousand tracebacks and HTTP 500s). ``DisconnectMiddleware`` watches each HTTP request's
``receive`` channel: once the app has been told ``http.disconnect`` before its answer was
complete, the request counts as a client disconnect (by route template and stage) and an
exception it raises afterwards (Starlette's ``ClientDisconnect`` from a body read, or a
failed write) is dropped with a debug line. ``/metrics`` exports the counts as
``gateway_client_disconnects_total{route, stage}`` (``gateway/server/metrics.py``); the stages:

* ``body``: the client left before its request body was complete;
* ``body_timeout``: the body did not arrive within ``http_body_timeout_s`` (the server
  answered 408 and closed; ``gateway/server/http_limits.py``);
* ``response``: the client left while the answer was pending or streaming.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["BODY_TIMEOUT_KEY", "ClientDisconnects", "DisconnectMiddleware", "route_of"]

log = logging.getLogger("gateway.http")

# set in the request's scope by the HTTP protocol when it timed the body out
BODY_TIMEOUT_KEY = "chatserve.body_timeout"


def route_of(scope: Scope) -> str:
    """The request's route template (``/api/sessions/{sid:str}``), or "unmatched"."""
    return getattr(scope.get("route"), "path", None) or "unmatched"


@dataclass
class ClientDisconnects:
    """Requests whose client went away before their answer was complete.

    Attributes:
        counts: (route template, stage) -> requests.
    """

    counts: dict[tuple[str, str], int] = field(default_factory=dict)

    def add(self, route: str, stage: str) -> None:
        """Count one request of ``route`` cut at ``stage`` (see the module doc)."""
        key = (route, stage)
        self.counts[key] = self.counts.get(key, 0) + 1


class DisconnectMiddleware:
    """Pure ASGI middleware: counts HTTP requests whose client left (module doc) in
    ``stats`` and keeps what the app raises after that out of the error log.

    Args:
        app: the wrapped app.
        stats: where the counts go (the app's ``state.disconnects``).
    """

    def __init__(self, app: ASGIApp, stats: ClientDisconnects) -> None:
        self.app = app
        self.stats = stats

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body_done = False
        started = answered = False
        gone_at: str | None = None

        async def watched_receive() -> Message:
            nonlocal body_done, gone_at
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False):
                body_done = True
            elif message["type"] == "http.disconnect" and not answered and gone_at is None:
                gone_at = ("body_timeout" if scope.get(BODY_TIMEOUT_KEY) else "body") if not body_done \
                    else "response"
            return message

        async def watched_send(message: Message) -> None:
            nonlocal answered, started
            if message["type"] == "http.response.start":
                started = True
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                answered = True
            await send(message)

        try:
            await self.app(scope, watched_receive, watched_send)
        except Exception as e:
            if gone_at is None:
                raise
            log.debug("%s %s: the client left (%s); dropped %s", scope.get("method"), scope.get("path"), gone_at,
                      type(e).__name__)
            if not started:  # nobody reads it; the status is for the request counters outside
                await send({"type": "http.response.start", "status": 499, "headers": []})
                await send({"type": "http.response.body", "body": b""})
        finally:
            if gone_at is not None:
                self.stats.add(route_of(scope), gone_at)
