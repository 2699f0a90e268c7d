"""Every text and number that enters is checked once, at the boundary, with one error
text: lone surrogates (invalid Unicode) are ``invalid_request`` naming the field,
deep JSON is a 400 on every route, and the sampling ranges come from the engine's
``RANGES`` table in the engine, the gateway, the OpenAI API, the page and the
terminal client alike. A refused first turn leaves no chat behind."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from engine.errors import InvalidRequestError
from engine.sampling_params import RANGES, SamplingParams, param_error
from gateway.api.openai_request import OpenAIError, parse_chat_request
from gateway.api.socket_frames import ProtocolError, decode_json, parse_client_frame
from gateway.api.validation import BadJson, loads_json
from tests.gateway_helpers import chat, read_reply, recv, send

LONE = "Say hi \ud83d"  # a JavaScript string cut in the middle of a surrogate pair
DEEP = "[" * 5000 + "]" * 5000
HOSTILE_BUT_VALID = "NUL\x00 rtl\u202e combining e\u0301 emoji \U0001F600 cjk \u4e2d"


# ---- unit: one check per kind ---------------------------------------------------------


def test_a_lone_surrogate_in_a_chat_frame_is_invalid_request_naming_content():
    frame = decode_json(json.dumps({"type": "chat", "content": LONE}))  # the escape written literally
    with pytest.raises(ProtocolError) as e:
        parse_client_frame(frame)
    assert e.value.code == "invalid_request" and "'content'" in e.value.message
    assert parse_client_frame({"type": "chat", "content": HOSTILE_BUT_VALID}).content == HOSTILE_BUT_VALID


@pytest.mark.parametrize("change, param", [
    ({"messages": [{"role": "user", "content": LONE}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "hi", "name": LONE}]}, "messages[0].name"),
    ({"messages": [{"role": "system", "content": LONE}, {"role": "user", "content": "hi"}]},
     "messages[0].content"),
    ({"stop": ["ok", LONE]}, "stop"),
    ({"model": LONE}, "model"),
    ({"session_id": LONE}, "session_id"),
])
def test_a_lone_surrogate_anywhere_in_an_openai_body_is_a_400_naming_the_field(change, param):
    body = {"messages": [{"role": "user", "content": "hi"}], **change}
    with pytest.raises(OpenAIError) as e:
        parse_chat_request(body)
    assert e.value.status == 400 and e.value.param == param and "not valid Unicode" in e.value.message


@pytest.mark.parametrize("stop", [5, {"a": 1}, True, ["ok", 5], [None]])
def test_a_stop_of_the_wrong_type_is_a_type_error_not_a_length_one(stop):
    with pytest.raises(OpenAIError) as e:
        parse_chat_request({"messages": [{"role": "user", "content": "hi"}], "stop": stop})
    assert e.value.status == 400 and e.value.param == "stop"
    assert e.value.message == "stop must be a string or a list of strings"
    with pytest.raises(InvalidRequestError, match="^stop must be a string or a list of strings$"):
        SamplingParams.from_dict({"stop": stop})
    with pytest.raises(OpenAIError, match="at most 16 non-empty strings"):  # lengths keep their own text
        parse_chat_request({"messages": [{"role": "user", "content": "hi"}], "stop": ["x"] * 17})


def test_hostile_but_valid_unicode_is_accepted_everywhere():
    req = parse_chat_request({"messages": [{"role": "user", "content": HOSTILE_BUT_VALID, "name": "\u202ex"}],
                              "stop": [HOSTILE_BUT_VALID[:10]]})
    assert req.messages[0]["content"] == HOSTILE_BUT_VALID
    SamplingParams(stop=["\x00", "\U0001F600"])


def test_deep_json_is_refused_as_bad_json_not_a_recursion_error():
    with pytest.raises(BadJson):
        loads_json(DEEP)
    with pytest.raises(BadJson):
        loads_json("[" * 100 + "]" * 100)  # parses, but past the documented depth
    assert loads_json('{"a": [[{"b": 1}]]}') == {"a": [[{"b": 1}]]}
    with pytest.raises(ProtocolError):
        decode_json(DEEP)


def test_bad_json_is_said_in_words_with_where_and_no_python_names():
    with pytest.raises(BadJson) as e:
        loads_json('{"messages": [}')
    assert str(e.value) == "not valid JSON: expecting value at line 1, column 15"
    with pytest.raises(BadJson) as e:
        loads_json(b'{"a": "\xff"}')
    assert str(e.value) == "not valid JSON: the bytes are not UTF-8 text"


# A value just outside each range, and how the OpenAI API names it.
OUTSIDE = [("temperature", 5), ("temperature", -0.1), ("top_p", 0), ("top_p", 1.5), ("min_p", 2),
           ("repetition_penalty", 0), ("repetition_penalty", 11), ("frequency_penalty", -3),
           ("presence_penalty", 2.5), ("top_k", -2), ("max_tokens", 0), ("max_tokens", 2.5),
           ("seed", 2 ** 64), ("seed", -(2 ** 63) - 1), ("seed", "42"), ("temperature", "hot")]


@pytest.mark.parametrize("name, value", OUTSIDE)
def test_every_layer_refuses_an_out_of_range_value_with_the_engines_text(name, value):
    expected = param_error(name, value)
    assert expected is not None and expected.startswith(name)
    with pytest.raises(InvalidRequestError) as engine_err:
        SamplingParams(**{name: value})
    assert engine_err.value.message == expected
    with pytest.raises(OpenAIError) as api_err:
        parse_chat_request({"messages": [{"role": "user", "content": "hi"}], name: value})
    assert api_err.value.message == expected and api_err.value.param == name


@pytest.mark.parametrize("seed", [-1, -7, 0, 2 ** 63 - 1, 2 ** 64 - 1, -(2 ** 63)])
def test_signed_and_unsigned_64_bit_seeds_are_accepted_and_minus_one_means_random(seed):
    req = parse_chat_request({"messages": [{"role": "user", "content": "hi"}], "seed": seed})
    assert req.params["seed"] == seed
    assert SamplingParams(seed=seed).seed == (None if seed == -1 else seed)


def test_the_terminal_client_refuses_an_out_of_range_temperature_before_connecting():
    r = subprocess.run([sys.executable, "-m", "gateway.client", "--url", "ws://127.0.0.1:9/ws",
                        "--temperature", "5", "hi"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "--temperature must be in [0, 2], got 5.0" in r.stderr


# ---- through a running gateway -----------------------------------------------------------


async def test_a_lone_surrogate_on_the_socket_leaves_no_chat_and_the_socket_works(gateway_factory):
    gw = gateway_factory()
    cookie = gw.new_cookie()
    async with gw.connect(cookie) as ws:
        await ws.send(json.dumps({"type": "chat", "content": LONE, "params": {"temperature": 0, "max_tokens": 4}}))
        err = await recv(ws)
        assert (err["type"], err["code"]) == ("error", "invalid_request") and "'content'" in err["message"]
        await ws.send(json.dumps({"type": "chat", "content": "hi", "params": {"stop": [LONE], "max_tokens": 4}}))
        err = await recv(ws)
        assert (err["type"], err["code"]) == ("error", "invalid_request") and "stop[0]" in err["message"]
        await ws.send(json.dumps({"type": "chat", "content": "hi", "params": {LONE: 1}}))
        err = await recv(ws)
        assert err["code"] == "invalid_request"
        await ws.send(DEEP)
        assert (await recv(ws))["code"] == "bad_frame"
        await send(ws, {"type": "ping"})
        assert await recv(ws) == {"type": "pong"}
        ok = await chat(ws, HOSTILE_BUT_VALID, max_tokens=3)
        assert ok.done is not None
    async with gw.http(cookie) as c:
        sessions = (await c.get("/api/sessions")).json()["sessions"]
    assert [s["id"] for s in sessions] == [ok.start["session_id"]]  # only the accepted chat


async def test_a_refused_first_turn_of_a_new_chat_leaves_no_chat(gateway_factory):
    gw = gateway_factory()
    max_len = gw.state.router.info().max_model_len
    cookie = gw.new_cookie()
    async with gw.connect(cookie) as ws:
        await send(ws, {"type": "chat", "content": "word " * (2 * max_len), "params": {"max_tokens": 4}})
        r = await read_reply(ws)
        assert r.error is not None and r.error["code"] == "context_length_exceeded"
    async with gw.http(cookie) as c:
        assert (await c.get("/api/sessions")).json()["sessions"] == []
        assert (await c.get(f"/api/sessions/{r.start['session_id']}")).status_code == 404


@pytest.mark.parametrize("method, path", [("POST", "/api/sessions"), ("PATCH", "/api/sessions/{sid}"),
                                          ("POST", "/v1/chat/completions")])
async def test_deeply_nested_json_is_a_400_on_every_route(gateway_factory, method, path):
    gw = gateway_factory()
    cookie = gw.new_cookie()
    async with gw.http(cookie) as c:
        sid = (await c.post("/api/sessions", json={})).json()["id"]
        for body in (DEEP, json.dumps({"params": json.loads("[" * 80 + "]" * 80)})):
            r = await c.request(method, path.format(sid=sid), content=body)
            assert r.status_code == 400, r.text
            assert "nests deeper" in r.text


async def test_text_fields_of_the_http_api_refuse_invalid_unicode_naming_the_field(gateway_factory):
    gw = gateway_factory()
    cookie = gw.new_cookie()
    async with gw.http(cookie) as c:
        for field in ("title", "system_prompt"):
            r = await c.post("/api/sessions", content=json.dumps({field: LONE}))
            assert r.status_code == 400 and f"'{field}'" in r.json()["error"]["message"]
        r = await c.post("/api/sessions", content=json.dumps({"params": {"stop": [LONE]}}))
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
        r = await c.post("/api/sessions", content=json.dumps({"params": {"temperature": 3}}))
        assert r.status_code == 400 and r.json()["error"]["message"] == param_error("temperature", 3)
        assert (await c.get("/api/sessions")).json()["sessions"] == []
        r = await c.post("/v1/chat/completions", content=json.dumps(
            {"messages": [{"role": "user", "content": LONE}], "max_tokens": 2, "session_id": "new"}))
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content"
        assert (await c.get("/api/sessions")).json()["sessions"] == []


def test_the_page_and_the_config_show_the_engines_ranges(gateway_factory):
    gw = gateway_factory()
    cfg = httpx.get(f"{gw.base_url}/api/config", timeout=10).json()
    assert cfg["ranges"]["temperature"] == {"min": RANGES["temperature"][0], "max": RANGES["temperature"][1],
                                            "min_exclusive": False}
    assert cfg["ranges"]["top_p"]["min_exclusive"] is True
    page = httpx.get(gw.base_url + "/", timeout=10).text
    assert f'id="set-temperature" min="{RANGES["temperature"][0]}" max="{RANGES["temperature"][1]}"' in page
