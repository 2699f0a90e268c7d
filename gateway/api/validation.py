"""One check per kind of input, used at every boundary of the gateway (the browser
socket, ``/api``, ``/v1``): JSON bodies and frames (size of nesting), text fields
(valid Unicode) and sampling parameters (``engine.sampling_params.RANGES``). The JSON
reader itself is ``gateway.json_input`` (below the import formats, which read with it too),
re-exported here.

Every failure is a ``GatewayError`` ``invalid_request`` (or the caller's own error
type built from the same message) naming the field; never an ``internal_error``.
"""

from __future__ import annotations

from typing import Any

from engine.sampling_params import OPEN_LOW, RANGES
from engine.text_checks import surrogate_at, text_error
from gateway.errors import GatewayError
from gateway.json_input import MAX_JSON_DEPTH as MAX_JSON_DEPTH
from gateway.json_input import BadJson as BadJson
from gateway.json_input import json_depth_over as json_depth_over
from gateway.json_input import loads_json as loads_json


def check_text(value: Any, field: str) -> None:
    """Refuse a string field that is not valid Unicode (a lone surrogate).

    Raises:
        GatewayError: ``invalid_request`` naming ``field``.
    """
    message = text_error(value, field)
    if message is not None:
        raise GatewayError("invalid_request", message)


def printable(text: str) -> str:
    """``text`` safe to send as UTF-8: a lone surrogate (only ever from echoed input)
    becomes U+FFFD."""
    if surrogate_at(text) is None:
        return text
    return "".join("\ufffd" if "\ud800" <= c <= "\udfff" else c for c in text)


def sampling_ranges() -> dict[str, dict[str, Any]]:
    """``RANGES`` for clients (``GET /api/config`` ``ranges``, the settings form):
    ``{name: {"min", "max", "min_exclusive"}}`` (None: unbounded)."""
    return {name: {"min": lo, "max": hi, "min_exclusive": name in OPEN_LOW} for name, (lo, hi) in RANGES.items()}
