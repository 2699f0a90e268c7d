"""OpenAI-compatible servers as engines (``gateway/engines/upstream.py``; docs/scaling.md,
"Existing engines as upstreams"). Real processes only: the upstream is another gateway
of this project (its ``/v1``, on the tiny-model engine) or llama.cpp's ``llama-server``
on SmolLM2's GGUF (skipped when it is not built); the browser chat runs through a
second gateway whose ``ENGINE_URLS`` names that upstream."""

from __future__ import annotations

import httpx
import pytest

from gateway.config import ConfigError, GatewayConfig
from gateway.engines.client import EngineClient, EngineRouter
from gateway.engines.run import EngineRun
from gateway.engines.upstream import UpstreamClient, engine_client, shown_model_name, upstream_body, upstream_error
from tests.engine_gate import of_type, text_delta
from tests.gateway_helpers import chat, openai_client, read_reply, recv, send, wait_for

BLOCK = 16  # the tiny engine's --block-size
SYSTEM = GatewayConfig().defaults.system_prompt


def v1(gw) -> str:
    """The OpenAI API base of a running gateway."""
    return f"{gw.base_url}/v1"


async def stored(gw, cookie: str, sid: str) -> dict:
    async with gw.http(cookie) as c:
        r = await c.get(f"/api/sessions/{sid}")
        assert r.status_code == 200, r.text
        return r.json()


async def engine_entry(gw) -> dict:
    async with gw.http(None) as c:
        return (await c.get("/api/engine/stats")).json()["engines"][0]


def uid_of(gw, cookie: str) -> str:
    from gateway.api.auth import UserIds

    uid = UserIds(gw.config.secret_key).verify(cookie)
    assert uid is not None
    return uid


# ---- the parts, without processes ----------------------------------------------------

