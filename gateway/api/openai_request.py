"""The OpenAI chat-completions request: validation into engine terms, and OpenAI errors.

``parse_chat_request`` turns a decoded ``POST /v1/chat/completions`` body into a
``ChatRequest``: messages with the engine's roles (tool calls and tool results
included), the engine ``SamplingParams`` keys the client set, and the ``generate``
frame's tool and continuation fields. What it accepts (docs/protocol.md section 4):

* supported: ``messages``, ``model``, ``temperature``, ``top_p``, ``max_tokens``,
  ``max_completion_tokens``, ``stop``, ``seed``, ``frequency_penalty``,
  ``presence_penalty``, ``n`` (1-8), ``stream``, ``stream_options``,
  ``response_format`` (text, ``json_object``, ``json_schema``), ``tools``,
  ``tool_choice``, ``parallel_tool_calls``, the legacy ``functions``/``function_call``,
  ``logprobs``/``top_logprobs``, ``logit_bias``; extensions (as vLLM and llama.cpp name
  them): ``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``,
  ``continue_final_message``, ``add_generation_prompt``, ``guided_json``,
  ``guided_regex``, ``guided_grammar``, ``guided_choice``, ``json_schema``, ``grammar``;
  the session link field ``session_id``.
* ignored as harmless: ``IGNORED_FIELDS`` (``user``, ``metadata``, ...).
* refused with 400: any other field, a feature we do not serve (images, audio), a
  value out of the engine's range (``engine.sampling_params.RANGES``, the same text as
  every other entry point), a schema the grammar library cannot compile (its reason),
  or text that is not valid Unicode.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from engine.errors import InvalidRequestError
from engine.sampling_params import (
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    STOP_ERROR,
    STOP_TYPE_ERROR,
    SamplingParams,
    param_error,
)
from engine.text_checks import text_error
from gateway.api import api_to_engine as a2e
from gateway.errors import GatewayError

# OpenAI fields with no effect on a reply here; accepted and dropped.
IGNORED_FIELDS = frozenset({
    "user", "metadata", "store", "service_tier", "reasoning_effort",
    "prompt_cache_key", "safety_identifier", "verbosity", "web_search_options",
    # llama.cpp's server's cache and slot hints (the prefix cache always serves here; no slots)
    "cache_prompt", "id_slot",
})
NEW_SESSION = "new"
# llama-server's reporting flags (booleans): its timings object, its prompt-progress chunks
LLAMA_FLAGS = ("timings_per_token", "return_progress")


class OpenAIError(Exception):
    """An error in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

    Attributes:
        status: the HTTP status (400, 401, 404, 409, 413, 429, 500, 503).
        message: a sentence for people.
        type: OpenAI's error type (``invalid_request_error``, ``rate_limit_error``, ``server_error``).
        param: the request field at fault, or None.
        code: a machine-readable code (``context_length_exceeded``, ``invalid_api_key``...) or None.
    """

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """The JSON body OpenAI clients parse."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# gateway/engine code -> (HTTP status, OpenAI type, OpenAI code)
_CODE_MAP: dict[str, tuple[int, str, str | None]] = {
    "invalid_request": (400, "invalid_request_error", None),
    "bad_frame": (400, "invalid_request_error", None),
    "context_length_exceeded": (400, "invalid_request_error", "context_length_exceeded"),
    "not_found": (404, "invalid_request_error", "not_found"),
    "busy": (409, "invalid_request_error", "busy"),
    "frame_too_large": (413, "invalid_request_error", "request_too_large"),
    "rate_limited": (429, "rate_limit_error", "rate_limit_exceeded"),
    "too_many_generations": (429, "rate_limit_error", "too_many_generations"),
    "too_many_sessions": (429, "rate_limit_error", "too_many_sessions"),
    "engine_unavailable": (503, "server_error", "engine_unavailable"),
    "store_unavailable": (503, "server_error", "store_unavailable"),
}


def openai_error_from(code: str, message: str, param: str | None = None, status: int = 0) -> OpenAIError:
    """The OpenAI error for a gateway or engine error ``code`` (unknown codes: 500), or,
    with ``status``, for an OpenAI-compatible upstream's own error: its code, with that
    HTTP status (429: ``rate_limit_error``, another 4xx: ``invalid_request_error``, else
    ``server_error``)."""
    if status and code not in _CODE_MAP:
        kind = "rate_limit_error" if status == 429 else "invalid_request_error" if status < 500 else "server_error"
        return OpenAIError(status, message, kind, param, code)
    status, kind, oa_code = _CODE_MAP.get(code, (500, "server_error", "internal_error"))
    if code == "context_length_exceeded" and param is None:
        param = "messages"
    return OpenAIError(status, message, kind, param, oa_code)


