"""Replies as tasks that outlive sockets (docs/architecture.md, a reply's path).

``GenerationManager.chat``/``regenerate`` reserve the turn in the store (chat lock,
user message), write the reply stream's start entry and spawn one task per reply.
The task sends ``generate`` to the engine (``replies.EngineRun``), appends the text of
each batch of engine items (everything that arrived since its last write: one entry per
engine step, or fewer) to the reply's Redis Stream, stores the finished message with its
token segments, and only then writes ``done``. Each entry also goes to the reply's
in-memory ``ReplyLog`` once written, from which sockets and SSE responses on this gateway
take it directly (``tails.py``); other replicas and later readers tail the stream. A
dropped socket does not stop a reply; ``cancel`` aborts the engine request at once and
the partial reply is stored with status "partial".

Failure policy (documented in docs/protocol.md): a turn the engine refuses before
producing anything (``context_length_exceeded``, ``invalid_request``, no engine) is
undone: its user message is removed (a regenerate puts the old reply back), the
stream ends with an ``error``. A reply that breaks after some text is stored as
"partial" with ``finish_reason`` "error" and ends with a ``done`` carrying ``error``.

Redis going away mid-reply loses nothing: the task keeps generating, keeps the text
it could not write to the reply stream in memory (``_Turn.unsent``, written later as
one delta, so seqs stay gapless), and retries every store write with backoff for up to
``store_retry_s`` seconds; the store's FINISH is idempotent by message id, so the reply
is stored exactly once and ``done`` follows it. A turn is answered
``store_unavailable`` only when it was not accepted (its begin is undone, in the
background if Redis is still down).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis.asyncio as aioredis

from engine.errors import InvalidRequestError
from engine.protocol import DoneFrame, ErrorFrame
from engine.sampling_params import SamplingParams
from gateway.config import GatewayConfig
from gateway.engines.cache_scope import CacheIsolation
from gateway.engines.client import EngineRouter
from gateway.engines.run import PASSTHROUGH_CODES, EngineRun, error_status, user_code
from gateway.errors import GatewayError, not_found
from gateway.reasoning import ReasoningSplitter, split_reasoning, without_reasoning
from gateway.replies.hooks import EventFanout, GenerationEvents
from gateway.replies.reply_end import ReplyEnd
from gateway.replies.tail import ReplyLog
from gateway.retry import Backoff, Outage, is_store_unavailable, keep_connected, retry
from gateway.store.connection import close_quietly
from gateway.store.reply_streams import ReplyStreams, StreamEntry
from gateway.store.sessions import History, SessionStore, TurnBegun, dumps

log = logging.getLogger("gateway.replies.manager")
T = TypeVar("T")

__all__ = ["PASSTHROUGH_CODES", "GenerationManager", "StartedTurn", "merge_params"]

ABORT_RESEND_S = 0.2  # seconds between repeated aborts until the engine confirms one
STORE_BACKOFF_S = (0.2, 5.0)  # first and longest wait between store retries (seconds)
# why a reply was cut short, stored with it as ``cut_reason`` (status "partial"): the
# user's Stop (or a delete of the chat), the gateway shutting down, the engine going away
# (or shutting down) mid-reply, an OpenAI-compatible upstream's own error after some text
# (a rate limit: its code and message are the stored ``error``), or another failure after
# some text was shown
CUT_REASONS = ("user_stop", "gateway_shutdown", "engine_lost", "upstream_error", "error")
NO_IDS_TO_CONTINUE = ("this reply cannot be continued: its token ids are not stored (a reply written by an "
                      "OpenAI-compatible upstream engine has none); regenerate it with a higher max tokens instead")
# the finish reasons of a reply Continue extends: cut at its max tokens, or stopped (a
# Stop, a shutdown: the engine's abort flushes the text of every sampled token, so the
# stored ids and text agree and the continuation is exact)
CONTINUABLE = ("length", "abort")


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
    clamp_max_tokens: bool = True
    created_chat: bool = False  # this turn's chat was created for it (undone with it)
    cut_reason: str | None = None  # why the reply was stopped early (see CUT_REASONS)
    task: asyncio.Task[None] | None = None
    run: EngineRun | None = None
    log: ReplyLog = field(default_factory=ReplyLog)
    synthetic_end: bool = False  # ended here after cancel_grace_s without the engine's word
    cancel_requested: bool = False
    cancel_deadline: float | None = None
    seq: int = 0
    parts: list[str] = field(default_factory=list)
    unsent: list[str] = field(default_factory=list)  # produced text not yet in the reply stream
    store_retry_at: float = 0.0  # monotonic time before which stream writes are not tried
    delta_uncertain: bool = False  # a delta write failed: it may or may not have been applied
    store_warned: bool = False
    output_ids: list[int] = field(default_factory=list)
    # a "continue" turn: the reply it extends (stored message) and that reply's token ids
    continued: dict[str, Any] | None = None
    continued_ids: list[int] = field(default_factory=list)
    # its reasoning (gateway/reasoning.py): the split so far, when its first text
    # came (monotonic s) and how long it reasoned (ms, once the reasoning closed)
    think: ReasoningSplitter | None = None
    think_t0: float | None = None
    reasoning_ms: float | None = None
    # the chat's model: only its engines write the reply (None: a chat that names none
    # goes to any engine, as when every engine serves the same model under its own name)
    model: str | None = None

    @property
    def produced(self) -> bool:
        """True once the engine produced any text or token (shown or not); the text a
        continued reply already had does not count."""
        return bool(self.parts[1 if self.continued else 0:] or self.output_ids)


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


def _reasoning_ms(turn: _Turn, now: float) -> float:
    """The reply's reasoning time until ``now`` (monotonic s), in ms, with a continued
    reply's earlier reasoning."""
    before = float((turn.continued or {}).get("reasoning_ms") or 0.0)
    return round(before + (now - (turn.think_t0 or now)) * 1000, 1)


