"""OpenAI's Responses API on our engine: ``POST /v1/responses`` (docs/protocol.md
section 4, "Responses API").

``instructions`` and ``input`` (a string, or message, ``function_call`` and
``function_call_output`` items: ``api_to_engine.messages_from_responses``) become a chat
for the engine; function tools (``tools_from_responses``), ``tool_choice``,
``parallel_tool_calls``, ``text.format`` (text, ``json_object``, ``json_schema``),
``max_output_tokens``, ``temperature``, ``top_p`` as in chat completions. The answer is
a ``response`` whose ``output`` holds a ``message`` item (``output_text`` content) and
``function_call`` items; streamed, the documented events: ``response.created``,
``response.in_progress``, per item ``response.output_item.added`` /
``response.content_part.added`` / ``response.output_text.delta`` (or
``response.function_call_arguments.delta``) / ``...done`` / ``response.output_item.done``,
then ``response.completed`` (or ``response.incomplete`` when cut by
``max_output_tokens``), each with its ``sequence_number``.

Not served: stored responses (``store`` is taken as false; ``previous_response_id``,
``conversation`` and ``background`` are refused), built-in tools (web and file search,
computer use, code interpreter, image generation, MCP), reasoning items, images and
files in the input.

llama-server's ``timings_per_token`` and ``return_progress`` work as in chat completions
(docs/protocol.md, "llama-server's extensions"): the ``timings`` object on each
``response.output_text.delta`` and on ``response.completed`` (and the body), and
``response.in_progress`` events carrying ``prompt_progress``.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from gateway.api import api_to_engine as a2e
from gateway.api import engine_to_api as e2a
from gateway.api.openai_replies import Delta, Finished, Progress, ReplyEvent
from gateway.api.openai_request import (
    IGNORED_FIELDS,
    LLAMA_FLAGS,
    BodyWording,
    OpenAIError,
    bad,
    check_body,
    check_text,
    sampling_fields,
)
from gateway.api.reply_collect import (
    ChoiceReply,
    CollectingWriter,
    finished_timings,
    live_timings,
    prompt_progress,
)
from gateway.api.sse import json_bytes, sse

KNOWN_FIELDS = frozenset({
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "tools", "tool_choice",
    "parallel_tool_calls", "text", "store", "previous_response_id", "conversation", "background", "include",
    "truncation", "reasoning", "top_logprobs", "stream_options", "max_tool_calls", *LLAMA_FLAGS,
}) | IGNORED_FIELDS
_WORDING = BodyWording("Unknown parameter: '{}'.")  # as OpenAI's Responses API words it


@dataclass(frozen=True)
class ResponsesRequest:
    """A validated Responses request.

    Attributes:
        messages: the chat in the engine's (chat-completions) shape.
        model: the requested model name, or None.
        params: engine ``SamplingParams`` keys.
        extra: ``generate`` frame fields (tools, tool choice, parallel calls).
        stream: answer with the Responses stream events.
        echo: request fields a ``response`` object repeats (instructions, tools, ...).
        timings, progress: llama-server's ``timings_per_token`` and ``return_progress``
            (``ChatRequest``'s; docs/protocol.md, "llama-server's extensions").
    """

    messages: list[dict[str, Any]]
    model: str | None
    params: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    echo: dict[str, Any] = field(default_factory=dict)
    timings: bool = False
    progress: bool = False


def _text_format(text: Any) -> dict[str, Any] | None:
    """``text.format`` as the engine's ``structured`` (None for text)."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise a2e.FieldError("text", "text must be an object like {\"format\": {\"type\": \"text\"}}")
    fmt = text.get("format")
    if fmt is None:
        return None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":  # flat here, nested in chat completions
        fmt = {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    return a2e.structured_from_response_format(fmt, "text")


def parse_responses_request(body: Any, defaults: dict[str, Any] | None = None) -> ResponsesRequest:
    """Validate a decoded ``/v1/responses`` body.

    Args:
        body: the decoded JSON body.
        defaults: the sampling the gateway gives the fields a request leaves out
            (``Defaults.stateless_sampling``): the response repeats the ``temperature``
            and ``top_p`` the reply is sampled with, so these, not OpenAI's 1.0.

    Raises:
        OpenAIError: 400 naming the first bad or unsupported field.
    """
    head = check_body(body, KNOWN_FIELDS, _WORDING, flags=("stream",) + LLAMA_FLAGS)
    body = head.body
    for name in ("previous_response_id", "conversation"):
        if body.get(name):
            raise bad(f"'{name}' needs stored responses, which this server does not keep; send the whole input",
                      name)
    if body.get("background"):
        raise bad("background responses are not served by this server", "background")
    try:
        messages = a2e.messages_from_responses(body.get("instructions"), body.get("input"))
        if not any(m["role"] != "system" for m in messages):
            raise a2e.FieldError("input", "input must hold at least one message")
        tools, choice = a2e.tools_from_responses(body.get("tools"), body.get("tool_choice"))
        extra = a2e.tool_fields(tools, choice, body.get("parallel_tool_calls")) if tools else {}
        if not tools and choice not in (None, "auto", "none"):
            raise a2e.FieldError("tool_choice", "tool_choice needs tools")
        params: dict[str, Any] = {}
        structured = _text_format(body.get("text"))
        if structured is not None:
            params["structured"] = structured
        if a2e.continue_final_message(messages, {}):
            extra["continue_final_message"] = True
    except a2e.FieldError as e:
        raise bad(e.message, e.param) from None
    for m in messages:
        check_text(m.get("content"), "input")
    sampling = {k: body[k] for k in ("temperature", "top_p") if body.get(k) is not None}
    if body.get("max_output_tokens") is not None:
        sampling["max_tokens"] = body["max_output_tokens"]
    try:
        params.update(sampling_fields(sampling))
    except OpenAIError as e:
        if e.param == "max_tokens":
            e.param = "max_output_tokens"
        raise
    echo = {"instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            **{k: body[k] if body.get(k) is not None else (defaults or {}).get(k, 1.0)
               for k in ("temperature", "top_p")},
            "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice", "auto"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "text": body.get("text") or {"format": {"type": "text"}}, "metadata": body.get("metadata") or {}}
    return ResponsesRequest(messages, head.model, params, extra, head.stream, echo,
                            timings=body.get("timings_per_token") is True, progress=body.get("return_progress") is True)


def _usage(done: Finished | None) -> dict[str, Any]:
    u = done.usage if done is not None else {}
    prompt, completion = int(u.get("prompt_tokens", 0)), int(u.get("completion_tokens", 0))
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": int(u.get("cached_tokens", 0))},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


class ResponsesWriter(CollectingWriter):
    """Builds one Responses answer (``openai_api.Writer``; see module doc).

    Args:
        rreq: the request (the fields a response repeats).
        response_id: ``resp_...``.
        model: the served model's name.
    """

    def __init__(self, rreq: ResponsesRequest, response_id: str, model: str) -> None:
        self.rreq = rreq
        self.id = response_id
        self.model = model
        self.created = int(time.time())
        self.choices = [ChoiceReply()]  # one choice: these APIs have no n
        self.items: list[dict[str, Any]] = []  # output items so far (streaming)
        self._seq = 0
        self._open: dict[str, Any] | None = None  # the item being streamed
        # llama-server's live timings: the request's arrival, its first text, tokens so far, prompt counts
        self.started = time.perf_counter()
        self._first_at: float | None = None
        self._n_tokens = 0
        self._prompt_usage: dict[str, int] | None = None

    @property
    def finished(self) -> Finished | None:
        """The reply's ``Finished``, once it came."""
        return self.choices[0].finished

    def _event(self, name: str, data: dict[str, Any], extra: dict[str, Any] | None = None) -> bytes:
        out = sse(json_bytes({"type": name, "sequence_number": self._seq, **data, **(extra or {})}), name)
        self._seq += 1
        return out

    def _response(self, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        done = self.finished
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "error": None, "incomplete_details": incomplete, "model": self.model, "output": output,
                "usage": _usage(done) if done is not None else None, "store": False, "background": False,
                "previous_response_id": None, "reasoning": {"effort": None, "summary": None},
                "truncation": "disabled", "user": None, **self.rreq.echo}

    def _status(self) -> str:
        return "incomplete" if self.finished is not None and self.finished.finish_reason == "length" else "completed"

    # ---- streaming --------------------------------------------------------------------

    def start_events(self) -> list[bytes]:
        """``response.created`` and ``response.in_progress``."""
        return [self._event("response.created", {"response": self._response("in_progress", [])}),
                self._event("response.in_progress", {"response": self._response("in_progress", [])})]

    def _close_item(self) -> list[bytes]:
        item, self._open = self._open, None
        if item is None:
            return []
        at = len(self.items)
        self.items.append(item)
        # the item open when max_output_tokens cut the reply is incomplete, as OpenAI marks it
        item["status"] = self._status()  # "completed" until the reply has finished
        if item["type"] == "message":
            text = item["content"][0]["text"]
            return [self._event("response.output_text.done", {"item_id": item["id"], "output_index": at,
                                                              "content_index": 0, "text": text, "logprobs": []}),
                    self._event("response.content_part.done", {"item_id": item["id"], "output_index": at,
                                                               "content_index": 0, "part": item["content"][0]}),
                    self._event("response.output_item.done", {"output_index": at, "item": item})]
        return [self._event("response.function_call_arguments.done", {
                    "item_id": item["id"], "output_index": at, "arguments": item["arguments"]}),
                self._event("response.output_item.done", {"output_index": at, "item": item})]

    def stream_events(self, index: int, ev: ReplyEvent) -> list[bytes]:
        """Item events for a delta; the closing events and ``response.completed`` at the end."""
        out: list[bytes] = []
        at = len(self.items)
        if isinstance(ev, Progress):
            if self.rreq.progress:
                out.append(self._in_progress(ev.done, ev.total, ev.cached))
        elif isinstance(ev, Delta):
            now = time.perf_counter()
            if self._first_at is None:
                self._first_at, self._prompt_usage = now, ev.prompt_usage
                if self.rreq.progress and ev.prompt_usage is not None:
                    total = int(ev.prompt_usage.get("prompt_tokens", 0))
                    out.append(self._in_progress(total, total, int(ev.prompt_usage.get("cached_tokens", 0))))
            self._n_tokens += ev.n_tokens
            timings = ({"timings": live_timings(self.started, self._first_at, self._n_tokens, self._prompt_usage,
                                                now)} if self.rreq.timings else None)
            if ev.text:
                if self._open is None or self._open["type"] != "message":
                    out += self._close_item()
                    at = len(self.items)
                    self._open = {"type": "message", "id": "msg_" + uuid.uuid4().hex[:24], "status": "in_progress",
                                  "role": "assistant", "content": []}
                    out.append(self._event("response.output_item.added", {"output_index": at, "item": {
                        **self._open, "content": []}}))
                    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                    self._open["content"].append(part)
                    out.append(self._event("response.content_part.added", {
                        "item_id": self._open["id"], "output_index": at, "content_index": 0, "part": dict(part)}))
                self._open["content"][0]["text"] += ev.text
                out.append(self._event("response.output_text.delta", {
                    "item_id": self._open["id"], "output_index": at, "content_index": 0, "delta": ev.text,
                    "logprobs": []}, timings))
            for d in ev.tool_calls:
                if d.get("id") is not None:
                    out += self._close_item()
                    at = len(self.items)
                    item = e2a.responses_function_calls([{**d, "arguments": ""}])[0]
                    item["status"] = "in_progress"
                    self._open = item
                    out.append(self._event("response.output_item.added", {"output_index": at, "item": dict(item)}))
                elif self._open is not None and d.get("arguments"):
                    self._open["arguments"] += d["arguments"]
                    out.append(self._event("response.function_call_arguments.delta", {
                        "item_id": self._open["id"], "output_index": at, "delta": d["arguments"]}))
        elif isinstance(ev, Finished):
            self.choices[0].finished = ev
            out += self._close_item()
            status = self._status()
            name = "response.incomplete" if status == "incomplete" else "response.completed"
            out.append(self._event(name, {"response": self._response(status, self.items)},
                                   {"timings": finished_timings(ev)} if self.rreq.timings else None))
        return out

    def _in_progress(self, done: int, total: int, cached: int) -> bytes:
        """A ``response.in_progress`` event with llama-server's ``prompt_progress``."""
        return self._event("response.in_progress", {"response": self._response("in_progress", [])}, {
            "prompt_progress": prompt_progress(done, total, cached, self.started, time.perf_counter())})

    def end_events(self) -> list[bytes]:
        """Nothing after ``response.completed``."""
        return []

    def error_event(self, e: OpenAIError) -> list[bytes]:
        """An ``error`` event, as the Responses stream sends one."""
        return [self._event("error", {"code": e.code, "message": e.message, "param": e.param})]

    # ---- whole -----------------------------------------------------------------------

    def body(self) -> dict[str, Any]:
        """The ``response``."""
        done, text = self.choices[0].done, self.choices[0].whole_text
        output: list[dict[str, Any]] = []
        if text or not done.tool_calls:
            # the message is the cut item when no call follows it
            output.append({"type": "message", "id": "msg_" + uuid.uuid4().hex[:24],
                           "status": "completed" if done.tool_calls else self._status(),
                           "role": "assistant",
                           "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]})
        output += e2a.responses_function_calls(done.tool_calls or [])
        timings = {"timings": finished_timings(done)} if self.rreq.timings else {}
        return {**self._response(self._status(), output), **timings}


def new_response_id() -> str:
    """``resp_`` and 32 hex digits."""
    return "resp_" + uuid.uuid4().hex
