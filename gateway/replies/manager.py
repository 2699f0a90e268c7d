"""The replies of this gateway: ``GenerationManager`` starts, cancels and tracks them
(docs/architecture.md, a reply's path). Its parts, one job each:

* ``starting.py``: the turn's preamble and its start (store, stream, task);
* ``task.py``: the reply task (engine batches to the writer, the chat lock's lease);
* ``writer.py``: the reply's sequence numbers, unsent text and in-memory log;
* ``ending.py``: storing the reply and ending its stream (``reply_end.py``'s ``ReplyEnd``);
* ``cancels.py``: cancels across replicas.

Redis going away mid-reply loses nothing: the task keeps generating, the writer keeps
the text it could not write (written later as one delta, so seqs stay gapless), and
every store write is retried with backoff for up to ``store_retry_s`` seconds; the
store's FINISH is idempotent by message id, so the reply is stored exactly once and
``done`` follows it. A turn is answered ``store_unavailable`` only when it was not
accepted.
"""

from __future__ import annotations

import asyncio
from typing import Any

import redis.asyncio as aioredis

from gateway.config import GatewayConfig
from gateway.engines.cache_scope import CacheIsolation
from gateway.engines.client import EngineRouter
from gateway.engines.run import PASSTHROUGH_CODES
from gateway.errors import GatewayError
from gateway.replies.cancels import Cancels
from gateway.replies.hooks import EventFanout, GenerationEvents
from gateway.replies.starting import TurnStarter, continue_budget, merge_params
from gateway.replies.tail import ReplyLog
from gateway.replies.task import ReplyTasks
from gateway.replies.turn import StartedTurn, Turn, TurnRequest
from gateway.store.reply_streams import ReplyStreams
from gateway.store.sessions import SessionInfo, SessionStore, TurnBegun

