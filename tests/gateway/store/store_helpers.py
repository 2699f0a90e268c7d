"""Helpers of the session-store tests: two users, a store on this test's key prefix, and
a turn finished the way the reply task finishes one."""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis

from gateway.store.keys import Keys
from gateway.store.sessions import SessionStore

ALICE, BOB = "a" * 32, "b" * 32


def make_store(rds: aioredis.Redis, prefix: str, ttl: int | None = None, **kw: int) -> SessionStore:
    """A session store on ``prefix`` with the gateway's default limits (``kw`` overrides them)."""
    args = dict(lock_lease_ms=30_000, max_sessions_per_user=50, max_generations_per_user=4)
    args.update(kw)
    return SessionStore(rds, Keys(prefix), ttl, **args)


async def finish_ok(store: SessionStore, owner: str, sid: str, turn: Any, text: str, user_ids: list[int],
                    out_ids: list[int], base: bool = False) -> str:
    """Finish ``turn`` as a complete reply of ``text`` with these token ids; the store's outcome."""
    return await store.finish_turn(
        owner, sid, turn,
        {"content": text, "status": "complete", "finish_reason": "stop",
         "usage": {"prompt_tokens": len(user_ids), "cached_tokens": 0, "completion_tokens": len(out_ids)},
         "timings": {"ttft_ms": 1.0, "tpot_ms": 1.0, "e2e_ms": 2.0}, "created_at": 0.0},
        {"ids": user_ids, "base": base}, {"ids": out_ids, "base": False})
