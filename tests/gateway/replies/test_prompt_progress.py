"""Prompt progress on the browser socket: while the engine reads a long prompt in chunks,
the socket gets ``progress`` frames (prompt tokens done of all), all before the reply's
first delta; nothing of it is stored in the reply's Redis Stream, and the OpenAI API's
stream does not show it. Real gateway, real Redis, the tiny model with a small step
budget (``chunked_engine``) behind an ``EngineGate`` that pauses the engine at its first
progress item, so the socket's frames are read while the prompt is still being read."""

from __future__ import annotations

import json
import random

import httpx

from tests.engine_gate import of_type
from tests.fixtures_servers import CHUNK_TOKENS
from tests.gateway_helpers import read_reply, send

PARAMS = {"max_tokens": 3, "temperature": 0, "ignore_eos": True}


def long_text(seed: int, words: int = 120) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(["canal", "lock", "barge", "towpath", "heron", "willow", "keeper", "mooring"])
                    + str(rng.randrange(100)) for _ in range(words))


async def test_a_long_prompt_sends_progress_frames_before_the_first_delta_and_none_are_stored(
        gateway_factory, chunked_gate):
    gw = gateway_factory(engine_urls=[chunked_gate.url])
    cookie = gw.new_cookie()
    chunked_gate.pause_on(of_type("progress"))
    seen: list[str] = []
    async with gw.connect(cookie) as ws:
        # about a dozen chunks: still reading when the engine stops a step or two after its
        # first progress frame, however fast its kernels are
        await send(ws, {"type": "chat", "content": long_text(1, words=300), "params": PARAMS})

        async def on_frame(f, r):
            seen.append(f["type"])
            if f["type"] == "progress" and seen.count("progress") == 1:
                # the engine is held after its first chunk: the frame came while the prompt is read
                await chunked_gate.paused()
                chunked_gate.resume()

        r = await read_reply(ws, on_frame=on_frame)
    assert r.error is None and r.done is not None
    progress = [f for f in r.others if f["type"] == "progress"]
    assert progress, seen
    prompt_tokens = r.done["usage"]["prompt_tokens"]
    cached = r.done["usage"]["cached_tokens"]
    assert prompt_tokens > 3 * CHUNK_TOKENS
    for f in progress:
        assert f["request_id"] == r.request_id and f["session_id"] == r.start["session_id"]
        assert f["prompt_tokens"] == prompt_tokens and f["cached_tokens"] == cached
    done = [f["prompt_tokens_done"] for f in progress]
    # the first chunk after the cache hit or, when the engine read the next chunk before the
    # socket wrote the first frame, a later one: a reply keeps only its newest progress
    assert cached + CHUNK_TOKENS <= done[0] < prompt_tokens
    assert done == sorted(set(done)) and done[-1] < prompt_tokens
    assert all((d - cached) % CHUNK_TOKENS == 0 for d in done)
    # every progress frame comes before the first delta
    assert seen.index("delta") > max(i for i, k in enumerate(seen) if k == "progress")
    # transient: after its start entry the reply stream holds deltas and the done only
    entries = gw.run(gw.state.streams.read(r.request_id, 0, 1000, 1))
    assert {e.kind for e in entries} == {"delta", "done"}
    assert not any("progress" in json.dumps(e.fields) for e in entries)


async def test_a_prompt_read_in_one_step_sends_no_progress(gateway_factory, chunked_gate):
    gw = gateway_factory(engine_urls=[chunked_gate.url])
    async with gw.connect(gw.new_cookie()) as ws:
        await send(ws, {"type": "chat", "content": "Hi.", "params": PARAMS})
        r = await read_reply(ws)
    assert r.done is not None and r.done["usage"]["prompt_tokens"] <= CHUNK_TOKENS
    assert [f for f in r.others if f["type"] == "progress"] == []


async def test_the_openai_stream_of_a_long_prompt_carries_no_progress(gateway_factory, chunked_gate):
    gw = gateway_factory(engine_urls=[chunked_gate.url])
    async with httpx.AsyncClient(base_url=gw.base_url, timeout=60) as c:
        model = (await c.get("/v1/models")).json()["data"][0]["id"]
        body = {"model": model, "stream": True, "messages": [{"role": "user", "content": long_text(2)}], **PARAMS}
        async with c.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = [ln async for ln in resp.aiter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert chunks and all(ch["object"] == "chat.completion.chunk" for ch in chunks)
    assert "progress" not in "".join(lines)
    assert any(e.get("type") == "progress" for e in chunked_gate.from_engine)  # the engine did send some
