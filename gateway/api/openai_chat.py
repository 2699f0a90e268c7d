"""Chat-completions answers: the ``chat.completion`` body and the streamed
``chat.completion.chunk`` events, built from a request's reply events, choice by choice.

Streaming follows OpenAI: a first chunk per choice with the role, then content chunks
(with their tokens' ``logprobs`` when asked), tool calls as ``delta.tool_calls`` (a
call's first entry has its ``index``, ``id``, ``type`` and function name with arguments
"", later ones fragments of the arguments), one chunk per choice with its
``finish_reason``, a ``usage`` chunk with ``stream_options.include_usage``, then
``[DONE]``. The non-streamed body holds the same text, calls and logprobs whole.

A reply's reasoning (the text between its thinking markers, ``gateway/reasoning.py``)
is apart, as vLLM and llama.cpp's server answer: ``reasoning_content`` deltas before the
content, and the message's ``reasoning_content`` (present only when the reply reasoned).

llama-server's extensions (docs/protocol.md, "llama-server's extensions"): with
``timings_per_token`` every chunk after the first carries its ``timings`` object (while
streaming, the gateway's clock and the tokens so far; the finish and usage chunks and the
body, the engine's figures); with ``return_progress`` a chunk with no choices and a
``prompt_progress`` object (``total``, ``cache``, ``processed`` tokens, ``time_ms``) goes
out for each chunk of a long prompt the engine computed, and one with ``processed`` =
``total`` before the first text.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from gateway.api import engine_to_api as e2a
from gateway.api.openai_replies import Delta, Failed, Finished, Progress, ReplyEvent
from gateway.api.openai_request import ChatRequest, OpenAIError
from gateway.api.reply_collect import (
    ChoiceReply,
    CollectingWriter,
    finished_timings,
    live_timings,
    prompt_progress,
)
from gateway.api.sse import json_bytes, sse
from gateway.reasoning import DEFAULT_MARKERS, ReasoningSplitter, ThinkMarkers, split_reasoning


@dataclass
class ChoiceState(ChoiceReply):
    """What one choice wrote so far, the streamed split of its reasoning, and (for live
    ``timings``) when its first text came (``time.perf_counter`` s), its tokens so far and
    its prompt's token counts."""

    think: ReasoningSplitter | None = None
    first_at: float | None = None
    n_tokens: int = 0
    prompt_usage: dict[str, int] | None = None


def usage_of(finished: list[Finished]) -> dict[str, Any]:
    """OpenAI's ``usage`` for a request's choices: the prompt counted once (choice 0's,
    its cached tokens too), the completion tokens of every choice."""
    u0 = finished[0].usage if finished else {}
    prompt = int(u0.get("prompt_tokens", 0))
    completion = sum(int(f.usage.get("completion_tokens", 0)) for f in finished)
    cached, disk = int(u0.get("cached_tokens", 0)), int(u0.get("cached_disk_tokens", 0))
    host = int(u0.get("cached_host_tokens", 0))
    # cached_tokens stays OpenAI's total; the split says where those tokens' KV came from
    # (the engine's pool, its host-memory KV tier or its disk KV tier: docs/kv_tiers.md)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached,
                                      "cached_tokens_by_tier": {"pool": cached - host - disk, "host": host,
                                                                "disk": disk}}}


def openai_error_event(e: OpenAIError) -> list[bytes]:
    """An error after the stream began, as OpenAI sends it (a ``data: {"error"}`` event)."""
    return [sse(json_bytes(e.body()))]


