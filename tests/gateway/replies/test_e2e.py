"""The browser protocol end to end: real gateway, real Redis, real engine (tiny model).

Where a test acts while a reply runs (Stop, a dropped socket, a busy chat), the gateway
reaches the engine through an ``EngineGate`` (tests/engine_gate.py) that pauses the
engine at the right frame, so the reply is still running however fast the engine is."""

from __future__ import annotations

import asyncio
import json

import pytest
import redis.asyncio as aioredis
from websockets.exceptions import InvalidStatus

from gateway.engines.routing import rendezvous_rank
from tests.engine_gate import of_type, text_delta
from tests.fixtures_servers import gate_in_front_of
from tests.gateway_helpers import BLOCK, Reply, chat, read_reply, recv, send, stored, token_messages, uid_of, wait_for


async def test_three_turn_chat_streams_in_order_and_stores_history_with_token_ids(gateway_factory):
    gw = gateway_factory()
    cookie = gw.new_cookie()
    replies = []
    async with gw.connect(cookie) as ws:
        sid = None
        for i, q in enumerate(["Hello there.", "Tell me more.", "And then?"]):
            r = await chat(ws, q, sid, max_tokens=12 + 4 * i)
            assert r.error is None, r.error
            sid = r.start["session_id"]
            assert r.seqs == list(range(1, len(r.deltas) + 1))  # in order, no gaps
            assert r.done["finish_reason"] in ("stop", "length")
            assert r.done["message_id"] == r.start["message_id"] and r.done["session_id"] == sid
            t = r.done["timings"]
            assert set(t) == {"ttft_ms", "tpot_ms", "e2e_ms", "acceptance_rate", "tokens_per_step"}
            assert 0.0 <= t["acceptance_rate"] <= 1.0  # speculation: accepted / verified drafts
            assert t["tokens_per_step"] >= 1.0 or r.done["usage"]["completion_tokens"] <= 1  # a token a step at least
            replies.append(r)
    assert replies[0].done["title"] == "Hello there." and "title" not in replies[1].done
    for prev, cur in zip(replies, replies[1:]):  # turn N+1 finds turn N's prompt and reply cached
        u0, u1 = prev.done["usage"], cur.done["usage"]
        assert u1["cached_tokens"] >= u0["prompt_tokens"] + u0["completion_tokens"] - BLOCK
    body = await stored(gw, cookie, sid)
    assert [m["role"] for m in body["messages"]] == ["user", "assistant"] * 3
    assert [m["content"] for m in body["messages"][1::2]] == [r.text for r in replies]
    assert all(m["status"] == "complete" for m in body["messages"]) and body["active"] is None
    uid = uid_of(gw, cookie)
    msgs = token_messages(gw, uid, sid)
    assert all(m["token_ids"] for m in msgs)
    for k, r in enumerate(replies):  # the segments add up to each turn's prompt, reply by reply
        seg = msgs[2 * k + 1]["token_ids"]
        assert len(seg) == r.done["usage"]["completion_tokens"]
        start = max(i for i in range(2 * k + 1) if i == 0 or msgs[i]["tokens_base"])
        prompt_len = sum(len(m["token_ids"]) for m in msgs[start:2 * k + 1])
        assert prompt_len == r.done["usage"]["prompt_tokens"]


async def engine_stats(gw) -> dict:
    async with gw.http(None) as c:
        return (await c.get("/api/engine/stats")).json()["engines"][0]["stats"]


async def idle(gw) -> dict:
    s = {}

    async def quiet() -> bool:
        s.update(await engine_stats(gw))
        return s["running"] == 0 and s["waiting"] == 0

    await wait_for(quiet, 60)
    return s


