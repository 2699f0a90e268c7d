"""The typed reply end (gateway/replies/reply_end.py): the stored message and the stream's
``done`` entry of a whole, a stopped and a failed reply, both from one ``ReplyEnd``."""

from __future__ import annotations

import dataclasses
import json

from engine.protocol import DoneFrame, Timings, Usage
from gateway.replies.reply_end import ReplyEnd

TIMINGS = Timings(ttft_ms=12.0, tpot_ms=3.0, e2e_ms=40.0, queue_ms=1.0, acceptance_rate=0.5, tokens_per_step=1.5)


def test_a_whole_reply_stores_and_announces_the_same_usage_and_timings():
    done = DoneFrame("r1", finish_reason="length", usage=Usage(10, 4, 7, 2), timings=TIMINGS)
    end = ReplyEnd.of_done(done, None)
    msg = end.stored_message("text", 5.0, "r1")
    assert msg == {"content": "text", "status": "complete", "finish_reason": "length",
                   "usage": {"prompt_tokens": 10, "cached_tokens": 4, "completion_tokens": 7, "cached_disk_tokens": 2},
                   "timings": {"ttft_ms": 12.0, "tpot_ms": 3.0, "e2e_ms": 40.0, "acceptance_rate": 0.5,
                               "tokens_per_step": 1.5},
                   "created_at": 5.0, "request_id": "r1"}
    entry = end.done_entry("r1", "s1", "m1", title="A title")
    assert entry == {"request_id": "r1", "session_id": "s1", "message_id": "m1", "finish_reason": "length",
                     "usage": msg["usage"], "timings": msg["timings"], "title": "A title"}


def test_a_stopped_reply_is_partial_with_its_cut_reason_and_the_count_it_received():
    end = ReplyEnd.of_done(DoneFrame("r1", finish_reason="abort", usage=Usage(3, 0, 9)), "user_stop",
                           completion_tokens=5)
    msg = end.stored_message("te", 1.0, "r1")
    assert msg["status"] == "partial" and msg["cut_reason"] == "user_stop"
    assert msg["usage"] == {"prompt_tokens": 3, "cached_tokens": 0, "completion_tokens": 5}
    assert "title" not in end.done_entry("r1", "s1", "m1")


def test_a_failed_reply_keeps_its_error_and_zero_timings_in_both():
    error = {"code": "engine_unavailable", "message": "gone"}
    end = ReplyEnd.of_error(error, "engine_lost", completion_tokens=4)
    msg = end.stored_message("par", 2.0, "r1")
    assert msg == {"content": "par", "status": "partial", "finish_reason": "error", "error": error,
                   "cut_reason": "engine_lost",
                   "usage": {"prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 4},
                   "timings": {"ttft_ms": 0.0, "tpot_ms": 0.0, "e2e_ms": 0.0}, "created_at": 2.0, "request_id": "r1"}
    assert end.done_entry("r1", "s1", "m1") == {
        "request_id": "r1", "session_id": "s1", "message_id": "m1", "finish_reason": "error",
        "usage": msg["usage"], "timings": msg["timings"], "error": error}


def test_a_reply_that_called_tools_stores_and_announces_its_calls_in_openais_shape():
    calls = [{"index": 0, "id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}]
    end = ReplyEnd.of_done(DoneFrame("r1", finish_reason="tool_calls", usage=Usage(3, 0, 9), timings=TIMINGS,
                                     output_tool_calls=calls), None)
    want = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    assert end.stored_message("", 1.0, "r1")["tool_calls"] == want
    assert end.done_entry("r1", "s1", "m1")["tool_calls"] == want
    plain = ReplyEnd.of_done(DoneFrame("r2", finish_reason="stop", usage=Usage(3, 0, 9), output_tool_calls=[]), None)
    assert "tool_calls" not in plain.stored_message("x", 1.0, "r2")
    assert "tool_calls" not in plain.done_entry("r2", "s", "m")


def test_a_done_entry_read_back_gives_the_same_usage_and_timings():
    end = ReplyEnd.of_done(DoneFrame("r1", finish_reason="stop", usage=Usage(10, 4, 7, 2), timings=TIMINGS), None)
    entry = json.loads(json.dumps(end.done_entry("r1", "s1", "m1")))  # as a reader of the stream gets it
    back = ReplyEnd.of_done_entry(entry)
    assert back.finish_reason == "stop"
    assert back.usage() == end.usage() and back.timings_dict() == end.timings_dict()
    assert ReplyEnd.of_done_entry({}).usage() == {"prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0}


def test_a_continued_reply_says_how_many_tokens_it_had_before_in_both_and_reads_back():
    done = DoneFrame("r1", finish_reason="length", usage=Usage(30, 28, 7), timings=TIMINGS)
    end = dataclasses.replace(ReplyEnd.of_done(done, None), continued_tokens=12)
    want = {"prompt_tokens": 30, "cached_tokens": 28, "completion_tokens": 7, "continued_tokens": 12}
    assert end.stored_message("text", 1.0, "r1")["usage"] == want
    entry = json.loads(json.dumps(end.done_entry("r1", "s1", "m1")))
    assert entry["usage"] == want and ReplyEnd.of_done_entry(entry).usage() == want
    assert "continued_tokens" not in ReplyEnd.of_done(done, None).usage()  # a reply written at once
