"""The gateway's pure mappings between the APIs and the engine (gateway/api/api_to_engine.py,
gateway/api/engine_to_api.py): request fields to engine fields with a 400 naming the field,
and engine reply items to OpenAI, Responses and Anthropic shapes. No model, no engine."""

from __future__ import annotations

import json

import pytest

from engine.sampling_params import SamplingParams
from engine.structured.spec import parse_structured
from engine.tools.spec import parse_tools
from gateway.api.api_to_engine import (
    FieldError,
    chat_logprob_params,
    choice_count,
    choice_params,
    completion_logprob_params,
    completion_prompts,
    continue_final_message,
    logit_bias_param,
    messages_from_anthropic,
    messages_from_responses,
    structured_from_extensions,
    structured_from_response_format,
    tool_fields,
    tools_from_anthropic,
    tools_from_functions,
    tools_from_responses,
)
from gateway.api.engine_to_api import (
    anthropic_stop_reason,
    anthropic_tool_use_blocks,
    anthropic_tool_use_events,
    chat_logprobs,
    chat_message_tool_calls,
    chat_tool_call_deltas,
    completion_logprobs,
    responses_function_calls,
)

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}


def test_response_formats_map_to_engine_constraints():
    assert structured_from_response_format(None) is None
    assert structured_from_response_format({"type": "text"}) is None
    assert structured_from_response_format({"type": "json_object"}) == {"type": "json_object"}
    got = structured_from_response_format({"type": "json_schema", "json_schema": {
        "name": "Weather", "schema": SCHEMA, "strict": True}})
    assert got == {"type": "json_schema", "schema": SCHEMA, "strict": True}
    assert parse_structured(got).strict  # what the engine will read
    for bad in ({"type": "xml"}, {"type": "json_schema"}, "json",
                {"type": "json_schema", "json_schema": {"schema": 3}}):
        with pytest.raises(FieldError) as e:
            structured_from_response_format(bad)
        assert e.value.param == "response_format"


def test_other_servers_constraint_fields_map_too():
    assert structured_from_extensions({}) is None
    assert structured_from_extensions({"guided_json": json.dumps(SCHEMA)}) == (
        "guided_json", {"type": "json_schema", "schema": SCHEMA})
    assert structured_from_extensions({"json_schema": SCHEMA})[1]["schema"] == SCHEMA  # llama.cpp's name
    assert structured_from_extensions({"grammar": 'root ::= "yes" | "no"'}) == (
        "grammar", {"type": "grammar", "grammar": 'root ::= "yes" | "no"'})
    assert structured_from_extensions({"guided_choice": ["a.b", "c|d"]}) == (
        "guided_choice", {"type": "regex", "pattern": r"a\.b|c\|d"})
    with pytest.raises(FieldError, match="one output constraint"):
        structured_from_extensions({"guided_regex": "a", "grammar": "b"})
    with pytest.raises(FieldError) as e:
        structured_from_extensions({"guided_choice": []})
    assert e.value.param == "guided_choice"


def test_tool_fields_are_checked_with_the_engines_rules():
    assert tool_fields(None) == {} and tool_fields([], "none") == {}
    fields = tool_fields([TOOL], "required", False)
    assert fields == {"tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False}
    assert parse_tools(fields["tools"], fields["tool_choice"], fields["parallel_tool_calls"]).choice == "required"
    with pytest.raises(FieldError) as e:
        tool_fields([TOOL], {"type": "function", "function": {"name": "nope"}})
    assert e.value.param == "tool_choice" and "not among the tools" in e.value.message
    with pytest.raises(FieldError) as e:
        tool_fields([TOOL, TOOL])
    assert e.value.param == "tools"


def test_legacy_responses_and_anthropic_tools_become_chat_tools():
    tools, choice = tools_from_functions([TOOL["function"]], {"name": "get_weather"})
    assert tools == [TOOL] and choice == {"type": "function", "function": {"name": "get_weather"}}
    tools, choice = tools_from_responses([{"type": "function", "name": "get_weather", "parameters": SCHEMA,
                                           "strict": True}], {"type": "function", "name": "get_weather"})
    assert tools[0]["function"] == {"name": "get_weather", "parameters": SCHEMA, "strict": True}
    assert choice == {"type": "function", "function": {"name": "get_weather"}}
    with pytest.raises(FieldError):
        tools_from_responses([{"type": "web_search"}])
    anthropic_tool = {"name": "get_weather", "description": "d", "input_schema": SCHEMA}
    tools, choice, parallel = tools_from_anthropic([anthropic_tool], {"type": "any", "disable_parallel_tool_use": True})
    assert tools == [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA,
                                                       "description": "d"}}]
    assert choice == "required" and parallel is False
    assert tools_from_anthropic(tools=None, tool_choice={"type": "tool", "name": "x"})[1] == {
        "type": "function", "function": {"name": "x"}}


