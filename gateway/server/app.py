"""The Starlette application factory (no globals: the lifespan yields the running parts
as one typed ``GatewayState``, see ``gateway.api.state``).

Routes: ``GET /`` (the chat page from ``web/index.html``), ``/static``, ``/sw.js`` and
``/manifest.webmanifest`` (the page's service worker and manifest, from ``static/``), ``WS /ws``,
``/api/...`` (http_api), ``/healthz``, ``/readyz``, plus any ``extra_routes`` (the
OpenAI API and ``/metrics`` plug in there) and ``events`` hooks on every reply.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import redis.asyncio as aioredis
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates
from starlette.types import Message, Receive, Scope, Send

from gateway.api.access_tokens import TokenAuthMiddleware, TokenStore
from gateway.api.attachments_api import TokenCounter, attachment_routes
from gateway.api.auth import UserCookieMiddleware, UserIds
from gateway.api.chat_export import export_routes
from gateway.api.cors import ApiCorsMiddleware
from gateway.api.http import api_routes, config_body, script_safe_json
from gateway.api.revocation import Revocations
from gateway.api.shares import share_routes
from gateway.api.socket import TAIL_BLOCK_MS, WsStats, websocket_endpoint, websocket_not_found
from gateway.api.state import GatewayState, LifespanState, gateway_state
from gateway.api.user_api import user_routes
from gateway.config import GatewayConfig
from gateway.engines.cache_scope import CacheIsolation
from gateway.engines.client import EngineRouter
from gateway.engines.routing import Placements
from gateway.engines.upstream import engine_client
from gateway.replies.hooks import GenerationEvents
from gateway.replies.manager import GenerationManager
from gateway.server.disconnects import ClientDisconnects, DisconnectMiddleware
from gateway.server.http_limits import ConnectionStats
from gateway.store.connection import handshake_options, packing_options, resilience_options
from gateway.store.imports import ChatTransfer
from gateway.store.keys import Keys
from gateway.store.live_events import LiveHub
from gateway.store.reply_streams import ReplyStreams
from gateway.store.sessions import SessionStore
from gateway.store.user_defaults import UserDefaultsStore

log = logging.getLogger("gateway")

# The page's CSP, as a header (a <meta> tag cannot carry frame-ancestors, and a header
# covers every response): only our own scripts and styles, nothing fetched from
# elsewhere, sockets only to this origin (connect-src 'self' covers ws: and wss: of it).
CONTENT_SECURITY_POLICY = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                           "font-src 'self'; connect-src 'self'; object-src 'none'; base-uri 'none'; "
                           "form-action 'none'; frame-ancestors 'none'")
SECURITY_HEADERS = [
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),
    (b"x-frame-options", b"DENY"),
    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
]


class SecurityHeadersMiddleware:
    """Adds ``SECURITY_HEADERS`` to every HTTP response."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = dict(message)
                message["headers"] = list(message.get("headers", [])) + SECURITY_HEADERS
            await send(message)

        await self.app(scope, receive, send_with_headers)


class RevalidatedStaticFiles(StaticFiles):
    """``/static``, which browsers revalidate at each use (``Cache-Control: no-cache``;
    unchanged files answer 304 by their ETag). Without it a browser keeps a file it
    guesses is fresh (heuristic caching from Last-Modified), so after an upgrade a page
    could run new modules beside old ones."""

    def file_response(self, *args: Any, **kwargs: Any) -> Response:
        """The file (or 304), with ``Cache-Control: no-cache``."""
        response = super().file_response(*args, **kwargs)
        response.headers["Cache-Control"] = "no-cache"
        return response