@pytest.mark.parametrize("when", ["after_first_delta", "before_first_delta"])
async def test_cancel_stops_the_engine_frees_its_blocks_and_stores_the_partial_reply(gateway_factory, engine_gate,
                                                                                     when):
    """Stop frees the engine (docs/acceptance.md#stop-frees-the-engine): Stop aborts the engine request at once; only
    cache blocks stay.
    The engine is paused from its first delta (or from before the request) until the abort reaches it."""
    gw = gateway_factory(engine_urls=[engine_gate.url])
    cookie = gw.new_cookie()
    before = await idle(gw)
    async with gw.connect(cookie) as ws:
        if when == "after_first_delta":
            engine_gate.pause_on(text_delta())
        else:
            engine_gate.pause()  # the abort reaches the engine with the request (during its tokenization)
        await send(ws, {"type": "chat", "content": "Write a 3,000-word story about a canal.",
                        "params": {"max_tokens": 1800, "temperature": 0, "ignore_eos": True}})
        cancelled = False

        async def cancel_at(f, r):
            nonlocal cancelled
            trigger = f["type"] == ("delta" if when == "after_first_delta" else "start")
            if trigger and not cancelled:
                cancelled = True
                await engine_gate.paused()
                await send(ws, {"type": "cancel", "request_id": r.request_id})
                await engine_gate.sent(of_type("abort", r.request_id))
                engine_gate.resume()

        r = await read_reply(ws, on_frame=cancel_at)
    assert r.error is None and r.done["finish_reason"] == "abort"
    assert r.done["usage"]["completion_tokens"] < 600  # stopped long before max_tokens
    after = await idle(gw)
    assert after["blocks_held_by_requests"] == 0
    in_use = lambda s: s["blocks_used"] - s["blocks_evictable"]  # noqa: E731
    assert in_use(after) <= in_use(before)
    body = await stored(gw, cookie, r.start["session_id"])
    reply = body["messages"][-1]
    assert (reply["role"], reply["status"], reply["finish_reason"]) == ("assistant", "partial", "abort")
    assert reply["content"] == r.text and body["active"] is None


async def test_dropped_socket_keeps_generating_and_resume_gets_every_delta_once(gateway_factory, engine_gate):
    gw = gateway_factory(engine_urls=[engine_gate.url])
    cookie = gw.new_cookie()
    async with gw.connect(cookie) as ws:
        engine_gate.pause_on(text_delta())  # the reply is a few tokens in when the socket drops
        await send(ws, {"type": "chat", "content": "Count slowly.",
                        "params": {"max_tokens": 80, "temperature": 0, "ignore_eos": True}})
        first = await recv(ws)
        assert first["type"] == "start"
        seen = [await recv(ws)]
        await engine_gate.paused()
    assert [f["seq"] for f in seen] == [1]
    engine_gate.resume()  # the rest is generated with no socket watching
    rid, sid = first["request_id"], first["session_id"]
    async with gw.connect(cookie) as ws2:
        await send(ws2, {"type": "resume", "request_id": rid, "last_seq": 1})
        rest = await read_reply(ws2, rid)
    assert rest.start["message_id"] == first["message_id"]
    assert rest.deltas and rest.seqs == list(range(2, 2 + len(rest.deltas)))  # exactly the rest, once
    whole = "".join(f["text"] for f in seen) + rest.text
    body = await stored(gw, cookie, sid)
    assert body["messages"][-1]["content"] == whole and body["messages"][-1]["status"] == "complete"
    assert rest.done["usage"]["completion_tokens"] == 80
    async with gw.connect(cookie) as ws3:  # after the end, a resume from 0 replays all of it
        await send(ws3, {"type": "resume", "request_id": rid, "last_seq": 0})
        again = await read_reply(ws3, rid)
        await send(ws3, {"type": "resume", "request_id": rid, "last_seq": 10_000})
        tail = await read_reply(ws3, rid)
    assert again.text == whole and again.seqs == list(range(1, len(again.deltas) + 1))
    assert tail.deltas == [] and tail.done == again.done