def test_sampling_params_map_to_openai_fields_and_the_rest_is_dropped():
    params = {"max_tokens": 7, "temperature": 0, "top_p": 0.9, "frequency_penalty": 0.4, "presence_penalty": 0.1,
              "seed": 5, "stop": "END", "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "ignore_eos": False,
              "stop_token_ids": [2], "logprobs": 3}
    body = upstream_body("m", [{"role": "user", "content": "hi"}], params)
    assert body == {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                    "stream_options": {"include_usage": True}, "max_tokens": 7, "temperature": 0, "top_p": 0.9,
                    "frequency_penalty": 0.4, "presence_penalty": 0.1, "seed": 5, "stop": ["END"]}
    ext = {"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.2, "ignore_eos": True, "seed": -1}
    body = upstream_body("m", [], ext)
    assert {k: body.get(k) for k in (*ext, "repeat_penalty")} == {
        "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.2, "ignore_eos": True, "seed": None,
        "repeat_penalty": None}
    llama = upstream_body("m", [], ext, flavor="llamacpp")
    assert llama["repeat_penalty"] == 1.2 and "repetition_penalty" not in llama


def test_a_model_path_is_shown_by_its_last_part_and_other_ids_as_they_are():
    assert shown_model_name("/models/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert shown_model_name("/srv/llama-3/") == "llama-3"
    assert shown_model_name("meta-llama/Llama-3.1-8B-Instruct") == "meta-llama/Llama-3.1-8B-Instruct"


@pytest.mark.parametrize("status, body, code", [
    (400, '{"error": {"message": "x", "type": "invalid_request_error", "code": "context_length_exceeded"}}',
     "context_length_exceeded"),
    (400, '{"error": {"code": 400, "message": "the request exceeds the available context size", '
          '"type": "exceed_context_size_error"}}', "context_length_exceeded"),  # llama-server
    (400, '{"object": "error", "message": "This model\'s maximum context length is 2048 tokens.", "code": 400}',
     "context_length_exceeded"),  # vLLM
    (400, '{"error": {"message": "top_p must be in (0, 1]"}}', "invalid_request"),
    (401, '{"error": {"message": "bad key"}}', "engine_unavailable"),
    (404, '{"error": {"message": "model gone"}}', "engine_unavailable"),
    (503, "overloaded", "engine_unavailable"),
    (429, '{"error": {"message": "x", "type": "rate_limit_error", "code": "rate_limit_exceeded"}}',
     "rate_limit_exceeded"),  # the upstream's own, tried on another engine first
    (429, "slow down", "rate_limit_exceeded"),
    (302, "", "upstream_error"),
])
def test_upstream_errors_map_to_our_codes_and_keep_the_message(status, body, code):
    err = upstream_error(status, body, "r1")
    assert (err.code, err.request_id) == (code, "r1")
    if "message" in body:
        assert any(w in err.message for w in ("x", "context", "top_p", "bad key", "model gone"))


def test_engine_urls_pick_the_client_by_scheme_and_refuse_credentials():
    cfg = GatewayConfig(engine_urls=("ws://e:9000", "http://vllm:8000/v1"), upstream_api_key="k",
                        upstream_max_model_len=4096)
    ws, up = (engine_client(u, cfg) for u in cfg.engine_urls)
    assert type(ws) is EngineClient and ws.takes_token_ids
    assert isinstance(up, UpstreamClient) and not up.takes_token_ids
    assert up._auth == {"Authorization": "Bearer k"} and up.default_max_model_len == 4096
    with pytest.raises(ConfigError, match="UPSTREAM_API_KEY"):
        GatewayConfig(engine_urls=("http://key@vllm:8000/v1",))
    with pytest.raises(ConfigError, match="engine url"):
        GatewayConfig(engine_urls=("vllm:8000",))


# ---- another gateway's /v1 as the upstream ---------------------------------------------

async def test_a_chat_through_an_upstream_streams_stores_and_sends_the_whole_history_next_turn(
        gateway_factory, engine_gate):
    up = gateway_factory(engine_urls=[engine_gate.url])
    front = gateway_factory(engine_urls=[v1(up)])
    client = front.state.router.clients[0]
    assert isinstance(client, UpstreamClient) and client.info.max_model_len == up.state.router.info().max_model_len
    assert client.info.model == up.state.router.info().model and client.flavor == "chatserve"
    cookie = front.new_cookie()
    replies = []
    async with front.connect(cookie) as ws:
        sid = None
        for q in ("Hello there.", "Tell me more."):
            r = await chat(ws, q, sid, max_tokens=12)
            assert r.error is None, r.error
            sid = r.start["session_id"]
            assert r.text and r.seqs == list(range(1, len(r.deltas) + 1))
            assert r.done["finish_reason"] in ("stop", "length")
            u = r.done["usage"]
            assert u["prompt_tokens"] > 0 and 0 < u["completion_tokens"] <= 12
            assert r.done["timings"]["e2e_ms"] >= r.done["timings"]["ttft_ms"] > 0
            replies.append(r)
        # the second turn's prompt is the whole chat as text (no token ids)
        sent = await engine_gate.sent(lambda f: f.get("type") == "generate" and len(f.get("messages", [])) == 4)
        assert [m["content"] for m in sent["messages"]] == [SYSTEM, "Hello there.", replies[0].text, "Tell me more."]
        assert "prefix_token_ids" not in sent
        # the upstream's cache served the first turn's prompt again, and it said so
        u0, u1 = replies[0].done["usage"], replies[1].done["usage"]
        assert u1["cached_tokens"] >= u0["prompt_tokens"] - BLOCK and u1["cached_tokens"] > 0
        body = await stored(front, cookie, sid)
        assert [m["content"] for m in body["messages"][1::2]] == [r.text for r in replies]
        assert [m["usage"] for m in body["messages"][1::2]] == [r.done["usage"] for r in replies]
        assert all(m["status"] == "complete" for m in body["messages"])
        msgs = front.run(front.state.store.messages(uid_of(front, cookie), sid, with_tokens=True))
        assert all(m["token_ids"] is None for m in msgs)  # no ids were invented
        # a reply cut at max tokens cannot be continued without ids: a clear refusal
        cut = await chat(ws, "Count to fifty.", sid, max_tokens=2, ignore_eos=True)
        assert cut.done["finish_reason"] == "length"
        await send(ws, {"type": "continue", "session_id": sid, "message_id": cut.done["message_id"]})
        err = await recv(ws)
        assert err["type"] == "error" and err["code"] == "invalid_request" and "upstream" in err["message"]
    assert len((await stored(front, cookie, sid))["messages"]) == 6  # the refused continue changed nothing
    entry = await engine_entry(front)
    assert entry["healthy"] and entry["stats"]["upstream"] is True
    assert entry["stats"]["running"] == 0 and entry["stats"]["requests_total"] == 3


async def test_stop_closes_the_upstream_stream_which_aborts_the_engine_request(gateway_factory, engine_gate):
    up = gateway_factory(engine_urls=[engine_gate.url])
    front = gateway_factory(engine_urls=[v1(up)])
    cookie = front.new_cookie()
    async with front.connect(cookie) as ws:
        engine_gate.pause_on(text_delta())
        await send(ws, {"type": "chat", "content": "Write a long story about a canal.",
                        "params": {"max_tokens": 1800, "temperature": 0, "ignore_eos": True}})
        cancelled = False

        async def cancel_at(f, r):
            nonlocal cancelled
            if f["type"] == "delta" and not cancelled:
                cancelled = True
                await engine_gate.paused()
                await send(ws, {"type": "cancel", "request_id": r.request_id})
                await engine_gate.sent(of_type("abort"))  # the upstream gateway saw its client go
                engine_gate.resume()

        r = await read_reply(ws, on_frame=cancel_at)
    assert r.error is None and r.done["finish_reason"] == "abort"
    assert 0 < r.done["usage"]["completion_tokens"] < 600
    body = await stored(front, cookie, r.start["session_id"])
    reply = body["messages"][-1]
    assert (reply["status"], reply["finish_reason"], reply["cut_reason"]) == ("partial", "abort", "user_stop")
    assert reply["content"] == r.text and body["active"] is None

    async def engine_idle() -> bool:
        s = (await engine_entry(up))["stats"]
        return s["running"] == 0 and s["waiting"] == 0 and s["blocks_held_by_requests"] == 0

    await wait_for(engine_idle, 60)
    assert (await engine_entry(front))["stats"]["aborted_total"] == 1


async def test_an_upstream_that_is_down_or_goes_away_answers_engine_unavailable(gateway_factory):
    down = gateway_factory(engine_urls=["http://127.0.0.1:9/v1"], wait_for_engine=False)
    cookie = down.new_cookie()
    async with down.http(cookie) as c:
        r = await c.get("/readyz")
        assert r.status_code == 503 and r.json()["engines"] == 0
    async with down.connect(cookie) as ws:
        await send(ws, {"type": "chat", "content": "anyone?"})
        err = await recv(ws)
        assert err["code"] == "engine_unavailable" and "Traceback" not in err["message"]

    up = gateway_factory()
    front = gateway_factory(engine_urls=[v1(up)])
    cookie = front.new_cookie()
    async with front.connect(cookie) as ws:
        first = await chat(ws, "Hello.", max_tokens=4)
        assert first.error is None
        sid = first.start["session_id"]
        up.stop()  # the upstream goes away; the front still believes it healthy until it tries
        r = await chat(ws, "Still there?", sid, max_tokens=4)
        assert r.error is not None and r.error["code"] == "engine_unavailable", r
    body = await stored(front, cookie, sid)
    assert [m["content"] for m in body["messages"]] == ["Hello.", first.text]  # the failed turn was undone
    await wait_for(lambda: not front.state.router.healthy, 30)


async def test_the_upstream_api_key_is_sent_as_a_bearer_token(gateway_factory):
    up = gateway_factory(api_key="upstream-secret")
    async with httpx.AsyncClient(timeout=10) as c:
        assert (await c.get(f"{v1(up)}/models")).status_code == 401  # the upstream wants the key
    keyed = gateway_factory(engine_urls=[v1(up)], upstream_api_key="upstream-secret")
    async with keyed.connect(keyed.new_cookie()) as ws:
        r = await chat(ws, "Hi.", max_tokens=3)
        assert r.error is None and r.done["finish_reason"] in ("stop", "length")
    keyless = gateway_factory(engine_urls=[v1(up)], wait_for_engine=False)
    async with keyless.connect(keyless.new_cookie()) as ws:
        await send(ws, {"type": "chat", "content": "Hi."})
        assert (await recv(ws))["code"] == "engine_unavailable"


def test_the_openai_api_through_an_upstream_streams_usage_with_cached_tokens(gateway_factory):
    up = gateway_factory()
    front = gateway_factory(engine_urls=[v1(up)])
    client = openai_client(front)
    messages = [{"role": "system", "content": "You are terse. " * 8}, {"role": "user", "content": "Hi."}]
    usages = []
    for _ in range(2):
        stream = client.chat.completions.create(model="default", messages=messages, max_tokens=5, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text and chunks[-1].usage is not None
        usages.append(chunks[-1].usage)
    assert usages[0].completion_tokens <= 5 and usages[1].prompt_tokens == usages[0].prompt_tokens
    assert usages[1].prompt_tokens_details.cached_tokens >= usages[1].prompt_tokens - BLOCK


async def test_a_mixed_engine_list_refreshes_stats_and_sends_token_id_prompts_to_our_engine(
        gateway_factory, engine_url):
    up = gateway_factory()
    front = gateway_factory(engine_urls=[engine_url, v1(up)])
    ours, upstream = front.state.router.clients
    await wait_for(lambda: ours.healthy and upstream.healthy, 30)
    await wait_for(lambda: upstream.last_stats is not None and ours.last_stats is not None, 30)  # the 1 s refresh
    assert upstream.last_stats["upstream"] is True
    async with httpx.AsyncClient(base_url=front.base_url, timeout=30) as c:
        metrics = (await c.get("/metrics")).text
    assert f'engine_up{{engine="{v1(up)}"}} 1.0' in metrics

    router = EngineRouter([EngineClient(engine_url), UpstreamClient(v1(up))])
    await router.start()
    try:
        await wait_for(lambda: len(router.healthy) == 2, 30)
        for key in ("a", "b", "c", "d", "e", "f"):  # whatever the chat's hash prefers
            run = EngineRun(router, f"req-{key}", key, [], prompt_token_ids=[1, 2, 3],
                            params={"max_tokens": 2, "temperature": 0})
            await run.start()
            assert type(run.engine) is EngineClient
            while (batch := await run.next(60)) is None or batch.end is None:
                pass
            assert batch.end.finish_reason == "length"
            run.close()
    finally:
        await router.close()


# ---- llama.cpp's llama-server as the upstream -------------------------------------------

@pytest.fixture(scope="module")
def llama_server():
    """llama-server on SmolLM2's Q4_1 GGUF (bench/serving.py's ``LlamaCpp``), 2 slots of
    2,048 tokens; skips when the binary or the GGUF is missing."""
    from bench.serving_lib.systems import LLAMA_SERVER_DEFAULT, LlamaCpp, default_gguf, llama_server_available

    if not llama_server_available():
        pytest.skip(f"llama-server is not built at {LLAMA_SERVER_DEFAULT} (bash bench/build_llamacpp.sh)")
    try:
        gguf = default_gguf()
    except FileNotFoundError as e:
        pytest.skip(f"no SmolLM2 GGUF: {e}")
    system = LlamaCpp(label="llama.cpp", gguf=gguf, slot_tokens=2048)
    base = system.start(2)
    try:
        yield base
    finally:
        system.stop()


async def test_llama_server_as_the_upstream_streams_stores_reports_its_cache_and_stops(gateway_factory,
                                                                                       llama_server):
    front = gateway_factory(engine_urls=[f"{llama_server}/v1"])
    client = front.state.router.clients[0]
    async with httpx.AsyncClient(timeout=10) as c:
        n_ctx = (await c.get(f"{llama_server}/props")).json()["default_generation_settings"]["n_ctx"]
    assert client.flavor == "llamacpp" and client.info.max_model_len == n_ctx > 0  # a slot's context
    assert client.model_id.startswith("/") and client.info.model == client.model_id.rsplit("/", 1)[-1]
    cookie = front.new_cookie()
    async with front.connect(cookie) as ws:
        sid = None
        replies = []
        for q in ("What is the capital of France?", "And of Italy?"):
            r = await chat(ws, q, sid, max_tokens=24)
            assert r.error is None, r.error
            sid = r.start["session_id"]
            assert r.text.strip() and r.done["usage"]["prompt_tokens"] > 0
            assert 0 < r.done["usage"]["completion_tokens"] <= 24
            replies.append(r)
        assert replies[1].done["usage"]["prompt_tokens"] > replies[0].done["usage"]["prompt_tokens"]
        assert replies[1].done["usage"]["cached_tokens"] > 0  # the slot kept turn 1's prompt
        body = await stored(front, cookie, sid)
        assert [m["content"] for m in body["messages"][1::2]] == [r.text for r in replies]

        stop_sent = False

        async def stop_at(f, r):
            nonlocal stop_sent
            if f["type"] == "delta" and not stop_sent:
                stop_sent = True
                await send(ws, {"type": "cancel", "request_id": r.request_id})

        await send(ws, {"type": "chat", "session_id": sid, "content": "Write a very long story.",
                        "params": {"max_tokens": 1500, "temperature": 0, "ignore_eos": True}})
        r = await read_reply(ws, on_frame=stop_at)
    assert r.done["finish_reason"] == "abort" and r.done["usage"]["completion_tokens"] < 1500
    assert (await stored(front, cookie, sid))["messages"][-1]["cut_reason"] == "user_stop"

    async def slots_idle() -> bool:
        async with httpx.AsyncClient(timeout=10) as c:
            slots = (await c.get(f"{llama_server}/slots")).json()
        return not any(s.get("is_processing") for s in slots)

    await wait_for(slots_idle, 30)  # closing the stream stopped the generation
