"""Client side of the internal engine protocol (docs/protocol.md section 1).

``EngineClient`` keeps one WebSocket to one engine and multiplexes many requests on
it by request id, each with its own queue of frames; it reconnects with exponential
backoff. When the connection drops, the engine aborts that connection's requests, so
every open request gets a synthetic ``error`` frame with code ``engine_unavailable``.

``EngineRouter`` spreads requests over several engines: each engine reports the KV
pages it caches (``kv_events``), the router indexes them (``gateway/engines/prefix_index.py``)
and sends a request where most of its prompt is cached, weighed against load; a chat
with nothing known goes to its home (rendezvous hashing of the chat id, Thaler &
Ravishankar 1996) unless that is overloaded (``gateway/engines/routing.py``, docs/scaling.md).
When an engine is down only its chats move, and its pages leave the index.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import websockets
from websockets.asyncio.client import ClientConnection, connect

from engine.block_hash import namespace_of, prompt_block_hashes
from engine.protocol import (
    SECRET_HEADER,
    AbortFrame,
    DeltaFrame,
    DoneFrame,
    EngineFrame,
    EngineInfo,
    ErrorFrame,
    FrameError,
    GenerateFrame,
    HelloFrame,
    KvEventsFrame,
    KvSubscribeFrame,
    ReplyItem,
    StatsFrame,
    StatsRequest,
    StepFrame,
    decode_engine_frame,
    encode,
)
from gateway.config import BIG_FRAME_CHARS
from gateway.engines.disagg import PrefillPlan, PrefillThenDecode
from gateway.engines.prefix_index import PrefixIndex
from gateway.engines.prompt_ids import RoutingTokenizer
from gateway.engines.routing import (
    EngineLoad,
    Placements,
    RoutingPolicy,
    choose,
    choose_cache_aware,
    rendezvous_rank,
    snapshot_load,
)
from gateway.errors import GatewayError
from gateway.retry import Backoff, Outage, keep_connected

log = logging.getLogger("gateway.engines.client")

__all__ = ["EngineClient", "EngineInfo", "EngineRequest", "EngineRouter", "RoutePrompt", "engine_unavailable"]

KvListener = Callable[[str, KvEventsFrame | None], None]  # (engine url, frame, or None: its link was lost)

UNREACHABLE_WARN_S = 5.0  # an engine down this long (seconds) is logged as a warning


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
        # a disaggregated turn's prefill phase, before the decode engine has it (gateway/engines/disagg.py)
        self.phases: PrefillThenDecode | None = None
        # takes an item the moment it arrives, in the connection's dispatch (no task step
        # per item); returns False to leave it in the queue for ``next`` (gateway/engines/run.py)
        self.sink: Callable[[ReplyItem], bool] | None = None

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
        if self.phases is not None:
            await self.phases.abort()
            return
        await self.client.abort(self.request_id)

    def close(self) -> None:
        """Stop routing items of this id to this handle; a request that has not ended is
        aborted in the engine (a reply nobody reads must not keep generating)."""
        if self.phases is not None:
            self.phases.cancel()
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
    # read and sampled; an OpenAI-compatible upstream (gateway/engines/upstream.py) does neither
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
        # set by a router that indexes prefixes: the engine's KV events go there
        self.kv_listener: KvListener | None = None

    @property
    def in_flight(self) -> int:
        """This gateway's requests the engine is serving now (sent, final item not yet read)."""
        return len(self._requests)

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
        outage = Outage(f"engine {self.url}", log, warn_after_s=UNREACHABLE_WARN_S, log_every_s=UNREACHABLE_WARN_S,
                        since=time.monotonic())
        await keep_connected(self._session, outage=outage, backoff=Backoff(0.1, self.max_backoff_s, jitter=0.5))

    async def _session(self, connected: Callable[[], None]) -> None:
        """One connection to the engine: hello, then its frames until it closes."""
        try:
            async with connect(self.url, max_size=None, compression=None, open_timeout=self.open_timeout_s,
                               ping_interval=20, ping_timeout=60, close_timeout=2,
                               additional_headers=self._headers) as ws:
                hello = decode_engine_frame(await asyncio.wait_for(ws.recv(), self.open_timeout_s))
                if not isinstance(hello, HelloFrame):
                    raise ConnectionError(f"engine sent {type(hello).__name__} instead of hello")
                self.info, self.protocol_version = hello.info, hello.protocol_version
                self._ws = ws
                if self.kv_listener is not None and self.protocol_version >= 4:
                    await ws.send(encode(KvSubscribeFrame()))
                self._ready.set()
                connected()
                log.info("connected to engine %s (%s)", self.url, self.info.model)
                async for raw in ws:
                    try:
                        self._dispatch(decode_engine_frame(raw))
                    except FrameError as e:
                        log.warning("engine %s sent a malformed frame (%s); ignored", self.url, e)
        except asyncio.CancelledError:
            raise  # close() says why
        except Exception:
            self._lost("connection to the engine was lost")
            raise
        self._lost("connection to the engine was lost")

    def _route(self, item: ReplyItem) -> None:
        req = self._requests.get(item.request_id) if item.request_id is not None else None
        if req is not None:
            # the sink only while nothing waits in the queue, so items stay in order
            if req.sink is None or not req.queue.empty() or not req.sink(item):
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
        elif isinstance(frame, KvEventsFrame):
            if self.kv_listener is not None:
                self.kv_listener(self.url, frame)
        elif isinstance(frame, (DeltaFrame, DoneFrame, ErrorFrame)):
            self._route(frame)  # an item sent on its own (a refused generate)

    def _lost(self, why: str) -> None:
        self._ready.clear()
        self._ws = None
        if self.kv_listener is not None:
            self.kv_listener(self.url, None)  # its cache is unknown until it reconnects
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
                       clamp_max_tokens: bool = False, continued_tokens: int = 0,
                       shared_messages: list[dict[str, str]] | None = None,
                       extra: dict[str, Any] | None = None,
                       prefill: PrefillPlan | None = None) -> EngineRequest:
        """Start a generation; read its items from the returned handle. With
        ``clamp_max_tokens`` the engine lowers ``max_tokens`` to the context room left
        (docs/protocol.md section 1) instead of refusing the request; ``continued_tokens``:
        the last that many ``prompt_token_ids`` are a cut reply to continue (sent to
        engines of protocol 5 and later; an older one continues without the seam's text);
        ``cache_salt`` and ``shared_messages`` place its KV pages (``gateway/engines/cache_scope.py``;
        the shared messages go to engines of protocol 6 and later). ``extra``: protocol 7's
        ``GenerateFrame`` fields (``prompt``, ``tools``, ``tool_choice``,
        ``parallel_tool_calls``, ``continue_final_message``), for the APIs that use them.
        With ``prefill`` (a prefill engine's plan, for a decode engine: ``gateway/engines/disagg.py``)
        the prompt is prefilled there first and this engine pulls its KV; the handle reads
        the same.

        Raises:
            GatewayError: ``engine_unavailable`` when not connected.
        """
        if not self.healthy:
            raise engine_unavailable("not connected")
        continued = continued_tokens if self.protocol_version >= 5 else 0
        frame = GenerateFrame(request_id, messages, prompt_token_ids, prefix_token_ids or None, params or None,
                              cache_salt or "", clamp_max_tokens, continued,
                              shared_messages if cache_salt and self.protocol_version >= 6 else None,
                              **(extra or {}))
        size = sum(len(m.get("content") or "") for m in messages or []) + 8 * len(prefix_token_ids or [])
        req = EngineRequest(self, request_id)
        self._requests[request_id] = req
        if prefill is not None:
            req.phases = PrefillThenDecode(req, prefill, replace(frame, kv_source=prefill.engine.url))
            return req
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


