"""Tool calls in the engine, on the tiny random Llama with SmolLM2's tokenizer (whose
template has no tool support, so the generic format applies): each ``tool_choice``
behaves as OpenAI documents it, calls always parse and match their schema, the streamed
deltas make up the final calls, tools and past calls reach the prompt, and the wire
carries it all. ``auto``'s lazy grammar is checked on the grammar itself."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import numpy as np
import pytest
from transformers import AutoTokenizer
from websockets.asyncio.client import connect

from engine.outputs import GenerateRequest
from engine.sampling_params import SamplingParams
from engine.structured.compiler import GrammarCompiler
from engine.structured.vocab import Vocabulary
from engine.tools.formats import GENERIC, HERMES
from engine.tools.grammar import tool_grammar
from engine.tools.spec import parse_tools
from tests.engine_helpers import collect, make_engine, run_core

# bounded arguments, so that even a random model's calls end within a few dozen tokens
UNIT = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {
        "city": {"enum": ["Paris", "Oslo", "Lima"]}, "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "unit", "days"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 99}, "y": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["x", "y"], "additionalProperties": False}}}
SCHEMAS = {"get_weather": UNIT["function"]["parameters"], "add": ADD["function"]["parameters"]}
CHAT = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return make_engine(tiny_model_dir)


def _run(engine, rid: str, tools=None, choice=None, parallel=None, messages=CHAT, **params):
    req = engine.core.add_request(rid, engine.prompts.build(GenerateRequest(
        rid, messages=messages, tools=parse_tools(tools, choice, parallel)))[0],
        SamplingParams(**{"max_tokens": 120, "temperature": 0.0, **params}), tools=parse_tools(tools, choice, parallel))
    deltas = []
    while engine.core.has_work():
        for out in engine.core.step():
            if out.request_id == rid:
                deltas.append(out)
    assert deltas[-1].finished
    return req, deltas


def _check_calls(final, deltas):
    """Every call parses and matches its tool's schema, and the streamed deltas make it up."""
    calls = final.output_tool_calls
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        assert call.id.startswith("call_")
        pieces = [d for out in deltas for d in (out.tool_calls or []) if d.index == call.index]
        assert pieces[0].id == call.id and pieces[0].name == call.name and pieces[0].arguments == ""
        assert all(p.id is None and p.name is None for p in pieces[1:])
        assert "".join(p.arguments for p in pieces) == call.arguments
    assert len({c.id for c in calls}) == len(calls)
    assert "".join(out.text for out in deltas) == final.output_text  # content only, calls apart
    assert "<tool_call>" not in final.output_text
    return calls


def test_required_makes_one_or_more_valid_calls_and_no_text(engine):
    _, deltas = _run(engine, "req", [UNIT, ADD], "required", temperature=0.9, seed=7)
    final = deltas[-1]
    calls = _check_calls(final, deltas)
    assert final.finish_reason == "tool_calls" and calls and final.output_text == ""


def test_a_named_function_is_called_exactly_once(engine):
    for seed in range(3):
        _, deltas = _run(engine, f"named{seed}", [UNIT, ADD], {"type": "function", "function": {"name": "add"}},
                         temperature=1.0, seed=seed)
        calls = _check_calls(deltas[-1], deltas)
        assert [c.name for c in calls] == ["add"] and deltas[-1].finish_reason == "tool_calls"


def test_parallel_calls_off_allows_a_single_call(engine):
    for seed in range(3):
        _, deltas = _run(engine, f"single{seed}", [UNIT, ADD], "required", False, temperature=1.0, seed=seed)
        assert len(_check_calls(deltas[-1], deltas)) == 1


def test_none_writes_text_and_leaves_the_tools_out_of_the_prompt(engine):
    req, deltas = _run(engine, "none", [UNIT, ADD], "none", max_tokens=12, ignore_eos=True)
    assert req.constraint is None and req.tool_stream is None
    assert deltas[-1].output_tool_calls is None and deltas[-1].finish_reason == "length"
    prompt = engine.prompts.tokenizer.decode(req.prompt_ids)
    assert "get_weather" not in prompt
    req2, _ = _run(engine, "auto-prompt", [UNIT, ADD], "auto", max_tokens=1)
    assert "get_weather" in engine.prompts.tokenizer.decode(req2.prompt_ids)  # auto shows the tools


def test_streamed_calls_equal_the_final_calls_across_the_async_engine(engine, tiny_model_dir, start_engine):
    eng = start_engine(tiny_model_dir)
    tools = parse_tools([UNIT, ADD], "required")

    async def go():
        return await collect(eng, GenerateRequest("s", messages=CHAT, tools=tools,
                                                  params=SamplingParams(max_tokens=120, temperature=0.7, seed=3)))
    got = asyncio.run(go())
    calls = _check_calls(got.final, got.deltas)
    # the same seeded request run synchronously gives the same calls (ids aside)
    _, deltas = _run(engine, "sync", [UNIT, ADD], "required", temperature=0.7, seed=3)
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in deltas[-1].output_tool_calls]


