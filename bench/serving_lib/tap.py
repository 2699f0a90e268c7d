"""A tap on the gateway's engine connections: when each engine frame arrived.

``EngineTap.install(router)`` wraps ``_dispatch`` of every ``EngineClient`` of a running
gateway (an instance attribute, so the gateway's code is unchanged) and records, per
request id, ``(t_ns, text, n_tokens)`` for each ``delta``/``done`` item (of the engine's
``step`` frames, typed as in ``engine.protocol``) at the moment the gateway's connection
task hands it on, in ``time.monotonic_ns()`` (CLOCK_MONOTONIC on
Linux: one clock for every process of the machine, so a client in another process can
compare its own receipt times with these).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from engine.protocol import DeltaFrame, DoneFrame, StepFrame


class EngineTap:
    """Receipt times of engine frames, by request id (see module doc)."""

    def __init__(self) -> None:
        self.frames: dict[str, list[tuple[int, str, int]]] = {}
        self._installed: set[int] = set()

    def install(self, router: Any) -> int:
        """Wrap every client of ``router`` (a ``gateway.engines.client.EngineRouter``); returns
        how many were newly wrapped. Idempotent."""
        n = 0
        for client in router.clients:
            if id(client) in self._installed:
                continue
            self._installed.add(id(client))
            client._dispatch = self._wrap(client._dispatch)
            n += 1
        return n

    def _wrap(self, dispatch: Callable[[Any], None]) -> Callable[[Any], None]:
        def tapped(frame: Any) -> None:
            t = time.monotonic_ns()  # before the gateway's own handling of the frame
            items = frame.items if isinstance(frame, StepFrame) else [frame]
            for item in items:
                if isinstance(item, (DeltaFrame, DoneFrame)):
                    self.frames.setdefault(item.request_id, []).append((t, item.text, len(item.token_ids)))
            dispatch(frame)
        return tapped

    def snapshot(self) -> dict[str, list[list[Any]]]:
        """The records so far as JSON-ready lists ``[t_ns, text, n_tokens]``."""
        return {rid: [list(f) for f in fs] for rid, fs in list(self.frames.items())}

    def clear(self) -> None:
        """Forget the records (the wrappers stay installed)."""
        self.frames.clear()