def from_gateway_error(e: GatewayError) -> OpenAIError:
    """``openai_error_from`` for a raised ``GatewayError``."""
    return openai_error_from(e.code, e.message)


def bad(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    """A 400 ``invalid_request_error``."""
    return OpenAIError(400, message, "invalid_request_error", param, code)


@dataclass(frozen=True)
class ChatRequest:
    """A validated chat-completions request.

    Attributes:
        messages: ``[{"role": "system"|"user"|"assistant"|"tool", "content": str}]``
            (``developer`` is folded into ``system``; text parts joined with newlines); an
            assistant message may carry ``tool_calls`` (OpenAI's shape), a tool message
            ``tool_call_id``.
        model: the requested model name, or None when omitted.
        params: engine ``SamplingParams`` keys the client set (validated; ``structured``,
            ``logprobs``, ``logit_bias`` included); unset keys take the gateway's defaults later.
        stream: answer with Server-Sent Events.
        include_usage: with ``stream``, send a final chunk holding ``usage``.
        session_id: the body's session link (an id or ``"new"``), or None.
        n: the number of choices (1-8).
        logprobs: answer with each token's logprobs.
        extra: the engine ``generate`` frame's ``tools``, ``tool_choice``,
            ``parallel_tool_calls`` and ``continue_final_message`` (only those set).
        timings: llama-server's ``timings_per_token``: answer with its ``timings`` object
            (docs/protocol.md, "llama-server's extensions").
        progress: llama-server's ``return_progress``: stream ``prompt_progress`` chunks
            while the prompt is read.
    """

    messages: list[dict[str, Any]]
    model: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    include_usage: bool = False
    session_id: str | None = None
    n: int = 1
    logprobs: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    timings: bool = False
    progress: bool = False

    @property
    def plain(self) -> bool:
        """A request a stored chat can take: one text choice, nothing but sampling settings."""
        return (self.n == 1 and not self.logprobs and not self.extra
                and not any(k in self.params for k in ("structured", "logit_bias", "logprobs")))


def check_text(value: Any, field: str, param: str | None = None) -> None:
    """Refuse a string that is not valid Unicode (``engine.text_checks``)."""
    message = text_error(value, field)
    if message is not None:
        raise bad(message, param or field)


@dataclass(frozen=True)
class BodyWording:
    """How one API words the errors ``check_body`` raises, as that API's own service does.

    Attributes:
        unknown: the message for a field it does not know, ``{}`` standing for the field.
        quote: the quote around a field's name in a type error (``'model'`` or ``model``).
    """

    unknown: str
    quote: str = "'"


OPENAI_WORDING = BodyWording("Unrecognized request argument supplied: {}")


@dataclass(frozen=True)
class BodyHead:
    """The fields every API's body checks the same way.

    Attributes:
        body: the body, known to be a JSON object.
        model: the requested model name, or None.
        stream: the body's ``stream``.
        include_usage: ``stream_options.include_usage`` (False where the API has none).
    """

    body: dict[str, Any]
    model: str | None
    stream: bool
    include_usage: bool = False


def check_body(body: Any, known: frozenset[str], wording: BodyWording = OPENAI_WORDING,
               flags: tuple[str, ...] = ("stream",), stream_options: bool = False) -> BodyHead:
    """The start of every API's request check: the body is an object, every field is
    one the API knows, ``model`` is a string of valid Unicode, each of ``flags`` a
    boolean, and (``stream_options``) ``stream_options`` an object with a boolean
    ``include_usage``.

    Raises:
        OpenAIError: 400 naming the first bad field, in ``wording``.
    """
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    unknown = sorted(k for k in body if k not in known)
    if unknown:
        raise bad(wording.unknown.format(unknown[0]), unknown[0])
    q = wording.quote
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad(f"{q}model{q} must be a string", "model")
    check_text(model, "model")
    for flag in flags:
        if body.get(flag) is not None and not isinstance(body[flag], bool):
            raise bad(f"{q}{flag}{q} must be a boolean", flag)
    opts = body.get("stream_options") if stream_options else None
    if opts is not None and (not isinstance(opts, dict) or not isinstance(opts.get("include_usage", False), bool)):
        raise bad(f"{q}stream_options{q} must be an object like {{\"include_usage\": true}}", "stream_options")
    return BodyHead(body, model, bool(body.get("stream")), bool((opts or {}).get("include_usage", False)))


def _content(i: int, role: str, content: Any) -> str:
    """A message's text: a string, or a list of ``{"type": "text", "text"}`` parts."""
    param = f"messages[{i}].content"
    if isinstance(content, str):
        check_text(content, param)
        return content
    if content is None and role in ("assistant", "tool"):
        return ""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad(f"only text content parts are supported; {param}[{j}] is {kind!r}", param)
            check_text(part["text"], f"{param}[{j}].text", param)
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad(f"{param} must be a string or a list of text parts", param)


def _tool_calls(i: int, calls: Any) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls``, checked for OpenAI's shape (arguments as a
    JSON text; an object some clients send is written as one)."""
    param = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise bad(f"{param} must be a list", param)
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or c.get("type", "function") != "function" or not isinstance(fn.get("name"), str):
            raise bad(f'{param}[{j}] must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}', param)
        args = fn.get("arguments", "{}")
        if isinstance(args, dict):
            args = json.dumps(args, ensure_ascii=False)
        if not isinstance(args, str):
            raise bad(f"{param}[{j}].function.arguments must be a JSON text", param)
        call_id = c.get("id") or f"call_{i}_{j}"
        if not isinstance(call_id, str):
            raise bad(f"{param}[{j}].id must be a string", param)
        for text, where in ((call_id, "id"), (fn["name"], "function.name"), (args, "function.arguments")):
            check_text(text, f"{param}[{j}].{where}", param)
        out.append({"id": call_id, "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def _messages(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise bad("'messages' must be a non-empty list", "messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object", f"messages[{i}]")
        role = m.get("role")
        if role == "developer":
            role = "system"  # OpenAI's newer name for the system role
        if role == "function":  # the legacy name of a tool result
            role = "tool"
        if role not in ("system", "user", "assistant", "tool"):
            raise bad(f"messages[{i}].role must be system, developer, user, assistant or tool, got {role!r}",
                      f"messages[{i}].role")
        if m.get("audio"):
            raise bad(f"messages[{i}]: audio is not supported", f"messages[{i}]")
        name = m.get("name")
        if name is not None and not isinstance(name, str):
            raise bad(f"messages[{i}].name must be a string", f"messages[{i}].name")
        check_text(name, f"messages[{i}].name")
        calls = m.get("tool_calls")
        if calls is None and isinstance(m.get("function_call"), dict):  # the legacy single call
            calls = [{"id": f"call_{i}", "type": "function", "function": m["function_call"]}]
        msg: dict[str, Any] = {"role": role, "content": _content(i, role, m.get("content"))}
        if calls:
            if role != "assistant":
                raise bad(f"messages[{i}]: only assistant messages carry tool_calls", f"messages[{i}].tool_calls")
            msg["tool_calls"] = _tool_calls(i, calls)
        if role == "tool":
            call_id = m.get("tool_call_id")
            if call_id is not None:
                if not isinstance(call_id, str):
                    raise bad(f"messages[{i}].tool_call_id must be a string", f"messages[{i}].tool_call_id")
                check_text(call_id, f"messages[{i}].tool_call_id")
                msg["tool_call_id"] = call_id
            if name is not None:
                msg["name"] = name
        out.append(msg)
    return out


def _off_features(body: dict[str, Any]) -> None:
    """Refuse output kinds we do not serve (audio, predicted outputs)."""
    if body.get("modalities") not in (None, ["text"]) or body.get("audio") is not None:
        raise bad("only text output is supported", "modalities")
    if body.get("prediction") is not None:
        raise bad("'prediction' is not supported by this server", "prediction")


def _engine_fields(body: dict[str, Any], messages: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The request's engine features: (``SamplingParams`` keys ``structured``,
    ``logprobs``, ``logit_bias``; ``generate`` frame fields ``tools``, ``tool_choice``,
    ``parallel_tool_calls``, ``continue_final_message``), each only when set.

    Raises:
        OpenAIError: 400 naming the field and the engine's reason.
    """
    params: dict[str, Any] = {}
    try:
        structured = a2e.structured_from_response_format(body.get("response_format"))
        ext = a2e.structured_from_extensions(body)
        if ext is not None:
            if structured is not None:
                raise a2e.FieldError(ext[0], f"give response_format or {ext[0]}, not both")
            structured = ext[1]
        if structured is not None:
            params["structured"] = structured
        tools, choice = body.get("tools"), body.get("tool_choice")
        if body.get("functions") is not None:
            if tools:
                raise a2e.FieldError("functions", "give tools or functions, not both")
            tools, choice = a2e.tools_from_functions(body["functions"], body.get("function_call"))
        elif body.get("function_call") is not None and choice is None:
            raise a2e.FieldError("function_call", "function_call needs functions")
        extra = a2e.tool_fields(tools or None, choice, body.get("parallel_tool_calls")) if tools else {}
        if not tools and choice not in (None, "none", "auto"):
            raise a2e.FieldError("tool_choice", "tool_choice needs tools")
        params.update(a2e.chat_logprob_params(body.get("logprobs"), body.get("top_logprobs")))
        params.update(a2e.logit_bias_param(body.get("logit_bias")))
        if a2e.continue_final_message(messages, body):
            extra["continue_final_message"] = True
    except a2e.FieldError as e:
        raise bad(e.message, e.param) from None
    return params, extra


