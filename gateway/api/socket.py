"""The browser WebSocket ``/ws`` (docs/protocol.md section 2).

Per socket there is one reader (frames in) and one tail task per reply the socket
watches (``tails.ReplyTail``: from the reply task's memory when the reply runs on this
gateway, else from its Redis Stream). Everything sent goes through a bounded outbox,
written out in order by whichever sender finds nobody writing: a tail that finds the
outbox full waits, so it reads no faster than the client reads the socket, and the
gateway holds at most ``ws_max_pending_frames`` frames plus one read batch per tail for
a slow client (bounded outbound buffers (docs/acceptance.md#bounded-outbound-buffers)).
A write the client has not taken within ``ws_send_timeout_s`` (checked every quarter of
it) marks the socket stalled: it is closed and its tails stop; the replies themselves
go on and are stored. A delta is encoded once however many sockets here follow its reply.

Frames are handled concurrently (at most ``ws_max_inflight`` per socket), so a ``ping``
is answered while a big ``chat`` of the same or another socket is being processed;
large frames are JSON-decoded off the event loop (the event loop is never blocked
(docs/acceptance.md#the-event-loop-is-never-blocked)).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import JSONResponse
from starlette.websockets import WebSocket

from gateway.api.auth import header, origin_allowed, own_origins, request_user
from gateway.api.socket_frames import (
    PONG,
    CancelFrame,
    ChatFrame,
    ClientFrame,
    ContinueFrame,
    DeltaOut,
    EditFrame,
    EventsFrame,
    PingFrame,
    ProgressOut,
    ProtocolError,
    RegenerateFrame,
    ResumeFrame,
    ServerFrame,
    StartOut,
    WireFrame,
    decode_json,
    done_frame,
    encode_frame,
    error_frame,
    error_from,
    parse_client_frame,
)
from gateway.api.state import gateway_state
from gateway.config import BIG_FRAME_CHARS, GatewayConfig
from gateway.errors import GatewayError, not_found
from gateway.replies.manager import GenerationManager, StartedTurn
from gateway.replies.tail import TAIL_BLOCK_MS, ReplyLog, ReplyTail
from gateway.store.live_events import LiveHub
from gateway.store.reply_streams import ReplyStreams, StreamEntry, done_payload

__all__ = ["TAIL_BLOCK_MS", "Connection", "WsStats", "websocket_endpoint"]

log = logging.getLogger("gateway.api.socket")

REVOKED_CLOSE_CODE = 1008  # policy violation: the socket's token was revoked (or its user deleted)


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
        by_user, by_address: sockets open now per user and per client address (capped
            by ``ws_max_sockets_per_user`` / ``ws_max_sockets_per_address``).
    """

    sockets_open: int = 0
    max_outbox_frames: int = 0
    max_outbox_bytes: int = 0
    frames_sent_total: int = 0
    stalled_closed_total: int = 0
    frames_too_large_total: int = 0
    bad_frames_total: int = 0
    by_user: dict[str, int] = field(default_factory=dict)  # open sockets per user id
    by_address: dict[str, int] = field(default_factory=dict)  # open sockets per client address


def _utf8_len_over(text: str, limit: int) -> bool:
    """True when ``text`` encodes to more than ``limit`` UTF-8 bytes (cheap when clear)."""
    if len(text) > limit:
        return True
    if 4 * len(text) <= limit:
        return False
    return len(text.encode("utf-8", "surrogatepass")) > limit


