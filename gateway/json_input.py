"""Reading JSON from outside (a request body, a socket frame, an imported file): a
nesting limit, and a reason in words (where it broke: line and column) instead of a
Python exception's name. Used by ``gateway.api.validation`` and ``gateway.chat_import``.
"""

from __future__ import annotations

import json
from typing import Any

# Deepest JSON nesting accepted in a body or frame. Real requests nest 4-5 levels (an
# OpenAI message's content parts); the limit keeps recursive code (json, validation,
# Redis serialisation) far from Python's recursion limit.
MAX_JSON_DEPTH = 64


class BadJson(ValueError):
    """A body or frame that is not JSON, or nests deeper than ``MAX_JSON_DEPTH``."""


def json_depth_over(obj: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """True when ``obj`` (decoded JSON) nests lists/objects more than ``limit`` deep.
    Iterative, so it cannot itself hit the recursion limit."""
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def loads_json(data: str | bytes | bytearray, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads`` with a nesting limit.

    Raises:
        BadJson: invalid JSON or UTF-8, or nesting deeper than ``max_depth`` (a body of
            thousands of ``[`` is refused, not a ``RecursionError``).
    """
    try:
        obj = json.loads(data)
    except RecursionError:
        raise BadJson(f"JSON nests deeper than {max_depth} levels") from None
    except json.JSONDecodeError as e:  # where, in words a person reads; never the input itself
        raise BadJson(f"not valid JSON: {e.msg.lower()} at line {e.lineno}, column {e.colno}") from None
    except ValueError:  # UnicodeDecodeError: bytes that are not UTF-8
        raise BadJson("not valid JSON: the bytes are not UTF-8 text") from None
    if json_depth_over(obj, max_depth):
        raise BadJson(f"JSON nests deeper than {max_depth} levels")
    return obj