KNOWN_FIELDS = frozenset({
    "messages", "model", "temperature", "top_p", "max_tokens", "max_completion_tokens", "stop", "seed",
    "frequency_penalty", "presence_penalty", "n", "stream", "stream_options", "session_id",
    "top_k", "min_p", "repetition_penalty", "ignore_eos",
    "tools", "functions", "tool_choice", "function_call", "response_format", "logit_bias", "modalities",
    "audio", "prediction", "logprobs", "top_logprobs", "parallel_tool_calls", "continue_final_message",
    "add_generation_prompt", "guided_json", "guided_regex", "guided_grammar", "guided_choice", "json_schema",
    "grammar", "timings_per_token", "return_progress",
}) | IGNORED_FIELDS


# OpenAI field -> engine parameter (its range and error text come from RANGES)
NUMERIC_FIELDS: dict[str, str] = {
    "temperature": "temperature", "top_p": "top_p", "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty", "min_p": "min_p", "repetition_penalty": "repetition_penalty",
    "max_tokens": "max_tokens", "max_completion_tokens": "max_tokens",  # the newer name wins when both are set
    "top_k": "top_k", "seed": "seed",
}


def sampling_fields(body: dict[str, Any]) -> dict[str, Any]:
    """The engine parameters the client set, each checked against the engine's own
    ranges (``RANGES``) with the engine's error text, naming the OpenAI field."""
    p: dict[str, Any] = {}
    for name, engine_name in NUMERIC_FIELDS.items():
        v = body.get(name)
        if v is None:
            continue
        message = param_error(engine_name, v, label=name)
        if message is not None:
            raise bad(message, name)
        p[engine_name] = v
    if body.get("ignore_eos") is not None:
        if not isinstance(body["ignore_eos"], bool):
            raise bad("'ignore_eos' must be a boolean", "ignore_eos")
        p["ignore_eos"] = body["ignore_eos"]
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or any(not isinstance(s, str) for s in stops):
            raise bad(STOP_TYPE_ERROR, "stop")
        if len(stops) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise bad(STOP_ERROR, "stop")
        for i, s in enumerate(stops):
            check_text(s, f"stop[{i}]", "stop")
        if stops:
            p["stop"] = stops
    try:  # the engine's own rules, so that nothing it would refuse is sent
        SamplingParams.from_dict(p)
    except InvalidRequestError as e:
        raise bad(e.message) from None
    return p


def parse_chat_request(body: Any) -> ChatRequest:
    """Validate a decoded request body.

    Raises:
        OpenAIError: 400 naming the first bad or unsupported field.
    """
    head = check_body(body, KNOWN_FIELDS, flags=("stream",) + LLAMA_FLAGS, stream_options=True)
    body = head.body
    messages = _messages(body.get("messages"))
    try:
        n = a2e.choice_count(body.get("n"))
    except a2e.FieldError as e:
        raise bad(e.message, e.param) from None
    sid = body.get("session_id")
    if sid is not None and not isinstance(sid, str):
        raise bad("'session_id' must be a string", "session_id")
    check_text(sid, "session_id")
    _off_features(body)
    features, extra = _engine_fields(body, messages)
    params = sampling_fields(body)
    params.update(features)
    return ChatRequest(messages=messages, model=head.model, params=params, stream=head.stream,
                       include_usage=head.include_usage, session_id=sid, n=n,
                       logprobs="logprobs" in features, extra=extra,
                       timings=body.get("timings_per_token") is True, progress=body.get("return_progress") is True)
