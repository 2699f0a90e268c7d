"""The model's vocabulary as the grammar library sees it, built once per engine.

llguidance's ``LLTokenizer`` holds every token's bytes in a trie (about 0.3 s to build
for SmolLM2's 49,152 tokens); the grammar compiler and the logprobs' token texts both
use it, so it is built on first use and shared.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any


class Vocabulary:
    """The tokenizer wrapped for llguidance, and each token's bytes.

    Args:
        tokenizer: the model's fast Hugging Face tokenizer.
        vocab_size: the model's vocabulary (rows of its logits, tokens); masks cover
            exactly these ids (ids the tokenizer lacks are never allowed).
        eos_ids: the ids that end a reply (any of them is allowed where a grammar ends);
            the tokenizer's own EOS comes first in ``self.eos_ids`` (the one forced when a
            grammar is complete).

    Thread-safe: built under a lock by whichever thread first needs it.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Iterable[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        own = getattr(tokenizer, "eos_token_id", None)
        ids = sorted(set(eos_ids))
        self.eos_ids = ([own] if own in ids else []) + [i for i in ids if i != own]
        self._lock = threading.Lock()
        self._ll: Any = None
        self._bytes: list[bytes] | None = None

    @property
    def ll_tokenizer(self) -> Any:
        """The ``llguidance.LLTokenizer`` (built on first use)."""
        with self._lock:
            if self._ll is None:
                from llguidance.hf import from_tokenizer

                self._ll = from_tokenizer(self.tokenizer, n_vocab=self.vocab_size,
                                          eos_token=self.eos_ids or None)
            return self._ll

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token ``token_id`` stands for in the output text (a special token:
        its name's UTF-8; an id outside the tokenizer: empty)."""
        table = self._table()
        return table[token_id] if 0 <= token_id < len(table) else b""

    def _table(self) -> list[bytes]:
        if self._bytes is None:
            ll = self.ll_tokenizer
            with self._lock:
                if self._bytes is None:
                    self._bytes = self._build_table(ll)
        return self._bytes

    def _build_table(self, ll: Any) -> list[bytes]:
        """Every token's bytes; a special token's are its name's."""
        table = []
        for i in range(self.vocab_size):
            if ll.is_special_token(i):
                name = self.tokenizer.convert_ids_to_tokens(i)
                table.append(name.encode() if isinstance(name, str) else b"")
            else:
                table.append(ll.decode_bytes([i]))
        return table

    def warm(self) -> None:
        """Build what ``token_bytes`` needs now (call it off the event loop and the step
        loop, before a request that asks for logprobs needs its tokens named)."""
        self._table()


def token_text(data: bytes) -> str:
    """A token's bytes as text: UTF-8, with bytes that are not (part of a partial
    character, say) written as ``\\xNN`` escapes, as OpenAI-compatible servers show them."""
    return data.decode("utf-8", errors="backslashreplace")
