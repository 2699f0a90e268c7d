"""Bounds on what an HTTP client may send before its request is read: header bytes,
header count and the time to send the headers (uvicorn has none of these for its
httptools parser: a 64 MiB header was buffered whole, and a header trickled a few bytes
at a time held its connection forever).

``bounded_http_protocol(limits)`` is uvicorn's ``HttpToolsProtocol`` with three checks:

* header bytes: once a request's head (request line and headers) exceeds
  ``http_max_header_bytes``, the client gets ``431 Request Header Fields Too Large`` and
  the connection is closed; the server holds at most that plus one socket read
  (256 KiB) of it;
* header count: more than ``http_max_headers`` fields is a 431 too;
* header timeout: a head not complete ``http_header_timeout_s`` after the connection
  opened (or after the request's first byte, on a kept-alive connection) gets
  ``408 Request Timeout`` and the connection is closed.

Bodies are bounded elsewhere (``max_http_body_bytes``, ``max_frame_bytes``), and idle
kept-alive connections by uvicorn's ``timeout_keep_alive``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.config import Limits

log = logging.getLogger("gateway.http")


class _Refused(Exception):
    """Raised inside a parser callback to stop parsing a refused request."""


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """``HttpToolsProtocol`` with header size, count and time limits (module doc).
    Subclassed per limits by ``bounded_http_protocol``; the class attributes are the limits."""

    max_header_bytes = 64 * 1024
    max_headers = 100
    header_timeout_s = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_open = True  # reading a request line and headers
        self._head_bytes = 0
        self._n_headers = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Start the header timer: a client that connects must send its head in time."""
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        """Stop the header timer."""
        self._disarm_head_timer()
        super().connection_lost(exc)

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
        """The head is complete: stop counting and timing it."""
        self._head_open = False
        self._head_bytes = 0
        self._disarm_head_timer()
        # a head that arrived whole in one read is measured here
        size = len(self.url) + sum(len(n) + len(v) + 4 for n, v in self.headers)
        if size > self.max_header_bytes:
            self._refuse(431, "Request Header Fields Too Large", f"request headers over {self.max_header_bytes} bytes")
            raise _Refused()
        super().on_headers_complete()

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

    def _refuse(self, status: int, reason: str, message: str) -> None:
        """Answer ``status`` with ``message`` as plain text and close the connection."""
        if self._refused:
            return
        self._refused = True
        self._disarm_head_timer()
        body = (message + "\n").encode()
        head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
        if not self.transport.is_closing():
            self.transport.write(head + body)
            self.transport.close()
        log.info("refused a request from %s: %s", self.client, message)


def bounded_http_protocol(limits: Limits) -> type[BoundedHttpToolsProtocol]:
    """A ``BoundedHttpToolsProtocol`` subclass with ``limits``' header settings, for
    uvicorn's ``http`` option."""
    return type("BoundedHttp", (BoundedHttpToolsProtocol,), {
        "max_header_bytes": limits.http_max_header_bytes, "max_headers": limits.http_max_headers,
        "header_timeout_s": limits.http_header_timeout_s})
