"""Anthropic's Messages API on our engine: ``POST /v1/messages`` and
``POST /v1/messages/count_tokens`` (docs/protocol.md section 4, "Anthropic Messages").

A request becomes a chat for the engine (``api_to_engine.messages_from_anthropic``:
``system``, text blocks, ``tool_use`` and ``tool_result`` blocks; a final assistant
message is a prefill the reply continues, as Anthropic's API treats it) with its tools
(``tools_from_anthropic``), on the same engine path as chat completions. The answer is a
``message`` with ``text`` and ``tool_use`` content blocks, or, streamed, Anthropic's
events: ``message_start`` (with the prompt's tokens), ``content_block_start`` / ``content_block_delta``
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
from gateway.api.openai_request import BodyWording, OpenAIError, bad, check_body, check_text, sampling_fields
from gateway.api.reply_collect import ChoiceReply, CollectingWriter
from gateway.api.sse import json_bytes, sse

KNOWN_FIELDS = frozenset({
    "model", "messages", "system", "max_tokens", "stop_sequences", "temperature", "top_p", "top_k", "stream",
    "tools", "tool_choice", "metadata", "thinking", "service_tier", "output_config",
    # routing, caching and accounting hints of Anthropic's service: no effect here
    "cache_control", "container", "diagnostics", "inference_geo", "speed", "user_profile_id", "workspace_id",
})

_WORDING = BodyWording("{}: Extra inputs are not permitted", quote="")  # as Anthropic's validation words them

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
    head = check_body(body, KNOWN_FIELDS, _WORDING)
    body = head.body
    thinking = body.get("thinking")
    if thinking is not None and not isinstance(thinking, dict):
        raise bad("thinking must be an object", "thinking")
    if not count_only and body.get("max_tokens") is None:
        raise bad("max_tokens: Field required", "max_tokens")
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
    return MessagesRequest(messages, head.model, params, extra, head.stream)


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


def _usage(u: dict[str, int]) -> dict[str, Any]:
    """Anthropic's ``usage`` from ours (``Finished.usage``, or a first delta's ``prompt_usage``)."""
    prompt, cached = int(u.get("prompt_tokens", 0)), int(u.get("cached_tokens", 0))
    return {"input_tokens": prompt - cached, "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0,
            "output_tokens": int(u.get("completion_tokens", 0))}


def _stop(done: Finished) -> tuple[str, str | None]:
    reason = e2a.anthropic_stop_reason(done.finish_reason, done.stop_reason)
    return reason, done.stop_reason if reason == "stop_sequence" and isinstance(done.stop_reason, str) else None


class MessagesWriter(CollectingWriter):
    """Builds one Messages answer (``openai_api.Writer``; see module doc).

    Args:
        message_id: ``msg_...``.
        model: the served model's name.
    """

    def __init__(self, message_id: str, model: str) -> None:
        self.id = message_id
        self.model = model
        self.choices = [ChoiceReply()]  # one choice: these APIs have no n
        self._block = -1  # the index of the open content block, -1 before any
        self._block_kind = ""  # "text" or "tool_use"
        self._started = False  # message_start went out

    @property
    def finished(self) -> Finished | None:
        """The reply's ``Finished``, once it came."""
        return self.choices[0].finished

    def _event(self, name: str, data: dict[str, Any]) -> bytes:
        return sse(json_bytes({"type": name, **data}), name)

    def _message(self, content: list[dict[str, Any]], stop: tuple[str | None, str | None]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop[0], "stop_sequence": stop[1],
                "usage": _usage(self.finished.usage if self.finished is not None else {})}

    def start_events(self) -> list[bytes]:
        """Nothing yet: ``message_start`` goes with the first event, which knows the prompt's tokens."""
        return []

    def _start(self, ev: ReplyEvent) -> list[bytes]:
        """``message_start`` (its usage: the prompt's tokens, from the reply's first delta
        or its end) and a ``ping``, before the first event's own."""
        if self._started:
            return []
        self._started = True
        usage = ev.prompt_usage if isinstance(ev, Delta) else ev.usage if isinstance(ev, Finished) else None
        message = self._message([], (None, None))
        message["usage"] = _usage({**(usage or {}), "completion_tokens": 0})
        return [self._event("message_start", {"message": message}), self._event("ping", {})]

    def _close_block(self) -> list[bytes]:
        if self._block < 0 or not self._block_kind:
            return []
        self._block_kind = ""
        return [self._event("content_block_stop", {"index": self._block})]

    def stream_events(self, index: int, ev: ReplyEvent) -> list[bytes]:
        """Content block events for a delta; ``message_delta`` and ``message_stop`` at the end."""
        out = self._start(ev)
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
            self.choices[0].finished = ev
            out += self._close_block()
            reason, seq = _stop(ev)
            out.append(self._event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": seq},
                                                     "usage": _usage(ev.usage)}))
            out.append(self._event("message_stop", {}))
        return out

    def end_events(self) -> list[bytes]:
        """Nothing after ``message_stop``."""
        return []

    def error_event(self, e: OpenAIError) -> list[bytes]:
        """An ``error`` event, as Anthropic's stream sends one."""
        return [sse(json_bytes(anthropic_error_body(e)), "error")]

    def body(self) -> dict[str, Any]:
        """The ``message``."""
        done, text = self.choices[0].done, self.choices[0].whole_text
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
        done = self.choices[0].done
        return {"input_tokens": int(done.usage.get("prompt_tokens", 0))}
