"""Several choices of one API request (``n``), read as one reply source.

The engine serves one choice per ``generate`` (docs/protocol.md section 1, "Choices"):
an ``n``-choice request is ``n`` ``EngineReply`` sources with the same prompt, sent to
the same engine at once (the same routing key), choice i with its own seed
(``api_to_engine.choice_params``), so the engine computes their shared prompt once.
``ChoiceSet`` waits on all of them and hands back each batch of events with its choice's
index; aborting or closing it does so for every choice. A one-choice request (a linked
chat's ``SessionReply`` included) is a ``ChoiceSet`` of one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from gateway.api.openai_replies import Failed, Finished, ReplyEvent, ReplySource


class ChoiceSet:
    """The choices of one request (see module doc).

    Args:
        sources: one reply source per choice, already started, choice 0 first.
    """

    def __init__(self, sources: Sequence[ReplySource]) -> None:
        self.sources = list(sources)
        self._pending: dict[int, asyncio.Future[list[ReplyEvent]]] = {}
        self._ended: set[int] = set()

    @property
    def first(self) -> ReplySource:
        """Choice 0's source (its request id and model name name the reply)."""
        return self.sources[0]

    @property
    def request_id(self) -> str:
        """The request id of choice 0."""
        return self.first.request_id

    @property
    def model_name(self) -> str:
        """The model serving choice 0."""
        return self.first.model_name

    @property
    def done(self) -> bool:
        """Every choice has ended."""
        return len(self._ended) == len(self.sources)

    async def next(self) -> list[tuple[int, ReplyEvent]]:
        """The events that arrived, with their choice index (waits for at least one
        batch; never raises). After every choice ended, returns []."""
        for i, src in enumerate(self.sources):
            if i not in self._ended and i not in self._pending:
                self._pending[i] = asyncio.ensure_future(src.next())
        if not self._pending:
            return []
        try:
            await asyncio.wait(self._pending.values(), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            self._cancel_pending()
            raise
        out: list[tuple[int, ReplyEvent]] = []
        for i in sorted(self._pending):
            fut = self._pending[i]
            if not fut.done():
                continue
            del self._pending[i]
            for ev in fut.result():
                out.append((i, ev))
                if isinstance(ev, (Finished, Failed)):
                    self._ended.add(i)
        return out

    def _cancel_pending(self) -> None:
        for fut in self._pending.values():
            fut.cancel()
        self._pending.clear()

    async def abort(self) -> None:
        """Abort every choice still running (the client left)."""
        self._cancel_pending()
        await asyncio.gather(*(s.abort() for s in self.sources), return_exceptions=True)

    async def discard(self) -> None:
        """``abort``, then ``close``, whatever the abort raises (a request that failed or
        whose client left)."""
        try:
            await self.abort()
        finally:
            self.close()

    def close(self) -> None:
        """Release every choice's engine request."""
        self._cancel_pending()
        for s in self.sources:
            s.close()
