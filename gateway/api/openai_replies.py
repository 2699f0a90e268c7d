"""Where an OpenAI-API reply comes from, and how a dropped HTTP client stops it.

A reply is read as batches of events (``Delta``, then one ``Finished`` or ``Failed``)
from one of two sources:

* ``EngineReply``: a stateless request, sent straight to an engine over the internal
  protocol (no Redis: the HTTP API has no resume) through ``replies.EngineRun``, which
  fails over to another engine while nothing was produced, the same path the browser's
  replies take. It reports to the ``GenerationEvents`` hooks itself (the browser's
  replies report through ``GenerationManager``).
* ``SessionReply``: a request linked to a stored chat. The turn runs through
  ``GenerationManager`` exactly like a browser turn (chat lock, limits, token segments,
  events) and is followed with ``tails.ReplyTail`` (from memory on this gateway), so
  the UI sees it live too.

``DisconnectWatcher`` listens for ``http.disconnect`` while the reply runs; every wait
on the source is raced against it, so a client that leaves during the prefill, the
queue or the decode is noticed at once and its reply aborted (stop frees the engine
(docs/acceptance.md#stop-frees-the-engine)).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from starlette.types import Receive

from engine.protocol import DoneFrame, ErrorFrame
from gateway.engines.client import EngineClient, EngineRouter
from gateway.engines.run import EngineRun, error_status, user_code
from gateway.errors import GatewayError
from gateway.replies.hooks import GenerationEvents
from gateway.replies.manager import GenerationManager, StartedTurn
from gateway.replies.reply_end import ReplyEnd
from gateway.replies.tail import ReplyTail
from gateway.store.reply_streams import ReplyStreams, done_payload

log = logging.getLogger("gateway.openai")

T = TypeVar("T")


@dataclass
class Delta:
    """New reply text; ``n_tokens`` engine tokens (0 when the source does not know).
    From an engine (protocol 7, when asked for): ``logprobs`` (an entry per token),
    ``tool_calls`` (call deltas), ``prompt_logprobs`` (once, an entry per prompt token),
    in the engine's wire shapes (docs/protocol.md section 1); ``prompt_usage`` (the
    reply's first delta, from engines that send it): the prompt's ``prompt_tokens`` and
    ``cached_tokens``."""

    text: str
    n_tokens: int = 0
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    prompt_logprobs: list[dict[str, Any]] | None = None
    prompt_usage: dict[str, int] | None = None


@dataclass
class Finished:
    """The reply ended, as its typed ``end`` (``gateway/replies/reply_end.py``) says; its
    ``finish_reason``, ``usage`` (tokens) and ``timings`` (ms) are read from that end, so
    every OpenAI-style answer derives them from the one type. From an engine: ``tool_calls``
    in the engine's wire shape, every call whole (a request with tools), ``stop_reason``
    (the stop string or token matched, or why the engine could not go on), the prompt's
    and reply's token ids."""

    end: ReplyEnd
    tool_calls: list[dict[str, Any]] | None = None
    stop_reason: str | int | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)

    @property
    def finish_reason(self) -> str:
        """"stop", "length", "abort", "tool_calls" or "error"."""
        return self.end.finish_reason

    @property
    def usage(self) -> dict[str, int]:
        """``prompt_tokens``, ``cached_tokens``, ``completion_tokens`` (and
        ``cached_disk_tokens`` when some); tokens."""
        return self.end.usage()

    @property
    def timings(self) -> dict[str, float]:
        """The reply's latencies (ms) and decode figures, as stored with a message."""
        return self.end.timings_dict()


@dataclass
class Failed:
    """The reply failed with a gateway/engine error ``code`` (``gateway.errors.HTTP_STATUS``),
    or an OpenAI-compatible upstream's own error code with the HTTP ``status`` it asks for
    (0 for our codes)."""

    code: str
    message: str
    status: int = 0


@dataclass
class Progress:
    """How far the engine has read the prompt (its chunked prefill; only for a request that
    asked, ``EngineReply(progress=True)``): ``done`` of ``total`` prompt tokens have their
    KV, ``cached`` of them from the prefix cache (tokens). The engine reports a prompt read
    in one step with none."""

    done: int
    total: int
    cached: int


ReplyEvent = Delta | Finished | Failed | Progress


class ClientGone(Exception):
    """The HTTP client disconnected."""


