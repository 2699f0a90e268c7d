"""Several engines and several gateways: a request moves to the next engine when its
engine is lost before the first delta, a busy home engine sheds a chat to an idle one
(which then keeps it), and two gateways on one Redis serve one chat as one. Real
engines (the tiny model) behind ``EngineGate`` relays, so where each ``generate`` went
is observable and an engine can be held still."""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis

from gateway.engines.routing import rendezvous_rank
from tests.engine_gate import EngineGate, of_type, text_delta
from tests.fixtures_servers import gate_in_front_of
from tests.gateway_helpers import Reply, chat, read_reply, recv, send, wait_for


async def chat_homed_on(c: Any, url: str, urls: list[str]) -> str:
    """A new chat (``POST /api/sessions``) whose rendezvous choice among ``urls`` is ``url``."""
    while True:
        sid = (await c.post("/api/sessions", json={})).json()["id"]
        if max(urls, key=lambda u: rendezvous_rank(sid, u)) == url:
            return sid


def generates(gate: EngineGate, request_id: str) -> int:
    """How many ``generate`` frames of ``request_id`` went through ``gate``."""
    return sum(1 for f in gate.to_engine if f.get("type") == "generate" and f.get("request_id") == request_id)


async def test_engine_lost_before_the_first_delta_the_next_engine_takes_the_request(gateway_factory, engine_gate,
                                                                                  spare_engine):
    doomed = gate_in_front_of(spare_engine)
    try:
        urls = [doomed.url, engine_gate.url]
        # rendezvous alone: the chat's first turn goes to its home, whatever the engines cached
        gw = gateway_factory(engine_urls=urls, routing={"policy": "hash"})
        await wait_for(lambda: len(gw.state.router.healthy) == 2, 30)
        cookie = gw.new_cookie()
        async with gw.http(cookie) as c:
            sid = await chat_homed_on(c, doomed.url, urls)
        async with gw.connect(cookie) as ws:
            doomed.pause()  # the home engine holds still: it can send no delta
            await send(ws, {"type": "chat", "session_id": sid, "content": "Hello there.",
                            "params": {"max_tokens": 6, "temperature": 0, "ignore_eos": True}})
            start = await recv(ws)
            rid = start["request_id"]
            await doomed.sent(of_type("generate", rid))
            spare_engine.process.kill()  # lost with the request on it and nothing produced
            r = await read_reply(ws, rid, reply=Reply(start=start))
        assert r.error is None and r.done is not None and r.done["finish_reason"] == "length", r
        assert r.done["usage"]["completion_tokens"] == 6 and r.text
        assert not any(f.get("request_id") == rid for f in doomed.from_engine)
        assert generates(engine_gate, rid) == 1
        async with gw.http(cookie) as c:
            body = (await c.get(f"/api/sessions/{sid}")).json()
        assert [m["role"] for m in body["messages"]] == ["user", "assistant"]  # stored once
        assert body["messages"][-1]["status"] == "complete" and body["messages"][-1]["content"] == r.text
        assert body["active"] is None
    finally:
        doomed.close()


