"""Bounds on what an HTTP client may send and hold: header bytes, header count, the time
to send the headers and the body, and connections per address and in total (uvicorn has
none of these for its httptools parser: a 64 MiB header was buffered whole, a header
trickled a few bytes at a time held its connection forever, and 1,000 clients trickling
bodies held 1,000 connections until the health checks ran out of file descriptors).

``bounded_http_protocol(limits, stats)`` is uvicorn's ``HttpToolsProtocol`` with these checks:

* header bytes: once a request's head (request line and headers) exceeds
  ``http_max_header_bytes``, the client gets ``431 Request Header Fields Too Large`` and
  the connection is closed; the server holds at most that plus one socket read
  (256 KiB) of it;
* header count: more than ``http_max_headers`` fields is a 431 too;
* header timeout: a head not complete ``http_header_timeout_s`` after the connection
  opened (or after the request's first byte, on a kept-alive connection) gets
  ``408 Request Timeout`` and the connection is closed;
* body timeout: a body not complete ``http_body_timeout_s`` after its head gets ``408``
  too (when the app has not answered yet; else the connection is just closed), and the
  app reads a disconnect (counted as ``body_timeout``, ``gateway/server/disconnects.py``);
* connections per address: past ``http_max_connections_per_address`` connections from
  one client address that are still HTTP (a WebSocket leaves the count when it upgrades:
  the app caps sockets per address itself), a new one is answered ``429`` and closed at
  once, before reading anything;
* connections in total: past ``http_max_connections`` (default: three quarters of the
  open file limit) connections of any kind, a new one is answered ``503`` with
  ``Retry-After`` and closed at once. uvicorn's own ``limit_concurrency`` answers only
  after a request's head arrived, holding the descriptor meanwhile, so it is not used.

Body sizes are bounded elsewhere (``max_http_body_bytes``, ``max_frame_bytes``), and idle
kept-alive connections by uvicorn's ``timeout_keep_alive``.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from dataclasses import dataclass, field
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.config import Limits
from gateway.server.disconnects import BODY_TIMEOUT_KEY

log = logging.getLogger("gateway.http")


@dataclass
class ConnectionStats:
    """Counters and per-address counts of one server's connections (``/metrics``).

    Attributes:
        http_by_address: open HTTP connections (not upgraded) per client address.
        refused_total: connections refused at once, by reason ("per_address", "total").
        body_timeouts_total: requests whose body did not arrive in time (408).
        ws_frames_too_large_total: WebSocket frames refused from their header.
        ws_stalled_aborted_total: WebSocket connections aborted after their writes stayed
            paused (a client that does not read).
    """

    http_by_address: dict[str, int] = field(default_factory=dict)
    refused_total: dict[str, int] = field(default_factory=dict)
    body_timeouts_total: int = 0
    ws_frames_too_large_total: int = 0
    ws_stalled_aborted_total: int = 0

    def refused(self, reason: str) -> None:
        """Count one connection refused for ``reason``."""
        self.refused_total[reason] = self.refused_total.get(reason, 0) + 1


def default_max_connections() -> int:
    """Three quarters of the process's soft open-file limit (at least 64): the rest stays
    for Redis, the engines, files and the connections the cap answers."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(64, soft * 3 // 4)


