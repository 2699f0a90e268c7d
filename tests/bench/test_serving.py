"""bench/serving.py: statistics, arrivals, chat bookkeeping, SSE parsing, the report,
and a tiny end-to-end run against our gateway's OpenAI API on the tiny model."""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics

import pytest

from bench import serving
from bench.hf_static_server import Pending, RowStreamer
from bench.serving_lib.openai_client import RequestResult, SSEParser, apply_chunk
from bench.serving_lib.stats import percentile
from bench.serving_lib.workloads import (
    Conversation,
    TextMaker,
    chat_users,
    mixed_requests,
    poisson_offsets,
    single_requests,
)

# ---- statistics -------------------------------------------------------------------------


def test_percentile_of_an_empty_sample_is_nan_and_q_is_checked():
    assert math.isnan(percentile([], 0.5))
    with pytest.raises(ValueError):
        percentile([1.0], 1.5)


def test_percentile_matches_linear_interpolation_on_a_known_sample():
    xs = list(range(1, 101))  # 1..100
    assert percentile(xs, 0.5) == pytest.approx(50.5)
    assert percentile(xs, 0.99) == pytest.approx(99.01)
    assert percentile([7.0], 0.99) == 7.0


# ---- arrivals ------------------------------------------------------------------------------


@pytest.mark.parametrize("rate", [0.5, 4.0, 50.0])
def test_poisson_mean_gap_is_one_over_the_rate(rate):
    offs = poisson_offsets(rate, 20_000, random.Random(7))
    gaps = [b - a for a, b in zip([0.0] + offs, offs)]
    assert all(g > 0 for g in gaps)
    assert statistics.fmean(gaps) == pytest.approx(1 / rate, rel=0.03)
    # exponential gaps: the standard deviation equals the mean
    assert statistics.pstdev(gaps) == pytest.approx(1 / rate, rel=0.05)


def test_poisson_arrivals_are_seeded_and_rate_must_be_positive():
    assert poisson_offsets(2.0, 5, random.Random(1)) == poisson_offsets(2.0, 5, random.Random(1))
    assert poisson_offsets(2.0, 5, random.Random(1)) != poisson_offsets(2.0, 5, random.Random(2))
    with pytest.raises(ValueError):
        poisson_offsets(0.0, 3, random.Random(0))


# ---- chat bookkeeping ----------------------------------------------------------------------


def test_a_conversation_sends_the_whole_history_and_tags_each_turn():
    conv = Conversation(3, ["u1", "u2", "u3"], [10, 20, 30], system_prompt="sys")
    r1 = conv.next_request()
    assert r1.tags == {"workload": "chat", "user": 3, "turn": 1} and r1.max_tokens == 10
    assert r1.messages == [{"role": "system", "content": "sys"}, {"role": "user", "content": "u1"}]
    conv.record_reply("a1")
    r2 = conv.next_request()
    assert r2.tags["turn"] == 2 and r2.max_tokens == 20
    assert [m["content"] for m in r2.messages] == ["sys", "u1", "a1", "u2"]
    assert [m["role"] for m in r2.messages] == ["system", "user", "assistant", "user"]
    conv.record_reply("a2")
    conv.record_reply("a3")
    assert conv.finished and conv.turn == 3
    with pytest.raises(IndexError):
        conv.next_request()
    with pytest.raises(IndexError):
        conv.record_reply("too many")


def test_chat_users_share_the_system_prompt_and_respect_the_ranges():
    users = chat_users(6, 8, seed=5, user_tokens=(20, 200), max_reply=128, min_reply=16)
    assert len(users) == 6 and all(len(u.user_messages) == 8 for u in users)
    assert len({u.system_prompt for u in users}) == 1
    assert all(16 <= n <= 128 for u in users for n in u.reply_tokens)
    words = [len(m.split()) for u in users for m in u.user_messages]
    assert min(words) >= 20 and max(words) <= 200
    again = chat_users(6, 8, seed=5)
    assert [u.user_messages for u in users] == [u.user_messages for u in again]


def test_mixed_and_single_requests_follow_their_sizes():
    reqs = mixed_requests(50, seed=1, prompt_tokens=(32, 1024), output_tokens=(16, 256))
    assert all(16 <= r.max_tokens <= 256 for r in reqs)
    assert all(32 <= len(r.messages[0]["content"].split()) <= 1024 for r in reqs)
    body = single_requests(1, seed=0, output_tokens=9)[0].body("m")
    assert body["max_tokens"] == 9 and body["ignore_eos"] is True and body["temperature"] == 0.0
    assert len(TextMaker(random.Random(0)).text(30).split()) == 30


