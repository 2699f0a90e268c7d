"""Reply streams: one Redis Stream per reply (``chat:gen:{request_id}``) that the
generation task writes and any socket (on any gateway) tails at its own pace.

Entry ids are chosen, not generated, so that a ``seq`` is its own cursor:

    0-1          start  {t: "start", owner, session_id, message_id, user_message_id}
    n-1          delta  {t: "delta", x: text}       seq n = 1, 2, ... without gaps
    last-2       end    {t: "done", d: done JSON} or {t: "error", code, message}

Reading from id ``{k}-1`` returns exactly the deltas with seq > k and then the end.
Writes are idempotent (re-adding a taken entry id is a no-op), so the generation
task can retry them while Redis is away. Entries go to Redis in round trips of one
packed write each (the connection's ``pack_commands``, no pipeline object; the answers
read in one go, ``PackedConnection.read_responses``): the
entries submitted in one event-loop iteration (the replies of one engine step) go
together, and those submitted while a round trip is out go together in the next one,
so at most one stream write is in flight per gateway; each entry still gets its own
outcome. The start and end entries refresh the key's TTL (``stream_ttl_s``), and so
does a delta when the last refresh from this gateway is older than ``TTL_REFRESH_S``
(at most a quarter of the TTL), so a reply whose gateway died expires on its own;
``MAXLEN ~`` is a safety cap far above any reply's frame count.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions as rexc
from redis.asyncio.connection import AbstractConnection

from gateway.errors import GatewayError
from gateway.store.connection import read_answers
from gateway.store.keys import Keys
from gateway.store.sessions import dumps, redis_errors

log = logging.getLogger("gateway.store.reply_streams")

TTL_REFRESH_S = 60.0  # a running reply's stream TTL is refreshed at least this often (seconds)


@dataclass(frozen=True)
class StreamEntry:
    """One decoded entry: ``kind`` is "start", "delta", "done" or "error"; ``seq`` the
    delta's seq (for start 0, for the end the last delta's seq)."""

    kind: str
    seq: int
    fields: dict[str, str]
    # the entry as a client protocol's frame, by protocol: encoded by the first socket that
    # sends it and reused by every other one watching the reply (not part of its value)
    wire: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def terminal(self) -> bool:
        """True for the entry that ends the reply."""
        return self.kind in ("done", "error")


Outcome = Callable[[BaseException | None], None]  # an entry's outcome: None (written) or its error


def _tell(batch: list[tuple[str, str, dict[str, str], Outcome]], err: BaseException | None) -> None:
    """Give each entry of ``batch`` its outcome ``err``; a failing callback is logged, never
    raised into the other entries' round trip."""
    for *_, outcome in batch:
        _call(outcome, err)


