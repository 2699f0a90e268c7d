"""Several models behind one gateway: two real engine processes serving different tiny
models (``tiny_model_dir`` and ``tiny_thinker_dir``), each behind an ``EngineGate`` that
records what it was sent. ``/v1/models`` and ``/api/config`` list both; a chat keeps the
model it was given and its turns go to that model's engine; switching the model does not
replay the other model's token ids; an unknown model is a clear error; the OpenAI API and
the terminal client route by ``model``."""

from __future__ import annotations

import io
import time
from typing import Any

import httpx
import pytest

from gateway.client import ask, socket_url
from tests.engine_gate import EngineGate
from tests.gateway_helpers import chat, read_reply, recv, send


def both_up(gw: Any, timeout_s: float = 60.0) -> Any:
    """``gw`` once every engine of it said hello (the factory waits for one)."""
    deadline = time.monotonic() + timeout_s
    while not all(c.info is not None and c.healthy for c in gw.state.router.clients):
        assert time.monotonic() < deadline, "an engine did not connect"
        time.sleep(0.05)
    return gw


def generates(gate: EngineGate) -> list[dict]:
    return [f for f in gate.to_engine if f.get("type") == "generate"]


@pytest.fixture
def two_models(gateway_factory, engine_gate: EngineGate, thinker_gate: EngineGate):
    gw = both_up(gateway_factory(engine_urls=[engine_gate.url, thinker_gate.url]))
    models = {c.info.model: c.url for c in gw.state.router.clients if c.info is not None}
    assert len(models) == 2
    plain = next(m for m, u in models.items() if u == engine_gate.url)
    thinker = next(m for m, u in models.items() if u == thinker_gate.url)
    return gw, plain, thinker


async def test_models_are_listed_and_a_chat_keeps_its_model_and_its_engine(two_models, engine_gate, thinker_gate):
    gw, plain, thinker = two_models
    cookie = gw.new_cookie()
    async with gw.http(cookie) as c:
        listed = (await c.get("/v1/models")).json()["data"]
        assert sorted(m["id"] for m in listed) == sorted([plain, thinker])
        config = (await c.get("/api/config")).json()
        assert [m["id"] for m in config["models"]] == [plain, thinker]  # the default first
        assert config["model"] == plain and all(m["available"] for m in config["models"])
    async with gw.connect(cookie) as ws:
        await send(ws, {"type": "chat", "content": "Hello", "model": plain,
                        "params": {"max_tokens": 6, "ignore_eos": True, "temperature": 0}})
        first = await read_reply(ws)
        sid = first.start["session_id"]
        assert len(generates(engine_gate)) == 1 and not generates(thinker_gate)
        await send(ws, {"type": "chat", "session_id": sid, "content": "Think about it.", "model": thinker,
                        "params": {"max_tokens": 6, "ignore_eos": True, "temperature": 0}})
        second = await read_reply(ws)
        assert second.error is None, second.error
        assert second.text.startswith("<think>")  # the thinker's reply, with its reasoning
        sent = generates(thinker_gate)
        assert len(sent) == 1
        # the first model's token ids are not the second's: none are replayed
        assert not sent[0].get("prefix_token_ids")
        third = await chat(ws, "And now?", sid, max_tokens=4, ignore_eos=True)  # the chat keeps its model
        assert third.error is None and len(generates(thinker_gate)) == 2 and len(generates(engine_gate)) == 1
    async with gw.http(cookie) as c:
        body = (await c.get(f"/api/sessions/{sid}")).json()
        assert body["model"] == thinker
        assert [m.get("model") for m in body["messages"][1::2]] == [plain, thinker, thinker]
        # the model can be changed with the chat's settings, and taken off (any engine then)
        res = await c.patch(f"/api/sessions/{sid}", json={"model": None})
        assert res.status_code == 200 and res.json()["model"] is None


