"""CORS for the ``/v1`` API: browser pages of the configured origins (``CORS_ORIGINS``;
``*`` for any) may call it, preflight ``OPTIONS`` included. Off by default; the chat
page, ``/api`` and the WebSocket are never opened to other origins by it (their own
origin checks stay: docs/protocol.md section 2)."""

from __future__ import annotations

from collections.abc import Sequence

from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

API_PREFIX = "/v1/"
# what SDKs running in a browser send besides the simple headers
ALLOWED_HEADERS = ("authorization", "content-type", "x-chat-token", "x-chat-session", "idempotency-key",
                   "anthropic-version", "x-api-key", "openai-organization", "openai-project")
EXPOSED_HEADERS = ("x-request-id", "x-chat-session")


class ApiCorsMiddleware:
    """Starlette's ``CORSMiddleware`` for ``/v1`` paths only (see module doc).

    Args:
        app: the next ASGI app.
        origins: allowed origins (``https://app.example``, or ``*``).
    """

    def __init__(self, app: ASGIApp, origins: Sequence[str]) -> None:
        self.app = app
        # credentials (cookies) are not allowed: the API authenticates by bearer key
        self.cors = CORSMiddleware(app, allow_origins=list(origins), allow_methods=["GET", "POST", "OPTIONS"],
                                   allow_headers=list(ALLOWED_HEADERS), expose_headers=list(EXPOSED_HEADERS),
                                   allow_credentials=False, max_age=600)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(API_PREFIX):
            await self.cors(scope, receive, send)
        else:
            await self.app(scope, receive, send)
