"""Anthropic's Messages API (with the official ``anthropic`` SDK) and OpenAI's Responses
API (with the ``openai`` SDK) against a real gateway and the tiny engine: text, system /
instructions, tools and tool results, streaming events, errors, token counting."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.gateway_helpers import openai_client

SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"enum": [1, 2, 3]}},
          "required": ["city", "days"], "additionalProperties": False}
ASK = "What is the weather in Paris?"


def claude(gw: Any, **kw: Any) -> anthropic.Anthropic:
    """The official ``anthropic`` client on a ``RunningGateway``, closed when it stops."""
    return gw.close_on_stop(anthropic.Anthropic(base_url=gw.base_url, api_key=kw.pop("api_key", "unused"),
                                                max_retries=0, timeout=120, **kw))


def message(ac: anthropic.Anthropic, **kw: Any) -> Any:
    kw.setdefault("messages", [{"role": "user", "content": ASK}])
    kw.setdefault("max_tokens", 12)
    kw.setdefault("extra_body", {"temperature": 0})  # the SDK's own fields no longer include it
    kw.setdefault("model", "default")
    return ac.messages.create(**kw)


# ---- Anthropic Messages ----------------------------------------------------------------


def test_a_message_answers_text_with_anthropic_usage(api_gateway):
    ac = claude(api_gateway())
    m = message(ac, system="You are terse.")
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.content[0].type == "text" and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens")
    assert 0 < m.usage.output_tokens <= 12 and m.usage.input_tokens > 0
    # a Claude model name means the one model served
    longer = message(ac, system="You are terse. Answer in few words, and never apologise.", model="claude-sonnet-4-5")
    assert (m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)
            < longer.usage.input_tokens + (longer.usage.cache_read_input_tokens or 0))  # the system prompt is read


def test_the_streamed_message_equals_the_whole_one(api_gateway):
    ac = claude(api_gateway())
    whole = message(ac)
    with ac.messages.stream(model="default", max_tokens=12, extra_body={"temperature": 0},
                            messages=[{"role": "user", "content": ASK}]) as s:
        names = [ev.type for ev in s]
        final = s.get_final_message()
    assert names[0] == "message_start" and names[-1] == "message_stop"
    assert "content_block_start" in names and "content_block_stop" in names and "message_delta" in names
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_message_start_states_the_prompts_tokens(api_gateway):
    ac = claude(api_gateway())
    whole = message(ac)
    with ac.messages.stream(model="default", max_tokens=12, extra_body={"temperature": 0},
                            messages=[{"role": "user", "content": ASK}]) as s:
        events = list(s)
        final = s.get_final_message()
    start = events[0]
    assert start.type == "message_start"
    read = start.message.usage.input_tokens + (start.message.usage.cache_read_input_tokens or 0)
    assert read == whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0) > 0
    assert start.message.usage.output_tokens == 0
    assert final.usage.input_tokens == start.message.usage.input_tokens  # the SDK keeps message_start's count


def test_a_stop_sequence_is_named(api_gateway):
    ac = claude(api_gateway())
    whole = message(ac, max_tokens=16).content[0].text
    stop = whole.strip().split()[1] if len(whole.split()) > 1 else whole.strip()[:2]
    m = message(ac, max_tokens=16, stop_sequences=[stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop and stop not in m.content[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_tool_is_used_with_input_matching_its_schema(api_gateway, stream):
    ac = claude(api_gateway())
    tools = [{"name": "get_weather", "description": "Weather in a city", "input_schema": SCHEMA}]
    kw = dict(tools=tools, tool_choice={"type": "tool", "name": "get_weather"}, max_tokens=64)
    if stream:
        with ac.messages.stream(model="default", extra_body={"temperature": 0},
                                messages=[{"role": "user", "content": ASK}],
                                **kw) as s:
            m = s.get_final_message()
    else:
        m = message(ac, **kw)
    uses = [b for b in m.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, SCHEMA)
    assert m.stop_reason == "tool_use"


def test_a_tool_result_in_the_history_is_answered(api_gateway):
    ac = claude(api_gateway())
    tools = [{"name": "get_weather", "description": "Weather in a city", "input_schema": SCHEMA}]
    history = [{"role": "user", "content": ASK},
               {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                  "input": {"city": "Paris", "days": 1}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}]
    m = message(ac, messages=history, tools=tools, tool_choice={"type": "none"}, max_tokens=6)
    assert m.content and m.content[0].type == "text" and m.stop_reason in ("end_turn", "max_tokens")


def test_count_tokens_is_the_prompt_the_reply_reads(api_gateway):
    ac = claude(api_gateway())
    counted = ac.messages.count_tokens(model="default", messages=[{"role": "user", "content": ASK}])
    m = message(ac)
    assert counted.input_tokens == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)


def test_anthropic_errors_have_anthropic_shapes_and_the_key_is_read_from_x_api_key(api_gateway):
    gw = api_gateway(api_key="sekret")
    with pytest.raises(anthropic.AuthenticationError):
        message(claude(gw, api_key="wrong"))
    ac = claude(gw, api_key="sekret")
    assert message(ac).content
    with pytest.raises(anthropic.BadRequestError) as e:
        ac.messages.create(model="default", max_tokens=5, messages=[
            {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    r = httpx.post(f"{gw.base_url}/v1/messages", headers={"x-api-key": "sekret"}, timeout=30,
                   json={"model": "default", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]


# ---- Responses ----------------------------------------------------------------------------


def respond(oa: openai.OpenAI, **kw: Any) -> Any:
    kw.setdefault("input", ASK)
    kw.setdefault("max_output_tokens", 12)
    kw.setdefault("temperature", 0)
    return oa.responses.create(model="default", **kw)


def test_a_response_answers_text_with_instructions(api_gateway):
    oa = openai_client(api_gateway())
    r = respond(oa, instructions="Answer in one word.")
    assert r.object == "response" and r.id.startswith("resp_") and r.status in ("completed", "incomplete")
    assert r.output_text and r.output[0].type == "message"
    longer = respond(oa, instructions="Answer in one word, and never apologise for being brief.")
    assert r.usage.output_tokens <= 12 and r.usage.input_tokens < longer.usage.input_tokens
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"


def test_a_response_reports_the_sampling_it_used_not_openais_defaults(api_gateway):
    gw = api_gateway()
    defaults = gw.config.defaults
    assert (defaults.temperature, defaults.top_p) != (1.0, 1.0)  # else this would prove nothing
    r = httpx.post(f"{gw.base_url}/v1/responses", json={"input": "Say hi", "max_output_tokens": 4}, timeout=60)
    assert r.status_code == 200
    assert (r.json()["temperature"], r.json()["top_p"]) == (defaults.temperature, defaults.top_p)
    given = respond(openai_client(gw), temperature=0.3, top_p=0.5, max_output_tokens=4)
    assert (given.temperature, given.top_p) == (0.3, 0.5)


def test_streamed_response_events_rebuild_the_whole_response(api_gateway):
    oa = openai_client(api_gateway())
    whole = respond(oa)
    events = list(respond(oa, stream=True))
    names = [e.type for e in events]
    assert names[:2] == ["response.created", "response.in_progress"]
    assert names[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text


@pytest.mark.parametrize("stream", [False, True])
def test_a_response_calls_a_required_function(api_gateway, stream):
    oa = openai_client(api_gateway())
    tools = [{"type": "function", "name": "get_weather", "description": "Weather", "parameters": SCHEMA,
              "strict": True}]
    kw = dict(tools=tools, tool_choice="required", parallel_tool_calls=False, max_output_tokens=64)
    if stream:
        events = list(respond(oa, stream=True, **kw))
        r = events[-1].response
        args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        assert args == [o for o in r.output if o.type == "function_call"][0].arguments
    else:
        r = respond(oa, **kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMA)
    follow = respond(oa, tools=tools, input=[
        {"role": "user", "content": ASK}, {"type": "function_call", "call_id": calls[0].call_id,
                                           "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}], tool_choice="none")
    assert follow.output_text


def test_an_anthropic_output_format_holds_the_text(api_gateway):
    m = message(claude(api_gateway()), max_tokens=40, output_config={"format": {"type": "json_schema",
                                                                                "schema": SCHEMA}})
    assert m.stop_reason == "end_turn"
    jsonschema.validate(json.loads(m.content[0].text), SCHEMA)


def test_a_response_format_holds_the_text(api_gateway):
    oa = openai_client(api_gateway())
    r = respond(oa, text={"format": {"type": "json_schema", "name": "w", "schema": SCHEMA, "strict": True}},
                max_output_tokens=40)
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), SCHEMA)


def test_stored_responses_are_refused_naming_the_field(api_gateway):
    oa = openai_client(api_gateway())
    with pytest.raises(openai.BadRequestError) as e:
        respond(oa, previous_response_id="resp_123")
    assert e.value.param == "previous_response_id"


@pytest.mark.parametrize("stream", [False, True])
def test_a_response_cut_by_max_output_tokens_marks_its_message_incomplete(api_gateway, stream):
    oa = openai_client(api_gateway())
    kw: dict[str, Any] = dict(input="Write a long story about a lighthouse.", max_output_tokens=4)
    r = list(respond(oa, stream=True, **kw))[-1].response if stream else respond(oa, **kw)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [(o.type, o.status) for o in r.output] == [("message", "incomplete")]  # as OpenAI marks it
    other = respond(oa, instructions="Answer in one word.", max_output_tokens=64)
    assert other.output[0].status == other.status  # completed with it, or incomplete with it