class GatewayApp(Starlette):
    """The gateway's Starlette app: ``connections`` (the server's connection counters,
    handed to uvicorn's protocols by ``gateway.server.serving.uvicorn_config``) and,
    once the lifespan started, ``gateway`` (the ``GatewayState`` every request reads
    through ``gateway_state``; for tests and benchmarks outside a request)."""

    def __init__(self, connections: ConnectionStats, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.connections = connections
        self.started: GatewayState | None = None

    @property
    def gateway(self) -> GatewayState:
        """The running gateway's parts.

        Raises:
            RuntimeError: the lifespan has not started (or has ended).
        """
        if self.started is None:
            raise RuntimeError("the gateway's lifespan has not started")
        return self.started


FALLBACK_PAGE = """<!doctype html><meta charset="utf-8"><title>chat</title>
<p>The chat UI (web/index.html) is not installed. The API is at /api and the socket at /ws.</p>"""


def create_app(config: GatewayConfig, *, extra_routes: Sequence[BaseRoute] = (),
               events: Sequence[GenerationEvents] = ()) -> GatewayApp:
    """Build the gateway application.

    Args:
        config: settings (``engine_urls`` must name at least one engine for replies: our
            engines' ``ws://`` urls and OpenAI-compatible ``http(s)://`` upstreams).
        extra_routes: more routes (e.g. ``/v1/...``, ``/metrics``); they see the same
            lifespan state (``gateway_state(request)``: a ``GatewayState``).
        events: hooks called on every reply (see ``gateway.replies.hooks``).
    Raises:
        OSError: the cookie secret cannot be read or created under ``data_dir``.
    """
    secret = config.resolve_secret()
    ids = UserIds(secret)
    isolation = CacheIsolation.of(secret, (config.defaults.system_prompt, *config.shared_prompts))
    templates = Jinja2Templates(directory=str(config.web_dir))
    disconnects = ClientDisconnects()  # a client that hangs up is counted, not logged (disconnects.py)
    connections = ConnectionStats()

    @asynccontextmanager
    async def lifespan(app: GatewayApp) -> AsyncIterator[LifespanState]:
        """Open Redis and the engine connections; close them (stopping replies) at exit."""
        # a bounded pool whose callers wait for a free connection (redis-py's default pool
        # raises MaxConnectionsError at once when all are busy, a 503 under mere latency);
        # a command that meets a stale connection retries on a fresh one (resilience_options)
        pool = aioredis.BlockingConnectionPool.from_url(
            config.redis_url, decode_responses=True, socket_connect_timeout=2, socket_timeout=10,
            max_connections=config.redis_max_connections, timeout=config.redis_pool_timeout_s,
            **resilience_options(), **handshake_options(), **packing_options())
        redis = aioredis.Redis(connection_pool=pool)
        # blocking stream reads hold a connection each while they wait
        tail_pool = aioredis.BlockingConnectionPool.from_url(
            config.redis_url, decode_responses=True, socket_connect_timeout=2,
            socket_timeout=TAIL_BLOCK_MS / 1000 + 10, max_connections=4096, timeout=30, **resilience_options(),
            **handshake_options(), **packing_options())
        tail_redis = aioredis.Redis(connection_pool=tail_pool)
        keys = Keys(config.key_prefix)
        lim = config.limits
        store = SessionStore(redis, keys, config.session_ttl_s, config.lock_lease_ms,
                             lim.max_sessions_per_user, lim.max_generations_per_user)
        streams = ReplyStreams(redis, tail_redis, keys, config.stream_ttl_s, config.stream_maxlen)
        router = EngineRouter((engine_client(u, config) for u in config.engine_urls),
                              config.routing, Placements(redis, config.key_prefix, config.session_ttl_s))
        gens = GenerationManager(config, store, streams, router, redis, list(events), isolation)
        user_defaults = gens.user_defaults = UserDefaultsStore(redis, config.key_prefix)
        tokens = TokenStore(redis, config.key_prefix)
        s = GatewayState(
            config=config, redis=redis, store=store, streams=streams, router=router, generations=gens,
            ws_stats=WsStats(), tokens=tokens, user_defaults=user_defaults, live=LiveHub(redis, keys),
            token_counter=TokenCounter(),  # the engines' tokenizers, loaded on first use
            chat_transfer=ChatTransfer(redis, store, keys, config.session_ttl_s, lim.max_sessions_per_user),
            revocations=Revocations(redis, tokens, config.key_prefix), disconnects=disconnects,
            connections=app.connections)
        await router.start()
        await gens.start()
        await s.live.start()
        await s.revocations.start()
        app.started = s
        try:
            yield {"gateway": s}  # gateway.api.state.STATE_KEY
        finally:
            app.started = None
            await s.revocations.close()
            await s.live.close()
            await gens.close()
            await router.close()
            await redis.aclose()
            await pool.aclose()
            await tail_redis.aclose()
            await tail_pool.aclose()  # a pool passed in is not closed by its client

    async def index(request: Request) -> Response:
        """GET /: the chat page (web/index.html with model_name, model_format, config_json, static_url)."""
        body = config_body(config, gateway_state(request).router)
        if not (config.web_dir / "index.html").exists():
            return HTMLResponse(FALLBACK_PAGE)
        return templates.TemplateResponse(request, "index.html", {
            "model_name": body["model"], "model_format": body.get("format"), "config_json": script_safe_json(body),
            "static_url": "/static", "ranges": body["ranges"]})  # the settings form's min/max: the engine's RANGES

    def static_file(name: str, media_type: str) -> Any:
        """A route serving ``static/{name}`` at the root, uncached by the browser (404 when absent)."""
        async def serve(request: Request) -> Response:
            path = config.static_dir / name
            if not path.is_file():
                return JSONResponse({"error": {"code": "not_found", "message": f"no {name}"}}, status_code=404)
            return FileResponse(path, media_type=media_type, headers={"Cache-Control": "no-cache"})
        return serve

    async def healthz(request: Request) -> Response:
        """GET /healthz: 200 while the process serves."""
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        """GET /readyz: 200 when Redis answers and an engine is connected, else 503."""
        state = gateway_state(request)
        try:
            redis_ok = bool(await asyncio.wait_for(state.redis.ping(), 2.0))
        except Exception:
            redis_ok = False
        engines = len(state.router.healthy)
        ok = redis_ok and engines > 0
        return JSONResponse({"status": "ready" if ok else "unavailable", "redis": redis_ok, "engines": engines},
                            status_code=200 if ok else 503)

    routes: list[BaseRoute] = [
        Route("/", index, methods=["GET"]),
        # installable (docs/ui.md): a service worker's scope is its own path's folder, so it
        # is served from the root; the manifest beside it
        Route("/sw.js", static_file("sw.js", "text/javascript"), methods=["GET"]),
        Route("/manifest.webmanifest", static_file("manifest.webmanifest", "application/manifest+json"),
              methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        WebSocketRoute("/ws", websocket_endpoint),
        *api_routes(),
        *user_routes(),
        *export_routes(),
        *attachment_routes(),
        *share_routes(),
        *extra_routes,
        WebSocketRoute("/{path:path}", websocket_not_found),
        Mount("/static", app=RevalidatedStaticFiles(directory=str(config.static_dir), check_dir=False), name="static"),
    ]
    # outermost first: hosts (a request for another host name, DNS rebinding, gets 400
    # before anything else), then headers; a personal token names the user before the
    # cookie is looked at
    middleware = [Middleware(DisconnectMiddleware, stats=disconnects),
                  Middleware(TrustedHostMiddleware, allowed_hosts=config.trusted_hosts(), www_redirect=False),
                  # a browser page of an allowed origin may call /v1 (preflight answered here)
                  *([Middleware(ApiCorsMiddleware, origins=config.cors_origins)] if config.cors_origins else []),
                  Middleware(SecurityHeadersMiddleware), Middleware(TokenAuthMiddleware),
                  Middleware(UserCookieMiddleware, ids=ids)]
    return GatewayApp(connections, routes=routes, middleware=middleware, lifespan=lifespan)


def new_secret() -> str:
    """A random cookie secret (for tests and throwaway gateways)."""
    return secrets.token_urlsafe(32)
