"""How a model writes tool calls, and how tools and past calls reach its prompt.

Three formats (docs/structured.md, "Tool calls"):

- ``hermes``: the chat template renders the tools and past calls itself, and the model
  writes each call as ``<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>``,
  calls separated by a newline (Qwen2.5, Hermes 2/3 and others whose template has
  ``<tool_call>``);
- ``llama3_json``: the template renders the tools (Llama 3.1 and later, whose template
  has ``<|python_tag|>``), and the reply is the call itself,
  ``{"name": N, "parameters": {...}}``, calls separated by ``"; "``;
- ``generic``: for templates without tool support (SmolLM2's): the engine describes the
  tools in a system message of its own (``GENERIC_INSTRUCTIONS``), writes past calls into
  the assistant's text and tool results into a user turn, in the ``hermes`` layout.

The format is read from the chat template once (``tool_format_for``). Whatever the format,
the call's JSON is constrained by the engine's grammar (``engine.tools.grammar``), so the
layout written here is exactly what the model is held to.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine.tools.spec import Tool, ToolRequest


@dataclass(frozen=True)
class ToolFormat:
    """One way of writing calls.

    Attributes:
        name: "hermes", "llama3_json" or "generic".
        native: the chat template renders tools, calls and tool results itself.
        call_start, call_end: the text around one call's JSON object.
        separator: the text between two calls of one reply.
        args_key: the key of the arguments object ("arguments" or "parameters").
        at_start_only: a call may only open the reply (no text before it).
    """

    name: str
    native: bool
    call_start: str
    call_end: str
    separator: str
    args_key: str
    at_start_only: bool = False

    def call_prefix(self, name: str) -> str:
        """The call's text before its arguments: start marker, then the JSON up to the
        arguments' value (our fixed layout: name first, ", " and ": " separators)."""
        return f'{self.call_start}{{"name": {json.dumps(name)}, "{self.args_key}": '

    def render_call(self, name: str, arguments: str) -> str:
        """One call's whole text (``arguments``: the arguments' JSON text)."""
        return f"{self.call_prefix(name)}{arguments}}}{self.call_end}"


HERMES = ToolFormat("hermes", True, "<tool_call>\n", "\n</tool_call>", "\n", "arguments")
LLAMA3_JSON = ToolFormat("llama3_json", True, "", "", "; ", "parameters", at_start_only=True)
GENERIC = ToolFormat("generic", False, "<tool_call>\n", "\n</tool_call>", "\n", "arguments")
FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON, GENERIC)}

# Our own wording of the generic format's instructions (a system message).
GENERIC_INSTRUCTIONS = """You can call functions to answer. Each function is described by a JSON schema:
<tools>
{tools}
</tools>
To call a function, write a JSON object with its name and its arguments between <tool_call> and \
</tool_call> tags, and nothing else:
<tool_call>
{{"name": "function_name", "arguments": {{"argument": "value"}}}}
</tool_call>
Use one block per call. The results come back between <tool_response> and </tool_response> tags; \
answer the user with them."""


def tool_format_for(chat_template: str | None) -> ToolFormat:
    """The format a chat template implies (``generic`` when it does not render tools)."""
    t = chat_template or ""
    if "tools" not in t:
        return GENERIC
    if "<tool_call>" in t:
        return HERMES
    if "<|python_tag|>" in t:
        return LLAMA3_JSON
    return GENERIC


def generic_system_text(tools: tuple[Tool, ...]) -> str:
    """The generic format's tool instructions for ``tools``."""
    lines = "\n".join(json.dumps(t.as_openai(), ensure_ascii=False) for t in tools)
    return GENERIC_INSTRUCTIONS.format(tools=lines)


def template_messages(messages: list[dict[str, Any]], fmt: ToolFormat,
                      tools: ToolRequest | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and ``tools`` argument to give the chat template.

    Args:
        messages: checked messages (``engine.prompt.validate_messages``): roles system,
            user, assistant (with optional ``tool_calls``: ``[{"id", "name", "arguments"}]``,
            arguments as JSON text) and tool (with ``tool_call_id``).
        fmt: the model's tool format.
        tools: the request's tools, or None; with ``choice`` "none" they are left out.

    Returns:
        ``(messages, tools)``: for a native format the messages in the shape Hugging Face
        templates take (calls as ``{"type": "function", "function": {"name", "arguments":
        dict}}``) and the tools in OpenAI's shape; for the generic format plain
        system/user/assistant messages (calls written into the assistant's text, results
        into a user turn, the instructions in the first system message) and None.
    """
    active = tools.tools if tools is not None and tools.choice != "none" else ()
    if fmt.native:
        out = [_native(m) for m in messages]
        return out, ([t.as_openai() for t in active] if active else None)
    out = []
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        elif m["role"] == "assistant" and m.get("tool_calls"):
            calls = fmt.separator.join(fmt.render_call(c["name"], c["arguments"]) for c in m["tool_calls"])
            text = m.get("content") or ""
            out.append({"role": "assistant", "content": f"{text}\n{calls}" if text else calls})
        else:
            out.append({"role": m["role"], "content": m["content"] or ""})
    for m in out:
        m.pop("_tool_results", None)
    if active:
        text = generic_system_text(active)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{text}" if out[0]["content"] else text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out, None


def _native(m: dict[str, Any]) -> dict[str, Any]:
    """One checked message in the shape Hugging Face chat templates read."""
    out: dict[str, Any] = {"role": m["role"], "content": m.get("content") or ""}
    if m["role"] == "tool":
        if m.get("tool_call_id"):
            out["tool_call_id"] = m["tool_call_id"]
        if m.get("name"):
            out["name"] = m["name"]
    if m.get("tool_calls"):
        out["tool_calls"] = [{"id": c["id"], "type": "function",
                              "function": {"name": c["name"], "arguments": _arguments(c["arguments"])}}
                             for c in m["tool_calls"]]
    return out


def _arguments(text: str) -> Any:
    """Arguments as a dict where they parse (templates print them with ``tojson``)."""
    try:
        return json.loads(text)
    except ValueError:
        return text