def _context_message(engine_message: str, info: Any) -> str:
    """The user-facing reason for a clamped turn the engine still refused: the prompt
    itself (history + new message) does not fit, whatever ``max_tokens`` is."""
    m = re.search(r"prompt \((\d+) tokens\)", engine_message)
    limit = getattr(info, "max_model_len", 0)
    if m is None or not limit:
        return engine_message
    return (f"the conversation with this message is {int(m.group(1))} tokens, and the model's context holds "
            f"{limit}: start a new chat or send a shorter message")


class GenerationManager:
    """Starts, runs, cancels and tracks this gateway's replies."""

    def __init__(self, config: GatewayConfig, store: SessionStore, streams: ReplyStreams, router: EngineRouter,
                 redis: aioredis.Redis, events: list[GenerationEvents] | None = None,
                 isolation: CacheIsolation | None = None) -> None:
        self.config = config
        # each user's cache salt and the messages declared shared (gateway/engines/cache_scope.py)
        self.isolation = isolation or CacheIsolation.of(config.resolve_secret(),
                                                        (config.defaults.system_prompt, *config.shared_prompts))
        self.store = store
        self.streams = streams
        self.router = router
        self.redis = redis
        self.events = EventFanout(events or [])
        self.running: dict[str, _Turn] = {}
        # users' defaults for new chats (gateway.store.user_defaults), set by the app; None: the config's
        self.user_defaults: Any = None
        self._listener: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()

    def _background_done(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("a background store write gave up: %s", task.exception())

    # ---- lifecycle -----------------------------------------------------------------

    async def start(self) -> None:
        """Listen for cancels published by other gateway replicas."""
        self._listener = asyncio.create_task(self._listen_cancels(), name="cancel-listener")

    async def close(self, timeout: float = 10.0) -> None:
        """Stop every reply (stored as partial) and the listener."""
        for turn in list(self.running.values()):
            await self._cancel_local(turn, "gateway_shutdown")
        tasks = [t.task for t in self.running.values() if t.task]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)
        if self._listener:
            self._listener.cancel()
        for t in list(self._background):
            t.cancel()

    async def _listen_cancels(self) -> None:
        await keep_connected(self._cancel_session, outage=Outage("cancel listener", log),
                             backoff=Backoff(*STORE_BACKOFF_S))

    async def _cancel_session(self, connected: Callable[[], None]) -> None:
        """One subscription to the cancel channel: cancels the replies it names that run here."""
        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(self.store.keys.cancel_channel())
            connected()
            async for msg in pubsub.listen():
                turn = self.running.get(str(msg.get("data")))
                if turn is not None:
                    await self._cancel_local(turn)
        finally:
            await close_quietly(pubsub)

    async def _store_retrying(self, rid: str, what: str, op: Callable[[], Awaitable[T]]) -> T:
        """Run one store write, retrying while Redis is unreachable (exponential backoff
        from 0.2 s to 5 s, for at most ``config.store_retry_s`` seconds).

        ``op`` must be idempotent (it may have been applied when its answer was lost).
        Raises:
            GatewayError: ``store_unavailable`` once the time is up.
        """
        failed = False

        def warn(_e: BaseException) -> None:
            nonlocal failed
            if not failed:
                log.warning("reply %s: Redis unreachable; keeping the reply in memory and retrying %s "
                            "for up to %.0f s", rid, what, self.config.store_retry_s)
                failed = True

        res = await retry(op, budget_s=self.config.store_retry_s, retryable=is_store_unavailable,
                          backoff=Backoff(*STORE_BACKOFF_S), on_retry=warn)
        if failed:
            log.info("reply %s: %s succeeded after Redis came back", rid, what)
        return res

    # ---- starting a reply ------------------------------------------------------------

    async def chat(self, owner: str, session_id: str | None, content: str, params: dict[str, Any],
                   client_msg_id: str | None, clamp_max_tokens: bool = True,
                   attachments: list[dict[str, Any]] | None = None, model: str | None = None) -> StartedTurn:
        """Append a user message (creating the chat when ``session_id`` is None) and
        start its reply. ``clamp_max_tokens`` lets the engine lower ``max_tokens`` to the
        context left (the browser chat); the OpenAI API passes False (strict check).
        ``attachments`` (checked ``gateway.attachments`` dicts) are stored with the message.
        ``model``: the model the chat's replies come from from now on (kept with the chat).

        Raises:
            GatewayError: ``not_found``, ``busy``, ``rate_limited``, ``too_many_*``,
                ``invalid_request``, ``model_not_found``, ``engine_unavailable``,
                ``store_unavailable``.
        """
        await self.store.count_message(owner, self.config.limits.max_messages_per_minute)
        if session_id is None:
            system_prompt, stored = self.config.defaults.system_prompt, {}
            if self.user_defaults is not None:
                system_prompt, stored = await self.user_defaults.for_new_chat(owner, system_prompt)
            merged = merge_params(self.config.defaults.sampling(), stored, params)
            self._require_engine(model)
            info = await self.store.create_session(owner, system_prompt=system_prompt, params=stored,
                                                   model=model or "")
        else:
            info = await self.store.get_session(owner, session_id)
            merged = merge_params(self.config.defaults.sampling(), info.params, params)
            self._require_engine(model or info.model)
            if model and model != info.model:
                await self.store.update_session(owner, info.id, model=model)
                info.model = model
        try:
            begun = await self.store.begin_turn(owner, info.id, mode="chat", content=content,
                                                client_msg_id=client_msg_id, attachments=attachments)
            return await self._launch(owner, info.id, begun, merged, info.system_prompt, client_msg_id,
                                      clamp_max_tokens, created_chat=session_id is None, model=info.model)
        except Exception:
            if session_id is None:  # refused before it began: leave no empty chat behind
                try:
                    await self.store.delete_session(owner, info.id)
                except GatewayError:
                    pass
            raise

    async def regenerate(self, owner: str, session_id: str, params: dict[str, Any],
                         replaces: str | None = None) -> StartedTurn:
        """Generate a new reply to the chat's last user message; the last reply is kept
        as a version (``SessionStore.switch_version`` shows it again). Same errors as
        ``chat``, and ``conflict`` when ``replaces`` is given and is not the last reply's id."""
        await self.store.count_message(owner, self.config.limits.max_messages_per_minute)
        info = await self.store.get_session(owner, session_id)
        merged = merge_params(self.config.defaults.sampling(), info.params, params)
        self._require_engine(info.model)
        begun = await self.store.begin_turn(owner, info.id, mode="regenerate", replaces=replaces)
        return await self._launch(owner, info.id, begun, merged, info.system_prompt, None, model=info.model)

    def reply_log(self, request_id: str) -> ReplyLog | None:
        """The in-memory entries of a reply running on this gateway, else None."""
        turn = self.running.get(request_id)
        return turn.log if turn is not None else None
    async def edit(self, owner: str, session_id: str, message_id: str, content: str, params: dict[str, Any],
                   client_msg_id: str | None, attachments: list[dict[str, Any]] | None = None) -> StartedTurn:
        """Replace the user message ``message_id`` (and everything after it) with
        ``content`` and start its reply; the old branch stays as a version the user can
        switch back to (``SessionStore.switch_version``). Same errors as ``chat``, and
        ``conflict`` when the chat has no such user message."""
        await self.store.count_message(owner, self.config.limits.max_messages_per_minute)
        info = await self.store.get_session(owner, session_id)
        merged = merge_params(self.config.defaults.sampling(), info.params, params)
        self._require_engine(info.model)
        begun = await self.store.begin_turn(owner, info.id, mode="edit", content=content,
                                            client_msg_id=client_msg_id, replaces=message_id,
                                            attachments=attachments)
        return await self._launch(owner, info.id, begun, merged, info.system_prompt, client_msg_id,
                                  model=info.model)

    async def continue_reply(self, owner: str, session_id: str, message_id: str,
                             params: dict[str, Any]) -> StartedTurn:
        """Extend the chat's last reply ``message_id``, cut at ``max_tokens`` or stopped by
        its user (a partial reply whose token ids are stored): the engine's
        prompt is the chat's exact token ids up to the end of that reply (no end-of-turn
        token), so the prefix cache serves all of it and the model writes on where it
        stopped. The reply keeps its id; its stream starts with the text it had.

        Raises:
            GatewayError: as ``regenerate``; ``invalid_request`` when the reply did not
                stop at max_tokens or by a Stop, or its token ids are not stored.
        """
        await self.store.count_message(owner, self.config.limits.max_messages_per_minute)
        info = await self.store.get_session(owner, session_id)
        merged = merge_params(self.config.defaults.sampling(), info.params, params)
        self._require_engine(info.model)
        begun = await self.store.begin_turn(owner, info.id, mode="continue", replaces=message_id)
        popped = json.loads(begun.popped_json) if begun.popped_json else {}
        seg = json.loads(begun.popped_tokens) if begun.popped_tokens else None
        cut = popped.get("finish_reason") in CONTINUABLE
        model = info.model
        if seg and model and seg.get("model", model) != model:
            await self.store.fail_turn(owner, info.id, begun, None)
            raise GatewayError("invalid_request", f"this reply was written by {seg['model']}, not by this chat's "
                               f"model {model}; regenerate it instead")
        if not cut or not seg or seg.get("base"):
            await self.store.fail_turn(owner, info.id, begun, None)
            if cut and not seg:
                raise GatewayError("invalid_request", NO_IDS_TO_CONTINUE)
            raise GatewayError("invalid_request", "only a reply cut at its max tokens or stopped can be continued")
        started = await self._launch(owner, info.id, begun, merged, info.system_prompt, None,
                                     continued=popped, continued_ids=list(seg["ids"]), model=info.model)
        return started

    def served_models(self) -> list[str]:
        """The models the gateway's engines serve (those that said hello), in
        ``ENGINE_URLS`` order, each once."""
        return list(dict.fromkeys(c.info.model for c in self.router.clients if c.info is not None))

    def check_model(self, model: str | None) -> None:
        """Raises:
            GatewayError: ``model_not_found`` when ``model`` (a name; None or "" is the
                default) is not among ``served_models`` (when any engine said hello)."""
        served = self.served_models()
        if model and served and model not in served:
            raise GatewayError("model_not_found", f"the model {model!r} is not served here; choose one of "
                               f"{', '.join(served)}")

    def _require_engine(self, model: str | None = None) -> None:
        """Raises:
            GatewayError: ``model_not_found`` (``check_model``), ``engine_unavailable``
                when no engine (serving ``model``) is up."""
        self.check_model(model)
        healthy = [c for c in self.router.healthy if not model or (c.info is not None and c.info.model == model)]
        if not healthy:
            self.router.pick("", exclude=self.router.clients)  # raises engine_unavailable

    async def _launch(self, owner: str, sid: str, begun: TurnBegun, params: dict[str, Any],
                      system_prompt: str, client_msg_id: str | None, clamp_max_tokens: bool = True,
                      created_chat: bool = False, continued: dict[str, Any] | None = None,
                      continued_ids: list[int] | None = None, model: str = "") -> StartedTurn:
        started = StartedTurn(begun.request_id, sid, begun.message_id, begun.user_message_id, begun.duplicate)
        if begun.duplicate:
            return started
        turn = _Turn(owner, sid, begun, params, system_prompt, client_msg_id, clamp_max_tokens, created_chat,
                     continued=continued, continued_ids=list(continued_ids or []),
                     think=ReasoningSplitter(self.config.think_markers), model=model or None)
        if continued is not None:
            # the stream starts with the text the reply had, so any tab rebuilds it whole
            # (a length-cut reply stored before engines dropped an unfinished character
            # ends in U+FFFD: the continuation writes that character whole)
            turn.parts.append(str(continued.get("content", "")).rstrip("\ufffd"))
            turn.unsent.append(turn.parts[0])
        try:
            await self.streams.open(begun.request_id, owner, sid, begun.message_id, begun.user_message_id)
        except GatewayError:
            try:
                await self.store.fail_turn(owner, sid, begun, client_msg_id)
            except GatewayError:
                # Redis is down: undo the turn once it is back, so that the answer
                # store_unavailable stays true (no user message without its reply)
                undo = asyncio.create_task(self._store_retrying(
                    begun.request_id, "undoing the refused turn",
                    lambda: self.store.fail_turn(owner, sid, begun, client_msg_id)))
                self._background.add(undo)
                undo.add_done_callback(self._background_done)
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

    async def _cancel_local(self, turn: _Turn, reason: str = "user_stop") -> None:
        if turn.cancel_requested:
            return
        turn.cancel_requested = True
        turn.cut_reason = reason
        turn.cancel_deadline = time.monotonic() + self.config.cancel_grace_s
        if turn.run is not None:
            await turn.run.abort()
            turn.run.wake()  # re-evaluate the deadline

    # ---- the reply task ----------------------------------------------------------------

    async def _run(self, turn: _Turn) -> None:
        rid = turn.begun.request_id
        self.events.on_start(rid, turn.session_id, time.perf_counter())
        lease = asyncio.create_task(self._keep_lease(turn))
        try:
            history = await self._store_retrying(
                rid, "reading the chat", lambda: self.store.history(turn.owner, turn.session_id, turn.system_prompt,
                                                                    turn.model or ""))
            # earlier replies' reasoning stays out of the prompt (their token ids are not
            # reused either: gateway.store.sessions.plan_prefix)
            history.messages = without_reasoning(history.messages, self.config.think_markers)
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
            if turn.run is not None:
                turn.run.close()
            if turn.log.end is None:  # ended without its end entry (a bug, or cancelled): tell followers
                turn.log.finish(StreamEntry("error", turn.log.last_seq, {
                    "code": "internal_error", "message": "the reply failed unexpectedly"}))
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

    async def _generate(self, turn: _Turn, history: History) -> DoneFrame | ErrorFrame:
        """Run the reply on an engine (``EngineRun`` fails over while nothing was
        produced); returns the final engine item."""
        # browser turns clamp max_tokens to the context left, so a high per-chat
        # max_tokens never makes every turn fail; the OpenAI API keeps the strict check
        prompt_ids = self._continue_ids(turn, history) if turn.continued is not None else None
        run = turn.run = EngineRun(self.router, turn.begun.request_id, turn.session_id, history.messages,
                                   history.prefix_token_ids, turn.params, turn.clamp_max_tokens,
                                   prompt_token_ids=prompt_ids, continued_tokens=len(turn.continued_ids),
                                   cache_salt=self.isolation.salt(turn.owner),
                                   shared_messages=self.isolation.shared_messages(history.messages),
                                   think_open=self.config.think_markers.open, model=turn.model)
        run.cancelled = turn.cancel_requested
        await run.start()  # raises engine_unavailable when no engine is left
        if turn.cancel_requested:
            await run.abort()
        return await self._pump(turn, run)

    @staticmethod
    def _continue_ids(turn: _Turn, history: History) -> list[int]:
        """A continued reply's prompt: the chat's exact ids through its user message,
        then the reply's sampled ids (docs/protocol.md, continue).

        Raises:
            GatewayError: ``invalid_request`` when an earlier message has no token ids.
        """
        ids = history.full_ids
        if ids is None:
            raise GatewayError("invalid_request", NO_IDS_TO_CONTINUE)
        return ids + turn.continued_ids

    async def _pump(self, turn: _Turn, run: EngineRun) -> DoneFrame | ErrorFrame:
        """Copy engine batches to the reply stream until the final item.

        After a cancel the abort is re-sent every ``ABORT_RESEND_S`` until the engine
        confirms it: an abort that reaches the engine while it is still preparing the
        request (tokenizing) finds no request to stop. After ``cancel_grace_s`` without
        a confirmation the reply ends here anyway (a synthetic "abort").
        """
        last_abort = time.monotonic()
        while True:
            timeout = None
            if turn.cancel_deadline is not None:
                now = time.monotonic()
                if now >= turn.cancel_deadline:
                    turn.synthetic_end = True
                    return DoneFrame(turn.begun.request_id, finish_reason="abort")
                if now - last_abort >= ABORT_RESEND_S:
                    await run.abort()
                    last_abort = now
                timeout = min(turn.cancel_deadline - now, ABORT_RESEND_S)
            batch = await run.next(timeout)
            if batch is None:
                continue  # re-check the deadline, re-send the abort
            if batch.progress is not None and not turn.produced:
                p = batch.progress
                turn.log.set_progress(p.prompt_tokens_done, p.prompt_tokens, p.cached_tokens)
            turn.output_ids.extend(batch.token_ids)
            if batch.trim_prior:
                self._trim_continued(turn, batch.trim_prior)
            if batch.text:
                self._time_reasoning(turn, batch.text)
                turn.parts.append(batch.text)
                turn.unsent.append(batch.text)
                await self._write_unsent(turn)
                self.events.on_delta(turn.begun.request_id, len(batch.token_ids), len(batch.text),
                                     time.perf_counter())
            if batch.end is not None:
                return batch.end

    @staticmethod
    def _time_reasoning(turn: _Turn, text: str) -> None:
        """Follow the reply's reasoning: it starts with the reply's first text and ends
        when the closing marker comes (``reasoning_ms``, added to a continued reply's)."""
        if turn.think is None:
            return
        now = time.monotonic()
        if turn.think_t0 is None:
            turn.think_t0 = now
            if turn.continued is not None:  # where the earlier text left the reasoning
                turn.think.feed(str(turn.continued.get("content", "")))
        was = turn.think.in_reasoning
        turn.think.feed(text)
        # closed by this text (or opened and closed in it; not the earlier text's block)
        closed = turn.think.reasoned and not turn.think.in_reasoning and (was or turn.continued is None)
        if closed and turn.reasoning_ms is None:
            turn.reasoning_ms = _reasoning_ms(turn, now)

    @staticmethod
    def _final_reasoning_ms(turn: _Turn) -> float | None:
        """How long the reply reasoned (ms): until its closing marker, or until now when
        it ended while reasoning; a continued reply's earlier reasoning counts; None
        when it has no reasoning."""
        if turn.reasoning_ms is not None:
            return turn.reasoning_ms
        if turn.think is not None and turn.think.in_reasoning and turn.think_t0 is not None:
            return _reasoning_ms(turn, time.monotonic())
        earlier = (turn.continued or {}).get("reasoning_ms")
        return float(earlier) if earlier is not None else None

    @staticmethod
    def _trim_continued(turn: _Turn, n: int) -> None:
        """Take ``n`` characters off the end of a continued reply's earlier text: a stop
        string begun before the cut completed after it, so the reply written at once
        would never have shown them (docs/protocol.md, continuing a cut reply). The engine
        sends this before the continuation's first text, so that earlier text is still
        unsent (the reply stream's first delta holds it with the first new text)."""
        if turn.continued is None or turn.seq or len(turn.unsent) != 1 or len(turn.parts) != 1:
            log.error("reply %s: the engine took back %d characters of text already streamed; kept",
                      turn.begun.request_id, n)
            return
        kept = turn.parts[0][: max(0, len(turn.parts[0]) - n)]
        turn.parts[0] = turn.unsent[0] = kept

    async def _write_unsent(self, turn: _Turn) -> None:
        """Append the text not yet in the reply stream as the next delta; while Redis
        is unreachable, keep it (the generation goes on) and try again after a pause."""
        if not turn.unsent or time.monotonic() < turn.store_retry_at:
            return
        rid = turn.begun.request_id
        try:
            if turn.delta_uncertain:
                # the last failed write may have been applied with its answer lost: if
                # so, its text is already delta seq+1 and only the rest is still unsent
                written = await self.streams.delta_text(rid, turn.seq + 1)
                turn.delta_uncertain = False
                if written is not None:
                    rest = "".join(turn.unsent)[len(written):]
                    turn.seq += 1
                    turn.log.append(turn.seq, written)
                    turn.unsent = [rest] if rest else []
                    if not rest:
                        turn.store_retry_at = 0.0
                        return
            turn.delta_uncertain = True
            text = "".join(turn.unsent)
            await self.streams.delta(rid, turn.seq + 1, text)
            turn.delta_uncertain = False
        except GatewayError as e:
            if e.code != "store_unavailable":
                raise
            if not turn.store_warned:
                log.warning("reply %s: Redis unreachable; the reply goes on and is kept in memory", rid)
                turn.store_warned = True
            turn.store_retry_at = time.monotonic() + 1.0
            return
        turn.seq += 1
        turn.log.append(turn.seq, text)
        turn.unsent.clear()
        turn.store_retry_at = 0.0

    async def _flush_unsent(self, turn: _Turn) -> None:
        """Write the kept text to the reply stream, retrying (before the reply is stored,
        so that the stream's deltas add up to the stored content)."""
        async def write() -> None:
            turn.store_retry_at = 0.0
            await self._write_unsent(turn)
            if turn.unsent:
                raise GatewayError("store_unavailable", "the chat store (Redis) is unreachable")
        if turn.unsent:
            await self._store_retrying(turn.begun.request_id, "writing the reply stream", write)

    async def _finish(self, turn: _Turn, history: History, end: DoneFrame | ErrorFrame) -> None:
        rid, begun = turn.begun.request_id, turn.begun
        if isinstance(end, ErrorFrame):
            code = user_code(end)
            message = end.message or "the engine refused the request"
            if code == "context_length_exceeded" and turn.clamp_max_tokens:
                message = _context_message(message, self.router.info())
            if code == "engine_unavailable" and turn.produced:
                message = ("the model server stopped while writing this reply; what was written is kept. "
                           "It is being restarted: try again in a moment")
            await self._end_with_error(turn, code, message, error_status(end))
            return
        reason = end.finish_reason
        # an abort nobody here asked for is the engine shutting down
        reply_end = ReplyEnd.of_done(end, (turn.cut_reason or "engine_lost") if reason == "abort" else None,
                                     len(turn.output_ids) if turn.synthetic_end else None)
        created_at = time.time()
        reasoning_ms = self._final_reasoning_ms(turn)
        user_seg = a_seg = None
        if turn.continued is not None:
            new_ids = turn.output_ids if turn.synthetic_end else list(end.output_token_ids)
            if new_ids or turn.output_ids:
                a_seg = {"ids": turn.continued_ids + list(new_ids), "base": False}
            created_at = turn.continued.get("created_at", created_at)
        elif not turn.synthetic_end and end.prompt_token_ids:
            user_seg = history.user_segment(list(end.prompt_token_ids), end.prefix_reused)
            a_seg = {"ids": list(end.output_token_ids), "base": False}
        # else no ids came back (an OpenAI-compatible upstream): the turn stores no token
        # segments, so the next turn's exact prefix stops before it and its text is re-read
        assistant = reply_end.stored_message("".join(turn.parts), created_at, rid)
        if reasoning_ms is not None:
            assistant["reasoning_ms"] = reasoning_ms
        if a_seg is not None and split_reasoning(str(assistant["content"]), self.config.think_markers)[0] is not None:
            # its reasoning is left out of later prompts: they must not replay these ids
            # (a Continue of this reply still does)
            a_seg["reasoning"] = True
        engine = turn.run.engine if turn.run is not None else None
        if engine is not None and engine.info is not None:
            # token ids are the model's own: a later turn on another model does not reuse them
            for seg in (user_seg, a_seg):
                if seg is not None:
                    seg["model"] = engine.info.model
            assistant["model"] = engine.info.model
        try:
            await self._flush_unsent(turn)
            stored = await self._store_retrying(rid, "storing the reply", lambda: self.store.finish_turn(
                turn.owner, turn.session_id, begun, assistant, user_seg, a_seg))
            if stored != "ok":
                log.warning("reply %s not stored: %s", rid, stored)
            # the title is announced unless the chat was renamed while the reply ran
            title = begun.title if begun.title and await self._title_kept(turn) else None
            done = reply_end.done_entry(rid, turn.session_id, begun.message_id, title)
            if reasoning_ms is not None:
                done["reasoning_ms"] = reasoning_ms
            await self._store_retrying(rid, "ending the reply stream", lambda: self.streams.done(rid, turn.seq, done))
            turn.log.finish(StreamEntry("done", turn.seq, {"t": "done", "d": dumps(done)}))
        except GatewayError as e:
            log.error("reply %s could not be stored within %.0f s (%s); it is lost",
                      rid, self.config.store_retry_s, e.message)
            self._log_gave_up(turn)
        self.events.on_finish(rid, reason, reply_end.usage(), reply_end.timings_dict(), time.perf_counter())

    async def _title_kept(self, turn: _Turn) -> bool:
        """True when the chat still has the title this turn gave it."""
        try:
            info = await self.store.get_session(turn.owner, turn.session_id)
        except GatewayError:
            return False  # deleted, or Redis blinked: announce nothing
        return info.title == turn.begun.title

    async def _delete_chat(self, turn: _Turn) -> None:
        try:
            await self.store.delete_session(turn.owner, turn.session_id)
        except GatewayError as e:
            if e.code != "not_found":  # already deleted by its user
                raise

    async def _end_with_error(self, turn: _Turn, code: str, message: str, status: int = 0) -> None:
        """End a reply that failed: undo it when nothing was shown, else store what was
        shown as partial. ``status``: the HTTP status an OpenAI-compatible upstream's own
        error asks for (kept with the error for the OpenAI API; 0 for our codes). Best
        effort when Redis itself is the failure."""
        rid, begun = turn.begun.request_id, turn.begun
        error: dict[str, Any] = {"code": code, "message": message, **({"status": status} if status else {})}
        self.events.on_error(rid, code, time.perf_counter())
        try:
            if not turn.produced and turn.created_chat:
                # the first turn of a chat made for it was refused: leave no empty chat
                await self._store_retrying(rid, "removing the refused new chat", lambda: self._delete_chat(turn))
            elif not turn.produced:
                await self._store_retrying(rid, "undoing the refused turn", lambda: self.store.fail_turn(
                    turn.owner, turn.session_id, begun, turn.client_msg_id))
            if not turn.produced:
                await self._store_retrying(rid, "ending the reply stream",
                                           lambda: self.streams.error(rid, turn.seq, code, message, status))
                fields = {"t": "error", "code": code, "message": message, **({"status": str(status)} if status else {})}
                turn.log.finish(StreamEntry("error", turn.seq, fields))
                return
            await self._flush_unsent(turn)
            cut = "engine_lost" if code == "engine_unavailable" else "upstream_error" if status else "error"
            reply_end = ReplyEnd.of_error(error, cut, len(turn.output_ids))
            assistant = reply_end.stored_message("".join(turn.parts), time.time(), rid)
            reasoning_ms = self._final_reasoning_ms(turn)
            if reasoning_ms is not None:
                assistant["reasoning_ms"] = reasoning_ms
            await self._store_retrying(rid, "storing the partial reply", lambda: self.store.finish_turn(
                turn.owner, turn.session_id, begun, assistant, None, None))
            done = reply_end.done_entry(rid, turn.session_id, begun.message_id)
            await self._store_retrying(rid, "ending the reply stream", lambda: self.streams.done(rid, turn.seq, done))
            turn.log.finish(StreamEntry("done", turn.seq, {"t": "done", "d": dumps(done)}))
        except GatewayError as e:
            log.error("reply %s could not be closed in the store within %.0f s: %s",
                      rid, self.config.store_retry_s, e.message)
            self._log_gave_up(turn)

    @staticmethod
    def _log_gave_up(turn: _Turn) -> None:
        """Followers on this gateway hear that the store gave up (those reading the
        stream hear nothing more, as the stream got no end entry)."""
        turn.log.finish(StreamEntry("error", turn.log.last_seq, {
            "t": "error", "code": "store_unavailable", "message": "the chat store (Redis) is unreachable"}))