class Revoked(ClientGone):
    """The request's access token was revoked, or its user's data deleted, while it ran
    (``gateway/api/revocation.py``): end it as if the client had left, telling the client why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class DisconnectWatcher:
    """Waits for the request's ``http.disconnect`` in a task (start it after the body
    was read, so it only ever sees the disconnect); ``race`` waits for something else
    unless the client leaves first, or ``revoke`` is called. ``on_close`` (if set) is
    called once by ``close``."""

    def __init__(self, receive: Receive) -> None:
        # None: the client left; a reason: revoked
        self._gone: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._listen(receive), name="http-disconnect")
        self.on_close: Callable[[], None] | None = None

    async def _listen(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if not self._gone.done():
            self._gone.set_result(None)

    def revoke(self, reason: str) -> None:
        """End the request now: ``race`` raises ``Revoked(reason)``."""
        if not self._gone.done():
            self._gone.set_result(reason)

    @property
    def gone(self) -> bool:
        """True once the client disconnected (or the request was revoked)."""
        return self._gone.done()

    def _why(self) -> ClientGone:
        reason = self._gone.result()
        return Revoked(reason) if reason else ClientGone()

    async def race(self, aw: Awaitable[T]) -> T:
        """The result of ``aw``, unless the client disconnects (or it is revoked) first.

        Raises:
            ClientGone: the client left (``aw`` is cancelled); ``Revoked`` when revoked.
        """
        if self.gone:
            if asyncio.iscoroutine(aw):
                aw.close()
            raise self._why()
        task = asyncio.ensure_future(aw)
        waits: set[asyncio.Future[Any]] = {task, self._gone}
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise self._why()

    def close(self) -> None:
        """Stop listening (and call ``on_close``, once)."""
        self._task.cancel()
        callback, self.on_close = self.on_close, None
        if callback is not None:
            callback()


class EngineReply:
    """A stateless reply straight from an engine (see module doc).

    Args:
        router: the gateway's engines.
        events: hooks to report the reply to (metrics).
        request_id: the engine request id (unique on this gateway).
        messages: the chat for the engine's template.
        params: engine ``SamplingParams`` keys.
        affinity_key: picks the engine (rendezvous hashing), so that the turns of one
            conversation meet their own prefix cache.
        model: only engines serving this model name, or None for any.
        abort_grace_s: how long ``abort`` waits for the engine's final frame.
        cache_salt, shared_messages: its cache scope (``gateway/engines/cache_scope.py``).
        extra: protocol 7's ``generate`` fields (``prompt``, ``tools``, ...).
        prompt_token_ids: a prompt of token ids instead of ``messages``.
        think_open: the opening reasoning marker (``EngineRun``).
        progress: also hand back the engine's prompt-progress items, as ``Progress``
            events (only the writers that show them ask).
    """

    def __init__(self, router: EngineRouter, events: GenerationEvents, request_id: str,
                 messages: list[dict[str, Any]], params: dict[str, Any], affinity_key: str,
                 model: str | None, abort_grace_s: float, cache_salt: str = "",
                 shared_messages: list[dict[str, str]] | None = None, extra: dict[str, Any] | None = None,
                 prompt_token_ids: list[int] | None = None, think_open: str = "<think>",
                 progress: bool = False) -> None:
        self.router = router
        self.progress = progress
        self.events = events
        self.request_id = request_id
        self.model = model
        self.abort_grace_s = abort_grace_s
        self.run = EngineRun(router, request_id, affinity_key, messages, params=params, model=model,
                             cache_salt=cache_salt, shared_messages=shared_messages, extra=extra,
                             prompt_token_ids=prompt_token_ids, think_open=think_open)
        self._ended = False

    @property
    def engine(self) -> EngineClient | None:
        """The engine serving the reply (None before ``start``)."""
        return self.run.engine

    @property
    def model_name(self) -> str:
        """The model of the engine serving the reply."""
        info = self.engine.info if self.engine else self.router.info()
        return info.model if info else (self.model or "")

    async def start(self) -> None:
        """Send ``generate`` to the best healthy engine.

        Raises:
            GatewayError: ``engine_unavailable`` when no engine (serving ``model``) is up.
        """
        self.events.on_start(self.request_id, "", time.perf_counter())
        try:
            await self.run.start()
        except GatewayError as e:
            self._ended = True
            self.events.on_error(self.request_id, e.code, time.perf_counter())
            raise

    async def next(self) -> list[ReplyEvent]:
        """The events that arrived (at least one; waits for it). Never raises."""
        while True:
            batch = await self.run.next()
            if batch is None:
                continue
            events: list[ReplyEvent] = []
            if self.progress and batch.progress is not None and not (batch.text or batch.token_ids):
                p = batch.progress
                events.append(Progress(p.prompt_tokens_done, p.prompt_tokens, p.cached_tokens))
            if batch.text or batch.token_ids or batch.tool_calls:
                events.append(Delta(batch.text, len(batch.token_ids), batch.logprobs, batch.tool_calls,
                                    batch.prompt_logprobs, batch.prompt_usage))
                self.events.on_delta(self.request_id, len(batch.token_ids), len(batch.text), time.perf_counter())
            if batch.end is not None:
                events.append(self._end(batch.end))
            if events:
                return events

    def _end(self, end: DoneFrame | ErrorFrame) -> ReplyEvent:
        self._ended = True
        now = time.perf_counter()
        if isinstance(end, ErrorFrame):
            code = user_code(end)
            self.events.on_error(self.request_id, code, now)
            return Failed(code, end.message or "the engine refused the request", error_status(end))
        reply_end = replace(ReplyEnd.of_done(end, None), finish_reason=end.finish_reason or "stop")
        self.events.on_finish(self.request_id, reply_end, now)
        return Finished(reply_end, end.output_tool_calls, end.stop_reason, list(end.prompt_token_ids),
                        list(end.output_token_ids))

    async def abort(self) -> None:
        """Abort in the engine (the client left) and wait, up to ``abort_grace_s``, for
        its final item, so that the engine has freed the request's KV blocks when
        this returns. A no-op once the reply ended."""
        if self._ended or self.run.request is None:
            return
        await self.run.abort()
        deadline = time.monotonic() + self.abort_grace_s
        while not self._ended:
            left = deadline - time.monotonic()
            batch = await self.run.next(max(0.0, left)) if left > 0 else None
            if batch is None and left <= 0:
                self._ended = True
                self.events.on_error(self.request_id, "engine_unavailable", time.perf_counter())
                log.warning("engine did not confirm the abort of %s", self.request_id)
            elif batch is not None and batch.end is not None:
                self._end(batch.end)

    def close(self) -> None:
        """Unregister the request id from the engine connection."""
        self.run.close()


class SessionReply:
    """A reply to a stored chat, run by ``GenerationManager`` and read from its reply
    stream (see module doc). Create it with ``started`` from ``GenerationManager.chat``;
    ``created_chat`` says that the request created the chat for this turn."""

    def __init__(self, gens: GenerationManager, streams: ReplyStreams, owner: str, started: StartedTurn,
                 model: str, created_chat: bool = False) -> None:
        self.gens = gens
        self.created_chat = created_chat
        self.streams = streams
        self.owner = owner
        self.request_id = started.request_id
        self.session_id = started.session_id
        self.model_name = model
        self._tail = ReplyTail(started.request_id, 0, streams, gens.reply_log, gens.config.store_retry_s,
                               gens.config.lock_lease_ms)
        self._ended = False

    async def next(self) -> list[ReplyEvent]:
        """The entries that arrived, as events (waits for at least one). Never raises:
        a store failure becomes ``Failed("store_unavailable")``."""
        try:
            events: list[ReplyEvent] = []
            for e in await self._tail.next():
                if e.kind == "delta":
                    events.append(Delta(e.fields.get("x", "")))
                elif e.kind == "done":
                    self._ended = True
                    d = done_payload(e)
                    err = d.get("error")
                    if err:  # the reply broke after some text; that text is stored as partial
                        events.append(Failed(err.get("code", "internal_error"), err.get("message", ""),
                                             int(err.get("status") or 0)))
                    else:
                        events.append(Finished(ReplyEnd.of_done_entry(d)))
                elif e.kind == "error":
                    self._ended = True
                    events.append(Failed(e.fields.get("code", "internal_error"), e.fields.get("message", ""),
                                         int(e.fields.get("status") or 0)))
            return events
        except GatewayError as e:
            self._ended = True
            if e.code == "not_found":
                return [Failed("not_found", "this reply is no longer available")]
            return [Failed(e.code, e.message)]

    async def abort(self) -> None:
        """Stop the reply like the UI's Stop button (the partial reply is stored)."""
        if self._ended:
            return
        self._ended = True
        try:
            await self.gens.cancel(self.owner, self.request_id)
        except GatewayError:
            pass  # it ended meanwhile, or Redis is down (the engine still gets nothing more to do)

    def close(self) -> None:
        """Nothing to release (the reply task owns the engine request)."""


ReplySource = EngineReply | SessionReply