def test_schedule_runs_levels_in_ascending_order_with_single_first():
    plan = serving.Plan(levels=(16, 1, 4), workloads=("chat", "mixed", "single"), mixed_levels=(4,))
    assert serving.schedule(plan) == [(1, "single"), (1, "chat"), (4, "chat"), (4, "mixed"), (16, "chat")]


# ---- SSE and chunks -------------------------------------------------------------------------


def test_sse_events_split_anywhere_are_reassembled():
    stream = 'data: {"a": 1}\r\n\r\n: keep-alive\n\ndata: line1\ndata: line2\n\nevent: x\ndata: [DONE]\n\n'
    for cut in range(1, len(stream)):
        p = SSEParser()
        events = p.feed(stream[:cut]) + p.feed(stream[cut:]) + p.close()
        assert events == ['{"a": 1}', "line1\nline2", "[DONE]"], cut


def test_an_event_without_its_final_blank_line_is_returned_at_close():
    p = SSEParser()
    assert p.feed("data:x") == []
    assert p.close() == ["x"]


def test_chunks_fold_into_text_usage_and_cached_tokens():
    r = RequestResult()
    apply_chunk(r, {"choices": [{"delta": {"role": "assistant", "content": ""}}]}, 1.0)
    apply_chunk(r, {"choices": [{"delta": {"content": "Hi"}}]}, 10.0)
    apply_chunk(r, {"choices": [{"delta": {"content": " there"}}]}, 14.0)
    apply_chunk(r, {"choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 3,
                                             "prompt_tokens_details": {"cached_tokens": 32}}}, 15.0)
    assert r.text == "Hi there" and r.chunk_ms == [10.0, 14.0]
    assert (r.prompt_tokens, r.output_tokens, r.cached_tokens) == (40, 3, 32)
    assert r.ttft_ms == 10.0 and r.tpot_ms == pytest.approx(2.0) and r.gaps_ms == [4.0]


def test_llama_cpp_timings_give_cached_tokens_and_errors_raise():
    r = RequestResult()
    apply_chunk(r, {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 1},
                    "timings": {"cache_n": 7, "prompt_n": 2}}, 1.0)
    assert r.cached_tokens == 7
    with pytest.raises(RuntimeError):
        apply_chunk(r, {"error": {"message": "boom"}}, 2.0)


def test_run_summary_counts_errors_and_the_cache_hit_of_later_turns():
    def res(turn: int, cached: int | None, ok: bool = True) -> RequestResult:
        return RequestResult(ok=ok, chunk_ms=[100.0 * turn, 100.0 * turn + 30], prompt_tokens=100,
                             output_tokens=4, cached_tokens=cached, tags={"turn": turn})

    s = serving.summarize_run([res(1, 0), res(2, 80), res(2, 60), res(3, None, ok=False)], 2.0, expected=5)
    assert s["requests"] == 3 and s["errors"] == 2
    assert s["cache_hit"] == pytest.approx(0.7)  # turn 1 is left out
    assert s["ttft_by_turn"] == {"1": [100.0], "2": [200.0, 200.0]}
    assert s["output_tok_s"] == pytest.approx(6.0) and s["tpot_p50"] == pytest.approx(10.0)


def test_the_docs_block_is_inserted_once_then_replaced_in_its_section():
    doc = "# B\n\n## Serving, side by side (x)\n\n(pending)\n\n## GPU\n\ntext\n"
    once = serving.replace_block(doc, "## Serving, side by side", "TABLE 1")
    assert once.index("TABLE 1") < once.index("## GPU") and "(pending)" in once
    twice = serving.replace_block(once, "## Serving, side by side", "TABLE 2")
    assert "TABLE 1" not in twice and twice.count(serving.DOC_BEGIN) == 1 and twice.endswith("text\n")
    both = serving.replace_block(twice, "## Serving, side by side", "QUICK", quick=True)
    assert "TABLE 2" in both and "QUICK" in both and both.index("QUICK") < both.index("## GPU")


def test_targets_say_met_or_missed_with_the_ratio():
    mk = lambda tok, ttft8, tpot, mixed=100: {  # noqa: E731
        "chat": {"16": {"output_tok_s": tok, "ttft_by_turn": {"8": [ttft8]}}},
        "mixed": {"4": {"output_tok_s": mixed}}, "single": {"1": {"tpot_p50": tpot}}}
    lines = serving.targets({"ours": mk(200, 50, 6, 150), "llama.cpp": mk(100, 100, 10)})
    assert "met" in lines[0] and "2.00x" in lines[0]
    assert "met" in lines[1] and "0.50x" in lines[1]
    assert "met" in lines[2] and "1.50x" in lines[2]
    assert "met" in lines[3] and "0.60x" in lines[3]
    lines = serving.targets({"ours": mk(190, 60, 30, 140), "llama.cpp": mk(100, 100, 10)})
    assert "MISSED" in lines[0] and "1.90x" in lines[0] and "MISSED" in lines[1] and "0.60x" in lines[1]
    assert "MISSED" in lines[2] and "1.40x" in lines[2]
    assert "MISSED" in lines[3] and "3.00x" in lines[3]
    assert "met" in serving.targets({"ours": mk(160, 40, 9), "llama.cpp": mk(100, 100, 10)}, quick=False)[0]


