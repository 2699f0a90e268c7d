"""Prefill/decode disaggregation through the gateway: with a prefill engine and a decode
engine behind it (roles from their hello), a new turn is prefilled on one and decoded on
the other with its KV moved between them, and the browser and the OpenAI API get the
same greedy reply as from one engine. Real engine processes on the tiny model."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect

from gateway.server.local import LocalEngine
from tests.fixtures_servers import ENGINE_ARGS
from tests.gateway_helpers import chat, wait_for


def _engine(model: Path, role: str) -> LocalEngine:
    eng = LocalEngine(model=str(model), extra_args=[*ENGINE_ARGS, "--role", role], env={"HF_HUB_OFFLINE": "1"})
    eng.start(timeout_s=600)
    return eng


@pytest.fixture(scope="module")
def pd_engines(tiny_model_dir: Path) -> Iterator[tuple[LocalEngine, LocalEngine]]:
    """A prefill engine and a decode engine (processes) on the tiny model."""
    p, d = _engine(tiny_model_dir, "prefill"), _engine(tiny_model_dir, "decode")
    try:
        yield p, d
    finally:
        p.stop()
        d.stop()


async def _stats(url: str) -> dict[str, Any]:
    async with connect(url) as ws:
        await ws.recv()
        await ws.send(json.dumps({"type": "stats"}))
        return json.loads(await ws.recv())


def _document() -> str:
    words = uuid.uuid4().hex  # a prompt no engine has seen in an earlier test
    return "Notes: " + " ".join(f"{words[i % 32]}{i}" for i in range(90))


async def test_a_chat_through_prefill_and_decode_engines_streams_one_engines_reply(
        gateway_factory, pd_engines, engine_url):
    p, d = pd_engines
    doc, later = _document(), _document()
    one = gateway_factory()  # the reference: one engine of role "both"
    cookie = one.new_cookie()
    async with one.connect(cookie) as ws:
        want = await chat(ws, doc + "\nSummarize.", max_tokens=12)
        want2 = await chat(ws, "And again?", want.start["session_id"], max_tokens=12)
        want3 = await chat(ws, later + "\nAnd these?", want.start["session_id"], max_tokens=12)
    assert want.done is not None and want2.done is not None and want3.done is not None, (want.error, want2.error)

    gw = gateway_factory(engine_urls=[p.url, d.url])
    router = gw.state.router
    await wait_for(lambda: len(router.healthy) == 2, 30)
    before_p, before_d = await _stats(p.url), await _stats(d.url)
    cookie = gw.new_cookie()
    async with gw.connect(cookie) as ws:
        got = await chat(ws, doc + "\nSummarize.", max_tokens=12)
        assert got.done is not None, got.error
        after_p, after_d = await _stats(p.url), await _stats(d.url)
        # the same reply, prefilled there and decoded here with the moved pages
        assert got.text == want.text and got.done["usage"]["completion_tokens"] == 12
        assert after_p["requests_total"] == before_p["requests_total"] + 1
        assert after_d["kv_pulls_total"] == before_d["kv_pulls_total"] + 1
        assert after_d["kv_pull_failures_total"] == before_d["kv_pull_failures_total"]
        assert got.done["usage"]["cached_tokens"] >= 16 * (after_d["kv_pull_pages_total"]
                                                           - before_d["kv_pull_pages_total"]) > 0
        # the next turn's short message is prefilled where the chat's KV already is
        await wait_for(lambda: router.index.pages_of(d.url) > 0, 30)
        got2 = await chat(ws, "And again?", got.start["session_id"], max_tokens=12)
        assert got2.done is not None, got2.error
        assert got2.text == want2.text
        assert (await _stats(p.url))["requests_total"] == after_p["requests_total"]
        assert got2.done["usage"]["cached_tokens"] >= got.done["usage"]["prompt_tokens"] - 16
        # a long later message is prefilled on the prefill engine, which pulls the chat's
        # earlier turns (the replies only the decode engine computed) instead of computing
        # them; the decode engine then pulls only the new message's pages
        before_p, before_d = await _stats(p.url), await _stats(d.url)
        got3 = await chat(ws, later + "\nAnd these?", got.start["session_id"], max_tokens=12)
        assert got3.done is not None, got3.error
        assert got3.text == want3.text
        after_p, after_d = await _stats(p.url), await _stats(d.url)
        assert after_p["requests_total"] == before_p["requests_total"] + 1
        assert after_p["kv_pulls_total"] == before_p["kv_pulls_total"] + 1
        assert after_p["kv_pull_pages_total"] > before_p["kv_pull_pages_total"]
        assert after_p["kv_pull_failures_total"] == before_p["kv_pull_failures_total"]
        prior = got2.done["usage"]["prompt_tokens"] + 11  # the tokens turn 2 left on the decode engine
        assert after_p["cached_tokens_total"] - before_p["cached_tokens_total"] >= prior - 16
        new = got3.done["usage"]["prompt_tokens"] - prior
        assert 0 < 16 * (after_d["kv_pull_pages_total"] - before_d["kv_pull_pages_total"]) <= new + 16
        assert got3.done["usage"]["cached_tokens"] >= got3.done["usage"]["prompt_tokens"] - 16


def _completion(base_url: str, content: str) -> dict[str, Any]:
    model = httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 10, "temperature": 0}
    r = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


async def test_the_openai_api_through_prefill_and_decode_engines_answers_as_one_engine(
        gateway_factory, pd_engines):
    p, d = pd_engines
    doc = _document()
    one = gateway_factory()
    want = _completion(one.base_url, doc)
    gw = gateway_factory(engine_urls=[p.url, d.url])
    await wait_for(lambda: len(gw.state.router.healthy) == 2, 30)
    before = await _stats(d.url)
    got = _completion(gw.base_url, doc)
    assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    assert (await _stats(d.url))["kv_pulls_total"] == before["kv_pulls_total"] + 1


async def test_with_the_prefill_engine_down_the_decode_engine_prefills_itself(gateway_factory, tiny_model_dir):
    p, d = _engine(tiny_model_dir, "prefill"), _engine(tiny_model_dir, "decode")
    try:
        doc = _document()
        one = gateway_factory()
        want = _completion(one.base_url, doc)
        gw = gateway_factory(engine_urls=[p.url, d.url])
        await wait_for(lambda: len(gw.state.router.healthy) == 2, 30)
        p.stop()
        await wait_for(lambda: len(gw.state.router.healthy) == 1, 30)
        got = _completion(gw.base_url, doc)
        assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
        assert (await _stats(d.url))["kv_pulls_total"] == 0
    finally:
        p.stop()
        d.stop()


@pytest.mark.parametrize("files", [
    ("compose.yaml", "compose.pd.yaml"),
    ("compose.yaml", "compose.cpu.yaml", "compose.pd.yaml", "compose.pd.cpu.yaml"),
])
def test_the_compose_override_runs_a_prefill_and_a_decode_engine_behind_the_gateway(files):
    from tests.gateway.server.test_deploy import _env, compose_services

    services = compose_services(*files)
    assert set(services) == {"redis", "engine", "engine-prefill", "gateway"}
    assert _env(services["engine"])["ENGINE_ROLE"] == "decode"
    assert _env(services["engine-prefill"])["ENGINE_ROLE"] == "prefill"
    for name in ("engine", "engine-prefill"):
        e = services[name]
        assert e["build"]["target"] == "engine" and "healthcheck" in e and "--port 9000" in " ".join(e["command"])
        assert "ENGINE_SECRET" in _env(e)  # one link secret: the decode engine pulls from the prefill engine
    g = services["gateway"]
    assert "--engine" not in " ".join(g["command"])
    assert _env(g)["ENGINE_URLS"].split() == ["ws://engine-prefill:9000", "ws://engine:9000"]
    assert {"engine", "engine-prefill"} <= set(g["depends_on"])
    if "compose.cpu.yaml" in files:
        for name in ("engine", "engine-prefill"):
            assert "deploy" not in services[name] and "--threads 1" in _env(services[name])["ENGINE_ARGS"]
    else:
        gpus = [services[n]["deploy"]["resources"]["reservations"]["devices"] for n in ("engine", "engine-prefill")]
        assert [d[0]["device_ids"] for d in gpus] == [["${DECODE_GPU:-0}"], ["${PREFILL_GPU:-1}"]]


async def test_stop_during_the_prefill_phase_ends_the_turn_and_frees_both_engines(gateway_factory, pd_engines):
    from tests.engine_gate import of_type
    from tests.fixtures_servers import gate_in_front_of
    from tests.gateway_helpers import read_reply, recv, send

    p, d = pd_engines
    gate = gate_in_front_of(p)
    try:
        gw = gateway_factory(engine_urls=[gate.url, d.url])
        await wait_for(lambda: len(gw.state.router.healthy) == 2, 30)
        gate.pause()  # the prefill engine holds still: the turn is in its prefill phase
        async with gw.connect(gw.new_cookie()) as ws:
            await send(ws, {"type": "chat", "content": _document(), "params": {"max_tokens": 64, "temperature": 0}})
            start = await recv(ws)
            assert start["type"] == "start"
            rid = start["request_id"]
            await gate.sent(of_type("generate", rid))
            await send(ws, {"type": "cancel", "request_id": rid})
            await gate.sent(of_type("abort", rid))  # the prefill engine is told to stop it
            gate.resume()
            r = await read_reply(ws, rid)
        assert r.error is None and r.done is not None and r.done["finish_reason"] == "abort"

        async def idle(url: str) -> bool:
            s = await _stats(url)
            return s["running"] == s["waiting"] == 0 and s["blocks_held_by_requests"] == 0 \
                and s["blocks_free"] + s["blocks_evictable"] == s["num_blocks"]

        await wait_for(lambda: idle(p.url), 30)
        await wait_for(lambda: idle(d.url), 30)
    finally:
        gate.resume()
        gate.close()