async def test_a_reply_whose_gateway_died_ends_its_followers_and_a_live_one_does_not(gateway_factory, engine_gate):
    # A gateway killed outright (SIGKILL) leaves its reply's stream without an end: a
    # follower used to wait for one forever. It now gets not_found (the page then re-reads
    # the stored chat) once the reply's lease has run out; a reply that is only slow, on
    # another replica that renews its lease, is followed to its end.
    secret = "one-secret-for-both-replicas"
    home = gateway_factory(secret_key=secret, engine_urls=[engine_gate.url], lock_lease_ms=1000)
    other = gateway_factory(secret_key=secret, engine_urls=[engine_gate.url], lock_lease_ms=1000)
    cookie = home.new_cookie()
    async with home.connect(cookie) as ws:
        engine_gate.pause_on(text_delta())
        await send(ws, {"type": "chat", "content": "Count slowly.",
                        "params": {"max_tokens": 12, "temperature": 0, "ignore_eos": True}})
        start = await recv(ws)
        await engine_gate.paused()
        rid = start["request_id"]
        async with other.connect(cookie) as watcher:  # follows from the stream, not from memory
            await send(watcher, {"type": "resume", "request_id": rid, "last_seq": 0})
            await asyncio.sleep(7)  # longer than a blocking read of the stream (5 s), lease renewed meanwhile
            engine_gate.resume()
            slow = await read_reply(watcher, rid)
        assert slow.error is None and slow.done is not None
        await read_reply(ws, rid, reply=Reply(start=start))

    streams = home.state.streams
    key = streams.keys.gen(rid)
    last = home.run(streams.redis.xrevrange(key, "+", "-", count=1))
    assert home.run(streams.last(rid)).terminal
    home.run(streams.redis.xdel(key, last[0][0]))  # as if its gateway died before writing the end
    async with other.connect(cookie) as watcher:
        await send(watcher, {"type": "resume", "request_id": rid, "last_seq": 0})
        cut = await read_reply(watcher, rid)
    assert cut.done is None and cut.error is not None and cut.error["code"] == "not_found"
    assert cut.text == slow.text  # every delta written before the death still comes


async def test_a_second_tab_watches_the_same_reply(gateway_factory):
    gw = gateway_factory()
    cookie = gw.new_cookie()
    async with gw.connect(cookie) as a, gw.connect(cookie) as b:
        await send(a, {"type": "chat", "content": "Hi", "params": {"max_tokens": 40, "temperature": 0,
                                                                   "ignore_eos": True}})
        start = await recv(a)
        await send(b, {"type": "resume", "request_id": start["request_id"], "last_seq": 0})
        ra, rb = await asyncio.gather(read_reply(a, start["request_id"], reply=Reply(start=start)),
                                      read_reply(b, start["request_id"]))
    assert ra.text == rb.text and ra.seqs == rb.seqs and ra.done == rb.done
    assert len(ra.deltas) > 0


async def test_users_never_see_each_others_chats(gateway_factory):
    gw = gateway_factory()
    alice, bob = gw.new_cookie(), gw.new_cookie()
    async with gw.connect(alice) as ws:
        mine = await chat(ws, "secret plans", max_tokens=8)
    sid, rid = mine.start["session_id"], mine.request_id
    async with gw.http(bob) as c:
        assert (await c.get("/api/sessions")).json() == {"sessions": []}
        for method, body in (("GET", None), ("PATCH", {"title": "mine now"}), ("DELETE", None)):
            r = await c.request(method, f"/api/sessions/{sid}", json=body)
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    async with gw.connect(bob) as ws:
        for frame in ({"type": "chat", "session_id": sid, "content": "hi"},
                      {"type": "regenerate", "session_id": sid},
                      {"type": "resume", "request_id": rid, "last_seq": 0},
                      {"type": "cancel", "request_id": rid}):
            await send(ws, frame)
            err = await recv(ws)
            assert (err["type"], err["code"]) == ("error", "not_found"), frame
    body = await stored(gw, alice, sid)
    assert body["title"] == "secret plans" and len(body["messages"]) == 2


