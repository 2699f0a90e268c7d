"""The reply's writer: it owns the reply's sequence numbers, the text not yet in its
Redis Stream and its in-memory ``ReplyLog``, and holds the reply's text once (the
written deltas in the log, the rest unsent).

Redis going away mid-reply loses nothing: the writer keeps the text it could not write
(written later as one delta, so seqs stay gapless) and tries again after a pause; a
delta write whose answer was lost is checked against the stream before it is repeated.
Each entry goes to the ``ReplyLog`` only once it is in the stream, so a seq means the
same text in both places (``gateway/replies/tail.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from gateway.errors import GatewayError
from gateway.replies.store_retry import store_retrying
from gateway.replies.tail import ReplyLog
from gateway.store.reply_streams import ReplyStreams, StreamEntry
from gateway.store.sessions import dumps

log = logging.getLogger("gateway.replies.writer")

OUTAGE_PAUSE_S = 1.0  # after a failed delta write, new text waits this long before the next try (s)


class ReplyWriter:
    """Writes reply ``rid``'s stream after its start entry.

    Text taken while the store answers is written without waiting (``add_nowait``): at
    most one delta write of the reply is out at a time, and the text that comes
    meanwhile goes as the next delta once it is answered, so seqs stay in order. After
    a failed write the writer is no longer ``streaming``: the caller then takes text with
    ``add``, which waits for the store (the outage path below).

    Args:
        rid: the reply's request id.
        streams: the reply streams.
        store_retry_s: how long the reply's end waits out a Redis outage (seconds).
        prior: the text a continued reply already had (its stream's first delta holds
            it with the first new text); None for a new reply.
    """

    def __init__(self, rid: str, streams: ReplyStreams, store_retry_s: float, prior: str | None = None) -> None:
        self.rid = rid
        self.streams = streams
        self.store_retry_s = store_retry_s
        self.log = ReplyLog()
        self.unsent: list[str] = [] if prior is None else [prior]  # text not yet in the stream
        self.continued = prior is not None
        self.added = False  # text came from the engine (a continued reply's earlier text does not count)
        self._retry_at = 0.0  # monotonic time before which delta writes are not tried
        self._uncertain = False  # a delta write failed: it may or may not have been applied
        self._warned = False
        self._writing: str | None = None  # the text of the delta write that is out
        self._written: asyncio.Future[None] | None = None  # done when that write is answered
        self._failed: GatewayError | Exception | None = None  # a write's error other than an outage

    @property
    def seq(self) -> int:
        """The seq of the newest delta in the stream (0 before the first)."""
        return self.log.last_seq

    @property
    def text(self) -> str:
        """The reply's whole text so far (written, being written and unsent)."""
        return "".join(self.log.deltas) + (self._writing or "") + "".join(self.unsent)

    @property
    def streaming(self) -> bool:
        """True while text can be taken without waiting (no failed write to recover from)."""
        return not self._uncertain and self._failed is None

    def add_nowait(self, text: str) -> None:
        """Take new text from the engine and write it (or send it after the write that is
        out); only while ``streaming``."""
        assert self.streaming, "add() after a failed write"
        self.added = True
        self.unsent.append(text)
        if self._writing is None:
            self._send()

    async def add(self, text: str) -> None:
        """Take new text from the engine and write what is unsent: without waiting while
        ``streaming``, else as ``write`` does.

        Raises:
            GatewayError: a write's store error other than ``store_unavailable``.
        """
        if self.streaming:
            self.add_nowait(text)
            return
        self.added = True
        self.unsent.append(text)
        await self.write()

    def _send(self) -> None:
        """Submit the unsent text as the next delta (no write is out)."""
        text = self._writing = "".join(self.unsent)
        self.unsent.clear()
        seq = self.seq + 1
        self._written = None
        self.streams.submit(self.rid, f"{seq}-1", {"t": "delta", "x": text},
                            lambda err: self._answered(seq, text, err))

    def _answered(self, seq: int, text: str, err: BaseException | None) -> None:
        """The outcome of delta ``seq``'s write (``text``)."""
        self._writing = None
        if err is None:
            if self.log.end is None:  # else the reply was torn down meanwhile
                self.log.append(seq, text)
        else:
            self.unsent.insert(0, text)  # kept, to be written (or checked) again
            self._uncertain = True  # it may have been applied with its answer lost
            if isinstance(err, GatewayError) and err.code == "store_unavailable":
                self._outage()
            else:
                self._failed = err if isinstance(err, Exception) else GatewayError(
                    "store_unavailable", "the chat store write was cancelled")
        if self._written is not None and not self._written.done():
            self._written.set_result(None)
        if err is None and self.unsent:
            self._send()

    def _outage(self) -> None:
        if not self._warned:
            log.warning("reply %s: Redis unreachable; the reply goes on and is kept in memory", self.rid)
            self._warned = True
        self._retry_at = time.monotonic() + OUTAGE_PAUSE_S

    async def _settled(self) -> None:
        """Wait until no delta write is out."""
        while self._writing is not None:
            if self._written is None:
                self._written = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._written)

    def trim_prior(self, n: int) -> bool:
        """Take ``n`` characters off the end of a continued reply's earlier text: a stop
        string begun before the cut completed after it, so the reply written at once
        would never have shown them (docs/protocol.md, continuing a cut reply). The
        engine sends this before the continuation's first text, while the earlier text
        is still unsent; False (nothing changed) when it is not."""
        if not self.continued or self.seq or self.added or len(self.unsent) != 1 or self._writing is not None:
            return False
        self.unsent[0] = self.unsent[0][: max(0, len(self.unsent[0]) - n)]
        return True

    async def write(self) -> None:
        """Append the text not yet in the reply stream as the next delta, waiting for
        the answer; while Redis is unreachable, keep it (the generation goes on) and try
        again after a pause.

        Raises:
            GatewayError: any store error but ``store_unavailable``.
        """
        await self._settled()
        if self._failed is not None:
            err, self._failed = self._failed, None  # raised once; the next write checks and retries
            raise err
        if not self.unsent or time.monotonic() < self._retry_at:
            return
        try:
            if self._uncertain:
                # the last failed write may have been applied with its answer lost: if
                # so, its text is already delta seq+1 and only the rest is still unsent
                written = await self.streams.delta_text(self.rid, self.seq + 1)
                self._uncertain = False
                if written is not None:
                    rest = "".join(self.unsent)[len(written):]
                    self.log.append(self.seq + 1, written)
                    self.unsent = [rest] if rest else []
                    if not rest:
                        self._retry_at = 0.0
                        return
            self._uncertain = True
            text = "".join(self.unsent)
            await self.streams.delta(self.rid, self.seq + 1, text)
            self._uncertain = False
        except GatewayError as e:
            if e.code != "store_unavailable":
                raise
            self._outage()
            return
        self.unsent.clear()
        self.log.append(self.seq + 1, text)
        self._retry_at = 0.0

    async def flush(self) -> None:
        """Write the kept text to the reply stream, retrying (before the reply is stored,
        so that the stream's deltas add up to the stored content).

        Raises:
            GatewayError: ``store_unavailable`` after ``store_retry_s``.
        """
        async def write() -> None:
            self._retry_at = 0.0
            await self.write()
            if self.unsent:
                raise GatewayError("store_unavailable", "the chat store (Redis) is unreachable")
        await self._settled()
        if self.unsent or self._failed is not None:
            await store_retrying(self.rid, "writing the reply stream", write, self.store_retry_s)

    async def done(self, done: dict[str, Any]) -> None:
        """End the stream with the ``done`` payload (after the reply was stored), retrying.

        Raises:
            GatewayError: ``store_unavailable`` after ``store_retry_s``.
        """
        await self._settled()
        await store_retrying(self.rid, "ending the reply stream",
                             lambda: self.streams.done(self.rid, self.seq, done), self.store_retry_s)
        self.log.finish(StreamEntry("done", self.seq, {"t": "done", "d": dumps(done)}))

    async def error(self, code: str, message: str, status: int = 0) -> None:
        """End the stream with an error (nothing of the reply was stored), retrying.

        Raises:
            GatewayError: ``store_unavailable`` after ``store_retry_s``.
        """
        await self._settled()
        await store_retrying(self.rid, "ending the reply stream",
                             lambda: self.streams.error(self.rid, self.seq, code, message, status), self.store_retry_s)
        fields = {"t": "error", "code": code, "message": message, **({"status": str(status)} if status else {})}
        self.log.finish(StreamEntry("error", self.seq, fields))

    def gave_up(self) -> None:
        """Followers on this gateway hear that the store gave up (those reading the
        stream hear nothing more, as the stream got no end entry)."""
        self.log.finish(StreamEntry("error", self.seq, {
            "t": "error", "code": "store_unavailable", "message": "the chat store (Redis) is unreachable"}))

    def ended_unexpectedly(self) -> None:
        """Tell followers on this gateway that the reply ended without its end entry
        (a bug, or the task was cancelled); nothing when the end was recorded."""
        if self.log.end is None:
            self.log.finish(StreamEntry("error", self.seq, {
                "code": "internal_error", "message": "the reply failed unexpectedly"}))
