"""Ending a reply: store it, then end its stream.

A reply the engine finished (or one stopped) is stored with its token segments, and only
then its stream gets ``done`` (both derived from one ``ReplyEnd``). Failure policy
(docs/protocol.md): a turn the engine refuses before producing anything
(``context_length_exceeded``, ``invalid_request``, no engine) is undone: its user message
is removed (a regenerate puts the old reply back), the stream ends with an ``error``. A
reply that breaks after some text is stored as "partial" with ``finish_reason`` "error"
and ends with a ``done`` carrying ``error``. The store's FINISH is idempotent by message
id, so the reply is stored exactly once however often a write is retried.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from engine.protocol import DoneFrame, ErrorFrame
from gateway.config import GatewayConfig
from gateway.engines.client import EngineRouter
from gateway.engines.run import error_status, user_code
from gateway.errors import GatewayError
from gateway.reasoning import split_reasoning
from gateway.replies.hooks import GenerationEvents
from gateway.replies.reply_end import ReplyEnd
from gateway.replies.store_retry import store_retrying
from gateway.replies.turn import Turn
from gateway.store.sessions import History, SessionStore

log = logging.getLogger("gateway.replies.ending")
T = TypeVar("T")


def _context_message(engine_message: str, info: Any) -> str:
    """The user-facing reason for a clamped turn the engine still refused: the prompt
    itself (history + new message) does not fit, whatever ``max_tokens`` is."""
    m = re.search(r"prompt \((\d+) tokens\)", engine_message)
    limit = getattr(info, "max_model_len", 0)
    if m is None or not limit:
        return engine_message
    return (f"the conversation with this message is {int(m.group(1))} tokens, and the model's context holds "
            f"{limit}: start a new chat or send a shorter message")


def _counting_continued(end: ReplyEnd, turn: Turn) -> ReplyEnd:
    """``end`` with the tokens a continued reply had before (``ReplyEnd.continued_tokens``),
    so that its stored usage and ``done`` say the whole reply's length."""
    continued = turn.request.continued
    return dataclasses.replace(end, continued_tokens=len(continued.ids)) if continued is not None else end


