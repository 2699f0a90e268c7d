"""The gateway's running parts, as one typed lifespan state.

The app's lifespan (``gateway.server.app.create_app``) opens Redis and the engine links,
builds one ``GatewayState`` and yields it as Starlette's lifespan state
(``{"gateway": state}``, ``LifespanState``); the server copies that mapping into every
request's ``scope["state"]``. Handlers and middleware read it with ``gateway_state``,
the one accessor (a request, a WebSocket or a raw ASGI scope alike). Outside a request
(tests, benchmarks) the started app's ``GatewayApp.gateway`` is the same object.

See Starlette's "Lifespan State" (https://www.starlette.io/lifespan/#lifespan-state).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict

if TYPE_CHECKING:  # types only: the parts come from every floor below this one, and two from the server's
    import redis.asyncio as aioredis

    from gateway.api.access_tokens import TokenStore
    from gateway.api.attachments_api import TokenCounter
    from gateway.api.revocation import Revocations
    from gateway.api.socket import WsStats
    from gateway.config import GatewayConfig
    from gateway.engines.client import EngineRouter
    from gateway.replies.manager import GenerationManager
    from gateway.server.disconnects import ClientDisconnects
    from gateway.server.http_limits import ConnectionStats
    from gateway.store.imports import ChatTransfer
    from gateway.store.live_events import LiveHub
    from gateway.store.reply_streams import ReplyStreams
    from gateway.store.sessions import SessionStore
    from gateway.store.user_defaults import UserDefaultsStore

STATE_KEY = "gateway"  # the lifespan state's one key


@dataclass(frozen=True, slots=True)
class GatewayState:
    """Everything one running gateway holds, built once by the app's lifespan.

    Attributes:
        config: the settings the app was made with.
        redis: the shared Redis client (commands; blocking stream reads use ``streams``' own).
        store: chats, messages and turn locks.
        streams: the replies' Redis streams (written by the reply task, tailed by sockets).
        router: the engine links and the routing among them.
        generations: the replies running in this process (start, cancel, finish).
        ws_stats: the browser sockets' counters (``/metrics``).
        tokens: personal access tokens.
        user_defaults: each user's defaults for new chats.
        live: the cross-tab and cross-replica chat-list events.
        token_counter: the engines' tokenizers, loaded on first use.
        chat_transfer: chat import and export.
        revocations: token and cookie revocations, closing the sockets they cover.
        disconnects: HTTP clients that hung up, by route and stage (``/metrics``).
        connections: the server's connection caps and counters (``/metrics``).
    """

    config: GatewayConfig
    redis: aioredis.Redis
    store: SessionStore
    streams: ReplyStreams
    router: EngineRouter
    generations: GenerationManager
    ws_stats: WsStats
    tokens: TokenStore
    user_defaults: UserDefaultsStore
    live: LiveHub
    token_counter: TokenCounter
    chat_transfer: ChatTransfer
    revocations: Revocations
    disconnects: ClientDisconnects
    connections: ConnectionStats


class LifespanState(TypedDict):
    """What the app's lifespan yields (Starlette merges it into every ``scope["state"]``)."""

    gateway: GatewayState


def gateway_state(conn: Mapping[str, Any]) -> GatewayState:
    """The running gateway's parts, for a request, a WebSocket or an ASGI scope.

    Raises:
        KeyError: the app's lifespan has not run (a server without lifespan support).
    """
    state: GatewayState = conn["state"][STATE_KEY]
    return state
