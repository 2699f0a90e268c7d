"""Which engine serves a request: the one that holds most of its prompt, unless load says otherwise.

The default rule, ``cache_aware`` (docs/scaling.md), for one request of chat ``key``
whose prompt has ``P`` tokens over the healthy engines:

1. **Match.** For each engine, ``matched`` = the leading prompt tokens whose KV pages
   it holds, from the gateway's prefix index (``gateway/engines/prefix_index.py``, fed by the
   engines' KV events).
2. **Cost** = ``(P - matched) + load_tokens * load``: the prompt tokens the engine must
   still compute, plus ``load_tokens`` for each request it runs or queues (both in
   tokens of work); the lowest cost wins, ties going to the chat's home (below), then to
   the engine ranking higher for ``key``. This is the cost of NVIDIA Dynamo's KV router
   (prefill blocks the request still needs plus the blocks active on the worker, in one
   unit); vLLM's production-stack router scores the same two terms as a matched share
   minus beta times relative load, which bench/routing_sim.py found to move chats off
   their own history whenever another engine idles (a relative term charges 1 request
   against 0 as much as 100 against 0). A turn of a chat finds most of its prompt at the
   engine that served the previous turn, so it stays there; a new chat (nothing
   matched) goes to the least-loaded engine; a chat opening with a long shared document
   goes where that document is cached.
3. **Shed**, as below: when the winner is overloaded against the least-loaded engine
   (SGLang's imbalance test), the least-loaded engine takes the request.

With no prompt tokens known (or no index), the rule falls back to ``sticky``:

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

``choose`` is the pure function of that rule, ``choose_cache_aware`` of the default;
``Placements`` stores the moves. ``hash`` (rendezvous alone), ``round_robin`` and
``random`` exist as baselines for ``bench/routing.py``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.config import POLICIES, RoutingPolicy
from gateway.store.keys import Keys

__all__ = ["POLICIES", "EngineLoad", "Placements", "RoutingPolicy", "choose", "choose_cache_aware",
           "rendezvous_rank", "snapshot_load"]

def rendezvous_rank(key: str, url: str) -> int:
    """The rendezvous-hashing weight of engine ``url`` for ``key`` (a 64-bit int; the
    highest-weight engine is the key's choice). BLAKE2b of ``"key|url"``."""
    return int.from_bytes(hashlib.blake2b(f"{key}|{url}".encode(), digest_size=8).digest(), "big")


@dataclass(frozen=True)
class EngineLoad:
    """What the rule knows of one healthy engine.

    Attributes:
        url: the engine's address (its identity in hashing and placements).
        load: running + waiting requests (see ``snapshot_load``).
        matched_tokens: leading prompt tokens whose KV the engine holds (tokens).
    """

    url: str
    load: int
    matched_tokens: int = 0


def snapshot_load(stats: dict[str, Any] | None, age_s: float | None, in_flight: int, max_age_s: float) -> int:
    """An engine's load in requests: ``running + waiting`` of its stats snapshot when
    that is at most ``max_age_s`` seconds old, or ``in_flight`` (this gateway's open
    requests on it) when that is larger or the snapshot is missing or stale."""
    if stats is None or age_s is None or age_s > max_age_s:
        return in_flight
    seen = int(stats.get("running", 0) or 0) + int(stats.get("waiting", 0) or 0)
    return max(seen, in_flight)


def _ranks(key: str, engines: Sequence[EngineLoad]) -> dict[str, int]:
    return {e.url: rendezvous_rank(key, e.url) for e in engines}


def _shed(best: EngineLoad, engines: Sequence[EngineLoad], ranks: dict[str, int], policy: RoutingPolicy) -> str:
    """``best``, or the least-loaded engine when ``best`` is overloaded against it (SGLang's
    imbalance test; ties: the engine ranking higher for the key)."""
    least = min(engines, key=lambda e: (e.load, -ranks[e.url]))
    if best.load - least.load > policy.abs_threshold and best.load > policy.rel_threshold * least.load:
        return least.url
    return best.url


def choose(key: str, engines: Sequence[EngineLoad], policy: RoutingPolicy,
           placement: str | None = None) -> str:
    """The url of the engine for ``key`` by the ``sticky`` rule (see the module doc for
    the rule and its source).

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
    ranks = _ranks(key, engines)
    home_url = placement if placement in ranks else max(ranks, key=ranks.__getitem__)
    return _shed(next(e for e in engines if e.url == home_url), engines, ranks, policy)


def choose_cache_aware(key: str, engines: Sequence[EngineLoad], prompt_tokens: int, policy: RoutingPolicy,
                       placement: str | None = None) -> str:
    """The url of the engine for a request of chat ``key`` by the ``cache_aware`` rule
    (module doc): least ``uncached prompt tokens + load_tokens x load``, then the
    imbalance test. Falls back to ``choose`` when ``prompt_tokens < 1``.

    Args:
        key: the chat id.
        engines: the healthy candidates with their loads and matched tokens.
        prompt_tokens: the prompt's length (tokens), or 0 when unknown.
        policy: the weights and thresholds.
        placement: the chat's placement url, if any (its home for ties).

    Raises:
        ValueError: ``engines`` is empty.
    """
    if not engines:
        raise ValueError("no engine to choose from")
    if prompt_tokens < 1:
        return choose(key, engines, policy, placement)
    ranks = _ranks(key, engines)
    home_url = placement if placement in ranks else max(ranks, key=ranks.__getitem__)

    def cost(e: EngineLoad) -> tuple[float, bool, int]:
        work = prompt_tokens - min(e.matched_tokens, prompt_tokens) + policy.load_tokens * e.load
        return work, e.url != home_url, -ranks[e.url]

    return _shed(min(engines, key=cost), engines, ranks, policy)


class Placements:
    """Where shed chats live now: ``{prefix}chat:route:{key}`` holds the engine url, with
    the chat's TTL (or ``default_ttl_s``). Shared by every gateway on the Redis.

    A Redis error reads as "no placement" (the chat goes to its rendezvous home, which
    costs a cache miss at worst) and a failed write is dropped for the same reason.
    """

    def __init__(self, redis: aioredis.Redis, prefix: str, ttl_s: int | None, default_ttl_s: int = 7 * 86400) -> None:
        self.redis = redis
        self._key = Keys(prefix).route
        self.ttl_s = ttl_s or default_ttl_s

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
