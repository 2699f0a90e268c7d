"""A reply's store writes ride out a Redis outage: each is retried with backoff for up to
the gateway's ``store_retry_s`` (docs/protocol.md, failure policy), logged once when it
starts failing and once when it succeeds again."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from gateway.retry import Backoff, is_store_unavailable, retry

log = logging.getLogger("gateway.replies")
T = TypeVar("T")

STORE_BACKOFF_S = (0.2, 5.0)  # first and longest wait between store retries (seconds)


async def store_retrying(rid: str, what: str, op: Callable[[], Awaitable[T]], budget_s: float) -> T:
    """Run one store write of reply ``rid``, retrying while Redis is unreachable
    (exponential backoff from 0.2 s to 5 s, for at most ``budget_s`` seconds).

    ``op`` must be idempotent (it may have been applied when its answer was lost);
    ``what`` names it in the log.

    Raises:
        GatewayError: ``store_unavailable`` once the time is up; any other error of ``op`` at once.
    """
    failed = False

    def warn(_e: BaseException) -> None:
        nonlocal failed
        if not failed:
            log.warning("reply %s: Redis unreachable; keeping the reply in memory and retrying %s "
                        "for up to %.0f s", rid, what, budget_s)
            failed = True

    res = await retry(op, budget_s=budget_s, retryable=is_store_unavailable,
                      backoff=Backoff(*STORE_BACKOFF_S), on_retry=warn)
    if failed:
        log.info("reply %s: %s succeeded after Redis came back", rid, what)
    return res
