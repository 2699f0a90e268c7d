"""A set of JSON Schemas of the kinds API clients send, each with one valid instance.

Written for this project (not taken from a test suite): the shapes that agent
frameworks, the ``openai`` SDK's ``parse`` (Pydantic models: ``title``, ``$defs``,
``anyOf`` with null for optional fields) and OpenAI's strict mode (every property
required, ``additionalProperties: false``) produce, plus the keywords a constrained
decoder must honour: types, ``enum``/``const``, nested objects and arrays, string and
array lengths, numeric bounds, ``pattern``, ``format``, ``anyOf``/``oneOf``/``allOf``,
``$ref`` (also recursive). ``bench/structured.py`` times grammar compilation and the
per-token mask over them; ``tests/engine/test_structured_outputs.py`` decodes each and
validates every output with ``jsonschema``.

Each instance lists its properties in the schema's order and prints with
``json.dumps`` defaults (", " and ": "), the layout the engine's JSON grammar allows.
"""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]


def _obj(props: dict[str, Any], required: list[str] | None = None, strict: bool = False, **extra: Any) -> Schema:
    """An object schema; ``strict`` is OpenAI's strict form (all required, no extras)."""
    s: Schema = {"type": "object", "properties": props}
    if strict:
        s["required"] = list(props)
        s["additionalProperties"] = False
    elif required is not None:
        s["required"] = required
    s.update(extra)
    return s


