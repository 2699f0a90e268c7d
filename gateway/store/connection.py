"""How the gateway's Redis clients survive a Redis restart (one place for it).

After Redis restarts (``kill -9`` and start again), every pooled connection is stale:
its first command fails with ``ConnectionError``. ``redis.from_url`` and
``ConnectionPool.from_url`` build connections with no retry at all, so each stale
connection surfaced once as ``store_unavailable``. With these options a command that
meets a stale or broken connection is retried on a fresh one (``Retry`` on
``ConnectionError``/``TimeoutError``, exponential backoff with jitter), so requests
succeed as soon as Redis answers; a connection idle longer than the health-check
interval is PINGed before use. While Redis stays down a command still fails after
``RETRIES`` tries (about 2 s), and callers report ``store_unavailable``.
"""

from __future__ import annotations

from typing import Any

from redis.asyncio.client import PubSub
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError, TimeoutError
from redis.maint_notifications import MaintNotificationsConfig

RETRIES = 4  # tries after the first; backoff 50 ms doubling, at most 1 s (with jitter)
BACKOFF_BASE_S = 0.05
BACKOFF_CAP_S = 1.0
HEALTH_CHECK_INTERVAL_S = 10  # idle connections are PINGed before use after this long


def resilience_options() -> dict[str, Any]:
    """Keyword arguments for ``redis.asyncio.from_url`` / ``ConnectionPool.from_url``:
    ``retry``, ``retry_on_error`` and ``health_check_interval`` (see module doc)."""
    return {"retry": Retry(ExponentialWithJitterBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S), RETRIES),
            "retry_on_error": [ConnectionError, TimeoutError],
            "health_check_interval": HEALTH_CHECK_INTERVAL_S}


def handshake_options() -> dict[str, Any]:
    """Keyword arguments for ``BlockingConnectionPool.from_url`` that keep a new
    connection's handshake to what the gateway uses: no ``CLIENT SETINFO`` (library name
    and version) and no ``CLIENT MAINT_NOTIFICATIONS`` (a managed-cloud feature). redis-py
    sends all three by default and ignores their errors, so on a Redis that knows none of
    them (before 7.2) each new connection cost three extra commands, each answered with an
    error (about one per reply while the pool grows under a burst of new turns)."""
    return {"driver_info": None, "maint_notifications_config": MaintNotificationsConfig(enabled=False)}


async def close_quietly(pubsub: PubSub) -> None:
    """Close a pub/sub connection that may already be gone (then there is nothing to close)."""
    try:
        await pubsub.aclose()  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
    except Exception:
        pass
