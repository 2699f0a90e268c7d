"""Client side of the internal engine protocol (docs/protocol.md section 1).

``EngineClient`` keeps one WebSocket to one engine and multiplexes many requests on
it by request id, each with its own queue of frames; it reconnects with exponential
backoff. When the connection drops, the engine aborts that connection's requests, so
every open request gets a synthetic ``error`` frame with code ``engine_unavailable``.

``EngineRouter`` spreads chats over several engines with rendezvous hashing of the
chat id (Thaler & Ravishankar, "A name-based mapping scheme for rendezvous", 1996):
a chat keeps its engine, and so its prefix cache, while that engine is up; when it is
down only its chats move, each to the healthy engine that ranks next for it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import random
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import websockets
from websockets.asyncio.client import ClientConnection, connect

from gateway.errors import GatewayError

SECRET_HEADER = "X-Engine-Secret"  # the engine link's shared secret (engine/server.py checks it)
log = logging.getLogger("gateway.engines")

BIG_FRAME_CHARS = 256 * 1024  # frames above this are JSON-encoded off the event loop


def engine_unavailable(detail: str = "") -> GatewayError:
    """The error for "no engine can take this now"."""
    msg = "the model engine is unavailable; try again shortly"
    return GatewayError("engine_unavailable", msg + (f" ({detail})" if detail else ""))


@dataclass
class EngineInfo:
    """The engine's ``hello``: model name, context limit (tokens), KV block size and
    count (tokens per block, blocks), and the rest of the frame in ``raw``."""

    model: str
    max_model_len: int
    block_size: int
    num_blocks: int
    raw: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_hello(cls, frame: dict[str, Any]) -> EngineInfo:
        """Read a ``hello`` frame (missing numbers become 0)."""
        return cls(str(frame.get("model", "")), int(frame.get("max_model_len", 0)),
                   int(frame.get("block_size", 0)), int(frame.get("num_blocks", 0)), dict(frame))


class EngineRequest:
    """One generation in flight on an engine. Read its frames (``delta``, then ``done``
    or ``error``) with ``next()``; always ``close()`` it (it unregisters the id)."""

    def __init__(self, client: EngineClient, request_id: str) -> None:
        self.client = client
        self.request_id = request_id
        self.queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def next(self, timeout: float | None = None) -> dict[str, Any]:
        """The next frame of this request.

        Raises:
            asyncio.TimeoutError: nothing arrived within ``timeout`` seconds.
        """
        if timeout is None:
            return await self.queue.get()
        return await asyncio.wait_for(self.queue.get(), timeout)

    def ready(self) -> list[dict[str, Any]]:
        """The frames that have already arrived (possibly none), without waiting."""
        out = []
        while not self.queue.empty():
            out.append(self.queue.get_nowait())
        return out

    async def abort(self) -> None:
        """Ask the engine to stop this request now (it answers with ``done``/"abort")."""
        await self.client.abort(self.request_id)

    def close(self) -> None:
        """Stop routing frames of this id to this handle."""
        self.client._requests.pop(self.request_id, None)


class EngineClient:
    """One multiplexed connection to one engine, reconnecting with backoff.

    Args:
        url: the engine's ``ws://host:port`` address.
        max_backoff_s: the longest wait between reconnect attempts (seconds).
        secret: the engine link's shared secret (``ENGINE_SECRET``), sent on connect.
    """

    def __init__(self, url: str, max_backoff_s: float = 5.0, open_timeout_s: float = 10.0,
                 secret: str | None = None) -> None:
        self.url = url
        self._headers = {SECRET_HEADER: secret} if secret else {}
        self.info: EngineInfo | None = None
        self.max_backoff_s = max_backoff_s
        self.open_timeout_s = open_timeout_s
        self._ws: ClientConnection | None = None
        self._requests: dict[str, EngineRequest] = {}
        self._stats_waiters: deque[asyncio.Future[dict[str, Any]]] = deque()
        self._ready = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.connects_total = 0

    @property
    def healthy(self) -> bool:
        """Connected and greeted by the engine."""
        return self._ready.is_set()

    async def start(self) -> None:
        """Start connecting in the background (returns at once)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"engine-client {self.url}")

    async def wait_ready(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the connection; True when ready."""
        try:
            await asyncio.wait_for(self._ready.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def close(self) -> None:
        """Close the connection and stop reconnecting."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None
        self._lost("gateway shutting down")

    async def _run(self) -> None:
        backoff = 0.1
        while True:
            try:
                async with connect(self.url, max_size=None, compression=None, open_timeout=self.open_timeout_s,
                                   ping_interval=20, ping_timeout=60, close_timeout=2,
                                   additional_headers=self._headers) as ws:
                    hello = json.loads(await asyncio.wait_for(ws.recv(), self.open_timeout_s))
                    if hello.get("type") != "hello":
                        raise ConnectionError(f"engine sent {hello.get('type')!r} instead of hello")
                    self.info = EngineInfo.from_hello(hello)
                    self._ws = ws
                    self.connects_total += 1
                    self._ready.set()
                    backoff = 0.1
                    log.info("connected to engine %s (%s)", self.url, self.info.model)
                    async for raw in ws:
                        try:
                            frame = json.loads(raw)
                        except ValueError:
                            log.warning("engine %s sent a frame that is not JSON; ignored", self.url)
                            continue
                        self._dispatch(frame)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # any failure means "reconnect"; log without a traceback
                log.warning("engine %s unreachable: %s", self.url, e)
            self._lost("connection to the engine was lost")
            await asyncio.sleep(backoff * (0.5 + random.random()))
            backoff = min(backoff * 2, self.max_backoff_s)

    def _dispatch(self, frame: dict[str, Any]) -> None:
        kind = frame.get("type")
        if kind == "stats":
            while self._stats_waiters:
                fut = self._stats_waiters.popleft()
                if not fut.done():
                    fut.set_result(frame)
                    break
            return
        rid = frame.get("request_id")
        req = self._requests.get(rid) if rid is not None else None
        if req is not None:
            req.queue.put_nowait(frame)
        elif kind == "error":
            log.warning("engine %s error without a live request: %s", self.url, frame)

    def _lost(self, why: str) -> None:
        self._ready.clear()
        self._ws = None
        for req in list(self._requests.values()):
            req.queue.put_nowait({"type": "error", "request_id": req.request_id,
                                  "code": "engine_unavailable", "message": why})
        self._requests.clear()
        while self._stats_waiters:
            fut = self._stats_waiters.popleft()
            if not fut.done():
                fut.set_exception(engine_unavailable(why))

    async def _send(self, frame: dict[str, Any], big: bool = False) -> None:
        ws = self._ws
        if ws is None:
            raise engine_unavailable("not connected")
        text = await asyncio.to_thread(json.dumps, frame) if big else json.dumps(frame)
        try:
            await ws.send(text)
        except websockets.ConnectionClosed as e:
            raise engine_unavailable("connection closed") from e

    async def generate(self, request_id: str, messages: list[dict[str, str]] | None = None,
                       prefix_token_ids: list[int] | None = None, params: dict[str, Any] | None = None,
                       prompt_token_ids: list[int] | None = None, cache_salt: str | None = None,
                       clamp_max_tokens: bool = False) -> EngineRequest:
        """Start a generation; read its frames from the returned handle. With
        ``clamp_max_tokens`` the engine lowers ``max_tokens`` to the context room left
        (docs/protocol.md section 1) instead of refusing the request.

        Raises:
            GatewayError: ``engine_unavailable`` when not connected.
        """
        if not self.healthy:
            raise engine_unavailable("not connected")
        frame: dict[str, Any] = {"type": "generate", "request_id": request_id}
        size = 0
        if messages is not None:
            frame["messages"] = messages
            size = sum(len(m.get("content", "")) for m in messages)
        if prompt_token_ids is not None:
            frame["prompt_token_ids"] = prompt_token_ids
        if prefix_token_ids:
            frame["prefix_token_ids"] = prefix_token_ids
            size += 8 * len(prefix_token_ids)
        if params:
            frame["params"] = params
        if cache_salt:
            frame["cache_salt"] = cache_salt
        if clamp_max_tokens:
            frame["clamp_max_tokens"] = True
        req = EngineRequest(self, request_id)
        self._requests[request_id] = req
        try:
            await self._send(frame, big=size > BIG_FRAME_CHARS)
        except BaseException:
            req.close()
            raise
        return req

    async def abort(self, request_id: str) -> None:
        """Abort a request (a no-op when disconnected: the engine already aborted it)."""
        try:
            await self._send({"type": "abort", "request_id": request_id})
        except GatewayError:
            pass

    async def stats(self, timeout: float = 5.0) -> dict[str, Any]:
        """The engine's ``stats`` frame (KV blocks free/used/cached, running, ...).

        Raises:
            GatewayError: ``engine_unavailable`` when not connected or no answer in time.
        """
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._stats_waiters.append(fut)
        try:
            await self._send({"type": "stats"})
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise engine_unavailable("no stats answer") from None
        finally:
            if fut in self._stats_waiters:
                self._stats_waiters.remove(fut)


def _rank(key: str, url: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}|{url}".encode(), digest_size=8).digest(), "big")


class EngineRouter:
    """Picks an engine per chat (rendezvous hashing over the healthy ones)."""

    def __init__(self, clients: Iterable[EngineClient]) -> None:
        self.clients = list(clients)

    async def start(self) -> None:
        """Start every client's connection loop."""
        for c in self.clients:
            await c.start()

    async def close(self) -> None:
        """Close every client."""
        for c in self.clients:
            await c.close()

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

    def pick(self, key: str, exclude: Iterable[EngineClient] = ()) -> EngineClient:
        """The healthy engine that ranks highest for ``key`` (a chat id).

        Raises:
            GatewayError: ``engine_unavailable`` when no engine (outside ``exclude``) is up.
        """
        skip = set(map(id, exclude))
        live = [c for c in self.clients if c.healthy and id(c) not in skip]
        if not live:
            raise engine_unavailable("no engine is connected")
        return max(live, key=lambda c: _rank(key, c.url))
