"""API request fields in the engine's terms: structured outputs, tools, logprobs, logit
bias, choices, raw prompts and assistant prefill (docs/protocol.md section 1 names the
engine's side).

Pure functions over decoded JSON, torch-free, with no dependency on other gateway
modules: each returns the engine's ``generate`` frame fields or ``SamplingParams`` keys,
or raises ``FieldError`` naming the request field at fault (a 400 for the API). The
engine checks everything again; these checks only let the API answer before anything
is sent. Covered: OpenAI chat completions (``response_format``, ``tools``,
``tool_choice``, ``parallel_tool_calls``, the legacy ``functions``/``function_call``,
``logprobs``/``top_logprobs``, ``logit_bias``, ``n``, ``continue_final_message``), the
extensions clients of vLLM and llama.cpp send (``guided_json``, ``guided_regex``,
``guided_grammar``, ``guided_choice``, ``json_schema``, ``grammar``), OpenAI completions
(``prompt`` as text, token ids or a list of either; ``logprobs`` as a count), the
Responses API (``text.format``, flat function tools, ``input`` items) and Anthropic
Messages (``tools``, ``tool_choice``, ``tool_use``/``tool_result`` blocks).
"""

from __future__ import annotations

import json
import re
from typing import Any

from engine.errors import InvalidRequestError
from engine.sampling_params import MAX_CHOICES, SamplingParams, choice_seed
from engine.structured.spec import parse_structured
from engine.tools.spec import parse_tools

MAX_TOP_LOGPROBS = 20  # the engine's bound (OpenAI's chat API also allows 20)


class FieldError(ValueError):
    """A request field the engine cannot serve as given.

    Attributes:
        param: the request field at fault (OpenAI's ``param``).
        message: a sentence for people.
    """

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


def _engine_check(param: str, fn: Any, *args: Any) -> Any:
    """Run an engine check, turning its ``InvalidRequestError`` into a ``FieldError``."""
    try:
        return fn(*args)
    except InvalidRequestError as e:
        raise FieldError(param, e.message) from None


# ----- structured outputs ---------------------------------------------------------------

def structured_from_response_format(value: Any, param: str = "response_format") -> dict[str, Any] | None:
    """OpenAI's ``response_format`` as the engine's ``structured`` (None for text).

    ``{"type": "text"}`` -> None; ``{"type": "json_object"}`` (with a ``schema``, as
    llama.cpp's server takes it: that schema); ``{"type": "json_schema",
    "json_schema": {"name", "schema", "strict"?}}`` -> ``{"type": "json_schema", "schema",
    "strict"}`` (a missing schema means any JSON object, as OpenAI's SDKs send it for
    ``dict`` models).

    Raises:
        FieldError: an unknown type or a malformed ``json_schema``.
    """
    if value is None:
        return None
    if not isinstance(value, dict):
        raise FieldError(param, f"{param} must be an object with a 'type'")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        if "schema" in value:  # llama.cpp's form: a JSON object held to a schema
            return structured_from_response_format(
                {"type": "json_schema", "json_schema": {"schema": value["schema"]}}, param)
        return {"type": "json_object"}
    if kind == "json_schema":
        js = value.get("json_schema")
        if not isinstance(js, dict):
            raise FieldError(param, f"{param}.json_schema must be an object with a 'schema'")
        out: dict[str, Any] = {"type": "json_schema", "schema": js.get("schema", {"type": "object"}),
                               "strict": bool(js.get("strict") or False)}
        _engine_check(param, parse_structured, out, param)
        return out
    raise FieldError(param, f"{param}.type must be text, json_object or json_schema, got {ascii(kind)[:40]}")