def test_logprobs_logit_bias_and_choices():
    assert chat_logprob_params(None, None) == {} and chat_logprob_params(True, None) == {"logprobs": 0}
    assert chat_logprob_params(True, 20) == {"logprobs": 20}
    for args, param in (((False, 3), "top_logprobs"), ((True, 21), "top_logprobs"), (("yes", None), "logprobs")):
        with pytest.raises(FieldError) as e:
            chat_logprob_params(*args)
        assert e.value.param == param
    assert completion_logprob_params(5) == {"logprobs": 5} and completion_logprob_params(None) == {}
    assert logit_bias_param({"50256": -100}) == {"logit_bias": {"50256": -100.0}}
    assert SamplingParams.from_dict(logit_bias_param({"7": 3})).logit_bias == {7: 3.0}
    with pytest.raises(FieldError) as e:
        logit_bias_param({"x": 1})
    assert e.value.param == "logit_bias"
    assert choice_count(None) == 1 and choice_count(8) == 8
    for n in (0, 9, 2.0, True):
        with pytest.raises(FieldError):
            choice_count(n)
    seeds = [choice_params({"seed": 7, "temperature": 1}, i)["seed"] for i in range(4)]
    assert seeds[0] == 7 and len(set(seeds)) == 4
    assert seeds == [SamplingParams(seed=7).for_choice(i).seed for i in range(4)]  # the engine's own rule
    assert "seed" not in choice_params({"temperature": 1}, 3)


def test_a_trailing_assistant_message_is_continued_unless_told_otherwise():
    prefill = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I am"}]
    assert continue_final_message(prefill, {}) is True
    assert continue_final_message(prefill, {"continue_final_message": False}) is False
    assert continue_final_message(prefill[:1], {}) is False
    assert continue_final_message(prefill, {"add_generation_prompt": False}) is True
    with pytest.raises(FieldError):
        continue_final_message(prefill[:1], {"continue_final_message": True})


def test_completion_prompts_take_text_ids_and_lists_of_them():
    assert completion_prompts("Once") == [{"prompt": "Once"}]
    assert completion_prompts([1, 2, 3]) == [{"prompt_token_ids": [1, 2, 3]}]
    assert completion_prompts(["a", [4, 5]]) == [{"prompt": "a"}, {"prompt_token_ids": [4, 5]}]
    bad: object
    for bad in ("", [], [[]], [1, "a"], None, [-1]):
        with pytest.raises(FieldError):
            completion_prompts(bad)


def test_responses_and_anthropic_histories_become_chat_messages():
    msgs = messages_from_responses("Be brief.", [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "3C"}])
    assert msgs == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
                    {"role": "assistant", "content": None, "tool_calls": [{
                        "id": "call_1", "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "3C"}]
    msgs = messages_from_anthropic("Be brief.", [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "3C"},
                                     {"type": "text", "text": "And tomorrow?"}]}])
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "user"]
    assert msgs[2]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert msgs[3] == {"role": "tool", "tool_call_id": "toolu_1", "content": "3C"}
    with pytest.raises(FieldError):
        messages_from_anthropic(None, [{"role": "user", "content": [{"type": "image"}]}])


# ---- replies ---------------------------------------------------------------------------------