class ChatWriter(CollectingWriter):
    """Builds one chat-completions answer (see module doc).

    Args:
        creq: the request (its ``n``, ``logprobs``, ``include_usage``).
        completion_id: ``chatcmpl-...``.
        model: the served model's name.
        extra_fields: added to the non-streamed body (a linked chat's ``session_id``).
        markers: the reasoning markers (``reasoning_content``).
    """

    def __init__(self, creq: ChatRequest, completion_id: str, model: str,
                 extra_fields: dict[str, Any] | None = None, markers: ThinkMarkers = DEFAULT_MARKERS) -> None:
        self.creq = creq
        self.id = completion_id
        self.model = model
        self.created = int(time.time())
        self.started = time.perf_counter()
        self.extra_fields = extra_fields or {}
        self.markers = markers
        self.choices: list[ChoiceState] = [ChoiceState(think=ReasoningSplitter(markers)) for _ in range(creq.n)]
        self._base: dict[str, Any] = {"id": completion_id, "object": "chat.completion.chunk",
                                      "created": self.created, "model": model, "system_fingerprint": None}
        if creq.include_usage:
            self._base["usage"] = None

    # ---- streaming --------------------------------------------------------------------

    def _chunk(self, index: int, delta: dict[str, Any], finish_reason: str | None = None,
               logprobs: dict[str, Any] | None = None, extra: dict[str, Any] | None = None) -> bytes:
        return sse(json_bytes({**self._base, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                                          "finish_reason": finish_reason}], **(extra or {})}))

    def _live_timings(self, st: ChoiceState, now: float) -> dict[str, Any]:
        """``timings`` while a choice streams: the gateway's clock (prompt: request to first
        text; reply: first text to now) and the engine's token counts so far."""
        return {"timings": live_timings(self.started, st.first_at, st.n_tokens, st.prompt_usage, now)}

    def _progress(self, done: int, total: int, cached: int) -> bytes:
        """A ``prompt_progress`` chunk (no choices), as llama-server's ``return_progress``."""
        return sse(json_bytes({**self._base, "choices": [],
                               "prompt_progress": prompt_progress(done, total, cached, self.started,
                                                                  time.perf_counter())}))

    def start_events(self) -> list[bytes]:
        """The first chunk of each choice: its role (``content`` null: no content delta is
        ever empty, which llama.cpp's clients check)."""
        return [self._chunk(i, {"role": "assistant", "content": None}) for i in range(self.creq.n)]

    def stream_events(self, index: int, ev: ReplyEvent) -> list[bytes]:
        """The chunks for one event of choice ``index`` (and keeps what it needs for ``end_events``)."""
        st = self.choices[index]
        out: list[bytes] = []
        if isinstance(ev, Progress):
            if self.creq.progress and index == 0:  # the choices share one prompt: choice 0 reports it
                out.append(self._progress(ev.done, ev.total, ev.cached))
        elif isinstance(ev, Delta):
            now = time.perf_counter()
            if st.first_at is None:
                st.first_at = now
                st.prompt_usage = ev.prompt_usage
                if self.creq.progress and index == 0 and ev.prompt_usage is not None:
                    total = int(ev.prompt_usage.get("prompt_tokens", 0))
                    out.append(self._progress(total, total, int(ev.prompt_usage.get("cached_tokens", 0))))
            st.n_tokens += ev.n_tokens
            extra = self._live_timings(st, now) if self.creq.timings else None
            lp = e2a.chat_logprobs(ev.logprobs) if self.creq.logprobs and ev.logprobs else None
            reasoning, text = st.think.feed(ev.text) if st.think is not None and ev.text else ("", ev.text)
            if reasoning:
                out.append(self._chunk(index, {"reasoning_content": reasoning}, logprobs=lp, extra=extra))
                lp = None
            if text:
                out.append(self._chunk(index, {"content": text}, logprobs=lp, extra=extra))
                lp = None
            if ev.tool_calls:
                out.append(self._chunk(index, {"tool_calls": e2a.chat_tool_call_deltas(ev.tool_calls)}, logprobs=lp,
                                       extra=extra))
                lp = None
            if lp is not None:  # tokens that showed no text yet (held back, or a call's marker)
                out.append(self._chunk(index, {}, logprobs=lp, extra=extra))
        elif isinstance(ev, Finished):
            st.finished = ev
            extra = {"timings": finished_timings(ev)} if self.creq.timings else None
            reasoning, text = st.think.finish() if st.think is not None else ("", "")
            if reasoning:
                out.append(self._chunk(index, {"reasoning_content": reasoning}, extra=extra))
            if text:
                out.append(self._chunk(index, {"content": text}, extra=extra))
            out.append(self._chunk(index, {}, ev.finish_reason, extra=extra))
        return out

    def end_events(self) -> list[bytes]:
        """After every choice finished: the usage chunk (when asked) and ``[DONE]``."""
        out = []
        if self.creq.include_usage:
            finished = self.finished_choices()
            chunk = {**self._base, "choices": [], "usage": usage_of(finished)}
            if self.creq.timings and finished:
                chunk["timings"] = finished_timings(finished[0])
            out.append(sse(json_bytes(chunk)))
        return out + [sse(b"[DONE]")]

    error_event = staticmethod(openai_error_event)

    # ---- whole -----------------------------------------------------------------------

    def body(self) -> dict[str, Any]:
        """The ``chat.completion`` body, once every choice finished."""
        choices = []
        for i, st in enumerate(self.choices):
            fin = st.done
            reasoning, text = split_reasoning(st.whole_text, self.markers)
            message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
            if reasoning is not None:
                message["reasoning_content"] = reasoning
            if fin.tool_calls:
                message["tool_calls"] = e2a.chat_message_tool_calls(fin.tool_calls)
                if not text:
                    message["content"] = None
            choices.append({"index": i, "message": message,
                            "logprobs": e2a.chat_logprobs(st.logprobs) if self.creq.logprobs else None,
                            "finish_reason": fin.finish_reason})
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": choices, "usage": usage_of(self.finished_choices()),
                **({"timings": finished_timings(self.choices[0].done)} if self.creq.timings else {}),
                **self.extra_fields}


def is_end(ev: ReplyEvent) -> bool:
    """A choice's last event."""
    return isinstance(ev, (Finished, Failed))
