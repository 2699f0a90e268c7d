"""The legacy OpenAI completions API: ``POST /v1/completions`` (docs/protocol.md section 4).

A raw prompt (no chat template): a string, a list of token ids, or a list of either
(each prompt its own ``n`` choices, choice index ``prompt * n + j``), sent to the engine
as ``prompt`` / ``prompt_token_ids`` (protocol 7). ``logprobs`` (0-20 alternatives) in
the completions layout (``tokens``, ``token_logprobs``, ``top_logprobs``,
``text_offset``); ``echo`` puts the prompt before the reply's text (and, with
``logprobs``, the prompt's tokens before the reply's, the first one's logprob null).
``max_tokens`` defaults to 16, as OpenAI documents it. ``suffix`` (insertion) is refused;
``best_of`` only equal to ``n``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from gateway.api import api_to_engine as a2e
from gateway.api import engine_to_api as e2a
from gateway.api.openai_chat import openai_error_event, usage_of
from gateway.api.openai_replies import Delta, Finished, ReplyEvent
from gateway.api.openai_request import (
    IGNORED_FIELDS,
    NUMERIC_FIELDS,
    bad,
    check_body,
    check_text,
    sampling_fields,
)
from gateway.api.reply_collect import ChoiceReply, CollectingWriter
from gateway.api.sse import json_bytes, sse

DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for this API

KNOWN_FIELDS = frozenset({
    "model", "prompt", "suffix", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "logprobs",
    "echo", "stop", "presence_penalty", "frequency_penalty", "best_of", "logit_bias", "seed", "top_k", "min_p",
    "repetition_penalty", "ignore_eos", "response_format", "guided_json", "guided_regex", "guided_grammar",
    "guided_choice", "json_schema", "grammar",
}) | IGNORED_FIELDS


@dataclass(frozen=True)
class CompletionRequest:
    """A validated completions request.

    Attributes:
        prompts: one ``generate`` prompt field per prompt (``{"prompt": text}`` or
            ``{"prompt_token_ids": ids}``).
        model: the requested model name, or None.
        params: engine ``SamplingParams`` keys (``max_tokens`` always set).
        n: choices per prompt (1-8).
        logprobs: the number of alternatives per token, or None for no logprobs.
        echo: the prompt comes before the reply's text.
        stream, include_usage: as for chat completions.
    """

    prompts: list[dict[str, Any]]
    model: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    n: int = 1
    logprobs: int | None = None
    echo: bool = False
    stream: bool = False
    include_usage: bool = False


def parse_completion_request(body: Any) -> CompletionRequest:
    """Validate a decoded ``/v1/completions`` body.

    Raises:
        OpenAIError: 400 naming the first bad or unsupported field.
    """
    head = check_body(body, KNOWN_FIELDS, flags=("stream", "echo"), stream_options=True)
    body = head.body
    if body.get("suffix"):
        raise bad("'suffix' (insertion) is not supported by this server", "suffix")
    try:
        prompts = a2e.completion_prompts(body.get("prompt"))
        n = a2e.choice_count(body.get("n"))
        best_of = body.get("best_of")
        if best_of is not None and best_of not in (1, n):
            raise a2e.FieldError("best_of", "best_of must equal n (candidates are not ranked here)")
        if len(prompts) * n > 8 * 8:
            raise a2e.FieldError("prompt", "at most 64 prompts times choices per request")
        features = a2e.completion_logprob_params(body.get("logprobs"))
        features.update(a2e.logit_bias_param(body.get("logit_bias")))
        structured = a2e.structured_from_response_format(body.get("response_format"))
        ext = a2e.structured_from_extensions(body)
        if ext is not None:
            structured = ext[1]
        if structured is not None:
            features["structured"] = structured
    except a2e.FieldError as e:
        raise bad(e.message, e.param) from None
    for p in prompts:
        if "prompt" in p:
            check_text(p["prompt"], "prompt")
    sampling = {k: v for k, v in body.items() if k in NUMERIC_FIELDS or k in ("stop", "ignore_eos")}
    params = {"max_tokens": DEFAULT_MAX_TOKENS, **sampling_fields(sampling), **features}
    echo = bool(body.get("echo"))
    logprobs = features.get("logprobs")
    if echo and (logprobs is not None or any("prompt_token_ids" in p for p in prompts)):
        # the prompt's own tokens: their logprobs, and the text of a prompt of ids
        params["prompt_logprobs"] = logprobs or 0
    return CompletionRequest(prompts, head.model, params, n, logprobs, echo, head.stream, head.include_usage)


@dataclass
class _Choice(ChoiceReply):
    sent_echo: bool = False  # streamed: the echoed prompt went out


def _entries_text(entries: list[dict[str, Any]]) -> str:
    """The text of a run of logprob entries (their bytes, decoded together)."""
    return bytes(b for e in entries for b in (e.get("bytes") or [])).decode("utf-8", errors="replace")


class CompletionWriter(CollectingWriter):
    """Builds one completions answer from the engine's events (``openai_api.Writer``).

    Args:
        creq: the request.
        completion_id: ``cmpl-...``.
        model: the served model's name.
    """

    def __init__(self, creq: CompletionRequest, completion_id: str, model: str) -> None:
        self.creq = creq
        self.id = completion_id
        self.model = model
        self.created = int(time.time())
        self.choices: list[_Choice] = [_Choice() for _ in range(len(creq.prompts) * creq.n)]

    def _prompt_text(self, index: int, st: _Choice) -> str:
        p = self.creq.prompts[index // self.creq.n]
        if "prompt" in p:
            return str(p["prompt"])
        return _entries_text(st.prompt_logprobs or [])

    def _logprobs(self, st: _Choice, entries: list[dict[str, Any]], offset: int,
                  with_prompt: bool) -> dict[str, Any] | None:
        if self.creq.logprobs is None:
            return None
        lead = (st.prompt_logprobs or []) if with_prompt else []
        return e2a.completion_logprobs([*lead, *entries], offset)

    def _chunk(self, index: int, text: str, logprobs: dict[str, Any] | None, finish: str | None) -> bytes:
        return sse(json_bytes({"id": self.id, "object": "text_completion", "created": self.created,
                               "model": self.model, "system_fingerprint": None,
                               "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                            "finish_reason": finish}]}))

    def start_events(self) -> list[bytes]:
        """Nothing before the first text."""
        return []

    def stream_events(self, index: int, ev: ReplyEvent) -> list[bytes]:
        """A chunk per event with text (the first of an echoed choice starts with the prompt)."""
        st = self.choices[index]
        if isinstance(ev, Delta):
            if ev.prompt_logprobs is not None:
                st.prompt_logprobs = ev.prompt_logprobs
            echo = ""
            if self.creq.echo and not st.sent_echo:
                echo, st.sent_echo = self._prompt_text(index, st), True
            offset = sum(len(t) for t in st.text)
            st.text.append(echo + ev.text)
            if not (echo or ev.text or ev.logprobs):
                return []
            return [self._chunk(index, echo + ev.text, self._logprobs(st, ev.logprobs, offset, bool(echo)), None)]
        if isinstance(ev, Finished):
            st.finished = ev
            out = []
            if self.creq.echo and not st.sent_echo:  # a reply of no tokens still shows its prompt
                st.sent_echo = True
                out.append(self._chunk(index, self._prompt_text(index, st),
                                       self._logprobs(st, [], 0, True), None))
            return out + [self._chunk(index, "", None, ev.finish_reason)]
        return []

    def end_events(self) -> list[bytes]:
        """The usage chunk (when asked), then ``[DONE]``."""
        out = []
        if self.creq.include_usage:
            out.append(sse(json_bytes({"id": self.id, "object": "text_completion", "created": self.created,
                                       "model": self.model, "choices": [],
                                       "usage": self._usage(self.finished_choices())})))
        return out + [sse(b"[DONE]")]

    def _usage(self, done: list[Finished]) -> dict[str, Any]:
        # each prompt counted once (the first choice of each), every choice's completion
        per_prompt = [self.choices[i * self.creq.n].finished for i in range(len(self.creq.prompts))]
        u = usage_of(done)
        prompt = sum(int(f.usage.get("prompt_tokens", 0)) for f in per_prompt if f is not None)
        u["prompt_tokens"] = prompt
        u["total_tokens"] = prompt + u["completion_tokens"]
        return u

    error_event = staticmethod(openai_error_event)

    def body(self) -> dict[str, Any]:
        """The ``text_completion`` body."""
        choices = []
        for i, st in enumerate(self.choices):
            echo = self._prompt_text(i, st) if self.creq.echo else ""
            choices.append({"index": i, "text": echo + st.whole_text,
                            "logprobs": self._logprobs(st, st.logprobs, 0, self.creq.echo),
                            "finish_reason": st.done.finish_reason})
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": choices, "usage": self._usage(self.finished_choices())}
