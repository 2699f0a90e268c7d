"""How long a reply reasoned (``reasoning_ms``, stored with it and sent in its ``done``):
from the reply's first text until its closing reasoning marker (``gateway/reasoning.py``),
added to the time a continued reply had already reasoned."""

from __future__ import annotations

import time
from typing import Any

from gateway.reasoning import ReasoningSplitter, ThinkMarkers


class ReasoningClock:
    """Follows one reply's reasoning as its text streams.

    Args:
        markers: the reasoning markers.
        continued: the stored message a continued reply extends (its ``content`` and
            ``reasoning_ms``), None for a new reply.
    """

    def __init__(self, markers: ThinkMarkers, continued: dict[str, Any] | None = None) -> None:
        self.think = ReasoningSplitter(markers)
        self.continued = continued
        self.t0: float | None = None  # when the reply's first text came (monotonic s)
        self.ms: float | None = None  # how long it reasoned, once the reasoning closed (ms)

    def _ms_until(self, now: float) -> float:
        before = float((self.continued or {}).get("reasoning_ms") or 0.0)
        return round(before + (now - (self.t0 or now)) * 1000, 1)

    def feed(self, text: str) -> None:
        """Take the reply's next text: the reasoning starts with the first text and ends
        when the closing marker comes."""
        if self.t0 is not None and self.think.settled:
            return  # the reasoning is over (or there is none): nothing more to time
        now = time.monotonic()
        if self.t0 is None:
            self.t0 = now
            if self.continued is not None:  # where the earlier text left the reasoning
                self.think.feed(str(self.continued.get("content", "")))
        was = self.think.in_reasoning
        self.think.feed(text)
        # closed by this text (or opened and closed in it; not the earlier text's block)
        closed = self.think.reasoned and not self.think.in_reasoning and (was or self.continued is None)
        if closed and self.ms is None:
            self.ms = self._ms_until(now)

    def final_ms(self) -> float | None:
        """How long the reply reasoned (ms): until its closing marker, or until now when
        it ended while reasoning; a continued reply's earlier reasoning counts; None
        when it has no reasoning."""
        if self.ms is not None:
            return self.ms
        if self.think.in_reasoning and self.t0 is not None:
            return self._ms_until(time.monotonic())
        earlier = (self.continued or {}).get("reasoning_ms")
        return float(earlier) if earlier is not None else None
