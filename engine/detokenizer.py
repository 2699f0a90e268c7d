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

How a reply ends decides its last piece (``finish``): a reply that truly ends (EOS, a
stop token or string) flushes everything, and invalid or incomplete bytes at its end
become U+FFFD; a reply that is cut (``max_tokens``, the context, an abort) drops the
U+FFFDs of its unfinished tail instead, since its next tokens (a Continue) may still
complete the character: a cut reply never ends in U+FFFD.

Continuing a cut reply (``prior_ids``): the detokenizer replays the reply's earlier
tokens, so it is in the state the cut left it in, and knows the text already shown for
them. Its pieces are exactly the text the uncut reply would have shown after that
point, with two corrections that concern the shown text's end, ``trim``: a stop string
that began in the shown text and completes in the continuation takes its start back
(the uncut reply would never have shown it), and so does a shown tail whose bytes decode
differently once more tokens follow (a ``ByteFallback`` run that turns invalid). Both
can only happen before the continuation emits its first piece.

Invariant: with no stop string matched, the concatenation of all pieces from
``add`` and ``finish(complete=True)`` equals ``decode_text(tokenizer, token_ids)``;
for a continuation, the shown text minus its last ``trim`` characters plus the pieces
equals what one uncut reply would have shown (``tests/engine/test_detokenizer.py``).

Windowed decoding stays exact because both decodes of a step start at the same
token: a decoder that drops the leading space of the first token (SentencePiece
``Strip``/``Metaspace``) drops it from both, and the difference is the new text.
"""

from __future__ import annotations

import os
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

    def __init__(self, tokenizer: Any, stop: Sequence[str] = (), skip_special_tokens: bool = True,
                 prior_ids: Sequence[int] = ()) -> None:
        """Args:
            tokenizer: a transformers tokenizer (byte-level BPE or SentencePiece).
            stop: stop strings (non-empty); may be empty.
            skip_special_tokens: drop special tokens from the text, as the one-shot decode does.
            prior_ids: the tokens of a cut reply this request continues (see the module
                doc): replayed here (O(1) decode work each: 9 ms for 2,048 tokens of
                SmolLM2's tokenizer on this project's 2-core CPU), their text counted as
                shown, not as this detokenizer's ``text``. Empty for a new reply.
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
        # A continuation's seam: the shown text of the tokens from ``_read_offset`` on
        # (None once the first piece after it is out), the end of the shown text where
        # a stop string may still begin, and how much of the shown text was taken back.
        self._seam: str | None = None
        self._shown_tail = ""
        self._trim = 0
        self._trim_taken = 0
        if prior_ids:
            self._prime(prior_ids)

    @property
    def token_ids(self) -> list[int]:
        """The ids fed so far, ``prior_ids`` first (the detokenizer's own list: do not mutate)."""
        return self._ids

    @property
    def text(self) -> str:
        """All text emitted so far; after ``finish``, the full final text (of a
        continuation: the text after the shown part, see ``trim``)."""
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

    @property
    def trim(self) -> int:
        """Characters (code points) at the end of a continued reply's shown text that the
        continuation takes back (see the module doc); 0 for a new reply."""
        return self._trim

    def take_trim(self) -> int:
        """``trim`` not reported yet (then 0 until it grows): the engine puts it on the
        output item it first applies to."""
        new, self._trim_taken = self._trim - self._trim_taken, self._trim
        return new

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
        return self._emit(self._past_seam(new_text[len(prefix_text) :]), final=False)

    def finish(self, complete: bool = True) -> str:
        """Flush everything held back and return it; call once when the request ends.

        ``complete``: the reply truly ended (EOS, a stop token or string): an incomplete
        or invalid UTF-8 tail comes out as U+FFFD. False for a reply that was cut
        (``max_tokens``, the context, an abort): the U+FFFDs at the end of the unread
        tail are dropped (the token ids stay, and a continuation may complete the
        character). A stop string that completes only in the flushed text still cuts it
        (and sets ``stopped``).
        """
        if self._finished:
            return ""
        self._finished = True
        if self.stopped:
            return ""
        piece = self._unread_text(complete)
        self._read_offset = len(self._ids)
        return self._emit(self._past_seam(piece), final=True)

    # -- internals -----------------------------------------------------------------

    def _prime(self, prior_ids: Sequence[int]) -> None:
        """Replay a cut reply's tokens (stop strings off: the reply had none matched) and
        keep the state its cut left: the text it showed, and the seam after it."""
        stop, firsts, longest = self._stop, self._stop_firsts, self._max_stop
        self._stop, self._stop_firsts, self._max_stop = [], set(), 0
        for t in prior_ids:
            self.add(t)
        self._stop, self._stop_firsts, self._max_stop = stop, firsts, longest
        self._seam = self._unread_text(complete=False)
        shown = self.text + self._seam
        self._pieces = []
        # a stop string may begin up to max_stop - 1 characters before the end, also
        # after the seam's characters are taken back
        self._shown_tail = shown[max(0, len(shown) - (max(self._max_stop - 1, 0) + len(self._seam))):]

    def _unread_text(self, complete: bool) -> str:
        """The text of the tokens not decoded into final text yet; without ``complete``,
        less the U+FFFDs at its end (an unfinished character)."""
        prefix_text, new_text = self._window_texts()
        piece = new_text[len(prefix_text) :]
        return piece if complete else piece.rstrip(REPLACEMENT)

    def _past_seam(self, piece: str) -> str:
        """The first piece after a continuation's seam without the text the cut reply
        already showed for the same tokens; where that shown text decodes differently
        now, it is taken back (``trim``) and emitted as it decodes now."""
        seam = self._seam
        if seam is None:
            return piece
        self._seam = None
        common = len(os.path.commonprefix([seam, piece]))
        if common < len(seam):
            self._take_back(len(seam) - common)
        return piece[common:]

    def _take_back(self, n: int) -> None:
        """Take the last ``n`` characters of the shown text back."""
        self._trim += n
        self._shown_tail = self._shown_tail[: len(self._shown_tail) - n]

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
        """Append final text, cut at a stop string, hold back a possible stop prefix.

        A continuation's shown tail takes part in the stop search: a match that begins
        in it takes that part back (``trim``); a held prefix that begins in it keeps the
        tail from there on."""
        text = self._pending + new
        tail = self._shown_tail
        out_len = len(text)
        match = self._find_stop(tail + text, len(tail)) if self._stop else None
        if match is not None:
            start, self._stop_reason = match
            if start < len(tail):
                self._take_back(len(tail) - start)
            out_len = max(0, start - len(tail))
            self._shown_tail = ""
        elif not final:
            held = self._held_suffix_len(tail + text)
            out_len = max(0, len(text) - held)
            self._shown_tail = tail[len(tail) - (held - len(text)):] if held > len(text) else ""
        else:
            self._shown_tail = ""
        self._pending = "" if match is not None else text[out_len:]
        piece = clean_text(text[:out_len])
        if piece:
            self._pieces.append(piece)
        return piece

    def _find_stop(self, text: str, after: int = 0) -> tuple[int, str] | None:
        """(start, stop string) of the match that ends first in ``text`` (ties: starts
        first), among the matches that end past ``after`` characters."""
        best: tuple[int, int, str] | None = None
        for s in self._stop:
            i = text.find(s, max(0, after - len(s) + 1))
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
