"""Constrained decoding: the grammar library's costs with our vocabulary, and the engine's
decode speed constrained against unconstrained.

    python bench/structured.py grammar [--libs llguidance,xgrammar] [--repeats 3] [--json]
    python bench/structured.py decode [--batches 1,16] [--max-tokens 128] [--repeats 3] [--json]

``grammar``: for every schema of ``bench/json_schemas.py`` and each library, with the
bundled SmolLM2 tokenizer (49,152 tokens):
- compile: schema to a matcher ready for its first mask (llguidance: the grammar, the
  ``LLMatcher`` and its first mask, since it builds its lexer lazily; xgrammar:
  ``compile_json_schema`` with its cache off, the ``GrammarMatcher`` and its first mask),
  and for llguidance also the engine's cached path (``deep_copy`` of a compiled matcher
  and its first mask);
- mask per token: replaying the schema's instance token by token (each library picks, at
  every step, the longest allowed token that continues the instance's text, so each
  walks its own canonical tokenization), the time of each mask computation.
Both libraries get the same JSON layout: no free whitespace, separators ", " and ": ".

``decode``: the engine (``EngineCore`` stepped on this thread, the default CPU format,
speculation as configured by default) decoding B requests at once, unconstrained and
then with a JSON schema that keeps them writing (an array of 40 to 200 strings), with
the same prompts and ``max_tokens``; output tokens/s over the decode steps (first token
to last) of each run, median of ``--repeats`` alternating runs, and the ratio.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from bench.json_schemas import SCHEMAS  # noqa: E402
from bench.serving_lib.stats import percentile  # noqa: E402

SEPARATORS = (", ", ": ")


def _tokenizer() -> Any:
    from transformers import AutoTokenizer

    from engine.loader import ensure_default_model

    return AutoTokenizer.from_pretrained(str(ensure_default_model()))


def _walk(text: str, allowed: Any, table: dict[bytes, int]) -> int | None:
    """The longest token (by bytes) that ``allowed`` (a bool array over the vocabulary)
    admits and whose bytes start ``text``'s remaining bytes; None when none does."""
    data = text.encode() if isinstance(text, str) else text
    for n in range(min(48, len(data)), 0, -1):
        tid = table.get(data[:n])
        if tid is not None and allowed[tid]:
            return tid
    return None


def _unpack(mask: torch.Tensor, vocab: int) -> Any:
    """int32 bitmask [W] -> numpy bool [vocab]."""
    import numpy as np

    bits = np.unpackbits(mask.numpy().view(np.uint8), bitorder="little")
    return bits[:vocab].astype(bool)


class _LLG:
    """llguidance behind the replay's three calls."""

    name = "llguidance"

    def __init__(self, tok: Any) -> None:
        import llguidance
        import llguidance.hf

        self.llg = llguidance
        self.tok = llguidance.hf.from_tokenizer(tok)
        self.vocab = self.tok.vocab_size
        self.mask = torch.zeros((self.vocab + 31) // 32, dtype=torch.int32)

    def compile(self, schema: Any) -> Any:
        g = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults={
            "whitespace_flexible": False, "item_separator": SEPARATORS[0], "key_separator": SEPARATORS[1]})
        m = self.llg.LLMatcher(self.tok, g)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def copy(self, m: Any) -> Any:
        return m.deep_copy()

    def fill(self, m: Any) -> None:
        m.unsafe_compute_mask_ptr(self.mask.data_ptr(), self.mask.numel() * 4)

    def accept(self, m: Any, tid: int) -> bool:
        return bool(m.consume_token(tid))

    def token_bytes(self) -> dict[bytes, int]:
        return {self.tok.decode_bytes([i]): i for i in range(self.vocab) if not self.tok.is_special_token(i)}