def structured_from_extensions(body: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """The constraint of the extension fields other servers accept, and the field's name:
    vLLM's ``guided_json`` (a schema), ``guided_regex``, ``guided_grammar`` (Lark or GBNF),
    ``guided_choice`` (one of a list of strings), and llama.cpp's ``json_schema`` and
    ``grammar`` (GBNF). None when the body has none.

    Raises:
        FieldError: two of them at once, or one of the wrong type.
    """
    given = [k for k in ("guided_json", "guided_regex", "guided_grammar", "guided_choice", "json_schema", "grammar")
             if body.get(k) is not None]
    if not given:
        return None
    if len(given) > 1:
        raise FieldError(given[1], f"give one output constraint, not {' and '.join(given)}")
    key = given[0]
    value = body[key]
    out: dict[str, Any]
    if key in ("guided_json", "json_schema"):
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise FieldError(key, f"{key} must be a JSON Schema") from None
        out = {"type": "json_schema", "schema": value}
    elif key == "guided_regex":
        out = {"type": "regex", "pattern": value}
    elif key == "guided_choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise FieldError(key, "guided_choice must be a non-empty list of strings")
        out = {"type": "regex", "pattern": "|".join(_regex_literal(c) for c in value)}
    else:
        out = {"type": "grammar", "grammar": value}
    _engine_check(key, parse_structured, out, key)
    return key, out


def _regex_literal(text: str) -> str:
    """``text`` matched literally by a regex (Rust syntax)."""
    return re.sub(r"([\\.+*?()|\[\]{}^$#&\-~])", r"\\\1", text)


# ----- tools --------------------------------------------------------------------------------

def tool_fields(tools: Any, tool_choice: Any = None, parallel_tool_calls: Any = None) -> dict[str, Any]:
    """The ``generate`` frame's tool fields for OpenAI chat-completions tools (checked
    with the engine's own rules): ``tools``, ``tool_choice``, ``parallel_tool_calls``,
    each only when set; ``{}`` for none.

    Raises:
        FieldError: ``param`` ``tools`` (or ``tool_choice``) with the engine's reason.
    """
    param = "tool_choice" if tool_choice is not None and tools else "tools"
    _engine_check(param, parse_tools, tools, tool_choice, parallel_tool_calls)
    out: dict[str, Any] = {}
    if tools:
        out["tools"] = tools
    if tool_choice is not None and (tools or tool_choice != "none"):
        out["tool_choice"] = tool_choice
    if parallel_tool_calls is not None and tools:
        out["parallel_tool_calls"] = parallel_tool_calls
    return out


def tools_from_functions(functions: Any, function_call: Any = None) -> tuple[list[dict[str, Any]], Any]:
    """OpenAI's deprecated ``functions``/``function_call`` as ``tools``/``tool_choice``.

    Raises:
        FieldError: ``functions`` not a list of objects.
    """
    if not isinstance(functions, list) or not all(isinstance(f, dict) for f in functions):
        raise FieldError("functions", "functions must be a list of function definitions")
    tools = [{"type": "function", "function": f} for f in functions]
    if isinstance(function_call, dict) and "name" in function_call:
        return tools, {"type": "function", "function": {"name": function_call["name"]}}
    return tools, function_call


def tools_from_responses(tools: Any, tool_choice: Any = None) -> tuple[list[dict[str, Any]], Any]:
    """The Responses API's flat function tools (``{"type": "function", "name",
    "parameters", "strict"}``) and its ``tool_choice`` (``{"type": "function", "name"}``)
    in chat-completions form.

    Raises:
        FieldError: a tool of another type (web search, file search, ...).
    """
    if tools is None:
        return [], tool_choice
    if not isinstance(tools, list):
        raise FieldError("tools", "tools must be a list")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            raise FieldError("tools", f"tools[{i}]: only function tools are served here")
        out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters", "strict")
                                                     if k in t}})
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and "name" in tool_choice:
        tool_choice = {"type": "function", "function": {"name": tool_choice["name"]}}
    return out, tool_choice


def tools_from_anthropic(tools: Any, tool_choice: Any = None) -> tuple[list[dict[str, Any]], Any, bool | None]:
    """Anthropic's tools (``{"name", "description", "input_schema"}``) and ``tool_choice``
    (``{"type": "auto"|"any"|"none"|"tool", "name"?, "disable_parallel_tool_use"?}``) as
    chat-completions ``tools``, ``tool_choice`` and ``parallel_tool_calls``.

    Raises:
        FieldError: a malformed tool or choice.
    """
    if tools is None:
        tools = []
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise FieldError("tools", "tools must be a list of tool definitions")
    out = []
    for t in tools:
        if t.get("type") not in (None, "custom"):
            raise FieldError("tools", f"tool type {ascii(t.get('type'))[:40]} is not served here")
        fn = {"name": t.get("name"), "parameters": t.get("input_schema", {"type": "object"})}
        if t.get("description"):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    if tool_choice is None:
        return out, None, None
    if not isinstance(tool_choice, dict):
        raise FieldError("tool_choice", "tool_choice must be an object with a 'type'")
    kind = tool_choice.get("type")
    parallel = False if tool_choice.get("disable_parallel_tool_use") else None
    choice: Any = {"auto": "auto", "any": "required", "none": "none"}.get(str(kind))
    if kind == "tool":
        choice = {"type": "function", "function": {"name": tool_choice.get("name")}}
    elif choice is None:
        raise FieldError("tool_choice", "tool_choice.type must be auto, any, none or tool")
    return out, choice, parallel


