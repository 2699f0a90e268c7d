"""Which engine serves a chat's next turn: its cache home unless that home is overloaded.

The rule (docs/scaling.md), for one request of chat ``key`` over the healthy engines:

1. **Home.** The engine the chat was last moved to (its *placement*, kept in Redis so
   every gateway sees it) while that engine is healthy; otherwise the engine that ranks
   highest for ``key`` under rendezvous hashing (Thaler & Ravishankar, "A name-based
   mapping scheme for rendezvous", 1996). The home holds the chat's KV prefix.
2. **Load.** An engine's load is its ``running + waiting`` requests from its latest
   stats snapshot (taken at the end of its last step), or the requests this gateway
   has in flight on it, whichever is larger (the snapshot counts every gateway's
   requests; the local count is never stale). A snapshot older than
   ``RoutingPolicy.max_stats_age_s`` is not used (the local count alone remains).
3. **Shed.** The request goes to the least-loaded healthy engine instead of the home
   when ``home - least > abs_threshold`` and ``home > rel_threshold * least``; else it
   stays home. This is the imbalance test of SGLang's cache-aware router
   (sgl-project/sglang, ``sgl-router/src/policies/cache_aware.rs``: "a system is
   considered imbalanced if (max - min) > abs_threshold and max > rel_threshold * min",
   then it routes to the shortest queue instead of the best prefix match), applied to
   the chat's home instead of the busiest engine. A shed chat's placement becomes the
   new engine, so its next turns find their prefix there ("a chat keeps its engine
   while that is good").

``choose`` is the pure function of that rule; ``Placements`` stores the moves.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

__all__ = ["EngineLoad", "Placements", "RoutingPolicy", "choose", "rendezvous_rank", "snapshot_load"]


def rendezvous_rank(key: str, url: str) -> int:
    """The rendezvous-hashing weight of engine ``url`` for ``key`` (a 64-bit int; the
    highest-weight engine is the key's choice). BLAKE2b of ``"key|url"``."""
    return int.from_bytes(hashlib.blake2b(f"{key}|{url}".encode(), digest_size=8).digest(), "big")


@dataclass(frozen=True)
class RoutingPolicy:
    """The shedding thresholds (see the module doc).

    Attributes:
        abs_threshold: requests (running + waiting) the home must carry beyond the
            least-loaded engine before a request sheds. SGLang's router defaults are sized
            for GPUs that batch hundreds of requests; ours suit a CPU engine that
            batches a handful.
        rel_threshold: and the home's load must exceed ``rel_threshold`` times the
            least-loaded engine's.
        max_stats_age_s: a stats snapshot older than this (seconds) is not trusted.
        stats_interval_s: how often the gateway asks each engine for its stats while
            it has more than one (seconds; 0 turns the refresh off).
    """

    abs_threshold: int = 4
    rel_threshold: float = 1.5
    max_stats_age_s: float = 10.0
    stats_interval_s: float = 1.0


@dataclass(frozen=True)
class EngineLoad:
    """What the rule knows of one healthy engine.

    Attributes:
        url: the engine's address (its identity in hashing and placements).
        load: running + waiting requests (see ``snapshot_load``).
    """

    url: str
    load: int


def snapshot_load(stats: dict[str, Any] | None, age_s: float | None, in_flight: int, max_age_s: float) -> int:
    """An engine's load in requests: ``running + waiting`` of its stats snapshot when
    that is at most ``max_age_s`` seconds old, or ``in_flight`` (this gateway's open
    requests on it) when that is larger or the snapshot is missing or stale."""
    if stats is None or age_s is None or age_s > max_age_s:
        return in_flight
    seen = int(stats.get("running", 0) or 0) + int(stats.get("waiting", 0) or 0)
    return max(seen, in_flight)


def choose(key: str, engines: Sequence[EngineLoad], policy: RoutingPolicy,
           placement: str | None = None) -> str:
    """The url of the engine for ``key`` (see the module doc for the rule and its source).

    Args:
        key: the chat id.
        engines: the healthy candidates (at least one).
        policy: the thresholds.
        placement: the url the chat was moved to earlier, if any (used while it is
            among ``engines``).

    Raises:
        ValueError: ``engines`` is empty.
    """
    if not engines:
        raise ValueError("no engine to choose from")
    urls = {e.url for e in engines}
    home_url = placement if placement in urls else max(engines, key=lambda e: rendezvous_rank(key, e.url)).url
    home = next(e for e in engines if e.url == home_url)
    # ties go to the engine that ranks higher for this key: a stable, spread choice
    least = min(engines, key=lambda e: (e.load, -rendezvous_rank(key, e.url)))
    if home.load - least.load > policy.abs_threshold and home.load > policy.rel_threshold * least.load:
        return least.url
    return home.url


class Placements:
    """Where shed chats live now: ``{prefix}chat:route:{key}`` holds the engine url, with
    the chat's TTL (or ``default_ttl_s``). Shared by every gateway on the Redis.

    A Redis error reads as "no placement" (the chat goes to its rendezvous home, which
    costs a cache miss at worst) and a failed write is dropped for the same reason.
    """

    def __init__(self, redis: aioredis.Redis, prefix: str, ttl_s: int | None, default_ttl_s: int = 7 * 86400) -> None:
        self.redis = redis
        self.prefix = prefix
        self.ttl_s = ttl_s or default_ttl_s

    def _key(self, key: str) -> str:
        return f"{self.prefix}chat:route:{key}"

    async def get(self, key: str) -> str | None:
        """The url the chat was moved to, or None."""
        try:
            value = await self.redis.get(self._key(key))
        except (RedisError, OSError):
            return None
        return value if isinstance(value, str) else (value.decode() if isinstance(value, bytes) else None)

    async def set(self, key: str, url: str | None) -> None:
        """Remember ``url`` as the chat's engine (None forgets it)."""
        try:
            if url is None:
                await self.redis.delete(self._key(key))
            else:
                await self.redis.set(self._key(key), url, ex=self.ttl_s)
        except (RedisError, OSError):
            pass
