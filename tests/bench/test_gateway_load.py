"""bench/gateway_load.py: the overhead matching, the loss check, and a tiny real run."""

from __future__ import annotations

import asyncio
import threading

import pytest

from bench.gateway_load import LoadConfig, Reply, check_reply, gateway_added_ns, run_load
from bench.serving_lib.stats import percentile, summarize
from bench.serving_lib.tap import EngineTap
from engine.protocol import DeltaFrame, DoneFrame, StatsFrame, StepFrame


def test_each_engine_frame_is_matched_to_the_delta_that_delivered_it():
    engine = [(100, "Hel", 1), (200, "lo", 1), (300, "", 1), (400, " wor", 1), (500, "ld", 1)]
    # the gateway coalesced frames 2 and 3 (and the empty one) into delta 2
    deltas = [(1, 150, "Hel"), (2, 460, "lo wor"), (3, 520, "ld")]
    assert gateway_added_ns(engine, deltas) == [50, 260, 60, 20]


def test_frames_no_delta_covers_are_left_out_of_the_timing():
    engine = [(100, "ab", 1), (200, "cd", 1)]
    assert gateway_added_ns(engine, [(1, 110, "ab")]) == [10]
    assert gateway_added_ns(engine, []) == []


def _reply(texts: list[str], stored: str | None) -> Reply:
    return Reply("r", "s", "m", [(i + 1, i, t) for i, t in enumerate(texts)], {"finish_reason": "length"},
                 None, stored)


def test_a_reply_equal_to_the_stored_and_engine_text_passes():
    assert check_reply(_reply(["a", "b"], "ab"), [(0, "a", 1), (1, "b", 1)]) is None


@pytest.mark.parametrize("reply,frames,needle", [
    (_reply(["a", "b"], "abc"), None, "stored"),
    (_reply(["a", "b"], "ab"), [(0, "a", 1), (1, "bc", 1)], "engine"),
    (_reply(["a"], None), None, "stored"),
    (Reply("r", "s", "m", [(1, 0, "a"), (3, 1, "b")], {"finish_reason": "stop"}, None, "ab"), None, "seq"),
    (Reply("r", error="error frame busy"), None, "busy"),
    (Reply("r", deltas=[(1, 0, "a")], stored="a"), None, "done"),
])
def test_lost_altered_or_failed_replies_are_errors(reply, frames, needle):
    why = check_reply(reply, frames)
    assert why is not None and needle in why


def test_percentiles_interpolate_between_order_statistics():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(xs, 0.0) == 1.0 and percentile(xs, 1.0) == 5.0
    assert percentile(xs, 0.5) == 3.0
    assert percentile(xs, 0.9) == pytest.approx(4.6)
    s = summarize(xs)
    assert s["n"] == 5 and s["mean"] == 3.0 and s["p99"] == pytest.approx(4.96)


def test_tap_records_engine_frames_by_request_and_passes_them_on():
    class FakeClient:
        def __init__(self) -> None:
            self.seen: list[dict] = []

        def _dispatch(self, frame: dict) -> None:
            self.seen.append(frame)

    class Router:
        clients = [FakeClient()]

    tap = EngineTap()
    assert tap.install(Router) == 1 and tap.install(Router) == 0
    c = Router.clients[0]
    c._dispatch(StepFrame([DeltaFrame("x", "hi", [5]), DeltaFrame("y", "yo", [6, 7])]))
    c._dispatch(StatsFrame({}))
    c._dispatch(StepFrame([DoneFrame("x")]))
    assert len(c.seen) == 3
    snap = tap.snapshot()
    assert [f[1:] for f in snap["x"]] == [["hi", 1], ["", 0]]
    assert snap["x"][0][0] <= snap["x"][1][0]
    assert [f[1:] for f in snap["y"]] == [["yo", 2]]


@pytest.mark.timeout(300)
def test_a_tiny_load_through_a_real_gateway_loses_nothing(gateway_factory):
    gw = gateway_factory(limits={"max_messages_per_minute": 10_000})
    tap = EngineTap()
    assert tap.install(gw.state.router) == 1

    async def fetch():
        return tap.snapshot()

    cfg = LoadConfig(connected=4, streaming=2, requests=6, max_tokens=8)
    res = asyncio.run(run_load(gw.base_url, cfg, fetch))
    assert res["errors"] == 0, res["error_samples"]
    assert res["replies"] == 6
    assert res["tokens"] == 6 * 8  # ignore_eos: every reply runs to max_tokens
    assert res["added_ms"]["n"] > 0 and res["added_ms"]["p50"] >= 0
    assert res["browser_deltas"] <= res["engine_frames"]


def test_cpu_seconds_of_this_process_grow_with_work():
    import os

    from bench.gateway_load import cpu_seconds

    before = cpu_seconds(os.getpid())
    x = 0
    for i in range(3_000_000):
        x += i
    after = cpu_seconds(os.getpid())
    assert after > before >= 0.0


def test_a_schedstat_line_gives_its_time_on_the_cpu_in_nanoseconds():
    from bench.gateway_load import schedstat_run_ns

    assert schedstat_run_ns("273807 3204410 2\n") == 273807
    for bad in ("", "12 34", "x 1 2"):
        with pytest.raises(ValueError):
            schedstat_run_ns(bad)


def test_cpu_between_two_readings_counts_new_threads_whole_and_names_ended_ones():
    from bench.gateway_load import cpu_ns_between

    before = {1: 1_000, 2: 500, 3: 700}
    after = {1: 1_600, 2: 900, 4: 250}  # thread 3 ended, thread 4 started
    assert cpu_ns_between(before, after) == (600 + 400 + 250, 1)
    assert cpu_ns_between(after, after) == (0, 0)


def test_thread_cpu_of_this_process_grows_with_work_in_nanoseconds():
    import os

    from bench.gateway_load import cpu_ns_between, thread_cpu_ns

    before = thread_cpu_ns(os.getpid())
    x = 0
    for i in range(300_000):
        x += i
    used, ended = cpu_ns_between(before, thread_cpu_ns(os.getpid()))
    assert used > 0 and ended == 0
    assert threading.get_native_id() in before


async def test_the_fake_engine_writes_one_token_a_step_and_ends_with_the_whole_text_and_its_ids():
    from websockets.asyncio.client import connect
    from websockets.asyncio.server import serve

    from bench.serving_lib.fake_engine import FakeEngine
    from engine.protocol import GenerateFrame, HelloFrame, decode_engine_frame, encode

    engine = FakeEngine(rate=200.0)
    async with serve(engine.handle, "127.0.0.1", 0) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        steps = asyncio.create_task(engine.step_loop())
        try:
            async with connect(f"ws://127.0.0.1:{port}") as ws:
                assert isinstance(decode_engine_frame(await ws.recv()), HelloFrame)
                await ws.send(encode(GenerateFrame("r1", messages=[{"role": "user", "content": "hi"}],
                                                   params={"max_tokens": 5})))
                items: list = []
                while not items or not isinstance(items[-1], DoneFrame):
                    frame = decode_engine_frame(await asyncio.wait_for(ws.recv(), 10))
                    assert isinstance(frame, StepFrame) and len(frame.items) == 1  # one token a step
                    items += frame.items
        finally:
            steps.cancel()
    done = items[-1]
    assert [type(i) for i in items] == [DeltaFrame] * 4 + [DoneFrame]
    assert "".join(i.text for i in items) == done.output_text and len(done.output_token_ids) == 5
    assert done.finish_reason == "length" and done.usage.completion_tokens == 5 and done.prompt_token_ids