# ----- sampling extras ----------------------------------------------------------------

def chat_logprob_params(logprobs: Any, top_logprobs: Any) -> dict[str, Any]:
    """Chat completions' ``logprobs`` (bool) and ``top_logprobs`` (0-20) as the engine's
    ``logprobs`` key (the number of alternatives; absent when off).

    Raises:
        FieldError: a wrong type, a count out of range, or ``top_logprobs`` without ``logprobs``.
    """
    if logprobs not in (None, True, False):
        raise FieldError("logprobs", "logprobs must be a boolean")
    if top_logprobs is not None and (not isinstance(top_logprobs, int) or isinstance(top_logprobs, bool)
                                     or not 0 <= top_logprobs <= MAX_TOP_LOGPROBS):
        raise FieldError("top_logprobs", f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}]")
    if not logprobs:
        if top_logprobs:
            raise FieldError("top_logprobs", "top_logprobs needs logprobs: true")
        return {}
    return {"logprobs": top_logprobs or 0}


def completion_logprob_params(logprobs: Any) -> dict[str, Any]:
    """Completions' ``logprobs`` (the number of alternatives, 0-20; OpenAI allows 5) as the
    engine's key.

    Raises:
        FieldError: not an integer in range.
    """
    if logprobs is None or logprobs is False:
        return {}
    if not isinstance(logprobs, int) or isinstance(logprobs, bool) or not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise FieldError("logprobs", f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}]")
    return {"logprobs": logprobs}


def logit_bias_param(value: Any) -> dict[str, Any]:
    """``logit_bias`` as the engine's key (``{}`` when empty or absent).

    Raises:
        FieldError: with the engine's reason (ids must be integers, biases in [-100, 100]).
    """
    if not value:
        return {}
    params = _engine_check("logit_bias", SamplingParams.from_dict, {"logit_bias": value})
    return {"logit_bias": {str(k): v for k, v in params.logit_bias.items()}}


def choice_count(n: Any) -> int:
    """``n`` checked: 1 to ``MAX_CHOICES`` (8) choices.

    Raises:
        FieldError: out of range or not an integer.
    """
    if n is None:
        return 1
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_CHOICES:
        raise FieldError("n", f"n must be an integer in [1, {MAX_CHOICES}]")
    return n


def choice_params(params: dict[str, Any], index: int) -> dict[str, Any]:
    """The ``params`` of choice ``index`` of an ``n``-choice request: the same, with a
    seeded request's seed replaced by its choice's own (``SamplingParams.for_choice``), so
    the choices sample differently and each is reproducible. Send every choice to the same
    engine, at once: the engine computes their shared prompt once (its prefix cache)."""
    seed = params.get("seed")
    if index == 0 or seed is None or seed == -1:
        return dict(params)
    return {**params, "seed": choice_seed(seed, index)}


def continue_final_message(messages: list[dict[str, Any]], body: dict[str, Any]) -> bool:
    """Whether a reply continues the final message instead of answering it: the body's
    ``continue_final_message`` (vLLM's name), else ``add_generation_prompt: false``, else
    whether the last message is the assistant's (an assistant prefill, as llama.cpp's
    server and Anthropic's API treat it).

    Raises:
        FieldError: ``continue_final_message`` set without a final assistant message.
    """
    last_is_assistant = bool(messages) and messages[-1].get("role") == "assistant"
    flag = body.get("continue_final_message")
    if flag is None and body.get("add_generation_prompt") is False:
        flag = True
    if flag is None:
        return last_is_assistant
    if not isinstance(flag, bool):
        raise FieldError("continue_final_message", "continue_final_message must be a boolean")
    if flag and body.get("add_generation_prompt") is True:
        raise FieldError("continue_final_message", "continue_final_message and add_generation_prompt cannot both "
                                                   "be true")
    if flag and not last_is_assistant:
        raise FieldError("continue_final_message", "continue_final_message needs a final assistant message")
    return flag


