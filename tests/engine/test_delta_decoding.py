"""decode_engine_frame's fast path for plain delta items gives the checked path's frames
and errors (engine/protocol.py, ``_item``)."""

from __future__ import annotations

import json

import pytest

from engine import protocol
from engine.protocol import DeltaFrame, FrameError, StepFrame, Usage, decode_engine_frame, encode


def _checked(item: dict) -> object:
    """The item decoded with the fast path out of reach (a key it does not take)."""
    keys = protocol._PLAIN_DELTA_KEYS
    protocol._PLAIN_DELTA_KEYS = frozenset()
    try:
        return protocol._item(item)
    finally:
        protocol._PLAIN_DELTA_KEYS = keys


PLAIN = [
    {"type": "delta", "request_id": "r1", "text": " river", "token_ids": [5]},
    {"type": "delta", "request_id": "r1", "text": "", "token_ids": []},
    {"type": "delta", "request_id": "r1", "text": "héllo 😀", "token_ids": [1, 2, 3]},
    {"type": "delta", "request_id": "r1"},  # text and ids left out
    {"type": "delta", "request_id": "r1", "text": "x"},
]


@pytest.mark.parametrize("item", PLAIN, ids=range(len(PLAIN)))
def test_a_plain_delta_decodes_to_the_checked_paths_frame(item):
    fast = decode_engine_frame(json.dumps({"type": "step", "items": [item]}))
    assert isinstance(fast, StepFrame)
    assert fast.items == [_checked(item)]
    assert type(fast.items[0]) is DeltaFrame


def test_a_delta_with_more_than_text_and_ids_keeps_every_field():
    item = DeltaFrame("r1", "a", [1], logprobs=[{"token_id": 1, "logprob": -0.5}], trim_prior=2,
                      tool_calls=[{"index": 0, "arguments": "{"}], usage=Usage(prompt_tokens=7, cached_tokens=3))
    frame = decode_engine_frame(encode(StepFrame([item])))
    assert frame == StepFrame([item])


BAD = [
    ({"type": "delta", "request_id": "", "text": "a", "token_ids": []}, "non-empty string request_id"),
    ({"type": "delta", "text": "a", "token_ids": []}, "needs 'request_id'"),
    ({"type": "delta", "request_id": 5, "text": "a", "token_ids": []}, "wrong type"),
    ({"type": "delta", "request_id": "r1", "text": None, "token_ids": []}, "wrong type"),
    ({"type": "delta", "request_id": "r1", "text": 3, "token_ids": []}, "wrong type"),
    ({"type": "delta", "request_id": "r1", "text": "a", "token_ids": [1, True]}, "list of integers"),
    ({"type": "delta", "request_id": "r1", "text": "a", "token_ids": [1.5]}, "list of integers"),
    ({"type": "delta", "request_id": "r1", "text": "a", "token_ids": "12"}, "wrong type"),
]


@pytest.mark.parametrize("item,expect", BAD, ids=range(len(BAD)))
def test_a_malformed_delta_raises_the_checked_paths_error(item, expect):
    with pytest.raises(FrameError, match=expect) as fast:
        decode_engine_frame(json.dumps({"type": "step", "items": [item]}))
    with pytest.raises(FrameError) as checked:
        _checked(item)
    assert str(fast.value) == str(checked.value)
