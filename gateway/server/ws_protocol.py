"""uvicorn's WebSocket protocol (``websockets-sansio``) with bounded memory per connection.

Where a hostile client made the gateway buffer without bound, and what this changes
(measured in docs/reliability.md, "Hostile clients"):

* **Pongs to a client that never reads.** uvicorn writes the automatic pong of every
  ping straight to the transport, whose write buffer has no cap: a client that sends
  pings and reads nothing grew the gateway by about 190 MiB. Here, once the transport's
  write buffer passes its high-water mark (``pause_writing``), the connection stops
  reading, so no more pings (or frames) are taken in until the client reads what was
  already written; it resumes with ``resume_writing``. A connection whose writes stay
  paused for ``stall_abort_s`` is aborted (its buffer dropped): closing it politely
  would wait for a flush that never comes.
* **Frames over the limit.** The WebSocket layer's ``max_size`` is the documented
  ``max_frame_bytes`` (it was a 16 MiB hard cap above a 4 MiB limit the app checked after
  reading the frame whole: 24 sockets sending 15 MiB each took the gateway to 866 MiB).
  The sans-I/O parser refuses a frame as soon as its header gives a length over it,
  before reading the payload; the client then gets a ``frame_too_large`` error frame and
  close 1009 with a reason, and reconnects.

``bounded_ws_protocol`` makes the subclass with the limits and the counters of one
server, for uvicorn's ``ws`` option.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from uvicorn._types import ASGIReceiveEvent
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.exceptions import PayloadTooBig
from websockets.frames import Frame, Opcode

from gateway.server.http_limits import ConnectionStats

__all__ = ["BoundedWebSocketProtocol", "bounded_ws_protocol"]


class BoundedWebSocketProtocol(WebSocketsSansIOProtocol):
    """``WebSocketsSansIOProtocol`` that stops reading while its writes are paused and
    answers an over-long frame before closing (module doc). Subclassed per server by
    ``bounded_ws_protocol``; the class attributes are its settings."""

    max_frame_bytes = 4 << 20
    stall_abort_s = 30.0
    stats = ConnectionStats()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._write_paused = False
        self._stall_timer: asyncio.TimerHandle | None = None

    # --- flow control: read no more than the client reads ------------------------------

    def pause_writing(self) -> None:
        """The write buffer passed its high-water mark: stop reading until it drains."""
        super().pause_writing()
        self._write_paused = True
        if not self.transport.is_closing():
            self.transport.pause_reading()
        if self._stall_timer is None:
            self._stall_timer = self.loop.call_later(self.stall_abort_s, self._abort_stalled)

    def resume_writing(self) -> None:
        """The client read what was written: read again (unless the app has a frame
        it has not taken yet)."""
        super().resume_writing()
        self._write_paused = False
        self._cancel_stall_timer()
        if not self.read_paused and not self.transport.is_closing():
            self.transport.resume_reading()

    async def receive(self) -> ASGIReceiveEvent:
        """uvicorn's ``receive``, resuming reads only while writes are not paused."""
        message = await self.queue.get()
        if self.read_paused and self.queue.empty():
            self.read_paused = False
            if not self._write_paused:
                self.transport.resume_reading()
        return message

    def _abort_stalled(self) -> None:
        self._stall_timer = None
        if self._write_paused and not self.disconnected:
            self.stats.ws_stalled_aborted_total += 1
            self.transport.abort()

    def _cancel_stall_timer(self) -> None:
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        """uvicorn's, without the stall timer."""
        self._cancel_stall_timer()
        super().connection_lost(exc)

    # --- frames over the limit: refused from their header ---------------------------------

    def data_received(self, data: bytes) -> None:
        """uvicorn's ``data_received``; a frame whose header says it is over the limit
        gets a ``frame_too_large`` error frame before the close frame (1009, with a reason)."""
        self.conn.receive_data(data)
        exc = self.conn.parser_exc
        if exc is not None:
            if isinstance(exc, PayloadTooBig):
                self.stats.ws_frames_too_large_total += 1
                frame = {"type": "error", "code": "frame_too_large",
                         "message": f"frame over the {self.max_frame_bytes}-byte limit; the socket closes "
                                    f"(code 1009): reconnect and send less"}
                if not self.transport.is_closing():
                    self.transport.write(Frame(Opcode.TEXT, json.dumps(frame).encode()).serialize(mask=False))
            self.handle_parser_exception()
            return
        self.handle_events()


def bounded_ws_protocol(max_frame_bytes: int, stall_abort_s: float,
                        stats: ConnectionStats) -> type[BoundedWebSocketProtocol]:
    """A ``BoundedWebSocketProtocol`` subclass with these settings and counters, for
    uvicorn's ``ws`` option (``ws_max_size`` must be ``max_frame_bytes``)."""
    return type("BoundedWebSocket", (BoundedWebSocketProtocol,), {
        "max_frame_bytes": max_frame_bytes, "stall_abort_s": stall_abort_s, "stats": stats})
