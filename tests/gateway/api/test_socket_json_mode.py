"""The browser protocol's JSON reply mode: a ``chat`` frame whose ``params`` hold
``structured`` gets a reply held to that JSON schema by the engine's grammar, stored as
it streamed; a schema the engine cannot use is an ``invalid_request`` error frame and
the turn is undone. Real gateway, Redis and tiny engine."""

from __future__ import annotations

import json

import jsonschema

from tests.gateway_helpers import chat, stored

SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"enum": [1, 2, 3]}},
          "required": ["city", "days"], "additionalProperties": False}


async def test_a_json_schema_turn_replies_json_that_matches_it_and_is_stored(gateway_factory):
    gw = gateway_factory()
    cookie = gw.new_cookie()
    async with gw.connect(cookie) as ws:
        r = await chat(ws, "Weather in Paris?", max_tokens=40,
                       structured={"type": "json_schema", "schema": SCHEMA, "strict": True})
        assert r.error is None and r.done["finish_reason"] == "stop", (r.error, r.done)
        jsonschema.validate(json.loads(r.text), SCHEMA)
        sid = r.start["session_id"]
        plain = await chat(ws, "And in Oslo?", sid, max_tokens=6)  # the mode is per turn
        assert plain.done["finish_reason"] in ("stop", "length")
        bad = await chat(ws, "Again?", sid, structured={"type": "json_schema", "strict": True, "schema": {
            "type": "array", "uniqueItems": True}})
        assert bad.error is not None and bad.error["code"] == "invalid_request"
        assert "uniqueItems" in bad.error["message"]
    messages = (await stored(gw, cookie, sid))["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]  # the refused turn is undone
    assert messages[1]["content"] == r.text


async def test_a_chat_whose_stored_params_hold_a_schema_replies_json_every_turn(gateway_factory):
    gw = gateway_factory()
    cookie = gw.new_cookie()
    async with gw.http(cookie) as http:
        r = await http.post("/api/sessions", json={"params": {
            "structured": {"type": "json_schema", "schema": SCHEMA}, "max_tokens": 40}})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
    async with gw.connect(cookie) as ws:
        for q in ("Weather in Paris?", "And tomorrow?"):
            reply = await chat(ws, q, sid)
            assert reply.done["finish_reason"] == "stop"
            jsonschema.validate(json.loads(reply.text), SCHEMA)