_ADDRESS = _obj({"street": {"type": "string"}, "city": {"type": "string"},
                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, strict=True)

# (name, schema, one valid instance)
SCHEMAS: list[tuple[str, Schema, Any]] = [
    ("flat_person", _obj({"name": {"type": "string"}, "age": {"type": "integer"}}, ["name", "age"]),
     {"name": "Ada", "age": 36}),
    ("strict_weather_args", _obj({"city": {"type": "string"}, "unit": {"type": "string",
                                                                      "enum": ["celsius", "fahrenheit"]}},
                                 strict=True),
     {"city": "Paris", "unit": "celsius"}),
    ("booleans_and_null", _obj({"ok": {"type": "boolean"}, "note": {"type": "null"}}, ["ok", "note"]),
     {"ok": True, "note": None}),
    ("number_bounds", _obj({"score": {"type": "number", "minimum": 0, "maximum": 1},
                            "count": {"type": "integer", "minimum": 1, "maximum": 100}}, ["score", "count"]),
     {"score": 0.75, "count": 12}),
    ("exclusive_bounds", _obj({"t": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}}, ["t"]),
     {"t": 5}),
    ("string_lengths", _obj({"code": {"type": "string", "minLength": 3, "maxLength": 8},
                             "tag": {"type": "string", "maxLength": 12}}, ["code", "tag"]),
     {"code": "ABC12", "tag": "short"}),
    ("pattern_phone", _obj({"phone": {"type": "string", "pattern": "^\\+?[0-9]{7,12}$"}}, ["phone"]),
     {"phone": "+33123456789"}),
    ("format_date", _obj({"day": {"type": "string", "format": "date"}}, ["day"]), {"day": "2024-05-17"}),
    ("format_datetime_email", _obj({"at": {"type": "string", "format": "date-time"},
                                    "email": {"type": "string", "format": "email"}}, ["at", "email"]),
     {"at": "2024-05-17T10:20:30Z", "email": "ada@example.com"}),
    ("format_uuid", _obj({"id": {"type": "string", "format": "uuid"}}, ["id"]),
     {"id": "123e4567-e89b-12d3-a456-426614174000"}),
    ("enum_priority", _obj({"priority": {"enum": ["low", "medium", "high"]}}, ["priority"]), {"priority": "high"}),
    ("const_version", _obj({"version": {"const": 2}, "kind": {"const": "event"}}, ["version", "kind"]),
     {"version": 2, "kind": "event"}),
    ("array_of_strings", _obj({"tags": {"type": "array", "items": {"type": "string"},
                                        "minItems": 1, "maxItems": 4}}, ["tags"]),
     {"tags": ["a", "b"]}),
    ("array_of_numbers", {"type": "array", "items": {"type": "number"}, "minItems": 2, "maxItems": 5},
     [1.5, 2, 3.25]),
    ("array_of_objects", _obj({"items": {"type": "array", "items": _obj(
        {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}}, strict=True), "maxItems": 3}},
        strict=True),
     {"items": [{"sku": "X1", "qty": 2}, {"sku": "Y2", "qty": 1}]}),
    ("nested_address", _obj({"name": {"type": "string"}, "address": _ADDRESS}, strict=True),
     {"name": "Ada", "address": {"street": "1 Main St", "city": "Paris", "zip": "75001"}}),
    ("deep_nesting", _obj({"a": _obj({"b": _obj({"c": _obj({"d": {"type": "integer"}}, ["d"])}, ["c"])}, ["b"])},
                          ["a"]),
     {"a": {"b": {"c": {"d": 4}}}}),
    ("optional_fields", _obj({"title": {"type": "string"}, "subtitle": {"type": "string"},
                              "pages": {"type": "integer"}}, ["title"]),
     {"title": "Dune", "pages": 412}),
    ("pydantic_optional", {"title": "Movie", "type": "object", "properties": {
        "title": {"title": "Title", "type": "string"},
        "year": {"title": "Year", "anyOf": [{"type": "integer"}, {"type": "null"}]},
        "rating": {"title": "Rating", "anyOf": [{"type": "number"}, {"type": "null"}]}},
        "required": ["title", "year", "rating"], "additionalProperties": False},
     {"title": "Alien", "year": 1979, "rating": None}),
    ("pydantic_defs", {"title": "Order", "type": "object", "$defs": {
        "Line": {"title": "Line", "type": "object", "properties": {
            "product": {"title": "Product", "type": "string"}, "price": {"title": "Price", "type": "number"}},
            "required": ["product", "price"], "additionalProperties": False},
        "Status": {"title": "Status", "enum": ["open", "paid", "shipped"], "type": "string"}},
        "properties": {"id": {"title": "Id", "type": "integer"},
                       "lines": {"title": "Lines", "type": "array", "items": {"$ref": "#/$defs/Line"}},
                       "status": {"$ref": "#/$defs/Status"}},
        "required": ["id", "lines", "status"], "additionalProperties": False},
     {"id": 7, "lines": [{"product": "pen", "price": 1.2}], "status": "paid"}),
    ("any_of_shapes", {"anyOf": [_obj({"circle": {"type": "number"}}, strict=True),
                                 _obj({"square": {"type": "number"}}, strict=True)]},
     {"square": 2}),
    ("one_of_tagged", {"oneOf": [_obj({"kind": {"const": "cat"}, "lives": {"type": "integer"}}, strict=True),
                                 _obj({"kind": {"const": "dog"}, "breed": {"type": "string"}}, strict=True)]},
     {"kind": "dog", "breed": "collie"}),
    ("all_of_merge", {"allOf": [_obj({"a": {"type": "integer"}}, ["a"]), _obj({"b": {"type": "string"}}, ["b"])]},
     {"a": 1, "b": "x"}),
    ("type_union", _obj({"v": {"type": ["string", "integer"]}}, ["v"]), {"v": 3}),
    ("recursive_tree", {"$defs": {"node": _obj({"value": {"type": "integer"}, "children": {
        "type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}}, ["value", "children"])},
        "$ref": "#/$defs/node"},
     {"value": 1, "children": [{"value": 2, "children": []}]}),
    ("additional_properties_schema", {"type": "object", "additionalProperties": {"type": "integer"}},
     {"x": 1, "y": 2}),
    ("free_object", {"type": "object"}, {"anything": [1, "two", {"three": None}]}),
    ("unicode_strings", _obj({"city": {"type": "string"}, "greeting": {"type": "string"}}, strict=True),
     {"city": "Zürich", "greeting": "こんにちは"}),
    ("tool_search", _obj({"query": {"type": "string", "description": "What to look for"},
                          "top_k": {"type": "integer", "minimum": 1, "maximum": 20},
                          "filters": _obj({"site": {"type": "string"}, "after": {"type": "string",
                                                                                 "format": "date"}}, [])},
                         ["query"]),
     {"query": "radix tree", "top_k": 5, "filters": {"site": "arxiv.org"}}),
    ("tool_calendar", _obj({"title": {"type": "string"}, "start": {"type": "string", "format": "date-time"},
                            "duration_min": {"type": "integer", "minimum": 5},
                            "attendees": {"type": "array", "items": {"type": "string", "maxLength": 40}}},
                           strict=True),
     {"title": "Sync", "start": "2024-06-01T09:00:00Z", "duration_min": 30, "attendees": ["Ada", "Alan"]}),
    ("classification", _obj({"label": {"enum": ["positive", "negative", "neutral"]},
                             "confidence": {"type": "number", "minimum": 0, "maximum": 1},
                             "reasons": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
                            strict=True),
     {"label": "neutral", "confidence": 0.5, "reasons": ["mixed"]}),
    ("extraction_people", _obj({"people": {"type": "array", "items": _obj(
        {"name": {"type": "string"}, "role": {"type": ["string", "null"]}}, strict=True)}}, strict=True),
     {"people": [{"name": "Ada", "role": None}, {"name": "Alan", "role": "reviewer"}]}),
    ("matrix", _obj({"rows": {"type": "array", "items": {"type": "array", "items": {"type": "integer"},
                                                          "minItems": 2, "maxItems": 2}, "maxItems": 3}},
                    ["rows"]),
     {"rows": [[1, 2], [3, 4]]}),
    ("string_enum_array", {"type": "array", "items": {"enum": ["red", "green", "blue"]}}, ["red", "blue"]),
    ("wide_object", _obj({f"field_{i}": {"type": "integer"} for i in range(12)}, strict=True),
     {f"field_{i}": i for i in range(12)}),
    ("top_level_string", {"type": "string", "maxLength": 20}, "just a string"),
    ("top_level_integer", {"type": "integer", "minimum": -5, "maximum": 5}, -3),
]
