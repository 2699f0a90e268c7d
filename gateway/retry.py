"""One retry policy for the gateway: exponential backoff with jitter, bounded in time.

Used by the engine connection loop (reconnects), the reply task's store writes, the
socket tails' stream reads, the cancel listener and the local engine's supervisor
(docs/architecture.md). Delays double from a first delay to a cap; the engine link adds
+-50% jitter (many gateways must not reconnect in step).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from gateway.errors import GatewayError

T = TypeVar("T")


@dataclass
class Backoff:
    """Doubling delays (seconds) from ``first_s`` up to ``max_s``; ``jitter`` multiplies
    each by a uniform factor in [1 - jitter, 1 + jitter]."""

    first_s: float = 0.2
    max_s: float = 5.0
    jitter: float = 0.0

    def __post_init__(self) -> None:
        self._next = self.first_s

    def reset(self) -> None:
        """Start again from ``first_s`` (after a success)."""
        self._next = self.first_s

    def peek(self) -> float:
        """The next delay without jitter (seconds)."""
        return self._next

    def next_delay(self) -> float:
        """The next delay (seconds), and advance."""
        d = self._next
        self._next = min(self._next * 2, self.max_s)
        return d * (1 - self.jitter + 2 * self.jitter * random.random()) if self.jitter else d

    async def sleep(self) -> None:
        """Sleep for the next delay."""
        await asyncio.sleep(self.next_delay())


def is_store_unavailable(e: BaseException) -> bool:
    """True for the error of an unreachable Redis (``store_unavailable``)."""
    return isinstance(e, GatewayError) and e.code == "store_unavailable"


async def retry(op: Callable[[], Awaitable[T]], *, budget_s: float, retryable: Callable[[BaseException], bool],
                backoff: Backoff | None = None, on_retry: Callable[[BaseException], None] | None = None) -> T:
    """Run ``op`` until it succeeds, retrying errors that ``retryable`` accepts with
    ``backoff`` (0.2 s doubling to 5 s by default) for at most ``budget_s`` seconds.

    ``op`` must be safe to repeat (a write may have been applied when its answer was lost).
    ``on_retry`` is called with each error that will be retried.

    Raises:
        the last error of ``op`` when it is not retryable or the budget is spent.
    """
    b = backoff if backoff is not None else Backoff()
    deadline = time.monotonic() + budget_s
    while True:
        try:
            return await op()
        except Exception as e:
            if not retryable(e) or time.monotonic() + b.peek() > deadline:
                raise
            if on_retry is not None:
                on_retry(e)
        await b.sleep()
