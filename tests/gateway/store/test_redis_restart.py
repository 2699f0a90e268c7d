"""A Redis restart is invisible to users: after ``kill -9`` and a restart, every pooled
connection is stale, and each command that meets one is retried on a fresh connection
(gateway/store/connection.py), so requests succeed as soon as Redis answers and
``/readyz`` says Redis is down only while it is."""

from __future__ import annotations

import asyncio

from tests.gateway_helpers import chat


async def _parallel_gets(gw, cookie: str, path: str, n: int = 16) -> list[int]:
    async with gw.http(cookie) as c:
        rs = await asyncio.gather(*(c.get(path) for _ in range(n)))
    return [r.status_code for r in rs]


async def test_requests_succeed_at_once_after_redis_is_killed_and_restarted(gateway_factory, private_redis):
    gw = gateway_factory(redis_url=private_redis.url)
    cookie = gw.new_cookie()
    async with gw.connect(cookie) as ws:
        first = await chat(ws, "Hello there", max_tokens=3)
    sid = first.start["session_id"]
    assert await _parallel_gets(gw, cookie, f"/api/sessions/{sid}") == [200] * 16  # fills the pool

    private_redis.kill()
    async with gw.http(cookie) as c:
        down = await c.get("/readyz")
        assert down.status_code == 503 and down.json()["redis"] is False
        assert (await c.get(f"/api/sessions/{sid}")).status_code == 503  # store_unavailable, no 500
    private_redis.start()  # returns once it answers PING; every pooled connection is now stale

    async with gw.http(cookie) as c:
        up = await c.get("/readyz")
    assert up.status_code == 200 and up.json()["redis"] is True
    assert await _parallel_gets(gw, cookie, f"/api/sessions/{sid}") == [200] * 16
    assert await _parallel_gets(gw, cookie, "/api/sessions") == [200] * 16
    async with gw.connect(cookie) as ws:  # the reply path (stream writes, store scripts) too
        again = await chat(ws, "And again", sid, max_tokens=3)
    assert again.done is not None and again.error is None
    async with gw.http(cookie) as c:
        body = (await c.get(f"/api/sessions/{sid}")).json()
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "user", "assistant"]