CALLS = [{"index": 0, "id": "call_abc", "name": "get_weather", "arguments": '{"city": "Oslo"}'}]


def test_engine_call_deltas_become_openai_chunk_deltas():
    deltas = [{"index": 0, "id": "call_abc", "name": "get_weather", "arguments": ""},
              {"index": 0, "arguments": '{"city": '}, {"index": 0, "arguments": '"Oslo"}'},
              {"index": 1, "id": "call_def", "name": "add", "arguments": ""}, {"index": 1, "arguments": "{}"}]
    got = chat_tool_call_deltas(deltas)
    assert got == [{"index": 0, "id": "call_abc", "type": "function", "function": {"name": "get_weather",
                                                                                  "arguments": ""}},
                   {"index": 0, "function": {"arguments": '{"city": "Oslo"}'}},
                   {"index": 1, "id": "call_def", "type": "function", "function": {"name": "add", "arguments": ""}},
                   {"index": 1, "function": {"arguments": "{}"}}]
    later = chat_tool_call_deltas([{"index": 0, "arguments": "{"}, {"index": 0, "arguments": "}"}])
    assert later == [{"index": 0, "function": {"arguments": "{}"}}]
    assert chat_message_tool_calls(CALLS) == [{"id": "call_abc", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]


def test_calls_become_responses_items_and_anthropic_blocks():
    assert responses_function_calls(CALLS)[0] == {"type": "function_call", "id": "fc_abc", "call_id": "call_abc",
                                                  "name": "get_weather", "arguments": '{"city": "Oslo"}',
                                                  "status": "completed"}
    assert anthropic_tool_use_blocks(CALLS + [{"index": 1, "id": "call_x", "name": "f", "arguments": '{"a'}]) == [
        {"type": "tool_use", "id": "toolu_abc", "name": "get_weather", "input": {"city": "Oslo"}},
        {"type": "tool_use", "id": "toolu_x", "name": "f", "input": {}}]
    start = anthropic_tool_use_events({"index": 0, "id": "call_abc", "name": "get_weather", "arguments": ""}, 1)
    assert start[0]["content_block"]["type"] == "tool_use" and start[0]["index"] == 1
    assert anthropic_tool_use_events({"index": 0, "arguments": '{"a"'}, 1)[0]["delta"] == {
        "type": "input_json_delta", "partial_json": '{"a"'}
    assert anthropic_stop_reason("tool_calls") == "tool_use" and anthropic_stop_reason("length") == "max_tokens"
    assert anthropic_stop_reason("stop", "END") == "stop_sequence" and anthropic_stop_reason("stop", 2) == "end_turn"


def test_logprob_entries_become_chat_and_completions_logprobs():
    entries = [{"token_id": 9, "token": "Hi", "bytes": [72, 105], "logprob": -0.1,
                "top": [{"token_id": 9, "token": "Hi", "bytes": [72, 105], "logprob": -0.1},
                        {"token_id": 4, "token": "Yo", "bytes": [89, 111], "logprob": -2.5}]},
               {"token_id": 5, "token": " é", "bytes": [32, 195, 169], "logprob": -0.7, "top": []}]
    chat = chat_logprobs(entries)
    assert chat["content"][0] == {"token": "Hi", "logprob": -0.1, "bytes": [72, 105], "top_logprobs": [
        {"token": "Hi", "logprob": -0.1, "bytes": [72, 105]}, {"token": "Yo", "logprob": -2.5, "bytes": [89, 111]}]}
    legacy = completion_logprobs(entries, text_offset=10)
    assert legacy == {"tokens": ["Hi", " é"], "token_logprobs": [-0.1, -0.7],
                      "top_logprobs": [{"Hi": -0.1, "Yo": -2.5}, {}], "text_offset": [10, 12]}
    echo = completion_logprobs([{"token_id": 1, "token": "A", "bytes": [65], "logprob": None, "top": []}] + entries)
    assert echo["token_logprobs"][:2] == [None, -0.1] and echo["top_logprobs"][0] is None
    assert echo["text_offset"] == [0, 1, 3]
