"""Anonymous users and the WebSocket ``Origin`` check.

A user is a random id held in a signed cookie (``chat_uid``: HttpOnly, SameSite=Lax,
signed with itsdangerous under the gateway's secret). Whoever holds the cookie owns
its chats. ``UserCookieMiddleware`` gives every HTTP request a user (creating one and
setting the cookie on the first visit); WebSocket handshakes must already carry one.

Browsers do not apply CORS to WebSockets, so the handshake's ``Origin`` is checked
here against the page's own origin plus the configured ones (cross-site WebSocket
hijacking would otherwise ride on the cookie).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from http.cookies import SimpleCookie

from itsdangerous import BadSignature, Signer
from starlette.types import ASGIApp, Message, Receive, Scope, Send

COOKIE_NAME = "chat_uid"
COOKIE_MAX_AGE_S = 400 * 24 * 3600  # the longest browsers keep a cookie
_SALT = "chat-user-id"
COOKIELESS_PATHS = frozenset({"/healthz", "/readyz"})  # probes need no user and get no cookie


class UserIds:
    """Creates user ids and signs/verifies them for the cookie."""

    def __init__(self, secret: str) -> None:
        self._signer = Signer(secret, salt=_SALT)

    @staticmethod
    def new_id() -> str:
        """A fresh random user id (32 hex characters)."""
        return secrets.token_hex(16)

    def sign(self, uid: str) -> str:
        """The cookie value for ``uid``."""
        return self._signer.sign(uid).decode()

    def verify(self, value: str | None) -> str | None:
        """The user id in a cookie value, or None when missing, forged or malformed."""
        if not value:
            return None
        try:
            uid = self._signer.unsign(value).decode()
        except (BadSignature, UnicodeDecodeError):
            return None
        return uid if len(uid) == 32 and all(c in "0123456789abcdef" for c in uid) else None


def header(scope: Scope, name: bytes) -> str | None:
    """The first value of request header ``name`` (lower-case bytes), decoded as latin-1."""
    for key, value in scope.get("headers", ()):
        if key == name:
            return str(value.decode("latin-1"))
    return None


def cookie_value(scope: Scope, name: str = COOKIE_NAME) -> str | None:
    """The value of cookie ``name`` in the request, or None."""
    raw = header(scope, b"cookie")
    if not raw:
        return None
    jar = SimpleCookie()
    try:
        jar.load(raw)
    except Exception:  # a malformed Cookie header means "no cookie", never a 500
        return None
    morsel = jar.get(name)
    return morsel.value if morsel else None


def set_cookie_header(value: str, secure: bool) -> tuple[bytes, bytes]:
    """The ``Set-Cookie`` header carrying the signed user id."""
    parts = [f"{COOKIE_NAME}={value}", "Path=/", f"Max-Age={COOKIE_MAX_AGE_S}", "HttpOnly", "SameSite=Lax"]
    if secure:
        parts.append("Secure")
    return b"set-cookie", "; ".join(parts).encode("latin-1")


def request_user(scope: Scope) -> str | None:
    """The user id that ``UserCookieMiddleware`` (HTTP) or the WebSocket endpoint put in scope."""
    uid = scope.get("state", {}).get("user_id")
    return uid if isinstance(uid, str) else None


class UserCookieMiddleware:
    """Pure ASGI middleware: puts the user id in ``scope["state"]["user_id"]`` for HTTP
    requests, creating a user and setting the cookie when the request has no valid one.
    WebSocket scopes get the id only if their cookie verifies (None otherwise). A request
    that ``gateway.api.access_tokens.TokenAuthMiddleware`` already identified by a personal token
    (``state["auth"] == "token"``) passes untouched; others get ``state["auth"] = "cookie"``."""

    def __init__(self, app: ASGIApp, ids: UserIds) -> None:
        self.app = app
        self.ids = ids

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        if state.get("auth") == "token":  # TokenAuthMiddleware named the user: no cookie needed
            await self.app(scope, receive, send)
            return
        uid = self.ids.verify(cookie_value(scope))
        state["auth"] = "cookie"
        if uid is not None or scope["type"] == "websocket" or scope.get("path") in COOKIELESS_PATHS:
            state["user_id"] = uid
            await self.app(scope, receive, send)
            return
        uid = self.ids.new_id()
        state["user_id"] = uid
        cookie = set_cookie_header(self.ids.sign(uid), secure=scope.get("scheme") == "https")

        async def send_with_cookie(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = dict(message)
                message["headers"] = list(message.get("headers", [])) + [cookie]
            await send(message)

        await self.app(scope, receive, send_with_cookie)


def own_origins(scope: Scope) -> set[str]:
    """The origins of the page this gateway serves, from the request's ``Host``.

    Both http and https are accepted for the same host: behind a TLS-terminating
    proxy the gateway sees ``ws`` while the page is ``https``; the host must match.
    """
    host = header(scope, b"host")
    if not host:
        return set()
    host = host.strip().lower()
    return {f"http://{host}", f"https://{host}"}


def host_trusted(scope: Scope, trusted_hosts: Iterable[str]) -> bool:
    """True when the request's ``Host`` name (port ignored) matches one of
    ``trusted_hosts`` (exact, ``*.domain``, or ``*``)."""
    raw = (header(scope, b"host") or "").strip().lower()
    if raw.startswith("["):  # an IPv6 literal keeps its brackets
        name = raw[: raw.find("]") + 1] if "]" in raw else ""
    else:
        name = raw.rsplit(":", 1)[0] if raw.count(":") == 1 else raw
    if not name:
        return False
    return any(p == "*" or name == p or (p.startswith("*.") and name.endswith(p[1:])) for p in trusted_hosts)


def origin_allowed(scope: Scope, extra_allowed: Iterable[str], trusted_hosts: Iterable[str] = ("*",)) -> bool:
    """True when the handshake's ``Origin`` is the page's own or a configured one.

    A missing ``Origin`` is refused: browsers always send it, and the protocol
    (docs/protocol.md section 2) requires it of every client. The page's own origin
    counts only when its ``Host`` is one of ``trusted_hosts`` (``GatewayConfig.trusted_hosts``):
    a DNS-rebinding page sends a matching ``Host`` and ``Origin`` of its own name.
    """
    origin = header(scope, b"origin")
    if not origin:
        return False
    origin = origin.strip().lower().rstrip("/")
    own = own_origins(scope) if host_trusted(scope, trusted_hosts) else set()
    allowed = own | {o.lower() for o in extra_allowed}
    return origin in allowed