async def test_an_unknown_model_is_a_clear_error_and_changes_nothing(two_models):
    gw, plain, thinker = two_models
    cookie = gw.new_cookie()
    async with gw.connect(cookie) as ws:
        await send(ws, {"type": "chat", "content": "Hi", "model": "no-such-model"})
        err = await recv(ws)
        assert err["type"] == "error" and err["code"] == "model_not_found"
        assert "no-such-model" in err["message"] and plain in err["message"] and thinker in err["message"]
    async with gw.http(cookie) as c:
        assert (await c.get("/api/sessions")).json()["sessions"] == []  # no chat was left behind
        res = await c.post("/api/sessions", json={"model": "no-such-model"})
        assert res.status_code == 404 and res.json()["error"]["code"] == "model_not_found"
        sid = (await c.post("/api/sessions", json={"model": thinker})).json()["id"]
        res = await c.patch(f"/api/sessions/{sid}", json={"model": "no-such-model"})
        assert res.status_code == 404 and (await c.get(f"/api/sessions/{sid}")).json()["model"] == thinker
    async with httpx.AsyncClient(base_url=gw.base_url, timeout=60) as c:
        res = await c.post("/v1/chat/completions", json={"model": "no-such-model", "messages": [
            {"role": "user", "content": "Hi"}]})
        assert res.status_code == 404 and res.json()["error"]["code"] == "model_not_found"


async def test_the_openai_api_and_the_terminal_client_route_by_model(two_models, engine_gate, thinker_gate):
    gw, plain, thinker = two_models
    async with httpx.AsyncClient(base_url=gw.base_url, timeout=60) as c:
        for model in (thinker, plain):
            res = await c.post("/v1/chat/completions", json={
                "model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                "temperature": 0, "ignore_eos": True})
            assert res.status_code == 200, res.text
            body = res.json()
            assert body["model"] == model
            assert ("reasoning_content" in body["choices"][0]["message"]) == (model == thinker)
    assert len(generates(thinker_gate)) == 1 and len(generates(engine_gate)) == 1
    out, err = io.StringIO(), io.StringIO()
    code = await ask(socket_url(gw.base_url), gw.new_cookie(), "Hello", params={"max_tokens": 4, "ignore_eos": True},
                     out=out, err=err, model=thinker)
    assert code == 0 and "[thinking]" in err.getvalue() and len(generates(thinker_gate)) == 2
    bad_out, bad_err = io.StringIO(), io.StringIO()
    code = await ask(socket_url(gw.base_url), gw.new_cookie(), "Hello", out=bad_out, err=bad_err, model="nope")
    assert code == 1 and "model_not_found" in bad_err.getvalue()


async def test_a_linked_openai_request_sets_the_chats_model_as_the_picker_would(two_models, engine_gate,
                                                                                  thinker_gate):
    gw, plain, thinker = two_models
    ask_for = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    async with gw.http(gw.new_cookie()) as c:
        sid = (await c.post("/api/sessions", json={"model": plain})).json()["id"]
        res = await c.post("/v1/chat/completions", json={
            "model": thinker, "session_id": sid, "messages": [{"role": "user", "content": "Hi"}], **ask_for})
        assert res.status_code == 200, res.text
        assert res.json()["model"] == thinker and len(generates(thinker_gate)) == 1 and not generates(engine_gate)
        assert (await c.get(f"/api/sessions/{sid}")).json()["model"] == thinker
        # no model named: the chat keeps its own, and the answer names it
        res = await c.post("/v1/chat/completions", json={
            "session_id": sid, "messages": [{"role": "user", "content": "And?"}], **ask_for})
        assert res.status_code == 200 and res.json()["model"] == thinker and len(generates(thinker_gate)) == 2
        body = (await c.get(f"/api/sessions/{sid}")).json()
        assert body["model"] == thinker and [m.get("model") for m in body["messages"][1::2]] == [thinker, thinker]
        # a chat the request creates starts with the model it names
        res = await c.post("/v1/chat/completions", json={
            "model": thinker, "session_id": "new", "messages": [{"role": "user", "content": "Hi"}], **ask_for})
        assert res.status_code == 200 and res.json()["model"] == thinker
        created = res.json()["session_id"]
        assert (await c.get(f"/api/sessions/{created}")).json()["model"] == thinker
        assert len(generates(thinker_gate)) == 3 and not generates(engine_gate)
