"""Failures a user hit from a fresh clone, each reproduced with real parts: Redis
killed mid-reply (a private redis-server), the chat's max_tokens set to the whole
context, and a second tab on the same chat. Real gateway, real engine (tiny model);
where a test acts while a reply runs, the engine is paused through an ``EngineGate``
(tests/engine_gate.py), so the reply is still running however fast the engine is."""

from __future__ import annotations

import asyncio
import logging

from tests.engine_gate import of_type, text_delta
from tests.gateway_helpers import chat, read_reply, recv, send, wait_for


async def session_body(gw, cookie: str, sid: str) -> dict:
    async with gw.http(cookie) as c:
        r = await c.get(f"/api/sessions/{sid}")
        assert r.status_code == 200, r.text
        return r.json()


async def test_redis_killed_mid_reply_keeps_the_reply_and_stores_it_once_when_redis_returns(
        gateway_factory, engine_gate, private_redis, caplog):
    caplog.set_level(logging.WARNING, logger="gateway")
    gw = gateway_factory(redis_url=private_redis.url, engine_urls=[engine_gate.url])
    cookie = gw.new_cookie()
    async with gw.connect(cookie) as ws:
        engine_gate.pause_on(text_delta())  # the rest of the reply waits for Redis to go
        await send(ws, {"type": "chat", "content": "Tell me a long story.",
                        "params": {"temperature": 0, "max_tokens": 300, "ignore_eos": True}})
        killed: list[bool] = []

        async def kill_after_first_delta(frame, reply):
            if frame["type"] == "delta" and not killed:
                await engine_gate.paused()
                private_redis.kill()
                killed.append(True)
                engine_gate.resume()
                await asyncio.sleep(3.0)  # the reply goes on (or ends) while Redis is away
                private_redis.start()

        r = await read_reply(ws, on_frame=kill_after_first_delta, timeout=180)
        assert killed and r.error is None, r.error  # the client is never told the turn failed
        assert r.done["finish_reason"] == "length" and r.done["usage"]["completion_tokens"] == 300
        assert r.seqs == list(range(1, len(r.deltas) + 1))
        sid = r.start["session_id"]
        body = await session_body(gw, cookie, sid)
        assert [m["role"] for m in body["messages"]] == ["user", "assistant"]  # stored exactly once
        assert body["messages"][1]["content"] == r.text and body["messages"][1]["status"] == "complete"
        assert body["active"] is None

        # the next turn after Redis came back is accepted and answered
        again = await chat(ws, "And then?", sid, max_tokens=8)
        assert again.error is None and again.done is not None, again.error
    body = await session_body(gw, cookie, sid)
    assert [m["role"] for m in body["messages"]] == ["user", "assistant"] * 2
    listener = [rec for rec in caplog.records if "cancel listener" in rec.getMessage()]
    assert len(listener) <= 1, [rec.getMessage() for rec in listener]  # no per-second log spam


async def test_a_reply_finished_while_redis_is_down_is_stored_after_it_returns(gateway_factory, engine_gate,
                                                                              private_redis):
    gw = gateway_factory(redis_url=private_redis.url, engine_urls=[engine_gate.url])
    cookie = gw.new_cookie()
    async with gw.connect(cookie) as ws:
        first = await chat(ws, "Hello.", max_tokens=4)
        sid = first.start["session_id"]
        engine_gate.pause()  # the reply cannot be written (let alone stored) before Redis goes
        await send(ws, {"type": "chat", "session_id": sid, "content": "More please.",
                        "params": {"temperature": 0, "max_tokens": 40, "ignore_eos": True}})
        start = await recv(ws)
        assert start["type"] == "start"
        await engine_gate.sent(of_type("generate", start["request_id"]))  # the chat was read from Redis
        private_redis.kill()
        engine_gate.resume()
        gens = gw.state.generations
        turn = gens.running[start["request_id"]]
        # the engine finishes the reply while Redis is down; the task takes it all and waits to store it
        await wait_for(lambda: any(of_type("done", start["request_id"])(f) for f in engine_gate.from_engine)
                       and turn.run is not None and turn.run.request.queue.empty() and len(turn.output_ids) == 40,
                       timeout=60)
        await asyncio.sleep(1.0)
        assert start["request_id"] in gens.running  # kept in memory, not dropped
        private_redis.start()
        r = await read_reply(ws, start["request_id"], timeout=120)
        assert r.error is None and r.done["finish_reason"] == "length", r.error
    body = await session_body(gw, cookie, sid)
    assert [m["role"] for m in body["messages"]] == ["user", "assistant"] * 2
    assert body["messages"][3]["content"] == r.text and body["messages"][3]["usage"]["completion_tokens"] == 40


