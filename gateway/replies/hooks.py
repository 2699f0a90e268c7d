"""Hooks into the life of a reply, for metrics and logs (no-ops here).

Subclass ``GenerationEvents`` and pass instances to ``create_app(events=[...])``; the
generation task calls them in order. A hook must be quick and must not raise (an
exception is logged and ignored). Times are seconds from ``time.perf_counter()``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from gateway.replies.reply_end import ReplyEnd

log = logging.getLogger("gateway.replies.hooks")


class GenerationEvents:
    """Called by ``GenerationManager`` for each reply (all methods optional)."""

    def on_start(self, request_id: str, session_id: str, t: float) -> None:
        """The reply's task started (before the engine request is sent)."""

    def on_delta(self, request_id: str, n_tokens: int, n_chars: int, t: float) -> None:
        """A coalesced delta was handed to the reply stream's writer (``n_tokens`` engine tokens)."""

    def on_finish(self, request_id: str, end: ReplyEnd, t: float) -> None:
        """The reply ended (and, for a chat's reply, was stored): its finish reason,
        usage and timings in ``end``, from which its ``done`` frame is derived."""

    def on_error(self, request_id: str, code: str, t: float) -> None:
        """The reply failed with ``code`` (nothing or a partial reply was stored)."""


class EventFanout(GenerationEvents):
    """Calls several ``GenerationEvents`` in order, isolating their failures."""

    def __init__(self, sinks: Sequence[GenerationEvents] = ()) -> None:
        self.sinks = list(sinks)

    def _call(self, name: str, *args: Any) -> None:
        for s in self.sinks:
            try:
                getattr(s, name)(*args)
            except Exception:
                log.exception("generation event hook %s.%s failed", type(s).__name__, name)

    def on_start(self, *args: Any) -> None:
        self._call("on_start", *args)

    def on_delta(self, *args: Any) -> None:
        self._call("on_delta", *args)

    def on_finish(self, *args: Any) -> None:
        self._call("on_finish", *args)

    def on_error(self, *args: Any) -> None:
        self._call("on_error", *args)
