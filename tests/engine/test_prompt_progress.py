"""Prompt progress: a prompt read in several chunked-prefill steps reports, after each
chunk that did not finish it, how many of its tokens are done; a short prompt reports
nothing. Numbers are exact (the budget fixes the chunk sizes)."""

from __future__ import annotations

import asyncio
import json
import random

import pytest
from websockets.asyncio.client import connect

from engine.protocol import FrameError, ProgressFrame, StepFrame, decode_engine_frame, encode
from engine.server import run_server
from tests.engine_helpers import greedy, make_engine

BUDGET = 64  # max_num_batched_tokens: a prompt of n tokens takes ceil(n / 64) steps


@pytest.fixture
def core(tiny_model_dir):
    return make_engine(tiny_model_dir, num_blocks=256, max_num_batched_tokens=BUDGET).core


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 30000) for _ in range(n)]


def _steps(core) -> list[list]:
    """Every step's outputs until the engine is idle."""
    steps = []
    while core.has_work():
        steps.append(core.step())
    return steps


def test_a_chunked_prompt_reports_progress_after_each_unfinished_chunk(core):
    core.add_request("long", _tokens(1, 200), greedy(3))
    steps = _steps(core)
    progress = [(o.progress.done, o.progress.total, o.progress.cached) for s in steps for o in s if o.progress]
    assert progress == [(64, 200, 0), (128, 200, 0), (192, 200, 0)]
    # one progress item in each of the first three steps, then the first token in the fourth
    assert [len(s) for s in steps[:3]] == [1, 1, 1]
    first = steps[3][0]
    assert first.progress is None and len(first.token_ids) == 1
    assert all(not o.text and not o.token_ids and not o.finished for s in steps[:3] for o in s)


def test_a_prompt_read_in_one_step_reports_no_progress(core):
    core.add_request("short", _tokens(2, BUDGET), greedy(3))
    core.add_request("tiny", _tokens(3, 5), greedy(3))
    steps = _steps(core)
    assert not [o for s in steps for o in s if o.progress is not None]


def test_progress_counts_the_prefix_cache_hit_as_done_and_cached(core):
    shared = _tokens(4, 160)  # ten full 16-token blocks
    core.add_request("first", shared + _tokens(5, 10), greedy(2))
    _steps(core)
    core.add_request("second", shared + _tokens(6, 100), greedy(2))
    steps = _steps(core)
    progress = [o.progress for s in steps for o in s if o.progress]
    # 160 cached, then one 64-token chunk of the 100 new ones; the last 36 finish the prompt
    assert [(p.done, p.total, p.cached) for p in progress] == [(224, 260, 160)]


def test_progress_goes_only_to_the_prompt_being_read_while_another_decodes(core):
    core.add_request("decoding", _tokens(7, 10), greedy(20))
    core.step()  # its prefill: it decodes from now on
    core.add_request("long", _tokens(8, 150), greedy(2))
    steps = _steps(core)
    progress = [(o.request_id, o.progress.done) for s in steps for o in s if o.progress]
    # the decode takes one token of each step's budget, so chunks are 63 tokens
    assert progress == [("long", 63), ("long", 126)]


def test_a_progress_item_round_trips_and_a_bad_one_is_refused():
    step = StepFrame([ProgressFrame("r", 1536, 5240, 512)])
    assert json.loads(encode(step))["items"][0] == {"type": "progress", "request_id": "r", "prompt_tokens_done": 1536,
                                                   "prompt_tokens": 5240, "cached_tokens": 512}
    assert decode_engine_frame(encode(step)) == step
    with pytest.raises(FrameError, match="prompt_tokens_done"):
        decode_engine_frame('{"type": "progress", "request_id": "r", "prompt_tokens": 5}')
    with pytest.raises(FrameError, match="cached_tokens <= prompt_tokens_done <= prompt_tokens"):
        decode_engine_frame('{"type": "progress", "request_id": "r", "prompt_tokens_done": 9, "prompt_tokens": 5}')


async def test_the_server_sends_progress_items_in_step_frames_before_the_first_delta(tiny_model_dir, capsys):
    eng = make_engine(tiny_model_dir, num_blocks=256, max_num_batched_tokens=BUDGET)
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(run_server(eng, "127.0.0.1", 0, ready=ready, stop=stop))
    try:
        await asyncio.wait_for(ready.wait(), 30)
        url = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("ENGINE READY")][-1].split()[-1]
        async with connect(url) as ws:
            await ws.recv()  # hello
            await ws.send(json.dumps({"type": "generate", "request_id": "a", "prompt_token_ids": _tokens(9, 150),
                                      "params": {"max_tokens": 2, "temperature": 0, "ignore_eos": True}}))
            kinds: list[tuple] = []
            while not kinds or kinds[-1][0] != "done":
                frame = json.loads(await asyncio.wait_for(ws.recv(), 30))
                assert frame["type"] == "step"
                for it in frame["items"]:
                    kinds.append((it["type"], it.get("prompt_tokens_done"), it.get("prompt_tokens"),
                                  it.get("cached_tokens")))
        assert kinds[:3] == [("progress", 64, 150, 0), ("progress", 128, 150, 0), ("delta", None, None, None)]
    finally:
        stop.set()
        await task