class Connection:
    """One accepted browser socket of user ``uid``.

    Frames out wait in ``outbox`` (at most ``ws_max_pending_frames``, the one being
    written included); whichever sender finds nobody writing writes the outbox out in
    order (no task hop per frame), and a watchdog marks the socket stalled when one
    write has waited ``ws_send_timeout_s`` (checked every quarter of it)."""

    def __init__(self, ws: WebSocket, uid: str, config: GatewayConfig, gens: GenerationManager,
                 streams: ReplyStreams, stats: WsStats) -> None:
        self.ws = ws
        self.uid = uid
        self.limits = config.limits
        self.store_retry_s = config.store_retry_s
        self.gens = gens
        self.streams = streams
        self.stats = stats
        self.outbox: deque[WireFrame] = deque()
        self.outbox_bytes = 0
        self._writing = False  # a sender is writing the outbox out
        self._write_started: float | None = None  # loop time the current write began
        self._room: deque[asyncio.Future[None]] = deque()  # senders waiting for a free slot
        self._gone = asyncio.Event()  # the client went away (a write failed) or stalled
        self.inflight = asyncio.Semaphore(config.limits.ws_max_inflight)
        self.tails: dict[str, asyncio.Task[None]] = {}
        self.handlers: set[asyncio.Task[None]] = set()
        self.stalled = False
        self.live: LiveHub | None = None  # set by the endpoint; ``events`` frames (un)register here
        self.revoked: str | None = None  # why the socket must close now (gateway/api/revocation.py)
        self._revoked = asyncio.Event()

    # ---- out ---------------------------------------------------------------------------

    async def send(self, frame: ServerFrame) -> None:
        """Queue a frame; waits while the outbox is full (the client reads slowly)."""
        await self.send_wire(encode_frame(frame))

    async def send_wire(self, wire: WireFrame) -> None:
        """Queue an encoded frame (waiting while the outbox is full) and, when nobody is
        writing, write the outbox out."""
        while len(self.outbox) >= self.limits.ws_max_pending_frames and not self._gone.is_set():
            room = asyncio.get_running_loop().create_future()
            self._room.append(room)
            await room
        self._queue(wire)
        if not self._writing:
            await self._write_out()

    def offer(self, frame: dict[str, Any]) -> bool:
        """Queue a frame without waiting (live events); False when the outbox is full."""
        if len(self.outbox) >= self.limits.ws_max_pending_frames:
            return False
        self._queue(encode_frame(frame))
        if not self._writing:
            task = asyncio.get_running_loop().create_task(self._write_out())
            self.handlers.add(task)
            task.add_done_callback(self.handlers.discard)
        return True

    def _queue(self, wire: WireFrame) -> None:
        self.outbox.append(wire)
        self.outbox_bytes += wire.size
        self.stats.max_outbox_frames = max(self.stats.max_outbox_frames, len(self.outbox))
        self.stats.max_outbox_bytes = max(self.stats.max_outbox_bytes, self.outbox_bytes)

    async def _write_out(self) -> None:
        """Write the outbox to the client in order until it is empty. A frame leaves the
        outbox once written; a writer cancelled mid-frame leaves it first in line and
        hands the rest to a task of its own."""
        self._writing = True
        loop = asyncio.get_running_loop()
        try:
            while self.outbox and not self._gone.is_set():
                wire = self.outbox[0]
                self._write_started = loop.time()
                try:
                    await self.ws.send_text(wire.text)
                except asyncio.CancelledError:
                    raise
                except Exception:  # the client went away
                    self._gone.set()
                    return
                finally:
                    self._write_started = None
                self.outbox.popleft()
                self.outbox_bytes -= wire.size
                self.stats.frames_sent_total += 1
                while self._room:
                    room = self._room.popleft()
                    if not room.done():
                        room.set_result(None)
                        break
        finally:
            self._writing = False
            if self.outbox and not self._gone.is_set() and not loop.is_closed():
                # cancelled (its tail replaced or ended) with frames still to write
                task = loop.create_task(self._write_out())
                self.handlers.add(task)
                task.add_done_callback(self.handlers.discard)
            if self._gone.is_set():
                for room in self._room:
                    if not room.done():
                        room.set_result(None)
                self._room.clear()

    async def _watch_writes(self) -> None:
        """Mark the socket stalled once a write has waited ``ws_send_timeout_s``."""
        timeout = self.limits.ws_send_timeout_s
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(timeout / 4)
            started = self._write_started
            if started is not None and loop.time() - started >= timeout:
                self.stalled = True
                self.stats.stalled_closed_total += 1
                log.info("closing a stalled socket of user %s", self.uid)
                self._gone.set()
                return

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
                                                              frame.params, frame.client_msg_id,
                                                              attachments=frame.attachments, model=frame.model,
                                                              tools=frame.tools, tool_results=frame.tool_results))
                await self.subscribe(started.request_id, 0, self._head_of(started))
            elif isinstance(frame, RegenerateFrame):
                started = await asyncio.shield(self.gens.regenerate(self.uid, frame.session_id, frame.params,
                                                                    frame.message_id, frame.tools))
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
                                  frame.client_msg_id, attachments=frame.attachments)
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
        tail = ReplyTail(rid, cursor, self.streams, self.gens.reply_log, self.store_retry_s,
                         self.gens.config.lock_lease_ms)
        progress: asyncio.Task[None] | None = None
        try:
            await self.send(StartOut(type="start", request_id=rid, session_id=sid,
                                     message_id=head.fields.get("message_id"),
                                     user_message_id=head.fields.get("user_message_id") or None))
            reply_log = self.gens.reply_log(rid)
            if reply_log is not None and not reply_log.deltas and reply_log.end is None:
                progress = asyncio.create_task(self._progress(rid, sid, reply_log))
            while not tail.done:
                for e in await tail.next():
                    if e.kind == "delta":
                        # one encoding per delta, shared by every socket here that follows the reply
                        wire = e.wire.get("ws")
                        if wire is None:
                            wire = e.wire["ws"] = encode_frame(DeltaOut(type="delta", request_id=rid, seq=e.seq,
                                                                        text=e.fields["x"]))
                        await self.send_wire(wire)
                    elif e.kind == "done":
                        await self.send(done_frame(done_payload(e)))
                    elif e.kind == "error":
                        await self.send(error_frame(e.fields.get("code", "internal_error"),
                                                    e.fields.get("message", ""), rid, sid))
        except GatewayError as e:
            if e.code == "not_found":
                await self.send(error_frame("not_found", "this reply is no longer available", rid, sid))
            else:
                await self.send(error_from(e, request_id=rid, session_id=sid))
        finally:
            if progress is not None:
                progress.cancel()

    async def _progress(self, rid: str, sid: str | None, reply_log: ReplyLog) -> None:
        """Send ``progress`` frames while the reply's long prompt is read, until its first
        delta or its end (a reply running on this gateway only: progress is never stored)."""
        seen = 0
        while True:
            await reply_log.wait_progress(seen)
            if reply_log.deltas or reply_log.end is not None or reply_log.progress is None:
                return
            seen = reply_log.progress_version
            done, total, cached = reply_log.progress
            await self.send(ProgressOut(type="progress", request_id=rid, session_id=sid, prompt_tokens_done=done,
                                        prompt_tokens=total, cached_tokens=cached))

    # ---- lifetime ----------------------------------------------------------------------

    def revoke(self, reason: str) -> None:
        """Close the socket now with code 1008 and ``reason`` (its token was revoked or its
        user's data deleted); its replies go on and are stored."""
        self.revoked = reason
        self._revoked.set()

    async def run(self) -> None:
        """Serve the socket until the client leaves or stalls, or it is revoked; replies go on."""
        self.stats.sockets_open += 1
        reader = asyncio.create_task(self._reader())
        watchdog = asyncio.create_task(self._watch_writes())
        gone = asyncio.create_task(self._gone.wait())
        revoked = asyncio.create_task(self._revoked.wait())
        try:
            await asyncio.wait({reader, watchdog, gone, revoked}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.stats.sockets_open -= 1
            self._gone.set()  # nothing more is written
            tasks = [reader, watchdog, gone, revoked, *self.tails.values(), *self.handlers]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if self.revoked is not None:
            try:  # a client that does not read cannot hold this up
                await asyncio.wait_for(self.ws.close(code=REVOKED_CLOSE_CODE, reason=self.revoked), 1.0)
            except Exception:  # noqa: BLE001 - gone already, or not reading: the server drops it
                pass


def _refusal(code: str, message: str, status: int = 403) -> JSONResponse:
    """The HTTP answer to a refused handshake: ``{"error": {"code", "message"}}``, so a
    client can say which of Origin, cookie or path was wrong."""
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status)


