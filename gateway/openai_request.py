"""The OpenAI chat-completions request: validation into engine terms, and OpenAI errors.

``parse_chat_request`` turns a decoded ``POST /v1/chat/completions`` body into a
``ChatRequest``: text-only messages with the engine's roles and the engine
``SamplingParams`` keys the client set. What it accepts (docs/protocol.md section 4):

* supported: ``messages``, ``model``, ``temperature``, ``top_p``, ``max_tokens``,
  ``max_completion_tokens``, ``stop``, ``seed``, ``frequency_penalty``,
  ``presence_penalty``, ``n`` (1 only), ``stream``, ``stream_options``;
  extensions (as vLLM names them): ``top_k``, ``min_p``, ``repetition_penalty``,
  ``ignore_eos``; the session link field ``session_id``.
* ignored as harmless: ``IGNORED_FIELDS`` (``user``, ``metadata``, ...), and
  feature fields at their "off" value (``tools: []``, ``response_format: {"type": "text"}``...).
* refused with 400: any other field, a feature we do not serve (tools, images,
  logprobs), or a value out of OpenAI's range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from gateway.errors import GatewayError

# OpenAI fields with no effect on a text reply here; accepted and dropped.
IGNORED_FIELDS = frozenset({
    "user", "metadata", "store", "service_tier", "parallel_tool_calls", "reasoning_effort",
    "prompt_cache_key", "safety_identifier", "verbosity", "web_search_options",
})
SEED_RANGE = (-(2 ** 63), 2 ** 63 - 1)  # OpenAI's int64; torch generators refuse more
MAX_STOP_STRINGS = 16  # the engine's limit (OpenAI allows 4)
NEW_SESSION = "new"


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


def openai_error_from(code: str, message: str, param: str | None = None) -> OpenAIError:
    """The OpenAI error for a gateway or engine error ``code`` (unknown codes: 500)."""
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
        messages: ``[{"role": "system"|"user"|"assistant", "content": str}]`` (``developer``
            is folded into ``system``; text parts joined with newlines).
        model: the requested model name, or None when omitted.
        params: engine ``SamplingParams`` keys the client set (validated); unset keys
            take the gateway's defaults later.
        stream: answer with Server-Sent Events.
        include_usage: with ``stream``, send a final chunk holding ``usage``.
        session_id: the body's session link (an id or ``"new"``), or None.
    """

    messages: list[dict[str, str]]
    model: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    include_usage: bool = False
    session_id: str | None = None


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _number(body: dict[str, Any], name: str, lo: float, hi: float, lo_open: bool = False) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_num(v) or v > hi or v < lo or (lo_open and v == lo):
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise bad(f"'{name}' must be a number in {interval}, got {v!r}", name)
    return float(v)


def _content(i: int, role: str, content: Any) -> str:
    """A message's text: a string, or a list of ``{"type": "text", "text"}`` parts."""
    param = f"messages[{i}].content"
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return ""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad(f"only text content parts are supported; {param}[{j}] is {kind!r}", param)
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad(f"{param} must be a string or a list of text parts", param)


def _messages(raw: Any) -> list[dict[str, str]]:
    if not isinstance(raw, list) or not raw:
        raise bad("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object", f"messages[{i}]")
        role = m.get("role")
        if role == "developer":
            role = "system"  # OpenAI's newer name for the system role
        if role not in ("system", "user", "assistant"):
            raise bad(f"messages[{i}].role must be system, developer, user or assistant, got {role!r}"
                      " (tool and function messages are not supported)", f"messages[{i}].role")
        if m.get("tool_calls") or m.get("function_call") or m.get("audio"):
            raise bad(f"messages[{i}]: tool calls and audio are not supported", f"messages[{i}]")
        out.append({"role": role, "content": _content(i, role, m.get("content"))})
    return out