def _call(outcome: Outcome, err: BaseException | None) -> None:
    try:
        outcome(err)
    except Exception:
        log.exception("a reply stream write's outcome handler failed")


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
        self._pending: list[tuple[str, str, dict[str, str], Outcome]] = []  # for the next round trip
        self._writing: asyncio.Task[None] | None = None  # the task making the round trips, while there are any
        self._conn: AbstractConnection | None = None  # the pool connection the writes use (see _round_trip)
        self._refreshed: dict[str, float] = {}  # key -> monotonic time of its last EXPIRE from here
        self._refresh_s = min(TTL_REFRESH_S, ttl_s / 4)

    def submit(self, rid: str, entry_id: str, fields: dict[str, str], outcome: Outcome) -> None:
        """Queue an entry of reply ``rid`` for the next round trip (see module doc), without
        waiting; ``outcome`` is called once, with None when the entry is in the stream
        (written now, or already there: a retried write whose answer was lost), else
        with the error (``GatewayError`` ``store_unavailable``, a ``redis`` ``ResponseError``)."""
        self._pending.append((self.keys.gen(rid), entry_id, fields, outcome))
        if self._writing is None:
            self._writing = asyncio.get_running_loop().create_task(self._write_all(), name="reply-stream writes")

    async def _add(self, rid: str, entry_id: str, fields: dict[str, str]) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def outcome(err: BaseException | None) -> None:
            if fut.done():  # its writer was cancelled
                return
            if err is None:
                fut.set_result(None)
            else:
                fut.set_exception(err)

        self.submit(rid, entry_id, fields, outcome)
        await fut

    async def _write_all(self) -> None:
        """Round trips until nothing is pending (the entries submitted meanwhile go in the next)."""
        try:
            while self._pending:
                batch, self._pending = self._pending, []
                await self._write(batch)
        except BaseException:  # cancelled with the gateway: no writer may hang
            batch, self._pending = self._pending, []
            _tell(batch, GatewayError("store_unavailable", "the chat store write was cancelled"))
            raise
        finally:
            self._writing = None

    async def _write(self, batch: list[tuple[str, str, dict[str, str], Outcome]]) -> None:
        """One packed write (no MULTI: every command is idempotent) for the batch's entries;
        each entry's ``outcome`` gets its own result."""
        now = time.monotonic()
        commands: list[list[Any]] = []
        spans: list[int] = []  # each entry's number of commands, in order
        for key, entry_id, fields, _ in batch:
            cmd: list[Any] = ["XADD", key, "MAXLEN", "~", self.maxlen, entry_id]
            for k, v in fields.items():
                cmd += (k, v)
            commands.append(cmd)
            kind = fields.get("t")
            if kind != "delta" or now - self._refreshed.get(key, 0.0) >= self._refresh_s:
                commands.append(["EXPIRE", key, self.ttl])
                spans.append(2)
                if kind in ("done", "error"):
                    self._refreshed.pop(key, None)
                else:
                    self._refreshed[key] = now
            else:
                spans.append(1)
        try:
            async with redis_errors():
                results = await self._round_trip(commands)
        except (GatewayError, rexc.RedisError) as e:
            _tell(batch, e)
            return
        except BaseException as e:  # cancelled with the gateway, or a bug: no writer may hang
            _tell(batch, e if isinstance(e, Exception) else GatewayError(
                "store_unavailable", "the chat store write was cancelled"))
            raise
        i = 0
        for n, (*_, outcome) in zip(spans, batch):
            err = next((r for r in results[i:i + n] if isinstance(r, Exception)), None)
            i += n
            # a retried write whose first try was applied (its answer was lost): the entry
            # id is taken, so it is already there (writes are idempotent)
            _call(outcome, err if err is not None and "equal or smaller" not in str(err) else None)

    async def _round_trip(self, commands: list[list[Any]]) -> list[Any]:
        """Send ``commands`` as one packed write and read every answer (a command's
        error is its answer: the rest are still read, so the connection stays in step).
        The writes use one connection of the pool, taken at the first write and kept
        (one round trip at a time uses it, so taking it from the pool each time would
        only cost); a broken connection is retried on a fresh one as the client's other
        commands are (``gateway/store/connection.py``): every command here is idempotent.

        Raises:
            redis.exceptions.ConnectionError, TimeoutError: Redis stayed unreachable.
        """
        conn = self._conn
        if conn is None:
            # typed loosely by redis-py; a pool connection is a Connection
            conn = self._conn = await self.redis.connection_pool.get_connection()  # type: ignore[no-untyped-call]
        packed = conn.pack_commands(commands)

        async def exchange() -> list[Any]:
            await conn.send_packed_command(packed)
            return await read_answers(conn, len(commands))

        async def broken(_err: Exception) -> None:
            await conn.disconnect()  # the next try connects afresh

        try:
            answers: list[Any] = await conn.retry.call_with_retry(exchange, broken)
        except BaseException:
            await conn.disconnect()  # cancelled or failed mid-answer: never reuse it out of step
            raise
        return answers

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

    async def abandoned(self, rid: str, owner: str, grace_ms: int) -> bool:
        """Whether reply ``rid`` of user ``owner`` has no live gateway any more: its lease in
        the user's replies in progress is gone, or ran out more than ``grace_ms`` ago (a
        margin for the clocks of other replicas; the lease's own length is a fair one).
        A gateway killed outright leaves its replies' streams without an end; this tells a
        follower to stop waiting for one. (Time in ms of this machine's clock.)"""
        async with redis_errors():
            score: Any = await self.redis.zscore(self.keys.user_gens(owner), rid)
        return score is None or float(score) < time.time() * 1000 - grace_ms

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