def test_history_with_calls_and_results_renders_in_the_generic_format(engine):
    history = CHAT + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"x": 2, "y": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    ids, _ = engine.prompts.build(GenerateRequest("h", messages=history, tools=parse_tools([ADD])))
    text = engine.prompts.tokenizer.decode(ids)
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"x": 2, "y": 3}}\n</tool_call>'
            '<|im_end|>') in text
    assert "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n") and "<tools>" in text


def test_a_hermes_template_gets_the_tools_and_calls_itself(smollm2_dir, tmp_path):
    """A chat template with tool support (our own small Hermes-style template): the tools
    and past calls go through the template's own ``tools`` and ``tool_calls``."""
    from engine.prompt import PromptBuilder

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    tok.chat_template = (
        "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n"
        "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
        "{% for c in m.tool_calls or [] %}<tool_call>\n{{ {'name': c.function.name, 'arguments': c.function.arguments}"
        " | tojson }}\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    builder = PromptBuilder(tok, 49152)
    assert builder.tool_format is HERMES
    history = CHAT + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": '{"x": 2, "y": 3}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "5"}]
    text = tok.decode(builder.build(GenerateRequest("n", messages=history, tools=parse_tools([UNIT, ADD])))[0])
    assert text.startswith("<|im_start|>system\nTOOLS: get_weather add<|im_end|>")
    assert '<tool_call>\n{"name": "add", "arguments": {"x": 2, "y": 3}}\n</tool_call>' in text
    assert "<|im_start|>tool\n5<|im_end|>" in text


def test_auto_lets_text_through_until_the_marker_then_holds_the_call_to_its_schema(smollm2_dir):
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    compiler = GrammarCompiler(Vocabulary(tok, 49152, [2]))
    from llguidance import LLMatcher

    def constraint(choice="auto"):
        return compiler.compile(grammar=LLMatcher.grammar_from_lark(tool_grammar(parse_tools([UNIT, ADD], choice),
                                                                                  GENERIC)))

    def allowed(c) -> int:
        return int(np.unpackbits(np.frombuffer(c.matcher.compute_bitmask(), dtype=np.uint8)).sum())

    c = constraint()
    assert allowed(c) > 40_000  # free text: nearly every token
    for t in tok.encode("Sure, let me check the weather.", add_special_tokens=False):
        assert c.accept(t)
    assert c.matcher.is_accepting()  # a text reply may end here
    for t in tok.encode("<tool_call>", add_special_tokens=False):
        assert c.accept(t)
    assert not c.matcher.is_accepting()
    forced = tok.decode(c.forced())
    assert forced == '\n{"name": "'  # after the marker only a call may follow
    for t in c.forced():
        c.accept(t)
    rest = 'get_weather", "arguments": {"city": "Oslo", "unit": "celsius", "days": 3}}\n</tool_call>'
    for t in tok.encode(rest, add_special_tokens=False):
        assert c.accept(t), tok.decode([t])
    assert c.matcher.is_accepting()
    bad = constraint()
    rome = 'ok<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"'
    for t in tok.encode(rome, add_special_tokens=False):
        if not bad.accept(t):
            break
    else:
        pytest.fail("a city outside the schema's enum was accepted")
    req = constraint("required")
    assert tok.decode(req.forced()) == '<tool_call>\n{"name": "'  # no text before the call


async def test_the_wire_carries_calls_and_named_logprobs(server):
    url, _ = server
    async with connect(url) as ws:
        json.loads(await ws.recv())  # hello
        await ws.send(json.dumps({"type": "generate", "request_id": "w", "messages": CHAT, "tools": [UNIT, ADD],
                                  "tool_choice": "required", "parallel_tool_calls": False,
                                  "params": {"max_tokens": 120, "temperature": 0.0, "logprobs": 2}}))
        items: list[dict] = []
        while not items or items[-1]["type"] != "done":
            frame = json.loads(await asyncio.wait_for(ws.recv(), 60))
            assert frame["type"] == "step", frame
            items += frame["items"]
    done = items[-1]
    assert done["finish_reason"] == "tool_calls" and len(done["output_tool_calls"]) == 1
    call = done["output_tool_calls"][0]
    jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    deltas = [d for i in items for d in i.get("tool_calls", [])]
    assert deltas[0] == {"index": 0, "id": call["id"], "name": call["name"], "arguments": ""}
    assert "".join(d["arguments"] for d in deltas) == call["arguments"]
    # every sampled token has its logprob, named: the tokens' bytes spell the reply
    lps = [lp for i in items for lp in i.get("logprobs", [])]
    assert [lp["token_id"] for lp in lps] == done["output_token_ids"]
    raw = b"".join(bytes(lp["bytes"]) for lp in lps[:-1])  # the last is the end-of-turn token
    assert raw.decode() == '<tool_call>\n{"name": "' + call["name"] + '", "arguments": ' + call["arguments"] + \
        "}\n</tool_call>"
    assert lps[-1]["token"] == "<|im_end|>"
    assert all(len(lp["top"]) == 2 and lp["top"][0]["logprob"] >= lp["top"][1]["logprob"] for lp in lps)


def test_a_request_without_tools_has_no_calls_and_its_text_whole(engine):
    engine.core.add_request("plain", engine.prompts.render_ids(CHAT), SamplingParams(max_tokens=3, temperature=0))
    assert run_core(engine.core)["plain"].output_tool_calls is None