class _Refused(Exception):
    """Raised inside a parser callback to stop parsing a refused request."""


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """``HttpToolsProtocol`` with header size, count and time limits (module doc).
    Subclassed per limits by ``bounded_http_protocol``; the class attributes are the limits."""

    max_header_bytes = 64 * 1024
    max_headers = 100
    header_timeout_s = 10.0
    body_timeout_s = 30.0
    max_per_address: int | None = 256
    max_connections = 1024
    stats = ConnectionStats()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_open = True  # reading a request line and headers
        self._head_bytes = 0
        self._n_headers = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._refused = False
        self._address: str | None = None  # counted in stats.http_by_address while set

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Refuse the connection at once past the caps (429 per address, 503 in total);
        else start the header timer: a client that connects must send its head in time."""
        total = len(self.connections)  # before this one joins them
        super().connection_made(transport)
        address = self.client[0] if self.client else ""
        per_address = self.stats.http_by_address.get(address, 0)
        if total >= self.max_connections:
            self.stats.refused("total")
            self._refuse(503, "Service Unavailable", "the server holds too many connections; retry shortly",
                         ("retry-after", "1"))
            return
        if self.max_per_address is not None and per_address >= self.max_per_address:
            self.stats.refused("per_address")
            self._refuse(429, "Too Many Requests", f"more than {self.max_per_address} open connections from this "
                                                   "address; close some or retry shortly", ("retry-after", "1"))
            return
        self._address = address
        self.stats.http_by_address[address] = per_address + 1
        self._arm_head_timer()

    def _release_address(self) -> None:
        address, self._address = self._address, None
        if address is not None:
            left = self.stats.http_by_address.get(address, 1) - 1
            if left > 0:
                self.stats.http_by_address[address] = left
            else:
                self.stats.http_by_address.pop(address, None)

    def connection_lost(self, exc: Exception | None) -> None:
        """Stop the timers and leave the per-address count."""
        self._disarm_head_timer()
        self._disarm_body_timer()
        self._release_address()
        super().connection_lost(exc)

    def handle_websocket_upgrade(self) -> None:
        """uvicorn's upgrade; the connection leaves the HTTP count (the app caps sockets)."""
        self._disarm_body_timer()
        self._release_address()
        super().handle_websocket_upgrade()

    def data_received(self, data: bytes) -> None:
        """uvicorn's ``data_received`` (feed the parser; 400 on a parse error; hand a
        WebSocket upgrade over), counting the head's bytes first."""
        if self._refused:
            return
        if self._head_open:
            self._head_bytes += len(data)
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if not self._refused:
                self.logger.warning("Invalid HTTP request received.")
                self.send_400_response("Invalid HTTP request received.")
            return
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        if self._head_open and self._head_bytes > self.max_header_bytes:
            self._refuse(431, "Request Header Fields Too Large",
                         f"request headers over {self.max_header_bytes} bytes")

    def on_message_begin(self) -> None:
        """A new request: its head is counted and timed from here."""
        super().on_message_begin()
        self._head_open = True
        self._n_headers = 0
        if self._head_timer is None:
            self._arm_head_timer()

    def on_header(self, name: bytes, value: bytes) -> None:
        """Count header fields; refuse past ``max_headers``."""
        self._n_headers += 1
        if self._n_headers > self.max_headers:
            self._refuse(431, "Request Header Fields Too Large", f"more than {self.max_headers} header fields")
            raise _Refused()
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        """The head is complete: stop counting and timing it, and time the body."""
        self._head_open = False
        self._head_bytes = 0
        self._disarm_head_timer()
        # a head that arrived whole in one read is measured here
        size = len(self.url) + sum(len(n) + len(v) + 4 for n, v in self.headers)
        if size > self.max_header_bytes:
            self._refuse(431, "Request Header Fields Too Large", f"request headers over {self.max_header_bytes} bytes")
            raise _Refused()
        super().on_headers_complete()
        if self.cycle is not None and self.cycle.more_body and not self._refused:
            self._disarm_body_timer()
            self._body_timer = self.loop.call_later(self.body_timeout_s, self._body_timeout)

    def on_message_complete(self) -> None:
        """The body is complete: stop timing it."""
        self._disarm_body_timer()
        super().on_message_complete()

    def _disarm_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _body_timeout(self) -> None:
        """The body did not arrive in time: 408 if nothing was answered yet, then close;
        the app's next read is a disconnect (marked as a body timeout in its scope)."""
        self._body_timer = None
        cycle = self.cycle
        if cycle is None or self.transport.is_closing():
            return
        self.stats.body_timeouts_total += 1
        cycle.scope[BODY_TIMEOUT_KEY] = True  # type: ignore[literal-required]  # read by DisconnectMiddleware
        answered = cycle.response_started
        cycle.disconnected = True  # the app's answer, if it still sends one, goes nowhere
        cycle.message_event.set()
        if answered:
            self.transport.close()
            return
        self._refuse(408, "Request Timeout", f"request body not received within {self.body_timeout_s:g} s")

    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timeout)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self._head_open and not self.transport.is_closing():
            self._refuse(408, "Request Timeout", f"request headers not received within {self.header_timeout_s:g} s")

    def _refuse(self, status: int, reason: str, message: str, *headers: tuple[str, str]) -> None:
        """Answer ``status`` with ``message`` as plain text and close the connection (logged
        at info; a refusal by the connection caps, counted in ``stats``, at debug)."""
        if self._refused:
            return
        self._refused = True
        self._disarm_head_timer()
        self._disarm_body_timer()
        body = (message + "\n").encode()
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers)
        head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\n"
                f"content-length: {len(body)}\r\n{extra}connection: close\r\n\r\n").encode()
        if not self.transport.is_closing():
            self.transport.write(head + body)
            self.transport.close()
        log.log(logging.DEBUG if status in (429, 503) else logging.INFO, "refused a request from %s: %s",
                self.client, message)


def bounded_http_protocol(limits: Limits, stats: ConnectionStats) -> type[BoundedHttpToolsProtocol]:
    """A ``BoundedHttpToolsProtocol`` subclass with ``limits``' settings and one server's
    counters, for uvicorn's ``http`` option."""
    return type("BoundedHttp", (BoundedHttpToolsProtocol,), {
        "max_header_bytes": limits.http_max_header_bytes, "max_headers": limits.http_max_headers,
        "header_timeout_s": limits.http_header_timeout_s, "body_timeout_s": limits.http_body_timeout_s,
        "max_per_address": limits.http_max_connections_per_address,
        "max_connections": limits.http_max_connections or default_max_connections(), "stats": stats})
