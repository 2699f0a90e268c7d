"""Chat completions beyond text, end to end with the official ``openai`` SDK against a
real gateway and engine: response formats (``parse`` with Pydantic models), tools and
each ``tool_choice``, streamed tool calls, logprobs, ``n`` choices, logit bias,
``max_completion_tokens`` and continuing a final assistant message. The tiny random
model where only the shape matters (its text is noise, but grammars still hold it);
SmolLM2 where the content does."""

from __future__ import annotations

import json
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.gateway_helpers import openai_client as client

QUESTION = [{"role": "user", "content": "What is the weather in Paris for the next two days?"}]
PARAMS = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                           "days": {"enum": [1, 2, 3]}},
          "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast for a city",
                                           "parameters": PARAMS}},
         {"type": "function", "function": {"name": "get_time", "description": "The local time in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"enum": ["Paris", "Oslo", "Lima"]}},
                                               "required": ["city"], "additionalProperties": False}}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def create(oa: openai.OpenAI, **kw: Any) -> Any:
    kw.setdefault("messages", QUESTION)
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 48)
    return oa.chat.completions.create(model="default", **kw)


def assert_valid_calls(calls: list[Any]) -> None:
    assert calls
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_")
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def streamed(oa: openai.OpenAI, **kw: Any) -> tuple[str, list[dict[str, Any]], str | None, list[Any]]:
    """(content, calls rebuilt from their deltas, finish_reason, chunks) of a streamed reply."""
    chunks = list(create(oa, stream=True, **kw))
    content, calls, finish = "", {}, None
    for ch in chunks:
        for c in ch.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                if tc.id is not None:
                    assert tc.index not in calls and tc.function.name  # id and name come first, once
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments or ""}
                else:
                    calls[tc.index]["arguments"] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish, chunks


# ---- tools -----------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_returns_only_calls_that_match_their_schemas(api_gateway, stream):
    oa = client(api_gateway())
    kw = dict(tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=64)
    if stream:
        content, calls, finish, _ = streamed(oa, **kw)
        assert finish == "tool_calls" and content == "" and len(calls) == 1
        for c in calls:
            jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])
    else:
        r = create(oa, **kw)
        m = r.choices[0]
        assert m.finish_reason == "tool_calls" and m.message.content is None
        assert_valid_calls(m.message.tool_calls)


def call_keys(calls: list[Any]) -> list[tuple[str, str]]:
    """Each call as (name, its arguments in one JSON layout): equal keys are the same call."""
    return [(c["name"], json.dumps(json.loads(c["arguments"]), sort_keys=True)) if isinstance(c, dict)
            else (c.function.name, json.dumps(json.loads(c.function.arguments), sort_keys=True)) for c in calls]


def test_parallel_calls_each_match_their_schemas(api_gateway):
    oa = client(api_gateway())
    several = 0
    for seed in range(6):
        r = create(oa, tools=TOOLS, tool_choice="required", max_tokens=150, temperature=1.5, seed=seed)
        calls = r.choices[0].message.tool_calls
        assert len({c.id for c in calls}) == len(calls)
        if r.choices[0].finish_reason == "length":  # the last call may be cut short, as OpenAI's are
            calls = calls[:-1]
        assert_valid_calls(calls)
        assert len(set(call_keys(calls))) == len(calls)  # never the same call twice
        several += len(calls) >= 2
    assert several  # hot enough, the tiny model makes several different calls too


@pytest.mark.parametrize("stream", [False, True])
def test_a_model_that_repeats_its_call_gets_it_once_and_the_reply_ends_there(api_gateway, stream):
    # greedy, the tiny model calls get_weather with the same arguments again after its first call
    oa = client(api_gateway())
    kw = dict(tools=TOOLS, tool_choice="required", max_tokens=200)
    r = create(oa, **kw)
    calls, finish = r.choices[0].message.tool_calls, r.choices[0].finish_reason
    if stream:
        _, calls, finish, chunks = streamed(oa, stream_options={"include_usage": True}, **kw)
        assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert finish == "tool_calls" and len(set(call_keys(calls))) == len(calls) == 1
    assert r.usage.completion_tokens < 200  # the engine stopped at the repeat, not at max_tokens
    single = create(oa, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=200)
    assert call_keys(single.choices[0].message.tool_calls) == call_keys(calls)


