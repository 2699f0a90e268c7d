"""Personal access tokens: one identity for the browser, the terminal client and the API.

A user (the random id of the browser's cookie, ``gateway.api.auth``) creates tokens in the
page's "Access tokens" dialog. A token (``cspat_`` + 43 URL-safe characters, 256 random
bits) is shown once; Redis keeps only its SHA-256, so a leaked database does not leak
usable tokens. A request that presents a token acts as the token's user, exactly as
that user's cookie would: the same chats, listed in the same sidebar.

Where a token is accepted (``token_from_scope``):

* ``X-Chat-Token: <token>`` on any request (HTTP or the WebSocket handshake);
* ``Authorization: Bearer cspat_...`` on any request. A bearer without the prefix is
  not ours: it is left to the OpenAI API's operator key (``API_KEY``), which keeps its
  meaning (with a key configured, ``/v1`` still requires it as the bearer; the user then
  comes from ``X-Chat-Token``).

A token that does not resolve (unknown, revoked, malformed) is refused with HTTP 401 and
``WWW-Authenticate: Bearer error="invalid_token"`` (a WebSocket handshake gets the same
401 before the upgrade), never silently treated as anonymous.

Layout (under the gateway's key prefix):

    chat:token:{sha256 hex}      hash    uid, id, name, created_at
    chat:user:{uid}:tokens       hash    token id -> {"id", "name", "created_at", "hint", "hash"}
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.api.auth import header
from gateway.api.state import gateway_state
from gateway.errors import GatewayError
from gateway.store.keys import Keys
from gateway.store.sessions import dumps, redis_errors

TOKEN_PREFIX = "cspat_"
TOKEN_HEADER = b"x-chat-token"
MAX_TOKENS_PER_USER = 20
MAX_NAME_CHARS = 80
_TOKEN_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


class InvalidToken(Exception):
    """A presented token does not name a live token (unknown, revoked or malformed)."""


def token_hash(token: str) -> str:
    """The stored form of a token: SHA-256 of its UTF-8 bytes, 64 hex characters."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def well_formed(token: str) -> bool:
    """True when ``token`` has the shape this module issues (prefix + 43 URL-safe characters)."""
    body = token[len(TOKEN_PREFIX):]
    return token.startswith(TOKEN_PREFIX) and len(body) == 43 and set(body) <= _TOKEN_CHARS


def token_from_scope(scope: Scope) -> str | None:
    """The personal token a request presents (``X-Chat-Token``, else a ``cspat_``
    bearer), or None when it presents none. An empty ``X-Chat-Token`` counts as none."""
    explicit = (header(scope, TOKEN_HEADER) or "").strip()
    if explicit:
        return explicit
    scheme, _, value = (header(scope, b"authorization") or "").partition(" ")
    value = value.strip()
    if scheme.lower() == "bearer" and value.startswith(TOKEN_PREFIX):
        return value
    return None


@dataclass
class TokenInfo:
    """A token as its owner sees it (never the token itself after creation).

    Attributes:
        id: 12 hex characters naming the token (for revoking it).
        name: the owner's label (at most ``MAX_NAME_CHARS`` characters).
        created_at: Unix seconds.
        hint: the token's first 10 characters (``cspat_ab12``), to recognise it.
        digest: its stored SHA-256 (hex), known when it was resolved from a request.
    """

    id: str
    name: str
    created_at: float
    hint: str
    digest: str = ""

    def public(self) -> dict[str, Any]:
        """The JSON shape of ``GET /api/tokens`` items."""
        return {"id": self.id, "name": self.name, "created_at": self.created_at, "hint": self.hint}


