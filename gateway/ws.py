"""The browser WebSocket ``/ws`` (docs/protocol.md section 2).

Per socket there is one reader (frames in), one writer (frames out) and one tail task
per reply the socket watches. Everything sent goes through a bounded outbox: a tail
that finds the outbox full waits, so it reads its Redis Stream no faster than the
client reads the socket, and the gateway holds at most ``ws_max_pending_frames`` frames
plus one read batch per tail for a slow client (bounded outbound buffers (docs/acceptance.md)). A frame the client
has not taken within ``ws_send_timeout_s`` marks the socket stalled: it is closed and
its tails stop; the replies themselves go on and are stored.

Frames are handled concurrently (at most ``ws_max_inflight`` per socket), so a ``ping``
is answered while a big ``chat`` of the same or another socket is being processed;
large frames are JSON-decoded off the event loop (the event loop is never blocked (docs/acceptance.md)).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from starlette.websockets import WebSocket

from gateway.auth import origin_allowed, request_user
from gateway.config import GatewayConfig
from gateway.errors import GatewayError, not_found
from gateway.generation import GenerationManager, StartedTurn
from gateway.live import LiveHub
from gateway.protocol import (
    PONG,
    CancelFrame,
    ChatFrame,
    ClientFrame,
    ContinueFrame,
    EditFrame,
    EventsFrame,
    PingFrame,
    ProtocolError,
    RegenerateFrame,
    ResumeFrame,
    decode_json,
    error_frame,
    error_from,
    parse_client_frame,
)
from gateway.streams import ReplyStreams, StreamEntry, done_payload

log = logging.getLogger("gateway.ws")
T = TypeVar("T")

BIG_FRAME_CHARS = 256 * 1024  # frames above this are decoded in a worker thread
TAIL_BATCH = 32  # stream entries read at once per tail
TAIL_BLOCK_MS = 5000


@dataclass
class WsStats:
    """Counters of all sockets of one gateway (read by tests and, later, /metrics).

    Attributes:
        sockets_open: sockets connected now.
        max_outbox_frames, max_outbox_bytes: the most frames / bytes (UTF-8 JSON) ever
            waiting in one socket's outbox, including the frame being written.
        frames_sent_total: frames handed to the socket.
        stalled_closed_total: sockets closed because the client stopped reading.
        frames_too_large_total, bad_frames_total: rejected client frames.
    """

    sockets_open: int = 0
    max_outbox_frames: int = 0
    max_outbox_bytes: int = 0
    frames_sent_total: int = 0
    stalled_closed_total: int = 0
    frames_too_large_total: int = 0
    bad_frames_total: int = 0


def _utf8_len_over(text: str, limit: int) -> bool:
    """True when ``text`` encodes to more than ``limit`` UTF-8 bytes (cheap when clear)."""
    if len(text) > limit:
        return True
    if 4 * len(text) <= limit:
        return False
    return len(text.encode("utf-8", "surrogatepass")) > limit


class Connection:
    """One accepted browser socket of user ``uid``."""

    def __init__(self, ws: WebSocket, uid: str, config: GatewayConfig, gens: GenerationManager,
                 streams: ReplyStreams, stats: WsStats) -> None:
        self.ws = ws
        self.uid = uid
        self.limits = config.limits
        self.store_retry_s = config.store_retry_s
        self.gens = gens
        self.streams = streams
        self.stats = stats
        self.outbox: asyncio.Queue[str] = asyncio.Queue(maxsize=config.limits.ws_max_pending_frames)
        self.outbox_bytes = 0
        self.inflight = asyncio.Semaphore(config.limits.ws_max_inflight)
        self.tails: dict[str, asyncio.Task[None]] = {}
        self.handlers: set[asyncio.Task[None]] = set()
        self.stalled = False
        self.live: LiveHub | None = None  # set by the endpoint; ``events`` frames (un)register here

    # ---- out ---------------------------------------------------------------------------

    async def send(self, frame: dict[str, Any]) -> None:
        """Queue a frame; waits while the outbox is full (the client reads slowly)."""
        data = json.dumps(frame, ensure_ascii=False)
        await self.outbox.put(data)
        self.outbox_bytes += len(data.encode())
        self.stats.max_outbox_frames = max(self.stats.max_outbox_frames, self.outbox.qsize())
        self.stats.max_outbox_bytes = max(self.stats.max_outbox_bytes, self.outbox_bytes)

    def offer(self, frame: dict[str, Any]) -> bool:
        """Queue a frame without waiting (live events); False when the outbox is full."""
        data = json.dumps(frame, ensure_ascii=False)
        try:
            self.outbox.put_nowait(data)
        except asyncio.QueueFull:
            return False
        self.outbox_bytes += len(data.encode())
        return True

    async def _writer(self) -> None:
        timeout = self.limits.ws_send_timeout_s
        while True:
            data = await self.outbox.get()
            try:
                await asyncio.wait_for(self.ws.send_text(data), timeout)
            except asyncio.TimeoutError:
                self.stalled = True
                self.stats.stalled_closed_total += 1
                log.info("closing a stalled socket of user %s", self.uid)
                return
            except Exception:  # the client went away
                return
            self.outbox_bytes -= len(data.encode())
            self.stats.frames_sent_total += 1

    # ---- in ----------------------------------------------------------------------------

    async def _reader(self) -> None:
        while True:
            msg = await self.ws.receive()
            if msg["type"] == "websocket.disconnect":
                return
            text = msg.get("text")
            if text is None:
                self.stats.bad_frames_total += 1
                await self.send(error_frame("bad_frame", "binary frames are not supported; send JSON text"))
                continue
            if _utf8_len_over(text, self.limits.max_frame_bytes):
                self.stats.frames_too_large_total += 1
                await self.send(error_frame("frame_too_large",
                                            f"frame over the {self.limits.max_frame_bytes}-byte limit"))
                continue
            try:
                obj = await asyncio.to_thread(decode_json, text) if len(text) > BIG_FRAME_CHARS else decode_json(text)
                frame = parse_client_frame(obj)
            except ProtocolError as e:
                self.stats.bad_frames_total += 1
                await self.send(error_from(e))
                continue
            if isinstance(frame, PingFrame):
                await self.send(PONG)
                continue
            if isinstance(frame, EventsFrame):
                self._watch_events(frame.on)
                continue
            await self.inflight.acquire()
            task = asyncio.create_task(self._handle(frame))
            self.handlers.add(task)
            task.add_done_callback(self._handler_done)

    def _watch_events(self, on: bool) -> None:
        """``events``: (un)register this socket for the user's live chat events."""
        if self.live is not None:
            (self.live.add if on else self.live.remove)(self.uid, self.offer)

    def _handler_done(self, task: asyncio.Task[None]) -> None:
        self.handlers.discard(task)
        self.inflight.release()

    async def _handle(self, frame: ClientFrame) -> None:
        rid = getattr(frame, "request_id", None)
        sid = getattr(frame, "session_id", None)
        try:
            if isinstance(frame, ChatFrame):
                # shielded: a socket that goes away must not cut a turn half-begun
                started = await asyncio.shield(self.gens.chat(self.uid, frame.session_id, frame.content,
                                                              frame.params, frame.client_msg_id))
                await self.subscribe(started.request_id, 0, self._head_of(started))
            elif isinstance(frame, RegenerateFrame):
                started = await asyncio.shield(self.gens.regenerate(self.uid, frame.session_id, frame.params,
                                                                    frame.message_id))
                await self.subscribe(started.request_id, 0, self._head_of(started))
            elif isinstance(frame, CancelFrame):
                await asyncio.shield(self.gens.cancel(self.uid, frame.request_id))
            elif isinstance(frame, ResumeFrame):
                await self.subscribe(frame.request_id, frame.last_seq)
            elif isinstance(frame, (EditFrame, ContinueFrame)):
                await self._edit_or_continue(frame)
        except GatewayError as e:
            await self.send(error_from(e, request_id=rid, session_id=sid))
        except Exception:
            log.exception("handling a %s frame failed", type(frame).__name__)
            await self.send(error_frame("internal_error", "something went wrong; try again", rid, sid))

    async def _edit_or_continue(self, frame: EditFrame | ContinueFrame) -> None:
        """``edit`` and ``continue``: start the turn (shielded, as ``chat``) and follow it."""
        if isinstance(frame, EditFrame):
            turn = self.gens.edit(self.uid, frame.session_id, frame.message_id, frame.content, frame.params,
                                  frame.client_msg_id)
        else:
            turn = self.gens.continue_reply(self.uid, frame.session_id, frame.message_id, frame.params)
        started = await asyncio.shield(turn)
        await self.subscribe(started.request_id, 0, self._head_of(started))

    # ---- tails -------------------------------------------------------------------------

    def _head_of(self, started: StartedTurn) -> StreamEntry:
        """The start entry of a turn this socket just began (known without reading
        Redis: an accepted turn is followed even if Redis blinks right now)."""
        return StreamEntry("start", 0, {"owner": self.uid, "session_id": started.session_id,
                                        "message_id": started.message_id,
                                        "user_message_id": started.user_message_id})

    async def subscribe(self, rid: str, last_seq: int, head: StreamEntry | None = None) -> None:
        """Start sending reply ``rid`` from ``last_seq`` (replacing an older tail of it);
        ``head`` is its start entry when the caller knows it (else it is read).

        Raises:
            GatewayError: ``not_found`` (unknown, expired or another user's reply),
                ``rate_limited`` (too many replies watched on this socket).
        """
        if head is None:
            head = await self.streams.head(rid)
        if head is None or head.fields.get("owner") != self.uid:
            raise not_found("reply")
        old = self.tails.pop(rid, None)
        if old is not None:
            old.cancel()
        if len(self.tails) >= self.limits.ws_max_subscriptions:
            raise GatewayError("rate_limited", "too many replies watched on one socket")
        task = asyncio.create_task(self._tail(rid, head, last_seq))
        self.tails[rid] = task
        task.add_done_callback(lambda t: self.tails.pop(rid, None) if self.tails.get(rid) is t else None)

    async def _tail(self, rid: str, head: StreamEntry, cursor: int) -> None:
        sid = head.fields.get("session_id")
        try:
            await self.send({"type": "start", "request_id": rid, "session_id": sid,
                             "message_id": head.fields.get("message_id"),
                             "user_message_id": head.fields.get("user_message_id") or None})
            last = await self._patiently(lambda: self.streams.last(rid))
            if last is not None and last.seq < cursor:
                cursor = last.seq  # the client claims more than exists: send the end only
            while True:
                entries = await self._patiently(partial(self.streams.read, rid, cursor, TAIL_BATCH, TAIL_BLOCK_MS))
                if not entries and await self._patiently(lambda: self.streams.head(rid)) is None:
                    if rid in self.gens.running:
                        continue  # its start entry is still waiting for Redis to come back
                    await self.send(error_frame("not_found", "this reply is no longer available", rid, sid))
                    return
                for e in entries:
                    if e.kind == "delta":
                        await self.send({"type": "delta", "request_id": rid, "seq": e.seq, "text": e.fields["x"]})
                        cursor = e.seq
                    elif e.kind == "done":
                        await self.send({"type": "done", **done_payload(e)})
                        return
                    elif e.kind == "error":
                        await self.send(error_frame(e.fields.get("code", "internal_error"),
                                                    e.fields.get("message", ""), rid, sid))
                        return
        except GatewayError as e:
            await self.send(error_from(e, request_id=rid, session_id=sid))

    async def _patiently(self, op: Callable[[], Awaitable[T]]) -> T:
        """Run a stream read, waiting out a Redis outage (backoff up to 5 s, at most
        ``store_retry_s``): the reply task keeps the reply meanwhile, so the client
        is not told it failed.

        Raises:
            GatewayError: ``store_unavailable`` once the time is up; other codes at once.
        """
        deadline = time.monotonic() + self.store_retry_s
        backoff = 0.2
        while True:
            try:
                return await op()
            except GatewayError as e:
                if e.code != "store_unavailable" or time.monotonic() + backoff > deadline:
                    raise
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, 5.0)

    # ---- lifetime ----------------------------------------------------------------------

    async def run(self) -> None:
        """Serve the socket until the client leaves or stalls; replies go on."""
        self.stats.sockets_open += 1
        writer = asyncio.create_task(self._writer())
        reader = asyncio.create_task(self._reader())
        try:
            await asyncio.wait({writer, reader}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.stats.sockets_open -= 1
            tasks = [writer, reader, *self.tails.values(), *self.handlers]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def websocket_endpoint(websocket: WebSocket) -> None:
    """``WS /ws``: check the Origin and the user cookie (HTTP 403 before the upgrade
    otherwise), then serve the browser protocol."""
    state = websocket.app.state
    config: GatewayConfig = state.config
    uid = request_user(websocket.scope)
    if not origin_allowed(websocket.scope, config.allowed_origins) or uid is None:
        await websocket.close(code=1008)  # before accept: uvicorn answers HTTP 403
        return
    await websocket.accept()
    conn = Connection(websocket, uid, config, state.generations, state.streams, state.ws_stats)
    conn.live = getattr(state, "live", None)
    try:
        await conn.run()
    finally:
        if conn.live is not None:
            conn.live.remove(uid, conn.offer)
    # A stalled socket is not closed politely (the close frame would queue behind the
    # unread data); returning lets the server drop the connection.
