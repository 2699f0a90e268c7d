"""A request's tools and tool choice, checked (standard library only: the gateway imports it).

Wire form (the ``generate`` frame's ``tools``, ``tool_choice`` and ``parallel_tool_calls``;
docs/protocol.md section 1), OpenAI's chat-completions shapes:

- ``tools``: ``[{"type": "function", "function": {"name", "description"?, "parameters"?,
  "strict"?}}]``; names are 1-64 of ``[A-Za-z0-9_-]`` and distinct; ``parameters`` is a
  JSON Schema of the arguments object (default: any object);
- ``tool_choice``: ``"auto"`` (the model decides: text, or calls), ``"none"`` (text only;
  the tools are left out of the prompt), ``"required"`` (one call at least, no text),
  or ``{"type": "function", "function": {"name": N}}`` (exactly that function);
  default ``"auto"`` with tools, ``"none"`` without;
- ``parallel_tool_calls``: several calls in one reply (default true).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from engine.errors import InvalidRequestError
from engine.structured.spec import MAX_SPEC_BYTES

MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
CHOICES = ("auto", "none", "required")


@dataclass(frozen=True)
class Tool:
    """One function the model may call.

    Attributes:
        name: the function's name.
        description: what it does (shown to the model), may be empty.
        parameters: JSON Schema of its arguments (an object schema).
        strict: refuse schema keywords the grammar library does not implement.
    """

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object"})
    strict: bool = False

    def as_openai(self) -> dict[str, Any]:
        """The tool in OpenAI's shape (what chat templates and prompts are given)."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolRequest:
    """The checked tools of a request.

    Attributes:
        tools: the functions, in the request's order.
        choice: "auto", "none", "required", or "function" (``name`` names it).
        name: the forced function's name when ``choice`` is "function".
        parallel: whether a reply may hold several calls.
    """

    tools: tuple[Tool, ...]
    choice: str = "auto"
    name: str | None = None
    parallel: bool = True

    @property
    def active(self) -> bool:
        """True when the model may call a tool (tools given and the choice is not "none")."""
        return bool(self.tools) and self.choice != "none"

    def callable_tools(self) -> tuple[Tool, ...]:
        """The tools a call may name: the forced one, or all."""
        if self.choice == "function":
            return tuple(t for t in self.tools if t.name == self.name)
        return self.tools


def parse_tools(tools: Any, tool_choice: Any = None, parallel_tool_calls: Any = None) -> ToolRequest | None:
    """Check a request's tool fields; None when it has no tools and no choice but "none".

    Raises:
        InvalidRequestError: a malformed tool, a repeated or bad name, a choice naming no
            given tool, ``required`` or a named choice without tools, or a wrong type.
    """
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise InvalidRequestError("tools must be a list of function tools")
    if len(tools) > MAX_TOOLS:
        raise InvalidRequestError(f"at most {MAX_TOOLS} tools are accepted, got {len(tools)}")
    parsed = tuple(_tool(t, i) for i, t in enumerate(tools))
    names = [t.name for t in parsed]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise InvalidRequestError(f"tool names must be distinct: {', '.join(dup)} appear more than once")
    choice, name = _choice(tool_choice, bool(parsed))
    if name is not None and name not in names:
        raise InvalidRequestError(f"tool_choice names the function {name!r}, which is not among the tools")
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise InvalidRequestError("parallel_tool_calls must be a boolean")
    if not parsed:
        return None
    return ToolRequest(parsed, choice, name, True if parallel_tool_calls is None else parallel_tool_calls)


def _tool(t: Any, i: int) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"), dict):
        raise InvalidRequestError(f'{where} must be {{"type": "function", "function": {{"name": ...}}}}')
    fn = t["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidRequestError(f"{where}.function.name must be 1-64 of letters, digits, '_' and '-', "
                                  f"got {ascii(name)[:70]}")
    description = fn.get("description") or ""
    if not isinstance(description, str):
        raise InvalidRequestError(f"{where}.function.description must be a string")
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object"}
    if not isinstance(params, dict):
        raise InvalidRequestError(f"{where}.function.parameters must be a JSON Schema object")
    try:
        size = len(json.dumps(params, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    except (TypeError, ValueError, RecursionError):
        raise InvalidRequestError(f"{where}.function.parameters is not a JSON object") from None
    if size > MAX_SPEC_BYTES:
        raise InvalidRequestError(f"{where}.function.parameters is {size} bytes; at most {MAX_SPEC_BYTES}")
    strict = fn.get("strict", False)
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequestError(f"{where}.function.strict must be a boolean")
    return Tool(name, description, params, bool(strict))


def _choice(value: Any, have_tools: bool) -> tuple[str, str | None]:
    if value is None:
        return ("auto" if have_tools else "none"), None
    if isinstance(value, str):
        if value not in CHOICES:
            raise InvalidRequestError(f"tool_choice must be one of {', '.join(CHOICES)} or a named function, "
                                      f"got {ascii(value)[:40]}")
        if value == "required" and not have_tools:
            raise InvalidRequestError("tool_choice 'required' needs tools")
        return value, None
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict):
        name = value["function"].get("name")
        if not isinstance(name, str):
            raise InvalidRequestError("tool_choice.function.name must be a string")
        if not have_tools:
            raise InvalidRequestError("tool_choice names a function but no tools were given")
        return "function", name
    raise InvalidRequestError('tool_choice must be "auto", "none", "required" or '
                              '{"type": "function", "function": {"name": ...}}')
