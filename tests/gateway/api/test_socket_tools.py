"""Tool calls over the browser protocol: a ``chat`` frame with tools gets a reply that
calls them (``done`` with ``finish_reason`` "tool_calls" and the calls, stored with the
reply), and a ``chat`` frame with ``tool_results`` sends the results back as the chat's
next message, which the model reads. Real gateway, Redis and tiny engine."""

from __future__ import annotations

import json

import jsonschema

from tests.gateway_helpers import read_reply, send, stored

SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"enum": [1, 2, 3]}},
          "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": SCHEMA}}]
FORCED = {"type": "function", "function": {"name": "get_weather"}}


async def turn(ws, session_id: str | None = None, **frame):
    frame = {"type": "chat", "content": "", "params": {"temperature": 0, "max_tokens": 64}, **frame}
    if session_id:
        frame["session_id"] = session_id
    await send(ws, frame)
    return await read_reply(ws)


async def test_a_turn_with_tools_calls_one_and_the_results_sent_back_are_read(gateway_factory):
    gw = gateway_factory()
    cookie = gw.new_cookie()
    async with gw.connect(cookie) as ws:
        call = await turn(ws, content="Weather in Paris?", tools=TOOLS, tool_choice=FORCED)
        assert call.error is None and call.done["finish_reason"] == "tool_calls", (call.error, call.done)
        [c] = call.done["tool_calls"]
        assert c["type"] == "function" and c["function"]["name"] == "get_weather" and c["id"]
        jsonschema.validate(json.loads(c["function"]["arguments"]), SCHEMA)
        assert "get_weather" not in call.text  # the call is not in the reply's text
        sid = call.start["session_id"]
        result = "It is sunny and warm in Paris today, with a light wind from the west. " * 8
        answer = await turn(ws, sid, tool_results=[{"tool_call_id": c["id"], "content": result}], tools=TOOLS,
                            tool_choice="none", params={"temperature": 0, "max_tokens": 6})
        assert answer.error is None and answer.done["finish_reason"] in ("stop", "length"), answer.error
        assert "tool_calls" not in answer.done
        # the model read the result: the prompt grew by at least its tokens
        grew = answer.done["usage"]["prompt_tokens"] - call.done["usage"]["prompt_tokens"]
        assert grew > call.done["usage"]["completion_tokens"] + len(result.split())
    messages = (await stored(gw, cookie, sid))["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert messages[1]["tool_calls"] == call.done["tool_calls"]
    assert messages[2]["tool_results"] == [{"tool_call_id": c["id"], "content": result}]
    assert messages[3]["content"] == answer.text


async def test_bad_tools_and_bad_results_are_refused_and_store_nothing(gateway_factory):
    gw = gateway_factory()
    cookie = gw.new_cookie()
    async with gw.connect(cookie) as ws:
        first = await turn(ws, content="Hello", params={"temperature": 0, "max_tokens": 3})
        sid = first.start["session_id"]
        bad_tool = await turn(ws, sid, content="Weather?", tools=[{"type": "function", "function": {}}])
        assert bad_tool.error is not None and bad_tool.error["code"] == "invalid_request"
        assert "tools" in bad_tool.error["message"]
        no_tools = await turn(ws, sid, content="Weather?", tool_choice="required")
        assert no_tools.error["code"] == "invalid_request" and "tool_choice" in no_tools.error["message"]
        bad_result = await turn(ws, sid, tool_results=[{"tool_call_id": "", "content": "x"}])
        assert bad_result.error["code"] == "bad_frame" and "tool_results[0]" in bad_result.error["message"]
    assert [m["role"] for m in (await stored(gw, cookie, sid))["messages"]] == ["user", "assistant"]
