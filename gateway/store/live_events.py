"""Live tabs: a change to a user's chats shows in all of that user's open pages, on any
gateway replica (docs/protocol.md, ``event`` frames).

Every store script that changes a chat publishes a small JSON event on the owner's
channel ``{prefix}chat:user:{uid}:sessions:events`` in the same atomic step
(``store_scripts.notify``), so no change can be made without its event. Each gateway
runs one ``LiveHub``: one Redis pub/sub connection, subscribed to the channels of the
users that have a socket open on this gateway, which forwards each event as an
``{"type": "event", ...}`` frame to those sockets. Events are hints to re-read (the
page fetches the chat or the list): a socket whose outbox is full skips one rather
than hold up the others, and a page re-reads everything after a reconnect anyway.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis

from gateway.retry import Backoff, Outage, keep_connected
from gateway.store.connection import close_quietly
from gateway.store.keys import Keys

log = logging.getLogger("gateway.store.live_events")

POLL_S = 0.2  # how often the listener applies (un)subscriptions between reads (seconds)
BACKOFF_S = (0.2, 5.0)  # first and longest wait before reconnecting to Redis (seconds)

Sink = Callable[[dict[str, Any]], bool]  # queues a frame without waiting; False when it could not


class LiveHub:
    """Forwards the chat events of the users connected here to their sockets.

    ``add(uid, sink)`` when a socket opens and ``remove(uid, sink)`` when it closes;
    ``start()``/``close()`` with the application.
    """

    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self.sinks: dict[str, set[Sink]] = {}
        self._task: asyncio.Task[None] | None = None
        self._uid_of: dict[str, str] = {}  # channel -> user id, for the channels subscribed
        self.subscribed: frozenset[str] = frozenset()  # users whose channel is subscribed now
        self.delivered_total = 0  # frames handed to sockets (tests and debugging)
        self.skipped_total = 0  # frames dropped because a socket's outbox was full

    def add(self, uid: str, sink: Sink) -> None:
        """Send ``uid``'s events to ``sink`` from now on (subscribed within ``POLL_S``)."""
        self.sinks.setdefault(uid, set()).add(sink)

    def remove(self, uid: str, sink: Sink) -> None:
        """Stop sending to ``sink``; the user's channel is left with their last socket."""
        s = self.sinks.get(uid)
        if s is not None:
            s.discard(sink)
            if not s:
                del self.sinks[uid]

    async def start(self) -> None:
        """Start the listener task."""
        self._task = asyncio.create_task(self._run(), name="live-events")

    async def close(self) -> None:
        """Stop the listener."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def _channel(self, uid: str) -> str:
        return self.keys.user_events(uid)

    def _dispatch(self, channel: str, data: str) -> None:
        sinks = self.sinks.get(self._uid_of.get(channel, ""))
        if not sinks:
            return
        try:
            event = json.loads(data)
        except ValueError:
            return
        frame = {"type": "event", **{k: v for k, v in event.items() if k in ("kind", "session_id", "request_id")}}
        for sink in list(sinks):
            if sink(frame):
                self.delivered_total += 1
            else:
                self.skipped_total += 1

    async def _run(self) -> None:
        await keep_connected(self._session, outage=Outage("live events", log), backoff=Backoff(*BACKOFF_S))

    async def _session(self, connected: Callable[[], None]) -> None:
        """One pub/sub connection: keeps the subscriptions to the users connected here and
        forwards their events until the connection fails."""
        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        subscribed: set[str] = set()
        try:
            while True:
                wanted = set(self.sinks)
                gone, new = subscribed - wanted, wanted - subscribed
                if new:
                    self._uid_of.update({self._channel(u): u for u in new})
                    await pubsub.subscribe(*(self._channel(u) for u in new))
                if gone:
                    await pubsub.unsubscribe(*(self._channel(u) for u in gone))
                    for u in gone:
                        self._uid_of.pop(self._channel(u), None)
                subscribed = wanted
                self.subscribed = frozenset(subscribed)
                connected()
                if not pubsub.subscribed:
                    await asyncio.sleep(POLL_S)
                    continue
                msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=POLL_S)
                while msg is not None:
                    if msg.get("type") == "message":
                        self._dispatch(str(msg["channel"]), str(msg["data"]))
                    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0)
        finally:
            self.subscribed = frozenset()
            await close_quietly(pubsub)
