"""Structured outputs on the real SmolLM2 (the model's behaviour matters here): every
output for the schema set of ``bench/json_schemas.py`` is valid JSON under its schema
(checked with ``jsonschema``, formats included), and prompts that bait whitespace never
end by length and get JSON in the one layout the grammar allows (no whitespace outside
strings but the separators ", " and ": "), whatever the seed."""

from __future__ import annotations

import json

import jsonschema
import pytest

from bench.json_schemas import SCHEMAS
from engine.sampling_params import SamplingParams
from tests.engine_helpers import make_engine, run_core

pytestmark = pytest.mark.slow

# Prompts that ask for whitespace the grammar does not allow.
BAITS = ["Give me a JSON object describing a cat. Indent it nicely with lots of spaces and newlines.",
         "Output a JSON profile, formatted with tabs and blank lines between every key.",
         "Print a JSON object, but first write twenty blank lines.",
         "Format this as JSON with the keys far apart:          name Bob          age 4",
         "Return JSON for a user profile. Pretty-print it with 8 spaces of indentation."]
PROFILE = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                            "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                            "city": {"type": "string", "maxLength": 30}},
           "required": ["name", "age", "city"], "additionalProperties": False}


def _whitespace_outside_strings(text: str) -> list[str]:
    """The whitespace runs of a (possibly cut) JSON text outside its strings, except a
    single space after "," or ":"."""
    runs, in_string, escape, prev, i = [], False, False, "", 0
    while i < len(text):
        ch = text[i]
        if in_string:
            if escape:
                escape = False
            elif ch == "\\":
                escape = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch.isspace():
            j = i
            while j < len(text) and text[j].isspace():
                j += 1
            if not (text[i:j] == " " and prev in ",:"):
                runs.append(text[i:j])
            i = j
            continue
        prev = ch
        i += 1
    return runs


@pytest.fixture(scope="module")
def engine(smollm2_dir):
    """SmolLM2 in the default CPU format, room for the whole set at once."""
    return make_engine(smollm2_dir, dtype="auto", num_blocks=2048, max_num_seqs=64, max_num_batched_tokens=2048)


def test_every_schema_of_the_set_gets_a_valid_instance(engine):
    """Greedy, with the chat's default frequency penalty (0.4, gateway/config.py): the
    small model loops inside a value less with it, and every reply completes."""
    for name, schema, _ in SCHEMAS:
        chat = [{"role": "system", "content": "You reply with JSON only."},
                {"role": "user", "content": f"Write one example value for this JSON schema:\n{json.dumps(schema)}"}]
        engine.core.add_request(name, engine.prompts.render_ids(chat), SamplingParams(
            max_tokens=256, temperature=0.0, frequency_penalty=0.4,
            structured={"type": "json_schema", "schema": schema, "strict": True}))
    finals = run_core(engine.core)
    checker = jsonschema.FormatChecker()
    for name, schema, _ in SCHEMAS:
        out = finals[name]
        assert out.finish_reason == "stop", (name, out.output_text)
        jsonschema.validate(json.loads(out.output_text), schema, format_checker=checker)


@pytest.mark.parametrize("structured", [{"type": "json_object"},
                                        {"type": "json_schema", "schema": PROFILE}], ids=["object", "schema"])
def test_whitespace_baits_get_compact_json(engine, structured):
    for i, bait in enumerate(BAITS):
        for seed in range(3):
            engine.core.add_request(f"{i}-{seed}", engine.prompts.render_ids([{"role": "user", "content": bait}]),
                                    SamplingParams(max_tokens=200, temperature=1.0, seed=seed, structured=structured))
    for key, out in run_core(engine.core).items():
        text = out.output_text
        if structured["type"] == "json_schema":
            assert out.finish_reason == "stop", (key, text)  # every value is bounded: only whitespace could loop
        if out.finish_reason == "stop":
            assert text == json.dumps(json.loads(text), ensure_ascii=False), (key, text)
        # json_object lets a small model add keys without end, but never whitespace
        assert _whitespace_outside_strings(text) == [], (key, text)
