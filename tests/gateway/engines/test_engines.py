"""The engine client (multiplexing, stats, errors), chat-to-engine routing, and what a
user sees when the engine dies mid-reply. Real engines only."""

from __future__ import annotations

import asyncio
import gc
import weakref
from types import SimpleNamespace
from typing import Any, cast

import pytest

from engine.protocol import to_dict
from gateway.engines.client import EngineClient, EngineRequest, EngineRouter
from gateway.engines.run import EngineRun
from gateway.server.local import LocalEngine
from tests.engine_gate import of_type, text_delta
from tests.fixtures_servers import ENGINE_ARGS, gate_in_front_of
from tests.gateway_helpers import read_reply, recv, send, wait_for


async def drain(req) -> tuple[list[dict], dict]:
    """A request's items as wire dicts: its deltas and its final item."""
    deltas = []
    while True:
        f = to_dict(await req.next(60))
        if f["type"] == "delta":
            deltas.append(f)
        else:
            return deltas, f


async def test_one_connection_multiplexes_many_requests_by_id(engine_url):
    client = EngineClient(engine_url)
    await client.start()
    try:
        await wait_for(lambda: client.healthy, 30)
        assert client.info.block_size == 16 and client.info.max_model_len > 0
        reqs = [await client.generate(f"r{i}", [{"role": "user", "content": f"Say {i}."}],
                                      params={"max_tokens": 5 + i, "temperature": 0, "ignore_eos": True})
                for i in range(5)]
        results = await asyncio.gather(*[drain(r) for r in reqs])
        for i, (deltas, done) in enumerate(results):
            assert done["type"] == "done" and done["request_id"] == f"r{i}"
            assert all(d["request_id"] == f"r{i}" for d in deltas)
            assert done["usage"]["completion_tokens"] == 5 + i
            assert "".join(d["text"] for d in deltas) + done["text"] == done["output_text"]
        bad = await client.generate("bad", [{"role": "user", "content": "x"}], params={"top_p": 5})
        _, err = await drain(bad)
        assert (err["type"], err["code"], err["request_id"]) == ("error", "invalid_request", "bad")
        stats = await client.stats()
        assert stats["running"] == 0 and stats["num_blocks"] == 512
        for r in reqs + [bad]:
            r.close()
    finally:
        await client.close()
    assert not client.healthy


async def test_the_engine_gate_holds_a_reply_still_until_resumed_and_relays_every_frame(engine_gate):
    """The tests that act mid-reply rely on this: a paused engine sends nothing more (so a
    reply cannot end behind the test's back), and resumed it goes on where it stopped."""
    client = EngineClient(engine_gate.url)
    await client.start()
    try:
        await wait_for(lambda: client.healthy, 30)
        engine_gate.pause_on(of_type("delta", "r"))
        req = await client.generate("r", [{"role": "user", "content": "Go on."}],
                                    params={"max_tokens": 200, "temperature": 0, "ignore_eos": True})
        await engine_gate.paused()
        await asyncio.sleep(0.2)  # frames the engine wrote before SIGSTOP took effect arrive
        held = len(engine_gate.from_engine)
        await asyncio.sleep(0.5)  # a running engine writes dozens of tokens in this time
        assert len(engine_gate.from_engine) == held, "a paused engine sent more frames"
        engine_gate.resume()
        deltas, done = await drain(req)
        assert done["type"] == "done" and done["usage"]["completion_tokens"] == 200
        assert "".join(d["text"] for d in deltas) + done["text"] == done["output_text"]
        assert [f for f in engine_gate.from_engine if f.get("request_id") == "r"] == deltas + [done]
        assert engine_gate.wait_sent(of_type("generate", "r"))["params"]["max_tokens"] == 200
        req.close()
    finally:
        await client.close()