class ReplyEnding:
    """Stores and ends replies (see module doc)."""

    def __init__(self, config: GatewayConfig, store: SessionStore, router: EngineRouter,
                 events: GenerationEvents) -> None:
        self.config = config
        self.store = store
        self.router = router
        self.events = events

    async def _retrying(self, turn: Turn, what: str, op: Callable[[], Awaitable[T]]) -> T:
        return await store_retrying(turn.request.rid, what, op, self.config.store_retry_s)

    async def finish(self, turn: Turn, history: History, end: DoneFrame | ErrorFrame) -> None:
        """End a reply with the engine's final item: store it and write ``done``, or
        handle its error (``end_with_error``)."""
        req = turn.request
        rid, begun = req.rid, req.begun
        if isinstance(end, ErrorFrame):
            code = user_code(end)
            message = end.message or "the engine refused the request"
            if code == "context_length_exceeded" and req.clamp_max_tokens:
                message = _context_message(message, self.router.info())
            if code == "engine_unavailable" and turn.produced:
                message = ("the model server stopped while writing this reply; what was written is kept. "
                           "It is being restarted: try again in a moment")
            await self.end_with_error(turn, code, message, error_status(end))
            return
        reason = end.finish_reason
        synthetic = turn.cancel.synthetic_end
        # an abort nobody here asked for is the engine shutting down
        reply_end = ReplyEnd.of_done(end, (turn.cancel.reason or "engine_lost") if reason == "abort" else None,
                                     len(turn.output_ids) if synthetic else None,
                                     turn.reasoning.final_ms())
        reply_end = _counting_continued(reply_end, turn)
        created_at = time.time()
        user_seg = a_seg = None
        if req.continued is not None:
            new_ids = turn.output_ids if synthetic else list(end.output_token_ids)
            if new_ids or turn.output_ids:
                a_seg = {"ids": req.continued.ids + list(new_ids), "base": False}
                if req.budget is not None:  # what a later Continue of it may write (continue_budget)
                    a_seg["budget"] = list(req.budget)
            created_at = req.continued.message.get("created_at", created_at)
        elif not synthetic and end.prompt_token_ids:
            user_seg = history.user_segment(list(end.prompt_token_ids), end.prefix_reused)
            a_seg = {"ids": list(end.output_token_ids), "base": False}
            if req.params.get("max_tokens") is not None:
                a_seg["budget"] = [int(req.params["max_tokens"]), 0]
        # else no ids came back (an OpenAI-compatible upstream): the turn stores no token
        # segments, so the next turn's exact prefix stops before it and its text is re-read
        assistant = reply_end.stored_message(turn.writer.text, created_at, rid)
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
            await turn.writer.flush()
            stored = await self._retrying(turn, "storing the reply", lambda: self.store.finish_turn(
                req.owner, req.session_id, begun, assistant, user_seg, a_seg))
            if stored != "ok":
                log.warning("reply %s not stored: %s", rid, stored)
            # the title is announced unless the chat was renamed while the reply ran
            title = begun.title if begun.title and await self._title_kept(turn) else None
            await turn.writer.done(reply_end.done_entry(rid, req.session_id, begun.message_id, title))
        except GatewayError as e:
            log.error("reply %s could not be stored within %.0f s (%s); it is lost",
                      rid, self.config.store_retry_s, e.message)
            turn.writer.gave_up()
        self.events.on_finish(rid, reply_end, time.perf_counter())

    async def _title_kept(self, turn: Turn) -> bool:
        """True when the chat still has the title this turn gave it."""
        try:
            info = await self.store.get_session(turn.request.owner, turn.request.session_id)
        except GatewayError:
            return False  # deleted, or Redis blinked: announce nothing
        return info.title == turn.request.begun.title

    async def _delete_chat(self, turn: Turn) -> None:
        try:
            await self.store.delete_session(turn.request.owner, turn.request.session_id)
        except GatewayError as e:
            if e.code != "not_found":  # already deleted by its user
                raise

    async def end_with_error(self, turn: Turn, code: str, message: str, status: int = 0) -> None:
        """End a reply that failed: undo it when nothing was shown, else store what was
        shown as partial. ``status``: the HTTP status an OpenAI-compatible upstream's own
        error asks for (kept with the error for the OpenAI API; 0 for our codes). Best
        effort when Redis itself is the failure."""
        req = turn.request
        rid, begun = req.rid, req.begun
        error: dict[str, Any] = {"code": code, "message": message, **({"status": status} if status else {})}
        self.events.on_error(rid, code, time.perf_counter())
        try:
            if not turn.produced and req.created_chat:
                # the first turn of a chat made for it was refused: leave no empty chat
                await self._retrying(turn, "removing the refused new chat", lambda: self._delete_chat(turn))
            elif not turn.produced:
                await self._retrying(turn, "undoing the refused turn", lambda: self.store.fail_turn(
                    req.owner, req.session_id, begun, req.client_msg_id))
            if not turn.produced:
                await turn.writer.error(code, message, status)
                return
            await turn.writer.flush()
            cut = "engine_lost" if code == "engine_unavailable" else "upstream_error" if status else "error"
            reply_end = _counting_continued(ReplyEnd.of_error(error, cut, len(turn.output_ids),
                                                              turn.reasoning.final_ms()), turn)
            assistant = reply_end.stored_message(turn.writer.text, time.time(), rid)
            await self._retrying(turn, "storing the partial reply", lambda: self.store.finish_turn(
                req.owner, req.session_id, begun, assistant, None, None))
            await turn.writer.done(reply_end.done_entry(rid, req.session_id, begun.message_id))
        except GatewayError as e:
            log.error("reply %s could not be closed in the store within %.0f s: %s",
                      rid, self.config.store_retry_s, e.message)
            turn.writer.gave_up()