@dataclass(frozen=True)
class RoutePrompt:
    """What the router knows of a request's prompt.

    Attributes:
        token_ids: its leading token ids known exactly (the whole prompt, or the chat so
            far before the new message); empty when none are known (a new chat).
        num_tokens: the prompt's length, or an estimate of it (tokens, >= len(token_ids)).
        cache_salt: the request's prefix-cache salt (``gateway/engines/cache_scope.py``).
        shared_tokens: with a salt, the leading tokens declared shared (unsalted); the
            engine rounds them down to whole pages, and so does the hashing here.
    """

    token_ids: Sequence[int]
    num_tokens: int
    cache_salt: str = ""
    shared_tokens: int = 0


class EngineRouter:
    """Picks an engine per request: where most of its prompt is cached, weighed against
    load, else the chat's home unless it is overloaded (the rules, their sources and
    their weights: ``gateway/engines/routing.py`` and docs/scaling.md).

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
        self.index = PrefixIndex(self.policy.max_index_pages)
        self._turn = 0  # round_robin's counter
        self._rng = random.Random()
        self.prefix_routing = len(self.clients) > 1 and self.policy.policy == "cache_aware"
        if self.prefix_routing:
            for c in self.clients:
                c.kv_listener = self._on_kv_events
        # the engines' tokenizer, read here to hash new prompts (loaded once, in the background)
        self.tokenizer: RoutingTokenizer | None = None
        self._tokenizer_task: asyncio.Task[None] | None = None

    def prompt_tokenizer(self) -> RoutingTokenizer | None:
        """The tokenizer for prefix routing, or None (not wanted, not found, or still
        loading: the first call that finds an engine's folder starts the load)."""
        if self.tokenizer is not None or not self.prefix_routing:
            return self.tokenizer
        if self._tokenizer_task is None:
            folder = self.policy.tokenizer or next(
                (c.info.tokenizer_dir for c in self.clients if c.info is not None and c.info.tokenizer_dir), "")
            if folder and Path(folder).is_dir():
                self._tokenizer_task = asyncio.get_running_loop().create_task(self._load_tokenizer(folder))
        return None

    async def _load_tokenizer(self, folder: str) -> None:
        self.tokenizer = await RoutingTokenizer.load(folder)

    def _on_kv_events(self, url: str, frame: KvEventsFrame | None) -> None:
        if frame is None:
            self.index.forget(url)
            return
        self.index.apply(url, frame.stored, frame.removed, frame.reset)
        if frame.reset:  # an engine just said hello: read its tokenizer now, not at the first request
            self.prompt_tokenizer()

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
        if self._tokenizer_task is not None:
            self._tokenizer_task.cancel()
            await asyncio.gather(self._tokenizer_task, return_exceptions=True)

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
        # a prefill engine stops every request at its first token: it serves no replies
        live = [c for c in self.clients if c.healthy and id(c) not in skip
                and (c.info is None or c.info.role != "prefill")]
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

    def matched_tokens(self, prompt: RoutePrompt, engines: Sequence[EngineClient]
                       ) -> tuple[dict[str, int], dict[str, list[int]]]:
        """Leading tokens of ``prompt`` whose KV each engine holds (or was just sent), by
        the prefix index (tokens; 0 for an engine that has not said hello), and the
        prompt's page hashes as each engine names them."""
        out = dict.fromkeys((c.url for c in engines), 0)
        names: dict[str, list[int]] = {}
        groups: dict[tuple[str, int], list[str]] = {}
        for c in engines:
            if c.info is not None and c.info.block_size > 0:  # an upstream names no pages
                groups.setdefault((c.info.weights_id, c.info.block_size), []).append(c.url)
        for (weights_id, block_size), urls in groups.items():
            hashes = prompt_block_hashes(prompt.token_ids, block_size, namespace_of(weights_id), prompt.cache_salt,
                                         prompt.shared_tokens)
            for url, pages in self.index.match(hashes, urls).items():
                out[url] = pages * block_size
                names[url] = hashes
        return out, names

    async def choose(self, key: str, exclude: Iterable[EngineClient] = (),
                     prompt: RoutePrompt | None = None) -> EngineClient:
        """The engine for a request of chat ``key`` by ``policy.policy``: by default
        (``cache_aware``) where most of ``prompt`` is cached weighed against load; with
        no ``prompt`` (nothing known of it) the chat's home (placement or rendezvous
        choice) unless the load rule sheds it to the least-loaded engine. An engine
        chosen other than the rendezvous choice becomes the chat's placement.

        Raises:
            GatewayError: ``engine_unavailable`` when no engine (outside ``exclude``) is up.
        """
        live = self._live(exclude)
        if len(live) == 1:
            return live[0]
        name = self.policy.policy
        if name == "hash":
            return self.pick(key, exclude)
        if name == "round_robin":
            self._turn += 1
            return live[self._turn % len(live)]
        if name == "random":
            return self._rng.choice(live)
        placement = await self.placements.get(key) if self.placements is not None else None
        loads = self.loads(live)
        if name == "cache_aware" and prompt is not None:
            matched, names = self.matched_tokens(prompt, live) if prompt.token_ids else ({}, {})
            loads = [replace(e, matched_tokens=matched.get(e.url, 0)) for e in loads]
            url = choose_cache_aware(key, loads, max(1, prompt.num_tokens), self.policy, placement)
            self.index.note_routed(url, names.get(url, []))
        else:
            url = choose(key, loads, self.policy, placement)
        if self.placements is not None:
            ranked = max(live, key=lambda c: rendezvous_rank(key, c.url)).url
            wanted = None if url == ranked else url
            if wanted != placement and not (wanted is None and placement not in {c.url for c in live}):
                await self.placements.set(key, wanted)
        return next(c for c in live if c.url == url)