async def test_a_busy_home_engine_sheds_a_chat_to_the_idle_one_which_keeps_it(gateway_factory, engine_gate,
                                                                            spare_engine, redis_url, key_prefix):
    """The ``sticky`` rule (the cache-aware rule's fallback when nothing of a prompt is
    known): five replies held on engine A (its load is 5, engine B's 0: above both
    thresholds, 5 - 0 > 4 and 5 > 1.5 x 0; the fifth itself met 4 - 0, not above) send
    a new chat homed on A to B; once A is idle again the chat's
    second turn still goes to B (its placement in Redis), where its prefix is cached."""
    idle_gate = gate_in_front_of(spare_engine)
    try:
        busy_gate = engine_gate
        urls = [busy_gate.url, idle_gate.url]
        gw = gateway_factory(engine_urls=urls, limits={"max_generations_per_user": 16},
                             routing={"policy": "sticky", "abs_threshold": 4, "rel_threshold": 1.5})
        await wait_for(lambda: len(gw.state.router.healthy) == 2, 30)
        cookie = gw.new_cookie()
        async with gw.http(cookie) as c:
            held = [await chat_homed_on(c, busy_gate.url, urls) for _ in range(5)]
            late = await chat_homed_on(c, busy_gate.url, urls)
        async with gw.connect(cookie) as busy_ws, gw.connect(cookie) as ws:
            busy_gate.pause()
            for sid in held:
                await send(busy_ws, {"type": "chat", "session_id": sid, "content": "Wait.",
                                     "params": {"max_tokens": 4, "temperature": 0}})
                start = await recv(busy_ws)
                await busy_gate.sent(of_type("generate", start["request_id"]))  # none shed
            r1 = await chat(ws, "Shed me.", late, max_tokens=4)
            assert r1.done is not None, r1.error
            assert generates(idle_gate, r1.request_id) == 1 and generates(busy_gate, r1.request_id) == 0
            client = aioredis.from_url(redis_url, decode_responses=True)
            try:
                assert await client.get(f"{key_prefix}chat:route:{late}") == idle_gate.url
            finally:
                await client.aclose()
            busy_gate.resume()
            await wait_for(lambda: not gw.state.generations.running, 60)
            r2 = await chat(ws, "Still there?", late, max_tokens=4)
        assert r2.done is not None, r2.error
        assert generates(idle_gate, r2.request_id) == 1  # the chat kept its new engine
        assert r2.done["usage"]["cached_tokens"] > 0
    finally:
        idle_gate.close()


async def test_two_gateways_on_one_redis_serve_one_chat_as_one(gateway_factory, engine_gate, spare_engine):
    """Gateways A and B, engines 1 and 2, one Redis: both choose the same engine for
    every chat; a chat started on A continues on B with its prefix cache hit; B resumes
    and cancels a reply that A is generating."""
    other = gate_in_front_of(spare_engine)
    try:
        urls = [engine_gate.url, other.url]
        secret = "one-secret-for-both-gateways"
        gw_a = gateway_factory(engine_urls=urls, secret_key=secret)
        gw_b = gateway_factory(engine_urls=urls, secret_key=secret)
        await wait_for(lambda: len(gw_a.state.router.healthy) == len(gw_b.state.router.healthy) == 2, 30)
        cookie = gw_a.new_cookie()
        async with gw_a.http(cookie) as c:
            sids = [(await c.post("/api/sessions", json={})).json()["id"] for _ in range(12)]
            sid = await chat_homed_on(c, engine_gate.url, urls)
        for s in sids:
            on_a = gw_a.run(gw_a.state.router.choose(s)).url
            on_b = gw_b.run(gw_b.state.router.choose(s)).url
            assert on_a == on_b, s
        assert len({max(urls, key=lambda u: rendezvous_rank(s, u)) for s in sids}) == 2  # both engines chosen

        async with gw_a.connect(cookie) as a:
            r1 = await chat(a, "Tell me about rivers.", sid, max_tokens=8)
        async with gw_b.connect(cookie) as b:
            r2 = await chat(b, "And lakes?", sid, max_tokens=8)
        assert r1.done is not None and r2.done is not None
        assert generates(engine_gate, r1.request_id) == generates(engine_gate, r2.request_id) == 1
        assert r2.done["usage"]["cached_tokens"] > 0  # turn 2 through B met turn 1's cache

        async with gw_a.connect(cookie) as a, gw_b.connect(cookie) as b:
            engine_gate.pause_on(text_delta())
            await send(a, {"type": "chat", "session_id": sid, "content": "Go on.",
                           "params": {"max_tokens": 1800, "temperature": 0, "ignore_eos": True}})
            start = await recv(a)
            rid = start["request_id"]
            await send(b, {"type": "resume", "request_id": rid, "last_seq": 0})

            async def cancel_from_b(f: dict, r: Reply) -> None:
                if f["type"] == "delta" and f["seq"] == 1:
                    await engine_gate.paused()
                    await send(b, {"type": "cancel", "request_id": rid})
                    await engine_gate.sent(of_type("abort", rid))  # gateway A got it through Redis
                    engine_gate.resume()

            on_b = await read_reply(b, rid, on_frame=cancel_from_b)
            on_a = await read_reply(a, rid, reply=Reply(start=start))
        assert on_b.done["finish_reason"] == on_a.done["finish_reason"] == "abort"
        assert on_b.text == on_a.text
        async with gw_b.http(cookie) as c:
            body = (await c.get(f"/api/sessions/{sid}")).json()
        assert body["messages"][-1]["status"] == "partial" and body["messages"][-1]["content"] == on_a.text
        assert [m["role"] for m in body["messages"]] == ["user", "assistant"] * 3
    finally:
        other.close()


