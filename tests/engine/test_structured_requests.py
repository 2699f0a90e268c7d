"""The torch-free halves of structured outputs and tools (no model): the checks of
``structured``, ``logit_bias``, choice seeds, tools and tool choice; the tool formats read
from chat templates; tools and past calls turned into template messages; and the split
of a streamed reply into content and tool-call deltas."""

from __future__ import annotations

import json

import pytest

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams, choice_seed
from engine.structured.spec import parse_structured
from engine.tools.formats import GENERIC, HERMES, LLAMA3_JSON, template_messages, tool_format_for
from engine.tools.spec import parse_tools
from engine.tools.stream import ToolCallStream

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
    "x": {"type": "number"}, "y": {"type": "number"}}}}}


# ---- structured ----------------------------------------------------------------------------

def test_structured_kinds_parse_and_malformed_ones_name_the_field():
    assert parse_structured(None) is None
    assert parse_structured({"type": "json_object"}).schema == {"type": "object"}
    s = parse_structured({"type": "json_schema", "schema": {"type": "integer"}, "strict": True, "name": "n"})
    assert s.is_json and s.strict and s.schema == {"type": "integer"}
    assert parse_structured({"type": "regex", "pattern": "[a-z]+"}).pattern == "[a-z]+"
    assert parse_structured({"type": "grammar", "grammar": 'start: "x"'}).grammar == 'start: "x"'
    for bad, words in [("json", "must be an object"), ({"type": "xml"}, "structured.type"),
                       ({"type": "json_schema"}, "structured.schema"),
                       ({"type": "json_schema", "schema": {}, "strict": "yes"}, "strict"),
                       ({"type": "regex", "pattern": ""}, "pattern"),
                       ({"type": "json_object", "schema": {}}, "unknown key"),
                       ({"type": "regex", "pattern": "\ud800"}, "not valid Unicode")]:
        with pytest.raises(InvalidRequestError, match=words):
            parse_structured(bad)


def test_the_constraint_key_names_the_constraint_exactly():
    a = parse_structured({"type": "json_schema", "schema": {"a": 1, "b": 2}})
    b = parse_structured({"type": "json_schema", "schema": {"b": 2, "a": 1}})
    c = parse_structured({"type": "json_schema", "schema": {"a": 1, "b": 2}, "strict": True})
    assert a.key() == b.key() != c.key()


def test_sampling_params_check_structured_and_logit_bias():
    p = SamplingParams.from_dict({"logit_bias": {"12": 5, "7": -100}, "structured": {"type": "json_object"}})
    assert p.logit_bias == {12: 5.0, 7: -100.0} and p.structured_output.kind == "json_object"
    for bad, words in [({"logit_bias": {"x": 1}}, "token ids"), ({"logit_bias": {"1": 101}}, r"\[-100, 100\]"),
                       ({"logit_bias": {"-1": 1}}, "token ids"), ({"logit_bias": [1]}, "object"),
                       ({"logit_bias": {"1": True}}, r"\[-100, 100\]"),
                       ({"logit_bias": {str(i): 1 for i in range(1025)}}, "at most"),
                       ({"structured": {"type": "nope"}}, "structured.type")]:
        with pytest.raises(InvalidRequestError, match=words):
            SamplingParams.from_dict(bad)


def test_choices_get_their_own_seed_streams_and_choice_zero_is_the_plain_request():
    p = SamplingParams(seed=42, temperature=0.9)
    seeds = [p.for_choice(i).seed for i in range(8)]
    assert seeds[0] == 42 and len(set(seeds)) == 8 and seeds[1] == choice_seed(42, 1)
    assert SamplingParams().for_choice(3).seed is None  # unseeded choices share the engine's generator
    with pytest.raises(InvalidRequestError):
        p.for_choice(8)


# ---- tools ------------------------------------------------------------------------------------

def test_tools_and_tool_choice_parse_with_openai_defaults():
    t = parse_tools([WEATHER, ADD])
    assert t.choice == "auto" and t.parallel and [x.name for x in t.tools] == ["get_weather", "add"]
    assert t.tools[1].parameters == {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}}}
    named = parse_tools([WEATHER, ADD], {"type": "function", "function": {"name": "add"}}, False)
    assert named.choice == "function" and [x.name for x in named.callable_tools()] == ["add"] and not named.parallel
    assert parse_tools(None, "none") is None and parse_tools([], None) is None
    assert not parse_tools([WEATHER], "none").active