async def test_malformed_and_unknown_frames_get_errors_and_the_socket_keeps_working(gateway_factory):
    gw = gateway_factory()
    cookie = gw.new_cookie()
    async with gw.connect(cookie) as ws:
        for raw in ("not json", "[1, 2]", json.dumps({"type": "dance"}), json.dumps({"type": "chat"}),
                    json.dumps({"type": "resume", "request_id": "r", "last_seq": -1})):
            await ws.send(raw)
            err = await recv(ws)
            assert (err["type"], err["code"]) == ("error", "bad_frame"), raw
        await ws.send(b"\x00\x01binary")
        assert (await recv(ws))["code"] == "bad_frame"
        await send(ws, {"type": "chat", "session_id": "0" * 32, "content": "hi"})
        err = await recv(ws)
        assert (err["code"], err["session_id"]) == ("not_found", "0" * 32)
        await send(ws, {"type": "resume", "request_id": "f" * 32, "last_seq": 0})
        assert (await recv(ws))["code"] == "not_found"
        await send(ws, {"type": "chat", "content": "hi", "params": {"temperature": -1}})
        assert (await recv(ws))["code"] == "invalid_request"
        await send(ws, {"type": "chat", "content": "hi", "params": {"no_such_param": 1}})
        assert (await recv(ws))["code"] == "invalid_request"
        await send(ws, {"type": "ping"})
        assert await recv(ws) == {"type": "pong"}
        r = await chat(ws, "still there?", max_tokens=4)
        assert r.done is not None
    async with gw.http(cookie) as c:  # the invalid frames created no chats
        assert len((await c.get("/api/sessions")).json()["sessions"]) == 1


async def test_handshake_without_allowed_origin_or_valid_cookie_is_refused_with_403(gateway_factory):
    gw = gateway_factory()
    cookie = gw.new_cookie()
    for kwargs in ({"cookie": cookie, "origin": "http://evil.example"}, {"cookie": cookie, "origin": None},
                   {"cookie": None}, {"cookie": cookie[:-3] + "abc"}):
        with pytest.raises(InvalidStatus) as e:
            async with gw.connect(**kwargs):
                pass
        assert e.value.response.status_code == 403, kwargs
    async with gw.connect(cookie) as ws:  # and the server still serves
        await send(ws, {"type": "ping"})
        assert await recv(ws) == {"type": "pong"}


async def test_second_request_on_a_busy_chat_gets_busy_and_two_tabs_lose_nothing(gateway_factory, engine_gate):
    """No lost writes (docs/acceptance.md#no-lost-writes) through the socket: both tabs send at once; one is told busy,
    retries, and every message and reply is stored in the order the tabs saw."""
    gw = gateway_factory(engine_urls=[engine_gate.url])
    cookie = gw.new_cookie()
    async with gw.connect(cookie) as a, gw.connect(cookie) as b:
        first = await chat(a, "start", max_tokens=4)
        sid = first.start["session_id"]
        frames = [{"type": "chat", "session_id": sid, "content": f"from {n}",
                   "params": {"max_tokens": 30, "temperature": 0, "ignore_eos": True}} for n in "ab"]
        engine_gate.pause()  # the winner's reply cannot end before the other tab's frame is handled
        await asyncio.gather(send(a, frames[0]), send(b, frames[1]))
        reads = [asyncio.create_task(read_reply(a)), asyncio.create_task(read_reply(b))]
        await asyncio.wait(reads, return_when=asyncio.FIRST_COMPLETED)  # the loser's answer
        engine_gate.resume()
        ra, rb = await asyncio.gather(*reads)
        winner, loser, loser_ws, loser_frame = (ra, rb, b, frames[1]) if ra.start else (rb, ra, a, frames[0])
        assert winner.done is not None
        assert loser.error["code"] == "busy" and loser.error["session_id"] == sid
        await send(loser_ws, loser_frame)
        retry = await read_reply(loser_ws)
        assert retry.done is not None
    body = await stored(gw, cookie, sid)
    contents = [m["content"] for m in body["messages"]]
    won = "from a" if winner is ra else "from b"
    lost = "from b" if won == "from a" else "from a"
    assert contents == ["start", first.text, won, winner.text, lost, retry.text]


async def test_regenerate_replaces_the_last_reply(gateway_factory):
    gw = gateway_factory()
    cookie = gw.new_cookie()
    async with gw.connect(cookie) as ws:
        old = await chat(ws, "Say something.", max_tokens=6)
        sid = old.start["session_id"]
        await send(ws, {"type": "regenerate", "session_id": sid,
                        "params": {"temperature": 1.0, "seed": 7, "max_tokens": 9}})
        new = await read_reply(ws)
    assert new.done is not None and new.start["message_id"] != old.start["message_id"]
    assert new.done["usage"]["cached_tokens"] >= new.done["usage"]["prompt_tokens"] - BLOCK
    body = await stored(gw, cookie, sid)
    assert [(m["role"], m["content"]) for m in body["messages"]] == [("user", "Say something."),
                                                                     ("assistant", new.text)]