async def test_a_high_max_tokens_is_clamped_to_the_context_left_in_the_browser_chat(gateway_factory):
    gw = gateway_factory()
    max_len = gw.state.router.info().max_model_len
    cookie = gw.new_cookie()
    async with gw.connect(cookie) as ws:
        r = await chat(ws, "Hi there, a short question.", max_tokens=max_len)
        assert r.error is None, r.error
        assert r.done["finish_reason"] in ("stop", "length")
        u = r.done["usage"]
        assert u["prompt_tokens"] + u["completion_tokens"] <= max_len
        # a message that alone is longer than the context is still refused, accurately
        r2 = await chat(ws, "word " * (2 * max_len), r.start["session_id"], max_tokens=8)
        assert r2.error is not None and r2.error["code"] == "context_length_exceeded"
        assert f"the model's context holds {max_len}" in r2.error["message"]
        assert "max_tokens" not in r2.error["message"]  # the setting is not what is wrong


async def test_the_openai_api_keeps_the_strict_max_tokens_check_on_linked_chats(gateway_factory):
    gw = gateway_factory()
    max_len = gw.state.router.info().max_model_len
    cookie = gw.new_cookie()
    async with gw.http(cookie) as c:
        r = await c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": max_len, "session_id": "new"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


async def test_a_refused_first_message_leaves_no_title_from_the_rejected_text(gateway_factory):
    gw = gateway_factory()
    max_len = gw.state.router.info().max_model_len
    cookie = gw.new_cookie()
    async with gw.http(cookie) as c:  # the page creates the chat first, then sends into it
        sid = (await c.post("/api/sessions", json={})).json()["id"]
    async with gw.connect(cookie) as ws:
        r = await chat(ws, "rejected " * (2 * max_len), sid, max_tokens=8)
    assert r.error is not None and r.error["code"] == "context_length_exceeded"
    body = await session_body(gw, cookie, sid)
    assert body["messages"] == [] and body["title"] == ""


async def test_renaming_a_new_chat_while_its_first_reply_streams_is_not_undone(gateway_factory, engine_gate):
    gw = gateway_factory(engine_urls=[engine_gate.url])
    cookie = gw.new_cookie()
    async with gw.connect(cookie) as ws:
        engine_gate.pause_on(text_delta())  # still streaming when the rename lands
        await send(ws, {"type": "chat", "content": "First words",
                        "params": {"temperature": 0, "max_tokens": 300, "ignore_eos": True}})
        renamed: list[int] = []

        async def rename_once(frame, reply):
            if frame["type"] == "delta" and not renamed:
                await engine_gate.paused()
                async with gw.http(cookie) as c:
                    res = await c.patch(f"/api/sessions/{frame_sid(reply)}", json={"title": "My name"})
                    renamed.append(res.status_code)
                engine_gate.resume()

        r = await read_reply(ws, on_frame=rename_once)
    assert renamed == [200] and r.done is not None
    assert "title" not in r.done  # nothing tells the page to put the old title back
    assert (await session_body(gw, cookie, r.start["session_id"]))["title"] == "My name"


def frame_sid(reply) -> str:
    return reply.start["session_id"]


async def test_regenerate_naming_another_reply_than_the_last_is_refused_as_conflict(gateway_factory):
    gw = gateway_factory()
    cookie = gw.new_cookie()
    async with gw.connect(cookie) as ws:
        first = await chat(ws, "Hello.", max_tokens=6)
        sid, shown = first.start["session_id"], first.done["message_id"]
        # another tab regenerated meanwhile: the reply this tab shows is gone
        await send(ws, {"type": "regenerate", "session_id": sid, "params": {"max_tokens": 6}})
        newer = await read_reply(ws)
        assert newer.error is None
        await send(ws, {"type": "regenerate", "session_id": sid, "message_id": shown})
        stale = await recv(ws)
        assert stale["type"] == "error" and stale["code"] == "conflict" and stale["session_id"] == sid
        body = await session_body(gw, cookie, sid)
        assert body["messages"][-1]["id"] == newer.done["message_id"] and body["active"] is None  # untouched
        await send(ws, {"type": "regenerate", "session_id": sid, "message_id": newer.done["message_id"],
                        "params": {"max_tokens": 6}})
        ok = await read_reply(ws)
        assert ok.error is None and ok.done is not None