class _XGR:
    """xgrammar behind the same calls."""

    name = "xgrammar"

    def __init__(self, tok: Any) -> None:
        import xgrammar

        self.xgr = xgrammar
        self.info = xgrammar.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
        self.vocab = len(tok)
        self.compiler = xgrammar.GrammarCompiler(self.info, max_threads=torch.get_num_threads(),
                                                 cache_enabled=False)
        self.mask = xgrammar.allocate_token_bitmask(1, self.vocab)
        self._tok = tok

    def compile(self, schema: Any) -> Any:
        cg = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=SEPARATORS,
                                               strict_mode=False)
        return self.xgr.GrammarMatcher(cg)

    def fill(self, m: Any) -> None:
        m.fill_next_token_bitmask(self.mask, 0)

    def accept(self, m: Any, tid: int) -> bool:
        return bool(m.accept_token(tid))

    def token_bytes(self) -> dict[bytes, int]:
        from llguidance.hf import from_tokenizer

        t = from_tokenizer(self._tok)  # the same bytes per token as the other library sees
        return {t.decode_bytes([i]): i for i in range(self.vocab) if not t.is_special_token(i)}


def bench_grammar(libs: list[str], repeats: int) -> dict[str, Any]:
    """Compile and mask times per library (ms), over ``SCHEMAS``."""
    tok = _tokenizer()
    out: dict[str, Any] = {"schemas": len(SCHEMAS), "vocab": len(tok), "threads": torch.get_num_threads()}
    for lib_name in libs:
        if lib_name == "xgrammar" and importlib.util.find_spec("xgrammar") is None:
            out[lib_name] = {"skipped": "not installed (pip install xgrammar==0.2.8 to compare)"}
            continue
        lib = _LLG(tok) if lib_name == "llguidance" else _XGR(tok)
        table = lib.token_bytes()
        compile_ms: list[float] = []
        cached_ms: list[float] = []
        mask_ms: list[float] = []
        failures: list[str] = []
        for name, schema, instance in SCHEMAS:
            text = json.dumps(instance, ensure_ascii=False)
            for _ in range(repeats):
                t0 = time.perf_counter()
                try:
                    m = lib.compile(schema)
                except Exception as e:  # a schema this library refuses
                    failures.append(f"{name}: {str(e)[:80]}")
                    break
                lib.fill(m)
                compile_ms.append((time.perf_counter() - t0) * 1000)
                if isinstance(lib, _LLG):
                    t0 = time.perf_counter()
                    c = lib.copy(m)
                    lib.fill(c)
                    cached_ms.append((time.perf_counter() - t0) * 1000)
                rest = text.encode()
                while rest:
                    t0 = time.perf_counter()
                    lib.fill(m)
                    mask_ms.append((time.perf_counter() - t0) * 1000)
                    tid = _walk(rest, _unpack(lib.mask.view(-1), lib.vocab), table)
                    if tid is None or not lib.accept(m, tid):
                        failures.append(f"{name}: stuck at {rest[:20]!r}")
                        break
                    rest = rest[len(_bytes_of(table, tid)):]
        out[lib_name] = {
            "compile_ms_p50": percentile(compile_ms, 0.5), "compile_ms_p99": percentile(compile_ms, 0.99),
            "compile_ms_max": max(compile_ms, default=float("nan")),
            "cached_ms_p50": percentile(cached_ms, 0.5), "cached_ms_p99": percentile(cached_ms, 0.99),
            "mask_ms_p50": percentile(mask_ms, 0.5), "mask_ms_p99": percentile(mask_ms, 0.99),
            "mask_samples": len(mask_ms), "failures": sorted(set(failures)),
        }
    return out


_REVERSE: dict[int, dict[int, bytes]] = {}


def _bytes_of(table: dict[bytes, int], tid: int) -> bytes:
    """The bytes of token ``tid`` (reverse of ``table``, built once per table)."""
    rev = _REVERSE.get(id(table))
    if rev is None:
        rev = _REVERSE[id(table)] = {i: b for b, i in table.items()}
    return rev[tid]


# ----- decode ------------------------------------------------------------------------------

LIST_SCHEMA = {"type": "object", "properties": {"items": {
    "type": "array", "items": {"type": "string", "maxLength": 40}, "minItems": 40, "maxItems": 200}},
    "required": ["items"], "additionalProperties": False}
