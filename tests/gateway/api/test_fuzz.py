"""Fuzzing (hypothesis) of every input path: browser frames, the OpenAI request body,
the HTTP API bodies and the engine's ``generate`` frame, with random shapes, types,
sizes and hostile Unicode (lone surrogates, NUL, RTL marks, combining marks, 4-byte
characters). Nothing answers ``internal_error``, 500 or a traceback; a socket stays
usable after every frame; Redis holds no half-written chat.

Budget (examples per target, run in CI; docs/reliability.md): the four parsers 300 each
(pure functions, no I/O), the live gateway socket 60, the live OpenAI endpoint 40, the
live ``/api`` bodies 60, the live engine socket 60.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from websockets.sync.client import connect as sync_connect

from engine.errors import EngineError
from engine.prompt import validate_messages
from engine.protocol import FrameError, GenerateFrame, decode_client_frame
from engine.server import parse_generate
from gateway.api.http import _session_fields
from gateway.api.openai_api import json_bytes
from gateway.api.openai_request import OpenAIError, parse_chat_request
from gateway.api.socket_frames import ChatFrame, ProtocolError, RegenerateFrame, decode_json, parse_client_frame
from gateway.api.validation import printable
from gateway.config import GatewayConfig
from gateway.errors import GatewayError
from gateway.replies.manager import merge_params

UNIT = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LIVE = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

# ---- strategies -------------------------------------------------------------------------

SPECIALS = ["\x00", "\u202e", "\u200f", "e\u0301", "\U0001F600", "\ud83d", "\udc00", "\ufeff", "\uffff",
            "", " ", "\n" * 3, "a" * 300]
hostile_text = st.one_of(
    st.text(alphabet=st.characters(exclude_categories=()), max_size=40),  # includes lone surrogates
    st.sampled_from(SPECIALS),
    st.lists(st.sampled_from(SPECIALS + ["hi", "word "]), max_size=6).map("".join),
)
scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2 ** 70), max_value=2 ** 70),
                    st.floats(allow_nan=True, allow_infinity=True), hostile_text)
json_values = st.recursive(scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(hostile_text, c, max_size=4),
                           max_leaves=12)
ids = st.one_of(st.text(alphabet="abcdef0123456789", min_size=1, max_size=32), hostile_text, scalars)
SAMPLING_KEYS = ["temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
                 "presence_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs"]
small_tokens = st.one_of(st.integers(min_value=-2, max_value=4), scalars)
params = st.one_of(
    json_values,
    st.dictionaries(st.sampled_from(SAMPLING_KEYS) | hostile_text, json_values, max_size=4),
    st.fixed_dictionaries({"max_tokens": small_tokens}, optional={k: json_values for k in SAMPLING_KEYS}),
)


@st.composite
def browser_frames(draw: Any) -> Any:
    """A frame: mostly objects with a real ``type`` and random fields, sometimes anything,
    often a plausible ``chat`` (hostile text, random params) that reaches the store."""
    pick = draw(st.integers(0, 9))
    if pick == 0:
        return draw(json_values)
    if pick <= 4:
        return {"type": "chat", "content": draw(hostile_text.filter(lambda t: t.strip())),
                "params": draw(params) if draw(st.booleans()) else {"max_tokens": draw(st.integers(1, 4))}}
    frame: dict[str, Any] = {"type": draw(st.sampled_from(["chat", "cancel", "regenerate", "resume", "ping"])
                                          | hostile_text | scalars)}
    optional = {"content": hostile_text | json_values, "session_id": ids, "request_id": ids, "message_id": ids,
                "client_msg_id": ids, "last_seq": scalars, "params": params}
    for key, strategy in optional.items():
        if draw(st.booleans()):
            frame[key] = draw(strategy)
    return frame


message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]) | ids,
                           "content": hostile_text | st.lists(
                               st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]) | scalars,
                                                      "text": hostile_text | scalars}), max_size=3) | scalars},
                          optional={"name": hostile_text | scalars}),
    json_values)


@st.composite
def openai_bodies(draw: Any) -> Any:
    """A chat-completions body: real field names with random values, sometimes anything."""
    if draw(st.integers(0, 9)) == 0:
        return draw(json_values)
    body: dict[str, Any] = {"messages": draw(st.lists(message, min_size=0, max_size=3) | json_values),
                            "max_tokens": draw(small_tokens)}
    fields = {"model": ids, "temperature": scalars, "top_p": scalars, "stop": json_values, "seed": scalars,
              "stream": scalars, "stream_options": json_values, "n": scalars, "frequency_penalty": scalars,
              "presence_penalty": scalars, "top_k": scalars, "min_p": scalars, "repetition_penalty": scalars,
              "tools": json_values, "response_format": json_values, "logprobs": scalars, "user": json_values,
              "max_completion_tokens": small_tokens, "ignore_eos": st.just(False) | scalars}
    for key, strategy in fields.items():
        if draw(st.integers(0, 4)) == 0:
            body[key] = draw(strategy)
    if draw(st.integers(0, 9)) == 0:
        body[draw(hostile_text)] = draw(json_values)
    return body


session_bodies = st.one_of(
    st.fixed_dictionaries({}, optional={"title": hostile_text | json_values, "system_prompt": hostile_text | scalars,
                                        "params": params}),
    json_values)

generate_frames = st.fixed_dictionaries(
    {"type": st.just("generate"), "request_id": st.text(alphabet="abcdef0123456789", min_size=1, max_size=8)},
    optional={"messages": st.lists(message, max_size=3) | json_values,
              "prompt_token_ids": st.lists(st.integers(-5, 60000), max_size=8) | json_values,
              "prefix_token_ids": st.lists(st.integers(-5, 60000), max_size=8) | json_values,
              "params": params, "cache_salt": hostile_text | scalars, "clamp_max_tokens": scalars,
              "shared_messages": st.lists(message, max_size=2) | json_values, "extra": json_values})


def as_wire(obj: Any) -> str:
    """JSON text as a client sends it (NaN/Infinity allowed: Python's json emits them)."""
    return json.dumps(obj)


# ---- the parsers: any input is parsed or refused with the right error type -------------------

DEFAULTS = GatewayConfig().defaults.sampling()


@UNIT
@given(browser_frames())
def test_fuzzed_browser_frames_are_parsed_or_refused_as_protocol_errors(frame):
    try:
        parsed = parse_client_frame(decode_json(as_wire(frame)))
    except ProtocolError as e:
        assert e.code in ("bad_frame", "invalid_request")
        printable(e.message).encode("utf-8")
        return
    if isinstance(parsed, (ChatFrame, RegenerateFrame)):
        try:
            merge_params(DEFAULTS, parsed.params)
        except GatewayError as e:
            assert e.code == "invalid_request"
            printable(e.message).encode("utf-8")
    if isinstance(parsed, ChatFrame):
        parsed.content.encode("utf-8")  # what reaches Redis is valid UTF-8


@UNIT
@given(openai_bodies())
def test_fuzzed_openai_bodies_are_parsed_or_refused_with_a_400(body):
    try:
        req = parse_chat_request(json.loads(as_wire(body)))
    except OpenAIError as e:
        assert e.status == 400 and e.type == "invalid_request_error"
        json_bytes(e.body())
        return
    for m in req.messages:
        m["content"].encode("utf-8")
    for v in req.params.values():
        assert not isinstance(v, float) or math.isfinite(v)


@UNIT
@given(session_bodies)
def test_fuzzed_http_api_bodies_are_accepted_or_refused_as_invalid_request(body):
    if not isinstance(body, dict):
        return  # refused by the body reader before this (covered live below)
    try:
        out = _session_fields(body, GatewayConfig())
    except GatewayError as e:
        assert e.code == "invalid_request"
        printable(e.message).encode("utf-8")
        return
    for key in ("title", "system_prompt"):
        if key in out:
            out[key].encode("utf-8")


@UNIT
@given(generate_frames)
def test_fuzzed_generate_frames_are_parsed_or_refused_as_engine_errors(frame):
    """A fuzzed frame is refused by the typed protocol's decoder (FrameError, a clear
    message the server sends as ``bad_frame``/``invalid_request``) or by the engine's
    checks (EngineError), or parses into a request whose text is valid UTF-8."""
    try:
        decoded = decode_client_frame(as_wire(frame))
    except FrameError as e:
        json.dumps({"message": e.message}).encode("utf-8")
        return
    assert isinstance(decoded, GenerateFrame)
    try:
        req = parse_generate(decoded, "1:x")
        if req.messages is not None:
            for m in validate_messages(req.messages):
                m["content"].encode("utf-8")
    except EngineError as e:
        assert e.code in ("invalid_request", "context_length_exceeded")
        json.dumps({"message": e.message}).encode("utf-8")


# ---- live: a real gateway, a real engine, the real Redis -----------------------------------------


@pytest.fixture
def fuzz_gateway(gateway_factory):
    return gateway_factory(limits={"max_messages_per_minute": 100_000, "max_generations_per_user": 64,
                                   "max_sessions_per_user": 10_000, "ws_max_subscriptions": 64})


def _assert_whole_chats(gw, cookie: str) -> None:
    """Every chat of the user ends with a stored reply: no user message without one, no
    empty chat, nothing in progress."""
    async def check() -> None:
        deadline = asyncio.get_running_loop().time() + 120
        while gw.state.generations.running and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.1)
        assert not gw.state.generations.running
    gw.run(check(), timeout=150)
    with httpx.Client(base_url=gw.base_url, cookies={"chat_uid": cookie}, timeout=30) as c:
        for s in c.get("/api/sessions").json()["sessions"]:
            body = c.get(f"/api/sessions/{s['id']}").json()
            roles = [m["role"] for m in body["messages"]]
            assert roles and roles == ["user", "assistant"] * (len(roles) // 2), (s, roles)
            assert body["active"] is None


def test_fuzzed_frames_on_a_live_socket_never_break_it(fuzz_gateway):
    gw = fuzz_gateway
    cookie = gw.new_cookie()
    headers = {"Cookie": f"chat_uid={cookie}"}
    seen_codes: set[str] = set()
    with sync_connect(gw.ws_url, origin=gw.origin, additional_headers=headers, max_size=None) as ws:

        # one frame for each check the final assert names, whatever the random draws
        @settings(max_examples=60, **LIVE)
        @example({"type": 7})
        @example({"type": "chat", "content": "hi", "params": {"max_tokens": -1}})
        @given(browser_frames())
        def one(frame):
            ws.send(as_wire(frame))
            ws.send('{"type": "ping"}')
            while True:  # everything up to the pong (replies of valid chats may interleave)
                f = json.loads(ws.recv(timeout=60))
                if f["type"] == "pong":
                    return
                if f["type"] == "error":
                    seen_codes.add(f["code"])
                    assert f["code"] != "internal_error", f
                    assert f["code"] in ("bad_frame", "invalid_request", "not_found", "busy", "conflict",
                                         "context_length_exceeded", "rate_limited"), f

        one()
    assert "bad_frame" in seen_codes and "invalid_request" in seen_codes  # the fuzzer reached both checks
    _assert_whole_chats(gw, cookie)


def test_fuzzed_openai_bodies_on_the_live_endpoint_never_get_a_500(fuzz_gateway):
    gw = fuzz_gateway
    statuses: set[int] = set()
    with httpx.Client(base_url=gw.base_url, timeout=120) as c:

        @settings(max_examples=40, **LIVE)
        @given(openai_bodies(), st.booleans())
        def one(body, link):
            if link and isinstance(body, dict):
                body = {**body, "session_id": "new"}
            r = c.post("/v1/chat/completions", content=as_wire(body),
                       headers={"content-type": "application/json"})
            statuses.add(r.status_code)
            assert r.status_code in (200, 400, 404, 409, 429), r.text[:300]
            if r.status_code != 200:
                assert r.json()["error"]["code"] != "internal_error"
            else:
                assert "internal_error" not in r.text and "Traceback" not in r.text

        one()
        cookie = c.cookies.get("chat_uid")
    assert 400 in statuses
    if cookie:
        _assert_whole_chats(gw, cookie)


def test_fuzzed_http_api_bodies_never_get_a_500(fuzz_gateway):
    gw = fuzz_gateway
    with httpx.Client(base_url=gw.base_url, timeout=60) as c:
        sid = c.post("/api/sessions", json={}).json()["id"]

        @settings(max_examples=60, **LIVE)
        @given(session_bodies | st.binary(max_size=64).map(lambda b: b"\xff" + b), st.booleans())
        def one(body, patch):
            content = body if isinstance(body, bytes) else as_wire(body).encode()
            r = c.request("PATCH" if patch else "POST", f"/api/sessions/{sid}" if patch else "/api/sessions",
                          content=content)
            assert r.status_code in (200, 201, 400, 413), r.text[:300]
            if r.status_code >= 400:
                assert r.json()["error"]["code"] in ("invalid_request", "frame_too_large")

        one()


def test_fuzzed_generate_frames_on_the_live_engine_never_get_an_internal_error(engine_url):
    with sync_connect(engine_url, max_size=None) as ws:
        assert json.loads(ws.recv(timeout=30))["type"] == "hello"

        @settings(max_examples=60, **LIVE)
        @given(generate_frames)
        def one(frame):
            ws.send(as_wire(frame))
            ws.send('{"type": "ping"}')
            while True:
                f = json.loads(ws.recv(timeout=60))
                if f["type"] == "pong":
                    return
                # errors come alone or as items of a step frame (engine/protocol.py)
                for e in [f] if f["type"] == "error" else [i for i in f.get("items", []) if i["type"] == "error"]:
                    assert e["code"] in ("invalid_request", "context_length_exceeded", "bad_frame",
                                         "duplicate_request_id"), e

        one()
