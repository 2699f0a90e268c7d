"""Revocation reaches what is already open: sockets and streams close when their token is
revoked or their user's data is deleted, on every gateway replica, within a second.

A personal access token is checked when a request or a socket's handshake arrives
(``gateway/api/access_tokens.py``). Revoking it (``DELETE /api/tokens/{id}``) refuses it from then on,
but a socket opened with it, or a ``/v1`` stream begun with it, would go on. So every
long-lived connection registers here (``hold``) with its user and, when it came with a
token, the token's id and stored hash; a revocation closes the matching ones:

* the gateway that revokes closes its own at once, then publishes
  ``{"kind": "token", "uid", "id"}`` (or ``{"kind": "user", "uid"}`` when the user's data
  was deleted: every connection of that user, cookie or token) on the pub/sub channel
  ``{prefix}chat:revocations``, which every gateway subscribes to (as live events and
  cancels already travel);
* a connection that registers just after a revocation went by (its token was resolved a
  moment before) is closed by the recent-revocation memory (``RECENT_S``);
* a gateway whose subscription was down may have missed messages: each time it
  (re)subscribes it checks in Redis that every token it holds a connection of still
  exists, and closes those that do not.

What "close" means is the holder's: a browser socket closes with code 1008 and a reason
(its replies go on and are stored; only that client is cut off), a ``/v1`` request ends
as if its client had left, with an ``invalid_token`` error to the client (``openai_api``).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis

from gateway.api.access_tokens import TokenStore
from gateway.retry import Backoff, Outage, keep_connected
from gateway.store.connection import close_quietly
from gateway.store.keys import Keys

__all__ = ["TOKEN_REVOKED", "USER_DELETED", "Revocations"]

log = logging.getLogger("gateway.api.revocation")

TOKEN_REVOKED = "access token revoked"  # the close reasons a client sees
USER_DELETED = "user data deleted"
RECENT_S = 60.0  # how long a revocation is remembered for connections registering late (seconds)
BACKOFF_S = (0.2, 5.0)  # reconnecting the subscription (seconds)


@dataclass
class _Holder:
    uid: str
    token_id: str | None
    token_hash: str | None
    close: Callable[[str], None]
    closed: bool = False


class Revocations:
    """This gateway's long-lived connections by user and token, closed on revocation.

    Args:
        redis: the gateway's Redis client (publishes and subscribes).
        tokens: the token store (to check, after a broken subscription, which tokens live).
        prefix: the Redis key prefix.
    """

    def __init__(self, redis: aioredis.Redis, tokens: TokenStore, prefix: str = "") -> None:
        self.redis = redis
        self.tokens = tokens
        self.channel = Keys(prefix).revocations_channel()
        self._holders: dict[int, _Holder] = {}
        self._ids = itertools.count()
        self._recent: deque[tuple[float, str, str, str | None]] = deque()  # (time, kind, uid, token id)
        self._task: asyncio.Task[None] | None = None
        self.closed_total = 0  # connections closed by a revocation (tests, metrics)

    # ---- connections ------------------------------------------------------------------

    def hold(self, uid: str, close: Callable[[str], None], token_id: str | None = None,
             token_hash: str | None = None) -> Callable[[], None]:
        """Register a connection of user ``uid`` (opened with the token ``token_id``, whose
        stored hash is ``token_hash``, or with a cookie); ``close(reason)`` is called once,
        on the event loop, when it must go. Returns the function that unregisters it."""
        key = next(self._ids)
        holder = _Holder(uid, token_id, token_hash, close)
        self._holders[key] = holder
        self._forget_old()
        for _, kind, r_uid, r_id in self._recent:
            if r_uid == uid and (kind == "user" or (token_id is not None and r_id == token_id)):
                self._close(holder, USER_DELETED if kind == "user" else TOKEN_REVOKED)
                break

        def release() -> None:
            self._holders.pop(key, None)

        return release

    def _close(self, holder: _Holder, reason: str) -> None:
        if holder.closed:
            return
        holder.closed = True
        self.closed_total += 1
        try:
            holder.close(reason)
        except Exception:  # one holder's failure must not stop the others
            log.exception("closing a revoked connection failed")

    def _apply(self, kind: str, uid: str, token_id: str | None) -> None:
        self._recent.append((time.monotonic(), kind, uid, token_id))
        self._forget_old()
        reason = USER_DELETED if kind == "user" else TOKEN_REVOKED
        for h in list(self._holders.values()):
            if h.uid == uid and (kind == "user" or (h.token_id is not None and h.token_id == token_id)):
                self._close(h, reason)

    def _forget_old(self) -> None:
        horizon = time.monotonic() - RECENT_S
        while self._recent and self._recent[0][0] < horizon:
            self._recent.popleft()

    # ---- revoking ---------------------------------------------------------------------

    async def revoke_token(self, uid: str, token_id: str) -> None:
        """Close every connection opened with user ``uid``'s token ``token_id``, here at once
        and on the other replicas through Redis (call after the token was deleted)."""
        await self._publish({"kind": "token", "uid": uid, "id": token_id})

    async def revoke_user(self, uid: str) -> None:
        """Close every connection of user ``uid`` (its data was deleted), on every replica."""
        await self._publish({"kind": "user", "uid": uid})

    async def _publish(self, message: dict[str, str]) -> None:
        self._apply(message["kind"], message["uid"], message.get("id"))
        try:
            await self.redis.publish(self.channel, json.dumps(message))
        except Exception as e:  # the other replicas re-check their tokens when they resubscribe
            log.warning("could not publish a revocation (%s); other gateways find it when Redis is back", e)

    # ---- the subscription ---------------------------------------------------------------

    async def start(self) -> None:
        """Start listening for revocations from the other replicas."""
        self._task = asyncio.create_task(self._listen(), name="revocations")

    async def close(self) -> None:
        """Stop listening."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _listen(self) -> None:
        await keep_connected(self._session, outage=Outage("revocations", log), backoff=Backoff(*BACKOFF_S))

    async def _session(self, connected: Callable[[], None]) -> None:
        """One subscription: re-checks the open tokens (what a broken subscription may have
        missed), then applies each revocation it hears."""
        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(self.channel)
            await self._recheck_tokens()
            connected()
            async for msg in pubsub.listen():
                if msg.get("type") != "message":
                    continue
                try:
                    d = json.loads(msg["data"])
                    self._apply(str(d["kind"]), str(d["uid"]), d.get("id"))
                except (ValueError, KeyError, TypeError):
                    log.warning("ignored a malformed revocation message")
        finally:
            await close_quietly(pubsub)

    async def _recheck_tokens(self) -> None:
        """Close the connections whose token no longer exists in Redis."""
        by_hash: dict[str, list[_Holder]] = {}
        for h in self._holders.values():
            if h.token_hash and not h.closed:
                by_hash.setdefault(h.token_hash, []).append(h)
        if not by_hash:
            return
        hashes = list(by_hash)
        for digest, exists in zip(hashes, await self.tokens.alive(hashes)):
            if not exists:
                for h in by_hash[digest]:
                    self._close(h, TOKEN_REVOKED)