QUESTIONS = ["List animals that live in the sea.", "List cities in Europe.", "List programming languages.",
             "List fruits and vegetables.", "List famous scientists.", "List musical instruments.",
             "List board games.", "List kitchen tools.", "List rivers of the world.", "List car brands.",
             "List flowers.", "List sports.", "List colours.", "List planets and moons.", "List birds.",
             "List trees."]


def bench_decode(batches: list[int], max_tokens: int, repeats: int) -> dict[str, Any]:
    """Output tokens/s unconstrained vs constrained per batch size (medians over repeats)."""
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from engine.loader import load_model
    from engine.sampling_params import SamplingParams

    config = EngineConfig()
    engine = AsyncEngine.from_loaded(load_model(config), config, verbose=False)
    core, prompts = engine.core, engine.prompts
    out: dict[str, Any] = {"max_tokens": max_tokens, "format": engine.info.format}

    def run(batch: int, constrained: bool, tag: str) -> float:
        reqs = []
        for i in range(batch):
            q = QUESTIONS[i % len(QUESTIONS)] + " Answer in JSON."
            ids = prompts.render_ids([{"role": "user", "content": q}])
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=not constrained,
                                    structured={"type": "json_schema", "schema": LIST_SCHEMA} if constrained
                                    else None)
            req = core.add_request(f"{tag}-{i}", ids, params)  # compiles its grammar (cached after the first)
            reqs.append(req)
        finals = []
        while core.has_work():
            finals += [o for o in core.step() if o.finished]
        tokens = sum(len(o.output_token_ids or []) - 1 for o in finals)
        first = min(r.first_token_s for r in reqs if r.first_token_s)
        last = max(r.finished_s for r in reqs if r.finished_s)
        return tokens / (last - first)

    for batch in batches:
        free, bound = [], []
        run(batch, False, "warm-f")
        run(batch, True, "warm-c")
        for r in range(repeats):
            free.append(run(batch, False, f"f{r}"))
            bound.append(run(batch, True, f"c{r}"))
        f, b = statistics.median(free), statistics.median(bound)
        out[f"batch_{batch}"] = {"unconstrained_tok_s": f, "constrained_tok_s": b, "ratio": b / f,
                                 "runs_unconstrained": free, "runs_constrained": bound}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", choices=["grammar", "decode"])
    ap.add_argument("--libs", default="llguidance,xgrammar")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.part == "grammar":
        result = bench_grammar(args.libs.split(","), args.repeats)
    else:
        result = bench_decode([int(b) for b in args.batches.split(",")], args.max_tokens, args.repeats)
    result["loadavg_1m"] = os.getloadavg()[0]
    if args.json:
        print(json.dumps(result, indent=1))
        return
    if args.part == "grammar":
        print(f"{result['schemas']} schemas, vocabulary {result['vocab']}, {result['threads']} threads")
        print("library      compile p50/p99/max ms   cached p50/p99 ms   mask/token p50/p99 ms   masks")
        for lib in args.libs.split(","):
            r = result[lib]
            if "skipped" in r:
                print(f"{lib:12s} skipped: {r['skipped']}")
                continue
            print(f"{lib:12s} {r['compile_ms_p50']:8.2f} {r['compile_ms_p99']:8.2f} {r['compile_ms_max']:8.2f}"
                  f"   {r['cached_ms_p50']:8.3f} {r['cached_ms_p99']:8.3f}"
                  f"   {r['mask_ms_p50']:8.4f} {r['mask_ms_p99']:8.4f}   {r['mask_samples']}")
            for f in r["failures"]:
                print(f"  {lib} refused {f}")
    else:
        print(f"format: {result['format']}; max_tokens {result['max_tokens']}")
        print("batch   unconstrained tok/s   constrained tok/s   ratio")
        for key, r in result.items():
            if key.startswith("batch_"):
                print(f"{key[6:]:>5}   {r['unconstrained_tok_s']:19.1f}   {r['constrained_tok_s']:17.1f}"
                      f"   {r['ratio']:.3f}")
    print(f"load average (1 min): {result['loadavg_1m']:.2f}")


if __name__ == "__main__":
    main()
