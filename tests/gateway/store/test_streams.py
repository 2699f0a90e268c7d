"""Reply-stream writes on the real Redis: the writes of one event-loop iteration (the
replies of one engine step) share one packed write, and each writer gets its own outcome."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
import redis.exceptions as rexc
from redis.asyncio.connection import AbstractConnection

from gateway.store.connection import PackedConnection, packing_options
from gateway.store.keys import Keys
from gateway.store.reply_streams import ReplyStreams


@pytest.fixture(params=["plain", "packed"])
async def streams(redis_url, key_prefix, request):
    # redis-py's own connections, and the gateway's (answers read in one go)
    extra = packing_options() if request.param == "packed" else {}
    r = aioredis.from_url(redis_url, decode_responses=True, socket_timeout=10, **extra)
    yield ReplyStreams(r, r, Keys(key_prefix), ttl_s=60, maxlen=1000), r
    await r.aclose()


async def test_one_iterations_writes_go_as_one_packed_write_each_with_its_own_outcome(streams, monkeypatch):
    s, r = streams
    await r.set(s.keys.gen("bad"), "not a stream")  # XADD to it fails with WRONGTYPE
    calls = 0
    sends = {cls: cls.send_packed_command for cls in (AbstractConnection, PackedConnection)}

    def counting(cls):
        async def count(self, *args, **kwargs):
            nonlocal calls
            calls += 1
            return await sends[cls](self, *args, **kwargs)
        return count

    for cls in sends:
        monkeypatch.setattr(cls, "send_packed_command", counting(cls))
    try:
        await s.delta("a", 1, "x")
        calls = 0
        results = await asyncio.gather(*(s.delta(f"r{i}", 1, f"t{i}") for i in range(16)),
                                       s.delta("a", 1, "x"),  # a retried write that was applied: no error
                                       s.delta("bad", 1, "y"), return_exceptions=True)
    finally:
        monkeypatch.undo()
    assert calls == 1
    assert results[:17] == [None] * 17
    assert isinstance(results[17], rexc.ResponseError) and "WRONGTYPE" in str(results[17])
    for i in range(16):
        assert await s.delta_text(f"r{i}", 1) == f"t{i}"
        assert 0 < await r.ttl(s.keys.gen(f"r{i}")) <= 60
