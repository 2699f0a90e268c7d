"""Constrained decoding in the engine, on the tiny random Llama with SmolLM2's tokenizer:
the grammar mask holds on every sampling path, speculative decoding keeps the output of
decoding without it (drafts the grammar forbids are never verified, the matcher rolls
back exactly), forced tokens are taken without sampling, a schema the library cannot
compile is refused with its reason, and a dead end ends the reply with finish reason
``error`` (never NaN logits)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from engine.structured.compiler import GrammarCompiler
from engine.structured.masks import MaskFiller, allowed_by_shifts, allowed_matrix
from engine.structured.spec import parse_structured
from engine.structured.vocab import Vocabulary
from tests.engine_helpers import make_engine, run_core

DIGITS = {"type": "regex", "pattern": "[0-9]{6}"}
ENUMS = {"type": "json_schema", "schema": {
    "type": "object", "properties": {
        "tags": {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]}, "minItems": 3, "maxItems": 10},
        "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["tags", "n"], "additionalProperties": False}}
# the JSON the prompt repeats, so that prompt lookup proposes drafts while the reply copies it
EXAMPLE = '{"tags": ["alpha", "beta", "gamma", "alpha", "beta", "gamma"], "n": 3}'


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(Vocabulary(tok, 49152, [2]))


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    """The tiny model with speculation forced on and off (same weights, same settings)."""
    return {mode: make_engine(tiny_model_dir, speculative=mode) for mode in ("ngram", "off")}


def _prompt(engine, text: str) -> list[int]:
    return engine.prompts.render_ids([{"role": "user", "content": text}])


# ---- compile ------------------------------------------------------------------------------

def test_a_schema_the_library_cannot_compile_is_refused_naming_why(compiler):
    strict = parse_structured({"type": "json_schema", "strict": True,
                               "schema": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}})
    with pytest.raises(InvalidRequestError, match="uniqueItems"):
        compiler.compile(strict)
    lenient = parse_structured({"type": "json_schema",
                                "schema": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}})
    assert compiler.compile(lenient).matcher.is_error() is False  # best effort without strict
    with pytest.raises(InvalidRequestError, match="regex"):
        compiler.compile(parse_structured({"type": "regex", "pattern": "[a-"}))
    with pytest.raises(InvalidRequestError, match="cannot be used|could not be read"):
        compiler.compile(parse_structured({"type": "grammar", "grammar": "start: missing_rule"}))
    with pytest.raises(InvalidRequestError):
        compiler.compile(parse_structured({"type": "json_schema", "schema": {"$ref": "#/$defs/nowhere"}}))


def test_compiled_grammars_are_cached_and_each_request_gets_its_own_matcher(compiler):
    spec = parse_structured(ENUMS)
    a = compiler.compile(spec)
    hits = compiler.hits
    b = compiler.compile(parse_structured(json.loads(json.dumps(ENUMS))))
    assert compiler.hits == hits + 1 and a.matcher is not b.matcher
    assert a.accept(a.forced()[0]) and b.forced() == compiler.compile(spec).forced()  # b did not move with a


def test_step_masks_with_drafts_equal_masks_one_by_one_and_leave_the_matcher_unmoved(compiler, tok):
    c = compiler.compile(parse_structured(ENUMS))
    text_ids = tok.encode(EXAMPLE, add_special_tokens=False)
    n = c.valid_prefix(text_ids)
    assert 0 < n <= len(text_ids)
    for t in text_ids[:3]:  # somewhere inside the object
        assert c.accept(t)
    drafts = text_ids[3:8]
    assert c.valid_prefix(drafts) == len(drafts)
    filler = MaskFiller(threads=2)
    together = filler.fill([(c, 0, drafts)]).bits
    one_by_one = []
    for j in range(len(drafts) + 1):
        one_by_one.append(filler.fill([(c, 0, [])]).bits[0])
        if j < len(drafts):
            assert c.accept(drafts[j])
    assert torch.equal(together, torch.stack(one_by_one))
    assert c.matcher.rollback(len(drafts))
    assert torch.equal(filler.fill([(c, 0, [])]).bits[0], together[0])  # where it was before the drafts
    allowed = allowed_matrix(together, 49152)
    assert all(bool(allowed[j, drafts[j]]) for j in range(len(drafts)))  # each draft allowed at its row
    assert not c.dead_rows


def test_bitmasks_unpack_the_same_on_the_cpu_and_the_tensor_path():
    bits = torch.randint(-(2**31), 2**31 - 1, (5, 8), dtype=torch.int32)
    bits[0] = -1
    bits[1] = 0
    bits[2, 3] = -(2**31)  # only bit 31 of word 3: token 127
    want = torch.tensor([[(int(w) >> b) & 1 for w in row for b in range(32)] for row in bits.tolist()]).bool()
    for vocab in (256, 250):
        assert torch.equal(allowed_matrix(bits, vocab), want[:, :vocab])
        assert torch.equal(allowed_by_shifts(bits, vocab), want[:, :vocab])
    assert allowed_matrix(bits, 256)[2, 96:128].nonzero().flatten().tolist() == [31]


# ---- the mask on every path -------------------------------------------------------------------

@pytest.mark.parametrize("extra", [
    dict(temperature=0.0),
    dict(temperature=1.0, seed=1),
    dict(temperature=1.5, top_k=5, seed=2),
    dict(temperature=1.0, top_p=0.3, seed=3),
    dict(temperature=1.0, min_p=0.5, seed=4),
    dict(temperature=0.7, repetition_penalty=1.3, frequency_penalty=1.5, presence_penalty=2.0, seed=5),
    dict(temperature=0.0, logit_bias={"64": 100, "65": 100, "33": 100}),  # letters and a quote, pushed hard
])
def test_the_grammar_holds_on_every_sampling_path(engines, extra):
    eng = engines["off"]
    eng.core.add_request("r", _prompt(eng, "Say anything."), SamplingParams(max_tokens=12, structured=DIGITS, **extra))
    out = run_core(eng.core)["r"]
    assert re.fullmatch("[0-9]{6}", out.output_text), out.output_text
    assert out.finish_reason == "stop"  # the grammar ended the reply (the pattern is complete)


def test_constrained_output_is_the_same_with_and_without_speculation(engines, tok):
    """Greedy and seeded requests at batch 1 and 4: identical tokens. The prompts repeat
    what the replies write, so prompt lookup drafts: some drafts are forbidden by the
    grammar (truncated before verification), some allowed ones are rejected (the matcher
    rolls back), some are kept (a reply of lowercase words, two of them pushed by
    logit_bias so that the reply repeats itself)."""
    the, cat = tok.encode(" the", add_special_tokens=False)[0], tok.encode(" cat", add_special_tokens=False)[0]
    words = {"type": "regex", "pattern": "[a-z ]{1,200}"}
    results: dict = {}
    for mode, eng in engines.items():
        core = eng.core
        before = core.counters.spec_drafted_total, core.counters.spec_accepted_total
        json_prompt = _prompt(eng, f"Copy this JSON exactly, three times: {EXAMPLE} {EXAMPLE} {EXAMPLE}")
        words_prompt = _prompt(eng, "the cat the cat THE CAT 42 the cat the cat the cat THE CAT 42 the cat")
        for batch in (1, 4):
            for i in range(batch):
                params = [(json_prompt, SamplingParams(max_tokens=60, temperature=0.0, structured=ENUMS)),
                          (json_prompt, SamplingParams(max_tokens=60, temperature=0.9, seed=11 + i, structured=ENUMS)),
                          (words_prompt, SamplingParams(max_tokens=40, temperature=0.0, structured=words,
                                                        logit_bias={the: 30, cat: 30})),
                          (words_prompt, SamplingParams(max_tokens=40, temperature=0.8, seed=i, structured=words,
                                                        logit_bias={the: 30, cat: 30}))]
                for j, (prompt, p) in enumerate(params):
                    core.add_request(f"b{batch}-{i}-{j}", prompt, p)
            results[(mode, batch)] = {k: (o.output_token_ids, o.output_text, o.finish_reason)
                                      for k, o in run_core(core).items()}
        results[(mode, "spec")] = (core.counters.spec_drafted_total - before[0],
                                   core.counters.spec_accepted_total - before[1])
    for batch in (1, 4):
        assert results[("ngram", batch)] == results[("off", batch)]
    drafted, accepted = results[("ngram", "spec")]
    assert drafted > accepted > 0, results[("ngram", "spec")]
    assert results[("off", "spec")] == (0, 0)
    for key, (_tokens, text, reason) in results[("off", 1)].items():
        if key.endswith(("-0", "-1")) and reason == "stop":
            jsonschema.validate(json.loads(text), ENUMS["schema"])
        elif key.endswith(("-2", "-3")):
            assert re.fullmatch("[a-z ]{1,200}", text), text


def test_forced_tokens_are_taken_without_sampling(engines):
    """A schema whose keys and constants are fixed: those tokens come in the step after the
    token before them, so the reply takes fewer steps than it has tokens."""
    eng = engines["off"]
    const = {"type": "json_schema", "schema": {
        "type": "object", "properties": {"kind": {"const": "measurement"}, "unit": {"const": "kilogram"},
                                         "value": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["kind", "unit", "value"], "additionalProperties": False}}
    steps = eng.core.counters.steps_total
    eng.core.add_request("f", _prompt(eng, "Measure."), SamplingParams(max_tokens=40, temperature=0.0,
                                                                     structured=const))
    out = run_core(eng.core)["f"]
    taken = eng.core.counters.steps_total - steps
    assert re.fullmatch(r'\{"kind": "measurement", "unit": "kilogram", "value": [0-9]\}', out.output_text)
    assert out.finish_reason == "stop" and out.output_token_ids[-1] == 2
    assert taken <= 4 < len(out.output_token_ids), (taken, len(out.output_token_ids))  # prefill, digit, end


def test_a_dead_end_ends_the_reply_with_error_and_keeps_its_text(engines):
    eng = engines["off"]
    req = eng.core.add_request("d", _prompt(eng, "Digits."), SamplingParams(max_tokens=20, temperature=0.0,
                                                                            structured=DIGITS))
    run_one = eng.core.step()  # the prefill samples the first digit
    assert run_one and not run_one[0].finished
    req.constraint.matcher.consume_token(64)  # a letter: the matcher is now in its error state
    out = run_core(eng.core)["d"]
    assert out.finish_reason == "error" and "grammar" in str(out.stop_reason)
    assert re.fullmatch("[0-9]+", out.output_text)
    eng.core.check_invariants()


def test_ignore_eos_does_not_keep_a_finished_grammar_going(engines):
    eng = engines["off"]
    eng.core.add_request("e", _prompt(eng, "Digits."), SamplingParams(max_tokens=30, temperature=0.0,
                                                                      ignore_eos=True, structured=DIGITS))
    out = run_core(eng.core)["e"]
    assert out.finish_reason == "stop" and len(out.output_token_ids) < 30


def test_uncompilable_constraints_are_refused_before_any_work(engines):
    eng = engines["off"]
    with pytest.raises(InvalidRequestError, match="uniqueItems"):
        eng.core.add_request("u", _prompt(eng, "x"), SamplingParams(structured={
            "type": "json_schema", "strict": True, "schema": {"type": "array", "uniqueItems": True}}))
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        eng.core.add_request("v", _prompt(eng, "x"), SamplingParams(logit_bias={"49152": 1}))
    assert not eng.core.has_work() and "u" not in eng.core.requests
