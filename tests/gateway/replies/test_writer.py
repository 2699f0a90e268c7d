"""The reply writer on the real Redis: text taken without waiting while a delta write is
out goes as the next delta, in order, and the stream, the in-memory log and the reply's
text agree."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis
import redis.exceptions as rexc

from gateway.replies.writer import ReplyWriter
from gateway.store.keys import Keys
from gateway.store.reply_streams import ReplyStreams


@pytest.fixture
async def streams(redis_url, key_prefix):
    r = aioredis.from_url(redis_url, decode_responses=True)
    yield ReplyStreams(r, r, Keys(key_prefix), ttl_s=60, maxlen=1000), r
    await r.aclose()


async def test_text_taken_while_a_write_is_out_goes_as_the_next_delta_in_order(streams):
    s, r = streams
    w = ReplyWriter("w1", s, store_retry_s=5)
    for word in ("a", "b", "c", "d"):
        w.add_nowait(word)  # "a" is written at once; the rest comes while its write is out
    assert w.text == "abcd" and w.seq == 0
    await w.flush()
    rows = await r.xrange(s.keys.gen("w1"))
    assert [(eid, f["x"]) for eid, f in rows] == [("1-1", "a"), ("2-1", "bcd")]
    assert w.log.deltas == ["a", "bcd"] and w.seq == 2 and w.text == "abcd" and w.streaming


async def test_a_failed_write_keeps_its_text_and_the_next_write_stores_it(streams):
    s, r = streams
    await r.set(s.keys.gen("w2"), "not a stream")  # XADD to it fails with WRONGTYPE
    w = ReplyWriter("w2", s, store_retry_s=5)
    w.add_nowait("kept")
    with pytest.raises(rexc.ResponseError, match="WRONGTYPE"):
        await w.flush()
    assert not w.streaming and w.text == "kept" and w.seq == 0
    await r.delete(s.keys.gen("w2"))
    await w.add(" and more")  # after a failure: the waiting path, which checks, then writes
    assert [f["x"] for _, f in await r.xrange(s.keys.gen("w2"))] == ["kept and more"]
    assert w.log.deltas == ["kept and more"] and w.text == "kept and more"