async def test_a_new_chat_opening_with_a_cached_document_goes_to_the_engine_that_holds_it(
        gateway_factory, engine_gate, spare_engine):
    """cache_aware routing: the engines report the pages they cache, the gateway hashes a
    new chat's prompt with the engines' tokenizer, and a chat whose home is engine 2 but
    whose document engine 1 has cached goes to engine 1 and reads it from the cache."""
    import uuid

    other = gate_in_front_of(spare_engine)
    try:
        urls = [engine_gate.url, other.url]
        gw = gateway_factory(engine_urls=urls)
        router = gw.state.router
        await wait_for(lambda: len(router.healthy) == 2, 30)
        words = uuid.uuid4().hex  # a document no engine has seen in an earlier test
        doc = "Shared notes " + " ".join(f"{words[i % 32]}{i}" for i in range(120))
        cookie = gw.new_cookie()
        async with gw.http(cookie) as c:
            first = await chat_homed_on(c, engine_gate.url, urls)
            second = await chat_homed_on(c, other.url, urls)
        async with gw.connect(cookie) as ws:
            r1 = await chat(ws, doc + "\n\nWhat is the first word?", first, max_tokens=4)
            assert r1.done is not None, r1.error
            assert generates(engine_gate, r1.request_id) == 1  # nothing cached anywhere: its home
            await wait_for(lambda: router.tokenizer is not None, 120)
            await wait_for(lambda: router.index.pages_of(engine_gate.url) >= 4, 30)
            r2 = await chat(ws, doc + "\n\nWhat is the last word?", second, max_tokens=4)
        assert r2.done is not None, r2.error
        assert generates(engine_gate, r2.request_id) == 1 and generates(other, r2.request_id) == 0
        assert r2.done["usage"]["cached_tokens"] >= 4 * 16
    finally:
        other.close()


async def test_an_engine_that_drops_leaves_the_prefix_index(gateway_factory, engine_gate, spare_engine):
    """The pages of an engine whose link is lost leave the index (its cache is unknown
    until it reconnects and sends its snapshot); the other engine's stay."""
    other = gate_in_front_of(spare_engine)
    try:
        gw = gateway_factory(engine_urls=[engine_gate.url, other.url])
        router = gw.state.router
        await wait_for(lambda: len(router.healthy) == 2, 30)
        cookie = gw.new_cookie()
        async with gw.connect(cookie) as ws:
            r = await chat(ws, "Count to five, please.", max_tokens=4)
        assert r.done is not None, r.error
        await wait_for(lambda: router.index.pages_of(engine_gate.url) + router.index.pages_of(other.url) > 0, 30)
        held = {u: router.index.pages_of(u) for u in (engine_gate.url, other.url)}
    finally:
        other.close()
    await wait_for(lambda: len(router.healthy) == 1, 30)
    assert router.index.pages_of(other.url) == 0
    assert router.index.pages_of(engine_gate.url) == held[engine_gate.url]
