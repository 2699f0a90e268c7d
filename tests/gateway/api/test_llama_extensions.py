"""llama-server's extensions of the OpenAI API, against a real gateway, real Redis and the
tiny engine: ``timings_per_token`` (its ``timings`` object), ``return_progress`` (its
``prompt_progress`` chunks, from the engine's chunked prefill), ``POST
/chat/completions/input_tokens``, the read-only ``GET /slots`` and the gateway-wide
default seed (``GatewayConfig.api_seed``, llama-server's ``--seed``)."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import pytest

from tests.engine_gate import of_type, text_delta
from tests.fixtures_servers import CHUNK_TOKENS
from tests.gateway.replies.test_prompt_progress import long_text

QUESTION = [{"role": "user", "content": "Name a colour."}]
TIMING_KEYS = {"cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n",
               "predicted_ms", "predicted_per_token_ms", "predicted_per_second"}


def _stream(gw: Any, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", f"{gw.base_url}{path}", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"]


def test_timings_per_token_puts_llama_servers_timings_on_the_chunks_and_the_usage_chunk(api_gateway):
    gw = api_gateway()
    body = {"messages": QUESTION, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "timings_per_token": True,
            "stream_options": {"include_usage": True}}
    chunks = _stream(gw, "/v1/chat/completions", body)
    assert "timings" not in chunks[0] and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and set(usage_chunk["timings"]) == TIMING_KEYS
    t = usage_chunk["timings"]
    assert t["predicted_n"] == usage_chunk["usage"]["completion_tokens"] == 6
    assert t["prompt_n"] + t["cache_n"] == usage_chunk["usage"]["prompt_tokens"]
    live = [c["timings"]["predicted_n"] for c in chunks[1:-1] if c["choices"] and c["choices"][0]["delta"]]
    assert live and live == sorted(live) and live[-1] <= 6
    whole = httpx.post(f"{gw.base_url}/v1/chat/completions", json={**body, "stream": False}, timeout=120).json()
    assert whole["timings"]["predicted_n"] == whole["usage"]["completion_tokens"]
    plain = httpx.post(f"{gw.base_url}/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 2},
                       timeout=120).json()
    assert "timings" not in plain


def test_return_progress_streams_prompt_progress_before_the_text(api_gateway, chunked_engine):
    gw = api_gateway(engine_urls=[chunked_engine.url])
    body = {"messages": [{"role": "user", "content": long_text(7, words=200)}], "max_tokens": 2, "temperature": 0,
            "return_progress": True, "stream_options": {"include_usage": True}}
    chunks = _stream(gw, "/chat/completions", body)
    progress = [c["prompt_progress"] for c in chunks if "prompt_progress" in c]
    first_text = next(i for i, c in enumerate(chunks) if c["choices"] and c["choices"][0]["delta"].get("content"))
    assert all(i < first_text for i, c in enumerate(chunks) if "prompt_progress" in c)
    usage = chunks[-1]["usage"]
    assert usage["prompt_tokens"] > 3 * CHUNK_TOKENS
    assert all(p["total"] == usage["prompt_tokens"] for p in progress)
    assert all(p["cache"] == usage["prompt_tokens_details"]["cached_tokens"] for p in progress)
    done = [p["processed"] for p in progress]
    assert done == sorted(set(done)) and done[-1] == usage["prompt_tokens"]
    assert not any("prompt_progress" in c for c in _stream(gw, "/chat/completions", {**body, "return_progress": False}))


def test_input_tokens_counts_the_chat_prompt_as_the_reply_does(api_gateway):
    gw = api_gateway()
    messages = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]
    counted = httpx.post(f"{gw.base_url}/chat/completions/input_tokens", json={"messages": messages}, timeout=120)
    assert counted.status_code == 200, counted.text
    reply = httpx.post(f"{gw.base_url}/v1/chat/completions", json={"messages": messages, "max_tokens": 1},
                       timeout=120).json()
    assert counted.json() == {"input_tokens": reply["usage"]["prompt_tokens"]}
    bad = httpx.post(f"{gw.base_url}/v1/chat/completions/input_tokens", json={"messages": []}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"


def test_slots_shows_an_engine_busy_while_it_serves_a_request_and_idle_after_a_dropped_client(
        api_gateway, engine_gate):
    gw = api_gateway(engine_urls=[engine_gate.url])
    slots = lambda: httpx.get(f"{gw.base_url}/slots", timeout=30).json()  # noqa: E731
    assert slots() == [{"id": 0, "model": gw.state.router.clients[0].info.model,
                        "n_ctx": gw.state.router.clients[0].info.max_model_len, "healthy": True,
                        "is_processing": False, "n_processing": 0}]
    engine_gate.pause_on(text_delta())
    body = {"messages": QUESTION, "max_tokens": 1900, "ignore_eos": True}
    gave_up = threading.Event()

    def give_up() -> None:
        with pytest.raises(httpx.ReadTimeout):  # the client leaves while the engine is held
            httpx.post(f"{gw.base_url}/v1/chat/completions", json=body, timeout=httpx.Timeout(30, read=2.0))
        gave_up.set()

    t = threading.Thread(target=give_up)
    t.start()
    engine_gate.wait_paused()
    busy = slots()[0]  # the engine's final item is held back by the gate: the request is live
    t.join()
    engine_gate.wait_sent(of_type("abort"))
    engine_gate.resume()
    deadline = time.monotonic() + 30
    while slots()[0]["is_processing"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gave_up.is_set() and busy["is_processing"] is True and busy["n_processing"] == 1
    assert slots()[0]["is_processing"] is False


def test_the_default_seed_makes_unseeded_requests_reproducible(api_gateway):
    body = {"prompt": "The lighthouse keeper said", "max_tokens": 12, "temperature": 1.0, "ignore_eos": True}

    def texts(gw: Any) -> list[str]:
        return [httpx.post(f"{gw.base_url}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
                for _ in range(2)]

    seeded = texts(api_gateway(api_seed=42))
    assert seeded[0] == seeded[1]
    unseeded = texts(api_gateway())
    assert unseeded[0] != unseeded[1]
    explicit = httpx.post(f"{api_gateway(api_seed=42).base_url}/v1/completions", json={**body, "seed": 7},
                          timeout=120).json()["choices"][0]["text"]
    assert explicit != seeded[0]


def test_responses_carry_timings_and_prompt_progress_when_asked(api_gateway):
    gw = api_gateway()
    body = {"input": "This is a test " * 10, "max_output_tokens": 5, "temperature": 0, "timings_per_token": True,
            "return_progress": True}
    with httpx.stream("POST", f"{gw.base_url}/responses", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    progress = [e for e in events if "prompt_progress" in e]
    assert progress and all(e["type"] == "response.in_progress" for e in progress)
    assert progress[-1]["prompt_progress"]["processed"] == progress[-1]["prompt_progress"]["total"] > 0
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert deltas and all(set(e["timings"]) == TIMING_KEYS for e in deltas)
    end = events[-1]
    assert end["type"] in ("response.completed", "response.incomplete")
    assert end["timings"]["predicted_n"] == end["response"]["usage"]["output_tokens"]
    whole = httpx.post(f"{gw.base_url}/v1/responses", json=body, timeout=120).json()
    assert whole["timings"]["predicted_n"] == whole["usage"]["output_tokens"]
    plain = httpx.post(f"{gw.base_url}/v1/responses", json={"input": "Hi", "max_output_tokens": 2}, timeout=120)
    assert "timings" not in plain.json()