async def test_resending_a_client_msg_id_reattaches_to_the_same_turn(gateway_factory):
    gw = gateway_factory()
    cookie = gw.new_cookie()
    async with gw.connect(cookie) as ws:
        frame = {"type": "chat", "content": "once", "client_msg_id": "tab1-42",
                 "params": {"max_tokens": 10, "temperature": 0}}
        await send(ws, frame)
        first = await read_reply(ws)
        await send(ws, {**frame, "session_id": first.start["session_id"]})
        again = await read_reply(ws)
    assert again.request_id == first.request_id and again.text == first.text and again.done == first.done
    body = await stored(gw, cookie, first.start["session_id"])
    assert [m["content"] for m in body["messages"]] == ["once", first.text]


async def test_context_length_error_is_passed_on_and_the_chat_stays_usable(gateway_factory):
    gw = gateway_factory()
    cookie = gw.new_cookie()
    async with gw.connect(cookie) as ws:
        ok = await chat(ws, "Short one.", max_tokens=5)
        sid = ok.start["session_id"]
        huge = "lorem ipsum dolor sit amet " * 800  # ~4,000 tokens > the tiny model's 2,048
        await send(ws, {"type": "chat", "session_id": sid, "content": huge})
        r = await read_reply(ws)
        assert r.error["code"] == "context_length_exceeded" and r.error["request_id"] == r.request_id
        again = await chat(ws, "Short two.", sid, max_tokens=5)
        assert again.done is not None
        assert again.done["usage"]["cached_tokens"] >= ok.done["usage"]["prompt_tokens"] - BLOCK
    body = await stored(gw, cookie, sid)
    assert [m["content"] for m in body["messages"]] == ["Short one.", ok.text, "Short two.", again.text]


