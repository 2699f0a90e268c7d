"""The grammar a tool-using reply is held to (llguidance's Lark syntax).

Every call is ``{"name": N, "<args_key>": ARGS}`` between the format's markers, with N
one of the callable tools and ARGS valid under that tool's ``parameters`` schema (an
embedded ``%json``), so a call always parses and matches its schema. By choice:

- ``auto``: free text, or (from the first call marker on) calls only. The free text is a
  lazy lexeme that ends at the first marker, so the grammar costs nothing until the
  model writes the marker, and from there on every byte is constrained: the lazy grammar
  "triggered" by the call marker that llama.cpp and vLLM use. For ``llama3_json`` the
  marker is the ``{`` that opens the reply (a text reply must not start with one).
  With a JSON response format as well, the text alternative is that JSON instead;
- ``required``: one call or more, nothing before;
- a named function: exactly one call of it.

``parallel`` allows further calls after the first, each after the format's separator;
after the last call only the end of the reply may follow.
"""

from __future__ import annotations

import json

from engine.structured.compiler import schema_with_layout
from engine.structured.spec import StructuredOutput
from engine.tools.formats import ToolFormat
from engine.tools.spec import ToolRequest


def _lit(text: str) -> str:
    """A Lark string literal for ``text``."""
    return json.dumps(text, ensure_ascii=False)


def tool_grammar(tools: ToolRequest, fmt: ToolFormat, content: StructuredOutput | None = None) -> str:
    """The Lark grammar of a reply to a request with active tools.

    Args:
        tools: the request's tools (``tools.active`` must be True).
        fmt: the model's tool format.
        content: a JSON response format the text alternative of ``auto`` must follow, or None.

    Returns:
        Lark text for ``llguidance.LLMatcher.grammar_from_lark``.

    Raises:
        ValueError: no callable tool (``tools.active`` False), or ``content`` not a JSON kind.
    """
    callable_tools = tools.callable_tools()
    if not tools.active or not callable_tools:
        raise ValueError("tool_grammar needs active tools")
    if content is not None and not content.is_json:
        raise ValueError("only a JSON response format combines with tools")
    lines = ["%llguidance {}"]
    fns = []
    for i, tool in enumerate(callable_tools):
        schema = schema_with_layout(tool.parameters, tool.strict)
        head = f'{{"name": {json.dumps(tool.name)}, "{fmt.args_key}": '
        lines.append(f"fn_{i}: {_lit(head)} args_{i} \"}}\"")
        lines.append(f"args_{i}: %json {json.dumps(schema, ensure_ascii=False)}")
        fns.append(f"fn_{i}")
    body = " | ".join(fns)
    end = f" {_lit(fmt.call_end)}" if fmt.call_end else ""
    marker = fmt.call_start.rstrip("\n")  # the trigger; its trailing newline starts the body
    after_marker = fmt.call_start[len(marker):]
    lines.append(f"call_body: {_lit(after_marker) + ' ' if after_marker else ''}({body}){end}")
    lines.append(f"call: {_lit(marker) + ' ' if marker else ''}call_body")
    more = f" ({_lit(fmt.separator)} call)*" if tools.parallel and tools.choice != "function" else ""
    if tools.choice == "auto":
        if content is not None:
            assert content.schema is not None
            lines.append(f"text: %json {json.dumps(schema_with_layout(content.schema, content.strict))}")
            lines.append(f"start: text | call{more}")
        elif fmt.at_start_only or not marker:
            # the reply is a call when it opens with "{", else text that does not
            lines.append("TEXT: /([^{](.|\\n)*)?/")
            lines.append(f"start: TEXT | call{more}")
        else:
            lines.append("TEXT: /(.|\\n)*/")
            lines.append(f"head[lazy]: /(.|\\n)*{_regex_escape(marker)}/")
            lines.append(f"start: TEXT | head call_body{more}")
    else:
        lines.append(f"start: call{more}")
    return "\n".join(lines) + "\n"


def _regex_escape(text: str) -> str:
    """``text`` as a literal inside a Lark ``/.../`` regex (Rust regex syntax)."""
    out = []
    for ch in text:
        if ch in "\\.+*?()|[]{}^$#&-~/":
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        else:
            out.append(ch)
    return "".join(out)