async def test_router_keeps_each_chat_on_its_engine_and_moves_only_the_dead_ones(engine_url):
    port = engine_url.rsplit(":", 1)[1]
    a, b = EngineClient(f"ws://127.0.0.1:{port}"), EngineClient(f"ws://localhost:{port}")
    router = EngineRouter([a, b])
    await router.start()
    try:
        await wait_for(lambda: a.healthy and b.healthy, 30)
        keys = [f"chat-{i}" for i in range(200)]
        first = {k: router.pick(k) for k in keys}
        assert all(router.pick(k) is first[k] for k in keys)  # sticky
        on_a = [k for k in keys if first[k] is a]
        assert 50 < len(on_a) < 150  # spread over both
        await b.close()
        assert all(router.pick(k) is a for k in keys)
        with pytest.raises(Exception) as e:
            router.pick("x", exclude=[a])
        assert getattr(e.value, "code", None) == "engine_unavailable"
    finally:
        await router.close()


async def test_engine_dying_mid_reply_stores_what_was_shown_and_says_so(gateway_factory, tiny_model_dir):
    engine = LocalEngine(model=str(tiny_model_dir), extra_args=ENGINE_ARGS + ["--threads", "1"])
    engine.start(timeout_s=600)
    gate = gate_in_front_of(engine)
    try:
        gw = gateway_factory(engine_urls=[gate.url])
        cookie = gw.new_cookie()
        async with gw.connect(cookie) as ws:
            gate.pause_on(text_delta())  # it dies mid-reply, however fast it writes
            await send(ws, {"type": "chat", "content": "Go on and on.",
                            "params": {"max_tokens": 1500, "temperature": 0, "ignore_eos": True}})
            killed = False

            async def kill_after_the_first(f, r):
                nonlocal killed
                if f["type"] == "delta" and not killed:
                    killed = True
                    await gate.paused()
                    engine.process.kill()

            r = await read_reply(ws, on_frame=kill_after_the_first)
            assert r.done["finish_reason"] == "error" and r.done["error"]["code"] == "engine_unavailable"
            await send(ws, {"type": "chat", "content": "again?", "session_id": r.start["session_id"]})
            err = await recv(ws)
            assert err["code"] == "engine_unavailable"
        async with gw.http(cookie) as c:
            body = (await c.get(f"/api/sessions/{r.start['session_id']}")).json()
            assert (await c.get("/readyz")).status_code == 503
        reply = body["messages"][-1]
        assert (reply["status"], reply["finish_reason"], reply["content"]) == ("partial", "error", r.text)
        assert [m["role"] for m in body["messages"]] == ["user", "assistant"] and body["active"] is None
    finally:
        gate.close()
        engine.stop()


async def test_gateway_reconnects_when_the_engine_comes_back(gateway_factory, tiny_model_dir):
    engine = LocalEngine(model=str(tiny_model_dir), extra_args=ENGINE_ARGS + ["--threads", "1"])
    url = engine.start(timeout_s=600)
    port = int(url.rsplit(":", 1)[1])
    try:
        gw = gateway_factory(engine_urls=[url])
        engine.stop()
        await wait_for(lambda: not gw.state.router.healthy, 30)
        engine = LocalEngine(model=str(tiny_model_dir), extra_args=ENGINE_ARGS + ["--threads", "1"], port=port)
        engine.start(timeout_s=600)
        await wait_for(lambda: bool(gw.state.router.healthy), 30)
        async with gw.connect(gw.new_cookie()) as ws:
            await send(ws, {"type": "chat", "content": "back?", "params": {"max_tokens": 3}})
            r = await read_reply(ws)
        assert r.done is not None and r.done["usage"]["completion_tokens"] >= 1
    finally:
        engine.stop()


def test_a_closed_engine_run_leaves_no_cycle_back_to_its_reply():
    # the reply holds its run, and the run's stream_to callbacks are the reply's: once
    # closed, reference counting alone frees the reply (no wait for a full collection)
    class Reply:
        def __init__(self) -> None:
            self.batches: list[Any] = []
            self.run = EngineRun(cast(Any, None), "r1", "k", [])

        def accepts(self) -> bool:
            return True

        def take(self, batch: Any) -> None:
            self.batches.append(batch)

    reply = Reply()
    run = reply.run
    run.request = EngineRequest(cast(Any, SimpleNamespace(_requests={})), "r1")
    run.stream_to(reply.accepts, reply.take)
    assert run.request.sink is not None
    gone = weakref.ref(reply)
    gc.disable()
    try:
        run.close()
        del reply, run
        assert gone() is None
    finally:
        gc.enable()
