"""One retry policy for the gateway: exponential backoff with jitter, bounded in time,
and one reconnect loop built on it.

``retry`` bounds a repeatable operation in time (the reply task's store writes).
``keep_connected`` is the one reconnect-with-backoff loop: the engine links, the cancel
listener, live events and revocations run their connection through it, so each logs an
outage once (and at most once a minute while it lasts) and its end once. The local
engine's supervisor (a thread) uses ``Backoff`` directly. Delays double from a first
delay to a cap; the engine links add +-50% jitter (many gateways must not reconnect in
step). (docs/architecture.md)
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import NoReturn, TypeVar

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


@dataclass
class Outage:
    """How a link that reconnects logs its outages: the first failure, then at most once
    every ``log_every_s`` seconds while it stays down (not once per retry), and its end.

    A failure is logged at INFO while the link has been down less than ``warn_after_s``
    seconds (an engine restarting is a second or two of refused connections), at WARNING
    after. ``since`` is when the link went down (``time.monotonic()`` seconds), None while up.
    """

    name: str
    log: logging.Logger
    warn_after_s: float = 0.0
    log_every_s: float = 60.0
    since: float | None = None
    _logged_at: float | None = field(default=None, repr=False)

    def down(self, error: BaseException | None) -> None:
        """The link failed with ``error`` (None: it closed without one, logged as nothing)."""
        now = time.monotonic()
        if self.since is None:
            self.since = now
        if error is None or (self._logged_at is not None and now - self._logged_at < self.log_every_s):
            return
        level = logging.WARNING if now - self.since >= self.warn_after_s else logging.INFO
        self.log.log(level, "%s: %s; reconnecting in the background", self.name, str(error) or type(error).__name__)
        self._logged_at = now

    def up(self) -> None:
        """The link is connected again (logs how long it was down, if it was)."""
        if self.since is not None and self._logged_at is not None:
            self.log.info("%s: back after %.0f s", self.name, time.monotonic() - self.since)
        self.since, self._logged_at = None, None


async def keep_connected(session: Callable[[Callable[[], None]], Awaitable[None]], *, outage: Outage,
                         backoff: Backoff) -> NoReturn:
    """Run ``session`` for ever, again after each failure, with ``backoff`` between tries.

    ``session(connected)`` opens its link, calls ``connected()`` once the link is up (that
    resets ``backoff`` and ends the outage), serves until the link fails or closes, and
    cleans up after itself (``finally``). Its exceptions are the link failing: logged
    through ``outage``, without a traceback. Ends only by cancellation.
    """
    def connected() -> None:
        backoff.reset()
        outage.up()

    while True:
        try:
            await session(connected)
            outage.down(None)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # any failure means "reconnect"
            outage.down(e)
        await backoff.sleep()
