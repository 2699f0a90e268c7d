"""What a request asks its output to be: the ``structured`` sampling parameter, checked.

The wire form (a JSON object, ``SamplingParams.structured``; docs/protocol.md section 1):

- ``{"type": "json_object"}``: any JSON object;
- ``{"type": "json_schema", "schema": {...}, "strict"?: bool}``: a JSON value valid under
  the schema. With ``strict`` (OpenAI's ``strict: true``) a keyword the grammar library
  does not implement is an error; without it such keywords are ignored (best effort, as
  OpenAI treats non-strict schemas);
- ``{"type": "regex", "pattern": str}``: text matching the regular expression (Rust
  ``regex`` syntax, anchored at both ends);
- ``{"type": "grammar", "grammar": str}``: text of a context-free grammar, in the Lark
  syntax of llguidance or in llama.cpp's GBNF (converted).

This module only checks the shape (standard library only: the gateway imports it
without torch); whether the grammar library can compile the schema or grammar is known
when the engine compiles it (``engine.structured.compiler``), which reports the library's
reason as ``invalid_request``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidRequestError
from engine.text_checks import text_error

KINDS = ("json_object", "json_schema", "regex", "grammar")
# A schema or grammar larger than this is refused before any work (bytes of its JSON/text).
MAX_SPEC_BYTES = 256 * 1024
_KEYS = {"json_object": {"type"}, "json_schema": {"type", "schema", "strict", "name", "description"},
         "regex": {"type", "pattern"}, "grammar": {"type", "grammar"}}


@dataclass(frozen=True)
class StructuredOutput:
    """A checked output constraint.

    Attributes:
        kind: one of ``KINDS``.
        schema: the JSON Schema (json_schema), ``{"type": "object"}`` for json_object, else None.
        strict: refuse schema keywords the library does not implement (json_schema).
        pattern: the regular expression (regex).
        grammar: the grammar text, Lark or GBNF (grammar).
    """

    kind: str
    schema: dict[str, Any] | bool | None = None
    strict: bool = False
    pattern: str | None = None
    grammar: str | None = None

    @property
    def is_json(self) -> bool:
        """True for the two JSON kinds (their output is one JSON value)."""
        return self.kind in ("json_object", "json_schema")

    def key(self) -> str:
        """A stable text naming this constraint exactly (the compiler's cache key)."""
        return json.dumps([self.kind, self.schema, self.strict, self.pattern, self.grammar], sort_keys=True,
                          separators=(",", ":"), ensure_ascii=False)


def parse_structured(value: Any, field: str = "structured") -> StructuredOutput | None:
    """Check the wire form of ``structured`` (None passes as None).

    Raises:
        InvalidRequestError: not an object, an unknown ``type`` or key, a field of the wrong
            type, text that is not valid Unicode, or a schema/grammar over ``MAX_SPEC_BYTES``.
    """
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{field} must be an object with a 'type'")
    kind = value.get("type")
    if kind not in KINDS:
        raise InvalidRequestError(f"{field}.type must be one of {', '.join(KINDS)}, got {ascii(kind)[:40]}")
    unknown = sorted(set(value) - _KEYS[kind])
    if unknown:
        raise InvalidRequestError(f"unknown key(s) in {field} of type {kind}: {', '.join(map(ascii, unknown))}"[:300])
    if kind == "json_object":
        return StructuredOutput(kind, schema={"type": "object"})
    if kind == "json_schema":
        schema = value.get("schema")
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError(f"{field}.schema must be a JSON Schema (an object)")
        strict = value.get("strict", False)
        if not isinstance(strict, bool) and strict is not None:
            raise InvalidRequestError(f"{field}.strict must be a boolean")
        try:
            size = len(json.dumps(schema, ensure_ascii=False).encode("utf-8", "surrogatepass"))
        except (TypeError, ValueError, RecursionError):
            raise InvalidRequestError(f"{field}.schema is not a JSON object") from None
        if size > MAX_SPEC_BYTES:
            raise InvalidRequestError(f"{field}.schema is {size} bytes; at most {MAX_SPEC_BYTES} are accepted")
        _check_text(json.dumps(schema, ensure_ascii=False), f"{field}.schema")
        return StructuredOutput(kind, schema=schema, strict=bool(strict))
    name = "pattern" if kind == "regex" else "grammar"
    text = value.get(name)
    if not isinstance(text, str) or not text:
        raise InvalidRequestError(f"{field}.{name} must be a non-empty string")
    if len(text.encode("utf-8", "surrogatepass")) > MAX_SPEC_BYTES:
        raise InvalidRequestError(f"{field}.{name} is longer than {MAX_SPEC_BYTES} bytes")
    _check_text(text, f"{field}.{name}")
    return StructuredOutput(kind, pattern=text) if kind == "regex" else StructuredOutput(kind, grammar=text)


def _check_text(text: str, field: str) -> None:
    message = text_error(text, field)
    if message is not None:
        raise InvalidRequestError(message)
