"""Following a reply: from this gateway's memory when the reply runs here, else from its
Redis Stream. Shared by the browser socket (``ws.py``) and the OpenAI API's session
replies (``openai_replies.py``).

The reply task appends each delta to its ``ReplyLog`` right after the delta's stream
entry was written (so a seq means the same text in both places, and the log never runs
ahead of the record), and its end after the end entry was written. A follower of a reply
that runs on this gateway reads the log: no Redis read and no extra wake-up per token.
A follower of a reply running elsewhere (another replica) or already gone from memory
reads the stream with blocking ``XREAD``, waiting out a Redis outage. Either way it gets
each entry with seq > its cursor exactly once, in order, then the end entry.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from gateway.errors import not_found
from gateway.retry import is_store_unavailable, retry
from gateway.store.reply_streams import ReplyStreams, StreamEntry

T = TypeVar("T")
TAIL_BATCH = 32  # stream entries read at once
TAIL_BLOCK_MS = 5000
ABANDONED_WAIT_MS = 1000  # a reply without a lease: its end, if it comes, is this close


class ReplyLog:
    """The reply stream entries written so far by a reply running on this gateway.

    ``deltas[i]`` is the text of delta seq ``i + 1``; ``end`` the terminal entry once written.
    ``progress``: (prompt tokens done, prompt tokens, cached tokens) of the newest prompt
    progress while a long prompt is read, and ``progress_version`` how many came; kept in
    memory only (never in the stream: a follower that misses it loses nothing).
    """

    def __init__(self) -> None:
        self.deltas: list[str] = []
        self._entries: list[StreamEntry] = []  # deltas[i] as an entry, made once for every follower
        self.end: StreamEntry | None = None
        self.progress: tuple[int, int, int] | None = None
        self.progress_version = 0
        self._waiters: list[asyncio.Future[None]] = []

    @property
    def last_seq(self) -> int:
        """The seq of the newest delta (0 before the first)."""
        return len(self.deltas)

    def _notify(self) -> None:
        waiters, self._waiters = self._waiters, []
        for f in waiters:
            if not f.done():
                f.set_result(None)

    def append(self, seq: int, text: str) -> None:
        """Record delta ``seq`` (written to the stream just now).

        Raises:
            ValueError: ``seq`` is not the next one (a bug: seqs are gapless).
        """
        if seq != len(self.deltas) + 1:
            raise ValueError(f"delta seq {seq} after {len(self.deltas)}")
        self.deltas.append(text)
        self._entries.append(StreamEntry("delta", seq, {"x": text}))
        self._notify()

    def set_progress(self, done: int, total: int, cached: int) -> None:
        """Record how far the prompt is read (tokens)."""
        self.progress = (done, total, cached)
        self.progress_version += 1
        self._notify()

    async def wait_progress(self, seen_version: int) -> None:
        """Return once there is progress newer than ``seen_version``, a delta or the end."""
        while self.end is None and not self.deltas and self.progress_version <= seen_version:
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            await fut

    def finish(self, entry: StreamEntry) -> None:
        """Record the terminal entry (written to the stream, or given up on)."""
        self.end = entry
        self._notify()

    def read(self, after_seq: int, count: int) -> list[StreamEntry]:
        """Up to ``count`` deltas with seq > ``after_seq``, then the end once reached."""
        out = self._entries[after_seq:after_seq + count]
        if self.end is not None and after_seq + len(out) >= len(self.deltas):
            out.append(self.end)
        return out

    async def wait(self, after_seq: int) -> None:
        """Return once there is a delta with seq > ``after_seq`` or the end."""
        while self.end is None and len(self.deltas) <= after_seq:
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            await fut


class ReplyTail:
    """Reads reply ``rid`` from delta ``cursor`` on (see module doc).

    Args:
        rid: the reply's request id.
        cursor: the last seq the reader has (0: everything).
        streams: the reply streams.
        local: returns the ``ReplyLog`` of a reply running on this gateway, else None.
        store_retry_s: how long a stream read waits out a Redis outage (seconds).
        lease_ms: the chats' lock lease (``GatewayConfig.lock_lease_ms``): a reply whose
            lease ran out more than this long ago, with no end in its stream, was cut off
            by its gateway's death and ends its followers with ``not_found``.
    """

    def __init__(self, rid: str, cursor: int, streams: ReplyStreams, local: Callable[[str], ReplyLog | None],
                 store_retry_s: float, lease_ms: int) -> None:
        self.rid = rid
        self.lease_ms = lease_ms
        self.cursor = cursor
        self.streams = streams
        self.local = local
        self.store_retry_s = store_retry_s
        self._clamped = False
        self._log: ReplyLog | None = None
        self.done = False

    async def _patiently(self, op: Callable[[], Awaitable[T]]) -> T:
        return await retry(op, budget_s=self.store_retry_s, retryable=is_store_unavailable)

    def _local(self) -> ReplyLog | None:
        # once found, the log is kept: it outlives the reply task's entry in ``running``
        if self._log is None:
            self._log = self.local(self.rid)
        return self._log

    async def _abandoned(self, owner: str) -> bool:
        return await self._patiently(lambda: self.streams.abandoned(self.rid, owner, self.lease_ms))

    async def next(self) -> list[StreamEntry]:
        """The next entries (at least one; the last one is the end when ``done``).

        Raises:
            GatewayError: ``not_found`` when the stream no longer exists (expired) and the
                reply does not run here, or when its gateway died before its end;
                ``store_unavailable`` after ``store_retry_s`` of outage.
        """
        while True:
            log = self._local()
            if log is not None:
                if not self._clamped:
                    self.cursor, self._clamped = min(self.cursor, log.last_seq), True
                await log.wait(self.cursor)
                entries = log.read(self.cursor, TAIL_BATCH)
            else:
                if not self._clamped:
                    last = await self._patiently(lambda: self.streams.last(self.rid))
                    if last is not None and last.seq < self.cursor:
                        self.cursor = last.seq  # the reader claims more than exists: send the end only
                    self._clamped = True
                entries = await self._patiently(lambda: self.streams.read(self.rid, self.cursor, TAIL_BATCH,
                                                                          TAIL_BLOCK_MS))
                if not entries:
                    if self._local() is not None:
                        continue  # it started here meanwhile (its start entry awaits Redis)
                    head = await self._patiently(lambda: self.streams.head(self.rid))
                    if head is None:
                        raise not_found("reply")
                    # a chat's reply holds a lease while it runs (an API stream of its own does not)
                    if not head.fields.get("owner") or not head.fields.get("session_id") \
                            or not await self._abandoned(head.fields["owner"]):
                        continue
                    # No lease: its gateway died, or it is between storing the reply (which
                    # drops the lease) and writing its end; a second's wait tells them apart.
                    entries = await self._patiently(lambda: self.streams.read(self.rid, self.cursor, TAIL_BATCH,
                                                                              ABANDONED_WAIT_MS))
                    if not entries:
                        raise not_found("reply")  # killed outright: no end will come
            out: list[StreamEntry] = []
            for e in entries:
                out.append(e)
                if e.kind == "delta":
                    self.cursor = e.seq
                elif e.terminal:
                    self.done = True
                    break
            if out:
                return out

