"""Starting a turn: chat, regenerate, edit and continue share one preamble (the user's
message rate, the chat, the merged sampling parameters, an engine for the chat's model),
then reserve the turn in the store (``begin_turn``: chat lock, user message), write the
reply stream's start entry in the same step, reading the chat for the prompt) and hand
the turn to its task. A turn on an existing chat reaches its engine after two Redis round
trips: the count with the chat's read, and the begin; so does a turn that creates its
chat (the count with the user's defaults, then the begin that creates the chat). A turn
refused before it began leaves nothing behind (a chat created for it is deleted)."""

from __future__ import annotations

import json
import time
from typing import Any

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from gateway.config import GatewayConfig
from gateway.engines.client import EngineRouter
from gateway.errors import GatewayError
from gateway.replies.reasoning_clock import ReasoningClock
from gateway.replies.task import NO_IDS_TO_CONTINUE, ReplyTasks
from gateway.replies.turn import Continued, StartedTurn, Turn, TurnRequest
from gateway.replies.writer import ReplyWriter
from gateway.store.reply_streams import ReplyStreams
from gateway.store.sessions import History, SessionInfo, SessionStore, TurnBegun, new_id

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


def continue_budget(seg: dict[str, Any], finish_reason: Any, asked: dict[str, Any],
                    merged_max: int | None) -> tuple[int | None, tuple[int, int] | None]:
    """The ``max_tokens`` of a Continue and the budget to store with the reply.

    A reply stores ``budget`` ``[max_tokens, from]`` with its token ids: the budget of the
    turn that wrote it, begun when the reply had ``from`` tokens. A reply stopped
    (``abort``) goes on as if it had never been cut: what is left of that budget
    (``max_tokens - (written - from)``). A reply cut at its budget (``length``), or stopped
    with none left, gets that budget again, from where it is. A ``max_tokens`` the
    Continue itself asks for (``asked``) is a new budget from where the reply is; so is the
    chat's (``merged_max``) for a reply stored without a budget.

    Args:
        seg: the reply's stored token segment (``ids``, ``budget``?).
        finish_reason: the reply's stored finish reason.
        asked: the Continue frame's own sampling parameters.
        merged_max: ``max_tokens`` of the merged parameters (None: the engine's default).
    Returns:
        (``max_tokens`` for this request, or None to keep the merged one; the budget to
        store, ``(max_tokens, from)``, or None when there is none to store).
    """
    written = len(seg.get("ids", []))
    stored = seg.get("budget")
    if "max_tokens" in asked or not (isinstance(stored, list) and len(stored) == 2):
        return None, ((int(merged_max), written) if merged_max is not None else None)
    total, start = int(stored[0]), int(stored[1])
    left = total - (written - start)
    if finish_reason == "abort" and left >= 1:
        return left, (total, start)
    return total, (total, written)


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
        """The common start of a turn on an existing chat: count the user's message and
        read the chat (one round trip), merge its parameters with ``params``, check an engine serves its
        model (``model``, when given, becomes the chat's model). Returns the chat and the
        merged parameters.

        Raises:
            GatewayError: ``rate_limited``, ``not_found``, ``invalid_request``,
                ``model_not_found``, ``engine_unavailable``, ``store_unavailable``.
        """
        info = await self.store.counted_session(owner, session_id, self.config.limits.max_messages_per_minute)
        merged = merge_params(self.config.defaults.sampling(), info.params, params)
        self._require_engine(model or info.model)
        if model and model != info.model:
            await self.store.update_session(owner, info.id, model=model)
            info.model = model
        return info, merged

    async def new_chat(self, owner: str, params: dict[str, Any], model: str | None,
                       system_prompt: str | None = None) -> tuple[SessionInfo, dict[str, Any]]:
        """The start of a turn that creates its chat (with the user's defaults): count the
        user's message and read their defaults (one round trip), merge the parameters,
        check an engine serves ``model``. Returns the chat to create (not stored yet:
        ``begin`` with ``create=True`` stores it) and the merged parameters.
        ``system_prompt``: the chat's, in place of the user's default (None: the default).

        Raises:
            GatewayError: ``rate_limited``, ``invalid_request``, ``model_not_found``,
                ``engine_unavailable``, ``store_unavailable``.
        """
        limit = self.config.limits.max_messages_per_minute
        default_prompt, stored = self.config.defaults.system_prompt, {}
        if self.user_defaults is None:
            await self.store.count_message(owner, limit)
        else:
            raw = await self.store.count_message(owner, limit, read=self.user_defaults.key(owner))
            default_prompt, stored = self.user_defaults.new_chat_fields(self.user_defaults.parse(raw), default_prompt)
        if system_prompt is None:
            system_prompt = default_prompt
        merged = merge_params(self.config.defaults.sampling(), stored, params)
        self._require_engine(model)
        now = time.time()
        return SessionInfo(new_id(), owner, "", system_prompt, stored, now, now, model=model or ""), merged

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
        return Continued(popped, list(seg["ids"]), seg)

    async def begin(self, owner: str, info: SessionInfo, mode: str, create: bool = False, **kw: Any) -> TurnBegun:
        """``begin_turn`` that also opens the reply stream and reads the chat for the
        prompt, in the same round trip (see ``SessionStore.begin_turn``); with ``create``,
        it first creates ``info`` (a chat from ``new_chat``) in that round trip too."""
        return await self.store.begin_turn(owner, info.id, mode=mode, stream_ttl_s=self.streams.ttl,
                                           create=info if create else None, **kw)

    async def launch(self, req: TurnRequest) -> StartedTurn:
        """Start the task of a turn begun by ``begin`` (its stream open, its chat read)."""
        begun = req.begun
        started = StartedTurn(begun.request_id, req.session_id, begun.message_id, begun.user_message_id,
                              begun.duplicate)
        if begun.duplicate:
            return started
        if begun.chat is None:
            raise ValueError("launch needs a turn begun with its reply stream (TurnStarter.begin)")
        history = History.of(*begun.chat, req.system_prompt, req.model or "")
        # a continued reply's stream starts with the text it had, so any tab rebuilds it
        # whole (a length-cut reply stored before engines dropped an unfinished character
        # ends in U+FFFD: the continuation writes that character whole)
        prior = str(req.continued.message.get("content", "")).rstrip("\ufffd") if req.continued else None
        turn = Turn(req, ReplyWriter(req.rid, self.streams, self.config.store_retry_s, prior),
                    ReasoningClock(self.config.think_markers, req.continued.message if req.continued else None))
        self.tasks.spawn(turn, history)
        return started

