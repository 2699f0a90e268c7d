"""Incremental detokenization of one request's output, with stop strings.

Text is decoded over a small window of recent tokens (vLLM's prefix_offset /
read_offset scheme in ``detokenize_incrementally``), so each token costs O(1)
decode work, and a piece is emitted only when it is final:

* it does not end in U+FFFD (an incomplete UTF-8 sequence may still complete), and
  the last token that adds text is not a SentencePiece byte-fallback token
  ``<0xNN>`` (the ``ByteFallback`` decoder turns a whole run of byte tokens into
  U+FFFDs when any byte of the run is invalid, so a run is final only once a text
  token ends it; skipped special tokens do not end it);
* no stop string can still cut it: the longest suffix of the unemitted text that
  is a prefix of some stop string is held back.

Invariant: with no stop string matched, the concatenation of all pieces from
``add`` and ``finish`` equals ``decode_text(tokenizer, token_ids)``.

Windowed decoding stays exact because both decodes of a step start at the same
token: a decoder that drops the leading space of the first token (SentencePiece
``Strip``/``Metaspace``) drops it from both, and the difference is the new text.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

REPLACEMENT = "\ufffd"
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def clean_text(s: str) -> str:
    """Return ``s`` with lone surrogates replaced by U+FFFD, so ``s.encode('utf-8')`` never raises.

    A valid surrogate pair (two code points, as some decode paths produce) is joined
    into its character.
    """
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:
        return s.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


def _skipped_ids(tokenizer: Any) -> frozenset[int]:
    """Ids that ``decode(..., skip_special_tokens=True)`` drops: special and special-added tokens."""
    ids = set(getattr(tokenizer, "all_special_ids", ()) or ())
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(i for i, tok in added.items() if getattr(tok, "special", False))
    return frozenset(ids)


def decode_text(tokenizer: Any, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    """One-shot decode of ``ids`` with the same settings the incremental path uses.

    ``clean_up_tokenization_spaces`` is off: it rewrites " ." to "." and the like, which
    is not stable under appending tokens, and it changes the model's text.
    """
    text = tokenizer.decode(
        list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )
    return clean_text(text)


class IncrementalDetokenizer:
    """Turns one request's generated token ids into safe-to-stream text pieces.

    Feed every generated token with ``add`` (not EOS or stop token ids: the engine
    stops before), then call ``finish`` once when the request ends.

    Stop strings: a match is the one that ends first in the text (ties: the one that
    starts first); the text before it is final, ``stopped`` becomes True,
    ``stop_reason`` is the matched string, and nothing after it is ever emitted.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str] = (), skip_special_tokens: bool = True) -> None:
        """Args:
            tokenizer: a transformers tokenizer (byte-level BPE or SentencePiece).
            stop: stop strings (non-empty); may be empty.
            skip_special_tokens: drop special tokens from the text, as the one-shot decode does.
        """
        self._tok = tokenizer
        self._stop = [s for s in stop if s]
        self._stop_firsts = {s[0] for s in self._stop}
        self._max_stop = max((len(s) for s in self._stop), default=0)
        self._skip = skip_special_tokens
        self._special_ids = _skipped_ids(tokenizer) if skip_special_tokens else frozenset()
        self._ids: list[int] = []
        self._prefix_offset = 0  # window start: first token of the last final piece
        self._read_offset = 0  # tokens before this are decoded into final text
        self._pending = ""  # final decoded text not emitted yet (a possible stop prefix)
        self._pieces: list[str] = []
        self._stop_reason: str | None = None
        self._finished = False

    @property
    def token_ids(self) -> list[int]:
        """The ids fed so far (the detokenizer's own list: do not mutate)."""
        return self._ids

    @property
    def text(self) -> str:
        """All text emitted so far; after ``finish``, the full final text."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def stopped(self) -> bool:
        """True once a stop string matched."""
        return self._stop_reason is not None

    @property
    def stop_reason(self) -> str | None:
        """The stop string that matched, or None."""
        return self._stop_reason

    def add(self, token_id: int) -> str:
        """Feed one generated token; return the text that became safe to emit (maybe "").

        After a stop string matched (or after ``finish``), tokens are ignored and "" is returned.
        """
        if self.stopped or self._finished:
            return ""
        self._ids.append(token_id)
        if self._skip and token_id in self._special_ids:
            return ""  # adds no text; a byte run continues across it in the one-shot decode
        if self._is_byte_token(token_id):
            return ""
        prefix_text, new_text = self._window_texts()
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return self._emit(new_text[len(prefix_text) :], final=False)

    def finish(self) -> str:
        """Flush everything held back and return it; call once when the request ends.

        An incomplete UTF-8 tail comes out as U+FFFD. A stop string that completes
        only in the flushed text still cuts it (and sets ``stopped``).
        """
        if self._finished:
            return ""
        self._finished = True
        if self.stopped:
            return ""
        prefix_text, new_text = self._window_texts()
        self._read_offset = len(self._ids)
        return self._emit(new_text[len(prefix_text) :], final=True)

    # -- internals -----------------------------------------------------------------

    def _window_texts(self) -> tuple[str, str]:
        """Decode the final window and the window extended by the unread tokens."""
        window = self._ids[self._prefix_offset :]
        read = self._read_offset - self._prefix_offset
        prefix_text = self._decode(window[:read]) if read else ""
        return prefix_text, self._decode(window)

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip, clean_up_tokenization_spaces=False)

    def _is_byte_token(self, token_id: int) -> bool:
        """True for a SentencePiece byte-fallback token such as ``<0xE6>``."""
        piece = self._tok.convert_ids_to_tokens(token_id)
        return isinstance(piece, str) and len(piece) == 6 and _BYTE_TOKEN.fullmatch(piece) is not None

    def _emit(self, new: str, final: bool) -> str:
        """Append final text, cut at a stop string, hold back a possible stop prefix."""
        text = self._pending + new
        out_len = len(text)
        match = self._find_stop(text)
        if match is not None:
            out_len, self._stop_reason = match
        elif not final:
            out_len -= self._held_suffix_len(text)
        self._pending = "" if match is not None else text[out_len:]
        piece = clean_text(text[:out_len])
        if piece:
            self._pieces.append(piece)
        return piece

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """(start, stop string) of the match that ends first in ``text`` (ties: starts first)."""
        best: tuple[int, int, str] | None = None
        for s in self._stop:
            i = text.find(s)
            if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
                best = (i + len(s), i, s)
        return None if best is None else (best[1], best[2])

    def _held_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        for i in range(max(0, len(text) - self._max_stop + 1), len(text)):
            if text[i] in self._stop_firsts:
                tail = text[i:]
                if any(s.startswith(tail) for s in self._stop):
                    return len(text) - i
        return 0
