"""Grammars compiled into per-request matchers (llguidance), with a cache.

Why llguidance (measured with our tokenizer, ``bench/structured.py grammar``;
docs/structured.md): it compiles a JSON schema to a ready matcher in well under a
millisecond at the median (xgrammar: tens of milliseconds, hundreds at p99), its mask
per token is far below a decode step, it checks draft tokens without moving
(``validate_tokens``), rolls back exactly, names forced tokens, embeds JSON schemas in
Lark grammars with lazy triggers (tool calls), and needs neither torch nor a GPU.

``GrammarCompiler.compile`` turns a ``StructuredOutput`` (or a grammar text built for
tool calls) into a ``Constraint``: one matcher per request. Compiled matchers are kept
in an LRU cache keyed by the grammar text; a request gets a ``deep_copy`` of the cached
one (the lexer and parser tables are shared). Compiling happens where the prompt is
built (``AsyncEngine``'s prompt threads), never on the step loop.

JSON layout: no whitespace outside strings, separators ``", "`` and ``": "`` (what
``json.dumps`` prints). A grammar that allowed free whitespace lets a small model emit
spaces or newlines between tokens until ``max_tokens``, a failure users of other
servers report; fixing the separators bounds it (docs/structured.md).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

from engine.errors import InvalidRequestError
from engine.structured.spec import StructuredOutput
from engine.structured.vocab import Vocabulary

# The JSON layout every JSON grammar gets (overrides anything a schema's "x-guidance" says).
JSON_LAYOUT: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 64  # compiled matchers kept (distinct grammars)


def json_grammar_options(strict: bool) -> dict[str, Any]:
    """llguidance's JSON options: our layout, and ``lenient`` (ignore keywords the library
    does not implement) unless ``strict``."""
    return {**JSON_LAYOUT, "lenient": not strict}


def schema_with_layout(schema: dict[str, Any] | bool, strict: bool) -> dict[str, Any] | bool:
    """``schema`` with our JSON options in its ``x-guidance`` (for a schema embedded in a
    Lark grammar with ``%json``, where options travel inside the schema)."""
    if not isinstance(schema, dict):
        return schema
    return {**schema, "x-guidance": json_grammar_options(strict)}


def grammar_text(spec: StructuredOutput) -> str:
    """The llguidance grammar (its JSON form) for one ``StructuredOutput``.

    Raises:
        InvalidRequestError: a GBNF grammar that does not convert to Lark.
    """
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    if spec.is_json:
        assert spec.schema is not None
        options: Any = json_grammar_options(spec.strict)  # llguidance's JsonCompileOptions (a TypedDict)
        return str(LLMatcher.grammar_from_json_schema(json.dumps(spec.schema), overrides=options))
    if spec.kind == "regex":
        assert spec.pattern is not None
        return str(LLMatcher.grammar_from_regex(spec.pattern))
    assert spec.grammar is not None
    try:
        lark = any_to_lark(spec.grammar)
    except Exception as e:  # the converter's own error names the line
        raise InvalidRequestError(f"the grammar could not be read: {e}"[:500]) from None
    return str(LLMatcher.grammar_from_lark(lark))


class GrammarCompiler:
    """Compiles grammars for one model's vocabulary; thread-safe.

    Args:
        vocab: the model's vocabulary (``Vocabulary``).
        cache_size: compiled matchers kept, least recently used dropped first.
    """

    def __init__(self, vocab: Vocabulary, cache_size: int = CACHE_SIZE) -> None:
        self.vocab = vocab
        self.cache_size = cache_size
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def compile(self, spec: StructuredOutput | None = None, *, grammar: str | None = None,
                what: str = "response format") -> Constraint:
        """A fresh ``Constraint`` for ``spec``, or for a ready llguidance ``grammar`` text.

        Raises:
            InvalidRequestError: the library cannot compile it; the message names the
                library's reason (an unsupported keyword, a bad regex, a grammar error).
        """
        from llguidance import LLMatcher

        text = grammar if grammar is not None else grammar_text(spec) if spec is not None else None
        if text is None:
            raise ValueError("compile needs a spec or a grammar")
        with self._lock:
            base = self._cache.get(text)
            if base is not None:
                self._cache.move_to_end(text)
                self.hits += 1
                return Constraint(base.deep_copy(), self.vocab)
        ll = self.vocab.ll_tokenizer
        is_error, messages = LLMatcher.validate_grammar_with_warnings(text, ll)
        if is_error:
            raise InvalidRequestError(f"the {what} cannot be used: {_short(messages[0])}")
        base = LLMatcher(ll, text, log_level=0)
        if base.is_error():
            raise InvalidRequestError(f"the {what} cannot be used: {_short(base.get_error())}")
        with self._lock:
            self.misses += 1
            self._cache[text] = base
            self._cache.move_to_end(text)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return Constraint(base.deep_copy(), self.vocab)


def _short(message: str) -> str:
    """The library's message without its trailing detail, at most 500 characters."""
    return " ".join(message.split())[:500]


class Constraint:
    """One request's grammar state: which tokens may come next, advanced token by token.

    Used by the step thread only (after its construction in a prompt thread).
    ``dead_rows`` maps a position of the current step (0: the next token, j: after the
    j-th draft) whose mask allowed no token to the reason; the engine ends the reply
    there with finish reason ``error`` instead of sampling from an empty distribution.
    """

    def __init__(self, matcher: Any, vocab: Vocabulary) -> None:
        self.matcher = matcher
        self.vocab = vocab
        self.dead_rows: dict[int, str] = {}

    @property
    def words(self) -> int:
        """int32 words of one mask (``ceil(vocab_size / 32)``)."""
        return (self.vocab.vocab_size + 31) // 32

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many leading ``tokens`` the grammar allows from here (no state change)."""
        if not tokens:
            return 0
        return int(self.matcher.validate_tokens(tokens))

    def accept(self, token_id: int) -> bool:
        """Advance past ``token_id``; False (and the matcher in error) if the grammar
        forbids it."""
        return bool(self.matcher.consume_token(token_id))

    def forced(self) -> list[int]:
        """Tokens the grammar forces from here, to take without sampling: the canonical
        tokens of forced text (the mask would allow only them one by one), or an end of
        reply token once the grammar is complete. Empty when the model has a choice."""
        if self.matcher.is_error():
            return []
        if self.matcher.is_stopped():
            return [self.vocab.eos_ids[0]] if self.vocab.eos_ids else []  # the tokenizer's own first
        return [int(t) for t in self.matcher.compute_ff_tokens()]

    @property
    def error(self) -> str:
        """The matcher's error ("" when none)."""
        return str(self.matcher.get_error())

    def is_done(self) -> bool:
        """The grammar is complete: only an end-of-reply token may follow."""
        return bool(self.matcher.is_stopped())