__all__ = ["PASSTHROUGH_CODES", "GenerationManager", "StartedTurn", "merge_params"]


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
        self.events = EventFanout(events or [])
        self.running: dict[str, Turn] = {}
        self.tasks = ReplyTasks(config, store, router, self.isolation, self.events, self.running)
        self.starter = TurnStarter(config, store, streams, router, self.tasks)
        self.cancels = Cancels(self.running, redis, store.keys, streams, config.cancel_grace_s)

    @property
    def user_defaults(self) -> Any:
        """Users' defaults for new chats (``gateway.store.user_defaults``); None: the config's."""
        return self.starter.user_defaults

    @user_defaults.setter
    def user_defaults(self, value: Any) -> None:
        self.starter.user_defaults = value

    # ---- lifecycle -----------------------------------------------------------------

    async def start(self) -> None:
        """Listen for cancels published by other gateway replicas."""
        self.cancels.start()

    async def close(self, timeout: float = 10.0) -> None:
        """Stop every reply (stored as partial) and the listener."""
        for turn in list(self.running.values()):
            await self.cancels.local(turn, "gateway_shutdown")
        tasks = [t.task for t in self.running.values() if t.task]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)
        self.cancels.close()

    # ---- starting a reply ------------------------------------------------------------

    def _request(self, owner: str, info: SessionInfo, begun: TurnBegun, params: dict[str, Any],
                 client_msg_id: str | None, **kw: Any) -> TurnRequest:
        return TurnRequest(owner, info.id, begun, params, info.system_prompt, client_msg_id,
                           model=info.model or None, **kw)

    async def chat(self, owner: str, session_id: str | None, content: str, params: dict[str, Any],
                   client_msg_id: str | None, clamp_max_tokens: bool = True,
                   attachments: list[dict[str, Any]] | None = None, model: str | None = None,
                   tools: dict[str, Any] | None = None,
                   tool_results: list[dict[str, str]] | None = None,
                   system_prompt: str | None = None) -> StartedTurn:
        """Append a user message (creating the chat when ``session_id`` is None) and
        start its reply. ``clamp_max_tokens`` lets the engine lower ``max_tokens`` to the
        context left (the browser chat); the OpenAI API passes False (strict check).
        ``attachments`` (checked ``gateway.attachments`` dicts) are stored with the message.
        ``model``: the model the chat's replies come from from now on (kept with the chat).
        ``tools``: the turn's tool fields (``TurnRequest.tools``); ``tool_results``: the
        message answers the last reply's calls (``SessionStore.begin_turn``).
        ``system_prompt``: a new chat's, instead of the user's default (None: the default).

        Raises:
            GatewayError: ``not_found``, ``busy``, ``rate_limited``, ``too_many_*``,
                ``invalid_request``, ``model_not_found``, ``engine_unavailable``,
                ``store_unavailable``.
        """
        if session_id is None:
            info, merged = await self.starter.new_chat(owner, params, model, system_prompt)
        else:
            info, merged = await self.starter.preamble(owner, session_id, params, model)
        begun: TurnBegun | None = None
        try:
            begun = await self.starter.begin(owner, info, "chat", create=session_id is None, content=content,
                                             client_msg_id=client_msg_id, attachments=attachments,
                                             tool_results=tool_results)
            return await self.starter.launch(self._request(owner, info, begun, merged, client_msg_id,
                                                           clamp_max_tokens=clamp_max_tokens,
                                                           created_chat=session_id is None, tools=tools or {}))
        except Exception as e:
            # a begin refused by the store created nothing; after a launch that failed, or
            # an outage that hid the begin's answer, the chat may exist
            refused = begun is None and isinstance(e, GatewayError) and e.code != "store_unavailable"
            if session_id is None and not refused:  # leave no empty chat behind
                try:
                    await self.store.delete_session(owner, info.id)
                except GatewayError:
                    pass
            raise

    async def regenerate(self, owner: str, session_id: str, params: dict[str, Any],
                         replaces: str | None = None, tools: dict[str, Any] | None = None) -> StartedTurn:
        """Generate a new reply to the chat's last user message; the last reply is kept
        as a version (``SessionStore.switch_version`` shows it again). Same errors as
        ``chat``, and ``conflict`` when ``replaces`` is given and is not the last reply's id.
        ``tools``: as for ``chat``."""
        info, merged = await self.starter.preamble(owner, session_id, params)
        begun = await self.starter.begin(owner, info, "regenerate", replaces=replaces)
        return await self.starter.launch(self._request(owner, info, begun, merged, None, tools=tools or {}))

    async def edit(self, owner: str, session_id: str, message_id: str, content: str, params: dict[str, Any],
                   client_msg_id: str | None, attachments: list[dict[str, Any]] | None = None) -> StartedTurn:
        """Replace the user message ``message_id`` (and everything after it) with
        ``content`` and start its reply; the old branch stays as a version the user can
        switch back to (``SessionStore.switch_version``). Same errors as ``chat``, and
        ``conflict`` when the chat has no such user message."""
        info, merged = await self.starter.preamble(owner, session_id, params)
        begun = await self.starter.begin(owner, info, "edit", content=content, client_msg_id=client_msg_id,
                                         replaces=message_id, attachments=attachments)
        return await self.starter.launch(self._request(owner, info, begun, merged, client_msg_id))

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
        info, merged = await self.starter.preamble(owner, session_id, params)
        begun = await self.starter.begin(owner, info, "continue", replaces=message_id)
        continued = self.starter.continued(begun, info.model)
        if isinstance(continued, str):
            await self.store.fail_turn(owner, info.id, begun, None)
            raise GatewayError("invalid_request", continued)
        max_tokens, budget = continue_budget(continued.segment, continued.message.get("finish_reason"), params,
                                             merged.get("max_tokens"))
        if max_tokens is not None:
            merged = {**merged, "max_tokens": max_tokens}
        return await self.starter.launch(self._request(owner, info, begun, merged, None, continued=continued,
                                                       budget=budget))

    def served_models(self) -> list[str]:
        """The models the gateway's engines serve (those that said hello), in
        ``ENGINE_URLS`` order, each once."""
        return self.starter.served_models()

    def check_model(self, model: str | None) -> None:
        """Raises:
            GatewayError: ``model_not_found`` when ``model`` is not served here (``TurnStarter.check_model``)."""
        self.starter.check_model(model)

    # ---- following and cancelling ------------------------------------------------------

    def reply_log(self, request_id: str) -> ReplyLog | None:
        """The in-memory entries of a reply running on this gateway, else None."""
        turn = self.running.get(request_id)
        return turn.writer.log if turn is not None else None

    async def cancel(self, owner: str, request_id: str) -> None:
        """Stop a reply of ``owner`` now, wherever it runs.

        Raises:
            GatewayError: ``not_found`` for an unknown, finished or foreign reply.
        """
        await self.cancels.cancel(owner, request_id)
