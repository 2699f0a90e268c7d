"""Replies as tasks that outlive sockets (DESIGN.md, generation flow).

``GenerationManager.chat``/``regenerate`` reserve the turn in the store (chat lock,
user message), write the reply stream's start entry and spawn one task per reply.
The task sends ``generate`` to the engine, appends each engine frame's text (frames
already waiting are coalesced into one entry) to the reply's Redis Stream, stores the
finished message with its token segments, and only then writes ``done``. Sockets
only tail the stream, so a dropped socket does not stop a reply; ``cancel`` aborts the
engine request at once and the partial reply is stored with status "partial".

Failure policy (documented in docs/protocol.md): a turn the engine refuses before
producing anything (``context_length_exceeded``, ``invalid_request``, no engine) is
undone: its user message is removed (a regenerate puts the old reply back), the
stream ends with an ``error``. A reply that breaks after some text is stored as
"partial" with ``finish_reason`` "error" and ends with a ``done`` carrying ``error``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from gateway.config import GatewayConfig
from gateway.engines import EngineClient, EngineRequest, EngineRouter
from gateway.errors import GatewayError, not_found
from gateway.events import EventFanout, GenerationEvents
from gateway.sessions import History, SessionStore, TurnBegun
from gateway.streams import ReplyStreams

log = logging.getLogger("gateway.generation")

# engine error codes shown to the user as they are; any other becomes internal_error
PASSTHROUGH_CODES = {"context_length_exceeded", "invalid_request", "engine_unavailable"}
ABORT_RESEND_S = 0.2  # seconds between repeated aborts until the engine confirms one


@dataclass
class StartedTurn:
    """A reply that began (or, with ``duplicate``, was begun earlier by the same
    ``client_msg_id``): subscribe to ``request_id`` from seq 0."""

    request_id: str
    session_id: str
    message_id: str
    user_message_id: str
    duplicate: bool = False


@dataclass
class _Turn:
    owner: str
    session_id: str
    begun: TurnBegun
    params: dict[str, Any]
    system_prompt: str
    client_msg_id: str | None
    task: asyncio.Task[None] | None = None
    request: EngineRequest | None = None
    cancel_requested: bool = False
    cancel_deadline: float | None = None
    seq: int = 0
    parts: list[str] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)


def merge_params(*layers: dict[str, Any] | None) -> dict[str, Any]:
    """Later layers win; the result is validated as engine ``SamplingParams``.

    Raises:
        GatewayError: ``invalid_request`` naming the bad parameter.
    """
    merged: dict[str, Any] = {}
    for layer in layers:
        merged.update(layer or {})
    try:
        SamplingParams.from_dict(merged)
    except InvalidRequestError as e:
        raise GatewayError("invalid_request", e.message) from None
    return merged


class GenerationManager:
    """Starts, runs, cancels and tracks this gateway's replies."""

    def __init__(self, config: GatewayConfig, store: SessionStore, streams: ReplyStreams, router: EngineRouter,
                 redis: aioredis.Redis, events: list[GenerationEvents] | None = None) -> None:
        self.config = config
        self.store = store
        self.streams = streams
        self.router = router
        self.redis = redis
        self.events = EventFanout(events or [])
        self.running: dict[str, _Turn] = {}
        self._listener: asyncio.Task[None] | None = None

    # ---- lifecycle -----------------------------------------------------------------

    async def start(self) -> None:
        """Listen for cancels published by other gateway replicas."""
        self._listener = asyncio.create_task(self._listen_cancels(), name="cancel-listener")

    async def close(self, timeout: float = 10.0) -> None:
        """Stop every reply (stored as partial) and the listener."""
        for turn in list(self.running.values()):
            await self._cancel_local(turn)
        tasks = [t.task for t in self.running.values() if t.task]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)
        if self._listener:
            self._listener.cancel()

    async def _listen_cancels(self) -> None:
        channel = self.store.keys.cancel_channel()
        while True:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(channel)
                async for msg in pubsub.listen():
                    turn = self.running.get(str(msg.get("data")))
                    if turn is not None:
                        await self._cancel_local(turn)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("cancel listener: %s; retrying", e)
                await asyncio.sleep(1.0)
            finally:
                try:
                    await pubsub.aclose()
                except Exception:
                    pass  # the connection is already gone

    # ---- starting a reply ------------------------------------------------------------

    async def chat(self, owner: str, session_id: str | None, content: str, params: dict[str, Any],
                   client_msg_id: str | None) -> StartedTurn:
        """Append a user message (creating the chat when ``session_id`` is None) and
        start its reply.

        Raises:
            GatewayError: ``not_found``, ``busy``, ``rate_limited``, ``too_many_*``,
                ``invalid_request``, ``engine_unavailable``, ``store_unavailable``.
        """
        await self.store.count_message(owner, self.config.limits.max_messages_per_minute)
        if session_id is None:
            merged = merge_params(self.config.defaults.sampling(), params)
            self._require_engine()
            info = await self.store.create_session(owner, system_prompt=self.config.defaults.system_prompt)
        else:
            info = await self.store.get_session(owner, session_id)
            merged = merge_params(self.config.defaults.sampling(), info.params, params)
            self._require_engine()
        try:
            begun = await self.store.begin_turn(owner, info.id, mode="chat", content=content,
                                                client_msg_id=client_msg_id)
            return await self._launch(owner, info.id, begun, merged, info.system_prompt, client_msg_id)
        except GatewayError:
            if session_id is None:  # refused before it began: leave no empty chat behind
                try:
                    await self.store.delete_session(owner, info.id)
                except GatewayError:
                    pass
            raise

    async def regenerate(self, owner: str, session_id: str, params: dict[str, Any]) -> StartedTurn:
        """Drop the chat's last reply and generate a new one (same errors as ``chat``)."""
        await self.store.count_message(owner, self.config.limits.max_messages_per_minute)
        info = await self.store.get_session(owner, session_id)
        merged = merge_params(self.config.defaults.sampling(), info.params, params)
        self._require_engine()
        begun = await self.store.begin_turn(owner, info.id, mode="regenerate")
        return await self._launch(owner, info.id, begun, merged, info.system_prompt, None)

    def _require_engine(self) -> None:
        if not self.router.healthy:
            self.router.pick("")  # raises engine_unavailable

    async def _launch(self, owner: str, sid: str, begun: TurnBegun, params: dict[str, Any],
                      system_prompt: str, client_msg_id: str | None) -> StartedTurn:
        started = StartedTurn(begun.request_id, sid, begun.message_id, begun.user_message_id, begun.duplicate)
        if begun.duplicate:
            return started
        turn = _Turn(owner, sid, begun, params, system_prompt, client_msg_id)
        try:
            await self.streams.open(begun.request_id, owner, sid, begun.message_id, begun.user_message_id)
        except GatewayError:
            try:
                await self.store.fail_turn(owner, sid, begun, client_msg_id)
            except GatewayError:
                pass  # Redis is down: the lock's lease runs out on its own
            raise
        self.running[begun.request_id] = turn
        turn.task = asyncio.create_task(self._run(turn), name=f"reply {begun.request_id}")
        return started

    # ---- cancelling ------------------------------------------------------------------

    async def cancel(self, owner: str, request_id: str) -> None:
        """Stop a reply of ``owner`` now, wherever it runs.

        Raises:
            GatewayError: ``not_found`` for an unknown, finished or foreign reply.
        """
        turn = self.running.get(request_id)
        if turn is not None:
            if turn.owner != owner:
                raise not_found("reply")
            await self._cancel_local(turn)
            return
        head = await self.streams.head(request_id)
        last = await self.streams.last(request_id)
        if head is None or head.fields.get("owner") != owner or last is None or last.terminal:
            raise not_found("reply")
        await self.redis.publish(self.store.keys.cancel_channel(), request_id)

    async def _cancel_local(self, turn: _Turn) -> None:
        if turn.cancel_requested:
            return
        turn.cancel_requested = True
        turn.cancel_deadline = time.monotonic() + self.config.cancel_grace_s
        if turn.request is not None:
            await turn.request.abort()
            turn.request.queue.put_nowait({"type": "_wake"})  # re-evaluate the deadline

    # ---- the reply task ----------------------------------------------------------------

    async def _run(self, turn: _Turn) -> None:
        rid = turn.begun.request_id
        self.events.on_start(rid, turn.session_id, time.perf_counter())
        lease = asyncio.create_task(self._keep_lease(turn))
        try:
            history = await self.store.history(turn.owner, turn.session_id, turn.system_prompt)
            end = await self._generate(turn, history)
            await self._finish(turn, history, end)
        except asyncio.CancelledError:
            raise
        except GatewayError as e:
            await self._end_with_error(turn, e.code, e.message)
        except Exception:
            log.exception("reply %s failed", rid)
            await self._end_with_error(turn, "internal_error", "the reply failed unexpectedly")
        finally:
            lease.cancel()
            if turn.request is not None:
                turn.request.close()
            self.running.pop(rid, None)

    async def _keep_lease(self, turn: _Turn) -> None:
        period = self.config.lock_lease_ms / 3000
        while True:
            await asyncio.sleep(period)
            try:
                if not await self.store.renew_lease(turn.owner, turn.session_id, turn.begun.request_id):
                    log.warning("reply %s lost its chat lock", turn.begun.request_id)
            except GatewayError:
                pass  # Redis is down; the reply task itself reports it

    async def _generate(self, turn: _Turn, history: History) -> dict[str, Any]:
        """Run the reply on an engine (failing over while nothing was produced); returns
        the terminal engine frame (``done`` or ``error``)."""
        tried: list[EngineClient] = []
        while True:
            engine = self.router.pick(turn.session_id, exclude=tried)  # raises when none is left
            tried.append(engine)
            try:
                turn.request = await engine.generate(turn.begun.request_id, history.messages,
                                                     history.prefix_token_ids, turn.params)
            except GatewayError as e:
                if e.code == "engine_unavailable" and not turn.cancel_requested:
                    continue  # it dropped between pick and send: try the next one
                raise
            if turn.cancel_requested:
                await turn.request.abort()
            end = await self._pump(turn)
            if end.get("type") == "error" and end.get("code") == "engine_unavailable" and turn.seq == 0 \
                    and not turn.output_ids and not turn.cancel_requested:
                turn.request.close()
                if any(c.healthy and c not in tried for c in self.router.clients):
                    continue  # fail over: nothing was shown yet
            return end

    async def _pump(self, turn: _Turn) -> dict[str, Any]:
        """Copy engine frames to the reply stream until the terminal frame.

        After a cancel the abort is re-sent every ``ABORT_RESEND_S`` until the engine
        confirms it: an abort that reaches the engine while it is still preparing the
        request (tokenizing) finds no request to stop. After ``cancel_grace_s`` without
        a confirmation the reply ends here anyway (a synthetic "abort").
        """
        req = turn.request
        assert req is not None
        last_abort = time.monotonic()
        while True:
            timeout = None
            if turn.cancel_deadline is not None:
                now = time.monotonic()
                if now >= turn.cancel_deadline:
                    return {"type": "done", "finish_reason": "abort", "synthetic": True}
                if now - last_abort >= ABORT_RESEND_S:
                    await req.abort()
                    last_abort = now
                timeout = min(turn.cancel_deadline - now, ABORT_RESEND_S)
            try:
                frames = [await req.next(timeout)] + req.ready()
            except asyncio.TimeoutError:
                continue  # re-check the deadline, re-send the abort
            text, n_tokens, end = [], 0, None
            for f in frames:
                kind = f.get("type")
                if kind in ("delta", "done"):
                    text.append(f.get("text") or "")
                    ids = f.get("token_ids") or []
                    turn.output_ids.extend(ids)
                    n_tokens += len(ids)
                if kind in ("done", "error"):
                    end = f
                    break
            chunk = "".join(text)
            if chunk:
                turn.seq += 1
                turn.parts.append(chunk)
                await self.streams.delta(turn.begun.request_id, turn.seq, chunk)
                self.events.on_delta(turn.begun.request_id, n_tokens, len(chunk), time.perf_counter())
            if end is not None:
                return end

    async def _finish(self, turn: _Turn, history: History, end: dict[str, Any]) -> None:
        rid, begun = turn.begun.request_id, turn.begun
        if end.get("type") == "error":
            code = end.get("code", "engine_error")
            code = code if code in PASSTHROUGH_CODES else "internal_error"
            await self._end_with_error(turn, code, str(end.get("message") or "the engine refused the request"))
            return
        reason = end.get("finish_reason", "stop")
        usage = {k: int((end.get("usage") or {}).get(k, 0)) for k in ("prompt_tokens", "cached_tokens",
                                                                        "completion_tokens")}
        timings = {k: float((end.get("timings") or {}).get(k, 0.0)) for k in ("ttft_ms", "tpot_ms", "e2e_ms")}
        if end.get("synthetic"):
            usage["completion_tokens"] = len(turn.output_ids)
        assistant = {"content": "".join(turn.parts), "status": "partial" if reason == "abort" else "complete",
                     "finish_reason": reason, "usage": usage, "timings": timings, "created_at": time.time(),
                     "request_id": rid}
        user_seg = a_seg = None
        if "prompt_token_ids" in end:
            user_seg = history.user_segment(list(end["prompt_token_ids"]), bool(end.get("prefix_reused")))
            a_seg = {"ids": list(end.get("output_token_ids", turn.output_ids)), "base": False}
        stored = await self.store.finish_turn(turn.owner, turn.session_id, begun, assistant, user_seg, a_seg)
        if stored != "ok":
            log.warning("reply %s not stored: %s", rid, stored)
        done = {"request_id": rid, "session_id": turn.session_id, "message_id": begun.message_id,
                "finish_reason": reason, "usage": usage, "timings": timings}
        if begun.title:
            done["title"] = begun.title
        await self.streams.done(rid, turn.seq, done)
        self.events.on_finish(rid, reason, usage, timings, time.perf_counter())

    async def _end_with_error(self, turn: _Turn, code: str, message: str) -> None:
        """End a reply that failed: undo it when nothing was shown, else store what was
        shown as partial. Best effort when Redis itself is the failure."""
        rid, begun = turn.begun.request_id, turn.begun
        self.events.on_error(rid, code, time.perf_counter())
        try:
            if turn.seq == 0:
                await self.store.fail_turn(turn.owner, turn.session_id, begun, turn.client_msg_id)
                await self.streams.error(rid, 0, code, message)
                return
            assistant = {"content": "".join(turn.parts), "status": "partial", "finish_reason": "error",
                         "usage": {"prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": len(turn.output_ids)},
                         "timings": {"ttft_ms": 0.0, "tpot_ms": 0.0, "e2e_ms": 0.0}, "created_at": time.time(),
                         "request_id": rid}
            await self.store.finish_turn(turn.owner, turn.session_id, begun, assistant, None, None)
            done = {"request_id": rid, "session_id": turn.session_id, "message_id": begun.message_id,
                    "finish_reason": "error", "usage": assistant["usage"], "timings": assistant["timings"],
                    "error": {"code": code, "message": message}}
            await self.streams.done(rid, turn.seq, done)
        except GatewayError as e:
            log.warning("reply %s could not be closed in the store: %s", rid, e.message)
