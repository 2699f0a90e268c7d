"""Checks on text that enters from outside (chat content, prompts, titles, stop strings).

Python strings decoded from JSON may hold lone UTF-16 surrogates (U+D800-U+DFFF):
``"\\ud83d"`` is valid JSON, and a JavaScript client that cuts a string by length
produces one. Such a string cannot be encoded as UTF-8, so it breaks Redis writes,
tokenizers and replies far from where it entered. Every entry point refuses it with
an error naming the field (policy: refuse, never replace silently). NUL, RTL marks,
combining marks and 4-byte characters are valid text and pass. Torch-free.
"""

from __future__ import annotations

import re
from typing import Any

_SURROGATE = re.compile("[\ud800-\udfff]")


def surrogate_at(text: str) -> int | None:
    """The index (in code points) of the first lone surrogate in ``text``, or None."""
    if text.isascii():
        return None
    m = _SURROGATE.search(text)
    return m.start() if m else None


def text_error(value: Any, field: str) -> str | None:
    """The error for a string ``value`` of request field ``field`` that is not valid
    Unicode text, or None when it is (non-strings are the caller's business)."""
    if not isinstance(value, str):
        return None
    at = surrogate_at(value)
    if at is None:
        return None
    return (f"'{field}' is not valid Unicode: a lone UTF-16 surrogate {ascii(value[at])} at character {at} "
            "(send whole characters; a surrogate pair must not be split)")