async def test_http_api_creates_reads_renames_and_deletes_chats(gateway_factory, engine_gate):
    gw = gateway_factory(engine_urls=[engine_gate.url])
    cookie = gw.new_cookie()
    async with gw.http(cookie) as c:
        r = await c.post("/api/sessions", json={"title": "Notes", "system_prompt": "Be terse.",
                                                 "params": {"temperature": 0, "max_tokens": 30, "ignore_eos": True}})
        assert r.status_code == 201
        sid = r.json()["id"]
        assert r.json()["system_prompt"] == "Be terse." and r.json()["messages"] == []
        for bad in ({"params": {"top_p": 0}}, {"title": 5}, {"params": "hot"}, {"title": "x" * 1000}):
            r = await c.patch(f"/api/sessions/{sid}", json=bad)
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", bad
        r = await c.post("/api/sessions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400
        r = await c.post("/api/sessions", content=b"x" * (2 << 20))
        assert r.status_code == 413
        async with gw.connect(cookie) as ws:
            engine_gate.pause()  # the reply is still running when the chat is read
            await send(ws, {"type": "chat", "session_id": sid, "content": "go"})
            start = await recv(ws)
            mid = (await c.get(f"/api/sessions/{sid}")).json()
            assert mid["active"]["request_id"] == start["request_id"] and mid["active"]["last_seq"] >= 0
            assert [m["role"] for m in mid["messages"]] == ["user"]
            engine_gate.resume()
            r = await read_reply(ws, start["request_id"], reply=Reply(start=start))
        assert r.done["usage"]["completion_tokens"] == 30  # the chat's stored params applied
        r = await c.patch(f"/api/sessions/{sid}", json={"title": "Renamed"})
        assert r.status_code == 200 and r.json()["title"] == "Renamed" and r.json()["active"] is None
        listed = (await c.get("/api/sessions")).json()["sessions"]
        assert [(s["id"], s["title"]) for s in listed] == [(sid, "Renamed")]
        assert (await c.delete(f"/api/sessions/{sid}")).status_code == 204
        assert (await c.get(f"/api/sessions/{sid}")).status_code == 404
        assert (await c.get("/api/sessions/not*an*id")).status_code == 404


async def test_no_engine_gives_engine_unavailable_and_readyz_503(gateway_factory):
    gw = gateway_factory(engine_urls=["ws://127.0.0.1:9"], wait_for_engine=False)
    cookie = gw.new_cookie()
    async with gw.http(cookie) as c:
        assert (await c.get("/healthz")).status_code == 200
        r = await c.get("/readyz")
        assert r.status_code == 503 and r.json()["engines"] == 0 and r.json()["redis"] is True
    async with gw.connect(cookie) as ws:
        await send(ws, {"type": "chat", "content": "anyone?"})
        err = await recv(ws)
        assert err["code"] == "engine_unavailable"
    async with gw.http(cookie) as c:
        assert (await c.get("/api/sessions")).json()["sessions"] == []  # nothing half-made


async def test_redis_down_gives_store_unavailable_without_tracebacks(gateway_factory):
    gw = gateway_factory(redis_url="redis://127.0.0.1:9/0")
    cookie = gw.new_cookie()
    async with gw.http(cookie) as c:
        r = await c.get("/readyz")
        assert r.status_code == 503 and r.json()["redis"] is False
        r = await c.get("/api/sessions")
        assert r.status_code == 503 and r.json() == {"error": {"code": "store_unavailable",
                                                               "message": r.json()["error"]["message"]}}
        assert "Traceback" not in r.text
    async with gw.connect(cookie) as ws:
        await send(ws, {"type": "chat", "content": "hello"})
        err = await recv(ws)
        assert err["code"] == "store_unavailable" and "Traceback" not in err["message"]
        await send(ws, {"type": "ping"})
        assert await recv(ws) == {"type": "pong"}


async def test_one_dead_engine_among_three_is_routed_around_by_hashing(gateway_factory, tiny_engine):
    """Rendezvous hashing over the configured engines, one of them dead: a chat whose
    choice is the dead engine goes to the live engine that ranks next for it, and a chat
    whose choice is a live engine stays there. Two relays in front of the live engine
    give it two addresses, so where each chat's ``generate`` went is observable."""
    dead = "ws://127.0.0.1:9"
    gates = [gate_in_front_of(tiny_engine), gate_in_front_of(tiny_engine)]
    try:
        urls = [dead] + [g.url for g in gates]
        gw = gateway_factory(engine_urls=urls)
        await wait_for(lambda: len(gw.state.router.healthy) == 2, 30)
        cookie = gw.new_cookie()
        wanted = {(dead, gates[0].url), (dead, gates[1].url), (gates[0].url, None), (gates[1].url, None)}
        cases: dict[tuple[str, str | None], str] = {}
        async with gw.http(cookie) as c:
            while len(cases) < len(wanted):  # new chat ids until every case has one
                sid = (await c.post("/api/sessions", json={})).json()["id"]
                ranked = sorted(urls, key=lambda u: rendezvous_rank(sid, u), reverse=True)
                case = (ranked[0], ranked[1] if ranked[0] == dead else None)
                cases.setdefault(case, sid)
        async with gw.connect(cookie) as ws:
            for (first, second), sid in cases.items():
                r = await chat(ws, "hello", sid, max_tokens=3)
                assert r.done is not None, r.error
                expected = second if first == dead else first
                took = [g.url for g in gates if any(f.get("type") == "generate" and f.get("request_id") ==
                                                    r.request_id for f in g.to_engine)]
                assert took == [expected], (first, second, took)
    finally:
        for g in gates:
            g.close()


async def test_keys_written_by_a_conversation_all_keep_the_configured_ttl(gateway_factory, redis_url, key_prefix):
    """TTLs are kept (docs/acceptance.md#ttls-are-kept) through the whole gateway (streams included)."""
    gw = gateway_factory(session_ttl_s=1800)
    cookie = gw.new_cookie()
    client = aioredis.from_url(redis_url, decode_responses=True)
    try:
        async with gw.connect(cookie) as ws:
            sid = None
            for i in range(5):
                r = await chat(ws, f"message {i}", sid, max_tokens=4)
                sid = r.start["session_id"]
                keys = [k async for k in client.scan_iter(match=key_prefix + "*")]
                assert len(keys) >= 6
                for k in keys:
                    assert await client.ttl(k) > 0, k
    finally:
        await client.aclose()


async def test_a_reply_can_be_watched_and_stopped_from_another_gateway_replica(gateway_factory, engine_gate):
    """Replicas share Redis: a socket on gateway B resumes and cancels a reply that
    gateway A is generating (the engine paused from its first delta until the abort)."""
    secret = "shared-secret-for-both-replicas"
    gw_a = gateway_factory(secret_key=secret, engine_urls=[engine_gate.url])
    gw_b = gateway_factory(secret_key=secret, engine_urls=[engine_gate.url])
    cookie = gw_a.new_cookie()
    async with gw_a.connect(cookie) as a, gw_b.connect(cookie) as b:
        engine_gate.pause_on(text_delta())
        await send(a, {"type": "chat", "content": "Go on.",
                       "params": {"max_tokens": 1800, "temperature": 0, "ignore_eos": True}})
        start = await recv(a)
        rid = start["request_id"]
        assert rid in gw_a.state.generations.running and not gw_b.state.generations.running
        await send(b, {"type": "resume", "request_id": rid, "last_seq": 0})

        async def cancel_from_b(f, r):
            if f["type"] == "delta" and f["seq"] == 1:
                await engine_gate.paused()
                await send(b, {"type": "cancel", "request_id": rid})
                await engine_gate.sent(of_type("abort", rid))  # gateway A got it through Redis
                engine_gate.resume()

        on_b = await read_reply(b, rid, on_frame=cancel_from_b)
        on_a = await read_reply(a, rid, reply=Reply(start=start))
    assert on_b.done["finish_reason"] == on_a.done["finish_reason"] == "abort"
    assert on_b.text == on_a.text and on_b.seqs == list(range(1, len(on_b.deltas) + 1))
    body = await stored(gw_b, cookie, start["session_id"])
    assert body["messages"][-1]["status"] == "partial" and body["messages"][-1]["content"] == on_a.text


async def test_repeated_stops_leave_no_engine_blocks_locks_or_tasks_behind(gateway_factory, engine_gate, redis_url,
                                                                          key_prefix):
    """stop frees the engine repeated: many start-then-stop cycles, stopped before the engine started
    and after its first delta in turn; afterwards the engine holds no blocks for requests, the
    gateway runs no replies and no chat lock is left in Redis."""
    gw = gateway_factory(engine_urls=[engine_gate.url])
    cookie = gw.new_cookie()
    before = await idle(gw)
    async with gw.connect(cookie) as ws:
        sids = []
        for i in range(20):  # a new chat each time, so partial replies never fill the context
            mid_reply = i % 2 == 1
            if mid_reply:
                engine_gate.pause_on(text_delta())
            else:
                engine_gate.pause()
            await send(ws, {"type": "chat", "content": f"story {i}",
                            "params": {"max_tokens": 1000, "ignore_eos": True}})
            start = await recv(ws)
            sids.append(start["session_id"])
            r = Reply(start=start)
            if mid_reply:
                r.deltas.append(await recv(ws))
                assert r.deltas[0]["type"] == "delta", r.deltas
            await engine_gate.paused()
            await send(ws, {"type": "cancel", "request_id": start["request_id"]})
            await engine_gate.sent(of_type("abort", start["request_id"]))
            engine_gate.resume()
            r = await read_reply(ws, start["request_id"], reply=r)
            assert r.error is None and r.done["finish_reason"] == "abort", (r.error, r.others)
            # stopped within a few steps, even when the stop raced the engine's tokenization
            assert r.done["usage"]["completion_tokens"] < 150, r.done
    after = await idle(gw)
    assert after["blocks_held_by_requests"] == 0
    assert after["blocks_used"] - after["blocks_evictable"] <= before["blocks_used"] - before["blocks_evictable"]
    assert gw.state.generations.running == {}
    client = aioredis.from_url(redis_url, decode_responses=True)
    try:
        assert [k async for k in client.scan_iter(match=key_prefix + "*:lock")] == []
    finally:
        await client.aclose()
    for sid in sids:
        body = await stored(gw, cookie, sid)
        assert [m["status"] for m in body["messages"]] == ["complete", "partial"] and body["active"] is None
