"""Every reply cut short is stored as ``partial`` with why it was cut: the user's Stop
(``user_stop``), the gateway shutting down (``gateway_shutdown``) or the engine going
away mid-reply (``engine_lost``)."""

from __future__ import annotations

import json

import redis

from gateway.store.keys import Keys
from tests.engine_gate import of_type, text_delta
from tests.fixtures_servers import gate_in_front_of
from tests.gateway_helpers import read_reply, recv, send

STORY = {"temperature": 0, "max_tokens": 300, "ignore_eos": True}


def stored_messages(redis_url: str, prefix: str, sid: str) -> list[dict]:
    """The chat's messages read from Redis directly (works with the gateway stopped)."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        return [json.loads(m) for m in client.lrange(Keys(prefix).session(sid) + ":messages", 0, -1)]
    finally:
        client.close()


async def _start_and_pause(ws, gate) -> dict:
    gate.pause_on(text_delta())
    await send(ws, {"type": "chat", "content": "Tell me a long story.", "params": STORY})
    start = await recv(ws)
    assert start["type"] == "start"
    await gate.paused()
    return start


async def test_a_stopped_reply_is_stored_with_cut_reason_user_stop(gateway_factory, engine_gate, redis_url,
                                                                   key_prefix):
    gw = gateway_factory(engine_urls=[engine_gate.url])
    cookie = gw.new_cookie()
    async with gw.connect(cookie) as ws:
        start = await _start_and_pause(ws, engine_gate)
        await send(ws, {"type": "cancel", "request_id": start["request_id"]})
        await engine_gate.sent(of_type("abort", start["request_id"]))
        engine_gate.resume()
        r = await read_reply(ws, start["request_id"], reply=None)
    assert r.done is not None and r.done["finish_reason"] == "abort"
    reply = stored_messages(redis_url, key_prefix, start["session_id"])[-1]
    assert (reply["status"], reply["cut_reason"]) == ("partial", "user_stop")


async def test_a_reply_cut_by_a_gateway_shutdown_is_stored_with_that_reason(gateway_factory, engine_gate, redis_url,
                                                                            key_prefix):
    gw = gateway_factory(engine_urls=[engine_gate.url], cancel_grace_s=1.0)
    cookie = gw.new_cookie()
    async with gw.connect(cookie) as ws:
        start = await _start_and_pause(ws, engine_gate)
        gw.stop()  # stores the reply as partial (the paused engine never confirms the abort)
    engine_gate.resume()
    reply = stored_messages(redis_url, key_prefix, start["session_id"])[-1]
    assert reply["role"] == "assistant"
    assert (reply["status"], reply["cut_reason"]) == ("partial", "gateway_shutdown")


async def test_a_reply_cut_by_a_lost_engine_is_stored_with_that_reason(gateway_factory, tiny_engine, redis_url,
                                                                       key_prefix):
    gate = gate_in_front_of(tiny_engine)  # its own gate: closing it is the engine going away
    closed = False
    try:
        gw = gateway_factory(engine_urls=[gate.url])
        cookie = gw.new_cookie()
        async with gw.connect(cookie) as ws:
            start = await _start_and_pause(ws, gate)
            await recv(ws)  # the first delta reached the client: the reply has text
            gate.close()  # resumes the engine and drops the link mid-reply
            closed = True
            r = await read_reply(ws, start["request_id"])
        assert r.done is not None and r.done["finish_reason"] == "error"
    finally:
        if not closed:
            gate.close()
    reply = stored_messages(redis_url, key_prefix, start["session_id"])[-1]
    assert (reply["status"], reply["cut_reason"]) == ("partial", "engine_lost")
