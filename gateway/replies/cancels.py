"""Stopping a reply wherever it runs: a cancel of a reply running on this gateway aborts
its engine request at once; one running on another replica is published on the cancel
channel, to which every replica listens (through the one reconnect loop,
``gateway/retry.py``)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import redis.asyncio as aioredis

from gateway.errors import not_found
from gateway.replies.store_retry import STORE_BACKOFF_S
from gateway.replies.turn import Turn
from gateway.retry import Backoff, Outage, keep_connected
from gateway.store.connection import close_quietly
from gateway.store.keys import Keys
from gateway.store.reply_streams import ReplyStreams

log = logging.getLogger("gateway.replies.cancels")


class Cancels:
    """Cancels replies across replicas.

    Args:
        running: this gateway's running replies by request id (shared, not copied).
        redis, keys, streams: the store.
        cancel_grace_s: how long a cancelled reply waits for the engine's confirmation (s).
    """

    def __init__(self, running: dict[str, Turn], redis: aioredis.Redis, keys: Keys, streams: ReplyStreams,
                 cancel_grace_s: float) -> None:
        self.running = running
        self.redis = redis
        self.keys = keys
        self.streams = streams
        self.cancel_grace_s = cancel_grace_s
        self._listener: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Listen for cancels published by other gateway replicas."""
        self._listener = asyncio.create_task(keep_connected(
            self._session, outage=Outage("cancel listener", log), backoff=Backoff(*STORE_BACKOFF_S)),
            name="cancel-listener")

    def close(self) -> None:
        """Stop listening."""
        if self._listener:
            self._listener.cancel()

    async def _session(self, connected: Callable[[], None]) -> None:
        """One subscription to the cancel channel: cancels the replies it names that run here."""
        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(self.keys.cancel_channel())
            connected()
            async for msg in pubsub.listen():
                turn = self.running.get(str(msg.get("data")))
                if turn is not None:
                    await self.local(turn)
        finally:
            await close_quietly(pubsub)

    async def cancel(self, owner: str, request_id: str) -> None:
        """Stop a reply of ``owner`` now, wherever it runs.

        Raises:
            GatewayError: ``not_found`` for an unknown, finished or foreign reply.
        """
        turn = self.running.get(request_id)
        if turn is not None:
            if turn.request.owner != owner:
                raise not_found("reply")
            await self.local(turn)
            return
        head = await self.streams.head(request_id)
        last = await self.streams.last(request_id)
        if head is None or head.fields.get("owner") != owner or last is None or last.terminal:
            raise not_found("reply")
        await self.redis.publish(self.keys.cancel_channel(), request_id)

    async def local(self, turn: Turn, reason: str = "user_stop") -> None:
        """Cancel a reply running here (once): abort its engine request and give the
        engine ``cancel_grace_s`` to confirm; ``reason`` is stored as its ``cut_reason``."""
        c = turn.cancel
        if c.requested:
            return
        c.requested, c.reason = True, reason
        c.deadline = time.monotonic() + self.cancel_grace_s
        if turn.run is not None:
            await turn.run.abort()
            turn.run.wake()  # re-evaluate the deadline
