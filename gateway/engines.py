"""Client side of the internal engine protocol (docs/protocol.md section 1).

``EngineClient`` keeps one WebSocket to one engine and multiplexes many requests on
it by request id, each with its own queue of frames; it reconnects with exponential
backoff. When the connection drops, the engine aborts that connection's requests, so
every open request gets a synthetic ``error`` frame with code ``engine_unavailable``.

``EngineRouter`` spreads chats over several engines: each chat has a home engine (by
rendezvous hashing of the chat id, Thaler & Ravishankar 1996) where its prefix cache
is, and a request sheds to the least-loaded engine when the home is overloaded
(``gateway/routing.py``, docs/scaling.md). When an engine is down only its chats move,
each to the healthy engine that ranks next for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Any

import websockets
from websockets.asyncio.client import ClientConnection, connect

from engine.protocol import (
    AbortFrame,
    DeltaFrame,
    DoneFrame,
    EngineFrame,
    EngineInfo,
    ErrorFrame,
    FrameError,
    GenerateFrame,
    HelloFrame,
    ReplyItem,
    StatsFrame,
    StatsRequest,
    StepFrame,
    decode_engine_frame,
    encode,
)
from gateway.errors import GatewayError
from gateway.retry import Backoff
from gateway.routing import EngineLoad, Placements, RoutingPolicy, choose, rendezvous_rank, snapshot_load

SECRET_HEADER = "X-Engine-Secret"  # the engine link's shared secret (engine/server.py checks it)
log = logging.getLogger("gateway.engines")

__all__ = ["EngineClient", "EngineInfo", "EngineRequest", "EngineRouter", "engine_unavailable"]

UNREACHABLE_WARN_S = 5.0  # an engine down this long (seconds) is logged as a warning
BIG_FRAME_CHARS = 256 * 1024  # frames above this are JSON-encoded off the event loop


def engine_unavailable(detail: str = "") -> GatewayError:
    """The error for "no engine can take this now"."""
    msg = "the model engine is unavailable; try again shortly"
    return GatewayError("engine_unavailable", msg + (f" ({detail})" if detail else ""))


class EngineRequest:
    """One generation in flight on an engine. Read its items (``DeltaFrame``s, then one
    ``DoneFrame`` or ``ErrorFrame``) with ``next()``; always ``close()`` it (it
    unregisters the id, and aborts the request if it has not ended)."""

    def __init__(self, client: EngineClient, request_id: str) -> None:
        self.client = client
        self.request_id = request_id
        self.queue: asyncio.Queue[ReplyItem | None] = asyncio.Queue()  # None: a wake-up
        self.ended = False

    def _take(self, item: ReplyItem | None) -> ReplyItem | None:
        if isinstance(item, (DoneFrame, ErrorFrame)):
            self.ended = True
        return item

    async def next(self, timeout: float | None = None) -> ReplyItem | None:
        """The next item of this request; None when ``wake`` was called.

        Raises:
            asyncio.TimeoutError: nothing arrived within ``timeout`` seconds.
        """
        if timeout is None:
            return self._take(await self.queue.get())
        return self._take(await asyncio.wait_for(self.queue.get(), timeout))

    def ready(self) -> list[ReplyItem]:
        """The items that have already arrived (possibly none), without waiting."""
        out = []
        while not self.queue.empty():
            item = self._take(self.queue.get_nowait())
            if item is not None:
                out.append(item)
        return out

    def wake(self) -> None:
        """Make a waiting ``next`` return None (its caller re-checks its own state)."""
        self.queue.put_nowait(None)

    async def abort(self) -> None:
        """Ask the engine to stop this request now (it answers with ``done``/"abort")."""
        await self.client.abort(self.request_id)

    def close(self) -> None:
        """Stop routing items of this id to this handle; a request that has not ended is
        aborted in the engine (a reply nobody reads must not keep generating)."""
        if self.client._requests.get(self.request_id) is self:
            del self.client._requests[self.request_id]
            if not self.ended:
                self.client.abort_soon(self.request_id)


class EngineClient:
    """One multiplexed connection to one engine, reconnecting with backoff.

    ``healthy`` (and the ``engine_up`` metric) means the link is open and the engine's
    ``hello`` arrived; a busy engine stays healthy (its socket reader never waits for a
    step). ``last_stats`` is the engine's latest ``stats`` answer and ``stats_taken_at``
    the monotonic time of the snapshot it came from.

    Args:
        url: the engine's ``ws://host:port`` address.
        max_backoff_s: the longest wait between reconnect attempts (seconds).
        open_timeout_s: how long a connection attempt and its ``hello`` may take (seconds).
        secret: the engine link's shared secret (``ENGINE_SECRET``), sent on connect.
    """

    # the engine takes prompts as token ids (a continued reply) and reports the ids it
    # read and sampled; an OpenAI-compatible upstream (gateway/upstream.py) does neither
    takes_token_ids: bool = True

    def __init__(self, url: str, max_backoff_s: float = 5.0, open_timeout_s: float = 10.0,
                 secret: str | None = None) -> None:
        self.url = url
        self._headers = {SECRET_HEADER: secret} if secret else {}
        self.info: EngineInfo | None = None
        self.protocol_version = 0
        self.max_backoff_s = max_backoff_s
        self.open_timeout_s = open_timeout_s
        self._ws: ClientConnection | None = None
        self._requests: dict[str, EngineRequest] = {}
        self._stats_waiter: asyncio.Future[StatsFrame] | None = None
        self._ready = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._aborts: set[asyncio.Task[None]] = set()
        self.last_stats: dict[str, Any] | None = None
        self.stats_taken_at: float | None = None

    @property
    def healthy(self) -> bool:
        """Connected and greeted by the engine."""
        return self._ready.is_set()

    async def start(self) -> None:
        """Start connecting in the background (returns at once)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"engine-client {self.url}")

    async def close(self) -> None:
        """Close the connection and stop reconnecting."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None
        for t in list(self._aborts):
            t.cancel()
        self._lost("gateway shutting down")

    async def _run(self) -> None:
        backoff = Backoff(0.1, self.max_backoff_s, jitter=0.5)
        down_since: float | None = time.monotonic()
        while True:
            try:
                async with connect(self.url, max_size=None, compression=None, open_timeout=self.open_timeout_s,
                                   ping_interval=20, ping_timeout=60, close_timeout=2,
                                   additional_headers=self._headers) as ws:
                    hello = decode_engine_frame(await asyncio.wait_for(ws.recv(), self.open_timeout_s))
                    if not isinstance(hello, HelloFrame):
                        raise ConnectionError(f"engine sent {type(hello).__name__} instead of hello")
                    self.info, self.protocol_version = hello.info, hello.protocol_version
                    self._ws = ws
                    self._ready.set()
                    backoff.reset()
                    down_since = None
                    log.info("connected to engine %s (%s)", self.url, self.info.model)
                    async for raw in ws:
                        try:
                            self._dispatch(decode_engine_frame(raw))
                        except FrameError as e:
                            log.warning("engine %s sent a malformed frame (%s); ignored", self.url, e)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # any failure means "reconnect"; log without a traceback
                # a warning once it stays down: a restart (or the engine stopping with the
                # gateway on Ctrl-C) is a second or two of refused connections
                now = time.monotonic()
                down_since = now if down_since is None else down_since
                level = logging.WARNING if now - down_since >= UNREACHABLE_WARN_S else logging.INFO
                log.log(level, "engine %s unreachable: %s", self.url, e)
            if down_since is None:
                down_since = time.monotonic()
            self._lost("connection to the engine was lost")
            await backoff.sleep()

    def _route(self, item: ReplyItem) -> None:
        req = self._requests.get(item.request_id) if item.request_id is not None else None
        if req is not None:
            req.queue.put_nowait(item)
        elif isinstance(item, ErrorFrame):
            log.warning("engine %s error without a live request: %s %s", self.url, item.code, item.message)

    def _dispatch(self, frame: EngineFrame) -> None:
        if isinstance(frame, StepFrame):
            for item in frame.items:
                self._route(item)
        elif isinstance(frame, StatsFrame):
            self.last_stats = frame.stats
            self.stats_taken_at = time.monotonic() - frame.age_ms / 1000
            fut, self._stats_waiter = self._stats_waiter, None
            if fut is not None and not fut.done():
                fut.set_result(frame)
        elif isinstance(frame, (DeltaFrame, DoneFrame, ErrorFrame)):
            self._route(frame)  # an item sent on its own (a refused generate)

    def _lost(self, why: str) -> None:
        self._ready.clear()
        self._ws = None
        for req in list(self._requests.values()):
            req.queue.put_nowait(ErrorFrame("engine_unavailable", why, req.request_id))
        self._requests.clear()
        fut, self._stats_waiter = self._stats_waiter, None
        if fut is not None and not fut.done():
            fut.set_exception(engine_unavailable(why))
            fut.exception()  # retrieved: nobody may be waiting any more

    async def _send_text(self, text: str) -> None:
        ws = self._ws
        if ws is None:
            raise engine_unavailable("not connected")
        try:
            await ws.send(text)
        except websockets.ConnectionClosed as e:
            raise engine_unavailable("connection closed") from e

    async def generate(self, request_id: str, messages: list[dict[str, str]] | None = None,
                       prefix_token_ids: list[int] | None = None, params: dict[str, Any] | None = None,
                       prompt_token_ids: list[int] | None = None, cache_salt: str | None = None,
                       clamp_max_tokens: bool = False) -> EngineRequest:
        """Start a generation; read its items from the returned handle. With
        ``clamp_max_tokens`` the engine lowers ``max_tokens`` to the context room left
        (docs/protocol.md section 1) instead of refusing the request.

        Raises:
            GatewayError: ``engine_unavailable`` when not connected.
        """
        if not self.healthy:
            raise engine_unavailable("not connected")
        frame = GenerateFrame(request_id, messages, prompt_token_ids, prefix_token_ids or None, params or None,
                              cache_salt or "", clamp_max_tokens)
        size = sum(len(m.get("content", "")) for m in messages or []) + 8 * len(prefix_token_ids or [])
        req = EngineRequest(self, request_id)
        self._requests[request_id] = req
        try:
            text = await asyncio.to_thread(encode, frame) if size > BIG_FRAME_CHARS else encode(frame)
            await self._send_text(text)
        except BaseException:
            req.ended = True  # never reached the engine (or the link is gone): nothing to abort
            req.close()
            raise
        return req

    async def abort(self, request_id: str) -> None:
        """Abort a request (a no-op when disconnected: the engine already aborted it)."""
        try:
            await self._send_text(encode(AbortFrame(request_id)))
        except GatewayError:
            pass

    def abort_soon(self, request_id: str) -> None:
        """``abort`` in the background (from synchronous code)."""
        if self._ws is None:
            return
        task = asyncio.get_running_loop().create_task(self.abort(request_id))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def stats(self, timeout: float = 5.0) -> dict[str, Any]:
        """The engine's counters (KV blocks free/used/cached, running, ...), from the
        snapshot it took at the end of its last step. Concurrent callers share one
        ``stats`` round trip.

        Raises:
            GatewayError: ``engine_unavailable`` when not connected or no answer in time.
        """
        fut = self._stats_waiter
        if fut is None or fut.done():
            fut = self._stats_waiter = asyncio.get_running_loop().create_future()
            try:
                await self._send_text(encode(StatsRequest()))
            except GatewayError:
                self._stats_waiter = None
                raise
        try:
            frame = await asyncio.wait_for(asyncio.shield(fut), timeout)
        except asyncio.TimeoutError:
            raise engine_unavailable("no stats answer") from None
        return dict(frame.stats)


class EngineRouter:
    """Picks an engine per request: the chat's cache home unless it is overloaded
    (the rule, its source and its thresholds: ``gateway/routing.py`` and docs/scaling.md).

    With more than one engine it asks each healthy one for its stats every
    ``policy.stats_interval_s`` seconds (the engine answers from its end-of-step
    snapshot without waiting for a step), so the loads it compares are at most that old.

    Args:
        clients: the engines.
        policy: the shedding thresholds.
        placements: where shed chats were moved (shared by gateways through Redis);
            None keeps no placements (a shed request's chat goes home next time).
    """

    def __init__(self, clients: Iterable[EngineClient], policy: RoutingPolicy | None = None,
                 placements: Placements | None = None) -> None:
        self.clients = list(clients)
        self.policy = policy or RoutingPolicy()
        self.placements = placements
        self._refresh: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Start every client's connection loop (and the stats refresh, with several)."""
        for c in self.clients:
            await c.start()
        if len(self.clients) > 1 and self.policy.stats_interval_s > 0 and self._refresh is None:
            self._refresh = asyncio.create_task(self._refresh_stats(), name="engine-stats-refresh")

    async def close(self) -> None:
        """Stop the stats refresh and close every client."""
        if self._refresh is not None:
            self._refresh.cancel()
            try:
                await self._refresh
            except (asyncio.CancelledError, Exception):
                pass
            self._refresh = None
        for c in self.clients:
            await c.close()

    async def _refresh_stats(self) -> None:
        interval = self.policy.stats_interval_s

        async def one(c: EngineClient) -> None:
            try:
                await c.stats(timeout=max(interval, 1.0))
            except GatewayError:
                pass  # a late or lost answer leaves the old snapshot, whose age is known

        while True:
            await asyncio.gather(*(one(c) for c in self.healthy))
            await asyncio.sleep(interval)

    @property
    def healthy(self) -> list[EngineClient]:
        """The engines that are connected now."""
        return [c for c in self.clients if c.healthy]

    def info(self) -> EngineInfo | None:
        """The ``hello`` of a healthy engine (else of any that ever answered), or None."""
        for c in self.healthy + self.clients:
            if c.info is not None:
                return c.info
        return None

    def _live(self, exclude: Iterable[EngineClient]) -> list[EngineClient]:
        skip = set(map(id, exclude))
        live = [c for c in self.clients if c.healthy and id(c) not in skip]
        if not live:
            raise engine_unavailable("no engine is connected")
        return live

    def pick(self, key: str, exclude: Iterable[EngineClient] = ()) -> EngineClient:
        """The healthy engine that ranks highest for ``key`` (rendezvous hashing alone).

        Raises:
            GatewayError: ``engine_unavailable`` when no engine (outside ``exclude``) is up.
        """
        return max(self._live(exclude), key=lambda c: rendezvous_rank(key, c.url))

    def loads(self, engines: Iterable[EngineClient]) -> list[EngineLoad]:
        """The load of each engine now (``routing.snapshot_load``: its stats snapshot's
        running + waiting, or this gateway's requests in flight on it if more)."""
        now = time.monotonic()
        return [EngineLoad(c.url, snapshot_load(c.last_stats, None if c.stats_taken_at is None
                                                else now - c.stats_taken_at,
                                                len(c._requests), self.policy.max_stats_age_s))
                for c in engines]

    async def choose(self, key: str, exclude: Iterable[EngineClient] = ()) -> EngineClient:
        """The engine for the next request of chat ``key``: its home (placement or
        rendezvous choice) unless the load rule sheds it to the least-loaded engine,
        whose url then becomes the chat's placement.

        Raises:
            GatewayError: ``engine_unavailable`` when no engine (outside ``exclude``) is up.
        """
        live = self._live(exclude)
        if len(live) == 1:
            return live[0]
        placement = await self.placements.get(key) if self.placements is not None else None
        url = choose(key, self.loads(live), self.policy, placement)
        if self.placements is not None:
            ranked = max(live, key=lambda c: rendezvous_rank(key, c.url)).url
            wanted = None if url == ranked else url
            if wanted != placement and not (wanted is None and placement not in {c.url for c in live}):
                await self.placements.set(key, wanted)
        return next(c for c in live if c.url == url)