class TokenStore:
    """Creates, lists, revokes and resolves personal tokens in Redis.

    Raises (every async method):
        GatewayError: ``store_unavailable`` when Redis cannot be reached.
    """

    def __init__(self, redis: aioredis.Redis, prefix: str = "") -> None:
        self.redis = redis
        self.keys = Keys(prefix)
        self._token_key, self._user_key = self.keys.token, self.keys.user_tokens

    async def create(self, uid: str, name: str = "") -> tuple[str, TokenInfo]:
        """A new token for user ``uid``; returns the token (shown once) and its info.

        Raises:
            ValueError: the user already has ``MAX_TOKENS_PER_USER`` tokens.
        """
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        digest = token_hash(token)
        info = TokenInfo(secrets.token_hex(6), name.strip()[:MAX_NAME_CHARS] or "token", time.time(),
                         token[:len(TOKEN_PREFIX) + 4])
        async with redis_errors():
            if await self.redis.hlen(self._user_key(uid)) >= MAX_TOKENS_PER_USER:
                raise ValueError(f"at most {MAX_TOKENS_PER_USER} tokens per user; revoke one first")
            pipe = self.redis.pipeline(transaction=True)
            pipe.hset(self._token_key(digest), mapping={"uid": uid, "id": info.id, "name": info.name,
                                                        "created_at": str(info.created_at)})
            pipe.hset(self._user_key(uid), info.id, dumps({**info.public(), "hash": digest}))
            await pipe.execute()
        return token, info

    async def list(self, uid: str) -> list[TokenInfo]:
        """The user's live tokens, oldest first."""
        async with redis_errors():
            rows = await self.redis.hvals(self._user_key(uid))
        out = []
        for raw in rows:
            d = json.loads(raw)
            out.append(TokenInfo(d["id"], d["name"], float(d["created_at"]), d["hint"]))
        return sorted(out, key=lambda t: t.created_at)

    async def revoke(self, uid: str, token_id: str) -> bool:
        """Revoke one of the user's tokens at once; False when the user has no such token."""
        async with redis_errors():
            raw = await self.redis.hget(self._user_key(uid), token_id)
            if raw is None:
                return False
            digest = json.loads(raw)["hash"]
            pipe = self.redis.pipeline(transaction=True)
            pipe.delete(self._token_key(digest))
            pipe.hdel(self._user_key(uid), token_id)
            await pipe.execute()
        return True

    async def resolve(self, token: str) -> tuple[str, TokenInfo]:
        """The user id and info of a presented token.

        Raises:
            InvalidToken: unknown, revoked or malformed.
        """
        if not well_formed(token):
            raise InvalidToken("malformed token")
        async with redis_errors():
            d: dict[str, str] = await self.redis.hgetall(self._token_key(token_hash(token)))  # type: ignore[assignment]  # decode_responses
        if not d or "uid" not in d:
            raise InvalidToken("unknown or revoked token")
        return d["uid"], TokenInfo(d["id"], d.get("name", ""), float(d.get("created_at", 0)),
                                   token[:len(TOKEN_PREFIX) + 4], token_hash(token))

    async def alive(self, digests: Sequence[str]) -> tuple[bool, ...]:
        """Whether each stored token hash still names a live token (one round trip)."""
        async with redis_errors():
            pipe = self.redis.pipeline(transaction=False)
            for digest in digests:
                pipe.exists(self._token_key(digest))
            return tuple(bool(n) for n in await pipe.execute())

    async def revoke_all(self, uid: str) -> tuple[str, ...]:
        """Revoke every token of user ``uid``; returns their ids."""
        async with redis_errors():
            rows: dict[str, str] = await self.redis.hgetall(self._user_key(uid))  # type: ignore[assignment]  # decode_responses
            pipe = self.redis.pipeline(transaction=True)
            for raw in rows.values():
                pipe.delete(self._token_key(json.loads(raw)["hash"]))
            pipe.delete(self._user_key(uid))
            await pipe.execute()
        return tuple(rows)


INVALID_TOKEN_BODY = json.dumps({"error": {
    "code": "invalid_token", "type": "invalid_request_error", "param": None,
    "message": "The access token is unknown or was revoked; create one in the chat page's Access tokens "
               "dialog."}}).encode()
UNAVAILABLE_BODY = json.dumps({"error": {
    "code": "store_unavailable", "type": "server_error", "param": None,
    "message": "the chat store (Redis) is unreachable; try again shortly"}}).encode()
WWW_AUTHENTICATE = (b"www-authenticate", b'Bearer realm="chatserve", error="invalid_token"')


class TokenAuthMiddleware:
    """Pure ASGI middleware: a request presenting a personal token acts as its user.

    Sets ``scope["state"]["user_id"]`` to the token's user and ``scope["state"]["auth"]``
    to ``"token"`` (``UserCookieMiddleware``, inside this one, then leaves the request
    alone: no cookie is created for it). Requests without a token pass through. A bad
    token answers 401 (HTTP and WebSocket handshakes alike), Redis down 503.
    The store is the lifespan state's ``GatewayState.tokens``.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        token = token_from_scope(scope)
        if token is None:
            await self.app(scope, receive, send)
            return
        try:
            uid, info = await gateway_state(scope).tokens.resolve(token)
        except InvalidToken:
            await _refuse(scope, send, 401, INVALID_TOKEN_BODY, [WWW_AUTHENTICATE])
            return
        except GatewayError:
            await _refuse(scope, send, 503, UNAVAILABLE_BODY, [])
            return
        state = scope.setdefault("state", {})
        state["user_id"] = uid
        state["auth"] = "token"
        state["token"] = info
        await self.app(scope, receive, send)


async def _refuse(scope: Scope, send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    """Answer an HTTP request, or refuse a WebSocket handshake, with a JSON body."""
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]
    kind = "websocket.http.response" if scope["type"] == "websocket" else "http.response"
    if scope["type"] == "websocket" and "websocket.http.response" not in scope.get("extensions", {}):
        await send({"type": "websocket.close", "code": 1008})
        return
    await send({"type": f"{kind}.start", "status": status, "headers": hdrs})
    await send({"type": f"{kind}.body", "body": body})