@pytest.mark.parametrize("tools,choice,words", [
    ([WEATHER, WEATHER], None, "distinct"),
    ([{"type": "function", "function": {"name": "bad name"}}], None, "letters, digits"),
    ([{"type": "code_interpreter"}], None, "must be"),
    ([WEATHER], "sometimes", "tool_choice must be"),
    ([WEATHER], {"type": "function", "function": {"name": "add"}}, "not among the tools"),
    (None, "required", "needs tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], None, "JSON Schema object"),
])
def test_bad_tools_are_refused_naming_the_problem(tools, choice, words):
    with pytest.raises(InvalidRequestError, match=words):
        parse_tools(tools, choice)


def test_the_tool_format_is_read_from_the_chat_template():
    assert tool_format_for(None) is GENERIC
    assert tool_format_for("{{ messages }}") is GENERIC  # SmolLM2's kind: no tools in the template
    assert tool_format_for("{% if tools %}<tool_call>{% endif %}") is HERMES
    assert tool_format_for("{% if tools %}<|python_tag|>{% endif %}") is LLAMA3_JSON


def test_generic_format_writes_tools_calls_and_results_as_plain_turns():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "",
             "tool_calls": [{"id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'}]},
            {"role": "tool", "content": "18C", "tool_call_id": "c1"},
            {"role": "tool", "content": "sunny", "tool_call_id": "c2"}]
    out, tools = template_messages(msgs, GENERIC, parse_tools([WEATHER]))
    assert tools is None and [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n") and '"name": "get_weather"' in out[0]["content"]
    assert out[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert out[3]["content"] == "<tool_response>\n18C\n</tool_response>\n<tool_response>\nsunny\n</tool_response>"
    none, _ = template_messages(msgs[:2], GENERIC, parse_tools([WEATHER], "none"))
    assert none == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]


def test_native_formats_hand_the_template_tools_and_calls_in_its_own_shape():
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "name": "add", "arguments": '{"x": 1}'}]},
            {"role": "tool", "content": "1", "tool_call_id": "c1"}]
    out, tools = template_messages(msgs, HERMES, parse_tools([ADD]))
    assert tools == [ADD]
    assert out[1]["tool_calls"] == [{"id": "c1", "type": "function",
                                     "function": {"name": "add", "arguments": {"x": 1}}}]
    assert out[2] == {"role": "tool", "content": "1", "tool_call_id": "c1"}


# ---- the streamed split of a reply -----------------------------------------------------------

REPLY = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "New {York}"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "add", "arguments": {"x": 1, "y": [2, "]"]}}\n</tool_call>')


def _stream(fmt, text: str, step: int, cut: bool = False):
    ids = iter(f"id{i}" for i in range(10))
    s = ToolCallStream(fmt, make_id=lambda: next(ids))
    content, deltas = "", []
    for i in range(0, len(text), step):
        c, d = s.feed(text[i:i + step])
        content += c
        deltas += d
    c, d = s.finish(cut=cut)
    return s, content + c, deltas + d


@pytest.mark.parametrize("step", [1, 2, 7, 1000])
def test_calls_stream_as_openai_deltas_whatever_the_pieces(step):
    s, content, deltas = _stream(GENERIC, REPLY, step)
    assert content == s.content == "Let me check."
    assert [(c.index, c.id, c.name, c.arguments, c.complete) for c in s.calls] == [
        (0, "id0", "get_weather", '{"city": "New {York}"}', True), (1, "id1", "add", '{"x": 1, "y": [2, "]"]}', True)]
    firsts = [d for d in deltas if d.id is not None]
    assert [(d.index, d.name, d.arguments) for d in firsts] == [(0, "get_weather", ""), (1, "add", "")]
    for call in s.calls:  # the fragments, in order, are the arguments
        assert "".join(d.arguments for d in deltas if d.index == call.index) == call.arguments
        json.loads(call.arguments)
    # a delta never mixes calls, and a call's id and name come before its arguments
    assert deltas.index(firsts[1]) > max(i for i, d in enumerate(deltas) if d.index == 0)


def test_text_that_only_looks_like_a_marker_is_content_and_a_cut_call_keeps_what_it_had():
    s, content, deltas = _stream(GENERIC, "a <tool_ is not <b>it</b>", 3)
    assert content == "a <tool_ is not <b>it</b>" and not deltas
    s, content, deltas = _stream(GENERIC, 'x<tool_call>\n{"name": "add", "arguments": {"x": 1', 4)
    assert content == "x" and s.calls[0].arguments == '{"x": 1' and not s.calls[0].complete