def completion_prompts(prompt: Any) -> list[dict[str, Any]]:
    """``/v1/completions``' ``prompt`` as one ``generate`` prompt field per prompt: a
    string is ``{"prompt": text}``, a list of integers ``{"prompt_token_ids": ids}``, and a
    list of either is several prompts (each its own choices, in order).

    Raises:
        FieldError: anything else, or an empty prompt.
    """
    def one(p: Any) -> dict[str, Any]:
        if isinstance(p, str) and p:
            return {"prompt": p}
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p):
            return {"prompt_token_ids": p}
        raise FieldError("prompt", "prompt must be a non-empty string, a list of token ids, or a list of those")

    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return [one(p) for p in prompt]
    return [one(prompt)]


# ----- messages of other APIs --------------------------------------------------------------

def messages_from_responses(instructions: Any, items: Any) -> list[dict[str, Any]]:
    """The Responses API's ``instructions`` and ``input`` (a string, or items: messages
    with text content, ``function_call`` and ``function_call_output``) as chat messages.

    Raises:
        FieldError: an item of another kind, or content that is not text.
    """
    out: list[dict[str, Any]] = []
    if instructions:
        out.append({"role": "system", "content": str(instructions)})
    if isinstance(items, str):
        return out + [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise FieldError("input", "input must be a string or a list of items")
    for i, it in enumerate(items):
        kind = it.get("type", "message") if isinstance(it, dict) else None
        if kind == "message":
            role = "system" if it.get("role") == "developer" else it.get("role")
            out.append({"role": role, "content": _text_of(it.get("content"), f"input[{i}].content",
                                                          ("input_text", "output_text", "text"))})
        elif kind == "function_call":
            call = {"id": it.get("call_id"), "type": "function",
                    "function": {"name": it.get("name"), "arguments": it.get("arguments", "{}")}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": it.get("call_id"),
                        "content": it.get("output") if isinstance(it.get("output"), str) else
                        json.dumps(it.get("output"))})
        else:
            raise FieldError("input", f"input[{i}]: items of type {ascii(kind)[:40]} are not served here")
    return out


def messages_from_anthropic(system: Any, messages: Any) -> list[dict[str, Any]]:
    """Anthropic Messages' ``system`` and ``messages`` as chat messages: text blocks joined,
    an assistant's ``tool_use`` blocks as its ``tool_calls``, a user's ``tool_result``
    blocks as ``tool`` messages (before the rest of that user turn).

    Raises:
        FieldError: a block of a kind not served (images, documents) or a bad role.
    """
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": _text_of(system, "system", ("text",))})
    if not isinstance(messages, list):
        raise FieldError("messages", "messages must be a list")
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            raise FieldError("messages", f"messages[{i}].role must be user or assistant")
        content = m["content"]
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise FieldError("messages", f"messages[{i}].content must be a string or a list of blocks")
        texts, calls = [], []
        for j, b in enumerate(blocks):
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text":
                texts.append(str(b.get("text", "")))
            elif kind == "tool_use" and role == "assistant":
                calls.append({"id": b.get("id"), "type": "function",
                              "function": {"name": b.get("name"), "arguments": json.dumps(b.get("input", {}))}})
            elif kind == "tool_result" and role == "user":
                out.append({"role": "tool", "tool_call_id": b.get("tool_use_id"),
                            "content": _text_of(b.get("content", ""), f"messages[{i}].content[{j}].content",
                                                ("text",))})
            else:
                raise FieldError("messages", f"messages[{i}].content[{j}]: {ascii(kind)[:30]} blocks are not served "
                                             "here")
        if calls:
            out.append({"role": "assistant", "content": "\n".join(texts) or None, "tool_calls": calls})
        elif texts or role == "assistant":
            out.append({"role": role, "content": "\n".join(texts)})
    return out


def _text_of(content: Any, param: str, kinds: tuple[str, ...]) -> str:
    """A string, or the text of a list of text parts joined with newlines."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in kinds for p in content):
        return "\n".join(str(p.get("text", "")) for p in content)
    raise FieldError(param.split("[")[0].split(".")[0], f"{param} must be text")
