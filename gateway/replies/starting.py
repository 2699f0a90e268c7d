"""Starting a turn: chat, regenerate, edit and continue share one preamble (the user's
message rate, the chat, the merged sampling parameters, an engine for the chat's model),
then reserve the turn in the store (``begin_turn``: chat lock, user message), write the
reply stream's start entry and hand the turn to its task. A turn refused before it began
leaves nothing behind (a chat created for it is deleted; a begun turn whose stream could
not be opened is undone, in the background while Redis is down)."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from gateway.config import GatewayConfig
from gateway.engines.client import EngineRouter
from gateway.errors import GatewayError
from gateway.replies.reasoning_clock import ReasoningClock
from gateway.replies.store_retry import store_retrying
from gateway.replies.task import NO_IDS_TO_CONTINUE, ReplyTasks
from gateway.replies.turn import Continued, StartedTurn, Turn, TurnRequest
from gateway.replies.writer import ReplyWriter
from gateway.store.reply_streams import ReplyStreams
from gateway.store.sessions import SessionInfo, SessionStore, TurnBegun

log = logging.getLogger("gateway.replies.starting")

# the finish reasons of a reply Continue extends: cut at its max tokens, or stopped (a
# Stop, a shutdown: the engine's abort flushes the text of every sampled token, so the
# stored ids and text agree and the continuation is exact)
CONTINUABLE = ("length", "abort")


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


class TurnStarter:
    """Starts turns (see module doc)."""

    def __init__(self, config: GatewayConfig, store: SessionStore, streams: ReplyStreams, router: EngineRouter,
                 tasks: ReplyTasks) -> None:
        self.config = config
        self.store = store
        self.streams = streams
        self.router = router
        self.tasks = tasks
        # users' defaults for new chats (gateway.store.user_defaults), set by the app; None: the config's
        self.user_defaults: Any = None
        self._background: set[asyncio.Task[Any]] = set()

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

    async def preamble(self, owner: str, session_id: str, params: dict[str, Any],
                       model: str | None = None) -> tuple[SessionInfo, dict[str, Any]]:
        """The common start of a turn on an existing chat: count the user's message,
        read the chat, merge its parameters with ``params``, check an engine serves its
        model (``model``, when given, becomes the chat's model). Returns the chat and the
        merged parameters.

        Raises:
            GatewayError: ``rate_limited``, ``not_found``, ``invalid_request``,
                ``model_not_found``, ``engine_unavailable``, ``store_unavailable``.
        """
        await self.store.count_message(owner, self.config.limits.max_messages_per_minute)
        info = await self.store.get_session(owner, session_id)
        merged = merge_params(self.config.defaults.sampling(), info.params, params)
        self._require_engine(model or info.model)
        if model and model != info.model:
            await self.store.update_session(owner, info.id, model=model)
            info.model = model
        return info, merged

    async def new_chat(self, owner: str, params: dict[str, Any],
                       model: str | None) -> tuple[SessionInfo, dict[str, Any]]:
        """The start of a turn that creates its chat (with the user's defaults)."""
        await self.store.count_message(owner, self.config.limits.max_messages_per_minute)
        system_prompt, stored = self.config.defaults.system_prompt, {}
        if self.user_defaults is not None:
            system_prompt, stored = await self.user_defaults.for_new_chat(owner, system_prompt)
        merged = merge_params(self.config.defaults.sampling(), stored, params)
        self._require_engine(model)
        info = await self.store.create_session(owner, system_prompt=system_prompt, params=stored, model=model or "")
        return info, merged

    @staticmethod
    def continued(begun: TurnBegun, model: str) -> Continued | str:
        """The reply a "continue" turn extends, or why it cannot be continued."""
        popped = json.loads(begun.popped_json) if begun.popped_json else {}
        seg = json.loads(begun.popped_tokens) if begun.popped_tokens else None
        cut = popped.get("finish_reason") in CONTINUABLE
        if seg and model and seg.get("model", model) != model:
            return (f"this reply was written by {seg['model']}, not by this chat's model {model}; "
                    "regenerate it instead")
        if not cut or not seg or seg.get("base"):
            if cut and not seg:
                return NO_IDS_TO_CONTINUE
            return "only a reply cut at its max tokens or stopped can be continued"
        return Continued(popped, list(seg["ids"]))

    async def launch(self, req: TurnRequest) -> StartedTurn:
        """Open the begun turn's reply stream and start its task.

        Raises:
            GatewayError: ``store_unavailable`` when the stream could not be opened (the
                turn is undone).
        """
        begun = req.begun
        started = StartedTurn(begun.request_id, req.session_id, begun.message_id, begun.user_message_id,
                              begun.duplicate)
        if begun.duplicate:
            return started
        # a continued reply's stream starts with the text it had, so any tab rebuilds it
        # whole (a length-cut reply stored before engines dropped an unfinished character
        # ends in U+FFFD: the continuation writes that character whole)
        prior = str(req.continued.message.get("content", "")).rstrip("\ufffd") if req.continued else None
        turn = Turn(req, ReplyWriter(req.rid, self.streams, self.config.store_retry_s, prior),
                    ReasoningClock(self.config.think_markers, req.continued.message if req.continued else None))
        try:
            await self.streams.open(begun.request_id, req.owner, req.session_id, begun.message_id,
                                    begun.user_message_id)
        except GatewayError:
            try:
                await self.store.fail_turn(req.owner, req.session_id, begun, req.client_msg_id)
            except GatewayError:
                # Redis is down: undo the turn once it is back, so that the answer
                # store_unavailable stays true (no user message without its reply)
                undo = asyncio.create_task(store_retrying(
                    begun.request_id, "undoing the refused turn",
                    lambda: self.store.fail_turn(req.owner, req.session_id, begun, req.client_msg_id),
                    self.config.store_retry_s))
                self._background.add(undo)
                undo.add_done_callback(self._background_done)
            raise
        self.tasks.spawn(turn)
        return started

    def _background_done(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("a background store write gave up: %s", task.exception())

    def close(self) -> None:
        """Cancel the background undos still waiting for Redis."""
        for t in list(self._background):
            t.cancel()
