"""The engine's reply items in the shapes the APIs answer with: tool calls (OpenAI chat
chunks and messages, Responses ``function_call`` items, Anthropic ``tool_use`` blocks and
their streamed ``input_json_delta``), logprobs (chat's ``logprobs.content`` and the
legacy completions layout) and finish reasons.

Pure functions over the engine's wire dicts (docs/protocol.md section 1: a tool-call
delta ``{"index", "id"?, "name"?, "arguments"}``, a whole call ``{"index", "id", "name",
"arguments"}``, a logprob entry ``{"token_id", "token", "bytes", "logprob", "top"}``),
torch-free, with no dependency on other gateway modules.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

# engine finish reason -> Anthropic stop_reason ("error": the engine could not go on)
_ANTHROPIC_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn",
                   "error": "end_turn"}


def chat_tool_call_deltas(deltas: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Engine tool-call deltas as a chat chunk's ``delta.tool_calls``: a call's first
    entry carries ``index``, ``id``, ``type`` and the function name (arguments ""), later
    ones ``index`` and an arguments fragment, as OpenAI streams them; consecutive
    fragments of one call (one engine item) are merged into one entry."""
    out: list[dict[str, Any]] = []
    for d in deltas:
        if d.get("id") is not None:
            out.append({"index": d["index"], "id": d["id"], "type": "function",
                        "function": {"name": d.get("name", ""), "arguments": d.get("arguments", "")}})
        elif out and out[-1]["index"] == d["index"] and "id" not in out[-1]:
            out[-1]["function"]["arguments"] += d.get("arguments", "")
        else:
            out.append({"index": d["index"], "function": {"arguments": d.get("arguments", "")}})
    return out


def chat_message_tool_calls(calls: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """A reply's whole calls as a chat message's ``tool_calls``."""
    return [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in calls]


def responses_function_calls(calls: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """A reply's whole calls as Responses API ``function_call`` output items."""
    return [{"type": "function_call", "id": f"fc_{c['id'].removeprefix('call_')}", "call_id": c["id"],
             "name": c["name"], "arguments": c["arguments"], "status": "completed"} for c in calls]


def anthropic_tool_use_blocks(calls: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """A reply's whole calls as Anthropic ``tool_use`` content blocks (``input`` parsed;
    the arguments of a call cut short, which do not parse, as ``{}``)."""
    out = []
    for c in calls:
        try:
            args = json.loads(c["arguments"])
        except ValueError:
            args = {}
        out.append({"type": "tool_use", "id": "toolu_" + c["id"].removeprefix("call_"), "name": c["name"],
                    "input": args})
    return out


def anthropic_tool_use_events(delta: dict[str, Any], block_index: int) -> list[dict[str, Any]]:
    """One engine tool-call delta as Anthropic stream events: a call's first delta starts
    a ``tool_use`` block at ``block_index`` (the caller counts blocks and stops the
    previous one), later ones are ``input_json_delta`` fragments of it."""
    if delta.get("id") is not None:
        return [{"type": "content_block_start", "index": block_index, "content_block": {
            "type": "tool_use", "id": "toolu_" + delta["id"].removeprefix("call_"), "name": delta.get("name", ""),
            "input": {}}}]
    if not delta.get("arguments"):
        return []
    return [{"type": "content_block_delta", "index": block_index,
             "delta": {"type": "input_json_delta", "partial_json": delta["arguments"]}}]


def anthropic_stop_reason(finish_reason: str, stop_reason: Any = None) -> str:
    """The engine's finish reason as Anthropic's ``stop_reason`` (a matched stop string is
    ``stop_sequence``)."""
    if finish_reason == "stop" and isinstance(stop_reason, str):
        return "stop_sequence"
    return _ANTHROPIC_STOP.get(finish_reason, "end_turn")


def chat_logprobs(entries: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Engine logprob entries as a chat choice's ``logprobs``: ``{"content": [{"token",
    "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``."""
    def one(e: dict[str, Any]) -> dict[str, Any]:
        return {"token": e["token"], "logprob": e["logprob"], "bytes": e["bytes"]}

    return {"content": [{**one(e), "top_logprobs": [one(t) for t in e.get("top", [])]} for e in entries]}


def completion_logprobs(entries: Iterable[dict[str, Any]], text_offset: int = 0) -> dict[str, Any]:
    """Engine logprob entries in the completions API's layout: parallel lists ``tokens``,
    ``token_logprobs``, ``top_logprobs`` (one ``{token: logprob}`` per position) and
    ``text_offset`` (characters from ``text_offset``, the start of this chunk's text).
    With ``echo``, the prompt's entries come first (the engine's ``prompt_logprobs``):
    its first token has logprob and alternatives null, as OpenAI shows it."""
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    at = text_offset
    for e in entries:
        tokens.append(e["token"])
        values.append(e["logprob"])
        tops.append(None if e["logprob"] is None else {t["token"]: t["logprob"] for t in e.get("top", [])})
        offsets.append(at)
        at += len(bytes(e["bytes"]).decode("utf-8", errors="replace")) if e.get("bytes") else len(e["token"])
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}