def _off_features(body: dict[str, Any]) -> None:
    """Refuse features we do not serve unless they are set to their "off" value."""
    for name in ("tools", "functions"):
        if body.get(name):
            raise bad(f"'{name}' is not supported by this server", name)
    for name in ("tool_choice", "function_call"):
        if body.get(name) not in (None, "none", "auto"):
            raise bad(f"'{name}' is not supported by this server", name)
    rf = body.get("response_format")
    if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
        raise bad("only response_format {\"type\": \"text\"} is supported", "response_format")
    if body.get("logit_bias"):
        raise bad("'logit_bias' is not supported by this server", "logit_bias")
    if body.get("modalities") not in (None, ["text"]) or body.get("audio") is not None:
        raise bad("only text output is supported", "modalities")
    if body.get("prediction") is not None:
        raise bad("'prediction' is not supported by this server", "prediction")
    if body.get("logprobs") not in (None, False):
        raise bad("logprobs are not supported by this server", "logprobs")
    if body.get("top_logprobs") not in (None, 0):
        raise bad("'top_logprobs' needs logprobs, which this server does not support", "top_logprobs")


KNOWN_FIELDS = frozenset({
    "messages", "model", "temperature", "top_p", "max_tokens", "max_completion_tokens", "stop", "seed",
    "frequency_penalty", "presence_penalty", "n", "stream", "stream_options", "session_id",
    "top_k", "min_p", "repetition_penalty", "ignore_eos",
    "tools", "functions", "tool_choice", "function_call", "response_format", "logit_bias", "modalities",
    "audio", "prediction", "logprobs", "top_logprobs",
}) | IGNORED_FIELDS


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    """The engine parameters the client set, range-checked as OpenAI documents them."""
    p: dict[str, Any] = {}
    for name, lo, hi, lo_open in (("temperature", 0, 2, False), ("top_p", 0, 1, True),
                                  ("frequency_penalty", -2, 2, False), ("presence_penalty", -2, 2, False),
                                  ("min_p", 0, 1, False), ("repetition_penalty", 0, math.inf, True)):
        v = _number(body, name, lo, hi, lo_open)
        if v is not None:
            p[name] = v
    for name in ("max_tokens", "max_completion_tokens"):  # the newer name wins when both are set
        v = body.get(name)
        if v is not None:
            if not _is_int(v) or v < 1:
                raise bad(f"'{name}' must be an integer >= 1, got {v!r}", name)
            p["max_tokens"] = v
    if body.get("top_k") is not None:
        v = body["top_k"]
        if not _is_int(v) or v < -1:
            raise bad(f"'top_k' must be an integer >= -1, got {v!r}", "top_k")
        p["top_k"] = v
    if body.get("seed") is not None:
        v = body["seed"]
        if not _is_int(v) or not (SEED_RANGE[0] <= v <= SEED_RANGE[1]):
            raise bad(f"'seed' must be a 64-bit integer, got {v!r}", "seed")
        p["seed"] = v
    if body.get("ignore_eos") is not None:
        if not isinstance(body["ignore_eos"], bool):
            raise bad("'ignore_eos' must be a boolean", "ignore_eos")
        p["ignore_eos"] = body["ignore_eos"]
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if (not isinstance(stops, list) or len(stops) > MAX_STOP_STRINGS
                or any(not isinstance(s, str) or not s or len(s) > 256 for s in stops)):
            raise bad(f"'stop' must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them "
                      "(each at most 256 characters)", "stop")
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
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    unknown = sorted(k for k in body if k not in KNOWN_FIELDS)
    if unknown:
        raise bad(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0])
    messages = _messages(body.get("messages"))
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("'model' must be a string", "model")
    n = body.get("n")
    if n is not None and n != 1:
        raise bad(f"only n=1 is supported (one choice per request), got {n!r}", "n")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad("'stream' must be a boolean", "stream")
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or not isinstance(opts.get("include_usage", False), bool)):
        raise bad("'stream_options' must be an object like {\"include_usage\": true}", "stream_options")
    sid = body.get("session_id")
    if sid is not None and not isinstance(sid, str):
        raise bad("'session_id' must be a string", "session_id")
    _off_features(body)
    return ChatRequest(messages=messages, model=model, params=_sampling(body), stream=bool(stream),
                       include_usage=bool((opts or {}).get("include_usage", False)), session_id=sid)