def test_a_named_tool_choice_calls_exactly_that_function_once(api_gateway):
    oa = client(api_gateway())
    r = create(oa, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_time"
    assert_valid_calls(calls)
    assert r.choices[0].finish_reason in ("stop", "tool_calls")  # OpenAI answers stop for a forced function


def test_tool_choice_none_answers_text_without_calls(api_gateway):
    oa = client(api_gateway())
    r = create(oa, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
    assert r.choices[0].message.content


def test_parallel_tool_calls_false_allows_one_call_at_most(api_gateway):
    oa = client(api_gateway())
    for seed in range(3):
        r = create(oa, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=seed,
                   max_tokens=64)
        assert len(r.choices[0].message.tool_calls) == 1 and r.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_streamed_and_whole_tool_calls_are_identical(api_gateway, choice):
    oa = client(api_gateway())
    kw = dict(tools=TOOLS, tool_choice=choice, seed=5, temperature=1.0, max_tokens=100)
    whole = create(oa, **kw)
    content, calls, finish, chunks = streamed(oa, **kw)
    msg = whole.choices[0].message
    assert finish == whole.choices[0].finish_reason
    assert content == (msg.content or "")
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in msg.tool_calls or []]
    assert all(c["id"].startswith("call_") for c in calls)


def test_a_history_with_tool_calls_and_results_is_answered(api_gateway):
    oa = client(api_gateway())
    history = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"forecast": ["sun", "rain"]}'}]
    r = create(oa, messages=history, tools=TOOLS, max_tokens=6)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    no_tools = create(oa, messages=history, max_tokens=6)  # the history alone, without tools, is served too
    assert no_tools.usage.prompt_tokens > create(oa, max_tokens=1).usage.prompt_tokens


def test_unusable_tools_and_choices_are_400_naming_the_field(api_gateway):
    oa = client(api_gateway())
    for kw, param in (({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                       "tool_choice"),
                      ({"tool_choice": "required"}, "tool_choice"),
                      ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools")):
        with pytest.raises(openai.BadRequestError) as e:
            create(oa, **kw)
        assert e.value.param == param, e.value.message


# ---- response formats ----------------------------------------------------------------


class Forecast(BaseModel):
    city: Literal["Paris", "Oslo", "Lima"]
    days: int
    sunny: bool


def test_parse_with_a_pydantic_model_gives_that_model(api_gateway, smollm2_engine_url):
    oa = client(api_gateway(engine_urls=[smollm2_engine_url]))
    r = oa.chat.completions.parse(model="default", messages=[
        {"role": "user", "content": "Give the forecast for Paris over 2 days: sunny."}],
        response_format=Forecast, temperature=0, max_tokens=40)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Forecast) and r.choices[0].finish_reason == "stop"
    assert parsed == Forecast.model_validate_json(r.choices[0].message.content)


@pytest.mark.parametrize("stream", [False, True])
def test_json_object_output_parses_even_from_a_random_model(api_gateway, stream):
    oa = client(api_gateway())
    kw = dict(response_format={"type": "json_object"}, temperature=1.0, seed=3, max_tokens=64,
              frequency_penalty=1.0)
    for seed in range(3):
        kw["seed"] = seed
        if stream:
            content, _, finish, _ = streamed(oa, **kw)
        else:
            r = create(oa, **kw)
            content, finish = r.choices[0].message.content, r.choices[0].finish_reason
        if finish == "stop":
            assert isinstance(json.loads(content), dict)
        else:  # cut by max_tokens: still a prefix of JSON (an object opened)
            assert finish == "length" and content.startswith("{")


def test_a_schema_the_library_cannot_compile_is_400_naming_why(api_gateway):
    gw = api_gateway()
    bad_format = {"type": "json_schema", "json_schema": {"name": "s", "strict": True, "schema": {
        "type": "array", "items": {"type": "string"}, "uniqueItems": True}}}
    r = httpx.post(f"{gw.base_url}/v1/chat/completions", timeout=60, json={
        "messages": QUESTION, "response_format": bad_format})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "response_format" and "uniqueItems" in err["message"]


# ---- logprobs, n, logit bias, limits, continuing ------------------------------------------


def test_logprobs_name_the_sampled_tokens_and_their_alternatives(api_gateway):
    oa = client(api_gateway())
    r = create(oa, logprobs=True, top_logprobs=5, max_tokens=10)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    text = bytes(b for e in content for b in e.bytes).decode("utf-8", errors="replace")
    assert text.startswith(r.choices[0].message.content) or r.choices[0].message.content.startswith(text[:1])
    for e in content:
        assert len(e.top_logprobs) == 5 and e.logprob <= 0
        # greedy: the sampled token is the most likely one
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob, abs=1e-5)
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
    _, _, _, chunks = streamed(oa, logprobs=True, top_logprobs=5, max_tokens=10)
    streamed_entries = [e for ch in chunks for c in ch.choices if c.logprobs for e in c.logprobs.content or []]
    assert [(e.token, e.logprob) for e in streamed_entries] == [(e.token, e.logprob) for e in content]


