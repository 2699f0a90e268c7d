"""Reply streams: one Redis Stream per reply (``chat:gen:{request_id}``) that the
generation task writes and any socket (on any gateway) tails at its own pace.

Entry ids are chosen, not generated, so that a ``seq`` is its own cursor:

    0-1          start  {t: "start", owner, session_id, message_id, user_message_id}
    n-1          delta  {t: "delta", x: text}       seq n = 1, 2, ... without gaps
    last-2       end    {t: "done", d: done JSON} or {t: "error", code, message}

Reading from id ``{k}-1`` returns exactly the deltas with seq > k and then the end.
Writes are idempotent (re-adding a taken entry id is a no-op), so the generation
task can retry them while Redis is away. The writes of all replies made in one
event-loop iteration (the replies of one engine step) go to Redis as one pipeline:
each writer still waits for, and gets the outcome of, its own entry. The start and end
entries refresh the key's TTL (``stream_ttl_s``), and so does a delta when the last
refresh from this gateway is older than ``TTL_REFRESH_S`` (at most a quarter of the
TTL), so a reply whose gateway died expires on its own; ``MAXLEN ~`` is a safety cap
far above any reply's frame count.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any, cast

import redis.asyncio as aioredis
import redis.exceptions as rexc

from gateway.errors import GatewayError
from gateway.store.keys import Keys
from gateway.store.sessions import dumps, redis_errors

TTL_REFRESH_S = 60.0  # a running reply's stream TTL is refreshed at least this often (seconds)


@dataclass(frozen=True)
class StreamEntry:
    """One decoded entry: ``kind`` is "start", "delta", "done" or "error"; ``seq`` the
    delta's seq (for start 0, for the end the last delta's seq)."""

    kind: str
    seq: int
    fields: dict[str, str]

    @property
    def terminal(self) -> bool:
        """True for the entry that ends the reply."""
        return self.kind in ("done", "error")


def _decode(entry_id: str, fields: dict[str, str]) -> StreamEntry:
    major, _, _minor = entry_id.partition("-")
    return StreamEntry(fields.get("t", ""), int(major), fields)


class ReplyStreams:
    """Writes and reads reply streams (see module doc).

    Raises (every async method):
        GatewayError: ``store_unavailable`` when Redis is unreachable.
    """

    def __init__(self, redis: aioredis.Redis, tail_redis: aioredis.Redis, keys: Keys, ttl_s: int, maxlen: int) -> None:
        """``tail_redis`` serves blocking reads (each holds a connection while it waits)."""
        self.redis = redis
        self.tail_redis = tail_redis
        self.keys = keys
        self.ttl = ttl_s
        self.maxlen = maxlen
        self._pending: list[tuple[str, str, dict[str, Any], asyncio.Future[None]]] = []
        self._flushes: set[asyncio.Task[None]] = set()
        self._refreshed: dict[str, float] = {}  # key -> monotonic time of its last EXPIRE from here
        self._refresh_s = min(TTL_REFRESH_S, ttl_s / 4)

    async def _add(self, rid: str, entry_id: str, fields: dict[str, Any]) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush_soon)  # after this iteration's other writers
        self._pending.append((self.keys.gen(rid), entry_id, fields, fut))
        await fut

    def _flush_soon(self) -> None:
        batch, self._pending = self._pending, []
        if batch:
            task = asyncio.create_task(self._flush(batch))
            self._flushes.add(task)
            task.add_done_callback(self._flushes.discard)

    async def _flush(self, batch: list[tuple[str, str, dict[str, Any], asyncio.Future[None]]]) -> None:
        """One pipeline (no MULTI: every command is idempotent) for the batch's entries;
        each entry's future gets its own outcome."""
        now = time.monotonic()
        spans: list[tuple[int, int]] = []  # each entry's commands in the pipeline's results
        try:
            async with redis_errors():
                pipe = self.redis.pipeline(transaction=False)
                n = 0
                for key, entry_id, fields, _ in batch:
                    pipe.xadd(key, cast("dict[Any, Any]", fields), id=entry_id, maxlen=self.maxlen, approximate=True)
                    kind = fields.get("t")
                    if kind != "delta" or now - self._refreshed.get(key, 0.0) >= self._refresh_s:
                        pipe.expire(key, self.ttl)
                        spans.append((n, n + 2))
                        n += 2
                        if kind in ("done", "error"):
                            self._refreshed.pop(key, None)
                        else:
                            self._refreshed[key] = now
                    else:
                        spans.append((n, n + 1))
                        n += 1
                results = await pipe.execute(raise_on_error=False)
        except (GatewayError, rexc.RedisError) as e:
            for *_, fut in batch:
                if not fut.done():
                    fut.set_exception(e)
            return
        except BaseException as e:  # cancelled with the gateway, or a bug: no writer may hang
            for *_, fut in batch:
                if not fut.done():
                    fut.set_exception(e if isinstance(e, Exception) else GatewayError(
                        "store_unavailable", "the chat store write was cancelled"))
            raise
        for (a, b), (*_, fut) in zip(spans, batch):
            if fut.done():  # its writer was cancelled
                continue
            err = next((r for r in results[a:b] if isinstance(r, Exception)), None)
            # a retried write whose first try was applied (its answer was lost): the entry
            # id is taken, so it is already there (writes are idempotent)
            if err is not None and "equal or smaller" not in str(err):
                fut.set_exception(err)
            else:
                fut.set_result(None)

    async def open(self, rid: str, owner: str, session_id: str, message_id: str, user_message_id: str) -> None:
        """Write the start entry (before any socket subscribes)."""
        await self._add(rid, "0-1", {"t": "start", "owner": owner, "session_id": session_id,
                                     "message_id": message_id, "user_message_id": user_message_id})

    async def delta(self, rid: str, seq: int, text: str) -> None:
        """Append delta ``seq`` (>= 1, one more than the previous)."""
        await self._add(rid, f"{seq}-1", {"t": "delta", "x": text})

    async def done(self, rid: str, last_seq: int, done: dict[str, Any]) -> None:
        """End the reply with its ``done`` payload (written after the reply is stored)."""
        await self._add(rid, f"{last_seq}-2", {"t": "done", "d": dumps(done)})

    async def error(self, rid: str, last_seq: int, code: str, message: str, status: int = 0) -> None:
        """End the reply with an error (nothing was stored for it); ``status``: the HTTP
        status an upstream's own error asks for (kept as the entry's ``status``; 0: none)."""
        fields = {"t": "error", "code": code, "message": message}
        if status:
            fields["status"] = str(status)
        await self._add(rid, f"{last_seq}-2", fields)

    async def forget(self, rid: str) -> None:
        """Delete reply ``rid``'s stream (a resumable API stream that was stopped)."""
        self._refreshed.pop(self.keys.gen(rid), None)
        async with redis_errors():
            await self.redis.delete(self.keys.gen(rid))

    async def delta_text(self, rid: str, seq: int) -> str | None:
        """The text of delta ``seq``, or None when it was never written (used after a
        write whose answer was lost, to learn whether it was applied)."""
        async with redis_errors():
            rows: Any = await self.redis.xrange(self.keys.gen(rid), f"{seq}-1", f"{seq}-1")
        return str(rows[0][1].get("x", "")) if rows else None

    async def head(self, rid: str) -> StreamEntry | None:
        """The start entry, or None when the stream does not exist (any more)."""
        async with redis_errors():
            rows: Any = await self.redis.xrange(self.keys.gen(rid), "0-1", "0-1")
        return _decode(*rows[0]) if rows else None

    async def last(self, rid: str) -> StreamEntry | None:
        """The newest entry, or None when the stream does not exist."""
        async with redis_errors():
            rows: Any = await self.redis.xrevrange(self.keys.gen(rid), "+", "-", count=1)
        return _decode(*rows[0]) if rows else None

    async def read(self, rid: str, after_seq: int, count: int, block_ms: int) -> list[StreamEntry]:
        """Entries after delta ``after_seq`` (at most ``count``), waiting up to
        ``block_ms`` for the first one; [] on timeout."""
        async with redis_errors():
            res: Any = await self.tail_redis.xread({self.keys.gen(rid): f"{after_seq}-1"}, count=count, block=block_ms)
        if not res:
            return []
        # redis-py returns [[key, [(id, fields), ...]]] (RESP2) or {key: [[...]]} (RESP3)
        rows = next(iter(res.values()))[0] if isinstance(res, dict) else res[0][1]
        return [_decode(eid, f) for eid, f in rows]


def done_payload(entry: StreamEntry) -> dict[str, Any]:
    """The ``done`` JSON of a terminal "done" entry."""
    done: dict[str, Any] = json.loads(entry.fields["d"])
    return done
