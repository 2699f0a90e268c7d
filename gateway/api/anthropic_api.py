"""Anthropic's Messages API on our engine: ``POST /v1/messages`` and
``POST /v1/messages/count_tokens`` (docs/protocol.md section 4, "Anthropic Messages").

A request becomes a chat for the engine (``api_to_engine.messages_from_anthropic``:
``system``, text blocks, ``tool_use`` and ``tool_result`` blocks; a final assistant
message is a prefill the reply continues, as Anthropic's API treats it) with its tools
(``tools_from_anthropic``), on the same engine path as chat completions. The answer is a
``message`` with ``text`` and ``tool_use`` content blocks, or, streamed, Anthropic's
events: ``message_start``, ``content_block_start`` / ``content_block_delta``
(``text_delta``, ``input_json_delta``) / ``content_block_stop`` per block,
``message_delta`` (``stop_reason``, usage), ``message_stop``. Errors are Anthropic's
``{"type": "error", "error": {"type", "message"}}``.

``output_config.format`` (a JSON schema) holds the text as ``response_format`` does;
``temperature``, ``top_p`` and ``top_k`` are taken from clients that still send them.

Not served: images, documents and other non-text blocks, server tools (web search,
code execution), MCP servers, citations, batches; ``thinking`` is accepted and has no
effect (replies carry no thinking blocks), as are the service's hints
(``cache_control``, ``container``, ``speed``...).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import Response

from gateway.api import api_to_engine as a2e
from gateway.api import engine_to_api as e2a
from gateway.api.openai_replies import Delta, Finished, ReplyEvent
from gateway.api.openai_request import OpenAIError, bad, check_text, sampling_fields
from gateway.api.sse import json_bytes, sse

KNOWN_FIELDS = frozenset({
    "model", "messages", "system", "max_tokens", "stop_sequences", "temperature", "top_p", "top_k", "stream",
    "tools", "tool_choice", "metadata", "thinking", "service_tier", "output_config",
    # routing, caching and accounting hints of Anthropic's service: no effect here
    "cache_control", "container", "diagnostics", "inference_geo", "speed", "user_profile_id", "workspace_id",
})

# HTTP status -> Anthropic's error type
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error_response(e: OpenAIError) -> Response:
    """An error as Anthropic answers it (same HTTP status as ours)."""
    return Response(json_bytes(anthropic_error_body(e)), status_code=e.status, media_type="application/json")


def anthropic_error_body(e: OpenAIError) -> dict[str, Any]:
    """``{"type": "error", "error": {"type", "message"}}`` for one of our errors."""
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(e.status, "api_error"), "message": e.message}}


@dataclass(frozen=True)
class MessagesRequest:
    """A validated Messages request.

    Attributes:
        messages: the chat in the engine's (chat-completions) shape.
        model: the requested model name, or None.
        params: engine ``SamplingParams`` keys.
        extra: ``generate`` frame fields (tools, tool choice, ``continue_final_message``).
        stream: answer with Anthropic's events.
    """

    messages: list[dict[str, Any]]
    model: str | None
    params: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    stream: bool = False


def parse_messages_request(body: Any, count_only: bool = False) -> MessagesRequest:
    """Validate a decoded ``/v1/messages`` body (``count_only``: a ``count_tokens``
    body, which has no ``max_tokens``).

    Raises:
        OpenAIError: 400 naming the first bad or unsupported field.
    """
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    unknown = sorted(k for k in body if k not in KNOWN_FIELDS)
    if unknown:
        raise bad(f"{unknown[0]}: Extra inputs are not permitted", unknown[0])
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model must be a string", "model")
    check_text(model, "model")
    thinking = body.get("thinking")
    if thinking is not None and not isinstance(thinking, dict):
        raise bad("thinking must be an object", "thinking")
    if not count_only and body.get("max_tokens") is None:
        raise bad("max_tokens: Field required", "max_tokens")
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise bad("stream must be a boolean", "stream")
    try:
        messages = a2e.messages_from_anthropic(body.get("system"), body.get("messages"))
        if not messages or all(m["role"] == "system" for m in messages):
            raise a2e.FieldError("messages", "messages must hold at least one message")
        tools, choice, parallel = a2e.tools_from_anthropic(body.get("tools"), body.get("tool_choice"))
        extra = a2e.tool_fields(tools, choice, parallel) if tools else {}
        if not tools and choice not in (None, "auto", "none"):
            raise a2e.FieldError("tool_choice", "tool_choice needs tools")
        if a2e.continue_final_message(messages, {}):
            extra["continue_final_message"] = True
        structured = _output_format(body.get("output_config"))
    except a2e.FieldError as e:
        raise bad(e.message, e.param) from None
    for m in messages:
        check_text(m.get("content"), "messages")
    # temperature, top_p, top_k: older clients send them (the current API has none)
    sampling = {k: body[k] for k in ("temperature", "top_p", "top_k") if body.get(k) is not None}
    if not count_only:
        sampling["max_tokens"] = body["max_tokens"]
    if body.get("stop_sequences"):
        sampling["stop"] = body["stop_sequences"]
    try:
        params = sampling_fields(sampling)
    except OpenAIError as e:
        if e.param == "stop":
            e.param = "stop_sequences"
        raise
    if structured is not None:
        params["structured"] = structured
    return MessagesRequest(messages, model, params, extra, bool(body.get("stream")))


def _output_format(config: Any) -> dict[str, Any] | None:
    """``output_config.format`` (``{"type": "json_schema", "schema"}``, Anthropic's
    structured outputs) as the engine's ``structured``; ``effort`` is ignored.

    Raises:
        FieldError: another format, or a schema the engine would refuse.
    """
    if config is None:
        return None
    if not isinstance(config, dict):
        raise a2e.FieldError("output_config", "output_config must be an object")
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise a2e.FieldError("output_config", "output_config.format must be {\"type\": \"json_schema\", \"schema\"}")
    return a2e.structured_from_response_format(
        {"type": "json_schema", "json_schema": {"schema": fmt.get("schema"), "strict": True}}, "output_config")


def _usage(done: Finished | None) -> dict[str, Any]:
    u = done.usage if done is not None else {}
    prompt, cached = int(u.get("prompt_tokens", 0)), int(u.get("cached_tokens", 0))
    return {"input_tokens": prompt - cached, "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0,
            "output_tokens": int(u.get("completion_tokens", 0))}


def _stop(done: Finished) -> tuple[str, str | None]:
    reason = e2a.anthropic_stop_reason(done.finish_reason, done.stop_reason)
    return reason, done.stop_reason if reason == "stop_sequence" and isinstance(done.stop_reason, str) else None


class MessagesWriter:
    """Builds one Messages answer (``openai_api.Writer``; see module doc).

    Args:
        message_id: ``msg_...``.
        model: the served model's name.
    """

    def __init__(self, message_id: str, model: str) -> None:
        self.id = message_id
        self.model = model
        self.text: list[str] = []
        self.finished: Finished | None = None
        self._block = -1  # the index of the open content block, -1 before any
        self._block_kind = ""  # "text" or "tool_use"

    def _event(self, name: str, data: dict[str, Any]) -> bytes:
        return sse(json_bytes({"type": name, **data}), name)

    def _message(self, content: list[dict[str, Any]], stop: tuple[str | None, str | None]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop[0], "stop_sequence": stop[1], "usage": _usage(self.finished)}

    def start_events(self) -> list[bytes]:
        """``message_start`` (usage comes with ``message_delta``: the prompt's count is
        known when the reply ends) and a ``ping``."""
        return [self._event("message_start", {"message": self._message([], (None, None))}),
                self._event("ping", {})]

    def _close_block(self) -> list[bytes]:
        if self._block < 0 or not self._block_kind:
            return []
        self._block_kind = ""
        return [self._event("content_block_stop", {"index": self._block})]

    def stream_events(self, index: int, ev: ReplyEvent) -> list[bytes]:
        """Content block events for a delta; ``message_delta`` and ``message_stop`` at the end."""
        out: list[bytes] = []
        if isinstance(ev, Delta):
            if ev.text:
                if self._block_kind != "text":
                    out += self._close_block()
                    self._block += 1
                    self._block_kind = "text"
                    out.append(self._event("content_block_start", {
                        "index": self._block, "content_block": {"type": "text", "text": ""}}))
                out.append(self._event("content_block_delta", {
                    "index": self._block, "delta": {"type": "text_delta", "text": ev.text}}))
            for d in ev.tool_calls:
                if d.get("id") is not None:
                    out += self._close_block()
                    self._block += 1
                    self._block_kind = "tool_use"
                for e in e2a.anthropic_tool_use_events(d, self._block):
                    out.append(sse(json_bytes(e), e["type"]))
        elif isinstance(ev, Finished):
            self.finished = ev
            out += self._close_block()
            reason, seq = _stop(ev)
            out.append(self._event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": seq},
                                                     "usage": _usage(ev)}))
            out.append(self._event("message_stop", {}))
        return out

    def end_events(self) -> list[bytes]:
        """Nothing after ``message_stop``."""
        return []

    def error_event(self, e: OpenAIError) -> list[bytes]:
        """An ``error`` event, as Anthropic's stream sends one."""
        return [sse(json_bytes(anthropic_error_body(e)), "error")]

    def take(self, index: int, ev: ReplyEvent) -> None:
        """Keep one event for ``body``."""
        if isinstance(ev, Delta):
            self.text.append(ev.text)
        elif isinstance(ev, Finished):
            self.finished = ev

    def body(self) -> dict[str, Any]:
        """The ``message``."""
        done = self.finished or Finished("stop")
        text = "".join(self.text)
        content: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
        content += e2a.anthropic_tool_use_blocks(done.tool_calls or [])
        return self._message(content, _stop(done))


def new_message_id() -> str:
    """``msg_`` and 24 hex digits."""
    return "msg_" + uuid.uuid4().hex[:24]


class CountWriter(MessagesWriter):
    """``count_tokens``' answer, ``{"input_tokens"}``, from a one-token run of the prompt
    (the engine renders and tokenizes it exactly as for the reply, tools included; its
    pages then sit in the prefix cache for the request that follows)."""

    def body(self) -> dict[str, Any]:
        """``{"input_tokens": N}``."""
        done = self.finished or Finished("stop")
        return {"input_tokens": int(done.usage.get("prompt_tokens", 0))}