def test_targets_compare_against_llamacpps_q4_0_when_it_ran():
    mk = lambda tok: {"chat": {"16": {"output_tok_s": tok, "ttft_by_turn": {"8": [10.0]}}}}  # noqa: E731
    results = {"ours": mk(200), "llama.cpp Q4_1": mk(50), "llama.cpp Q4_0": mk(100)}
    assert serving.peer_label(results) == "llama.cpp Q4_0"
    assert "llama.cpp Q4_0" in serving.targets(results)[0] and "2.00x" in serving.targets(results)[0]
    assert serving.peer_label({"ours": {}, "llama.cpp Q4_1": {}}) == "llama.cpp Q4_1"


# ---- the static-batching peer's streamer ---------------------------------------------------


def test_the_static_batch_streamer_caps_each_row_and_stops_at_eos():
    import torch

    async def go() -> list[list]:
        loop = asyncio.get_running_loop()
        batch = [Pending([1], 2, ignore_eos=True), Pending([1], 5, ignore_eos=False)]
        s = RowStreamer(batch, loop, eos={2})
        s.put(torch.tensor([[1], [1]]))  # the prompt
        s.put(torch.tensor([7, 8]))
        s.put(torch.tensor([9, 2]))  # row 1 ends at EOS
        s.put(torch.tensor([4, 4]))
        s.end()
        await asyncio.sleep(0)
        out = []
        for p in batch:
            items = []
            while not p.queue.empty():
                items.append(p.queue.get_nowait())
            out.append(items)
        return out

    assert asyncio.run(go()) == [[7, 9, None], [8, 2, None]]


# ---- end to end ----------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_serving_measures_our_gateway_end_to_end(engine_url, redis_url, key_prefix, tmp_path, tiny_model_dir,
                                                  capsys):
    import time

    from bench.serving_lib.gateway_proc import build_app
    from gateway.config import GatewayConfig
    from gateway.server.app import new_secret
    from gateway.server.serving import ThreadedServer

    config = GatewayConfig().with_overrides(host="127.0.0.1", port=0, redis_url=redis_url, key_prefix=key_prefix,
                                            engine_urls=(engine_url,), secret_key=new_secret(),
                                            data_dir=tmp_path / "data")
    server = ThreadedServer(build_app(config, None), config)
    port = server.start()
    try:
        deadline = time.monotonic() + 60
        while not server.gateway.router.healthy and time.monotonic() < deadline:
            time.sleep(0.05)
        rc = serving.main(["--systems", "ours", "--ours-url", f"http://127.0.0.1:{port}",
                           "--model", str(tiny_model_dir), "--workloads", "chat,single", "--levels", "2",
                           "--turns", "2", "--user-tokens", "5,10", "--reply-tokens", "3,5",
                           "--single-requests", "1", "--single-output", "4", "--json"])
    finally:
        server.stop()
    report = json.loads(capsys.readouterr().out)
    assert rc == 0
    chat = report["results"]["ours"]["chat"]["2"]
    assert chat["requests"] == 4 and chat["errors"] == 0
    planned = sum(sum(u.reply_tokens) for u in chat_users(2, 2, seed=2, user_tokens=(5, 10), max_reply=5,
                                                          min_reply=3))
    assert chat["output_tokens"] == planned  # ignore_eos: exactly the planned tokens
    assert set(chat["ttft_by_turn"]) == {"1", "2"}
    assert chat["cache_hit"] is not None and chat["cache_hit"] > 0  # turn 2 reuses turn 1's prefix
    single = report["results"]["ours"]["single"]["1"]
    assert single["output_tokens"] == 4 and single["errors"] == 0
    assert report["systems"]["ours"]["bytes_per_step"] > 0


def test_the_bytes_a_decode_step_reads_follow_the_serving_format(tiny_model_dir):
    from bench.serving_lib.systems import count_params, weight_read_bytes

    params = count_params(tiny_model_dir)
    f32 = weight_read_bytes(tiny_model_dir, None, "float32")
    i8 = weight_read_bytes(tiny_model_dir, "int8", "float32")
    i4 = weight_read_bytes(tiny_model_dir, "int4", "float32")
    sym = weight_read_bytes(tiny_model_dir, "int4-sym", "float32")
    assert f32 == 4 * params
    assert params < i8 < 1.1 * params  # a byte a weight, the norms in float32
    assert sym < i4 < i8  # the layers' projections at 18 or 20 bytes per 32 weights