async def _deny(websocket: WebSocket, response: JSONResponse) -> None:
    """Refuse the handshake with ``response`` (HTTP, before the upgrade); a server
    without the denial-response extension answers a bare 403."""
    if "websocket.http.response" in websocket.scope.get("extensions", {}):
        await websocket.send_denial_response(response)
    else:
        await websocket.close(code=1008)


async def websocket_endpoint(websocket: WebSocket) -> None:
    """``WS /ws``: check the Origin and the user (cookie or personal token), answering
    HTTP 403 with the reason before the upgrade otherwise, and the caps on open sockets
    per user and per address (over either: a ``rate_limited`` error frame and close
    1008), then serve the browser protocol.

    A handshake identified by a personal token (``X-Chat-Token``, ``gateway.api.access_tokens``)
    needs no ``Origin``: browsers cannot set that header, so it cannot be a cross-site
    page riding on someone's cookie.
    """
    state = gateway_state(websocket)
    config: GatewayConfig = state.config
    uid = request_user(websocket.scope)
    by_token = websocket.scope.get("state", {}).get("auth") == "token"
    if not by_token and not origin_allowed(websocket.scope, config.allowed_origins, config.trusted_hosts()):
        origin = header(websocket.scope, b"origin")
        seen = f"Origin {origin!r}" if origin else "no Origin header"
        await _deny(websocket, _refusal(
            "origin_not_allowed", f"{seen}: the socket accepts the page's own origin "
                                  f"({sorted(own_origins(websocket.scope))}) or ALLOWED_ORIGINS"))
        return
    if uid is None:
        await _deny(websocket, _refusal(
            "no_user", "no valid user cookie (chat_uid): get one with GET /api/config, "
                       "or send a personal access token in X-Chat-Token"))
        return
    stats: WsStats = state.ws_stats
    addr = websocket.client.host if websocket.client else ""
    lim = config.limits
    await websocket.accept()
    if stats.by_user.get(uid, 0) >= lim.ws_max_sockets_per_user or \
            stats.by_address.get(addr, 0) >= lim.ws_max_sockets_per_address:
        who = "user" if stats.by_user.get(uid, 0) >= lim.ws_max_sockets_per_user else "address"
        await websocket.send_text(encode_frame(error_frame("rate_limited", f"too many open sockets for this {who}; "
                                                           "close other tabs or try again later")).text)
        await websocket.close(code=1008, reason=f"too many sockets per {who}")
        return
    stats.by_user[uid] = stats.by_user.get(uid, 0) + 1
    stats.by_address[addr] = stats.by_address.get(addr, 0) + 1
    conn = Connection(websocket, uid, config, state.generations, state.streams, stats)
    conn.live = state.live
    token = websocket.scope.get("state", {}).get("token") if by_token else None
    release = state.revocations.hold(uid, conn.revoke, token.id if token else None, token.digest if token else None)
    try:
        await conn.run()
    finally:
        release()
        if conn.live is not None:
            conn.live.remove(uid, conn.offer)
        for counts, key in ((stats.by_user, uid), (stats.by_address, addr)):
            counts[key] -= 1
            if counts[key] <= 0:
                del counts[key]
    # A stalled socket is not closed politely (the close frame would queue behind the
    # unread data); returning lets the server drop the connection.


async def websocket_not_found(websocket: WebSocket) -> None:
    """A WebSocket handshake on any path but ``/ws``: HTTP 404 with the right path."""
    await _deny(websocket, _refusal("wrong_path", f"no WebSocket at {websocket.url.path!r}; "
                                                  "the chat socket is at /ws", 404))
