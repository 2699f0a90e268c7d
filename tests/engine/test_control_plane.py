"""The engine's control plane never waits behind a step: while the step thread is held
inside one step (as in a long prefill), ping, stats and keepalive are answered at once,
and an abort sent meanwhile takes effect before the next step. The step thread is held
with ``AsyncEngine.call`` running a function that blocks until the test lets it go, so
the test does not depend on how long a real step takes."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from websockets.asyncio.client import connect

from engine.protocol import FrameError, StepFrame, decode_client_frame, decode_engine_frame


class HeldStep:
    """Holds the engine's step thread (between two steps) until ``release``."""

    def __init__(self, eng) -> None:
        self.entered, self.go = threading.Event(), threading.Event()
        self.task = asyncio.create_task(eng.call(self._hold))

    def _hold(self, _core) -> None:
        self.entered.set()
        self.go.wait(60)

    async def held(self) -> None:
        assert await asyncio.to_thread(self.entered.wait, 30), "the step thread never took the call"

    async def release(self) -> None:
        self.go.set()
        await asyncio.wait_for(self.task, 30)


async def next_frame(ws, timeout: float = 30) -> dict:
    return json.loads(await asyncio.wait_for(ws.recv(), timeout))


async def test_stats_ping_and_keepalive_are_answered_while_a_step_is_held(server):
    url, eng = server
    async with connect(url) as ws:
        await next_frame(ws)  # hello
        held = HeldStep(eng)
        await held.held()
        try:
            for _ in range(200):  # a scraper hammering stats: every one answered during the step
                await ws.send(json.dumps({"type": "stats"}))
            await ws.send(json.dumps({"type": "ping"}))
            kinds = [(await next_frame(ws))["type"] for _ in range(201)]
            assert kinds == ["stats"] * 200 + ["pong"]
            pong = await ws.ping()  # the WebSocket keepalive
            await asyncio.wait_for(pong, 10)
        finally:
            await held.release()


async def test_an_abort_sent_during_a_held_step_under_stats_takes_effect_before_the_next_step(server):
    url, eng = server
    async with connect(url) as ws:
        await next_frame(ws)
        await ws.send(json.dumps({"type": "generate", "request_id": "long", "prompt_token_ids": list(range(100, 140)),
                                  "params": {"max_tokens": 1000, "ignore_eos": True}}))
        first = decode_engine_frame(await asyncio.wait_for(ws.recv(), 30))
        assert isinstance(first, StepFrame) and first.items[0].request_id == "long"
        held = HeldStep(eng)
        await held.held()
        await ws.send(json.dumps({"type": "stats"}))
        stats: list[dict] = []
        while not stats:  # step frames of steps before the hold may still be on their way
            f = await next_frame(ws)
            if f["type"] == "stats":
                stats.append(f)
        steps_before = stats[0]["steps_total"]
        await ws.send(json.dumps({"type": "abort", "request_id": "long"}))
        for _ in range(50):
            await ws.send(json.dumps({"type": "stats"}))
        answered = 0
        while answered < 50:  # answered during the held step; the abort, read before them, is queued
            f = await next_frame(ws)
            answered += f["type"] == "stats"
        await held.release()
        done = None
        while done is None:
            f = await next_frame(ws)
            for item in f.get("items", []):
                if item["type"] == "done":
                    done = item
        assert done["finish_reason"] == "abort" and done["usage"]["completion_tokens"] < 1000
        await ws.send(json.dumps({"type": "stats"}))
        while (f := await next_frame(ws))["type"] != "stats" or f["running"] != 0:
            pass
        assert f["steps_total"] == steps_before, "the engine ran a step after the abort arrived"
        assert f["blocks_held_by_requests"] == 0


def test_a_step_frame_carries_the_items_of_several_requests_and_round_trips():
    from engine.protocol import DeltaFrame, DoneFrame, ErrorFrame, Timings, Usage, encode

    timings = Timings(1.0, 2.0, 3.0, 0.5, draft_tokens=12, accepted_tokens=9, acceptance_rate=0.75, tokens_per_step=2.5)
    step = StepFrame([DeltaFrame("a", "hé", [1, 2]), DeltaFrame("d", "x", [7], usage=Usage(12, 8)),
                      DoneFrame("b", "", [], None, "length", None, "xy", [3, 4], [5], True, Usage(1, 0, 2), timings),
                      ErrorFrame("context_length_exceeded", "too long", "c")])
    assert decode_engine_frame(encode(step)) == step


@pytest.mark.parametrize("text, expect", [
    ("nope", "not valid JSON"),
    ('{"type": "generate"}', "request_id"),
    ('{"type": "generate", "request_id": "r", "prompt_token_ids": ["x"]}', "list of integers"),
    ('{"type": "generate", "request_id": "r", "bogus": 1}', "unknown field"),
    ('{"type": "abort", "request_id": 5}', "wrong type"),
    ('{"type": "launch"}', "unknown frame type"),
])
def test_malformed_client_frames_raise_a_clear_frame_error(text, expect):
    with pytest.raises(FrameError, match=expect):
        decode_client_frame(text)


@pytest.mark.parametrize("text, expect", [
    ('{"type": "step"}', "items"),
    ('{"type": "step", "items": [{"type": "delta"}]}', "request_id"),
    ('{"type": "step", "items": [{"type": "done", "request_id": "r", "usage": {"prompt_tokens": "x"}}]}', "numbers"),
    ('{"type": "step", "items": [{"type": "delta", "request_id": "r", "usage": {"cached_tokens": []}}]}', "numbers"),
    ('{"type": "hello", "model": "m"}', "max_model_len"),
])
def test_malformed_engine_frames_raise_a_clear_frame_error(text, expect):
    with pytest.raises(FrameError, match=expect):
        decode_engine_frame(text)


def test_kv_event_frames_round_trip_and_refuse_hashes_outside_64_bits():
    from engine.protocol import KvEventsFrame, KvSubscribeFrame, encode

    frame = KvEventsFrame([1, (1 << 64) - 1], [5], reset=True)
    assert decode_engine_frame(encode(frame)) == frame
    assert decode_engine_frame(encode(KvEventsFrame([2], []))) == KvEventsFrame([2], [], False)
    assert isinstance(decode_client_frame(encode(KvSubscribeFrame())), KvSubscribeFrame)
    for bad in ('{"type": "kv_events", "stored": [-1]}', '{"type": "kv_events", "stored": [18446744073709551616]}',
                '{"type": "kv_events", "removed": ["x"]}'):
        with pytest.raises(FrameError):
            decode_engine_frame(bad)