@pytest.mark.parametrize("tail", ['<tool_call>\n{"name": "add", "argu', "<tool_call>", "<tool_"])
def test_a_reply_cut_inside_a_calls_opening_shows_no_call_markup(tail):
    # after a whole call, max_tokens cuts the next one's opening: no markup in the content
    text = 'x<tool_call>\n{"name": "add", "arguments": {"x": 1}}\n</tool_call>\n' + tail
    s, content, deltas = _stream(GENERIC, text, 3, cut=True)
    assert content == "x" and [c.arguments for c in s.calls] == ['{"x": 1}'] and s.calls[0].complete
    assert "".join(d.arguments for d in deltas) == '{"x": 1}'


def test_a_cut_calls_opening_is_dropped_but_a_reply_that_ended_there_keeps_it():
    opening = 'x<tool_call>\n{"name": "add", "argu'
    s, content, deltas = _stream(GENERIC, opening, 3, cut=True)
    assert content == "x" and not s.calls and not deltas
    # the model itself ended the reply there: a marker that led to no call is content
    s, content, _ = _stream(GENERIC, opening, 3)
    assert content == opening and not s.calls


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>\n'


@pytest.mark.parametrize("step", [1, 3, 1000])
@pytest.mark.parametrize("again", [
    CALL, CALL.replace('"city": "Oslo", "days": 2', '"days": 2, "city": "Oslo"'),  # key order is no difference
    CALL.replace('"city": "Oslo", "days": 2', '"city":"Oslo","days":2')])  # nor is whitespace
def test_a_repeated_call_is_dropped_and_ends_the_calls_unseen(step, again):
    s, content, deltas = _stream(GENERIC, CALL + again + CALL + "more text", step)
    assert s.repeated and content == "" and s.content == ""
    assert [(c.index, c.name, c.arguments, c.complete) for c in s.calls] == [
        (0, "get_weather", '{"city": "Oslo", "days": 2}', True)]
    assert {d.index for d in deltas} == {0} and [d.id for d in deltas if d.id] == ["id0"]
    assert "".join(d.arguments for d in deltas) == '{"city": "Oslo", "days": 2}'


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_a_new_call_of_the_same_function_is_held_until_it_differs_then_streams_whole(step):
    other = CALL.replace("Oslo", "Lima")
    s, content, deltas = _stream(GENERIC, CALL + other, step)
    assert not s.repeated and [c.arguments for c in s.calls] == ['{"city": "Oslo", "days": 2}',
                                                                 '{"city": "Lima", "days": 2}']
    assert [(d.index, d.id, d.name) for d in deltas if d.id] == [(0, "id0", "get_weather"), (1, "id1", "get_weather")]
    assert "".join(d.arguments for d in deltas if d.index == 1) == '{"city": "Lima", "days": 2}'
    # fed piece by piece, nothing of the second call shows before its arguments end
    s = ToolCallStream(GENERIC, make_id=iter(["a", "b"]).__next__)
    s.feed(CALL)
    assert s.feed(other[:-len('2}}\n</tool_call>\n')]) == ("", [])
    _, released = s.feed(other[-len('2}}\n</tool_call>\n'):])
    assert (released[0].id, released[0].name, released[0].arguments) == ("b", "get_weather", "")
    assert "".join(d.arguments for d in released) == '{"city": "Lima", "days": 2}'  # in order


def test_a_held_call_cut_by_max_tokens_still_comes_out_with_what_it_had():
    s, content, deltas = _stream(GENERIC, CALL + CALL[:CALL.index('"days"')], 5, cut=True)
    assert not s.repeated and len(s.calls) == 2 and not s.calls[1].complete
    assert "".join(d.arguments for d in deltas if d.index == 1) == s.calls[1].arguments == '{"city": "Oslo", '


def test_a_repeated_llama3_json_call_ends_the_calls_too():
    one = '{"name": "add", "parameters": {"x": 1}}'
    s, content, _ = _stream(LLAMA3_JSON, f"{one}; {one}; {one}", 4)
    assert s.repeated and content == "" and [c.arguments for c in s.calls] == ['{"x": 1}']


def test_llama3_json_calls_open_the_reply_and_text_replies_stay_text():
    two = '{"name": "add", "parameters": {"x": 1}}; {"name": "add", "parameters": {}}'
    s, content, _ = _stream(LLAMA3_JSON, two, 5)
    assert content == "" and [c.arguments for c in s.calls] == ['{"x": 1}', "{}"]
    s, content, _ = _stream(LLAMA3_JSON, 'Hello {"name": "add"}', 3)
    assert content == 'Hello {"name": "add"}' and not s.calls