def test_n_choices_are_identical_under_greedy_and_differ_when_sampled(api_gateway):
    oa = client(api_gateway())
    greedy = create(oa, n=3, max_tokens=12)
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert len({c.message.content for c in greedy.choices}) == 1
    assert greedy.usage.completion_tokens % 3 == 0  # every choice's tokens counted
    sampled = create(oa, n=4, max_tokens=12, temperature=1.0, seed=11)
    assert len({c.message.content for c in sampled.choices}) > 1
    again = create(oa, n=4, max_tokens=12, temperature=1.0, seed=11)  # each choice is reproducible
    assert [c.message.content for c in again.choices] == [c.message.content for c in sampled.choices]
    chunks = list(create(oa, n=4, max_tokens=12, temperature=1.0, seed=11, stream=True))
    texts = ["", "", "", ""]
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [c.message.content for c in sampled.choices]


def test_logit_bias_can_force_and_ban_a_token(api_gateway):
    gw = api_gateway()
    oa = client(gw)
    plain = create(oa, logprobs=True, max_tokens=6)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gw.state.router.clients[0].info.tokenizer_dir)
    forced = tokenizer.encode(" lighthouse", add_special_tokens=False)[0]
    r = create(oa, logit_bias={str(forced): 100}, max_tokens=4)
    assert r.choices[0].message.content == tokenizer.decode([forced] * 4)
    first = tokenizer.encode(plain.choices[0].message.content, add_special_tokens=False)[0]
    banned = create(oa, logit_bias={str(first): -100}, max_tokens=6)
    assert tokenizer.encode(banned.choices[0].message.content, add_special_tokens=False)[0] != first


def test_max_completion_tokens_bounds_the_reply(api_gateway):
    oa = client(api_gateway())
    r = oa.chat.completions.create(model="default", messages=QUESTION, temperature=0, max_completion_tokens=3)
    assert r.usage.completion_tokens <= 3
    if r.choices[0].finish_reason == "length":
        assert r.usage.completion_tokens == 3


def test_a_trailing_assistant_message_is_continued(api_gateway, smollm2_engine_url):
    oa = client(api_gateway(engine_urls=[smollm2_engine_url]))
    ask = [{"role": "user", "content": "Name three colours of the rainbow."}]
    first = create(oa, messages=ask, max_tokens=16)
    whole = first.choices[0].message.content
    head = whole[: whole.rindex(" ", 0, len(whole) // 2)]  # at a word's end: the same tokens as in the reply
    go_on = create(oa, messages=ask + [{"role": "assistant", "content": head}], max_tokens=16)
    assert (head + go_on.choices[0].message.content).startswith(whole[: len(whole) * 3 // 4])
    # usage counts the request, as a chat's continued reply does (docs/protocol.md, continue):
    # the continued text is prompt, the completion only what was written now
    assert go_on.usage.prompt_tokens > first.usage.prompt_tokens and go_on.usage.completion_tokens <= 16
    # asked not to continue, the same messages start a new turn
    fresh = create(oa, messages=ask + [{"role": "assistant", "content": head}], max_tokens=4,
                   extra_body={"continue_final_message": False})
    assert fresh.usage.prompt_tokens > go_on.usage.prompt_tokens
