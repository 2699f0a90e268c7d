"""The OpenAI-compatible API end to end: the official ``openai`` client against a real
gateway (real Redis, real engine on the tiny model), plus raw HTTP where the wire
format itself is under test."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import openai
import pytest

from gateway.api.auth import COOKIE_NAME
from gateway.api.openai_api import key_user_id
from gateway.config import Defaults
from tests.engine_gate import of_type, text_delta
from tests.fixtures_servers import RunningGateway
from tests.gateway_helpers import openai_client as client

BLOCK = 16  # the engine fixture's --block-size
QUESTION = [{"role": "user", "content": "Tell me about lighthouses."}]


def engine_stats(gw: RunningGateway) -> dict[str, Any]:
    r = httpx.get(f"{gw.base_url}/api/engine/stats", timeout=30)
    return r.json()["engines"][0]["stats"]


def idle_stats(gw: RunningGateway, timeout: float = 60) -> dict[str, Any]:
    """Engine stats once nothing runs or waits (fails after ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        s = engine_stats(gw)
        if s["running"] == 0 and s["waiting"] == 0:
            return s
        assert time.monotonic() < deadline, f"engine still busy: {s}"
        time.sleep(0.05)


def greedy(oa: openai.OpenAI, messages: list[dict[str, str]], **kw: Any) -> Any:
    kw.setdefault("max_tokens", 16)
    return oa.chat.completions.create(model="default", messages=messages, temperature=0, **kw)


def stream_text(oa: openai.OpenAI, messages: list[dict[str, str]], **kw: Any) -> tuple[list[Any], str]:
    """(all chunks, concatenated content) of a streamed greedy reply."""
    kw.setdefault("max_tokens", 16)
    chunks: list[Any] = list(oa.chat.completions.create(model="default", messages=messages, temperature=0,
                                                        stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return chunks, text


# ---- replies ---------------------------------------------------------------------------


def test_models_lists_the_served_model_and_it_is_accepted_by_name(api_gateway):
    gw = api_gateway()
    oa = client(gw)
    models = oa.models.list().data
    info = gw.state.router.info()
    assert [m.id for m in models] == [info.model]
    assert info.format and models[0].model_extra["format"] == info.format  # the serving format, as the engine said
    # the chat page and its config say it too
    import html

    import httpx

    page = httpx.get(gw.base_url + "/").text
    assert f'id="model-format">{html.escape(info.format)}<' in page
    assert httpx.get(gw.base_url + "/api/config").json()["format"] == info.format
    r = oa.chat.completions.create(model=models[0].id, messages=QUESTION, max_tokens=4, temperature=0)
    assert r.model == info.model and r.object == "chat.completion"


def test_non_streaming_reply_has_the_openai_shape_and_usage(api_gateway):
    gw = api_gateway()
    r = greedy(client(gw), QUESTION, max_tokens=12)
    assert r.id.startswith("chatcmpl-") and len(r.choices) == 1
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    u = r.usage
    assert 0 < u.completion_tokens <= 12 and u.prompt_tokens > 0
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens <= u.prompt_tokens
    if choice.finish_reason == "length":
        assert u.completion_tokens == 12


@pytest.mark.parametrize("max_tokens", [1, 7, 24])
def test_streamed_text_equals_the_non_streamed_text_and_counts_every_token(api_gateway, max_tokens):
    """The finishing step's tokens are delivered (docs/acceptance.md#the-finishing-steps-tokens-are-delivered): the
    finishing step's tokens are streamed too."""
    gw = api_gateway()
    oa = client(gw)
    whole = greedy(oa, QUESTION, max_tokens=max_tokens)
    chunks, text = stream_text(oa, QUESTION, max_tokens=max_tokens, stream_options={"include_usage": True})
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishing) == 1 and finishing[0].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage is not None  # the usage chunk comes last
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    if whole.choices[0].finish_reason == "length":
        assert whole.usage.completion_tokens == max_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_the_wire_format_is_sse_data_lines_ending_with_done(api_gateway):
    gw = api_gateway()
    body = {"model": "default", "messages": QUESTION, "max_tokens": 5, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{gw.base_url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") and "\n" not in e for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert "usage" not in chunks[-1]  # no include_usage: no usage chunk


def _a_stop_string(text: str) -> str:
    """A 4-character piece of ``text`` from its middle that first occurs there."""
    for k in range(len(text) // 3, len(text) - 4):
        s = text[k:k + 4]
        if text.find(s) == k and s.strip():
            return s
    raise AssertionError(f"no usable stop string in {text!r}")


def test_a_stop_string_ends_the_reply_and_no_part_of_it_is_ever_streamed(api_gateway):
    """Stop strings never leak (docs/acceptance.md#stop-strings-never-leak), on whatever the model says greedily."""
    gw = api_gateway()
    oa = client(gw)
    full = greedy(oa, QUESTION, max_tokens=48).choices[0].message.content
    stop = _a_stop_string(full)
    expected = full[:full.index(stop)]
    whole = greedy(oa, QUESTION, max_tokens=48, stop=[stop, "\u2603never\u2603"])
    assert whole.choices[0].message.content == expected and whole.choices[0].finish_reason == "stop"
    chunks, text = stream_text(oa, QUESTION, max_tokens=48, stop=stop)
    assert text == expected  # a stream cannot take text back: nothing past the cut was sent
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


def test_a_seed_makes_a_sampled_reply_reproducible(api_gateway):
    gw = api_gateway()
    oa = client(gw)

    def sample(seed: int) -> str:
        return oa.chat.completions.create(model="default", messages=QUESTION, temperature=0.8, seed=seed,
                                          max_tokens=16).choices[0].message.content

    first = sample(1234)
    assert sample(1234) == first
    assert len({first, sample(1), sample(2), sample(3)}) > 1  # the seed is really used


def test_a_second_turn_finds_the_first_in_the_prefix_cache(api_gateway):
    gw = api_gateway()
    oa = client(gw)
    turn1 = [{"role": "system", "content": "You are terse."},
             {"role": "user", "content": "Name three rivers of Europe, with a word about each one."}]
    r1 = greedy(oa, turn1, max_tokens=20)
    turn2 = turn1 + [{"role": "assistant", "content": r1.choices[0].message.content},
                     {"role": "user", "content": "And of Asia?"}]
    r2 = greedy(oa, turn2, max_tokens=8)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached >= r1.usage.prompt_tokens - BLOCK
    assert r2.usage.prompt_tokens > r1.usage.prompt_tokens


def test_content_given_as_text_parts_is_the_same_as_a_string(api_gateway):
    gw = api_gateway()
    oa = client(gw)
    as_string = greedy(oa, [{"role": "user", "content": "Hello there.\nHow are you?"}], max_tokens=8)
    as_parts = greedy(oa, [{"role": "user", "content": [{"type": "text", "text": "Hello there."},
                                                         {"type": "text", "text": "How are you?"}]}], max_tokens=8)
    assert as_parts.choices[0].message.content == as_string.choices[0].message.content
    assert as_parts.usage.prompt_tokens == as_string.usage.prompt_tokens


# ---- errors ------------------------------------------------------------------------------


def post(gw: RunningGateway, body: dict[str, Any], headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(f"{gw.base_url}/v1/chat/completions", json=body, headers=headers, timeout=60)


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None,
                        code: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    return err


@pytest.mark.parametrize("change, param", [
    ({"messages": []}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({"n": 9}, "n"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": 2.5}, "max_completion_tokens"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"seed": 2 ** 70}, "seed"),
    ({"seed": "42"}, "seed"),
    ({"stop": ""}, "stop"),
    ({"stop": ["a"] * 17}, "stop"),
    ({"stream": "yes"}, "stream"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"logit_bias": {"1": 500}}, "logit_bias"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
])
def test_bad_requests_get_400_with_an_openai_error_body(api_gateway, change, param):
    gw = api_gateway()
    before = idle_stats(gw)["requests_total"]
    r = post(gw, {"model": "default", "messages": QUESTION, "max_tokens": 4, **change})
    err = assert_openai_error(r, 400, param=param)
    assert err["type"] == "invalid_request_error"
    assert engine_stats(gw)["requests_total"] == before  # refused before reaching the engine


def test_harmless_openai_fields_are_ignored(api_gateway):
    gw = api_gateway()
    r = post(gw, {"model": "default", "messages": QUESTION, "max_tokens": 3, "user": "someone",
                  "metadata": {"a": "b"}, "store": False, "n": 1, "tools": [], "tool_choice": "none",
                  "response_format": {"type": "text"}, "logprobs": False, "parallel_tool_calls": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def test_n_above_eight_and_a_too_long_prompt_are_refused_through_the_sdk(api_gateway):
    gw = api_gateway()
    oa = client(gw)
    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(model="default", messages=QUESTION, n=9)
    assert e.value.status_code == 400 and e.value.param == "n"
    long = [{"role": "user", "content": "lighthouse keeper " * 1500}]  # beyond the 2048-token context
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            oa.chat.completions.create(model="default", messages=long, max_tokens=8, stream=stream)
        assert e.value.code == "context_length_exceeded" and "context" in e.value.message
    assert greedy(oa, QUESTION, max_tokens=2).usage.completion_tokens >= 1  # still serving


def test_an_unknown_model_is_404(api_gateway):
    gw = api_gateway()
    with pytest.raises(openai.NotFoundError) as e:
        client(gw).chat.completions.create(model="gpt-17", messages=QUESTION)
    assert e.value.code == "model_not_found" and e.value.param == "model"


def test_model_aliases_name_the_one_model_served_and_other_names_stay_404(api_gateway):
    gw = api_gateway(model_aliases=("gpt-4o",))
    served = client(gw).models.list().data[0].id
    r = client(gw).chat.completions.create(model="gpt-4o", messages=QUESTION, max_tokens=2, temperature=0)
    assert r.model == served and r.choices[0].message.content is not None
    with pytest.raises(openai.NotFoundError):
        client(gw).chat.completions.create(model="gpt-17", messages=QUESTION, max_tokens=2)
    anything = api_gateway(model_aliases=("*",))
    for name in ("gpt-17", "gpt-3.5-turbo-instruct"):
        r = client(anything).completions.create(model=name, prompt="Hello", max_tokens=2, temperature=0)
        assert r.model == served and r.choices[0].finish_reason in ("length", "stop")


def test_no_engine_gives_503_engine_unavailable(api_gateway):
    gw = api_gateway(engine_urls=["ws://127.0.0.1:9"], wait_for_engine=False)
    r = post(gw, {"model": "default", "messages": QUESTION})
    assert_openai_error(r, 503, code="engine_unavailable")


def test_an_api_key_is_required_when_configured(api_gateway):
    gw = api_gateway(api_key="s3cret-key")
    with pytest.raises(openai.AuthenticationError) as e:
        greedy(client(gw, api_key="wrong"), QUESTION)
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client(gw, api_key="wrong").models.list()
    assert_openai_error(post(gw, {"model": "default", "messages": QUESTION}), 401, code="invalid_api_key")
    ok = client(gw, api_key="s3cret-key")
    assert greedy(ok, QUESTION, max_tokens=2).usage.completion_tokens >= 1
    assert ok.models.list().data


# ---- a dropped client aborts (stop frees the engine) ----------------------------------------------
# The engine is paused at its first delta until the abort that the drop causes reaches it
# (tests/engine_gate.py): the reply cannot end before the client goes, however fast it is.


def assert_aborted_and_freed(gw: RunningGateway, before: dict[str, Any], max_tokens: int) -> None:
    after = idle_stats(gw, timeout=30)
    assert after["aborted_total"] == before["aborted_total"] + 1
    assert after["blocks_held_by_requests"] == 0
    in_use = lambda s: s["blocks_used"] - s["blocks_evictable"]  # noqa: E731
    assert in_use(after) <= in_use(before)
    assert after["completion_tokens_total"] - before["completion_tokens_total"] < max_tokens


def test_a_dropped_streaming_client_aborts_the_engine_request_and_frees_its_blocks(api_gateway, engine_gate):
    gw = api_gateway(engine_urls=[engine_gate.url])
    oa = client(gw)
    before = idle_stats(gw)
    max_tokens = 1900
    engine_gate.pause_on(text_delta())
    stream = oa.chat.completions.create(model="default", messages=QUESTION, max_tokens=max_tokens, stream=True,
                                        extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            break
    stream.close()  # drops the connection mid-reply
    engine_gate.wait_sent(of_type("abort"))
    engine_gate.resume()
    assert_aborted_and_freed(gw, before, max_tokens)


def test_a_dropped_non_streaming_client_aborts_too(api_gateway, engine_gate):
    gw = api_gateway(engine_urls=[engine_gate.url])
    before = idle_stats(gw)
    max_tokens = 1900
    body = {"model": "default", "messages": QUESTION, "max_tokens": max_tokens, "ignore_eos": True}
    engine_gate.pause_on(text_delta())
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(f"{gw.base_url}/v1/chat/completions", json=body, timeout=httpx.Timeout(30, read=1.0))
    engine_gate.wait_sent(of_type("abort"))
    engine_gate.resume()
    assert_aborted_and_freed(gw, before, max_tokens)


# ---- the session link ----------------------------------------------------------------------


def new_chat(gw: RunningGateway, cookie: str) -> str:
    r = httpx.post(f"{gw.base_url}/api/sessions", json={}, cookies={COOKIE_NAME: cookie}, timeout=30)
    assert r.status_code == 201, r.text
    return r.json()["id"]


def chat_messages(gw: RunningGateway, cookie: str, sid: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{gw.base_url}/api/sessions/{sid}", cookies={COOKIE_NAME: cookie}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["messages"]


def test_a_linked_request_appends_both_turns_to_the_chat_and_reuses_their_exact_ids(api_gateway):
    gw = api_gateway()
    cookie = gw.new_cookie()
    sid = new_chat(gw, cookie)
    oa = client(gw, default_headers={"Cookie": f"{COOKIE_NAME}={cookie}", "X-Chat-Session": sid})
    q1, q2 = "Name three rivers of Europe.", "And of Asia?"
    raw = oa.chat.completions.with_raw_response.create(
        model="default", messages=[{"role": "user", "content": q1}], temperature=0, max_tokens=20)
    assert raw.headers["x-chat-session"] == sid
    r1 = raw.parse()
    a1 = r1.choices[0].message.content
    assert r1.model_extra["session_id"] == sid
    # a client that resends the whole history, as OpenAI clients do, streaming this time
    history = [{"role": "user", "content": q1}, {"role": "assistant", "content": a1}, {"role": "user", "content": q2}]
    chunks, a2 = stream_text(oa, history, max_tokens=8, stream_options={"include_usage": True})
    u1, u2 = r1.usage, chunks[-1].usage
    assert u2.prompt_tokens_details.cached_tokens >= u1.prompt_tokens + u1.completion_tokens - BLOCK
    stored = chat_messages(gw, cookie, sid)
    assert [(m["role"], m["content"]) for m in stored] == [("user", q1), ("assistant", a1), ("user", q2),
                                                           ("assistant", a2)]
    assert stored[1]["usage"]["completion_tokens"] == u1.completion_tokens and stored[3]["status"] == "complete"


def test_a_chat_of_another_user_is_404(api_gateway):
    gw = api_gateway()
    sid = new_chat(gw, gw.new_cookie())
    stranger = gw.new_cookie()
    oa = client(gw, default_headers={"Cookie": f"{COOKIE_NAME}={stranger}"})
    with pytest.raises(openai.NotFoundError) as refused:
        oa.chat.completions.create(model="default", messages=QUESTION, extra_body={"session_id": sid})
    # the answer says what finds a chat (a client that keeps no cookie makes one-off users)
    assert "token, API key or cookie" in refused.value.message, refused.value.message
    r = post(gw, {"model": "default", "messages": QUESTION}, headers={"X-Chat-Session": "not/an id"})
    assert_openai_error(r, 404)
    r = post(gw, {"model": "default", "messages": QUESTION, "session_id": sid}, headers={"X-Chat-Session": "other"})
    assert_openai_error(r, 400, param="session_id")


def test_an_api_key_user_creates_and_continues_its_own_chats(api_gateway):
    key = "key-for-tests"
    gw = api_gateway(api_key=key)
    oa = client(gw, api_key=key)
    first = oa.chat.completions.with_raw_response.create(
        model="default", max_tokens=6, temperature=0, extra_headers={"X-Chat-Session": "new"},
        messages=[{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Hi!"}])
    sid = first.headers["x-chat-session"]
    second = oa.chat.completions.create(model="default", max_tokens=6, temperature=0,
                                        messages=[{"role": "user", "content": "Where is the treasure?"}],
                                        extra_headers={"X-Chat-Session": sid})
    owner = key_user_id(gw.config.secret_key, key)
    info = gw.run(gw.state.store.get_session(owner, sid))
    assert info.system_prompt == "You are a pirate."
    stored = gw.run(gw.state.store.messages(owner, sid))
    assert [m["content"] for m in stored] == ["Hi!", first.parse().choices[0].message.content,
                                              "Where is the treasure?", second.choices[0].message.content]
    # the key reaches a browser user's chat only together with that user's cookie
    cookie = gw.new_cookie()
    ui_sid = new_chat(gw, cookie)
    body = {"model": "default", "messages": QUESTION, "max_tokens": 3}
    auth = {"Authorization": f"Bearer {key}", "X-Chat-Session": ui_sid}
    assert_openai_error(post(gw, body, auth), 404)
    assert post(gw, body, {**auth, "Cookie": f"{COOKIE_NAME}={cookie}"}).status_code == 200
    assert [m["role"] for m in chat_messages(gw, cookie, ui_sid)] == ["user", "assistant"]
    # ... and a cookie without the key reaches nothing
    assert_openai_error(post(gw, body, {"X-Chat-Session": ui_sid, "Cookie": f"{COOKIE_NAME}={cookie}"}), 401)


def test_a_linked_request_needs_a_user_message_last(api_gateway):
    gw = api_gateway()
    cookie = gw.new_cookie()
    sid = new_chat(gw, cookie)
    r = post(gw, {"model": "default", "messages": QUESTION + [{"role": "assistant", "content": "ok"}]},
             headers={"X-Chat-Session": sid, "Cookie": f"{COOKIE_NAME}={cookie}"})
    assert_openai_error(r, 400, param="messages")
    assert chat_messages(gw, cookie, sid) == []


def test_a_refused_first_turn_of_a_new_linked_chat_leaves_no_chat_behind(api_gateway):
    gw = api_gateway()
    cookie = gw.new_cookie()
    headers = {"X-Chat-Session": "new", "Cookie": f"{COOKIE_NAME}={cookie}"}
    long = [{"role": "user", "content": "lighthouse keeper " * 1500}]
    r = post(gw, {"model": "default", "messages": long, "max_tokens": 8}, headers)
    assert_openai_error(r, 400, code="context_length_exceeded")
    ok = post(gw, {"model": "default", "messages": QUESTION, "max_tokens": 3}, headers)
    assert ok.status_code == 200 and ok.headers["x-chat-session"] == ok.json()["session_id"]
    listed = httpx.get(f"{gw.base_url}/api/sessions", cookies={COOKIE_NAME: cookie}, timeout=30).json()
    assert [c["id"] for c in listed["sessions"]] == [ok.json()["session_id"]]


def test_an_idempotency_key_makes_a_linked_retry_reattach_to_the_same_turn(api_gateway):
    gw = api_gateway()
    cookie = gw.new_cookie()
    sid = new_chat(gw, cookie)
    headers = {"X-Chat-Session": sid, "Cookie": f"{COOKIE_NAME}={cookie}", "Idempotency-Key": "retry-1"}
    body = {"model": "default", "messages": QUESTION, "max_tokens": 6, "temperature": 0.9}
    r1, r2 = post(gw, body, headers), post(gw, body, headers)
    assert r1.status_code == r2.status_code == 200
    assert r1.json()["choices"][0]["message"]["content"] == r2.json()["choices"][0]["message"]["content"]
    assert r1.json()["id"] == r2.json()["id"]
    assert [m["role"] for m in chat_messages(gw, cookie, sid)] == ["user", "assistant"]


def test_a_dropped_linked_stream_stops_the_reply_and_stores_it_as_partial(api_gateway, engine_gate):
    gw = api_gateway(engine_urls=[engine_gate.url])
    cookie = gw.new_cookie()
    sid = new_chat(gw, cookie)
    before = idle_stats(gw)
    oa = client(gw, default_headers={"Cookie": f"{COOKIE_NAME}={cookie}", "X-Chat-Session": sid})
    engine_gate.pause_on(text_delta())  # mid-reply when the client drops (see above)
    stream = oa.chat.completions.create(model="default", messages=QUESTION, max_tokens=1900, stream=True,
                                        extra_body={"ignore_eos": True})
    got = ""
    for chunk in stream:
        got += (chunk.choices[0].delta.content or "") if chunk.choices else ""
        if got:
            break
    stream.close()
    engine_gate.wait_sent(of_type("abort"))
    engine_gate.resume()
    assert_aborted_and_freed(gw, before, 1900)
    deadline = time.monotonic() + 30
    while len(chat_messages(gw, cookie, sid)) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    reply = chat_messages(gw, cookie, sid)[-1]
    assert (reply["status"], reply["finish_reason"]) == ("partial", "abort")
    assert reply["content"].startswith(got)


def test_a_stateless_request_without_sampling_fields_gets_the_gateways_defaults_not_openais(
        api_gateway, engine_gate):
    gw = api_gateway(engine_urls=[engine_gate.url])
    oa = client(gw)
    oa.chat.completions.create(model="default", messages=QUESTION, max_tokens=3)
    oa.chat.completions.create(model="default", messages=QUESTION, max_tokens=3, temperature=1.3, top_p=0.5)
    sent = [f for f in engine_gate.to_engine if f.get("type") == "generate"]
    assert len(sent) == 2, sent
    first, second = sent[0]["params"], sent[1]["params"]
    d = Defaults()  # the fixture's gateway keeps the built-in defaults
    # OpenAI's 1 and 1 make a small model ramble: the gateway's chat defaults fill what is left out
    assert (first["temperature"], first["top_p"]) == (d.temperature, d.top_p) != (1, 1)
    assert "frequency_penalty" not in first  # the chats' anti-loop penalty would bend JSON and tool calls
    assert (second["temperature"], second["top_p"]) == (1.3, 0.5)
